// A model that is not a language model, under FSDP: your own blocks, your own data, validation,
// checkpoints, resume, and the trained weights loaded back without a Trainer.
//
//   build/bin/train_regression --ckpt-dir ckpt --max-epochs 2            # 2 ranks, FULL_SHARD
//   build/bin/train_regression --ckpt-dir ckpt --max-epochs 4 --resume ckpt/last
//
// What it shows, in the order a program meets it:
//   - the data: a Dataset of (features, target) pairs made on the fly (a fixed random "teacher"
//     network gives each point its target), batched by the DataLoader into (B, 16) and (B, 1);
//   - the model: Block, an fsdp::nn::Module (its forward runs FSDP's hooks, so FSDP can make it a
//     unit) built from plain torch::nn layers (Linear, LayerNorm), and Net, a plain
//     torch::nn::Module holding the blocks between an input and an output layer;
//   - the LightningModule holds the Net as its member "net" and builds it in configure_model,
//     passing each block through fsdp::nn::built (under FSDP a block is sharded as soon as it
//     exists);
//   - FSDP with one unit per Block (AutoWrapPolicy::of_types); the input and output layers stay in
//     the root unit;
//   - validation at the end of every epoch ("val_loss", averaged over ranks), a ModelCheckpoint
//     keeping the two best epochs by val_loss plus `last`, and --resume to continue a run;
//   - fsdp::load_weights: the checkpoint names carry the LightningModule's member prefix
//     ("net.blocks.0.fc1.weight"), so the weights load into a LightningModule of the same class
//     (whose configure_model built the same "net"), not into a bare Net.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

// ---- Data: y = teacher(x) + noise, x ~ N(0, I). Every rank builds the same dataset (same seeds).
class TeacherData : public fsdp::Dataset {
 public:
  static constexpr int64_t kFeatures = 16;

  TeacherData(int64_t size, uint64_t seed) {
    // The teacher is the same for every dataset (its own seed); `seed` draws the points.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto teacher_gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    at::Tensor w1 = at::randn({kFeatures, 32}, teacher_gen) / 4.0;  // (F, 32)
    at::Tensor w2 = at::randn({32, 1}, teacher_gen) / 4.0;         // (32, 1)
    x_ = at::randn({size, kFeatures}, gen);                          // (N, F)
    y_ = at::tanh(x_.matmul(w1)).matmul(w2) + 0.01 * at::randn({size, 1}, gen);  // (N, 1)
  }
  int64_t size() const override { return x_.size(0); }
  fsdp::Example get(int64_t i) const override { return {x_[i], y_[i]}; }

 private:
  at::Tensor x_, y_;
};

// ---- Model. Block: a residual MLP block FSDP can wrap (fsdp::nn::Module), made of plain
// torch::nn layers.
class Block : public fsdp::nn::Module {
 public:
  explicit Block(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))) {}

  at::Tensor forward(const fsdp::nn::Inputs& in) override {
    const at::Tensor& x = in[0];  // (B, width)
    return x + fc2(torch::gelu(fc1(norm(x))));
  }

  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};

// Net: a plain torch::nn::Module; only its blocks are FSDP units.
class Net : public torch::nn::Module {
 public:
  Net(int64_t width, int64_t depth)
      : input(register_module("input", torch::nn::Linear(TeacherData::kFeatures, width))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        output(register_module("output", torch::nn::Linear(width, 1))) {
    // built(): "this block is complete" -- under FSDP's deferred init it is sharded right here,
    // so no rank ever holds the whole model (outside configure_model it does nothing).
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(fsdp::nn::built(std::make_shared<Block>(width)));
  }

  at::Tensor forward(at::Tensor x) {  // (B, F) -> (B, 1)
    x = input(x);
    for (auto& block : *blocks) x = (*block->as<Block>())(x);
    return output(x);
  }

  torch::nn::Linear input;
  torch::nn::ModuleList blocks;
  torch::nn::Linear output;
};

// ---- The LightningModule: the model is its member "net", so checkpoint names start "net.".
class Regression : public fsdp::LightningModule {
 public:
  Regression(int64_t width, int64_t depth, double lr) : width_(width), depth_(depth), lr_(lr) {}

  void configure_model() override {
    if (net) return;  // called again on resume: build once
    net = register_module("net", std::make_shared<Net>(width_, depth_));
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor loss = at::mse_loss(net->forward(batch.input), batch.target);
    fsdp::LogOptions shown;
    shown.prog_bar = true;
    log("train_loss", loss, shown);
    return loss;
  }

  at::Tensor validation_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor loss = at::mse_loss(net->forward(batch.input), batch.target);
    fsdp::LogOptions shown;
    shown.prog_bar = true;
    shown.sync_dist = true;  // the mean over ranks: what ModelCheckpoint compares
    log("val_loss", loss, shown);
    return loss;
  }

  fsdp::OptimizerConfig configure_optimizers() override {
    // parameters() are this rank's shards here: the optimizer state is sharded too.
    return {std::make_shared<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(lr_)),
            /*scheduler=*/nullptr};
  }

  std::shared_ptr<Net> net;

 private:
  int64_t width_, depth_;
  double lr_;
};

