// LoRA and PEFT adapter files against peft 0.21 (tests/hf_reference.py): an adapter saved by
// fsdp.cpp loads with PeftModel.from_pretrained and gives the same logits (fp32 base within
// 1e-4; 4-bit base loaded by transformers + bitsandbytes within bf16 rounding); an adapter
// saved by PEFT loads in fsdp.cpp with the same logits. Also: a new adapter leaves the output
// unchanged, merge/unmerge, prepare_for_kbit_training (only adapters get gradients, through
// checkpointed layers), target matching and the adapter_config.json fields.
#include "fsdp/activation_checkpointing.h"
#include "fsdp/hf.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"
#include "fsdp/quantization.h"
#include "hf_testing.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace {

namespace fs = std::filesystem;
using fsdp::testing::hf_scratch;
using fsdp::testing::max_abs_diff;
using fsdp::testing::read_tensors;
using fsdp::testing::run_hf_reference;
using fsdp::testing::write_tensors;

const std::vector<std::string> kAllTargets = {"q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj", "lm_head"};

fsdp::LoraConfig lora_config() {
  fsdp::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = kAllTargets;
  return c;
}

at::Tensor logits(fsdp::LlamaForCausalLM& model, const at::Tensor& ids) {
  at::NoGradGuard g;
  return model(ids);
}

void randomize_adapters(torch::nn::Module& model, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard g;
  for (auto& [name, p] : fsdp::lora_parameters(model)) p.copy_(at::randn(p.sizes(), gen) * 0.05);
}

