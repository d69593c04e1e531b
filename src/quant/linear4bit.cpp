// Linear4bit and quantize_linears. See include/fsdp/quantization.h.
#include "fsdp/quantization.h"

#include "fsdp/memory.h"
#include "models/detail.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstring>

namespace fsdp {
namespace {

constexpr int64_t kLinearNestedBlocksize = 256;

// Note [Linear4bit quant_state layout]
// ------------------------------------
// The quantization state of one weight is a single uint8 parameter, so that FSDP shards it with
// the packed weight and mixed precision (which casts floating parameters) leaves it alone:
//   double quant:  [ absmax: blocks x uint8 | pad to 4 | nested absmax: ceil(blocks/256) x fp32
//                    | offset: 1 x fp32 ]
//   single quant:  [ absmax: blocks x fp32 ]
// fp32 fields are read through views (.view(kFloat)) at 4-byte-aligned offsets.
struct StateLayout {
  int64_t blocks = 0;
  int64_t nested_blocks = 0;
  int64_t nested_at = 0;  // byte offset of the nested absmax
  int64_t offset_at = 0;  // byte offset of the offset
  int64_t nbytes = 0;

  StateLayout(int64_t n, int64_t blocksize, bool nested) {
    blocks = (n + blocksize - 1) / blocksize;
    if (!nested) {
      nbytes = blocks * 4;
      return;
    }
    nested_blocks = (blocks + kLinearNestedBlocksize - 1) / kLinearNestedBlocksize;
    nested_at = (blocks + 3) / 4 * 4;
    offset_at = nested_at + nested_blocks * 4;
    nbytes = offset_at + 4;
  }
};

// grad_x = grad_out W (W dequantized again: only the 4-bit weight is saved). W gets no gradient.
// `bias` is a 0-element tensor when the layer has none (autograd functions take defined tensors).
struct Nf4Linear : torch::autograd::Function<Nf4Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& bias, const Linear4bit* layer) {
    at::Tensor w = layer->dense_weight(x.scalar_type());  // (out, in)
    const bool has_bias = bias.numel() > 0;
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    ctx->saved_data["bias_grad"] = has_bias && bias.requires_grad();
    // The parameters themselves (not copies): under FSDP they are refilled before backward.
    ctx->save_for_backward({layer->weight, layer->quant_state});
    return at::linear(x, w, has_bias ? bias : at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* layer = reinterpret_cast<const Linear4bit*>(ctx->saved_data["layer"].toInt());
    ctx->get_saved_variables();  // checks the saved parameters were not modified in place
    const at::Tensor& g = grads[0];  // (..., out)
    at::Tensor grad_x = at::matmul(g, layer->dense_weight(g.scalar_type()));
    at::Tensor grad_b;
    if (ctx->saved_data["bias_grad"].toBool()) {
      grad_b = g.reshape({-1, g.size(-1)}).sum(0);
    }
    return {grad_x, grad_b, at::Tensor()};
  }
};

}  // namespace

void QuantizationConfig::validate() const {
  TORCH_CHECK(quant_type == "nf4", "[QuantizationConfig] quant_type '", quant_type,
              "' is not implemented; use \"nf4\" (the QLoRA data type)");
  TORCH_CHECK(blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0,
              "[QuantizationConfig] blocksize must be a power of two in [32, 4096], got ", blocksize);
  TORCH_CHECK(compute_dtype == at::kBFloat16 || compute_dtype == at::kFloat,
              "[QuantizationConfig] compute_dtype must be bfloat16 or float32 (CPU libtorch has "
              "no fast fp16 matmul), got ", compute_dtype);
}

int64_t linear4bit_nbytes(int64_t out_features, int64_t in_features, const QuantizationConfig& c) {
  const int64_t n = out_features * in_features;
  return (n + 1) / 2 + StateLayout(n, c.blocksize, c.double_quant).nbytes;
}

void Linear4bit::register_storage(int64_t n, bool with_bias, at::ScalarType bias_dtype) {
  StateLayout layout(n, blocksize_, nested_);
  std::optional<MemoryCategoryGuard> category;  // Note [Memory categories]; not the bias
  category.emplace(MemoryCategory::kQuantized);
  weight = register_parameter("weight", at::empty({(n + 1) / 2}, at::kByte), false);
  quant_state = register_parameter("quant_state", at::empty({layout.nbytes}, at::kByte), false);
  category.reset();
  if (with_bias) bias = register_parameter("bias", at::empty({out_}, bias_dtype), false);
}

Linear4bit::Linear4bit(int64_t in_features, int64_t out_features, bool with_bias,
                       const QuantizationConfig& config)
    : in_(in_features),
      out_(out_features),
      blocksize_(config.blocksize),
      nested_(config.double_quant),
      compute_dtype_(config.compute_dtype) {
  config.validate();
  register_storage(in_ * out_, with_bias, at::kFloat);
}

