// Demo models: the Lightning demo Transformer and a GPT-2 style decoder, built from the hooked
// module base fsdp::nn::Module so that FSDP wrap policies and activation checkpointing can match
// their blocks:
//
//   auto model = fsdp::demos::make_model("transformer-tiny", dataset.vocab_size(), /*dropout=*/0.1);
//   at::Tensor logp = (*model)(batch.input, batch.target);        // (B*T, vocab) log-probs
//   at::Tensor loss = at::nll_loss(logp, batch.target.reshape(-1));
//   auto policy = fsdp::demos::layer_types("transformer-tiny");   // {EncoderLayer, DecoderLayer}
//
// Conventions shared by every demo model (so a trainer can treat them alike):
//   - forward(inputs = {input, target}) with int64 token ids of shape (B, T), batch first.
//     The Transformer feeds `target` to its decoder (as the Lightning demo does); GPT ignores it
//     (an undefined target is fine there).
//   - The output is log-probabilities of shape (B*T, vocab) (log_softmax over the last dim), so
//     `at::nll_loss(output, target.reshape(-1))` is the loss, as in the Lightning demo.
//   - Parameters are initialized in module construction order from the global torch generator:
//     torch::manual_seed(s) before construction gives the same model every time.
//   - Parameter names follow PyTorch where it is cheap: the Transformer's are those of the Python
//     demo (`embedding.weight`, `transformer.encoder.layers.0.self_attn.in_proj_weight`, ...,
//     `decoder.weight`); GPT's are `wte.weight`, `h.0.attn.in_proj_weight`, `ln_f.weight`, ...
//   - Layers read their parameters through members (e.g. `in_proj_weight`, `linear1->weight`):
//     code that swaps parameter storage (FSDP) must keep each parameter's TensorImpl (set_data,
//     storage resize) rather than register a new tensor under the same name.
#pragma once

#include "fsdp/linear_cross_entropy.h"
#include "fsdp/nn.h"
#include "fsdp/sharded_compute.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::demos {

// (T, T) additive attention mask: 0 on and below the diagonal, -inf above it (position t may
// attend to positions <= t). Same as nn.Transformer.generate_square_subsequent_mask.
at::Tensor causal_mask(int64_t t, const at::TensorOptions& options = at::kFloat);

// Which kernel computes softmax(q k^T / sqrt(D) + mask) v inside MultiheadAttention.
// See Note [Attention kernel] in src/models/attention.cpp for the measurements behind kAuto.
enum class AttentionKernel {
  kAuto,    // at::scaled_dot_product_attention where it measured faster on CPU, else kManual
  kManual,  // baddbmm (scale and mask fused) + softmax + dropout + bmm
  kSdpa,    // at::scaled_dot_product_attention, dropout inside it
};

// The kernel kAuto stands for, given the query (B, H, T, D), the key (B, H, S, D) and the
// dropout probability in effect (0 in eval mode): kSdpa for fp32 without dropout when
// T * S >= 256 * 256, else kManual.
AttentionKernel resolve_attention_kernel(AttentionKernel kernel, const at::Tensor& q,
                                         const at::Tensor& k, double dropout_p);

// softmax(q k^T / sqrt(D) + mask) v, with dropout p on the attention weights:
//   q (B, H, T, D), k and v (B, H, S, D) (any strides with unit stride in D), mask (T, S)
//   additive or undefined; returns (B, H, T, D). Under kSdpa a causal mask (causal_mask(T)) is
//   recognised and passed as is_causal, so the kernel skips the masked blocks.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask, double dropout_p,
                     AttentionKernel kernel = AttentionKernel::kAuto);

// Multi-head attention like torch.nn.MultiheadAttention (fused in-projection weight (3E, E) and
// bias (3E), out_proj (E, E) + bias, dropout on the attention weights), but batch first:
//   forward({query, key_value, attn_mask})
//     query      (B, T, E)
//     key_value  (B, S, E), or undefined for self-attention (key = value = query)
//     attn_mask  (T, S) additive float mask, or undefined for none
//   returns      (B, T, E)
// Heads are computed together (batched matmuls or one SDPA call; no per-head loop).
class MultiheadAttention : public fsdp::nn::Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }

  AttentionKernel kernel = AttentionKernel::kAuto;  // benchmarks and tests pin one

  at::Tensor in_proj_weight;  // (3E, E): rows [q; k; v]
  at::Tensor in_proj_bias;    // (3E)
  torch::nn::Linear out_proj{nullptr};  // E -> E

 private:
  int64_t embed_dim_;
  int64_t num_heads_;
  double dropout_;
};