TEST(Lora, PeftAdaptersLoadBothWays) {
  const std::string dir = hf_scratch("lora_peft");
  const std::string base = dir + "/base", theirs = dir + "/peft_adapter", ours = dir + "/our_adapter";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor ids = at::randint(96, {2, 7}, gen);
  write_tensors(dir + "/in.safetensors", {{"input_ids", ids}});
  std::string targets;
  for (const auto& t : kAllTargets) targets += (targets.empty() ? "" : ",") + t;
  // 1. PEFT makes an adapter; its logits.
  // --inter 128: every quantized layer's in_features a multiple of the NF4 block (64), as in
  // every real Llama. bitsandbytes 0.50.2's CPU dequantize_4bit kernel (what bnb.nn.Linear4bit
  // runs on CPU) indexes the absmax per row, absmax[row * (in / 64) + col / 64], which reads the
  // wrong scale when in % 64 != 0 (down_proj of a 96-wide MLP: logits off by 0.02); its
  // quantizer and its generic backend (_dequantize_4bit_compute) use flat blocks of 64, as
  // fsdp.cpp does.
  run_hf_reference({"make-llama", base, "--tied", "--inter", "128", ";", "peft-make", base, theirs,
                    "--r", "4", "--alpha", "8", "--targets", targets, ";", "peft-logits", base, theirs,
                    dir + "/in.safetensors", dir + "/theirs.safetensors"});
  fsdp::HfLoadOptions o;
  o.adapter_dir = theirs;
  auto with_theirs = fsdp::load_llama(base, o);
  EXPECT_EQ(fsdp::lora_parameters(*with_theirs).size(), 2u * (7 * 2 + 1));
  EXPECT_LE(max_abs_diff(logits(*with_theirs, ids), read_tensors(dir + "/theirs.safetensors").at("logits")),
            1e-4);

  // 2. We make an adapter on the fp32 and on a 4-bit base; PEFT loads it.
  fsdp::HfLoadOptions dense;
  dense.lora = lora_config();
  auto ours_dense = fsdp::load_llama(base, dense);
  randomize_adapters(*ours_dense, 11);
  fsdp::save_peft_adapter(*ours_dense, *dense.lora, ours, base);
  fsdp::HfLoadOptions q = dense;
  q.quantization = fsdp::QuantizationConfig{};  // nf4, double quant, bf16 compute
  q.prepare_for_kbit_training = true;
  q.adapter_dir = ours;
  auto ours_4bit = fsdp::load_llama(base, q);
  run_hf_reference({"peft-logits", base, ours, dir + "/in.safetensors", dir + "/ours.safetensors",
                    ";", "peft-logits", base, ours, dir + "/in.safetensors",
                    dir + "/ours_merged.safetensors", "--merge",
                    ";", "peft-logits", base, ours, dir + "/in.safetensors",
                    dir + "/ours4.safetensors", "--4bit"});
  const at::Tensor want = read_tensors(dir + "/ours.safetensors").at("logits");
  const at::Tensor got = logits(*ours_dense, ids);
  EXPECT_LE(max_abs_diff(got, want), 1e-4);
  // merge_and_unload. The base ties lm_head to the embeddings and lm_head is a target: PEFT
  // merges its delta into the shared table, so the input embeddings change too and the merged
  // model is not the adapted one (their logits differ by far more than rounding); ours merges
  // the same way. Unmerging gives the adapted model back.
  const at::Tensor want_merged = read_tensors(dir + "/ours_merged.safetensors").at("logits");
  EXPECT_GT(max_abs_diff(want_merged, want), 1e-2);
  fsdp::merge_lora(*ours_dense);
  EXPECT_LE(max_abs_diff(logits(*ours_dense, ids), want_merged), 1e-4);
  fsdp::unmerge_lora(*ours_dense);
  EXPECT_LE(max_abs_diff(logits(*ours_dense, ids), want), 1e-4);
  const at::Tensor want4 = read_tensors(dir + "/ours4.safetensors").at("logits");
  const at::Tensor got4 = logits(*ours_4bit, ids);
  EXPECT_LE(max_abs_diff(got4, want4), 2e-3 * want4.abs().max().item<double>());
  EXPECT_GT(max_abs_diff(want4, want), 1e-4);  // 4-bit really is another model

  // adapter_config.json reads back as what we wrote, with PEFT's type and file names.
  auto cfg = fsdp::load_peft_config(ours);
  EXPECT_EQ(cfg.r, 4);
  EXPECT_EQ(cfg.lora_alpha, 8);
  EXPECT_EQ(cfg.target_modules, kAllTargets);
  EXPECT_TRUE(fs::exists(ours + "/adapter_model.safetensors"));
  auto keys = read_tensors(ours + "/adapter_model.safetensors");
  EXPECT_TRUE(keys.count("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(keys.count("base_model.model.lm_head.lora_B.weight"));
}

// target_modules = all-linear: the adapter is saved as PEFT saves it (the adapted layers' names,
// not the literal "all-linear", which PeftModel.from_pretrained cannot match), and PEFT loads it
// with the same logits.
TEST(Lora, AllLinearAdapterIsSavedAsPeftSavesIt) {
  const std::string dir = hf_scratch("lora_all_linear");
  const std::string base = dir + "/base", ours = dir + "/adapter";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor ids = at::randint(96, {2, 7}, gen);
  write_tensors(dir + "/in.safetensors", {{"input_ids", ids}});
  run_hf_reference({"make-llama", base, "--inter", "128"});
  fsdp::HfLoadOptions o;
  o.lora = lora_config();
  o.lora->target_modules = {"all-linear"};
  auto model = fsdp::load_llama(base, o);
  randomize_adapters(*model, 13);
  fsdp::save_peft_adapter(*model, *o.lora, ours, base);
  std::ifstream config_file(ours + "/adapter_config.json");
  const auto saved = nlohmann::json::parse(config_file);
  auto names = saved["target_modules"].get<std::vector<std::string>>();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"down_proj", "gate_proj", "k_proj", "o_proj",
                                             "q_proj", "up_proj", "v_proj"}));
  run_hf_reference({"peft-logits", base, ours, dir + "/in.safetensors", dir + "/ours.safetensors"});
  EXPECT_LE(max_abs_diff(logits(*model, ids), read_tensors(dir + "/ours.safetensors").at("logits")),
            1e-4);
}

