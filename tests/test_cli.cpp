// fsdp-train from the outside: flag errors, --help, and a tiny run's --summary-json.
#include <gtest/gtest.h>

#include "testing.h"

#include <fsdp/precision.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace {
namespace fs = std::filesystem;
using fsdp::testing::run_process;

std::string train_bin() { return fsdp::testing::bin_path("fsdp-train"); }

int lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n')) +
         (!s.empty() && s.back() != '\n' ? 1 : 0);
}

std::string temp_path(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("fsdp_test_cli_" + std::to_string(::getpid()));
  fs::create_directories(p);
  return (p / name).string();
}

TEST(Cli, UnknownFlagExits2WithOneLine) {
  auto r = run_process({train_bin(), "--max-stepz", "3"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--max-stepz"), std::string::npos) << r.err;
}

TEST(Cli, BadValuesExit2WithOneLine) {
  const std::vector<std::vector<std::string>> cases = {
      {"--devices", "0"},         {"--batch-size", "abc"},    {"--precision", "bf17"},
      {"--strategy", "dpp"},      {"--model", "gpt5"},        {"--data", "imagenet"},
      {"--lr", "-1"},             {"--backend", "nccl"},      {"--nlayers", "3"},
      {"--dropout", "1.5"},       {"--optimizer", "lion"},    {"--accumulate-grad-batches", "0"}};
  for (const auto& c : cases) {
    std::vector<std::string> argv{train_bin()};
    argv.insert(argv.end(), c.begin(), c.end());
    auto r = run_process(argv);
    EXPECT_EQ(r.exit_code, 2) << c[0] << " " << c[1] << ": " << r.err;
    EXPECT_EQ(lines(r.err), 1) << c[0] << " " << c[1] << ": " << r.err;
    EXPECT_NE(r.err.find(c[0]), std::string::npos) << r.err;
  }
}

TEST(Cli, HelpDocumentsEveryFlagWithItsDefault) {
  auto r = run_process({train_bin(), "--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* flag :
       {"--accelerator", "--devices", "--num-nodes", "--strategy", "--precision", "--max-steps",
        "--max-epochs", "--batch-size", "--lr", "--model", "--nlayers", "--nhid", "--ninp",
        "--nhead", "--vocab-size", "--dropout", "--data", "--data-dir", "--seed", "--log-every",
        "--default-root-dir", "--summary-json", "--accumulate-grad-batches",
        "--gradient-clip-val", "--limit-train-batches", "--limit-val-batches",
        "--val-check-interval", "--backend", "--no-progress-bar", "--optimizer",
        "--weight-decay"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  // Defaults are shown beside the flags.
  EXPECT_NE(r.out.find("=transformer-tiny"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("=32-true"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("=synthetic"), std::string::npos) << r.out;
}

// 16-mixed is real on libtorch 2.x (it was refused on 1.13): a run trains, and where this CPU has
// no fp16 kernels it says so once and names the fast choice, without a backtrace.
TEST(Cli, Fp16RunsAndSaysWhereItIsSlow) {
  auto r = run_process({train_bin(), "--model", "transformer-tiny", "--precision", "16-mixed",
                        "--max-steps", "2", "--batch-size", "2", "--no-progress-bar",
                        "--default-root-dir", temp_path("fp16")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto warning = fsdp::precision_performance_warning(fsdp::Precision::k16Mixed);
  if (warning) {
    EXPECT_NE(r.err.find(*warning), std::string::npos) << r.err;
    EXPECT_NE(warning->find("'bf16-mixed'"), std::string::npos) << *warning;
  } else {
    EXPECT_EQ(r.err.find("[precision]"), std::string::npos) << r.err;
  }
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << "no C++ backtrace: " << r.err;
}

TEST(Cli, TinyRunWritesSummaryJson) {
  const std::string json_path = temp_path("summary.json");
  fs::remove(json_path);
  auto r = run_process({train_bin(), "--model", "transformer-tiny", "--max-steps", "4",
                        "--batch-size", "2", "--dropout", "0", "--seed", "7",
                        "--no-progress-bar", "--default-root-dir", temp_path("logs"),
                        "--summary-json", json_path});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(json_path);
  ASSERT_TRUE(f) << json_path;
  auto j = nlohmann::json::parse(f);
  for (const char* key : {"strategy", "world_size", "params", "steps", "it_per_s",
                          "peak_alloc_mb", "peak_rss_mb", "losses", "final_loss"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["strategy"], "single");
  EXPECT_EQ(j["world_size"], 1);
  EXPECT_EQ(j["steps"], 4);
  ASSERT_EQ(j["losses"].size(), 4u);
  EXPECT_EQ(j["final_loss"].get<double>(), j["losses"][3].get<double>());
  EXPECT_GT(j["params"].get<int64_t>(), 0);
  ASSERT_EQ(j["peak_alloc_mb"].size(), 1u);
  EXPECT_GT(j["peak_alloc_mb"][0].get<double>(), 0);
  EXPECT_GT(j["peak_rss_mb"][0].get<double>(), 0);
  // The end-of-run summary is printed.
  EXPECT_NE(r.out.find("it/s"), std::string::npos) << r.out;
}

TEST(Cli, TwoRankRunReportsMemoryPerRank) {
  const std::string json_path = temp_path("summary2.json");
  fs::remove(json_path);
  auto r = run_process({train_bin(), "--model", "transformer-tiny", "--max-steps", "3",
                        "--batch-size", "2", "--devices", "2", "--strategy", "ddp",
                        "--no-progress-bar", "--default-root-dir", temp_path("logs2"),
                        "--summary-json", json_path});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(json_path);
  ASSERT_TRUE(f) << json_path;
  auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["strategy"], "ddp");
  EXPECT_EQ(j["peak_alloc_mb"].size(), 2u);
  EXPECT_EQ(j["peak_rss_mb"].size(), 2u);
  EXPECT_EQ(j["losses"].size(), 3u);
}

}  // namespace
