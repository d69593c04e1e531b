// FSDPStrategy: the Strategy calls (fsdp/strategy.h) turned into the engine's. setup_module
// makes the shard and replicate groups, selects the units and hands them to an FsdpState;
// every per-step call goes to that state (src/shard/fsdp_state.cpp).
#include "fsdp/fsdp_strategy.h"

#include "comm/local_groups.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/lightning.h"
#include "fsdp/memory.h"
#include "nn/construction_scope.h"
#include "offload/disk_tier.h"
#include "shard/collectives.h"
#include "shard/deferred_init.h"
#include "shard/fsdp_strategy_impl.h"
#include "shard/options.h"
#include "shard/wrap_policy.h"

#include <cstdio>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace fsdp {

void wrap_module(fsdp::nn::Module& module) { detail::notify_wrap(module); }

FSDPStrategy::FSDPStrategy(FSDPOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  detail::check_options(options_);
}

FSDPStrategy::~FSDPStrategy() { detail::end_deferred_init(*this); }

void FSDPStrategy::enter_configure_model() {
  impl_->manual_units.clear();
  // See Note [Deferred initialization] and, on CUDA, Note [Deferred init onto the device] in
  // deferred_init.cpp.
  detail::begin_deferred_init(*this);
}

void FSDPStrategy::exit_configure_model() { detail::end_deferred_init(*this); }

void FSDPStrategy::on_module_built(torch::nn::Module& module) {
  if (impl_->deferred) impl_->deferred->on_built(module);
}

void FSDPStrategy::on_module_wrapped(fsdp::nn::Module& module) {
  auto& manual = impl_->manual_units;
  if (std::find(manual.begin(), manual.end(), &module) == manual.end()) {
    manual.push_back(&module);
  }
  // A wrapped module is complete: shard it now.
  if (impl_->deferred) impl_->deferred->on_wrap(module);
}

bool FSDPStrategy::has_manual_wraps() const { return !impl_->manual_units.empty(); }

int FSDPStrategy::num_deferred_units() const { return impl_->num_deferred_units; }

bool FSDPStrategy::connect_precision(Precision precision) {
  const std::optional<MixedPrecisionPolicy> policy = mixed_precision_policy(precision);
  if (!policy) return false;
  TORCH_CHECK(!impl_->state, "[FSDPStrategy] mixed precision must be chosen before setup_module");
  if (!options_.mixed_precision) {  // an explicit policy wins over the Trainer's precision
    options_.mixed_precision = *policy;
    detail::check_options(options_);
  }
  return true;
}

// Activation checkpointing is a module transform (fsdp/activation_checkpointing.h): the
// policy's blocks get the checkpoint forward wrapper before the units are hooked. A model that
// checkpointed some of its blocks itself in configure_model keeps its own choice (as Lightning
// does): the policy is not applied on top. See Note [Checkpointed units] in fsdp_param_group.cpp.
void FSDPStrategy::apply_checkpointing_policy(LightningModule& module) {
  if (options_.activation_checkpointing_policy.empty()) return;
  const int already = count_activation_checkpointed(module);
  if (already > 0) {
    if (rank() == 0) {
      TORCH_WARN("[FSDPStrategy] activation_checkpointing_policy is set, but the model already "
                 "checkpointed ", already, " module(s) itself (apply_activation_checkpointing in "
                 "configure_model); the policy is not applied on top.");
    }
    return;
  }
  const int wrapped =
      apply_activation_checkpointing(module, options_.activation_checkpointing_policy);
  TORCH_CHECK(wrapped > 0, "[FSDPStrategy] activation_checkpointing_policy matched no module of "
              "the model: its types must be fsdp::nn::Module subclasses the model contains. "
              "HINT: use fsdp::nn::module_types<YourBlock>() (or fsdp::demos::layer_types(name) "
              "for the demo models).");
}

