// Backward after the strategy that built the graph is gone. A graph keeps its autograd nodes,
// the hooks on them and the callbacks queued while it runs, so a kept loss can run backward
// after its strategy was destroyed. The strategy's hooks must then do nothing -- backward is
// plain autograd: local gradients in .grad, no collective -- or, for an FSDP unit whose
// parameters were freed after forward, raise a clear error; they never touch the destroyed
// strategy's memory. DDP, ZeRO stages 1/2/3 and FSDP, Gloo and MPI, worlds 2 and 3, with the
// strategy destroyed before backward and (DDP, ZeRO-1/2, FSDP SHARD_GRAD_OP) in the middle of
// it. See Note [Gradient buckets] in src/ddp/grad_buckets.h, "Liveness".
#include "fsdp/ddp.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/models.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

using fsdp::testing::TinyLM;

namespace {

struct Case {
  std::string name;
  std::function<std::shared_ptr<fsdp::Strategy>()> make;
  // FSDP FULL_SHARD / ZeRO-3: the units' parameters are freed after forward, and only the
  // strategy could gather them again: backward without it must be a clear error.
  bool params_freed_after_forward = false;
  // DDP, ZeRO-1/2: the model's registered parameters are the ones backward accumulates into.
  bool whole_params = true;
};

fsdp::DeepSpeedOptions zero(int stage) {
  fsdp::DeepSpeedOptions o;
  o.stage = stage;
  o.reduce_bucket_size = 6000;  // several buckets (transformer-tiny: ~47k parameters)
  o.allgather_bucket_size = 9000;
  o.stage3_param_persistence_threshold = 64;
  return o;
}

fsdp::FSDPOptions fsdp_options(fsdp::ShardingStrategy ss) {
  fsdp::FSDPOptions o;
  o.sharding_strategy = ss;
  o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  return o;
}

template <typename S, typename O>
std::function<std::shared_ptr<fsdp::Strategy>()> maker(O options) {
  return [options] {
    return std::shared_ptr<fsdp::Strategy>(
        fsdp::testing::connect_to_world(std::make_shared<S>(options)));
  };
}

std::vector<Case> all_cases() {
  fsdp::DDPOptions ddp;
  ddp.bucket_cap_mb = 0.01;  // ~10 KB: about 20 buckets
  std::vector<Case> cases;
  cases.push_back({"ddp", maker<fsdp::DDPStrategy>(ddp)});
  cases.push_back({"zero1", maker<fsdp::DeepSpeedStrategy>(zero(1))});
  cases.push_back({"zero2", maker<fsdp::DeepSpeedStrategy>(zero(2))});
  cases.push_back({"zero3", maker<fsdp::DeepSpeedStrategy>(zero(3)), true, false});
  cases.push_back({"fsdp_shard_grad_op",
                   maker<fsdp::FSDPStrategy>(fsdp_options(fsdp::ShardingStrategy::kShardGradOp)),
                   false, false});
  cases.push_back({"fsdp_full_shard",
                   maker<fsdp::FSDPStrategy>(fsdp_options(fsdp::ShardingStrategy::kFullShard)),
                   true, false});
  return cases;
}

fsdp::Batch local_batch(const fsdp::ProcessGroup& pg) {
  const int64_t rows = 12 / pg.size();
  return fsdp::testing::slice(fsdp::testing::global_batch(0, 12), pg.rank() * rows, rows);
}

// Every rank is still in step: one more collective completes with the expected value.
void expect_group_consistent(fsdp::ProcessGroup& pg) {
  at::Tensor x = at::full({1}, static_cast<float>(pg.rank() + 1));
  pg.all_reduce(x, fsdp::ReduceOp::kSum);
  const int w = pg.size();
  EXPECT_EQ(x.item<float>(), static_cast<float>(w * (w + 1) / 2));
}

std::map<std::string, at::Tensor> grads_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value().grad();
  return out;
}

void destroyed_before_backward(fsdp::ProcessGroup& pg) {
  const fsdp::Batch mb = local_batch(pg);
  // What plain autograd computes on this rank's batch.
  TinyLM ref;
  ref.configure_model();
  ref.training_step(mb, 0).backward();
  const auto want = grads_of(ref);

  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    TinyLM lm;
    std::shared_ptr<fsdp::Strategy> strategy = c.make();
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    strategy->pre_forward(lm, /*sync=*/true);
    at::Tensor loss = lm.training_step(mb, 0);
    const int64_t calls = pg.counters().calls;
    strategy.reset();  // the strategy and all it owns are gone; the graph is not

    if (c.params_freed_after_forward) {
      try {
        loss.backward();
        ADD_FAILURE() << "backward through resharded units after the strategy was destroyed "
                         "must be an error";
      } catch (const c10::Error& e) {
        const std::string what = e.what_without_backtrace();
        EXPECT_NE(what.find("destroyed"), std::string::npos) << what;
        EXPECT_NE(what.find("keep the strategy alive"), std::string::npos) << what;
      }
    } else {
      loss.backward();
      if (c.whole_params) {
        // Plain autograd: exactly the local gradients, nothing averaged.
        const auto got = grads_of(lm);
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, g] : want) {
          ASSERT_TRUE(got.at(name).defined()) << name;
          EXPECT_TRUE(got.at(name).equal(g)) << name;
        }
      } else {
        // FSDP: gradients stay on the unsharded parameters; no sharded gradient was produced.
        for (const auto& [name, g] : grads_of(lm)) EXPECT_FALSE(g.defined()) << name;
      }
    }
    EXPECT_EQ(pg.counters().calls, calls) << "a destroyed strategy communicated";
    expect_group_consistent(pg);
  }
}

