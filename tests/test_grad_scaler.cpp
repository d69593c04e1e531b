// ShardedGradScaler on its own: loss scaling, unscale, skip on inf/nan, backoff, growth, and
// the found-inf agreement across ranks (only one rank sees an inf; every rank skips).
#include "fsdp/precision.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <limits>

namespace {

struct OneParam {
  at::Tensor w = at::ones({4}, at::kFloat).set_requires_grad(true);
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5)};
  void set_grad(at::Tensor g) { w.mutable_grad() = std::move(g); }
};

TEST(GradScaler, ScalesLossAndUnscalesGradsBeforeTheStep) {
  OneParam p;
  fsdp::GradScalerOptions o;
  o.init_scale = 8.0;
  fsdp::ShardedGradScaler scaler(nullptr, o);
  EXPECT_DOUBLE_EQ(scaler.scale(at::full({}, 3.0)).item<double>(), 24.0);
  p.set_grad(at::full({4}, 16.0));  // = scale x true gradient 2
  EXPECT_TRUE(scaler.step(p.opt));
  EXPECT_FALSE(scaler.found_inf());
  // w = 1 - 0.5 * (16 / 8) = 0
  EXPECT_TRUE(at::allclose(p.w.detach(), at::zeros({4})));
  scaler.update();
  EXPECT_EQ(scaler.skipped_steps(), 0);
}

TEST(GradScaler, SkipsTheStepAndBacksOffOnInfOrNan) {
  for (double bad : {std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    OneParam p;
    fsdp::GradScalerOptions o;
    o.init_scale = 1024.0;
    fsdp::ShardedGradScaler scaler(nullptr, o);
    at::Tensor g = at::ones({4});
    g[2] = bad;
    p.set_grad(g);
    EXPECT_FALSE(scaler.step(p.opt));
    EXPECT_TRUE(scaler.found_inf());
    EXPECT_TRUE(at::equal(p.w.detach(), at::ones({4}))) << "a skipped step must not move w";
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.get_scale(), 512.0);  // x backoff_factor 0.5
    EXPECT_EQ(scaler.skipped_steps(), 1);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanStepsAndAnOverflowResetsTheCount) {
  OneParam p;
  fsdp::GradScalerOptions o;
  o.init_scale = 4.0;
  o.growth_interval = 3;
  fsdp::ShardedGradScaler scaler(nullptr, o);
  auto clean_step = [&] {
    p.set_grad(at::ones({4}));
    EXPECT_TRUE(scaler.step(p.opt));
    scaler.update();
  };
  clean_step();
  clean_step();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  // An overflow: backoff, and the clean-step count starts over.
  at::Tensor g = at::ones({4});
  g[0] = std::numeric_limits<double>::infinity();
  p.set_grad(g);
  EXPECT_FALSE(scaler.step(p.opt));
  scaler.update();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 2.0);
  clean_step();
  clean_step();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 2.0);
  clean_step();  // third clean step in a row
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, BadOptionsAndMisuseFailClearly) {
  fsdp::GradScalerOptions o;
  o.backoff_factor = 1.5;
  EXPECT_THROW(fsdp::ShardedGradScaler(nullptr, o), c10::Error);
  fsdp::ShardedGradScaler scaler;
  try {
    scaler.update();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("update() without unscale()"), std::string::npos);
  }
}

// step(optimizer, step_fn): the Trainer's form, where the strategy runs the step.
TEST(GradScaler, StepFunctionRunsOnlyWhenGradientsAreFinite) {
  OneParam p;
  fsdp::ShardedGradScaler scaler;
  int calls = 0;
  p.set_grad(at::ones({4}));
  EXPECT_TRUE(scaler.step(p.opt, [&] { ++calls; }));
  scaler.update();
  at::Tensor g = at::ones({4});
  g[1] = std::numeric_limits<double>::quiet_NaN();
  p.set_grad(g);
  EXPECT_FALSE(scaler.step(p.opt, [&] { ++calls; }));
  scaler.update();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(p.w.detach(), at::ones({4}))) << "step_fn replaces optimizer.step()";
}

TEST(GradScaler, StateDictRoundTripsScaleGrowthAndSkips) {
  OneParam p;
  fsdp::GradScalerOptions o;
  o.init_scale = 1024.0;
  fsdp::ShardedGradScaler a(nullptr, o);
  at::Tensor g = at::ones({4});
  g[0] = std::numeric_limits<double>::infinity();
  p.set_grad(g);
  a.step(p.opt);
  a.update();  // scale 512, one skip
  p.set_grad(at::ones({4}));
  a.step(p.opt);
  a.update();  // growth tracker 1
  fsdp::ShardedGradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_DOUBLE_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.skipped_steps(), 1);
  for (const char* bad : {"[]", "{\"scale\": 2}", "{\"scale\": -1, \"growth_tracker\": 0}",
                          "not json"}) {
    EXPECT_THROW(b.load_state_dict(bad), c10::Error) << bad;
  }
}

// Every rank holds different shards; only rank 1 sees an inf. The found-inf flag is
// all-reduced (MAX), so every rank skips the step and backs off by the same factor.
void one_rank_overflows(int world) {
  fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
    auto group = fsdp::world_group();
    ASSERT_TRUE(group);
    OneParam p;
    fsdp::GradScalerOptions o;
    o.init_scale = 256.0;
    fsdp::ShardedGradScaler scaler(group, o);
    at::Tensor g = at::ones({4});
    if (group->rank() == 1) g[3] = std::numeric_limits<double>::infinity();
    p.set_grad(g);
    EXPECT_FALSE(scaler.step(p.opt)) << "rank " << group->rank();
    EXPECT_TRUE(scaler.found_inf());
    EXPECT_TRUE(at::equal(p.w.detach(), at::ones({4})));
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.get_scale(), 128.0);
    // The next step is clean on every rank: all step.
    p.set_grad(at::ones({4}));
    EXPECT_TRUE(scaler.step(p.opt));
    scaler.update();
    EXPECT_FALSE(at::equal(p.w.detach(), at::ones({4})));
  });
}

TEST(GradScaler, FoundInfIsAgreedAcrossRanksWorld2) { one_rank_overflows(2); }
TEST(GradScaler, FoundInfIsAgreedAcrossRanksWorld3) { one_rank_overflows(3); }

}  // namespace
