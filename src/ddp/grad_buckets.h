// Gradient buckets: the gradient-ready hooks, the bucket layout, in-order launches and the
// collectives in flight that DDP's reducer (src/ddp/reducer.cpp) and ZeRO stages 1/2's
// partitioner (src/zero/partitioner.cpp) share. Not a public header. See Note [Gradient buckets].
#pragma once

#include "common/liveness.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

namespace fsdp::detail {

// Note [Gradient buckets]
// -----------------------
// Data-parallel strategies that hold whole gradients (DDP; ZeRO stages 1 and 2) reduce them in
// buckets: one flat buffer and one collective for several parameters' gradients, started while
// backward still computes the gradients of earlier layers.
//   Ready      A post-hook on every parameter's AccumulateGrad node (GradReadyHooks) runs once
//              the parameter's gradient is accumulated into .grad. The owner checks its own
//              state (DDP: no_sync, double gradients; ZeRO: armed) and marks the parameter
//              ready (GradBuckets::mark_ready).
//   Layout     Buckets are filled in reverse registration order (assign_buckets over
//              reverse_order): autograd produces gradients roughly in reverse order of use, and
//              modules are usually registered in order of use, so bucket 0 completes first.
//              A bucket is closed by a size cap, in one of two conventions (BucketCap: PyTorch
//              DDP's or DeepSpeed's), and never mixes kinds (DDP: dtype and device). DDP's
//              static_graph replaces the guessed order by the observed one.
//   Order      Every rank must issue the same collectives in the same order, but autograd may
//              complete the buckets in different orders on different ranks. So bucket k is
//              launched only after buckets 0..k-1 (launch_ready); a bucket complete before an
//              earlier one is *held* (held()).
//   In flight  A launch is copy-in (gradients into the bucket's buffer), then issue (start the
//              collective, asynchronously). With max_in_flight = 1 (ZeRO) issuing bucket k first
//              finishes bucket k-1 (waits for it, copies its result out, frees its buffers): the
//              transient memory stays at two buckets whatever the model size, and one
//              collective still overlaps the backward compute that fills the next bucket. DDP's
//              buffers are persistent, so it leaves every bucket in flight (kUnbounded) and
//              finishes them in order after backward (finish_all): backward never waits for a
//              collective.
//   End        A bucket with a parameter that gets no gradient (unused in this forward) never
//              completes by itself: at the end of backward the owner launches what is left, in
//              order (launch_remaining). DDP does it from an engine callback queued in the
//              backward's own graph task (queue_end_of_backward in src/common/liveness.h; see
//              Note [DDP end of backward] in src/ddp/reducer.cpp), ZeRO from post_backward.
//   Liveness   A graph keeps its nodes alive, with their hooks and the callbacks queued in it,
//              so backward can run after the object the hooks call is gone: keep the loss,
//              destroy the strategy, call backward. Every hook and callback therefore reaches
//              its owner through an AliveRef (src/common/liveness.h), never a raw pointer:
//              AliveRef::if_alive runs only while the owner's Liveness is not expired, and an
//              owner expires it first thing in its destructor (GradReadyHooks also removes its
//              hooks then). A dead owner's hooks do nothing: backward is plain autograd, the
//              gradients stay in .grad, nothing is communicated. The FSDP state
//              (src/shard/fsdp_state.cpp) reaches its units through the same token.

// Which parameters share a bucket, and where each one sits in its bucket's buffer.
struct BucketLayout {
  struct Bucket {
    std::vector<int> params;  // parameter indices, in buffer order
    int64_t numel = 0;        // the sum of their sizes
  };
  std::vector<Bucket> buckets;     // in launch order
  std::vector<int> bucket_of;      // per parameter
  std::vector<int64_t> offset_of;  // per parameter: element offset in its bucket's buffer
};

// How a bucket's size cap closes it.
enum class BucketCap {
  // PyTorch DDP (bucket_cap_mb): a bucket closes once it holds at least `cap` elements; the
  // parameter that reaches the cap is still in it.
  kCloseAtCap,
  // DeepSpeed (reduce_bucket_size): a parameter that would take a non-empty bucket past `cap`
  // opens the next one; a parameter larger than `cap` is a bucket of its own.
  kStayUnderCap,
};

struct BucketItem {
  int64_t numel = 0;  // elements the parameter takes in its bucket
  int64_t kind = 0;   // buckets never mix kinds (one bucket per kind is open at a time)
  double cap = 0;     // the cap, in elements, of a bucket of this kind
};

// n-1, ..., 1, 0: the default bucket order (see Note [Gradient buckets], "Layout").
std::vector<int> reverse_order(size_t n);
// Fills buckets with items[order[0]], items[order[1]], ... Bucket indices follow the order in
// which buckets are opened.
BucketLayout assign_buckets(const std::vector<BucketItem>& items, const std::vector<int>& order,
                            BucketCap rule);

// A post-hook on each parameter's AccumulateGrad node that calls owner.*on_ready(index) once
// params[index]'s gradient is accumulated, while the owner lives. The hooks are removed when this
// object is destroyed (a graph that outlives it keeps the nodes, without our hooks).
class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  template <class T>
  GradReadyHooks(const std::vector<at::Tensor>& params, AliveRef<T> owner,
                 void (T::*on_ready)(int))
      : GradReadyHooks(params, [owner, on_ready](int index) {
          owner.if_alive([&](T& target) { (target.*on_ready)(index); });
        }) {}
  ~GradReadyHooks() { remove(); }
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;
  GradReadyHooks(GradReadyHooks&& other) noexcept : installed_(std::move(other.installed_)) {}
  GradReadyHooks& operator=(GradReadyHooks&& other) noexcept;

