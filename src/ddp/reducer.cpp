#include "ddp/reducer.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <sstream>

namespace fsdp::detail {

namespace {
std::string c10_what(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}  // namespace

// Note [DDP bucket launch order]
// DDP's buckets follow Note [Gradient buckets] in src/ddp/grad_buckets.h: reverse registration
// order, PyTorch's cap (a bucket closes once it holds bucket_cap_mb; one bucket per dtype and
// device open at a time), bucket k launched only after buckets 0..k-1 (a bucket full early is
// *held*, counted in last_held_buckets()), every bucket in flight until finish_backward.
// static_graph replaces the guessed order by the observed one (Note [DDP static graph]).

// Note [DDP static graph]
// static_graph=true promises that every iteration uses the same parameters in the same order.
// Iteration 1 runs like find_unused_parameters=true (unused parameters allowed, one extra small
// all-reduce of the "used" mask) and records (a) the order in which gradients became ready and
// (b) which parameters got none. After iteration 1:
//   - buckets are rebuilt in rank 0's observed ready order (broadcast, so the layout is the same
//     on every rank): each bucket fills with consecutive gradients and none is held back by a
//     late parameter, so launches start as early as backward allows;
//   - the unused parameters are known: they are marked ready (zero slot) when a synchronized
//     micro-batch starts, so their buckets need not wait for the end of backward, and no "used"
//     mask is all-reduced any more, also with find_unused_parameters=true (as PyTorch's reducer:
//     its dynamic_graph_find_unused() is find_unused_parameters && !static_graph; without
//     static_graph, find_unused_parameters=true pays the mask every step);
//   - deviations are errors that say so: a parameter that got a gradient in iteration 1 and none
//     now, or the reverse.

// Note [DDP unused parameters]
// Without find_unused_parameters, a trainable parameter that got no gradient in a synchronized
// backward would leave its bucket incomplete forever; the end-of-backward check turns that
// into an error naming the parameter(s). With it, the end of backward zero-fills the missing
// slots (or keeps the gradient accumulated during no_sync micro-batches), launches the
// remaining buckets in order and then all-reduces a per-parameter "used" mask (after the
// buckets, so that every rank issues the same collectives in the same order). Parameters used
// on no rank keep their .grad untouched, as in PyTorch, so optimizers skip them like in a
// single process.

// Note [DDP end of backward]
// Buckets whose parameters got no gradient (unused parameters, static_graph's known-unused ones)
// and the "used" mask are launched by finalize_backward, which must run once the whole backward
// is over: it is an autograd engine callback (Engine::queue_callback), and a callback runs when
// the graph task it was queued in finishes. Queuing it from the first parameter's gradient hook
// is wrong when that gradient comes from a *nested* backward: activation checkpointing
// (src/nn/activation_checkpointing.cpp) back-propagates each checkpointed block in its own
// graph task, started from the checkpoint function's backward, so with every parameter inside
// checkpointed blocks (or the first gradient from one) the callback would run when the first
// block's nested backward ends, before the other blocks' gradients exist. So
// DDPStrategy::backward(loss) hooks the loss tensor (hook_loss): that hook runs in the outer
// graph task, before any parameter gradient, and queues the callback there.
// The gradient-hook path stays as a fallback for custom loops that call loss.backward()
// directly (and for backward without pre_forward). It has the limitation above: with
// activation checkpointing, the first gradient must come from outside the checkpointed blocks;
// otherwise the early end of backward is reported as an error whose hint says to call
// DDPStrategy::backward(loss).

Reducer::Reducer(ProcessGroupPtr group, std::vector<NamedTensor> params,
                 const DDPOptions& options, CommHook hook, std::shared_ptr<CommHookState> state)
    : group_(std::move(group)),
      options_(options),
      hook_(std::move(hook)),
      hook_state_(std::move(state)),
      grad_buckets_(BucketLayout{}, GradBuckets::kUnbounded,
                    GradBuckets::Ops{[this](int b) { copy_in(b); }, [this](int b) { issue(b); },
                                     [this](int b) { finish(b); }}) {
  TORCH_INTERNAL_ASSERT(group_, "Reducer needs a process group");
  TORCH_INTERNAL_ASSERT(hook_ && hook_state_, "Reducer needs a comm hook and its state");
  TORCH_CHECK(options_.bucket_cap_mb > 0, "[ddp] bucket_cap_mb must be > 0, got ",
              options_.bucket_cap_mb);
  params_.reserve(params.size());
  std::vector<at::Tensor> tensors;
  for (auto& np : params) {
    TORCH_INTERNAL_ASSERT(np.tensor.requires_grad(), "parameter ", np.name,
                          " does not require grad");
    TORCH_CHECK(np.tensor.is_leaf(), "[ddp] parameter '", np.name,
                "' is not a leaf tensor; DDP hooks the AccumulateGrad node of leaf parameters");
    Param p;
    p.name = std::move(np.name);
    p.tensor = np.tensor;
    tensors.push_back(p.tensor);
    params_.push_back(std::move(p));
  }
  build_buckets(reverse_order(params_.size()));
  used_local_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kFloat);
  static_unused_.assign(params_.size(), false);
  static_global_used_.assign(params_.size(), true);
  if (options_.gradient_as_bucket_view) point_grads_at_buckets();
  hooks_ = GradReadyHooks(tensors, alive_.ref(this), &Reducer::on_grad_ready);
}

Reducer::~Reducer() {
  alive_.expire();
  hooks_.remove();
  wait_launched();
}

BucketLayout Reducer::layout_for(const std::vector<int>& order) const {
  // PyTorch's rule (Note [DDP bucket launch order]): the cap in bytes, one kind per dtype and
  // device.
  const double cap_bytes = options_.bucket_cap_mb * 1024.0 * 1024.0;
  std::vector<std::pair<at::ScalarType, at::Device>> kinds;
  std::vector<BucketItem> items;
  for (const auto& p : params_) {
    const std::pair<at::ScalarType, at::Device> kind{p.tensor.scalar_type(), p.tensor.device()};
    auto it = std::find(kinds.begin(), kinds.end(), kind);
    if (it == kinds.end()) it = kinds.insert(kinds.end(), kind);
    BucketItem item;
    item.numel = p.tensor.numel();
    item.kind = it - kinds.begin();
    item.cap = cap_bytes / static_cast<double>(p.tensor.element_size());
    items.push_back(item);
  }
  return assign_buckets(items, order, BucketCap::kCloseAtCap);
}

void Reducer::build_buckets(const std::vector<int>& order) {
  grad_buckets_.set_layout(layout_for(order));
  const BucketLayout& layout = grad_buckets_.layout();
  buckets_.assign(layout.buckets.size(), Bucket());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const at::Tensor& first = params_[layout.buckets[b].params.front()].tensor;
    buckets_[b].dtype = first.scalar_type();
    buckets_[b].buffer = at::zeros({layout.buckets[b].numel}, first.options());
  }
}

