// fsdp-train: train a demo language model with any strategy, from the command line.
//
//   fsdp-train --model transformer-small --strategy ddp --devices 2 --max-steps 100
//   fsdp-train --model custom --nlayers 4 --ninp 256 --nhead 4 --nhid 1024 --data wikitext2
//              --data-dir data/wikitext-2                                      (one line)
//
// Every flag sets a TrainerOptions / StrategyOptions (FSDPOptions, DDPOptions with its comm
// hook, DeepSpeedOptions) / ModelCheckpointOptions field, or a model/data/optimizer choice
// (`--help` lists them with their defaults). The strategy comes from the registry
// (include/fsdp/strategy_registry.h) with the flags of its family; the flags both this program
// and fsdp-finetune have, the demo model and data, the dry-run planner and the summary JSON are
// in apps/support/. An unknown flag or a bad value prints one line and exits 2; an error during
// the run prints "[rank R] error: ..." once and exits 1 (all ranks stop).
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>

#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "support/flags.h"
#include "support/language_model.h"
#include "support/planner.h"
#include "support/summary.h"

namespace {

using fsdp::app::CommonFlags;

// --save-initial-weights FILE: the parameters training starts from (after DDP's broadcast from
// rank 0), FQN keys, safetensors, so that a Python peer can start from the same weights
// (bench/peers/ddp_hooks_peer.py --weights).
class InitialWeightsWriter : public fsdp::Callback {
 public:
  explicit InitialWeightsWriter(std::string path) : path_(std::move(path)) {}
  void on_fit_start(fsdp::Trainer& t, fsdp::LightningModule& module) override {
    if (!t.is_global_zero()) return;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value().detach());
    }
    fsdp::save_safetensors(path_, tensors);
  }

 private:
  std::string path_;
};

// The command line. The shared flags (trainer, strategy and its family's options, output) land
// in `common`; the rest are this program's own: checkpoints, model, optimizer, data.
struct Args {
  fsdp::app::CommonArgs common;
  fsdp::ModelCheckpointOptions checkpoint;
  fsdp::app::ModelSpec model;
  fsdp::app::OptimizerSpec optimizer;
  fsdp::app::DataSpec data;
  std::string save_batches;          // write the run's micro-batches (every rank's) here and exit
  std::string save_initial_weights;  // rank 0 writes the weights training starts from here
  std::string ckpt_path;
  std::string logger = "csv,tensorboard";  // --logger

  Args() {  // this program's defaults where they differ from the library's
    common.trainer.max_steps = 100;
    common.trainer.log_every_n_steps = 10;
    common.trainer.seed = 42;
    checkpoint.save_top_k = -1;     // keep every checkpoint unless --save-top-k
    checkpoint.every_n_epochs = 0;  // 0: not given (see run())
    model.dropout = 0.2;
  }
  int world() const { return common.world(); }
};

