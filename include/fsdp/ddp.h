// DDPStrategy: replicate the model on every rank, average gradients with bucketed all-reduce.
//
//   fsdp::DDPOptions opts;
//   opts.gradient_as_bucket_view = true;
//   auto ddp = std::make_shared<fsdp::DDPStrategy>(opts);   // or strategy name "ddp"
//
// What it does, in the Strategy call sequence (see fsdp/strategy.h):
//   setup_module   broadcasts parameters and buffers from rank 0 (one flat buffer per bucket),
//                  then groups trainable parameters into gradient buckets (reverse registration
//                  order, ~bucket_cap_mb each, one dtype per bucket) and hooks each parameter's
//                  AccumulateGrad node.
//   backward       when every parameter of a bucket has its gradient, the bucket's all-reduce
//                  (average) is launched asynchronously while backward continues; buckets launch
//                  in the same fixed order on every rank. Use strategy.backward(loss) (the
//                  Trainer does): it ends the reduction after the whole backward, also with
//                  activation checkpointing (nested backward runs).
//   post_backward  waits for every bucket and leaves the averaged gradients in .grad.
//   pre_forward(sync=false)  no_sync: gradients accumulate locally, nothing is communicated; the
//                  next synchronized micro-batch all-reduces the accumulated sum.
// World size 1 runs the same code (the collectives are no-ops of the group).
#pragma once

#include "fsdp/comm_hooks.h"
#include "fsdp/strategy.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

struct DDPOptions {
  // Target size of one gradient bucket. Smaller buckets start communicating earlier in backward
  // (more overlap) but pay more per-collective latency.
  double bucket_cap_mb = 25;
  // Allow trainable parameters that receive no gradient in a backward: their bucket slot is
  // zero-filled and their bucket launches at the end of backward. Off, such a parameter is an
  // error that names it.
  bool find_unused_parameters = false;
  // Promise that every iteration uses the same parameters in the same order. The first
  // iteration records which parameters receive gradients and in which order; afterwards buckets
  // are rebuilt in that order (so they fill and launch as early as possible) and the unused
  // parameters are known up front (no end-of-backward search, unused parameters allowed).
  // See Note [DDP static graph] in src/ddp/reducer.cpp.
  bool static_graph = false;
  // Each parameter's .grad is a view into its bucket's flat buffer: backward accumulates
  // straight into the buffer the all-reduce uses, so there is no copy in or out and no second
  // copy of the gradients (saves one gradient-sized buffer per rank, i.e. 4 bytes/param fp32).
  bool gradient_as_bucket_view = false;
  // Broadcast module buffers (e.g. running statistics) from rank 0 before every synchronized
  // forward, as PyTorch DDP does. Parameters are broadcast once, at setup.
  bool broadcast_buffers = true;

  // --- Communication hooks (fsdp/comm_hooks.h), as Lightning's DDPStrategy(ddp_comm_hook,
  // ddp_comm_state, ddp_comm_wrapper, model_averaging_period).
  // How each bucket is communicated; empty: allreduce_hook (divide, all-reduce sum).
  CommHook comm_hook;
  // Passed to every hook call; empty: a CommHookState on the world group. Keep a pointer to
  // read it (PowerSGDState::iter(), compression_rate()). Its state is saved in checkpoints.
  std::shared_ptr<CommHookState> comm_state;
  // Applied to comm_hook (or to allreduce_hook when comm_hook is empty), e.g.
  // fp16_compress_wrapper. (Lightning ignores a wrapper without a hook.)
  CommHookWrapper comm_wrapper;
  // Post-local SGD: after every optimizer step a PeriodicModelAverager(period,
  // warmup = start_local_sgd_iter, world group) averages the parameters. Needs comm_state to be
  // a PostLocalSGDState, which in turn needs it (as Lightning). 0: off.
  int64_t model_averaging_period = 0;
};

// Sets options.comm_hook / comm_state / comm_wrapper to a built-in by name (the fsdp-train
// flags): hook one of comm_hook_names() ("" or "none": no hook), wrapper one of
// comm_wrapper_names() or "". powersgd applies to "powersgd" and "batched_powersgd",
// post_local_sgd to "post_local_sgd". An unknown name is an error that lists the valid ones.
void set_comm_hook(DDPOptions& options, const std::string& hook, const std::string& wrapper = "",
                   const PowerSGDOptions& powersgd = {},
                   const PostLocalSGDOptions& post_local_sgd = {});

