// detail::ZeroPartitioner: ZeRO stage 1 and 2 for parameters every rank holds whole. Each rank
// owns a dim-0 partition of every trainable parameter: it receives only that partition's
// averaged gradient (reduce-scatter in buckets), the optimizer steps only that partition, and
// the updated partitions are all-gathered back into every rank's parameter (in buckets).
// Used by DeepSpeedStrategy (src/zero/deepspeed_strategy.cpp) for stages 1 and 2, and for the
// persistent parameters of stage 3. See Note [ZeRO partitions] in partitioner.cpp.
#pragma once

#include "ddp/grad_buckets.h"
#include "fsdp/comm.h"
#include "fsdp/strategy.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// When gradients are reduce-scattered:
//   kAtBoundary     stage 1: gradients accumulate whole in .grad over the micro-batches of a
//                   step; the boundary micro-batch's post_backward reduce-scatters them, bucket
//                   by bucket, and frees them.
//   kDuringBackward stage 2: a bucket is reduce-scattered as soon as all its gradients exist,
//                   during backward, every micro-batch; whole gradients live only until their
//                   bucket is copied in. The partition gradient accumulates over micro-batches.
enum class GradReduction { kAtBoundary, kDuringBackward };

struct ZeroParam {
  std::string fqn;
  at::Tensor param;      // P: the registered parameter, whole on every rank
  at::Tensor partition;  // this rank's rows of P: a leaf view of P's storage (no copy)
  int64_t dim0 = 1;      // P viewed as (dim0, row_numel); 0-d and 1-d: (numel, 1)
  int64_t row_numel = 1;
  int64_t shard_rows = 0;  // R = ceil(dim0 / W)
  RowRange rows;           // this rank's rows
  int64_t shard_numel() const { return shard_rows * row_numel; }
};

class ZeroPartitioner {
 public:
  struct Options {
    GradReduction reduction = GradReduction::kDuringBackward;
    int64_t reduce_bucket_numel = 200000000;     // elements per reduce-scatter bucket
    int64_t allgather_bucket_numel = 200000000;  // elements per all-gather bucket
  };
  // `params`: trainable leaf parameters (fqn, tensor), registration order, each once.
  ZeroPartitioner(ProcessGroupPtr group, std::vector<std::pair<std::string, at::Tensor>> params,
                  Options options);
  ~ZeroPartitioner();
  ZeroPartitioner(const ZeroPartitioner&) = delete;
  ZeroPartitioner& operator=(const ZeroPartitioner&) = delete;

  // Replaces every managed parameter in the optimizer's groups by its partition (the optimizer
  // then steps, and keeps state for, this rank's rows only). Refuses an optimizer with state.
  void partition_optimizer(torch::optim::Optimizer& optimizer);

  // Strategy::pre_forward: arms the backward hooks (kDuringBackward).
  void prepare_forward(bool sync);
  // Strategy::post_backward: every gradient of this backward (kDuringBackward) or, on a
  // boundary micro-batch, of this step (kAtBoundary) is reduced into the partition gradients.
  void finish_backward(bool sync);
  // After optimizer.step(): every rank's updated partitions into every rank's parameters.
  void all_gather_params();
  // Frees partition gradients and whole gradients.
  void zero_grad();

  // The partitions' gradients (defined ones), for the global norm.
  std::vector<at::Tensor> partition_grads() const;
  const std::vector<ZeroParam>& params() const { return params_; }
  const ProcessGroupPtr& group() const { return group_; }
  int64_t num_grad_buckets() const { return grad_buckets_.num_buckets(); }
  // Largest bucket chunk per rank (elements), reduce-scatter and all-gather: what bounds the
  // transient buffers (two reduce-scatter buckets in flight: 2 x (W + 1) x chunk).
  int64_t max_grad_bucket_chunk() const;

 private:
  // The reduce-scatter buffers of a bucket of grad_buckets_'s layout, from launch to finish.
  // The layout's numel is the bucket's chunk: elements per rank (the sum of shard_numel).
  struct Bucket {
    at::Tensor input;   // (W * chunk), rank-major
    at::Tensor output;  // (chunk)
    WorkPtr work;
  };
  void on_grad_ready(int index);
  void copy_in(int bucket);  // the whole gradients into its input, and free them
  void issue(int bucket);    // async reduce-scatter
  void finish(int bucket);   // wait, accumulate into the partition gradients, free buffers
  void reduce_all_defined();  // every bucket holding a whole gradient, in order

  ProcessGroupPtr group_;
  Options options_;
  std::vector<ZeroParam> params_;
  std::vector<Bucket> buckets_;
  // Reduce-scatter buckets in reverse registration order, one in flight. See Note [Gradient
  // buckets] in src/ddp/grad_buckets.h.
  GradBuckets grad_buckets_;
  std::vector<std::vector<int>> gather_buckets_;  // registration order
  bool armed_ = false;
  // Declared last, so destroyed first (and the destructor expires alive_ before anything else).
  Liveness alive_;
  GradReadyHooks hooks_;  // kDuringBackward only
};

}  // namespace fsdp::detail
