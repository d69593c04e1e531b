// Llama decoder: RMSNorm, rotary embeddings, attention, MLP, layers, model. See fsdp/llama.h.
#include "fsdp/llama.h"

#include "models/detail.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>

namespace fsdp {
namespace {

// transformers' _init_weights for nn.Linear: normal(0, std) weight, zero bias.
LinearPtr init_linear(int64_t in, int64_t out, bool bias, double std) {
  auto linear = std::make_shared<Linear>(in, out, bias);
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (bias) torch::nn::init::zeros_(linear->bias);
  return linear;
}

// (D/2) inverse frequencies in fp32, with the ops (and so the roundings) of transformers'
// compute_default_rope_parameters / _compute_linear_scaling_rope_parameters /
// _compute_llama3_parameters.
at::Tensor inv_freq(const LlamaConfig& c) {
  const int64_t dim = c.head_size();
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  at::Tensor inv = at::reciprocal(at::pow(c.rope_theta, exponent));  // 1.0 / base ** (...)
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == "linear") return inv / rs.factor;
  if (rs.type != "llama3") return inv;
  const double old_len = static_cast<double>(rs.original_max_position_embeddings);
  const double low_wavelen = old_len / rs.low_freq_factor;
  const double high_wavelen = old_len / rs.high_freq_factor;
  at::Tensor wavelen = at::reciprocal(inv) * (2 * M_PI);  // 2 * pi / inv_freq
  at::Tensor llama = at::where(wavelen > low_wavelen, inv / rs.factor, inv);
  at::Tensor smooth = (at::reciprocal(wavelen) * old_len - rs.low_freq_factor) /
                      (rs.high_freq_factor - rs.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * llama / rs.factor + smooth * llama;
  at::Tensor medium = at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
  return at::where(medium, smoothed, llama);
}

// cat(-x2, x1) over the last dim's halves.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const LlamaConfig& config, int64_t seq_len) {
  at::Tensor pos = at::arange(seq_len, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv_freq(config));  // (T, D/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1);         // (T, D)
  return {emb.cos(), emb.sin()};
}

// --- RMSNorm -------------------------------------------------------------------------------------

RMSNorm::RMSNorm(int64_t hidden_size, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({hidden_size}));
}

at::Tensor RMSNorm::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);  // (..., C)
  const at::ScalarType input_dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(input_dtype);
}

// --- attention -----------------------------------------------------------------------------------

LlamaAttention::LlamaAttention(const LlamaConfig& c)
    : heads_(c.num_attention_heads),
      kv_heads_(c.kv_heads()),
      head_dim_(c.head_size()),
      dropout_(c.attention_dropout) {
  const int64_t C = c.hidden_size;
  const double std = c.initializer_range;
  register_linear(*this, "q_proj", q_proj, init_linear(C, heads_ * head_dim_, c.attention_bias, std));
  register_linear(*this, "k_proj", k_proj, init_linear(C, kv_heads_ * head_dim_, c.attention_bias, std));
  register_linear(*this, "v_proj", v_proj, init_linear(C, kv_heads_ * head_dim_, c.attention_bias, std));
  register_linear(*this, "o_proj", o_proj, init_linear(heads_ * head_dim_, C, c.attention_bias, std));
}

at::Tensor LlamaAttention::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);    // (B, T, C)
  const at::Tensor cos = demos::detail::arg(inputs, 1);  // (T, D)
  const at::Tensor sin = demos::detail::arg(inputs, 2);  // (T, D)
  const at::Tensor mask = demos::detail::arg(inputs, 3); // (B, 1, T, T) bool or undefined
  const int64_t B = x.size(0), T = x.size(1), H = heads_, KV = kv_heads_, D = head_dim_;
  at::Tensor q = (*q_proj)(x).view({B, T, H, D}).transpose(1, 2);   // (B, H, T, D)
  at::Tensor k = (*k_proj)(x).view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
  at::Tensor v = (*v_proj)(x).view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (KV != H) {  // repeat_kv: each key/value head serves H/KV query heads
    k = k.unsqueeze(2).expand({B, KV, H / KV, T, D}).reshape({B, H, T, D});
    v = v.unsqueeze(2).expand({B, KV, H / KV, T, D}).reshape({B, H, T, D});
  }
  const double dropout = is_training() ? dropout_ : 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor out = mask.defined()
                       ? at::scaled_dot_product_attention(q, k, v, mask, dropout, false, scale)
                       : at::scaled_dot_product_attention(q, k, v, {}, dropout, T > 1, scale);
  out = out.transpose(1, 2).reshape({B, T, H * D});  // (B, T, H*D)
  return (*o_proj)(out);
}