// --dry-run: every strategy's per-rank model state for the model, built on the meta device.
int dry_run(const Args& a, const CommonFlags& flags) {
  fsdp::app::ModelSpec spec = a.model;
  const fsdp::TrainerOptions& t = a.common.trainer;
  spec.vocab_size = a.data.data == "wikitext2"
                        ? fsdp::app::load_data(a.data, spec.name, t, a.world()).vocab_size
                        : fsdp::app::synthetic_vocab_size(a.data, spec.name);
  std::shared_ptr<fsdp::nn::Module> model;
  {
    fsdp::MetaInitGuard meta;  // shapes only: no storage, no init
    model = fsdp::app::build_model(spec);
  }
  const int64_t params = fsdp::app::count_parameters(*model);
  const fsdp::StrategyOptions options = flags.strategy_options(spec.unit_types());
  const auto rows = fsdp::app::plan_strategies(*model, options, a.world(), t.devices, t.num_nodes);
  std::cout << "[fsdp-train] dry run: model " << spec.name << ", " << fsdp::app::with_commas(params)
            << " parameters (" << fsdp::format_bytes(params * 4) << " fp32), vocab "
            << spec.model_vocab_size() << ", world " << a.world() << " (" << t.devices
            << " per node), wrap policy " << a.common.wrap_policy
            << "; nothing allocated (meta device)" << std::endl;
  const fsdp::ModelStateBudget budget = fsdp::app::plan_budget(t.accelerator, t.devices);
  fsdp::app::print_plan(rows, budget);
  // The disk tier as the run's strategy would set it up (a DeepSpeed preset's own offload
  // included), else as the offload flags ask; FSDP shards every parameter (no persistent ones).
  fsdp::DeepSpeedOptions disk = options.deepspeed;
  if (flags.family() == fsdp::StrategyFamily::kFSDP) disk.stage3_param_persistence_threshold = 0;
  if (flags.family() == fsdp::StrategyFamily::kDeepSpeed) {
    auto strategy = flags.make_strategy(options);
    if (auto ds = std::dynamic_pointer_cast<fsdp::DeepSpeedStrategy>(strategy)) disk = ds->options();
  }
  const bool disk_fits = fsdp::app::print_disk_plans(*model, disk, a.world(), t.devices);
  const int64_t rss = fsdp::peak_rss_bytes();
  std::cout << "model state only (fp32 params, grads, 2 Adam moments; DDP: + bucket buffers; "
               "FSDP: + root unit and the two largest units unsharded); activations not "
               "included. Peak RSS of this dry run: "
            << fsdp::format_bytes(rss) << std::endl;
  if (!a.common.summary_json.empty()) {
    fsdp::app::write_json(a.common.summary_json,
                          {{"model", spec.name}, {"params", params},
                           {"vocab_size", spec.model_vocab_size()}, {"world_size", a.world()},
                           {"peak_rss_bytes", rss}, {"budget", fsdp::app::budget_json(budget)},
                           {"strategies", fsdp::app::plan_json(rows, budget)}});
  }
  return disk_fits ? 0 : 1;
}

// The loss a model that learned nothing scores, and what the data allows, so the logged
// losses can be read.
std::string loss_reference(const Args& a, int64_t vocab) {
  std::ostringstream ref;
  ref << std::fixed << std::setprecision(2) << "[fsdp-train] loss reference: uniform guess ln("
      << vocab << ") = " << std::log(static_cast<double>(vocab));
  if (a.data.data == "synthetic") {
    ref << ", a perfect model of the synthetic chain = "
        << fsdp::demos::SyntheticCorpus::entropy_rate();
    // Lightning's demo Transformer feeds the targets to its decoder (causal mask, but position
    // i sees target i), so it can copy and go below the chain's entropy; GPT-2 cannot.
    if (a.model.name != "custom" && !fsdp::demos::is_transformer_model(a.model.name)) {
      ref << " (causal: the floor for this model)";
    } else {
      ref << " (Lightning's demo Transformer sees each target in its decoder input and can "
             "copy it, going below that; a gpt2-* model is causal)";
    }
  }
  return ref.str();
}

// The Trainer's options: the strategy (which checks its options when it is built) and the
// callbacks the flags ask for, after the summary's recorders. Starts nothing (--check-flags
// builds them too).
fsdp::TrainerOptions trainer_options(const Args& a, const CommonFlags& flags,
                                     fsdp::app::RunRecorders* recorders) {
  fsdp::TrainerOptions t = a.common.trainer;
  t.strategy = flags.make_strategy(flags.strategy_options(a.model.unit_types()));
  *recorders = fsdp::app::add_run_recorders(t);
  fsdp::app::set_loggers(t, a.logger);
  if (!a.save_initial_weights.empty()) {
    t.callbacks.push_back(std::make_shared<InitialWeightsWriter>(a.save_initial_weights));
  }
  const fsdp::ModelCheckpointOptions& c = a.checkpoint;
  if (!c.dirpath.empty()) {
    // A ModelCheckpoint: DIR/step-<k>[-<monitor>=<value>] entries, DIR/last -> the newest.
    // --checkpoint-dir alone saves as Lightning's ModelCheckpoint(dirpath=DIR) does: at the end
    // of every epoch, and at the end of training (docs/fsdp-train.md, "Checkpoints").
    fsdp::ModelCheckpointOptions mc = c;
    mc.filename = "step-{step}";
    if (!c.monitor.empty()) mc.filename += "-" + c.monitor + "={" + c.monitor + "}";
    mc.auto_insert_metric_name = false;
    mc.save_last = true;
    // Lightning's default (-1): every epoch when no step period is given.
    if (mc.every_n_epochs == 0) mc.every_n_epochs = -1;
    t.callbacks.push_back(std::make_shared<fsdp::ModelCheckpoint>(mc));
  }
  return t;
}

