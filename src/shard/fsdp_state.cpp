#include "shard/fsdp_state.h"

#include "fsdp/nn.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <map>
#include <set>
#include <unordered_map>

namespace fsdp::detail {

FsdpState::FsdpState(FsdpConfig config, ProcessGroupPtr shard_group,
                     ProcessGroupPtr replicate_group)
    : config_(config),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      alive_(std::make_shared<bool>(true)) {}

FsdpState::~FsdpState() {
  // Hooks installed on the modules outlive this object when the model outlives the strategy:
  // they check this flag and do nothing afterwards (the model's parameters stay sharded).
  *alive_ = false;
}

void FsdpState::build(torch::nn::Module& root, const std::vector<UnitSpec>& specs) {
  TORCH_INTERNAL_ASSERT(units_.empty(), "FsdpState::build called twice");
  // Deferred units the selection does not keep become full parameters again.
  restore_unselected_deferred(specs);
  units_.push_back(new_unit("<root>", nullptr, /*reshard=*/false));
  std::unordered_map<const torch::nn::Module*, FsdpParamGroup*> unit_of;
  for (const auto& spec : specs) {
    TORCH_INTERNAL_ASSERT(spec.module, "unit spec without module");
    if (unit_of.count(spec.module)) continue;
    // A unit sharded during configure_model (deferred init) keeps its sharded parameters.
    auto deferred = take_deferred_unit(spec.module, spec.fqn);
    units_.push_back(deferred ? std::move(deferred)
                              : new_unit(spec.fqn, spec.module, config_.reshard_after_forward));
    unit_of[spec.module] = units_.back().get();
  }
  deferred_keep_alive_.clear();  // adopted units live in the model from here on

  struct Seen {
    FsdpParam* param;
    FsdpParamGroup* unit;
  };
  std::unordered_map<const c10::TensorImpl*, Seen> seen;
  std::set<std::pair<const torch::nn::Module*, std::string>> registered;
  std::set<const torch::nn::Module*> visited;
  // Parameters of adopted deferred units are assigned already (both P and S are theirs).
  for (auto& unit : units_) {
    if (!preinitialized_.count(unit.get())) continue;
    for (auto& p : unit->params()) {
      for (const auto& reg : p->registrations()) registered.insert({reg.module, reg.name});
      seen[p->unsharded().unsafeGetTensorImpl()] = Seen{p.get(), unit.get()};
      seen[p->sharded().unsafeGetTensorImpl()] = Seen{p.get(), unit.get()};
    }
  }

  std::function<void(torch::nn::Module&, const std::string&, FsdpParamGroup*)> visit =
      [&](torch::nn::Module& m, const std::string& prefix, FsdpParamGroup* owner) {
        auto it = unit_of.find(&m);
        if (it != unit_of.end()) owner = it->second;
        if (!visited.insert(&m).second) return;  // a shared submodule: registered already
        for (auto& item : registered_parameters(m)) {
          const std::string& name = item.key();
          const at::Tensor& tensor = item.value();
          if (!tensor.defined()) continue;
          if (!registered.insert({&m, name}).second) continue;
          FsdpParam::Registration reg{&m, name, prefix + name};
          auto found = seen.find(tensor.unsafeGetTensorImpl());
          if (found != seen.end()) {
            TORCH_CHECK(found->second.unit == owner, "[fully_shard] parameter '", reg.fqn,
                        "' (shape ", tensor.sizes(), ") is the same tensor as '",
                        found->second.param->fqn(), "', but '", reg.fqn, "' belongs to unit '",
                        owner->name(), "' and '", found->second.param->fqn(),
                        "' to unit '", found->second.unit->name(),
                        "'. Tied parameters must live in one unit. HINT: wrap a module that "
                        "contains both, or leave both in the root unit.");
            found->second.param->add_registration(std::move(reg));
            continue;
          }
          FsdpParam& p = owner->add_param(tensor, std::move(reg));
          seen[tensor.unsafeGetTensorImpl()] = Seen{&p, owner};
        }
        for (auto& child : m.named_children()) {
          visit(*child.value(), prefix + child.key() + ".", owner);
        }
      };
  visit(root, "", units_.front().get());

  for (const auto& [module, unit] : unit_of) {
    TORCH_CHECK(visited.count(module), "[fully_shard] unit '", unit->name(),
                "' is not a submodule of the model given to the strategy. HINT: register the "
                "module (register_module) before wrapping it.");
  }
}

void FsdpState::materialize() {
  for (auto& unit : units_) {
    if (!preinitialized_.count(unit.get())) unit->init();  // deferred units are sharded
  }
  std::weak_ptr<bool> alive = alive_;
  for (auto& unit : units_) {
    if (unit->is_root()) continue;
    FsdpParamGroup* g = unit.get();
    fsdp::nn::Module* m = unit->module();
    std::vector<int> handles;
    handles.push_back(m->add_pre_forward_hook(
        [g, alive](fsdp::nn::Module&, fsdp::nn::Inputs& inputs) {
          auto a = alive.lock();
          if (a && *a) g->pre_forward(inputs);
        }));
    handles.push_back(m->add_post_forward_hook(
        [g, alive](fsdp::nn::Module&, const fsdp::nn::Inputs&, at::Tensor& output) {
          auto a = alive.lock();
          if (a && *a) g->post_forward(output);
        }));
  }
}

std::unique_ptr<FsdpParamGroup> FsdpState::new_unit(std::string name, fsdp::nn::Module* module,
                                                    bool reshard) {
  return std::make_unique<FsdpParamGroup>(std::move(name), module, this, shard_group_,
                                          replicate_group_, reshard);
}

std::vector<FsdpParam*> FsdpState::all_params() {
  std::vector<FsdpParam*> out;
  for (auto& unit : units_) {
    for (auto& p : unit->params()) out.push_back(p.get());
  }
  return out;
}

void FsdpState::begin_step(bool sync) {
  sync_ = sync;
  for (auto& unit : units_) {
    // A previous forward without backward (e.g. the loss was not used) leaves units unsharded
    // or resharded-after-forward: bring them back to rest.
    unit->drop_pending_all_gather();
    if (!unit->is_root() && unit->is_unsharded()) unit->reshard(ShardedState::kSharded);
    if (unit->sharded_state() == ShardedState::kShardedPostForward) {
      unit->reshard_state_to_rest();
    }
    unit->set_training_state(TrainingState::kIdle);
  }
  FsdpParamGroup& root = root_unit();
  if (!root.params().empty() && !root.is_unsharded()) root.unshard();
  root.set_training_state(TrainingState::kForward);
}

void FsdpState::on_backward_start() {
  if (callback_queued_) return;
  callback_queued_ = true;
  order_frozen_ = true;  // the forward order of this step drives prefetching from now on
  std::weak_ptr<bool> alive = alive_;
  torch::autograd::Engine::get_default_engine().queue_callback([this, alive] {
    auto a = alive.lock();
    if (a && *a) on_backward_end();
  });
}

void FsdpState::on_backward_end() {
  // Non-root units in reverse forward order, then the root: the same order on every rank.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    if (!(*it)->is_root()) (*it)->finalize_backward();
  }
  root_unit().finalize_backward();
  callback_queued_ = false;
}