// --- MLP, layer ----------------------------------------------------------------------------------

LlamaMLP::LlamaMLP(const LlamaConfig& c) {
  const int64_t C = c.hidden_size, I = c.intermediate_size;
  const double std = c.initializer_range;
  register_linear(*this, "gate_proj", gate_proj, init_linear(C, I, c.mlp_bias, std));
  register_linear(*this, "up_proj", up_proj, init_linear(C, I, c.mlp_bias, std));
  register_linear(*this, "down_proj", down_proj, init_linear(I, C, c.mlp_bias, std));
}

at::Tensor LlamaMLP::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);
  return (*down_proj)(at::silu((*gate_proj)(x)) * (*up_proj)(x));
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& c, int64_t idx) : layer_idx(idx) {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(c));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(c));
  input_layernorm =
      register_module("input_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
}

at::Tensor LlamaDecoderLayer::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor x = demos::detail::arg(inputs, 0);  // (B, T, C)
  at::Tensor h = (*self_attn)((*input_layernorm)(x), demos::detail::arg(inputs, 1),
                              demos::detail::arg(inputs, 2), demos::detail::arg(inputs, 3));
  x = x + h;
  return x + (*mlp)((*post_attention_layernorm)(x));
}

// --- model ---------------------------------------------------------------------------------------

LlamaEmbedding::LlamaEmbedding(int64_t vocab_size, int64_t hidden_size)
    : fsdp::nn::Module("LlamaEmbedding") {
  weight = register_parameter("weight", at::empty({vocab_size, hidden_size}));
}

at::Tensor LlamaEmbedding::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor& x = demos::detail::arg(inputs, 0);
  TORCH_CHECK(x.defined(), "[LlamaEmbedding] forward needs token ids or hidden states");
  if (!x.is_floating_point()) return at::embedding(weight, x);  // (..., hidden)
  // The tied head. As Linear: an input of another floating dtype (fp32 after fp32 norms, a bf16
  // table under KbitUpcast::kNorms) is cast to the table's.
  if (x.scalar_type() != weight.scalar_type()) return at::linear(x.to(weight.scalar_type()), weight);
  return at::linear(x, weight);  // (..., vocab)
}

LlamaModel::LlamaModel(const LlamaConfig& c, const LlamaLayerHook& on_layer) : config_(c) {
  c.validate();
  embed_tokens = register_module("embed_tokens", std::make_shared<LlamaEmbedding>(c.vocab_size, c.hidden_size));
  torch::nn::init::normal_(embed_tokens->weight, 0.0, c.initializer_range);
  if (c.pad_token_id >= 0 && c.pad_token_id < c.vocab_size) {
    at::NoGradGuard no_grad;
    embed_tokens->weight[c.pad_token_id].zero_();
  }
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto layer = std::make_shared<LlamaDecoderLayer>(c, i);
    if (on_layer) on_layer(*layer, "layers." + std::to_string(i) + ".");
    // built(): complete; FSDP may shard it before the next layer exists (fsdp/init.h).
    layers.push_back(fsdp::nn::built(layer));
    list->push_back(layer);
  }
  norm = register_module("norm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps));
}

at::Tensor LlamaModel::embed(const at::Tensor& input_ids) {
  at::Tensor h = (*embed_tokens)(input_ids);
  if (input_require_grads && at::GradMode::is_enabled() && !h.requires_grad()) {
    h.requires_grad_(true);
  }
  return h;
}

const std::pair<at::Tensor, at::Tensor>& LlamaModel::cos_sin(int64_t seq_len,
                                                             const at::Tensor& like) {
  const at::ScalarType dtype = like.scalar_type();
  if (seq_len != cached_len_ || dtype != cached_dtype_ || like.device() != cached_device_) {
    auto [cos, sin] = rotary_cos_sin(config_, seq_len);  // computed on the host, in fp32
    cached_cos_sin_ = {cos.to(like.device(), dtype), sin.to(like.device(), dtype)};
    cached_len_ = seq_len;
    cached_dtype_ = dtype;
    cached_device_ = like.device();
  }
  return cached_cos_sin_;
}