// ---------------------------------------------------------------------------------------------
// The vocabulary as its own FSDP unit (torchtitan's `tok_embeddings` and `output` units).
//
// Vocabulary holds a (vocab, dim) matrix `weight` and an optional (vocab) `bias`, registered
// under those names (so a model's parameter names stay those of torch.nn.Embedding / Linear).
// One module serves every use of the matrix, so a tied embedding and head are one unit whose
// parameters are gathered for each call:
//   forward({ids (...) int64})                     -> embeddings (..., dim)
//   forward({x (..., dim) floating})               -> logits (..., vocab) = x W^T (+ b)
//   forward({x (N, dim) floating, target (N)})     -> mean cross-entropy (fp32 scalar) by
//                                                     fsdp::linear_cross_entropy(loss_policy)
// The demo models register their embeddings and heads as Vocabulary, and unit_types() lists it
// beside their layers, so FSDP shards the vocabulary matrices as units of their own. Such a
// unit computes on its shards (fsdp/sharded_compute.h): the matrix is never gathered, the
// tokens travel instead, and its gradient is formed sharded. With `compute_on_shards` false
// (or where the strategy cannot: one rank, HYBRID_SHARD, offload) it is gathered just before
// each use, resharded after, its gradient reduce-scattered when ready, as any unit.
class Vocabulary : public fsdp::nn::Module, public fsdp::ShardedComputeModule {
 public:
  // Adopts `weight` (vocab, dim) and `bias` (vocab, or undefined) as its parameters.
  explicit Vocabulary(at::Tensor weight, at::Tensor bias = {});
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  int64_t vocab_size() const { return weight.size(0); }
  int64_t dim() const { return weight.size(1); }

  at::Tensor weight;  // (vocab, dim)
  at::Tensor bias;    // (vocab) or undefined
  VocabLossPolicy loss_policy;  // how forward({x, target}) computes the loss
  // Compute on the shards when a strategy shards this unit (read once, at the strategy's setup).
  bool compute_on_shards = true;

  bool computes_on_shards() const override { return compute_on_shards; }
  void set_shard_context(std::shared_ptr<const ShardContext> context) override {
    shards_ = std::move(context);
  }
  // The shards this module computes with (null: its own parameters).
  const ShardContext* shard_context() const { return shards_.get(); }

 private:
  at::Tensor forward_on_shards(const at::Tensor& x, const at::Tensor& target);
  std::shared_ptr<const ShardContext> shards_;
};

// A model whose last step is a vocabulary head. loss(input, target) is the mean cross-entropy
// of target (B, T) under the head, the value of nll_loss(forward({input, target}),
// target.reshape(-1)), computed by the head unit's forward({hidden, target}) without the
// whole logits when its loss_policy chunks them.
class VocabHeadModel {
 public:
  virtual ~VocabHeadModel() = default;
  virtual at::Tensor loss(const at::Tensor& input, const at::Tensor& target) = 0;
  virtual Vocabulary& head() = 0;
};

// model.loss(input, target) for a VocabHeadModel; otherwise nll_loss of its log-probabilities.
at::Tensor language_model_loss(fsdp::nn::Module& model, const at::Tensor& input,
                               const at::Tensor& target);
// Sets the loss policy of every Vocabulary in `model` (e.g. {kWholeLogits} for the plain path).
void set_vocab_loss_policy(torch::nn::Module& model, const VocabLossPolicy& policy);
// Sets compute_on_shards of every Vocabulary in `model` (before the strategy's setup).
void set_vocab_compute_on_shards(torch::nn::Module& model, bool on);

// ---------------------------------------------------------------------------------------------
// Lightning demo Transformer (lightning.pytorch.demos.Transformer).

struct TransformerOptions {
  int64_t vocab_size = 33278;  // WikiText-2's full vocabulary
  int64_t ninp = 200;          // embedding / model width E
  int64_t nhead = 2;
  int64_t nhid = 200;          // feed-forward width
  int64_t nlayers = 2;         // encoder layers, and as many decoder layers
  double dropout = 0.2;
};

