// Precision: bf16-mixed and 16-mixed FULL_SHARD against fp32 (loss over 50 steps, all-gathered
// bytes, fp32 master shards and optimizer state) at worlds 2 and 3, the grad scaler skipping
// together under FSDP; the Trainer's precision values (bf16-/16-mixed under FSDP and under the
// single strategy, bf16-true, 16-true, 64-true, explicit policy wins, scaler skip and resume,
// the fp16 checks) in one process; the one precision parser.
#include "fully_shard_common.h"
#include "fsdp/precision.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>

#include <unistd.h>

using fsdp::testing::TinyLM;

namespace {

// Expects got[s] within `tolerance` of want[s] at every step; returns the largest difference.
double expect_losses_near(const std::vector<double>& got, const std::vector<double>& want,
                          double tolerance) {
  EXPECT_EQ(got.size(), want.size());
  double max_diff = 0;
  for (size_t s = 0; s < std::min(got.size(), want.size()); ++s) {
    EXPECT_NEAR(got[s], want[s], tolerance) << "step " << s;
    max_diff = std::max(max_diff, std::abs(got[s] - want[s]));
  }
  return max_diff;
}

// Unsharded parameters (what computes) are in `compute` (and hold no memory after backward); the
// sharded parameters and their gradients are fp32.
void expect_master_fp32(fsdp::FSDPStrategy& strategy, at::ScalarType compute) {
  for (auto* p : fsdp::detail::state_of(strategy).all_params()) {
    EXPECT_EQ(p->unsharded().scalar_type(), compute) << p->fqn();
    EXPECT_EQ(p->sharded().scalar_type(), at::kFloat) << p->fqn();
    if (p->requires_grad()) {
      ASSERT_TRUE(p->sharded().grad().defined()) << p->fqn();
      EXPECT_EQ(p->sharded().grad().scalar_type(), at::kFloat) << p->fqn();
    }
  }
}

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

// Connects `strategy` to the world group, builds and shards `lm` under it; returns its optimizer
// (set up by the strategy).
std::shared_ptr<torch::optim::Optimizer> setup(fsdp::FSDPStrategy& strategy, TinyLM& lm) {
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
  return opt;
}

// Sets up `lm` under `strategy` and trains `steps` steps on this rank's share of the global
// batches (fully_shard_common.h), counting the bytes the world group moved in each step.
// `inspect` runs after backward, before the optimizer step (sharded grads present). With a
// `scaler` the loop is the Trainer's 16-mixed one: scaled loss, unscale, step unless inf/nan.
RunResult train(fsdp::FSDPStrategy& strategy, TinyLM& lm, int steps,
          const std::function<void(torch::optim::Optimizer&)>& inspect = {},
          fsdp::ShardedGradScaler* scaler = nullptr) {
  auto world = fsdp::world_group();
  auto opt = setup(strategy, lm);
  const int64_t rows = 12 / world->size();
  RunResult run;
  for (int step = 0; step < steps; ++step) {
    fsdp::Batch g = fsdp::testing::global_batch(step, 12);
    fsdp::Batch mb = fsdp::testing::slice(g, world->rank() * rows, rows);
    world->reset_counters();
    strategy.pre_forward(lm, true);
    at::Tensor loss = lm.training_step(mb, step);
    strategy.backward(scaler ? scaler->scale(loss) : loss);
    strategy.post_backward(lm, true);
    run.all_gather_bytes.push_back(world->counters().all_gather_bytes);
    run.reduce_scatter_bytes.push_back(world->counters().reduce_scatter_bytes);
    if (inspect) inspect(*opt);
    run.losses.push_back(strategy.reduce(loss.detach(), fsdp::ReduceOp::kAvg).item<double>());
    if (scaler) {
      scaler->step(*opt, [&] { strategy.optimizer_step(*opt); });
      scaler->update();
    } else {
      strategy.optimizer_step(*opt);
    }
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
      expect_master_fp32(bf16, at::kBFloat16);
    });

