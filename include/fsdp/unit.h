// fsdp::nn::Unit: any torch::nn module as an FSDP unit, without rewriting it.
//
// FSDP unshards a unit before its forward and reshards it after, so a unit needs a call site
// with hooks: an fsdp::nn::Module. Unit<M> is one around a plain torch::nn module `M` (a
// torch::nn::Linear, your own torch::nn::Module subclass, a torch::nn::Sequential block):
//
//   // A Sequential's children, in place (every child that holds parameters):
//   auto net = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
//                                    torch::nn::Linear(256, 64));
//   fsdp::nn::unit_children(*net);
//
//   // One module, where it is registered; call it as before: (*block)(x) or block->forward(x).
//   block = register_module("block", fsdp::nn::unit(std::make_shared<MyBlock>()));
//
// A unit holder is a candidate: the wrap policy decides which become units
// (AutoWrapPolicy::of_types(fsdp::nn::module_types<torch::nn::Linear>()) selects the holders of
// Linear; size_based(N) the holders with at least N parameter elements), or fsdp::wrap(holder)
// inside configure_model makes it one. Under every other strategy a holder just calls the module.
//
// Names do not change: the holder registers the wrapped module's parameters, buffers and
// children as its own, under their own names, and the wrapped module itself is not a child. So
// `0.weight` of a Sequential stays `0.weight`, and checkpoints and fsdp::load_weights files of
// the plain model and of the wrapped one are interchangeable. Wrap a module after it has
// registered everything (a parameter registered later is not seen by the holder).
//
// The wrapped module's forward must take tensors and return one tensor (what FSDP's hooks see).
#pragma once

#include "fsdp/nn.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <type_traits>
#include <utility>

namespace fsdp::detail {

template <typename... Ts>
inline constexpr bool always_false = false;

template <typename T>
inline constexpr bool is_tensor = std::is_same_v<std::decay_t<T>, at::Tensor>;

// The signature of M::forward as a function type, or void when M has no single forward (an
// overloaded or template forward). A Sequential block is called with one tensor.
template <typename F>
struct FunctionOf {
  using type = void;
};
template <typename R, typename C, typename... Args>
struct FunctionOf<R (C::*)(Args...)> {
  using type = R(Args...);
};
template <typename R, typename C, typename... Args>
struct FunctionOf<R (C::*)(Args...) const> {
  using type = R(Args...);
};
template <typename M, typename = void>
struct ForwardOf {
  using type = void;
};
template <typename M>
struct ForwardOf<M, std::void_t<decltype(&M::forward)>> : FunctionOf<decltype(&M::forward)> {};
template <>
struct ForwardOf<torch::nn::SequentialImpl> {
  using type = at::Tensor(at::Tensor);
};

template <typename F>
inline constexpr bool tensor_signature = false;
template <typename R, typename... Args>
inline constexpr bool tensor_signature<R(Args...)> =
    std::is_same_v<R, at::Tensor> && (is_tensor<Args> && ...);

// `M` of a module handle: LinearImpl for torch::nn::Linear and std::shared_ptr<LinearImpl>.
template <typename T, typename = void>
struct ModuleOf {
  using type = void;
};
template <typename M>
struct ModuleOf<std::shared_ptr<M>> {
  using type = M;
};
template <typename T>
struct ModuleOf<T, std::enable_if_t<std::is_base_of_v<torch::nn::ModuleHolder<typename T::ContainedType>, T>>> {
  using type = typename T::ContainedType;
};

}  // namespace fsdp::detail

namespace fsdp::nn {

// The part of every holder that does not depend on the wrapped type.
class UnitBase : public Module {
 public:
  // The wrapped module: not a registered child (its registrations are the holder's).
  const std::shared_ptr<torch::nn::Module>& wrapped() const { return wrapped_; }
  // train()/eval() reach the wrapped module's own flag too (its children are the holder's).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;
  // The wrapped module's forward, unhooked.
  at::Tensor forward(const Inputs& inputs) final;

 protected:
  explicit UnitBase(std::shared_ptr<torch::nn::Module> wrapped);
  virtual at::Tensor run_wrapped(const Inputs& inputs) = 0;
  // The error for `given` inputs to a forward of `arity` tensors.
  void check_arity(size_t given, size_t arity) const;

