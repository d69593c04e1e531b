// FsdpParam: one parameter's sharded and unsharded representation.
#pragma once

#include "fsdp/strategy.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

// Note [Sharded and unsharded parameters]
// ----------------------------------------
// A parameter exists as two tensors:
//
//   unsharded parameter P  The tensor the layer was built with (Linear::weight, ...): same
//                          TensorImpl the layer's member refers to, full shape, a leaf with the
//                          original requires_grad. Forward and backward compute with P.
//                          Its storage holds memory only while its unit is unsharded: reshard
//                          resizes the storage to 0 bytes, unshard resizes it back
//                          (what Python's storage().resize_() does: resize_bytes_cpu on the
//                          CPU, a block of the storage's allocator on CUDA) and writes the all-gathered values through P.variable_data(),
//                          so P's version counter does not move and the tensors autograd saved
//                          in forward (views like weight.t(), which share P's StorageImpl) see
//                          the refilled values in backward. A plain copy_ into P would bump the
//                          version and fail backward with "modified by an inplace operation".
//                          Backward accumulates the unsharded gradient into P.grad; the unit's
//                          post-backward reduce-scatters and frees it.
//
//   sharded parameter S    This rank's dim-0 chunk: rows [r*R, (r+1)*R) of P viewed as
//                          (dim0, rest...) where R = ceil(dim0 / W) and W = shard-group size;
//                          rows past dim0 (last ranks) are zero padding. A 0-d or 1-d P is
//                          viewed as (numel,). S is a separate leaf tensor with its own storage
//                          and P's requires_grad; S.grad receives the reduce-scattered (averaged)
//                          gradient. Padding rows get zero gradients, so Adam/AdamW/SGD (with
//                          weight decay) keep them at 0 and norms over S are exact.
//
// Ownership: S replaces P in the owning module's registered parameters (the protected
// `parameters_` dict of torch::nn::Module), so module.parameters()/named_parameters() return
// sharded parameters and the optimizer built in configure_optimizers owns S (Lightning
// semantics), while the layer's member still refers to P. FsdpParam holds both.
//
// With a shard group of one rank (world 1, NO_SHARD) the shard is the whole parameter: S and P
// are the same tensor, nothing is swapped and unshard/reshard move no memory -- unless a
// param_dtype asks P to compute in another dtype (see Note [Mixed-precision parameters]).
//
// Note [Mixed-precision parameters]
// ---------------------------------
// With MixedPrecisionPolicy::param_dtype (say bf16) on an fp32 floating parameter:
//   S stays fp32: it is the master copy the optimizer steps (optimizer state stays fp32) and
//     S.grad is fp32.
//   P becomes bf16 at shard(): P.set_data(bf16 tensor of the full shape) keeps P's TensorImpl
//     (the layer's member) but changes its dtype (set_data also drops a stale AccumulateGrad
//     node). Its storage is freed and refilled as above, with full_nbytes() = bf16 bytes.
//   Copy-in casts S to bf16 into the all-gather input, so the all-gather moves half the bytes;
//     copy-out writes bf16 into P. Backward accumulates a bf16 P.grad; the unit casts it to
//     reduce_dtype in the reduce-scatter input, and the reduced slice is cast back to S's
//     dtype and accumulated into S.grad.
//   Such a parameter is never aliased, even with a shard group of one rank: S (fp32, the whole
//     parameter) and P (bf16) are separate tensors and "all-gather" is a local cast copy.
class FsdpParam {
 public:
  // One place where the parameter is registered: module->parameters_[name]. A tensor may be
  // registered several times (tied weights inside one unit).
  struct Registration {
    torch::nn::Module* module;
    std::string name;
    std::string fqn;
  };

