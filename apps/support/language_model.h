// fsdp-train's model and data: the demo language models (Lightning's Transformer, GPT-2
// layouts) as a LightningModule, and the corpora they train on (a synthetic Markov chain or
// WikiText-2).
#pragma once

#include <fsdp/fsdp.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::app {

// What the model is made of; built on every rank from the same flags and seed.
struct ModelSpec {
  std::string name = "transformer-tiny";   // a preset (fsdp::demos::model_names()) or "custom"
  fsdp::demos::TransformerOptions custom;  // when name == "custom"
  int64_t vocab_size = 0;
  double dropout = 0;
  bool activation_checkpointing = false;   // checkpoint the model's layer types
  VocabLossPolicy loss;                    // --loss-chunk-tokens: the head's chunked loss
  bool vocab_parallel = true;              // --vocab-parallel: vocabulary units on their shards

  // The module types activation checkpointing recomputes.
  nn::ModuleTypes layer_types() const;
  // The module types FSDP wraps (--wrap-policy layers): the layers and the vocabulary units.
  nn::ModuleTypes unit_types() const;
  // The vocabulary the model gets: a preset with a published vocabulary keeps it.
  int64_t model_vocab_size() const;
};

std::shared_ptr<nn::Module> build_model(const ModelSpec& spec);

// The optimizer a LanguageModel configures (--optimizer adam | adamw | sgd | cpu_adam |
// cpu_adamw, --lr, --weight-decay, --adam-eps).
struct OptimizerSpec {
  std::string name = "adam";
  double lr = 1e-3;
  double weight_decay = 0;
  double adam_eps = 1e-8;
};

// The reference's LanguageModel: the demo model built in configure_model, the mean
// cross-entropy of the targets (the value of nll_loss over its log-probabilities, computed by
// the model's head in chunks: fsdp::demos::language_model_loss), logged as train_loss /
// val_loss / test_loss (global means).
class LanguageModel : public LightningModule {
 public:
  LanguageModel(ModelSpec spec, OptimizerSpec optimizer);

  void configure_model() override;
  at::Tensor training_step(const Batch& batch, int64_t) override;
  at::Tensor validation_step(const Batch& batch, int64_t) override;
  at::Tensor test_step(const Batch& batch, int64_t) override;
  OptimizerConfig configure_optimizers() override;
  // The metrics training and validation log (what fsdp-train's --monitor may name).
  static std::vector<std::string> metric_names() { return {kTrainLoss, kValLoss}; }
  static constexpr const char* kTrainLoss = "train_loss";
  static constexpr const char* kValLoss = "val_loss";

 private:
  // The batch's loss, logged as `name` (the global mean over ranks).
  at::Tensor logged_loss(const Batch& batch, const std::string& name, bool prog_bar);

  ModelSpec spec_;
  OptimizerSpec optimizer_;
  std::shared_ptr<nn::Module> model_;
};

// Where the tokens come from (--data, --data-dir, --vocab-size, --num-tokens) and how they are
// cut (--batch-size, --block-size).
struct DataSpec {
  std::string data = "synthetic";  // "synthetic" | "wikitext2"
  std::string data_dir = "data/wikitext-2";
  int64_t vocab_size = 0;  // synthetic: 0 = the model preset's, at most 1024
  int64_t num_tokens = 0;  // synthetic: 0 = enough for the run
  int64_t batch_size = 4;  // samples per rank per micro-batch
  int64_t block_size = 35;
};

struct Data {
  std::shared_ptr<const TokenBlockDataset> train, val;  // val may be null
  int64_t vocab_size = 0;
};

// The synthetic corpus's vocabulary for `model` (without reading any data).
int64_t synthetic_vocab_size(const DataSpec& spec, const std::string& model);
// The run's data on this process. A synthetic corpus is sized for `t.max_steps` steps of the
// global batch over `world` ranks; it depends on t.seed only, so every rank builds the same one.
Data load_data(const DataSpec& spec, const std::string& model, const TrainerOptions& t, int world);

// --save-batches FILE: the micro-batches the first t.max_steps steps train on, every rank's, as
// the Trainer's loaders would give them to `world` ranks, so that other systems
// (bench/peers/*.py) read the same samples in the same order. safetensors {"input", "target"}:
// int64 (micro_batches, world * batch_size, block_size); rows [r*B, (r+1)*B) of micro-batch i
// are rank r's batch i (see Note [Sampler striding]). Covers the first epoch; nothing trains.
void save_batches(const std::string& path, const DataSpec& spec, const std::string& model,
                  const TrainerOptions& t, int world);

}  // namespace fsdp::app
