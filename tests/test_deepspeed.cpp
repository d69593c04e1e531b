// DeepSpeed ZeRO stages 1/2/3 (fsdp/deepspeed.h): parity with a single process (per-step
// losses within 1e-5 relative, parameters after 10 steps) at worlds 2, 3, 4 on Gloo and MPI,
// with gradient accumulation, clipping and bf16-mixed; per-rank model-state bytes against
// ZeRO's formulas; names, option and config errors.
#include "fsdp/deepspeed.h"
#include "fsdp/memory.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

using fsdp::testing::LoopConfig;
using fsdp::testing::TinyLM;

namespace {

// Small buckets so that every model has several (transformer-tiny: ~47k parameters), and a
// persistence threshold that keeps the 1-d parameters of stage 3 whole and shards the rest.
fsdp::DeepSpeedOptions zero_options(int stage) {
  fsdp::DeepSpeedOptions o;
  o.stage = stage;
  o.reduce_bucket_size = 6000;
  o.allgather_bucket_size = 9000;
  o.stage3_param_persistence_threshold = 64;
  return o;
}

std::shared_ptr<fsdp::DeepSpeedStrategy> connected(const fsdp::DeepSpeedOptions& o) {
  auto s = std::make_shared<fsdp::DeepSpeedStrategy>(o);
  auto world = fsdp::world_group();
  fsdp::LaunchInfo launch;
  launch.rank = world->rank();
  launch.world_size = world->size();
  launch.local_world_size = world->size();
  s->connect(world, launch);
  return s;
}

void check_parity(const fsdp::DeepSpeedOptions& o, const LoopConfig& cfg,
                  const std::function<void(TinyLM&)>& setup = {}, double tol = 1e-5) {
  SCOPED_TRACE("ZeRO stage " + std::to_string(o.stage));
  TinyLM ref;
  if (setup) setup(ref);
  auto want = fsdp::testing::train_reference(ref, cfg);
  TinyLM lm;
  if (setup) setup(lm);
  auto strategy = connected(o);
  auto got = fsdp::testing::train_with(*strategy, lm, cfg);
  fsdp::testing::expect_losses_close(got, want, tol);
  fsdp::testing::expect_params_close(strategy->gather_full_params(), ref, tol);
  EXPECT_GT(strategy->num_grad_buckets(), o.stage == 3 ? 0 : 1) << "buckets not exercised";
  if (o.stage == 3) EXPECT_GT(strategy->persistent_numel(), 0);
}

void parity_all_stages(int world_size, const std::string& backend) {
  fsdp::testing::run_ranks(world_size, backend, [&](fsdp::ProcessGroup&) {
    LoopConfig cfg;  // 10 steps, global batch 12
    for (int stage : {1, 2, 3}) check_parity(zero_options(stage), cfg);
  });
}

}  // namespace

TEST(DeepSpeed, ParityGlooWorld2) { parity_all_stages(2, "gloo"); }
TEST(DeepSpeed, ParityGlooWorld3) { parity_all_stages(3, "gloo"); }
TEST(DeepSpeed, ParityGlooWorld4) { parity_all_stages(4, "gloo"); }
TEST(DeepSpeed, ParityMpiWorld2) { parity_all_stages(2, "mpi"); }
TEST(DeepSpeed, ParityMpiWorld3) { parity_all_stages(3, "mpi"); }

TEST(DeepSpeed, AccumulationClippingAndAdamWWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    for (int stage : {1, 2, 3}) {
      LoopConfig acc;
      acc.global_batch = 24;
      acc.accumulate = 2;  // micro-batches of 12 rows, 4 per rank
      acc.steps = 6;
      check_parity(zero_options(stage), acc);
      LoopConfig clip;
      clip.clip = 0.05;  // small enough that every step clips
      clip.steps = 6;
      check_parity(zero_options(stage), clip, [](TinyLM& m) { m.optimizer = "adamw"; });
    }
  });
}

TEST(DeepSpeed, AccumulationAndClippingMpiWorld2) {
  fsdp::testing::run_ranks(2, "mpi", [](fsdp::ProcessGroup&) {
    for (int stage : {1, 2, 3}) {
      LoopConfig cfg;
      cfg.accumulate = 3;  // micro-batches of 4 rows, 2 per rank
      cfg.clip = 0.05;
      cfg.steps = 6;
      check_parity(zero_options(stage), cfg);
    }
  });
}

