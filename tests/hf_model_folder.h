// A tiny Hugging Face Llama folder for the tests that run fine-tuning programs
// (test_finetune_cli.cpp, test_qlora_example.cpp): config.json, model.safetensors (save_llama)
// and a byte-level tokenizer.json.
#pragma once

#include "fsdp/hf.h"
#include "fsdp/llama.h"
#include "hf_testing.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

namespace fsdp::testing {

// tokenizer.json with GPT-2's 256 byte characters as tokens (ids 0..255), no merges, BOS/EOS.
inline void write_byte_tokenizer(const std::string& dir) {
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

// A tiny random Llama (llama-tiny with vocab 260, hidden 64) saved as a Hugging Face folder in
// hf_scratch(name), in bf16, with the byte-level tokenizer above. Returns the folder.
inline std::string tiny_llama_folder(const std::string& name) {
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

}  // namespace fsdp::testing
