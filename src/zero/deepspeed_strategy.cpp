// DeepSpeedStrategy: the Strategy calls (fsdp/strategy.h) for ZeRO stages 1, 2 and 3. Stages 1
// and 2 are the ZeroPartitioner (partitioner.cpp) over every trainable parameter; stage 3 is the
// FSDP engine (FULL_SHARD, a unit per module with parameters) plus a ZeroPartitioner over the
// persistent parameters the engine ignores. See docs/design.md "ZeRO stages".
#include "fsdp/deepspeed.h"

#include "common/limits.h"
#include "common/settings.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/comm.h"

#include "fsdp/fsdp_strategy.h"
#include "fsdp/lightning.h"
#include "fsdp/memory.h"
#include "fsdp/trainer.h"
#include "offload/disk_tier.h"
#include "offload/nvme_adam.h"
#include "zero/partitioner.h"
#include "zero/warmup_lr.h"

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <unistd.h>
#include <unordered_set>

namespace fsdp {

struct DeepSpeedStrategy::Impl {
  // Stages 1/2: every trainable parameter; stage 3: the persistent trainable ones (or null).
  std::unique_ptr<detail::ZeroPartitioner> zero;
  std::shared_ptr<FSDPStrategy> fsdp;  // stage 3
  // Stage 3: parameters kept whole (fqn, tensor), trainable or not.
  std::vector<std::pair<std::string, at::Tensor>> persistent;
  torch::nn::Module* module = nullptr;
  // Stages 1 and 2 with the optimizer on disk (offload_optimizer_device "nvme"): steps in
  // place of optimizer.step(). Stage 3's engine has its own disk tier: its OffloadPolicy.
  std::unique_ptr<detail::NvmeAdam> nvme;
};

namespace {

void check_device(const std::string& what, const std::string& device) {
  TORCH_CHECK(device == "cpu" || device == "nvme", "[deepspeed] ", what,
              " must be \"cpu\" or \"nvme\", got \"", device, "\"");
}

bool optimizer_on_disk(const DeepSpeedOptions& o) {
  return o.offload_optimizer && o.offload_optimizer_device == "nvme";
}

// ZeRO-Infinity's offload_param to NVMe: offload_parameters with offload_params_device "nvme",
// or remote_device "nvme" (Lightning's deepspeed_stage_3_offload_nvme sets both).
bool params_on_disk(const DeepSpeedOptions& o) {
  return (o.offload_parameters && o.offload_params_device == "nvme") || o.remote_device == "nvme";
}

// An element count DeepSpeedOptions keeps as a double: finite, whole, in [min, 2^53] (converted
// to int64_t exactly; see detail::kMaxExactInteger).
void check_elements(const char* name, double v, double min) {
  TORCH_CHECK(std::isfinite(v) && v >= min && v <= static_cast<double>(detail::kMaxExactInteger) &&
                  v == std::floor(v),
              "[deepspeed] ", name, " must be a whole number of elements from ", min, " to ",
              detail::kMaxExactInteger, ", got ", v);
}

// The OffloadPolicy of these options (stage 3's engine is built with it; stages 1 and 2 use its
// nvme settings for their optimizer on disk).
OffloadPolicy offload_policy_of(const DeepSpeedOptions& o) {
  auto device = [](bool on, const std::string& d) {
    return !on ? OffloadDevice::kNone : parse_offload_device(d);
  };
  OffloadPolicy p;
  p.params = params_on_disk(o) ? OffloadDevice::kNvme
                               : device(o.offload_parameters, o.offload_params_device);
  p.optimizer = device(o.offload_optimizer, o.offload_optimizer_device);
  p.pin_memory = o.pin_memory;
  p.disk.path = o.nvme_path;
  p.disk.aio = o.aio;
  p.disk.params_buffer_count = o.params_buffer_count;
  p.disk.params_buffer_size = static_cast<int64_t>(o.params_buffer_size);
  p.disk.max_in_cpu = static_cast<int64_t>(o.max_in_cpu);
  p.disk.sub_group_size = static_cast<int64_t>(o.sub_group_size);
  return p;
}

// Stages 1 and 2 keep every parameter whole, so a model can be too large for them where stage
// 3 fits. Refuse that before the first byte of gradient or optimizer state is allocated, as FSDP
// and DDP do (ZeRO's per-parameter bytes: docs/design.md "ZeRO stages"): params whole; grads
// whole (stage 1) or a 1/N partition plus one reduce bucket (stage 2); Adam's two fp32 moments
// for a 1/N partition (none in RAM when they are on disk). Other optimizers' state differs;
// Adam's is what the stages are sized for.
void check_zero_budget(const DeepSpeedOptions& o, int rank, int world,
                       const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const ModelStateBudget& budget) {
  if (budget.bytes <= 0) return;
  int64_t param_bytes = 0, trainable = 0, grad_element = 4;
  for (const auto& [name, p] : params) {
    param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    if (p.requires_grad()) {
      trainable += p.numel();
      grad_element = static_cast<int64_t>(p.element_size());
    }
  }
  const int64_t partition = (trainable + world - 1) / world;
  const int64_t grad_bytes =
      o.stage == 1 ? trainable * grad_element
                   : partition * 4 + std::min<int64_t>(trainable, static_cast<int64_t>(
                                                                      o.reduce_bucket_size)) * 4;
  // With offload_optimizer_device "nvme" the moments live in swap files, not in RAM (the disk
  // tier's own plan checks its buffers and the disk).
  const int64_t adam_bytes = optimizer_on_disk(o) ? 0 : partition * 8;
  const int64_t need = param_bytes + grad_bytes + adam_bytes;
  if (need <= budget.bytes) return;
  std::ostringstream os;
  os << "[deepspeed] ZeRO stage " << o.stage << " needs " << format_bytes(need)
     << " per rank for model state (whole params " << format_bytes(param_bytes) << " + grads "
     << format_bytes(grad_bytes) << (o.stage == 1 ? " whole" : " partition + reduce bucket")
     << " + Adam state " << format_bytes(adam_bytes) << ") but " << budget.what << " is "
     << format_bytes(budget.bytes) << " per rank (rank " << rank << " of " << world
     << "). HINT: " << (o.stage == 1 ? "'deepspeed_stage_2' also partitions the gradients, " : "")
     << "'deepspeed_stage_3' partitions the parameters too; or use more devices"
     << (o.stage == 2 ? ", a smaller reduce_bucket_size" : "") << ", " << budget.more << ".";
  throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, os.str());
}

void check_options(const DeepSpeedOptions& o) {
  TORCH_CHECK(o.zero_optimization, "[deepspeed] zero_optimization=false is DeepSpeed's plain "
              "data parallelism; use strategy 'ddp' for that");
  TORCH_CHECK(o.stage >= 1 && o.stage <= 3, "[deepspeed] ZeRO stage ", o.stage,
              " is not available; stages 1, 2 and 3 are (stage 0 is plain data parallelism: "
              "use strategy 'ddp')");
  if (!o.remote_device.empty()) check_device("remote_device", o.remote_device);
  if (o.offload_optimizer) check_device("offload_optimizer_device", o.offload_optimizer_device);
  if (o.offload_parameters) check_device("offload_params_device", o.offload_params_device);
  TORCH_CHECK(!(optimizer_on_disk(o) || params_on_disk(o)) || !o.nvme_path.empty(),
              "[deepspeed] offload to \"nvme\" needs nvme_path (a directory on the disk for "
              "the swap files)");
  if (params_on_disk(o)) {
    TORCH_CHECK(o.stage == 3, "[deepspeed] parameters on disk (offload_params_device / "
                "remote_device \"nvme\") need stage 3 (only partitioned parameters are "
                "offloaded, as in DeepSpeed); got stage ", o.stage);
    TORCH_CHECK(optimizer_on_disk(o), "[deepspeed] parameters on disk (offload_params_device / "
                "remote_device \"nvme\") need the optimizer state on disk too, as DeepSpeed "
                "requires: the step streams each unit's parameters with its moments. HINT: "
                "offload_optimizer=true with offload_optimizer_device=\"nvme\" (JSON: "
                "zero_optimization.offload_optimizer.device \"nvme\"; fsdp-train "
                "--offload-optimizer-device nvme), or strategy 'deepspeed_stage_3_offload_nvme'");
    TORCH_CHECK(o.params_buffer_count >= 1, "[deepspeed] offload_param buffer_count must be >= 1, "
                "got ", o.params_buffer_count);
    check_elements("offload_param buffer_size", o.params_buffer_size, 1);
    check_elements("offload_param max_in_cpu", o.max_in_cpu, 0);
  }
  check_elements("sub_group_size", o.sub_group_size, 1);
  TORCH_CHECK(!o.offload_parameters || o.stage == 3, "[deepspeed] offload_parameters needs "
              "stage 3 (DeepSpeed offloads parameters only when they are partitioned); got stage ",
              o.stage, ". HINT: use offload_optimizer for stages 1 and 2");
  check_elements("reduce_bucket_size", o.reduce_bucket_size, 1);
  check_elements("allgather_bucket_size", o.allgather_bucket_size, 1);
  TORCH_CHECK(o.stage3_prefetch_bucket_size >= 0 && o.stage3_max_live_parameters >= 1,
              "[deepspeed] stage3_prefetch_bucket_size must be >= 0 and "
              "stage3_max_live_parameters >= 1 (elements), got ", o.stage3_prefetch_bucket_size,
              " and ", o.stage3_max_live_parameters);
  TORCH_CHECK(o.stage3_param_persistence_threshold >= 0,
              "[deepspeed] stage3_param_persistence_threshold must be >= 0, got ",
              o.stage3_param_persistence_threshold);
}

// Parameters of a module tree, each tensor once (tied weights under their first name).
std::vector<std::pair<std::string, at::Tensor>> unique_params(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace

// DeepSpeed's activation checkpointing options (Note [Activation partitioning] in
// src/nn/activation_partitioning.cpp). The group is the model-parallel one a user configured
// with fsdp::configure_activation_partitioning; without one (fsdp.cpp has no tensor
// parallelism, and Lightning gives DeepSpeed no model-parallel unit either) the data-parallel
// ranks hold different activations, so each rank keeps its own whole, as DeepSpeed does then.
void DeepSpeedStrategy::setup_activation_partitioning(LightningModule& module) {
  auto current = activation_partitioning();
  ActivationPartitioning config = current.value_or(ActivationPartitioning{});
  config.cpu_checkpointing = config.cpu_checkpointing || options_.cpu_checkpointing;
  if (options_.partition_activations || current) configure_activation_partitioning(config);
  if (rank() != 0) return;
  const int checkpointed = count_activation_checkpointed(module);
  if (options_.partition_activations) {
    const int w = config.group ? config.group->size() : 1;
    if (w > 1) {
      std::fprintf(stderr, "[deepspeed] partition_activations: the inputs saved by checkpointed "
                   "blocks are split over the model-parallel group (%d ranks) and all-gathered "
                   "for the recompute\n", w);
    } else {
      std::fprintf(stderr, "[deepspeed] partition_activations: no model-parallel group is "
                   "configured (fsdp::configure_activation_partitioning), as under Lightning: "
                   "data-parallel ranks hold different activations, so each rank keeps the "
                   "inputs of its checkpointed blocks whole\n");
    }
    if (checkpointed == 0) {
      std::fprintf(stderr, "[deepspeed] partition_activations: no block of the model is "
                   "checkpointed, so there is nothing to partition. HINT: "
                   "fsdp::apply_activation_checkpointing or fsdp-train "
                   "--activation-checkpointing\n");
    }
  }
  if (options_.cpu_checkpointing) {
    std::fprintf(stderr, "[deepspeed] cpu_checkpointing: the compute device is the CPU, so the "
                 "saved activations already live in host memory; nothing is moved\n");
  }
}

DeepSpeedStrategy::DeepSpeedStrategy(DeepSpeedOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  // Config source order, as Lightning: the argument, then PL_DEEPSPEED_CONFIG_PATH. A config
  // replaces the defaults (and the preset's stage).
  std::string config = options_.config;
  if (config.empty()) {
    config = detail::read_settings().deepspeed_config_path;  // PL_DEEPSPEED_CONFIG_PATH
  }
  if (!config.empty()) options_ = parse_deepspeed_config(config, &training_);
  check_options(options_);
}

DeepSpeedStrategy::~DeepSpeedStrategy() = default;

void DeepSpeedStrategy::connect(ProcessGroupPtr world, const LaunchInfo& launch) {
  Strategy::connect(std::move(world), launch);  // stage 3's engine is connected in setup_module
}

void DeepSpeedStrategy::setup_module(LightningModule& module) {
  TORCH_CHECK(!impl_->module, "[deepspeed] setup_module called twice; one strategy drives one model");
  if (!world_) connect(world_group(), launch_);
  TORCH_CHECK(world_, "[deepspeed] no process group: call connect(world, launch) (the Trainer "
              "does) or fsdp::init_process_group() first");
  // ZeRO 1-3 in device memory run on CUDA; offload from the device does not yet.
  TORCH_CHECK(!device().is_cuda() ||
                  !(options_.offload_optimizer || options_.offload_parameters ||
                    options_.cpu_checkpointing),
              "[deepspeed] offload from a CUDA device (offload_optimizer, offload_parameters, "
              "cpu_checkpointing) is not on CUDA yet (docs/gpu.md); on a GPU use ZeRO stages "
              "1-3 without offload ('deepspeed_stage_1', 'deepspeed_stage_2', "
              "'deepspeed_stage_3'), or accelerator='cpu'");
  impl_->module = &module;
  auto params = unique_params(module);

  // Offload: on a CPU device the state already lives in host memory. See docs/design.md
  // "ZeRO stages" (offload).
  if (options_.offload_optimizer || options_.offload_parameters) {
    bool all_cpu = true;
    for (const auto& [name, p] : params) all_cpu = all_cpu && p.device().is_cpu();
    TORCH_CHECK(all_cpu, "[deepspeed] offload from an accelerator to host memory is not "
                "implemented yet (parameters are on ", params.front().second.device(), ")");
    const bool to_cpu_opt = options_.offload_optimizer && !optimizer_on_disk(options_);
    const bool to_cpu_params = options_.offload_parameters && !params_on_disk(options_);
    // Stage 3's engine says it for its OffloadPolicy.
    if (rank() == 0 && options_.stage < 3 && (to_cpu_opt || to_cpu_params)) {
      std::fprintf(stderr, "[deepspeed] %s%s%s: the compute device is the CPU, so this state "
                   "already lives in host memory and the step already runs there; nothing is "
                   "moved\n",
                   to_cpu_opt ? "offload_optimizer" : "",
                   to_cpu_opt && to_cpu_params ? " + " : "",
                   to_cpu_params ? "offload_parameters" : "");
    }
    if (rank() == 0 && optimizer_on_disk(options_) && options_.pin_memory) {
      std::fprintf(stderr, "[deepspeed] pin_memory: there is no accelerator to copy to, so "
                   "pinned (page-locked) host buffers would change nothing; the swap buffers "
                   "are ordinary page-aligned host memory\n");
    }
  }

  if (options_.partition_activations || options_.cpu_checkpointing) setup_activation_partitioning(module);

  detail::ZeroPartitioner::Options zo;
  zo.reduce_bucket_numel = static_cast<int64_t>(options_.reduce_bucket_size);
  zo.allgather_bucket_numel = static_cast<int64_t>(options_.allgather_bucket_size);
  // Stage 2 without overlap_comm still reduces during backward (to keep only the partition),
  // but synchronously per bucket is what overlap_comm=false would mean in DeepSpeed; the
  // in-flight limit of one bucket makes the difference small, so both run the same schedule.
  zo.reduction = options_.stage == 1 ? detail::GradReduction::kAtBoundary
                                     : detail::GradReduction::kDuringBackward;

  if (options_.stage < 3) {
    check_zero_budget(options_, rank(), world_->size(), params,
                      model_state_budget(device(), launch_.local_world_size));
    // Every rank starts from rank 0's values, as DeepSpeed's engine broadcasts the model.
    if (world_->size() > 1) {
      at::NoGradGuard no_grad;
      for (auto& [name, p] : params) world_->broadcast(p.detach(), 0);
      for (auto& b : module.buffers(true)) {
        if (b.defined() && b.numel() > 0) world_->broadcast(b.detach(), 0);
      }
    }
    std::vector<std::pair<std::string, at::Tensor>> trainable;
    for (auto& np : params) {
      if (np.second.requires_grad()) trainable.push_back(np);
    }
    impl_->zero = std::make_unique<detail::ZeroPartitioner>(world_, std::move(trainable), zo);
    return;
  }

  // Stage 3: persistent parameters stay whole; every module with parameters is a unit. With a
  // persistence threshold of 0 the engine was made in enter_configure_model (deferred init).
  std::vector<std::pair<std::string, at::Tensor>> persistent_trainable;
  if (impl_->fsdp) {
    impl_->fsdp->setup_module(module);
    return;
  }
  FSDPOptions fo = stage3_engine_options(/*deferred=*/false);
  for (auto& np : params) {
    if (np.second.numel() <= options_.stage3_param_persistence_threshold) {
      impl_->persistent.push_back(np);
      fo.ignored_params.push_back(np.second);
      if (np.second.requires_grad()) persistent_trainable.push_back(np);
    }
  }
  if (world_->size() > 1) {  // the FSDP engine broadcasts the parameters it shards
    at::NoGradGuard no_grad;
    for (auto& [name, p] : impl_->persistent) world_->broadcast(p.detach(), 0);
  }
  make_stage3_engine(fo);
  impl_->fsdp->setup_module(module);
  if (!persistent_trainable.empty()) {
    impl_->zero =
        std::make_unique<detail::ZeroPartitioner>(world_, std::move(persistent_trainable), zo);
  }
}

// The stage-3 engine's options: FULL_SHARD, a unit per module with parameters, ZeRO-3's
// prefetch window and live-parameter bound (Note [Prefetch window]; a bucket of 0 turns
// prefetching off, as in DeepSpeed). Eager setup broadcasts rank 0's values; deferred init
// (Note [Deferred initialization]) builds the same values on every rank from the seed.
FSDPOptions DeepSpeedStrategy::stage3_engine_options(bool deferred) const {
  FSDPOptions fo;
  fo.sharding_strategy = ShardingStrategy::kFullShard;
  fo.deferred_init = deferred;
  fo.sync_module_states = !deferred;
  fo.forward_prefetch = options_.stage3_prefetch_bucket_size > 0;
  fo.backward_prefetch = options_.stage3_prefetch_bucket_size > 0 ? BackwardPrefetch::kPre
                                                                   : BackwardPrefetch::kNone;
  fo.prefetch_bucket_numel = options_.stage3_prefetch_bucket_size;
  fo.max_live_numel = options_.stage3_max_live_parameters;
  fo.auto_wrap_policy =
      AutoWrapPolicy::of_predicate([](const torch::nn::Module&, int64_t n) { return n > 0; });
  fo.offload_policy = offload_policy_of(options_);
  return fo;
}

void DeepSpeedStrategy::make_stage3_engine(const FSDPOptions& fo) {
  auto fsdp = std::make_shared<FSDPStrategy>(fo);
  fsdp->set_name(name_);
  fsdp->set_device(device());
  fsdp->connect(world_, launch_);
  impl_->fsdp = fsdp;
}

// Stage 3 with stage3_param_persistence_threshold 0 (no parameter stays whole, so the engine
// ignores none) shards each unit while configure_model builds it: no rank ever holds the whole
// model (what a model larger than RAM needs, e.g. with parameters on disk).
void DeepSpeedStrategy::enter_configure_model() {
  if (options_.stage != 3 || options_.stage3_param_persistence_threshold != 0) return;
  if (!world_) connect(world_group(), launch_);
  if (!world_ || world_->size() < 2) return;
  if (!impl_->fsdp) make_stage3_engine(stage3_engine_options(/*deferred=*/true));
  impl_->fsdp->enter_configure_model();
}

void DeepSpeedStrategy::exit_configure_model() {
  if (impl_->fsdp) impl_->fsdp->exit_configure_model();
}

void DeepSpeedStrategy::on_module_built(torch::nn::Module& module) {
  if (impl_->fsdp) impl_->fsdp->on_module_built(module);
}

void DeepSpeedStrategy::configure_trainer(TrainerOptions& o) const {
  const DeepSpeedTrainingConfig& t = training_;
  if (t.precision) {
    TORCH_CHECK(o.precision == "32-true" || o.precision == "32" || o.precision == *t.precision,
                "[deepspeed] the DeepSpeed config enables bf16 (precision '", *t.precision,
                "') but the Trainer's precision is '", o.precision, "'; set one of them only");
    o.precision = *t.precision;
  }
  if (t.gradient_clipping) {
    TORCH_CHECK(o.gradient_clip_val == 0 || o.gradient_clip_val == *t.gradient_clipping,
                "[deepspeed] the DeepSpeed config's gradient_clipping is ", *t.gradient_clipping,
                " but the Trainer's gradient_clip_val is ", o.gradient_clip_val,
                "; set one of them only");
    o.gradient_clip_val = *t.gradient_clipping;
  }
  if (t.gradient_accumulation_steps) {
    TORCH_CHECK(o.accumulate_grad_batches == 1 ||
                    o.accumulate_grad_batches == *t.gradient_accumulation_steps,
                "[deepspeed] the DeepSpeed config's gradient_accumulation_steps is ",
                *t.gradient_accumulation_steps, " but the Trainer's accumulate_grad_batches is ",
                o.accumulate_grad_batches, "; set one of them only");
    o.accumulate_grad_batches = *t.gradient_accumulation_steps;
  }
}

void DeepSpeedStrategy::configure_optimizers(LightningModule& module, OptimizerConfig& config) {
  const DeepSpeedTrainingConfig& t = training_;
  if (t.optimizer_type.empty()) {
    TORCH_CHECK(t.scheduler_type.empty() || !config.optimizer || !config.scheduler,
                "[deepspeed] the DeepSpeed config has a scheduler and configure_optimizers "
                "returned one too; keep one of them");
    if (!t.scheduler_type.empty() && config.optimizer) {
      config.scheduler = std::make_shared<detail::WarmupLR>(
          *config.optimizer, t.warmup_min_lr, t.warmup_max_lr, t.warmup_num_steps, t.warmup_type,
          t.scheduler_type == "WarmupDecayLR" ? t.total_num_steps : 0);
    }
    return;
  }
  if (rank() == 0 && config.optimizer) {
    std::fprintf(stderr, "[deepspeed] the DeepSpeed config defines the optimizer (%s): it "
                 "replaces the one configure_optimizers returned\n", t.optimizer_type.c_str());
  }
  std::vector<at::Tensor> params;
  for (auto& p : module.parameters(true)) {
    if (p.requires_grad()) params.push_back(p);
  }
  if (t.adam_w_mode) {
    config.optimizer = std::make_shared<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(t.lr)
                    .betas({t.beta1, t.beta2})
                    .eps(t.eps)
                    .weight_decay(t.weight_decay));
  } else {
    config.optimizer = std::make_shared<torch::optim::Adam>(
        params, torch::optim::AdamOptions(t.lr)
                    .betas({t.beta1, t.beta2})
                    .eps(t.eps)
                    .weight_decay(t.weight_decay));
  }
  config.scheduler = nullptr;
  if (!t.scheduler_type.empty()) {
    config.scheduler = std::make_shared<detail::WarmupLR>(
        *config.optimizer, t.warmup_min_lr, t.warmup_max_lr, t.warmup_num_steps, t.warmup_type,
        t.scheduler_type == "WarmupDecayLR" ? t.total_num_steps : 0);
  }
}

void DeepSpeedStrategy::setup_optimizer(torch::optim::Optimizer& optimizer) {
  if (impl_->zero) impl_->zero->partition_optimizer(optimizer);
  if (impl_->fsdp) {
    impl_->fsdp->setup_optimizer(optimizer);  // its OffloadPolicy: the disk tier at stage 3
  } else if (optimizer_on_disk(options_)) {
    setup_disk_tier(optimizer);
  }
}

void DeepSpeedStrategy::setup_disk_tier(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(!impl_->nvme, "[deepspeed] setup_optimizer called twice with the disk tier");
  const NvmeOffloadOptions nvme = offload_policy_of(options_).disk;
  detail::DiskPlacement at;
  at.job = detail::disk_job_name(nvme, world_.get());
  at.rank = rank();
  at.ranks_sharing_disk = launch_.local_world_size;
  at.who = "[deepspeed]";
  impl_->nvme = std::make_unique<detail::NvmeAdam>(optimizer, detail::nvme_adam_options(nvme, at));
  const DiskPlan& plan = impl_->nvme->plan();
  std::fprintf(stderr, "[deepspeed] rank %d: optimizer state on disk (offload_optimizer "
               "device nvme, aio block_size %lld, queue_depth %d):\n%s", rank(),
               static_cast<long long>(options_.aio.block_size), options_.aio.queue_depth,
               plan.describe().c_str());
}

// The disk tier: stage 3's engine holds it (its OffloadPolicy), stages 1 and 2 hold the
// optimizer's own.
const DiskPlan* DeepSpeedStrategy::disk_plan() const {
  if (impl_->fsdp) return impl_->fsdp->disk_plan();
  return impl_->nvme ? &impl_->nvme->plan() : nullptr;
}

const ParamDiskPlan* DeepSpeedStrategy::param_disk_plan() const {
  return impl_->fsdp ? impl_->fsdp->param_disk_plan() : nullptr;
}

std::vector<std::string> DeepSpeedStrategy::swap_files() const {
  if (impl_->fsdp) return impl_->fsdp->swap_files();
  return impl_->nvme ? impl_->nvme->files() : std::vector<std::string>{};
}

std::vector<std::string> DeepSpeedStrategy::param_swap_files() const {
  return impl_->fsdp ? impl_->fsdp->param_swap_files() : std::vector<std::string>{};
}

void DeepSpeedStrategy::flush_disk_tier() {
  if (impl_->fsdp) impl_->fsdp->flush_disk_tier();
  if (impl_->nvme) impl_->nvme->flush();
}

StreamedOptimizerState* DeepSpeedStrategy::streamed_optimizer_state() {
  if (impl_->fsdp) return impl_->fsdp->streamed_optimizer_state();
  return impl_->nvme.get();
}

void DeepSpeedStrategy::pre_forward(LightningModule& module, bool sync) {
  if (impl_->fsdp) impl_->fsdp->pre_forward(module, sync);
  if (impl_->zero) impl_->zero->prepare_forward(sync);
}

void DeepSpeedStrategy::backward(const at::Tensor& loss) {
  if (impl_->fsdp) {
    impl_->fsdp->backward(loss);
  } else {
    loss.backward();
  }
}

void DeepSpeedStrategy::post_backward(LightningModule& module, bool sync) {
  if (impl_->fsdp) impl_->fsdp->post_backward(module, sync);
  if (impl_->zero) impl_->zero->finish_backward(sync);
}

void DeepSpeedStrategy::post_eval_step(LightningModule& module) {
  if (impl_->fsdp) impl_->fsdp->post_eval_step(module);
}

double DeepSpeedStrategy::clip_grad_norm(LightningModule& module, double max_norm) {
  TORCH_CHECK(impl_->module, "[deepspeed] clip_grad_norm before setup_module");
  // Every gradient a rank holds is a disjoint part of the model's: the partitions' (stages 1/2,
  // persistent parameters), the FSDP shards' (stage 3; padding rows are zero). The global norm
  // is the square root of their sums of squares summed over the world.
  std::vector<at::Tensor> grads;
  if (impl_->zero) grads = impl_->zero->partition_grads();
  if (impl_->fsdp) {
    std::unordered_set<const c10::TensorImpl*> persistent;
    for (auto& [n, p] : impl_->persistent) persistent.insert(p.unsafeGetTensorImpl());
    for (auto& p : module.parameters(true)) {
      if (!persistent.count(p.unsafeGetTensorImpl()) && p.grad().defined()) {
        grads.push_back(p.grad());
      }
    }
  }
  return clip_grad_norm_of_parts(grads, *world_, max_norm);
}

void DeepSpeedStrategy::optimizer_step(torch::optim::Optimizer& optimizer) {
  if (impl_->fsdp) {
    impl_->fsdp->optimizer_step(optimizer);  // the disk tier's step with the optimizer on disk
  } else if (impl_->nvme) {
    impl_->nvme->step(optimizer);  // See Note [Disk tier swapper]
  } else {
    TORCH_CHECK(!optimizer_on_disk(options_), "[deepspeed] the optimizer state is on disk "
                "(offload_optimizer_device \"nvme\"), but setup_optimizer was not called with "
                "this optimizer: the disk tier's step replaces optimizer.step()");
    optimizer.step();
  }
  if (impl_->zero) impl_->zero->all_gather_params();
}

void DeepSpeedStrategy::zero_grad(torch::optim::Optimizer& optimizer) {
  if (impl_->fsdp) {
    impl_->fsdp->zero_grad(optimizer);
  } else {
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined()) p.mutable_grad() = at::Tensor();
      }
    }
  }
  if (impl_->zero) impl_->zero->zero_grad();
}

