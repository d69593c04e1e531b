// Memory of the sharding strategies at world 4, from the tensors themselves and from the
// tracking allocator (fsdp/memory.h).
//
// Model state per rank (fp32, Adam): parameters 4 B + gradients 4 B + exp_avg 4 B + exp_avg_sq
// 4 B = 16 B per element of this rank's shards. FULL_SHARD and SHARD_GRAD_OP hold
// 16 B x sum(padded shard numel) = 16 B x params / 4 + 16 B x padding / 4 at rest; NO_SHARD
// holds 16 B x params.
//
// Peak during a FULL_SHARD step (bound derived from the schedule in fsdp_param_group.cpp):
//   sharded params + sharded grads + Adam state               16 B x sum(shard numel)
// + root unit unsharded for the whole step: params, grads,
//   reduce-scatter input and output                          16 B x root padded numel
// + at most two units unsharded at once (the running one and one prefetched): params, grads,
//   all-gather output, reduce-scatter input                  2 x 16 B x largest unit padded numel
// + activations of the local batch                           A (measured: peak of a plain
//                                                            forward+backward minus its params)
#include "fully_shard_common.h"
#include "fsdp/memory.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

using fsdp::testing::TinyLM;

namespace {

struct Measured {
  int64_t state_tensor_bytes = 0;  // S + S.grad + Adam state, counted from tensors
  int64_t state_alloc_bytes = 0;   // allocator: current after the step minus before the model
  int64_t peak_bytes = 0;          // allocator peak during setup-free step, minus baseline
  int64_t params = 0;              // parameter elements (full model)
  int64_t padded = 0;              // sum of padded numel over parameters (W x shard numel)
  int64_t root_padded = 0;
  int64_t max_unit_padded = 0;
  int64_t sum_unit_full = 0;       // elements of all non-root units
};

fsdp::Batch local_batch(int rank) {
  return fsdp::testing::slice(fsdp::testing::global_batch(0, 16), rank * 4, 4);
}

Measured measure(fsdp::ShardingStrategy ss) {
  Measured m;
  const int64_t base = fsdp::memory_stats().current_bytes;
  {
    TinyLM lm;
    fsdp::FSDPOptions o;
    o.sharding_strategy = ss;
    o.auto_wrap_policy =
        fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
    fsdp::FSDPStrategy strategy(o);
    strategy.connect(fsdp::world_group(), {});
    fsdp::configure_model_with(strategy, lm);
    strategy.setup_module(lm);
    for (auto& unit : fsdp::detail::state_of(strategy).units()) {
      int64_t padded = 0, full = 0;
      for (auto& p : unit->params()) {
        padded += p->padded_numel();
        full += p->unsharded().numel();
        // Full shapes: with deferred init, lm.parameters() are shards already after
        // configure_model.
        m.params += p->unsharded().numel();
      }
      m.padded += padded;
      if (unit->is_root()) {
        m.root_padded = padded;
      } else {
        m.max_unit_padded = std::max(m.max_unit_padded, padded);
        m.sum_unit_full += full;
      }
    }
    auto opt = lm.configure_optimizers().optimizer;
    const int64_t before_step = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    {
      fsdp::Batch b = local_batch(strategy.rank());
      strategy.pre_forward(lm, true);
      at::Tensor loss = lm.training_step(b, 0);
      strategy.backward(loss);
      strategy.post_backward(lm, true);
      strategy.optimizer_step(*opt);
    }
    m.peak_bytes = fsdp::memory_stats().peak_bytes - before_step +
                   (before_step - base);  // relative to the baseline before the model
    for (auto& p : lm.parameters()) {
      m.state_tensor_bytes += p.numel() * 4;
      if (p.grad().defined()) m.state_tensor_bytes += p.grad().numel() * 4;
    }
    for (auto& kv : opt->state()) {
      auto* adam = dynamic_cast<torch::optim::AdamParamState*>(kv.second.get());
      EXPECT_NE(adam, nullptr);
      m.state_tensor_bytes += (adam->exp_avg().numel() + adam->exp_avg_sq().numel()) * 4;
    }
    // Gloo's worker threads drop their references to a collective's staging tensors after the
    // work completes, asynchronously: let the process-wide counter settle before reading it.
    int64_t now = fsdp::memory_stats().current_bytes;
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const int64_t next = fsdp::memory_stats().current_bytes;
      if (next == now) break;
      now = next;
    }
    m.state_alloc_bytes = now - base;
  }
  return m;
}

