// Demo models: shapes, determinism, parameter counts, causality, attention math, registry,
// and learnability of the synthetic corpus.
#include "fsdp/models.h"

#include "fsdp/data.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace {

using fsdp::demos::GPT;
using fsdp::demos::GPTOptions;
using fsdp::demos::Transformer;
using fsdp::demos::TransformerOptions;

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

at::Tensor random_tokens(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {b, t}, gen, at::kLong);
}

TEST(Transformer, ForwardShapeIsLogProbsPerToken) {
  torch::manual_seed(0);
  auto model = fsdp::demos::make_model("transformer-tiny", /*vocab_size=*/100, /*dropout=*/0.1);
  at::Tensor x = random_tokens(3, 35, 100, 1), y = random_tokens(3, 35, 100, 2);
  at::Tensor out = (*model)(x, y);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3 * 35, 100}));
  EXPECT_TRUE(at::allclose(out.exp().sum(-1), at::ones({105}), 1e-4, 1e-5));
  // nll_loss on the flattened target works as in the Lightning demo, and backward reaches every
  // parameter.
  at::Tensor loss = at::nll_loss(out, y.reshape(-1));
  loss.backward();
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(p.value().grad().defined()) << p.key();
  }
}

TEST(GPT, ForwardShapeIsLogProbsPerToken) {
  torch::manual_seed(0);
  auto model = fsdp::demos::make_model("gpt2-tiny", 50, 0.1);
  at::Tensor x = random_tokens(2, 35, 50, 1);
  at::Tensor out = (*model)(x, at::Tensor());
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{70, 50}));
  EXPECT_TRUE(at::allclose(out.exp().sum(-1), at::ones({70}), 1e-4, 1e-5));
  // Longer than block_size (64) is a clear error.
  const std::string msg = error_of([&] { (*model)(random_tokens(1, 65, 50, 3)); });
  EXPECT_NE(msg.find("block_size 64"), std::string::npos) << msg;
}

TEST(Models, DeterministicForSeed) {
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    torch::manual_seed(42);
    auto a = fsdp::demos::make_model(name, 64, 0.0);
    // ...and independent of the intra-op thread count (ranks run with cores/N threads).
    const int threads = at::get_num_threads();
    at::set_num_threads(threads == 1 ? 2 : 1);
    torch::manual_seed(42);
    auto b = fsdp::demos::make_model(name, 64, 0.0);
    at::set_num_threads(threads);
    torch::manual_seed(43);
    auto c = fsdp::demos::make_model(name, 64, 0.0);
    auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    bool any_differs = false;
    for (const auto& p : pa) {
      EXPECT_TRUE(at::equal(p.value(), pb[p.key()])) << name << " " << p.key();
      if (p.value().dim() > 1 && !at::equal(p.value(), pc[p.key()])) any_differs = true;
    }
    EXPECT_TRUE(any_differs) << name << ": a different seed gave the same weights";
    a->eval(), b->eval();
    at::Tensor x = random_tokens(2, 35, 64, 5);
    EXPECT_TRUE(at::equal((*a)(x, x), (*b)(x, x))) << name;
  }
}

TEST(Models, ParameterCountFormulaMatchesConstructedModels) {
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    for (int64_t vocab : {0, 77}) {
      auto model = fsdp::demos::make_model(name, vocab);
      EXPECT_EQ(count_parameters(*model), fsdp::demos::model_parameter_count(name, vocab))
          << name << " vocab " << vocab;
    }
  }
  // transformer-small with a small vocabulary (the layers are the preset's; ~25M parameters).
  auto small = fsdp::demos::make_model("transformer-small", 1000);
  EXPECT_EQ(count_parameters(*small), fsdp::demos::model_parameter_count("transformer-small", 1000));
  // Untied GPT has a separate lm_head (vocab x n_embd).
  GPTOptions untied = fsdp::demos::gpt_preset("gpt2-tiny", 64);
  untied.tie_embeddings = false;
  GPT gpt(untied);
  EXPECT_EQ(count_parameters(gpt), fsdp::demos::parameter_count(untied));
  EXPECT_EQ(fsdp::demos::parameter_count(untied) - fsdp::demos::model_parameter_count("gpt2-tiny", 64),
            64 * 32);
  // Without constructing: the 1B preset is about 1.0e9 parameters, and GPT-2 small has the
  // 124,439,808 parameters of the published GPT-2 (tied embeddings).
  const int64_t billion = fsdp::demos::model_parameter_count("transformer-1b");
  EXPECT_GT(billion, 0.98e9);
  EXPECT_LT(billion, 1.04e9);
  EXPECT_EQ(fsdp::demos::model_parameter_count("gpt2-124m"), 124439808);
  // make demo's model: 4 blocks of width 256 (12 * 256^2 + 13 * 256 each), 128 positions and
  // 128 tokens of width 256, the final LayerNorm.
  const int64_t d = 256;
  EXPECT_EQ(fsdp::demos::model_parameter_count("gpt2-mini", 128),
            4 * (12 * d * d + 13 * d) + 128 * d + 128 * d + 2 * d);
  EXPECT_EQ(fsdp::demos::model_parameter_count("gpt2-mini", 128), 3225088);
}

