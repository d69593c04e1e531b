// The Lightning demo Transformer: EncoderLayer, DecoderLayer, Transformer. See models.h.
#include "fsdp/models.h"

#include "models/detail.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>

namespace fsdp::demos {
namespace {

// nn.Transformer._reset_parameters: xavier_uniform_ on every matrix of the stacks.
void xavier_matrices(torch::nn::Module& module) {
  for (auto& p : module.parameters()) {
    if (p.dim() > 1) torch::nn::init::xavier_uniform_(p);
  }
}

void check_options(const TransformerOptions& o) {
  TORCH_CHECK(o.vocab_size > 0 && o.ninp > 0 && o.nhead > 0 && o.nhid > 0 && o.nlayers > 0,
              "[Transformer] options must be positive: vocab_size=", o.vocab_size,
              " ninp=", o.ninp, " nhead=", o.nhead, " nhid=", o.nhid, " nlayers=", o.nlayers);
  TORCH_CHECK(o.ninp % o.nhead == 0, "[Transformer] ninp (", o.ninp,
              ") must be divisible by nhead (", o.nhead, ")");
  TORCH_CHECK(o.dropout >= 0.0 && o.dropout < 1.0, "[Transformer] dropout must be in [0, 1), got ",
              o.dropout);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

EncoderLayer::EncoderLayer(int64_t d_model, int64_t nhead, int64_t dim_feedforward,
                           double dropout)
    : dropout_(dropout) {
  self_attn = register_module("self_attn",
                              std::make_shared<MultiheadAttention>(d_model, nhead, dropout));
  linear1 = register_module("linear1", torch::nn::Linear(d_model, dim_feedforward));
  linear2 = register_module("linear2", torch::nn::Linear(dim_feedforward, d_model));
  norm1 = register_module("norm1", detail::layer_norm(d_model));
  norm2 = register_module("norm2", detail::layer_norm(d_model));
  xavier_matrices(*this);
}

at::Tensor EncoderLayer::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor x = detail::arg(inputs, 0);           // (B, S, E)
  const at::Tensor mask = detail::arg(inputs, 1);  // (S, S) or undefined
  const bool train = is_training();
  at::Tensor a = (*self_attn)(x, at::Tensor(), mask);
  x = norm1(x + detail::dropout(a, dropout_, train));
  at::Tensor f = linear2(detail::dropout(at::relu(linear1(x)), dropout_, train));  // (B, S, E)
  return norm2(x + detail::dropout(f, dropout_, train));
}

DecoderLayer::DecoderLayer(int64_t d_model, int64_t nhead, int64_t dim_feedforward,
                           double dropout)
    : dropout_(dropout) {
  self_attn = register_module("self_attn",
                              std::make_shared<MultiheadAttention>(d_model, nhead, dropout));
  multihead_attn = register_module(
      "multihead_attn", std::make_shared<MultiheadAttention>(d_model, nhead, dropout));
  linear1 = register_module("linear1", torch::nn::Linear(d_model, dim_feedforward));
  linear2 = register_module("linear2", torch::nn::Linear(dim_feedforward, d_model));
  norm1 = register_module("norm1", detail::layer_norm(d_model));
  norm2 = register_module("norm2", detail::layer_norm(d_model));
  norm3 = register_module("norm3", detail::layer_norm(d_model));
  xavier_matrices(*this);
}

at::Tensor DecoderLayer::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor x = detail::arg(inputs, 0);             // (B, T, E)
  const at::Tensor memory = detail::arg(inputs, 1);  // (B, S, E)
  const at::Tensor mask = detail::arg(inputs, 2);    // (T, T) or undefined
  TORCH_CHECK(memory.defined(), "[DecoderLayer] forward needs {x, memory, tgt_mask}: memory is missing");
  const bool train = is_training();
  at::Tensor a = (*self_attn)(x, at::Tensor(), mask);
  x = norm1(x + detail::dropout(a, dropout_, train));
  at::Tensor c = (*multihead_attn)(x, memory, at::Tensor());
  x = norm2(x + detail::dropout(c, dropout_, train));
  at::Tensor f = linear2(detail::dropout(at::relu(linear1(x)), dropout_, train));  // (B, T, E)
  return norm3(x + detail::dropout(f, dropout_, train));
}

// ---------------------------------------------------------------------------------------------

Transformer::Transformer(const TransformerOptions& options) : options_(options) {
  check_options(options);
  const auto& o = options;
  // Registration (and so init) order: embedding, encoder layers, encoder norm, decoder layers,
  // decoder norm, decoder. Module paths mirror the Python demo's (see models.h).
  // The vocabulary matrices are Vocabulary units, initialized as torch.nn.Embedding / Linear
  // (the same draws from the generator as before they were units).
  embedding = register_module(
      "embedding", fsdp::nn::built(std::make_shared<Vocabulary>(
                       torch::nn::Embedding(o.vocab_size, o.ninp)->weight.detach())));
  auto transformer = register_module("transformer", std::make_shared<torch::nn::Module>());
  auto encoder = transformer->register_module("encoder", std::make_shared<torch::nn::Module>());
  auto encoder_list = encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.nlayers; ++i) {
    // built(): the layer is complete; FSDP may shard it now (deferred init, fsdp/init.h).
    encoder_layers.push_back(
        fsdp::nn::built(std::make_shared<EncoderLayer>(o.ninp, o.nhead, o.nhid, o.dropout)));
    encoder_list->push_back(encoder_layers.back());
  }
  encoder_norm = encoder->register_module("norm", detail::layer_norm(o.ninp));
  auto decoder_stack =
      transformer->register_module("decoder", std::make_shared<torch::nn::Module>());
  auto decoder_list = decoder_stack->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.nlayers; ++i) {
    decoder_layers.push_back(
        fsdp::nn::built(std::make_shared<DecoderLayer>(o.ninp, o.nhead, o.nhid, o.dropout)));
    decoder_list->push_back(decoder_layers.back());
  }
  decoder_norm = decoder_stack->register_module("norm", detail::layer_norm(o.ninp));
  torch::nn::Linear head(o.ninp, o.vocab_size);
  decoder = register_module("decoder", fsdp::nn::built(std::make_shared<Vocabulary>(
                                           head->weight.detach(), head->bias.detach())));
}

