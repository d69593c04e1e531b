// Wrap policies: which modules of a model become FSDP units.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "shard/fsdp_state.h"

#include <functional>
#include <vector>

namespace fsdp::detail {

// Whether a size-based or predicate `policy` wraps `module`, whose subtree holds `nparams`
// parameter elements that no descendant unit took.
bool wraps_by_count(const AutoWrapPolicy& policy, const torch::nn::Module& module,
                    int64_t nparams);

// The children-first count of size-based and predicate policies over `root`'s subtree: a
// module's count is the parameter elements of its subtree that no descendant unit took (tied
// tensors once). Returns the fsdp::nn::Module instances the policy wraps, in post-order. A
// module for which `taken` is true already is a unit: it counts 0 and is not visited. `root`
// itself is a candidate only when `root_may_wrap`.
std::vector<fsdp::nn::Module*> choose_units_by_count(
    torch::nn::Module& root, const AutoWrapPolicy& policy, bool root_may_wrap,
    const std::function<bool(const torch::nn::Module&)>& taken = {});

// Units for `root` (never a unit itself): the manually wrapped modules when there are any
// (fsdp::wrap inside configure_model; the policy is then not applied), else the policy's
// choice. Units are returned in module-tree (pre-order) order with their FQNs.
std::vector<UnitSpec> select_units(torch::nn::Module& root, const AutoWrapPolicy& policy,
                                   const std::vector<fsdp::nn::Module*>& manual);

}  // namespace fsdp::detail
