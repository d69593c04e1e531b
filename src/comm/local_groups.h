// Process groups that talk to no peer: a group of one rank, and a group that only has a size.
// Both sit beside the real backends so that code above src/comm/ never special-cases them.
#pragma once

#include "fsdp/comm.h"

namespace fsdp::detail {

// A Work that is complete when it is returned (collectives of a one-rank group).
WorkPtr done_work();

// A group of exactly one rank (this process): every collective is a local copy, completed on
// return. The shard group of NO_SHARD (each rank holds whole parameters) and of any strategy
// that runs without a world group.
ProcessGroupPtr make_single_rank_group(int world_rank);

// A group of `size` ranks that has no peers: for planning units and shard sizes without a
// launcher (fsdp::estimate_fsdp_memory). Any collective is an error that says so.
ProcessGroupPtr make_shape_only_group(int size);

}  // namespace fsdp::detail
