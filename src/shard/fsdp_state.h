// FsdpState: all units of one model, the hooks that drive them, the step's bookkeeping and
// prefetching. Control flows down: each hook calls the unit's operation (fsdp_param_group.h),
// then prefetches and does the bookkeeping across units (PyTorch FSDP2's FSDPState._pre_forward
// calls fsdp_param_group.pre_forward, then _prefetch_unshard). Units never call the state.
#pragma once

#include "common/liveness.h"
#include "fsdp/comm.h"
#include "fsdp/fsdp_strategy.h"
#include "offload/param_swapper.h"
#include "shard/fsdp_param_group.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {
class ShardedComputeModule;
}

namespace fsdp::detail {

// The engine's configuration (one place builds it from FSDPOptions: make_fsdp_config in
// options.h).
struct FsdpConfig {
  bool reshard_after_forward = true;  // FULL_SHARD / HYBRID_SHARD
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;
  bool limit_all_gathers = false;
  // See Note [Mixed-precision parameters] in fsdp_param.h.
  std::optional<MixedPrecisionPolicy> mixed_precision;
  // FSDPOptions::ignored_params: never assigned to a unit.
  std::set<const c10::TensorImpl*> ignored;
  // FSDPOptions::prefetch_bucket_numel / max_live_numel (ZeRO-3's stage3_prefetch_bucket_size
  // and stage3_max_live_parameters); 0 = off. See Note [Prefetch window] in fsdp_state.cpp.
  int64_t prefetch_bucket_numel = 0;
  int64_t max_live_numel = 0;
  // FSDPOptions::offload_policy: where the sharded parameters live between all-gathers.
  OffloadDevice offload_params = OffloadDevice::kNone;
  // Deferred init on CUDA: the device the shards of units built on the host go to (Note
  // [Deferred init onto the device] in deferred_init.cpp); nullopt = where the parameters are.
  std::optional<c10::Device> device;
};

// A unit to build: the module (null for the root) and its FQN.
struct UnitSpec {
  fsdp::nn::Module* module = nullptr;
  std::string fqn;
};

class FsdpState {
 public:
  FsdpState(FsdpConfig config, ProcessGroupPtr shard_group, ProcessGroupPtr replicate_group);
  // Removes the hooks from the units' modules that are still alive.
  ~FsdpState();

  // Assigns every parameter of `root` to the closest enclosing unit (or the root unit) and
  // checks tied parameters. Nothing is sharded yet.
  void build(torch::nn::Module& root, const std::vector<UnitSpec>& units);
  // Shards every parameter and installs the forward hooks on the units' modules.
  void materialize();

  const FsdpConfig& config() const { return config_; }
  std::vector<std::unique_ptr<FsdpParamGroup>>& units() { return units_; }  // root unit first
  const std::vector<std::unique_ptr<FsdpParamGroup>>& units() const { return units_; }
  FsdpParamGroup& root_unit() { return *units_.front(); }
  std::vector<FsdpParam*> all_params() const;
  const ProcessGroupPtr& shard_group() const { return shard_group_; }
  const ProcessGroupPtr& replicate_group() const { return replicate_group_; }

  // --- offload (FsdpConfig::offload_params). After materialize(), with offload_params kNvme:
  // every unit's shard becomes one swap record of a parameter swapper this state owns, and each
  // unit reads its record before its all-gather. Needs a shard group of 2+ ranks. See Note
  // [Parameters on disk] in docs/design.md.
  void place_params_on_disk(ParamSwapper::Options options);
  // The swapper of place_params_on_disk (null: the parameters are in RAM).
  ParamSwapper* param_swapper() const { return params_on_disk_.get(); }

  // --- one step, driven by FSDPStrategy (fsdp/strategy.h call order).
  void begin_step(bool sync);         // Strategy::pre_forward: the root unit's pre-forward
  void hook_loss(const at::Tensor& loss);  // Strategy::backward: on_backward_start at the loss
  void on_backward_start();           // first pre-backward of a backward: queue the callback
  void finish_step();                 // Strategy::post_backward: wait, check invariants
  void finish_eval_step();            // Strategy::post_eval_step: reshard, drop prefetches

  // --- the hooks (installed by materialize on every unit's module; see fsdp_state.cpp).
  void pre_forward(FsdpParamGroup& unit, std::vector<at::Tensor>& inputs);
  void post_forward(FsdpParamGroup& unit, at::Tensor& output);
  void pre_backward(FsdpParamGroup& unit);
  void post_backward(FsdpParamGroup& unit);
  void on_backward_end();  // the queued end-of-backward callback

