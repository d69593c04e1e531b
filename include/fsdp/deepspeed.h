// DeepSpeedStrategy: DeepSpeed's ZeRO stages 1, 2 and 3 as native strategies, with Lightning's
// names, constructor options and defaults (lightning.pytorch.strategies.DeepSpeedStrategy).
//
//   fsdp::Trainer trainer({.devices = 4, .strategy = "deepspeed_stage_2"});
//   // or
//   fsdp::DeepSpeedOptions o;
//   o.stage = 1;
//   o.reduce_bucket_size = 5e7;
//   fsdp::Trainer trainer({.devices = 4, .strategy = std::make_shared<fsdp::DeepSpeedStrategy>(o)});
//
// What each stage keeps per rank (fp32, Adam; W ranks, Ψ parameters):
//   stage 1  parameters whole (4Ψ), gradients whole until the step (4Ψ), Adam state of this
//            rank's partition (8Ψ/W). At the step's last micro-batch the gradients are
//            reduce-scattered in reduce_bucket_size buckets; each rank steps its partition;
//            the updated partitions are all-gathered in allgather_bucket_size buckets.
//   stage 2  as stage 1, but each bucket is reduce-scattered during backward as soon as its
//            gradients exist, every micro-batch, and only this rank's partition of the gradient
//            is kept (4Ψ + 12Ψ/W, plus two buckets in flight).
//   stage 3  parameters sharded too: the FSDP engine (FULL_SHARD, one unit per module with
//            parameters, as DeepSpeed fetches per module), 16Ψ/W. Parameters with at most
//            stage3_param_persistence_threshold elements stay whole on every rank and are
//            partitioned as in stage 2 (DeepSpeed's persistent parameters).
// The partition of a parameter is its dim-0 row range (FSDP's layout), so checkpoints of every
// stage are fsdp.cpp's sharded/full checkpoints: they load at any world size and under any
// strategy. See docs/design.md "ZeRO stages".
#pragma once

#include "fsdp/offload.h"
#include "fsdp/strategy.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class FSDPStrategy;
struct FSDPOptions;

