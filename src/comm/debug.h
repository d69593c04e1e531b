// FSDP_DEBUG=detail: before each collective every rank of the group all-gathers a fixed-size
// fingerprint of the call and compares. See Note [Collective fingerprints].
#pragma once

#include "comm/process_group_impl.h"

#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

struct CollectiveFingerprint {
  CollectiveOp op = CollectiveOp::kBarrier;
  int64_t seq = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t arg = 0;  // root (broadcast), reduce op (reductions), hash of ranks (new_subgroup)
};

// "all_gather #3 [1024] float32" (+ " root 1", " sum", ...).
std::string describe_fingerprint(const CollectiveFingerprint& fp);

// Collective over the transport's group. Returns the mismatch text (the same on every rank:
// "rank 0 called all_gather #3 [1024] float32 but rank 1 called all_reduce #3 [512] bfloat16")
// or nullopt when all ranks agree.
std::optional<std::string> check_same_collective(Transport& transport, int group_size,
                                                 const CollectiveFingerprint& mine,
                                                 const std::vector<int>& world_ranks);

}  // namespace fsdp::detail
