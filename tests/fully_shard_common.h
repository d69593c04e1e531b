// Shared by tests/test_fully_shard_*.cpp: a tiny LightningModule over the demo models and a
// training loop that drives a Strategy exactly as the Trainer does (fsdp/strategy.h), plus the
// single-process reference on the same global batch.
#pragma once

#include "fsdp/fsdp_strategy.h"
#include "fsdp/lightning.h"
#include "fsdp/models.h"
#include "fsdp/precision.h"
#include "fsdp/trainer.h"

#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::testing {

constexpr int64_t kVocab = 64;
constexpr int64_t kSeq = 8;

struct TinyLM : fsdp::LightningModule {
  std::string model_name = "transformer-tiny";
  std::string optimizer = "adam";  // "adam" | "adamw" | "sgd"
  double lr = 1e-3;
  // Adam's eps: the key bias of attention has a gradient that is exactly zero in theory
  // (softmax is shift invariant) and ~1e-9 rounding noise in practice; with eps=1e-8 Adam
  // turns that noise into full-size steps, so two correct runs that round differently drift
  // apart by ~lr per step. eps=1e-3 keeps real gradients (>= 1e-3) Adam-like and noise inert.
  double eps = 1e-3;
  bool freeze_embedding = false;
  // true: the model's loss() (its Vocabulary head computes the loss in chunks, see
  // fsdp/linear_cross_entropy.h); false: nll_loss of its log-probabilities (whole logits).
  bool vocab_loss = false;
  // Called inside configure_model after the model exists (e.g. fsdp::wrap calls).
  std::function<void(TinyLM&)> after_build;
  std::shared_ptr<fsdp::nn::Module> model;

  void configure_model() override {
    if (model) return;
    torch::manual_seed(1234);
    model = register_module("model", fsdp::demos::make_model(model_name, kVocab, 0.0));
    if (freeze_embedding) {
      for (auto& p : model->named_parameters()) {
        if (p.key().find("embedding") != std::string::npos || p.key().find("wte") != std::string::npos) {
          p.value().set_requires_grad(false);
        }
      }
    }
    if (after_build) after_build(*this);
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    if (vocab_loss) return fsdp::demos::language_model_loss(*model, batch.input, batch.target);
    at::Tensor out = (*model)(batch.input, batch.target);
    return at::nll_loss(out, batch.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    // Parameter groups: no weight decay on 1-d parameters (norms, biases), as users do.
    std::vector<at::Tensor> decay, no_decay;
    for (auto& p : named_parameters()) {
      if (!p.value().requires_grad()) continue;
      (p.value().dim() >= 2 && p.key().find("norm") == std::string::npos ? decay : no_decay)
          .push_back(p.value());
    }
    if (optimizer == "sgd") {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(decay, std::make_unique<torch::optim::SGDOptions>(
                                     torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(0.01)));
      groups.emplace_back(no_decay, std::make_unique<torch::optim::SGDOptions>(
                                        torch::optim::SGDOptions(lr).momentum(0.9)));
      return {std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(lr))};
    }
    if (optimizer == "adamw") {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                     torch::optim::AdamWOptions(lr).weight_decay(0.1).eps(eps)));
      groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                        torch::optim::AdamWOptions(lr).weight_decay(0.0).eps(eps)));
      return {std::make_shared<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(lr))};
    }
    std::vector<at::Tensor> all = decay;
    all.insert(all.end(), no_decay.begin(), no_decay.end());
    return {std::make_shared<torch::optim::Adam>(all, torch::optim::AdamOptions(lr).eps(eps))};
  }
};

struct LoopConfig {
  int steps = 10;
  int64_t global_batch = 12;  // rows per optimizer step over all ranks
  int accumulate = 1;         // micro-batches per optimizer step
  double clip = 0;            // > 0: clip to this global norm
  bool bf16_autocast = false; // "bf16-mixed" as the Trainer runs it for strategies that leave
                              // precision to it: training_step under CPU autocast
  // Called once the strategy has set up the module and the optimizer, before the first step
  // (e.g. to save the initial weights a peer starts from).
  std::function<void(fsdp::Strategy&, fsdp::LightningModule&)> after_setup;
};

// Connects `strategy` to the world group as the Trainer would (every rank on this host) and
// returns it.
template <typename S>
std::shared_ptr<S> connect_to_world(std::shared_ptr<S> strategy) {
  auto world = fsdp::world_group();
  fsdp::LaunchInfo launch;
  launch.rank = world->rank();
  launch.world_size = world->size();
  launch.local_world_size = world->size();
  strategy->connect(world, launch);
  return strategy;
}

