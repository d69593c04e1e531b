// A process group held in an autograd context's saved_data, for the custom Functions whose
// backward runs collectives (the vocabulary-parallel ops, partitioned activation checkpoints).
#pragma once

#include "fsdp/comm.h"

#include <ATen/core/ivalue.h>

#include <memory>
#include <utility>

namespace fsdp::detail {

struct GroupRef : torch::CustomClassHolder {
  ProcessGroupPtr group;
};

inline c10::IValue group_capsule(ProcessGroupPtr group) {
  auto ref = c10::make_intrusive<GroupRef>();
  ref->group = std::move(group);
  return c10::IValue::make_capsule(std::move(ref));
}

// The group of a capsule made by group_capsule.
inline const ProcessGroupPtr& group_in_capsule(const c10::IValue& capsule) {
  return static_cast<GroupRef*>(capsule.toCapsule().get())->group;
}

}  // namespace fsdp::detail
