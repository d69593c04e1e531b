// Model initialization: deferred (sharded-as-built) init under FSDP, empty init before loading
// weights, and shape-only (meta) construction for memory planning.
//
//   // Skip parameter initialization because a checkpoint overwrites every value anyway
//   // (Lightning's `with fabric.init_module(empty_init=True)`):
//   {
//     auto guard = fsdp::init_module(/*empty_init=*/true);   // or trainer.init_module(true)
//     model = fsdp::demos::make_model("transformer-small");
//   }
//   fsdp::load_weights(*model, "ckpt/step-100");
//
//   // Shapes only, nothing allocated (fsdp-train --dry-run):
//   std::shared_ptr<fsdp::nn::Module> shapes;
//   { fsdp::MetaInitGuard meta; shapes = fsdp::demos::make_model("transformer-1b"); }
//   auto need = fsdp::estimate_fsdp_memory(*shapes, options, /*world_size=*/2);
//
// Deferred initialization needs no code from users of the demo models: under FSDPStrategy
// (FULL_SHARD / SHARD_GRAD_OP) every unit is sharded as soon as it is built, inside
// configure_model, so no rank ever holds the whole model. See Note [Deferred initialization]
// in src/shard/deferred_init.cpp and fsdp::nn::built() in fsdp/nn.h for custom models.
#pragma once

#include "fsdp/fsdp_strategy.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>

namespace fsdp {

// Note [Empty init]
// -----------------
// While an EmptyInitGuard is alive on a thread, the random in-place ops are skipped on that
// thread (they return their input untouched, its memory uninitialized):
//   uniform_, normal_, random_ (all overloads)
// These are what parameter initialization spends its time on: torch::nn::init::uniform_,
// normal_, xavier_*, kaiming_* and the constructors of torch::nn::Linear/Embedding/Conv and
// of the demo models all draw through them. Constructing a model under the guard therefore
// allocates its parameters (at::empty) but draws no random numbers and does not write (or
// touch: the pages stay unmapped) the memory of randomly initialized tensors. Not skipped:
// deterministic fills (zeros_/ones_/constant_, at::zeros, LayerNorm's ones and zeros,
// zero biases), which are cheap and which arithmetic with scalars relies on.
// Consequences:
//   - randomly initialized parameters hold garbage until they are loaded: load every
//     parameter (fsdp::load_weights, Trainer checkpoints), or initialize it after the guard;
//   - the global torch generator is not advanced, so random numbers drawn later (dropout,
//     data) differ from a run that initialized normally;
//   - at::rand/randn/randint called under the guard return uninitialized memory too.
// Implemented with kernels under the DeferredInit dispatch key (the out-of-tree key libtorch
// reserves for deferred module initialization), included in the thread's dispatch key set.
class EmptyInitGuard {
 public:
  EmptyInitGuard();
  ~EmptyInitGuard();
  EmptyInitGuard(const EmptyInitGuard&) = delete;
  EmptyInitGuard& operator=(const EmptyInitGuard&) = delete;

 private:
  bool previous_;
};
// True while an EmptyInitGuard is alive on this thread.
bool empty_init_enabled();

// Lightning's init_module(empty_init): returns a guard; with empty_init=false it does nothing.
// Keep it alive while the model is constructed:
//   auto g = fsdp::init_module(true);   // ... construct ...   g.reset();  (or end the scope)
std::unique_ptr<EmptyInitGuard> init_module(bool empty_init);

// Shape-only construction: while alive, at::empty / at::empty_strided (and so every factory
// built on them: zeros, ones, full, rand, ...) called on this thread with a CPU or unspecified
// device create meta tensors (shapes, no storage), and random ops are skipped as under
// EmptyInitGuard. Parameters get their real shapes,
// dtypes and requires_grad, so parameter counts and memory estimates work; running forward
// or copying values out of such a model fails. A meta model cannot become a real one in
// place: build the real model separately.
class MetaInitGuard {
 public:
  MetaInitGuard();
  ~MetaInitGuard();
  MetaInitGuard(const MetaInitGuard&) = delete;
  MetaInitGuard& operator=(const MetaInitGuard&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  EmptyInitGuard empty_;
};

// FSDP model-state estimate per rank for `model` (its parameters may be meta tensors) under
// `options` (sharding strategy, wrap policy) at `world_size` ranks, `local_world_size` per
// node (hybrid shard groups): the same numbers FSDPStrategy::memory_estimate() gives after
// setup_module, computed without process groups and without allocating anything.
FSDPMemoryEstimate estimate_fsdp_memory(torch::nn::Module& model, const FSDPOptions& options,
                                        int world_size, int local_world_size = 0);

}  // namespace fsdp
