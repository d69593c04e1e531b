// Strategy: how the Trainer spreads one model over ranks (single, ddp, fsdp, ...).
//
// The Trainer drives every strategy through the same calls, in this order:
//
//   connect(world, launch)                    once, after the ranks exist
//   [enter_configure_model(); module.configure_model(); exit_configure_model()]
//   setup_module(module)                      broadcast (ddp) / shard (fsdp) the parameters
//   module.configure_optimizers()             sees module.parameters() as the strategy left them
//   configure_optimizers(module, config)      a strategy's configured optimizer replaces it
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
//
// Besides, the Trainer and the checkpointer ask every strategy the same questions through this
// interface and never look at a concrete strategy: connect_precision (who carries out the
// precision), parameter_counts (full-shape counts) and local_shards (how this rank holds the
// parameters, for checkpoints).
#pragma once

#include "fsdp/comm.h"
#include "fsdp/launcher.h"
#include "fsdp/precision.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

namespace nn {
class Module;  // fsdp/nn.h
}  // namespace nn
class LightningModule;
struct OptimizerConfig;
struct TrainerOptions;

// --- Dim-0 sharding, as the checkpointer sees it.
//
// A tensor split over a shard group of W ranks is viewed as dim0 rows (0-d and 1-d tensors:
// numel rows of one element). Every rank holds shard_rows = ceil(dim0 / W) rows; rank r holds
// rows [r * shard_rows, (r + 1) * shard_rows) clipped to dim0, and the rows past dim0 are zero
// padding. This is FSDP's layout (Note [Sharded and unsharded parameters] in
// src/shard/fsdp_param.h) and the checkpoint's (Note [Checkpoint layout] in src/ckpt/layout.h).
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;  // exclusive
  int64_t size() const { return end - begin; }
};
// The rows of a tensor of `dim0` rows that shard rank `rank` holds (empty for ranks past the end).
RowRange shard_row_range(int64_t dim0, int64_t shard_rows, int rank);

// One parameter of which this rank holds a dim-0 shard: what FSDP2 hands distributed
// checkpointing as a DTensor with placement Shard(0), without showing it its internals.
struct LocalShard {
  at::Tensor local;                 // the registered parameter: shard_rows rows (padding included)
  std::vector<int64_t> full_shape;  // the parameter's full shape
  int64_t shard_rows = 0;           // rows every rank holds
  RowRange rows;                    // the real (unpadded) rows this rank holds
  // Set when the registered parameter is held whole by every rank and only its optimizer state
  // is split (ZeRO stages 1 and 2): `param` is the registered parameter, `local` the view of
  // this rank's rows (exactly rows.size() rows, no padding) that the optimizer steps and keys
  // its state by. Undefined when `local` is the registered parameter (FSDP).
  at::Tensor param;
};

// Shards whose values a strategy keeps away from memory between uses (pages out), e.g. on
// disk: whoever reads or writes such a shard outside the training step (the checkpointer)
// brings it in first and hands it back after. Calls nest (counted).
class ShardPager {
 public:
  virtual ~ShardPager() = default;
  // True when `local`'s values may be away (page_in before reading or writing them).
  virtual bool pages(const at::Tensor& local) const = 0;
  // Blocks until `local`'s values are in its storage.
  virtual void page_in(const at::Tensor& local) = 0;
  // Done with `local`; `modified`: its values changed (they are written back).
  virtual void page_out(const at::Tensor& local, bool modified) = 0;
};

// How this rank holds the model's parameters.
struct LocalShards {
  // The ranks a sharded parameter is split over; null when nothing is split.
  ProcessGroupPtr shard_group;
  // Which copy of the (sharded) model state this rank belongs to: ranks with replica_rank 0
  // write checkpoints, the others hold the same values (DDP and single: every rank is a copy).
  int replica_rank = 0;
  // The sharded parameters; every other parameter and buffer is held whole by every rank.
  std::vector<LocalShard> params;
  // Set when a sharded parameter's values may be away from memory (an OffloadPolicy with
  // parameters on disk). A `local` it pages holds its values only between
  // pager->page_in(local) and pager->page_out(local, modified); checkpoints hold one unit at a
  // time. See Note [Checkpoints of parameters on disk] in docs/design.md.
  ShardPager* pager = nullptr;
};

// Optimizer state that a strategy keeps outside the optimizer's state() (the disk tier's
// moments in swap files, src/offload/nvme_adam.h): checkpoints stream it, one buffer at a time,
// in the format of the optimizer's own state (float32 "optim.<fqn>.<stat>" tensors with the
// parameter's rows), so it reloads under any strategy and world size. See Note [Streamed
// optimizer state] in docs/design.md.
class StreamedOptimizerState {
 public:
  virtual ~StreamedOptimizerState() = default;
  // The statistics kept per parameter, in this order ("exp_avg", "exp_avg_sq", and
  // "max_exp_avg_sq" with amsgrad); all float32.
  virtual std::vector<std::string> stats() const = 0;
  // Whether `param` (a tensor the optimizer steps) is held here, and its step count (0: never
  // stepped, so it has no state yet, as in torch's optimizers).
  virtual bool holds(const at::Tensor& param) const = 0;
  virtual int64_t step_of(const at::Tensor& param) const = 0;
  virtual void set_step(const at::Tensor& param, int64_t step) = 0;
  // Visits the whole state, a piece at a time: elements [offset, offset + numel) of statistic
  // `stat` (an index into stats()) of `param`, at `data`, held in a streaming buffer. Pieces
  // of one parameter may come in any order; every element is visited once.
  using Visitor = std::function<void(const at::Tensor& param, int stat, int64_t offset,
                                     float* data, int64_t numel)>;
  // Saving: `visit` reads the pieces.
  virtual void read_state(const Visitor& visit) = 0;
  // Loading: `fill` overwrites what it wants of each piece (the pieces hold the current state
  // on entry); every piece is then written back.
  virtual void write_state(const Visitor& fill) = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual std::string name() const = 0;