at::Tensor LlamaModel::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor ids = demos::detail::arg(inputs, 0);             // (B, T)
  const at::Tensor attention_mask = demos::detail::arg(inputs, 1);  // (B, T) or undefined
  TORCH_CHECK(ids.defined() && ids.dim() == 2, "[LlamaModel] input_ids must be (batch, seq), got ",
              ids.defined() ? ids.sizes() : at::IntArrayRef{});
  const int64_t B = ids.size(0), T = ids.size(1);
  at::Tensor x = embed(ids);  // (B, T, C)
  const auto& [cos, sin] = cos_sin(T, x);
  at::Tensor mask;  // undefined: causal only (see LlamaAttention)
  if (attention_mask.defined() && !attention_mask.to(at::kBool).all().item<bool>()) {
    TORCH_CHECK(attention_mask.sizes() == ids.sizes(), "[LlamaModel] attention_mask must be ",
                ids.sizes(), ", got ", attention_mask.sizes());
    const auto bools = at::TensorOptions(at::kBool).device(x.device());
    at::Tensor causal = at::ones({T, T}, bools).tril();
    at::Tensor keys = attention_mask.to(x.device(), at::kBool).view({B, 1, 1, T});
    // A query row whose keys are all padding (left padding) attends to itself instead of
    // producing NaN; its output is never a prediction target.
    mask = (causal & keys) | at::eye(T, bools);
  }
  for (auto& layer : layers) x = (*layer)(x, cos, sin, mask);
  return (*norm)(x);
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& c, const LlamaLayerHook& on_layer)
    : config_(c) {
  LlamaLayerHook hook;
  if (on_layer) {
    hook = [&on_layer](LlamaDecoderLayer& layer, const std::string& prefix) {
      on_layer(layer, "model." + prefix);
    };
  }
  model = register_module("model", std::make_shared<LlamaModel>(c, hook));
  if (c.tie_word_embeddings) {
    register_linear(*this, "lm_head", lm_head, std::make_shared<TiedLinear>(model->embed_tokens));
  } else {
    register_linear(*this, "lm_head", lm_head,
                    init_linear(c.hidden_size, c.vocab_size, false, c.initializer_range));
  }
}

at::Tensor LlamaForCausalLM::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor h = (*model)(demos::detail::arg(inputs, 0), demos::detail::arg(inputs, 1));
  return (*lm_head)(h);  // (B, T, V)
}

at::Tensor TiedLinear::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor& x = demos::detail::arg(inputs, 0);
  TORCH_CHECK(x.defined() && x.is_floating_point(), "[TiedLinear] the head takes hidden states "
              "(a floating tensor)");
  return (*embedding_)(x);  // x E^T inside the embedding's call (gathered there under FSDP)
}

at::Tensor TiedLinear::dense_weight(at::ScalarType dtype) const {
  return embedding_->weight.detach().to(dtype);
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 3 && labels.dim() == 2 && logits.size(0) == labels.size(0) &&
                  logits.size(1) == labels.size(1),
              "[causal_lm_loss] logits must be (B, T, V) and labels (B, T); got ", logits.sizes(),
              " and ", labels.sizes());
  const int64_t T = labels.size(1), V = logits.size(2);
  // labels[:, 1:] padded with -100: the last position predicts nothing.
  at::Tensor shifted = at::constant_pad_nd(labels, {0, 1}, -100).narrow(1, 1, T);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, V}), shifted.reshape({-1}), {},
                                at::Reduction::Mean, /*ignore_index=*/-100);
}

// Note [A tied table stays in the root]
// --------------------------------------
// An untied model's embedding table and head are two matrices the root unit would hold
// unsharded together for the whole step; as units, one is gathered at a time. Measured with
// fsdp-finetune (QLoRA, PEFT's recipe, llama-1b's layout, world 2): untied, the peak went from
// 5,266 to 3,301 MB per rank at 0.96x the speed. A tied table is one matrix used at both ends
// of forward and again at the start of backward: as a unit it is gathered three times instead
// of once, and the peak is still the moment it is gathered (the all-gather output beside the
// unsharded copy): 2,800 against 2,761 MB, at 0.81x the speed. So is_unit leaves it in the
// root; of_types(llama_unit_types()) still makes it a unit for whoever wants that.
bool LlamaForCausalLM::is_unit(const torch::nn::Module& m) const {
  const bool tied = config_.tie_word_embeddings;
  if (tied && dynamic_cast<const LlamaEmbedding*>(&m)) return false;
  if (fsdp::nn::is_instance_of(m, llama_unit_types())) return true;
  return !tied && lm_head && &m == lm_head.get();
}

fsdp::nn::ModuleTypes llama_layer_types() { return fsdp::nn::module_types<LlamaDecoderLayer>(); }

fsdp::nn::ModuleTypes llama_unit_types() {
  return fsdp::nn::module_types<LlamaDecoderLayer, LlamaEmbedding>();
}

bool is_llama_unit(const LlamaForCausalLM* model, const torch::nn::Module& m) {
  return model ? model->is_unit(m) : fsdp::nn::is_instance_of(m, llama_unit_types());
}

}  // namespace fsdp
