// fsdp::nn::Module — a torch::nn::Module whose call operator runs hooks around forward.
//
// libtorch modules have no forward hooks, and FSDP needs a call site: pre-forward unshards a
// unit, post-forward reshards it and arms the backward hooks. Modules that FSDP may wrap (the
// demo models' layers, your own blocks) derive from fsdp::nn::Module and implement
// `forward(const Inputs&)`; callers use `(*module)(x, mask)` or `module->call({x, mask})`.
// Plain torch::nn modules can live inside such a module as usual, and a plain torch::nn module
// becomes a unit candidate through a holder (fsdp::nn::unit, fsdp::nn::unit_children in
// fsdp/unit.h) without being rewritten.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fsdp::detail {

// The module type a module handle (torch::nn::ModuleHolder) holds; any other type itself.
template <typename T, typename = void>
struct HandledType {
  using type = T;
};
template <typename T>
struct HandledType<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;
};

}  // namespace fsdp::detail

namespace fsdp::nn {

using Inputs = std::vector<at::Tensor>;

class Module : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  ~Module() override = default;

  // May replace inputs (e.g. cast them for mixed precision).
  using PreForwardHook = std::function<void(Module&, Inputs& inputs)>;
  // May replace the output.
  using PostForwardHook = std::function<void(Module&, const Inputs& inputs, at::Tensor& output)>;
  // Replaces the call of forward itself (activation checkpointing routes forward through a
  // recomputing autograd function). At most one.
  using ForwardWrapper = std::function<at::Tensor(Module&, const Inputs& inputs)>;

  int add_pre_forward_hook(PreForwardHook hook);
  int add_post_forward_hook(PostForwardHook hook);
  void remove_hook(int handle);
  void set_forward_wrapper(ForwardWrapper wrapper) { forward_wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(forward_wrapper_); }

  // Runs pre-forward hooks, forward (or the forward wrapper), post-forward hooks.
  at::Tensor call(Inputs inputs);

  template <typename... Ts>
  at::Tensor operator()(Ts&&... args) {
    return call(Inputs{at::Tensor(std::forward<Ts>(args))...});
  }

  // Unhooked forward. Undefined tensors stand for "no argument" (e.g. no mask).
  virtual at::Tensor forward(const Inputs& inputs) = 0;

 private:
  std::vector<std::pair<int, PreForwardHook>> pre_hooks_;
  std::vector<std::pair<int, PostForwardHook>> post_hooks_;
  ForwardWrapper forward_wrapper_;
  int next_handle_ = 0;
};

// A set of module types, for wrap and activation-checkpointing policies:
//   fsdp::nn::ModuleTypes types = fsdp::nn::module_types<EncoderLayer, DecoderLayer>();
// A module handle names its module type: module_types<torch::nn::Linear>() is
// module_types<torch::nn::LinearImpl>().
using ModuleTypes = std::unordered_set<std::type_index>;
template <typename... Ts>
ModuleTypes module_types() {
  return ModuleTypes{std::type_index(typeid(typename fsdp::detail::HandledType<Ts>::type))...};
}
// Whether `m`'s type is in `types`; a unit holder (fsdp/unit.h) also matches by the type of the
// module it wraps.
bool is_instance_of(const torch::nn::Module& m, const ModuleTypes& types);

// --- Construction notifications (deferred initialization; see fsdp/init.h).
//
// A model says "this submodule is fully constructed and initialized; nothing writes its
// parameters again before training" by passing it through built():
//
//   layers->push_back(fsdp::nn::built(std::make_shared<Block>(...)));
//
// Outside configure_model (as the Trainer or fsdp::configure_model_with runs it) this returns the
// module and does nothing else. Under FSDPStrategy (FULL_SHARD / SHARD_GRAD_OP), the units the
// auto-wrap policy selects inside the module are sharded at once, freeing their full-size
// storage before the next layer is built. Afterwards module.parameters() of that subtree returns
// sharded parameters, so change requires_grad or values before built(), not after. The demo
// models call it for their layers; fsdp::wrap() implies it. The strategy that receives it is the
// one running configure_model on this thread (Note [Configure-model scope] in
// src/train/strategy.cpp).
void notify_built(torch::nn::Module& module);

template <typename M>
std::shared_ptr<M> built(std::shared_ptr<M> module) {
  notify_built(*module);
  return module;
}

}  // namespace fsdp::nn
