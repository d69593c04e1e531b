// examples/finetune_qlora.cpp, run as a user runs it: a tiny Llama folder (hf_model_folder.h),
// a few JSONL examples, 2 ranks under FSDP, 6 steps. The loss falls and the saved adapter is a
// PEFT folder that loads back onto the 4-bit base with trained (non-zero) lora_B weights.
#include "hf_model_folder.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace {

namespace fs = std::filesystem;

TEST(Examples, FinetuneQLoraSavesAPeftAdapter) {
  const std::string dir = fsdp::testing::tiny_llama_folder("qlora_example");
  {
    std::ofstream out(dir + "/train.jsonl");
    const std::string text = "the quick brown fox jumps over the lazy dog";
    for (int i = 0; i < 32; ++i) out << nlohmann::json({{"text", text}}).dump() << "\n";
  }
  const std::string adapter = dir + "/adapter";
  auto r = fsdp::testing::run_process(
      {fsdp::testing::bin_path("finetune_qlora"), "--model-dir", dir, "--data", dir + "/train.jsonl",
       "--output-dir", adapter, "--devices", "2", "--max-steps", "6", "--batch-size", "4",
       "--max-length", "48", "--default-root-dir", dir + "/logs"},
      {{"FSDP_BACKEND", "gloo"}, {"FSDP_NUM_THREADS", "1"}}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const size_t at = r.out.find("losses:");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::istringstream line(r.out.substr(at + 7, r.out.find('\n', at) - at - 7));
  std::vector<double> losses;
  for (double x; line >> x;) losses.push_back(x);
  ASSERT_EQ(losses.size(), 6u) << r.out;
  for (double l : losses) EXPECT_TRUE(std::isfinite(l)) << r.out;
  EXPECT_LT(losses.back(), losses.front()) << r.out;
  // 7 targets x 2 layers x (lora_A, lora_B).
  EXPECT_NE(r.out.find("28 adapter tensors saved to " + adapter), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(adapter + "/adapter_model.safetensors"));
  ASSERT_TRUE(fs::exists(adapter + "/adapter_config.json"));

  EXPECT_EQ(fsdp::load_peft_config(adapter).r, 8);
  fsdp::HfLoadOptions o;
  o.quantization = fsdp::QuantizationConfig{};
  o.prepare_for_kbit_training = true;
  o.adapter_dir = adapter;
  auto model = fsdp::load_llama(dir, o);
  bool any_nonzero_b = false;
  for (auto& [k, v] : fsdp::lora_parameters(*model)) {
    if (k.find("lora_B") != std::string::npos) any_nonzero_b |= v.abs().sum().item<double>() > 0;
  }
  EXPECT_TRUE(any_nonzero_b);  // trained: B moved away from zero
}

}  // namespace
