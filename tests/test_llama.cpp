// Llama model and Hugging Face folder loading against transformers 5.17: a tiny random
// LlamaForCausalLM written by save_pretrained (tests/hf_reference.py) is loaded by
// fsdp::load_llama and its fp32 logits must equal transformers' within 1e-4 -- grouped-query
// and multi-head attention, tied and untied embeddings, bf16 on disk, sharded index files,
// llama3 rope scaling, right padding with an attention mask, and loaded under FSDP at world 2
// (each layer sharded as it is read).
#include "fsdp/fsdp_strategy.h"
#include "fsdp/hf.h"
#include "fsdp/lightning.h"
#include "fsdp/llama.h"
#include "fsdp/trainer.h"
#include "hf_testing.h"
#include "shard/fsdp_state.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using fsdp::testing::hf_scratch;
using fsdp::testing::max_abs_diff;
using fsdp::testing::read_tensors;
using fsdp::testing::run_hf_reference;
using fsdp::testing::write_tensors;

constexpr double kTol = 1e-4;

at::Tensor sample_ids(int64_t vocab, int64_t b, int64_t t, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {b, t}, gen, at::kLong);
}

// transformers' logits for `ids` (and `mask`) from the model in `dir`; with `make_args`, the
// model is first created there by make-llama (one Python process for both).
at::Tensor hf_logits(const std::string& dir, const at::Tensor& ids, const at::Tensor& mask = {},
                     const std::vector<std::string>& make_args = {}, bool make = false) {
  const std::string in = dir + "/inputs.safetensors", out = dir + "/logits.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> t = {{"input_ids", ids}};
  if (mask.defined()) t.emplace_back("attention_mask", mask);
  write_tensors(in, t);
  std::vector<std::string> args;
  if (make) {
    args = {"make-llama", dir};
    args.insert(args.end(), make_args.begin(), make_args.end());
    args.push_back(";");
  }
  for (const std::string& a : {std::string("llama-logits"), dir, in, out}) args.push_back(a);
  run_hf_reference(args);
  return read_tensors(out).at("logits");
}

constexpr int64_t kVocab = 96;  // hf_reference.py make-llama's default

at::Tensor our_logits(fsdp::LlamaForCausalLM& model, const at::Tensor& ids, const at::Tensor& mask = {}) {
  at::NoGradGuard no_grad;
  model.eval();
  return model(ids, mask);
}

struct Case {
  std::string name;
  std::vector<std::string> args;
};

void check_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const std::string dir = hf_scratch("llama_" + c.name);
  at::Tensor ids = sample_ids(kVocab, 2, 11, 7);
  at::Tensor want = hf_logits(dir, ids, {}, c.args, /*make=*/true);
  auto model = fsdp::load_llama(dir);
  at::Tensor got = our_logits(*model, ids);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LE(max_abs_diff(got, want), kTol);
  // Not trivially equal: the logits vary.
  EXPECT_GT(want.std().item<double>(), 1e-3);
}

TEST(Llama, LogitsEqualTransformersGqaUntied) {
  check_case({"gqa_untied", {"--heads", "4", "--kv-heads", "2"}});
}

TEST(Llama, LogitsEqualTransformersMhaTied) {
  check_case({"mha_tied", {"--heads", "4", "--kv-heads", "4", "--tied"}});
}

TEST(Llama, LogitsEqualTransformersBf16ShardedFilesLlama3Rope) {
  // bf16 on disk, written as several shard files with an index; loaded to fp32 on both sides.
  check_case({"bf16_sharded", {"--heads", "8", "--kv-heads", "2", "--tied", "--dtype", "bfloat16",
                               "--max-shard-size", "20KB", "--rope-llama3"}});
  const std::string dir = hf_scratch("llama_bf16_sharded", /*keep=*/true);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
}

TEST(Llama, RightPaddingWithAttentionMask) {
  const std::string dir = hf_scratch("llama_mask");
  at::Tensor ids = sample_ids(kVocab, 3, 9, 11);
  at::Tensor mask = at::ones({3, 9}, at::kLong);
  mask[1].narrow(0, 6, 3).zero_();
  mask[2].narrow(0, 2, 7).zero_();
  at::Tensor want = hf_logits(dir, ids, mask, {}, /*make=*/true);
  auto model = fsdp::load_llama(dir);
  at::Tensor got = our_logits(*model, ids, mask);
  // Real (unmasked) positions must match; padding positions are never targets.
  at::Tensor real = mask.to(at::kBool);
  EXPECT_LE(max_abs_diff(got.index({real}), want.index({real})), kTol);
  // The mask changes nothing before the padding (causal): same as without a mask there.
  at::Tensor nomask = our_logits(*model, ids);
  EXPECT_LE(max_abs_diff(got.index({real}), nomask.index({real})), 1e-5);
}

