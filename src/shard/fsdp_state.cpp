// FsdpState: building the units, installing the hooks, and the hooks themselves. One step of
// FULL_SHARD, as this file drives it (see also docs/design.md, "The engine, top-down"):
//
//   begin_step          the root unit is unsharded (Strategy::pre_forward)
//   pre_forward(u)      unit u is unsharded (or finds its prefetched all-gather), the next unit's
//                       all-gather is prefetched (forward_prefetch), inputs are cast (mixed
//                       precision) and routed through the post-backward function
//   post_forward(u)     u is resharded (FULL_SHARD); its output gets the pre-backward hook
//   pre_backward(u)     u is unsharded again; the previous unit's all-gather is prefetched
//   post_backward(u)    u's gradients are reduce-scattered, u is resharded; the reduce-scatter
//                       issued before it is finished (one in flight)
//   on_backward_end     units whose post-backward did not run are finished
//   finish_step         every reduce-scatter is finished (Strategy::post_backward)
#include "shard/fsdp_state.h"

#include "fsdp/activation_checkpointing.h"
#include "fsdp/nn.h"
#include "fsdp/sharded_compute.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <cstdlib>
#include <functional>

namespace fsdp::detail {
namespace {

// Note [Post-backward function]
// -----------------------------
// libtorch has no module backward hooks. In pre-forward, the unit's inputs that require grad go
// through this identity function; its backward runs once every gradient flowing to those
// inputs is computed, i.e. after the unit's own backward. The gradients of the unit's
// parameters are accumulated by AccumulateGrad nodes that become ready at the same time or
// earlier and run first (they have the highest priority in the engine's ready queue), so P.grad
// is complete when this fires. Units whose inputs do not require grad (the first layer after
// the token ids) and the root unit are finished by the end-of-backward callback instead.
// The node outlives the state when the graph does: it reaches the state (and the unit, which the
// state owns) only through a checked AliveRef; a dead state's post-backward does nothing (see
// Note [Gradient buckets] in src/ddp/grad_buckets.h, "Liveness").
struct UnitRef : torch::CustomClassHolder {
  AliveRef<FsdpState> state;
  FsdpParamGroup* unit = nullptr;  // owned by the state: used only inside state.if_alive
};

struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, c10::IValue unit_ref) {
    ctx->saved_data["unit"] = std::move(unit_ref);
    return torch::autograd::variable_list(inputs.begin(), inputs.end());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* ref = static_cast<const UnitRef*>(ctx->saved_data["unit"].toCapsule().get());
    ref->state.if_alive([&](FsdpState& state) { state.post_backward(*ref->unit); });
    grads.emplace_back();  // for unit_ref
    return grads;
  }
};

}  // namespace

FsdpState::FsdpState(FsdpConfig config, ProcessGroupPtr shard_group,
                     ProcessGroupPtr replicate_group)
    : config_(config),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)) {}

FsdpState::~FsdpState() {
  alive_.expire();
  // The model may outlive the strategy: its modules stop calling into us. A module that died
  // first took its hooks with it.
  for (const auto& h : hooks_) {
    if (auto module = h.module.lock()) {
      h.hooked->remove_hook(h.pre_forward);
      h.hooked->remove_hook(h.post_forward);
    }
  }
  for (const auto& m : sharded_modules_) {
    if (auto module = m.module.lock()) m.sharded->set_shard_context(nullptr);
  }
}