// Note [One reduce-scatter in flight]
// A unit's reduce-scatter input is its whole unsharded gradient laid out rank-major
// (W x shard numel). Waiting for every unit's reduce-scatter only in finish_step would keep all
// those inputs alive until the end of backward: the full unsharded gradient of the model, which
// is exactly what sharding gradients is meant to avoid (measured on transformer-small at world
// 2: +117 MiB of peak). So when unit k issues its reduce-scatter, the one issued before it (unit
// k+1 in backward order) is finished: waited for, its input freed, its output turned into
// sharded gradients. At most one reduce-scatter is in flight and it still overlaps the next
// unit's backward compute. The order in which units finish is the backward order, the same on
// every rank, so the replicate-group all-reduce of hybrid sharding stays matched across ranks.
void FsdpState::reduce_scatter_issued(FsdpParamGroup& unit) {
  if (reduce_scatter_in_flight_ && reduce_scatter_in_flight_ != &unit) {
    reduce_scatter_in_flight_->finish_reduce_scatter();
  }
  reduce_scatter_in_flight_ = &unit;
}

void FsdpState::finish_step() {
  reduce_scatter_in_flight_ = nullptr;
  // Backward ran without any hook of ours (e.g. loss.backward() called directly on a model
  // whose only unit is the root): finish the units now.
  bool unfinished = false;
  for (auto& unit : units_) {
    unfinished |= unit->is_unsharded() || unit->has_pending_all_gather() ||
                  unit->sharded_state() == ShardedState::kShardedPostForward;
  }
  if (unfinished) on_backward_end();
  for (auto& unit : units_) unit->finish_reduce_scatter();
  for (auto& unit : units_) {
    TORCH_INTERNAL_ASSERT(unit->sharded_state() == ShardedState::kSharded &&
                              !unit->has_pending_all_gather(),
                          "[fully_shard] unit '", unit->name(), "' is ",
                          to_string(unit->sharded_state()), " after backward");
    unit->set_training_state(TrainingState::kIdle);
  }
  order_frozen_ = order_frozen_ || !forward_order_.empty();
}

