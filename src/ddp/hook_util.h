// What the built-in comm hooks share (src/ddp/*_hook*.cpp). Not a public header.
#pragma once

#include "fsdp/comm_hooks.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

// The hook state's process group, or an error naming the hook.
ProcessGroup& hook_group(const CommHookState& state, const char* hook);

// PyTorch's default_hooks._allreduce_fut: tensor /= group size, all-reduce (sum) in place;
// the future's value is `tensor`.
CommFuture allreduce_average(ProcessGroup& group, at::Tensor tensor);

// The state as the type a hook needs, or an error that names both.
template <typename T>
T& state_as(CommHookState& state, const char* hook, const char* needed) {
  auto* s = dynamic_cast<T*>(&state);
  TORCH_CHECK(s != nullptr, "[", hook, "] needs a ", needed, " as the DDP comm_state, got a '",
              state.kind(), "' state; set DDPOptions::comm_state = std::make_shared<fsdp::",
              needed, ">(...)");
  return *s;
}

}  // namespace fsdp::detail