int run(const Args& a, const CommonFlags& flags) {
  const fsdp::TrainerOptions& in = a.common.trainer;
  const uint64_t seed = static_cast<uint64_t>(in.seed);
  fsdp::seed_everything(seed);
  // Data first: a missing file fails once, here, before the other ranks are started.
  const fsdp::app::Data data = fsdp::app::load_data(a.data, a.model.name, in, a.world());

  fsdp::app::RunRecorders recorders;
  const fsdp::TrainerOptions t = trainer_options(a, flags, &recorders);
  fsdp::Trainer trainer(t);  // devices > 1: the other ranks start here and run main() again

  fsdp::app::ModelSpec spec = a.model;
  spec.vocab_size = data.vocab_size;
  // Lightning's convention: batch size per rank; the Trainer strides the sampler over ranks.
  const int64_t B = a.data.batch_size;
  fsdp::DataLoader train_loader(
      data.train, B, fsdp::DistributedSampler(data.train->size(), 1, 0, /*shuffle=*/true, seed),
      true);
  std::unique_ptr<fsdp::DataLoader> val_loader;
  if (data.val && data.val->size() > 0) {
    val_loader = std::make_unique<fsdp::DataLoader>(
        data.val, B, fsdp::DistributedSampler(data.val->size(), 1, 0, /*shuffle=*/false, seed),
        true);
  }

  fsdp::app::LanguageModel model(spec, a.optimizer);
  trainer.print("[fsdp-train] model " + spec.name + ", vocab " + std::to_string(spec.vocab_size) +
                ", data " + a.data.data + " (" + std::to_string(data.train->size()) +
                " training blocks of " + std::to_string(a.data.block_size) + "), strategy " +
                trainer.strategy()->name() + ", world " + std::to_string(trainer.world_size()) +
                ", batch " + std::to_string(B) + " per rank" +
                (spec.activation_checkpointing ? ", activation checkpointing on" : ""));
  trainer.print(loss_reference(a, spec.vocab_size));
  const bool validate = val_loader && val_loader->num_batches() > 0;
  if (validate && a.ckpt_path.empty()) {
    trainer.fit(model, train_loader, *val_loader);
  } else if (validate) {
    trainer.fit(model, train_loader, *val_loader, a.ckpt_path);
  } else if (a.ckpt_path.empty()) {
    trainer.fit(model, train_loader);
  } else {
    trainer.fit(model, train_loader, a.ckpt_path);
  }

  const fsdp::FitResults& r = trainer.results();
  if (r.losses.size() >= 2) {
    std::ostringstream learned;
    learned << std::fixed << std::setprecision(2) << "[fsdp-train] loss " << r.losses.front()
            << " (step 1) -> " << r.losses.back() << " (step " << r.losses.size()
            << "); uniform guess " << std::log(static_cast<double>(spec.vocab_size));
    trainer.print(learned.str());
  }
  nlohmann::json j = fsdp::app::run_summary(trainer, recorders);
  if (trainer.is_global_zero() && !a.common.summary_json.empty()) {
    j["model"] = spec.name;
    j["batch_size"] = B;
    j["precision"] = t.precision;
    j["activation_checkpointing"] = spec.activation_checkpointing;
    // Tokens per optimizer step over every rank, and per second from it_per_s.
    const int64_t tokens_per_step = static_cast<int64_t>(B) * a.data.block_size * a.world() *
                                    t.accumulate_grad_batches;
    j["tokens_per_step"] = tokens_per_step;
    j["tokens_per_s"] = r.it_per_s * static_cast<double>(tokens_per_step);
    fsdp::app::write_json(a.common.summary_json, j);
  }
  return 0;
}