const at::Tensor& Transformer::positional_encoding(int64_t t, const at::Tensor& like) {
  if (!pe_cache_.defined() || pe_cache_.size(0) < t || pe_cache_.device() != like.device() ||
      pe_cache_.scalar_type() != like.scalar_type()) {
    // pe[pos, 2i] = sin(pos * w_i), pe[pos, 2i+1] = cos(pos * w_i), w_i = 10000^(-2i/E).
    // Computed in float32 like the demo, for at least 64 positions to avoid recomputation.
    const int64_t E = options_.ninp;
    const int64_t len = std::max<int64_t>(t, 64);
    at::Tensor position = at::arange(len, at::kFloat).unsqueeze(1);  // (len, 1)
    at::Tensor div_term =
        at::exp(at::arange(0, E, 2, at::kFloat) * (-std::log(10000.0) / E));  // (ceil(E/2))
    at::Tensor angles = position * div_term;                                // (len, ceil(E/2))
    at::Tensor pe = at::zeros({len, E}, at::kFloat);
    pe.slice(1, 0, E, 2).copy_(at::sin(angles));
    pe.slice(1, 1, E, 2).copy_(at::cos(angles.slice(1, 0, E / 2)));
    pe_cache_ = pe.to(like.options());
  }
  return pe_cache_;
}

at::Tensor Transformer::hidden_states(const fsdp::nn::Inputs& inputs) {
  const at::Tensor src = detail::arg(inputs, 0);  // (B, S) token ids
  const at::Tensor tgt = detail::arg(inputs, 1);  // (B, T) token ids, already shifted
  TORCH_CHECK(src.defined() && tgt.defined(),
              "[Transformer] forward needs {input, target} token ids (the demo's decoder reads "
              "the target); got ", inputs.size(), " inputs");
  TORCH_CHECK(src.dim() == 2 && tgt.dim() == 2 && src.size(0) == tgt.size(0),
              "[Transformer] input and target must be (batch, seq) with the same batch, got ",
              src.sizes(), " and ", tgt.sizes());
  const bool train = is_training();
  const double scale = std::sqrt(static_cast<double>(options_.ninp));
  auto embed = [&](const at::Tensor& ids) {
    at::Tensor e = (*embedding)(ids) * scale;  // (B, L, E)
    e = e + positional_encoding(ids.size(1), e).narrow(0, 0, ids.size(1));
    return detail::dropout(e, options_.dropout, train);
  };

  at::Tensor memory = embed(src);  // (B, S, E)
  for (auto& layer : encoder_layers) memory = (*layer)(memory, at::Tensor());
  memory = encoder_norm(memory);

  at::Tensor out = embed(tgt);                                  // (B, T, E)
  const at::Tensor mask = causal_mask(tgt.size(1), out.options());  // (T, T)
  for (auto& layer : decoder_layers) out = (*layer)(out, memory, mask);
  return decoder_norm(out);
}

at::Tensor Transformer::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor out = (*decoder)(hidden_states(inputs));    // (B, T, V)
  if (out.element_size() < 4) out = out.to(at::kFloat);  // bf16 logits: log-softmax in fp32
  return at::log_softmax(out, -1).reshape({-1, options_.vocab_size});  // (B*T, V)
}

// Between the model's own forward hooks (detail::call_with_hooks): a strategy that made the
// model a unit gathers its own parameters (the final norms) for the loss as for forward.
at::Tensor Transformer::loss(const at::Tensor& input, const at::Tensor& target) {
  return detail::call_with_hooks(*this, {input, target}, [this](const fsdp::nn::Inputs& in) {
    return (*decoder)(hidden_states(in), in[1]);
  });
}

int64_t parameter_count(const TransformerOptions& o) {
  const int64_t E = o.ninp, F = o.nhid, V = o.vocab_size;
  const int64_t attention = 3 * E * E + 3 * E + E * E + E;  // in_proj + out_proj
  const int64_t feed_forward = E * F + F + F * E + E;       // linear1 + linear2
  const int64_t norm = 2 * E;
  const int64_t encoder_layer = attention + feed_forward + 2 * norm;
  const int64_t decoder_layer = 2 * attention + feed_forward + 3 * norm;
  return V * E                                      // embedding
         + o.nlayers * (encoder_layer + decoder_layer)  //
         + 2 * norm                                 // final encoder and decoder norms
         + E * V + V;                               // decoder
}

}  // namespace fsdp::demos
