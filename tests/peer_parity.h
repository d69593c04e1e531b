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

}  // namespace fsdp::testing
