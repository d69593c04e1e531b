// Shared by the tests that train fsdp.cpp beside a Python peer (bench/peers/*.py) from the same
// weights on the same batches and compare the losses (test_pytorch_parity.cpp,
// test_ddp_comm_hooks_pytorch.cpp): the batch file, the peer's losses, printing.
#pragma once

#include "fsdp/checkpoint.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp::testing {

// A flag value for a peer's command line (std::to_string(1e-8) is "0.000000").
inline std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.12g", v);
  return buf;
}

inline std::string str(const std::vector<double>& v) {
  std::ostringstream out;
  out.precision(9);
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "[") << v[i];
  return out.str() + "]";
}

// The batches train_with feeds (global_batch): rank r of a world-W run takes rows [r*B, (r+1)*B)
// of each, which is the batch file's layout (mirror.py).
inline void write_batches(const std::string& path, int steps, int64_t rows) {
  std::vector<at::Tensor> inputs, targets;
  for (int step = 0; step < steps; ++step) {
    fsdp::Batch b = global_batch(step, rows);
    inputs.push_back(b.input);
    targets.push_back(b.target);
  }
  fsdp::save_safetensors(path, {{"input", at::stack(inputs)}, {"target", at::stack(targets)}});
}

// Runs a peer (argv: interpreter, script, flags) and returns the per-step losses of the JSON
// object it printed last (a non-finite loss arrives as null: NaN). Empty, with a test failure
// naming `what`, when it fails or reports an error.
inline std::vector<double> peer_losses(const std::vector<std::string>& argv,
                                       const std::string& what) {
  auto r = run_process(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << what << " failed:\n" << r.out << r.err;
  nlohmann::json last;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line[0] == '{') {
      last = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    }
  }
  if (last.contains("error")) ADD_FAILURE() << what << ": " << last["error"];
  if (!last.contains("losses") || last.contains("error")) {
    ADD_FAILURE() << what << " printed no losses:\n" << r.out << r.err;
    return {};
  }
  std::vector<double> losses;
  for (const auto& v : last["losses"]) {
    losses.push_back(v.is_number() ? v.get<double>() : std::numeric_limits<double>::quiet_NaN());
  }
  return losses;
}

// In a rank of run_ranks: connects `strategy` to the world group, saves the weights training
// starts from to DIR/init (a full checkpoint: what the peer loads with --weights), trains
// `steps` global batches of `rows` rows (train_with) and writes rank 0's losses to
// DIR/fsdp_losses.json (under mpirun rank 0 is not the test's process: they travel by file).
inline void train_saving_start(fsdp::Strategy& strategy, fsdp::LightningModule& lm,
                               fsdp::ProcessGroup& world, const std::string& dir, int steps,
                               int64_t rows) {
  fsdp::LaunchInfo launch;
  launch.rank = world.rank();
  launch.world_size = world.size();
  launch.local_world_size = world.size();
  strategy.connect(fsdp::world_group(), launch);
  LoopConfig cfg;
  cfg.steps = steps;
  cfg.global_batch = rows;
  cfg.after_setup = [&](fsdp::Strategy& s, fsdp::LightningModule& m) {
    fsdp::save_checkpoint(dir + "/init", s, m, nullptr, {}, fsdp::StateDictType::kFull);
  };
  auto losses = train_with(strategy, lm, cfg);
  if (world.rank() == 0) std::ofstream(dir + "/fsdp_losses.json") << nlohmann::json(losses).dump();
}

// The losses train_saving_start wrote (empty when there are none).
inline std::vector<double> saved_losses(const std::string& dir) {
  std::ifstream f(dir + "/fsdp_losses.json");
  if (!f) return {};
  return nlohmann::json::parse(f).get<std::vector<double>>();
}

}  // namespace fsdp::testing
