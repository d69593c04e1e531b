// The chunked linear + cross-entropy (fsdp/linear_cross_entropy.h) against the plain path
// (whole logits, at::cross_entropy_loss): losses and gradients within 1e-6 relative, with a
// bias, ignored (padding) targets, uneven chunks, fp32 and fp64; the chunk rule; and the demo
// models' loss() (Vocabulary heads, tied and called twice) against nll_loss of their forward.
#include "fsdp/linear_cross_entropy.h"
#include "fsdp/models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

namespace {

// ||a - b|| / ||b||, the relative error of a whole tensor.
double relative(const at::Tensor& a, const at::Tensor& b) {
  const double denom = b.to(at::kDouble).norm().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / std::max(denom, 1e-300);
}

struct Result {
  at::Tensor loss, grad_hidden, grad_weight, grad_bias;
};

Result run(const fsdp::VocabLossPolicy& policy, at::ScalarType dtype, bool with_bias) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const int64_t N = 37, E = 16, V = 100;
  at::Tensor hidden = at::randn({N, E}, gen, at::kDouble).to(dtype).requires_grad_(true);
  at::Tensor weight = (at::randn({V, E}, gen, at::kDouble) * 0.3).to(dtype).requires_grad_(true);
  at::Tensor bias = with_bias ? (at::randn({V}, gen, at::kDouble) * 0.1).to(dtype).requires_grad_(true)
                              : at::Tensor();
  at::Tensor target = at::randint(V, {N}, gen, at::kLong);
  // Padding: every fifth token and the last two are ignored.
  target.index_put_({at::arange(0, N, 5)}, policy.ignore_index);
  target.narrow(0, N - 2, 2).fill_(policy.ignore_index);
  at::Tensor loss = fsdp::linear_cross_entropy(hidden, weight, bias, target, policy);
  // A non-unit upstream gradient, as a loss scaled for accumulation gives.
  (loss * 0.75).backward();
  return {loss.detach(), hidden.grad(), weight.grad(), with_bias ? bias.grad() : at::Tensor()};
}

void expect_same(const Result& got, const Result& want, double tol) {
  EXPECT_LE(relative(got.loss, want.loss), tol) << got.loss.item<double>() << " vs "
                                                << want.loss.item<double>();
  EXPECT_LE(relative(got.grad_hidden, want.grad_hidden), tol);
  EXPECT_LE(relative(got.grad_weight, want.grad_weight), tol);
  if (want.grad_bias.defined()) {
    ASSERT_TRUE(got.grad_bias.defined());
    EXPECT_LE(relative(got.grad_bias, want.grad_bias), tol);
  }
}

TEST(LinearCrossEntropy, ChunkedEqualsWholeLogitsWithin1e6) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool with_bias : {true, false}) {
      fsdp::VocabLossPolicy whole;
      whole.chunk_tokens = fsdp::VocabLossPolicy::kWholeLogits;
      const Result want = run(whole, dtype, with_bias);
      // The plain path is at::cross_entropy_loss itself: mean over the 28 counted targets.
      EXPECT_GT(want.loss.item<double>(), 0.0);
      for (int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{16}, fsdp::VocabLossPolicy::kAuto}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + (with_bias ? " bias" : " no bias") +
                     " chunk " + std::to_string(chunk));
        fsdp::VocabLossPolicy p;
        p.chunk_tokens = chunk;
        expect_same(run(p, dtype, with_bias), want, 1e-6);
      }
    }
  }
}

TEST(LinearCrossEntropy, FrozenHeadAndNoGradGiveTheSameLoss) {
  // Gradients are formed in forward only for inputs that require them: a frozen head (LoRA's
  // case) gets none and the hidden states the same gradient; under NoGradGuard nothing at all.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor hidden = at::randn({70, 8}, gen, at::kDouble);
  at::Tensor weight = at::randn({50, 8}, gen, at::kDouble);
  at::Tensor target = at::randint(50, {70}, gen, at::kLong);
  fsdp::VocabLossPolicy whole, chunked;
  whole.chunk_tokens = fsdp::VocabLossPolicy::kWholeLogits;
  chunked.chunk_tokens = 9;
  at::Tensor h1 = hidden.clone().requires_grad_(true);
  fsdp::linear_cross_entropy(h1, weight, {}, target, whole).backward();
  at::Tensor h2 = hidden.clone().requires_grad_(true);
  at::Tensor w2 = weight.clone();  // frozen
  at::Tensor l2 = fsdp::linear_cross_entropy(h2, w2, {}, target, chunked);
  l2.backward();
  EXPECT_LE(relative(h2.grad(), h1.grad()), 1e-12);
  EXPECT_FALSE(w2.grad().defined());
  at::Tensor h3 = hidden.clone().requires_grad_(true);
  torch::NoGradGuard no_grad;
  at::Tensor l3 = fsdp::linear_cross_entropy(h3, weight, {}, target, chunked);
  EXPECT_FALSE(l3.requires_grad());
  EXPECT_EQ(l3.item<double>(), l2.item<double>());
}

TEST(LinearCrossEntropy, IgnoredTargetsAddNothing) {
  // The same tokens with the ignored ones removed give the same mean and gradients.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor hidden = at::randn({12, 8}, gen, at::kDouble);
  at::Tensor weight = at::randn({40, 8}, gen, at::kDouble);
  at::Tensor target = at::randint(40, {12}, gen, at::kLong);
  target.narrow(0, 3, 4).fill_(-100);
  at::Tensor keep = target.ne(-100);
  fsdp::VocabLossPolicy p;
  p.chunk_tokens = 5;
  at::Tensor w1 = weight.clone().requires_grad_(true);
  at::Tensor l1 = fsdp::linear_cross_entropy(hidden, w1, {}, target, p);
  l1.backward();
  at::Tensor w2 = weight.clone().requires_grad_(true);
  at::Tensor l2 = fsdp::linear_cross_entropy(hidden.index({keep}), w2, {}, target.index({keep}), p);
  l2.backward();
  EXPECT_LE(relative(l1, l2), 1e-12);
  EXPECT_LE(relative(w1.grad(), w2.grad()), 1e-12);
  // Every target ignored: NaN, as at::cross_entropy_loss gives.
  at::Tensor none = at::full({12}, -100, at::kLong);
  EXPECT_TRUE(std::isnan(fsdp::linear_cross_entropy(hidden, weight, {}, none, p).item<double>()));
}

