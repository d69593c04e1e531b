// Activation checkpointing: trade compute for activation memory.
//
//   fsdp::apply_activation_checkpointing(*model, fsdp::demos::layer_types("transformer-small"));
//
// Every fsdp::nn::Module of the given types (or accepted by the predicate) gets a forward
// wrapper (fsdp::nn::Module::set_forward_wrapper) that runs the block under no-grad, keeping
// only its inputs and the CPU RNG state; backward re-runs the block's forward with the same RNG
// state (so dropout masks match) and back-propagates through the recomputed graph. Gradients
// are those of the plain model: input gradients flow on, parameter gradients accumulate into
// .grad as usual. See Note [Checkpoint function] in src/nn/activation_checkpointing.cpp.
//
// It is a module transform, so it works under every strategy:
//   - FSDP: FSDPOptions::activation_checkpointing_policy applies it in setup_module, or the
//     model calls apply_activation_checkpointing in configure_model (then the strategy's policy
//     is not applied on top). A resharded unit is re-gathered by its pre-backward hook before
//     the recompute runs.
//   - DDP / single: call apply_activation_checkpointing in configure_model (or on any model).
//
// Limits: the recompute runs the block's forward again (about +1/3 of the block's compute);
// only the default CPU generator's state is saved and restored; double backward
// (create_graph=true) through a checkpointed block is not supported; a block must be
// deterministic given its inputs, parameters and the RNG state; tensors the block reads other
// than its inputs and parameters (e.g. members changed between forward and backward) are read
// again at recompute time.
#pragma once

#include "fsdp/nn.h"

#include <torch/nn/module.h>

#include <functional>

namespace fsdp {

using CheckpointPredicate = std::function<bool(const fsdp::nn::Module&)>;

// Wraps every fsdp::nn::Module in `root` (including root itself) of one of `policy`'s types.
// A module that is already checkpointed is left as it is. Returns the number of modules newly
// wrapped. A matching module that already has another forward wrapper is an error.
int apply_activation_checkpointing(torch::nn::Module& root, const fsdp::nn::ModuleTypes& policy);
// Predicate form: wraps every fsdp::nn::Module for which `predicate` returns true.
int apply_activation_checkpointing(torch::nn::Module& root, const CheckpointPredicate& predicate);

// Wraps one module (no-op when it is already checkpointed).
void checkpoint_module(fsdp::nn::Module& module);

// True when `module`'s forward wrapper is the activation-checkpointing one.
bool is_activation_checkpointed(const fsdp::nn::Module& module);
// Number of checkpointed fsdp::nn::Modules in `root` (including root).
int count_activation_checkpointed(torch::nn::Module& root);

// True on this thread while a checkpointed block re-runs its forward during backward (hooks
// use it: FSDP does not reshard a unit after a recomputed forward, since its backward follows).
bool in_activation_recompute();

}  // namespace fsdp
