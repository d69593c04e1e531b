// LlamaConfig: config.json parsing and writing, presets, parameter count. See fsdp/llama.h.
#include "fsdp/llama.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace fsdp {
namespace {

using json = nlohmann::json;

template <typename T>
void read_field(const json& j, const char* key, T* out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  try {
    *out = it->get<T>();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[LlamaConfig] ", what, ": field '", key, "' has the wrong type (",
                it->type_name(), "): ", e.what());
  }
}

void read_rope_scaling(const json& j, RopeScaling* rs, const std::string& what) {
  if (!j.is_object()) return;
  std::string type = "default";
  read_field(j, "type", &type, what);  // older configs
  read_field(j, "rope_type", &type, what);
  rs->type = type;
  read_field(j, "factor", &rs->factor, what);
  read_field(j, "low_freq_factor", &rs->low_freq_factor, what);
  read_field(j, "high_freq_factor", &rs->high_freq_factor, what);
  read_field(j, "original_max_position_embeddings", &rs->original_max_position_embeddings, what);
}

}  // namespace

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 &&
                  num_hidden_layers > 0 && num_attention_heads > 0,
              "[LlamaConfig] vocab_size, hidden_size, intermediate_size, num_hidden_layers and "
              "num_attention_heads must be positive (got ", vocab_size, ", ", hidden_size, ", ",
              intermediate_size, ", ", num_hidden_layers, ", ", num_attention_heads, ")");
  TORCH_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, "[LlamaConfig] hidden_size ",
              hidden_size, " is not divisible by num_attention_heads ", num_attention_heads,
              " and head_dim is not given");
  TORCH_CHECK(head_size() % 2 == 0, "[LlamaConfig] head_dim ", head_size(),
              " must be even (rotary embeddings rotate pairs)");
  TORCH_CHECK(num_attention_heads % kv_heads() == 0, "[LlamaConfig] num_attention_heads ",
              num_attention_heads, " must be a multiple of num_key_value_heads ", kv_heads());
  TORCH_CHECK(hidden_act == "silu", "[LlamaConfig] hidden_act '", hidden_act,
              "' is not implemented; Llama models use 'silu'");
  TORCH_CHECK(rope_scaling.type == "default" || rope_scaling.type == "linear" ||
                  rope_scaling.type == "llama3",
              "[LlamaConfig] rope type '", rope_scaling.type,
              "' is not implemented; supported: default, linear, llama3");
  TORCH_CHECK(rms_norm_eps > 0 && rope_theta > 0, "[LlamaConfig] rms_norm_eps and rope_theta "
              "must be positive");
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t C = hidden_size, D = head_size(), H = num_attention_heads, KV = kv_heads();
  const int64_t I = intermediate_size, V = vocab_size;
  const int64_t attn = C * H * D + 2 * C * KV * D + H * D * C +
                       (attention_bias ? H * D + 2 * KV * D + C : 0);
  const int64_t mlp = 3 * C * I + (mlp_bias ? 2 * I + C : 0);
  const int64_t layer = attn + mlp + 2 * C;
  return V * C + num_hidden_layers * layer + C + (tie_word_embeddings ? 0 : V * C);
}