std::pair<int64_t, int64_t> DeepSpeedStrategy::parameter_counts(torch::nn::Module& module) {
  if (!impl_->fsdp) return Strategy::parameter_counts(module);
  auto counts = impl_->fsdp->parameter_counts(module);
  for (auto& [n, p] : impl_->persistent) {
    counts.first += p.numel();
    if (p.requires_grad()) counts.second += p.numel();
  }
  return counts;
}

LocalShards DeepSpeedStrategy::local_shards() {
  TORCH_CHECK(impl_->module, "[deepspeed] local_shards before setup_module");
  LocalShards out;
  if (impl_->fsdp) {
    out = impl_->fsdp->local_shards();  // with its pager when the parameters are on disk
  } else {
    out.shard_group = world_;
    out.replica_rank = 0;  // the world is one copy of the (partitioned) optimizer state
  }
  if (impl_->zero) {
    if (!out.shard_group) out.shard_group = impl_->zero->group();
    for (const auto& p : impl_->zero->params()) {
      std::vector<int64_t> full = p.param.sizes().vec();
      out.params.push_back(LocalShard{p.partition, full, p.shard_rows, p.rows, p.param});
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> DeepSpeedStrategy::gather_full_params() {
  TORCH_CHECK(impl_->module, "[deepspeed] gather_full_params before setup_module");
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (impl_->fsdp) {
    out = impl_->fsdp->gather_full_params();
    for (auto& [n, p] : impl_->persistent) out.emplace_back(n, p.detach().clone());
    return out;
  }
  for (auto& [n, p] : unique_params(*impl_->module)) out.emplace_back(n, p.detach().clone());
  return out;
}

int64_t DeepSpeedStrategy::persistent_numel() const {
  int64_t n = 0;
  for (auto& [name, p] : impl_->persistent) n += p.numel();
  return n;
}

int64_t DeepSpeedStrategy::num_grad_buckets() const {
  return impl_->zero ? impl_->zero->num_grad_buckets() : 0;
}

FSDPStrategy* DeepSpeedStrategy::stage3_engine() const { return impl_->fsdp.get(); }

}  // namespace fsdp