TEST(Models, ParameterNamesFollowThePythonDemo) {
  auto model = fsdp::demos::make_model("transformer-tiny");
  auto params = model->named_parameters();
  for (const char* name :
       {"embedding.weight", "transformer.encoder.layers.0.self_attn.in_proj_weight",
        "transformer.encoder.layers.1.linear2.bias", "transformer.encoder.norm.weight",
        "transformer.decoder.layers.1.multihead_attn.out_proj.weight",
        "transformer.decoder.layers.0.norm3.bias", "transformer.decoder.norm.weight",
        "decoder.weight", "decoder.bias"}) {
    EXPECT_TRUE(params.contains(name)) << name;
  }
  EXPECT_EQ(params["transformer.encoder.layers.0.self_attn.in_proj_weight"].sizes(),
            (std::vector<int64_t>{96, 32}));
  auto gpt = fsdp::demos::make_model("gpt2-tiny");
  auto gp = gpt->named_parameters();
  EXPECT_TRUE(gp.contains("wte.weight"));
  EXPECT_TRUE(gp.contains("h.1.attn.in_proj_weight"));
  EXPECT_FALSE(gp.contains("lm_head.weight"));  // tied: one tensor, registered as wte.weight
}

// Output at position t must not depend on target tokens after t (dropout 0).
TEST(Models, CausalMaskHidesFutureTokens) {
  const int64_t T = 12, V = 40, t = 5;
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    torch::manual_seed(1);
    auto model = fsdp::demos::make_model(name, V, 0.0);
    at::Tensor src = random_tokens(2, T, V, 7);
    at::Tensor tgt = random_tokens(2, T, V, 8);
    at::Tensor tgt2 = tgt.clone();
    tgt2.slice(1, t + 1, T).copy_((tgt.slice(1, t + 1, T) + 1) % V);  // change every token > t
    // GPT reads only its first input: feed the changed sequence there.
    const bool gpt = name == "gpt2-tiny";
    at::Tensor a = gpt ? (*model)(tgt) : (*model)(src, tgt);
    at::Tensor b = gpt ? (*model)(tgt2) : (*model)(src, tgt2);
    a = a.view({2, T, V}), b = b.view({2, T, V});
    EXPECT_TRUE(at::allclose(a.slice(1, 0, t + 1), b.slice(1, 0, t + 1), 1e-5, 1e-6)) << name;
    // ...while the later positions do see the change (the check is not vacuous).
    EXPECT_GT((a.slice(1, t + 1, T) - b.slice(1, t + 1, T)).abs().max().item<double>(), 1e-3)
        << name;
  }
}

