#include "fsdp/fsdp_strategy.h"

#include "fsdp/activation_checkpointing.h"
#include "fsdp/lightning.h"
#include "fsdp/memory.h"
#include "shard/collectives.h"
#include "shard/deferred_init.h"
#include "shard/fsdp_state.h"
#include "shard/wrap_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

namespace fsdp {
namespace {

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string join(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size(); ++i) os << (i ? ", " : "") << "'" << names[i] << "'";
  return os.str();
}

bool is_hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardZero2;
}

bool reshards_after_forward(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kHybridShard:
      return true;
    case ShardingStrategy::kShardGradOp:
    case ShardingStrategy::kHybridShardZero2:
    case ShardingStrategy::kNoShard:
      return false;
  }
  return true;
}

void check_not_supported_yet(const FSDPOptions& o) {
  if (o.mixed_precision) detail::check_mixed_precision_policy(*o.mixed_precision);
  TORCH_CHECK(!o.cpu_offload, "[FSDPStrategy] cpu_offload=true is not supported yet");
  TORCH_CHECK(o.state_dict_type == "full", "[FSDPStrategy] state_dict_type='", o.state_dict_type,
              "' is not supported yet; only 'full' is accepted for now");
  TORCH_CHECK(o.hybrid_shard_size >= 0, "[FSDPStrategy] hybrid_shard_size must be >= 0 (0 = "
              "ranks of one node), got ", o.hybrid_shard_size);
}

}  // namespace

// --- names -----------------------------------------------------------------------------------

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  const std::string u = upper(name);
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                             ShardingStrategy::kHybridShardZero2}) {
    if (u == to_string(s)) return s;
  }
  TORCH_CHECK(false, "[FSDPStrategy] unknown sharding strategy '", name, "'; valid names: ",
              join(sharding_strategy_names()));
}

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

std::vector<std::string> sharding_strategy_names() {
  return {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"};
}

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  if (name == "pre" || upper(name) == "BACKWARD_PRE") return BackwardPrefetch::kPre;
  if (name == "post" || upper(name) == "BACKWARD_POST") return BackwardPrefetch::kPost;
  if (name == "none" || name.empty()) return BackwardPrefetch::kNone;
  TORCH_CHECK(false, "[FSDPStrategy] unknown backward prefetch '", name,
              "'; valid values: 'pre', 'post', 'none'");
}

const char* to_string(BackwardPrefetch prefetch) {
  switch (prefetch) {
    case BackwardPrefetch::kPre:
      return "pre";
    case BackwardPrefetch::kPost:
      return "post";
    case BackwardPrefetch::kNone:
      return "none";
  }
  return "?";
}

std::vector<std::string> fsdp_strategy_names() {
  return {"fsdp",          "fsdp_full_shard",   "fsdp_shard_grad_op",
          "fsdp_no_shard", "fsdp_hybrid_shard", "fsdp_hybrid_shard_zero2"};
}

const char* fsdp_strategy_help(const std::string& name) {
  if (name == "fsdp") return "fully sharded data parallel (FULL_SHARD; see --sharding-strategy)";
  if (name == "fsdp_full_shard") return "FSDP: shard params, grads, optimizer state";
  if (name == "fsdp_shard_grad_op") return "FSDP: shard grads and optimizer state (ZeRO-2 like)";
  if (name == "fsdp_no_shard") return "FSDP engine without sharding (DDP-like)";
  if (name == "fsdp_hybrid_shard") return "FSDP: FULL_SHARD inside a node, replicate across";
  if (name == "fsdp_hybrid_shard_zero2") return "FSDP: SHARD_GRAD_OP inside a node, replicate across";
  return "";
}