namespace {

// Note [No unit below the root]
// -----------------------------
// A model in which the policy found no unit (plain torch::nn modules have no call hooks, a
// size threshold above every module, no policy at all) still trains, as one root unit: but the
// root unit is unsharded from pre-forward until the end of backward, so every rank holds the
// whole model's parameters and gradients for the whole step. That is silent unless said, so
// setup says it once (rank 0) wherever sharding is meant to save memory.
void warn_if_no_unit(const detail::FsdpState& state, const FSDPOptions& options,
                     const std::string& name, int rank) {
  if (rank != 0 || state.units().size() > 1) return;
  if (options.sharding_strategy == ShardingStrategy::kNoShard || state.shard_group()->size() < 2) {
    return;  // nothing is sharded: one unit or many hold the same memory
  }
  int64_t numel = 0;
  for (const auto& p : state.units().front()->params()) numel += p->unsharded().numel();
  if (numel == 0) return;
  TORCH_WARN("[", name, "] no unit below the root: the wrap policy selected no module and no "
             "module was wrapped with fsdp::wrap, so all ", numel, " parameter elements form "
             "the root unit, which stays gathered from the start of forward to the end of "
             "backward (every rank holds the whole model's parameters and gradients for the "
             "whole step). HINT: set FSDPOptions::auto_wrap_policy (AutoWrapPolicy::of_types("
             "fsdp::nn::module_types<Block>()) or AutoWrapPolicy::size_based(n); fsdp-train "
             "--wrap-policy), or call fsdp::wrap(block) in configure_model. Units are "
             "fsdp::nn::Module instances: a plain torch::nn module becomes one with "
             "fsdp::nn::unit(module), a torch::nn::Sequential's children with "
             "fsdp::nn::unit_children(seq) (fsdp/unit.h, docs/strategies.md).");
}

}  // namespace

void FSDPStrategy::setup_module(LightningModule& module) {
  TORCH_CHECK(!impl_->state,
              "[FSDPStrategy] setup_module called twice; one strategy shards one model");
  detail::check_options(options_);
  apply_checkpointing_policy(module);
  const int world_rank = rank();
  const int world = world_size();
  check_host_offload(module);

  // Shard and replicate groups. See docs/design.md, "Decisions": sharding strategies are policies.
  ProcessGroupPtr shard_group, replicate_group;
  if (!world_ || world == 1) {
    shard_group = world_ ? world_ : detail::make_single_rank_group(world_rank);
  } else if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
    shard_group = detail::make_single_rank_group(world_rank);  // every rank holds it whole
    replicate_group = world_;
  } else if (detail::is_hybrid(options_.sharding_strategy)) {
    // Shard inside a node (or hybrid_shard_size ranks), replicate across.
    DeviceMesh mesh = make_2d_mesh(
        world_, detail::shard_group_size(options_, world, launch_.local_world_size));
    shard_group = mesh.shard_group;
    replicate_group = mesh.replicate_group;
  } else {
    shard_group = world_;
  }

  const detail::FsdpConfig config = detail::make_fsdp_config(options_);

  // Units sharded during configure_model live in the deferred state (deferred init); a
  // configuration changed since then (e.g. mixed precision) sends them back to eager.
  detail::end_deferred_init(*this);
  std::unique_ptr<detail::FsdpState> state = std::move(impl_->deferred_state);
  if (state && !detail::same_sharding_config(state->config(), config)) {
    state->restore_all_deferred();
    state.reset();
  }
  // Size/predicate policies count elements: deferred units keep the choices made when built.
  const AutoWrapPolicy policy =
      state ? detail::policy_with_deferred_units(*state, options_.auto_wrap_policy)
            : options_.auto_wrap_policy;
  auto units = detail::select_units(module, policy, impl_->manual_units);
  if (!state) state = std::make_unique<detail::FsdpState>(config, shard_group, replicate_group);
  state->build(module, units);
  impl_->num_deferred_units = static_cast<int>(state->num_adopted_units());
  impl_->state = std::move(state);
  warn_if_no_unit(*impl_->state, options_, name_, world_rank);

  // Refuse a configuration that cannot fit before anything is allocated for it: host memory on
  // the CPU, the device's on a GPU (Note [Model-state budget] in src/memory/state_budget.cpp).
  const ModelStateBudget budget = model_state_budget(device(), launch_.local_world_size);
  if (budget.bytes > 0) {
    // Tiers on disk are left out: the disk tier checks its own buffers against the budget
    // (Note [Disk tier swapper], Note [Parameters on disk] in docs/design.md).
    FSDPMemoryEstimate need = memory_estimate();
    if (options_.offload_policy.optimizer_on_disk()) need.optimizer_bytes = 0;
    if (options_.offload_policy.params_on_disk()) need.sharded_param_bytes = 0;
    if (need.total_bytes() > budget.bytes) {
      std::ostringstream os;
      os << "[FSDPStrategy] " << to_string(options_.sharding_strategy) << " needs "
         << format_bytes(need.total_bytes()) << " per rank for model state (sharded params "
         << format_bytes(need.sharded_param_bytes) << " + sharded grads "
         << format_bytes(need.sharded_grad_bytes) << " + Adam state "
         << format_bytes(need.optimizer_bytes) << " + unsharded units "
         << format_bytes(need.unsharded_peak_bytes) << ") but " << budget.what << " is "
         << format_bytes(budget.bytes) << " per rank (rank " << world_rank << " of " << world
         << "). HINT: use more devices, FULL_SHARD, a finer --wrap-policy, " << budget.more
         << ".";
      impl_->state.reset();
      throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, os.str());
    }
  }

  if (options_.sync_module_states && world_ && world > 1) {
    at::NoGradGuard no_grad;
    for (auto* p : impl_->state->all_params()) world_->broadcast(p->unsharded().detach(), 0);
    for (auto& b : module.buffers()) {
      if (b.defined() && b.numel() > 0) world_->broadcast(b.detach(), 0);
    }
  }
  impl_->state->materialize();
  if (options_.mixed_precision && options_.mixed_precision->buffer_dtype) {
    at::NoGradGuard no_grad;
    const at::ScalarType dtype = *options_.mixed_precision->buffer_dtype;
    for (auto& b : module.buffers(/*recurse=*/true)) {
      if (b.defined() && b.is_floating_point() && b.scalar_type() != dtype) {
        b.set_data(b.to(dtype));
      }
    }
  }
  if (options_.offload_policy.params_on_disk()) place_params_on_disk();
}

