// The unit's buffer math (FSDP2's _fsdp_collectives.py): how a unit's parameters are laid out
// in one flat all-gather and one flat reduce-scatter, and the copies in and out of them. Free
// functions over parameters; the unit (fsdp_param_group.cpp) decides when they run.
// See Note [Unit all-gather] and Note [Unit reduce-scatter] in collectives.cpp.
#pragma once

#include "fsdp/comm.h"
#include "shard/fsdp_param.h"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

namespace fsdp::detail {

using FsdpParams = std::vector<std::unique_ptr<FsdpParam>>;

// Where every parameter of a unit sits in the flat buffers.
struct FlatLayout {
  std::vector<int64_t> all_gather_offsets;      // per parameter, into the all-gather input
  std::vector<int64_t> reduce_scatter_offsets;  // per parameter, into the reduce-scatter output
                                                // (-1: frozen, not reduced)
  int64_t all_gather_numel = 0;                 // sum of shard numels (bytes when `bytes`)
  int64_t reduce_scatter_numel = 0;             // sum of trainable shard numels
  // Parameters of different compute dtypes (a quantized base): the all-gather moves bytes.
  // See Note [Units of mixed dtypes] in collectives.cpp.
  bool bytes = false;
};
FlatLayout flat_layout(const FsdpParams& params);

// Parameter i's slice of an all-gather buffer (the flat input, or the (W, all_gather_numel)
// rank-major output), viewed in its compute dtype.
at::Tensor all_gather_slice(const at::Tensor& buffer, const FlatLayout& layout,
                            const FsdpParam& param, size_t i);

// An all-gather in flight.
struct AllGather {
  WorkPtr work;
  at::Tensor input;   // (all_gather_numel)
  at::Tensor output;  // (W * all_gather_numel)
};
// Copy-in (every S, cast to `dtype`, into one flat input; to each parameter's own compute
// dtype in a byte layout) and the asynchronous all-gather.
AllGather all_gather(const FsdpParams& params, const FlatLayout& layout, ProcessGroup& group,
                     at::ScalarType dtype);
// Waits for `ag`, allocates every P and copies its full value out of the output.
void all_gather_copy_out(AllGather& ag, const FsdpParams& params, const FlatLayout& layout);

// A reduce-scatter (or, with aliased parameters, a replicate all-reduce) in flight.
struct ReduceScatter {
  WorkPtr work;
  at::Tensor input;         // (W * reduce_scatter_numel), rank-major; empty when aliased
  at::Tensor output;        // (reduce_scatter_numel)
  bool replicated = false;  // work already averaged over the replicate group
};
// Copy-in (the unsharded gradients, rank-major, cast to `dtype`), frees them, and issues the
// asynchronous reduce-scatter (AVG) over `shard_group`. Nothing to do (no gradient this step,
// or an aliased unit without a replicate group): nullopt.
std::optional<ReduceScatter> reduce_scatter(const FsdpParams& params, const FlatLayout& layout,
                                            ProcessGroup& shard_group,
                                            const ProcessGroupPtr& replicate_group,
                                            at::ScalarType dtype);
// Waits for `rs`, averages over the replicate group, and accumulates into every S.grad.
void reduce_scatter_copy_out(ReduceScatter& rs, const FsdpParams& params,
                             const FlatLayout& layout, const ProcessGroupPtr& replicate_group);

// --- one parameter (rows as in Note [Sharded and unsharded parameters]).

// `rank_major`: (W, shard_numel) slice of an all-gather output -> P's full value.
void copy_out(const FsdpParam& param, const at::Tensor& rank_major);
// P.grad -> `rank_major`: (W, shard_numel) slice of a reduce-scatter input; every element is
// written (padding rows past dim0 as zeros).
void copy_grad_in(const FsdpParam& param, const at::Tensor& rank_major);
// A new tensor with the full value of `param`, all-gathered from its shards over `group` (its
// shard group; every rank of it calls this, in the same order).
at::Tensor gather_full(const FsdpParam& param, ProcessGroup& group);

}  // namespace fsdp::detail