// bf16-mixed as the Trainer runs it for these strategies (CPU autocast, fp32 parameters and
// state): against DDP at the same world (same per-rank batches, so the same bf16 roundings)
// within 1e-5, and against the single process within the stated bf16 tolerance (the single
// process multiplies 12 rows where a rank multiplies 4 or 6: its bf16 gradient products round
// differently).
TEST(DeepSpeed, Bf16MixedMatchesDdpAndTracksSingleWorld2And3) {
  for (int world : {2, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
      LoopConfig cfg;
      cfg.bf16_autocast = true;
      cfg.steps = 6;
      TinyLM ddp_lm;
      auto ddp = fsdp::make_strategy("ddp");
      ddp->connect(fsdp::world_group(), {});
      auto want = fsdp::testing::train_with(*ddp, ddp_lm, cfg);
      TinyLM single;
      auto single_losses = fsdp::testing::train_reference(single, cfg);
      for (int stage : {1, 2, 3}) {
        SCOPED_TRACE("bf16-mixed stage " + std::to_string(stage));
        TinyLM lm;
        auto s = connected(zero_options(stage));
        auto got = fsdp::testing::train_with(*s, lm, cfg);
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(s->gather_full_params(), ddp_lm, 1e-5);
        fsdp::testing::expect_losses_close(got, single_losses, 2e-3);
      }
    });
  }
}

// --- model-state bytes per rank vs ZeRO's formulas ---------------------------------------------

namespace {

// Sixteen 64x64 layers: 66,560 parameters (260 KiB fp32) against a few KiB of activations,
// every dim-0 divisible by 4 (no padding), and one-layer buckets small against the model (with
// four layers, two buckets in flight cost as much as stage 2 saves over stage 1).
struct WideNet : fsdp::LightningModule {
  std::vector<torch::nn::Linear> layers;
  void configure_model() override {
    if (!layers.empty()) return;
    torch::manual_seed(5);
    for (int i = 0; i < 16; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(64, 64)));
    }
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor h = batch.input;
    for (auto& l : layers) h = at::tanh(l(h));
    return (h - batch.target).pow(2).mean();
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-3))};
  }
};

int64_t settled_bytes() {
  // Gloo's worker threads drop their references to a collective's buffers asynchronously.
  int64_t now = fsdp::memory_stats().current_bytes;
  for (int i = 0; i < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int64_t next = fsdp::memory_stats().current_bytes;
    if (next == now) break;
    now = next;
  }
  return now;
}

struct StateBytes {
  int64_t after_backward = 0;       // before post_backward: stage 1 holds whole gradients here
  int64_t after_post_backward = 0;  // partitioned gradients
  int64_t backward_peak = 0;        // allocator peak from forward to post_backward
};

StateBytes measure(int stage) {
  const int64_t base = settled_bytes();
  StateBytes m;
  {
    WideNet net;
    fsdp::DeepSpeedOptions o;
    o.stage = stage;
    o.reduce_bucket_size = 64 * 64 + 64;  // one layer per bucket
    o.allgather_bucket_size = 64 * 64 + 64;
    o.stage3_param_persistence_threshold = 0;
    auto s = connected(o);
    fsdp::configure_model_with(*s, net);
    s->setup_module(net);
    auto opt = net.configure_optimizers().optimizer;
    s->setup_optimizer(*opt);
    const int rank = s->rank();
    for (int step = 0; step < 2; ++step) {  // step 1 creates Adam's state; step 2 is measured
      auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + rank);
      fsdp::Batch b{at::randn({2, 64}, gen), at::randn({2, 64}, gen)};
      if (step == 1) fsdp::reset_peak_memory_stats();
      s->pre_forward(net, true);
      at::Tensor loss = net.training_step(b, step);
      s->backward(loss);
      loss = at::Tensor();
      if (step == 1) m.after_backward = settled_bytes() - base;
      s->post_backward(net, true);
      if (step == 1) {
        m.backward_peak = fsdp::memory_stats().peak_bytes - base;
        m.after_post_backward = settled_bytes() - base;
      }
      s->optimizer_step(*opt);
      s->zero_grad(*opt);
    }
  }
  return m;
}

}  // namespace

