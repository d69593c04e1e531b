// PEFT adapter folders: save_peft_adapter, load_peft_config, load_peft_adapter. See fsdp/hf.h.
#include "fsdp/hf.h"

#include "ckpt/layout.h"
#include "ckpt/safetensors.h"
#include "hf/hf_weights.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <set>

namespace fsdp {
namespace {

namespace fs = std::filesystem;

// PEFT's saved key: the wrapper prefix, the model FQN, no adapter name.
constexpr const char* kPeftPrefix = "base_model.model.";

// PEFT resolves target_modules = "all-linear" before it saves: adapter_config.json names the
// adapted layers (the last component of each FQN, e.g. "q_proj"), and PEFT's loader matches
// those names; a literal "all-linear" in the list matches nothing there.
LoraConfig as_peft_saves_it(const LoraConfig& config,
                            const std::vector<std::pair<std::string, at::Tensor>>& lora_weights) {
  const auto& t = config.target_modules;
  if (std::find(t.begin(), t.end(), "all-linear") == t.end()) return config;
  std::set<std::string> names;
  for (const auto& [fqn, tensor] : lora_weights) {
    const std::string layer = fqn.substr(0, fqn.rfind(".lora_"));
    names.insert(layer.substr(layer.rfind('.') + 1));
  }
  for (const auto& name : t) {
    if (name != "all-linear") names.insert(name);
  }
  LoraConfig out = config;
  out.target_modules.assign(names.begin(), names.end());
  return out;
}

}  // namespace

void save_peft_adapter(const std::vector<std::pair<std::string, at::Tensor>>& lora_weights,
                       const LoraConfig& config, const std::string& dir,
                       const std::string& base_model_name_or_path) {
  config.validate();
  TORCH_CHECK(!lora_weights.empty(), "[save_peft_adapter] the model has no LoRA parameters; "
              "apply_lora (or load_llama with options.lora) first");
  std::vector<ckpt::TensorSpec> specs;
  std::vector<at::Tensor> data;
  for (const auto& [fqn, t] : lora_weights) {
    at::Tensor c = t.detach().contiguous();
    specs.push_back({kPeftPrefix + fqn, ckpt::to_dtype(c.scalar_type()), c.sizes().vec()});
    data.push_back(c);
  }
  fs::create_directories(dir);
  ckpt::write_file_atomic((fs::path(dir) / "adapter_config.json").string(),
                          as_peft_saves_it(config, lora_weights).to_json(base_model_name_or_path) +
                              "\n");
  ckpt::SafetensorsWriter writer((fs::path(dir) / "adapter_model.safetensors").string(), specs,
                                 {{"format", "pt"}});
  for (const at::Tensor& c : data) writer.write(c.data_ptr(), static_cast<size_t>(c.nbytes()));
  writer.commit();
}

void save_peft_adapter(torch::nn::Module& model, const LoraConfig& config, const std::string& dir,
                       const std::string& base_model_name_or_path) {
  save_peft_adapter(lora_parameters(model), config, dir, base_model_name_or_path);
}

std::vector<std::pair<std::string, at::Tensor>> gather_lora_weights(torch::nn::Module& model,
                                                                    ProcessGroup* group) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::NoGradGuard no_grad;
  for (auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* lora = dynamic_cast<LoraLinear*>(item.value().get());
    if (lora == nullptr) continue;
    for (auto* part : {&lora->lora_A, &lora->lora_B}) {
      const at::Tensor& full = (*part)->weight;  // the member: full shape (storage maybe freed)
      const at::Tensor shard = (*part)->named_parameters(/*recurse=*/false)["weight"];
      const std::string fqn = item.key() + ((*part).get() == lora->lora_A.get() ? ".lora_A.weight"
                                                                                 : ".lora_B.weight");
      if (shard.numel() == full.numel() || group == nullptr || group->size() == 1) {
        out.emplace_back(fqn, shard.detach().reshape(full.sizes()).clone());
        continue;
      }
      const int64_t world = group->size();
      const int64_t rows = shard.size(0), row_numel = shard.numel() / std::max<int64_t>(rows, 1);
      at::Tensor flat = at::empty({world * shard.numel()}, shard.options().requires_grad(false));
      group->all_gather_into_tensor(flat, shard.detach().reshape({-1}).contiguous());
      out.emplace_back(fqn, flat.view({world * rows, row_numel})
                                .narrow(0, 0, full.size(0))
                                .reshape(full.sizes())
                                .clone());
    }
  }
  return out;
}

LoraConfig load_peft_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  TORCH_CHECK(fs::exists(path), "[load_peft_config] '", dir, "' has no adapter_config.json; pass a "
              "folder written by PEFT's save_pretrained or fsdp::save_peft_adapter");
  return LoraConfig::from_json(ckpt::read_file(path), path);
}

void load_peft_adapter(torch::nn::Module& model, const std::string& dir) {
  detail::HfWeights weights(dir, "adapter_model.safetensors");
  auto params = lora_parameters(model);
  TORCH_CHECK(!params.empty(), "[load_peft_adapter] the model has no LoRA layers; apply_lora with "
              "load_peft_config('", dir, "') first");
  for (auto& [fqn, t] : params) {
    const std::string key = kPeftPrefix + fqn;
    TORCH_CHECK(weights.has(key), "[load_peft_adapter] '", dir, "' has no tensor '", key,
                "'; the adapter was trained for other target modules or another model");
    weights.read_into(key, t);
  }
  const auto left = weights.unused();
  TORCH_CHECK(left.empty(), "[load_peft_adapter] '", dir, "' holds ", left.size(),
              " tensor(s) with no LoRA layer in the model, e.g. '", left.empty() ? "" : left.front(),
              "' (apply_lora with the adapter's own config)");
}

}  // namespace fsdp
