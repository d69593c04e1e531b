// Deferred initialization: units sharded while configure_model builds them. See include/fsdp/init.h.
#include "shard/deferred_init.h"

#include "common/settings.h"
#include "fsdp/init.h"
#include "fsdp/strategy.h"
#include "shard/collectives.h"
#include "shard/fsdp_state.h"
#include "shard/fsdp_strategy_impl.h"
#include "shard/options.h"
#include "shard/wrap_policy.h"

#include <c10/util/Exception.h>

#include <functional>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace detail {

// Note [Deferred initialization]
// ------------------------------
// Eager setup builds the whole model on every rank, then shards it: the setup peak is the full
// model (3.8 GiB per rank for transformer-1b). Deferred init shards each unit as soon as it is
// built, inside configure_model, so a rank holds at most its shards so far plus one full unit:
//
//   enter_configure_model  FSDPStrategy creates the FsdpState that will own the model and a
//                          DeferredInit, which receives what the model's construction says
//                          (Note [Configure-model scope] in src/train/strategy.cpp).
//   fsdp::nn::built(m)     the model says "m is complete" (the demo models do it for every
//                          layer right after constructing it). The wrap policy picks units
//                          inside m now (types: every module of a policy type, innermost
//                          first; size/predicate: the same children-first count select_units
//                          does, which inside m depends only on m's subtree). Each becomes a
//                          unit at once: FsdpParamGroup::init() creates each parameter's shard S
//                          from its values, frees P's storage and swaps S into the module, one
//                          parameter at a time, before the next layer is constructed.
//   fsdp::wrap(m)          the same for a manually wrapped module.
//   setup_module           the usual unit selection runs over the whole model (size and
//                          predicate policies through policy_with_deferred_units, so they do
//                          not count shards); a selected
//                          module that is already a deferred unit is adopted as it is (its
//                          FQN is filled in now), everything else is built and sharded as
//                          before (the root unit: embeddings, final norms, heads).
//
// Values: each layer is constructed and initialized exactly as in eager construction, from the
// same global generator in the same order, and sharding copies rows without arithmetic, so
// the gathered parameters are bitwise those of a single-process model built from the same seed,
// at any world size.
//
// Falls back to eager build-then-shard (nothing is sharded during configure_model) for:
// NO_SHARD and the HYBRID strategies (their groups are made in setup_module), a world of one
// rank, sync_module_states (rank 0's full values are broadcast first), and models that call
// neither fsdp::nn::built nor fsdp::wrap. If the selection at setup does not keep a deferred
// unit (e.g. the model called fsdp::wrap after the policy had sharded its layers, or the
// mixed-precision policy changed after configure_model, or a parameter of it was frozen or
// unfrozen afterwards through module.parameters()), that unit is all-gathered back into full
// parameters first, so the result is always the eager one (at the cost of one gather).
//
// Note [Deferred init onto the device]
// ------------------------------------
// On CUDA the model is built on the host as on the CPU (configure_model runs there, with the
// CPU generator, so the values are the CPU run's), but each deferred unit's shards are created
// on the rank's device (FsdpConfig::device): FsdpParam::shard copies this rank's rows of the
// host values to the device and gives P (the unsharded parameter) an empty device storage;
// the host's full values are freed with the layer's registration. The host holds at most one
// full unit; the device only this rank's shards. The Trainer then moves what is left on the
// host (the root unit's parameters, buffers; Note [Moving the model to the device] in
// src/train/trainer.cpp): the units' shards are on the device already, so Module::to leaves
// them. A deferred unit that setup does not keep is all-gathered back, on the device.

// Contract for models: after built(m), m's parameters as seen through m.parameters() are
// shards; set requires_grad and values before calling built(), and do not re-initialize a
// built layer from its parent (the GPT-2 `apply(init_weights)` idiom must run inside each
// layer's constructor instead).

DeferredInit::DeferredInit(FsdpState* state, AutoWrapPolicy policy)
    : state_(state), policy_(std::move(policy)) {}

