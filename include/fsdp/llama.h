// Llama family decoder (Llama 2/3, and models with the same layout): RMSNorm, rotary position
// embeddings in Hugging Face's convention, SwiGLU MLP, grouped-query attention, optional tied
// embeddings. Module and parameter names are those of transformers' LlamaForCausalLM, so HF
// checkpoints and PEFT adapters map one to one:
//
//   model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight,
//   model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight
//
//   auto config = fsdp::LlamaConfig::from_file("Llama-3-8B/config.json");
//   auto model = fsdp::load_llama("Llama-3-8B");              // fsdp/hf.h: reads the weights
//   at::Tensor logits = (*model)(input_ids);                  // (B, T, vocab)
//   at::Tensor loss = fsdp::causal_lm_loss(logits, labels);   // HF's shift and ignore_index
//
// Each decoder layer is passed through fsdp::nn::built() as soon as it is complete, so under
// FSDP (FULL_SHARD / SHARD_GRAD_OP) it is sharded before the next one is constructed; the
// `on_layer` hook of the constructor runs first (the HF loader reads, quantizes and adds LoRA
// there). LlamaDecoderLayer is the activation-checkpointing type (llama_layer_types). FSDP units:
// each decoder layer and, in an untied model, the embedding table and the head (torchtitan's
// split), so the two vocabulary matrices are gathered one at a time like a layer:
//
//   fsdp::FSDPOptions o;   // `model` is read when the strategy sets up, after configure_model
//   o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_predicate(
//       [&model](const torch::nn::Module& m, int64_t) { return fsdp::is_llama_unit(model.get(), m); });
//
// (of_types(llama_unit_types()) alone leaves the untied head in the root unit, and makes a tied
// table a unit, which is_unit does not: LlamaForCausalLM::is_unit.)
//
// Semantics follow transformers 5.17 modeling_llama.py: RMSNorm computes in fp32 and multiplies
// its weight after casting back (weight * x.to(input dtype)); RoPE inv_freq = 1/theta^(2i/d),
// emb = cat(freqs, freqs), q*cos + rotate_half(q)*sin with rotate_half(x) = cat(-x2, x1);
// attention is causal scaled-dot-product attention with scale 1/sqrt(head_dim) and key/value
// heads repeated for grouped-query attention; MLP = down(silu(gate(x)) * up(x)).
// Limits: hidden_act "silu" only; rope types default, linear and llama3 (others are an error
// naming the type); no KV cache (training and full-sequence scoring only); positions are
// 0..T-1 for every row (right padding).
#pragma once

#include "fsdp/linear.h"
#include "fsdp/nn.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

struct RopeScaling {
  std::string type = "default";  // default | linear | llama3
  double factor = 1.0;           // linear, llama3
  double low_freq_factor = 1.0;  // llama3
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// transformers' LlamaConfig (the fields a Llama forward reads). from_json accepts both the
// transformers 5 layout ("rope_parameters": {"rope_type", "rope_theta", ...}, "dtype") and the
// older one ("rope_theta", "rope_scaling", "torch_dtype").
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 0;  // 0: num_attention_heads
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool attention_bias = false;
  bool mlp_bias = false;
  double attention_dropout = 0.0;
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;            // -1: none
  std::vector<int64_t> eos_token_ids;   // config "eos_token_id" (a number or a list)
  int64_t pad_token_id = -1;
  std::string dtype = "float32";        // the checkpoint's dtype ("dtype" / "torch_dtype")

  int64_t kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  // Throws c10::Error naming the first inconsistent field.
  void validate() const;
  int64_t parameter_count() const;

  static LlamaConfig from_json(const std::string& json_text, const std::string& what = "config.json");
  static LlamaConfig from_file(const std::string& path);
  // config.json as transformers 5 writes it (architectures, model_type "llama", ...).
  std::string to_json() const;
};

// Named configurations (random init or --dry-run planning):
//   llama-tiny   vocab 256, hidden 64, inter 128, 2 layers, 4 heads, 2 kv heads (tests)
//   llama-1b     Llama 3.2 1B layout: vocab 128256, hidden 2048, inter 8192, 16 layers,
//                32 heads, 8 kv heads, tied, rope llama3 (1.24e9 params)
//   llama3-8b    Llama 3 8B layout: vocab 128256, hidden 4096, inter 14336, 32 layers,
//                32 heads, 8 kv heads, untied, rope theta 5e5 (8.03e9 params)
LlamaConfig llama_preset(const std::string& name);
std::vector<std::string> llama_preset_names();

// (T, D) cos and sin tables (fp32) for positions 0..T-1, as LlamaRotaryEmbedding computes them.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const LlamaConfig& config, int64_t seq_len);

// LlamaRMSNorm: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype).
class RMSNorm : public fsdp::nn::Module {
 public:
  RMSNorm(int64_t hidden_size, double eps);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  at::Tensor weight;  // (hidden)
  double eps;
};

// forward({x (B, T, C), cos (T, D), sin (T, D), mask}) -> (B, T, C). mask: undefined (causal),
// or a bool (B, 1, T, T) "may attend" mask (causal and padding combined).
class LlamaAttention : public fsdp::nn::Module, public LinearOwner {
 public:
  explicit LlamaAttention(const LlamaConfig& config);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  LinearPtr q_proj, k_proj, v_proj, o_proj;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double dropout_;
};

class LlamaMLP : public fsdp::nn::Module, public LinearOwner {
 public:
  explicit LlamaMLP(const LlamaConfig& config);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;  // {x} -> x
  LinearPtr gate_proj, up_proj, down_proj;
};

