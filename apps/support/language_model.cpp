// fsdp-train's model and data; see apps/support/language_model.h.
#include "language_model.h"

#include <fsdp/checkpoint.h>
#include <fsdp/cpu_adam.h>

#include <algorithm>
#include <iostream>
#include <vector>

namespace fsdp::app {
namespace {

// The preset's own vocabulary (0 for "custom").
int64_t preset_vocab(const std::string& model) {
  if (model == "custom") return 0;
  return demos::is_transformer_model(model) ? demos::transformer_preset(model).vocab_size
                                            : demos::gpt_preset(model).vocab_size;
}

}  // namespace

nn::ModuleTypes ModelSpec::layer_types() const {
  return demos::layer_types(name == "custom" ? "transformer-tiny" : name);
}

nn::ModuleTypes ModelSpec::unit_types() const {
  return demos::unit_types(name == "custom" ? "transformer-tiny" : name);
}

int64_t ModelSpec::model_vocab_size() const {
  if (name == "custom") return vocab_size;
  return demos::is_transformer_model(name) ? demos::transformer_preset(name, vocab_size).vocab_size
                                           : demos::gpt_preset(name, vocab_size).vocab_size;
}

std::shared_ptr<nn::Module> build_model(const ModelSpec& spec) {
  if (spec.name == "custom") {
    auto options = spec.custom;
    options.vocab_size = spec.vocab_size;
    options.dropout = spec.dropout;
    return std::make_shared<demos::Transformer>(options);
  }
  return demos::make_model(spec.name, spec.vocab_size, spec.dropout);
}

LanguageModel::LanguageModel(ModelSpec spec, OptimizerSpec optimizer)
    : spec_(std::move(spec)), optimizer_(std::move(optimizer)) {}

void LanguageModel::configure_model() {
  if (model_) return;  // idempotent, as Lightning asks
  model_ = register_module("model", build_model(spec_));
  demos::set_vocab_loss_policy(*model_, spec_.loss);
  demos::set_vocab_compute_on_shards(*model_, spec_.vocab_parallel);
  if (spec_.activation_checkpointing) {
    // A module transform, so it works under every strategy (under FSDP the model's own
    // choice is respected: FSDPOptions::activation_checkpointing_policy stays empty here).
    apply_activation_checkpointing(*model_, spec_.layer_types());
  }
}

at::Tensor LanguageModel::training_step(const Batch& batch, int64_t) {
  return logged_loss(batch, kTrainLoss, /*prog_bar=*/false);
}

at::Tensor LanguageModel::validation_step(const Batch& batch, int64_t) {
  return logged_loss(batch, kValLoss, /*prog_bar=*/true);
}

at::Tensor LanguageModel::test_step(const Batch& batch, int64_t) {
  return logged_loss(batch, "test_loss", /*prog_bar=*/false);
}

at::Tensor LanguageModel::logged_loss(const Batch& batch, const std::string& name, bool prog_bar) {
  at::Tensor loss = demos::language_model_loss(*model_, batch.input, batch.target);
  // sync_dist: the global mean, carried by the Trainer's one per-step all-reduce.
  LogOptions o;
  o.prog_bar = prog_bar;
  o.sync_dist = true;
  log(name, loss, o);
  return loss;
}

OptimizerConfig LanguageModel::configure_optimizers() {
  const OptimizerSpec& o = optimizer_;
  if (o.name == "adamw") {
    auto options = torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay).eps(o.adam_eps);
    return {std::make_shared<torch::optim::AdamW>(parameters(), options), nullptr};
  }
  if (o.name == "cpu_adam" || o.name == "cpu_adamw") {
    // fsdp::optim::CPUAdam: libtorch's Adam / AdamW math in one fused vectorized pass.
    optim::CPUAdamOptions c;
    c.lr = o.lr;
    c.weight_decay = o.weight_decay;
    c.adamw_mode = o.name == "cpu_adamw";
    return {std::make_shared<optim::CPUAdam>(parameters(), c), nullptr};
  }
  if (o.name == "sgd") {
    return {std::make_shared<torch::optim::SGD>(
                parameters(), torch::optim::SGDOptions(o.lr).weight_decay(o.weight_decay)),
            nullptr};
  }
  auto options = torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay).eps(o.adam_eps);
  return {std::make_shared<torch::optim::Adam>(parameters(), options), nullptr};
}

int64_t synthetic_vocab_size(const DataSpec& spec, const std::string& model) {
  // The preset's vocabulary, capped at 1024 so small runs can learn the chain; --vocab-size
  // sets it.
  const int64_t vocab =
      spec.vocab_size > 0 ? spec.vocab_size : std::min<int64_t>(preset_vocab(model), 1024);
  return vocab > 0 ? vocab : 1024;
}

