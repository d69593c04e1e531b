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
#include <memory>
#include <optional>

namespace fsdp {

class ProcessGroup;

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

// --- Activation partitioning (DeepSpeed's partition_activations and cpu_checkpointing) -------
//
//   fsdp::configure_activation_partitioning(fsdp::ActivationPartitioning{tp_group});
//
// While configured, a checkpointed block keeps, of each floating input it saves for its
// recompute (with at least `group` size elements), only this rank's 1/W slice (flattened; the
// last slices padded) and all-gathers the whole input over `group` when backward recomputes the
// block. The other inputs are saved as usual. The ranks of `group` must hold identical inputs to
// the checkpointed blocks and run the same blocks in the same order: that is DeepSpeed's
// model-parallel group. Data-parallel ranks see different batches and must not form one; with
// no group (or a group of one rank) every rank keeps its inputs whole, which is what DeepSpeed
// does when no model-parallel unit is given (Lightning passes none). cpu_checkpointing keeps the
// saved slices in host memory (on a CPU device that is where they are: nothing is copied).
// Process-wide, like deepspeed.checkpointing.configure; std::nullopt turns it off. See Note
// [Activation partitioning] in src/nn/activation_partitioning.cpp.
struct ActivationPartitioning {
  std::shared_ptr<ProcessGroup> group;  // null: one rank, inputs stay whole
  bool cpu_checkpointing = false;
};
void configure_activation_partitioning(std::optional<ActivationPartitioning> config);
std::optional<ActivationPartitioning> activation_partitioning();

}  // namespace fsdp
