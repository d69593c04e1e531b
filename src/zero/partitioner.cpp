// ZeroPartitioner: ZeRO stage 1/2 gradient and optimizer-state partitioning over parameters that
// every rank holds whole. See partitioner.h.
#include "zero/partitioner.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace fsdp::detail {

// Note [ZeRO partitions]
// ----------------------
// Every rank holds every parameter P whole (stages 1 and 2 partition optimizer state and
// gradients, not parameters). P is viewed as (dim0, row_numel) rows -- 0-d and 1-d P as
// (numel, 1) -- and rank r owns rows [r*R, (r+1)*R) clipped to dim0, R = ceil(dim0 / W): FSDP's
// dim-0 layout (fsdp::shard_row_range), so checkpoints written here load under FSDP and back.
//
// The partition is a *view* of P's rows (P.detach(), narrowed), made a leaf that requires grad:
// the optimizer steps it in place, which updates this rank's rows of P directly. In fp32 there
// is no separate master copy, so per parameter a rank holds P (4 B), its gradient (stage 1: 4 B
// whole until the boundary; stage 2: 4/W B, plus one bucket of whole gradients in flight) and
// Adam's two moments for its rows (8/W B): ZeRO's 4+4+8/W and 4+12/W bytes per parameter.
// See docs/design.md "ZeRO stages".
//
// Reduce-scatter buckets hold whole parameters, in reverse registration order (the order
// backward produces gradients), up to reduce_bucket_size elements (a larger parameter is a
// bucket of its own). A bucket's input is rank-major: rank r's part is the concatenation of
// rows [r*R, r*R + R) of every gradient in the bucket, zero-padded to R rows; the reduce-scatter
// (AVG) leaves this rank's part, averaged, in the output, which is added to the partitions'
// gradients. All-gather buckets (registration order, allgather_bucket_size) are the same layout
// the other way round: this rank's rows in, every rank's rows out into P.
//
// Buckets launch in the same order on every rank (a bucket whose gradients are complete waits
// for the earlier ones), and one reduce-scatter is in flight: launching a bucket finishes the
// one before (after the new bucket's copy-in), so the transient memory stays two buckets
// whatever the model size. The hooks, the order and the window are Note [Gradient buckets] in
// src/ddp/grad_buckets.h.

ZeroPartitioner::ZeroPartitioner(ProcessGroupPtr group,
                                 std::vector<std::pair<std::string, at::Tensor>> params,
                                 Options options)
    : group_(std::move(group)),
      options_(options),
      grad_buckets_(BucketLayout{}, /*max_in_flight=*/1,
                    GradBuckets::Ops{[this](int b) { copy_in(b); }, [this](int b) { issue(b); },
                                     [this](int b) { finish(b); }}) {
  TORCH_INTERNAL_ASSERT(group_, "ZeroPartitioner needs a process group");
  TORCH_CHECK(options_.reduce_bucket_numel > 0 && options_.allgather_bucket_numel > 0,
              "[deepspeed] reduce_bucket_size and allgather_bucket_size must be > 0 (got ",
              options_.reduce_bucket_numel, ", ", options_.allgather_bucket_numel, ")");
  const int W = group_->size();
  const int rank = group_->rank();
  for (auto& [fqn, p] : params) {
    TORCH_CHECK(p.is_leaf() && p.requires_grad(), "[deepspeed] parameter '", fqn,
                "' is not a trainable leaf tensor; ZeRO partitions trainable leaf parameters");
    TORCH_CHECK(p.is_contiguous(), "[deepspeed] parameter '", fqn, "' is not contiguous");
    ZeroParam zp;
    zp.fqn = fqn;
    zp.param = p;
    zp.dim0 = p.dim() >= 2 ? p.size(0) : p.numel();
    zp.row_numel = zp.dim0 == 0 ? 0 : p.numel() / zp.dim0;
    zp.shard_rows = (zp.dim0 + W - 1) / W;
    zp.rows = shard_row_range(zp.dim0, zp.shard_rows, rank);
    std::vector<int64_t> piece = p.sizes().vec();
    if (p.dim() >= 2) {
      piece[0] = zp.rows.size();
    } else {
      piece = {zp.rows.size()};
    }
    at::Tensor view = p.detach().reshape({zp.dim0, zp.row_numel})
                          .narrow(0, zp.rows.begin, zp.rows.size())
                          .view(piece);
    view.set_requires_grad(true);
    zp.partition = view;
    params_.push_back(std::move(zp));
  }
  // Both kinds of bucket follow DeepSpeed's cap: W * chunk elements at most, a larger parameter
  // alone. Reduce-scatter buckets in reverse registration order, all-gather buckets in
  // registration order.
  auto items_capped_at = [&](int64_t cap) {
    std::vector<BucketItem> items;
    for (const auto& p : params_) {
      BucketItem item;
      item.numel = p.shard_numel();
      item.cap = static_cast<double>(cap) / W;
      items.push_back(item);
    }
    return items;
  };
  grad_buckets_.set_layout(assign_buckets(items_capped_at(options_.reduce_bucket_numel),
                                          reverse_order(params_.size()), BucketCap::kStayUnderCap));
  buckets_.resize(grad_buckets_.layout().buckets.size());
  std::vector<int> registration_order(params_.size());
  std::iota(registration_order.begin(), registration_order.end(), 0);
  for (auto& b : assign_buckets(items_capped_at(options_.allgather_bucket_numel),
                                registration_order, BucketCap::kStayUnderCap)
                     .buckets) {
    gather_buckets_.push_back(std::move(b.params));
  }
  if (options_.reduction == GradReduction::kDuringBackward) {
    std::vector<at::Tensor> tensors;
    for (const auto& p : params_) tensors.push_back(p.param);
    hooks_ = GradReadyHooks(tensors, alive_.ref(this), &ZeroPartitioner::on_grad_ready);
  }
}