LlamaConfig LlamaConfig::from_json(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[LlamaConfig] ", what, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "[LlamaConfig] ", what, " must hold a JSON object");
  std::string model_type;
  read_field(j, "model_type", &model_type, what);
  TORCH_CHECK(model_type.empty() || model_type == "llama", "[LlamaConfig] ", what,
              " describes a '", model_type, "' model; only the Llama layout (model_type "
              "\"llama\") is implemented");
  LlamaConfig c;
  read_field(j, "vocab_size", &c.vocab_size, what);
  read_field(j, "hidden_size", &c.hidden_size, what);
  read_field(j, "intermediate_size", &c.intermediate_size, what);
  read_field(j, "num_hidden_layers", &c.num_hidden_layers, what);
  read_field(j, "num_attention_heads", &c.num_attention_heads, what);
  read_field(j, "num_key_value_heads", &c.num_key_value_heads, what);
  read_field(j, "head_dim", &c.head_dim, what);
  read_field(j, "max_position_embeddings", &c.max_position_embeddings, what);
  read_field(j, "rms_norm_eps", &c.rms_norm_eps, what);
  read_field(j, "attention_bias", &c.attention_bias, what);
  read_field(j, "mlp_bias", &c.mlp_bias, what);
  read_field(j, "attention_dropout", &c.attention_dropout, what);
  read_field(j, "tie_word_embeddings", &c.tie_word_embeddings, what);
  read_field(j, "hidden_act", &c.hidden_act, what);
  read_field(j, "initializer_range", &c.initializer_range, what);
  read_field(j, "bos_token_id", &c.bos_token_id, what);
  read_field(j, "pad_token_id", &c.pad_token_id, what);
  read_field(j, "torch_dtype", &c.dtype, what);
  read_field(j, "dtype", &c.dtype, what);
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_array()) {
      for (const auto& v : *it) c.eos_token_ids.push_back(v.get<int64_t>());
    } else {
      c.eos_token_ids.push_back(it->get<int64_t>());
    }
  }
  // Older layout: "rope_theta" + "rope_scaling"; transformers 5: "rope_parameters".
  read_field(j, "rope_theta", &c.rope_theta, what);
  if (auto it = j.find("rope_scaling"); it != j.end()) read_rope_scaling(*it, &c.rope_scaling, what);
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    read_field(*it, "rope_theta", &c.rope_theta, what);
    read_rope_scaling(*it, &c.rope_scaling, what);
  }
  c.validate();
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "[LlamaConfig] cannot read '", path,
              "'; a Hugging Face model folder holds config.json next to its safetensors files");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

std::string LlamaConfig::to_json() const {
  json rope = {{"rope_type", rope_scaling.type}, {"rope_theta", rope_theta}};
  if (rope_scaling.type == "linear" || rope_scaling.type == "llama3") rope["factor"] = rope_scaling.factor;
  if (rope_scaling.type == "llama3") {
    rope["low_freq_factor"] = rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
  }
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", kv_heads()},
            {"head_dim", head_size()},
            {"max_position_embeddings", max_position_embeddings},
            {"rms_norm_eps", rms_norm_eps},
            {"rope_parameters", rope},
            {"attention_bias", attention_bias},
            {"mlp_bias", mlp_bias},
            {"attention_dropout", attention_dropout},
            {"tie_word_embeddings", tie_word_embeddings},
            {"hidden_act", hidden_act},
            {"initializer_range", initializer_range},
            {"dtype", dtype}};
  j["bos_token_id"] = bos_token_id >= 0 ? json(bos_token_id) : json(nullptr);
  j["pad_token_id"] = pad_token_id >= 0 ? json(pad_token_id) : json(nullptr);
  if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  return j.dump(2);
}

std::vector<std::string> llama_preset_names() { return {"llama-tiny", "llama-1b", "llama3-8b"}; }

LlamaConfig llama_preset(const std::string& name) {
  LlamaConfig c;
  if (name == "llama-tiny") {
    c.vocab_size = 256, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 512;
  } else if (name == "llama-1b") {
    c.vocab_size = 128256, c.hidden_size = 2048, c.intermediate_size = 8192;
    c.num_hidden_layers = 16, c.num_attention_heads = 32, c.num_key_value_heads = 8;
    c.head_dim = 64, c.max_position_embeddings = 131072, c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0, c.tie_word_embeddings = true;
    c.rope_scaling = RopeScaling{"llama3", 32.0, 1.0, 4.0, 8192};
    c.bos_token_id = 128000, c.eos_token_ids = {128001}, c.dtype = "bfloat16";
  } else if (name == "llama3-8b") {
    c.vocab_size = 128256, c.hidden_size = 4096, c.intermediate_size = 14336;
    c.num_hidden_layers = 32, c.num_attention_heads = 32, c.num_key_value_heads = 8;
    c.max_position_embeddings = 8192, c.rms_norm_eps = 1e-5, c.rope_theta = 500000.0;
    c.bos_token_id = 128000, c.eos_token_ids = {128001}, c.dtype = "bfloat16";
  } else {
    std::ostringstream valid;
    for (const auto& n : llama_preset_names()) valid << " " << n;
    TORCH_CHECK(false, "[llama_preset] unknown preset '", name, "'; valid names:", valid.str());
  }
  c.validate();
  return c;
}

}  // namespace fsdp
