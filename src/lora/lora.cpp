// LoRA: LoraConfig, LoraLinear, apply_lora, merge. See include/fsdp/lora.h.
#include "fsdp/lora.h"

#include "fsdp/llama.h"
#include "fsdp/quantization.h"
#include "models/detail.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/nn/init.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <regex>

namespace fsdp {
namespace {

using json = nlohmann::json;

const std::vector<std::string>& llama_default_targets() {
  // peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"].
  static const std::vector<std::string> kTargets = {"q_proj", "v_proj"};
  return kTargets;
}

bool ends_with_component(const std::string& fqn, const std::string& name) {
  return fqn == name || (fqn.size() > name.size() &&
                         fqn.compare(fqn.size() - name.size(), name.size(), name) == 0 &&
                         fqn[fqn.size() - name.size() - 1] == '.');
}

// Which entry of target_modules matches `fqn` ("" when none).
std::string matching_target(const LoraConfig& c, const std::string& fqn) {
  if (!c.target_regex.empty()) {
    return std::regex_match(fqn, std::regex(c.target_regex)) ? c.target_regex : "";
  }
  for (const auto& t : c.targets()) {
    if (t == "all-linear") {
      if (!ends_with_component(fqn, "lm_head")) return t;
      continue;
    }
    if (ends_with_component(fqn, t)) return t;
  }
  return "";
}

}  // namespace

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

std::vector<std::string> LoraConfig::targets() const {
  return target_modules.empty() && target_regex.empty() ? llama_default_targets() : target_modules;
}

void LoraConfig::validate() const {
  TORCH_CHECK(r > 0, "[LoraConfig] r must be positive, got ", r);
  TORCH_CHECK(lora_dropout >= 0 && lora_dropout < 1, "[LoraConfig] lora_dropout must be in [0, 1), got ",
              lora_dropout);
  TORCH_CHECK(bias == "none", "[LoraConfig] bias '", bias, "' is not implemented; use \"none\" "
              "(the QLoRA recipe's setting)");
  TORCH_CHECK(modules_to_save.empty(), "[LoraConfig] modules_to_save is not implemented");
  TORCH_CHECK(at::isFloatingType(dtype), "[LoraConfig] dtype must be floating, got ", dtype);
}

std::string LoraConfig::to_json(const std::string& base_model) const {
  json j;
  j["alpha_pattern"] = json::object();
  j["base_model_name_or_path"] = base_model.empty() ? json(nullptr) : json(base_model);
  j["bias"] = bias;
  j["exclude_modules"] = nullptr;
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["lora_alpha"] = lora_alpha;
  j["lora_bias"] = false;
  j["lora_dropout"] = lora_dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = r;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  j["target_modules"] = target_regex.empty() ? json(targets()) : json(target_regex);
  j["task_type"] = task_type;
  j["use_dora"] = false;
  j["use_rslora"] = use_rslora;
  return j.dump(2);
}

LoraConfig LoraConfig::from_json(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[LoraConfig] ", what, " is not valid JSON: ", e.what());
  }
  auto unsupported = [&](const char* key, const std::string& why) {
    TORCH_CHECK(false, "[LoraConfig] ", what, ": ", key, " = ", j[key].dump(), " is not supported (",
                why, ")");
  };
  const std::string type = j.value("peft_type", "");
  TORCH_CHECK(type == "LORA", "[LoraConfig] ", what, " is a '", type,
              "' adapter; only LoRA adapters (peft_type \"LORA\") are read");
  LoraConfig c;
  c.r = j.value("r", c.r);
  c.lora_alpha = j.value("lora_alpha", c.lora_alpha);
  c.lora_dropout = j.value("lora_dropout", c.lora_dropout);
  c.bias = j.value("bias", c.bias);
  c.use_rslora = j.value("use_rslora", false);
  if (j.contains("task_type") && j["task_type"].is_string()) c.task_type = j["task_type"];
  const json& t = j.value("target_modules", json());
  if (t.is_array()) {
    c.target_modules = t.get<std::vector<std::string>>();
  } else if (t.is_string()) {
    if (t.get<std::string>() == "all-linear") {
      c.target_modules = {"all-linear"};
    } else {
      c.target_regex = t.get<std::string>();
    }
  }
  if (j.value("use_dora", false)) unsupported("use_dora", "DoRA");
  if (j.value("fan_in_fan_out", false)) unsupported("fan_in_fan_out", "Conv1D-style weights");
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null() && !j["modules_to_save"].empty()) {
    unsupported("modules_to_save", "fully trained extra modules");
  }
  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    if (j.contains(key) && !j[key].is_null() && !j[key].empty()) unsupported(key, "per-layer ranks");
  }
  if (j.contains("layers_to_transform") && !j["layers_to_transform"].is_null()) {
    unsupported("layers_to_transform", "a subset of layers");
  }
  c.validate();
  return c;
}