Data load_data(const DataSpec& spec, const std::string& model, const TrainerOptions& t,
               int world) {
  Data d;
  if (spec.data == "wikitext2") {
    auto train = std::make_shared<demos::WikiText2>(spec.data_dir, "train", spec.block_size);
    d.train = train;
    d.vocab_size = train->vocab_size();
    try {
      d.val = std::make_shared<demos::WikiText2>(spec.data_dir, "valid", spec.block_size);
    } catch (const c10::Error&) {
      // no valid.txt: train without validation
    }
    return d;
  }
  // Synthetic: a sparse Markov chain over `vocab` tokens.
  const int64_t vocab = synthetic_vocab_size(spec, model);
  int64_t tokens = spec.num_tokens;
  if (tokens <= 0) {
    // Enough that one epoch covers max_steps steps (depends only on the global batch, so runs
    // with the same global batch over different worlds read the same corpus), at least 100k,
    // at most 16M tokens (128 MB): longer runs (a soak's --max-steps 100000000) go round it
    // in epochs instead of asking for a corpus larger than memory.
    constexpr int64_t kMaxAutoTokens = int64_t{1} << 24;
    const int64_t steps = std::min<int64_t>(std::max<int64_t>(t.max_steps, 0), kMaxAutoTokens);
    const int64_t samples = steps * t.accumulate_grad_batches * spec.batch_size * world + world;
    tokens = std::min(kMaxAutoTokens, std::max<int64_t>(100000, (samples + 2) * spec.block_size));
  }
  // One chain, one token stream: the first 90% trains, the rest validates (a different seed
  // would be a different chain, which no model could predict).
  auto corpus = std::make_shared<demos::SyntheticCorpus>(
      vocab, tokens + tokens / 9, static_cast<uint64_t>(t.seed), spec.block_size);
  const at::Tensor& all = corpus->tokens();
  d.train = std::make_shared<TokenBlockDataset>(all.narrow(0, 0, tokens), vocab, spec.block_size);
  d.val = std::make_shared<TokenBlockDataset>(all.narrow(0, tokens, all.numel() - tokens), vocab,
                                              spec.block_size);
  d.vocab_size = vocab;
  return d;
}

void save_batches(const std::string& path, const DataSpec& spec, const std::string& model,
                  const TrainerOptions& t, int world) {
  const uint64_t seed = static_cast<uint64_t>(t.seed);
  seed_everything(seed);
  Data data = load_data(spec, model, t, world);
  const int64_t B = spec.batch_size;
  const int64_t micro = t.max_steps * t.accumulate_grad_batches;
  TORCH_CHECK(t.max_steps > 0, "[fsdp-train] --save-batches needs --max-steps > 0 (how many "
              "steps' batches to write)");
  std::vector<DataLoader> loaders;
  for (int r = 0; r < world; ++r) {  // what the Trainer's distribute() gives rank r
    loaders.emplace_back(data.train, B,
                         DistributedSampler(data.train->size(), world, r, /*shuffle=*/true, seed),
                         /*drop_last=*/true);
  }
  TORCH_CHECK(micro <= loaders[0].num_batches(), "[fsdp-train] --save-batches writes one epoch: ",
              micro, " micro-batches asked (--max-steps x --accumulate-grad-batches), the epoch "
              "has ", loaders[0].num_batches(), " per rank; lower --max-steps or add data "
              "(--num-tokens)");
  at::Tensor input = at::empty({micro, world * B, spec.block_size}, at::kLong);  // (I, N*B, T)
  at::Tensor target = at::empty_like(input);
  for (int64_t i = 0; i < micro; ++i) {
    for (int r = 0; r < world; ++r) {
      const Batch b = loaders[r].batch(i);
      input[i].narrow(0, r * B, B).copy_(b.input);
      target[i].narrow(0, r * B, B).copy_(b.target);
    }
  }
  save_safetensors(path, {{"input", input}, {"target", target}},
                   {{"world_size", std::to_string(world)},
                    {"batch_size_per_rank", std::to_string(B)},
                    {"vocab_size", std::to_string(data.vocab_size)},
                    {"layout", "micro-batch i, rows [r*B, (r+1)*B): rank r's batch i"}});
  std::cout << "[fsdp-train] wrote " << micro << " micro-batches of " << world << " x " << B
            << " samples (" << spec.block_size << " tokens, vocab " << data.vocab_size << ") to "
            << path << std::endl;
}

}  // namespace fsdp::app