at::Tensor Reducer::bucket_view(int param) const {
  // Below the autograd/view-tracking layer: the slot is a plain alias of the buffer, not an
  // autograd view, so optimizers may detach_()/zero_() it as a gradient.
  at::AutoDispatchBelowADInplaceOrView guard;
  const at::Tensor& t = params_[param].tensor;
  const BucketLayout& layout = grad_buckets_.layout();
  return buckets_[layout.bucket_of[param]].buffer.narrow(0, layout.offset_of[param], t.numel())
      .view(t.sizes());
}

void Reducer::point_grads_at_buckets() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    at::Tensor slot = bucket_view(static_cast<int>(i));
    const at::Tensor& g = p.tensor.grad();
    if (g.defined() && g.data_ptr() != slot.data_ptr()) slot.copy_(g);
    p.tensor.mutable_grad() = slot;
  }
}

void Reducer::arm(bool sync) {
  if (!sync) {
    state_ = ReducerState::kNoSync;
    return;
  }
  state_ = ReducerState::kSync;
  for (auto& b : buckets_) b.future = CommFuture();
  grad_buckets_.abandon_in_flight();
  grad_buckets_.arm();
  ready_order_.clear();
  callback_queued_ = false;
  callback_from_grad_hook_ = false;
  used_work_.reset();
  if (static_recorded_) {
    // See Note [DDP static graph]: known-unused parameters are ready from the start.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (static_unused_[i]) mark_ready(static_cast<int>(i));
    }
  }
}

void Reducer::prepare_forward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != ReducerState::kReducing,
              "[ddp] pre_forward called while the previous synchronized backward is still "
              "reducing; call post_backward (finish_backward) after every backward");
  arm(sync);
}

void Reducer::hook_loss(const at::Tensor& loss) {
  TORCH_INTERNAL_ASSERT(loss.requires_grad());
  on_gradient_of(loss, alive_.ref(this), [](Reducer& r) { r.on_backward_start(); });
}

void Reducer::on_backward_start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == ReducerState::kIdle) arm(true);  // backward without pre_forward: synchronize
  // kNoSync: nothing to finish. kReducing: a second backward before post_backward; the first
  // gradient hook reports it.
  if (state_ != ReducerState::kSync || callback_queued_) return;
  queue_end_of_backward();
}

