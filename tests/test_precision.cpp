// Precision: bf16-mixed FULL_SHARD against fp32 (loss over 50 steps, all-gathered bytes, fp32
// master shards and optimizer state) at worlds 2 and 3; the Trainer's precision values
// (bf16-mixed under FSDP and under the single strategy, bf16-true, 64-true, explicit policy
// wins, the fp16 error) in one process; the one precision parser.
#include "fully_shard_common.h"
#include "fsdp/precision.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

using fsdp::testing::TinyLM;

namespace {

// Stated tolerance: per-step global-mean loss of bf16-mixed within 0.05 (absolute; the loss
// starts near ln 64 = 4.16) of the fp32 run over 50 steps. bf16 keeps 8 mantissa bits
// (relative rounding 2^-9 = 0.002 per operation); the measured maximum is printed.
constexpr double kBf16LossTolerance = 0.05;
constexpr int kSteps = 50;

fsdp::FSDPOptions full_shard(std::optional<fsdp::MixedPrecisionPolicy> mp) {
  fsdp::FSDPOptions o;
  o.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
  o.auto_wrap_policy =
      fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  o.mixed_precision = std::move(mp);
  return o;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<int64_t> all_gather_bytes;      // per step, world group counters
  std::vector<int64_t> reduce_scatter_bytes;  // per step
};

// Sets up `lm` under `strategy` and trains `steps` steps on this rank's share of the global
// batches (fully_shard_common.h), counting the bytes the world group moved in each step.
// `inspect` runs after backward, before the optimizer step (sharded grads present).
RunResult train(fsdp::FSDPStrategy& strategy, TinyLM& lm, int steps,
          const std::function<void(torch::optim::Optimizer&)>& inspect = {}) {
  auto world = fsdp::world_group();
  fsdp::LaunchInfo launch;
  launch.rank = world->rank();
  launch.world_size = world->size();
  launch.local_world_size = world->size();
  strategy.connect(world, launch);
  fsdp::configure_model_with(strategy, lm);
  strategy.setup_module(lm);
  auto opt = lm.configure_optimizers().optimizer;
  strategy.setup_optimizer(*opt);
  const int64_t rows = 12 / world->size();
  RunResult run;
  for (int step = 0; step < steps; ++step) {
    fsdp::Batch g = fsdp::testing::global_batch(step, 12);
    fsdp::Batch mb = fsdp::testing::slice(g, world->rank() * rows, rows);
    world->reset_counters();
    strategy.pre_forward(lm, true);
    at::Tensor loss = lm.training_step(mb, step);
    strategy.backward(loss);
    strategy.post_backward(lm, true);
    run.all_gather_bytes.push_back(world->counters().all_gather_bytes);
    run.reduce_scatter_bytes.push_back(world->counters().reduce_scatter_bytes);
    if (inspect) inspect(*opt);
    run.losses.push_back(strategy.reduce(loss.detach(), fsdp::ReduceOp::kAvg).item<double>());
    strategy.optimizer_step(*opt);
    strategy.zero_grad(*opt);
  }
  return run;
}

void bf16_mixed_tracks_fp32(int world_size) {
  fsdp::testing::run_ranks(world_size, "gloo", [](fsdp::ProcessGroup&) {
    TinyLM ref_lm;
    fsdp::FSDPStrategy fp32(full_shard(std::nullopt));
    RunResult ref = train(fp32, ref_lm, kSteps);

    TinyLM lm;
    fsdp::FSDPStrategy bf16(full_shard(fsdp::bf16_mixed_policy()));
    bool inspected = false;
    RunResult got = train(bf16, lm, kSteps, [&](torch::optim::Optimizer&) {
      if (inspected) return;
      inspected = true;
      // Unsharded parameters (what computes) are bf16 and hold no memory now; the sharded
      // parameters and their gradients are fp32.
      for (auto* p : fsdp::detail::state_of(bf16).all_params()) {
        EXPECT_EQ(p->unsharded().scalar_type(), at::kBFloat16) << p->fqn();
        EXPECT_EQ(p->sharded().scalar_type(), at::kFloat) << p->fqn();
        if (p->requires_grad()) {
          ASSERT_TRUE(p->sharded().grad().defined()) << p->fqn();
          EXPECT_EQ(p->sharded().grad().scalar_type(), at::kFloat) << p->fqn();
        }
      }
    });

    double max_diff = 0;
    for (int s = 0; s < kSteps; ++s) {
      max_diff = std::max(max_diff, std::abs(got.losses[s] - ref.losses[s]));
      EXPECT_NEAR(got.losses[s], ref.losses[s], kBf16LossTolerance) << "step " << s;
    }
    EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.1) << "the fp32 run must learn";
    EXPECT_LT(got.losses.back(), got.losses.front() - 0.1) << "the bf16 run must learn";
    EXPECT_GT(max_diff, 0.0) << "bf16 rounding must show: did the policy apply?";
    if (fsdp::world_group()->rank() == 0) {
      std::printf("[precision] world %d, %d steps: fp32 loss %.4f -> %.4f, bf16-mixed %.4f -> "
                  "%.4f, max |diff| %.5f (tolerance %.2f)\n",
                  fsdp::world_group()->size(), kSteps, ref.losses.front(), ref.losses.back(),
                  got.losses.front(), got.losses.back(), max_diff, kBf16LossTolerance);
      std::printf("[precision] all-gathered bytes per step (this rank): fp32 %lld, bf16 %lld; "
                  "reduce-scatter %lld -> %lld\n",
                  static_cast<long long>(ref.all_gather_bytes[1]),
                  static_cast<long long>(got.all_gather_bytes[1]),
                  static_cast<long long>(ref.reduce_scatter_bytes[1]),
                  static_cast<long long>(got.reduce_scatter_bytes[1]));
    }

    // Bytes on the wire: exactly half in every step (CommCounters of the world group).
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_GT(ref.all_gather_bytes[s], 0);
      EXPECT_EQ(2 * got.all_gather_bytes[s], ref.all_gather_bytes[s]) << "step " << s;
      EXPECT_EQ(2 * got.reduce_scatter_bytes[s], ref.reduce_scatter_bytes[s]) << "step " << s;
    }

  });
}

