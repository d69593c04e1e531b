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

#include <algorithm>
#include <cmath>
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

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

// JSONL of `n` examples whose lengths vary from a few bytes to 40 (so that ranks see very
// different numbers of target tokens in a step).
void write_uneven_examples(const std::string& path, int n) {
  std::ofstream out(path);
  const std::string text = "the quick brown fox jumps over the lazy dog while it sleeps";
  for (int i = 0; i < n; ++i) {
    const size_t len = 3 + (i * 17) % 38;
    out << nlohmann::json({{"text", text.substr(0, len)}}).dump() << "\n";
  }
}

// transformers' names: --model-name-or-path, --dataset-text-field, --torch-dtype,
// --bnb-4bit-quant-type, --optim adamw_bnb_8bit, --lr-scheduler-type with --warmup-ratio,
// --report-to, --logging-dir, --save-strategy; gradient clipping on at 1.0 by default (its norm
// recorded every step) and the learning rate logged every step as transformers' cosine schedule.
TEST(FinetuneCli, TransformersNamesScheduleAndDefaultClipping) {
  const std::string dir = tiny_model("finetune_hf_names");
  write_uneven_examples(dir + "/train.jsonl", 16);
  const std::string out_dir = dir + "/results";
  const std::string log_dir = dir + "/logs";
  auto r = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--model-name-or-path", dir,
                        "--data", dir + "/train.jsonl", "--dataset-text-field", "text",
                        "--torch-dtype", "float32", "--bnb-4bit-quant-type", "nf4",
                        "--optim", "adamw_bnb_8bit", "--max-length", "48",
                        "--per-device-train-batch-size", "2", "--max-steps", "8",
                        "--learning-rate", "1e-3", "--lr-scheduler-type", "cosine",
                        "--warmup-ratio", "0.25", "--logging-steps", "1", "--report-to", "csv",
                        "--logging-dir", log_dir, "--save-strategy", "no", "--save-steps", "2",
                        "--output-dir", out_dir, "--summary-json", dir + "/summary.json",
                        "--no-progress-bar"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto s = read_json(dir + "/summary.json");
  // Default --max-grad-norm 1.0: clipping ran every step (the norm before clipping recorded).
  EXPECT_EQ(s["grad_norms"].size(), 8u) << s.dump();
  // --report-to csv into --logging-dir: metrics.csv there, no TensorBoard file, nothing in
  // --output-dir's version_N.
  const std::string v0 = log_dir + "/version_0";
  ASSERT_TRUE(fs::exists(v0 + "/metrics.csv"));
  for (const auto& e : fs::directory_iterator(v0)) {
    EXPECT_EQ(e.path().filename().string().find("tfevents"), std::string::npos) << e.path();
  }
  EXPECT_FALSE(fs::exists(out_dir + "/version_0"));
  // --save-strategy no: only final/.
  EXPECT_TRUE(fs::exists(out_dir + "/final/adapter_model.safetensors"));
  for (const auto& e : fs::directory_iterator(out_dir)) {
    EXPECT_NE(e.path().filename().string().rfind("checkpoint-", 0), 0u) << e.path();
  }
  // learning_rate at steps 1..8: warmup ceil(0.25 * 8) = 2 steps, then cosine to 0.
  std::ifstream f(v0 + "/metrics.csv");
  std::string header;
  std::getline(f, header);
  std::vector<std::string> cols;
  {
    std::stringstream hs(header);
    for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
  }
  const size_t lr_col = std::find(cols.begin(), cols.end(), "learning_rate") - cols.begin();
  ASSERT_LT(lr_col, cols.size()) << header;
  std::vector<double> lrs;
  for (std::string line; std::getline(f, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    if (cells.size() > lr_col && !cells[lr_col].empty()) lrs.push_back(std::stod(cells[lr_col]));
  }
  ASSERT_EQ(lrs.size(), 8u);
  for (int k = 0; k < 8; ++k) {
    const double want = k < 2 ? 1e-3 * k / 2.0
                              : 1e-3 * 0.5 * (1.0 + std::cos(M_PI * (k - 2) / 6.0));
    EXPECT_NEAR(lrs[k], want, 1e-12) << "step " << k + 1;
  }
}

// transformers 5 averages the loss over every target token of a step, all ranks together
// (average_tokens_across_devices, on by default): 2 ranks with batch 2 then give the losses of
// one process with batch 4 even when examples have very different lengths. A mean of per-rank
// means (--no-average-tokens-across-devices) does not.
TEST(FinetuneCli, TokenWeightedLossIsTheSameAtWorlds1And2) {
  const std::string dir = tiny_model("finetune_tokens");
  write_uneven_examples(dir + "/train.jsonl", 24);
  auto run = [&](const std::string& devices, const std::string& batch, const std::string& name,
                 bool weighted) {
    std::vector<std::string> argv = {
        fsdp::testing::bin_path("fsdp-finetune"), "--model-dir", dir, "--data",
        dir + "/train.jsonl", "--devices", devices, "--backend", "gloo", "--max-length", "48",
        "--per-device-train-batch-size", batch, "--gradient-accumulation-steps", "2",
        "--max-steps", "3", "--learning-rate", "3e-3", "--lora-dropout", "0",
        "--bnb-4bit-compute-dtype", "float32", "--report-to", "none", "--save-strategy", "no",
        "--output-dir", dir + "/" + name, "--summary-json", dir + "/" + name + ".json",
        "--no-progress-bar"};
    if (!weighted) argv.push_back("--no-average-tokens-across-devices");
    auto r = run_process(argv);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return read_json(dir + "/" + name + ".json")["losses"].get<std::vector<double>>();
  };
  const auto one = run("1", "4", "w1", true);
  const auto two = run("2", "2", "w2", true);
  const auto two_mean = run("2", "2", "w2_mean", false);
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  ASSERT_EQ(two_mean.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(two[i], one[i], 1e-6 * std::abs(one[i])) << "step " << i + 1;
  }
  // The per-rank mean weights short and long examples' ranks alike: another loss, far outside
  // the tolerance above.
  for (size_t i = 0; i < 3; ++i) {
    std::printf("step %zu: world 1 %.9g, world 2 token-weighted %.9g, mean of rank means %.9g\n",
                i + 1, one[i], two[i], two_mean[i]);
  }
  // (Measured: 4e-8 relative token-weighted, 2.7e-4 to 8.4e-4 for the mean of rank means.)
  double gap = 0;
  for (size_t i = 0; i < 3; ++i) gap = std::max(gap, std::abs(two_mean[i] - one[i]) / std::abs(one[i]));
  EXPECT_GT(gap, 1e-4);
}

// Names transformers has but fsdp-finetune does not implement are one line each.
TEST(FinetuneCli, UnimplementedTransformersChoicesAreOneLine) {
  auto fp16 = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--preset", "llama-tiny",
                           "--data", "synthetic", "--fp16"});
  EXPECT_EQ(fp16.exit_code, 2);
  EXPECT_NE(fp16.err.find("--fp16"), std::string::npos) << fp16.err;
  EXPECT_NE(fp16.err.find("--bf16"), std::string::npos) << fp16.err;
  auto fp4 = run_process({fsdp::testing::bin_path("fsdp-finetune"), "--preset", "llama-tiny",
                          "--data", "synthetic", "--bnb-4bit-quant-type", "fp4"});
  EXPECT_EQ(fp4.exit_code, 2);
  EXPECT_NE(fp4.err.find("fp4 is not implemented"), std::string::npos) << fp4.err;
  EXPECT_EQ(std::count(fp4.err.begin(), fp4.err.end(), '\n'), 1) << fp4.err;
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