// The strategy is destroyed by a hook on the last block's output: some of its gradient hooks
// have run (buckets launched, the end-of-backward callback queued), the rest of backward runs
// without it.
void destroyed_during_backward(fsdp::ProcessGroup& pg) {
  const fsdp::Batch mb = local_batch(pg);
  const auto layers = fsdp::demos::layer_types("transformer-tiny");
  for (const Case& c : all_cases()) {
    if (c.params_freed_after_forward) continue;
    SCOPED_TRACE(c.name);
    TinyLM lm;
    std::shared_ptr<fsdp::Strategy> strategy = c.make();
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    fsdp::nn::Module* last = nullptr;
    for (const auto& m : lm.model->modules()) {
      if (fsdp::nn::is_instance_of(*m, layers)) last = dynamic_cast<fsdp::nn::Module*>(m.get());
    }
    ASSERT_NE(last, nullptr);
    int64_t calls_at_teardown = -1;
    last->add_post_forward_hook(
        [&](fsdp::nn::Module&, const fsdp::nn::Inputs&, at::Tensor& output) {
          ASSERT_TRUE(output.requires_grad());
          output.register_hook([&](const at::Tensor&) {
            strategy.reset();
            calls_at_teardown = pg.counters().calls;
          });
        });
    strategy->pre_forward(lm, /*sync=*/true);
    at::Tensor loss = lm.training_step(mb, 0);
    loss.backward();
    EXPECT_EQ(strategy, nullptr) << "the hook did not run";
    EXPECT_GE(calls_at_teardown, 0);
    EXPECT_EQ(pg.counters().calls, calls_at_teardown) << "a destroyed strategy communicated";
    expect_group_consistent(pg);
  }
}

// FSDPStrategy::backward hooks the loss; a second backward through the same loss after the
// strategy is gone reaches that hook again (and then fails in autograd: the graph was freed).
void loss_hook_after_teardown(fsdp::ProcessGroup& pg) {
  const fsdp::Batch mb = local_batch(pg);
  for (auto ss : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
    SCOPED_TRACE(fsdp::to_string(ss));
    TinyLM lm;
    auto strategy = maker<fsdp::FSDPStrategy>(fsdp_options(ss))();
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    strategy->pre_forward(lm, true);
    at::Tensor loss = lm.training_step(mb, 0);
    strategy->backward(loss);
    strategy->post_backward(lm, true);
    strategy.reset();
    try {
      loss.backward();
      ADD_FAILURE() << "autograd should refuse a second backward through a freed graph";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("second time"), std::string::npos) << what;
    }
    expect_group_consistent(pg);
  }
}

}  // namespace

TEST(BackwardAfterTeardown, DestroyedBeforeBackwardGlooWorld2) {
  fsdp::testing::run_ranks(2, "gloo", destroyed_before_backward);
}
TEST(BackwardAfterTeardown, DestroyedBeforeBackwardGlooWorld3) {
  fsdp::testing::run_ranks(3, "gloo", destroyed_before_backward);
}
TEST(BackwardAfterTeardown, DestroyedBeforeBackwardMpiWorld2) {
  fsdp::testing::run_ranks(2, "mpi", destroyed_before_backward);
}
TEST(BackwardAfterTeardown, DestroyedBeforeBackwardMpiWorld3) {
  fsdp::testing::run_ranks(3, "mpi", destroyed_before_backward);
}
TEST(BackwardAfterTeardown, DestroyedDuringBackwardGlooWorld2) {
  fsdp::testing::run_ranks(2, "gloo", destroyed_during_backward);
}
TEST(BackwardAfterTeardown, DestroyedDuringBackwardGlooWorld3) {
  fsdp::testing::run_ranks(3, "gloo", destroyed_during_backward);
}
TEST(BackwardAfterTeardown, DestroyedDuringBackwardMpiWorld2) {
  fsdp::testing::run_ranks(2, "mpi", destroyed_during_backward);
}
TEST(BackwardAfterTeardown, DestroyedDuringBackwardMpiWorld3) {
  fsdp::testing::run_ranks(3, "mpi", destroyed_during_backward);
}
TEST(BackwardAfterTeardown, FsdpLossHookAfterTeardownGlooWorld2) {
  fsdp::testing::run_ranks(2, "gloo", loss_hook_after_teardown);
}
TEST(BackwardAfterTeardown, FsdpLossHookAfterTeardownMpiWorld3) {
  fsdp::testing::run_ranks(3, "mpi", loss_hook_after_teardown);
}