// OffloadPolicy kCpu (fsdp/offload.h): on a CPU device the identity, said once; from an
// accelerator not implemented.
void FSDPStrategy::check_host_offload(LightningModule& module) {
  const OffloadPolicy& policy = options_.offload_policy;
  TORCH_CHECK(!device().is_cuda() || !policy.any(), "[", name_, "] offload_policy (",
              "parameters and optimizer state in host memory or on disk) from a CUDA device is "
              "not on CUDA yet (docs/gpu.md); train on the GPU without offload, or with "
              "accelerator='cpu'");
  const bool params = policy.params == OffloadDevice::kCpu;
  const bool optim = policy.optimizer == OffloadDevice::kCpu;
  if (!params && !optim) return;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    TORCH_CHECK(!p.defined() || p.device().is_cpu() || p.device().is_meta(), "[", name_,
                "] offload_policy \"cpu\" from an accelerator to host memory is not "
                "implemented yet (a parameter is on ", p.device(), ")");
  }
  if (rank() == 0) {
    std::fprintf(stderr, "[%s] offload_policy cpu (%s%s%s): the compute device is the CPU, so "
                 "this state already lives in host memory and the step already runs there; "
                 "nothing is moved\n", name_.c_str(), params ? "parameters, gradients" : "",
                 params && optim ? " + " : "", optim ? "optimizer state" : "");
  }
}

// --- the disk tier (OffloadPolicy kNvme) ------------------------------------------------------

namespace {

// Where this rank's swap files go; the job's name is decided once (a collective).
detail::DiskPlacement disk_placement(FSDPStrategy& strategy, std::string& job) {
  if (job.empty()) {
    job = detail::disk_job_name(strategy.options().offload_policy.disk, strategy.world().get());
  }
  detail::DiskPlacement at;
  at.job = job;
  at.rank = strategy.rank();
  at.ranks_sharing_disk = std::max(1, strategy.launch_info().local_world_size);
  at.who = "[" + strategy.name() + "]";
  return at;
}

}  // namespace

