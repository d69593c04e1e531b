#include "shard/fsdp_param_group.h"

#include "fsdp/activation_checkpointing.h"
#include "fsdp/nn.h"
#include "shard/fsdp_state.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp::detail {

const char* to_string(ShardedState state) {
  switch (state) {
    case ShardedState::kSharded:
      return "kSharded";
    case ShardedState::kShardedPostForward:
      return "kShardedPostForward";
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
struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t unit_address) {
    ctx->saved_data["unit"] = unit_address;
    return torch::autograd::variable_list(inputs.begin(), inputs.end());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* unit = reinterpret_cast<FsdpParamGroup*>(ctx->saved_data["unit"].toInt());
    unit->post_backward();
    grads.emplace_back();  // for unit_address
    return grads;
  }
};

}  // namespace

FsdpParamGroup::FsdpParamGroup(std::string name, fsdp::nn::Module* module, FsdpState* state,
                               ProcessGroupPtr shard_group, ProcessGroupPtr replicate_group,
                               bool reshard_after_forward)
    : name_(std::move(name)),
      module_(module),
      state_(state),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      reshard_after_forward_(reshard_after_forward) {
  TORCH_INTERNAL_ASSERT(shard_group_, "unit '", name_, "' has no shard group");
}

FsdpParam& FsdpParamGroup::add_param(at::Tensor unsharded, FsdpParam::Registration reg) {
  const auto& mp = state_->config().mixed_precision;
  params_.push_back(std::make_unique<FsdpParam>(std::move(unsharded), std::move(reg),
                                                shard_group_->rank(), shard_group_->size(),
                                                mp ? mp->param_dtype : std::nullopt));
  return *params_.back();
}

