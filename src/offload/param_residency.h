// detail::ParamResidency: where a sharded parameter's values live between uses. The FSDP engine
// (before a unit's all-gather copy-in) and the disk tier's optimizer (before a parameter is
// stepped) call acquire; the values are then in the tensor's storage until the matching
// release. A parameter the residency does not manage is always in RAM. The one implementation
// is the parameter swapper (offload/param_swapper.h): parameters on disk, ZeRO-Infinity's
// offload_param to NVMe. See Note [Parameters on disk] in docs/design.md.
#pragma once

#include "fsdp/strategy.h"

#include <ATen/core/Tensor.h>

namespace fsdp::detail {

// It is the checkpointer's ShardPager (fsdp/strategy.h): paging in is an acquire outside the
// step, paging out a release.
class ParamResidency : public ShardPager {
 public:
  // True when `param`'s values may be away from RAM (acquire before reading or writing them).
  virtual bool manages(const at::Tensor& param) const = 0;
  // Blocks until `param`'s values are in its storage; calls nest (counted).
  virtual void acquire(const at::Tensor& param) = 0;
  // The caller is done with `param`; `modified`: its values changed (they are written back).
  virtual void release(const at::Tensor& param, bool modified) = 0;
  // acquire for a use outside the training step (a checkpoint's save or load): the access is
  // not part of the order that prefetching follows, and starts no read-ahead.
  virtual void acquire_outside_step(const at::Tensor& param) { acquire(param); }

  bool pages(const at::Tensor& local) const override { return manages(local); }
  void page_in(const at::Tensor& local) override { acquire_outside_step(local); }
  void page_out(const at::Tensor& local, bool modified) override { release(local, modified); }
};

}  // namespace fsdp::detail
