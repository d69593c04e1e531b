// FSDPStrategy's engine (include/fsdp/fsdp_strategy.h keeps it behind a pointer): the state
// that owns the set-up model's units, and the deferred-initialization state that receives
// units sharded while configure_model runs.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "offload/nvme_adam.h"
#include "shard/deferred_init.h"
#include "shard/fsdp_state.h"

#include <memory>
#include <vector>

namespace fsdp {

struct FSDPStrategy::Impl {
  std::vector<fsdp::nn::Module*> manual_units;  // fsdp::wrap inside configure_model
  std::unique_ptr<detail::FsdpState> state;     // after setup_module / plan_module

  // Deferred initialization (src/shard/deferred_init.cpp): the state that receives units
  // sharded while configure_model runs, and the observer that shards them.
  std::unique_ptr<detail::FsdpState> deferred_state;
  std::unique_ptr<detail::DeferredInit> deferred;
  int num_deferred_units = 0;

  // The optimizer on disk (FSDPOptions::offload_policy.optimizer nvme), after setup_optimizer:
  // steps in place of optimizer.step(). Declared after `state`: it pages the parameters through
  // the state's swapper, so it goes first.
  std::unique_ptr<detail::NvmeAdam> nvme;
  std::string job;  // the disk tier's directory under disk.path: decided once (a collective)
};

namespace detail {

// The engine state of a set-up (or planned) strategy; an error before setup_module.
inline FsdpState& state_of(FSDPStrategy& strategy) {
  TORCH_CHECK(strategy.impl().state,
              "[FSDPStrategy] no model is set up yet: call setup_module first");
  return *strategy.impl().state;
}

}  // namespace detail
}  // namespace fsdp
