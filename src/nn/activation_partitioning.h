// Activation partitioning: the slice of a checkpointed block's saved input that this rank keeps,
// and the all-gather that restores the input for the recompute. Used by the checkpoint function
// (activation_checkpointing.cpp); configured through fsdp/activation_checkpointing.h.
#pragma once

#include "fsdp/activation_checkpointing.h"
#include "fsdp/comm.h"

#include <ATen/ATen.h>

namespace fsdp::detail {

// Whether `t` is partitioned over a group of `world` ranks (floating, at least `world` elements,
// world > 1), as DeepSpeed's checkpointing decides.
bool partitions(const at::Tensor& t, int world);
// This rank's slice of `t` flattened: ceil(numel / W) elements (zero padded at the end), own
// storage, in host memory when `to_cpu`.
at::Tensor partition_activation(const at::Tensor& t, const ProcessGroup& group, bool to_cpu);
// The whole input from every rank's slice: `sizes`, on `device`, a fresh tensor.
at::Tensor gather_activation(const at::Tensor& part, at::IntArrayRef sizes, c10::Device device,
                             ProcessGroup& group);

}  // namespace fsdp::detail
