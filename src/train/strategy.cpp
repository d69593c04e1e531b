#include "fsdp/strategy.h"

namespace fsdp {

at::Tensor Strategy::reduce(const at::Tensor& value, ReduceOp op) {
  if (!world_ || world_->size() == 1) return value;
  at::Tensor out = value.detach().clone().contiguous();
  world_->all_reduce(out, op);
  return out;
}

void Strategy::barrier() {
  if (world_) world_->barrier();
}

}  // namespace fsdp
