// Every input checked before work starts, from the outside: the real programs, each bad value
// refused in one line that names the flag (or the DeepSpeed config key), before step 1, leaving
// nothing behind. docs/errors.md, "Input checks: numbers, paths and the DeepSpeed config".
#include <gtest/gtest.h>

#include "cli_test_util.h"
#include "testing.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace {
namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

std::string bin(const std::string& name) { return fsdp::testing::bin_path(name); }

fs::path scratch() {
  static const fs::path p = fsdp::testing::fresh_scratch("fsdp_test_input_checks_");
  return p;
}

int lines(const std::string& s) { return fsdp::testing::count_lines(s); }

// A short fsdp-train run (synthetic data, one step) with `extra` flags.
std::vector<std::string> train(std::vector<std::string> extra) {
  std::vector<std::string> argv = {bin("fsdp-train"), "--max-steps", "1", "--batch-size", "2",
                                   "--num-tokens", "2000", "--no-progress-bar",
                                   "--default-root-dir", (scratch() / "logs").string()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// `r` was refused on the command line: exit 2, one line holding `text`, no trace, no CLI11 text,
// and no training started (the run's first line never printed).
void expect_refused(const ProcResult& r, const std::string& text) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << "expected: " << text << "\ngot: " << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  for (const char* never : {"frame #", "Exception raised from", "not in range", "json.exception",
                            "filesystem error", "17976931348623157"}) {
    EXPECT_EQ(r.err.find(never), std::string::npos) << r.err;
  }
  EXPECT_EQ(r.out.find("[fsdp-train] model"), std::string::npos) << "training started: " << r.out;
}

TEST(InputChecks, SummaryJsonInAMissingDirectoryIsRefusedBeforeStepOne) {
  auto r = run_process(train({"--summary-json", "/nonexistent/x"}));
  expect_refused(r, "--summary-json: directory '/nonexistent' does not exist");
  r = run_process(train({"--summary-json", scratch().string()}));
  expect_refused(r, "--summary-json: '" + scratch().string() + "' is a directory, not a file");
}

TEST(InputChecks, MonitorIsCheckedBeforeStepOne) {
  const fs::path ck = scratch() / "monitor-ck";
  auto r = run_process(train({"--monitor", "bogus", "--checkpoint-dir", ck.string()}));
  expect_refused(r, "--monitor: 'bogus' is not one of: train_loss, val_loss");
  EXPECT_FALSE(fs::exists(ck)) << "an empty checkpoint directory was left behind";
}

TEST(InputChecks, SaveInitialWeightsNamesItsFlag) {
  auto r = run_process(train({"--save-initial-weights", "/nonexistent/w.safetensors"}));
  expect_refused(r, "--save-initial-weights: directory '/nonexistent' does not exist");
  EXPECT_EQ(r.err.find(".tmp"), std::string::npos) << r.err;
}

TEST(InputChecks, EmptyNvmePathIsRefused) {
  auto r = run_process(train({"--strategy", "deepspeed_stage_3_offload_nvme", "--devices", "2",
                              "--nvme-path", "", "--dry-run"}));
  expect_refused(r, "--nvme-path needs a value");
}

TEST(InputChecks, NonUtf8CheckpointDirIsRefusedAtParse) {
  const fs::path ck = scratch() / "\xff\xfe";
  auto r = run_process(train({"--checkpoint-dir", ck.string(), "--save-every-n-steps", "1"}));
  expect_refused(r, "is not valid UTF-8");
  EXPECT_NE(r.err.find("--checkpoint-dir"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(ck));
}

TEST(InputChecks, LongPathsAreRefusedAtParse) {
  const fs::path ck = scratch() / std::string(5000, 'a');
  auto r = run_process(train({"--checkpoint-dir", ck.string(), "--save-every-n-steps", "1"}));
  expect_refused(r, "--checkpoint-dir: a path of ");
  EXPECT_NE(r.err.find("is too long (at most 4095)"), std::string::npos) << r.err;
  EXPECT_LT(r.err.size(), 400u) << "one readable line: " << r.err;
  r = run_process(train({"--summary-json", (scratch() / std::string(300, 'b')).string()}));
  expect_refused(r, "--summary-json: a name of 300 bytes in ");
}

TEST(InputChecks, LearningRateAboveTheBoundIsRefused) {
  expect_refused(run_process(train({"--lr", "1e308"})), "--lr must be between 0 and 1000");
}

TEST(InputChecks, ElementCountsAreBounded) {
  // These flags are doubles (users write 1e8); 1.2e19 became a negative size per rank.
  for (const char* flag : {"--params-buffer-size", "--max-in-cpu", "--sub-group-size"}) {
    auto r = run_process(train({"--strategy", "deepspeed_stage_3_offload_nvme", "--devices", "2",
                                "--nvme-path", scratch().string(), flag, "1.2e19", "--dry-run"}));
    expect_refused(r, std::string(flag) + " must be between ");
    r = run_process(train({"--strategy", "deepspeed_stage_3", "--devices", "2", flag, "nan",
                           "--dry-run"}));
    expect_refused(r, std::string(flag) + ": 'nan' is not a finite number");
  }
}

TEST(InputChecks, DeepSpeedConfigNumbersAreCheckedBeforeTheRun) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"zero_optimization": {"stage": 4294967298}})",
       "'zero_optimization.stage' must be an integer from 0 to 3, got 4294967298"},
      {R"({"zero_optimization": {"stage": 2}, "aio": {"queue_depth": 4294967304}})",
       "'aio.queue_depth' must be an integer from 1 to 4096, got 4294967304"},
      {R"({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 1e15})",
       "'gradient_accumulation_steps' must be an integer from 1 to 1073741824, got 1e+15"},
      {R"({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}})",
       "'scheduler.params.warmup_num_steps' must be an integer from 0 to"},
      {R"({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 1e308}}})",
       "'optimizer.params.lr' must be a number above 0 and at most 1000, got 1e+308"},
  };
  for (const auto& [config, message] : cases) {
    auto r = run_process(train({"--deepspeed-config", config, "--devices", "2", "--dry-run"}));
    expect_refused(r, message);
  }
  const fs::path file = scratch() / "nul.json";
  {
    std::ofstream f(file, std::ios::binary);
    f << R"({"zero_optimization": {"stage": 2}})" << std::string(1, '\0') << "garbage";
  }
  auto r = run_process(train({"--deepspeed-config", file.string(), "--devices", "2", "--dry-run"}));
  expect_refused(r, "holds a NUL byte at offset 35");
}