TEST(Precision, Bf16MixedFullShardTracksFp32World2) { bf16_mixed_tracks_fp32(2); }
TEST(Precision, Bf16MixedFullShardTracksFp32World3) { bf16_mixed_tracks_fp32(3); }

// The other sharding strategies under a policy: SHARD_GRAD_OP (params kept unsharded through
// backward), NO_SHARD (shard group of one rank: S is the whole fp32 parameter, P its bf16 copy,
// gradients all-reduced in bf16 over the replicate group), and an fp32 reduce_dtype.
TEST(Precision, Bf16MixedOtherStrategiesTrackFp32World2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    constexpr int kShortSteps = 10;
    TinyLM ref_lm;
    fsdp::FSDPStrategy fp32(full_shard(std::nullopt));
    const RunResult ref = train(fp32, ref_lm, kShortSteps);
    struct Case {
      const char* name;
      fsdp::ShardingStrategy ss;
      std::optional<at::ScalarType> reduce;
    };
    for (const Case& c : {Case{"SHARD_GRAD_OP", fsdp::ShardingStrategy::kShardGradOp, {}},
                          Case{"NO_SHARD", fsdp::ShardingStrategy::kNoShard, {}},
                          Case{"FULL_SHARD fp32 reduce", fsdp::ShardingStrategy::kFullShard,
                               at::kFloat}}) {
      SCOPED_TRACE(c.name);
      fsdp::MixedPrecisionPolicy mp = fsdp::bf16_mixed_policy();
      mp.reduce_dtype = c.reduce;
      fsdp::FSDPOptions o = full_shard(mp);
      o.sharding_strategy = c.ss;
      TinyLM lm;
      fsdp::FSDPStrategy strategy(o);
      const RunResult got = train(strategy, lm, kShortSteps);
      for (int s = 0; s < kShortSteps; ++s) {
        EXPECT_NEAR(got.losses[s], ref.losses[s], kBf16LossTolerance) << "step " << s;
      }
      EXPECT_NE(got.losses.back(), ref.losses.back()) << "bf16 must round differently";
      for (auto* p : fsdp::detail::state_of(strategy).all_params()) {
        EXPECT_EQ(p->unsharded().scalar_type(), at::kBFloat16) << p->fqn();
        EXPECT_EQ(p->sharded().scalar_type(), at::kFloat) << p->fqn();
      }
    }
  });
}