TEST(LinearCrossEntropy, ChunkRule) {
  fsdp::VocabLossPolicy p;  // auto: chunks of logits no larger than the hidden states
  // Whole fp32 logits of at most 64 MiB are not chunked: 140 x 33,278 x 4 B = 18.6 MB, and
  // GPT-2's 256 x 50,257 x 4 B = 51.5 MB.
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 140, 33278, 512), 140);
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 256, 50257, 768), 256);
  // At 33,278 words, 504 tokens are 67,088,448 B (at most 64 MiB = 67,108,864 B: whole) and
  // 505 tokens 67,221,560 B (chunked).
  const int64_t over = fsdp::kAutoWholeLogitsBytes / (33278 * 4) + 1;
  EXPECT_EQ(over, 505);
  EXPECT_EQ(fsdp::chunk_tokens_for(p, over - 1, 33278, 512), over - 1);
  // ceil(505 / 65) = 8 is below the 64-token floor: seven chunks of 73 (the last 67).
  EXPECT_EQ(fsdp::chunk_tokens_for(p, over, 33278, 512), 73);
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 8192, 50257, 768), 125);  // ceil(8192 / 66)
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 4096, 33278, 16), 64);  // ceil(4096 / 2080) = 2: the floor
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 100, 64, 128), 100);    // vocab <= width: one chunk
  p.chunk_tokens = 7;
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 100, 64, 8), 7);
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 5, 64, 8), 5);
  p.chunk_tokens = fsdp::VocabLossPolicy::kWholeLogits;
  EXPECT_EQ(fsdp::chunk_tokens_for(p, 100, 33278, 8), 100);
  p.chunk_tokens = -2;
  EXPECT_THROW(fsdp::chunk_tokens_for(p, 100, 64, 8), c10::Error);
}

// --- the demo models' loss() --------------------------------------------------------------------

std::map<std::string, at::Tensor> grads_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> g;
  for (auto& p : m.named_parameters()) {
    g[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::Tensor();
    p.value().mutable_grad() = at::Tensor();
  }
  return g;
}

void expect_loss_matches_forward(const std::string& name, bool tie = true) {
  SCOPED_TRACE(name + (tie ? "" : " untied"));
  torch::manual_seed(3);
  std::shared_ptr<fsdp::nn::Module> model;
  if (fsdp::demos::is_transformer_model(name)) {
    model = fsdp::demos::make_model(name, 96);
  } else {
    auto o = fsdp::demos::gpt_preset(name, 96);
    o.tie_embeddings = tie;
    model = std::make_shared<fsdp::demos::GPT>(o);
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor input = at::randint(96, {3, 10}, gen, at::kLong);
  at::Tensor target = at::randint(96, {3, 10}, gen, at::kLong);
  // Padding: the last position of every row (GPT only: the Transformer embeds its targets).
  if (!fsdp::demos::is_transformer_model(name)) target.select(1, 9).fill_(-100);

  at::Tensor plain = at::nll_loss(model->call({input, target}), target.reshape(-1), {},
                                  at::Reduction::Mean, -100);
  plain.backward();
  auto want = grads_of(*model);
  auto* lm = dynamic_cast<fsdp::demos::VocabHeadModel*>(model.get());
  ASSERT_NE(lm, nullptr);
  fsdp::VocabLossPolicy p;
  p.chunk_tokens = 7;  // 30 tokens: chunks 7, 7, 7, 7, 2
  fsdp::demos::set_vocab_loss_policy(*model, p);
  at::Tensor chunked = lm->loss(input, target);
  chunked.backward();
  auto got = grads_of(*model);
  EXPECT_LE(relative(chunked, plain), 1e-6);
  ASSERT_EQ(got.size(), want.size());
  for (auto& [fqn, g] : want) {
    ASSERT_TRUE(g.defined()) << fqn;
    ASSERT_TRUE(got[fqn].defined()) << fqn;
    EXPECT_LE(relative(got[fqn], g), 1e-6) << fqn;
  }
}

TEST(LinearCrossEntropy, ModelLossEqualsNllOfForward) {
  expect_loss_matches_forward("transformer-tiny");   // embedding called twice, head with bias
  expect_loss_matches_forward("gpt2-tiny");          // wte: embedding and tied head
  expect_loss_matches_forward("gpt2-tiny", false);   // separate lm_head
}

TEST(LinearCrossEntropy, VocabularyMatricesAreUnitTypes) {
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    auto model = fsdp::demos::make_model(name);
    const auto units = fsdp::demos::unit_types(name);
    std::vector<std::string> vocab;
    for (auto& item : model->named_modules()) {
      if (fsdp::nn::is_instance_of(*item.value(), units) &&
          !fsdp::nn::is_instance_of(*item.value(), fsdp::demos::layer_types(name))) {
        vocab.push_back(item.key());
      }
    }
    if (name == "gpt2-tiny") {
      EXPECT_EQ(vocab, std::vector<std::string>({"wte"}));  // tied: one unit
    } else {
      EXPECT_EQ(vocab, std::vector<std::string>({"embedding", "decoder"}));
    }
  }
}

}  // namespace