TEST(InputChecks, CheckpointDirAloneSavesAtTheEnd) {
  const fs::path ck = scratch() / "alone";
  // One step of an epoch of many: the save at the end of training, inside the epoch.
  auto r = run_process(train({"--checkpoint-dir", ck.string()}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(ck / "last")) << "--checkpoint-dir alone saved nothing";
  EXPECT_TRUE(fs::exists(ck / "step-1")) << r.out;
}

TEST(InputChecks, CheckFlagsStartsNothing) {
  const fs::path ck = scratch() / "check-ck", logs = scratch() / "check-logs";
  auto r = run_process({bin("fsdp-train"), "--check-flags", "--checkpoint-dir", ck.string(),
                        "--default-root-dir", logs.string(), "--summary-json",
                        (scratch() / "s.json").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(ck));
  EXPECT_FALSE(fs::exists(logs));
  EXPECT_FALSE(fs::exists(scratch() / "s.json"));
  // The checks a run makes after parsing are made too: a flag of another strategy family.
  r = run_process({bin("fsdp-train"), "--check-flags", "--bucket-cap-mb", "10", "--strategy",
                   "fsdp", "--devices", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--bucket-cap-mb applies to --strategy ddp"), std::string::npos) << r.err;
}

TEST(InputChecks, ConvertWorldIsBounded) {
  const fs::path out = scratch() / "converted";
  auto r = run_process({bin("fsdp-ckpt"), "convert", "--to", "sharded", "--world", "2147483647",
                        scratch().string(), out.string()},
                       {}, 30);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--world must be between 1 and 65536"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST(InputChecks, FinetuneNumbersAndLists) {
  if (!fs::exists(bin("fsdp-finetune"))) GTEST_SKIP() << "[fsdp-skip] built without QLoRA";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--lora-r", "-1"}, "--lora-r must be at least 1"},
      {{"--lora-alpha", "NaN"}, "--lora-alpha: 'NaN' is not a finite number"},
      {{"--max-steps", "12345678901234567890"}, "--max-steps: '12345678901234567890' is out of range"},
      {{"--seed", ""}, "--seed needs a value"},
      {{"--max-steps", ""}, "--max-steps needs a value"},
      {{"--lora-target-modules", ""}, "--lora-target-modules needs a value"},
      {{"--lora-target-modules", ","}, "--lora-target-modules: ',' names no module"},
      {{"--num-train-epochs", "1e300"}, "--num-train-epochs must be between 0 and"},
      {{"--learning-rate", "1e308"}, "--learning-rate must be between 0 and 1000"},
      {{"--output-dir", (scratch() / "f" / "x").string()}, ""},
  };
  std::ofstream(scratch() / "f") << "a file\n";
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {bin("fsdp-finetune"), "--preset", "llama-tiny", "--data",
                                     "synthetic", "--synthetic-examples", "8", "--max-length",
                                     "16", "--output-dir", (scratch() / "ft").string()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto r = run_process(argv, {}, 120);
    expect_refused(r, message.empty() ? "--output-dir: '" + (scratch() / "f" / "x").string() +
                                            "' cannot be created: '" +
                                            (scratch() / "f").string() + "' is not a directory"
                                      : message);
    EXPECT_FALSE(fs::exists(scratch() / "ft")) << flags[0];
  }
}

}  // namespace