// Lightning's DeepSpeedStrategy arguments, same names and defaults (facts: Lightning's
// strategies/deepspeed.py). Bucket sizes count elements, as in DeepSpeed.
struct DeepSpeedOptions {
  bool zero_optimization = true;  // false (plain DeepSpeed data parallel): use "ddp" instead
  int stage = 2;                  // 1 | 2 | 3
  // "cpu" places parameters and optimizer state in host memory (where they already are on a
  // CPU device); "nvme" is the disk tier (fsdp/offload.h, docs/offload.md):
  // offload_optimizer_device = "nvme" streams Adam's moments from swap files under nvme_path;
  // offload_params_device = "nvme" (or remote_device = "nvme"; stage 3, with the optimizer on
  // nvme too) keeps each unit's shard of the parameters in a swap file, read before its
  // all-gather and streamed through the optimizer step.
  std::string remote_device;
  bool offload_optimizer = false;   // optimizer state and step in host memory (stages 1-3)
  bool offload_parameters = false;  // parameters in host memory (stage 3 only)
  std::string offload_params_device = "cpu";     // "cpu" | "nvme"
  std::string offload_optimizer_device = "cpu";  // "cpu" | "nvme"
  std::string nvme_path = "/local_nvme";         // swap files go to nvme_path/<job>/rank<r>/
  // The disk tier's I/O: DeepSpeed's "aio" block.
  AioOptions aio;
  // DeepSpeed's offload buffers (Lightning's defaults). offload_optimizer: the disk tier always
  // streams through three buffers of one sub-group each (read, step, write), so
  // optimizer_buffer_count is reported, not used. offload_param's (parameters on disk):
  // buffer_count buffers of at most buffer_size elements read units ahead and write them back
  // (a unit's shard larger than buffer_size is refused at setup); the first units, up to
  // max_in_cpu elements, stay in RAM.
  int64_t optimizer_buffer_count = 4;
  int64_t params_buffer_count = 5;
  double params_buffer_size = 1e8;
  double max_in_cpu = 1e9;
  bool pin_memory = false;
  double sub_group_size = 1e12;
  bool contiguous_gradients = true;  // gradients copied into one flat bucket (always, here)
  bool overlap_comm = true;          // reduce-scatter buckets while backward runs (stage 2)
  bool allgather_partitions = true;  // all-gather updated partitions (the only way, here)
  bool reduce_scatter = true;        // reduce-scatter gradients (the only way, here)
  double allgather_bucket_size = 2e8;  // elements per all-gather bucket
  double reduce_bucket_size = 2e8;     // elements per reduce-scatter bucket
  bool zero_allow_untested_optimizer = true;
  // DeepSpeed's activation checkpointing options, for the blocks the model checkpoints
  // (fsdp::apply_activation_checkpointing, fsdp-train --activation-checkpointing):
  // partition_activations splits their saved inputs over the model-parallel group given to
  // fsdp::configure_activation_partitioning (fsdp/activation_checkpointing.h); without one, as
  // under Lightning, each rank keeps them whole (data-parallel ranks hold different
  // activations). cpu_checkpointing keeps them in host memory: on a CPU device they are there
  // already. Setup says which applies, in one line each.
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  // ZeRO-3 knob from DeepSpeed's zero_optimization (default as DeepSpeed's): parameters with at
  // most this many elements are never sharded (kept whole, gradients reduce-scattered, optimizer
  // state partitioned, updated values all-gathered).
  int64_t stage3_param_persistence_threshold = 100000;
  // ZeRO-3 knobs (DeepSpeed's defaults), in elements: the forward/backward prefetch gathers the
  // next units as long as they fit in stage3_prefetch_bucket_size (0: no prefetch), and the
  // gathered parameters (running, unsharded and in flight) stay within
  // stage3_max_live_parameters, except for what the running units themselves need. See Note
  // [Prefetch window] in src/shard/fsdp_state.cpp. (stage3_max_reuse_distance is not
  // implemented: parameters are released after each use.)
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_max_live_parameters = 1000000000;
  // A DeepSpeed JSON config: a path to a file, or the JSON object itself (text starting with
  // '{'). When set it replaces every default above, as in Lightning; unset, the environment
  // variable PL_DEEPSPEED_CONFIG_PATH names a file. See parse_deepspeed_config.
  std::string config;
};

// What a DeepSpeed JSON config asks for besides ZeRO (the Trainer applies these).
struct DeepSpeedTrainingConfig {
  std::optional<std::string> precision;           // "bf16-mixed" when bf16.enabled
  std::optional<double> gradient_clipping;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  // optimizer: {"type": "Adam" | "AdamW", "params": {lr, betas, eps, weight_decay,
  // adam_w_mode}}. As in DeepSpeed, "Adam" decouples weight decay (AdamW) unless
  // "adam_w_mode": false; built as torch::optim::AdamW, or torch::optim::Adam (L2) then.
  std::string optimizer_type;  // "" = none in the config
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool adam_w_mode = true;
  // scheduler: {"type": "WarmupLR" | "WarmupDecayLR", "params": {warmup_min_lr, warmup_max_lr,
  // warmup_num_steps, warmup_type, total_num_steps}}
  std::string scheduler_type;  // "" = none
  double warmup_min_lr = 0, warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" | "linear"
  int64_t total_num_steps = 0;      // WarmupDecayLR only (required there)
};

// Parses a DeepSpeed JSON config (file path, or JSON object text) into ZeRO options (replacing
// `defaults`' ZeRO fields: a config replaces the defaults, as in Lightning) and the training
// settings. An unknown or unsupported key, or a value of the wrong type, is one error that names
// the key and lists the supported ones.
DeepSpeedOptions parse_deepspeed_config(const std::string& path_or_json,
                                        DeepSpeedTrainingConfig* training = nullptr);

class DeepSpeedStrategy : public Strategy {
 public:
  // Applies `config` (or PL_DEEPSPEED_CONFIG_PATH) and checks the options: an unsupported
  // combination (nvme, stage 0) is an error saying what is missing.
  explicit DeepSpeedStrategy(DeepSpeedOptions options = {});
  ~DeepSpeedStrategy() override;

