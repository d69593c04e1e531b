// QLoRA fine-tuning under FSDP, written with the library instead of fsdp-finetune: a Hugging Face
// Llama folder loaded with its linear layers in 4-bit NF4, LoRA adapters on the attention and
// MLP projections, 8-bit paged AdamW, one FSDP unit per decoder layer (activation checkpointing
// on each), and the adapter saved as PEFT saves it.
//
//   build/bin/finetune_qlora --model-dir Llama-3-8B --data train.jsonl --output-dir adapter
//
// The Python recipe it follows (the QLoRA + FSDP article in the reference texts):
//
//   bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
//                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
//   model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb)
//   model = prepare_model_for_kbit_training(model)
//   model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
//                                            target_modules=[...]))
//   ... Trainer(..., optim="paged_adamw_8bit", fsdp="full_shard auto_wrap") ... save_pretrained
//
// --model-dir needs config.json, model.safetensors (or an index and its shards) and
// tokenizer.json; --data is a JSONL file of {"text": ...} lines (or plain text, one example per
// paragraph). The output folder (adapter_config.json + adapter_model.safetensors) loads with
// PeftModel.from_pretrained, or with fsdp::load_llama's HfLoadOptions::adapter_dir.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <sstream>
#include <string>

class QLoraFinetune : public fsdp::LightningModule {
 public:
  QLoraFinetune(std::string model_dir, fsdp::LoraConfig lora, double lr)
      : model_dir_(std::move(model_dir)), lora_(std::move(lora)), lr_(lr) {}

  void configure_model() override {
    if (model) return;
    // What from_pretrained(quantization_config) + prepare_model_for_kbit_training +
    // get_peft_model do, applied to each decoder layer as it is read: under FSDP every layer is
    // sharded right after, so no rank ever holds the whole model.
    fsdp::HfLoadOptions o;
    o.quantization = fsdp::QuantizationConfig{};  // NF4, double quantization, bf16 compute
    o.prepare_for_kbit_training = true;           // base frozen, non-quantized parameters fp32
    o.lora = lora_;
    model = register_module("model", fsdp::load_llama(model_dir_, o));
    // enable_input_require_grads: the checkpointed layers back-propagate into their adapters
    // although the frozen embeddings' output needs no gradient.
    model->model->input_require_grads = true;
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    const int64_t n = fsdp::used_length(batch);                 // drop right padding
    at::Tensor logits = (*model)(batch.input.narrow(1, 0, n));  // (B, n, vocab)
    at::Tensor target = batch.target.narrow(1, 0, n).reshape({-1});
    at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat).reshape({target.numel(), -1}),
                                             target, {}, at::Reduction::Mean, /*ignore=*/-100);
    fsdp::LogOptions shown;
    shown.prog_bar = true;
    shown.sync_dist = true;  // the mean over ranks
    log("train_loss", loss, shown);
    return loss;
  }

  fsdp::OptimizerConfig configure_optimizers() override {
    std::vector<at::Tensor> trainable;  // the adapters' shards
    for (auto& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    auto optimizer =
        std::make_shared<fsdp::AdamW8bit>(trainable, fsdp::AdamW8bitOptions(lr_).paged(true));
    return {optimizer, /*scheduler=*/nullptr};
  }

  std::shared_ptr<fsdp::LlamaForCausalLM> model;

 private:
  std::string model_dir_;
  fsdp::LoraConfig lora_;
  double lr_;
};

int main(int argc, char** argv) {
  std::string model_dir, data_path, output_dir = "qlora_adapter", root_dir = "fsdp_logs";
  int devices = 2;
  int64_t max_steps = 10, batch_size = 4, max_length = 64;
  double lr = 2e-3;
  fsdp::LoraConfig lora;
  lora.r = 8;
  lora.lora_alpha = 16;
  lora.lora_dropout = 0.05;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

  CLI::App app{"QLoRA fine-tuning of a Hugging Face Llama folder under FSDP"};
  app.option_defaults()->always_capture_default();
  app.add_option("--model-dir", model_dir, "Llama folder: config.json, *.safetensors, tokenizer.json")
      ->required();
  app.add_option("--data", data_path, "JSONL file of {\"text\": ...} lines")->required();
  app.add_option("--output-dir", output_dir, "where the PEFT adapter is written");
  app.add_option("--devices", devices, "ranks (processes)")->check(CLI::PositiveNumber);
  app.add_option("--max-steps", max_steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "examples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--max-length", max_length, "tokens per example")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--lora-r", lora.r, "LoRA rank")->check(CLI::PositiveNumber);
  app.add_option("--default-root-dir", root_dir, "where the loggers write");
  CLI11_PARSE(app, argc, argv);  // --help, or a bad flag: print and return

  try {
    // The data first: a bad file fails here once, before the other ranks start.
    fsdp::Tokenizer tok = fsdp::Tokenizer::from_pretrained(model_dir);
    tok.add_bos_token = tok.add_eos_token = true;  // the recipe's tokenizer settings
    tok.pad_token_id = tok.eos_token_id;
    auto data = std::make_shared<fsdp::CausalLMDataset>(fsdp::read_text_examples(data_path), tok,
                                                        max_length);

    fsdp::FSDPOptions fo;
    fo.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::llama_layer_types());
    fo.activation_checkpointing_policy = fsdp::llama_layer_types();
    fsdp::TrainerOptions options;
    options.devices = devices;
    options.strategy = std::make_shared<fsdp::FSDPStrategy>(fo);
    options.max_steps = max_steps;
    options.gradient_clip_val = 1.0;  // transformers' max_grad_norm
    options.seed = 42;
    options.enable_progress_bar = false;
    options.default_root_dir = root_dir;
    fsdp::Trainer trainer(options);  // devices > 1: the other ranks start here

    fsdp::DataLoader loader(data, batch_size, fsdp::DistributedSampler(data->size()),
                            /*drop_last=*/true);
    QLoraFinetune module(model_dir, lora, lr);
    trainer.fit(module, loader);

    // The adapter: every rank gathers its shards of lora_A / lora_B (collective), rank 0 writes
    // adapter_config.json + adapter_model.safetensors as PEFT's save_pretrained does.
    auto weights = fsdp::gather_lora_weights(*module.model, trainer.world().get());
    if (trainer.is_global_zero()) fsdp::save_peft_adapter(weights, lora, output_dir, model_dir);
    trainer.strategy()->barrier();

    std::ostringstream line;
    line << "[finetune_qlora] " << weights.size() << " adapter tensors saved to " << output_dir
         << "; losses:";
    for (double l : trainer.results().losses) line << " " << l;
    trainer.print(line.str());
    return 0;
  } catch (const c10::Error& e) {
    fsdp::fail_rank(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fsdp::fail_rank(e.what());
  }
}
