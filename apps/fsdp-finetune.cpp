// fsdp-finetune: QLoRA fine-tuning of a Hugging Face Llama model, the FSDP-QLoRA recipe (4-bit
// NF4 + double quantization base, LoRA adapters, 8-bit AdamW, FSDP) in one command (one line):
//
//   fsdp-finetune --model-dir Meta-Llama-3-8B --data train.jsonl --strategy fsdp --devices 2
//     --per-device-train-batch-size 16 --gradient-accumulation-steps 8 --num-train-epochs 3
//     --learning-rate 2.5e-5 --warmup-steps 2 --logging-steps 1 --optim paged_adamw_8bit
//     --save-steps 100 --save-total-limit 2 --output-dir results
//     --lora-r 8 --lora-alpha 16 --lora-dropout 0.05
//     --lora-target-modules q_proj,k_proj,v_proj,o_proj,w1,w2,w3,lm_head
//
// Flags carry transformers.TrainingArguments / LoraConfig / BitsAndBytesConfig names (dashes
// for underscores). Adapters are saved in PEFT's format to OUTPUT_DIR/checkpoint-<step> every
// --save-steps optimizer steps (the --save-total-limit newest kept) and to OUTPUT_DIR/final.
// --preset NAME replaces --model-dir with a randomly initialized model of a named layout (no
// files; benchmarks); --dry-run prints the per-rank memory plan and exits without allocating.
// The strategy comes from the registry (include/fsdp/strategy_registry.h): any single, ddp or
// fsdp strategy; the flags shared with fsdp-train, the planner and the summary JSON are in
// apps/support/.
#include <fsdp/causal_lm_data.h>
#include <fsdp/fsdp.h>
#include <fsdp/hf.h>
#include <fsdp/llama.h>
#include <fsdp/lora.h>
#include <fsdp/optim8bit.h>
#include <fsdp/quantization.h>
#include <fsdp/tokenizer.h>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "support/flags.h"
#include "support/planner.h"
#include "support/summary.h"

namespace {

namespace fs = std::filesystem;

struct Args {
  // Model
  std::string model_dir;
  std::string preset;
  std::string tokenizer_dir;
  bool load_in_4bit = true;
  bool double_quant = true;
  std::string compute_dtype = "bfloat16";
  std::string base_dtype = "float32";  // non-quantized base parameters (torch_dtype)
  std::string kbit_upcast = "all";     // which of them prepare_model_for_kbit_training makes fp32
  // LoRA
  int64_t lora_r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0.05;
  std::string lora_target_modules = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
  // Data
  std::string data;
  std::string text_field = "text";
  int64_t max_length = 512;
  int64_t synthetic_examples = 0;  // --data synthetic: random token sequences (benchmarks)
  // TrainingArguments
  std::string output_dir = "results";
  int64_t warmup_steps = 0;
  int64_t per_device_train_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  double num_train_epochs = 3;
  int64_t max_steps = -1;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  int64_t logging_steps = 10;
  int64_t save_steps = 500;
  int64_t save_total_limit = -1;
  bool gradient_checkpointing = true;
  bool vocabulary_units = true;
  std::string optim = "paged_adamw_8bit";
  double max_grad_norm = 1.0;              // transformers' default
  std::string lr_scheduler_type = "linear";
  double warmup_ratio = 0;                 // used when --warmup-steps is 0
  std::string save_strategy = "steps";
  std::string report_to = "all";           // transformers 5: "none" (see docs/qlora.md)
  std::string logging_dir;                 // "": --output-dir
  bool bf16 = false;
  bool fp16 = false;
  bool average_tokens_across_devices = true;
  std::string quant_type = "nf4";          // --bnb-4bit-quant-type
  // Trainer, strategy and output: the flags fsdp-train has too.
  fsdp::app::CommonArgs common;