void Reducer::queue_end_of_backward() {
  callback_queued_ = true;
  detail::queue_end_of_backward(alive_.ref(this), [](Reducer& r) {
    std::lock_guard<std::mutex> lock(r.mutex_);
    r.finalize_backward();
  });
}

std::string Reducer::nested_backward_hint() const {
  if (!callback_from_grad_hook_) return "";
  return " ---> HINT: if the model uses activation checkpointing: backward was started with "
         "loss.backward(), so DDP ends the reduction when the backward run that produced the "
         "first gradient ends, and for a gradient from a checkpointed block that is the block's "
         "nested backward, before the other blocks' gradients exist. Call "
         "strategy.backward(loss) (fsdp::DDPStrategy::backward; the Trainer does) instead of "
         "loss.backward()";
}

void Reducer::on_grad_ready(int index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == ReducerState::kIdle) arm(true);  // backward without pre_forward: synchronize
  Param& p = params_[index];
  if (state_ == ReducerState::kNoSync) {
    p.used = true;
    return;
  }
  TORCH_CHECK(state_ == ReducerState::kSync, "[ddp] parameter '", p.name,
              "' received a gradient after backward had finished; call post_backward before "
              "the next backward (one backward per pre_forward)", nested_backward_hint());
  if (static_recorded_ && static_unused_[index]) {
    TORCH_CHECK(false, "[ddp] static_graph=true but parameter '", p.name,
                "' received a gradient in synchronized backward ", num_synced_backwards_ + 1,
                " although it received none in the first one: the graph is not static. Set "
                "static_graph=false (and find_unused_parameters=true if some parameters are "
                "unused in some iterations)");
  }
  TORCH_CHECK(!grad_buckets_.ready(index), "[ddp] parameter '", p.name,
              "' received two gradients in one synchronized backward; call pre_forward before "
              "each forward and post_backward after each backward");
  p.used = true;
  if (!callback_queued_) {
    // Fallback: loss.backward() without DDPStrategy::backward (Note [DDP end of backward]).
    callback_from_grad_hook_ = true;
    queue_end_of_backward();
  }
  if (options_.static_graph && !static_recorded_) ready_order_.push_back(index);
  mark_ready(index);
  grad_buckets_.launch_ready();
}

void Reducer::mark_ready(int index) {
  TORCH_INTERNAL_ASSERT(!grad_buckets_.launched(grad_buckets_.layout().bucket_of[index]));
  grad_buckets_.mark_ready(index);
}

void Reducer::copy_in(int index) {
  // Copy-in (or, with gradient_as_bucket_view, make sure .grad still is the slot: an optimizer
  // that sets gradients to none/new tensors breaks the aliasing, which is repaired here).
  for (int idx : grad_buckets_.layout().buckets[index].params) {
    Param& p = params_[idx];
    at::Tensor slot = bucket_view(idx);
    const at::Tensor& g = p.tensor.grad();
    const bool has = p.used && g.defined();
    if (!has) {
      slot.zero_();
    } else if (!options_.gradient_as_bucket_view) {
      slot.copy_(g);
    } else if (g.data_ptr() != slot.data_ptr()) {
      slot.copy_(g);
      p.tensor.mutable_grad() = slot;
    }
  }
}

void Reducer::issue(int index) {
  Bucket& b = buckets_[index];
  const BucketLayout& layout = grad_buckets_.layout();
  const std::vector<int>& members = layout.buckets[index].params;
  // The comm hook (allreduce_hook unless the user set one) starts the communication. See
  // Note [Comm hook futures] in src/ddp/comm_future.cpp.
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> offsets;
  std::vector<std::string> names;
  for (int idx : members) {
    tensors.push_back(params_[idx].tensor);
    offsets.push_back(layout.offset_of[idx]);
    names.push_back(params_[idx].name);
  }
  GradBucket bucket(index, static_cast<int>(buckets_.size()), b.buffer, std::move(tensors),
                    std::move(offsets), std::move(names));
  try {
    b.future = hook_(*hook_state_, bucket);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[ddp] rank ", group_->rank(), ": the comm hook failed on gradient bucket ",
                index, " (", bucket_numel(index), " elements, first parameter '",
                params_[members.front()].name, "'): ", c10_what(e));
  }
  TORCH_CHECK(b.future.valid(), "[ddp] the comm hook returned an invalid CommFuture for bucket ",
              index, "; return the future of the reduced buffer (CommFuture::ready(buffer) if "
              "nothing is communicated)");
}