std::unique_ptr<FsdpParamGroup> FsdpState::new_unit(std::string name, fsdp::nn::Module* module,
                                                    bool reshard) {
  UnitConfig unit;
  unit.shard_group = shard_group_;
  unit.replicate_group = replicate_group_;
  unit.reshard_after_forward = reshard;
  unit.mixed_precision = config_.mixed_precision;
  unit.device = config_.device;
  return std::make_unique<FsdpParamGroup>(std::move(name), module, std::move(unit));
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
        // A unit holder's parameters are registered in the wrapped module too (Note [Unit
        // holders] in src/nn/unit.cpp): both dicts get the sharded parameter.
        for (torch::nn::Module* dict_owner : parameter_owners(m)) {
          for (auto& item : registered_parameters(*dict_owner)) {
            const std::string& name = item.key();
            const at::Tensor& tensor = item.value();
            if (!tensor.defined()) continue;
            if (config_.ignored.count(tensor.unsafeGetTensorImpl())) continue;  // FSDPOptions::ignored_params
            if (!registered.insert({dict_owner, name}).second) continue;
            FsdpParam::Registration reg{dict_owner, name, prefix + name};
            auto found = seen.find(tensor.unsafeGetTensorImpl());
            if (found != seen.end()) {
              TORCH_CHECK(found->second.unit == owner, "[FSDPStrategy] parameter '", reg.fqn,
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
        }
        for (auto& child : m.named_children()) {
          visit(*child.value(), prefix + child.key() + ".", owner);
        }
      };
  visit(root, "", units_.front().get());

  for (const auto& [module, unit] : unit_of) {
    TORCH_CHECK(visited.count(module), "[FSDPStrategy] unit '", unit->name(),
                "' is not a submodule of the model given to the strategy. HINT: register the "
                "module (register_module) before wrapping it.");
  }
}

void FsdpState::materialize() {
  for (auto& unit : units_) {
    if (!preinitialized_.count(unit.get())) unit->init();  // deferred units are sharded
  }
  const AliveRef<FsdpState> self = alive_.ref(this);
  for (auto& unit : units_) {
    if (unit->is_root()) continue;
    if (hand_shards_to_module(*unit)) continue;
    FsdpParamGroup* u = unit.get();
    fsdp::nn::Module* m = unit->module();
    InstalledHooks h;
    try {
      h.module = m->shared_from_this();
    } catch (const std::bad_weak_ptr&) {
      // Not owned by a shared_ptr: its hooks stay and check `self` instead.
    }
    h.hooked = m;
    h.pre_forward = m->add_pre_forward_hook(
        [self, u](fsdp::nn::Module&, fsdp::nn::Inputs& inputs) {
          self.if_alive([&](FsdpState& state) { state.pre_forward(*u, inputs); });
        });
    h.post_forward = m->add_post_forward_hook(
        [self, u](fsdp::nn::Module&, const fsdp::nn::Inputs&, at::Tensor& output) {
          self.if_alive([&](FsdpState& state) { state.post_forward(*u, output); });
        });
    hooks_.push_back(std::move(h));
  }
}

// Note [Units on shards]
// ----------------------
// A unit whose module implements fsdp::ShardedComputeModule and says yes computes on its shards
// (Note [Computing on shards] in src/nn/vocab_parallel.cpp): it gets a context with its shards
// (S, keyed by the names the module registered them under) and the shard group, and no hooks.
// It never leaves kSharded, so begin_step, on_backward_end and finish_step pass over it; the
// prefetcher never sees it (it is not in the forward order), and its S.grad is written by
// autograd, already averaged. Only where that is the same computation: a shard group of 2+
// ranks without a replicate group (HYBRID_SHARD would also need the replicas' all-reduce),
// parameters in RAM (offload moves S between uses) and only the module's own parameters.
// Everywhere else the unit is gathered as any other.
namespace {

// The registration of `p` in the unit's own module (or its holder's), or null.
const FsdpParam::Registration* own_registration(const FsdpParam& p,
                                                const std::vector<torch::nn::Module*>& owners) {
  for (const auto& reg : p.registrations()) {
    if (std::find(owners.begin(), owners.end(), reg.module) != owners.end()) return &reg;
  }
  return nullptr;
}

}  // namespace

bool FsdpState::computes_on_shards(const FsdpParamGroup& unit) const {
  if (unit.is_root() || unit.params().empty()) return false;
  auto* sharded = dynamic_cast<ShardedComputeModule*>(unit.module());
  if (!sharded || !sharded->computes_on_shards()) return false;
  const ProcessGroupPtr& group = unit.shard_group();
  if (!group || group->size() < 2) return false;
  if (unit.replicate_group() && unit.replicate_group()->size() > 1) return false;
  if (config_.offload_params != OffloadDevice::kNone) return false;
  const std::vector<torch::nn::Module*> owners = parameter_owners(*unit.module());
  for (const auto& p : unit.params()) {
    if (!own_registration(*p, owners)) return false;
  }
  return true;
}

bool FsdpState::hand_shards_to_module(FsdpParamGroup& unit) {
  if (!computes_on_shards(unit)) return false;
  auto* sharded = dynamic_cast<ShardedComputeModule*>(unit.module());
  const ProcessGroupPtr& group = unit.shard_group();
  auto context = std::make_shared<ShardContext>();
  context->group = group;
  const std::vector<torch::nn::Module*> owners = parameter_owners(*unit.module());
  for (const auto& p : unit.params()) {
    const FsdpParam::Registration* own = own_registration(*p, owners);
    if (p->casts()) context->compute_dtype = p->compute_dtype();
    ParamShard shard;
    shard.shard = p->sharded();
    shard.dim0 = p->dim0();
    shard.rows_per_rank = p->shard_rows();
    shard.rank = group->rank();
    context->params[own->name] = std::move(shard);
  }
  sharded->set_shard_context(std::move(context));
  ShardedModule m;
  try {
    m.module = unit.module()->shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    // Not owned by a shared_ptr: it keeps its context.
  }
  m.sharded = sharded;
  sharded_modules_.push_back(std::move(m));
  on_shards_.insert(&unit);
  return true;
}

void FsdpState::place_params_on_disk(ParamSwapper::Options options) {
  TORCH_INTERNAL_ASSERT(config_.offload_params == OffloadDevice::kNvme && !params_on_disk_,
                        "parameters placed on disk twice, or without offload_params nvme");
  std::vector<ParamSwapper::UnitParams> units;
  for (auto& unit : units_) {
    ParamSwapper::UnitParams up;
    up.name = unit->name();
    for (auto& p : unit->params()) up.params.push_back(p->sharded());
    units.push_back(std::move(up));
  }
  params_on_disk_ = std::make_unique<ParamSwapper>(std::move(units), std::move(options));
  for (auto& unit : units_) unit->set_residency(params_on_disk_.get());
}

std::vector<FsdpParam*> FsdpState::all_params() const {
  std::vector<FsdpParam*> out;
  for (const auto& unit : units_) {
    for (const auto& p : unit->params()) out.push_back(p.get());
  }
  return out;
}

// --- one step ------------------------------------------------------------------------------------

void FsdpState::begin_step(bool sync) {
  RECORD_FUNCTION("FSDP::root_pre_forward", c10::ArrayRef<const c10::IValue>{});
  sync_ = sync;
  for (auto& unit : units_) {
    // A previous forward without backward (e.g. the loss was not used) leaves units unsharded
    // or resharded-after-forward: bring them back to rest.
    unit->drop_pending_all_gather();
    if (!unit->is_root() && unit->is_unsharded()) unit->reshard(ShardedState::kSharded);
    if (unit->sharded_state() == ShardedState::kReshardedAfterForward) unit->mark_at_rest();
    unit->set_training_state(TrainingState::kIdle);
  }
  FsdpParamGroup& root = root_unit();
  if (!root.params().empty() && !root.is_unsharded()) root.unshard();
  note_live();
  root.set_training_state(TrainingState::kForward);
}

void FsdpState::pre_forward(FsdpParamGroup& unit, std::vector<at::Tensor>& inputs) {
  RECORD_FUNCTION("FSDP::pre_forward", c10::ArrayRef<const c10::IValue>{});
  record_forward(unit);
  make_room_for(unit);
  unit.pre_forward();
  note_live();
  // A recomputed forward runs during backward: no forward prefetch then. See Note
  // [Checkpointed units] in fsdp_param_group.cpp.
  if (config_.forward_prefetch && !fsdp::in_activation_recompute()) {
    if (config_.prefetch_bucket_numel > 0) {
      prefetch_window(unit, /*forward=*/true);
    } else {
      prefetch_after_forward_of(unit);
    }
  }
  // Mixed precision: floating inputs compute in the parameters' dtype. FSDP2 casts at the root
  // only; a unit may also receive fp32 from un-cast code (e.g. an fp32 buffer added to bf16
  // activations), so every unit casts its own inputs (a no-op when they already match).
  const auto& mp = config_.mixed_precision;
  if (mp && mp->param_dtype) {
    for (auto& x : inputs) {
      if (x.defined() && x.is_floating_point() && x.scalar_type() != *mp->param_dtype) {
        x = x.to(*mp->param_dtype);
      }
    }
  }
  if (!at::GradMode::is_enabled()) return;
  // See Note [Post-backward function].
  std::vector<at::Tensor> with_grad;
  std::vector<size_t> where;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      with_grad.push_back(inputs[i]);
      where.push_back(i);
    }
  }
  if (with_grad.empty()) return;
  auto ref = c10::make_intrusive<UnitRef>();
  ref->state = alive_.ref(this);
  ref->unit = &unit;
  auto outputs = PostBackwardFunction::apply(at::TensorList(with_grad),
                                             c10::IValue::make_capsule(std::move(ref)));
  for (size_t k = 0; k < where.size(); ++k) inputs[where[k]] = outputs[k];
}