// Adam's exp_avg / exp_avg_sq after a bf16-mixed step are fp32 and shaped like the shards.
TEST(Precision, Bf16MixedOptimizerStateIsFp32World2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    TinyLM lm;
    fsdp::MixedPrecisionPolicy mp = fsdp::bf16_mixed_policy();
    mp.reduce_dtype = at::kFloat;  // fp32 reduce-scatter: bytes equal fp32's
    fsdp::FSDPStrategy strategy(full_shard(mp));
    train(strategy, lm, 2);
    // The optimizer built in train() is gone; build one more over the sharded parameters and
    // step it once after a bf16-mixed backward to read its state.
    auto opt = lm.configure_optimizers().optimizer;
    strategy.pre_forward(lm, true);
    at::Tensor loss = lm.training_step(fsdp::testing::global_batch(9, 2), 0);
    strategy.backward(loss);
    strategy.post_backward(lm, true);
    strategy.optimizer_step(*opt);
    int64_t checked = 0;
    for (auto& group : opt->param_groups()) {
      for (auto& p : group.params()) {
        EXPECT_EQ(p.scalar_type(), at::kFloat);
        auto it = opt->state().find(p.unsafeGetTensorImpl());
        if (it == opt->state().end()) continue;
        auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
        EXPECT_EQ(st.exp_avg().scalar_type(), at::kFloat);
        EXPECT_EQ(st.exp_avg_sq().scalar_type(), at::kFloat);
        EXPECT_EQ(st.exp_avg().sizes(), p.sizes());
        ++checked;
      }
    }
    EXPECT_GT(checked, 0);
  });
}

// --- Trainer precision values (one process) ----------------------------------------------

fsdp::DataLoader corpus_loader() {
  auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(fsdp::testing::kVocab, 6000,
                                                             /*seed=*/1, fsdp::testing::kSeq);
  return fsdp::DataLoader(data, 4, fsdp::DistributedSampler(data->size(), 1, 0, true, 3), true);
}

fsdp::TrainerOptions quiet(const std::string& precision, int64_t steps) {
  fsdp::TrainerOptions o;
  o.precision = precision;
  o.max_steps = steps;
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.logger = false;
  o.seed = 5;
  o.default_root_dir =
      (std::filesystem::temp_directory_path() / ("fsdp_test_precision_" + precision)).string();
  return o;
}

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / static_cast<double>(end - begin);
}

TEST(Precision, Bf16TrueTrainsWithBf16Parameters) {
  for (const char* strategy : {"single", "fsdp"}) {
    SCOPED_TRACE(strategy);
    auto loader = corpus_loader();
    TinyLM lm;
    lm.lr = 3e-3;
    auto o = quiet("bf16-true", 40);
    o.strategy = strategy;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    for (auto& p : lm.parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
    const auto& losses = trainer.results().losses;
    ASSERT_EQ(losses.size(), 40u);
    EXPECT_LT(mean(losses, 30, 40), mean(losses, 0, 10) - 0.2) << "bf16-true must learn";
  }
}

TEST(Precision, SixtyFourTrueTrainsInDouble) {
  auto loader = corpus_loader();
  TinyLM lm;
  fsdp::Trainer trainer(quiet("64-true", 3));
  trainer.fit(lm, loader);
  for (auto& p : lm.parameters()) EXPECT_EQ(p.scalar_type(), at::kDouble);
  for (double l : trainer.results().losses) EXPECT_TRUE(std::isfinite(l));
}

// bf16-mixed: under FSDP (world 1: the cast path without aliasing) and under the single
// strategy (CPU autocast), parameters stay fp32 and losses track fp32 closely but not exactly.
TEST(Precision, Bf16MixedTrainerTracksFp32UnderFsdpAndSingle) {
  auto fp32_losses = [&](const std::string& strategy) {
    auto loader = corpus_loader();
    TinyLM lm;
    auto o = quiet("32-true", 10);
    o.strategy = strategy;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    return trainer.results().losses;
  };
  for (const char* strategy : {"single", "fsdp"}) {
    SCOPED_TRACE(strategy);
    const auto want = fp32_losses(strategy);
    auto loader = corpus_loader();
    TinyLM lm;
    lm.after_build = [](TinyLM& m) { m.register_buffer("running_scale", at::ones({4})); };
    auto o = quiet("bf16-mixed", 10);
    o.strategy = strategy;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    for (auto& p : lm.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    // FSDP's policy casts buffers (buffer_dtype bf16); autocast leaves them alone.
    const bool is_fsdp = std::string(strategy) == "fsdp";
    EXPECT_EQ(lm.named_buffers()["running_scale"].scalar_type(),
              is_fsdp ? at::kBFloat16 : at::kFloat);
    const auto& got = trainer.results().losses;
    ASSERT_EQ(got.size(), want.size());
    double max_diff = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], kBf16LossTolerance) << "step " << i;
      max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
    }
    EXPECT_GT(max_diff, 0.0) << "bf16 compute must round differently from fp32";
    if (std::string(strategy) == "fsdp") {
      auto* fsdp = dynamic_cast<fsdp::FSDPStrategy*>(trainer.strategy().get());
      ASSERT_NE(fsdp, nullptr);
      ASSERT_TRUE(fsdp->options().mixed_precision.has_value());
      EXPECT_EQ(fsdp->options().mixed_precision->param_dtype, at::kBFloat16);
      for (auto* p : fsdp::detail::state_of(*fsdp).all_params()) {
        EXPECT_EQ(p->unsharded().scalar_type(), at::kBFloat16) << p->fqn();
      }
    }
  }
}