void Reducer::finalize_backward() {
  if (state_ != ReducerState::kSync) return;  // idempotent: callback and finish_backward
  std::vector<int> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grad_buckets_.ready(static_cast<int>(i))) missing.push_back(static_cast<int>(i));
  }
  const bool first_static = options_.static_graph && !static_recorded_;
  // See Note [DDP static graph]: after its first iteration, static_graph knows the unused
  // parameters, so find_unused_parameters no longer searches for them (nor sends the mask).
  const bool dynamic_find_unused = options_.find_unused_parameters && !options_.static_graph;
  const bool allow_unused = dynamic_find_unused || first_static;
  if (!missing.empty() && !allow_unused) {
    // Leave the group consistent: buckets already launched complete on every rank that has
    // the same unused parameters.
    wait_launched();
    state_ = ReducerState::kIdle;
    for (auto& p : params_) p.used = false;
    std::ostringstream names;
    for (size_t k = 0; k < missing.size() && k < 8; ++k) {
      names << (k ? ", " : "") << "'" << params_[missing[k]].name << "'";
    }
    if (missing.size() > 8) names << " and " << missing.size() - 8 << " more";
    if (static_recorded_) {
      TORCH_CHECK(false, "[ddp] rank ", group_->rank(), ": static_graph=true but parameter(s) ",
                  names.str(), " received no gradient in synchronized backward ",
                  num_synced_backwards_ + 1,
                  " although they received one in the first: the graph is not static. Set "
                  "static_graph=false and find_unused_parameters=true", nested_backward_hint());
    }
    TORCH_CHECK(false, "[ddp] rank ", group_->rank(), ": ", missing.size(),
                " trainable parameter(s) received no gradient in this backward: ", names.str(),
                ". DDP waits for every parameter's gradient before it can all-reduce its bucket. "
                "---> HINT: if these parameters are unused on purpose, pass "
                "find_unused_parameters=true (fsdp::DDPOptions), or set "
                "requires_grad=false on them; otherwise check that forward uses them and that "
                "the loss depends on its output", nested_backward_hint());
  }
  for (int i : missing) mark_ready(i);
  grad_buckets_.launch_ready();
  TORCH_INTERNAL_ASSERT(grad_buckets_.all_launched());
  if (allow_unused) {
    // See Note [DDP unused parameters]: after every bucket, on every rank.
    auto used = used_local_.accessor<float, 1>();
    for (size_t i = 0; i < params_.size(); ++i) used[i] = params_[i].used ? 1.f : 0.f;
    // On the group's device (NCCL: the rank's GPU); read back on the host in finish().
    used_exchanged_ = used_local_.to(group_->device());
    used_work_ = group_->all_reduce_async(used_exchanged_, ReduceOp::kSum);
  }
  state_ = ReducerState::kReducing;
}

void Reducer::finish(int k) {
  Bucket& b = buckets_[k];
  TORCH_INTERNAL_ASSERT(b.future.valid());
  at::Tensor result;
  try {
    result = b.future.wait();
  } catch (const std::exception& e) {
    state_ = ReducerState::kIdle;
    wait_launched();
    TORCH_CHECK(false, "[ddp] rank ", group_->rank(), ": reduction of gradient bucket ", k, " (",
                bucket_numel(k), " elements) failed: ", c10_what(e));
  }
  b.future = CommFuture();
  TORCH_CHECK(result.defined() && result.numel() == bucket_numel(k), "[ddp] the comm hook's "
              "future for gradient bucket ", k, " holds ", result.defined() ? result.numel() : 0,
              " elements, the bucket has ", bucket_numel(k), "; a hook's future must hold the "
              "reduced flat buffer");
  // A hook may reduce into another tensor (a compression wrapper's half-precision copy).
  if (!(result.data_ptr() == b.buffer.data_ptr() && result.scalar_type() == b.dtype)) {
    b.buffer.copy_(result.reshape({-1}));
  }
}

void Reducer::wait_launched() noexcept {
  for (auto& b : buckets_) {
    if (!b.future.valid()) continue;
    b.future.drain();
    b.future = CommFuture();
  }
  grad_buckets_.abandon_in_flight();
  if (used_work_) {
    try {
      used_work_->wait();
    } catch (...) {
    }
    used_work_.reset();
  }
}