void FsdpState::post_forward(FsdpParamGroup& unit, at::Tensor& output) {
  RECORD_FUNCTION("FSDP::post_forward", c10::ArrayRef<const c10::IValue>{});
  unit.post_forward();
  if (output.defined() && output.requires_grad() && at::GradMode::is_enabled()) {
    FsdpParamGroup* u = &unit;
    // A graph that outlives the state reaches this hook with nobody left to unshard the unit:
    // with its parameters freed after forward, its backward would read freed storage.
    const bool resharded = unit.sharded_state() == ShardedState::kReshardedAfterForward;
    on_gradient_of(
        output, alive_.ref(this), [u](FsdpState& state) { state.pre_backward(*u); },
        [resharded, name = unit.name()] {
          TORCH_CHECK(!resharded, "[FSDPStrategy] backward reached unit '", name,
                      "' after its FSDPStrategy was destroyed; the unit's parameters were "
                      "resharded after forward and only the strategy can gather them again. "
                      "---> HINT: keep the strategy alive until backward has run (destroy it "
                      "after post_backward)");
        });
  }
}

void FsdpState::pre_backward(FsdpParamGroup& unit) {
  RECORD_FUNCTION("FSDP::pre_backward", c10::ArrayRef<const c10::IValue>{});
  on_backward_start();
  make_room_for(unit);
  unit.pre_backward();
  note_live();
  if (config_.backward_prefetch == BackwardPrefetch::kPre) prefetch_before_backward_of(unit);
}

