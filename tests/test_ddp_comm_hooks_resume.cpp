// Comm hook state in checkpoints, and the DDP flags of fsdp-train.
//
// Resume: through the Trainer, 6 steps straight == 3 steps, save, resume, 3 steps, losses
// bitwise, with PowerSGD (error feedback and warm-started Q live at the save) and with
// post-local SGD (hook counter and model averager step), at world 2 on Gloo and world 3 on MPI.
// The control resumes from the same checkpoint without its comm state files and must differ,
// so the test fails if the hook state were not restored.
#include <gtest/gtest.h>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "testing.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace {
namespace fs = std::filesystem;

constexpr const char* kEnvDir = "FSDP_TEST_HOOK_RESUME_DIR";
constexpr const char* kEnvBackend = "FSDP_TEST_HOOK_RESUME_BACKEND";
constexpr const char* kEnvWorld = "FSDP_TEST_HOOK_RESUME_WORLD";
constexpr const char* kEnvHook = "FSDP_TEST_HOOK_RESUME_HOOK";
constexpr int64_t kVocab = 32;

struct TinyLM : fsdp::LightningModule {
  std::shared_ptr<fsdp::nn::Module> model;
  void configure_model() override {
    if (!model) {
      model = register_module("model", fsdp::demos::make_model("transformer-tiny", kVocab, 0.1));
    }
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    return at::nll_loss((*model)(b.input, b.target), b.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(),
                                                torch::optim::SGDOptions(0.05).momentum(0.9))};
  }
};

fsdp::DDPOptions hook_options(const std::string& hook) {
  fsdp::DDPOptions o;
  o.bucket_cap_mb = 0.05;  // several buckets, so the state is keyed by more than one
  if (hook == "powersgd") {
    fsdp::PowerSGDOptions p;
    p.matrix_approximation_rank = 2;
    p.start_powersgd_iter = 2;
    fsdp::set_comm_hook(o, "powersgd", "", p);
  } else {
    fsdp::PostLocalSGDOptions p;
    p.start_local_sgd_iter = 2;
    p.subgroup_size = 1;
    fsdp::set_comm_hook(o, "post_local_sgd", "", {}, p);
    o.model_averaging_period = 2;
  }
  return o;
}

std::vector<double> fit(const std::string& backend, int world, const std::string& hook,
                        int64_t max_steps, const std::string& ckpt_dir, const std::string& resume) {
  auto corpus = std::make_shared<fsdp::demos::SyntheticCorpus>(kVocab, 6000, 1, 8);
  fsdp::DataLoader train(corpus, 2, fsdp::DistributedSampler(corpus->size(), 1, 0, true, 3), true);
  fsdp::TrainerOptions o;
  o.devices = world;
  o.strategy = std::make_shared<fsdp::DDPStrategy>(hook_options(hook));
  o.process_group_backend = backend;
  o.max_steps = max_steps;
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.logger = false;
  o.seed = 11;
  o.checkpoint_dir = ckpt_dir;
  o.save_every_n_steps = ckpt_dir.empty() ? 0 : 3;
  fsdp::Trainer trainer(o);
  TinyLM lm;
  if (resume.empty()) {
    trainer.fit(lm, train);
  } else {
    trainer.fit(lm, train, resume);
  }
  return trainer.results().losses;
}