std::shared_ptr<FSDPStrategy> make_fsdp_strategy(const std::string& name, FSDPOptions options) {
  const std::string lower = [&] {
    std::string s = name;
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }();
  if (lower != "fsdp") {
    const std::string prefix = "fsdp_";
    const std::vector<std::string> names = fsdp_strategy_names();
    TORCH_CHECK(lower.rfind(prefix, 0) == 0 &&
                    std::find(names.begin(), names.end(), lower) != names.end(),
                "[make_fsdp_strategy] unknown FSDP strategy '", name, "'; valid names: ",
                join(fsdp_strategy_names()));
    const ShardingStrategy named = parse_sharding_strategy(lower.substr(prefix.size()));
    TORCH_CHECK(options.sharding_strategy == ShardingStrategy::kFullShard ||
                    options.sharding_strategy == named,
                "[make_fsdp_strategy] strategy '", name, "' means ", to_string(named),
                " but the options ask for ", to_string(options.sharding_strategy),
                ". HINT: use --strategy fsdp with --sharding-strategy, or drop the latter.");
    options.sharding_strategy = named;
  }
  auto strategy = std::make_shared<FSDPStrategy>(std::move(options));
  strategy->set_name(lower);
  return strategy;
}

void wrap_module(fsdp::nn::Module& module) {
  if (auto* fsdp = dynamic_cast<FSDPStrategy*>(active_strategy())) fsdp->mark_unit(module);
}

namespace detail {
FsdpConfig make_fsdp_config(const FSDPOptions& options) {
  FsdpConfig config;
  config.reshard_after_forward = reshards_after_forward(options.sharding_strategy);
  config.forward_prefetch = options.forward_prefetch;
  config.backward_prefetch = options.backward_prefetch;
  config.limit_all_gathers = options.limit_all_gathers;
  config.mixed_precision = options.mixed_precision;
  return config;
}
}  // namespace detail

// --- FSDPStrategy ------------------------------------------------------------------------------

FSDPStrategy::FSDPStrategy(FSDPOptions options) : options_(std::move(options)) {
  check_not_supported_yet(options_);
}

FSDPStrategy::~FSDPStrategy() { end_deferred_init(); }

void FSDPStrategy::connect(ProcessGroupPtr world, const LaunchInfo& launch) {
  Strategy::connect(std::move(world), launch);
}

void FSDPStrategy::enter_configure_model() {
  manual_units_.clear();
  begin_deferred_init();  // See Note [Deferred initialization] in deferred_init.cpp.
}
void FSDPStrategy::exit_configure_model() { end_deferred_init(); }

void FSDPStrategy::mark_unit(fsdp::nn::Module& module) {
  if (std::find(manual_units_.begin(), manual_units_.end(), &module) == manual_units_.end()) {
    manual_units_.push_back(&module);
  }
  if (deferred_) deferred_->on_wrap(module);  // a wrapped module is complete: shard it now
}