TEST(Precision, ExplicitPolicyWinsOverTrainerBf16Mixed) {
  fsdp::FSDPOptions options = full_shard(fsdp::MixedPrecisionPolicy{});
  options.mixed_precision->param_dtype = at::kBFloat16;
  options.mixed_precision->reduce_dtype = at::kFloat;
  auto strategy = std::make_shared<fsdp::FSDPStrategy>(options);
  auto loader = corpus_loader();
  TinyLM lm;
  auto o = quiet("bf16-mixed", 2);
  o.strategy = strategy;
  fsdp::Trainer trainer(o);
  trainer.fit(lm, loader);
  ASSERT_TRUE(strategy->options().mixed_precision.has_value());
  EXPECT_EQ(strategy->options().mixed_precision->reduce_dtype, at::kFloat);
  EXPECT_FALSE(strategy->options().mixed_precision->buffer_dtype.has_value());
  for (auto& unit : fsdp::detail::state_of(*strategy).units()) {
    if (unit->params().empty()) continue;
    EXPECT_EQ(unit->compute_dtype(), at::kBFloat16) << unit->name();
    EXPECT_EQ(unit->reduce_dtype(), at::kFloat) << unit->name();
  }
}

TEST(Precision, Fp16PrecisionsFailWithOneSentenceNamingBf16Mixed) {
  for (const char* p : {"16-mixed", "16-true"}) {
    try {
      fsdp::TrainerOptions o;
      o.precision = p;
      fsdp::Trainer t(o);
      FAIL() << p;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("'" + std::string(p) + "' needs fp16 matmul, which CPU libtorch 1.13 "
                         "does not implement"), std::string::npos) << msg;
      EXPECT_NE(msg.find("use precision 'bf16-mixed'"), std::string::npos) << msg;
    }
  }
}

TEST(Precision, OneParserForPrecisionNames) {
  EXPECT_EQ(fsdp::parse_precision("32"), fsdp::Precision::k32True);
  EXPECT_EQ(fsdp::parse_precision("32-true"), fsdp::Precision::k32True);
  EXPECT_EQ(fsdp::parse_precision("bf16-mixed"), fsdp::Precision::kBf16Mixed);
  EXPECT_EQ(fsdp::parse_precision("bf16-true"), fsdp::Precision::kBf16True);
  EXPECT_EQ(fsdp::parse_precision("64"), fsdp::Precision::k64True);
  for (const auto& name : fsdp::precision_names()) {
    EXPECT_NO_THROW(fsdp::parse_precision(name)) << name;
  }
  try {
    fsdp::parse_precision("bf32-mixed");
    FAIL();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("unknown precision 'bf32-mixed'"), std::string::npos) << msg;
    for (const auto& name : fsdp::precision_names()) {
      EXPECT_NE(msg.find("'" + name + "'"), std::string::npos) << name;
    }
  }
  EXPECT_EQ(fsdp::Trainer::precision_names(), fsdp::precision_names());
}

}  // namespace
