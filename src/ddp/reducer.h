// detail::Reducer — DDP's gradient buckets and the autograd hooks that launch their all-reduce.
// Used by DDPStrategy (src/ddp/ddp_strategy.cpp); not a public header.
#pragma once

#include "ddp/grad_buckets.h"
#include "fsdp/comm.h"
#include "fsdp/ddp.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

// Note [DDP reducer states]
// One state per rank; which tensors hold gradient memory in each:
//   kIdle      between steps. .grad holds the (averaged) gradients of the last step, or
//              nothing; bucket buffers hold stale data (with gradient_as_bucket_view they ARE
//              the gradients).
//   kNoSync    a non-boundary micro-batch (no_sync): hooks only record which parameters were
//              used; gradients accumulate in .grad, nothing is communicated.
//   kSync      a boundary micro-batch: each hook counts its bucket down; a full bucket is copied
//              into its flat buffer and, in bucket order, handed to the comm hook, which
//              starts its communication and returns a future (Note [Gradient buckets] in
//              src/ddp/grad_buckets.h).
//   kReducing  backward is over and every bucket is launched; finish_backward waits for the
//              futures in bucket order and copies the results back into .grad.
enum class ReducerState { kIdle, kNoSync, kSync, kReducing };

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

class Reducer {
 public:
  // params: trainable parameters with their FQNs, in registration order (deduplicated).
  // hook: how a bucket is communicated (already wrapped); state: what it is called with.
  Reducer(ProcessGroupPtr group, std::vector<NamedTensor> params, const DDPOptions& options,
          CommHook hook, std::shared_ptr<CommHookState> state);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called before each forward. sync=false: no_sync micro-batch.
  void prepare_forward(bool sync);
  // Registers a hook on `loss` that queues the end-of-backward callback when backward reaches
  // the loss, i.e. in the graph task that loss.backward() starts (DDPStrategy::backward). See
  // Note [DDP end of backward].
  void hook_loss(const at::Tensor& loss);
  // Called after loss.backward(). On a synchronized micro-batch: waits for every bucket and
  // leaves the averaged gradients in .grad.
  void finish_backward(bool sync);
  // Zeroes gradients in place (the bucket buffers when gradients are bucket views).
  void zero_grad();

  std::vector<DDPStrategy::BucketInfo> bucket_infos() const;
  std::vector<int> last_launch_order() const { return last_launch_order_; }
  int64_t num_synced_backwards() const { return num_synced_backwards_; }
  // Buckets that were full before an earlier bucket in the last synchronized backward (they had
  // to wait for it; see Note [DDP bucket launch order]).
  int64_t last_held_buckets() const { return last_held_buckets_; }

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;   // the parameter itself
    bool used = false;   // got a gradient since the last synchronized backward (incl. no_sync)
  };
  // What DDP keeps per bucket of the layout (GradBuckets holds which parameters and where).
  struct Bucket {
    at::ScalarType dtype = at::kFloat;
    at::Tensor buffer;   // (numel) flat; what the all-reduce reads and writes
    CommFuture future;   // the comm hook's, from launch until finish_backward
  };

  BucketLayout layout_for(const std::vector<int>& order) const;
  void build_buckets(const std::vector<int>& order);
  void point_grads_at_buckets();  // gradient_as_bucket_view: .grad := view into the buffer
  at::Tensor bucket_view(int param) const;  // (param shape) view of its slot
  int64_t bucket_numel(int bucket) const { return grad_buckets_.layout().buckets[bucket].numel; }
  void arm(bool sync);
  void on_grad_ready(int index);  // from the AccumulateGrad post-hook
  void on_backward_start();       // from the loss hook (hook_loss)
  void queue_end_of_backward();
  std::string nested_backward_hint() const;
  void mark_ready(int index);
  void copy_in(int bucket);       // GradBuckets::Ops
  void issue(int bucket);
  void finish(int bucket);
  void finalize_backward();  // end of backward (engine callback or finish_backward)
  void wait_launched() noexcept;
  void record_static_graph(bool have_mask);  // after the first synchronized backward

  // Public entry points (and the engine callback) lock; private helpers expect it held. On CPU
  // hooks run on the thread that runs backward; with several devices autograd runs one thread
  // per device, and their hooks would race on the bucket counters without it.
  std::mutex mutex_;
  ProcessGroupPtr group_;
  DDPOptions options_;
  CommHook hook_;
  std::shared_ptr<CommHookState> hook_state_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  // Which parameters form which bucket, readiness and in-order launches; every bucket stays in
  // flight until finish_backward (see Note [Gradient buckets]).
  GradBuckets grad_buckets_;
  ReducerState state_ = ReducerState::kIdle;
  bool callback_queued_ = false;
  // The callback was queued by a gradient hook (loss.backward() called directly), not by the
  // loss hook: it may belong to a nested backward (Note [DDP end of backward]).
  bool callback_from_grad_hook_ = false;

  // find_unused_parameters / static_graph: 1 per parameter used on any rank (all-reduced).
  at::Tensor used_local_;   // (num params) float
  WorkPtr used_work_;
  at::Tensor used_exchanged_;  // used_local_ on the group's device while used_work_ runs

  // static_graph: see Note [DDP static graph].
  std::vector<int> ready_order_;         // parameter indices as their gradients arrived
  std::vector<bool> static_unused_;      // parameters without gradient in iteration 1 (locally)
  std::vector<bool> static_global_used_; // parameters with a gradient on some rank in iteration 1
  bool static_recorded_ = false;

  std::vector<int> last_launch_order_;
  int64_t last_held_buckets_ = 0;
  int64_t num_synced_backwards_ = 0;

  // Declared last, so destroyed first (and the destructor expires alive_ before anything else):
  // no hook reaches a half-destroyed reducer. See Note [Gradient buckets], "Liveness".
  Liveness alive_;
  GradReadyHooks hooks_;
};

}  // namespace fsdp::detail