    const double max_diff = expect_losses_near(got.losses, ref.losses, kBf16LossTolerance);
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

// 16-mixed under FSDP: MixedPrecisionPolicy{fp16, fp16, fp16} and the Trainer's loss scaling
// (ShardedGradScaler over the world, default init scale 65536). Stated tolerance: per-step
// global-mean loss within 0.01 of the fp32 run over 50 steps. fp16 keeps 11 mantissa bits
// (relative rounding 2^-12, 8x finer than bf16), so a fifth of bf16's tolerance leaves room
// for a skipped step; the measured maximum and the skipped steps are printed.
constexpr double kFp16LossTolerance = 0.01;

void fp16_mixed_tracks_fp32(int world_size, const std::string& backend) {
  fsdp::testing::run_ranks(world_size, backend, [](fsdp::ProcessGroup&) {
    TinyLM ref_lm;
    fsdp::FSDPStrategy fp32(full_shard(std::nullopt));
    RunResult ref = train(fp32, ref_lm, kSteps);

    TinyLM lm;
    fsdp::FSDPStrategy fp16(full_shard(fsdp::fp16_mixed_policy()));
    fsdp::ShardedGradScaler scaler(fsdp::world_group());
    bool inspected = false;
    RunResult got = train(
        fp16, lm, kSteps,
        [&](torch::optim::Optimizer&) {
          if (inspected) return;
          inspected = true;
          expect_master_fp32(fp16, at::kHalf);
        },
        &scaler);

    const double max_diff = expect_losses_near(got.losses, ref.losses, kFp16LossTolerance);
    EXPECT_LT(got.losses.back(), got.losses.front() - 0.1) << "the fp16 run must learn";
    EXPECT_GT(max_diff, 0.0) << "fp16 rounding must show: did the policy apply?";
    EXPECT_LT(scaler.skipped_steps(), 3) << "the default scale should rarely overflow here";
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(2 * got.all_gather_bytes[s], ref.all_gather_bytes[s]) << "step " << s;
      EXPECT_EQ(2 * got.reduce_scatter_bytes[s], ref.reduce_scatter_bytes[s]) << "step " << s;
    }
    if (fsdp::world_group()->rank() == 0) {
      std::printf("[precision] world %d: fp32 loss %.4f -> %.4f, 16-mixed %.4f -> %.4f, max "
                  "|diff| %.5f (tolerance %.2f), %lld skipped steps, final scale %.0f\n",
                  fsdp::world_group()->size(), ref.losses.front(), ref.losses.back(),
                  got.losses.front(), got.losses.back(), max_diff, kFp16LossTolerance,
                  static_cast<long long>(scaler.skipped_steps()), scaler.get_scale());
    }
  });
}

TEST(Precision, Fp16MixedFullShardTracksFp32World2) { fp16_mixed_tracks_fp32(2, "gloo"); }
TEST(Precision, Fp16MixedFullShardTracksFp32World3) { fp16_mixed_tracks_fp32(3, "gloo"); }
TEST(Precision, Fp16MixedFullShardTracksFp32World2Mpi) { fp16_mixed_tracks_fp32(2, "mpi"); }
TEST(Precision, Fp16MixedFullShardTracksFp32World3Mpi) { fp16_mixed_tracks_fp32(3, "mpi"); }

// The grad scaler under FSDP 16-mixed: (1) an initial scale too large for fp16 overflows the
// backward; every rank skips (parameters bitwise unchanged) and halves the scale, until steps
// run; (2) later, a NaN injected into the last rank's gradient shard only makes every rank
// skip that step together.
void fp16_scaler_skips_together(int world_size, const std::string& backend) {
  fsdp::testing::run_ranks(world_size, backend, [](fsdp::ProcessGroup&) {
    auto world = fsdp::world_group();
    TinyLM lm;
    fsdp::FSDPStrategy strategy(full_shard(fsdp::fp16_mixed_policy()));
    auto opt = setup(strategy, lm);
    fsdp::GradScalerOptions so;
    so.init_scale = 16777216.0;  // 2^24: d(loss)/d(logits) alone is ~2^24/48 > fp16 max 65504
    fsdp::ShardedGradScaler scaler(world, so);
    auto snapshot = [&] {
      std::vector<at::Tensor> v;
      for (auto& p : lm.parameters()) v.push_back(p.detach().clone());
      return v;
    };
    auto unchanged = [&](const std::vector<at::Tensor>& before) {
      auto now = lm.parameters();
      for (size_t i = 0; i < now.size(); ++i) {
        if (!at::equal(now[i].detach(), before[i])) return false;
      }
      return true;
    };
    const int64_t rows = 12 / world->size();
    constexpr int kInjectAt = 14;
    int first_step_taken = -1;
    const auto initial = snapshot();
    for (int step = 0; step < 20; ++step) {
      const auto before = snapshot();
      const double scale_before = scaler.get_scale();
      fsdp::Batch mb = fsdp::testing::slice(fsdp::testing::global_batch(step, 12),
                                            world->rank() * rows, rows);
      strategy.pre_forward(lm, true);
      at::Tensor loss = lm.training_step(mb, step);
      strategy.backward(scaler.scale(loss));
      strategy.post_backward(lm, true);
      if (step == kInjectAt && world->rank() == world->size() - 1) {
        at::NoGradGuard no_grad;
        lm.parameters()[0].mutable_grad().view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
      }
      const bool stepped = scaler.step(*opt, [&] { strategy.optimizer_step(*opt); });
      scaler.update();
      strategy.zero_grad(*opt);
      // Every rank made the same decision.
      at::Tensor flag = at::full({1}, stepped ? 1.0f : 0.0f);
      at::Tensor all = at::empty({world->size()}, at::kFloat);
      world->all_gather_into_tensor(all, flag);
      EXPECT_EQ(all.min().item<float>(), all.max().item<float>()) << "step " << step;
      if (!stepped) {
        EXPECT_TRUE(unchanged(before)) << "a skipped step moved parameters, step " << step;
        EXPECT_DOUBLE_EQ(scaler.get_scale(), scale_before * 0.5) << "step " << step;
      } else if (first_step_taken < 0) {
        first_step_taken = step;
      }
      if (step == kInjectAt) {
        EXPECT_FALSE(stepped) << "the injected NaN must skip the step";
      }
      if (step == kInjectAt - 1) {
        EXPECT_TRUE(stepped) << "expected clean steps before the NaN";
      }
    }
    EXPECT_FALSE(unchanged(initial)) << "no step ran";
    EXPECT_GE(first_step_taken, 1) << "2^24 must overflow fp16 at first";
    EXPECT_LE(first_step_taken, 10) << "the scale must back off to a usable value";
    if (world->rank() == 0) {
      std::printf("[precision] world %d: first step taken at %d, %lld skipped, final scale %.0f\n",
                  world->size(), first_step_taken,
                  static_cast<long long>(scaler.skipped_steps()), scaler.get_scale());
    }
  });
}