void FsdpState::post_backward(FsdpParamGroup& unit) {
  RECORD_FUNCTION("FSDP::post_backward", c10::ArrayRef<const c10::IValue>{});
  if (!unit.post_backward(sync_)) return;  // another call of the unit is still in backward
  if (sync_) reduce_scatter_issued(unit);
  if (config_.backward_prefetch == BackwardPrefetch::kPost) prefetch_before_backward_of(unit);
}

void FsdpState::hook_loss(const at::Tensor& loss) {
  on_gradient_of(loss, alive_.ref(this), [](FsdpState& state) { state.on_backward_start(); });
}

void FsdpState::on_backward_start() {
  if (callback_queued_) return;
  callback_queued_ = true;
  order_frozen_ = true;  // the forward order of this step drives prefetching from now on
  queue_end_of_backward(alive_.ref(this), [](FsdpState& state) { state.on_backward_end(); });
}

void FsdpState::on_backward_end() {
  RECORD_FUNCTION("FSDP::root_post_backward", c10::ArrayRef<const c10::IValue>{});
  // Non-root units in reverse forward order, then the root: the same order on every rank.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    if (!(*it)->is_root()) (*it)->finalize_backward(sync_);
  }
  root_unit().finalize_backward(sync_);
  callback_queued_ = false;
}

