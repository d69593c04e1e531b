// GPT-2 style decoder-only model: GPTBlock, GPT. See models.h.
#include "fsdp/models.h"

#include "models/detail.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>

namespace fsdp::demos {
namespace {

constexpr double kInitStd = 0.02;  // GPT-2's initializer_range

void normal_init(torch::nn::Linear& linear, double std) {
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
}

}  // namespace

GPTBlock::GPTBlock(int64_t n_embd, int64_t n_head, double dropout, int64_t n_layer)
    : dropout_(dropout) {
  TORCH_CHECK(n_layer > 0, "[GPTBlock] n_layer must be positive, got ", n_layer);
  ln_1 = register_module("ln_1", detail::layer_norm(n_embd));
  attn = register_module("attn", std::make_shared<MultiheadAttention>(n_embd, n_head, dropout));
  ln_2 = register_module("ln_2", detail::layer_norm(n_embd));
  mlp_fc = register_module("mlp_fc", torch::nn::Linear(n_embd, 4 * n_embd));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * n_embd, n_embd));
  // GPT-2 init; the two projections into the residual stream are scaled down by depth.
  const double residual_std = kInitStd / std::sqrt(2.0 * static_cast<double>(n_layer));
  torch::nn::init::normal_(attn->in_proj_weight, 0.0, kInitStd);
  torch::nn::init::zeros_(attn->in_proj_bias);
  normal_init(attn->out_proj, residual_std);
  normal_init(mlp_fc, kInitStd);
  normal_init(mlp_proj, residual_std);
}

at::Tensor GPTBlock::forward(const fsdp::nn::Inputs& inputs) {
  at::Tensor x = detail::arg(inputs, 0);           // (B, T, C)
  const at::Tensor mask = detail::arg(inputs, 1);  // (T, T) causal
  const bool train = is_training();
  at::Tensor a = (*attn)(ln_1(x), at::Tensor(), mask);
  x = x + detail::dropout(a, dropout_, train);
  at::Tensor h = at::gelu(mlp_fc(ln_2(x)), "tanh");  // (B, T, 4C)
  return x + detail::dropout(mlp_proj(h), dropout_, train);
}

GPT::GPT(const GPTOptions& o) : options_(o) {
  TORCH_CHECK(o.vocab_size > 0 && o.block_size > 0 && o.n_layer > 0 && o.n_head > 0 &&
                  o.n_embd > 0 && o.n_embd % o.n_head == 0,
              "[GPT] invalid options: vocab_size=", o.vocab_size, " block_size=", o.block_size,
              " n_layer=", o.n_layer, " n_head=", o.n_head, " n_embd=", o.n_embd,
              " (all positive, n_embd divisible by n_head)");
  TORCH_CHECK(o.dropout >= 0.0 && o.dropout < 1.0, "[GPT] dropout must be in [0, 1), got ",
              o.dropout);
  // The generator's draws in the order of the torch.nn modules wte used to be: both tables'
  // default init, then GPT-2's. wte is then registered (and, under deferred init, sharded) first.
  at::Tensor wte_weight = torch::nn::Embedding(o.vocab_size, o.n_embd)->weight.detach();
  torch::nn::Embedding wpe_table(o.block_size, o.n_embd);
  torch::nn::init::normal_(wte_weight, 0.0, kInitStd);
  torch::nn::init::normal_(wpe_table->weight, 0.0, kInitStd);
  wte = register_module("wte", fsdp::nn::built(std::make_shared<Vocabulary>(wte_weight)));
  wpe = register_module("wpe", wpe_table);
  auto h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) {
    // built(): the block is complete; FSDP may shard it now (deferred init, fsdp/init.h).
    blocks.push_back(
        fsdp::nn::built(std::make_shared<GPTBlock>(o.n_embd, o.n_head, o.dropout, o.n_layer)));
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", detail::layer_norm(o.n_embd));
  if (!o.tie_embeddings) {
    at::Tensor w =
        torch::nn::Linear(torch::nn::LinearOptions(o.n_embd, o.vocab_size).bias(false))->weight.detach();
    torch::nn::init::normal_(w, 0.0, kInitStd);
    lm_head = register_module("lm_head", fsdp::nn::built(std::make_shared<Vocabulary>(w)));
  }
}

at::Tensor GPT::hidden_states(const at::Tensor& idx) {
  TORCH_CHECK(idx.defined() && idx.dim() == 2, "[GPT] input must be (batch, seq) token ids, got ",
              idx.defined() ? idx.sizes() : at::IntArrayRef{});
  const int64_t T = idx.size(1);
  TORCH_CHECK(T <= options_.block_size, "[GPT] sequence length ", T, " exceeds block_size ",
              options_.block_size, "; use a shorter block or a model with a larger block_size");
  at::Tensor pos = at::arange(T, idx.options());       // (T)
  at::Tensor x = (*wte)(idx) + wpe(pos);               // (B, T, C)
  x = detail::dropout(x, options_.dropout, is_training());
  const at::Tensor mask = causal_mask(T, x.options());  // (T, T)
  for (auto& block : blocks) x = (*block)(x, mask);
  return ln_f(x);
}

at::Tensor GPT::forward(const fsdp::nn::Inputs& inputs) {
  // inputs[1] (the target) is ignored. Tied head: logits = x wte^T, a second call of the wte
  // unit, which reads the one registered tensor wte.weight.
  at::Tensor logits = head()(hidden_states(detail::arg(inputs, 0)));  // (B, T, V)
  if (logits.element_size() < 4) logits = logits.to(at::kFloat);    // bf16: log-softmax in fp32
  return at::log_softmax(logits, -1).reshape({-1, options_.vocab_size});  // (B*T, V)
}

// Between the model's own forward hooks, as Transformer::loss (transformer.cpp).
at::Tensor GPT::loss(const at::Tensor& input, const at::Tensor& target) {
  return detail::call_with_hooks(*this, {input, target}, [this](const fsdp::nn::Inputs& in) {
    return head()(hidden_states(in[0]), in[1]);
  });
}

int64_t parameter_count(const GPTOptions& o) {
  const int64_t C = o.n_embd, V = o.vocab_size;
  const int64_t block = 2 * C                   // ln_1
                        + 3 * C * C + 3 * C     // attn in_proj
                        + C * C + C             // attn out_proj
                        + 2 * C                 // ln_2
                        + C * 4 * C + 4 * C     // mlp_fc
                        + 4 * C * C + C;        // mlp_proj
  return V * C + o.block_size * C + o.n_layer * block + 2 * C +
         (o.tie_embeddings ? 0 : C * V);
}

}  // namespace fsdp::demos
