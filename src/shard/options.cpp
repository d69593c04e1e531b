// The names FSDP accepts, parsed in one place each (docs/design.md, "Decisions"), and
// FSDPOptions turned into the engine's configuration.
#include "shard/options.h"

#include "common/text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace fsdp {
namespace {

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
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
              detail::quoted_list(sharding_strategy_names()));
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

std::shared_ptr<FSDPStrategy> make_fsdp_strategy(const std::string& name, FSDPOptions options) {
  const std::string lowered = lower(name);
  if (lowered != "fsdp") {
    const std::string prefix = "fsdp_";
    const std::vector<std::string> names = fsdp_strategy_names();
    TORCH_CHECK(lowered.rfind(prefix, 0) == 0 &&
                    std::find(names.begin(), names.end(), lowered) != names.end(),
                "[FSDPStrategy] unknown FSDP strategy '", name, "'; valid names: ",
                detail::quoted_list(names));
    const ShardingStrategy named = parse_sharding_strategy(lowered.substr(prefix.size()));
    TORCH_CHECK(options.sharding_strategy == ShardingStrategy::kFullShard ||
                    options.sharding_strategy == named,
                "[FSDPStrategy] strategy '", name, "' means ", to_string(named),
                " but the options ask for ", to_string(options.sharding_strategy),
                ". HINT: use --strategy fsdp with --sharding-strategy, or drop the latter.");
    options.sharding_strategy = named;
  }
  auto strategy = std::make_shared<FSDPStrategy>(std::move(options));
  strategy->set_name(lowered);
  return strategy;
}

namespace detail {

// --- options -> engine configuration ----------------------------------------------------------

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

bool is_hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardZero2;
}

FsdpConfig make_fsdp_config(const FSDPOptions& options) {
  FsdpConfig config;
  config.reshard_after_forward = reshards_after_forward(options.sharding_strategy);
  config.forward_prefetch = options.forward_prefetch;
  config.backward_prefetch = options.backward_prefetch;
  config.limit_all_gathers = options.limit_all_gathers;
  config.mixed_precision = options.mixed_precision;
  for (const auto& t : options.ignored_params) config.ignored.insert(t.unsafeGetTensorImpl());
  config.prefetch_bucket_numel = options.prefetch_bucket_numel;
  config.max_live_numel = options.max_live_numel;
  config.offload_params = options.offload_policy.params;
  return config;
}

bool same_sharding_config(const FsdpConfig& a, const FsdpConfig& b) {
  auto mp = [](const FsdpConfig& c) {
    return c.mixed_precision ? c.mixed_precision->to_string() : std::string("none");
  };
  return a.reshard_after_forward == b.reshard_after_forward && mp(a) == mp(b);
}

int shard_group_size(const FSDPOptions& options, int world_size, int local_world_size) {
  const ShardingStrategy ss = options.sharding_strategy;
  if (ss == ShardingStrategy::kNoShard) return 1;
  if (!is_hybrid(ss)) return world_size;
  int shard_size = options.hybrid_shard_size > 0 ? options.hybrid_shard_size : local_world_size;
  if (shard_size <= 0 || shard_size > world_size) shard_size = world_size;
  TORCH_CHECK(world_size % shard_size == 0, "[FSDPStrategy] ", to_string(ss),
              ": the shard group size ", shard_size, " must divide the world size ", world_size,
              ". HINT: set hybrid_shard_size (e.g. ranks per node).");
  return shard_size;
}

void check_options(const FSDPOptions& o) {
  if (o.mixed_precision) {
    auto check = [](const char* field, const std::optional<at::ScalarType>& t) {
      TORCH_CHECK(!t || at::isFloatingType(*t), "[FSDPStrategy] MixedPrecisionPolicy.", field,
                  " must be a floating dtype (e.g. at::kBFloat16, at::kFloat), got ", *t);
    };
    check("param_dtype", o.mixed_precision->param_dtype);
    check("reduce_dtype", o.mixed_precision->reduce_dtype);
    check("buffer_dtype", o.mixed_precision->buffer_dtype);
  }
  TORCH_CHECK(o.prefetch_bucket_numel >= 0 && o.max_live_numel >= 0,
              "[FSDPStrategy] prefetch_bucket_numel and max_live_numel must be >= 0 elements "
              "(0 = off), got ", o.prefetch_bucket_numel, " and ", o.max_live_numel);
  TORCH_CHECK(o.ignored_params.empty() || !o.deferred_init,
              "[FSDPStrategy] ignored_params needs deferred_init = false: deferred "
              "initialization shards units while configure_model builds them, before the "
              "ignored parameters exist. HINT: set FSDPOptions::deferred_init = false");
  TORCH_CHECK(o.state_dict_type == "full", "[FSDPStrategy] FSDPOptions::state_dict_type='",
              o.state_dict_type, "' is not implemented (only 'full'): the checkpoint format is "
              "the Trainer's. HINT: TrainerOptions::state_dict_type = \"sharded\" (fsdp-train "
              "--state-dict-type sharded; Lightning's FSDPStrategy(state_dict_type=...)), see "
              "docs/checkpoints.md");
  check_offload_policy(o.offload_policy, "[FSDPStrategy]");
  TORCH_CHECK(!o.offload_policy.params_on_disk() ||
                  o.sharding_strategy != ShardingStrategy::kNoShard,
              "[FSDPStrategy] parameters on disk (offload_policy.params nvme) need a sharding "
              "strategy that shards: NO_SHARD keeps every parameter whole, so there is no "
              "all-gather to read them for. HINT: FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD");
  TORCH_CHECK(o.hybrid_shard_size >= 0, "[FSDPStrategy] hybrid_shard_size must be >= 0 (0 = "
              "ranks of one node), got ", o.hybrid_shard_size);
}

}  // namespace detail
}  // namespace fsdp
