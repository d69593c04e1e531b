// Deferred initialization: units sharded while configure_model builds them.
// See Note [Deferred initialization] in deferred_init.cpp.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "fsdp/nn.h"

namespace fsdp::detail {

class FsdpState;
struct FsdpConfig;

// The engine configuration of `options` (one place: setup_module and deferred init agree).
// Defined in fsdp_strategy.cpp.
FsdpConfig make_fsdp_config(const FSDPOptions& options);
// `policy` for select_units over a model some of whose units were sharded during
// configure_model: size-based and predicate policies would count their shards, so deferred
// units are chosen as they were and modules inside them are not; everything else is asked as
// usual (full counts). Other policies are returned unchanged.
AutoWrapPolicy policy_with_deferred_units(const FsdpState& state, const AutoWrapPolicy& policy);
// Whether units built under `a` are valid under `b` (resharding and mixed precision agree).
bool same_sharding_config(const FsdpConfig& a, const FsdpConfig& b);

// The init observer FSDPStrategy installs on its thread while configure_model runs.
class DeferredInit : public fsdp::nn::InitObserver {
 public:
  DeferredInit(const FSDPStrategy* strategy, FsdpState* state, AutoWrapPolicy policy);
  // fsdp::nn::built(module): shards the units the type policy selects inside `module`.
  void on_built(torch::nn::Module& module) override;
  // fsdp::wrap(module): shards `module` as a unit.
  void on_wrap(fsdp::nn::Module& module);

 private:
  bool active() const;  // our strategy's configure_model is the one running

  const FSDPStrategy* strategy_;
  FsdpState* state_;
  AutoWrapPolicy policy_;
};

}  // namespace fsdp::detail
