// load_llama / save_llama: Hugging Face model folders. See fsdp/hf.h.
#include "fsdp/hf.h"

#include "ckpt/layout.h"
#include "ckpt/safetensors.h"
#include "fsdp/init.h"
#include "hf/hf_weights.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <iostream>
#include <set>

namespace fsdp {
namespace {

namespace fs = std::filesystem;

const char* dtype_config_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: break;
  }
  TORCH_CHECK(false, "[save_llama] dtype ", dtype, " is not a checkpoint dtype; use kFloat, "
              "kBFloat16 or kHalf");
}


struct HeadHolder : torch::nn::Module, LinearOwner {
  explicit HeadHolder(LinearPtr head) { register_linear(*this, "lm_head", lm_head, std::move(head)); }
  LinearPtr lm_head;
};

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The model of `config` through the HfLoadOptions pipeline, its tensors read from `weights`
// (random init as transformers' when null).
std::shared_ptr<LlamaForCausalLM> build(const LlamaConfig& config, const HfLoadOptions& options_in,
                                        const detail::HfWeights* weights, const std::string& what) {
  HfLoadOptions options = options_in;
  TORCH_CHECK(at::isFloatingType(options.dtype), "[load_llama] HfLoadOptions.dtype must be a "
              "floating dtype, got ", options.dtype);
  if (options.quantization) options.quantization->validate();
  std::unique_ptr<detail::HfWeights> adapter;
  if (!options.adapter_dir.empty()) {
    options.lora = load_peft_config(options.adapter_dir);
    adapter = std::make_unique<detail::HfWeights>(options.adapter_dir, "adapter_model.safetensors");
  }
  // Reads (or, for a random model, casts) the parameters of one part of the model.
  auto fill = [&](torch::nn::Module& part, const std::string& prefix) {
    for (auto& p : part.named_parameters()) {
      at::Tensor t = p.value();
      if (t.is_floating_point() && t.scalar_type() != options.dtype) {
        t.set_data(weights ? at::empty(t.sizes(), t.options().dtype(options.dtype))
                           : t.detach().to(options.dtype));  // same TensorImpl
      }
      if (weights) weights->read_into(prefix + p.key(), t);
    }
  };
  std::set<std::string> lora_matched;
  int lora_layers = 0;
  // Quantize, freeze/upcast and add adapters to one part of the model (see HfLoadOptions).
  auto finish = [&](torch::nn::Module& part, const std::string& prefix) {
    if (options.quantization) quantize_linears(part, *options.quantization, prefix);
    if (options.prepare_for_kbit_training) freeze_and_upcast(part, options.kbit_upcast);
    if (options.lora) {
      lora_layers += apply_lora(part, *options.lora, prefix, /*require_match=*/false, &lora_matched);
    }
    if (adapter) {
      for (auto& [fqn, t] : lora_parameters(part)) adapter->read_into("base_model.model." + prefix + fqn, t);
    }
  };
  std::shared_ptr<LlamaForCausalLM> model;
  {
    // Loading reads every parameter from the files: skip the random initialization (new
    // adapters are initialized regardless, see LoraLinear).
    std::unique_ptr<EmptyInitGuard> no_init;
    if (weights) no_init = std::make_unique<EmptyInitGuard>();
    model = std::make_shared<LlamaForCausalLM>(
        config, [&](LlamaDecoderLayer& layer, const std::string& prefix) {
          fill(layer, prefix);
          finish(layer, prefix);
        });
  }
  // The root parameters (embeddings, final norm, untied head); the layers are done (and,
  // under deferred FSDP init, already sharded: they are not touched again).
  fill(*model->model->embed_tokens, "model.embed_tokens.");
  fill(*model->model->norm, "model.norm.");
  fill(*model->lm_head, "lm_head.");
  if (options.prepare_for_kbit_training) {
    freeze_and_upcast(*model->model->embed_tokens, options.kbit_upcast);
    freeze_and_upcast(*model->model->norm, options.kbit_upcast);
    model->model->input_require_grads = true;
  }
  if (options.lora) {  // get_peft_model freezes everything but the adapters
    for (auto* part : {static_cast<torch::nn::Module*>(model->model->embed_tokens.get()),
                       static_cast<torch::nn::Module*>(model->model->norm.get())}) {
      for (auto& p : part->parameters()) p.set_requires_grad(false);
    }
  }
  // The head, the one linear layer outside the decoder layers, goes through `finish` inside a
  // stand-in root that holds only it.
  if (options.quantization || options.prepare_for_kbit_training || options.lora) {
    auto holder = std::make_shared<HeadHolder>(model->lm_head);
    finish(*holder, "");
    replace_linear(*model, "lm_head", holder->lm_head);
  }
  if (options.lora) {
    TORCH_CHECK(lora_layers > 0, "[load_llama] LoRA target modules {", join(options.lora->targets()),
                "} not found in the base model. Please check the target modules and try again.");
    for (const auto& t : options.lora->targets()) {
      if (options.lora->target_regex.empty() && !lora_matched.count(t)) {
        std::cerr << "[load_llama] LoRA target module '" << t << "' matches no linear layer\n";
      }
    }
  }
  if (adapter) {
    // PEFT (0.21) also saves the base weight of a targeted layer tied to the embeddings
    // ("...lm_head.base_layer.weight"); that is the base model's tensor, read from the model
    // folder, not an adapter tensor.
    std::vector<std::string> left;
    for (const auto& name : adapter->unused()) {
      if (name.find(".base_layer.") == std::string::npos) left.push_back(name);
    }
    TORCH_CHECK(left.empty(), "[load_llama] adapter '", options.adapter_dir, "' holds ", left.size(),
                " tensor(s) with no LoRA layer in the model, e.g. '", left.empty() ? "" : left.front(),
                "'");
  }
  if (weights) {
    std::vector<std::string> unused;
    for (const auto& name : weights->unused()) {
      if (name.find("rotary_emb.inv_freq") == std::string::npos) unused.push_back(name);
    }
    if (!unused.empty()) {
      std::cerr << "[load_llama] " << unused.size() << " tensor(s) in '" << what
                << "' are not used by the model, e.g. '" << unused.front() << "'\n";
    }
  }
  return model;
}

}  // namespace