// Batched attention equals a per-head reference computed the textbook way.
TEST(MultiheadAttention, MatchesPerHeadReference) {
  torch::manual_seed(3);
  const int64_t B = 2, T = 5, S = 7, E = 12, H = 3, D = E / H;
  auto mha = std::make_shared<fsdp::demos::MultiheadAttention>(E, H);
  torch::nn::init::normal_(mha->in_proj_bias);  // non-zero biases, to test their use
  torch::nn::init::normal_(mha->out_proj->bias);
  at::Tensor q_in = at::randn({B, T, E}), kv_in = at::randn({B, S, E});

  auto reference = [&](const at::Tensor& q_src, const at::Tensor& kv_src, const at::Tensor& mask) {
    const auto& w = mha->in_proj_weight;
    const auto& bias = mha->in_proj_bias;
    at::Tensor q = at::matmul(q_src, w.slice(0, 0, E).t()) + bias.slice(0, 0, E);
    at::Tensor k = at::matmul(kv_src, w.slice(0, E, 2 * E).t()) + bias.slice(0, E, 2 * E);
    at::Tensor v = at::matmul(kv_src, w.slice(0, 2 * E, 3 * E).t()) + bias.slice(0, 2 * E, 3 * E);
    std::vector<at::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      at::Tensor qh = q.slice(2, h * D, (h + 1) * D), kh = k.slice(2, h * D, (h + 1) * D);
      at::Tensor vh = v.slice(2, h * D, (h + 1) * D);
      at::Tensor s = at::matmul(qh, kh.transpose(1, 2)) / std::sqrt(double(D));
      if (mask.defined()) s = s + mask;
      heads.push_back(at::matmul(at::softmax(s, -1), vh));
    }
    return mha->out_proj(at::cat(heads, -1));
  };

  at::Tensor self_out = (*mha)(q_in, at::Tensor(), at::Tensor());
  EXPECT_TRUE(at::allclose(self_out, reference(q_in, q_in, at::Tensor()), 1e-5, 1e-6));
  at::Tensor mask = fsdp::demos::causal_mask(T);
  at::Tensor masked = (*mha)(q_in, at::Tensor(), mask);
  EXPECT_TRUE(at::allclose(masked, reference(q_in, q_in, mask), 1e-5, 1e-6));
  at::Tensor cross = (*mha)(q_in, kv_in, at::Tensor());
  EXPECT_EQ(cross.sizes(), (std::vector<int64_t>{B, T, E}));
  EXPECT_TRUE(at::allclose(cross, reference(q_in, kv_in, at::Tensor()), 1e-5, 1e-6));
}

// The SDPA kernel (at::scaled_dot_product_attention) computes what the manual kernel computes,
// forward and backward: self-attention with no mask, a causal mask (handed over as is_causal),
// an arbitrary additive mask, and cross-attention, in fp32.
TEST(MultiheadAttention, SdpaKernelMatchesTheManualKernel) {
  using fsdp::demos::AttentionKernel;
  const int64_t B = 2, T = 6, S = 9, E = 16, H = 4;
  at::Tensor arbitrary = at::randn({T, T});
  struct Case {
    const char* name;
    bool cross;
    at::Tensor mask;
  };
  for (const Case& c : {Case{"self", false, at::Tensor()},
                        Case{"causal", false, fsdp::demos::causal_mask(T)},
                        Case{"additive", false, arbitrary},
                        Case{"cross", true, at::Tensor()}}) {
    SCOPED_TRACE(c.name);
    auto run = [&](AttentionKernel kernel) {
      torch::manual_seed(11);
      auto mha = std::make_shared<fsdp::demos::MultiheadAttention>(E, H);
      torch::nn::init::normal_(mha->in_proj_bias);
      mha->kernel = kernel;
      at::Tensor x = at::randn({B, T, E}).requires_grad_(true);
      at::Tensor kv = c.cross ? at::randn({B, S, E}) : at::Tensor();
      at::Tensor out = (*mha)(x, kv, c.mask);
      (out * out).sum().backward();
      return std::make_tuple(out.detach(), x.grad(), mha->in_proj_weight.grad());
    };
    auto [out_m, dx_m, dw_m] = run(AttentionKernel::kManual);
    auto [out_s, dx_s, dw_s] = run(AttentionKernel::kSdpa);
    EXPECT_TRUE(at::allclose(out_s, out_m, 1e-5, 1e-6)) << (out_s - out_m).abs().max();
    EXPECT_TRUE(at::allclose(dx_s, dx_m, 1e-4, 1e-5)) << (dx_s - dx_m).abs().max();
    EXPECT_TRUE(at::allclose(dw_s, dw_m, 1e-4, 1e-5)) << (dw_s - dw_m).abs().max();
  }
}

