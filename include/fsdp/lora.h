// LoRA adapters as PEFT makes them (peft 0.21 LoraConfig / lora.Linear / bnb Linear4bit), and
// prepare_model_for_kbit_training:
//
//   fsdp::LoraConfig lora;
//   lora.r = 8; lora.lora_alpha = 16; lora.lora_dropout = 0.05;
//   lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"};
//   fsdp::prepare_for_kbit_training(*model);          // freeze, fp32, checkpointing, input grads
//   int n = fsdp::apply_lora(*model, lora);           // get_peft_model
//   ... train (only lora_A / lora_B require grad) ...
//   fsdp::save_peft_adapter(*model, lora, "out/checkpoint-100");   // fsdp/hf.h
//
// A targeted linear layer L becomes LoraLinear{base_layer = L, lora_A: in -> r, lora_B: r -> out}
// computing base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, scaling = lora_alpha / r
// (lora_alpha / sqrt(r) with use_rslora). lora_A is Kaiming-uniform (a = sqrt(5)), lora_B zero,
// so a new adapter leaves the model's output unchanged. Names follow PEFT's in-memory layout
// minus the adapter name: "...q_proj.base_layer.weight", "...q_proj.lora_A.weight"; the adapter
// file adds PEFT's "base_model.model." prefix (PEFT keys drop the adapter name on save).
//
// Matching target_modules (PEFT's check_target_module_exists): a layer whose FQN equals an
// entry or ends in "." + entry; a single entry "all-linear" matches every linear layer except
// the output head (lm_head); target_regex (target_modules given as one string) must match the
// whole FQN. No match at all is an error, as in PEFT; entries that match nothing
// (e.g. the recipe's "w1", "w2", "w3", Meta's names, on an HF Llama) are reported on stderr.
// Limits (errors naming the field): bias other than "none", modules_to_save, DoRA, fan_in_fan_out,
// init_lora_weights other than true; only the default adapter (one per model).
#pragma once

#include "fsdp/linear.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace fsdp {

class LlamaForCausalLM;
class FSDPStrategy;

struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0.0;
  std::vector<std::string> target_modules;  // empty: PEFT's Llama default {"q_proj", "v_proj"}
  std::string target_regex;                 // PEFT's string form: FQNs fully matching it
  std::string bias = "none";
  bool use_rslora = false;
  std::string task_type = "CAUSAL_LM";
  std::vector<std::string> modules_to_save;  // must stay empty
  at::ScalarType dtype = at::kFloat;         // adapter weights (PEFT keeps adapters in fp32)

  double scaling() const;
  std::vector<std::string> targets() const;  // target_modules or the Llama default
  void validate() const;
  // adapter_config.json as PEFT 0.21 writes it (peft_type "LORA").
  std::string to_json(const std::string& base_model_name_or_path = "") const;
  // Reads PEFT's adapter_config.json; unsupported settings are errors naming them.
  static LoraConfig from_json(const std::string& json_text, const std::string& what);
};

// One LoRA-adapted linear layer (PEFT lora.Linear / lora.bnb.Linear4bit).
class LoraLinear : public LinearLayer, public LinearOwner {
 public:
  LoraLinear(LinearPtr base, const LoraConfig& config);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  int64_t in_features() const override { return base_layer->in_features(); }
  int64_t out_features() const override { return base_layer->out_features(); }
  at::Tensor dense_weight(at::ScalarType dtype) const override { return base_layer->dense_weight(dtype); }
  at::Tensor dense_bias() const override { return base_layer->dense_bias(); }

  // scaling * B A, (out, in) fp32.
  at::Tensor delta_weight() const;
  // Adds delta_weight() into the base weight (dense: in place; 4-bit: dequantize, add,
  // quantize again -- lossy, as PEFT warns; a head tied to the embeddings: in place into the
  // shared embedding table, so the input embeddings change too, as PEFT's merge does) and stops
  // applying the adapter; unmerge subtracts it.
  void merge();
  void unmerge();
  bool merged() const { return merged_; }
  // Only sets the flag: for merge_lora(FSDPStrategy&, ...), which writes the merged weights into
  // the shards itself.
  void mark_merged(bool merged) { merged_ = merged; }
  double scaling() const { return scaling_; }