  virtual void connect(ProcessGroupPtr world, const LaunchInfo& launch) {
    world_ = std::move(world);
    launch_ = launch;
  }

  // Around module.configure_model() (configure_model_with).
  virtual void enter_configure_model() {}
  virtual void exit_configure_model() {}
  // While configure_model runs under this strategy, what the model's construction says: a
  // finished layer (fsdp::nn::built) and a module to wrap as a unit (fsdp::wrap). Default:
  // nothing. See Note [Configure-model scope] in src/train/strategy.cpp.
  virtual void on_module_built(torch::nn::Module& module) {}
  virtual void on_module_wrapped(fsdp::nn::Module& module) {}

  // The Trainer's precision, before configure_model. Returns true when the strategy carries it
  // out itself (FSDP: "bf16-mixed" / "16-mixed" become its MixedPrecisionPolicy); false leaves
  // it to the Trainer ("bf16-mixed" / "16-mixed": CPU autocast around the steps; "*-true": the
  // model is built in that dtype). 16-mixed's loss scaling is the Trainer's either way.
  virtual bool connect_precision(Precision precision) { return false; }

  // A strategy whose own configuration fixes training settings (a DeepSpeed JSON config:
  // precision, gradient clipping, accumulation) writes them into the Trainer's options when the
  // Trainer takes the strategy; an option the user set to a different value is an error.
  virtual void configure_trainer(TrainerOptions& options) const {}

  virtual void setup_module(LightningModule& module) = 0;
  // After module.configure_optimizers(): a strategy whose configuration defines the optimizer
  // and scheduler (a DeepSpeed config's "optimizer" / "scheduler") replaces `config` with them,
  // built over the set-up module's parameters.
  virtual void configure_optimizers(LightningModule& module, OptimizerConfig& config) {}
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

  // State a strategy keeps across steps besides what the checkpoint's model and optimizer files
  // hold (DDP: its communication-hook state; with post-local SGD also this rank's own replica of
  // the parameters and optimizer state, which differ between ranks), per rank. save_checkpoint
  // calls save_extra_state on every rank with the directory it is writing (before it is
  // published); load_checkpoint calls load_extra_state with the checkpoint's directory after it
  // has loaded the model and the optimizer (optimizer may be null in both).
  virtual void save_extra_state(const std::string& dir, torch::nn::Module& module,
                                torch::optim::Optimizer* optimizer) {}
  virtual void load_extra_state(const std::string& dir, torch::nn::Module& module,
                                torch::optim::Optimizer* optimizer) {}

  // Optimizer state this strategy keeps outside optimizer.state() (checkpoints stream it), or
  // null when the optimizer holds its own state.
  virtual StreamedOptimizerState* streamed_optimizer_state() { return nullptr; }

  // Reduces a metric over the world (for log(..., sync_dist) and the global mean loss).
  virtual at::Tensor reduce(const at::Tensor& value, ReduceOp op);
  virtual void barrier();
  // Bytes this rank has passed to collectives so far, summed over the process groups the
  // strategy communicates on (CommCounters, input bytes per rank): the world group, plus DDP's
  // comm-hook subgroups. Benchmarks difference it per step.
  virtual int64_t comm_bytes() const;

  // After setup_module: (all, trainable) parameter elements of the model at their full shapes
  // (default: module.parameters() as they are; FSDP counts its full parameters, not shards).
  virtual std::pair<int64_t, int64_t> parameter_counts(torch::nn::Module& module);
  // After setup_module: how this rank holds the parameters (default: every rank holds them
  // whole and is its own copy of the model state).
  virtual LocalShards local_shards();

  const ProcessGroupPtr& world() const { return world_; }
  int rank() const { return world_ ? world_->rank() : 0; }
  int world_size() const { return world_ ? world_->size() : 1; }
  const LaunchInfo& launch_info() const { return launch_; }

  // The device this rank trains on (the Trainer sets it before configure_model: the CPU, or
  // cuda:i). A strategy that cannot run there refuses it in setup_module.
  void set_device(c10::Device device) { device_ = device; }
  c10::Device device() const { return device_; }

 protected:
  ProcessGroupPtr world_;
  LaunchInfo launch_;
  c10::Device device_{c10::kCPU};
};
using StrategyPtr = std::shared_ptr<Strategy>;

// Clips `grads` -- disjoint parts of the model's gradients, spread over the ranks of `group`
// (shards, partitions; zero padding allowed) -- to a global L2 norm of at most max_norm, as
// torch.nn.utils.clip_grad_norm_ would over the whole gradients: the sums of squares are
// all-reduced over the group. Returns the norm before clipping. Collective over `group`.
double clip_grad_norm_of_parts(const std::vector<at::Tensor>& grads, ProcessGroup& group,
                               double max_norm);

// Strategy-driven configure_model, as the Trainer runs it: strategy.enter_configure_model(),
// module.configure_model(), strategy.exit_configure_model(); fsdp::nn::built and fsdp::wrap
// called meanwhile on this thread reach `strategy` (on_module_built / on_module_wrapped). It
// must not nest. See Note [Configure-model scope] in src/train/strategy.cpp.
void configure_model_with(Strategy& strategy, LightningModule& module);

}  // namespace fsdp
