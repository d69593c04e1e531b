// FSDPStrategy: fully sharded data parallel (per-parameter sharding, FSDP2 style).
//
//   auto fsdp = std::make_shared<fsdp::FSDPStrategy>(fsdp::FSDPOptions{
//       .sharding_strategy = fsdp::ShardingStrategy::kFullShard,
//       .auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-small")),
//   });
//   fsdp::Trainer trainer({.devices = 2, .strategy = fsdp});
//
// Every parameter is split on dim 0 into `shard world` equal chunks (the last ones padded with
// zero rows). module.parameters() returns the sharded parameters after setup_module, so
// configure_optimizers builds an optimizer over this rank's shards only (Lightning semantics);
// the layers keep computing with their full-size parameters, which hold memory only while
// their unit is unsharded. See Note [Sharded and unsharded parameters] in src/shard/fsdp_param.h.
//
// Units: every module the wrap policy (or fsdp::wrap inside configure_model) selects becomes a
// unit whose parameters are all-gathered together before its forward and backward, and whose
// gradients are reduce-scattered together after its backward. Parameters in no unit form the
// root unit, unsharded from pre_forward until the end of backward.
#pragma once

#include "fsdp/nn.h"
#include "fsdp/offload.h"
#include "fsdp/precision.h"
#include "fsdp/strategy.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdp {

// What is sharded, and when parameters are resharded (docs/design.md, "Decisions"):
//   kFullShard        params, grads, optimizer state sharded over the world; reshard after forward
//   kShardGradOp      as kFullShard, but parameters stay unsharded from forward until after backward
//   kNoShard          replicate everything (like DDP): gradients are all-reduced (average)
//   kHybridShard      kFullShard inside a shard group (one node by default), replicated across
//   kHybridShardZero2 kShardGradOp inside the shard group, replicated across
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard, kHybridShardZero2 };

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2" (also
// lower-case). An unknown name is an error listing the valid ones.
ShardingStrategy parse_sharding_strategy(const std::string& name);
const char* to_string(ShardingStrategy strategy);
std::vector<std::string> sharding_strategy_names();

// When the next unit's all-gather is issued during backward:
//   kPre   in the pre-backward hook of the current unit (most overlap, one more unit of memory)
//   kPost  after the current unit's reduce-scatter is issued
//   kNone  no prefetch: every unit all-gathers when its backward starts
enum class BackwardPrefetch { kPre, kPost, kNone };
BackwardPrefetch parse_backward_prefetch(const std::string& name);  // "pre" | "post" | "none"
const char* to_string(BackwardPrefetch prefetch);

// Which modules become units. Only fsdp::nn::Module instances can be units (they have the call
// hooks); a plain torch::nn module gets them from a unit holder (fsdp::nn::unit,
// fsdp::nn::unit_children in fsdp/unit.h), which the type policy matches by the wrapped
// module's type. The root module never is a unit (its leftover parameters form the root unit);
// setup warns when no unit is found below it.
struct AutoWrapPolicy {
  enum class Kind { kNone, kTypes, kSize, kPredicate };
  Kind kind = Kind::kNone;
  fsdp::nn::ModuleTypes types;   // kTypes: wrap every module of these types
  int64_t min_num_params = 0;    // kSize: wrap a module once its not-yet-wrapped subtree has
                                 // at least this many parameter elements (children first)
  // kPredicate: called children first with the module and the number of parameter elements in
  // its subtree that no descendant unit has taken; true makes it a unit.
  std::function<bool(const torch::nn::Module&, int64_t nparams)> predicate;

  static AutoWrapPolicy none() { return {}; }
  static AutoWrapPolicy of_types(fsdp::nn::ModuleTypes types);
  static AutoWrapPolicy size_based(int64_t min_num_params);
  static AutoWrapPolicy of_predicate(
      std::function<bool(const torch::nn::Module&, int64_t nparams)> predicate);
};

