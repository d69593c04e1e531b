// merge_lora / unmerge_lora on a model sharded by FSDPStrategy. See fsdp/lora.h.
//
// Note [Merging sharded adapters]
// -------------------------------
// Under FSDP a layer's members (LoraLinear::lora_A->weight, Linear4bit::weight, ...) are the
// unsharded parameters P, whose storage is freed at rest; the shards S are what the module's
// registered parameters, the optimizer and checkpoints hold (Note [Sharded and unsharded
// parameters] in src/shard/fsdp_param.h). Merging must change S.
//
// One adapted layer at a time, in model order (every rank walks the same order, so the
// collectives line up): the full values of its lora_A, lora_B and base tensors are gathered
// from their shards over the shard group (gather_full, in the shards' dtype: the fp32 master
// copy under a MixedPrecisionPolicy), the merge is computed on them exactly as the
// single-process LoraLinear::merge computes it (delta = scaling * B A in fp32; dense: W + delta
// in W's dtype; a head tied to the embeddings: into the shared table; 4-bit: dequantize to fp32,
// add, quantize again with the layer's block size and double quantization), and each rank
// copies its own rows of the result into its shard S (and into P when its unit happens to be
// unsharded). Peak: one layer's full tensors (for a 4-bit layer, its fp32 dense weight) beside
// the shards; never the whole model. The results are bitwise those of merge_lora on the
// unsharded model (the same operations on the same values). Tensors FSDP does not manage (a
// NO_SHARD/world-1 parameter is its own shard) are changed in place.
#include "fsdp/fsdp_strategy.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"
#include "fsdp/quantization.h"
#include "shard/collectives.h"
#include "shard/fsdp_strategy_impl.h"

#include <c10/util/Exception.h>

#include <functional>
#include <unordered_map>

namespace fsdp {
namespace {

using detail::FsdpParam;

class ShardedTensors {
 public:
  explicit ShardedTensors(detail::FsdpState& state) : group_(state.shard_group().get()) {
    for (FsdpParam* p : state.all_params()) by_unsharded_[p->unsharded().unsafeGetTensorImpl()] = p;
  }

  // The full value of a layer's member tensor `t` (a new tensor when gathered).
  at::Tensor full(const at::Tensor& t) {
    FsdpParam* p = find(t);
    if (p == nullptr) return t.detach();
    if (p->aliased()) return p->sharded().detach();  // the shard is the whole parameter
    TORCH_CHECK(group_ != nullptr, "[merge_lora] FSDP has no shard group");
    return detail::gather_full(*p, *group_);
  }

  // Writes `value` (full shape) as the new value of `t`: this rank's rows into its shard, and
  // into P when P is allocated; in place for tensors FSDP does not shard.
  void write(const at::Tensor& t, const at::Tensor& value) {
    at::NoGradGuard no_grad;
    FsdpParam* p = find(t);
    if (p == nullptr || p->aliased()) {
      at::Tensor target = p ? p->sharded().detach() : t.detach();
      if (target.data_ptr() != value.data_ptr()) target.copy_(value);
      return;
    }
    const RowRange rows = p->rows_of(group_->rank());
    at::Tensor src = value.reshape({p->dim0(), p->row_numel()});
    at::Tensor dst = p->sharded().detach().view({p->shard_rows(), p->row_numel()});
    if (rows.size() > 0) {
      dst.narrow(0, 0, rows.size()).copy_(src.narrow(0, rows.begin, rows.size()));
    }
    if (p->unsharded_allocated()) p->unsharded().variable_data().copy_(value);
  }

 private:
  FsdpParam* find(const at::Tensor& t) const {
    auto it = by_unsharded_.find(t.unsafeGetTensorImpl());
    return it == by_unsharded_.end() ? nullptr : it->second;
  }
  ProcessGroup* group_;
  std::unordered_map<const c10::TensorImpl*, FsdpParam*> by_unsharded_;
};

// LoraLinear::merge / unmerge (src/lora/lora.cpp add_delta) on gathered tensors.
void merge_one(LoraLinear& l, double sign, ShardedTensors& tensors) {
  at::NoGradGuard no_grad;
  const at::Tensor a = tensors.full(l.lora_A->weight);
  const at::Tensor b = tensors.full(l.lora_B->weight);
  const at::Tensor delta = at::matmul(b.to(at::kFloat), a.to(at::kFloat)) * l.scaling() * sign;
  if (auto dense = std::dynamic_pointer_cast<Linear>(l.base_layer)) {
    at::Tensor w = tensors.full(dense->weight);  // not gathered: the tensor itself, in place
    w.add_(delta.to(w.scalar_type()));
    tensors.write(dense->weight, w);
    return;
  }
  if (auto tied = std::dynamic_pointer_cast<TiedLinear>(l.base_layer)) {
    // Into the shared embedding table, as the single-process merge (and PEFT 0.21) does.
    const at::Tensor& table_member = tied->embedding()->weight;
    at::Tensor table = tensors.full(table_member);
    table.add_(delta.to(table.scalar_type()));
    tensors.write(table_member, table);
    return;
  }
  if (auto q = std::dynamic_pointer_cast<Linear4bit>(l.base_layer)) {
    const at::Tensor packed = tensors.full(q->weight);
    const at::Tensor state = tensors.full(q->quant_state);
    const at::Tensor w = quant::dequantize_nf4(q->nf4_of(packed, state), at::kFloat) + delta;
    auto [new_packed, new_state] = q->quantize_like(w);
    tensors.write(q->weight, new_packed);
    tensors.write(q->quant_state, new_state);
    return;
  }
  TORCH_CHECK(false, "[merge_lora] merge needs a dense, tied or 4-bit base layer");
}

void merge_sharded(FSDPStrategy& strategy, torch::nn::Module& root, bool merge) {
  ShardedTensors tensors(detail::state_of(strategy));
  auto visit = [&](torch::nn::Module& m) {
    auto* l = dynamic_cast<LoraLinear*>(&m);
    if (l == nullptr || l->merged() == merge) return;
    merge_one(*l, merge ? 1.0 : -1.0, tensors);
    l->mark_merged(merge);
  };
  visit(root);
  for (auto& m : root.modules(/*include_self=*/false)) visit(*m);
}

}  // namespace

void merge_lora(FSDPStrategy& strategy, torch::nn::Module& root) {
  merge_sharded(strategy, root, /*merge=*/true);
}

void unmerge_lora(FSDPStrategy& strategy, torch::nn::Module& root) {
  merge_sharded(strategy, root, /*merge=*/false);
}

}  // namespace fsdp