void Reducer::finish_backward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync) {
    TORCH_CHECK(state_ != ReducerState::kReducing && state_ != ReducerState::kSync,
                "[ddp] post_backward(sync=false) after a synchronized forward; pass the same "
                "sync flag to pre_forward and post_backward");
    return;
  }
  TORCH_CHECK(state_ != ReducerState::kNoSync,
              "[ddp] post_backward(sync=true) after pre_forward(sync=false); pass the same sync "
              "flag to pre_forward and post_backward");
  if (state_ == ReducerState::kIdle) arm(true);  // no hook fired and no pre_forward
  finalize_backward();  // no-op when the engine callback already ran
  TORCH_INTERNAL_ASSERT(state_ == ReducerState::kReducing);

  grad_buckets_.finish_all();  // every bucket, in bucket order: finish() below
  const bool have_mask = static_cast<bool>(used_work_);
  if (have_mask) {
    used_work_->wait();
    used_work_.reset();
    if (!used_exchanged_.is_same(used_local_)) used_local_.copy_(used_exchanged_);
  }
  auto used = used_local_.accessor<float, 1>();
  // Copy-out into .grad (nothing to copy with gradient_as_bucket_view).
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    bool globally_used = true;
    if (have_mask) globally_used = used[i] > 0.f;
    else if (static_recorded_) globally_used = static_global_used_[i];
    if (!globally_used) continue;  // Note [DDP unused parameters]: leave .grad untouched
    at::Tensor slot = bucket_view(static_cast<int>(i));
    at::Tensor& g = p.tensor.mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!g.defined() || g.data_ptr() != slot.data_ptr()) g = slot;
    } else if (g.defined()) {
      g.copy_(slot);
    } else {
      g = slot.clone();
    }
  }
  last_launch_order_ = grad_buckets_.launch_order();
  last_held_buckets_ = grad_buckets_.held();
  ++num_synced_backwards_;
  state_ = ReducerState::kIdle;
  if (options_.static_graph && !static_recorded_) record_static_graph(have_mask);
  for (auto& p : params_) p.used = false;
}

void Reducer::record_static_graph(bool have_mask) {
  // See Note [DDP static graph].
  static_recorded_ = true;
  const int64_t n = static_cast<int64_t>(params_.size());
  std::vector<bool> seen(params_.size(), false);
  for (int i : ready_order_) seen[i] = true;
  auto used = used_local_.accessor<float, 1>();
  for (int64_t i = 0; i < n; ++i) {
    static_unused_[i] = !seen[i];
    static_global_used_[i] = have_mask ? used[i] > 0.f : true;
  }
  // Rank 0's order, so the bucket layout is identical everywhere.
  at::Tensor order = at::empty({n}, at::kLong);
  auto acc = order.accessor<int64_t, 1>();
  int64_t k = 0;
  for (int i : ready_order_) acc[k++] = i;
  for (int64_t i = n - 1; i >= 0; --i) {
    if (!seen[i]) acc[k++] = i;
  }
  TORCH_INTERNAL_ASSERT(k == n);
  broadcast_host(*group_, order, 0);  // through the group's device (NCCL: the rank's GPU)
  std::vector<int> new_order(n);
  for (int64_t i = 0; i < n; ++i) {
    new_order[i] = static_cast<int>(acc[i]);
    TORCH_CHECK(new_order[i] >= 0 && new_order[i] < n,
                "[ddp] static_graph: rank 0 sent a bucket order for a different model");
  }
  // Keep the current gradients across the rebuild (the optimizer has not consumed them yet).
  std::vector<at::Tensor> grads(params_.size());
  if (options_.gradient_as_bucket_view) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].tensor.grad();
      if (g.defined()) grads[i] = g.clone();
    }
  }
  build_buckets(new_order);
  if (options_.gradient_as_bucket_view) {
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor slot = bucket_view(static_cast<int>(i));
      if (grads[i].defined()) slot.copy_(grads[i]);
      params_[i].tensor.mutable_grad() = slot;
    }
  }
}

void Reducer::zero_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& b : buckets_) b.buffer.zero_();
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& g = params_[i].tensor.mutable_grad();
    if (!g.defined()) continue;
    if (options_.gradient_as_bucket_view &&
        g.data_ptr() == bucket_view(static_cast<int>(i)).data_ptr()) {
      continue;
    }
    g.zero_();
  }
}

std::vector<DDPStrategy::BucketInfo> Reducer::bucket_infos() const {
  std::vector<DDPStrategy::BucketInfo> out;
  const BucketLayout& layout = grad_buckets_.layout();
  for (size_t k = 0; k < buckets_.size(); ++k) {
    DDPStrategy::BucketInfo info;
    info.numel = layout.buckets[k].numel;
    info.dtype = buckets_[k].dtype;
    for (int idx : layout.buckets[k].params) info.names.push_back(params_[idx].name);
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace fsdp::detail