  // compute_dtype: P's dtype after shard() (see Note [Mixed-precision parameters]); nullopt or
  // P's own dtype = no cast. Only floating parameters are cast. device: where S and P live
  // after shard(); nullopt = where P is now (see Note [Deferred init onto the device] in
  // deferred_init.cpp).
  FsdpParam(at::Tensor unsharded, Registration first, int shard_rank, int shard_world,
            std::optional<at::ScalarType> compute_dtype = std::nullopt,
            std::optional<c10::Device> device = std::nullopt);

  void add_registration(Registration reg) { registrations_.push_back(std::move(reg)); }
  const std::vector<Registration>& registrations() const { return registrations_; }
  const std::string& fqn() const { return registrations_.front().fqn; }
  // Deferred init: registrations made relative to their unit get the unit's FQN in front.
  void prefix_fqns(const std::string& prefix) {
    for (auto& reg : registrations_) reg.fqn = prefix + reg.fqn;
  }

  // Creates S from P's current values, frees P's storage and swaps S into every registration.
  void shard();

  const at::Tensor& unsharded() const { return unsharded_; }  // P
  const at::Tensor& sharded() const { return sharded_; }      // S
  bool requires_grad() const { return requires_grad_; }
  bool aliased() const { return shard_world_ == 1 && !casts(); }
  // P computes in another dtype than S. See Note [Mixed-precision parameters].
  bool casts() const { return compute_dtype_ != sharded_dtype_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }  // P's dtype (after shard)
  at::ScalarType sharded_dtype() const { return sharded_dtype_; }  // S's dtype

  at::IntArrayRef full_shape() const { return unsharded_.sizes(); }
  int64_t dim0() const { return dim0_; }                // rows of P viewed as (dim0, row)
  int64_t row_numel() const { return row_numel_; }
  int64_t shard_rows() const { return shard_rows_; }    // R = ceil(dim0 / W)
  int shard_world() const { return shard_world_; }      // W
  // The real rows shard rank `rank` holds (fsdp::shard_row_range).
  RowRange rows_of(int rank) const { return shard_row_range(dim0_, shard_rows_, rank); }
  int64_t shard_numel() const { return shard_rows_ * row_numel_; }
  int64_t padded_numel() const { return shard_numel() * shard_world_; }
  int64_t compute_element_size() const { return static_cast<int64_t>(c10::elementSize(compute_dtype_)); }
  int64_t full_nbytes() const {  // P's bytes when allocated (compute dtype)
    return unsharded_.numel() * static_cast<int64_t>(c10::elementSize(compute_dtype_));
  }
  int64_t shard_nbytes() const {  // S's bytes (master dtype)
    return shard_numel() * static_cast<int64_t>(c10::elementSize(sharded_dtype_));
  }

  // --- P's storage. See Note [Sharded and unsharded parameters].
  void free_unsharded();    // storage -> 0 bytes
  void alloc_unsharded();   // storage -> full bytes (values undefined until copy-out)
  bool unsharded_allocated() const;

 private:
  at::Tensor unsharded_;  // P, full shape
  at::Tensor sharded_;    // S, (R, rest...) or (R,) for 0-d/1-d P
  std::vector<Registration> registrations_;
  bool requires_grad_;
  int shard_rank_;
  int shard_world_;
  int64_t dim0_;
  int64_t row_numel_;
  int64_t shard_rows_;
  at::ScalarType sharded_dtype_;  // S (and P before shard())
  at::ScalarType compute_dtype_;  // P after shard()
  c10::Device device_;            // S and P after shard()
};

// Reaches the protected parameters_ dict of any torch::nn::Module.
torch::OrderedDict<std::string, at::Tensor>& registered_parameters(torch::nn::Module& module);

// The modules whose parameters_ dicts hold `module`'s own parameters under the same names:
// `module`, and for a unit holder the module it wraps (Note [Unit holders] in
// src/nn/unit.cpp). A walk that registers parameters registers every pair.
std::vector<torch::nn::Module*> parameter_owners(torch::nn::Module& module);

}  // namespace fsdp::detail
