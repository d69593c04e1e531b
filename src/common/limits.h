// Bounds on numbers users give (flags, DeepSpeed JSON, environment variables), shared by every
// reader so that one value is accepted or refused the same way wherever it is written.
#pragma once

#include <cstdint>

namespace fsdp::detail {

// The largest whole number a double holds exactly (2^53). Element counts that the DeepSpeed
// config and options keep as doubles (buffer_size, max_in_cpu, sub_group_size, bucket sizes)
// are at most this, so the conversion to int64_t is exact and never wraps.
constexpr int64_t kMaxExactInteger = int64_t{1} << 53;

// The largest learning rate accepted. Adam moves a weight by about lr per step; beyond this,
// training only produces inf and nan (a learning rate of 1e308 ends in a nan loss).
constexpr double kMaxLearningRate = 1e3;

}  // namespace fsdp::detail