// One sentence for a command line the flags' own checks let through, or "".
std::string check_run(const Args& a, const CommonFlags& flags) {
  if (!a.save_initial_weights.empty()) {
    const fsdp::StrategyFamily family = flags.family();
    if (family != fsdp::StrategyFamily::kSingle && family != fsdp::StrategyFamily::kDDP) {
      return "--save-initial-weights needs whole parameters on rank 0 (strategy single or "
             "ddp); --strategy " + a.common.strategy + " shards them";
    }
  }
  const fsdp::ModelCheckpointOptions& c = a.checkpoint;
  if (c.dirpath.empty() && (c.every_n_train_steps != 0 || c.every_n_epochs != 0 ||
                            !c.monitor.empty() || c.save_top_k != -1)) {
    return "--save-every-n-steps, --every-n-epochs, --monitor and --save-top-k need "
           "--checkpoint-dir DIR (where the checkpoints go)";
  }
  return {};
}

// One sentence for a command line the flags' own checks let through, or "".
std::string check_model(const Args& a, const std::vector<CLI::Option*>& custom_flags) {
  for (auto* o : custom_flags) {
    if (o->count() > 0 && a.model.name != "custom") {
      return o->get_name() + " only applies to --model custom (got --model " + a.model.name + ")";
    }
  }
  if (a.model.name == "custom" && a.model.custom.ninp % a.model.custom.nhead != 0) {
    return "--ninp " + std::to_string(a.model.custom.ninp) + " must be divisible by --nhead " +
           std::to_string(a.model.custom.nhead);
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "fsdp-train: train a demo language model (Lightning's Transformer or a GPT-2) with the "
      "fsdp.cpp Trainer.\nRanks are processes: --devices N runs N processes (this program re-executes itself N - 1 times)."};
  app.option_defaults()->always_capture_default();
  app.get_formatter()->column_width(34);
  using fsdp::cli::at_least;
  using fsdp::cli::between;
  using fsdp::cli::greater_than;
  using fsdp::cli::one_of;

  fsdp::app::CommonFlagsSpec spec;
  spec.precision_help =
      "32-true (fp32); bf16-mixed (FSDP: fp32 master shards, bf16 all-gather/compute/"
      "reduce-scatter; other strategies: CPU autocast); bf16-true (bf16 everything); 16-mixed "
      "(as bf16-mixed in fp16, with loss scaling); 16-true (fp16 everything; with --adam-eps "
      "1e-4); 64-true";
  spec.dry_run_help =
      "print the parameter count and per-rank memory of every strategy at --devices, without "
      "allocating the model (meta device), and exit";
  spec.summary_json_help = "write the run summary (losses, it/s, memory) as JSON here";
  CommonFlags flags(app, a.common, spec);

  fsdp::TrainerOptions& t = a.common.trainer;
  app.option_defaults()->group("Trainer");
  app.add_option("--accelerator", t.accelerator, "cpu | auto | cuda | gpu (cuda: a CUDA build, rank r on cuda:(local rank % GPUs); "
                 "auto: cuda when a GPU is visible; what runs on CUDA: docs/gpu.md)")
      ->check(one_of(fsdp::Trainer::accelerator_names()));
  app.add_option("--num-nodes", t.num_nodes, "nodes (under SLURM/mpirun/torchrun-style env)")
      ->check(at_least(1));
  app.add_flag("--activation-checkpointing", a.model.activation_checkpointing,
               "recompute each layer's activations in backward (any strategy): less activation "
               "memory, about 1/3 more compute");
  app.add_option("--max-steps", t.max_steps, "optimizer steps to take (-1: until --max-epochs)")
      ->check(at_least(int64_t{-1}));
  app.add_option("--max-epochs", t.max_epochs, "epochs (-1: unlimited; 1000 if --max-steps is -1 too)")
      ->check(at_least(int64_t{-1}));
  app.add_option("--accumulate-grad-batches", t.accumulate_grad_batches,
                 "micro-batches per optimizer step (loss divided by it)")
      ->check(at_least(int64_t{1}));
  app.add_option("--gradient-clip-val", t.gradient_clip_val, "clip to this global L2 norm (0: off)")
      ->check(at_least(0.0));
  app.add_option("--limit-train-batches", t.limit_train_batches,
                 "batches per epoch: <0 all, (0,1) fraction, >=1 count");
  app.add_option("--limit-val-batches", t.limit_val_batches,
                 "validation batches: <0 all, 0 none, (0,1) fraction, >=1 count");
  app.add_option("--val-check-interval", t.val_check_interval,
                 "validate every N training batches (>=1), a fraction of the epoch (0,1), or at epoch end (0)")
      ->check(at_least(0.0));
  app.add_option("--log-every", t.log_every_n_steps, "log_every_n_steps: logged rows and non-terminal progress lines")
      ->check(at_least(int64_t{1}));
  app.add_option("--default-root-dir", t.default_root_dir, "logs go to DIR/version_N (metrics.csv, TensorBoard events)")
      ->check(fsdp::cli::output_dir());
  app.add_option("--logger", a.logger,
                 "csv,tensorboard (both, in one DIR/version_N), csv, tensorboard, or none")
      ->check(one_of({"csv,tensorboard", "csv", "tensorboard", "none"}));
  app.option_defaults()->group("Model");
  const std::vector<std::string> models = [] {
    auto v = fsdp::demos::model_names();
    v.push_back("custom");
    return v;
  }();
  fsdp::demos::TransformerOptions& custom = a.model.custom;
  app.add_option("--model", a.model.name, "a preset or custom")->check(one_of(models));
  const std::vector<CLI::Option*> custom_flags = {
      app.add_option("--nlayers", custom.nlayers, "custom: encoder (and decoder) layers"),
      app.add_option("--nhid", custom.nhid, "custom: feed-forward width"),
      app.add_option("--ninp", custom.ninp, "custom: embedding width"),
      app.add_option("--nhead", custom.nhead, "custom: attention heads")};
  for (auto* o : custom_flags) o->check(at_least(int64_t{1}));
  app.add_option("--vocab-size", a.data.vocab_size,
                 "synthetic data vocabulary (0: the preset's, at most 1024); wikitext2 uses its own")
      ->check(at_least(int64_t{0}));
  app.add_option("--dropout", a.model.dropout, "dropout probability")
      ->check(between(0.0, 1.0));
  app.add_option("--loss-chunk-tokens", a.model.loss.chunk_tokens,
                 "tokens per chunk of the head's logits in the loss (fsdp::linear_cross_entropy): "
                 "0 = auto (chunks of ceil(tokens / ceil(vocab / width)), at least 64, once the "
                 "whole fp32 logits would pass 64 MiB and the vocabulary is wider than the "
                 "model), -1 = off (the whole logits at once), N = N tokens")
      ->check(at_least(int64_t{-1}))
      ->capture_default_str();
  app.add_flag("--vocab-parallel,!--no-vocab-parallel", a.model.vocab_parallel,
               "on (default): under a sharding strategy the embedding and the head compute on "
               "their shards of the vocabulary and move the tokens, never gathering the "
               "vocabulary matrices (docs/models_and_data.md); off: gather them as any unit");
  app.option_defaults()->group("Optimizer");
  app.add_option("--optimizer", a.optimizer.name,
                 "adam | adamw | sgd | cpu_adam | cpu_adamw (fused CPU Adam / AdamW, fsdp::optim::CPUAdam)")
      ->check(one_of({"adam", "adamw", "sgd", "cpu_adam", "cpu_adamw"}));
  app.add_option("--lr", a.optimizer.lr, "learning rate")
      ->check(greater_than(0.0))
      ->check(between(0.0, fsdp::app::kMaxLearningRate));
  app.add_option("--weight-decay", a.optimizer.weight_decay, "weight decay")
      ->check(at_least(0.0));
  app.add_option("--adam-eps", a.optimizer.adam_eps,
                 "adam/adamw eps (16-true needs one fp16 can hold, e.g. 1e-4)")
      ->check(greater_than(0.0));
  app.option_defaults()->group("Data");
  app.add_option("--data", a.data.data, "synthetic (built in, no files) | wikitext2")
      ->check(one_of({"synthetic", "wikitext2"}));
  app.add_option("--data-dir", a.data.data_dir, "wikitext2: directory with train.txt (valid.txt optional)");
  auto* o_batch = app.add_option("--batch-size", a.data.batch_size, "samples per rank per micro-batch")
                      ->check(at_least(int64_t{1}));
  app.add_option("--block-size", a.data.block_size, "tokens per sample")
      ->check(at_least(int64_t{1}));
  app.add_option("--num-tokens", a.data.num_tokens,
                 "synthetic corpus size for training (0: enough for --max-steps, at least 100000)")
      ->check(at_least(int64_t{0}));
  app.option_defaults()->group("Output");
  app.add_option("--save-initial-weights", a.save_initial_weights,
                 "rank 0 writes the parameters training starts from to FILE (safetensors, FQN "
                 "keys; strategy single or ddp), e.g. for a Python peer's --weights")
      ->check(fsdp::cli::output_file());
  app.add_option("--save-batches", a.save_batches,
                 "write the micro-batches of the first --max-steps steps, every rank's, to this "
                 "safetensors file (for bench/peers/*.py) and exit without training")
      ->check(fsdp::cli::output_file());
  // Checkpoints
  fsdp::ModelCheckpointOptions& c = a.checkpoint;
  app.option_defaults()->group("Checkpoints");
  app.add_option("--checkpoint-dir", c.dirpath,
                 "save DIR/step-<k> every --save-every-n-steps steps (or --every-n-epochs "
                 "epochs; alone: every epoch and at the end of training), and DIR/last -> the "
                 "newest")
      ->check(fsdp::cli::output_dir());
  app.add_option("--save-every-n-steps", c.every_n_train_steps, "checkpoint period in optimizer steps (0: off)")
      ->check(at_least(int64_t{0}));
  app.add_option("--state-dict-type", t.state_dict_type, "checkpoint format: full | sharded")
      ->check(one_of({"full", "sharded"}));
  app.add_option("--every-n-epochs", c.every_n_epochs,
                 "also save at the end of every N epochs (default with --monitor and no "
                 "--save-every-n-steps: 1)")
      ->check(at_least(int64_t{0}));
  app.add_option("--monitor", c.monitor,
                 "rank checkpoints by this logged metric for --save-top-k")
      ->check(one_of(fsdp::app::LanguageModel::metric_names()));
  app.add_option("--mode", c.mode, "min | max: which --monitor values are better")
      ->check(one_of({"min", "max"}));
  app.add_option("--save-top-k", c.save_top_k,
                 "keep the K best checkpoints by --monitor (-1: all; 1 without --monitor: the "
                 "newest); others are deleted once a better one is saved")
      ->check(at_least(int64_t{-1}));
  app.add_option("--ckpt-path", a.ckpt_path,
                 "resume from this checkpoint (e.g. DIR/last); --max-steps counts from the start");

  if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-train",
                                   fsdp::cli::CheckFlags::kByTheProgram)) {
    return *code;
  }

  // train_micro_batch_size_per_gpu is --batch-size (per rank); both given must agree.
  try {
    if (auto micro = flags.deepspeed_micro_batch_size()) {
      if (o_batch->count() > 0 && a.data.batch_size != *micro) {
        std::cerr << "fsdp-train: error: --batch-size " << a.data.batch_size << " but the "
                  << "DeepSpeed config's train_micro_batch_size_per_gpu is " << *micro
                  << "; give one of them" << std::endl;
        return 2;
      }
      a.data.batch_size = *micro;
    }
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-train: error: " << e.what_without_backtrace() << std::endl;
    return 2;
  }
  for (const std::string& why : {check_model(a, custom_flags), flags.check(), check_run(a, flags)}) {
    if (why.empty()) continue;
    std::cerr << "fsdp-train: error: " << why << std::endl;
    return 2;
  }
  if (t.max_steps < 0 && t.max_epochs < 0 && a.data.data == "synthetic" && a.data.num_tokens == 0) {
    // Lightning would run 1000 epochs; say so rather than surprise.
    std::cerr << "fsdp-train: note: neither --max-steps nor --max-epochs set: up to 1000 epochs"
              << std::endl;
  }
  return fsdp::app::run_or_fail([&] {
    if (fsdp::cli::check_only()) {
      fsdp::app::RunRecorders unused;
      trainer_options(a, flags, &unused);  // throws for what the strategy or a callback refuses
      return 0;
    }
    if (a.common.dry_run) return dry_run(a, flags);
    if (!a.save_batches.empty()) {
      fsdp::app::save_batches(a.save_batches, a.data, a.model.name, t, a.world());
      return 0;
    }
    return run(a, flags);
  });
}
