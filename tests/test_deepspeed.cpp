// DeepSpeed ZeRO stages 1/2/3 (fsdp/deepspeed.h): parity with a single process (per-step
// losses within 1e-5 relative, parameters after 10 steps) at worlds 2, 3, 4 on Gloo and MPI,
// with gradient accumulation, clipping and bf16-mixed; per-rank model-state bytes against
// ZeRO's formulas; names, option and config errors.
#include "fsdp/deepspeed.h"
#include "fsdp/memory.h"
#include "fully_shard_common.h"
#include "fsdp/activation_checkpointing.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
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
  return fsdp::testing::connect_to_world(std::make_shared<fsdp::DeepSpeedStrategy>(o));
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
TEST(DeepSpeed, ParityMpiWorld4) { parity_all_stages(4, "mpi"); }

// Accumulation with clipping at the worlds and backends the two tests above leave out.
TEST(DeepSpeed, AccumulationAndClippingGlooWorlds2And4MpiWorlds3And4) {
  const std::vector<std::pair<int, std::string>> runs = {{2, "gloo"}, {4, "gloo"}, {3, "mpi"},
                                                         {4, "mpi"}};
  for (const auto& [world, backend] : runs) {
    fsdp::testing::run_ranks(world, backend, [](fsdp::ProcessGroup&) {
      for (int stage : {1, 2, 3}) {
        LoopConfig cfg;
        cfg.global_batch = 24;
        cfg.accumulate = 2;
        cfg.clip = 0.05;
        cfg.steps = 4;
        check_parity(zero_options(stage), cfg);
      }
    });
  }
}

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

// Stage 3 with nothing persistent (threshold 0): every module with parameters is a unit, the
// model itself included (it owns its final norms), and the model is sharded while
// configure_model builds it. The demo models' loss() runs the trunk and the head without the
// model's forward; it must still gather the model's own parameters (it runs between the model's
// forward hooks), or the norms would read freed storage.
TEST(DeepSpeed, Stage3NothingPersistentTrainsThroughTheModelsLossGloo2And3) {
  for (int world : {2, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
      for (const std::string model : {"transformer-tiny", "gpt2-tiny"}) {
        SCOPED_TRACE(model);
        LoopConfig cfg;
        cfg.steps = 4;
        TinyLM ref;
        ref.model_name = model;
        ref.vocab_loss = true;
        auto want = fsdp::testing::train_reference(ref, cfg);
        TinyLM lm;
        lm.model_name = model;
        lm.vocab_loss = true;
        fsdp::DeepSpeedOptions o = zero_options(3);
        o.stage3_param_persistence_threshold = 0;
        auto s = connected(o);
        auto got = fsdp::testing::train_with(*s, lm, cfg);
        EXPECT_EQ(s->persistent_numel(), 0);
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(s->gather_full_params(), ref, 1e-5);
      }
    });
  }
}

// Stage 3 with the default persistence threshold keeps small parameters whole on every rank:
// the Transformer's decoder bias (kVocab elements) stays replicated while its weight is a unit
// computing on its shards (fsdp/sharded_compute.h). The bias must still take part, with this
// rank's own gradient for the strategy to reduce: through the loss and through all logits.
TEST(DeepSpeed, Stage3VocabularyOnShardsWithAPersistentBiasGloo2And3) {
  for (int world : {2, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
      for (bool vocab_loss : {true, false}) {
        SCOPED_TRACE(vocab_loss ? "loss" : "all logits");
        LoopConfig cfg;
        cfg.steps = 4;
        TinyLM ref;
        ref.vocab_loss = vocab_loss;
        auto want = fsdp::testing::train_reference(ref, cfg);
        TinyLM lm;
        lm.vocab_loss = vocab_loss;
        auto s = connected(zero_options(3));
        auto got = fsdp::testing::train_with(*s, lm, cfg);
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(s->gather_full_params(), ref, 1e-5);
        auto* model = dynamic_cast<fsdp::demos::Transformer*>(lm.model.get());
        ASSERT_TRUE(model);
        const fsdp::ShardContext* shards = model->decoder->shard_context();
        ASSERT_TRUE(shards) << "the decoder does not compute on its shards";
        EXPECT_TRUE(shards->has("weight"));
        EXPECT_FALSE(shards->has("bias")) << "the bias was expected to be persistent (whole)";
      }
    });
  }
}