// Note [One reduce-scatter in flight]
// A unit's reduce-scatter input is its whole unsharded gradient laid out rank-major
// (W x shard numel). Waiting for every unit's reduce-scatter only in finish_step would keep all
// those inputs alive until the end of backward: the full unsharded gradient of the model, which
// is exactly what sharding gradients is meant to avoid (measured on transformer-small at world
// 2: +117 MiB of peak). So when unit k has issued its reduce-scatter, the one issued before it
// (unit k+1 in backward order) is finished: waited for, its input freed, its output turned into
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
  RECORD_FUNCTION("FSDP::finish_step", c10::ArrayRef<const c10::IValue>{});
  reduce_scatter_in_flight_ = nullptr;
  // Backward ran without any hook of ours (e.g. loss.backward() called directly on a model
  // whose only unit is the root): finish the units now.
  bool unfinished = false;
  for (auto& unit : units_) {
    unfinished |= unit->is_unsharded() || unit->has_pending_all_gather() ||
                  unit->sharded_state() == ShardedState::kReshardedAfterForward;
  }
  if (unfinished) on_backward_end();
  for (auto& unit : units_) unit->finish_reduce_scatter();
  for (auto& unit : units_) {
    TORCH_INTERNAL_ASSERT(unit->sharded_state() == ShardedState::kSharded &&
                              !unit->has_pending_all_gather(),
                          "[FSDPStrategy] unit '", unit->name(), "' is ",
                          to_string(unit->sharded_state()), " after backward");
    unit->set_training_state(TrainingState::kIdle);
  }
  order_frozen_ = order_frozen_ || !forward_order_.empty();
}

