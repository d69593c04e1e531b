// fsdp-finetune end to end: a tiny Llama folder (save_llama) and a byte-level tokenizer.json,
// JSONL examples from WikiText-2, QLoRA under FSDP at 2 ranks: the loss falls, PEFT adapter
// checkpoints appear every --save-steps with --save-total-limit honoured, the final adapter
// loads back into the model. Plus --dry-run of the recipe's 8B layout (per-rank memory plan,
// ~0.52 bytes per quantized weight) and a bad flag.
#include "fsdp/hf.h"
#include "fsdp/llama.h"
#include "hf_testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using fsdp::testing::hf_scratch;
using fsdp::testing::run_process;

// tokenizer.json with GPT-2's 256 byte characters as tokens (ids 0..255), no merges, BOS/EOS.
void write_byte_tokenizer(const std::string& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  int printable[256] = {0};
  for (int b = '!'; b <= '~'; ++b) printable[b] = 1;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = 1;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = 1;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = printable[b] ? b : 256 + n++;
    std::string s;
    if (c < 0x80) {
      s.push_back(static_cast<char>(c));
    } else {
      s.push_back(static_cast<char>(0xC0 | (c >> 6)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    vocab[s] = b;
  }
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 256}, {"content", "<s>"}, {"special", true}},
        {{"id", 257}, {"content", "</s>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  std::ofstream(dir + "/tokenizer_config.json")
      << R"({"bos_token": "<s>", "eos_token": "</s>"})";
}

std::string tiny_model(const std::string& name) {
  const std::string dir = hf_scratch(name);
  torch::manual_seed(9);
  fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
  c.vocab_size = 260;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  fsdp::LlamaForCausalLM m(c);
  fsdp::save_llama(m, dir, at::kBFloat16);
  write_byte_tokenizer(dir);
  return dir;
}

TEST(FinetuneCli, QLoraUnderFsdpSavesPeftCheckpoints) {
  const std::string wt = fsdp::testing::wikitext2_dir();
  if (wt.empty()) GTEST_SKIP() << "[fsdp-skip] WikiText-2 is not available";
  const std::string dir = tiny_model("finetune_cli");
  // 64 paragraphs of WikiText-2 as JSONL.
  {
    std::ifstream in(wt + "/valid.txt");
    std::ofstream out(dir + "/train.jsonl");
    std::string line;
    int n = 0;
    while (n < 64 && std::getline(in, line)) {
      if (line.size() < 40) continue;
      out << nlohmann::json({{"text", line.substr(0, 200)}}).dump() << "\n";
      ++n;
    }
  }
  const std::string out_dir = dir + "/results";
  auto r = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--model-dir", dir, "--data",
                        dir + "/train.jsonl", "--strategy", "fsdp", "--devices", "2",
                        "--max-length", "48", "--per-device-train-batch-size", "4",
                        "--gradient-accumulation-steps", "2", "--max-steps", "8",
                        "--learning-rate", "3e-3", "--warmup-steps", "2", "--logging-steps", "1",
                        "--save-steps", "4", "--save-total-limit", "1", "--lora-r", "8",
                        "--lora-alpha", "16", "--lora-dropout", "0.05",
                        "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj,w1,w2,w3,lm_head",
                        "--optim", "paged_adamw_8bit", "--output-dir", out_dir,
                        "--summary-json", dir + "/summary.json", "--no-progress-bar"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("trainable params:"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("'w1' matches no linear layer"), std::string::npos) << r.err;  // recipe's Meta names
  std::ifstream sf(dir + "/summary.json");
  std::stringstream ss;
  ss << sf.rdbuf();
  auto s = nlohmann::json::parse(ss.str());
  EXPECT_EQ(s["steps"], 8);
  EXPECT_EQ(s["world_size"], 2);
  auto losses = s["losses"].get<std::vector<double>>();
  ASSERT_EQ(losses.size(), 8u);
  EXPECT_LT(losses.back(), losses.front());
  // The training peak split by memory category, per rank: the parts add up to the peak, and
  // an FSDP QLoRA step's peak holds sharded parameters, quantized shards and gathered units.
  ASSERT_EQ(s["peak_breakdown_mb"].size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    double total = 0;
    for (auto& [name, mb] : s["peak_breakdown_mb"][rank].items()) total += mb.get<double>();
    const double peak = s["peak_alloc_mb"][rank].get<double>();
    EXPECT_NEAR(total, peak, 0.02 * peak) << s["peak_breakdown_mb"][rank].dump();
    for (const char* part : {"parameters", "quantized", "gathered"}) {
      EXPECT_GT(s["peak_breakdown_mb"][rank].value(part, 0.0), 0.0) << part;
    }
  }
  // --save-total-limit 1: only the newest step checkpoint stays; the final adapter too.
  EXPECT_FALSE(fs::exists(out_dir + "/checkpoint-4"));
  EXPECT_TRUE(fs::exists(out_dir + "/checkpoint-8/adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(out_dir + "/checkpoint-8/adapter_config.json"));
  EXPECT_TRUE(fs::exists(out_dir + "/final/adapter_model.safetensors"));
  // The adapter loads back onto the (4-bit) base.
  fsdp::HfLoadOptions o;
  o.quantization = fsdp::QuantizationConfig{};
  o.prepare_for_kbit_training = true;
  o.adapter_dir = out_dir + "/final";
  auto model = fsdp::load_llama(dir, o);
  EXPECT_EQ(fsdp::load_peft_config(out_dir + "/final").r, 8);
  bool any_nonzero_b = false;
  for (auto& [k, v] : fsdp::lora_parameters(*model)) {
    if (k.find("lora_B") != std::string::npos) any_nonzero_b |= v.abs().sum().item<double>() > 0;
  }
  EXPECT_TRUE(any_nonzero_b);  // trained: B moved away from zero
}

TEST(FinetuneCli, DryRunOfTheRecipes8BLayout) {
  const std::string dir = hf_scratch("finetune_dry");
  auto r = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--preset", "llama3-8b",
                        "--devices", "2", "--dry-run", "--lora-target-modules",
                        "q_proj,k_proj,v_proj,o_proj,lm_head", "--summary-json", dir + "/dry.json"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("bytes/weight"), std::string::npos) << r.out;
  std::ifstream f(dir + "/dry.json");
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str());
  const double per_weight = j["quantized_bytes"].get<double>() / j["quantized_weights"].get<double>();
  EXPECT_GT(per_weight, 0.5);
  EXPECT_LT(per_weight, 0.52);
  EXPECT_NEAR(j["params"].get<double>() / 1e9, 8.03 + 0.0, 0.05);
  // Per rank: about half of (6.98e9 quantized weights x 0.516 B + 1.05e9 fp32 embedding and
  // head weights x 4 B) of sharded parameters -- far below the 16 GB of bf16 weights.
  EXPECT_LT(j["sharded_param_bytes"].get<double>(), 4.5e9);
  EXPECT_GT(j["sharded_param_bytes"].get<double>(), 3.5e9);
}

TEST(FinetuneCli, BadFlagsAreOneLineErrors) {
  // --data synthetic: a file given to --data must exist (checked at parse), and the flag under
  // test is the point here.
  auto r = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--preset", "llama-tiny",
                        "--optim", "sgd", "--data", "synthetic"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--optim"), std::string::npos) << r.err;
  auto u = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--preset", "llama-tiny",
                        "--kbit-upcast", "half", "--data", "synthetic"});
  EXPECT_EQ(u.exit_code, 2);
  EXPECT_NE(u.err.find("--kbit-upcast"), std::string::npos) << u.err;
  auto m = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--data", "synthetic"});
  EXPECT_EQ(m.exit_code, 2);
  EXPECT_NE(m.err.find("--model-dir"), std::string::npos) << m.err;
}

}  // namespace