// Command-line form (fsdp-train --wrap-policy): "layers" (the model's block types, given as
// `layer_types`), "size:N" (size-based, min_num_params N) or "none". Anything else is an error
// listing the forms.
AutoWrapPolicy parse_wrap_policy(const std::string& spec, const fsdp::nn::ModuleTypes& layer_types);

struct FSDPOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  AutoWrapPolicy auto_wrap_policy;  // default: no units besides the root
  // Caps the units holding unsharded parameters at two (the running one and one prefetched):
  // a prefetch that would exceed it is skipped and happens on demand instead.
  bool limit_all_gathers = false;
  // Issue the next unit's all-gather (forward order recorded in the first step) in the current
  // unit's pre-forward, so it overlaps the current unit's compute.
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;
  // Broadcast rank 0's parameters and buffers over the world before sharding (ranks that built
  // their models from different seeds then agree).
  bool sync_module_states = false;
  // Ranks per shard group for the hybrid strategies; 0 = the ranks of one node
  // (LaunchInfo::local_world_size). Must divide the world size.
  int hybrid_shard_size = 0;
  // Deferred initialization: shard each unit as soon as configure_model has built it
  // (fsdp::nn::built / fsdp::wrap), so no rank ever holds the whole model. Applies to
  // FULL_SHARD and SHARD_GRAD_OP over more than one rank (any wrap policy, manual wraps);
  // other configurations build the whole model, then shard it. See
  // Note [Deferred initialization] in src/shard/deferred_init.cpp.
  bool deferred_init = true;

  // Mixed precision (fsdp/precision.h): fp32 sharded master parameters and optimizer state;
  // all-gather, compute and reduce-scatter in the policy's dtypes. Unset = fp32 throughout.
  // The Trainer's precision "bf16-mixed" sets {bf16, bf16, bf16} unless this is already set.
  std::optional<MixedPrecisionPolicy> mixed_precision;

  // Activation checkpointing: every module of these types (typically the wrap policy's) runs
  // forward without keeping its activations and recomputes them in backward (see
  // fsdp/activation_checkpointing.h). Applied in setup_module, unless the model already
  // called apply_activation_checkpointing itself in configure_model. Empty: off.
  fsdp::nn::ModuleTypes activation_checkpointing_policy;

  // Parameters the engine leaves alone (FSDP2's fully_shard(ignored_params)): they stay
  // registered whole on every rank, belong to no unit, and their gradients are not reduced:
  // whoever sets this reduces them (DeepSpeedStrategy's stage-3 persistent parameters).
  // parameter_counts, local_shards and gather_full_params do not list them.
  std::vector<at::Tensor> ignored_params;

  // ZeRO-3's prefetch and live-parameter bounds, in parameter elements (DeepSpeedStrategy sets
  // them from stage3_prefetch_bucket_size / stage3_max_live_parameters); 0 = off.
  //   prefetch_bucket_numel  > 0: forward/backward prefetch gathers as many units ahead as fit
  //                          in this many elements (instead of one unit ahead); a unit larger
  //                          than it is gathered on demand.
  //   max_live_numel         > 0: prefetches never take the unsharded and in-flight units above
  //                          this many elements, and a unit gathered on demand drops
  //                          prefetched all-gathers to fit (they are gathered again later).
  // See Note [Prefetch window] in src/shard/fsdp_state.cpp.
  int64_t prefetch_bucket_numel = 0;
  int64_t max_live_numel = 0;

  // Where the sharded parameters and the optimizer state live between uses (fsdp/offload.h):
  //   OffloadPolicy::none()            on the compute device (default)
  //   OffloadPolicy::cpu()             host memory, the step there (FSDP2's CPUOffloadPolicy,
  //                                    Lightning's cpu_offload=True). On a CPU device they are
  //                                    there already: setup says so once and moves nothing; from
  //                                    an accelerator it is an error (not implemented)
  //   OffloadPolicy::nvme(path)        the disk tier: each unit's shard and Adam's moments in swap
  //                                    files (ZeRO-Infinity); nvme(path, false): the moments only
  // The disk tier needs Adam, AdamW or CPUAdam (its step replaces optimizer.step()), and for
  // the parameters a shard group of 2+ ranks. See docs/offload.md.
  OffloadPolicy offload_policy;

  // --- not implemented: present so configurations can name it; any value other than the
  // default is refused with "not supported yet". Sharded checkpoints are the Trainer's
  // (TrainerOptions::state_dict_type, fsdp/checkpoint.h).
  std::string state_dict_type = "full";                  // "full" | "sharded"
};

