// Hugging Face model folders: Llama weights in, Llama weights out.
//
//   auto model = fsdp::load_llama("Meta-Llama-3-8B");      // config.json + *.safetensors
//
// A folder holds config.json and either model.safetensors or model.safetensors.index.json
// ({"weight_map": {tensor name: shard file}}) with its shard files, as transformers'
// save_pretrained writes them. Tensors are read with the project's safetensors reader
// (src/ckpt/safetensors.h: validated headers, pread of exactly the bytes asked for), one
// tensor at a time, and converted from the file's dtype (F32, BF16, F16) to the parameter's.
//
// Streaming under FSDP: load_llama builds the model layer by layer and loads each decoder layer
// in LlamaForCausalLM's layer hook, before fsdp::nn::built(); inside configure_model under
// FSDPStrategy (FULL_SHARD / SHARD_GRAD_OP, deferred init) each layer is therefore sharded
// right after its tensors are read, and a rank holds at most its shards so far, one full layer
// and the root parameters (embeddings, final norm, head). No rank ever holds the whole model.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"
#include "fsdp/quantization.h"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

// What AutoModelForCausalLM.from_pretrained(..., quantization_config=...) followed by
// prepare_model_for_kbit_training and get_peft_model does, applied to each layer as it is read
// (in this order: load, quantize, freeze and upcast, add adapters), so that under FSDP's
// deferred init a layer is complete when it is sharded.
struct HfLoadOptions {
  // dtype of the loaded parameters (transformers' torch_dtype). fp32 by default, which is
  // also what prepare_for_kbit_training leaves non-quantized parameters in.
  at::ScalarType dtype = at::kFloat;
  // load_in_4bit: dense linear layers become Linear4bit (NF4) as they are read.
  std::optional<QuantizationConfig> quantization;
  // prepare_model_for_kbit_training's parameter part (freeze_and_upcast) and
  // enable_input_require_grads. Gradient checkpointing is the caller's (apply_activation_
  // checkpointing, or FSDPOptions::activation_checkpointing_policy = llama_layer_types()).
  bool prepare_for_kbit_training = false;
  // With prepare_for_kbit_training: which non-quantized parameters become fp32 (KbitUpcast in
  // fsdp/lora.h). kAll is PEFT's behaviour; kNone with dtype = kBFloat16 keeps embeddings,
  // norms and head in bf16 (half their fp32 bytes) -- not what PEFT does, see docs/qlora.md.
  KbitUpcast kbit_upcast = KbitUpcast::kAll;
  // get_peft_model: adapters on the targets (no match in the whole model is an error).
  std::optional<LoraConfig> lora;
  // PeftModel.from_pretrained(model, adapter_dir): the adapter's config (replacing `lora`)
  // and weights, loaded into each layer before it is sharded.
  std::string adapter_dir;
};

// Reads config.json and every tensor of the Llama layout. A tensor the model needs that no file
// holds is an error naming it and the folder; tensors the model does not use are reported on
// stderr and skipped (as transformers warns about unexpected keys).
std::shared_ptr<LlamaForCausalLM> load_llama(const std::string& dir,
                                             const HfLoadOptions& options = {});

// A randomly initialized model of `config` (transformers' init, from the global generator)
// through the same pipeline: quantization, freeze/upcast, adapters (options.adapter_dir loads
// adapter weights). For benchmarks and planning (under fsdp::MetaInitGuard: shapes only).
std::shared_ptr<LlamaForCausalLM> make_llama(const LlamaConfig& config, const HfLoadOptions& options = {});

// Writes `model` as save_pretrained does (config.json + model.safetensors, tensors in
// `dtype`), for models whose linear layers are all dense (fsdp::Linear / TiedLinear). Tied
// heads are not written (transformers ties them at load).
void save_llama(LlamaForCausalLM& model, const std::string& dir, at::ScalarType dtype = at::kFloat);

// --- PEFT adapters: adapter_config.json + adapter_model.safetensors, as PEFT's
// save_pretrained writes them: keys "base_model.model." + the layer's FQN in the model +
// ".lora_A.weight" / ".lora_B.weight" (PEFT drops the adapter name), tensors in their dtype,
// safetensors metadata {"format": "pt"}. PeftModel.from_pretrained loads the folder.

// From the model's LoRA layers (full tensors: not under FSDP, or after gathering).
void save_peft_adapter(torch::nn::Module& model, const LoraConfig& config, const std::string& dir,
                       const std::string& base_model_name_or_path = "");
// From (FQN, full tensor) pairs, e.g. gathered from FSDP shards.
void save_peft_adapter(const std::vector<std::pair<std::string, at::Tensor>>& lora_weights,
                       const LoraConfig& config, const std::string& dir,
                       const std::string& base_model_name_or_path = "");
// The full LoRA weights of `model` by FQN when FSDP may have sharded them (collective over
// `shard_group`, the group parameters are sharded over: every rank calls it). FSDP splits each
// parameter on dim 0 into equal padded chunks (fsdp/fsdp_strategy.h); the layer's own member
// keeps the full shape, the registered parameter is this rank's chunk. Unsharded (or
// NO_SHARD-replicated) weights are copied. Small: adapters only, never the base model.
std::vector<std::pair<std::string, at::Tensor>> gather_lora_weights(torch::nn::Module& model,
                                                                    ProcessGroup* shard_group);
// adapter_config.json of a PEFT adapter folder.
LoraConfig load_peft_config(const std::string& dir);
// Copies the folder's adapter weights into the model's LoRA layers (created before with the
// same config: apply_lora, or load_llama with options.lora = load_peft_config(dir)). Every
// LoRA parameter must be in the file with its shape and every file tensor must have a place:
// otherwise an error names the first mismatch. Under FSDP call it before the layers are
// sharded, or load full tensors and shard after.
void load_peft_adapter(torch::nn::Module& model, const std::string& dir);

}  // namespace fsdp