 private:
  std::shared_ptr<torch::nn::Module> wrapped_;
};

// Wraps every child of `seq` that holds parameters and is not an fsdp::nn::Module already into a
// holder, in place (same names, same order; `seq->forward` calls the holders). Children without
// parameters (activations, dropout) stay as they are. Such a child's forward must take the one
// tensor the Sequential passes and return a tensor; another signature is an error at its first
// forward, naming the child. Returns how many children it wrapped.
int unit_children(torch::nn::SequentialImpl& seq);
inline int unit_children(torch::nn::Sequential& seq) { return unit_children(*seq); }


// The holder of a module of type M. Its forward has M's signature and runs FSDP's hooks around
// M's forward; module() is the wrapped module (`holder->module()->weight`).
template <typename M, typename Signature = typename fsdp::detail::ForwardOf<M>::type>
class Unit;

// Unit<M>::forward hides fsdp::nn::Module::forward(const Inputs&) on purpose: a
// torch::nn::Sequential calls a child through its one `forward`, which must have M's signature.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverloaded-virtual"
template <typename M, typename... Args>
class Unit<M, at::Tensor(Args...)> : public UnitBase {
 public:
  explicit Unit(std::shared_ptr<M> module) : UnitBase(module), module_(std::move(module)) {}

  at::Tensor forward(Args... args) { return call(Inputs{at::Tensor(args)...}); }
  const std::shared_ptr<M>& module() const { return module_; }

 protected:
  // Missing trailing inputs are undefined tensors ("no argument", as fsdp::nn::Module's).
  at::Tensor run_wrapped(const Inputs& inputs) override {
    check_arity(inputs.size(), sizeof...(Args));
    return run(inputs, std::index_sequence_for<Args...>{});
  }

 private:
  template <size_t... I>
  at::Tensor run(const Inputs& inputs, std::index_sequence<I...>) {
    return module_->forward((I < inputs.size() ? inputs[I] : at::Tensor())...);
  }

  std::shared_ptr<M> module_;
};
#pragma GCC diagnostic pop

// The holder of `module` (a std::shared_ptr<M> or a module handle such as torch::nn::Linear).
template <typename T>
auto unit(T module) {
  using M = typename fsdp::detail::ModuleOf<std::decay_t<T>>::type;
  if constexpr (std::is_void_v<M>) {
    static_assert(fsdp::detail::always_false<T>,
                  "fsdp::nn::unit takes a torch::nn module: a std::shared_ptr to a "
                  "torch::nn::Module subclass or a module handle such as torch::nn::Linear.");
  } else if constexpr (!std::is_base_of_v<torch::nn::Module, M>) {
    static_assert(fsdp::detail::always_false<T>,
                  "fsdp::nn::unit: the module type does not derive from torch::nn::Module.");
  } else if constexpr (std::is_base_of_v<Module, M>) {
    static_assert(fsdp::detail::always_false<T>,
                  "fsdp::nn::unit: this module is an fsdp::nn::Module already and has FSDP's "
                  "hooks; use it as it is (fsdp::wrap(module) makes it a unit).");
  } else if constexpr (std::is_void_v<typename fsdp::detail::ForwardOf<M>::type>) {
    static_assert(fsdp::detail::always_false<T>,
                  "fsdp::nn::unit: the module has no single forward (it is overloaded or a "
                  "template), so its holder cannot take its call signature. Wrap the module "
                  "that calls it, or derive it from fsdp::nn::Module.");
  } else if constexpr (!fsdp::detail::tensor_signature<typename fsdp::detail::ForwardOf<M>::type>) {
    static_assert(fsdp::detail::always_false<T>,
                  "fsdp::nn::unit: the module's forward must take tensors (at::Tensor or const "
                  "at::Tensor&) and return one at::Tensor, which FSDP's hooks see. Wrap the "
                  "module around it whose forward does, or derive it from fsdp::nn::Module.");
  } else {
    std::shared_ptr<M> ptr;
    if constexpr (std::is_base_of_v<torch::nn::ModuleHolder<M>, std::decay_t<T>>) {
      ptr = module.ptr();
    } else {
      ptr = std::move(module);
    }
    return std::make_shared<Unit<M>>(std::move(ptr));
  }
}

}  // namespace fsdp::nn