TEST(DeepSpeedMemory, ModelStateBytesMatchZeroFormulasWorld4) {
  fsdp::testing::run_ranks(4, "gloo", [](fsdp::ProcessGroup& world) {
    fsdp::install_tracking_allocator();
    const double W = world.size();
    const double psi = 16 * (64 * 64 + 64);  // parameters
    StateBytes s1 = measure(1), s2 = measure(2), s3 = measure(3);
    // fp32 with Adam: stage 1 4+4+8/N, stage 2 4+12/N, stage 3 16/N bytes per parameter.
    const double f1 = (4 + 4 + 8 / W) * psi, f2 = (4 + 12 / W) * psi, f3 = 16 / W * psi;
    EXPECT_NEAR(s1.after_backward, f1, 0.05 * f1) << "stage 1 with whole gradients";
    EXPECT_NEAR(s2.after_post_backward, f2, 0.05 * f2) << "stage 2";
    EXPECT_NEAR(s3.after_post_backward, f3, 0.05 * f3) << "stage 3";
    // Stage 2 never holds every whole gradient: its peak during backward stays below stage 1's
    // state with whole gradients (buckets of one layer: at most two in flight).
    EXPECT_LT(s2.backward_peak, s1.after_backward);
    // Bound: the final state, two one-layer buckets in flight (input W x chunk + output chunk),
    // at most two layers' whole gradients waiting for their bucket, activations (< 64 KiB).
    const double layer = 4 * psi / 16;  // bytes of one layer's gradients
    EXPECT_LT(s2.backward_peak, f2 + 2 * (1 + 1 / W) * layer + 2 * layer + 64 * 1024);
    if (world.rank() == 0) {
      std::printf("[zero memory] psi %.0f params, world 4: stage 1 %lld B (formula %.0f), stage 2 "
                  "%lld B (formula %.0f, backward peak %lld), stage 3 %lld B (formula %.0f)\n",
                  psi, (long long)s1.after_backward, f1, (long long)s2.after_post_backward,
                  f2, (long long)s2.backward_peak, (long long)s3.after_post_backward, f3);
    }
  });
}