LoraLinear::LoraLinear(LinearPtr base, const LoraConfig& config)
    : scaling_(config.scaling()), dropout_(config.lora_dropout) {
  config.validate();
  TORCH_CHECK(base, "[LoraLinear] base layer is null");
  TORCH_CHECK(!std::dynamic_pointer_cast<LoraLinear>(base), "[LoraLinear] the layer already has "
              "an adapter (one adapter per layer)");
  const int64_t in = base->in_features(), out = base->out_features();
  register_linear(*this, "base_layer", base_layer, std::move(base));
  auto opts = [&](int64_t i, int64_t o) { return torch::nn::LinearOptions(i, o).bias(false); };
  lora_A = register_module("lora_A", torch::nn::Linear(opts(in, config.r)));
  lora_B = register_module("lora_B", torch::nn::Linear(opts(config.r, out)));
  at::NoGradGuard no_grad;
  if (config.dtype != at::kFloat) {
    lora_A->weight.set_data(lora_A->weight.to(config.dtype));
    lora_B->weight.set_data(lora_B->weight.to(config.dtype));
  }
  // A new adapter is always initialized, also under an EmptyInitGuard (fsdp/init.h), which
  // skips random init only for weights that a checkpoint will overwrite: nothing loads a new
  // adapter. Allocation above still follows the guards (meta tensors under MetaInitGuard).
  c10::impl::ExcludeDispatchKeyGuard real_init(c10::DispatchKey::DeferredInit);
  torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));  // PEFT reset_lora_parameters
  torch::nn::init::zeros_(lora_B->weight);
}

at::Tensor LoraLinear::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);
  at::Tensor result = (*base_layer)(x);
  if (merged_) return result;
  const at::ScalarType result_dtype = result.scalar_type();
  at::Tensor h = x.to(lora_A->weight.scalar_type());  // PEFT _cast_input_dtype
  h = demos::detail::dropout(h, dropout_, is_training());
  at::Tensor delta = lora_B(lora_A(h)) * scaling_;
  if (std::dynamic_pointer_cast<Linear4bit>(base_layer)) {
    // peft lora.bnb.Linear4bit: the adapter output is cast to the result's dtype, then added.
    return result + delta.to(result_dtype);
  }
  // peft lora.Linear: added with type promotion, then cast back.
  return (result + delta).to(result_dtype);
}

at::Tensor LoraLinear::delta_weight() const {
  at::NoGradGuard no_grad;
  return at::matmul(lora_B->weight.to(at::kFloat), lora_A->weight.to(at::kFloat)) * scaling_;
}

namespace {

// W <- W + sign * scaling * B A on the base layer.
void add_delta(LoraLinear& lora, double sign) {
  at::NoGradGuard no_grad;
  at::Tensor delta = lora.delta_weight() * sign;
  if (auto dense = std::dynamic_pointer_cast<Linear>(lora.base_layer)) {
    dense->weight.add_(delta.to(dense->weight.scalar_type()));
    return;
  }
  if (auto tied = std::dynamic_pointer_cast<TiedLinear>(lora.base_layer)) {
    // A head tied to the embeddings (tie_word_embeddings) has no weight of its own. PEFT 0.21
    // (lora.Linear.merge: base_layer.weight.data += delta) adds the delta in place into the
    // shared Parameter, and merge_and_unload leaves the tie in place: the input embeddings
    // change too, so the merged model's logits differ from the adapted model's (PEFT warns
    // about merging a tied target). Same here: into the shared table, in place.
    at::Tensor table = tied->embedding()->weight;
    table.add_(delta.to(table.scalar_type()));
    return;
  }
  if (auto q = std::dynamic_pointer_cast<Linear4bit>(lora.base_layer)) {
    // PEFT: dequantize, add, quantize again (rounding error of one more quantization).
    QuantizationConfig cfg;
    cfg.compute_dtype = q->compute_dtype();
    cfg.blocksize = q->nf4().blocksize;
    cfg.double_quant = q->nf4().nested;
    at::Tensor w = q->dense_weight(at::kFloat) + delta;
    auto requantized = std::make_shared<Linear4bit>(w, q->bias, cfg);
    lora.replace_module("base_layer", requantized);
    *lora.linear_slot("base_layer") = requantized;
    return;
  }
  TORCH_CHECK(false, "[LoraLinear] merge needs a dense, tied or 4-bit base layer");
}

}  // namespace

void LoraLinear::merge() {
  if (merged_) return;
  add_delta(*this, 1.0);
  merged_ = true;
}

void LoraLinear::unmerge() {
  if (!merged_) return;
  add_delta(*this, -1.0);
  merged_ = false;
}

bool is_lora_target(const LoraConfig& config, const std::string& fqn) {
  return !matching_target(config, fqn).empty();
}

