// Empty init and shape-only (meta) construction. See Note [Empty init] in include/fsdp/init.h.
#include "fsdp/init.h"

#include "fsdp/nn.h"
#include "nn/construction_scope.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fsdp {
namespace {

thread_local bool t_empty_init = false;
thread_local bool t_meta_init = false;
// The open construction scope of this thread. See Note [Configure-model scope] in
// src/train/strategy.cpp.
thread_local detail::ConstructionScope* t_scope = nullptr;

// The skipped op returns its first argument (self) untouched: in-place ops return self.
void skip_init_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  c10::IValue self = (*stack)[stack->size() - n];
  torch::jit::drop(*stack, n);
  stack->push_back(std::move(self));
}

// Factories: under MetaInitGuard a CPU (or unspecified) device becomes the meta device; then
// the op runs as usual below this key.
void meta_factory(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (t_meta_init) {
    const auto& args = op.schema().arguments();
    const size_t n = args.size();
    for (size_t i = 0; i < n; ++i) {
      if (args[i].name() != "device") continue;
      c10::IValue& device = (*stack)[stack->size() - n + i];
      if (device.isNone() || device.toDevice().is_cpu()) device = c10::IValue(c10::Device(c10::kMeta));
    }
  }
  c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::DeferredInit);
  op.callBoxed(stack);
}

}  // namespace

// Every other op falls through the key to its usual kernels.
TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, DeferredInit, m) {
  for (const char* name : {"uniform_", "normal_", "random_", "random_.from", "random_.to"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&skip_init_op>());
  }
  for (const char* name : {"empty.memory_format", "empty_strided"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&meta_factory>());
  }
}

EmptyInitGuard::EmptyInitGuard() : previous_(t_empty_init) {
  // The included key stays in the thread's set for as long as any guard is alive.
  if (!previous_) {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.included_ = tls.included_.add(c10::DispatchKey::DeferredInit);
    c10::impl::_force_tls_local_dispatch_key_set(tls);
  }
  t_empty_init = true;
}

EmptyInitGuard::~EmptyInitGuard() {
  if (!previous_) {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.included_ = tls.included_.remove(c10::DispatchKey::DeferredInit);
    c10::impl::_force_tls_local_dispatch_key_set(tls);
  }
  t_empty_init = previous_;
}

bool empty_init_enabled() { return t_empty_init; }

std::unique_ptr<EmptyInitGuard> init_module(bool empty_init) {
  if (!empty_init) return nullptr;
  return std::make_unique<EmptyInitGuard>();
}

struct MetaInitGuard::Impl {
  bool previous = t_meta_init;
};

MetaInitGuard::MetaInitGuard() : impl_(std::make_unique<Impl>()) { t_meta_init = true; }
MetaInitGuard::~MetaInitGuard() { t_meta_init = impl_->previous; }

namespace nn {

void notify_built(torch::nn::Module& module) {
  if (auto* listener = detail::ConstructionScope::current()) listener->on_built(module);
}

}  // namespace nn

namespace detail {

ConstructionScope::ConstructionScope(ConstructionListener& listener, std::string owner)
    : listener_(listener), owner_(std::move(owner)) {
  TORCH_CHECK(t_scope == nullptr, "[configure_model] configure_model is already running under ",
              t_scope ? t_scope->owner_ : std::string(), " on this thread; it must not nest (",
              owner_, " was asked to run it inside)");
  t_scope = this;
}

ConstructionScope::~ConstructionScope() { t_scope = nullptr; }

ConstructionListener* ConstructionScope::current() { return t_scope ? &t_scope->listener_ : nullptr; }

void notify_wrap(fsdp::nn::Module& module) {
  if (auto* listener = ConstructionScope::current()) listener->on_wrap(module);
}

}  // namespace detail
}  // namespace fsdp
