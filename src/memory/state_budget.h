// The parts of fsdp::model_state_budget (fsdp/memory.h) that tests check on a machine without a
// GPU. See Note [Model-state budget] in state_budget.cpp.
#pragma once

#include "fsdp/memory.h"

namespace fsdp::detail {

// Local ranks r in [0, local_world_size) on device `index` when rank r uses r % `devices`.
int ranks_sharing_device(int local_world_size, int devices, int index);

// The budget of a rank on CUDA device `device` whose total memory is `total_bytes`, shared by
// `ranks_sharing` ranks: what model_state_budget returns for a CUDA device.
ModelStateBudget device_state_budget(c10::Device device, int64_t total_bytes, int ranks_sharing);

}  // namespace fsdp::detail