// nn.TransformerEncoderLayer, post-norm (norm_first=False), ReLU:
//   x = norm1(x + dropout(self_attn(x)))
//   x = norm2(x + dropout(linear2(dropout(relu(linear1(x))))))
// forward({x (B, S, E), src_mask (S, S) or undefined}) -> (B, S, E)
class EncoderLayer : public fsdp::nn::Module {
 public:
  EncoderLayer(int64_t d_model, int64_t nhead, int64_t dim_feedforward, double dropout);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  std::shared_ptr<MultiheadAttention> self_attn;
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};

 private:
  double dropout_;
};

// nn.TransformerDecoderLayer, post-norm, ReLU:
//   x = norm1(x + dropout(self_attn(x, tgt_mask)))
//   x = norm2(x + dropout(multihead_attn(x, memory)))
//   x = norm3(x + dropout(feed_forward(x)))
// forward({x (B, T, E), memory (B, S, E), tgt_mask (T, T) or undefined}) -> (B, T, E)
class DecoderLayer : public fsdp::nn::Module {
 public:
  DecoderLayer(int64_t d_model, int64_t nhead, int64_t dim_feedforward, double dropout);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  std::shared_ptr<MultiheadAttention> self_attn, multihead_attn;  // multihead_attn: cross
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};

 private:
  double dropout_;
};

// Embedding (vocab, ninp) scaled by sqrt(ninp) + sinusoidal positional encoding + dropout, an
// nn.Transformer-style encoder-decoder (nlayers each, final LayerNorm on both stacks), causal
// target mask, linear decoder ninp -> vocab and log_softmax.
// forward({input (B, T), target (B, T)}) -> log-probs (B*T, vocab).
//
// Differences from the Python demo, on purpose:
//   - The demo's PositionalEncoding computes `x + pe` and discards the sum (so it only applies
//     dropout); here the encoding is added, indexed by sequence position.
//   - Initialization follows nn.Transformer (xavier_uniform_ on every matrix inside the
//     encoder/decoder stacks, zero attention biases), but draws in construction order, so the
//     random streams differ from PyTorch's.
// Like the demo, the decoder reads `target` (already shifted w.r.t. input) under a causal mask
// that includes the current position; the demo's task is therefore easy, not a language model.
class Transformer : public fsdp::nn::Module, public VocabHeadModel {
 public:
  explicit Transformer(const TransformerOptions& options);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  at::Tensor loss(const at::Tensor& input, const at::Tensor& target) override;
  Vocabulary& head() override { return *decoder; }

  const TransformerOptions& options() const { return options_; }

  std::shared_ptr<Vocabulary> embedding;  // (vocab, ninp), called for input and target
  std::vector<std::shared_ptr<EncoderLayer>> encoder_layers;
  std::vector<std::shared_ptr<DecoderLayer>> decoder_layers;
  torch::nn::LayerNorm encoder_norm{nullptr}, decoder_norm{nullptr};
  std::shared_ptr<Vocabulary> decoder;  // ninp -> vocab, with bias

 private:
  // The decoder's output after decoder_norm: (B, T, E).
  at::Tensor hidden_states(const fsdp::nn::Inputs& inputs);

  // (T, E) sinusoidal encoding for the first T positions, in x's dtype and device (cached; not a
  // parameter or buffer, as in the demo, so it is in no state dict and FSDP never shards it).
  const at::Tensor& positional_encoding(int64_t t, const at::Tensor& like);

  TransformerOptions options_;
  at::Tensor pe_cache_;
};

// Parameter count of Transformer(options), computed without allocating anything.
int64_t parameter_count(const TransformerOptions& options);

// ---------------------------------------------------------------------------------------------
// GPT-2 style decoder-only language model.

struct GPTOptions {
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;  // maximum sequence length (learned position embeddings)
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double dropout = 0.0;
  // Tied embeddings: the lm head multiplies by wte.weight; no separate lm_head parameter exists
  // (the tensor is registered once, as `wte.weight`), so FSDP and checkpoints see one tensor.
  bool tie_embeddings = true;
};