// Per-rank model-state bytes of a configuration (fp32 parameters, fp32 gradients and two fp32
// Adam moments per trainable element), as FSDPStrategy computes them for the memory budget.
// Under a MixedPrecisionPolicy the shards stay fp32 and the unsharded units count in
// param_dtype.
struct FSDPMemoryEstimate {
  int64_t sharded_param_bytes = 0;    // this rank's padded shards (replicated for NO_SHARD)
  int64_t sharded_grad_bytes = 0;     // trainable shards only
  int64_t optimizer_bytes = 0;        // 2 x sharded trainable bytes (Adam/AdamW)
  int64_t unsharded_peak_bytes = 0;   // root unit + the two largest units unsharded (params+grads)
  int64_t total_bytes() const {
    return sharded_param_bytes + sharded_grad_bytes + optimizer_bytes + unsharded_peak_bytes;
  }
};

class FSDPStrategy : public Strategy {
 public:
  explicit FSDPStrategy(FSDPOptions options = {});
  ~FSDPStrategy() override;

  // "fsdp", "fsdp_full_shard", ... (see fsdp_strategy_names()).
  std::string name() const override { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  const FSDPOptions& options() const { return options_; }

  void enter_configure_model() override;
  void exit_configure_model() override;
  // "bf16-mixed" / "16-mixed" become MixedPrecisionPolicy{bf16 / fp16 for all three} unless
  // options.mixed_precision is set (explicit wins); the other precisions are left to the Trainer.
  bool connect_precision(Precision precision) override;
  // Builds the units (manual wraps, else the auto-wrap policy), checks the memory budget,
  // shards every parameter and installs the hooks.
  void setup_module(LightningModule& module) override;
  // With the optimizer on disk (offload_policy.optimizer nvme): the swap files of the
  // optimizer's state (every parameter it steps: the shards, and whatever else the caller put
  // in it). Refuses an optimizer the disk tier cannot step.
  void setup_optimizer(torch::optim::Optimizer& optimizer) override;
  void pre_forward(LightningModule& module, bool sync) override;
  void backward(const at::Tensor& loss) override;
  void post_backward(LightningModule& module, bool sync) override;
  void post_eval_step(LightningModule& module) override;
  double clip_grad_norm(LightningModule& module, double max_norm) override;
  // optimizer.step(), or the disk tier's step with the optimizer on disk.
  void optimizer_step(torch::optim::Optimizer& optimizer) override;
  // Frees the sharded gradients (set_to_none).
  void zero_grad(torch::optim::Optimizer& optimizer) override;
  // With the optimizer on disk, checkpoints stream the moments from the swap files.
  StreamedOptimizerState* streamed_optimizer_state() override;
  // Full shapes of the set-up model (tied parameters once), also for units sharded during
  // configure_model; `module` is not needed.
  std::pair<int64_t, int64_t> parameter_counts(torch::nn::Module& module) override;
  // Every parameter split over the shard group, with its full shape and this rank's rows.
  LocalShards local_shards() override;

  // During configure_model: a finished layer (deferred init shards the units the policy selects
  // in it) and a manually wrapped unit (fsdp::wrap).
  void on_module_built(torch::nn::Module& module) override;
  void on_module_wrapped(fsdp::nn::Module& module) override;
  bool has_manual_wraps() const;

  // --- introspection for tests and tools (valid after setup_module or plan_module).
  FSDPMemoryEstimate memory_estimate() const;
  // Full parameter values by FQN (collective over the world: every rank calls it).
  std::vector<std::pair<std::string, at::Tensor>> gather_full_params();
  // The disk tier (offload_policy with nvme): this rank's plans (null without that tier: the
  // optimizer's after setup_optimizer, the parameters' after setup_module), the swap files
  // (parameters' and optimizer's), and a wait for the writes still in flight (the swap files
  // then hold the last step; a no-op without the disk tier).
  const DiskPlan* disk_plan() const;
  const ParamDiskPlan* param_disk_plan() const;
  std::vector<std::string> swap_files() const;
  std::vector<std::string> param_swap_files() const;
  void flush_disk_tier();
  // Units sharded during configure_model by deferred initialization (0 when it was off).
  int num_deferred_units() const;
  // Builds the units of `module` (parameters on any device, e.g. meta tensors) as for a world
  // of `world_size` ranks, `local_world_size` per node, without process groups, sharding or
  // allocation: memory_estimate() is valid afterwards. For fsdp::estimate_fsdp_memory.
  void plan_module(torch::nn::Module& module, int world_size, int local_world_size);

  // The engine behind the strategy (its units and parameters; src/shard/fsdp_strategy_impl.h),
  // for the engine's own tests and tools.
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  // setup_module: FSDPOptions::activation_checkpointing_policy, unless the model applied its own.
  void apply_checkpointing_policy(LightningModule& module);
  // setup_module: offload_policy's tiers (fsdp/offload.h): kCpu is checked and said; kNvme
  // parameters become swap records of the engine's (after sharding).
  void check_host_offload(LightningModule& module);
  void place_params_on_disk();

  FSDPOptions options_;
  std::string name_ = "fsdp";
  std::unique_ptr<Impl> impl_;
};

// The one parser of FSDP strategy names: "fsdp" (FULL_SHARD), "fsdp_full_shard",
// "fsdp_shard_grad_op", "fsdp_no_shard", "fsdp_hybrid_shard", "fsdp_hybrid_shard_zero2".
// An unknown name is an error listing the valid ones. An explicit form ("fsdp_no_shard") sets
// options.sharding_strategy; it is an error when options already asks for a different
// non-default one.
std::vector<std::string> fsdp_strategy_names();
std::shared_ptr<FSDPStrategy> make_fsdp_strategy(const std::string& name, FSDPOptions options = {});

// Manual wrapping inside configure_model: marks `module` (a std::shared_ptr to an
// fsdp::nn::Module, unit holders included) as a unit when the strategy running configure_model
// is an FSDPStrategy, does nothing otherwise. A model with manual wraps is not re-wrapped by the
// auto-wrap policy. Returns the module.
void wrap_module(fsdp::nn::Module& module);

namespace detail {
template <typename T>
inline constexpr bool is_hooked_module_ptr = false;
template <typename M>
inline constexpr bool is_hooked_module_ptr<std::shared_ptr<M>> =
    std::is_base_of_v<fsdp::nn::Module, M>;
}  // namespace detail

template <typename T>
T wrap(T module) {
  static_assert(detail::is_hooked_module_ptr<T>,
                "fsdp::wrap takes a std::shared_ptr to an fsdp::nn::Module, which has the call "
                "hooks a unit needs. A plain torch::nn module (torch::nn::Linear, your own "
                "torch::nn::Module subclass, seq->ptr(i)) gets them from a unit holder: "
                "fsdp::wrap(fsdp::nn::unit(module)), registered where the module was; a "
                "torch::nn::Sequential's children: fsdp::nn::unit_children(seq) (fsdp/unit.h).");
  if constexpr (detail::is_hooked_module_ptr<T>) wrap_module(*module);
  return module;
}

}  // namespace fsdp