// bf16-mixed as the Trainer runs it for these strategies (CPU autocast, fp32 parameters and
// state), against DDP at the same world (same per-rank batches, so the same bf16 roundings) and
// against the single process within the stated bf16 tolerance (the single process multiplies 12
// rows where a rank multiplies 4 or 6: its bf16 gradient products round differently).
// How close to DDP depends on the world. Two ranks sum each gradient element in one order
// whatever the buffer layout, so ZeRO and DDP stay within 1e-5 for all six steps. Three or more
// ranks sum in an order set by where the element falls in the ring's chunks, and DDP's buckets
// and ZeRO's partitions lay the gradients out differently: the fp32 gradients may differ in the
// last bit (fp32 training: 6e-8 at world 3 after four steps), and under autocast a weight one
// bit apart can round to another bf16 value, after which the runs drift apart as two bf16 runs
// do (2e-4 by the fourth step). There, one step must match DDP to 1e-6 (a wrong average, sum or
// shard would be off by far more), and six steps must track DDP within the bf16 tolerance.
TEST(DeepSpeed, Bf16MixedMatchesDdpAndTracksSingleGloo2And3Mpi4) {
  const std::vector<std::pair<int, std::string>> runs = {{2, "gloo"}, {3, "gloo"}, {4, "mpi"}};
  for (const auto& [world, backend] : runs) {
    fsdp::testing::run_ranks(world, backend, [world = world](fsdp::ProcessGroup&) {
      auto ddp_run = [](const LoopConfig& cfg, TinyLM& lm) {
        auto ddp = fsdp::make_strategy("ddp");
        ddp->connect(fsdp::world_group(), {});
        return fsdp::testing::train_with(*ddp, lm, cfg);
      };
      LoopConfig cfg;
      cfg.bf16_autocast = true;
      cfg.steps = 6;
      TinyLM ddp_lm;
      auto want = ddp_run(cfg, ddp_lm);
      LoopConfig one = cfg;
      one.steps = 1;
      TinyLM ddp_one_lm;
      auto want_one = world > 2 ? ddp_run(one, ddp_one_lm) : std::vector<double>{};
      TinyLM single;
      auto single_losses = fsdp::testing::train_reference(single, cfg);
      for (int stage : {1, 2, 3}) {
        SCOPED_TRACE("bf16-mixed stage " + std::to_string(stage) + ", world " +
                     std::to_string(world));
        TinyLM lm;
        auto s = connected(zero_options(stage));
        auto got = fsdp::testing::train_with(*s, lm, cfg);
        if (world == 2) {
          fsdp::testing::expect_losses_close(got, want, 1e-5);
          fsdp::testing::expect_params_close(s->gather_full_params(), ddp_lm, 1e-5);
        } else {
          fsdp::testing::expect_losses_close(got, want, 2e-3);
          TinyLM one_lm;
          auto s_one = connected(zero_options(stage));
          auto got_one = fsdp::testing::train_with(*s_one, one_lm, one);
          fsdp::testing::expect_losses_close(got_one, want_one, 1e-6);
          fsdp::testing::expect_params_close(s_one->gather_full_params(), ddp_one_lm, 1e-6);
        }
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

// Stages 1 and 2 keep every parameter whole: with a budget that holds stage 3's state but not
// theirs, setup refuses them with the sizes and the way out, before any state is allocated (a
// transformer-1b at world 2 was killed by the kernel's OOM killer instead, before this check).
TEST(DeepSpeedMemory, StagesThatCannotFitTheBudgetAreRefusedAtSetupWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& world) {
    fsdp::install_tracking_allocator();
    const int64_t psi = 16 * (64 * 64 + 64);
    for (int stage : {1, 2, 3}) {
      WideNet net;
      fsdp::DeepSpeedOptions o;
      o.stage = stage;
      o.reduce_bucket_size = 64 * 64 + 64;
      auto s = connected(o);
      fsdp::configure_model_with(*s, net);
      // The parameters exist (4 psi B). Model state per rank: stage 1 4 + 4 + 8/2 = 12 psi B,
      // stage 2 4 + 12/2 = 10 psi B + one bucket (0.25 psi), stage 3 16/2 = 8 psi B + two
      // unsharded one-layer units (0.5 psi). A budget of ~9.6 psi B sits between 3 and 2.
      const int64_t allocated = fsdp::memory_stats().current_bytes;
      fsdp::set_memory_budget(allocated + 56 * psi / 10);
      std::string message;
      try {
        s->setup_module(net);
      } catch (const fsdp::OutOfMemoryError& e) {
        message = e.what_without_backtrace();
      }
      fsdp::set_memory_budget(0);
      if (stage == 3) {
        EXPECT_EQ(message, "") << "stage 3 partitions the parameters too and fits";
        continue;
      }
      EXPECT_NE(message.find("ZeRO stage " + std::to_string(stage) + " needs"), std::string::npos)
          << message;
      EXPECT_NE(message.find("whole params 260.00 KiB"), std::string::npos) << message;
      EXPECT_NE(message.find("(rank " + std::to_string(world.rank()) + " of 2)"),
                std::string::npos) << message;
      EXPECT_NE(message.find("'deepspeed_stage_3'"), std::string::npos) << message;
    }
  });
}

// --- ZeRO-3: stage3_prefetch_bucket_size and stage3_max_live_parameters ----------------------

namespace {

// A linear layer that can be a unit (fsdp::Linear is built with the QLoRA sources only).
struct Lin : fsdp::nn::Module {
  at::Tensor weight, bias;
  Lin(int64_t in, int64_t out) {
    auto l = torch::nn::Linear(in, out);  // torch.nn.Linear's initialization
    weight = register_parameter("weight", l->weight.detach().clone());
    bias = register_parameter("bias", l->bias.detach().clone());
  }
  at::Tensor forward(const fsdp::nn::Inputs& in) override { return at::linear(in[0], weight, bias); }
};

// Small 32x32 layers (1056 elements each, every one a unit of its own under stage 3) and an
// optional big block (two 96x32 matrices, 6144 elements) at the end. On the steps listed in
// `skip_on`, the layers between the first and the big block are skipped: the unit order then
// differs from the one the engine recorded in step 1.
struct Big : fsdp::nn::Module {
  at::Tensor w1, w2;
  Big() {
    w1 = register_parameter("w1", at::randn({96, 32}) * 0.1);
    w2 = register_parameter("w2", at::randn({32, 96}) * 0.1);
  }
  at::Tensor forward(const fsdp::nn::Inputs& in) override {
    return at::matmul(at::tanh(at::matmul(in[0], w1.t())), w2.t());
  }
};

struct ChainNet : fsdp::LightningModule {
  int small = 6;
  bool big = false;
  std::set<int64_t> skip_on;
  std::vector<std::shared_ptr<Lin>> layers;
  std::shared_ptr<Big> block;
  void configure_model() override {
    if (!layers.empty()) return;
    torch::manual_seed(11);
    for (int i = 0; i < small; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), std::make_shared<Lin>(32, 32)));
    }
    if (big) block = register_module("big", std::make_shared<Big>());
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t step) override {
    at::Tensor h = batch.input;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (i > 0 && skip_on.count(step)) continue;
      h = at::tanh((*layers[i])(h));
    }
    if (block) h = (*block)(h);
    return (h - batch.target).pow(2).mean();
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    // eps 1e-3 as TinyLM's: Adam with eps 1e-8 turns rounding noise in near-zero gradients
    // into lr-sized steps, so two correct runs drift apart (measured 2.4e-5 on big.w2).
    return {std::make_shared<torch::optim::Adam>(parameters(),
                                                 torch::optim::AdamOptions(1e-2).eps(1e-3))};
  }
};