  Args() { common.trainer.seed = 42; }
  int world() const { return common.world(); }
  uint64_t seed() const { return static_cast<uint64_t>(common.trainer.seed); }
};

// The dtype names --bnb-4bit-compute-dtype and --base-dtype take (parse_dtype).
const std::vector<std::string> kDtypeNames = {"bfloat16", "bf16", "float32", "fp32"};
// --num-train-epochs at most this: epochs x steps per epoch must stay a count of steps.
constexpr double kMaxEpochs = 1e6;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

at::ScalarType parse_dtype(const std::string& name, const char* flag) {
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float32" || name == "fp32") return at::kFloat;
  TORCH_CHECK(false, "[fsdp-finetune] ", flag, " '", name, "': use bfloat16 or float32");
}

fsdp::LlamaConfig model_config(const Args& a) {
  if (!a.preset.empty()) return fsdp::llama_preset(a.preset);
  return fsdp::LlamaConfig::from_file((fs::path(a.model_dir) / "config.json").string());
}

fsdp::HfLoadOptions load_options(const Args& a) {
  fsdp::HfLoadOptions o;
  o.dtype = parse_dtype(a.base_dtype, "--base-dtype");
  if (a.load_in_4bit) {
    fsdp::QuantizationConfig q;
    q.double_quant = a.double_quant;
    q.compute_dtype = parse_dtype(a.compute_dtype, "--bnb-4bit-compute-dtype");
    o.quantization = q;
    o.prepare_for_kbit_training = true;  // prepare_model_for_kbit_training (parameters part)
    o.kbit_upcast = fsdp::parse_kbit_upcast(a.kbit_upcast, "fsdp-finetune --kbit-upcast");
  }
  fsdp::LoraConfig lora;
  lora.r = a.lora_r;
  lora.lora_alpha = a.lora_alpha;
  lora.lora_dropout = a.lora_dropout;
  lora.target_modules = split_list(a.lora_target_modules);
  o.lora = lora;
  return o;
}

// transformers' schedules (get_scheduler): lr * s/warmup during warmup, then
//   linear: linearly to 0 at the last step; cosine: 0.5 * (1 + cos(pi * progress));
//   constant_with_warmup: 1; constant: 1 from the first step (no warmup, as transformers).
// Optimizer step k uses base * lambda(k).
class WarmupSchedule : public torch::optim::LRScheduler {
 public:
  WarmupSchedule(torch::optim::Optimizer& opt, std::string type, int64_t warmup, int64_t total)
      : LRScheduler(opt), type_(std::move(type)), warmup_(warmup), total_(total) {
    for (auto& g : opt.param_groups()) base_.push_back(g.options().get_lr());
    for (size_t i = 0; i < base_.size(); ++i) opt.param_groups()[i].options().set_lr(base_[i] * lambda(0));
  }

 private:
  double lambda(int64_t s) const {
    if (type_ == "constant") return 1.0;
    if (s < warmup_) return static_cast<double>(s) / std::max<int64_t>(1, warmup_);
    if (type_ == "constant_with_warmup") return 1.0;
    const double progress =
        static_cast<double>(s - warmup_) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
    if (type_ == "cosine") return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
    return std::max(0.0, 1.0 - progress);  // linear
  }
  std::vector<double> get_lrs() override {
    std::vector<double> out;
    for (double b : base_) out.push_back(b * lambda(static_cast<int64_t>(step_count_) + 1));
    return out;
  }
  std::string type_;
  int64_t warmup_, total_;
  std::vector<double> base_;
};

// --warmup-steps, or ceil(--warmup-ratio x total) when it is 0 (transformers'
// get_warmup_steps).
int64_t warmup_steps(const Args& a, int64_t total_steps) {
  if (a.warmup_steps > 0) return a.warmup_steps;
  return static_cast<int64_t>(std::ceil(a.warmup_ratio * static_cast<double>(total_steps)));
}

// Note [Token-weighted loss]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// transformers 5 (average_tokens_across_devices, num_items_in_batch) divides the summed token
// losses of an optimizer step by the number of target tokens in the whole step: every rank's
// micro-batches of it together. A mean of per-rank means weights a rank with few real tokens
// (much padding) as much as one with many. The step's count needs no collective here: every
// rank knows the shared epoch order (DistributedSampler::epoch_order, Note [Sampler striding])
// and so which examples all ranks read in each micro-batch. A micro-batch's loss is then
//   sum of its token losses x world x m / tokens of the step,
// m the micro-batches of this step (the accumulation steps, fewer in an epoch's last partial
// group): the Trainer divides it by the accumulation steps and the strategies average gradients
// over ranks, so the gradient is the step's token mean, and the mean of the returned losses over
// the step's micro-batches and ranks -- the logged loss -- is exactly the token-weighted loss.
class StepTokens {
 public:
  StepTokens(std::shared_ptr<fsdp::CausalLMDataset> data, int64_t accumulation)
      : data_(std::move(data)), k_(accumulation), valid_(data_->size(), -1) {}

  struct Counts {
    int64_t step_tokens;    // target tokens of the step holding the micro-batch, all ranks
    int64_t micro_batches;  // micro-batches of that step
    int64_t batch_tokens;   // target tokens of this micro-batch, all ranks
  };
  Counts of(const fsdp::DataLoader& loader, int64_t batch_idx) {
    const fsdp::DistributedSampler& s = loader.sampler();
    if (s.epoch() != epoch_ || order_.empty()) {
      order_ = s.epoch_order();
      epoch_ = s.epoch();
    }
    const int64_t per_batch = loader.batch_size() * s.world();
    const int64_t batches = loader.num_batches();
    const int64_t first = batch_idx / k_ * k_;
    const int64_t last = std::min(first + k_, batches);
    Counts c{0, last - first, 0};
    for (int64_t b = first; b < last; ++b) {
      int64_t tokens = 0;
      for (int64_t p = b * per_batch; p < (b + 1) * per_batch; ++p) tokens += valid(order_[p]);
      c.step_tokens += tokens;
      if (b == batch_idx) c.batch_tokens = tokens;
    }
    return c;
  }

