// DDP communication hooks: how a gradient bucket is communicated, the C++ shape of PyTorch's
// DistributedDataParallel.register_comm_hook(state, hook) and of Lightning's
// DDPStrategy(ddp_comm_hook=..., ddp_comm_state=..., ddp_comm_wrapper=..., model_averaging_period=...).
//
//   fsdp::DDPOptions o;
//   o.comm_state = std::make_shared<fsdp::PowerSGDState>(fsdp::PowerSGDOptions{.start_powersgd_iter = 10});
//   o.comm_hook = fsdp::powersgd_hook;
//   o.comm_wrapper = fsdp::fp16_compress_wrapper;   // optional: compress what the hook sends
//   auto ddp = std::make_shared<fsdp::DDPStrategy>(o);
//
// A hook receives one bucket (GradBucket: the flat gradient buffer of a few parameters, their
// offsets, the bucket index, whether it is the last bucket of this backward) when every
// gradient of the bucket is ready, starts its communication and returns a CommFuture of the
// reduced buffer. The reducer waits on the futures in bucket order after backward and copies each
// result into the parameters' .grad. Hooks run only on synchronized backward passes (not in
// no_sync micro-batches). See Note [Comm hook futures] in src/ddp/comm_future.cpp for when the
// continuations run, and docs/ddp_comm_hooks.md for every built-in's algorithm.
#pragma once

#include "fsdp/comm.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace fsdp {

struct LaunchInfo;
namespace detail {
struct CommFutureAccess;
}

// A tensor that a collective (or a chain of collectives and computations) fills in later.
// wait() blocks until the value is there and returns it; continuations added with then() run
// on the thread that waits, in the order futures are waited on (the reducer waits in bucket
// order on every rank, so a continuation that communicates does so in the same order
// everywhere). Copies share the same state.
class CommFuture {
 public:
  CommFuture() = default;  // invalid (valid() == false)
  // Already complete.
  static CommFuture ready(at::Tensor value);
  // Complete when `work` is; its value is `value` (the collective's output tensor).
  static CommFuture of_work(WorkPtr work, at::Tensor value);
  // Complete when every (non-null) work is.
  static CommFuture of_works(std::vector<WorkPtr> works, at::Tensor value);

  // A future of fn(this future's value).
  CommFuture then(std::function<at::Tensor(at::Tensor)> fn) const;
  // A future of the future fn returns (a continuation that starts more communication).
  CommFuture then_future(std::function<CommFuture(at::Tensor)> fn) const;

  // Blocks until the value is available (runs pending continuations), returns it or rethrows
  // the error of the collective or continuation that failed. Idempotent.
  at::Tensor wait() const;
  bool valid() const { return static_cast<bool>(state_); }
  bool completed() const;  // wait() would not block
  // Waits for the communication already started along the chain, without running
  // continuations and ignoring errors (error paths and destructors).
  void drain() const noexcept;

  struct State;

 private:
  friend struct detail::CommFutureAccess;
  std::shared_ptr<State> state_;
};

// One gradient bucket as a hook sees it (PyTorch's dist.GradBucket).
class GradBucket {
 public:
  // buffer: the flat gradients (numel = sum of the parameters' numel); offsets[i]: element
  // offset of parameters[i] in it. Public so that hooks can be called on hand-made buckets.
  GradBucket(int index, int num_buckets, at::Tensor buffer, std::vector<at::Tensor> parameters,
             std::vector<int64_t> offsets, std::vector<std::string> names = {});

  int index() const { return index_; }
  // The last bucket of the backward pass (hooks count iterations on it).
  bool is_last() const { return index_ == num_buckets_ - 1; }
  int num_buckets() const { return num_buckets_; }
  // The flat gradient buffer (1-D). Hooks may modify it in place and return it.
  const at::Tensor& buffer() const { return buffer_; }
  // Replaces the buffer the next hook sees (a compression wrapper passes an fp16 copy); the
  // same number of elements, any floating dtype.
  void set_buffer(at::Tensor buffer);
  // One view per parameter into buffer() (the current one), shaped like the parameter.
  std::vector<at::Tensor> gradients() const;
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<std::string>& names() const { return names_; }

 private:
  int index_;
  int num_buckets_;
  at::Tensor buffer_;  // (numel) flat
  std::vector<at::Tensor> parameters_;
  std::vector<int64_t> offsets_;
  std::vector<std::string> names_;
};

// What a hook keeps between buckets and steps, saved in checkpoints (per rank).
struct CommHookStateDict {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> values;  // small values (counters, RNG state) as text
};