// Note [Parameters on disk] in docs/design.md: every unit's shard becomes one swap record; the
// units' all-gathers and the disk tier's optimizer step acquire them.
void FSDPStrategy::place_params_on_disk() {
  detail::FsdpState& state = *impl_->state;
  TORCH_CHECK(state.shard_group()->size() > 1, "[", name_, "] parameters on disk (offload "
              "params \"nvme\") need at least 2 ranks in the shard group: with one rank nothing "
              "is sharded, so there is no all-gather to read the parameters for. HINT: --devices 2 "
              "or more, or keep the parameters in RAM with the optimizer state on disk "
              "(OffloadPolicy::nvme(path, /*params=*/false); DeepSpeed: offload_params_device "
              "\"cpu\")");
  const detail::DiskPlacement at = disk_placement(*this, impl_->job);
  state.place_params_on_disk(detail::param_swapper_options(options_.offload_policy.disk, at));
  std::fprintf(stderr, "%s rank %d: parameters on disk (offload_param device nvme):\n%s",
               at.who.c_str(), rank(), state.param_swapper()->plan().describe().c_str());
}

void FSDPStrategy::setup_optimizer(torch::optim::Optimizer& optimizer) {
  if (!options_.offload_policy.optimizer_on_disk()) return;
  TORCH_CHECK(impl_->state, "[", name_, "] setup_optimizer before setup_module");
  TORCH_CHECK(!impl_->nvme, "[", name_, "] setup_optimizer called twice with the disk tier");
  const detail::DiskPlacement at = disk_placement(*this, impl_->job);
  const NvmeOffloadOptions& nvme = options_.offload_policy.disk;
  impl_->nvme = std::make_unique<detail::NvmeAdam>(optimizer, detail::nvme_adam_options(nvme, at));
  impl_->nvme->set_residency(impl_->state->param_swapper());
  std::fprintf(stderr, "%s rank %d: optimizer state on disk (offload_optimizer device nvme, aio "
               "block_size %lld, queue_depth %d):\n%s", at.who.c_str(), rank(),
               static_cast<long long>(nvme.aio.block_size), nvme.aio.queue_depth,
               impl_->nvme->plan().describe().c_str());
}

void FSDPStrategy::optimizer_step(torch::optim::Optimizer& optimizer) {
  detail::ParamSwapper* swapper = impl_->state ? impl_->state->param_swapper() : nullptr;
  TORCH_CHECK(!options_.offload_policy.optimizer_on_disk() || impl_->nvme, "[", name_,
              "] the optimizer state is on disk (offload optimizer \"nvme\"), but its disk "
              "tier was not set up: setup_optimizer was not called with this optimizer, or it "
              "failed. The disk tier's step replaces optimizer.step()");
  if (impl_->nvme) {
    impl_->nvme->step(optimizer);  // See Note [Disk tier swapper]
  } else {
    optimizer.step();
  }
  if (swapper) swapper->end_step();
}

StreamedOptimizerState* FSDPStrategy::streamed_optimizer_state() { return impl_->nvme.get(); }

const DiskPlan* FSDPStrategy::disk_plan() const {
  return impl_->nvme ? &impl_->nvme->plan() : nullptr;
}

const ParamDiskPlan* FSDPStrategy::param_disk_plan() const {
  auto* swapper = impl_->state ? impl_->state->param_swapper() : nullptr;
  return swapper ? &swapper->plan() : nullptr;
}

std::vector<std::string> FSDPStrategy::param_swap_files() const {
  auto* swapper = impl_->state ? impl_->state->param_swapper() : nullptr;
  return swapper ? swapper->files() : std::vector<std::string>{};
}

std::vector<std::string> FSDPStrategy::swap_files() const {
  std::vector<std::string> out = impl_->nvme ? impl_->nvme->files() : std::vector<std::string>{};
  for (const auto& f : param_swap_files()) out.push_back(f);
  return out;
}