// The global batch of step s (same on every rank and in the reference).
inline fsdp::Batch global_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  fsdp::Batch b;
  b.input = at::randint(kVocab, {rows, kSeq}, gen, at::kLong);
  b.target = at::randint(kVocab, {rows, kSeq}, gen, at::kLong);
  return b;
}

inline fsdp::Batch slice(const fsdp::Batch& b, int64_t begin, int64_t count) {
  return {b.input.narrow(0, begin, count).contiguous(), b.target.narrow(0, begin, count).contiguous()};
}

// Trains `module` with `strategy` (already connected) on this rank's share of each global
// batch; returns the per-step global mean loss.
inline std::vector<double> train_with(fsdp::Strategy& strategy, fsdp::LightningModule& module,
                                      const LoopConfig& cfg) {
  fsdp::configure_model_with(strategy, module);
  strategy.setup_module(module);
  auto opt = module.configure_optimizers().optimizer;
  strategy.setup_optimizer(*opt);
  if (cfg.after_setup) cfg.after_setup(strategy, module);
  const int world = strategy.world_size();
  const int rank = strategy.rank();
  const int64_t micro_rows = cfg.global_batch / cfg.accumulate;
  const int64_t local_rows = micro_rows / world;
  EXPECT_EQ(local_rows * world * cfg.accumulate, cfg.global_batch);
  std::vector<double> losses;
  for (int step = 0; step < cfg.steps; ++step) {
    fsdp::Batch g = global_batch(step, cfg.global_batch);
    double step_loss = 0;
    for (int j = 0; j < cfg.accumulate; ++j) {
      const bool sync = j == cfg.accumulate - 1;
      fsdp::Batch mb = slice(g, j * micro_rows + rank * local_rows, local_rows);
      strategy.pre_forward(module, sync);
      at::Tensor loss;
      {
        fsdp::CpuAutocastGuard autocast(cfg.bf16_autocast ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
        loss = module.training_step(mb, step);
      }
      strategy.backward(loss / cfg.accumulate);
      strategy.post_backward(module, sync);
      step_loss += strategy.reduce(loss.detach(), fsdp::ReduceOp::kAvg).item<double>();
    }
    if (cfg.clip > 0) strategy.clip_grad_norm(module, cfg.clip);
    strategy.optimizer_step(*opt);
    strategy.zero_grad(*opt);
    losses.push_back(step_loss / cfg.accumulate);
  }
  return losses;
}

// The single-process reference: plain libtorch on the whole global batch.
inline std::vector<double> train_reference(fsdp::LightningModule& module, const LoopConfig& cfg) {
  module.configure_model();
  auto opt = module.configure_optimizers().optimizer;
  const int64_t micro_rows = cfg.global_batch / cfg.accumulate;
  std::vector<double> losses;
  for (int step = 0; step < cfg.steps; ++step) {
    fsdp::Batch g = global_batch(step, cfg.global_batch);
    double step_loss = 0;
    for (int j = 0; j < cfg.accumulate; ++j) {
      at::Tensor loss;
      {
        fsdp::CpuAutocastGuard autocast(cfg.bf16_autocast ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
        loss = module.training_step(slice(g, j * micro_rows, micro_rows), step);
      }
      (loss / cfg.accumulate).backward();
      step_loss += loss.item<double>();
    }
    if (cfg.clip > 0) {
      std::vector<at::Tensor> ps;
      for (auto& p : module.parameters()) {
        if (p.grad().defined()) ps.push_back(p);
      }
      torch::nn::utils::clip_grad_norm_(ps, cfg.clip);
    }
    opt->step();
    for (auto& p : module.parameters()) p.mutable_grad() = at::Tensor();
    losses.push_back(step_loss / cfg.accumulate);
  }
  return losses;
}

inline void expect_losses_close(const std::vector<double>& got, const std::vector<double>& want,
                                double rtol = 1e-5) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rtol * std::abs(want[i])) << "step " << i;
  }
}

inline void expect_params_close(const std::vector<std::pair<std::string, at::Tensor>>& got,
                                torch::nn::Module& reference, double tol = 1e-5) {
  std::map<std::string, at::Tensor> want;
  for (auto& p : reference.named_parameters()) want[p.key()] = p.value().detach();
  ASSERT_EQ(got.size(), want.size());
  for (auto& [name, tensor] : got) {
    ASSERT_TRUE(want.count(name)) << name;
    ASSERT_EQ(tensor.sizes(), want[name].sizes()) << name;
    const double diff = (tensor - want[name]).abs().max().item<double>();
    EXPECT_LE(diff, tol) << name;
  }
}

}  // namespace fsdp::testing
