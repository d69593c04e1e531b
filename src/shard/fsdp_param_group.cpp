#include "shard/fsdp_param_group.h"

#include "fsdp/activation_checkpointing.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

const char* to_string(ShardedState state) {
  switch (state) {
    case ShardedState::kSharded:
      return "kSharded";
    case ShardedState::kReshardedAfterForward:
      return "kReshardedAfterForward";
    case ShardedState::kUnsharded:
      return "kUnsharded";
  }
  return "?";
}

const char* to_string(TrainingState state) {
  switch (state) {
    case TrainingState::kIdle:
      return "kIdle";
    case TrainingState::kForward:
      return "kForward";
    case TrainingState::kPreBackward:
      return "kPreBackward";
    case TrainingState::kPostBackward:
      return "kPostBackward";
  }
  return "?";
}

FsdpParamGroup::FsdpParamGroup(std::string name, fsdp::nn::Module* module, UnitConfig config)
    : name_(std::move(name)), module_(module), config_(std::move(config)) {
  TORCH_INTERNAL_ASSERT(config_.shard_group, "unit '", name_, "' has no shard group");
}

FsdpParam& FsdpParamGroup::add_param(at::Tensor unsharded, FsdpParam::Registration reg) {
  const auto& mp = config_.mixed_precision;
  params_.push_back(std::make_unique<FsdpParam>(
      std::move(unsharded), std::move(reg), config_.shard_group->rank(),
      config_.shard_group->size(), mp ? mp->param_dtype : std::nullopt, config_.device));
  return *params_.back();
}

void FsdpParamGroup::init() {
  // Trainable parameters share one dtype; frozen ones (a quantized base's uint8 weights) may
  // have any. See Note [Units of mixed dtypes] in collectives.cpp.
  const FsdpParam* first_trainable = nullptr;
  for (auto& p : params_) {
    if (p->requires_grad()) {
      if (first_trainable == nullptr) first_trainable = p.get();
      TORCH_CHECK(p->sharded_dtype() == first_trainable->sharded_dtype(),
                  "[FSDPStrategy] unit '", name_, "' mixes trainable dtypes: '", p->fqn(),
                  "' is ", p->sharded_dtype(), " but '", first_trainable->fqn(), "' is ",
                  first_trainable->sharded_dtype(),
                  ". HINT: wrap trainable parameters of different dtypes in separate units "
                  "(frozen parameters may have any dtype).");
    }
    p->shard();
  }
  layout_ = flat_layout(params_);
  // See Note [Mixed-precision parameters] in fsdp_param.h: nothing to gather only when S is P
  // for every parameter.
  aliased_ = !params_.empty();
  for (auto& p : params_) aliased_ = aliased_ && p->aliased();
  const auto& mp = config_.mixed_precision;
  if (!params_.empty()) {
    // The unit's compute dtype is its first floating parameter's; reductions use the trainable
    // parameters' dtype.
    compute_dtype_ = params_.front()->compute_dtype();
    for (auto& p : params_) {
      if (at::isFloatingType(p->compute_dtype())) {
        compute_dtype_ = p->compute_dtype();
        break;
      }
    }
    const at::ScalarType grad_dtype =
        first_trainable ? first_trainable->compute_dtype() : compute_dtype_;
    reduce_dtype_ = mp ? mp->reduce_dtype_or(grad_dtype) : grad_dtype;
    if (!at::isFloatingType(grad_dtype)) reduce_dtype_ = grad_dtype;
  }
  sharded_state_ = ShardedState::kSharded;
  training_state_ = TrainingState::kIdle;
}

int64_t FsdpParamGroup::unsharded_bytes() const {
  int64_t total = 0;
  for (const auto& p : params_) total += p->full_nbytes();
  return total;
}

int64_t FsdpParamGroup::unsharded_numel() const {
  int64_t total = 0;
  for (const auto& p : params_) total += p->unsharded().numel();
  return total;
}

void FsdpParamGroup::transition(ShardedState next) {
  const ShardedState cur = sharded_state_;
  const bool ok =
      (cur != ShardedState::kUnsharded && next == ShardedState::kUnsharded) ||
      (cur == ShardedState::kUnsharded && next != ShardedState::kUnsharded) ||
      (cur == ShardedState::kReshardedAfterForward && next == ShardedState::kSharded);
  TORCH_INTERNAL_ASSERT(ok, "[FSDPStrategy] invalid state transition ", to_string(cur), " -> ",
                        to_string(next), " in unit '", name_, "' (training state ",
                        to_string(training_state_), ")");
  sharded_state_ = next;
  for (const auto& p : params_) {
    if (p->aliased()) continue;
    TORCH_INTERNAL_ASSERT(p->unsharded_allocated() == (next == ShardedState::kUnsharded),
                          "parameter '", p->fqn(), "' storage does not match state ",
                          to_string(next));
  }
}

// --- collectives ---------------------------------------------------------------------------

void FsdpParamGroup::issue_all_gather() {
  TORCH_INTERNAL_ASSERT(!is_unsharded() && !has_pending_all_gather(),
                        "all-gather issued for unit '", name_, "' in state ",
                        to_string(sharded_state_));
  if (aliased_ || params_.empty()) return;  // nothing to gather
  if (!residency_) {
    pending_ag_ = all_gather(params_, layout_, *config_.shard_group, compute_dtype_);
    return;
  }
  // Parameters on disk: the shards are in RAM from here until the copy-in is done (the
  // all-gather input holds them then). See Note [Parameters on disk] in docs/design.md.
  for (auto& p : params_) residency_->acquire(p->sharded());
  auto release = [&] {
    for (auto& p : params_) residency_->release(p->sharded(), /*modified=*/false);
  };
  try {
    pending_ag_ = all_gather(params_, layout_, *config_.shard_group, compute_dtype_);
  } catch (...) {
    release();
    throw;
  }
  release();
}