std::shared_ptr<LlamaForCausalLM> load_llama(const std::string& dir, const HfLoadOptions& options) {
  const LlamaConfig config = LlamaConfig::from_file((fs::path(dir) / "config.json").string());
  detail::HfWeights weights(dir);
  return build(config, options, &weights, dir);
}

std::shared_ptr<LlamaForCausalLM> make_llama(const LlamaConfig& config, const HfLoadOptions& options) {
  return build(config, options, nullptr, "");
}

void save_llama(LlamaForCausalLM& model, const std::string& dir, at::ScalarType dtype) {
  const char* dtype_name = dtype_config_name(dtype);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<ckpt::TensorSpec> specs;
  for (auto& p : model.named_parameters()) {
    const at::Tensor& t = p.value();
    TORCH_CHECK(t.is_floating_point(), "[save_llama] parameter '", p.key(), "' is ", t.scalar_type(),
                " (a quantized layer); only dense models are written as Hugging Face "
                "checkpoints. HINT: save the adapter (save_peft_adapter) instead");
    ckpt::TensorSpec spec;
    spec.name = p.key();
    spec.dtype = ckpt::to_dtype(dtype);
    spec.shape = t.sizes().vec();
    specs.push_back(spec);
    tensors.emplace_back(p.key(), t);
  }
  fs::create_directories(dir);
  LlamaConfig config = model.config();
  config.dtype = dtype_name;
  ckpt::write_file_atomic((fs::path(dir) / "config.json").string(), config.to_json() + "\n");
  ckpt::SafetensorsWriter writer((fs::path(dir) / "model.safetensors").string(), specs,
                                 {{"format", "pt"}});
  for (auto& [name, t] : tensors) {
    at::Tensor data = t.detach().to(dtype).contiguous();  // one tensor at a time
    writer.write(data.data_ptr(), static_cast<size_t>(data.nbytes()));
  }
  writer.commit();
}

}  // namespace fsdp
