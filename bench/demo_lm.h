// A LightningModule over one demo model (fsdp::demos::make_model) trained with AdamW: what the
// benchmarks that run a Trainer inside fsdp-bench (checkpoint, overlap-run) train.
#pragma once

#include <fsdp/fsdp.h>

#include <memory>
#include <string>

namespace fsdp::bench {

struct DemoLM : fsdp::LightningModule {
  std::string name;
  int64_t vocab;
  double dropout;
  double lr;
  std::shared_ptr<fsdp::nn::Module> model;
  std::shared_ptr<torch::optim::Optimizer> opt;  // the one configure_optimizers returned last

  DemoLM(std::string model_name, int64_t vocab_size, double dropout_p = 0.0, double lr_ = 1e-4)
      : name(std::move(model_name)), vocab(vocab_size), dropout(dropout_p), lr(lr_) {}
  void configure_model() override {
    if (!model) model = register_module("model", fsdp::demos::make_model(name, vocab, dropout));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    return at::nll_loss((*model)(b.input, b.target), b.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    opt = std::make_shared<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(lr));
    return {opt, nullptr};
  }
};

}  // namespace fsdp::bench