  LinearPtr base_layer;
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};

 private:
  double scaling_;
  double dropout_;
  bool merged_ = false;
};

// True when the layer at `fqn` (relative to the model root) is a target of `config`.
bool is_lora_target(const LoraConfig& config, const std::string& fqn);

// get_peft_model for the linear layers under `root` (FQNs are prefix + name): wraps every target
// in a LoraLinear and freezes every other parameter under root (PEFT's
// mark_only_adapters_as_trainable). Returns how many. With require_match, no match is an error and target names
// that matched nothing are reported on stderr; the entries that matched are added to
// `matched_targets` when given (callers applying LoRA piece by piece check the total).
int apply_lora(torch::nn::Module& root, const LoraConfig& config, const std::string& prefix = "",
               bool require_match = true, std::set<std::string>* matched_targets = nullptr);

// The adapter parameters by FQN (lora_A / lora_B weights), in model order.
std::vector<std::pair<std::string, at::Tensor>> lora_parameters(torch::nn::Module& root);

// PEFT merge_and_unload / unmerge for every LoraLinear under root, in one process. A model
// whose parameters FSDP has sharded is an error naming merge_lora(FSDPStrategy&, root).
void merge_lora(torch::nn::Module& root);
void unmerge_lora(torch::nn::Module& root);

// The same on a model sharded by `strategy` (after setup_module; collective: every rank of the
// strategy calls it). Layer by layer: each adapted layer's lora_A, lora_B and base tensors are
// gathered from their shards, merged as the single-process merge does (dense: added; tied
// head: into the shared table; 4-bit: dequantized, added, quantized again), and each rank
// writes its own rows of the result back into its shards, so a rank holds at most one layer's
// full tensors beside its shards. Results equal the single-process merge_lora bit for bit
// (tested with FULL_SHARD at worlds 2 and 3, also under bf16 mixed precision). See Note
// [Merging sharded adapters] in src/shard/lora_merge.cpp.
void merge_lora(FSDPStrategy& strategy, torch::nn::Module& root);
void unmerge_lora(FSDPStrategy& strategy, torch::nn::Module& root);

// Which non-quantized base parameters prepare_model_for_kbit_training casts to fp32.
//   kAll    every floating bf16/fp16 parameter: embeddings, norms, the head (PEFT's behaviour,
//           the default)
//   kNorms  only the norms' weights (RMSNorm); embeddings and head keep their dtype
//   kNone   nothing: every parameter keeps the dtype it was loaded in (HfLoadOptions::dtype)
// Adapters are created afterwards in LoraConfig::dtype (fp32) whatever the choice.
enum class KbitUpcast { kAll, kNorms, kNone };
// "all" | "norms" | "none"; anything else is an error listing them (`what` names the source).
KbitUpcast parse_kbit_upcast(const std::string& text, const std::string& what = "kbit_upcast");
const char* to_string(KbitUpcast upcast);

// prepare_model_for_kbit_training, for one subtree (the HF loader calls it per layer, before
// FSDP shards the layer): every parameter frozen, floating bf16/fp16 parameters cast to fp32 as
// `upcast` says (quantized uint8 storage untouched). A parameter is a norm's when its module is
// an RMSNorm (its FQN's last module name ends in "norm" or "layernorm").
void freeze_and_upcast(torch::nn::Module& module, KbitUpcast upcast = KbitUpcast::kAll);

// The whole of prepare_model_for_kbit_training on a Llama: freeze_and_upcast, and with
// use_gradient_checkpointing: activation checkpointing on every decoder layer plus
// enable_input_require_grads (the embeddings' output requires grad, so checkpointed layers
// back-propagate into the adapters inside them).
void prepare_for_kbit_training(LlamaForCausalLM& model, bool use_gradient_checkpointing = true,
                               KbitUpcast upcast = KbitUpcast::kAll);

}  // namespace fsdp
