// Deferred initialization: units sharded while configure_model builds them.
// See Note [Deferred initialization] in deferred_init.cpp.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "fsdp/nn.h"

namespace fsdp::detail {

class FsdpState;

// FSDPStrategy::enter_configure_model: when deferred init applies to `strategy`, creates the
// state that will own the model and installs the observer that shards units as they are built.
void begin_deferred_init(FSDPStrategy& strategy);
// exit_configure_model (and setup_module): uninstalls the observer; the state stays for
// setup_module to adopt.
void end_deferred_init(FSDPStrategy& strategy);

// `policy` for select_units over a model some of whose units were sharded during
// configure_model: size-based and predicate policies would count their shards, so deferred
// units are chosen as they were and modules inside them are not; everything else is asked as
// usual (full counts). Other policies are returned unchanged.
AutoWrapPolicy policy_with_deferred_units(const FsdpState& state, const AutoWrapPolicy& policy);

// The init observer FSDPStrategy installs on its thread while configure_model runs.
class DeferredInit : public fsdp::nn::InitObserver {
 public:
  DeferredInit(const FSDPStrategy* strategy, FsdpState* state, AutoWrapPolicy policy);
  // fsdp::nn::built(module): shards the units the policy selects inside `module`.
  void on_built(torch::nn::Module& module) override;
  // fsdp::wrap(module): shards `module` as a unit.
  void on_wrap(fsdp::nn::Module& module);

 // A strategy that runs `strategy` as its engine (DeepSpeedStrategy's stage 3): its
  // configure_model counts as ours.
  void set_outer(const Strategy* outer) { outer_ = outer; }

 private:
  bool active() const;  // our strategy's configure_model is the one running
  const Strategy* outer_ = nullptr;

  const FSDPStrategy* strategy_;
  FsdpState* state_;
  AutoWrapPolicy policy_;
};

}  // namespace fsdp::detail