// kAuto: SDPA only for fp32 without dropout and a score matrix of >= 256 x 256 (Note
// [Attention kernel]); the module really computes with the kernel it resolves to.
TEST(MultiheadAttention, AutoPicksSdpaForLongFp32SequencesWithoutDropout) {
  using fsdp::demos::AttentionKernel;
  using fsdp::demos::resolve_attention_kernel;
  auto qk = [](int64_t t, at::ScalarType dtype) { return at::zeros({1, 2, t, 8}, dtype); };
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, qk(256, at::kFloat),
                                     qk(256, at::kFloat), 0.0),
            AttentionKernel::kSdpa);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, qk(35, at::kFloat),
                                     qk(35, at::kFloat), 0.0),
            AttentionKernel::kManual);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, qk(256, at::kFloat),
                                     qk(256, at::kFloat), 0.1),
            AttentionKernel::kManual);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, qk(256, at::kBFloat16),
                                     qk(256, at::kBFloat16), 0.0),
            AttentionKernel::kManual);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kManual, qk(1024, at::kFloat),
                                     qk(1024, at::kFloat), 0.0),
            AttentionKernel::kManual);

  const int64_t T = 256, E = 16, H = 2;
  at::Tensor x = at::randn({1, T, E});
  at::Tensor mask = fsdp::demos::causal_mask(T);
  auto out = [&](AttentionKernel kernel) {
    torch::manual_seed(2);
    fsdp::demos::MultiheadAttention mha(E, H);
    mha.kernel = kernel;
    return mha(x, at::Tensor(), mask).detach();
  };
  const at::Tensor automatic = out(AttentionKernel::kAuto);
  EXPECT_TRUE(at::equal(automatic, out(AttentionKernel::kSdpa)));
  EXPECT_TRUE(at::allclose(automatic, out(AttentionKernel::kManual), 1e-5, 1e-6));
}

TEST(Models, CausalMaskValues) {
  at::Tensor m = fsdp::demos::causal_mask(3);
  EXPECT_EQ(m[0][0].item<float>(), 0.0f);
  EXPECT_EQ(m[2][1].item<float>(), 0.0f);
  EXPECT_TRUE(std::isinf(m[0][1].item<float>()) && m[0][1].item<float>() < 0);
  EXPECT_TRUE(std::isinf(m[1][2].item<float>()));
}

TEST(Models, BlocksAreHookedWrapPolicyTypes) {
  auto model = fsdp::demos::make_model("transformer-tiny");
  auto types = fsdp::demos::layer_types("transformer-tiny");
  int matched = 0, calls = 0;
  for (const auto& m : model->modules(/*include_self=*/false)) {
    if (!fsdp::nn::is_instance_of(*m, types)) continue;
    ++matched;
    auto* hooked = dynamic_cast<fsdp::nn::Module*>(m.get());
    ASSERT_NE(hooked, nullptr);
    hooked->add_pre_forward_hook([&calls](fsdp::nn::Module&, fsdp::nn::Inputs&) { ++calls; });
  }
  EXPECT_EQ(matched, 4);  // 2 encoder + 2 decoder layers
  at::Tensor x = random_tokens(1, 8, 128, 1);
  (*model)(x, x);
  EXPECT_EQ(calls, 4);  // every block runs through its hooked call operator

  auto gpt = fsdp::demos::make_model("gpt2-tiny");
  int blocks = 0;
  for (const auto& m : gpt->modules(false)) {
    blocks += fsdp::nn::is_instance_of(*m, fsdp::demos::layer_types("gpt2-tiny"));
  }
  EXPECT_EQ(blocks, 2);
}