  // Diagnostics (for tests): the recorded forward order, how many all-gathers were issued as
  // prefetches and how many were skipped because of limit_all_gathers.
  const std::vector<FsdpParamGroup*>& forward_order() const { return forward_order_; }
  int64_t num_prefetches() const { return num_prefetches_; }
  int64_t num_prefetches_limited() const { return num_prefetches_limited_; }
  // Elements of the units that hold unsharded parameters or a pending all-gather (the root
  // unit included), now and at their highest since construction or reset_peak_live; and how
  // many prefetched all-gathers were dropped to keep max_live_numel.
  int64_t live_numel() const;
  int64_t peak_live_numel() const { return peak_live_numel_; }
  void reset_peak_live() { peak_live_numel_ = live_numel(); }
  int64_t num_prefetches_evicted() const { return num_prefetches_evicted_; }
  // Units whose module computes on its shards (fsdp/sharded_compute.h): no hooks, nothing
  // gathered or reduce-scattered for them.
  const std::set<const FsdpParamGroup*>& units_on_shards() const { return on_shards_; }
  // Whether `unit` computes on its shards once materialized (after build(); memory planning
  // asks before). See Note [Units on shards] in fsdp_state.cpp.
  bool computes_on_shards(const FsdpParamGroup& unit) const;

  // --- deferred initialization (src/shard/deferred_init.cpp). See Note [Deferred
  // initialization] there. Before build(): shards `module`'s parameters at once as a unit
  // (those no earlier deferred unit took); build() adopts it when `units` selects the module.
  void shard_deferred_unit(fsdp::nn::Module& module);
  bool is_deferred_unit(const torch::nn::Module* module) const;
  size_t num_deferred_units() const { return deferred_.size(); }
  size_t num_adopted_units() const { return preinitialized_.size(); }  // after build()
  const std::vector<std::unique_ptr<FsdpParamGroup>>& deferred_units() const { return deferred_; }
  // All-gathers the deferred units `specs` does not select back into full parameters (every
  // rank, same order) and drops them; so does restore_all_deferred for all of them.
  void restore_unselected_deferred(const std::vector<UnitSpec>& specs);
  void restore_all_deferred() { restore_unselected_deferred({}); }

 private:
  std::unique_ptr<FsdpParamGroup> new_unit(std::string name, fsdp::nn::Module* module,
                                           bool reshard);
  // See Note [One reduce-scatter in flight] in fsdp_state.cpp.
  void reduce_scatter_issued(FsdpParamGroup& unit);
  // See Note [Prefetch] in fsdp_state.cpp.
  void record_forward(FsdpParamGroup& unit);
  bool may_prefetch(FsdpParamGroup& candidate);
  void prefetch_after_forward_of(FsdpParamGroup& unit);
  void prefetch_before_backward_of(FsdpParamGroup& unit);
  // See Note [Prefetch window] in fsdp_state.cpp.
  void prefetch_window(FsdpParamGroup& unit, bool forward);
  void make_room_for(FsdpParamGroup& unit);
  void note_live() { peak_live_numel_ = std::max(peak_live_numel_, live_numel()); }
  // See Note [Units on shards] in fsdp_state.cpp. True when `unit` now computes on its shards.
  bool hand_shards_to_module(FsdpParamGroup& unit);

  FsdpConfig config_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  // Declared before the units: they hold a pointer to it, and it outlives them.
  std::unique_ptr<ParamSwapper> params_on_disk_;
  std::vector<std::unique_ptr<FsdpParamGroup>> units_;
  // The forward hooks materialize() installed, removed again by the destructor.
  struct InstalledHooks {
    std::weak_ptr<torch::nn::Module> module;
    fsdp::nn::Module* hooked;
    int pre_forward;
    int post_forward;
  };
  std::vector<InstalledHooks> hooks_;
  // Modules given a shard context, told to drop it by the destructor.
  struct ShardedModule {
    std::weak_ptr<torch::nn::Module> module;
    ShardedComputeModule* sharded;
  };
  std::vector<ShardedModule> sharded_modules_;
  std::set<const FsdpParamGroup*> on_shards_;
  // Expired in the destructor: every hook and callback (forward hooks, the loss and pre-backward
  // hooks, the post-backward function, the end-of-backward callback) may outlive us when a graph
  // built under this state runs backward later; each reaches us through alive_.ref(this). See
  // Note [Gradient buckets] in src/ddp/grad_buckets.h, "Liveness".
  Liveness alive_;

  bool sync_ = true;
  bool callback_queued_ = false;
  FsdpParamGroup* reduce_scatter_in_flight_ = nullptr;
  bool order_frozen_ = false;
  std::vector<FsdpParamGroup*> forward_order_;
  std::unordered_map<const FsdpParamGroup*, int> order_index_;  // position in forward_order_
  int64_t num_prefetches_ = 0;
  int64_t num_prefetches_limited_ = 0;
  int64_t num_prefetches_evicted_ = 0;
  int64_t peak_live_numel_ = 0;

  // Deferred units in build order, their (module, name) registrations, and the groups that
  // build() adopted from them (already sharded: materialize() does not init them again).
  std::unique_ptr<FsdpParamGroup> take_deferred_unit(const torch::nn::Module* module,
                                                     const std::string& fqn);
  std::vector<std::unique_ptr<FsdpParamGroup>> deferred_;
  std::set<std::pair<const torch::nn::Module*, std::string>> deferred_taken_;
  std::set<const FsdpParamGroup*> preinitialized_;
  // Deferred units' modules stay alive until build() (a module built in configure_model and
  // dropped again is restored, not left dangling).
  std::vector<std::shared_ptr<torch::nn::Module>> deferred_keep_alive_;
};

}  // namespace fsdp::detail