ZeroPartitioner::~ZeroPartitioner() {
  alive_.expire();
  hooks_.remove();
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {
      }
    }
  }
}

void ZeroPartitioner::partition_optimizer(torch::optim::Optimizer& optimizer) {
  std::unordered_map<const c10::TensorImpl*, const ZeroParam*> by_impl;
  for (const auto& p : params_) by_impl[p.param.unsafeGetTensorImpl()] = &p;
  for (auto& group : optimizer.param_groups()) {
    for (auto& t : group.params()) {
      auto it = by_impl.find(t.unsafeGetTensorImpl());
      if (it == by_impl.end()) continue;
      TORCH_CHECK(!optimizer.state().count(t.unsafeGetTensorImpl()),
                  "[deepspeed] the optimizer already holds state for '", it->second->fqn,
                  "'; hand the strategy a fresh optimizer (configure_optimizers) so that its "
                  "state is created for this rank's partition only");
      t = it->second->partition;
    }
  }
}

std::vector<at::Tensor> ZeroPartitioner::partition_grads() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) {
    if (p.partition.grad().defined()) out.push_back(p.partition.grad());
  }
  return out;
}

int64_t ZeroPartitioner::max_grad_bucket_chunk() const {
  int64_t m = 0;
  for (const auto& b : grad_buckets_.layout().buckets) m = std::max(m, b.numel);
  return m;
}

void ZeroPartitioner::prepare_forward(bool sync) {
  if (options_.reduction != GradReduction::kDuringBackward) return;
  // Every micro-batch reduces (sync or not): the partition gradient accumulates, so whole
  // gradients never outlive their bucket (DeepSpeed stage 2 does the same).
  armed_ = torch::GradMode::is_enabled();
  grad_buckets_.arm();
}

void ZeroPartitioner::on_grad_ready(int index) {
  if (!armed_) return;
  // A second accumulation (parameter used twice): its bucket copies both.
  if (grad_buckets_.ready(index)) return;
  // In a bucket launched already, it is reduced by finish_backward (GradBuckets ignores it).
  grad_buckets_.mark_ready(index);
  grad_buckets_.launch_ready();
}

void ZeroPartitioner::copy_in(int index) {
  RECORD_FUNCTION("ZeRO::reduce_scatter_copy_in", c10::ArrayRef<const c10::IValue>{});
  Bucket& b = buckets_[index];
  const BucketLayout& layout = grad_buckets_.layout();
  const std::vector<int>& members = layout.buckets[index].params;
  const int64_t chunk = layout.buckets[index].numel;
  const int W = group_->size();
  at::NoGradGuard no_grad;
  // Every rank launches every bucket, in order, also one that received no gradient on this
  // rank (unused parameters: zeros), so the collectives match across ranks.
  b.input = at::zeros({W * chunk}, params_[members.front()].param.options());
  for (int i : members) {
    ZeroParam& p = params_[i];
    at::Tensor g = p.param.grad();
    if (!g.defined()) continue;  // unused this step: its slots stay zero
    at::Tensor rows = g.reshape({p.dim0, p.row_numel});
    for (int r = 0; r < W; ++r) {
      const RowRange rr = shard_row_range(p.dim0, p.shard_rows, r);
      if (rr.size() == 0) continue;
      b.input.narrow(0, r * chunk + layout.offset_of[i], rr.size() * p.row_numel)
          .copy_(rows.narrow(0, rr.begin, rr.size()).reshape({-1}));
    }
    p.param.mutable_grad() = at::Tensor();  // whole gradient freed: only the partition stays
  }
  b.output = at::empty({chunk}, b.input.options());
}