void FsdpState::finish_eval_step() {
  for (auto& unit : units_) {
    unit->drop_pending_all_gather();
    if (unit->is_unsharded()) unit->reshard(ShardedState::kSharded);
    if (unit->sharded_state() == ShardedState::kShardedPostForward) unit->reshard_state_to_rest();
    unit->set_training_state(TrainingState::kIdle);
  }
}

// Note [Prefetch]
// ---------------
// The first step records the order in which units run forward. From then on:
//   forward_prefetch  pre-forward of unit i issues the all-gather of unit i+1 before unit i
//                     computes, so the collective (on Gloo's worker threads, or the MPI
//                     backend's communication thread) overlaps unit i's forward;
//   backward "pre"    pre-backward of unit i issues the all-gather of unit i-1 (backward runs
//                     in reverse forward order) before unit i's backward computes;
//   backward "post"   the same, but after unit i's reduce-scatter was issued (less memory:
//                     unit i is resharded before unit i-1 is gathered; less overlap).
// A prefetched unit is consumed by its own pre-forward / pre-backward (FsdpParamGroup::
// unshard waits for the pending all-gather). limit_all_gathers skips a prefetch when two
// non-root units already hold unsharded parameters or pending all-gathers, capping the
// parameter memory in flight at two units. Every rank takes the same decisions in the same
// order, so the collectives match.
void FsdpState::record_forward(FsdpParamGroup& unit) {
  if (order_frozen_ || unit.order_index >= 0) return;
  unit.order_index = static_cast<int>(forward_order_.size());
  forward_order_.push_back(&unit);
}

bool FsdpState::may_prefetch(FsdpParamGroup& candidate) {
  if (candidate.is_unsharded() || candidate.has_pending_all_gather()) return false;
  if (candidate.params().empty() || shard_group_->size() == 1) return false;
  if (config_.limit_all_gathers) {
    int in_flight = 0;
    for (auto& unit : units_) {
      if (!unit->is_root() && (unit->is_unsharded() || unit->has_pending_all_gather())) {
        ++in_flight;
      }
    }
    if (in_flight >= 2) {
      ++num_prefetches_limited_;
      return false;
    }
  }
  return true;
}

void FsdpState::prefetch_after_forward_of(FsdpParamGroup& unit) {
  if (!order_frozen_ || unit.order_index < 0) return;
  const size_t next = static_cast<size_t>(unit.order_index) + 1;
  if (next >= forward_order_.size()) return;
  FsdpParamGroup& candidate = *forward_order_[next];
  if (candidate.sharded_state() != ShardedState::kSharded) return;
  if (!may_prefetch(candidate)) return;
  candidate.issue_all_gather();
  ++num_prefetches_;
}

void FsdpState::prefetch_before_backward_of(FsdpParamGroup& unit) {
  if (unit.order_index <= 0) return;
  FsdpParamGroup& candidate = *forward_order_[unit.order_index - 1];
  // Only a unit that ran forward in this step and awaits its backward.
  if (candidate.sharded_state() != ShardedState::kShardedPostForward) return;
  if (candidate.training_state() != TrainingState::kForward) return;
  if (!may_prefetch(candidate)) return;
  candidate.issue_all_gather();
  ++num_prefetches_;
}

}  // namespace fsdp::detail
