// FsdpState: all units of one model, their hooks, the step's bookkeeping and prefetching.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/fsdp_strategy.h"
#include "shard/fsdp_param_group.h"

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {

struct FsdpConfig {
  bool reshard_after_forward = true;  // FULL_SHARD / HYBRID_SHARD
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;
  bool limit_all_gathers = false;
  // See Note [Mixed-precision parameters] in fsdp_param.h.
  std::optional<MixedPrecisionPolicy> mixed_precision;
};

// A unit to build: the module (null for the root) and its FQN.
struct UnitSpec {
  fsdp::nn::Module* module = nullptr;
  std::string fqn;
};

class FsdpState {
 public:
  FsdpState(FsdpConfig config, ProcessGroupPtr shard_group, ProcessGroupPtr replicate_group);
  ~FsdpState();

  // Assigns every parameter of `root` to the closest enclosing unit (or the root unit) and
  // checks tied parameters. Nothing is sharded yet.
  void build(torch::nn::Module& root, const std::vector<UnitSpec>& units);
  // Shards every parameter and installs the forward hooks on the units' modules.
  void materialize();

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

  const FsdpConfig& config() const { return config_; }
  std::vector<std::unique_ptr<FsdpParamGroup>>& units() { return units_; }  // root unit first
  FsdpParamGroup& root_unit() { return *units_.front(); }
  std::vector<FsdpParam*> all_params();
  const ProcessGroupPtr& shard_group() const { return shard_group_; }
  const ProcessGroupPtr& replicate_group() const { return replicate_group_; }

  // --- one step.
  bool sync() const { return sync_; }
  void begin_step(bool sync);           // Strategy::pre_forward: unshard the root unit
  void on_backward_start();             // first pre-backward of a backward: queue the callback
  void on_backward_end();               // the queued end-of-backward callback
  bool backward_finalized() const { return !callback_queued_; }
  void finish_step();                   // Strategy::post_backward: wait, check invariants
  void finish_eval_step();              // reshard everything, drop prefetches
  // A unit has just issued its reduce-scatter: finish the one issued before it (by another
  // unit). See Note [One reduce-scatter in flight] in fsdp_state.cpp.
  void reduce_scatter_issued(FsdpParamGroup& unit);

  // --- prefetch. See Note [Prefetch] in fsdp_state.cpp.
  void record_forward(FsdpParamGroup& unit);
  void prefetch_after_forward_of(FsdpParamGroup& unit);
  void prefetch_before_backward_of(FsdpParamGroup& unit);
  const std::vector<FsdpParamGroup*>& forward_order() const { return forward_order_; }

  // Diagnostics: how many all-gathers were issued as prefetches and how many were skipped
  // because of limit_all_gathers (for tests).
  int64_t num_prefetches() const { return num_prefetches_; }
  int64_t num_prefetches_limited() const { return num_prefetches_limited_; }

 private:
  bool may_prefetch(FsdpParamGroup& candidate);

  FsdpConfig config_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  std::vector<std::unique_ptr<FsdpParamGroup>> units_;
  // Deferred units in build order, their (module, name) registrations, and the groups that
  // build() adopted from them (already sharded: materialize() does not init them again).
  std::unique_ptr<FsdpParamGroup> new_unit(std::string name, fsdp::nn::Module* module,
                                           bool reshard);
  std::unique_ptr<FsdpParamGroup> take_deferred_unit(const torch::nn::Module* module,
                                                     const std::string& fqn);
  std::vector<std::unique_ptr<FsdpParamGroup>> deferred_;
  std::set<std::pair<const torch::nn::Module*, std::string>> deferred_taken_;
  std::set<const FsdpParamGroup*> preinitialized_;
  // Deferred units' modules stay alive until build() (a module built in configure_model and
  // dropped again is restored, not left dangling).
  std::vector<std::shared_ptr<torch::nn::Module>> deferred_keep_alive_;
  // Cleared in the destructor; hooks on the modules check it (the model may outlive us).
  std::shared_ptr<bool> alive_;

  bool sync_ = true;
  bool callback_queued_ = false;
  FsdpParamGroup* reduce_scatter_in_flight_ = nullptr;
  bool order_frozen_ = false;
  std::vector<FsdpParamGroup*> forward_order_;
  int64_t num_prefetches_ = 0;
  int64_t num_prefetches_limited_ = 0;
};

}  // namespace fsdp::detail
