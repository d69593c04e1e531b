// Memory planning: what a configuration needs per rank (the memory budget check in
// setup_module, fsdp::estimate_fsdp_memory, fsdp-train --dry-run), and the shape-only planning
// of a model that is never set up for training.
#include "fsdp/fsdp_strategy.h"

#include "comm/local_groups.h"
#include "shard/fsdp_strategy_impl.h"
#include "shard/options.h"
#include "shard/wrap_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {

FSDPMemoryEstimate FSDPStrategy::memory_estimate() const {
  TORCH_CHECK(impl_->state, "[FSDPStrategy] memory_estimate needs setup_module first");
  const detail::FsdpState& state = *impl_->state;
  FSDPMemoryEstimate e;
  const bool aliased = state.shard_group()->size() == 1;
  std::vector<int64_t> unit_bytes;  // params + grads, full size
  int64_t sum_unit_params = 0, max_grads = 0;
  for (const auto& unit : state.units()) {
    int64_t params = 0, grads = 0;
    for (const auto& p : unit->params()) {
      e.sharded_param_bytes += p->shard_nbytes();
      if (p->requires_grad()) {
        e.sharded_grad_bytes += p->shard_nbytes();
        grads += p->full_nbytes();
      }
      params += p->full_nbytes();
    }
    if (unit->is_root()) {
      if (!aliased) e.unsharded_peak_bytes += params + grads;
    } else if (state.computes_on_shards(*unit)) {
      // Never gathered, its gradient formed sharded (fsdp/sharded_compute.h).
    } else {
      unit_bytes.push_back(params + grads);
      sum_unit_params += params;
      max_grads = std::max(max_grads, grads);
    }
  }
  e.optimizer_bytes = 2 * e.sharded_grad_bytes;
  if (!aliased) {
    if (detail::reshards_after_forward(options_.sharding_strategy)) {
      std::sort(unit_bytes.rbegin(), unit_bytes.rend());
      for (size_t i = 0; i < unit_bytes.size() && i < 2; ++i) {
        e.unsharded_peak_bytes += unit_bytes[i];
      }
    } else {
      e.unsharded_peak_bytes += sum_unit_params + max_grads;
    }
  }
  return e;
}

void FSDPStrategy::plan_module(torch::nn::Module& module, int world_size, int local_world_size) {
  TORCH_CHECK(!impl_->state, "[FSDPStrategy] plan_module: this strategy already holds a model");
  TORCH_CHECK(world_size >= 1, "[FSDPStrategy] plan_module: world_size must be >= 1, got ",
              world_size);
  const int shard_size = detail::shard_group_size(options_, world_size, local_world_size);
  ProcessGroupPtr shard_group = detail::make_shape_only_group(shard_size);
  ProcessGroupPtr replicate_group;
  if (world_size / shard_size > 1) {
    replicate_group = detail::make_shape_only_group(world_size / shard_size);
  }
  auto units = detail::select_units(module, options_.auto_wrap_policy, impl_->manual_units);
  auto state = std::make_unique<detail::FsdpState>(detail::make_fsdp_config(options_),
                                                   shard_group, replicate_group);
  state->build(module, units);
  impl_->state = std::move(state);
}

std::pair<int64_t, int64_t> FSDPStrategy::parameter_counts(torch::nn::Module&) {
  int64_t all = 0, trainable = 0;
  for (auto* p : detail::state_of(*this).all_params()) {
    const int64_t n = p->unsharded().numel();  // P keeps its full sizes
    all += n;
    if (p->requires_grad()) trainable += n;
  }
  return {all, trainable};
}

FSDPMemoryEstimate estimate_fsdp_memory(torch::nn::Module& model, const FSDPOptions& options,
                                        int world_size, int local_world_size) {
  FSDPStrategy strategy(options);
  strategy.plan_module(model, world_size, local_world_size > 0 ? local_world_size : world_size);
  return strategy.memory_estimate();
}

}  // namespace fsdp
