// LightningModule for C++: the same shape as lightning.pytorch.LightningModule.
//
//   struct LanguageModel : fsdp::LightningModule {
//     void configure_model() override {              // create layers here (idempotent)
//       if (model) return;
//       model = register_module("model", fsdp::demos::make_transformer(opts));
//     }
//     at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
//       auto out = (*model)(batch.input, batch.target);
//       auto loss = torch::nll_loss(out, batch.target.view(-1));
//       log("train_loss", loss, {.prog_bar = true});
//       return loss;
//     }
//     fsdp::OptimizerConfig configure_optimizers() override {
//       return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.1))};
//     }
//   };
//
// Parameters are registered on the module tree as usual; strategies replace them in place
// (FSDP swaps in the sharded parameters before configure_optimizers, as Lightning does).
#pragma once

#include "fsdp/data.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class Trainer;

// fsdp::Batch (one collated batch: input and target token ids, (B, T) int64 each) is defined
// in fsdp/data.h.

struct LogOptions {
  bool prog_bar = false;
  std::optional<bool> on_step;   // default: true in training, false in validation/test
  std::optional<bool> on_epoch;  // default: false in training, true in validation/test
  bool sync_dist = false;        // reduce (mean) over ranks before logging
};

struct OptimizerConfig {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  // Optional; stepped every optimizer step.
  std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr;
};

class LightningModule : public torch::nn::Module {
 public:
  LightningModule() : torch::nn::Module("LightningModule") {}
  ~LightningModule() override = default;

  // Create layers here, not in the constructor, so strategies can shard them as they are
  // created. Must be safe to call twice (return early when already built).
  virtual void configure_model() {}

  virtual at::Tensor training_step(const Batch& batch, int64_t batch_idx) = 0;
  // Return an undefined tensor to log nothing.
  virtual at::Tensor validation_step(const Batch& batch, int64_t batch_idx) { return {}; }
  virtual at::Tensor test_step(const Batch& batch, int64_t batch_idx) { return {}; }
  virtual at::Tensor predict_step(const Batch& batch, int64_t batch_idx) { return {}; }
  virtual OptimizerConfig configure_optimizers() = 0;

  // Hooks (rank-local; called on every rank).
  virtual void on_fit_start() {}
  virtual void on_train_start() {}
  virtual void on_train_epoch_start() {}
  virtual void on_train_epoch_end() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_train_end() {}
  virtual void on_before_optimizer_step(torch::optim::Optimizer& optimizer) {}

  // Records a metric for the progress bar and the loggers.
  void log(const std::string& name, const at::Tensor& value, LogOptions options = {});
  void log(const std::string& name, double value, LogOptions options = {});
  // Prints on global rank 0 only.
  void print(const std::string& text) const;

  Trainer* trainer() const { return trainer_; }

  // --- used by the Trainer.
  struct LoggedValue {
    at::Tensor value;  // detached scalar
    LogOptions options;
  };
  void attach_trainer(Trainer* trainer) { trainer_ = trainer; }
  std::map<std::string, LoggedValue>& logged() { return logged_; }

 private:
  Trainer* trainer_ = nullptr;
  std::map<std::string, LoggedValue> logged_;
};

}  // namespace fsdp
