// Helpers of the disk-tier tests (test_disk_offload.cpp, test_fsdp_offload.cpp): swap-file
// headers, per-run scratch directories, and the parity check of a run with its parameters on
// disk, shared by DeepSpeed stage 3 and FSDP with OffloadPolicy::nvme.
#pragma once

#include "fsdp/offload.h"
#include "fully_shard_common.h"
#include "offload/swap_file.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

namespace fsdp::testing {

namespace fs = std::filesystem;

// The header at the start of a swap file (its magic and the generation of its last write).
inline fsdp::detail::SwapHeader read_swap_header(const std::string& file) {
  fsdp::detail::SwapHeader h{};
  std::ifstream in(file, std::ios::binary);
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  return h;
}

// Parameters on disk (offload_param nvme) get their own scratch root: /tmp/fsdp_disk_tests is
// shared with other runs of this file.
// The root is decided by the first process (the test) and inherited by its ranks.
inline std::string own_dir(const std::string& name) {
  const char* env = std::getenv("FSDP_PARAMS_DISK_TEST_ROOT");
  if (env == nullptr || *env == 0) {
    const std::string r = (fs::temp_directory_path() /
                           ("fsdp_params_disk_tests-" + std::to_string(::getpid()))).string();
    ::setenv("FSDP_PARAMS_DISK_TEST_ROOT", r.c_str(), 1);
    env = std::getenv("FSDP_PARAMS_DISK_TEST_ROOT");
  }
  fs::path d = fs::path(env) / name;
  fs::create_directories(d);
  return d.string();
}

// Removes `dir` and, once empty, the per-run root own_dir made (the first process only).
inline void remove_own_dir(const std::string& dir) {
  if (fsdp::testing::in_child_rank()) return;
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::remove(fs::path(dir).parent_path(), ec);  // only when empty: other tests may still use it
}


// A run with its parameters and optimizer state on disk, against a single process (Note
// [Parameters on disk] in docs/design.md): the same losses and final parameters; at rest every
// sharded parameter of a unit holds no storage (it is on disk), each unit's record was written
// at setup and in every step (every read checks its generation and checksum), and the swap
// directory root/job/rank<r> is gone after the strategy. `make` builds the connected strategy
// (its swap files under root/job); parameters with at most `whole_numel` elements may stay in
// RAM; `deferred_units(strategy)` counts the units built sharded inside configure_model, which
// must be more than 2 when `expect_deferred`. Call it inside run_ranks.
template <typename S>
void expect_params_on_disk_parity(const std::function<std::shared_ptr<S>()>& make,
                                  const std::string& root, const std::string& job,
                                  int64_t whole_numel, bool expect_deferred,
                                  const std::function<int(S&)>& deferred_units) {
  LoopConfig cfg;
  cfg.steps = 6;
  TinyLM ref;
  auto want = train_reference(ref, cfg);
  std::string rank_dir;
  {
    TinyLM lm;
    std::shared_ptr<S> strategy = make();
    rank_dir = root + "/" + job + "/rank" + std::to_string(strategy->rank());
    int64_t on_disk = 0;
    auto count_on_disk = [&] {
      int64_t n = 0;
      for (auto& p : lm.parameters(true)) {
        if (p.numel() > whole_numel && p.storage().nbytes() == 0) ++n;
      }
      return n;
    };
    cfg.after_setup = [&](fsdp::Strategy&, fsdp::LightningModule&) {
      const fsdp::ParamDiskPlan* plan = strategy->param_disk_plan();
      ASSERT_NE(plan, nullptr);
      EXPECT_GT(plan->units_on_disk, 2);
      EXPECT_EQ(plan->units_on_disk, plan->units);
      EXPECT_EQ(static_cast<int64_t>(strategy->param_swap_files().size()), plan->units_on_disk);
      on_disk = count_on_disk();
      EXPECT_GT(on_disk, 2) << "no sharded parameter left RAM";
      if (expect_deferred) EXPECT_GT(deferred_units(*strategy), 2) << "not built sharded";
    };
    auto got = train_with(*strategy, lm, cfg);
    expect_losses_close(got, want, 1e-5);
    EXPECT_EQ(count_on_disk(), on_disk) << "parameters left in RAM after the steps";
    expect_params_close(strategy->gather_full_params(), ref, 1e-5);
    EXPECT_EQ(count_on_disk(), on_disk) << "parameters left in RAM after gather_full_params";
    strategy->flush_disk_tier();
    ASSERT_TRUE(fs::is_directory(rank_dir)) << rank_dir;
    int64_t bytes = 0;
    for (const auto& f : strategy->param_swap_files()) {
      ASSERT_TRUE(fs::exists(f)) << f;
      bytes += static_cast<int64_t>(fs::file_size(f));
      const fsdp::detail::SwapHeader h = read_swap_header(f);
      EXPECT_EQ(std::string(h.magic, 8), "FSDPSWP1") << f;
      // Written at setup, then once per step, or twice when the unit's parameters sit in two
      // parameter groups (TinyLM: weights decay, biases do not; the step releases a unit after
      // each group's part).
      const uint64_t steps = static_cast<uint64_t>(cfg.steps);
      EXPECT_TRUE(h.generation == 1 + steps || h.generation == 1 + 2 * steps)
          << f << ": write #" << h.generation;
    }
    EXPECT_EQ(bytes, strategy->param_disk_plan()->disk_bytes);
  }
  EXPECT_FALSE(fs::exists(rank_dir)) << "swap directory left after the strategy ended";
}

}  // namespace fsdp::testing