// Activations of the local batch: a plain forward+backward's peak minus its parameters.
int64_t measure_activations(int rank) {
  TinyLM lm;
  lm.configure_model();
  const int64_t before = fsdp::memory_stats().current_bytes;
  fsdp::reset_peak_memory_stats();
  {
    at::Tensor loss = lm.training_step(local_batch(rank), 0);
    loss.backward();
  }
  return fsdp::memory_stats().peak_bytes - before;  // activations + full grads: an upper bound
}

}  // namespace

TEST(FullyShardMemory, ModelStateAndPeakMatchTheoryAtWorld4) {
  fsdp::testing::run_ranks(4, "gloo", [](fsdp::ProcessGroup& world) {
    fsdp::install_tracking_allocator();
    ASSERT_TRUE(fsdp::tracking_allocator_installed());
    const int W = 4;
    const int64_t activations = measure_activations(world.rank());
    Measured full = measure(fsdp::ShardingStrategy::kFullShard);
    Measured sgo = measure(fsdp::ShardingStrategy::kShardGradOp);
    Measured none = measure(fsdp::ShardingStrategy::kNoShard);

    // FULL_SHARD: 16 B x params / 4 plus padding, from tensors (exact) and the allocator (5%).
    const double theory = 16.0 * full.params / W + 16.0 * (full.padded - full.params) / W;
    EXPECT_EQ(full.state_tensor_bytes, 16 * full.padded / W);
    EXPECT_NEAR(full.state_tensor_bytes, theory, 0.05 * theory);
    EXPECT_NEAR(full.state_alloc_bytes, theory, 0.05 * theory)
        << "allocator says " << full.state_alloc_bytes << " B, theory " << theory << " B";
    // Sharding saves what it should: well under half of the replicated state.
    EXPECT_LT(full.state_alloc_bytes, 16.0 * full.params / 2);

    const int64_t bound = 16 * full.padded / W + 16 * full.root_padded +
                          2 * 16 * full.max_unit_padded + activations;
    EXPECT_LE(full.peak_bytes, bound) << "peak " << full.peak_bytes << " B above the bound "
                                      << bound << " B (activations " << activations << " B)";

    // SHARD_GRAD_OP: same state at rest; during the step every unit is unsharded at the end of
    // forward, so its peak holds at least the sharded params and all units' full params.
    EXPECT_EQ(sgo.state_tensor_bytes, full.state_tensor_bytes);
    EXPECT_NEAR(sgo.state_alloc_bytes, theory, 0.05 * theory);
    // (No ordering against FULL_SHARD's peak: on this 47k-parameter model the units' full
    // parameters are smaller than the activation and reduce-scatter staging that set both peaks,
    // so which strategy peaks higher depends on when the comm thread frees its buffers.)
    EXPECT_GE(sgo.peak_bytes, 4 * sgo.padded / W + 4 * sgo.sum_unit_full);

    // NO_SHARD: everything replicated, 16 B x params.
    EXPECT_EQ(none.state_tensor_bytes, 16 * none.params);
    EXPECT_NEAR(none.state_alloc_bytes, 16.0 * none.params, 0.05 * 16.0 * none.params);
    EXPECT_GT(none.peak_bytes, sgo.peak_bytes);
    if (world.rank() == 0) {
      std::printf("[memory] params %lld: FULL_SHARD state %lld B (theory %.0f), peak %lld B "
                  "(bound %lld); SHARD_GRAD_OP peak %lld B; NO_SHARD state %lld B, peak %lld B\n",
                  (long long)full.params, (long long)full.state_alloc_bytes, theory,
                  (long long)full.peak_bytes, (long long)bound, (long long)sgo.peak_bytes,
                  (long long)none.state_alloc_bytes, (long long)none.peak_bytes);
    }
  });
}

TEST(FullyShardMemory, BudgetRefusesUpFrontWithTheComputedNeed) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    fsdp::install_tracking_allocator();
    const int64_t old_budget = fsdp::memory_budget();
    TinyLM lm;
    fsdp::FSDPStrategy strategy(fsdp::FSDPOptions{});
    strategy.connect(fsdp::world_group(), {});
    fsdp::configure_model_with(strategy, lm);
    // Enough for the model as built, far too little for NO_SHARD-like replicated Adam state:
    // the root unit alone (no policy) needs its full params + grads unsharded.
    fsdp::set_memory_budget(fsdp::memory_stats().current_bytes + 1024);
    try {
      strategy.setup_module(lm);
      ADD_FAILURE() << "setup_module accepted a configuration above the budget";
    } catch (const fsdp::OutOfMemoryError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("needs"), std::string::npos) << msg;
      EXPECT_NE(msg.find("budget"), std::string::npos) << msg;
    }
    fsdp::set_memory_budget(old_budget);
  });
}