void FsdpParamGroup::init() {
  ag_offsets_.clear();
  rs_offsets_.clear();
  ag_total_ = rs_total_ = 0;
  // See Note [Units of mixed dtypes].
  byte_all_gather_ = false;
  const FsdpParam* first_trainable = nullptr;
  for (auto& p : params_) {
    byte_all_gather_ |= p->compute_dtype() != params_.front()->compute_dtype();
    if (!p->requires_grad()) continue;
    if (first_trainable == nullptr) first_trainable = p.get();
    TORCH_CHECK(p->sharded_dtype() == first_trainable->sharded_dtype(),
                "[fully_shard] unit '", name_, "' mixes trainable dtypes: '", p->fqn(), "' is ",
                p->sharded_dtype(), " but '", first_trainable->fqn(), "' is ",
                first_trainable->sharded_dtype(),
                ". HINT: wrap trainable parameters of different dtypes in separate units (frozen "
                "parameters may have any dtype).");
  }
  for (auto& p : params_) {
    ag_offsets_.push_back(ag_total_);
    ag_total_ += byte_all_gather_ ? aligned_bytes(p->shard_numel() * p->compute_element_size())
                                  : p->shard_numel();
    if (p->requires_grad()) {
      rs_offsets_.push_back(rs_total_);
      rs_total_ += p->shard_numel();
    } else {
      rs_offsets_.push_back(-1);
    }
    p->shard();
  }
  // See Note [Mixed-precision parameters] in fsdp_param.h.
  aliased_ = !params_.empty();
  for (auto& p : params_) aliased_ = aliased_ && p->aliased();
  const auto& mp = state_->config().mixed_precision;
  if (!params_.empty()) {
    // The unit's compute dtype: its (first) floating parameters'; reductions use the trainable
    // parameters' dtype.
    compute_dtype_ = params_.front()->compute_dtype();
    for (auto& p : params_) {
      if (at::isFloatingType(p->compute_dtype())) {
        compute_dtype_ = p->compute_dtype();
        break;
      }
    }
    const at::ScalarType grad_dtype = first_trainable ? first_trainable->compute_dtype() : compute_dtype_;
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

void FsdpParamGroup::transition(ShardedState next) {
  const ShardedState cur = sharded_state_;
  const bool ok = (cur != ShardedState::kUnsharded && next == ShardedState::kUnsharded) ||
                  (cur == ShardedState::kUnsharded && next != ShardedState::kUnsharded) ||
                  (cur == ShardedState::kShardedPostForward && next == ShardedState::kSharded);
  TORCH_INTERNAL_ASSERT(ok, "[fully_shard] invalid state transition ", to_string(cur), " -> ",
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

// Note [Units of mixed dtypes]
// ----------------------------
// A unit may hold parameters of different dtypes when only one dtype is trainable: QLoRA's
// layers hold frozen uint8 4-bit weights, frozen fp32 norms and trainable fp32 adapters (and
// under mixed precision the adapters compute in bf16 while the uint8 weights are never cast).
// Then the all-gather moves bytes: parameter i's shard occupies aligned_bytes(numel_i *
// itemsize_i) bytes at byte offset o_i of a uint8 all-gather input (offsets 16-byte aligned, so
// every slice can be viewed as its dtype), and copy-in/copy-out view those slices as the
// parameter's compute dtype. Reduce-scatters involve trainable parameters only, which must share
// one dtype. A unit of one dtype all-gathers in that dtype as before.

// Note [Unit all-gather]
// ----------------------
// Copy-in: every sharded parameter of the unit goes into one flat all-gather input of
// ag_total = sum of shard numels elements (parameter i at offset o_i). One collective gathers
// the output (W * ag_total): rank w's input lands at [w * ag_total, (w+1) * ag_total).
// Copy-out: output.view({W, ag_total}).narrow(1, o_i, n_i) is (W, n_i); viewed as
// (W * R_i, row_i) and cut to dim0_i rows it is P_i's full value (FsdpParam::copy_out). Both
// flat buffers are freed right after copy-out, so a unit holds 2x its unsharded bytes only
// while copying out.
void FsdpParamGroup::issue_all_gather() {
  TORCH_INTERNAL_ASSERT(!is_unsharded() && !has_pending_all_gather(),
                        "all-gather issued for unit '", name_, "' in state ",
                        to_string(sharded_state_));
  if (aliased_ || params_.empty()) return;  // nothing to gather
  // In the compute dtype: bf16 all-gathers move half the bytes. See Note [Mixed-precision
  // parameters] in fsdp_param.h.
  const auto options = params_.front()->sharded().options()
                           .dtype(byte_all_gather_ ? at::kByte : compute_dtype_)
                           .requires_grad(false);
  at::NoGradGuard no_grad;
  pending_ag_.input = at::empty({ag_total_}, options);
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->copy_in(all_gather_slice(pending_ag_.input, i));
  pending_ag_.output = at::empty({shard_world() * ag_total_}, options);
  pending_ag_.work =
      shard_group_->all_gather_into_tensor_async(pending_ag_.output, pending_ag_.input);
}

at::Tensor FsdpParamGroup::all_gather_slice(const at::Tensor& buffer, size_t i) const {
  // buffer: the flat input (ag_total) or the rank-major output (W, ag_total).
  const FsdpParam& p = *params_[i];
  if (!byte_all_gather_) return buffer.narrow(-1, ag_offsets_[i], p.shard_numel());
  // See Note [Units of mixed dtypes].
  return buffer.narrow(-1, ag_offsets_[i], p.shard_numel() * p.compute_element_size())
      .view(p.compute_dtype());
}

void FsdpParamGroup::unshard() {
  if (!has_pending_all_gather()) issue_all_gather();
  at::NoGradGuard no_grad;
  if (has_pending_all_gather()) {
    pending_ag_.work->wait();
    pending_ag_.input = at::Tensor();
    at::Tensor rank_major = pending_ag_.output.view({shard_world(), ag_total_});
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i]->alloc_unsharded();
      params_[i]->copy_out(all_gather_slice(rank_major, i));
    }
    pending_ag_ = PendingAllGather{};
  }
  transition(ShardedState::kUnsharded);
}

void FsdpParamGroup::drop_pending_all_gather() {
  if (!has_pending_all_gather()) return;
  pending_ag_.work->wait();
  pending_ag_ = PendingAllGather{};
}

void FsdpParamGroup::reshard(ShardedState next) {
  TORCH_INTERNAL_ASSERT(next != ShardedState::kUnsharded, "reshard to kUnsharded");
  for (auto& p : params_) p->free_unsharded();
  transition(next);
}

void FsdpParamGroup::reshard_state_to_rest() { transition(ShardedState::kSharded); }

void FsdpParamGroup::free_unsharded_grads() {
  for (auto& p : params_) {
    if (!p->aliased() && p->unsharded().grad().defined()) {
      p->unsharded().mutable_grad() = at::Tensor();
    }
  }
}

// Note [Unit reduce-scatter]
// --------------------------
// Trainable parameters' unsharded gradients are laid out rank-major in one flat reduce-scatter
// input (W, rs_total): row w holds, for every trainable parameter at offset o_i, the rows
// [w*R_i, (w+1)*R_i) of its gradient (zeros past dim0 and for parameters without a gradient
// this step). Reduce-scatter with AVG leaves this rank's (rs_total) slice averaged over the shard
// group; the replicate group (HYBRID, NO_SHARD) then all-reduces it with AVG. S.grad becomes a
// view into that output, or is accumulated into when it already exists (a unit called twice,
// gradient accumulation). The unsharded gradients are freed right after copy-in.
// With a shard group of one rank, P.grad is S.grad: only the replicate all-reduce runs, on a
// flat copy, and the result is written back.
void FsdpParamGroup::issue_reduce_scatter() {
  if (rs_total_ == 0) return;
  bool any_grad = false;
  for (auto& p : params_) any_grad |= p->requires_grad() && p->unsharded().grad().defined();
  if (!any_grad) return;
  at::NoGradGuard no_grad;
  const auto options =
      params_.front()->sharded().options().dtype(reduce_dtype_).requires_grad(false);
  PendingReduceScatter rs;
  const int w = shard_world();
  if (aliased_) {
    // P.grad is S.grad: nothing to scatter; average over the replicate group if there is one.
    if (!replicate_group_ || replicate_group_->size() == 1) return;
    rs.output = at::zeros({rs_total_}, options);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (rs_offsets_[i] < 0 || !params_[i]->unsharded().grad().defined()) continue;
      rs.output.narrow(0, rs_offsets_[i], params_[i]->shard_numel())
          .copy_(params_[i]->unsharded().grad().reshape({-1}));
    }
    rs.work = replicate_group_->all_reduce_async(rs.output, ReduceOp::kAvg);
    rs.replicated = true;
  } else {
    rs.input = at::zeros({w * rs_total_}, options);
    at::Tensor rank_major = rs.input.view({w, rs_total_});
    for (size_t i = 0; i < params_.size(); ++i) {
      if (rs_offsets_[i] < 0 || !params_[i]->unsharded().grad().defined()) continue;
      params_[i]->copy_grad_in(rank_major.narrow(1, rs_offsets_[i], params_[i]->shard_numel()));
    }
    free_unsharded_grads();
    rs.output = at::empty({rs_total_}, options);
    rs.work = shard_group_->reduce_scatter_tensor_async(rs.output, rs.input, ReduceOp::kAvg);
  }
  pending_rs_.push_back(std::move(rs));
}

void FsdpParamGroup::finish_reduce_scatter() {
  at::NoGradGuard no_grad;
  for (auto& rs : pending_rs_) {
    if (rs.work) rs.work->wait();
    rs.input = at::Tensor();
    if (!rs.replicated && replicate_group_ && replicate_group_->size() > 1) {
      replicate_group_->all_reduce(rs.output, ReduceOp::kAvg);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (rs_offsets_[i] < 0) continue;
      FsdpParam& p = *params_[i];
      // Back to S's dtype (fp32 master gradient); a no-op view without mixed precision.
      at::Tensor reduced =
          rs.output.narrow(0, rs_offsets_[i], p.shard_numel()).to(p.sharded_dtype());
      if (p.aliased()) {
        // S.grad is P.grad: write the averaged values back (only those that had a gradient).
        if (p.sharded().grad().defined()) {
          p.sharded().grad().view({-1}).copy_(reduced);
        }
        continue;
      }
      at::Tensor& grad = p.sharded().mutable_grad();
      if (grad.defined()) {
        grad.add_(reduced.view(p.sharded().sizes()));
      } else {
        grad = reduced.view(p.sharded().sizes());
      }
    }
  }
  pending_rs_.clear();
}

void FsdpParamGroup::pre_forward(std::vector<at::Tensor>& inputs) {
  training_state_ = TrainingState::kForward;
  state_->record_forward(*this);
  if (!is_unsharded()) unshard();
  // A recomputed forward runs during backward: no forward prefetch then. See Note
  // [Checkpointed units].
  if (state_->config().forward_prefetch && !fsdp::in_activation_recompute()) {
    state_->prefetch_after_forward_of(*this);
  }
  // Mixed precision: floating inputs compute in the parameters' dtype. FSDP2 casts at the root
  // only; a unit may also receive fp32 from un-cast code (e.g. an fp32 buffer added to bf16
  // activations), so every unit casts its own inputs (a no-op when they already match).
  const auto& mp = state_->config().mixed_precision;
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
  auto outputs = PostBackwardFunction::apply(at::TensorList(with_grad),
                                             reinterpret_cast<int64_t>(this));
  for (size_t k = 0; k < where.size(); ++k) inputs[where[k]] = outputs[k];
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
void FsdpParamGroup::post_forward(at::Tensor& output) {
  // See Note [Checkpointed units].
  if (reshard_after_forward_ && is_unsharded() && !fsdp::in_activation_recompute()) {
    reshard(ShardedState::kShardedPostForward);
  }
  if (output.defined() && output.requires_grad() && at::GradMode::is_enabled()) {
    output.register_hook([this](const at::Tensor&) { pre_backward(); });
  }
}

void FsdpParamGroup::pre_backward() {
  state_->on_backward_start();
  ++backward_pending_;
  training_state_ = TrainingState::kPreBackward;
  if (!is_unsharded()) unshard();
  if (state_->config().backward_prefetch == BackwardPrefetch::kPre) {
    state_->prefetch_before_backward_of(*this);
  }
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
void FsdpParamGroup::post_backward() {
  if (backward_pending_ > 0) --backward_pending_;
  if (backward_pending_ > 0) return;  // another call of this unit still runs its backward
  TORCH_INTERNAL_ASSERT(is_unsharded(), "[fully_shard] post-backward of unit '", name_,
                        "' found it ", to_string(sharded_state_), "; its parameters were freed "
                        "before its backward finished");
  if (state_->sync()) {  // See Note [No-sync gradient accumulation]
    issue_reduce_scatter();
    state_->reduce_scatter_issued(*this);
  }
  reshard(ShardedState::kSharded);
  training_state_ = TrainingState::kPostBackward;
  if (state_->config().backward_prefetch == BackwardPrefetch::kPost) {
    state_->prefetch_before_backward_of(*this);
  }
}

void FsdpParamGroup::finalize_backward() {
  drop_pending_all_gather();
  if (is_unsharded()) {
    backward_pending_ = 0;
    // Still unsharded: the root, a unit whose inputs needed no grad, a SHARD_GRAD_OP unit
    // without backward. Reduce whatever gradients it received.
    if (state_->sync()) issue_reduce_scatter();
    reshard(ShardedState::kSharded);
  } else if (sharded_state_ == ShardedState::kShardedPostForward) {
    // Ran forward but no gradient reached it (e.g. every output was unused): nothing to reduce.
    // Gradients may still have accumulated earlier without sync: they stay in P.grad.
    reshard_state_to_rest();
  }
  backward_pending_ = 0;
  training_state_ = TrainingState::kPostBackward;
}

}  // namespace fsdp::detail
