// The FSDP units a policy selects in a module (one rank, no process group), by name: for the
// wrap-policy tests (tests/test_fully_shard_engine.cpp, tests/test_nn_units.cpp).
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "fsdp/lightning.h"
#include "fsdp/strategy.h"
#include "shard/fsdp_strategy_impl.h"

#include <string>
#include <vector>

namespace fsdp::testing {

inline std::vector<std::string> unit_names(fsdp::LightningModule& module,
                                           fsdp::AutoWrapPolicy policy) {
  fsdp::FSDPOptions opts;
  opts.auto_wrap_policy = std::move(policy);
  fsdp::FSDPStrategy strategy(opts);
  strategy.connect(nullptr, {});
  fsdp::configure_model_with(strategy, module);
  strategy.setup_module(module);
  std::vector<std::string> names;
  for (auto& u : fsdp::detail::state_of(strategy).units()) names.push_back(u->name());
  return names;
}

}  // namespace fsdp::testing
