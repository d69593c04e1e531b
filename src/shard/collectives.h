// Process groups the sharding engine builds for itself.
#pragma once

#include "fsdp/comm.h"

namespace fsdp::detail {

// A group of exactly one rank (this process): every collective is a local copy, completed on
// return. Used as the shard group of NO_SHARD (each rank holds whole parameters) and whenever a
// strategy runs without a world group.
ProcessGroupPtr make_single_rank_group(int world_rank);

}  // namespace fsdp::detail