void ZeroPartitioner::issue(int index) {
  RECORD_FUNCTION("ZeRO::reduce_scatter", c10::ArrayRef<const c10::IValue>{});
  Bucket& b = buckets_[index];
  b.work = group_->reduce_scatter_tensor_async(b.output, b.input, ReduceOp::kAvg);
}

void ZeroPartitioner::finish(int index) {
  Bucket& b = buckets_[index];
  if (!b.work) return;
  RECORD_FUNCTION("ZeRO::reduce_scatter_copy_out", c10::ArrayRef<const c10::IValue>{});
  b.work->wait();
  b.work.reset();
  at::NoGradGuard no_grad;
  const BucketLayout& layout = grad_buckets_.layout();
  for (int i : layout.buckets[index].params) {
    ZeroParam& p = params_[i];
    if (p.rows.size() == 0) {
      // A rank past the parameter's last row: an empty gradient, so that the optimizer keeps
      // (empty) state for it on every rank and checkpoints list the same tensors everywhere.
      if (!p.partition.grad().defined()) p.partition.mutable_grad() = at::zeros_like(p.partition);
      continue;
    }
    at::Tensor mine =
        b.output.narrow(0, layout.offset_of[i], p.rows.size() * p.row_numel)
            .view(p.partition.sizes());
    if (p.partition.grad().defined()) {
      p.partition.mutable_grad().add_(mine);
    } else {
      p.partition.mutable_grad() = mine.clone();
    }
  }
  b.input = at::Tensor();
  b.output = at::Tensor();
}

void ZeroPartitioner::reduce_all_defined() {
  const BucketLayout& layout = grad_buckets_.layout();
  for (int i = 0; i < grad_buckets_.num_buckets(); ++i) {
    bool any = false;
    for (int j : layout.buckets[i].params) any = any || params_[j].param.grad().defined();
    if (any) grad_buckets_.launch(i);
  }
  grad_buckets_.finish_all();
}

void ZeroPartitioner::finish_backward(bool sync) {
  if (options_.reduction == GradReduction::kAtBoundary) {
    if (!sync) return;  // gradients keep accumulating whole until the step's last micro-batch
    for (int i = 0; i < grad_buckets_.num_buckets(); ++i) grad_buckets_.launch(i);
    grad_buckets_.finish_all();
    return;
  }
  if (!armed_) return;
  armed_ = false;
  // Buckets still waiting for a gradient that never came (unused parameters), in order.
  grad_buckets_.launch_remaining();
  grad_buckets_.finish_all();
  // Gradients accumulated after their bucket launched (a second accumulation into a parameter,
  // from a nested backward such as reentrant activation checkpointing; the same on every rank):
  // reduced now, the reduction is linear.
  reduce_all_defined();
}

void ZeroPartitioner::all_gather_params() {
  RECORD_FUNCTION("ZeRO::all_gather", c10::ArrayRef<const c10::IValue>{});
  const int W = group_->size();
  if (W == 1) return;  // the partition is the whole parameter, updated in place
  at::NoGradGuard no_grad;
  for (const auto& bucket : gather_buckets_) {
    int64_t chunk = 0;
    std::vector<int64_t> offsets;
    for (int i : bucket) {
      offsets.push_back(chunk);
      chunk += params_[i].shard_numel();
    }
    if (chunk == 0) continue;
    at::Tensor input = at::zeros({chunk}, params_[bucket.front()].param.options());
    for (size_t k = 0; k < bucket.size(); ++k) {
      const ZeroParam& p = params_[bucket[k]];
      if (p.rows.size() == 0) continue;
      input.narrow(0, offsets[k], p.rows.size() * p.row_numel).copy_(p.partition.reshape({-1}));
    }
    at::Tensor output = at::empty({W * chunk}, input.options());
    group_->all_gather_into_tensor(output, input);
    for (size_t k = 0; k < bucket.size(); ++k) {
      const ZeroParam& p = params_[bucket[k]];
      at::Tensor rows = p.param.detach().view({p.dim0, p.row_numel});
      for (int r = 0; r < W; ++r) {
        const RowRange rr = shard_row_range(p.dim0, p.shard_rows, r);
        if (rr.size() == 0 || r == group_->rank()) continue;
        rows.narrow(0, rr.begin, rr.size())
            .copy_(output.narrow(0, r * chunk + offsets[k], rr.size() * p.row_numel)
                       .view({rr.size(), p.row_numel}));
      }
    }
  }
}

void ZeroPartitioner::zero_grad() {
  for (auto& p : params_) {
    if (p.partition.grad().defined()) p.partition.mutable_grad() = at::Tensor();
    if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
  }
}

}  // namespace fsdp::detail
