// allreduce_hook, fp16/bf16_compress_hook and the compression wrappers: PyTorch's
// torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py in C++ (same order of
// operations: divide by the group size before the reduction, decompress in place).
#include "fsdp/comm_hooks.h"

#include "ddp/hook_util.h"
#include "fsdp/launcher.h"

#include <c10/util/Exception.h>

namespace fsdp {

void CommHookState::setup(const ProcessGroupPtr& world, const LaunchInfo& /*launch*/) {
  if (!process_group) process_group = world;
}

namespace detail {

ProcessGroup& hook_group(const CommHookState& state, const char* hook) {
  TORCH_CHECK(state.process_group, "[", hook, "] the hook state has no process group; DDP sets "
              "it at setup (for a hook called by hand, construct the state with a group)");
  return *state.process_group;
}

CommFuture allreduce_average(ProcessGroup& group, at::Tensor tensor) {
  // Divide first (PyTorch: avoids overflow in fp16), then sum.
  tensor.div_(group.size());
  WorkPtr work = group.all_reduce_async(tensor, ReduceOp::kSum);
  return CommFuture::of_work(std::move(work), tensor);
}

}  // namespace detail

CommFuture allreduce_hook(CommHookState& state, GradBucket& bucket) {
  return detail::allreduce_average(detail::hook_group(state, "allreduce_hook"), bucket.buffer());
}

namespace {

CommFuture compress_hook(at::ScalarType dtype, const char* name, CommHookState& state,
                         GradBucket& bucket) {
  ProcessGroup& group = detail::hook_group(state, name);
  at::Tensor buffer = bucket.buffer();
  // .to() returns the buffer itself when it already has this dtype (then it is divided in
  // place, as in PyTorch).
  at::Tensor compressed = buffer.to(dtype).div_(group.size());
  WorkPtr work = group.all_reduce_async(compressed, ReduceOp::kSum);
  return CommFuture::of_work(std::move(work), compressed).then([buffer](at::Tensor reduced) {
    buffer.copy_(reduced);  // decompress in place
    return buffer;
  });
}

CommHook compress_wrapper(at::ScalarType dtype, const char* name, CommHook hook) {
  TORCH_CHECK(hook, "[", name, "] needs a hook to wrap");
  return [dtype, hook = std::move(hook)](CommHookState& state, GradBucket& bucket) {
    bucket.set_buffer(bucket.buffer().to(dtype));
    at::Tensor compressed = bucket.buffer();
    CommFuture inner = hook(state, bucket);
    // The reducer casts the half-precision result back into the bucket's own buffer.
    return inner.then([compressed](at::Tensor result) {
      if (!result.is_same(compressed)) compressed.copy_(result);
      return compressed;
    });
  };
}

}  // namespace

CommFuture fp16_compress_hook(CommHookState& state, GradBucket& bucket) {
  return compress_hook(at::kHalf, "fp16_compress_hook", state, bucket);
}

CommFuture bf16_compress_hook(CommHookState& state, GradBucket& bucket) {
  return compress_hook(at::kBFloat16, "bf16_compress_hook", state, bucket);
}

CommHook fp16_compress_wrapper(CommHook hook) {
  return compress_wrapper(at::kHalf, "fp16_compress_wrapper", std::move(hook));
}

CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(at::kBFloat16, "bf16_compress_wrapper", std::move(hook));
}

}  // namespace fsdp
