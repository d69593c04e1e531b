// FsdpParamGroup: one unit (a wrapped module, or the root unit) whose parameters are
// all-gathered together and whose gradients are reduce-scattered together.
#pragma once

#include "fsdp/comm.h"
#include "shard/fsdp_param.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::nn {
class Module;
}

namespace fsdp::detail {

class FsdpState;

// Which tensors hold memory in each state (see Note [Sharded and unsharded parameters]):
//   kSharded             S of every parameter; P storages are 0 bytes. At rest between steps
//                        and after the unit's post-backward.
//   kShardedPostForward  same memory as kSharded, but the unit ran forward in this step and
//                        resharded after it (FULL_SHARD): its backward will unshard it again.
//   kUnsharded           S and P of every parameter (P refilled from the all-gather output).
// Transitions: kSharded|kShardedPostForward -> kUnsharded (unshard), kUnsharded -> kSharded or
// kShardedPostForward (reshard), kShardedPostForward -> kSharded (end of step). Anything else is a bug and trips TORCH_INTERNAL_ASSERT.
enum class ShardedState { kSharded, kShardedPostForward, kUnsharded };

// Where the unit is in the step:
//   kIdle          between steps (after Strategy::post_backward / post_eval_step)
//   kForward       pre-forward ran in this step
//   kPreBackward   a pre-backward hook ran: its backward is (or will be) running
//   kPostBackward  its gradients have been reduce-scattered (or kept, without sync) and it is
//                  resharded
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

const char* to_string(ShardedState state);
const char* to_string(TrainingState state);

class FsdpParamGroup {
 public:
  // shard_group: the ranks a parameter is split over (size 1: every rank holds it whole).
  // replicate_group: ranks holding the same shard (HYBRID, NO_SHARD); null or size 1 for none.
  FsdpParamGroup(std::string name, fsdp::nn::Module* module, FsdpState* state,
                 ProcessGroupPtr shard_group, ProcessGroupPtr replicate_group,
                 bool reshard_after_forward);

  const std::string& name() const { return name_; }          // FQN of the unit, "<root>"
  void set_name(std::string name) { name_ = std::move(name); }  // deferred init: FQN known late
  fsdp::nn::Module* module() const { return module_; }      // null for the root unit
  bool is_root() const { return module_ == nullptr; }
  std::vector<std::unique_ptr<FsdpParam>>& params() { return params_; }
  const std::vector<std::unique_ptr<FsdpParam>>& params() const { return params_; }
  FsdpParam& add_param(at::Tensor unsharded, FsdpParam::Registration reg);

  // Computes the flat-buffer layout, shards every parameter. State becomes kSharded.
  void init();

  ShardedState sharded_state() const { return sharded_state_; }
  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState s) { training_state_ = s; }
  bool is_unsharded() const { return sharded_state_ == ShardedState::kUnsharded; }
  bool has_pending_all_gather() const { return static_cast<bool>(pending_ag_.work); }
  bool has_trainable() const { return rs_total_ > 0; }

  // --- collectives. See Note [Unit all-gather] in fsdp_param_group.cpp.
  // Issues the all-gather without waiting (a prefetch). Requires a sharded state.
  void issue_all_gather();
  // Waits for the pending all-gather (issuing it first if there is none) and copies out.
  void unshard();
  // Frees P's storages: state -> `next` (kSharded or kShardedPostForward).
  void reshard(ShardedState next = ShardedState::kSharded);
  // kShardedPostForward -> kSharded (no memory moves): the step is over for this unit.
  void reshard_state_to_rest();
  // Waits for and discards a prefetched all-gather that will not be used.
  void drop_pending_all_gather();

  // Reduce-scatters (average) the unsharded gradients into the sharded gradients and frees
  // them. Asynchronous: finish_reduce_scatter() waits and writes S.grad.
  void issue_reduce_scatter();
  void finish_reduce_scatter();
  bool has_pending_reduce_scatter() const { return !pending_rs_.empty(); }
  void free_unsharded_grads();

  // --- hooks (installed by FsdpState).
  void pre_forward(std::vector<at::Tensor>& inputs);
  void post_forward(at::Tensor& output);
  void pre_backward();
  // From the post-backward autograd function (all gradients flowing to the unit's inputs are
  // done) or from the end-of-backward callback.
  void post_backward();
  // End-of-backward callback: finishes this unit if its post-backward did not run.
  void finalize_backward();

  int order_index = -1;  // position in the recorded forward order (-1: not seen / root)
  // Elements of the flat all-gather input (bytes for a unit of mixed dtypes, see
  // Note [Units of mixed dtypes] in fsdp_param_group.cpp).
  int64_t all_gather_numel() const { return ag_total_; }
  int64_t reduce_scatter_numel() const { return rs_total_; }
  int64_t unsharded_bytes() const;
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }

  const ProcessGroupPtr& shard_group() const { return shard_group_; }
  const ProcessGroupPtr& replicate_group() const { return replicate_group_; }

  // Validated transition, see ShardedState.
  void transition(ShardedState next);

 private:
  int shard_world() const { return shard_group_->size(); }
  // Parameter i's slice of an all-gather buffer, viewed in its compute dtype.
  at::Tensor all_gather_slice(const at::Tensor& buffer, size_t i) const;
  static int64_t aligned_bytes(int64_t n) { return (n + 15) / 16 * 16; }

  struct PendingAllGather {
    WorkPtr work;
    at::Tensor input;   // (ag_total)
    at::Tensor output;  // (W * ag_total)
  };
  struct PendingReduceScatter {
    WorkPtr work;
    at::Tensor input;   // (W * rs_total), rank-major; empty when aliased
    at::Tensor output;  // (rs_total)
    bool replicated = false;  // work already averaged over the replicate group
  };

  std::string name_;
  fsdp::nn::Module* module_;
  FsdpState* state_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  bool reshard_after_forward_;
  std::vector<std::unique_ptr<FsdpParam>> params_;
  std::vector<int64_t> ag_offsets_;  // per param, into the all-gather input
  std::vector<int64_t> rs_offsets_;  // per param, into the reduce-scatter output (-1: frozen)
  int64_t ag_total_ = 0;
  int64_t rs_total_ = 0;
  // See Note [Mixed-precision parameters] in fsdp_param.h. aliased_: S is P for every
  // parameter (shard group of one rank, no cast): nothing is gathered or scattered.
  bool aliased_ = false;
  // Parameters of different compute dtypes: the all-gather moves bytes.
  bool byte_all_gather_ = false;
  at::ScalarType compute_dtype_ = at::kFloat;  // all-gather dtype = P's dtype
  at::ScalarType reduce_dtype_ = at::kFloat;   // reduce-scatter dtype

  ShardedState sharded_state_ = ShardedState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  PendingAllGather pending_ag_;
  std::vector<PendingReduceScatter> pending_rs_;
  // Pre-backward hooks that fired minus post-backwards that ran (a unit called twice has two).
  int backward_pending_ = 0;
};

}  // namespace fsdp::detail