// --- names, options, config ---------------------------------------------------------------------

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::string write_config(const std::string& name, const std::string& text) {
  auto path = std::filesystem::temp_directory_path() / ("fsdp-ds-" + name + ".json");
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST(DeepSpeedNames, LightningRegistryNames) {
  struct Want {
    const char* name;
    int stage;
    bool offload_optimizer, offload_parameters;
  };
  for (auto w : {Want{"deepspeed", 2, false, false}, Want{"deepspeed_stage_1", 1, false, false},
                 Want{"deepspeed_stage_2", 2, false, false},
                 Want{"deepspeed_stage_2_offload", 2, true, false},
                 Want{"deepspeed_stage_3", 3, false, false},
                 Want{"deepspeed_stage_3_offload", 3, true, true}}) {
    auto s = fsdp::make_strategy(w.name);
    auto* ds = dynamic_cast<fsdp::DeepSpeedStrategy*>(s.get());
    ASSERT_NE(ds, nullptr) << w.name;
    EXPECT_EQ(ds->name(), w.name);
    EXPECT_EQ(ds->options().stage, w.stage) << w.name;
    EXPECT_EQ(ds->options().offload_optimizer, w.offload_optimizer) << w.name;
    EXPECT_EQ(ds->options().offload_parameters, w.offload_parameters) << w.name;
    // Lightning's defaults.
    EXPECT_EQ(ds->options().allgather_bucket_size, 2e8);
    EXPECT_EQ(ds->options().reduce_bucket_size, 2e8);
    EXPECT_EQ(ds->options().sub_group_size, 1e12);
    EXPECT_TRUE(ds->options().overlap_comm);
  }
  const std::string nvme = error_of([] { fsdp::make_strategy("deepspeed_stage_3_offload_nvme"); });
  EXPECT_NE(nvme.find("disk tier"), std::string::npos) << nvme;
  EXPECT_NE(nvme.find("not implemented yet"), std::string::npos) << nvme;
  fsdp::DeepSpeedOptions o;
  o.stage = 0;
  EXPECT_NE(error_of([&] { fsdp::DeepSpeedStrategy s(o); }).find("'ddp'"), std::string::npos);
  o.stage = 2;
  o.partition_activations = true;
  EXPECT_NE(error_of([&] { fsdp::DeepSpeedStrategy s(o); }).find("not implemented yet"),
            std::string::npos);
  o.partition_activations = false;
  o.offload_parameters = true;
  EXPECT_NE(error_of([&] { fsdp::DeepSpeedStrategy s(o); }).find("stage 3"), std::string::npos);
}

TEST(DeepSpeedConfig, ValidConfigReplacesTheDefaults) {
  const std::string path = write_config("valid", R"({
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "reduce_bucket_size": 5e7, "allgather_bucket_size": 3e7,
                          "stage3_param_persistence_threshold": 1000, "overlap_comm": false},
    "bf16": {"enabled": true},
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 4,
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                  "warmup_num_steps": 10, "total_num_steps": 100, "warmup_type": "linear"}}
  })");
  fsdp::DeepSpeedTrainingConfig t;
  fsdp::DeepSpeedOptions o = fsdp::parse_deepspeed_config(path, &t);
  EXPECT_EQ(o.stage, 3);
  EXPECT_TRUE(o.offload_optimizer);
  EXPECT_FALSE(o.offload_parameters);
  EXPECT_TRUE(o.pin_memory);
  EXPECT_EQ(o.reduce_bucket_size, 5e7);
  EXPECT_EQ(o.allgather_bucket_size, 3e7);
  EXPECT_EQ(o.stage3_param_persistence_threshold, 1000);
  EXPECT_FALSE(o.overlap_comm);
  EXPECT_EQ(o.sub_group_size, 1e9);  // DeepSpeed's default, not Lightning's 1e12
  EXPECT_EQ(t.precision.value_or(""), "bf16-mixed");
  EXPECT_EQ(t.gradient_clipping.value_or(0), 1.0);
  EXPECT_EQ(t.gradient_accumulation_steps.value_or(0), 4);
  EXPECT_EQ(t.train_micro_batch_size_per_gpu.value_or(0), 8);
  EXPECT_EQ(t.optimizer_type, "AdamW");
  EXPECT_DOUBLE_EQ(t.lr, 3e-4);
  EXPECT_DOUBLE_EQ(t.beta2, 0.95);
  EXPECT_EQ(t.scheduler_type, "WarmupDecayLR");
  EXPECT_EQ(t.total_num_steps, 100);
  EXPECT_EQ(t.warmup_type, "linear");

  // The JSON object itself, and the strategy reading it (config replaces the preset's stage).
  fsdp::DeepSpeedOptions with;
  with.stage = 2;
  with.config = R"({"zero_optimization": {"stage": 1}})";
  fsdp::DeepSpeedStrategy s(with);
  EXPECT_EQ(s.options().stage, 1);
  EXPECT_EQ(s.options().reduce_bucket_size, 5e8);  // DeepSpeed's default

  // PL_DEEPSPEED_CONFIG_PATH, as Lightning.
  const std::string env_path = write_config("env", R"({"zero_optimization": {"stage": 3}})");
  ::setenv("PL_DEEPSPEED_CONFIG_PATH", env_path.c_str(), 1);
  auto from_env = fsdp::make_deepspeed_strategy("deepspeed");
  ::unsetenv("PL_DEEPSPEED_CONFIG_PATH");
  EXPECT_EQ(from_env->options().stage, 3);
  EXPECT_EQ(fsdp::make_deepspeed_strategy("deepspeed")->options().stage, 2);
}

TEST(DeepSpeedConfig, UnknownKeyIsOneErrorNamingItAndTheSupportedKeys) {
  std::string e = error_of([] {
    fsdp::parse_deepspeed_config(R"({"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}})");
  });
  EXPECT_NE(e.find("'fp16'"), std::string::npos) << e;
  EXPECT_NE(e.find("'zero_optimization'"), std::string::npos) << e;
  EXPECT_NE(e.find("'gradient_clipping'"), std::string::npos) << e;
  e = error_of([] {
    fsdp::parse_deepspeed_config(
        R"({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}})");
  });
  EXPECT_NE(e.find("'zero_optimization.stage3_max_live_parameters'"), std::string::npos) << e;
  EXPECT_NE(e.find("'reduce_bucket_size'"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config(R"({"optimizer": {"type": "OneBitAdam"}})"); });
  EXPECT_NE(e.find("OneBitAdam"), std::string::npos) << e;
  EXPECT_NE(e.find("\"AdamW\""), std::string::npos) << e;
}