// The `state` passed to every hook call (PyTorch passes the process group or a state object).
// DDP fills process_group with its world group at setup when it is null.
class CommHookState {
 public:
  explicit CommHookState(ProcessGroupPtr process_group = nullptr)
      : process_group(std::move(process_group)) {}
  virtual ~CommHookState() = default;

  // Which state this is, for error messages and checkpoints ("default", "powersgd", ...).
  virtual std::string kind() const { return "default"; }
  // Called once by DDPStrategy::setup on every rank (collective for states that create
  // subgroups): sets process_group to `world` when null.
  virtual void setup(const ProcessGroupPtr& world, const LaunchInfo& launch);
  // Checkpoint support: everything needed to continue bitwise. load_state_dict gets
  // same_world = false when the checkpoint was saved at another world size: per-rank tensors
  // are then not meaningful and a state should keep only its counters.
  virtual CommHookStateDict state_dict() const { return {}; }
  virtual void load_state_dict(const CommHookStateDict& state, bool same_world) {}
  // Groups besides process_group that the hook communicates on (DDPStrategy::comm_bytes counts
  // them).
  virtual std::vector<ProcessGroupPtr> other_groups() const { return {}; }

  ProcessGroupPtr process_group;
};

using CommHook = std::function<CommFuture(CommHookState& state, GradBucket& bucket)>;
using CommHookWrapper = std::function<CommHook(CommHook hook)>;

// --- default hooks (PyTorch's ddp_comm_hooks.default_hooks).

// Divides the buffer by the group size, then all-reduces it (sum) in place. DDP's behaviour
// without a hook.
CommFuture allreduce_hook(CommHookState& state, GradBucket& bucket);
// Casts the buffer to fp16 (bf16), divides by the group size, all-reduces the half-size copy
// and copies the result back: half the bytes on the wire.
CommFuture fp16_compress_hook(CommHookState& state, GradBucket& bucket);
CommFuture bf16_compress_hook(CommHookState& state, GradBucket& bucket);
// Run `hook` on an fp16 (bf16) copy of the buffer (hook(state, bucket) sees the half-precision
// buffer) and cast its result back: fp16_compress_wrapper(allreduce_hook) is
// fp16_compress_hook; fp16_compress_wrapper(powersgd_hook) sends fp16 P and Q.
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);

// --- PowerSGD (PyTorch's ddp_comm_hooks.powerSGD_hook; Vogels et al. 2019).

struct PowerSGDOptions {
  // Rank of the approximation M ~ P Q^T per gradient matrix (the compression strength).
  int64_t matrix_approximation_rank = 1;
  // Plain all-reduce (allreduce_hook) for the first this many iterations; PyTorch's default.
  // Must be > 1 with error feedback or warm start (PyTorch's rule).
  int64_t start_powersgd_iter = 1000;
  // A matrix n x m is compressed only when (n + m) * rank * min_compression_rate < n * m;
  // the others (including every 1-D tensor at rates >= 1) are all-reduced uncompressed.
  double min_compression_rate = 2;
  // Add last step's compression error to this step's gradient.
  bool use_error_feedback = true;
  // Reuse last step's Q instead of a new random one.
  bool warm_start = true;
  // Added to column norms in the orthogonalization (0: divide by the norm; a zero column
  // then gives NaN, as in PyTorch: set e.g. 1e-8 if a whole gradient matrix can be zero).
  double orthogonalization_epsilon = 0;
  // Seeds the generator of the random Q (same on every rank).
  uint32_t random_seed = 0;
  // Compress same-shaped matrices of a bucket in one batched matmul.
  bool batch_tensors_with_same_shape = false;
};

class PowerSGDState : public CommHookState {
 public:
  explicit PowerSGDState(PowerSGDOptions options = {}, ProcessGroupPtr process_group = nullptr);
  std::string kind() const override { return "powersgd"; }
  const PowerSGDOptions& options() const { return options_; }

  // Synchronized backward passes seen so far (counted on the last bucket); compression starts
  // when iter() reaches start_powersgd_iter.
  int64_t iter() const { return iter_; }
  // Elements before and after compression, summed over every compressed iteration, and their
  // ratio (0 before any).
  int64_t numel_before_compression() const { return total_numel_before_; }
  int64_t numel_after_compression() const { return total_numel_after_; }
  double compression_rate() const;

  // Per bucket index: the error-feedback memory (buffer-sized; padded for the batched hook)
  // and the P and Q of the last step (warm start).
  std::map<int, at::Tensor> error_dict, p_memory_dict, q_memory_dict;

  CommHookStateDict state_dict() const override;
  void load_state_dict(const CommHookStateDict& state, bool same_world) override;