int apply_lora(torch::nn::Module& root, const LoraConfig& config, const std::string& prefix,
               bool require_match, std::set<std::string>* matched_targets) {
  config.validate();
  std::set<std::string> matched;
  int count = 0;
  for (auto& [fqn, layer] : named_linears(root)) {
    if (std::dynamic_pointer_cast<LoraLinear>(layer)) continue;
    // Base layers inside an adapter are not targets themselves.
    if (ends_with_component(fqn, "base_layer")) continue;
    const std::string target = matching_target(config, prefix + fqn);
    if (target.empty()) continue;
    replace_linear(root, fqn, std::make_shared<LoraLinear>(layer, config));
    matched.insert(target);
    ++count;
  }
  // PEFT's _mark_only_adapters_as_trainable (bias="none"): everything else is frozen.
  for (auto& p : root.named_parameters()) {
    const std::string& k = p.key();
    if (k.find(".lora_A.") == std::string::npos && k.find(".lora_B.") == std::string::npos) {
      p.value().set_requires_grad(false);
    }
  }
  if (matched_targets) matched_targets->insert(matched.begin(), matched.end());
  if (require_match) {
    std::string wanted;
    for (const auto& t : config.targets()) wanted += (wanted.empty() ? "" : ", ") + t;
    TORCH_CHECK(count > 0, "[apply_lora] Target modules {", config.target_regex.empty() ? wanted : config.target_regex,
                "} not found in the base model. Please check the target modules and try again.");
    for (const auto& t : config.targets()) {
      if (config.target_regex.empty() && !matched.count(t)) {
        std::cerr << "[apply_lora] target module '" << t << "' matches no linear layer\n";
      }
    }
  }
  return count;
}

std::vector<std::pair<std::string, at::Tensor>> lora_parameters(torch::nn::Module& root) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& p : root.named_parameters()) {
    const std::string& k = p.key();
    if (k.find(".lora_A.") != std::string::npos || k.find(".lora_B.") != std::string::npos) {
      out.emplace_back(k, p.value());
    }
  }
  return out;
}

namespace {

// Every LoraLinear in root's tree, root included. modules() with include_self needs the root in
// a shared_ptr; a model on the stack (LlamaForCausalLM model(cfg)) is not.
void for_each_lora(torch::nn::Module& root, const std::function<void(LoraLinear&)>& fn) {
  if (auto* l = dynamic_cast<LoraLinear*>(&root)) fn(*l);
  for (auto& m : root.modules(/*include_self=*/false)) {
    if (auto* l = dynamic_cast<LoraLinear*>(m.get())) fn(*l);
  }
}

// FSDP replaces a sharded parameter in its module's registered parameters by this rank's shard
// while the layer's member keeps the full-shape tensor (whose storage is freed at rest): a
// single-process merge would read freed or partial weights.
void check_not_sharded(LoraLinear& l, const char* what) {
  const at::Tensor* registered = l.lora_A->named_parameters(/*recurse=*/false).find("weight");
  const at::Tensor& member = l.lora_A->weight;
  const bool sharded = registered == nullptr ||
                       registered->unsafeGetTensorImpl() != member.unsafeGetTensorImpl() ||
                       member.storage().nbytes() < member.nbytes();
  TORCH_CHECK(!sharded, "[", what, "] the model's parameters are sharded by FSDP (the adapter's "
              "registered lora_A weight is this rank's shard); this single-process version would "
              "read partial weights. HINT: call fsdp::", what, "(strategy, model), the FSDP version "
              "in fsdp/lora.h, on every rank: it merges unit by unit into the shards");
}

}  // namespace

void merge_lora(torch::nn::Module& root) {
  for_each_lora(root, [](LoraLinear& l) { check_not_sharded(l, "merge_lora"); });
  for_each_lora(root, [](LoraLinear& l) { l.merge(); });
}

void unmerge_lora(torch::nn::Module& root) {
  for_each_lora(root, [](LoraLinear& l) { check_not_sharded(l, "unmerge_lora"); });
  for_each_lora(root, [](LoraLinear& l) { l.unmerge(); });
}

KbitUpcast parse_kbit_upcast(const std::string& text, const std::string& what) {
  if (text == "all") return KbitUpcast::kAll;
  if (text == "norms") return KbitUpcast::kNorms;
  if (text == "none") return KbitUpcast::kNone;
  TORCH_CHECK(false, "[", what, "] '", text, "' is not a choice; use all (PEFT's "
              "prepare_model_for_kbit_training: every non-quantized parameter in fp32), norms "
              "(only the norms) or none (keep the loaded dtype)");
}

const char* to_string(KbitUpcast upcast) {
  switch (upcast) {
    case KbitUpcast::kAll: return "all";
    case KbitUpcast::kNorms: return "norms";
    case KbitUpcast::kNone: return "none";
  }
  return "?";
}

void freeze_and_upcast(torch::nn::Module& module, KbitUpcast upcast) {
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters()) p.set_requires_grad(false);
  if (upcast == KbitUpcast::kNone) return;
  auto cast = [](at::Tensor& p) {
    if (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf) p.set_data(p.to(at::kFloat));
  };
  if (upcast == KbitUpcast::kAll) {
    for (auto& p : module.parameters()) cast(p);
    return;
  }
  // kNorms: the parameters of RMSNorm modules, the root included (modules() with include_self
  // needs the root in a shared_ptr).
  auto cast_module = [&](torch::nn::Module& m) {
    if (dynamic_cast<RMSNorm*>(&m) == nullptr) return;
    for (auto& p : m.parameters(/*recurse=*/false)) cast(p);
  };
  cast_module(module);
  for (auto& m : module.modules(/*include_self=*/false)) cast_module(*m);
}

}  // namespace fsdp
