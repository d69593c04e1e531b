// FSDPOptions turned into the engine's terms: its configuration, the shard group's size, and
// the checks every entry point runs. Names (strategies, sharding strategies, prefetch) are
// parsed in options.cpp too.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "shard/fsdp_state.h"

namespace fsdp::detail {

// The engine configuration of `options` (one place: setup_module, deferred init and planning
// agree).
FsdpConfig make_fsdp_config(const FSDPOptions& options);
// Whether units built under `a` are valid under `b` (resharding and mixed precision agree).
bool same_sharding_config(const FsdpConfig& a, const FsdpConfig& b);
// FULL_SHARD / HYBRID_SHARD reshard after forward; the others keep parameters until backward.
bool reshards_after_forward(ShardingStrategy strategy);
bool is_hybrid(ShardingStrategy strategy);
// Ranks per shard group for `options` over `world_size` ranks, `local_world_size` per node:
// the world (FULL_SHARD, SHARD_GRAD_OP), 1 (NO_SHARD), hybrid_shard_size or a node (HYBRID_*),
// which must divide the world size.
int shard_group_size(const FSDPOptions& options, int world_size, int local_world_size);
// Refuses options that are invalid or not supported yet, naming the field.
void check_options(const FSDPOptions& options);

}  // namespace fsdp::detail