TEST(Lora, NewAdapterIsANoOpAndMergeUnmergeRoundTrips) {
  torch::manual_seed(0);
  fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
  fsdp::LlamaForCausalLM model(c);
  at::Tensor ids = at::randint(c.vocab_size, {2, 5});
  const at::Tensor before = logits(model, ids);
  const at::Tensor w_before = model.model->layers[0]->self_attn->q_proj->dense_weight(at::kFloat);
  EXPECT_EQ(fsdp::apply_lora(model, lora_config()), 7 * 2 + 1);
  EXPECT_TRUE(at::equal(logits(model, ids), before));  // B = 0
  auto lora = std::dynamic_pointer_cast<fsdp::LoraLinear>(model.model->layers[0]->self_attn->q_proj);
  ASSERT_TRUE(lora);
  EXPECT_GT(lora->lora_A->weight.abs().sum().item<double>(), 0);  // Kaiming-uniform
  EXPECT_EQ(lora->scaling(), 2.0);
  randomize_adapters(model, 5);
  const at::Tensor adapted = logits(model, ids);
  EXPECT_GT(max_abs_diff(adapted, before), 1e-3);
  fsdp::merge_lora(model);
  EXPECT_TRUE(lora->merged());
  EXPECT_LE(max_abs_diff(logits(model, ids), adapted), 1e-5);
  fsdp::unmerge_lora(model);
  EXPECT_LE(max_abs_diff(lora->dense_weight(at::kFloat), w_before), 1e-6);
  EXPECT_LE(max_abs_diff(logits(model, ids), adapted), 1e-5);
}

TEST(Lora, OnlyAdaptersGetGradientsThroughCheckpointedQuantizedLayers) {
  torch::manual_seed(0);
  fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
  fsdp::LlamaForCausalLM model(c);
  fsdp::QuantizationConfig q;
  fsdp::quantize_linears(model, q);
  fsdp::prepare_for_kbit_training(model, /*use_gradient_checkpointing=*/true);
  EXPECT_EQ(fsdp::count_activation_checkpointed(model), c.num_hidden_layers);
  fsdp::apply_lora(model, lora_config());
  at::Tensor ids = at::randint(c.vocab_size, {2, 6});
  fsdp::causal_lm_loss(model(ids), ids).backward();
  int adapters = 0;
  for (auto& p : model.named_parameters()) {
    const bool is_lora = p.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), is_lora) << p.key();
    if (!is_lora) {
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
      continue;
    }
    ++adapters;
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    if (p.key().find("lora_B") != std::string::npos) {
      EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();  // B = 0, A != 0
    }
  }
  EXPECT_EQ(adapters, 2 * (7 * 2 + 1));
}

// HfLoadOptions::kbit_upcast: which non-quantized parameters prepare_for_kbit_training makes
// fp32 (all: PEFT's behaviour; norms; none), on a bf16 base with NF4 layers and adapters; and a
// short fine-tune's losses agree across the choices within bf16 rounding of the residual stream.
TEST(Lora, KbitUpcastChoosesWhichParametersAreFp32) {
  const fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
  std::map<fsdp::KbitUpcast, std::vector<double>> losses;
  std::map<fsdp::KbitUpcast, int64_t> dense_bytes;
  for (fsdp::KbitUpcast upcast : {fsdp::KbitUpcast::kAll, fsdp::KbitUpcast::kNorms,
                                  fsdp::KbitUpcast::kNone}) {
    SCOPED_TRACE(fsdp::to_string(upcast));
    torch::manual_seed(17);  // same base and adapter init for every choice
    fsdp::HfLoadOptions o;
    o.dtype = at::kBFloat16;
    o.quantization = fsdp::QuantizationConfig{};  // nf4, bf16 compute
    o.prepare_for_kbit_training = true;
    o.kbit_upcast = upcast;
    o.lora = lora_config();
    auto model = fsdp::make_llama(c, o);
    int64_t bytes = 0;
    for (auto& p : model->named_parameters()) {
      const std::string& k = p.key();
      const at::ScalarType dt = p.value().scalar_type();
      if (k.find(".lora_") != std::string::npos) {
        EXPECT_EQ(dt, at::kFloat) << k;  // adapters: fp32 whatever the choice
        EXPECT_TRUE(p.value().requires_grad()) << k;
        continue;
      }
      EXPECT_FALSE(p.value().requires_grad()) << k;
      if (dt == at::kByte) continue;  // NF4 storage
      bytes += p.value().nbytes();
      const bool norm = k.find("norm.weight") != std::string::npos;  // input_/post_attention_layernorm, model.norm
      const bool fp32 = upcast == fsdp::KbitUpcast::kAll || (upcast == fsdp::KbitUpcast::kNorms && norm);
      EXPECT_EQ(dt, fp32 ? at::kFloat : at::kBFloat16) << k;
    }
    dense_bytes[upcast] = bytes;
    // A short fine-tune of the adapters.
    std::vector<at::Tensor> trainable;
    for (auto& [k, p] : fsdp::lora_parameters(*model)) trainable.push_back(p);
    torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const at::Tensor ids = at::randint(c.vocab_size, {2, 16}, gen);
    for (int step = 0; step < 6; ++step) {
      opt.zero_grad();
      at::Tensor loss = fsdp::causal_lm_loss((*model)(ids), ids);
      loss.backward();
      opt.step();
      losses[upcast].push_back(loss.item<double>());
    }
  }
  // The non-quantized parameters.
  EXPECT_EQ(dense_bytes[fsdp::KbitUpcast::kNone] * 2, dense_bytes[fsdp::KbitUpcast::kAll]);
  EXPECT_GT(dense_bytes[fsdp::KbitUpcast::kNorms], dense_bytes[fsdp::KbitUpcast::kNone]);
  EXPECT_LT(dense_bytes[fsdp::KbitUpcast::kNorms], dense_bytes[fsdp::KbitUpcast::kAll]);
  const auto& all = losses[fsdp::KbitUpcast::kAll];
  EXPECT_LT(all.back(), all.front());  // it trains
  double largest = 0;
  for (fsdp::KbitUpcast upcast : {fsdp::KbitUpcast::kNorms, fsdp::KbitUpcast::kNone}) {
    for (size_t i = 0; i < all.size(); ++i) {
      const double rel = std::abs(losses[upcast][i] - all[i]) / std::abs(all[i]);
      largest = std::max(largest, rel);
      EXPECT_LE(rel, 2e-3) << fsdp::to_string(upcast) << " step " << i << ": " << losses[upcast][i]
                           << " vs " << all[i];
    }
  }
  EXPECT_GT(largest, 0.0);  // bf16 embeddings/head really changed the computation
  std::cout << "[kbit_upcast] largest relative loss difference to 'all': " << largest << "\n";
  EXPECT_EQ(fsdp::parse_kbit_upcast("norms"), fsdp::KbitUpcast::kNorms);
  EXPECT_THROW(fsdp::parse_kbit_upcast("half"), c10::Error);
}