TEST(Precision, Fp16GradScalerSkipsOnEveryRankUnderFullShardWorld2) {
  fp16_scaler_skips_together(2, "gloo");
}
TEST(Precision, Fp16GradScalerSkipsOnEveryRankUnderFullShardWorld3) {
  fp16_scaler_skips_together(3, "gloo");
}
TEST(Precision, Fp16GradScalerSkipsOnEveryRankUnderFullShardWorld3Mpi) {
  fp16_scaler_skips_together(3, "mpi");
}

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
    const double max_diff = expect_losses_near(got, want, kBf16LossTolerance);
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

// 16-mixed through the Trainer in one process: under FSDP (the fp16 policy) and under the
// single strategy (CPU autocast to fp16), with the loss scaler; parameters stay fp32 and losses
// track fp32 within kFp16LossTolerance, closely but not exactly.
TEST(Precision, Fp16MixedTrainerTracksFp32UnderFsdpAndSingle) {
  for (const char* strategy : {"single", "fsdp"}) {
    SCOPED_TRACE(strategy);
    auto run = [&](const std::string& precision, TinyLM& lm) {
      auto loader = corpus_loader();
      auto o = quiet(precision, 10);
      o.strategy = strategy;
      auto trainer = std::make_unique<fsdp::Trainer>(o);
      trainer->fit(lm, loader);
      return trainer;
    };
    TinyLM ref_lm;
    const auto want = run("32-true", ref_lm)->results().losses;
    TinyLM lm;
    lm.after_build = [](TinyLM& m) { m.register_buffer("running_scale", at::ones({4})); };
    auto trainer = run("16-mixed", lm);
    for (auto& p : lm.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    const bool is_fsdp = std::string(strategy) == "fsdp";
    EXPECT_EQ(lm.named_buffers()["running_scale"].scalar_type(), is_fsdp ? at::kHalf : at::kFloat);
    ASSERT_NE(trainer->grad_scaler(), nullptr);
    EXPECT_EQ(trainer->results().skipped_steps, trainer->grad_scaler()->skipped_steps());
    const auto& got = trainer->results().losses;
    const double max_diff = expect_losses_near(got, want, kFp16LossTolerance);
    EXPECT_GT(max_diff, 0.0) << "fp16 compute must round differently from fp32";
    if (is_fsdp) {
      auto* fsdp = dynamic_cast<fsdp::FSDPStrategy*>(trainer->strategy().get());
      ASSERT_NE(fsdp, nullptr);
      ASSERT_TRUE(fsdp->options().mixed_precision.has_value());
      EXPECT_EQ(fsdp->options().mixed_precision->param_dtype, at::kHalf);
      EXPECT_EQ(fsdp->options().mixed_precision->reduce_dtype, at::kHalf);
      for (auto* p : fsdp::detail::state_of(*fsdp).all_params()) {
        EXPECT_EQ(p->unsharded().scalar_type(), at::kHalf) << p->fqn();
      }
    }
  }
}

// A loss that overflows fp16 once (batch 0 scaled by 1e8) makes the Trainer skip that
// optimizer step: the parameters the next step starts from are the initial ones, the scale is
// halved, and the run then trains normally.
struct OverflowOnceLM : TinyLM {
  std::vector<at::Tensor> at_step_hook;  // parameters when on_before_optimizer_step ran
  int hooks = 0;
  at::Tensor training_step(const fsdp::Batch& batch, int64_t batch_idx) override {
    at::Tensor loss = TinyLM::training_step(batch, batch_idx);
    return batch_idx == 0 ? loss * 1e8 : loss;
  }
  void on_before_optimizer_step(torch::optim::Optimizer& optimizer) override {
    if (++hooks == 2) {
      for (auto& p : parameters()) at_step_hook.push_back(p.detach().clone());
    }
    // Gradients are unscaled before this hook (as Lightning): finite ones are loss-sized.
    if (hooks == 2) {
      for (auto& p : parameters()) {
        if (p.grad().defined()) {
          EXPECT_LT(p.grad().abs().max().item<double>(), 100.0);
        }
      }
    }
  }
};

TEST(Precision, Fp16MixedTrainerSkipsTheOverflowingStep) {
  for (const char* strategy : {"single", "fsdp"}) {
    SCOPED_TRACE(strategy);
    auto loader = corpus_loader();
    OverflowOnceLM lm;
    std::vector<at::Tensor> initial;
    lm.after_build = [&](TinyLM& m) {
      for (auto& p : m.parameters()) initial.push_back(p.detach().clone());
    };
    auto o = quiet("16-mixed", 4);
    o.strategy = strategy;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    EXPECT_EQ(trainer.results().skipped_steps, 1);
    ASSERT_NE(trainer.grad_scaler(), nullptr);
    EXPECT_DOUBLE_EQ(trainer.grad_scaler()->get_scale(), 65536.0 * 0.5);
    ASSERT_EQ(lm.at_step_hook.size(), initial.size());
    if (std::string(strategy) == "single") {  // FSDP's parameters() are shards of `initial`
      for (size_t i = 0; i < initial.size(); ++i) {
        EXPECT_TRUE(at::equal(lm.at_step_hook[i], initial[i])) << "the skipped step moved " << i;
      }
    }
    auto params = lm.parameters();
    bool moved = false;
    for (size_t i = 0; i < params.size(); ++i) {
      moved = moved || !at::equal(params[i].detach(), lm.at_step_hook[i]);
    }
    EXPECT_TRUE(moved) << "steps after the skipped one must run";
  }
}

// The scale survives a checkpoint: a resumed 16-mixed fit starts from the saved scale.
TEST(Precision, Fp16MixedScalerStateResumesFromACheckpoint) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("fsdp_test_precision_scaler_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  double saved_scale = 0;
  {
    auto loader = corpus_loader();
    OverflowOnceLM lm;
    auto o = quiet("16-mixed", 2);
    o.checkpoint_dir = dir.string();
    o.save_every_n_steps = 2;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    saved_scale = trainer.grad_scaler()->get_scale();
  }
  EXPECT_DOUBLE_EQ(saved_scale, 32768.0);
  auto loader = corpus_loader();
  TinyLM lm;  // no overflow after resuming: the scale only moves by resuming
  fsdp::Trainer trainer(quiet("16-mixed", 3));
  trainer.fit(lm, loader, (dir / "last").string());
  ASSERT_NE(trainer.grad_scaler(), nullptr);
  EXPECT_DOUBLE_EQ(trainer.grad_scaler()->get_scale(), saved_scale);
  EXPECT_EQ(trainer.grad_scaler()->skipped_steps(), 1) << "the count is part of the state";
  std::filesystem::remove_all(dir);
}

TEST(Precision, Fp16TrueTrainsWithFp16Parameters) {
  for (const char* strategy : {"single", "fsdp"}) {
    SCOPED_TRACE(strategy);
    auto loader = corpus_loader();
    TinyLM lm;  // Adam eps 1e-3: representable in fp16
    lm.lr = 3e-3;
    auto o = quiet("16-true", 40);
    o.strategy = strategy;
    fsdp::Trainer trainer(o);
    trainer.fit(lm, loader);
    for (auto& p : lm.parameters()) EXPECT_EQ(p.scalar_type(), at::kHalf);
    EXPECT_EQ(trainer.grad_scaler(), nullptr) << "16-true has no loss scaling (as Lightning)";
    const auto& losses = trainer.results().losses;
    ASSERT_EQ(losses.size(), 40u);
    for (double l : losses) EXPECT_TRUE(std::isfinite(l));
    EXPECT_LT(mean(losses, 30, 40), mean(losses, 0, 10) - 0.2) << "16-true must learn";
  }
}

TEST(Precision, Fp16TrueRefusesAdamEpsThatRoundsToZeroInFp16) {
  auto loader = corpus_loader();
  TinyLM lm;
  lm.eps = 1e-8;  // Adam's default
  fsdp::Trainer trainer(quiet("16-true", 2));
  try {
    trainer.fit(lm, loader);
    FAIL() << "expected the eps error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("'16-true': Adam eps=1e-08 of parameter group 0 rounds to 0 in fp16"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("set eps to 1e-4"), std::string::npos) << msg;
  }
}

// The probe behind "16-mixed"/"16-true": fp16 matmul runs on this libtorch; a dtype whose CPU
// matmul is missing gets the one-sentence error naming the dtype, the version and bf16-mixed.
TEST(Precision, CpuMatmulProbeAcceptsFp16AndNamesWhatIsMissing) {
  EXPECT_NO_THROW(fsdp::check_precision_supported(fsdp::Precision::k16Mixed));
  EXPECT_NO_THROW(fsdp::check_precision_supported(fsdp::Precision::k16True));
  EXPECT_NO_THROW(fsdp::check_cpu_matmul_supported(at::kHalf, "[test]"));
  // The speed warning: only for fp16, and (when the CPU lacks oneDNN fp16) pointing at bf16.
  for (auto p : {fsdp::Precision::k32True, fsdp::Precision::kBf16Mixed,
                 fsdp::Precision::kBf16True, fsdp::Precision::k64True}) {
    EXPECT_FALSE(fsdp::precision_performance_warning(p).has_value()) << fsdp::to_string(p);
  }
  if (auto w = fsdp::precision_performance_warning(fsdp::Precision::k16Mixed)) {
    EXPECT_NE(w->find("'bf16-mixed' is the fast choice here"), std::string::npos) << *w;
    std::printf("[precision] %s\n", w->c_str());
  }
  try {
    fsdp::check_cpu_matmul_supported(at::kBool, "[test] 'bool-mixed'");
    FAIL() << "CPU has no Bool matmul";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("[test] 'bool-mixed' needs Bool matmul on CPU, which this libtorch ("),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("not implemented for 'Bool'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("use precision 'bf16-mixed'"), std::string::npos) << msg;
  }
}

// --- fsdp-train: 16-mixed under DDP and FSDP at worlds 2 and 3, the way users run it ----------

nlohmann::json cli_summary(const std::vector<std::string>& extra, const std::string& tag) {
  return fsdp::testing::fsdp_train_summary(extra, "precision_" + tag);
}

// 16-mixed on `world` ranks with `strategy` (global batch 12) against 32-true in one process on
// the same global batch, within kFp16LossTolerance per step.
void cli_fp16_mixed_tracks_fp32(const std::string& strategy) {
  if (!std::filesystem::exists(fsdp::testing::bin_path("fsdp-train"))) {
    GTEST_SKIP() << "[fsdp-skip] fsdp-train is not built";
  }
  const auto want = cli_summary({"--strategy", "single", "--batch-size", "12"}, "ref");
  ASSERT_TRUE(want.contains("losses"));
  for (int world : {2, 3}) {
    SCOPED_TRACE(strategy + " world " + std::to_string(world));
    const auto got = cli_summary({"--strategy", strategy, "--devices", std::to_string(world),
                                  "--batch-size", std::to_string(12 / world), "--precision",
                                  "16-mixed"},
                                 strategy + std::to_string(world));
    ASSERT_TRUE(got.contains("losses"));
    EXPECT_EQ(got["precision"], "16-mixed");
    const auto a = got["losses"].get<std::vector<double>>();
    const auto b = want["losses"].get<std::vector<double>>();
    const double max_diff = expect_losses_near(a, b, kFp16LossTolerance);
    EXPECT_GT(max_diff, 0.0) << "fp16 compute must round differently from fp32";
    std::printf("[precision] fsdp-train %s world %d 16-mixed: max |loss diff| %.5f vs 32-true "
                "single, %lld skipped steps\n",
                strategy.c_str(), world, max_diff, got["skipped_steps"].get<long long>());
  }
}

TEST(PrecisionCli, Fp16MixedDdpTracksFp32AtWorld2And3) { cli_fp16_mixed_tracks_fp32("ddp"); }
TEST(PrecisionCli, Fp16MixedFsdpTracksFp32AtWorld2And3) { cli_fp16_mixed_tracks_fp32("fsdp"); }

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