  // --- used by the hooks (src/ddp/powersgd_hook.cpp).
  void maybe_increase_iter(bool bucket_is_last);
  // numpy.random.RandomState(random_seed).randint(1e9), as PyTorch seeds each random Q.
  uint32_t next_seed();
  void count(int64_t before, int64_t after) {
    total_numel_before_ += before;
    total_numel_after_ += after;
  }

 private:
  PowerSGDOptions options_;
  std::mt19937 rng_;  // MT19937, seeded like numpy's legacy RandomState
  int64_t iter_ = 0;
  int64_t total_numel_before_ = 0;
  int64_t total_numel_after_ = 0;
};

// Compresses each gradient matrix of the bucket to rank r (P = M Q all-reduced, orthogonalized,
// Q = M^T P all-reduced and averaged, M ~ P Q^T), with error feedback and warm start; vectors and
// incompressible matrices are all-reduced uncompressed. Needs a PowerSGDState.
CommFuture powersgd_hook(CommHookState& state, GradBucket& bucket);
// The whole bucket as one zero-padded ceil(sqrt(N)) x ceil(sqrt(N)) matrix: fewer, larger
// matmuls, usually less accurate. Needs a PowerSGDState.
CommFuture batched_powersgd_hook(CommHookState& state, GradBucket& bucket);

// --- post-local SGD (PyTorch's post_localSGD_hook + model_averaging.averagers; Lin et al. 2018).

struct PostLocalSGDOptions {
  // Global all-reduce for the first this many iterations, then all-reduce inside `subgroup`
  // only (or nothing, see below). PyTorch has no default: -1 is an error at construction.
  int64_t start_local_sgd_iter = -1;
  // The group gradients are averaged in after the start; null: groups of subgroup_size
  // consecutive ranks, and subgroup_size 0 means the ranks of one node (PyTorch's
  // dist.new_subgroups(); on CPU PyTorch needs the size given).
  ProcessGroupPtr subgroup;
  int subgroup_size = 0;
  // false: after the start, gradients are not communicated at all (pure local SGD).
  bool post_local_gradient_allreduce = true;
};

class PostLocalSGDState : public CommHookState {
 public:
  explicit PostLocalSGDState(PostLocalSGDOptions options, ProcessGroupPtr process_group = nullptr);
  std::string kind() const override { return "post_local_sgd"; }
  const PostLocalSGDOptions& options() const { return options_; }
  // Creates the subgroups when options().subgroup is null (collective over the world).
  void setup(const ProcessGroupPtr& world, const LaunchInfo& launch) override;
  const ProcessGroupPtr& subgroup() const { return subgroup_; }
  std::vector<ProcessGroupPtr> other_groups() const override;
  // Counts synchronized backward passes up to start_local_sgd_iter (then stays there).
  int64_t iter() const { return iter_; }
  void maybe_increase_iter(bool bucket_is_last);

  CommHookStateDict state_dict() const override;
  void load_state_dict(const CommHookStateDict& state, bool same_world) override;

 private:
  PostLocalSGDOptions options_;
  ProcessGroupPtr subgroup_;
  int64_t iter_ = 0;
};

// All-reduce over the process group until start_local_sgd_iter, then over the subgroup (or
// nothing without post_local_gradient_allreduce). Pair it with model averaging
// (DDPOptions::model_averaging_period, or a PeriodicModelAverager after optimizer.step()).
CommFuture post_local_sgd_hook(CommHookState& state, GradBucket& bucket);

// Averages parameters over `group` through one flat buffer (divide, all-reduce sum, copy back).
void average_parameters(const std::vector<at::Tensor>& params, ProcessGroup& group);

// PyTorch's PeriodicModelAverager: call average_parameters after every optimizer step; it
// averages when step >= warmup_steps and (step - warmup_steps) % period == 0, then counts the
// step. warmup_steps should equal start_local_sgd_iter.
class PeriodicModelAverager {
 public:
  PeriodicModelAverager(int64_t period, int64_t warmup_steps, ProcessGroupPtr group);
  // Averages the parameters that have a gradient (the others are left alone), when due.
  // Returns whether it averaged.
  bool average_parameters(const std::vector<at::Tensor>& params);
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }

 private:
  int64_t period_;
  int64_t warmup_steps_;
  ProcessGroupPtr group_;
  int64_t step_ = 0;
};

// --- built-ins by name (fsdp-train --ddp-comm-hook / --ddp-comm-wrapper).

// "allreduce", "fp16_compress", "bf16_compress", "powersgd", "batched_powersgd",
// "post_local_sgd".
std::vector<std::string> comm_hook_names();
// "fp16", "bf16" ("" or "none": no wrapper).
std::vector<std::string> comm_wrapper_names();

}  // namespace fsdp
