// Liveness / AliveRef: how an autograd hook or callback reaches an object that may be gone by
// the time backward runs, and the two checked autograd entry points built on them. Header-only,
// shared by src/shard (the FSDP state) and src/ddp, src/zero (src/ddp/grad_buckets.h). See Note
// [Gradient buckets] in src/ddp/grad_buckets.h, "Liveness".
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/engine.h>

#include <memory>
#include <utility>

namespace fsdp::detail {

class Liveness;

// What a hook or callback captures instead of `this`: the target is reachable only through
// if_alive, which checks the owner's Liveness first. Copyable; a default-constructed ref is dead.
template <class T>
class AliveRef {
 public:
  AliveRef() = default;

  // Calls f(target) if the owner is still alive; returns whether it did.
  template <class F>
  bool if_alive(F&& f) const {
    const std::shared_ptr<const void> anchor = anchor_.lock();
    if (!anchor) return false;
    std::forward<F>(f)(*target_);
    return true;
  }
  bool alive() const { return !anchor_.expired(); }

 private:
  friend class Liveness;
  AliveRef(std::weak_ptr<const void> anchor, T* target)
      : anchor_(std::move(anchor)), target_(target) {}

  std::weak_ptr<const void> anchor_;
  T* target_ = nullptr;
};

// The owner's side: a member of the object that hooks call. Not copyable (a copy of the owner
// must not inherit its hooks' token).
class Liveness {
 public:
  Liveness() : anchor_(std::make_shared<char>(0)) {}
  ~Liveness() { expire(); }
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // A ref to `target`: the owner itself, or an object it owns (lives exactly as long).
  template <class T>
  AliveRef<T> ref(T* target) const {
    return AliveRef<T>(anchor_, target);
  }
  // Every ref handed out is dead from here on. Owners call it first thing in their destructor,
  // before they tear anything down that a hook would touch.
  void expire() { anchor_.reset(); }
  bool expired() const { return anchor_ == nullptr; }

 private:
  std::shared_ptr<const void> anchor_;
};

// Runs on_alive(owner) when backward reaches `tensor` (a hook on the tensor: before its
// gradient flows into its grad_fn); on_dead() instead once the owner is gone. The hook stays on
// the tensor as long as the tensor lives.
struct NothingToDo {
  void operator()() const {}
};
template <class T, class F, class G = NothingToDo>
void on_gradient_of(const at::Tensor& tensor, AliveRef<T> owner, F on_alive, G on_dead = {}) {
  at::Tensor hooked = tensor;  // shares the TensorImpl: the hook is registered on `tensor`
  hooked.register_hook([owner = std::move(owner), on_alive = std::move(on_alive),
                        on_dead = std::move(on_dead)](const at::Tensor&) {
    if (!owner.if_alive(on_alive)) on_dead();
  });
}

// Runs fn(owner) when the backward that is running now (its graph task) ends, if the owner is
// still alive then. Must be called from inside backward (a hook).
template <class T, class F>
void queue_end_of_backward(AliveRef<T> owner, F fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(
      [owner = std::move(owner), fn = std::move(fn)] { owner.if_alive(fn); });
}

}  // namespace fsdp::detail