constexpr int64_t kSmall = 32 * 32 + 32;  // elements of one small layer
constexpr int64_t kBig = 2 * 96 * 32;

struct ChainRun {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;
  int64_t peak_live = 0, prefetches = 0, limited = 0, evicted = 0;
};

// Trains `net` for 5 steps (global batch 12 rows of 32, targets of the same shape) with stage 3
// and the given knobs, or as the single-process reference when `strategy_off`.
ChainRun train_chain(ChainNet& net, int64_t bucket, int64_t max_live, bool reference) {
  const int steps = 5;
  ChainRun r;
  auto batch = [](int step, int64_t rows) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    return fsdp::Batch{at::randn({rows, 32}, gen), at::randn({rows, 32}, gen)};
  };
  if (reference) {
    net.configure_model();
    auto opt = net.configure_optimizers().optimizer;
    for (int step = 0; step < steps; ++step) {
      at::Tensor loss = net.training_step(batch(step, 12), step);
      loss.backward();
      r.losses.push_back(loss.item<double>());
      opt->step();
      opt->zero_grad();
    }
    return r;
  }
  fsdp::DeepSpeedOptions o;
  o.stage = 3;
  o.stage3_param_persistence_threshold = 0;  // every layer is sharded
  o.stage3_prefetch_bucket_size = bucket;
  o.stage3_max_live_parameters = max_live;
  auto s = connected(o);
  fsdp::configure_model_with(*s, net);
  s->setup_module(net);
  auto opt = net.configure_optimizers().optimizer;
  s->setup_optimizer(*opt);
  const int world = s->world_size(), rank = s->rank();
  for (int step = 0; step < steps; ++step) {
    fsdp::Batch g = batch(step, 12);
    const int64_t rows = 12 / world;
    fsdp::Batch mine{g.input.narrow(0, rank * rows, rows), g.target.narrow(0, rank * rows, rows)};
    s->pre_forward(net, true);
    at::Tensor loss = net.training_step(mine, step);
    s->backward(loss);
    s->post_backward(net, true);
    r.losses.push_back(s->reduce(loss.detach(), fsdp::ReduceOp::kAvg).item<double>());
    s->optimizer_step(*opt);
    s->zero_grad(*opt);
  }
  r.params = s->gather_full_params();
  auto& state = fsdp::detail::state_of(*s->stage3_engine());
  r.peak_live = state.peak_live_numel();
  r.prefetches = state.num_prefetches();
  r.limited = state.num_prefetches_limited();
  r.evicted = state.num_prefetches_evicted();
  return r;
}