void DeferredInit::on_built(torch::nn::Module& module) {
  if (policy_.kind == AutoWrapPolicy::Kind::kSize ||
      policy_.kind == AutoWrapPolicy::Kind::kPredicate) {
    // As select_units, inside the built subtree (every decision there depends only on the
    // subtree); units sharded earlier count as taken.
    auto chosen = choose_units_by_count(
        module, policy_, /*root_may_wrap=*/true,
        [this](const torch::nn::Module& m) { return state_->is_deferred_unit(&m); });
    for (auto* unit : chosen) state_->shard_deferred_unit(*unit);
    return;
  }
  if (policy_.kind != AutoWrapPolicy::Kind::kTypes) return;
  // Children first: a nested unit takes its parameters before the unit around it.
  std::set<const torch::nn::Module*> seen;
  std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
    if (!seen.insert(&m).second) return;
    for (auto& child : m.children()) visit(*child);
    if (!fsdp::nn::is_instance_of(m, policy_.types)) return;
    if (auto* hooked = dynamic_cast<fsdp::nn::Module*>(&m)) state_->shard_deferred_unit(*hooked);
  };
  visit(module);
}

void DeferredInit::on_wrap(fsdp::nn::Module& module) { state_->shard_deferred_unit(module); }

// --- FsdpState: deferred units ------------------------------------------------------------------

void FsdpState::shard_deferred_unit(fsdp::nn::Module& module) {
  TORCH_INTERNAL_ASSERT(units_.empty(), "deferred unit after FsdpState::build");
  if (is_deferred_unit(&module)) return;
  auto unit = new_unit("<deferred>", &module, config_.reshard_after_forward);
  // Parameters of the subtree no earlier deferred unit took; FQNs relative to `module` until
  // build() knows where it lives. Tied parameters inside the subtree register once.
  std::unordered_map<const c10::TensorImpl*, FsdpParam*> seen;
  std::set<const torch::nn::Module*> visited;
  std::function<void(torch::nn::Module&, const std::string&)> visit =
      [&](torch::nn::Module& m, const std::string& prefix) {
        if (!visited.insert(&m).second) return;
        // See Note [Unit holders] in src/nn/unit.cpp: a holder's parameters live in two dicts.
        for (torch::nn::Module* owner : parameter_owners(m)) {
          for (auto& item : registered_parameters(*owner)) {
            const at::Tensor& tensor = item.value();
            if (!tensor.defined()) continue;
            if (!deferred_taken_.insert({owner, item.key()}).second) continue;  // a nested unit's
            FsdpParam::Registration reg{owner, item.key(), prefix + item.key()};
            auto found = seen.find(tensor.unsafeGetTensorImpl());
            if (found != seen.end()) {
              found->second->add_registration(std::move(reg));
              continue;
            }
            seen[tensor.unsafeGetTensorImpl()] = &unit->add_param(tensor, std::move(reg));
          }
        }
        for (auto& child : m.named_children()) {
          visit(*child.value(), prefix + child.key() + ".");
        }
      };
  visit(module, "");
  unit->init();  // shards every parameter: S created, P's storage freed, S registered
  try {
    deferred_keep_alive_.push_back(module.shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    // Not owned by a shared_ptr (e.g. a member object): its owner keeps it alive.
  }
  preinitialized_.insert(unit.get());
  deferred_.push_back(std::move(unit));
}

bool FsdpState::is_deferred_unit(const torch::nn::Module* module) const {
  for (const auto& unit : deferred_) {
    if (unit->module() == module) return true;
  }
  return false;
}

std::unique_ptr<FsdpParamGroup> FsdpState::take_deferred_unit(const torch::nn::Module* module,
                                                              const std::string& fqn) {
  for (auto it = deferred_.begin(); it != deferred_.end(); ++it) {
    if ((*it)->module() != module) continue;
    std::unique_ptr<FsdpParamGroup> unit = std::move(*it);
    deferred_.erase(it);
    unit->set_name(fqn);
    for (auto& p : unit->params()) p->prefix_fqns(fqn + ".");
    return unit;
  }
  return nullptr;
}

void FsdpState::restore_unselected_deferred(const std::vector<UnitSpec>& specs) {
  std::set<const torch::nn::Module*> selected;
  for (const auto& spec : specs) selected.insert(spec.module);
  at::NoGradGuard no_grad;
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    FsdpParamGroup& unit = **it;
    // A parameter frozen (or unfrozen) after its unit was sharded changed only the shard's
    // flag: the unit is rebuilt eagerly with the new flag rather than trained with the old one.
    bool requires_grad_changed = false;
    for (auto& p : unit.params()) {
      requires_grad_changed |= p->sharded().requires_grad() != p->requires_grad();
    }
    if (selected.count(unit.module()) && !requires_grad_changed) {
      ++it;
      continue;
    }
    // Every rank restores the same units in the same (construction) order.
    for (auto& p : unit.params()) {
      if (!p->aliased()) {
        // Same TensorImpl (the layer's member), full values, the sharded dtype.
        p->unsharded().set_data(gather_full(*p, *shard_group_));
        p->unsharded().set_requires_grad(p->sharded().requires_grad());
      }
      for (const auto& reg : p->registrations()) {
        registered_parameters(*reg.module)[reg.name] = p->unsharded();
        deferred_taken_.erase({reg.module, reg.name});
      }
    }
    preinitialized_.erase(&unit);
    it = deferred_.erase(it);
  }
}

