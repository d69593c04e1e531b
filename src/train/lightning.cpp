// LightningModule::log / print. The Trainer reads and clears `logged()` after every step.
#include "fsdp/lightning.h"

#include "fsdp/launcher.h"
#include "fsdp/trainer.h"

#include <c10/util/Exception.h>

#include <iostream>

namespace fsdp {

void LightningModule::log(const std::string& name, const at::Tensor& value, LogOptions options) {
  TORCH_CHECK(!name.empty(), "[LightningModule::log] metric name is empty");
  TORCH_CHECK(value.defined(), "[LightningModule::log] metric '", name,
              "' is an undefined tensor; log a scalar tensor or a number");
  TORCH_CHECK(value.numel() == 1, "[LightningModule::log] metric '", name,
              "' must be a scalar, got a tensor of shape ", value.sizes(),
              "; reduce it first (e.g. .mean())");
  // Detached and in fp64 so logging never keeps the autograd graph alive.
  logged_[name] = LoggedValue{value.detach().reshape({}).to(at::kDouble), options};
}

void LightningModule::log(const std::string& name, double value, LogOptions options) {
  log(name, at::scalar_tensor(value, at::kDouble), options);
}

void LightningModule::print(const std::string& text) const {
  const bool rank0 = trainer_ ? trainer_->is_global_zero() : launch_info_from_env().rank == 0;
  if (rank0) std::cout << text << (text.empty() || text.back() != '\n' ? "\n" : "") << std::flush;
}

}  // namespace fsdp
