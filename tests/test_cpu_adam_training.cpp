// fsdp::optim::CPUAdam in training, through fsdp-train --optimizer cpu_adamw: FULL_SHARD at
// worlds 2 and 3 on Gloo and MPI gives the losses of libtorch's AdamW (within 1e-5 relative),
// and its sharded checkpoint resumes under libtorch's AdamW at another world size.
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::string scratch(const std::string& name) {
  fs::path p = (fs::path(FSDP_BIN_DIR) / ".." / "cpu-adam-test" / name).lexically_normal();
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A tiny FULL_SHARD run with global batch 12 (devices x batch) and weight decay on.
std::vector<std::string> train_argv(const std::string& dir, int devices, int max_steps,
                                    const std::string& optimizer, const std::string& backend) {
  return {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny",
          "--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD",
          "--devices", std::to_string(devices), "--batch-size", std::to_string(12 / devices),
          "--backend", backend, "--optimizer", optimizer, "--weight-decay", "0.01",
          "--max-steps", std::to_string(max_steps), "--dropout", "0", "--seed", "7",
          "--num-tokens", "20000", "--limit-val-batches", "0", "--no-progress-bar",
          "--default-root-dir", dir + "/logs"};
}

std::vector<double> run_losses(std::vector<std::string> argv, const std::string& summary) {
  argv.push_back("--summary-json");
  argv.push_back(summary);
  auto r = fsdp::testing::run_process(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(summary);
  if (!f) return {};
  return nlohmann::json::parse(f)["losses"].get<std::vector<double>>();
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, size_t n) {
  ASSERT_EQ(got.size(), n);
  ASSERT_EQ(want.size(), n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << "step " << i;
  }
}

void parity(int devices, const std::string& backend) {
  const std::string dir = scratch(backend + std::to_string(devices));
  auto want = run_losses(train_argv(dir, devices, 8, "adamw", backend), dir + "/adamw.json");
  auto got = run_losses(train_argv(dir, devices, 8, "cpu_adamw", backend), dir + "/cpu.json");
  expect_close(got, want, 8);
  // The losses move: the runs trained.
  ASSERT_EQ(got.size(), 8u);
  EXPECT_LT(got.back(), got.front());
}

TEST(CPUAdamTraining, FullShardGlooWorld2MatchesAdamW) { parity(2, "gloo"); }
TEST(CPUAdamTraining, FullShardGlooWorld3MatchesAdamW) { parity(3, "gloo"); }
TEST(CPUAdamTraining, FullShardMpiWorld2MatchesAdamW) { parity(2, "mpi"); }
TEST(CPUAdamTraining, FullShardMpiWorld3MatchesAdamW) { parity(3, "mpi"); }

// CPUAdam(adamw_mode) saves "adamw" state: a sharded checkpoint from 2 ranks resumes under
// libtorch's AdamW on 3 ranks and continues as an uninterrupted AdamW run.
TEST(CPUAdamTraining, CheckpointResumesUnderAdamWAtAnotherWorldSize) {
  const std::string dir = scratch("resume");
  auto straight = run_losses(train_argv(dir, 3, 6, "adamw", "gloo"), dir + "/straight.json");
  auto first = run_losses([&] {
    auto a = train_argv(dir, 2, 3, "cpu_adamw", "gloo");
    a.insert(a.end(), {"--checkpoint-dir", dir + "/ckpt", "--save-every-n-steps", "3",
                       "--state-dict-type", "sharded"});
    return a;
  }(), dir + "/first.json");
  ASSERT_EQ(first.size(), 3u);
  ASSERT_TRUE(fs::exists(dir + "/ckpt/step-3"));
  auto resumed = run_losses([&] {
    auto a = train_argv(dir, 3, 6, "adamw", "gloo");
    a.insert(a.end(), {"--ckpt-path", dir + "/ckpt/step-3"});
    return a;
  }(), dir + "/resumed.json");
  ASSERT_EQ(straight.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(resumed[i], straight[3 + i], 1e-5 * std::abs(straight[3 + i])) << "step " << 3 + i;
  }
}

}  // namespace
