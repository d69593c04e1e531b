// Empty init and shape-only (meta) construction. See Note [Empty init] in include/fsdp/init.h.
#include "fsdp/init.h"

#include "fsdp/nn.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fsdp {
namespace {

thread_local bool t_empty_init = false;
thread_local bool t_meta_init = false;
thread_local nn::InitObserver* t_observer = nullptr;

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

InitObserver* init_observer() { return t_observer; }

InitObserver* set_init_observer(InitObserver* observer) {
  InitObserver* previous = t_observer;
  t_observer = observer;
  return previous;
}

void notify_built(torch::nn::Module& module) {
  if (t_observer) t_observer->on_built(module);
}

}  // namespace nn
}  // namespace fsdp
