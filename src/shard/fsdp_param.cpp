#include "shard/fsdp_param.h"

#include <ATen/native/Resize.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::detail {
namespace {

// Derived-class access to torch::nn::Module's protected parameters_.
struct ModuleAccess : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& params(torch::nn::Module& m) {
    return m.*(&ModuleAccess::parameters_);
  }
};

}  // namespace

torch::OrderedDict<std::string, at::Tensor>& registered_parameters(torch::nn::Module& module) {
  return ModuleAccess::params(module);
}

void check_mixed_precision_policy(const MixedPrecisionPolicy& policy) {
  auto check = [](const char* field, const std::optional<at::ScalarType>& t) {
    TORCH_CHECK(!t || at::isFloatingType(*t), "[FSDPStrategy] MixedPrecisionPolicy.", field,
                " must be a floating dtype (e.g. at::kBFloat16, at::kFloat), got ", *t);
  };
  check("param_dtype", policy.param_dtype);
  check("reduce_dtype", policy.reduce_dtype);
  check("buffer_dtype", policy.buffer_dtype);
}

void cast_buffers(torch::nn::Module& module, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (auto& b : module.buffers(/*recurse=*/true)) {
    if (b.defined() && b.is_floating_point() && b.scalar_type() != dtype) {
      b.set_data(b.to(dtype));
    }
  }
}

FsdpParam::FsdpParam(at::Tensor unsharded, Registration first, int shard_rank, int shard_world,
                     std::optional<at::ScalarType> compute_dtype)
    : unsharded_(std::move(unsharded)),
      requires_grad_(unsharded_.requires_grad()),
      shard_rank_(shard_rank),
      shard_world_(shard_world),
      sharded_dtype_(unsharded_.scalar_type()),
      compute_dtype_(unsharded_.scalar_type()) {
  if (compute_dtype && unsharded_.is_floating_point()) compute_dtype_ = *compute_dtype;
  registrations_.push_back(std::move(first));
  if (compute_dtype_ != sharded_dtype_ && unsharded_.device().is_cpu()) {
    check_cpu_matmul_supported(compute_dtype_, "[fully_shard] MixedPrecisionPolicy.param_dtype=" +
                                                   std::string(c10::toString(compute_dtype_)) +
                                                   " for CPU parameter '" + fqn() + "'");
  }
  TORCH_CHECK(unsharded_.is_contiguous() && unsharded_.storage_offset() == 0 &&
                  static_cast<int64_t>(unsharded_.storage().nbytes()) == unsharded_.nbytes(),
              "[fully_shard] parameter '", fqn(), "' (shape ", unsharded_.sizes(),
              ") is a view into a larger storage or not contiguous; FSDP shards parameters that "
              "own their storage. HINT: register a contiguous tensor (e.g. .clone()).");
  TORCH_CHECK(unsharded_.is_leaf(), "[fully_shard] parameter '", fqn(),
              "' is not a leaf tensor; register parameters created with requires_grad, not "
              "results of operations");
  if (unsharded_.dim() <= 1) {
    dim0_ = unsharded_.numel();
    row_numel_ = 1;
  } else {
    dim0_ = unsharded_.size(0);
    row_numel_ = dim0_ == 0 ? 0 : unsharded_.numel() / dim0_;
  }
  shard_rows_ = (dim0_ + shard_world_ - 1) / shard_world_;
}

void FsdpParam::shard() {
  if (aliased()) {
    sharded_ = unsharded_;
    return;
  }
  at::NoGradGuard no_grad;
  at::Tensor rows = unsharded_.detach().reshape({dim0_, row_numel_});
  const int64_t begin = std::min<int64_t>(dim0_, shard_rank_ * shard_rows_);
  const int64_t count = std::min<int64_t>(shard_rows_, dim0_ - begin);
  std::vector<int64_t> shape;
  if (unsharded_.dim() <= 1) {
    shape = {shard_rows_};
  } else {
    shape = unsharded_.sizes().vec();
    shape[0] = shard_rows_;
  }
  at::Tensor s = at::zeros(shape, unsharded_.options().requires_grad(false));
  if (count > 0) s.view({shard_rows_, row_numel_}).narrow(0, 0, count).copy_(rows.narrow(0, begin, count));
  s.set_requires_grad(requires_grad_);
  sharded_ = s;
  if (casts()) {
    // See Note [Mixed-precision parameters]: same TensorImpl, compute dtype, storage freed below.
    unsharded_.set_data(at::empty(unsharded_.sizes(), unsharded_.options().dtype(compute_dtype_)));
  }
  free_unsharded();
  for (auto& reg : registrations_) {
    auto& dict = registered_parameters(*reg.module);
    TORCH_INTERNAL_ASSERT(dict.contains(reg.name), "registration '", reg.fqn, "' vanished");
    dict[reg.name] = sharded_;
  }
}

void FsdpParam::free_unsharded() {
  if (aliased()) return;
  at::native::resize_bytes_cpu(unsharded_.storage().unsafeGetStorageImpl(), 0);
}

void FsdpParam::alloc_unsharded() {
  if (aliased()) return;
  at::native::resize_bytes_cpu(unsharded_.storage().unsafeGetStorageImpl(), full_nbytes());
}

bool FsdpParam::unsharded_allocated() const {
  return static_cast<int64_t>(unsharded_.storage().nbytes()) == full_nbytes();
}

void FsdpParam::copy_in(const at::Tensor& dst) const {
  dst.copy_(sharded_.detach().reshape({-1}));  // casts to the all-gather dtype
}

void FsdpParam::copy_out(const at::Tensor& rank_major) const {
  // rank_major: (W, shard_numel) strided slice of the all-gather output. Row block w holds
  // rows [w*R, (w+1)*R) of P; only the first dim0 rows overall are real.
  TORCH_INTERNAL_ASSERT(unsharded_allocated(), "copy-out into freed parameter '", fqn(), "'");
  at::Tensor target = unsharded_.variable_data().view({dim0_, row_numel_});
  at::Tensor blocks = rank_major.view({shard_world_, shard_rows_, row_numel_});
  for (int w = 0; w < shard_world_; ++w) {
    const int64_t begin = w * shard_rows_;
    const int64_t count = std::min<int64_t>(shard_rows_, dim0_ - begin);
    if (count <= 0) break;
    target.narrow(0, begin, count).copy_(blocks.select(0, w).narrow(0, 0, count));
  }
}

void FsdpParam::copy_grad_in(const at::Tensor& rank_major) const {
  const at::Tensor& grad = unsharded_.grad();
  TORCH_INTERNAL_ASSERT(grad.defined(), "no unsharded gradient for '", fqn(), "'");
  at::Tensor source = grad.detach().reshape({dim0_, row_numel_});
  at::Tensor blocks = rank_major.view({shard_world_, shard_rows_, row_numel_});
  for (int w = 0; w < shard_world_; ++w) {
    const int64_t begin = w * shard_rows_;
    const int64_t count = std::min<int64_t>(shard_rows_, dim0_ - begin);
    if (count <= 0) break;
    blocks.select(0, w).narrow(0, 0, count).copy_(source.narrow(0, begin, count));
  }
}

}  // namespace fsdp::detail
