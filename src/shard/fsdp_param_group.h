// FsdpParamGroup: one unit (a wrapped module, or the root unit) whose parameters are
// all-gathered together and whose gradients are reduce-scattered together. FSDP2 calls it a
// parameter group; this project says unit (docs/design.md).
//
// A unit knows its parameters, its state machine and its collectives, and nothing about the
// other units: FsdpState (fsdp_state.h) owns the hooks, calls the unit's operations below and
// does the prefetching and bookkeeping across units. A unit never calls its state.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/precision.h"
#include "shard/collectives.h"
#include "shard/fsdp_param.h"
#include "offload/param_residency.h"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::nn {
class Module;
}

namespace fsdp::detail {

// Which tensors hold memory in each state (see Note [Sharded and unsharded parameters]):
//   kSharded                S of every parameter; P storages are 0 bytes. At rest between
//                           steps and after the unit's post-backward.
//   kReshardedAfterForward  same memory as kSharded, but the unit ran forward in this step and
//                           was resharded after it (FULL_SHARD): its backward unshards it again.
//   kUnsharded              S and P of every parameter (P refilled from the all-gather output).
// Transitions: kSharded|kReshardedAfterForward -> kUnsharded (unshard), kUnsharded -> kSharded
// or kReshardedAfterForward (reshard), kReshardedAfterForward -> kSharded (mark_at_rest, end of
// step). Anything else is a bug and trips TORCH_INTERNAL_ASSERT.
enum class ShardedState { kSharded, kReshardedAfterForward, kUnsharded };

// Where the unit is in the step:
//   kIdle          between steps (after Strategy::post_backward / post_eval_step)
//   kForward       pre-forward ran in this step
//   kPreBackward   a pre-backward hook ran: its backward is (or will be) running
//   kPostBackward  its gradients have been reduce-scattered (or kept, without sync) and it is
//                  resharded
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

const char* to_string(ShardedState state);
const char* to_string(TrainingState state);

// A unit's configuration, given by value when it is built.
struct UnitConfig {
  // The ranks a parameter is split over (size 1: every rank holds it whole).
  ProcessGroupPtr shard_group;
  // Ranks holding the same shard (HYBRID, NO_SHARD); null or size 1 for none.
  ProcessGroupPtr replicate_group;
  bool reshard_after_forward = true;  // FULL_SHARD / HYBRID_SHARD
  // See Note [Mixed-precision parameters] in fsdp_param.h.
  std::optional<MixedPrecisionPolicy> mixed_precision;
  // Where the shards go when the parameters are elsewhere (deferred init on CUDA: Note
  // [Deferred init onto the device] in deferred_init.cpp); nullopt = where they are.
  std::optional<c10::Device> device;
};

class FsdpParamGroup {
 public:
  FsdpParamGroup(std::string name, fsdp::nn::Module* module, UnitConfig config);

  const std::string& name() const { return name_; }          // FQN of the unit, "<root>"
  void set_name(std::string name) { name_ = std::move(name); }  // deferred init: FQN known late
  fsdp::nn::Module* module() const { return module_; }      // null for the root unit
  bool is_root() const { return module_ == nullptr; }
  FsdpParams& params() { return params_; }
  const FsdpParams& params() const { return params_; }
  FsdpParam& add_param(at::Tensor unsharded, FsdpParam::Registration reg);

  // Computes the flat-buffer layout, shards every parameter. State becomes kSharded.
  void init();

  ShardedState sharded_state() const { return sharded_state_; }
  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState s) { training_state_ = s; }
  bool is_unsharded() const { return sharded_state_ == ShardedState::kUnsharded; }
  bool has_pending_all_gather() const { return static_cast<bool>(pending_ag_.work); }

  // --- collectives (collectives.h does the buffer math).
  // Issues the all-gather without waiting (a prefetch). Requires a sharded state.
  void issue_all_gather();
  // Waits for the pending all-gather (issuing it first if there is none) and copies out.
  void unshard();
  // Frees P's storages: state -> `next` (kSharded or kReshardedAfterForward).
  void reshard(ShardedState next = ShardedState::kSharded);
  // kReshardedAfterForward -> kSharded (no memory moves): the step is over for this unit.
  void mark_at_rest();
  // Waits for and discards a prefetched all-gather that will not be used.
  void drop_pending_all_gather();
  // Reduce-scatters (average) the unsharded gradients into the sharded gradients and frees
  // them. Asynchronous: finish_reduce_scatter() waits and writes S.grad.
  void issue_reduce_scatter();
  void finish_reduce_scatter();

  // --- the unit's part of each hook (FsdpState calls these; see fsdp_state.cpp).
  void pre_forward();   // kForward; unshard
  void post_forward();  // FULL_SHARD: reshard (not while recomputing a checkpointed block)
  void pre_backward();  // kPreBackward; unshard
  // The unit's backward is done: reduce-scatter (when `sync`), reshard. Returns false, doing
  // nothing, while another call of the same unit still runs its backward.
  bool post_backward(bool sync);
  // End of backward: finishes this unit if its post-backward did not run.
  void finalize_backward(bool sync);

  int64_t unsharded_bytes() const;
  int64_t unsharded_numel() const;  // elements of the full parameters
  // Where the parameters sit in the flat buffers (valid after init).
  const FlatLayout& layout() const { return layout_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  const ProcessGroupPtr& shard_group() const { return config_.shard_group; }
  const ProcessGroupPtr& replicate_group() const { return config_.replicate_group; }

  // Validated transition, see ShardedState.
  void transition(ShardedState next);

  // Where the sharded parameters live between all-gathers (parameters on disk); null: in RAM.
  // Only the FsdpState that built the unit sets it, as its FsdpConfig::offload_params says
  // (FsdpState::place_params_on_disk). See Note [Parameters on disk] in docs/design.md.
  void set_residency(ParamResidency* residency) { residency_ = residency; }

 private:
  std::string name_;
  fsdp::nn::Module* module_;
  UnitConfig config_;
  FsdpParams params_;
  FlatLayout layout_;
  // See Note [Mixed-precision parameters] in fsdp_param.h. aliased_: S is P for every
  // parameter (shard group of one rank, no cast): nothing is gathered or scattered.
  bool aliased_ = false;
  at::ScalarType compute_dtype_ = at::kFloat;  // all-gather dtype = P's dtype
  at::ScalarType reduce_dtype_ = at::kFloat;   // reduce-scatter dtype

  ParamResidency* residency_ = nullptr;
  ShardedState sharded_state_ = ShardedState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  AllGather pending_ag_;
  std::vector<ReduceScatter> pending_rs_;
  // Pre-backward hooks that fired minus post-backwards that ran (a unit called twice has two).
  int backward_pending_ = 0;
};

}  // namespace fsdp::detail
