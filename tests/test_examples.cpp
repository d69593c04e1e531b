// The example programs (examples/), run as a user runs them: 2 ranks (the program's Trainer
// starts the second one), a few steps each, on the gloo backend. What each prints and saves is
// checked: losses finite and falling, checkpoint files present, a resume continuing at the saved
// step, weights that load back, the DeepSpeed config's scheduler in effect.
#include "testing.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using fsdp::testing::run_process;

fs::path scratch(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("fsdp-examples-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

fsdp::testing::ProcResult run_example(const std::string& program, std::vector<std::string> args) {
  args.insert(args.begin(), fsdp::testing::bin_path(program));
  // gloo: no mpirun re-execution; one intra-op thread per rank on a 2-core machine.
  return run_process(args, {{"FSDP_BACKEND", "gloo"}, {"FSDP_NUM_THREADS", "1"}}, 300);
}

// The numbers after `key` on the line that has it, e.g. "losses: 1.2 1.1".
std::vector<double> numbers_after(const std::string& out, const std::string& key) {
  const size_t at = out.find(key);
  if (at == std::string::npos) return {};
  std::istringstream line(out.substr(at + key.size(), out.find('\n', at) - at - key.size()));
  std::vector<double> v;
  for (double x; line >> x;) v.push_back(x);
  return v;
}

double number_after(const std::string& out, const std::string& key) {
  const auto v = numbers_after(out, key);
  return v.empty() ? NAN : v.front();
}

TEST(Examples, TrainRegressionCheckpointsResumesAndReloads) {
  const fs::path dir = scratch("regression");
  const std::string ckpt = (dir / "ckpt").string();
  const std::vector<std::string> common = {"--devices", "2", "--ckpt-dir", ckpt,
                                           "--default-root-dir", (dir / "logs").string()};

  // 2 epochs of 1024 / (32 x 2) = 16 steps: 32 steps.
  auto args = common;
  args.insert(args.end(), {"--max-epochs", "2"});
  auto first = run_example("train_regression", args);
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  EXPECT_NE(first.out.find("fit starts at step 0\n"), std::string::npos) << first.out;
  const std::string r1 = "[train_regression] 32 steps, train_loss first";
  ASSERT_NE(first.out.find(r1), std::string::npos) << first.out;
  const std::string summary = first.out.substr(first.out.find(r1));
  const double loss_first = number_after(summary, r1);
  const double loss_last = number_after(summary, "last");
  EXPECT_TRUE(std::isfinite(loss_first) && std::isfinite(loss_last)) << first.out;
  EXPECT_LT(loss_last, 0.5 * loss_first) << first.out;
  // ModelCheckpoint: one entry per epoch (both kept: save_top_k 2), `last` -> the newest.
  const double val16 = number_after(first.out, "step 16 val_loss");
  const double val32 = number_after(first.out, "step 32 val_loss");
  EXPECT_LT(val32, val16) << first.out;
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    const std::string name = e.path().filename().string();
    if (name[0] != '.') entries.push_back(name);  // .fsdp-owner.json: which run owns `last`
  }
  std::sort(entries.begin(), entries.end());
  ASSERT_EQ(entries.size(), 3u) << ::testing::PrintToString(entries);
  EXPECT_TRUE(entries[0].rfind("epoch=0-step=16-val_loss=", 0) == 0) << entries[0];
  EXPECT_TRUE(entries[1].rfind("epoch=1-step=32-val_loss=", 0) == 0) << entries[1];
  EXPECT_EQ(entries[2], "last");
  EXPECT_EQ(fs::read_symlink(fs::path(ckpt) / "last").filename().string(), entries[1]);
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / entries[1] / "model.safetensors"));
  // load_weights into a fresh LightningModule gives the validation loss the run measured.
  const double reloaded = number_after(first.out, "into a new Regression: val_loss");
  EXPECT_NEAR(reloaded, val32, 1e-4 * val32 + 1e-7) << first.out;

  // Resume from `last` for a third epoch: it starts at step 32 and runs 16 steps.
  args = common;
  args.insert(args.end(), {"--max-epochs", "3", "--resume", ckpt + "/last"});
  auto second = run_example("train_regression", args);
  ASSERT_EQ(second.exit_code, 0) << second.out << second.err;
  EXPECT_NE(second.out.find("fit starts at step 32\n"), std::string::npos) << second.out;
  EXPECT_NE(second.out.find("[train_regression] 16 steps"), std::string::npos) << second.out;
  const double val48 = number_after(second.out, "step 48 val_loss");
  EXPECT_LT(val48, val32) << second.out;
  // save_top_k 2: the two best of epochs 0..2 stay; epoch 0's entry (the worst) is gone.
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / entries[0])) << second.out;
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / entries[1]));
  fs::remove_all(dir);
}

TEST(Examples, TrainDeepSpeedConfigFollowsTheConfig) {
  const fs::path dir = scratch("deepspeed");
  auto r = run_example("train_deepspeed_config",
                       {"--deepspeed-config", std::string(FSDP_SOURCE_DIR) + "/examples/deepspeed_config.json",
                        "--devices", "2", "--max-steps", "6", "--default-root-dir",
                        (dir / "logs").string()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The config's optimizer replaces configure_optimizers' SGD.
  EXPECT_NE(r.err.find("the DeepSpeed config defines the optimizer (Adam)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("strategy deepspeed, stage 2, batch 8 per rank"), std::string::npos) << r.out;
  // WarmupLR, linear, 0 -> 3e-3 over 4 steps, then constant.
  const std::vector<double> want = {0, 7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 3e-3};
  for (size_t s = 0; s < want.size(); ++s) {
    const double lr = number_after(r.out, "step " + std::to_string(s + 1) + " lr");
    EXPECT_NEAR(lr, want[s], 1e-9) << "step " << s + 1 << "\n" << r.out;
  }
  const auto losses = numbers_after(r.out, "losses:");
  ASSERT_EQ(losses.size(), 6u) << r.out;
  for (double l : losses) EXPECT_TRUE(std::isfinite(l)) << r.out;
  EXPECT_LT(losses.back(), losses.front()) << r.out;
  fs::remove_all(dir);
}

}  // namespace