void FSDPStrategy::flush_disk_tier() {
  if (impl_->nvme) impl_->nvme->flush();
  if (auto* swapper = impl_->state ? impl_->state->param_swapper() : nullptr) swapper->flush();
}

// --- one step: straight to the engine ----------------------------------------------------------

void FSDPStrategy::pre_forward(LightningModule&, bool sync) {
  detail::state_of(*this).begin_step(sync);
}

void FSDPStrategy::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.requires_grad(),
              "[FSDPStrategy] backward: the loss does not require grad (was it computed under "
              "NoGradGuard, or from frozen parameters only?)");
  // The root unit's "pre-backward": queue the end-of-backward callback as soon as backward
  // starts, even when no unit output carries a hook.
  detail::state_of(*this).hook_loss(loss);
  RECORD_FUNCTION("FSDP::backward", c10::ArrayRef<const c10::IValue>{});
  loss.backward();
}

void FSDPStrategy::post_backward(LightningModule&, bool) { detail::state_of(*this).finish_step(); }

void FSDPStrategy::post_eval_step(LightningModule&) { detail::state_of(*this).finish_eval_step(); }

double FSDPStrategy::clip_grad_norm(LightningModule&, double max_norm) {
  // Sum of squares over this rank's shards, summed over the shard group (replicate groups hold
  // identical shards; padding rows hold zero gradients), so the norm is exact.
  detail::FsdpState& state = detail::state_of(*this);
  std::vector<at::Tensor> grads;
  for (auto* p : state.all_params()) {
    if (p->sharded().grad().defined()) grads.push_back(p->sharded().grad());
  }
  return clip_grad_norm_of_parts(grads, *state.shard_group(), max_norm);
}

void FSDPStrategy::zero_grad(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
  if (!impl_->state) return;
  for (auto* p : impl_->state->all_params()) {
    if (p->sharded().grad().defined()) p->sharded().mutable_grad() = at::Tensor();
    if (p->unsharded().grad().defined()) p->unsharded().mutable_grad() = at::Tensor();
  }
}

// --- what the Trainer and the checkpointer see -------------------------------------------------

LocalShards FSDPStrategy::local_shards() {
  detail::FsdpState& state = detail::state_of(*this);
  LocalShards out;
  out.shard_group = state.shard_group();
  out.replica_rank = state.replicate_group() ? state.replicate_group()->rank() : 0;
  TORCH_INTERNAL_ASSERT(
      out.shard_group->size() * (state.replicate_group() ? state.replicate_group()->size() : 1) ==
          world_size(),
      "shard group ", out.shard_group->size(), " x replicate group does not cover the world of ",
      world_size());
  for (detail::FsdpParam* p : state.all_params()) {
    if (p->aliased()) continue;  // S is P: held whole
    // `local` is S itself (not a detached alias): the checkpointer finds it among
    // module.named_parameters() by its TensorImpl.
    out.params.push_back(LocalShard{p->sharded(), p->full_shape().vec(),
                                    p->shard_rows(), p->rows_of(out.shard_group->rank()),
                                    /*param=*/at::Tensor()});
  }
  out.pager = state.param_swapper();  // Note [Checkpoints of parameters on disk]
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPStrategy::gather_full_params() {
  detail::FsdpState& state = detail::state_of(*this);
  // Parameters on disk: every shard in RAM for the gather (a tool for tests and export, not
  // the step).
  detail::ParamSwapper* swapper = state.param_swapper();
  std::vector<at::Tensor> paged;
  auto page_out = [&] {
    for (auto& t : paged) swapper->page_out(t, /*modified=*/false);
    paged.clear();
  };
  std::vector<std::pair<std::string, at::Tensor>> out;
  try {
    if (swapper) {
      for (auto* p : state.all_params()) {
        swapper->page_in(p->sharded());
        paged.push_back(p->sharded());
      }
    }
    for (auto* p : state.all_params()) {
      out.emplace_back(p->fqn(), detail::gather_full(*p, *state.shard_group()));
    }
  } catch (...) {
    page_out();
    throw;
  }
  page_out();
  return out;
}

}  // namespace fsdp
