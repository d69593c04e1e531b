#include "shard/fsdp_param.h"

#include <ATen/native/Resize.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "fsdp/memory.h"
#include "fsdp/unit.h"

namespace fsdp::detail {
namespace {

// Derived-class access to torch::nn::Module's protected parameters_.
struct ModuleAccess : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& params(torch::nn::Module& m) {
    return m.*(&ModuleAccess::parameters_);
  }
};

// Resizes the storage of an unsharded parameter to `nbytes`: 0 (reshard) or its full size
// (unshard). CPU: at::native::resize_bytes_cpu. Another device (CUDA): a block of `nbytes`
// from the storage's own allocator (the caching allocator, on the current stream) replaces the
// old one, which is freed. The values are not kept: reshard drops them and unshard writes
// every byte right after (the all-gather's copy-out).
void resize_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->device().is_cpu()) {
    at::native::resize_bytes_cpu(storage, nbytes);
    return;
  }
  if (storage->nbytes() == nbytes) return;
  c10::DeviceGuard guard(storage->device());
  storage->set_data_ptr_noswap(nbytes == 0 ? at::DataPtr(nullptr, storage->device())
                                           : storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor>& registered_parameters(torch::nn::Module& module) {
  return ModuleAccess::params(module);
}

std::vector<torch::nn::Module*> parameter_owners(torch::nn::Module& module) {
  std::vector<torch::nn::Module*> owners{&module};
  if (auto* holder = dynamic_cast<fsdp::nn::UnitBase*>(&module)) {
    owners.push_back(holder->wrapped().get());
  }
  return owners;
}

FsdpParam::FsdpParam(at::Tensor unsharded, Registration first, int shard_rank, int shard_world,
                     std::optional<at::ScalarType> compute_dtype,
                     std::optional<c10::Device> device)
    : unsharded_(std::move(unsharded)),
      requires_grad_(unsharded_.requires_grad()),
      shard_rank_(shard_rank),
      shard_world_(shard_world),
      sharded_dtype_(unsharded_.scalar_type()),
      compute_dtype_(unsharded_.scalar_type()),
      device_(device.value_or(unsharded_.device())) {
  if (compute_dtype && unsharded_.is_floating_point()) compute_dtype_ = *compute_dtype;
  registrations_.push_back(std::move(first));
  if (compute_dtype_ != sharded_dtype_ && device_.is_cpu()) {
    check_cpu_matmul_supported(compute_dtype_, "[FSDPStrategy] MixedPrecisionPolicy.param_dtype=" +
                                                   std::string(c10::toString(compute_dtype_)) +
                                                   " for CPU parameter '" + fqn() + "'");
  }
  TORCH_CHECK(unsharded_.is_contiguous() && unsharded_.storage_offset() == 0 &&
                  unsharded_.storage().nbytes() == unsharded_.nbytes(),
              "[FSDPStrategy] parameter '", fqn(), "' (shape ", unsharded_.sizes(),
              ") is a view into a larger storage or not contiguous; FSDP shards parameters that "
              "own their storage. HINT: register a contiguous tensor (e.g. .clone()).");
  TORCH_CHECK(unsharded_.is_leaf(), "[FSDPStrategy] parameter '", fqn(),
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
  at::NoGradGuard no_grad;
  if (aliased()) {
    // The same tensor as S and P: moved whole when it is not on its device yet.
    if (unsharded_.device() != device_) unsharded_.set_data(unsharded_.detach().to(device_));
    sharded_ = unsharded_;
    return;
  }
  at::Tensor rows = unsharded_.detach().reshape({dim0_, row_numel_});
  const RowRange mine = rows_of(shard_rank_);
  std::vector<int64_t> shape;
  if (unsharded_.dim() <= 1) {
    shape = {shard_rows_};
  } else {
    shape = unsharded_.sizes().vec();
    shape[0] = shard_rows_;
  }
  // Quantized storage (uint8: NF4 packed weights and their state) is its own memory category.
  std::optional<MemoryCategoryGuard> category;
  if (unsharded_.scalar_type() == at::kByte) category.emplace(MemoryCategory::kQuantized);
  // On device_: a unit built on the host during deferred init sends only its rows there.
  at::Tensor s = at::zeros(shape, unsharded_.options().device(device_).requires_grad(false));
  if (mine.size() > 0) {
    s.view({shard_rows_, row_numel_})
        .narrow(0, 0, mine.size())
        .copy_(rows.narrow(0, mine.begin, mine.size()));
  }
  s.set_requires_grad(requires_grad_);
  sharded_ = s;
  if (casts() || unsharded_.device() != device_) {
    // See Note [Mixed-precision parameters]: same TensorImpl, compute dtype and device, its
    // storage freed below (the host's full values with it).
    unsharded_.set_data(at::empty(unsharded_.sizes(),
                                  unsharded_.options().dtype(compute_dtype_).device(device_)));
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
  resize_storage_bytes(unsharded_, 0);
}

void FsdpParam::alloc_unsharded() {
  if (aliased()) return;
  resize_storage_bytes(unsharded_, static_cast<size_t>(full_nbytes()));
}

bool FsdpParam::unsharded_allocated() const {
  return static_cast<int64_t>(unsharded_.storage().nbytes()) == full_nbytes();
}

}  // namespace fsdp::detail
