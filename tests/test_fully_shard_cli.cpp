// fsdp-train with --strategy fsdp: 3 ranks x batch 4 gives the losses of one process with batch
// 12 (the Trainer's DistributedSampler strides one permutation over the ranks), within 1e-5.
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::vector<double> run_losses(const std::vector<std::string>& extra, const std::string& tag) {
  const std::string json = ::testing::TempDir() + "fsdp_cli_" + tag + ".json";
  std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny",
                                   "--data", "synthetic", "--dropout", "0", "--seed", "7",
                                   "--max-steps", "10", "--no-progress-bar",
                                   "--default-root-dir", ::testing::TempDir() + "fsdp_cli_logs",
                                   "--summary-json", json};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = fsdp::testing::run_process(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(json);
  if (!in) {
    ADD_FAILURE() << "no summary " << json << "\n" << r.err;
    return {};
  }
  auto j = nlohmann::json::parse(in);
  std::remove(json.c_str());
  return j.at("losses").get<std::vector<double>>();
}

}  // namespace

TEST(FullyShardCli, ThreeRanksFullShardMatchSingleProcessLosses) {
  auto single = run_losses({"--strategy", "single", "--devices", "1", "--batch-size", "12"}, "single");
  auto fsdp3 = run_losses({"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--devices",
                           "3", "--batch-size", "4"},
                          "fsdp3");
  ASSERT_EQ(single.size(), 10u);
  ASSERT_EQ(fsdp3.size(), single.size());
  for (size_t i = 0; i < single.size(); ++i) {
    EXPECT_NEAR(fsdp3[i], single[i], 1e-5 * std::abs(single[i])) << "step " << i;
  }
}

TEST(FullyShardCli, FlagsAreValidated) {
  auto r = fsdp::testing::run_process({fsdp::testing::bin_path("fsdp-train"), "--strategy", "fsdp",
                                       "--sharding-strategy", "FULLSHARD", "--max-steps", "1",
                                       "--no-progress-bar"},
                                      {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("SHARD_GRAD_OP"), std::string::npos) << r.err;  // lists the valid names
  r = fsdp::testing::run_process({fsdp::testing::bin_path("fsdp-train"), "--strategy", "fsdp",
                                  "--wrap-policy", "size:lots", "--max-steps", "1",
                                  "--no-progress-bar"},
                                 {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("size:N"), std::string::npos) << r.err;
}
