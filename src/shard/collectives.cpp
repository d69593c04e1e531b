#include "shard/collectives.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "comm/local_groups.h"
#include "common/injected_hooks.h"
#include "fsdp/memory.h"

namespace fsdp::detail {

// Note [Benchmark collectives]
// ----------------------------
// `fsdp-bench overlap` measures how much of a step's all-gather and reduce-scatter time is
// hidden behind compute by running the same step three ways (InjectedHooks::collectives, which
// only fsdp-bench installs; see Note [Injected hooks] in src/common/injected_hooks.h):
//   kReal    the real asynchronous collectives (always, outside that benchmark);
//   kLocal   no communication: each collective writes its output from this rank's own input
//            (the all-gather output gets W copies of the input, the reduce-scatter output this
//            rank's slice of the input), so the step moves the same bytes through memory and
//            its values stay finite, but no rank waits for another (the values it trains to
//            are wrong);
//   kSerial  the real collectives, each waited for as soon as it is issued (nothing overlaps).
// hidden fraction = 1 - (t_real - t_local) / (t_serial - t_local).
namespace {

BenchCollectives bench_collectives() { return injected_hooks().collectives; }

}  // namespace

namespace {
int64_t aligned_bytes(int64_t n) { return (n + 15) / 16 * 16; }
}  // namespace

// Note [Units of mixed dtypes]
// ----------------------------
// A unit may hold parameters of different dtypes when only one dtype is trainable: QLoRA's
// layers hold frozen uint8 4-bit weights, frozen fp32 norms and trainable fp32 adapters (and
// under mixed precision the adapters compute in bf16 while the uint8 weights are never cast).
// Then the all-gather moves bytes: parameter i's shard occupies aligned_bytes(numel_i *
// itemsize_i) bytes at byte offset o_i of a uint8 all-gather input (offsets 16-byte aligned, so
// every slice can be viewed as its dtype), and copy-in/copy-out view those slices as the
// parameter's compute dtype. Reduce-scatters involve trainable parameters only, which must share
// one dtype (FsdpParamGroup::init checks). A unit of one dtype all-gathers in that dtype.
FlatLayout flat_layout(const FsdpParams& params) {
  FlatLayout layout;
  for (const auto& p : params) {
    layout.bytes |= p->compute_dtype() != params.front()->compute_dtype();
  }
  for (const auto& p : params) {
    layout.all_gather_offsets.push_back(layout.all_gather_numel);
    layout.all_gather_numel +=
        layout.bytes ? aligned_bytes(p->shard_numel() * p->compute_element_size())
                     : p->shard_numel();
    if (p->requires_grad()) {
      layout.reduce_scatter_offsets.push_back(layout.reduce_scatter_numel);
      layout.reduce_scatter_numel += p->shard_numel();
    } else {
      layout.reduce_scatter_offsets.push_back(-1);
    }
  }
  return layout;
}

at::Tensor all_gather_slice(const at::Tensor& buffer, const FlatLayout& layout,
                            const FsdpParam& param, size_t i) {
  if (!layout.bytes) return buffer.narrow(-1, layout.all_gather_offsets[i], param.shard_numel());
  // See Note [Units of mixed dtypes].
  return buffer
      .narrow(-1, layout.all_gather_offsets[i], param.shard_numel() * param.compute_element_size())
      .view(param.compute_dtype());
}

// Note [Unit all-gather]
// ----------------------
// Copy-in: every sharded parameter of the unit goes into one flat all-gather input of
// ag_total = sum of shard numels elements (parameter i at offset o_i). One collective gathers
// the output (W * ag_total): rank w's input lands at [w * ag_total, (w+1) * ag_total).
// Copy-out: output.view({W, ag_total}).narrow(1, o_i, n_i) is (W, n_i); viewed as
// (W * R_i, row_i) and cut to dim0_i rows it is P_i's full value (copy_out). Both flat buffers
// are freed right after copy-out, so a unit holds 2x its unsharded bytes only while copying
// out. The buffers are in the compute dtype: bf16 all-gathers move half the bytes (see Note
// [Mixed-precision parameters] in fsdp_param.h).
AllGather all_gather(const FsdpParams& params, const FlatLayout& layout, ProcessGroup& group,
                     at::ScalarType dtype) {
  RECORD_FUNCTION("FSDP::all_gather", c10::ArrayRef<const c10::IValue>{});
  MemoryCategoryGuard category(MemoryCategory::kGathered);  // Note [Memory categories]
  const auto options = params.front()->sharded().options()
                           .dtype(layout.bytes ? at::kByte : dtype)
                           .requires_grad(false);
  at::NoGradGuard no_grad;
  AllGather ag;
  ag.input = at::empty({layout.all_gather_numel}, options);
  for (size_t i = 0; i < params.size(); ++i) {
    const FsdpParam& p = *params[i];
    // Copy-in: S flattened, cast to the all-gather dtype.
    all_gather_slice(ag.input, layout, p, i).copy_(p.sharded().detach().reshape({-1}));
  }
  ag.output = at::empty({group.size() * layout.all_gather_numel}, options);
  switch (bench_collectives()) {  // See Note [Benchmark collectives]
    case BenchCollectives::kLocal:
      for (int w = 0; w < group.size(); ++w) {
        ag.output.narrow(0, w * layout.all_gather_numel, layout.all_gather_numel).copy_(ag.input);
      }
      ag.work = done_work();
      break;
    case BenchCollectives::kSerial:
      ag.work = group.all_gather_into_tensor_async(ag.output, ag.input);
      ag.work->wait();
      break;
    case BenchCollectives::kReal:
      ag.work = group.all_gather_into_tensor_async(ag.output, ag.input);
      break;
  }
  return ag;
}

void all_gather_copy_out(AllGather& ag, const FsdpParams& params, const FlatLayout& layout) {
  RECORD_FUNCTION("FSDP::all_gather_copy_out", c10::ArrayRef<const c10::IValue>{});
  MemoryCategoryGuard category(MemoryCategory::kGathered);  // the unsharded parameters
  at::NoGradGuard no_grad;
  ag.work->wait();
  ag.input = at::Tensor();
  const int64_t world = ag.output.numel() / layout.all_gather_numel;
  at::Tensor rank_major = ag.output.view({world, layout.all_gather_numel});
  for (size_t i = 0; i < params.size(); ++i) {
    params[i]->alloc_unsharded();
    copy_out(*params[i], all_gather_slice(rank_major, layout, *params[i], i));
  }
  ag = AllGather{};
}

// Note [Unit reduce-scatter]
// --------------------------
// Trainable parameters' unsharded gradients are laid out rank-major in one flat reduce-scatter
// input (W, rs_total): row w holds, for every trainable parameter at offset o_i, the rows
// [w*R_i, (w+1)*R_i) of its gradient (zeros past dim0 and for parameters without a gradient
// this step). Reduce-scatter with AVG leaves this rank's (rs_total) slice averaged over the shard
// group; the replicate group (HYBRID, NO_SHARD) then all-reduces it with AVG. S.grad becomes a
// view into that output, or is accumulated into when it already exists (a unit called twice,
// gradient accumulation). The unsharded gradients are freed right after copy-in.
// With a shard group of one rank, P.grad is S.grad: only the replicate all-reduce runs, on a
// flat copy, and the result is written back.
std::optional<ReduceScatter> reduce_scatter(const FsdpParams& params, const FlatLayout& layout,
                                            ProcessGroup& shard_group,
                                            const ProcessGroupPtr& replicate_group,
                                            at::ScalarType dtype) {
  if (layout.reduce_scatter_numel == 0) return std::nullopt;
  bool any_grad = false;
  for (const auto& p : params) any_grad |= p->requires_grad() && p->unsharded().grad().defined();
  if (!any_grad) return std::nullopt;
  RECORD_FUNCTION("FSDP::reduce_scatter", c10::ArrayRef<const c10::IValue>{});
  MemoryCategoryGuard category(MemoryCategory::kGradients);  // Note [Memory categories]
  at::NoGradGuard no_grad;
  const auto options = params.front()->sharded().options().dtype(dtype).requires_grad(false);
  const int64_t total = layout.reduce_scatter_numel;
  ReduceScatter rs;
  // Trainable parameters share one dtype, so they are all aliased or none is; frozen ones (a
  // uint8 quantized weight is never cast) may differ. See Note [Units of mixed dtypes].
  const FsdpParam* trainable = nullptr;
  for (const auto& p : params) {
    if (p->requires_grad() && trainable == nullptr) trainable = p.get();
  }
  if (trainable->aliased()) {
    // P.grad is S.grad: nothing to scatter; average over the replicate group if there is one.
    if (!replicate_group || replicate_group->size() == 1) return std::nullopt;
    rs.output = at::zeros({total}, options);
    for (size_t i = 0; i < params.size(); ++i) {
      const FsdpParam& p = *params[i];
      if (layout.reduce_scatter_offsets[i] < 0 || !p.unsharded().grad().defined()) continue;
      rs.output.narrow(0, layout.reduce_scatter_offsets[i], p.shard_numel())
          .copy_(p.unsharded().grad().reshape({-1}));
    }
    rs.work = replicate_group->all_reduce_async(rs.output, ReduceOp::kAvg);
    rs.replicated = true;
    return rs;
  }
  const int w = shard_group.size();
  // Not pre-zeroed: copy_grad_in writes every element of a parameter's slice (padding rows as
  // zeros), and a parameter without a gradient this step gets a zero slice here. Zeroing the
  // whole buffer first was one more pass over the unit's unsharded gradient bytes.
  rs.input = at::empty({w * total}, options);
  at::Tensor rank_major = rs.input.view({w, total});
  for (size_t i = 0; i < params.size(); ++i) {
    const FsdpParam& p = *params[i];
    if (layout.reduce_scatter_offsets[i] < 0) continue;
    at::Tensor slice = rank_major.narrow(1, layout.reduce_scatter_offsets[i], p.shard_numel());
    if (p.unsharded().grad().defined()) {
      copy_grad_in(p, slice);
    } else {
      slice.zero_();
    }
  }
  for (const auto& p : params) {  // copied in: the unsharded gradients are not needed any more
    if (!p->aliased() && p->unsharded().grad().defined()) {
      p->unsharded().mutable_grad() = at::Tensor();
    }
  }
  rs.output = at::empty({total}, options);
  switch (bench_collectives()) {  // See Note [Benchmark collectives]
    case BenchCollectives::kLocal:
      rs.output.copy_(rank_major.select(0, shard_group.rank()));
      rs.work = done_work();
      break;
    case BenchCollectives::kSerial:
      rs.work = shard_group.reduce_scatter_tensor_async(rs.output, rs.input, ReduceOp::kAvg);
      rs.work->wait();
      break;
    case BenchCollectives::kReal:
      rs.work = shard_group.reduce_scatter_tensor_async(rs.output, rs.input, ReduceOp::kAvg);
      break;
  }
  return rs;
}

void reduce_scatter_copy_out(ReduceScatter& rs, const FsdpParams& params,
                             const FlatLayout& layout, const ProcessGroupPtr& replicate_group) {
  RECORD_FUNCTION("FSDP::reduce_scatter_copy_out", c10::ArrayRef<const c10::IValue>{});
  MemoryCategoryGuard category(MemoryCategory::kGradients);
  at::NoGradGuard no_grad;
  if (rs.work) rs.work->wait();
  rs.input = at::Tensor();
  if (!rs.replicated && replicate_group && replicate_group->size() > 1) {
    replicate_group->all_reduce(rs.output, ReduceOp::kAvg);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (layout.reduce_scatter_offsets[i] < 0) continue;
    FsdpParam& p = *params[i];
    // Back to S's dtype (fp32 master gradient); a no-op view without mixed precision.
    at::Tensor reduced = rs.output.narrow(0, layout.reduce_scatter_offsets[i], p.shard_numel())
                             .to(p.sharded_dtype());
    if (p.aliased()) {
      // S.grad is P.grad: write the averaged values back (only those that had a gradient).
      if (p.sharded().grad().defined()) p.sharded().grad().view({-1}).copy_(reduced);
      continue;
    }
    at::Tensor& grad = p.sharded().mutable_grad();
    if (grad.defined()) {
      grad.add_(reduced.view(p.sharded().sizes()));
    } else {
      grad = reduced.view(p.sharded().sizes());
    }
  }
}

void copy_out(const FsdpParam& param, const at::Tensor& rank_major) {
  // rank_major: (W, shard_numel) strided slice of the all-gather output. Row block w holds
  // rows [w*R, (w+1)*R) of P; only the first dim0 rows overall are real.
  TORCH_INTERNAL_ASSERT(param.unsharded_allocated(), "copy-out into freed parameter '",
                        param.fqn(), "'");
  at::Tensor target = param.unsharded().variable_data().view({param.dim0(), param.row_numel()});
  at::Tensor blocks =
      rank_major.view({param.shard_world(), param.shard_rows(), param.row_numel()});
  for (int w = 0; w < param.shard_world(); ++w) {
    const RowRange rows = param.rows_of(w);
    if (rows.size() <= 0) break;
    target.narrow(0, rows.begin, rows.size()).copy_(blocks.select(0, w).narrow(0, 0, rows.size()));
  }
}

void copy_grad_in(const FsdpParam& param, const at::Tensor& rank_major) {
  const at::Tensor& grad = param.unsharded().grad();
  TORCH_INTERNAL_ASSERT(grad.defined(), "no unsharded gradient for '", param.fqn(), "'");
  at::Tensor source = grad.detach().reshape({param.dim0(), param.row_numel()});
  at::Tensor blocks =
      rank_major.view({param.shard_world(), param.shard_rows(), param.row_numel()});
  for (int w = 0; w < param.shard_world(); ++w) {
    const RowRange rows = param.rows_of(w);
    const int64_t real = std::max<int64_t>(rows.size(), 0);
    at::Tensor block = blocks.select(0, w);
    if (real > 0) block.narrow(0, 0, real).copy_(source.narrow(0, rows.begin, real));
    if (real < param.shard_rows()) block.narrow(0, real, param.shard_rows() - real).zero_();
  }
}

at::Tensor gather_full(const FsdpParam& param, ProcessGroup& group) {
  at::NoGradGuard no_grad;
  const at::Tensor& s = param.sharded();
  if (param.aliased()) return s.detach().clone();
  at::Tensor flat =
      at::empty({group.size() * param.shard_numel()}, s.options().requires_grad(false));
  group.all_gather_into_tensor(flat, s.detach().reshape({-1}).contiguous());
  return flat.view({group.size() * param.shard_rows(), param.row_numel()})
      .narrow(0, 0, param.dim0())
      .reshape(param.full_shape())
      .clone();
}

}  // namespace fsdp::detail