// Per-rank bytes DDP needs for a model: parameters, gradients, bucket buffers (none with
// gradient_as_bucket_view) and Adam-like optimizer state (2 fp32 values per trainable element).
struct DDPMemoryEstimate {
  int64_t num_params = 0;        // all parameter elements
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t bucket_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t total_bytes() const { return param_bytes + grad_bytes + bucket_bytes + optimizer_bytes; }
};
DDPMemoryEstimate estimate_ddp_memory(const torch::nn::Module& module, const DDPOptions& options);

class DDPStrategy : public Strategy {
 public:
  explicit DDPStrategy(DDPOptions options = {});
  ~DDPStrategy() override;

  std::string name() const override { return "ddp"; }
  const DDPOptions& options() const { return options_; }

  // Throws OutOfMemoryError when memory_budget() > 0 and estimate_ddp_memory exceeds it.
  void setup_module(LightningModule& module) override;
  void pre_forward(LightningModule& module, bool sync) override;
  // loss.backward() with a hook on the loss that ends the reduction when the whole backward is
  // over, also when parameter gradients come from nested backward runs (activation
  // checkpointing). Custom loops should call it instead of loss.backward(): a plain
  // loss.backward() works unless the first parameter gradient comes from inside a
  // checkpointed block (then it is an error that says so).
  void backward(const at::Tensor& loss) override;
  void post_backward(LightningModule& module, bool sync) override;
  // Gradients are identical on every rank after the all-reduce: the local norm is the global one.
  double clip_grad_norm(LightningModule& module, double max_norm) override;
  // Zeroes gradients in place when they are bucket views (keeps the views), else
  // optimizer.zero_grad().
  void zero_grad(torch::optim::Optimizer& optimizer) override;

  // Same as setup_module, for any module (tests, custom loops). The module must outlive the
  // strategy's use of it.
  void setup(torch::nn::Module& module);
  // Same as pre_forward / post_backward without a LightningModule.
  void prepare_forward(bool sync);
  void finish_backward(bool sync);
  double clip_grad_norm(double max_norm);
  void zero_grad();
  // optimizer.step(), then model averaging when model_averaging_period is set (post-local SGD).
  void optimizer_step(torch::optim::Optimizer& optimizer) override;

  // Communication-hook state and the model averager's step, per rank, in checkpoints:
  // DIR/ddp_comm_state-<rank>-of-<world>.safetensors; with post-local SGD also this rank's
  // parameters and optimizer state (its replica). See docs/ddp_comm_hooks.md "Checkpoints".
  void save_extra_state(const std::string& dir, torch::nn::Module& module,
                        torch::optim::Optimizer* optimizer) override;
  void load_extra_state(const std::string& dir, torch::nn::Module& module,
                        torch::optim::Optimizer* optimizer) override;
  // The world group's bytes plus those of the comm hook state's own groups (post-local SGD's
  // subgroup).
  int64_t comm_bytes() const override;

  // The state every hook call gets (options().comm_state, or the default one made at setup).
  const std::shared_ptr<CommHookState>& comm_state() const { return comm_state_; }
  // Non-null with model_averaging_period.
  PeriodicModelAverager* model_averager() const { return averager_.get(); }

  // --- introspection (tests, benchmarks).
  struct BucketInfo {
    std::vector<std::string> names;  // parameter FQNs, in bucket order
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
  };
  std::vector<BucketInfo> buckets() const;
  // Bucket indices in the order they were launched in the last synchronized backward.
  std::vector<int> last_launch_order() const;
  // Number of synchronized backward passes completed.
  int64_t num_synced_backwards() const;
  // Buckets that were full before an earlier bucket had launched, in the last synchronized
  // backward (they waited to keep the launch order identical on every rank). static_graph's
  // rebuilt buckets bring this to 0.
  int64_t last_held_buckets() const;

 private:
  struct Reducer;  // the bucketed gradient reducer (src/ddp/reducer.h)
  DDPOptions options_;
  std::unique_ptr<Reducer> reducer_;
  torch::nn::Module* module_ = nullptr;
  std::vector<at::Tensor> buffers_;  // module buffers, broadcast before synchronized forwards
  std::shared_ptr<CommHookState> comm_state_;
  std::unique_ptr<PeriodicModelAverager> averager_;
};

}  // namespace fsdp