// Activation checkpointing is a module transform (fsdp/activation_checkpointing.h): the
// policy's blocks get the checkpoint forward wrapper before the units are hooked. A model that
// checkpointed some of its blocks itself in configure_model keeps its own choice (as Lightning
// does): the policy is not applied on top. See Note [Checkpointed units] in fsdp_param_group.cpp.
void FSDPStrategy::apply_checkpointing_policy(LightningModule& module) {
  if (options_.activation_checkpointing_policy.empty()) return;
  const int already = count_activation_checkpointed(module);
  if (already > 0) {
    if (!world_ || world_->rank() == 0) {
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

detail::FsdpState& FSDPStrategy::state() {
  TORCH_CHECK(state_, "[FSDPStrategy] no model is set up yet: call setup_module first");
  return *state_;
}

void FSDPStrategy::setup_module(LightningModule& module) {
  TORCH_CHECK(!state_, "[FSDPStrategy] setup_module called twice; one strategy shards one model");
  check_not_supported_yet(options_);
  apply_checkpointing_policy(module);
  const ShardingStrategy ss = options_.sharding_strategy;
  const int world_rank = world_ ? world_->rank() : 0;
  const int world_size = world_ ? world_->size() : 1;

  // Shard and replicate groups. See DESIGN.md §3: sharding strategies are policies.
  ProcessGroupPtr shard_group, replicate_group;
  if (!world_ || world_size == 1) {
    shard_group = world_ ? world_ : detail::make_single_rank_group(world_rank);
  } else if (ss == ShardingStrategy::kNoShard) {
    shard_group = detail::make_single_rank_group(world_rank);
    replicate_group = world_;
  } else if (is_hybrid(ss)) {
    int shard_size = options_.hybrid_shard_size > 0 ? options_.hybrid_shard_size
                                                    : launch_.local_world_size;
    if (shard_size <= 0 || shard_size > world_size) shard_size = world_size;
    TORCH_CHECK(world_size % shard_size == 0, "[FSDPStrategy] ", to_string(ss),
                ": the shard group size ", shard_size, " must divide the world size ",
                world_size, ". HINT: set hybrid_shard_size (e.g. ranks per node).");
    DeviceMesh mesh = make_2d_mesh(world_, shard_size);
    shard_group = mesh.shard_group;
    replicate_group = mesh.replicate_group;
  } else {
    shard_group = world_;
  }

  const detail::FsdpConfig config = detail::make_fsdp_config(options_);

  // Units sharded during configure_model live in deferred_state_ (deferred init); a
  // configuration changed since then (e.g. mixed precision) sends them back to eager.
  end_deferred_init();
  std::unique_ptr<detail::FsdpState> state = std::move(deferred_state_);
  if (state && !detail::same_sharding_config(state->config(), config)) {
    state->restore_all_deferred();
    state.reset();
  }
  // Size/predicate policies count elements: deferred units keep the choices made when built.
  const AutoWrapPolicy policy =
      state ? detail::policy_with_deferred_units(*state, options_.auto_wrap_policy)
            : options_.auto_wrap_policy;
  auto units = detail::select_units(module, policy, manual_units_);
  if (!state) state = std::make_unique<detail::FsdpState>(config, shard_group, replicate_group);
  state->build(module, units);
  num_deferred_units_ = static_cast<int>(state->num_adopted_units());
  state_ = std::move(state);

  // Refuse a configuration that cannot fit before anything is allocated for it.
  const int64_t budget = memory_budget();
  if (budget > 0) {
    const FSDPMemoryEstimate need = memory_estimate();
    if (need.total_bytes() > budget) {
      std::ostringstream os;
      os << "[FSDPStrategy] " << to_string(ss) << " needs " << format_bytes(need.total_bytes())
         << " per rank for model state (sharded params " << format_bytes(need.sharded_param_bytes)
         << " + sharded grads " << format_bytes(need.sharded_grad_bytes) << " + Adam state "
         << format_bytes(need.optimizer_bytes) << " + unsharded units "
         << format_bytes(need.unsharded_peak_bytes) << ") but the memory budget is "
         << format_bytes(budget) << " (rank " << world_rank << " of " << world_size
         << "). HINT: use more devices, FULL_SHARD, a finer --wrap-policy, or raise "
            "FSDP_MEMORY_BUDGET.";
      state_.reset();
      throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, os.str());
    }
  }

  if (options_.sync_module_states && world_ && world_size > 1) {
    at::NoGradGuard no_grad;
    for (auto* p : state_->all_params()) world_->broadcast(p->unsharded().detach(), 0);
    for (auto& b : module.buffers()) {
      if (b.defined() && b.numel() > 0) world_->broadcast(b.detach(), 0);
    }
  }
  state_->materialize();
  if (options_.mixed_precision && options_.mixed_precision->buffer_dtype) {
    detail::cast_buffers(module, *options_.mixed_precision->buffer_dtype);
  }
}

MixedPrecisionPolicy FSDPStrategy::apply_default_mixed_precision(
    const MixedPrecisionPolicy& policy) {
  TORCH_CHECK(!state_, "[FSDPStrategy] mixed precision must be chosen before setup_module");
  if (!options_.mixed_precision) {
    detail::check_mixed_precision_policy(policy);
    options_.mixed_precision = policy;
  }
  return *options_.mixed_precision;
}

FSDPMemoryEstimate FSDPStrategy::memory_estimate() const {
  TORCH_CHECK(state_, "[FSDPStrategy] memory_estimate needs setup_module first");
  FSDPMemoryEstimate e;
  auto& units = const_cast<detail::FsdpState&>(*state_).units();
  const bool aliased = state_->shard_group()->size() == 1;
  std::vector<int64_t> unit_bytes;  // params + grads, full size
  int64_t sum_unit_params = 0, max_grads = 0;
  for (auto& unit : units) {
    int64_t params = 0, grads = 0;
    for (auto& p : unit->params()) {
      e.sharded_param_bytes += p->shard_nbytes();
      if (p->requires_grad()) {
        e.sharded_grad_bytes += p->shard_nbytes();
        grads += p->full_nbytes();
      }
      params += p->full_nbytes();
    }
    if (unit->is_root()) {
      if (!aliased) e.unsharded_peak_bytes += params + grads;
    } else {
      unit_bytes.push_back(params + grads);
      sum_unit_params += params;
      max_grads = std::max(max_grads, grads);
    }
  }
  e.optimizer_bytes = 2 * e.sharded_grad_bytes;
  if (!aliased) {
    if (reshards_after_forward(options_.sharding_strategy)) {
      std::sort(unit_bytes.rbegin(), unit_bytes.rend());
      for (size_t i = 0; i < unit_bytes.size() && i < 2; ++i) e.unsharded_peak_bytes += unit_bytes[i];
    } else {
      e.unsharded_peak_bytes += sum_unit_params + max_grads;
    }
  }
  return e;
}

void FSDPStrategy::pre_forward(LightningModule& module, bool sync) {
  state().begin_step(sync);
}

void FSDPStrategy::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.requires_grad(),
              "[FSDPStrategy] backward: the loss does not require grad (was it computed under "
              "NoGradGuard, or from frozen parameters only?)");
  detail::FsdpState* st = &state();
  // The root unit's "pre-backward": queue the end-of-backward callback as soon as backward
  // starts, even when no unit output carries a hook.
  at::Tensor hooked = loss;
  hooked.register_hook([st](const at::Tensor&) { st->on_backward_start(); });
  hooked.backward();
}

