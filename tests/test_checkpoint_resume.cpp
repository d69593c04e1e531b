// Exact resume through the Trainer with an LR scheduler that changes the learning rate every
// step and dropout on, at world 2 (gloo and mpi): 6 steps straight == 3 steps, save, resume, 3
// steps, losses and learning rates bitwise. The ranks' random streams are made to differ (rank r
// draws r+1 extra numbers per step, like rank-dependent augmentation), so the test fails unless
// every rank gets its own generator state back (see Note [Per-rank RNG state] in
// src/ckpt/checkpoint.cpp).
#include <gtest/gtest.h>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "testing.h"

#include <torch/optim/schedulers/step_lr.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

namespace {
namespace fs = std::filesystem;

constexpr const char* kEnvDir = "FSDP_TEST_RESUME_DIR";
constexpr const char* kEnvBackend = "FSDP_TEST_RESUME_BACKEND";
constexpr int64_t kVocab = 32;

struct DropoutLM : fsdp::LightningModule {
  std::shared_ptr<fsdp::nn::Module> model;
  std::shared_ptr<torch::optim::Optimizer> opt;
  void configure_model() override {
    if (!model) {
      model = register_module("model", fsdp::demos::make_model("transformer-tiny", kVocab, 0.2));
    }
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::rand({trainer()->global_rank() + 1});  // rank-dependent draws: the streams diverge
    return at::nll_loss((*model)(b.input, b.target), b.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    opt = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01));
    auto sched = std::make_shared<torch::optim::StepLR>(*opt, /*step_size=*/1, /*gamma=*/0.7);
    return {opt, sched};
  }
};

// Learning rate after every optimizer step.
struct LrRecorder : fsdp::Callback {
  DropoutLM* lm = nullptr;
  std::vector<double> lrs;
  int64_t last_step = -1;
  void on_train_batch_end(fsdp::Trainer& t, fsdp::LightningModule&, int64_t) override {
    if (t.global_step() == last_step) return;
    last_step = t.global_step();
    lrs.push_back(lm->opt->param_groups().at(0).options().get_lr());
  }
};

struct Run {
  std::vector<double> losses, lrs;
};

Run fit(const std::string& backend, int64_t max_steps, const std::string& ckpt_dir,
        const std::string& resume) {
  auto corpus = std::make_shared<fsdp::demos::SyntheticCorpus>(kVocab, 4000, 1, 8);
  fsdp::DataLoader train(corpus, 2, fsdp::DistributedSampler(corpus->size(), 1, 0, true, 3), true);
  fsdp::TrainerOptions o;
  o.devices = 2;
  o.strategy = "fsdp";
  o.process_group_backend = backend;
  o.max_steps = max_steps;
  o.limit_train_batches = 4;  // resuming at step 3 is mid-epoch; step 6 is in epoch 1
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.logger = false;
  o.seed = 11;
  o.state_dict_type = "sharded";
  o.checkpoint_dir = ckpt_dir;
  o.save_every_n_steps = ckpt_dir.empty() ? 0 : 3;
  auto rec = std::make_shared<LrRecorder>();
  o.callbacks = {rec};
  fsdp::Trainer trainer(o);
  DropoutLM lm;
  rec->lm = &lm;
  if (resume.empty()) {
    trainer.fit(lm, train);
  } else {
    trainer.fit(lm, train, resume);
  }
  return {trainer.results().losses, rec->lrs};
}

void body(const std::string& dir, const std::string& backend) {
  Run straight = fit(backend, 6, "", "");
  Run first = fit(backend, 3, dir + "/ckpt", "");
  Run resumed = fit(backend, 6, "", dir + "/ckpt/step-3");
  ASSERT_EQ(straight.losses.size(), 6u);
  ASSERT_EQ(first.losses.size(), 3u);
  ASSERT_EQ(resumed.losses.size(), 3u);
  ASSERT_EQ(resumed.lrs.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first.losses[i], straight.losses[i]) << i;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], straight.losses[3 + i]) << "step " << 4 + i;
    EXPECT_EQ(resumed.lrs[i], straight.lrs[3 + i]) << "lr after step " << 4 + i;
  }
  // The scheduler really moved the lr every step: libtorch's StepLR leaves its first step()
  // alone (step_count 0), so after 6 steps lr = 0.01 * 0.7^5.
  EXPECT_NEAR(straight.lrs.back(), 0.01 * std::pow(0.7, 5), 1e-12);
  EXPECT_NE(straight.lrs[2], straight.lrs[3]);
}

void run_outer(const std::string& test, const std::string& backend) {
  fs::path dir = fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test-resume" / test;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto r = fsdp::testing::run_process(
      {self, "--gtest_color=no", "--gtest_filter=CheckpointResume." + test},
      {{kEnvDir, dir.string()}, {kEnvBackend, backend}, {"FSDP_NUM_THREADS", "1"}}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out << r.err;
}

bool inner(std::string* dir, std::string* backend) {
  const char* d = std::getenv(kEnvDir);
  if (!d || !*d) return false;
  *dir = d;
  *backend = std::getenv(kEnvBackend);
  return true;
}

}  // namespace

TEST(CheckpointResume, SchedulerAndPerRankDropoutRngBitwiseGlooWorld2) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return body(dir, backend);
  run_outer("SchedulerAndPerRankDropoutRngBitwiseGlooWorld2", "gloo");
}

TEST(CheckpointResume, SchedulerAndPerRankDropoutRngBitwiseMpiWorld2) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return body(dir, backend);
  run_outer("SchedulerAndPerRankDropoutRngBitwiseMpiWorld2", "mpi");
}