  void remove() noexcept;

 private:
  // `checked` reaches the owner only through an AliveRef (the public constructor builds it).
  GradReadyHooks(const std::vector<at::Tensor>& params, std::function<void(int)> checked);

  struct Installed {
    c10::intrusive_ptr<torch::autograd::Node> grad_acc;  // kept alive: it carries the hook
    uintptr_t key = 0;
  };
  std::vector<Installed> installed_;
};

// One backward's progress over a layout's buckets: which parameters have their gradient, which
// buckets are launched (in bucket order) and which are in flight. The owner does the tensor
// work through `Ops`; everything here is bookkeeping. See Note [Gradient buckets].
class GradBuckets {
 public:
  struct Ops {
    std::function<void(int bucket)> copy_in;  // the bucket's gradients into its buffer
    std::function<void(int bucket)> issue;    // start its collective
    std::function<void(int bucket)> finish;   // wait for it and use its result
  };
  static constexpr int kUnbounded = 0;

  // max_in_flight: collectives issued and not finished at any time (kUnbounded: no limit).
  GradBuckets(BucketLayout layout, int max_in_flight, Ops ops);

  // Replaces the layout (between backwards; nothing in flight).
  void set_layout(BucketLayout layout);
  const BucketLayout& layout() const { return layout_; }
  int num_buckets() const { return static_cast<int>(layout_.buckets.size()); }

  // --- readiness, one backward at a time
  // A new backward: no parameter ready, no bucket launched.
  void arm();
  bool ready(int param) const { return ready_[param]; }
  // Marks params[param] ready (it must not be yet); launches nothing (launch_ready does).
  void mark_ready(int param);
  // Launches, in bucket order, every bucket whose parameters are all ready and whose
  // predecessors are launched.
  void launch_ready();
  // Launches every bucket not launched yet, in bucket order (the end of backward).
  void launch_remaining();
  bool launched(int bucket) const { return launched_[bucket]; }
  bool all_launched() const { return next_to_launch_ == num_buckets(); }
  // Buckets of this backward that were complete while an earlier bucket was not.
  int64_t held() const { return held_; }
  // The buckets launched since arm(), in launch order.
  const std::vector<int>& launch_order() const { return launch_order_; }

  // --- collectives
  // copy_in, then finish the oldest collectives while max_in_flight are in flight, then issue.
  // Also for a bucket outside the readiness order (ZeRO stage 1 launches every bucket at the
  // step's boundary).
  void launch(int bucket);
  // Finishes every collective in flight, in launch order.
  void finish_all();
  // Forgets the collectives in flight: the owner waited for them itself (errors, teardown).
  void abandon_in_flight() { in_flight_.clear(); }

 private:
  BucketLayout layout_;
  int max_in_flight_;
  Ops ops_;
  std::vector<bool> ready_;      // per parameter
  std::vector<int> pending_;     // per bucket: parameters not ready yet
  std::vector<bool> launched_;   // per bucket
  int next_to_launch_ = 0;
  int64_t held_ = 0;
  std::vector<int> launch_order_;
  std::deque<int> in_flight_;    // issued, not finished; oldest first
};

}  // namespace fsdp::detail