TEST(DeepSpeedConfig, WrongTypeIsAnErrorNamingTheKey) {
  std::string e = error_of(
      [] { fsdp::parse_deepspeed_config(R"({"zero_optimization": {"stage": "two"}})"); });
  EXPECT_NE(e.find("'zero_optimization.stage' must be an integer"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config(R"({"gradient_clipping": true})"); });
  EXPECT_NE(e.find("'gradient_clipping' must be a number"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config(R"({"bf16": {"enabled": 1}})"); });
  EXPECT_NE(e.find("'bf16.enabled' must be a boolean"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config(R"({"zero_optimization": []})"); });
  EXPECT_NE(e.find("'zero_optimization' must be an object"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config("/nonexistent/ds.json"); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
  e = error_of([] { fsdp::parse_deepspeed_config("{not json"); });
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

// Offload on a CPU device: one line at setup, training unchanged.
TEST(DeepSpeed, OffloadOnCpuSaysSoAndTrainsTheSameWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& world) {
    LoopConfig cfg;
    cfg.steps = 4;
    auto o = zero_options(3);
    o.offload_optimizer = true;
    o.offload_parameters = true;
    ::testing::internal::CaptureStderr();
    check_parity(o, cfg);
    const std::string err = ::testing::internal::GetCapturedStderr();
    if (world.rank() == 0) {
      EXPECT_NE(err.find("already lives in host memory"), std::string::npos) << err;
    }
  });
}

// The config's training settings reach the Trainer's options; a conflicting option is an error.
TEST(DeepSpeedConfig, TrainingSettingsGoToTheTrainerOptions) {
  fsdp::DeepSpeedOptions o;
  o.config = R"({"zero_optimization": {"stage": 2}, "bf16": {"enabled": true},
                 "gradient_clipping": 0.5, "gradient_accumulation_steps": 3})";
  fsdp::DeepSpeedStrategy s(o);
  fsdp::TrainerOptions t;
  s.configure_trainer(t);
  EXPECT_EQ(t.precision, "bf16-mixed");
  EXPECT_EQ(t.gradient_clip_val, 0.5);
  EXPECT_EQ(t.accumulate_grad_batches, 3);
  fsdp::TrainerOptions clash;
  clash.accumulate_grad_batches = 2;
  const std::string e = error_of([&] { s.configure_trainer(clash); });
  EXPECT_NE(e.find("gradient_accumulation_steps is 3"), std::string::npos) << e;
  EXPECT_NE(e.find("accumulate_grad_batches is 2"), std::string::npos) << e;
}

// The config's optimizer and scheduler replace the module's: AdamW with its hyperparameters,
// and DeepSpeed's WarmupDecayLR schedule.
TEST(DeepSpeedConfig, OptimizerAndSchedulerFromTheConfig) {
  fsdp::testing::run_ranks(1, "gloo", [](fsdp::ProcessGroup&) {
    fsdp::DeepSpeedOptions o;
    o.config = R"({"zero_optimization": {"stage": 1},
      "optimizer": {"type": "Adam", "params": {"lr": 0.5, "betas": [0.8, 0.9], "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.0,
                    "warmup_num_steps": 4, "total_num_steps": 8, "warmup_type": "linear"}}})";
    auto s = std::make_shared<fsdp::DeepSpeedStrategy>(o);
    s->connect(fsdp::world_group(), {});
    TinyLM lm;
    fsdp::configure_model_with(*s, lm);
    s->setup_module(lm);
    fsdp::OptimizerConfig cfg = lm.configure_optimizers();
    s->configure_optimizers(lm, cfg);
    auto* adamw = dynamic_cast<torch::optim::AdamW*>(cfg.optimizer.get());
    ASSERT_NE(adamw, nullptr) << "DeepSpeed's \"Adam\" decouples weight decay (adam_w_mode)";
    auto& opts = static_cast<torch::optim::AdamWOptions&>(adamw->param_groups()[0].options());
    EXPECT_DOUBLE_EQ(opts.weight_decay(), 0.1);
    EXPECT_DOUBLE_EQ(std::get<0>(opts.betas()), 0.8);
    ASSERT_TRUE(cfg.scheduler);
    // linear warmup over 4 iterations to 1.0, then linear decay to 0 at iteration 8.
    const std::vector<double> want = {0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0};
    for (size_t t = 0; t < want.size(); ++t) {
      EXPECT_NEAR(opts.get_lr(), want[t], 1e-12) << "iteration " << t;
      cfg.scheduler->step();
    }
  });
}