void FsdpState::finish_eval_step() {
  for (auto& unit : units_) {
    unit->drop_pending_all_gather();
    if (unit->is_unsharded()) unit->reshard(ShardedState::kSharded);
    if (unit->sharded_state() == ShardedState::kReshardedAfterForward) unit->mark_at_rest();
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
  if (order_frozen_ || order_index_.count(&unit)) return;
  order_index_[&unit] = static_cast<int>(forward_order_.size());
  forward_order_.push_back(&unit);
}

bool FsdpState::may_prefetch(FsdpParamGroup& candidate) {
  if (candidate.is_unsharded() || candidate.has_pending_all_gather()) return false;
  if (candidate.params().empty() || shard_group_->size() == 1) return false;
  if (config_.max_live_numel > 0 &&
      live_numel() + candidate.unsharded_numel() > config_.max_live_numel) {
    ++num_prefetches_limited_;
    return false;
  }
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
  auto it = order_index_.find(&unit);
  if (!order_frozen_ || it == order_index_.end()) return;
  const size_t next = static_cast<size_t>(it->second) + 1;
  if (next >= forward_order_.size()) return;
  FsdpParamGroup& candidate = *forward_order_[next];
  if (candidate.sharded_state() != ShardedState::kSharded) return;
  if (!may_prefetch(candidate)) return;
  candidate.issue_all_gather();
  ++num_prefetches_;
  note_live();
}

void FsdpState::prefetch_before_backward_of(FsdpParamGroup& unit) {
  if (config_.prefetch_bucket_numel > 0) {
    prefetch_window(unit, /*forward=*/false);
    return;
  }
  auto it = order_index_.find(&unit);
  if (it == order_index_.end() || it->second <= 0) return;
  FsdpParamGroup& candidate = *forward_order_[it->second - 1];
  // Only a unit that ran forward in this step and awaits its backward.
  if (candidate.sharded_state() != ShardedState::kReshardedAfterForward) return;
  if (candidate.training_state() != TrainingState::kForward) return;
  if (!may_prefetch(candidate)) return;
  candidate.issue_all_gather();
  ++num_prefetches_;
  note_live();
}

// Note [Prefetch window]
// ----------------------
// ZeRO-3's two knobs, in elements as in DeepSpeed (PartitionedParameterCoordinator):
//   prefetch_bucket_numel (stage3_prefetch_bucket_size)  instead of one unit ahead, the units
//       that follow in the recorded order (forward: the next ones; backward: the previous ones)
//       are all-gathered ahead as long as the elements ahead, in flight or already unsharded,
//       stay within the bucket. Unlike DeepSpeed, whose loop stops only after the bucket is
//       exceeded, the bound is strict: a unit larger than the bucket is gathered on demand.
//   max_live_numel (stage3_max_live_parameters)  a prefetch that would take the elements of all
//       unsharded and in-flight units above it is not issued (DeepSpeed caps its prefetch at
//       max_live - available the same way). A unit that must be gathered now (its forward or
//       backward starts) first drops prefetched all-gathers, furthest in the order first, until
//       it fits; they are gathered again when their unit runs. So the live elements never exceed
//       max_live_numel, except by what the running units themselves need (the current unit,
//       its ancestors, the root unit).
// Units are released after their forward (FULL_SHARD) and after their backward, as DeepSpeed
// releases a submodule's parameters (stage3_max_reuse_distance, which keeps parameters reused
// soon, is not implemented). Every rank takes the same decisions in the same order, so the
// collectives stay matched.
int64_t FsdpState::live_numel() const {
  int64_t n = 0;
  for (const auto& unit : units_) {
    if (unit->is_unsharded() || unit->has_pending_all_gather()) n += unit->unsharded_numel();
  }
  return n;
}

void FsdpState::prefetch_window(FsdpParamGroup& unit, bool forward) {
  auto it = order_index_.find(&unit);
  if (!order_frozen_ || it == order_index_.end()) return;
  const int step = forward ? 1 : -1;
  const int n = static_cast<int>(forward_order_.size());
  int64_t ahead = 0;
  for (int i = it->second + step; i >= 0 && i < n; i += step) {
    FsdpParamGroup& c = *forward_order_[static_cast<size_t>(i)];
    if (c.params().empty()) continue;
    const int64_t numel = c.unsharded_numel();
    if (c.is_unsharded() || c.has_pending_all_gather()) {
      ahead += numel;  // in flight already: part of the window
      if (ahead >= config_.prefetch_bucket_numel) return;
      continue;
    }
    // Forward: a unit that has not run in this step; backward: one that ran forward and awaits
    // its backward.
    const bool eligible =
        forward ? c.sharded_state() == ShardedState::kSharded
                : c.sharded_state() == ShardedState::kReshardedAfterForward &&
                      c.training_state() == TrainingState::kForward;
    if (!eligible) continue;
    if (ahead + numel > config_.prefetch_bucket_numel) return;
    if (!may_prefetch(c)) return;
    c.issue_all_gather();
    ++num_prefetches_;
    ahead += numel;
    note_live();
  }
}

void FsdpState::make_room_for(FsdpParamGroup& unit) {
  if (config_.max_live_numel <= 0) return;
  if (unit.is_unsharded() || unit.has_pending_all_gather()) return;
  const int64_t need = unit.unsharded_numel();
  if (live_numel() + need <= config_.max_live_numel) return;
  auto pos = [&](const FsdpParamGroup* u) {
    auto f = order_index_.find(u);
    return f == order_index_.end() ? 0 : f->second;
  };
  const int here = pos(&unit);
  std::vector<FsdpParamGroup*> prefetched;
  for (auto& u : units_) {
    if (u.get() != &unit && u->has_pending_all_gather()) prefetched.push_back(u.get());
  }
  std::stable_sort(prefetched.begin(), prefetched.end(),
                   [&](const FsdpParamGroup* a, const FsdpParamGroup* b) {
                     return std::abs(pos(a) - here) > std::abs(pos(b) - here);
                   });
  for (FsdpParamGroup* u : prefetched) {
    if (live_numel() + need <= config_.max_live_numel) break;
    u->drop_pending_all_gather();
    ++num_prefetches_evicted_;
  }
}

}  // namespace fsdp::detail
