// Wrap policies: which modules of a model become FSDP units.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "shard/fsdp_state.h"

#include <vector>

namespace fsdp::detail {

// Units for `root` (never a unit itself): the manually wrapped modules when there are any
// (fsdp::wrap inside configure_model; the policy is then not applied), else the policy's
// choice. Units are returned in module-tree (pre-order) order with their FQNs.
std::vector<UnitSpec> select_units(torch::nn::Module& root, const AutoWrapPolicy& policy,
                                   const std::vector<fsdp::nn::Module*>& manual);

}  // namespace fsdp::detail