void check_chain(int64_t bucket, int64_t max_live, const std::function<void(ChainNet&)>& setup,
                 const std::function<void(const ChainRun&)>& check) {
  SCOPED_TRACE("bucket " + std::to_string(bucket) + ", max_live " + std::to_string(max_live));
  ChainNet ref, net;
  setup(ref);
  setup(net);
  ChainRun want = train_chain(ref, 0, 1, /*reference=*/true);
  ChainRun got = train_chain(net, bucket, max_live, /*reference=*/false);
  fsdp::testing::expect_losses_close(got.losses, want.losses, 1e-5);
  fsdp::testing::expect_params_close(got.params, ref, 1e-5);
  check(got);
}

void prefetch_window_and_live_bound(fsdp::ProcessGroup&) {
  auto six_small = [](ChainNet& n) { n.small = 6; };
  // A window of three layers: forward gathers the running layer and three ahead.
  check_chain(3 * kSmall, 1000000000, six_small, [](const ChainRun& r) {
    EXPECT_EQ(r.peak_live, 4 * kSmall);
    EXPECT_GT(r.prefetches, 0);
    EXPECT_EQ(r.limited, 0);
  });
  // The same window under a live bound of two layers: prefetch one ahead at most.
  check_chain(3 * kSmall, 2 * kSmall, six_small, [](const ChainRun& r) {
    EXPECT_EQ(r.peak_live, 2 * kSmall);
    EXPECT_GT(r.prefetches, 0);
    EXPECT_GT(r.limited, 0);
  });
  // A bound of one layer: no prefetch fits.
  check_chain(3 * kSmall, kSmall, six_small, [](const ChainRun& r) {
    EXPECT_EQ(r.peak_live, kSmall);
    EXPECT_EQ(r.prefetches, 0);
  });
  // A bucket smaller than a layer: gathered on demand only (strict bound).
  check_chain(kSmall - 1, 1000000000, six_small, [](const ChainRun& r) {
    EXPECT_EQ(r.peak_live, kSmall);
    EXPECT_EQ(r.prefetches, 0);
  });
  // Bucket 0 turns prefetching off, as in DeepSpeed.
  check_chain(0, 1000000000, six_small, [](const ChainRun& r) {
    EXPECT_EQ(r.prefetches, 0);
    EXPECT_EQ(r.peak_live, kSmall);
  });
  // Steps 1 and 3 skip layers 1-2: the window prefetched them (recorded order), then the big
  // block must be gathered on demand and does not fit beside them: the prefetch furthest away
  // is dropped (gathered again when needed), and the live bound holds.
  auto skipping = [](ChainNet& n) {
    n.small = 3;
    n.big = true;
    n.skip_on = {1, 3};
  };
  check_chain(2 * kSmall, kBig + kSmall, skipping, [](const ChainRun& r) {
    EXPECT_GT(r.evicted, 0);
    EXPECT_LE(r.peak_live, kBig + kSmall);
  });
}

}  // namespace