AutoWrapPolicy policy_with_deferred_units(const FsdpState& state, const AutoWrapPolicy& policy) {
  if (state.num_deferred_units() == 0 || (policy.kind != AutoWrapPolicy::Kind::kSize &&
                                          policy.kind != AutoWrapPolicy::Kind::kPredicate)) {
    return policy;
  }
  std::set<const torch::nn::Module*> units, inside;
  for (const auto& unit : state.deferred_units()) {
    units.insert(unit->module());
    std::function<void(const torch::nn::Module&)> mark = [&](const torch::nn::Module& m) {
      for (const auto& child : m.children()) {
        if (inside.insert(child.get()).second) mark(*child);
      }
    };
    mark(*unit->module());
  }
  return AutoWrapPolicy::of_predicate(
      [units, inside, policy](const torch::nn::Module& m, int64_t n) {
        if (units.count(&m)) return true;
        if (inside.count(&m)) return false;
        return wraps_by_count(policy, m, n);
      });
}

// --- FSDPStrategy: entering and leaving deferred init -------------------------------------

namespace {

bool deferred_init_applies(const FSDPStrategy& strategy) {
  const FSDPOptions& options = strategy.options();
  const ShardingStrategy ss = options.sharding_strategy;
  // FSDP_DEFERRED_INIT=0 turns it off without recompiling (e.g. to compare setup peaks).
  return options.deferred_init && read_settings().deferred_init && strategy.world_size() > 1 &&
         !options.sync_module_states &&
         (ss == ShardingStrategy::kFullShard || ss == ShardingStrategy::kShardGradOp);
}

}  // namespace

void begin_deferred_init(FSDPStrategy& strategy) {
  FSDPStrategy::Impl& impl = strategy.impl();
  end_deferred_init(strategy);
  if (impl.deferred_state) impl.deferred_state->restore_all_deferred();  // configure_model ran again
  impl.deferred_state.reset();
  impl.num_deferred_units = 0;
  if (impl.state || !deferred_init_applies(strategy)) return;
  // Same groups as setup_module makes for these strategies: the world is the shard group.
  FsdpConfig config = make_fsdp_config(strategy.options());
  if (strategy.device().is_cuda()) config.device = strategy.device();  // see the Note above
  impl.deferred_state = std::make_unique<FsdpState>(std::move(config), strategy.world(), nullptr);
  impl.deferred = std::make_unique<DeferredInit>(impl.deferred_state.get(),
                                                 strategy.options().auto_wrap_policy);
}

void end_deferred_init(FSDPStrategy& strategy) { strategy.impl().deferred.reset(); }

}  // namespace detail
}  // namespace fsdp