 private:
  int64_t valid(int64_t i) {
    if (valid_[i] < 0) valid_[i] = data_->get(i).target.ne(-100).sum().item<int64_t>();
    return valid_[i];
  }
  std::shared_ptr<fsdp::CausalLMDataset> data_;
  int64_t k_;
  std::vector<int64_t> valid_;  // target tokens per example (-1: not counted yet)
  std::vector<int64_t> order_;
  int64_t epoch_ = -1;
};

// The model configure_model builds, for the wrap policy made before it (llama_units).
using BuiltModel = std::weak_ptr<fsdp::LlamaForCausalLM>;

// Under FSDP: a unit per decoder layer and, untied, the embedding table and the head
// (torchtitan's split; LlamaForCausalLM::is_unit). The head has no type of its own, so the
// policy asks the model once it exists; before that (each layer as configure_model builds it)
// the types decide. Without `vocabulary`: the layers only (the vocabulary in the root unit).
fsdp::AutoWrapPolicy llama_units(std::shared_ptr<BuiltModel> built, bool vocabulary) {
  if (!vocabulary) return fsdp::AutoWrapPolicy::of_types(fsdp::llama_layer_types());
  return fsdp::AutoWrapPolicy::of_predicate([built](const torch::nn::Module& m, int64_t) {
    return fsdp::is_llama_unit(built->lock().get(), m);
  });
}

class Finetune : public fsdp::LightningModule {
 public:
  // `strategy_checkpoints`: the strategy applies activation checkpointing itself (FSDP's
  // activation_checkpointing_policy), so the model does not.
  // `step_tokens` (null: per-rank mean losses): Note [Token-weighted loss]; `loader` the
  // loader fit() reads (the Trainer gives it this rank's sampler).
  // `built` receives the model once configure_model has built it (the wrap policy asks it).
  Finetune(const Args& a, int64_t total_steps, bool strategy_checkpoints,
           std::shared_ptr<StepTokens> step_tokens, const fsdp::DataLoader* loader,
           std::shared_ptr<BuiltModel> built)
      : a_(a),
        total_steps_(total_steps),
        strategy_checkpoints_(strategy_checkpoints),
        step_tokens_(std::move(step_tokens)),
        loader_(loader),
        built_(std::move(built)) {}

  void configure_model() override {
    if (model) return;
    fsdp::HfLoadOptions o = load_options(a_);
    model = register_module("model", a_.preset.empty() ? fsdp::load_llama(a_.model_dir, o)
                                                        : fsdp::make_llama(model_config(a_), o));
    if (built_) *built_ = model;
    // enable_input_require_grads: checkpointed layers back-propagate into their adapters even
    // though the frozen embedding's output needs no gradient. Under FSDP the strategy applies
    // checkpointing (FSDPOptions::activation_checkpointing_policy).
    if (a_.gradient_checkpointing) model->model->input_require_grads = true;
    if (a_.gradient_checkpointing && !strategy_checkpoints_) {
      fsdp::apply_activation_checkpointing(*model, fsdp::llama_layer_types());
    }
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t batch_idx) override {
    const int64_t n = fsdp::used_length(batch);  // drop right padding beyond every target
    at::Tensor logits = (*model)(batch.input.narrow(1, 0, n));  // (B, n, V)
    at::Tensor target = batch.target.narrow(1, 0, n).reshape({-1});
    at::Tensor flat = logits.to(at::kFloat).reshape({target.numel(), -1});
    at::Tensor loss, logged;
    if (step_tokens_) {
      const StepTokens::Counts c = step_tokens_->of(*loader_, batch_idx);
      const double world = static_cast<double>(trainer()->world_size());
      at::Tensor sum = at::cross_entropy_loss(flat, target, {}, at::Reduction::Sum, -100);
      loss = sum * (world * static_cast<double>(c.micro_batches) /
                    static_cast<double>(std::max<int64_t>(1, c.step_tokens)));
      // The micro-batch's token mean over all ranks, once sync_dist averages it.
      logged = sum.detach() * (world / static_cast<double>(std::max<int64_t>(1, c.batch_tokens)));
    } else {
      loss = at::cross_entropy_loss(flat, target, {}, at::Reduction::Mean, -100);
      logged = loss;
    }
    fsdp::LogOptions o;
    o.prog_bar = true;
    o.sync_dist = true;
    log("train_loss", logged, o);
    // As transformers logs it: the learning rate this step uses.
    if (opt_) log("learning_rate", opt_->param_groups()[0].options().get_lr());
    return loss;
  }

  fsdp::OptimizerConfig configure_optimizers() override {
    std::vector<at::Tensor> trainable;
    for (auto& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    std::shared_ptr<torch::optim::Optimizer> opt;
    if (a_.optim == "adamw_torch") {
      opt = std::make_shared<torch::optim::AdamW>(
          trainable, torch::optim::AdamWOptions(a_.learning_rate).weight_decay(a_.weight_decay));
    } else {
      opt = std::make_shared<fsdp::AdamW8bit>(
          trainable, fsdp::AdamW8bitOptions(a_.learning_rate)
                         .weight_decay(a_.weight_decay)
                         .paged(a_.optim == "paged_adamw_8bit"));
    }
    opt_ = opt.get();
    auto sched = std::make_shared<WarmupSchedule>(*opt, a_.lr_scheduler_type,
                                                  warmup_steps(a_, total_steps_), total_steps_);
    return {opt, sched};
  }

  std::shared_ptr<fsdp::LlamaForCausalLM> model;

 private:
  Args a_;
  int64_t total_steps_;
  bool strategy_checkpoints_;
  torch::optim::Optimizer* opt_ = nullptr;
  std::shared_ptr<StepTokens> step_tokens_;
  const fsdp::DataLoader* loader_;
  std::shared_ptr<BuiltModel> built_;
};

// PEFT adapter checkpoints: OUTPUT_DIR/checkpoint-<step> every save_steps optimizer steps,
// keeping the save_total_limit newest (HF Trainer's save_strategy="steps").
class AdapterCheckpoint : public fsdp::Callback {
 public:
  AdapterCheckpoint(const Args& a, fsdp::LoraConfig lora, std::string base)
      : a_(a), lora_(std::move(lora)), base_(std::move(base)) {}