// Pre-norm block: x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x)).
// forward({x, cos, sin, mask}) as LlamaAttention.
class LlamaDecoderLayer : public fsdp::nn::Module {
 public:
  LlamaDecoderLayer(const LlamaConfig& config, int64_t layer_idx);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  int64_t layer_idx;
};

// model.embed_tokens: the (vocab, hidden) token table as a module with FSDP's call hooks, so a
// wrap policy can make it a unit of its own (llama_unit_types). Its parameter is `weight`, as
// torch.nn.Embedding's. forward({ids int64}) -> embeddings (..., hidden);
// forward({x floating}) -> x W^T, the tied head's logits (x cast to the table's dtype first).
// A tied model calls it twice per forward, so as a unit the table is gathered for each use.
class LlamaEmbedding : public fsdp::nn::Module {
 public:
  LlamaEmbedding(int64_t vocab_size, int64_t hidden_size);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  at::Tensor weight;  // (vocab, hidden)
};

// Called for each decoder layer after construction and before fsdp::nn::built(): load its
// weights, quantize, add adapters. `prefix` is its FQN with a trailing dot
// ("model.layers.3.").
using LlamaLayerHook = std::function<void(LlamaDecoderLayer& layer, const std::string& prefix)>;

// The stack without the head. forward({input_ids (B, T), attention_mask (B, T) or undefined})
// -> hidden states (B, T, C) after the final norm.
class LlamaModel : public fsdp::nn::Module {
 public:
  LlamaModel(const LlamaConfig& config, const LlamaLayerHook& on_layer = {});
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  // Embeddings of `input_ids`; when input gradients are enabled (enable_input_require_grads,
  // as PEFT's prepare_model_for_kbit_training asks) the output requires grad even with a
  // frozen table, so checkpointed layers above it back-propagate.
  at::Tensor embed(const at::Tensor& input_ids);

  std::shared_ptr<LlamaEmbedding> embed_tokens;
  std::vector<std::shared_ptr<LlamaDecoderLayer>> layers;
  std::shared_ptr<RMSNorm> norm;
  bool input_require_grads = false;

 private:
  // The rotary tables for seq_len positions in `like`'s dtype, on its device (cached).
  const std::pair<at::Tensor, at::Tensor>& cos_sin(int64_t seq_len, const at::Tensor& like);
  LlamaConfig config_;
  int64_t cached_len_ = -1;
  at::ScalarType cached_dtype_ = at::kFloat;
  c10::Device cached_device_{c10::kCPU};
  std::pair<at::Tensor, at::Tensor> cached_cos_sin_;
};

// forward({input_ids (B, T) int64, attention_mask (B, T) or undefined}) -> logits (B, T, vocab)
// in the head's dtype. With tie_word_embeddings the head reads model.embed_tokens.weight (one
// tensor, registered once, as transformers ties them).
class LlamaForCausalLM : public fsdp::nn::Module, public LinearOwner {
 public:
  // Random init as transformers' _init_weights (normal(0, initializer_range) for linear and
  // embedding weights, ones for norms), in construction order from the global generator.
  explicit LlamaForCausalLM(const LlamaConfig& config, const LlamaLayerHook& on_layer = {});
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  const LlamaConfig& config() const { return config_; }
  // Whether FSDP should make `m` a unit of its own: a decoder layer and, untied, the embedding
  // table and the head as it is now (a Linear, a Linear4bit or the LoRA adapter around one,
  // which no type names). A tied table stays in the root unit: as a unit it measured slower at
  // the same peak (Note [A tied table stays in the root] in src/models/llama.cpp).
  bool is_unit(const torch::nn::Module& m) const;

  std::shared_ptr<LlamaModel> model;
  LinearPtr lm_head;

 private:
  LlamaConfig config_;
};

// The lm head of a tied model: logits = x E^T for the embedding table E, computed by calling
// the embedding module (through its hooks, so an FSDP unit gathers E for it; nothing registered
// here).
class TiedLinear : public LinearLayer {
 public:
  explicit TiedLinear(std::shared_ptr<LlamaEmbedding> embedding) : embedding_(std::move(embedding)) {}
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  int64_t in_features() const override { return embedding_->weight.size(1); }
  int64_t out_features() const override { return embedding_->weight.size(0); }
  at::Tensor dense_weight(at::ScalarType dtype) const override;
  at::Tensor dense_bias() const override { return {}; }
  // The embedding module whose table is this head's weight (LoRA merges into it).
  const std::shared_ptr<LlamaEmbedding>& embedding() const { return embedding_; }

 private:
  std::shared_ptr<LlamaEmbedding> embedding_;
};

// transformers' ForCausalLMLoss: mean cross-entropy (in fp32) of logits[:, t] against
// labels[:, t+1], ignoring label -100. logits (B, T, V), labels (B, T) int64.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

// {LlamaDecoderLayer}: the activation-checkpointing type, and FSDP units that leave the
// vocabulary in the root unit.
fsdp::nn::ModuleTypes llama_layer_types();
// {LlamaDecoderLayer, LlamaEmbedding}: FSDP units by type, the embedding table one of its own
// (torchtitan's tok_embeddings unit). The untied head has no type of its own: a policy that
// makes it a unit too asks LlamaForCausalLM::is_unit (AutoWrapPolicy::of_predicate).
fsdp::nn::ModuleTypes llama_unit_types();
// For a wrap policy made before the model exists (AutoWrapPolicy::of_predicate):
// model->is_unit(m) once `model` is built; before that (the layers configure_model passes
// through fsdp::nn::built) by type, llama_unit_types().
bool is_llama_unit(const LlamaForCausalLM* model, const torch::nn::Module& m);

}  // namespace fsdp