void FsdpParamGroup::unshard() {
  if (!has_pending_all_gather()) issue_all_gather();
  if (has_pending_all_gather()) all_gather_copy_out(pending_ag_, params_, layout_);
  transition(ShardedState::kUnsharded);
}

void FsdpParamGroup::drop_pending_all_gather() {
  if (!has_pending_all_gather()) return;
  pending_ag_.work->wait();
  pending_ag_ = AllGather{};
}

void FsdpParamGroup::reshard(ShardedState next) {
  TORCH_INTERNAL_ASSERT(next != ShardedState::kUnsharded, "reshard to kUnsharded");
  for (auto& p : params_) p->free_unsharded();
  transition(next);
}

void FsdpParamGroup::mark_at_rest() { transition(ShardedState::kSharded); }

void FsdpParamGroup::issue_reduce_scatter() {
  auto rs = reduce_scatter(params_, layout_, *config_.shard_group, config_.replicate_group,
                           reduce_dtype_);
  if (rs) pending_rs_.push_back(std::move(*rs));
}

void FsdpParamGroup::finish_reduce_scatter() {
  for (auto& rs : pending_rs_) {
    reduce_scatter_copy_out(rs, params_, layout_, config_.replicate_group);
  }
  pending_rs_.clear();
}

// --- the unit's part of each hook ------------------------------------------------------------

void FsdpParamGroup::pre_forward() {
  training_state_ = TrainingState::kForward;
  if (!is_unsharded()) unshard();
}

// Note [Checkpointed units]
// -------------------------
// Activation checkpointing (fsdp/activation_checkpointing.h) replaces a module's forward by a
// function that runs it without grad and re-runs it in backward. The module's call hooks run
// around that wrapper, in forward only:
//   - a checkpointed module that is a unit: pre-forward unshards and wraps the inputs in the
//     post-backward function, the block runs without grad, post-forward reshards (FULL_SHARD)
//     and hooks the output. In backward the output's pre-backward hook unshards the unit again
//     (or finds it prefetched) before the checkpoint function recomputes, so the recompute
//     sees full parameters; the nested backward accumulates P.grad, and the post-backward
//     function fires once, after it, with the whole gradient.
//   - a unit inside a checkpointed block: its forward under no-grad installs no backward hooks;
//     the recompute (in backward) calls it again with grad, so its pre-forward unshards it and
//     installs them. Its post-forward must not reshard then: its backward follows at once
//     (resharding would cost a second all-gather in pre-backward), and no forward prefetch is
//     issued from a recompute.
void FsdpParamGroup::post_forward() {
  if (config_.reshard_after_forward && is_unsharded() && !fsdp::in_activation_recompute()) {
    reshard(ShardedState::kReshardedAfterForward);
  }
}

void FsdpParamGroup::pre_backward() {
  ++backward_pending_;
  training_state_ = TrainingState::kPreBackward;
  if (!is_unsharded()) unshard();
}

// Note [No-sync gradient accumulation]
// ------------------------------------
// On a non-boundary micro-batch (Strategy::pre_forward(module, sync=false)) post-backward
// reshards the parameters but does not reduce-scatter: the unsharded gradients stay in P.grad
// and the next micro-batches' AccumulateGrad adds into them. The boundary micro-batch then
// reduce-scatters the sum once. Trade-off, per rank:
//   kept here    +4 B x (all trainable parameters, unsharded) for the whole accumulation window
//                (the full gradient, as DDP's no_sync), and 1 reduce-scatter per optimizer step;
//   the other way (reduce every micro-batch into S.grad) would hold only 4 B x params / W but
//                pay k reduce-scatters per optimizer step of k micro-batches.
// We follow PyTorch FSDP's no_sync: communication is the scarce resource on CPU ranks. Users
// short of memory run accumulate_grad_batches=1 with a larger per-rank batch instead.
bool FsdpParamGroup::post_backward(bool sync) {
  if (backward_pending_ > 0) --backward_pending_;
  if (backward_pending_ > 0) return false;  // another call of this unit still runs its backward
  TORCH_INTERNAL_ASSERT(is_unsharded(), "[FSDPStrategy] post-backward of unit '", name_,
                        "' found it ", to_string(sharded_state_), "; its parameters were freed "
                        "before its backward finished");
  if (sync) issue_reduce_scatter();  // See Note [No-sync gradient accumulation]
  reshard(ShardedState::kSharded);
  training_state_ = TrainingState::kPostBackward;
  return true;
}

void FsdpParamGroup::finalize_backward(bool sync) {
  drop_pending_all_gather();
  if (is_unsharded()) {
    // Still unsharded: the root, a unit whose inputs needed no grad, a SHARD_GRAD_OP unit
    // without backward. Reduce whatever gradients it received.
    if (sync) issue_reduce_scatter();
    reshard(ShardedState::kSharded);
  } else if (sharded_state_ == ShardedState::kReshardedAfterForward) {
    // Ran forward but no gradient reached it (e.g. every output was unused): nothing to reduce.
    // Gradients may still have accumulated earlier without sync: they stay in P.grad.
    mark_at_rest();
  }
  backward_pending_ = 0;
  training_state_ = TrainingState::kPostBackward;
}

}  // namespace fsdp::detail
