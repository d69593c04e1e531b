// Lightning's "Custom DeepSpeed Config" (the guide "Train 1 trillion+ parameter models"), in C++:
// the strategy, the optimizer and its scheduler come from a DeepSpeed JSON config.
//
//   build/bin/train_deepspeed_config --deepspeed-config examples/deepspeed_config.json
//   PL_DEEPSPEED_CONFIG_PATH=examples/deepspeed_config.json build/bin/train_deepspeed_config
//
// The Python original:
//
//   trainer = Trainer(accelerator="gpu", devices=4, precision=16,
//                     strategy=DeepSpeedStrategy(config="/path/to/deepspeed_config.json"))
//   trainer.fit(model)
//
// examples/deepspeed_config.json is the guide's config (ZeRO stage 2, optimizer state offloaded
// to the host, bucket sizes, a WarmupLR scheduler) with the guide's "OneBitAdam" replaced by
// "Adam": fsdp.cpp's config reader accepts Adam and AdamW and names any other type in its error.
// The config may also be given as the JSON text itself, as Lightning takes a dict:
//
//   fsdp::DeepSpeedOptions ds;
//   ds.config = R"({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", ...}})";
//
// What the config decides here: the strategy (DeepSpeed ZeRO stage 2, offload on a CPU is a
// no-op and setup says so), the optimizer (it replaces the one configure_optimizers returns, as
// in Lightning), the learning-rate schedule (WarmupLR, stepped after every optimizer step),
// gradient clipping, and the batch size per rank (train_micro_batch_size_per_gpu). Each
// optimizer step prints the learning rate the scheduler set for it.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

class LanguageModel : public fsdp::LightningModule {
 public:
  explicit LanguageModel(int64_t vocab_size) : vocab_size_(vocab_size) {}

  void configure_model() override {
    if (model_) return;
    model_ = register_module("model", fsdp::demos::make_model("transformer-tiny", vocab_size_));
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor output = (*model_)(batch.input, batch.target);  // (B*T, vocab) log-probabilities
    at::Tensor loss = at::nll_loss(output, batch.target.reshape(-1));
    fsdp::LogOptions shown;
    shown.prog_bar = true;
    log("train_loss", loss, shown);
    return loss;
  }

  // Replaced by the config's optimizer (the strategy says so on stderr).
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1)),
            /*scheduler=*/nullptr};
  }

  void on_before_optimizer_step(torch::optim::Optimizer& optimizer) override {
    char line[96];
    std::snprintf(line, sizeof line, "[train_deepspeed_config] step %lld lr %.6g",
                  static_cast<long long>(trainer()->global_step() + 1),
                  optimizer.param_groups()[0].options().get_lr());
    print(line);
  }

 private:
  int64_t vocab_size_;
  std::shared_ptr<fsdp::nn::Module> model_;
};

int main(int argc, char** argv) {
  int devices = 2;
  int64_t max_steps = 8;
  std::string config, root_dir = "fsdp_logs";
  CLI::App app{"Lightning's custom DeepSpeed config example, in C++"};
  app.option_defaults()->always_capture_default();
  app.add_option("--deepspeed-config", config,
                 "DeepSpeed JSON config (default: the file PL_DEEPSPEED_CONFIG_PATH names)");
  app.add_option("--devices", devices, "ranks (processes)")->check(CLI::PositiveNumber);
  app.add_option("--max-steps", max_steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--default-root-dir", root_dir, "where the loggers write");
  CLI11_PARSE(app, argc, argv);  // --help, or a bad flag: print and return

  try {
    fsdp::DeepSpeedOptions ds;
    ds.config = config;  // "" : PL_DEEPSPEED_CONFIG_PATH, else DeepSpeed's defaults
    auto strategy = std::make_shared<fsdp::DeepSpeedStrategy>(ds);

    fsdp::TrainerOptions options;
    options.devices = devices;
    options.strategy = strategy;
    options.max_steps = max_steps;
    options.seed = 42;
    options.enable_progress_bar = false;
    options.default_root_dir = root_dir;
    fsdp::Trainer trainer(options);  // devices > 1: the other ranks start here

    const int64_t batch_size =
        strategy->training_config().train_micro_batch_size_per_gpu.value_or(4);
    auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(/*vocab_size=*/128,
                                                               /*num_tokens=*/20000, /*seed=*/42);
    fsdp::DataLoader loader(data, batch_size, fsdp::DistributedSampler(data->size()));
    LanguageModel model(data->vocab_size());
    trainer.fit(model, loader);

    std::string losses;
    for (double l : trainer.results().losses) losses += " " + std::to_string(l);
    trainer.print("[train_deepspeed_config] strategy " + strategy->name() + ", stage " +
                  std::to_string(strategy->options().stage) + ", batch " +
                  std::to_string(batch_size) + " per rank; losses:" + losses);
    return 0;
  } catch (const c10::Error& e) {
    fsdp::fail_rank(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fsdp::fail_rank(e.what());
  }
}