// Pre-LN GPT-2 block:
//   x = x + dropout(attn(ln_1(x), causal))
//   x = x + dropout(mlp_proj(gelu_tanh(mlp_fc(ln_2(x)))))
// forward({x (B, T, C), mask (T, T)}) -> (B, T, C)
class GPTBlock : public fsdp::nn::Module {
 public:
  // n_layer only scales the init of the residual projections (GPT-2: std 0.02/sqrt(2*n_layer)).
  GPTBlock(int64_t n_embd, int64_t n_head, double dropout, int64_t n_layer);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  std::shared_ptr<MultiheadAttention> attn;
  torch::nn::Linear mlp_fc{nullptr}, mlp_proj{nullptr};  // C -> 4C -> C

 private:
  double dropout_;
};

// Token + learned position embeddings, n_layer pre-LN blocks, final LayerNorm, lm head (tied to
// wte by default), log_softmax. Init as GPT-2: N(0, 0.02) weights, zero biases, residual
// projections N(0, 0.02/sqrt(2*n_layer)).
// forward({input (B, T), target ignored}) -> log-probs (B*T, vocab); T <= block_size.
class GPT : public fsdp::nn::Module, public VocabHeadModel {
 public:
  explicit GPT(const GPTOptions& options);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;
  at::Tensor loss(const at::Tensor& input, const at::Tensor& target) override;
  Vocabulary& head() override { return options_.tie_embeddings ? *wte : *lm_head; }

  const GPTOptions& options() const { return options_; }

  // wte (vocab, n_embd) embeds the tokens and, tied, is the head too: called twice per forward.
  std::shared_ptr<Vocabulary> wte;
  torch::nn::Embedding wpe{nullptr};
  std::vector<std::shared_ptr<GPTBlock>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  std::shared_ptr<Vocabulary> lm_head;  // only when !tie_embeddings

 private:
  // ln_f's output: (B, T, C).
  at::Tensor hidden_states(const at::Tensor& idx);

  GPTOptions options_;
};

int64_t parameter_count(const GPTOptions& options);

// ---------------------------------------------------------------------------------------------
// Registry of presets by name.
//
//   transformer-tiny   vocab 128*,  ninp 32,  nhead 2,  nhid 64,   nlayers 2   (tests)
//   transformer-small  vocab 33278*, ninp 512, nhead 8,  nhid 2048, nlayers 4
//   transformer-1b     vocab 33278, ninp 1024, nhead 64, nhid 4096, nlayers 32  (~1.0e9 params)
//   transformer-3b     vocab 33278, ninp 2048, nhead 16, nhid 8192, nlayers 25  (~3.1e9 params)
//   gpt2-tiny          vocab 128*,  block 64,  n_layer 2,  n_head 2,  n_embd 32 (tests)
//   gpt2-mini          vocab 128*,  block 128, n_layer 4,  n_head 4,  n_embd 256 (make demo)
//   gpt2-124m          vocab 50257, block 1024, n_layer 12, n_head 12, n_embd 768 (~124M, tied)
//
// (*) vocab_size > 0 replaces the preset's vocabulary (pass the dataset's). The large presets
// (transformer-1b, transformer-3b, gpt2-124m) keep their published vocabulary so that their size is what the name
// says; a dataset vocabulary larger than theirs is an error.

std::vector<std::string> model_names();
bool is_transformer_model(const std::string& name);  // transformer-* vs gpt2-*
// Throws c10::Error listing the valid names for an unknown name.
TransformerOptions transformer_preset(const std::string& name, int64_t vocab_size = 0,
                                      double dropout = 0.0);
GPTOptions gpt_preset(const std::string& name, int64_t vocab_size = 0, double dropout = 0.0);

std::shared_ptr<fsdp::nn::Module> make_model(const std::string& name, int64_t vocab_size = 0,
                                             double dropout = 0.0);
// Parameter count of make_model(name, vocab_size), without constructing it.
int64_t model_parameter_count(const std::string& name, int64_t vocab_size = 0);
// The block types of the model (activation checkpointing): {EncoderLayer, DecoderLayer} for
// transformer-*, {GPTBlock} for gpt2-*.
fsdp::nn::ModuleTypes layer_types(const std::string& name);
// The FSDP units of `--wrap-policy layers`: the layer types and Vocabulary (the embedding and
// the head are units of their own).
fsdp::nn::ModuleTypes unit_types(const std::string& name);

}  // namespace fsdp::demos