  void on_train_batch_end(fsdp::Trainer& t, fsdp::LightningModule& m, int64_t) override {
    const int64_t step = t.global_step();
    if (a_.save_strategy != "steps" || a_.save_steps <= 0 || step == 0 ||
        step % a_.save_steps != 0) {
      return;
    }
    save_step(t, m, step);
  }

  void on_train_epoch_end(fsdp::Trainer& t, fsdp::LightningModule& m) override {
    if (a_.save_strategy == "epoch" && t.global_step() > 0) save_step(t, m, t.global_step());
  }

  void on_train_end(fsdp::Trainer& t, fsdp::LightningModule& m) override {
    save(t, m, (fs::path(a_.output_dir) / "final").string());
  }

 private:
  void save_step(fsdp::Trainer& t, fsdp::LightningModule& m, int64_t step) {
    if (step == last_saved_) return;
    save(t, m, (fs::path(a_.output_dir) / ("checkpoint-" + std::to_string(step))).string());
    last_saved_ = step;
    if (t.is_global_zero()) {
      saved_.push_back(step);
      while (a_.save_total_limit > 0 && static_cast<int64_t>(saved_.size()) > a_.save_total_limit) {
        fs::remove_all(fs::path(a_.output_dir) / ("checkpoint-" + std::to_string(saved_.front())));
        saved_.erase(saved_.begin());
      }
    }
  }

  void save(fsdp::Trainer& t, fsdp::LightningModule& m, const std::string& dir) {
    auto& f = static_cast<Finetune&>(m);
    // Collective: every rank gathers its adapter shards; rank 0 writes.
    auto weights = fsdp::gather_lora_weights(*f.model, t.world().get());
    if (t.is_global_zero()) {
      fsdp::save_peft_adapter(weights, lora_, dir, base_);
      t.print("[fsdp-finetune] saved adapter to " + dir);
    }
    t.strategy()->barrier();
  }