TEST(DeepSpeedStage3, PrefetchBucketAndMaxLiveParametersGlooWorld2) {
  fsdp::testing::run_ranks(2, "gloo", prefetch_window_and_live_bound);
}
TEST(DeepSpeedStage3, PrefetchBucketAndMaxLiveParametersMpiWorld3) {
  fsdp::testing::run_ranks(3, "mpi", prefetch_window_and_live_bound);
}

// The tracking allocator sees the same bound: the whole step's peak is lower with a live bound
// of one layer than with a window of four layers, by about the three layers not gathered.
TEST(DeepSpeedStage3, LiveBoundLowersTrackedPeakBytesWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    fsdp::install_tracking_allocator();
    auto peak_of = [](int64_t bucket, int64_t max_live) {
      ChainNet net;
      net.small = 12;
      const int64_t base = settled_bytes();
      fsdp::reset_peak_memory_stats();
      train_chain(net, bucket, max_live, false);
      return fsdp::memory_stats().peak_bytes - base;
    };
    const int64_t wide = peak_of(4 * kSmall, 1000000000);
    const int64_t bounded = peak_of(4 * kSmall, kSmall);
    EXPECT_LT(bounded + 2 * 4 * kSmall, wide) << "bounded " << bounded << " B, wide " << wide << " B";
  });
}

// --- activation partitioning (partition_activations, cpu_checkpointing) -----------------------

namespace {

// tanh(Linear(x)) blocks, each checkpointed: block k's input is block k-1's output, which only
// the checkpoint function keeps.
struct Block : fsdp::nn::Module {
  std::shared_ptr<Lin> lin;
  Block() { lin = register_module("lin", std::make_shared<Lin>(64, 64)); }
  at::Tensor forward(const fsdp::nn::Inputs& in) override { return at::tanh((*lin)(in[0])); }
};

struct BlockNet : torch::nn::Module {
  std::vector<std::shared_ptr<Block>> blocks;
  BlockNet() {
    torch::manual_seed(3);
    for (int i = 0; i < 6; ++i) {
      blocks.push_back(register_module("b" + std::to_string(i), std::make_shared<Block>()));
    }
    fsdp::apply_activation_checkpointing(
        *this, [](const fsdp::nn::Module& m) { return dynamic_cast<const Block*>(&m) != nullptr; });
  }
};

struct PartitionRun {
  int64_t after_forward = 0;  // tracked bytes held after forward, above the start
  std::vector<at::Tensor> grads;
  at::Tensor input_grad;
};

// Every rank runs the same model on the same input (the ranks of a model-parallel group hold
// identical activations): with the group configured, the saved inputs are split over it.
PartitionRun run_blocks(const std::shared_ptr<fsdp::ProcessGroup>& group) {
  if (group) {
    fsdp::configure_activation_partitioning(fsdp::ActivationPartitioning{group, true});
  } else {
    fsdp::configure_activation_partitioning(std::nullopt);
  }
  BlockNet net;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor x = at::randn({128, 64}, gen).requires_grad_(true);
  PartitionRun r;
  const int64_t base = settled_bytes();
  at::Tensor loss;
  {
    at::Tensor h = x;
    for (auto& b : net.blocks) h = (*b)(h);
    loss = h.pow(2).mean();
  }
  r.after_forward = fsdp::memory_stats().current_bytes - base;
  loss.backward();
  for (auto& p : net.parameters()) r.grads.push_back(p.grad().clone());
  r.input_grad = x.grad().clone();
  fsdp::configure_activation_partitioning(std::nullopt);
  return r;
}

void partitioned_inputs_are_split_and_regathered(fsdp::ProcessGroup& world) {
  fsdp::install_tracking_allocator();
  PartitionRun whole = run_blocks(nullptr);
  PartitionRun split = run_blocks(fsdp::world_group());
  // Same gradients, bitwise: the gathered inputs are the inputs.
  ASSERT_EQ(whole.grads.size(), split.grads.size());
  for (size_t i = 0; i < whole.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(whole.grads[i], split.grads[i])) << "parameter " << i;
  }
  EXPECT_TRUE(at::equal(whole.input_grad, split.input_grad));
  // Memory after forward: blocks 1..5 keep a slice of their input instead of the input (the
  // caller still holds block 0's input x, so its slice is extra).
  const int64_t W = world.size();
  const int64_t numel = 128 * 64;
  const int64_t slice = (numel + W - 1) / W * 4;
  const int64_t saved = 5 * (numel * 4 - slice) - slice;
  EXPECT_NEAR(static_cast<double>(whole.after_forward - split.after_forward),
              static_cast<double>(saved), 0.05 * saved)
      << "whole " << whole.after_forward << " B, split " << split.after_forward << " B";
}

}  // namespace