// Prints where each fit starts: step 0, or the step a resumed checkpoint holds.
struct PrintStart : fsdp::Callback {
  void on_fit_start(fsdp::Trainer& t, fsdp::LightningModule&) override {
    t.print("[train_regression] fit starts at step " + std::to_string(t.global_step()));
  }
  void on_validation_end(fsdp::Trainer& t, fsdp::LightningModule&) override {
    const auto& metrics = t.callback_metrics();
    const auto it = metrics.find("val_loss");
    char line[128];
    std::snprintf(line, sizeof line, "[train_regression] step %lld val_loss %.6f",
                  static_cast<long long>(t.global_step()),
                  it == metrics.end() ? std::nan("") : it->second);
    t.print(line);
  }
};

int main(int argc, char** argv) {
  int devices = 2;
  int64_t max_epochs = 2, width = 32, depth = 3, batch_size = 32;
  double lr = 3e-3;
  std::string ckpt_dir = "regression_ckpt", resume, root_dir = "fsdp_logs";

  CLI::App app{"An MLP regression under FSDP: own blocks and data, validation, checkpoints, resume"};
  app.option_defaults()->always_capture_default();
  app.add_option("--devices", devices, "ranks (processes)")->check(CLI::PositiveNumber);
  app.add_option("--max-epochs", max_epochs, "epochs to train, counted from the start of the run")
      ->check(CLI::PositiveNumber);
  app.add_option("--width", width, "block width")->check(CLI::PositiveNumber);
  app.add_option("--depth", depth, "blocks (FSDP units)")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "examples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--ckpt-dir", ckpt_dir, "ModelCheckpoint's directory");
  app.add_option("--resume", resume, "checkpoint to continue from (e.g. CKPT_DIR/last)");
  app.add_option("--default-root-dir", root_dir, "where the loggers write");
  CLI11_PARSE(app, argc, argv);  // --help, or a bad flag: print and return

  try {
    // Lightning's ModelCheckpoint(dirpath, filename, monitor="val_loss", save_top_k=2,
    // save_last=True): after every epoch's validation.
    fsdp::ModelCheckpointOptions mc;
    mc.dirpath = ckpt_dir;
    mc.filename = "{epoch}-{step}-{val_loss:.4f}";
    mc.monitor = "val_loss";
    mc.mode = "min";
    mc.save_top_k = 2;
    mc.save_last = true;
    auto checkpoint = std::make_shared<fsdp::ModelCheckpoint>(mc);

    // FULL_SHARD, one unit per Block.
    fsdp::FSDPOptions fo;
    fo.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
    fo.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<Block>());

    fsdp::TrainerOptions options;
    options.devices = devices;
    options.strategy = std::make_shared<fsdp::FSDPStrategy>(fo);
    options.max_epochs = max_epochs;
    options.seed = 42;  // the same initial model on every rank
    options.enable_progress_bar = false;
    options.default_root_dir = root_dir;
    options.callbacks = {checkpoint, std::make_shared<PrintStart>()};
    fsdp::Trainer trainer(options);  // devices > 1: the other ranks start here and run main() too

    auto train_data = std::make_shared<TeacherData>(/*size=*/1024, /*seed=*/1);
    auto val_data = std::make_shared<TeacherData>(/*size=*/256, /*seed=*/2);
    fsdp::DataLoader train(train_data, batch_size, fsdp::DistributedSampler(train_data->size()),
                           /*drop_last=*/true);
    fsdp::DataLoader val(val_data, batch_size,
                         fsdp::DistributedSampler(val_data->size(), 1, 0, /*shuffle=*/false));

    Regression model(width, depth, lr);
    if (resume.empty()) {
      trainer.fit(model, train, val);
    } else {
      trainer.fit(model, train, val, resume);  // weights, optimizer, step, epoch, RNG state
    }

    const auto& losses = trainer.results().losses;
    if (!losses.empty()) {
      char line[160];
      std::snprintf(line, sizeof line,
                    "[train_regression] %zu steps, train_loss first %.6f last %.6f; best %s",
                    losses.size(), losses.front(), losses.back(),
                    checkpoint->best_model_path().c_str());
      trainer.print(line);
    }

    // The weights without a Trainer (rank 0 only; the other ranks are done). The names in the
    // checkpoint are "net.input.weight", "net.blocks.0.fc1.weight", ...: load them into a
    // Regression whose configure_model built its "net", then use model.net as a plain module.
    if (trainer.is_global_zero() && !checkpoint->last_model_path().empty()) {
      Regression reloaded(width, depth, lr);
      reloaded.configure_model();  // outside a Trainer: an ordinary, whole model
      fsdp::load_weights(reloaded, checkpoint->last_model_path());
      torch::NoGradGuard no_grad;
      // The whole validation set in one process, in the batches the ranks used together.
      fsdp::DataLoader all(val_data, batch_size,
                           fsdp::DistributedSampler(val_data->size(), 1, 0, /*shuffle=*/false));
      double sum = 0;
      for (const fsdp::Batch& b : all) {
        sum += at::mse_loss(reloaded.net->forward(b.input), b.target).item<double>();
      }
      std::printf("[train_regression] reloaded %s into a new Regression: val_loss %.6f\n",
                  checkpoint->last_model_path().c_str(), sum / static_cast<double>(all.num_batches()));
    }
    return 0;
  } catch (const c10::Error& e) {
    fsdp::fail_rank(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fsdp::fail_rank(e.what());
  }
}