void body(const std::string& dir, const std::string& backend, int world, const std::string& hook) {
  std::vector<double> straight = fit(backend, world, hook, 6, "", "");
  std::vector<double> first = fit(backend, world, hook, 3, dir + "/ckpt", "");
  const std::string ckpt = dir + "/ckpt/step-3";
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(fs::exists(fs::path(ckpt) / ("ddp_comm_state-" + std::to_string(r) + "-of-" +
                                             std::to_string(world) + ".safetensors")));
  }
  // The control: the same checkpoint without the hook state (rank 0 writes it; every rank of
  // this program runs the body, the Trainers reuse the one world group).
  const std::string stripped = dir + "/stripped";
  auto group = fsdp::world_group();
  if (group->rank() == 0) {
    fs::remove_all(stripped);
    fs::copy(ckpt, stripped, fs::copy_options::recursive);
    for (const auto& e : fs::directory_iterator(stripped)) {
      if (e.path().filename().string().rfind("ddp_comm_state-", 0) == 0) fs::remove(e.path());
    }
  }
  group->barrier();
  std::vector<double> resumed = fit(backend, world, hook, 6, "", ckpt);
  std::vector<double> control = fit(backend, world, hook, 6, "", stripped);
  ASSERT_EQ(straight.size(), 6u);
  ASSERT_EQ(first.size(), 3u);
  ASSERT_EQ(resumed.size(), 3u);
  ASSERT_EQ(control.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first[i], straight[i]) << i;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed[i], straight[3 + i]) << "step " << 4 + i;
  bool control_differs = false;
  for (size_t i = 0; i < 3; ++i) control_differs |= control[i] != straight[3 + i];
  EXPECT_TRUE(control_differs) << "resuming without the " << hook << " state must not be bitwise "
                                  "(else this test could not detect a lost state)";
}

void run_outer(const std::string& test, const std::string& backend, int world,
               const std::string& hook) {
  fs::path dir = fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test-hook-resume" / test;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto r = fsdp::testing::run_process(
      {self, "--gtest_color=no", "--gtest_filter=CommHookResume." + test},
      {{kEnvDir, dir.string()}, {kEnvBackend, backend}, {kEnvWorld, std::to_string(world)},
       {kEnvHook, hook}, {"FSDP_NUM_THREADS", "1"}},
      300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out << r.err;
}

// In the re-executed test program (and its ranks): run the body.
bool inner() {
  const char* d = std::getenv(kEnvDir);
  if (!d || !*d) return false;
  body(d, std::getenv(kEnvBackend), std::atoi(std::getenv(kEnvWorld)), std::getenv(kEnvHook));
  return true;
}

}  // namespace

TEST(CommHookResume, PowerSGDBitwiseGlooWorld2) {
  if (!inner()) run_outer("PowerSGDBitwiseGlooWorld2", "gloo", 2, "powersgd");
}

TEST(CommHookResume, PowerSGDBitwiseMpiWorld3) {
  if (!inner()) run_outer("PowerSGDBitwiseMpiWorld3", "mpi", 3, "powersgd");
}

TEST(CommHookResume, PostLocalSGDBitwiseGlooWorld3) {
  if (!inner()) run_outer("PostLocalSGDBitwiseGlooWorld3", "gloo", 3, "post_local_sgd");
}

TEST(CommHookResume, PostLocalSGDBitwiseMpiWorld2) {
  if (!inner()) run_outer("PostLocalSGDBitwiseMpiWorld2", "mpi", 2, "post_local_sgd");
}

// ---------------------------------------------------------------------------------------------
// fsdp-train flags.

