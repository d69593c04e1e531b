// The first code example of Lightning's FSDP guide ("Train models with billions of parameters
// using FSDP"), in C++ with fsdp.cpp. The Python original:
//
//   class LanguageModel(L.LightningModule):
//       def __init__(self, vocab_size):
//           super().__init__()
//           self.model = Transformer(vocab_size=vocab_size, nlayers=32, nhid=4096, ninp=1024, nhead=64)
//       def training_step(self, batch):
//           input, target = batch
//           output = self.model(input, target)
//           loss = F.nll_loss(output, target.view(-1))
//           self.log("train_loss", loss, prog_bar=True)
//           return loss
//       def configure_optimizers(self):
//           return torch.optim.Adam(self.parameters(), lr=0.1)
//
//   L.seed_everything(42)
//   dataset = WikiText2()
//   train_dataloader = DataLoader(dataset)
//   model = LanguageModel(vocab_size=dataset.vocab_size)
//   trainer = L.Trainer(accelerator="cuda", devices=2, strategy=FSDPStrategy())
//   trainer.fit(model, train_dataloader)
//   trainer.print(torch.cuda.memory_summary())
//
// Differences, so that it runs on a CPU in seconds by default:
//   - the model is built in configure_model (the guide's recommended "fast init" form);
//   - --model transformer-tiny by default; --model transformer-1b is the guide's 1B model;
//   - WikiText-2 when --data-dir points at it (needs train.txt), else the built-in synthetic corpus;
//   - the guide's strategy is FSDP; this uses "fsdp" when the build has it, "ddp" otherwise;
//   - accelerator "cpu" (ranks are processes), and --max-steps 20 (the guide trains an epoch).
//
//   build/bin/train_transformer                       # 2 ranks, tiny model, synthetic data
//   build/bin/train_transformer --model transformer-1b --data-dir data/wikitext-2 --max-steps 5
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <iostream>

int64_t preset_vocab(const std::string& name) {
  return fsdp::demos::is_transformer_model(name) ? fsdp::demos::transformer_preset(name).vocab_size
                                                 : fsdp::demos::gpt_preset(name).vocab_size;
}

class LanguageModel : public fsdp::LightningModule {
 public:
  LanguageModel(std::string model_name, int64_t vocab_size)
      : model_name_(std::move(model_name)), vocab_size_(vocab_size) {}

  void configure_model() override {
    if (model_) return;
    // transformer-1b: nlayers 32, nhid 4096, ninp 1024, nhead 64 (the guide's 1B parameters).
    model_ = register_module("model", fsdp::demos::make_model(model_name_, vocab_size_));
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor output = (*model_)(batch.input, batch.target);
    at::Tensor loss = at::nll_loss(output, batch.target.reshape(-1));
    fsdp::LogOptions options;
    options.prog_bar = true;
    log("train_loss", loss, options);
    return loss;
  }

  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(lr_))};
  }

  void set_lr(double lr) { lr_ = lr; }

 private:
  std::string model_name_;
  int64_t vocab_size_;
  double lr_ = 0.1;
  std::shared_ptr<fsdp::nn::Module> model_;
};

int main(int argc, char** argv) {
  std::string model_name = "transformer-tiny";
  std::string data_dir;
  int devices = 2;
  int64_t max_steps = 20;
  double lr = 0.1;  // the guide's; high for Adam, so the loss is noisy
  const auto names = fsdp::strategy_names();
  std::string strategy =
      std::find(names.begin(), names.end(), "fsdp") != names.end() ? "fsdp" : "ddp";

  CLI::App app{"The Lightning FSDP guide's first example, in C++"};
  app.option_defaults()->always_capture_default();
  app.add_option("--model", model_name, "model preset")
      ->check(CLI::IsMember(fsdp::demos::model_names()));
  app.add_option("--data-dir", data_dir, "WikiText-2 directory (empty: synthetic corpus)");
  app.add_option("--devices", devices, "ranks")->check(CLI::PositiveNumber);
  app.add_option("--strategy", strategy, "strategy name")->check(CLI::IsMember(names));
  app.add_option("--max-steps", max_steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Adam learning rate")->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    fsdp::seed_everything(42);

    // Trainer first: with devices > 1 it starts the other ranks, which run main() again.
    fsdp::TrainerOptions options;
    options.accelerator = "cpu";
    options.devices = devices;
    options.strategy = strategy;
    options.max_steps = max_steps;
    options.seed = 42;
    fsdp::Trainer trainer(options);

    // Data
    std::shared_ptr<fsdp::TokenBlockDataset> dataset;
    if (!data_dir.empty()) {
      dataset = std::make_shared<fsdp::demos::WikiText2>(data_dir, "train");
    } else {
      dataset = std::make_shared<fsdp::demos::SyntheticCorpus>(
          /*vocab_size=*/std::min<int64_t>(1024, preset_vocab(model_name)),
          /*num_tokens=*/100000, /*seed=*/42);
    }
    // DataLoader(dataset): batch size 1 per rank, as the guide; the Trainer strides the
    // sampler over the ranks.
    fsdp::DataLoader train_dataloader(dataset, /*batch_size_per_rank=*/1,
                                      fsdp::DistributedSampler(dataset->size()));

    // Model
    LanguageModel model(model_name, dataset->vocab_size());
    model.set_lr(lr);

    trainer.fit(model, train_dataloader);
    trainer.print(fsdp::memory_summary());
    return 0;
  } catch (const c10::Error& e) {
    fsdp::fail_rank(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fsdp::fail_rank(e.what());
  }
}