TEST(ActivationPartitioning, InputsSplitOverTheGroupAndRegatheredGlooWorld2) {
  fsdp::testing::run_ranks(2, "gloo", partitioned_inputs_are_split_and_regathered);
}
TEST(ActivationPartitioning, InputsSplitOverTheGroupAndRegatheredMpiWorld3) {
  fsdp::testing::run_ranks(3, "mpi", partitioned_inputs_are_split_and_regathered);
}

// The DeepSpeed options: accepted, each says at setup what it does here, and training with
// checkpointed layers matches the single process for every stage.
TEST(DeepSpeed, PartitionActivationsAndCpuCheckpointingSayWhatTheyDoWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& world) {
    for (int stage : {1, 2, 3}) {
      auto o = zero_options(stage);
      o.partition_activations = true;
      o.cpu_checkpointing = true;
      LoopConfig cfg;
      cfg.steps = 4;
      auto checkpointed = [](TinyLM& m) {
        m.after_build = [](TinyLM& lm) {
          EXPECT_GT(fsdp::apply_activation_checkpointing(
                        *lm.model, fsdp::demos::layer_types("transformer-tiny")),
                    0);
        };
      };
      ::testing::internal::CaptureStderr();
      check_parity(o, cfg, checkpointed);
      const std::string err = ::testing::internal::GetCapturedStderr();
      if (world.rank() == 0) {
        EXPECT_NE(err.find("no model-parallel group"), std::string::npos) << err;
        EXPECT_NE(err.find("already live in host memory"), std::string::npos) << err;
        EXPECT_EQ(err.find("nothing to partition"), std::string::npos) << err;
      }
    }
  });
}

// --- names, options, config ---------------------------------------------------------------------

namespace {

using fsdp::testing::error_of;

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
  // The disk tier for parameters and optimizer state (tests/test_disk_offload.cpp trains it).
  auto nvme = std::dynamic_pointer_cast<fsdp::DeepSpeedStrategy>(
      fsdp::make_strategy("deepspeed_stage_3_offload_nvme"));
  ASSERT_NE(nvme, nullptr);
  EXPECT_EQ(nvme->options().stage, 3);
  EXPECT_TRUE(nvme->options().offload_parameters && nvme->options().offload_optimizer);
  EXPECT_EQ(nvme->options().offload_params_device, "nvme");
  EXPECT_EQ(nvme->options().offload_optimizer_device, "nvme");
  fsdp::DeepSpeedOptions o;
  o.stage = 0;
  EXPECT_NE(error_of([&] { fsdp::DeepSpeedStrategy s(o); }).find("'ddp'"), std::string::npos);
  o.stage = 2;
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
        R"({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9}})");
  });
  EXPECT_NE(e.find("'zero_optimization.stage3_max_reuse_distance'"), std::string::npos) << e;
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