  Args a_;
  fsdp::LoraConfig lora_;
  std::string base_;
  int64_t last_saved_ = -1;
  std::vector<int64_t> saved_;
};

// Logical parameter counts (a 4-bit weight counts its out x in elements), as PEFT's
// print_trainable_parameters.
std::pair<int64_t, int64_t> logical_counts(const fsdp::LlamaConfig& c, const fsdp::LoraConfig& lora) {
  int64_t trainable = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const int64_t C = c.hidden_size, D = c.head_size(), H = c.num_attention_heads, KV = c.kv_heads();
    const int64_t I = c.intermediate_size;
    const std::vector<std::tuple<std::string, int64_t, int64_t>> linears = {
        {"self_attn.q_proj", C, H * D},  {"self_attn.k_proj", C, KV * D}, {"self_attn.v_proj", C, KV * D},
        {"self_attn.o_proj", H * D, C}, {"mlp.gate_proj", C, I},         {"mlp.up_proj", C, I},
        {"mlp.down_proj", I, C}};
    for (const auto& [name, in, out] : linears) {
      if (fsdp::is_lora_target(lora, pre + name)) trainable += lora.r * (in + out);
    }
  }
  if (fsdp::is_lora_target(lora, "lm_head")) trainable += lora.r * (c.hidden_size + c.vocab_size);
  return {c.parameter_count() + trainable, trainable};
}

// --dry-run: the recipe's one strategy (FSDP FULL_SHARD, a unit per decoder layer and, untied,
// the embedding and the head) with the run's optimizer, on the meta device.
int dry_run(const Args& a) {
  const fsdp::LlamaConfig config = model_config(a);
  const fsdp::HfLoadOptions o = load_options(a);
  std::shared_ptr<fsdp::LlamaForCausalLM> model;
  {
    fsdp::MetaInitGuard meta;  // shapes only: nothing allocated, nothing read
    model = fsdp::make_llama(config, o);
  }
  const int world = a.world();
  fsdp::FSDPOptions fo;
  fo.auto_wrap_policy = llama_units(std::make_shared<BuiltModel>(model), a.vocabulary_units);
  fsdp::app::PlanRow row = fsdp::app::plan_fsdp(*model, fo, world, a.common.trainer.devices);
  const auto [all, trainable] = logical_counts(config, *o.lora);
  int64_t base_bytes = 0, quantized_elems = 0;
  for (auto& m : model->modules()) {
    if (auto* q = dynamic_cast<fsdp::Linear4bit*>(m.get())) {
      quantized_elems += q->in_features() * q->out_features();
      base_bytes += fsdp::linear4bit_nbytes(q->out_features(), q->in_features(), *o.quantization);
    }
  }
  // The planner counts fp32 Adam; 8-bit AdamW keeps two uint8 moments + two fp32 absmaxes per
  // 256 elements, on this rank's shard.
  const int64_t shard_trainable = (trainable + world - 1) / world;
  row.optimizer = a.optim == "adamw_torch" ? 8 * shard_trainable
                                           : 2 * shard_trainable + 8 * ((shard_trainable + 255) / 256);
  const std::string name = a.preset.empty() ? a.model_dir : a.preset;
  std::cout << "[fsdp-finetune] dry run: " << name << ", " << all << " parameters (" << trainable
            << " trainable LoRA, " << 100.0 * trainable / all << "%), 4-bit "
            << (a.load_in_4bit ? "on" : "off") << ", world " << world
            << " (FSDP FULL_SHARD, a unit per decoder layer"
            << (a.vocabulary_units && !config.tie_word_embeddings ? ", the embedding and the head" : "")
            << "); nothing allocated" << std::endl;
  if (quantized_elems > 0) {
    std::printf("quantized base: %lld weights in %s = %.4f bytes/weight\n",
                static_cast<long long>(quantized_elems), fsdp::format_bytes(base_bytes).c_str(),
                static_cast<double>(base_bytes) / quantized_elems);
  }
  const fsdp::ModelStateBudget budget =
      fsdp::app::plan_budget(a.common.trainer.accelerator, a.common.trainer.devices);
  fsdp::app::print_plan({row}, budget);
  const int64_t rss = fsdp::peak_rss_bytes();
  std::cout << "params: base + LoRA; grads: LoRA only; Adam state: "
            << (a.optim == "adamw_torch" ? "AdamW" : "8-bit AdamW")
            << "; units: the root and the two largest units unsharded. Activations not included "
               "(gradient checkpointing keeps one layer's input per layer). Peak RSS of this dry "
               "run: "
            << fsdp::format_bytes(rss) << std::endl;
  if (!a.common.summary_json.empty()) {
    fsdp::app::write_json(a.common.summary_json,
                          {{"model", name}, {"params", all}, {"trainable_params", trainable},
                           {"world_size", world}, {"quantized_weights", quantized_elems},
                           {"quantized_bytes", base_bytes}, {"sharded_param_bytes", row.params},
                           {"sharded_grad_bytes", row.grads}, {"optimizer_bytes", row.optimizer},
                           {"unsharded_peak_bytes", row.extra}, {"total_bytes", row.total()},
                           {"peak_rss_bytes", rss},
                           {"budget", fsdp::app::budget_json(budget)},
                           {"strategies", fsdp::app::plan_json({row}, budget)}});
  }
  return 0;
}

std::shared_ptr<fsdp::CausalLMDataset> load_data(const Args& a, const fsdp::LlamaConfig& config,
                                                 std::string* description) {
  if (a.data == "synthetic") {
    // Random token sequences of max_length (benchmarks without a tokenizer).
    TORCH_CHECK(a.synthetic_examples > 0, "[fsdp-finetune] --data synthetic needs --synthetic-examples N");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(a.seed());
    at::Tensor ids = at::randint(config.vocab_size, {a.synthetic_examples, a.max_length}, gen, at::kLong);
    std::vector<std::vector<int64_t>> seqs;
    for (int64_t i = 0; i < a.synthetic_examples; ++i) {
      const int64_t* p = ids[i].data_ptr<int64_t>();
      seqs.emplace_back(p, p + a.max_length);
    }
    *description = std::to_string(a.synthetic_examples) + " random sequences of " + std::to_string(a.max_length);
    return std::make_shared<fsdp::CausalLMDataset>(std::move(seqs), a.max_length, 0);
  }
  const std::string tok_dir = a.tokenizer_dir.empty() ? a.model_dir : a.tokenizer_dir;
  TORCH_CHECK(!tok_dir.empty(), "[fsdp-finetune] text data needs a tokenizer: pass --tokenizer-dir "
              "(a folder with tokenizer.json) or --model-dir");
  fsdp::Tokenizer tok = fsdp::Tokenizer::from_pretrained(tok_dir);
  // The recipe: AutoTokenizer(..., add_eos_token=True, add_bos_token=True); pad = eos.
  tok.add_bos_token = tok.add_eos_token = true;
  if (tok.bos_token_id < 0 && config.bos_token_id >= 0) tok.bos_token_id = config.bos_token_id;
  if (tok.eos_token_id < 0 && !config.eos_token_ids.empty()) tok.eos_token_id = config.eos_token_ids[0];
  tok.pad_token_id = tok.eos_token_id;
  TORCH_CHECK(tok.pad_token_id >= 0, "[fsdp-finetune] the tokenizer has no EOS token to pad with");
  auto texts = fsdp::read_text_examples(a.data, a.text_field);
  TORCH_CHECK(!texts.empty(), "[fsdp-finetune] '", a.data, "' holds no examples");
  auto data = std::make_shared<fsdp::CausalLMDataset>(texts, tok, a.max_length);
  *description = std::to_string(data->size()) + " examples, " + std::to_string(data->num_tokens()) +
                 " tokens (" + std::to_string(data->truncated()) + " truncated to " +
                 std::to_string(a.max_length) + ")";
  return data;
}

int run(const Args& a, const fsdp::app::CommonFlags& flags) {
  TORCH_CHECK(!a.data.empty(), "[fsdp-finetune] pass --data FILE (a .jsonl or text file) or --data synthetic");
  fsdp::seed_everything(a.seed());
  const fsdp::LlamaConfig config = model_config(a);
  std::string data_desc;
  auto data = load_data(a, config, &data_desc);  // fails once, before other ranks start

  fsdp::TrainerOptions t = a.common.trainer;
  // Under FSDP: a unit per decoder layer (checkpointed by the strategy), the embedding and the
  // head when untied.
  fsdp::StrategyOptions so;
  auto built = std::make_shared<BuiltModel>();
  so.fsdp.auto_wrap_policy = llama_units(built, a.vocabulary_units);
  if (a.gradient_checkpointing) so.fsdp.activation_checkpointing_policy = fsdp::llama_layer_types();
  t.strategy = flags.make_strategy(so);
  const int64_t world = a.world();
  const int64_t batches_per_epoch = data->size() / (a.per_device_train_batch_size * world);
  TORCH_CHECK(batches_per_epoch > 0, "[fsdp-finetune] ", data->size(), " examples are fewer than one "
              "batch of ", a.per_device_train_batch_size, " x ", world, " ranks");
  const int64_t steps_per_epoch = std::max<int64_t>(1, batches_per_epoch / a.gradient_accumulation_steps);
  const int64_t total_steps = a.max_steps > 0 ? a.max_steps
                                              : static_cast<int64_t>(std::ceil(a.num_train_epochs * steps_per_epoch));
  t.max_steps = total_steps;
  t.max_epochs = static_cast<int64_t>(std::ceil(a.num_train_epochs));
  if (a.max_steps > 0) t.max_epochs = -1;
  t.accumulate_grad_batches = a.gradient_accumulation_steps;
  t.log_every_n_steps = a.logging_steps;
  t.default_root_dir = a.logging_dir.empty() ? a.output_dir : a.logging_dir;
  t.gradient_clip_val = a.max_grad_norm;
  if (a.bf16) t.precision = "bf16-mixed";
  fsdp::app::set_loggers(t, a.report_to);
  const fsdp::HfLoadOptions lo = load_options(a);
  const std::string name = a.preset.empty() ? a.model_dir : a.preset;
  t.callbacks.push_back(std::make_shared<AdapterCheckpoint>(a, *lo.lora, name));
  const fsdp::app::RunRecorders recorders = fsdp::app::add_run_recorders(t);
  fsdp::Trainer trainer(t);  // devices > 1: the other ranks start here

  fsdp::DataLoader loader(data, a.per_device_train_batch_size,
                          fsdp::DistributedSampler(data->size(), 1, 0, /*shuffle=*/true, a.seed()), true);
  Finetune module(a, total_steps, flags.family() == fsdp::StrategyFamily::kFSDP,
                  a.average_tokens_across_devices
                      ? std::make_shared<StepTokens>(data, a.gradient_accumulation_steps)
                      : nullptr,
                  &loader, built);
  const auto [all, trainable] = logical_counts(config, *lo.lora);
  std::ostringstream head;
  head << "[fsdp-finetune] " << name << ": "
       << (a.load_in_4bit ? std::string("NF4") + (a.double_quant ? " + double quant" : "") + ", compute " + a.compute_dtype
                          : "dense " + a.base_dtype)
       << "; trainable params: " << trainable << " || all params: " << all << " || trainable%: "
       << 100.0 * trainable / all << "\n[fsdp-finetune] data: " << data_desc << "; " << total_steps
       << " optimizer steps of " << a.per_device_train_batch_size << " x " << world << " ranks x "
       << a.gradient_accumulation_steps << " accumulation; optim " << a.optim << ", strategy "
       << trainer.strategy()->name() << (a.gradient_checkpointing ? ", gradient checkpointing" : "");
  trainer.print(head.str());
  trainer.fit(module, loader);

  nlohmann::json j = fsdp::app::run_summary(trainer, recorders);
  if (trainer.is_global_zero() && !a.common.summary_json.empty()) {
    j["model"] = name;
    j["load_in_4bit"] = a.load_in_4bit;
    j["params"] = all;  // logical: a 4-bit weight counts its out x in elements
    j["trainable_params"] = trainable;
    j["kbit_upcast"] = a.load_in_4bit ? a.kbit_upcast : "n/a";
    j["base_dtype"] = a.base_dtype;
    fsdp::app::write_json(a.common.summary_json, j);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "fsdp-finetune: QLoRA fine-tuning of a Hugging Face Llama model (NF4 base, LoRA "
      "adapters in PEFT's format, 8-bit AdamW, FSDP).\nRanks are processes: --devices N runs N "
      "processes (this program re-executes itself N - 1 times)."};
  app.option_defaults()->always_capture_default();
  app.get_formatter()->column_width(40);
  using fsdp::cli::at_least;
  using fsdp::cli::between;
  using fsdp::cli::greater_than;
  using fsdp::cli::one_of;
  // Trainer, strategy, output: what fsdp-train has too. The strategies: single, ddp and FSDP
  // (the recipe's); the model picks its FSDP units and checkpointing itself.
  fsdp::app::CommonFlagsSpec spec;
  spec.families = {fsdp::StrategyFamily::kSingle, fsdp::StrategyFamily::kDDP,
                   fsdp::StrategyFamily::kFSDP};
  spec.family_flags = false;
  spec.precisions = {"32-true", "bf16-mixed"};
  spec.precision_help = "32-true (4-bit layers still compute in --bnb-4bit-compute-dtype) | bf16-mixed";
  spec.dry_run_help = "print the per-rank memory plan at --devices (meta device) and exit";
  spec.summary_json_help = "write the run summary as JSON here";
  fsdp::app::CommonFlags flags(app, a.common, spec);
  app.option_defaults()->group("Model");
  auto* o_dir = app.add_option("--model-dir,--model-name-or-path", a.model_dir,
                               "Hugging Face model folder (config.json, *.safetensors)")
                    ->check(fsdp::cli::input_dir());
  auto* o_preset = app.add_option("--preset", a.preset, "instead of --model-dir: a random model of this layout")
                       ->check(one_of(fsdp::llama_preset_names()));
  o_dir->excludes(o_preset);
  app.add_option("--tokenizer-dir", a.tokenizer_dir, "folder with tokenizer.json (default: --model-dir)")
      ->check(fsdp::cli::input_dir());
  app.add_flag("--load-in-4bit,!--no-load-in-4bit", a.load_in_4bit, "NF4-quantize the base's linear layers (QLoRA)")
      ->default_str(a.load_in_4bit ? "on" : "off");
  app.add_flag("--bnb-4bit-use-double-quant,!--no-double-quant", a.double_quant, "8-bit absmaxes (double quantization)")
      ->default_str(a.double_quant ? "on" : "off");
  app.add_option("--bnb-4bit-compute-dtype", a.compute_dtype, "4-bit layers compute in: bfloat16 | float32")
      ->check(one_of(kDtypeNames));
  app.add_option("--base-dtype,--torch-dtype", a.base_dtype,
                 "dtype of the non-quantized base parameters: float32 | bfloat16")
      ->check(one_of(kDtypeNames));
  app.add_option("--bnb-4bit-quant-type", a.quant_type, "4-bit data type: nf4 (fp4 is not implemented)")
      ->check(one_of({"nf4", "fp4"}));
  app.add_option("--kbit-upcast", a.kbit_upcast,
                 "with --load-in-4bit, which non-quantized parameters become fp32: all (PEFT's "
                 "prepare_model_for_kbit_training) | norms | none (keep --base-dtype)")
      ->check(one_of({"all", "norms", "none"}));
  app.option_defaults()->group("LoRA");
  app.add_option("--lora-r", a.lora_r, "LoRA rank")->check(at_least(int64_t{1}));
  app.add_option("--lora-alpha", a.lora_alpha, "LoRA alpha (scaling = alpha / r)")->check(greater_than(0.0));
  app.add_option("--lora-dropout", a.lora_dropout, "dropout on the adapter input")->check(between(0.0, 0.99));
  app.add_option("--lora-target-modules", a.lora_target_modules,
                 "comma-separated layer names (PEFT matching), or all-linear")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            if (auto why = fsdp::cli::detail::text_problem(text); !why.empty()) return why;
            return split_list(text).empty() ? "'" + text + "' names no module (give e.g. "
                                              "q_proj,v_proj or all-linear)"
                                            : std::string();
          },
          "", std::string(fsdp::cli::kCheckPrefix) + "module_list"));
  app.option_defaults()->group("Data");
  app.add_option("--data", a.data, "a local .jsonl (one {\"text\": ...} per line) or text file "
                 "(one example per paragraph), or synthetic")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            std::string path = text;
            return text == "synthetic" ? std::string() : fsdp::cli::input_file()(path);
          },
          "", std::string(fsdp::cli::kCheckPrefix) + "input_file"));
  app.add_option("--text-field,--dataset-text-field", a.text_field, "JSONL field holding the text");
  app.add_option("--max-length", a.max_length, "tokens per example (longer ones are truncated)")
      ->check(at_least(int64_t{2}));
  app.add_option("--synthetic-examples", a.synthetic_examples, "--data synthetic: number of random sequences")
      ->check(at_least(int64_t{1}));
  app.option_defaults()->group("TrainingArguments");
  app.add_option("--output-dir", a.output_dir, "checkpoint-<step>/ and final/ adapters, logs")
      ->check(fsdp::cli::output_dir());
  app.add_option("--warmup-steps", a.warmup_steps, "learning-rate warmup steps (linear from 0)")
      ->check(at_least(int64_t{0}));
  app.add_option("--warmup-ratio", a.warmup_ratio, "warmup as a fraction of the steps, when --warmup-steps is 0")
      ->check(between(0.0, 1.0));
  app.add_option("--lr-scheduler-type", a.lr_scheduler_type,
                 "after warmup: linear (to 0) | cosine (to 0) | constant_with_warmup | constant (no warmup)")
      ->check(one_of({"linear", "cosine", "constant", "constant_with_warmup"}));
  app.add_option("--max-grad-norm", a.max_grad_norm, "clip gradients to this global L2 norm (0: off)")
      ->check(at_least(0.0));
  app.add_flag("--bf16", a.bf16, "bf16 mixed precision (= --precision bf16-mixed)");
  app.add_flag("--fp16", a.fp16, "not offered: use --bf16 (fp16 mixed precision is not implemented for QLoRA)");
  app.add_flag("--average-tokens-across-devices,!--no-average-tokens-across-devices",
               a.average_tokens_across_devices,
               "loss = summed token losses / target tokens of the whole step, all ranks (else a mean of per-rank means)")
      ->default_str(a.average_tokens_across_devices ? "on" : "off");
  app.add_option("--per-device-train-batch-size", a.per_device_train_batch_size, "examples per rank per micro-batch")
      ->check(at_least(int64_t{1}));
  app.add_option("--gradient-accumulation-steps", a.gradient_accumulation_steps, "micro-batches per optimizer step")
      ->check(at_least(int64_t{1}));
  app.add_option("--num-train-epochs", a.num_train_epochs, "epochs (ignored when --max-steps > 0)")
      ->check(greater_than(0.0))
      ->check(between(0.0, kMaxEpochs));
  app.add_option("--max-steps", a.max_steps, "optimizer steps (-1: from --num-train-epochs)")
      ->check(at_least(int64_t{-1}));
  app.add_option("--learning-rate", a.learning_rate, "peak learning rate")
      ->check(greater_than(0.0))
      ->check(between(0.0, fsdp::app::kMaxLearningRate));
  app.add_option("--weight-decay", a.weight_decay, "AdamW weight decay")->check(at_least(0.0));
  app.add_option("--logging-steps", a.logging_steps, "log every N optimizer steps")->check(at_least(int64_t{1}));
  app.add_option("--report-to", a.report_to,
                 "all (CSV and TensorBoard) | tensorboard | csv | none")
      ->check(one_of({"all", "tensorboard", "csv", "none"}));
  app.add_option("--logging-dir", a.logging_dir, "logs go to DIR/version_N (default: --output-dir)")
      ->check(fsdp::cli::output_dir());
  app.add_option("--save-strategy", a.save_strategy,
                 "steps (every --save-steps) | epoch (each epoch's end) | no (only final/)")
      ->check(one_of({"steps", "epoch", "no"}));
  app.add_option("--save-steps", a.save_steps, "save the adapter every N optimizer steps (0: only at the end)")
      ->check(at_least(int64_t{0}));
  app.add_option("--save-total-limit", a.save_total_limit, "keep the N newest checkpoint-<step> adapters (-1: all)")
      ->check(at_least(int64_t{-1}));
  app.add_flag("--gradient-checkpointing,!--no-gradient-checkpointing", a.gradient_checkpointing,
               "recompute each decoder layer in backward")
      ->default_str(a.gradient_checkpointing ? "on" : "off");
  app.add_flag("--vocabulary-units,!--no-vocabulary-units", a.vocabulary_units,
               "under FSDP, an untied model's embedding table and head are units of their own "
               "(off, and for a tied table: the root unit, unsharded through forward and backward)")
      ->default_str(a.vocabulary_units ? "on" : "off");
  app.add_option("--optim", a.optim, "paged_adamw_8bit | adamw_8bit = adamw_bnb_8bit (bitsandbytes-exact "
                 "8-bit AdamW; paged = same on CPU) | adamw_torch")
      ->check(one_of({"paged_adamw_8bit", "adamw_8bit", "adamw_bnb_8bit", "adamw_torch"}));
  if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-finetune",
                                   fsdp::cli::CheckFlags::kByTheProgram)) {
    return *code;
  }
  if (a.quant_type != "nf4") {
    std::cerr << "fsdp-finetune: error: --bnb-4bit-quant-type " << a.quant_type
              << " is not implemented: the 4-bit layers are NF4 only; use nf4" << std::endl;
    return 2;
  }
  if (a.fp16) {
    std::cerr << "fsdp-finetune: error: --fp16: fp16 mixed precision is not implemented for "
                 "QLoRA fine-tuning (the 4-bit layers compute in bfloat16 or float32); use --bf16"
              << std::endl;
    return 2;
  }
  if (a.model_dir.empty() && a.preset.empty()) {
    std::cerr << "fsdp-finetune: error: pass --model-dir DIR (or --preset NAME)" << std::endl;
    return 2;
  }
  if (const std::string why = flags.check(); !why.empty()) {
    std::cerr << "fsdp-finetune: error: " << why << std::endl;
    return 2;
  }
  return fsdp::app::run_or_fail([&] {
    if (fsdp::cli::check_only()) {
      // What run() reads and builds before any work: the model's config, the load options,
      // the strategy (which checks its options).
      model_config(a);
      load_options(a);
      flags.make_strategy(fsdp::StrategyOptions{});
      return 0;
    }
    return a.common.dry_run ? dry_run(a) : run(a, flags);
  });
}
