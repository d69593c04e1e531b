#include "shard/wrap_policy.h"

#include <c10/util/Exception.h>

#include <functional>
#include <set>

namespace fsdp {

AutoWrapPolicy AutoWrapPolicy::of_types(fsdp::nn::ModuleTypes types) {
  AutoWrapPolicy p;
  p.kind = Kind::kTypes;
  p.types = std::move(types);
  return p;
}

AutoWrapPolicy AutoWrapPolicy::size_based(int64_t min_num_params) {
  TORCH_CHECK(min_num_params > 0, "[FSDPStrategy] AutoWrapPolicy::size_based needs min_num_params > 0, "
              "got ", min_num_params);
  AutoWrapPolicy p;
  p.kind = Kind::kSize;
  p.min_num_params = min_num_params;
  return p;
}

AutoWrapPolicy AutoWrapPolicy::of_predicate(
    std::function<bool(const torch::nn::Module&, int64_t nparams)> predicate) {
  TORCH_CHECK(static_cast<bool>(predicate), "[FSDPStrategy] AutoWrapPolicy::of_predicate: empty predicate");
  AutoWrapPolicy p;
  p.kind = Kind::kPredicate;
  p.predicate = std::move(predicate);
  return p;
}

AutoWrapPolicy parse_wrap_policy(const std::string& spec, const fsdp::nn::ModuleTypes& layer_types) {
  if (spec == "layers") {
    TORCH_CHECK(!layer_types.empty(), "[FSDPStrategy] --wrap-policy 'layers': the model names no layer types");
    return AutoWrapPolicy::of_types(layer_types);
  }
  if (spec == "none") return AutoWrapPolicy::none();
  if (spec.rfind("size:", 0) == 0) {
    int64_t n = 0;
    try {
      size_t used = 0;
      n = std::stoll(spec.substr(5), &used);
      TORCH_CHECK(used == spec.size() - 5, "trailing characters");
    } catch (const std::exception&) {
      TORCH_CHECK(false, "[FSDPStrategy] --wrap-policy '", spec, "': N in size:N must be a whole number, e.g. "
                  "size:1000000");
    }
    return AutoWrapPolicy::size_based(n);
  }
  TORCH_CHECK(false, "[FSDPStrategy] --wrap-policy: unknown policy '", spec,
              "'; valid forms: 'layers' (the model's encoder/decoder/GPT blocks), 'size:N' "
              "(wrap modules with at least N parameters), 'none' (root unit only)");
}

namespace detail {

bool wraps_by_count(const AutoWrapPolicy& policy, const torch::nn::Module& module,
                    int64_t nparams) {
  return policy.kind == AutoWrapPolicy::Kind::kSize ? nparams >= policy.min_num_params
                                                    : policy.predicate(module, nparams);
}

std::vector<fsdp::nn::Module*> choose_units_by_count(
    torch::nn::Module& root, const AutoWrapPolicy& policy, bool root_may_wrap,
    const std::function<bool(const torch::nn::Module&)>& taken) {
  TORCH_INTERNAL_ASSERT(policy.kind == AutoWrapPolicy::Kind::kSize ||
                        policy.kind == AutoWrapPolicy::Kind::kPredicate);
  std::set<const c10::TensorImpl*> counted;
  std::set<const torch::nn::Module*> done;
  std::vector<fsdp::nn::Module*> chosen;  // post-order
  std::function<int64_t(torch::nn::Module&)> count = [&](torch::nn::Module& m) -> int64_t {
    if (!done.insert(&m).second || (taken && taken(m))) return 0;
    int64_t n = 0;
    for (auto& child : m.children()) n += count(*child);
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      if (counted.insert(p.value().unsafeGetTensorImpl()).second) n += p.value().numel();
    }
    auto* hooked = dynamic_cast<fsdp::nn::Module*>(&m);
    if (hooked == nullptr || (&m == &root && !root_may_wrap)) return n;
    if (!wraps_by_count(policy, m, n)) return n;
    chosen.push_back(hooked);
    return 0;
  };
  count(root);
  return chosen;
}

std::vector<UnitSpec> select_units(torch::nn::Module& root, const AutoWrapPolicy& policy,
                                   const std::vector<fsdp::nn::Module*>& manual) {
  // FQN of every module, pre-order (first path wins for shared modules).
  std::vector<std::pair<torch::nn::Module*, std::string>> modules;
  std::set<const torch::nn::Module*> seen;
  std::function<void(torch::nn::Module&, const std::string&)> walk =
      [&](torch::nn::Module& m, const std::string& fqn) {
        if (!seen.insert(&m).second) return;
        modules.emplace_back(&m, fqn);
        for (auto& child : m.named_children()) {
          walk(*child.value(), fqn.empty() ? child.key() : fqn + "." + child.key());
        }
      };
  walk(root, "");

  std::vector<UnitSpec> units;
  if (!manual.empty()) {
    std::set<const torch::nn::Module*> marked(manual.begin(), manual.end());
    for (auto& [m, fqn] : modules) {
      if (m == &root && marked.count(m)) continue;  // the root is always the root unit
      if (marked.count(m)) units.push_back({static_cast<fsdp::nn::Module*>(m), fqn});
    }
    TORCH_CHECK(units.size() + marked.count(&root) == marked.size(),
                "[FSDPStrategy] fsdp::wrap: ", marked.size() - units.size(),
                " wrapped module(s) are not registered under the model. HINT: assign the result "
                "of fsdp::wrap(...) to a member registered with register_module.");
    return units;
  }

  switch (policy.kind) {
    case AutoWrapPolicy::Kind::kNone:
      return units;
    case AutoWrapPolicy::Kind::kTypes: {
      for (auto& [m, fqn] : modules) {
        if (m == &root || !fsdp::nn::is_instance_of(*m, policy.types)) continue;
        auto* hooked = dynamic_cast<fsdp::nn::Module*>(m);
        TORCH_CHECK(hooked != nullptr, "[FSDPStrategy] auto_wrap_policy: module '", fqn, "' (", m->name(),
                    ") matches the policy but is not an fsdp::nn::Module, so it has no forward "
                    "hooks to unshard it. HINT: put it in a unit holder where it is "
                    "registered (fsdp::nn::unit(module); a torch::nn::Sequential's children: "
                    "fsdp::nn::unit_children(seq); fsdp/unit.h), or derive the layer from "
                    "fsdp::nn::Module.");
        units.push_back({hooked, fqn});
      }
      return units;
    }
    case AutoWrapPolicy::Kind::kSize:
    case AutoWrapPolicy::Kind::kPredicate: {
      // Reported in pre-order, like the other policies.
      auto chosen = choose_units_by_count(root, policy, /*root_may_wrap=*/false);
      std::set<const torch::nn::Module*> picked(chosen.begin(), chosen.end());
      for (auto& [m, fqn] : modules) {
        if (picked.count(m)) units.push_back({static_cast<fsdp::nn::Module*>(m), fqn});
      }
      return units;
    }
  }
  return units;
}

}  // namespace detail
}  // namespace fsdp