void FSDPStrategy::post_backward(LightningModule& module, bool sync) { state().finish_step(); }

void FSDPStrategy::post_eval_step(LightningModule& module) { state().finish_eval_step(); }

double FSDPStrategy::clip_grad_norm(LightningModule& module, double max_norm) {
  // Sum of squares over this rank's shards, summed over the shard group (replicate groups hold
  // identical shards; padding rows hold zero gradients), so the norm is exact.
  std::vector<at::Tensor> grads;
  for (auto* p : state().all_params()) {
    if (p->sharded().grad().defined()) grads.push_back(p->sharded().grad());
  }
  at::NoGradGuard no_grad;
  at::Tensor total = at::zeros({1}, at::kDouble);
  for (auto& g : grads) total += g.detach().to(at::kDouble).pow(2).sum();
  const auto& group = state().shard_group();
  if (group->size() > 1) group->all_reduce(total, ReduceOp::kSum);
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

void FSDPStrategy::zero_grad(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
  if (!state_) return;
  for (auto* p : state_->all_params()) {
    if (p->sharded().grad().defined()) p->sharded().mutable_grad() = at::Tensor();
    if (p->unsharded().grad().defined()) p->unsharded().mutable_grad() = at::Tensor();
  }
}

std::vector<std::pair<std::string, at::Tensor>> FSDPStrategy::gather_full_params() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::NoGradGuard no_grad;
  const auto& group = state().shard_group();
  for (auto* p : state().all_params()) {
    const at::Tensor& s = p->sharded();
    if (p->aliased()) {
      out.emplace_back(p->fqn(), s.detach().clone());
      continue;
    }
    at::Tensor flat = at::empty({group->size() * p->shard_numel()}, s.options().requires_grad(false));
    group->all_gather_into_tensor(flat, s.detach().reshape({-1}).contiguous());
    at::Tensor full = flat.view({group->size() * p->shard_rows(), p->row_numel()})
                          .narrow(0, 0, p->dim0())
                          .reshape(p->full_shape())
                          .clone();
    out.emplace_back(p->fqn(), full);
  }
  return out;
}

}  // namespace fsdp