namespace {

std::string train_bin() { return fsdp::testing::bin_path("fsdp-train"); }

std::string temp_path(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("fsdp_test_hooks_" + std::to_string(::getpid()));
  fs::create_directories(p);
  return (p / name).string();
}

nlohmann::json run_summary(const std::vector<std::string>& extra) {
  const std::string path = temp_path("summary.json");
  fs::remove(path);
  std::vector<std::string> argv = {train_bin(),      "--strategy",   "ddp",     "--devices", "2",
                                   "--max-steps",     "4",            "--batch-size", "2",
                                   "--block-size",    "16",           "--dropout", "0",
                                   "--no-progress-bar", "--limit-val-batches", "0",
                                   "--default-root-dir", temp_path("logs"), "--summary-json", path};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = fsdp::testing::run_process(argv, {{"FSDP_NUM_THREADS", "1"}}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(path);
  if (!f) return nlohmann::json();
  return nlohmann::json::parse(f);
}

}  // namespace

TEST(CommHookCli, HooksAndDdpOptionsRunAndTheirBytesAreCounted) {
  if (!fs::exists(train_bin())) GTEST_SKIP() << "[fsdp-skip] fsdp-train is not built";
  nlohmann::json plain = run_summary({});
  nlohmann::json fp16 = run_summary({"--ddp-comm-hook", "fp16_compress", "--static-graph",
                                     "--gradient-as-bucket-view", "--bucket-cap-mb", "0.05",
                                     "--find-unused-parameters"});
  nlohmann::json psgd = run_summary({"--ddp-comm-hook", "powersgd", "--start-powersgd-iter", "2",
                                     "--powersgd-rank", "1", "--ddp-comm-wrapper", "fp16"});
  ASSERT_EQ(plain["comm_bytes_per_step"].size(), 4u) << plain.dump();
  ASSERT_EQ(fp16["comm_bytes_per_step"].size(), 4u);
  ASSERT_EQ(psgd["comm_bytes_per_step"].size(), 4u);
  const int64_t params = plain["params"];
  // Every step: the gradients (4 bytes per parameter) and the Trainer's loss all-reduce.
  const int64_t loss_bytes = plain["comm_bytes_per_step"][1].get<int64_t>() - params * 4;
  EXPECT_GT(loss_bytes, 0);
  EXPECT_LE(loss_bytes, 16);
  for (int s = 1; s < 4; ++s) {
    EXPECT_EQ(plain["comm_bytes_per_step"][s].get<int64_t>(), params * 4 + loss_bytes) << s;
    // fp16: half the gradient bytes, plus find_unused_parameters' used mask (4 bytes per
    // parameter tensor) in static_graph's first step only.
    if (s > 1) {
      EXPECT_EQ(fp16["comm_bytes_per_step"][s].get<int64_t>(), params * 2 + loss_bytes) << s;
    }
  }
  // PowerSGD from step 3 (iterations 0 and 1 are plain all-reduce, through the fp16 wrapper).
  EXPECT_EQ(psgd["comm_bytes_per_step"][1].get<int64_t>(), params * 2 + loss_bytes);
  EXPECT_LT(psgd["comm_bytes_per_step"][3].get<int64_t>(), params * 2 / 5);
  for (const auto* j : {&plain, &fp16, &psgd}) {
    for (const auto& l : (*j)["losses"]) EXPECT_TRUE(std::isfinite(l.get<double>()));
  }
}

TEST(CommHookCli, FlagErrorsSayWhatToDo) {
  if (!fs::exists(train_bin())) GTEST_SKIP() << "[fsdp-skip] fsdp-train is not built";
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--ddp-comm-hook", "powersdg"}, 2, "--ddp-comm-hook"},
      {{"--ddp-comm-wrapper", "fp8"}, 2, "--ddp-comm-wrapper"},
      {{"--powersgd-rank", "0"}, 2, "--powersgd-rank"},
      {{"--start-powersgd-iter", "-1"}, 2, "--start-powersgd-iter"},
      {{"--strategy", "fsdp", "--devices", "2", "--ddp-comm-hook", "fp16_compress"}, 2,
       "--ddp-comm-hook applies to --strategy ddp"},
      {{"--devices", "1", "--powersgd-rank", "2"}, 2, "applies to --strategy ddp"},
      {{"--strategy", "ddp", "--devices", "2", "--ddp-comm-hook", "post_local_sgd"}, 2,
       "--start-local-sgd-iter"},
      {{"--strategy", "ddp", "--devices", "2", "--ddp-comm-hook", "post_local_sgd",
        "--start-local-sgd-iter", "2"}, 2, "--model-averaging-period"},
      {{"--strategy", "ddp", "--devices", "2", "--model-averaging-period", "2"}, 2,
       "applies to --ddp-comm-hook post_local_sgd"},
      {{"--strategy", "ddp", "--devices", "2", "--ddp-comm-hook", "powersgd",
        "--start-powersgd-iter", "1"}, 1, "start_powersgd_iter must be > 1"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {train_bin(), "--max-steps", "1", "--no-progress-bar"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = fsdp::testing::run_process(argv, {{"FSDP_NUM_THREADS", "1"}}, 120);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
  }
}