TEST(Llama, SaveLlamaRoundTripsThroughTransformers) {
  // A random model of ours, written by save_llama, loads in transformers with the same logits
  // and loads back bitwise.
  const std::string dir = hf_scratch("llama_save");
  torch::manual_seed(3);
  fsdp::LlamaConfig cfg = fsdp::llama_preset("llama-tiny");
  cfg.tie_word_embeddings = true;
  fsdp::LlamaForCausalLM model(cfg);
  fsdp::save_llama(model, dir, at::kFloat);
  at::Tensor ids = sample_ids(cfg.vocab_size, 1, 5, 3);
  EXPECT_LE(max_abs_diff(hf_logits(dir, ids), our_logits(model, ids)), kTol);
  auto back = fsdp::load_llama(dir);
  EXPECT_TRUE(at::equal(our_logits(*back, ids), our_logits(model, ids)));
}

TEST(Llama, MissingTensorIsAClearError) {
  const std::string dir = hf_scratch("llama_missing");
  fsdp::LlamaConfig cfg = fsdp::llama_preset("llama-tiny");
  cfg.tie_word_embeddings = true;
  fsdp::LlamaForCausalLM model(cfg);
  fsdp::save_llama(model, dir);
  // Claim the tied model is untied: lm_head.weight is missing.
  cfg.tie_word_embeddings = false;
  std::ofstream(dir + "/config.json") << cfg.to_json();
  try {
    fsdp::load_llama(dir);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST(Llama, ConfigParsesOldAndNewLayouts) {
  auto a = fsdp::LlamaConfig::from_json(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,
      "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"rope_theta":500000.0,
      "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
      "high_freq_factor":4.0,"original_max_position_embeddings":8192},"eos_token_id":[1,2],
      "torch_dtype":"bfloat16"})");
  EXPECT_EQ(a.rope_theta, 500000.0);
  EXPECT_EQ(a.rope_scaling.type, "llama3");
  EXPECT_EQ(a.eos_token_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(a.dtype, "bfloat16");
  EXPECT_EQ(a.kv_heads(), 2);
  auto b = fsdp::LlamaConfig::from_json(a.to_json());
  EXPECT_EQ(b.rope_scaling.factor, 8.0);
  EXPECT_EQ(b.rope_theta, 500000.0);
  EXPECT_THROW(fsdp::LlamaConfig::from_json(R"({"model_type":"mistral"})"), c10::Error);
  EXPECT_THROW(fsdp::LlamaConfig::from_json(R"({"hidden_act":"gelu"})"), c10::Error);
  // Presets have the published sizes.
  EXPECT_NEAR(fsdp::llama_preset("llama3-8b").parameter_count() / 1e9, 8.03, 0.01);
  EXPECT_NEAR(fsdp::llama_preset("llama-1b").parameter_count() / 1e9, 1.236, 0.01);
}

// Loaded inside configure_model under FSDP at world 2: every decoder layer is sharded as soon
// as it is read (deferred units), and the sharded model's logits equal transformers'.
struct LoadedLlama : fsdp::LightningModule {
  std::string dir;
  std::shared_ptr<fsdp::LlamaForCausalLM> model;
  void configure_model() override {
    if (model) return;
    model = register_module("model", fsdp::load_llama(dir));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override { return {}; }
  fsdp::OptimizerConfig configure_optimizers() override { return {}; }
};

TEST(Llama, LoadedShardedUnderFsdpWorld2) {
  const std::string dir = hf_scratch("llama_fsdp_w2");
  at::Tensor ids = sample_ids(kVocab, 2, 7, 5);
  if (!fsdp::testing::in_child_rank()) {
    write_tensors(dir + "/want.safetensors",
                  {{"logits", hf_logits(dir, ids, {}, {"--layers", "3"}, /*make=*/true)}});
  }
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    auto world = fsdp::world_group();
    fsdp::FSDPOptions o;
    o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::llama_layer_types());
    fsdp::FSDPStrategy strategy(o);
    fsdp::LaunchInfo launch;
    launch.rank = world->rank();
    launch.world_size = launch.local_world_size = world->size();
    strategy.connect(world, launch);
    LoadedLlama lm;
    lm.dir = dir;
    fsdp::configure_model_with(strategy, lm);
    strategy.setup_module(lm);
    // Sharded while loading: setup adopted the 3 layers deferred init had already sharded (the
    // count is set by setup_module).
    EXPECT_EQ(strategy.num_deferred_units(), 3);
    // Every layer parameter is this rank's half.
    for (auto& p : lm.named_parameters()) {
      if (p.key().find("q_proj.weight") != std::string::npos) EXPECT_EQ(p.value().size(0), 32);
    }
    at::Tensor got;
    {
      at::NoGradGuard no_grad;
      lm.model->eval();
      strategy.pre_forward(lm, false);
      got = (*lm.model)(ids);
      strategy.post_eval_step(lm);
    }
    at::Tensor want = read_tensors(dir + "/want.safetensors").at("logits");
    EXPECT_LE(max_abs_diff(got, want), kTol);
  });
}

}  // namespace