  // "deepspeed", "deepspeed_stage_1", ... (set by make_deepspeed_strategy).
  std::string name() const override { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  const DeepSpeedOptions& options() const { return options_; }
  // The config's non-ZeRO settings (empty without a config).
  const DeepSpeedTrainingConfig& training_config() const { return training_; }

  void connect(ProcessGroupPtr world, const LaunchInfo& launch) override;
  // The config's bf16 (precision "bf16-mixed"), gradient_clipping and
  // gradient_accumulation_steps into the Trainer's options; a different non-default value
  // there is an error naming both.
  void configure_trainer(TrainerOptions& options) const override;
  // Stage 3 with stage3_param_persistence_threshold 0 at 2+ ranks: the engine shards each unit
  // while configure_model builds it (deferred init: no rank holds the whole model).
  void enter_configure_model() override;
  void exit_configure_model() override;
  // The finished layers go to that engine (fsdp::wrap is not DeepSpeed's: every module with
  // parameters is a unit at stage 3, and stages 1-2 have none).
  void on_module_built(torch::nn::Module& module) override;
  void setup_module(LightningModule& module) override;
  // The config's optimizer (and scheduler) over the set-up module's parameters, replacing the
  // module's own (Lightning: a config optimizer wins).
  void configure_optimizers(LightningModule& module, OptimizerConfig& config) override;
  void setup_optimizer(torch::optim::Optimizer& optimizer) override;
  void pre_forward(LightningModule& module, bool sync) override;
  void backward(const at::Tensor& loss) override;
  void post_backward(LightningModule& module, bool sync) override;
  void post_eval_step(LightningModule& module) override;
  double clip_grad_norm(LightningModule& module, double max_norm) override;
  // optimizer.step() on this rank's partitions, then the all-gather of the updated values.
  void optimizer_step(torch::optim::Optimizer& optimizer) override;
  void zero_grad(torch::optim::Optimizer& optimizer) override;
  std::pair<int64_t, int64_t> parameter_counts(torch::nn::Module& module) override;
  LocalShards local_shards() override;

  // Full parameter values by FQN (collective: every rank calls it).
  std::vector<std::pair<std::string, at::Tensor>> gather_full_params();

  // --- introspection (tests): elements of whole parameters kept persistent by stage 3, and the
  // number of gradient buckets of the partitioner (0 when there is none).
  int64_t persistent_numel() const;
  // The disk tier (offload_optimizer_device "nvme"), after setup_optimizer: this rank's plan
  // (null without the disk tier) and its swap files.
  const DiskPlan* disk_plan() const;
  // Parameters on disk (offload_param nvme), after setup_module: the plan (null without) and
  // their swap files (one per unit on disk). swap_files() lists both tiers' files.
  const ParamDiskPlan* param_disk_plan() const;
  std::vector<std::string> param_swap_files() const;
  std::vector<std::string> swap_files() const;
  // Waits for the disk tier's writes still in flight (a step's last writes overlap the next
  // forward): the swap files then hold the last step. A no-op without the disk tier.
  void flush_disk_tier();
  // With the disk tier, checkpoints stream the moments from the swap files (sharded format,
  // the same tensors as a RAM run's): Note [Streamed optimizer state] in docs/design.md.
  StreamedOptimizerState* streamed_optimizer_state() override;
  int64_t num_grad_buckets() const;
  // Stage 3's FSDP engine (null for stages 1 and 2), for tests and tools.
  FSDPStrategy* stage3_engine() const;

 private:
  void setup_activation_partitioning(LightningModule& module);
  FSDPOptions stage3_engine_options(bool deferred) const;
  void make_stage3_engine(const FSDPOptions& options);
  void setup_disk_tier(torch::optim::Optimizer& optimizer);

  struct Impl;
  DeepSpeedOptions options_;
  DeepSpeedTrainingConfig training_;
  std::string name_ = "deepspeed";
  std::unique_ptr<Impl> impl_;
};

// Lightning's registry names: "deepspeed" (stage 2), "deepspeed_stage_1", "deepspeed_stage_2",
// "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload",
// "deepspeed_stage_3_offload_nvme" (parameters and optimizer state on disk: set nvme_path).
std::vector<std::string> deepspeed_strategy_names();
std::shared_ptr<DeepSpeedStrategy> make_deepspeed_strategy(const std::string& name,
                                                           DeepSpeedOptions options = {});

}  // namespace fsdp
