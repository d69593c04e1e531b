// Deferred initialization: units sharded while configure_model builds them.
// See Note [Deferred initialization] in deferred_init.cpp.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "fsdp/nn.h"

namespace fsdp::detail {

class FsdpState;

// FSDPStrategy::enter_configure_model: when deferred init applies to `strategy`, creates the
// state that will own the model and the DeferredInit that shards units as they are built.
void begin_deferred_init(FSDPStrategy& strategy);
// exit_configure_model (and setup_module): drops the DeferredInit; the state stays for
// setup_module to adopt.
void end_deferred_init(FSDPStrategy& strategy);

// `policy` for select_units over a model some of whose units were sharded during
// configure_model: size-based and predicate policies would count their shards, so deferred
// units are chosen as they were and modules inside them are not; everything else is asked as
// usual (full counts). Other policies are returned unchanged.
AutoWrapPolicy policy_with_deferred_units(const FsdpState& state, const AutoWrapPolicy& policy);

// What FSDPStrategy does with the model's construction notifications while its configure_model
// runs (FSDPStrategy::on_module_built / on_module_wrapped).
class DeferredInit {
 public:
  DeferredInit(FsdpState* state, AutoWrapPolicy policy);
  // fsdp::nn::built(module): shards the units the policy selects inside `module`.
  void on_built(torch::nn::Module& module);
  // fsdp::wrap(module): shards `module` as a unit.
  void on_wrap(fsdp::nn::Module& module);

 private:
  FsdpState* state_;
  AutoWrapPolicy policy_;
};

}  // namespace fsdp::detail
