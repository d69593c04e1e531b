// Strategy: how the Trainer spreads one model over ranks (single, ddp, fsdp, ...).
//
// The Trainer drives every strategy through the same calls, in this order:
//
//   connect(world, launch)                    once, after the ranks exist
//   [enter_configure_model(); module.configure_model(); exit_configure_model()]
//   setup_module(module)                      broadcast (ddp) / shard (fsdp) the parameters
//   module.configure_optimizers()             sees module.parameters() as the strategy left them
//   setup_optimizer(optimizer)
//   per micro-batch:
//     pre_forward(module, sync)               sync=false on non-boundary micro-batches (no_sync)
//     loss = module.training_step(...)
//     backward(loss)                          loss.backward() plus whatever must follow it
//     post_backward(module, sync)             waits for gradient reductions
//   per optimizer step (boundary micro-batch):
//     clip_grad_norm(module, max)             global norm over all ranks' gradients, exact
//     optimizer_step(optimizer)
//     zero_grad(optimizer)
#pragma once

#include "fsdp/comm.h"
#include "fsdp/launcher.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

class LightningModule;

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual std::string name() const = 0;

  virtual void connect(ProcessGroupPtr world, const LaunchInfo& launch) {
    world_ = std::move(world);
    launch_ = launch;
  }

  // Active while configure_model runs (fsdp::wrap() asks the active strategy what to do).
  virtual void enter_configure_model() {}
  virtual void exit_configure_model() {}

  virtual void setup_module(LightningModule& module) = 0;
  virtual void setup_optimizer(torch::optim::Optimizer& optimizer) {}

  virtual void pre_forward(LightningModule& module, bool sync) {}
  virtual void backward(const at::Tensor& loss) { loss.backward(); }
  virtual void post_backward(LightningModule& module, bool sync) {}
  // Validation/test/predict steps run under torch::NoGradGuard between pre_forward(module,
  // false) and post_eval_step(module) (FSDP reshards there).
  virtual void post_eval_step(LightningModule& module) {}

  // Clips gradients so that their global L2 norm over every rank's shard is at most max_norm;
  // returns the norm before clipping.
  virtual double clip_grad_norm(LightningModule& module, double max_norm) = 0;
  virtual void optimizer_step(torch::optim::Optimizer& optimizer) { optimizer.step(); }
  virtual void zero_grad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }

  // State a strategy keeps across steps besides parameters and optimizer state (DDP: its
  // communication-hook state), per rank. save_checkpoint calls save_extra_state on every rank
  // with the directory it is writing (before it is published), load_checkpoint calls
  // load_extra_state with the checkpoint's directory.
  virtual void save_extra_state(const std::string& dir) {}
  virtual void load_extra_state(const std::string& dir) {}

  // Reduces a metric over the world (for log(..., sync_dist) and the global mean loss).
  virtual at::Tensor reduce(const at::Tensor& value, ReduceOp op);
  virtual void barrier();

  const ProcessGroupPtr& world() const { return world_; }
  int rank() const { return world_ ? world_->rank() : 0; }
  int world_size() const { return world_ ? world_->size() : 1; }
  const LaunchInfo& launch_info() const { return launch_; }

 protected:
  ProcessGroupPtr world_;
  LaunchInfo launch_;
};
using StrategyPtr = std::shared_ptr<Strategy>;

// The one parser of strategy names: "single", "ddp", "fsdp", ... An unknown name is an error
// that lists the valid ones. Implemented in src/train/strategy_registry.cpp.
StrategyPtr make_strategy(const std::string& name);
std::vector<std::string> strategy_names();

// The strategy whose configure_model context is active (nullptr outside configure_model).
Strategy* active_strategy();

}  // namespace fsdp