Linear4bit::Linear4bit(const at::Tensor& w, const at::Tensor& b, const QuantizationConfig& config)
    : in_(w.size(1)),
      out_(w.size(0)),
      blocksize_(config.blocksize),
      nested_(config.double_quant),
      compute_dtype_(config.compute_dtype) {
  config.validate();
  TORCH_CHECK(w.dim() == 2, "[Linear4bit] weight must be (out, in), got ", w.sizes());
  register_storage(w.numel(), b.defined(), b.defined() ? b.scalar_type() : at::kFloat);
  at::NoGradGuard no_grad;
  auto [packed, state] = quantize_like(w);
  weight.copy_(packed);
  quant_state.copy_(state);
  if (b.defined()) {
    bias.copy_(b.detach());
    bias.set_requires_grad(b.requires_grad());
  }
}

std::pair<at::Tensor, at::Tensor> Linear4bit::quantize_like(const at::Tensor& w) const {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == out_ && w.size(1) == in_, "[Linear4bit] weight must be (",
              out_, ", ", in_, "), got ", w.sizes());
  at::NoGradGuard no_grad;
  quant::Nf4Tensor q = quant::quantize_nf4(w, blocksize_, nested_);
  StateLayout layout(w.numel(), blocksize_, nested_);
  at::Tensor state = at::zeros({layout.nbytes}, at::kByte);
  if (nested_) {
    state.narrow(0, 0, layout.blocks).copy_(q.absmax);
    state.narrow(0, layout.nested_at, layout.nested_blocks * 4).view(at::kFloat).copy_(q.nested_absmax);
    std::memcpy(state.data_ptr<uint8_t>() + layout.offset_at, &q.offset, 4);
  } else {
    state.view(at::kFloat).copy_(q.absmax);
  }
  return {q.packed, state};
}

quant::Nf4Tensor Linear4bit::nf4() const {
  return nf4_of(weight, quant_state);
}

quant::Nf4Tensor Linear4bit::nf4_of(const at::Tensor& packed, const at::Tensor& quant_state_in) const {
  quant::Nf4Tensor t;
  t.shape = {out_, in_};
  t.blocksize = blocksize_;
  t.nested = nested_;
  t.packed = packed.detach();
  StateLayout layout(in_ * out_, blocksize_, nested_);
  TORCH_CHECK(packed.numel() == (in_ * out_ + 1) / 2 && quant_state_in.numel() == layout.nbytes,
              "[Linear4bit] packed weight / quant_state of ", packed.numel(), " / ",
              quant_state_in.numel(), " bytes do not fit a (", out_, ", ", in_, ") weight");
  const at::Tensor state = quant_state_in.detach();
  if (nested_) {
    t.absmax = state.narrow(0, 0, layout.blocks);
    t.nested_absmax = state.narrow(0, layout.nested_at, layout.nested_blocks * 4).view(at::kFloat);
    std::memcpy(&t.offset, state.data_ptr<uint8_t>() + layout.offset_at, 4);
  } else {
    t.absmax = state.view(at::kFloat);
  }
  return t;
}

at::Tensor Linear4bit::dense_weight(at::ScalarType dtype) const {
  MemoryCategoryGuard category(MemoryCategory::kDequantized);  // Note [Memory categories]
  return quant::dequantize_nf4(nf4(), dtype);
}

at::Tensor Linear4bit::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);  // (..., in)
  TORCH_CHECK(x.defined() && x.size(-1) == in_, "[Linear4bit] input must end in ", in_,
              " features, got ", x.defined() ? x.sizes() : at::IntArrayRef{});
  // bitsandbytes: compute in compute_dtype, return in the input's dtype.
  const at::Tensor xc = x.to(compute_dtype_);
  const at::Tensor bc = bias.defined() ? bias.to(compute_dtype_) : at::empty({0}, xc.options());
  return Nf4Linear::apply(xc, bc, this).to(x.scalar_type());
}

int quantize_linears(torch::nn::Module& root, const QuantizationConfig& config,
                     const std::string& prefix) {
  config.validate();
  auto skipped = [&](const std::string& fqn) {
    const std::string full = prefix + fqn;
    const std::string last = fqn.substr(fqn.rfind('.') == std::string::npos ? 0 : fqn.rfind('.') + 1);
    for (const auto& s : config.skip_modules) {
      if (s == last || s == full ||
          (full.size() > s.size() && full.compare(full.size() - s.size(), s.size(), s) == 0 &&
           full[full.size() - s.size() - 1] == '.')) {
        return true;
      }
    }
    return false;
  };
  int count = 0;
  auto linears = named_linears(root);
  for (auto& [fqn, layer] : linears) {
    auto* dense = dynamic_cast<Linear*>(layer.get());
    if (dense == nullptr || skipped(fqn)) continue;
    // Meta tensors (shape-only planning, fsdp::MetaInitGuard): storage of the right sizes only.
    auto q = dense->weight.is_meta()
                 ? std::make_shared<Linear4bit>(dense->in_features(), dense->out_features(),
                                                dense->bias.defined(), config)
                 : std::make_shared<Linear4bit>(dense->weight, dense->bias, config);
    layer.reset();  // drop our reference: the dense weight is freed by the replacement
    replace_linear(root, fqn, q);
    ++count;
  }
  return count;
}

}  // namespace fsdp