TEST(Models, RegistryNamesAndErrors) {
  auto names = fsdp::demos::model_names();
  for (const char* n :
       {"transformer-tiny", "transformer-small", "transformer-1b", "gpt2-tiny", "gpt2-mini",
        "gpt2-124m"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  const std::string msg = error_of([] { fsdp::demos::make_model("transformer-huge"); });
  EXPECT_NE(msg.find("transformer-huge"), std::string::npos) << msg;
  EXPECT_NE(msg.find("transformer-tiny, transformer-small"), std::string::npos) << msg;
  EXPECT_THROW(fsdp::demos::layer_types("resnet"), c10::Error);
  // Presets that take the dataset's vocabulary, and the fixed-vocabulary ones.
  EXPECT_EQ(fsdp::demos::transformer_preset("transformer-tiny", 77).vocab_size, 77);
  EXPECT_EQ(fsdp::demos::transformer_preset("transformer-small").vocab_size, 33278);
  EXPECT_EQ(fsdp::demos::transformer_preset("transformer-1b", 18328).vocab_size, 33278);
  // The disk tier's demo: >= 3e9 parameters, 16 bytes each with fp32 Adam (>= 48 GB).
  EXPECT_NE(std::find(names.begin(), names.end(), "transformer-3b"), names.end());
  EXPECT_GE(fsdp::demos::model_parameter_count("transformer-3b"), 3000000000);
  EXPECT_EQ(fsdp::demos::transformer_preset("transformer-3b", 1024).vocab_size, 33278);
  const std::string too_big = error_of([] { fsdp::demos::transformer_preset("transformer-1b", 40000); });
  EXPECT_NE(too_big.find("33278"), std::string::npos) << too_big;
  EXPECT_THROW(fsdp::demos::gpt_preset("transformer-tiny"), c10::Error);
  TransformerOptions bad = fsdp::demos::transformer_preset("transformer-tiny");
  bad.nhead = 5;  // 32 % 5 != 0
  EXPECT_THROW(Transformer{bad}, c10::Error);
}

// Mixed precision casts parameters to bf16: the models must run (and train) in bf16 on CPU.
TEST(Models, RunInBFloat16CloseToFloat32) {
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    torch::manual_seed(0);
    auto model = fsdp::demos::make_model(name, 64, 0.0);
    at::Tensor x = random_tokens(2, 35, 64, 4);
    at::Tensor ref = (*model)(x, x);
    model->to(at::kBFloat16);
    at::Tensor out = (*model)(x, x);
    // Blocks compute in bf16; the log-softmax (the loss's input) is computed in fp32 on purpose
    // (bf16 log-softmax loses precision), so the output is fp32 log-probabilities.
    EXPECT_EQ(out.scalar_type(), at::kFloat) << name;
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name;
    EXPECT_LT((out.to(at::kFloat) - ref).abs().max().item<double>(), 0.2) << name;
    at::nll_loss(out.to(at::kFloat), x.reshape(-1)).backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined()) << name;
  }
}

TEST(Models, DropoutOnlyInTrainingMode) {
  for (const std::string name : {"transformer-tiny", "gpt2-tiny"}) {
    auto model = fsdp::demos::make_model(name, 64, 0.5);
    at::Tensor x = random_tokens(2, 35, 64, 4);
    EXPECT_FALSE(at::equal((*model)(x, x), (*model)(x, x))) << name;
    model->eval();
    EXPECT_TRUE(at::equal((*model)(x, x), (*model)(x, x))) << name;
  }
}

// Learnability of the synthetic corpus: 100 Adam steps of a tiny model, single process.
double train_loss_ratio(const std::string& name, double* final_loss, double* first_loss) {
  const int64_t V = 64, B = 16;
  auto corpus = std::make_shared<fsdp::demos::SyntheticCorpus>(V, 60000, /*seed=*/1);
  fsdp::DataLoader loader(corpus, B, fsdp::DistributedSampler(corpus->size(), 1, 0, true, 0));
  torch::manual_seed(0);
  auto model = fsdp::demos::make_model(name, V, 0.0);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  std::vector<double> losses;
  int64_t step = 0, epoch = 0;
  while (step < 100) {
    loader.set_epoch(epoch++);
    for (const auto& batch : loader) {
      if (step++ >= 100) break;
      opt.zero_grad();
      at::Tensor loss = at::nll_loss((*model)(batch.input, batch.target), batch.target.reshape(-1));
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
  }
  *first_loss = losses.front();
  *final_loss = 0;
  for (size_t i = losses.size() - 10; i < losses.size(); ++i) *final_loss += losses[i] / 10;
  return *final_loss / *first_loss;
}

TEST(Models, SyntheticCorpusIsLearnable) {
  // Stated bound: the mean loss of the last 10 of 100 steps is at most 0.6 of the first loss.
  // The first loss is about log(64) = 4.16; the corpus' entropy rate is ~1.21 nats.
  for (const std::string name : {"gpt2-tiny", "transformer-tiny"}) {
    double final_loss = 0, first_loss = 0;
    const double ratio = train_loss_ratio(name, &final_loss, &first_loss);
    EXPECT_LE(ratio, 0.6) << name << ": first " << first_loss << " final " << final_loss;
    EXPECT_GT(first_loss, 0.8 * std::log(64.0)) << name << ": an untrained model is near uniform";
    std::cout << "[learnability] " << name << ": first loss " << first_loss
              << ", mean of last 10 " << final_loss << " (entropy rate "
              << fsdp::demos::SyntheticCorpus::entropy_rate() << ")\n";
  }
}

}  // namespace