TEST(Lora, TargetsMatchLikePeft) {
  fsdp::LoraConfig c;
  EXPECT_EQ(c.targets(), (std::vector<std::string>{"q_proj", "v_proj"}));  // PEFT's Llama default
  c.target_modules = {"q_proj", "w1"};
  EXPECT_TRUE(fsdp::is_lora_target(c, "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(fsdp::is_lora_target(c, "model.layers.0.self_attn.xq_proj"));
  c.target_modules = {"all-linear"};
  EXPECT_TRUE(fsdp::is_lora_target(c, "model.layers.0.mlp.up_proj"));
  EXPECT_FALSE(fsdp::is_lora_target(c, "lm_head"));
  c.target_modules = {};
  c.target_regex = R"(.*\.layers\.1\..*_proj)";
  EXPECT_TRUE(fsdp::is_lora_target(c, "model.layers.1.mlp.up_proj"));
  EXPECT_FALSE(fsdp::is_lora_target(c, "model.layers.0.mlp.up_proj"));
  // Nothing matches: PEFT's error.
  torch::manual_seed(0);
  fsdp::LlamaForCausalLM model(fsdp::llama_preset("llama-tiny"));
  fsdp::LoraConfig none;
  none.target_modules = {"w1", "w2"};
  try {
    fsdp::apply_lora(model, none);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not found in the base model"), std::string::npos);
  }
}

TEST(Lora, AdapterConfigJson) {
  fsdp::LoraConfig c = lora_config();
  c.lora_dropout = 0.05;
  auto j = nlohmann::json::parse(c.to_json("meta-llama/Meta-Llama-3-8B"));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["base_model_name_or_path"], "meta-llama/Meta-Llama-3-8B");
  auto back = fsdp::LoraConfig::from_json(j.dump(), "test");
  EXPECT_EQ(back.lora_dropout, 0.05);
  EXPECT_EQ(back.target_modules, kAllTargets);
  j["use_dora"] = true;
  EXPECT_THROW(fsdp::LoraConfig::from_json(j.dump(), "test"), c10::Error);
  j["use_dora"] = false;
  j["peft_type"] = "IA3";
  EXPECT_THROW(fsdp::LoraConfig::from_json(j.dump(), "test"), c10::Error);
}

}  // namespace
