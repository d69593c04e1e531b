// fsdp::Trainer — Lightning's Trainer for C++.
//
//   fsdp::seed_everything(42);
//   auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(/*vocab=*/128, /*tokens=*/100000,
//                                                              /*seed=*/42);
//   fsdp::DataLoader train_loader(data, /*batch_size_per_rank=*/4,
//                                 fsdp::DistributedSampler(data->size()));
//   fsdp::TrainerOptions options;
//   options.devices = 2;
//   options.strategy = "ddp";                            // or a StrategyPtr
//   options.max_steps = 100;
//   fsdp::Trainer trainer(options);                      // devices > 1: other ranks start here
//   LanguageModel model(data->vocab_size());             // a fsdp::LightningModule
//   trainer.fit(model, train_loader);
//   trainer.print(fsdp::memory_summary());
//
// Ranks are processes (docs/design.md, "Decisions"): constructing a Trainer with devices > 1
// re-executes the program devices-1 times (fsdp::launch), so every rank runs main() up to this
// point again and then the same fit(). Code before the Trainer runs in every rank as well (each
// rank re-executes main()); seed before building models so every rank builds the same one.
//
// Lightning conventions kept here:
//   - batch_size is per rank: the Trainer gives the loader a DistributedSampler for its rank and
//     world (rank r takes positions r, r+N, ... of one shared, seeded permutation), so one
//     process with batch B*N sees at every step the samples N ranks with batch B see together.
//   - accumulate_grad_batches = k: every micro-batch's loss is divided by k before backward and
//     the optimizer steps every k micro-batches (non-boundary micro-batches run without gradient
//     synchronization). max_steps counts optimizer steps; the LR scheduler steps after each.
//   - The strategy is driven in the order documented in fsdp/strategy.h.
#pragma once

#include "fsdp/callback.h"
#include "fsdp/data.h"
#include "fsdp/init.h"
#include "fsdp/launcher.h"
#include "fsdp/lightning.h"
#include "fsdp/logger.h"
#include "fsdp/precision.h"
#include "fsdp/strategy.h"
#include "fsdp/strategy_registry.h"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdp {

namespace detail {
struct Settings;  // src/common/settings.h
}  // namespace detail

// Seeds every random source a run uses: torch's global generator (parameter init, dropout,
// shuffling through torch) and std::rand. Call it before building models; the same seed on every
// rank gives every rank the same initial parameters. A Trainer with TrainerOptions::seed calls
// it before configure_model and reports the seed as Trainer::seed().
void seed_everything(uint64_t seed);

// A strategy by name ("auto", "single", "ddp", "fsdp", ...) or an object. "auto" means
// "single" for one rank and "ddp" for more, as Lightning's default does for DDP-capable setups.
class StrategySpec {
 public:
  StrategySpec() = default;
  StrategySpec(const char* name) : name_(name) {}               // NOLINT: implicit on purpose
  StrategySpec(std::string name) : name_(std::move(name)) {}    // NOLINT
  template <typename S, typename = std::enable_if_t<std::is_base_of_v<Strategy, S>>>
  StrategySpec(std::shared_ptr<S> strategy)                      // NOLINT
      : object_(std::move(strategy)) {}

  const std::string& name() const { return name_; }
  const StrategyPtr& object() const { return object_; }

 private:
  std::string name_ = "auto";
  StrategyPtr object_;
};

// Field order follows Lightning's Trainer signature; designated initializers must keep it.
struct TrainerOptions {
  // "cpu", "cuda" / "gpu" (a CUDA build: rank r trains on cuda:(local_rank % visible devices)),
  // or "auto" (cuda when this build has CUDA and a device is visible, else cpu). docs/gpu.md
  // says what runs on CUDA and what is refused there.
  std::string accelerator = "cpu";
  int devices = 1;    // ranks per node (processes on CPU)
  int num_nodes = 1;
  StrategySpec strategy = "auto";
  // fsdp/precision.h: "32-true" (alias "32"); "bf16-mixed" (FSDP: MixedPrecisionPolicy
  // {bf16, bf16, bf16} unless the FSDPStrategy has its own; other strategies: CPU autocast to
  // bf16 with fp32 parameters); "bf16-true" (model built in bf16: parameters, compute and
  // optimizer state); "16-mixed" (as bf16-mixed in fp16, plus loss scaling by a
  // ShardedGradScaler that skips steps with inf/nan gradients); "16-true" (model in fp16, no
  // loss scaling; Adam's eps must not round to 0 in fp16); "64-true" (alias "64", fp64).
  std::string precision = "32-true";
  // Stop after this many epochs / optimizer steps, whichever comes first. Both unset
  // (-1): max_epochs = 1000, as Lightning.
  int64_t max_epochs = -1;
  int64_t max_steps = -1;
  // Batches per epoch (per rank) to use: < 0 all; in (0, 1) a fraction of the epoch
  // (at least one batch); >= 1 a count (must be a whole number); 0 disables.
  double limit_train_batches = -1;
  double limit_val_batches = -1;
  // When to validate during a training epoch (when fit() got a val loader): <= 0 at the end of
  // every epoch; in (0, 1) after that fraction of the epoch's batches; >= 1 every that many
  // training batches (micro-batches, as Lightning).
  double val_check_interval = 0;
  int64_t accumulate_grad_batches = 1;
  // > 0: clip gradients to this global L2 norm (over every rank's gradients) before each step.
  double gradient_clip_val = 0;
  int64_t log_every_n_steps = 50;  // CSV rows and non-terminal progress lines
  bool enable_progress_bar = true;
  // The default loggers write into <default_root_dir>/version_N (rank 0).
  std::string default_root_dir = "fsdp_logs";
  // >= 0: seed_everything(seed) before configure_model (same model on every rank).
  int64_t seed = -1;
  // "auto" | "gloo" | "mpi" | "nccl" (CUDA builds). "auto" (FSDP_BACKEND overrides it): on a
  // CUDA device, nccl when every rank of a node has a GPU of its own, else gloo (ranks sharing
  // a GPU, CUDA tensors staged through host memory); on the CPU, mpi when launched by mpirun,
  // or on one host when MPI is built and mpirun is on PATH (the program re-runs itself through
  // mpirun); gloo otherwise. Rank 0 prints the choice and why (docs/process_groups.md).
  std::string process_group_backend = "auto";
  // Where logged metrics go (rank 0; fsdp/logger.h, docs/logging.md). logger false: nowhere.
  // loggers empty: a CSVLogger and a TensorBoardLogger writing into one
  // <default_root_dir>/version_N (metrics.csv and an events.out.tfevents.* file).
  bool logger = true;
  std::vector<LoggerPtr> loggers;
  bool enable_summary = true;      // end-of-run summary (it/s, memory table) on rank 0
  // Checkpoints (fsdp/checkpoint.h). With checkpoint_dir set and save_every_n_steps > 0, fit
  // saves <checkpoint_dir>/step-<k> every that many optimizer steps and points
  // <checkpoint_dir>/last (a symlink, replaced atomically) at it. state_dict_type: "full" (one
  // consolidated safetensors set) | "sharded" (one file per rank).
  std::string checkpoint_dir;
  int64_t save_every_n_steps = 0;
  std::string state_dict_type = "full";
  // Hooks called during fit (fsdp/callback.h), e.g. fsdp::ModelCheckpoint (fsdp/checkpoint.h).
  // checkpoint_dir + save_every_n_steps above is sugar for a ModelCheckpoint(dirpath =
  // checkpoint_dir, filename "step-{step}", every_n_train_steps, save_top_k = -1, save_last).
  std::vector<CallbackPtr> callbacks;
};

// What a fit() measured, on every rank (losses are already the global mean everywhere; the
// loggers, progress bar and summary exist on global rank 0 only).
struct FitResults {
  std::vector<double> losses;      // per optimizer step: mean training loss over micro-batches
                                   // and ranks (global mean), as returned by training_step
  int64_t steps = 0;               // optimizer steps taken
  int64_t epochs = 0;              // epochs started
  int64_t micro_batches = 0;       // training micro-batches run (per rank)
  double seconds = 0;              // wall time of the training loop
  double it_per_s = 0;             // optimizer steps per second, first step (warm-up) excluded
  int64_t skipped_steps = 0;       // "16-mixed": optimizer steps the grad scaler skipped (inf/nan)
  // Per optimizer step, with gradient_clip_val > 0: the global L2 norm of the gradients before
  // clipping (what transformers logs as grad_norm).
  std::vector<double> grad_norms;
  // Per optimizer step: seconds from the start of the training loop to the end of the step
  // (after its loss was averaged over the ranks, a synchronization point), on this rank's
  // clock. Benchmarks compute it/s over any warm-up from it, as they do for their peers.
  std::vector<double> step_end_seconds;
  // Per optimizer step, on this rank: where the step's time went. forward: the micro-batches'
  // training_step under the strategy's pre-forward (FSDP's all-gathers run inside it); backward:
  // backward and the gradient reduction (post_backward); optimizer: clipping, the step,
  // zero_grad and the scheduler. comm: seconds this process's communication threads spent
  // running collectives during the step (fsdp::comm_busy_seconds; it overlaps the other parts).
  // The rest of a step (step_end_seconds differences minus the three parts) is data loading,
  // the loss all-reduce and reporting.
  std::vector<double> forward_seconds;
  std::vector<double> backward_seconds;
  std::vector<double> optimizer_seconds;
  std::vector<double> comm_seconds;
  // Per optimizer step, on this rank: seconds blocked waiting for the disk tier's reads and
  // writes (fsdp::disk_wait_seconds; part of the forward, backward or optimizer time).
  std::vector<double> disk_wait_seconds;
  int64_t params = 0;              // parameter elements of the model after configure_model
  int64_t trainable_params = 0;
  // Per rank, during training: the peaks are reset once setup (configure_model, sharding,
  // configure_optimizers, resume) is done, so they measure the training steps the way the
  // reference's memory table does. Setup's own peaks are reported separately.
  std::vector<int64_t> peak_alloc_bytes;  // per rank: peak tensor bytes (tracking allocator)
  std::vector<int64_t> peak_rss_bytes;    // per rank: peak resident set size
  // Per rank: the CUDA caching allocator's peak allocated bytes during training
  // (torch.cuda.max_memory_allocated after setup); -1 when the run is not on a CUDA device.
  std::vector<int64_t> device_peak_bytes;
  std::vector<int64_t> device_peak_reserved_bytes;  // torch.cuda.max_memory_reserved; -1 as above
  std::vector<int64_t> setup_peak_alloc_bytes;  // per rank: peak tensor bytes during setup
  std::vector<int64_t> setup_peak_rss_bytes;    // per rank: peak RSS at the end of setup
  // Per rank: the training peak (peak_alloc_bytes) split by who allocated the bytes alive at
  // that moment, {category: bytes} (see Note [Memory categories] in fsdp/memory.h; categories
  // with no bytes left out). The parts sum to the peak.
  std::vector<std::map<std::string, int64_t>> peak_breakdown_bytes;
  std::map<std::string, double> metrics;  // last value of every logged metric (rank 0 view)
  std::string log_dir;             // the first logger's directory ("" without a logger)
};

class Trainer {
 public:
  // Launches the ranks (fsdp::launch), installs the tracking allocator, creates the world
  // process group and connects the strategy. Throws c10::Error for a bad option.
  explicit Trainer(TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The loaders are re-strided in place for this rank when their sampler was built for world 1
  // (see Note [Sampler striding] in fsdp/data.h); a sampler built for another world is an error.
  void fit(LightningModule& module, DataLoader& train_loader);
  void fit(LightningModule& module, DataLoader& train_loader, DataLoader& val_loader);
  // Resumes from a checkpoint written by save_checkpoint (or a checkpoint_dir entry): weights,
  // optimizer and scheduler state, step/epoch/batch position and RNG state, at any world size
  // and strategy. max_steps still counts from the start of training.
  void fit(LightningModule& module, DataLoader& train_loader, const std::string& ckpt_path);
  void fit(LightningModule& module, DataLoader& train_loader, DataLoader& val_loader,
           const std::string& ckpt_path);
  // Saves the fitted module, optimizer and progress (collective: every rank calls it), in
  // options().state_dict_type format. Valid during and after fit().
  void save_checkpoint(const std::string& path);
  // Lightning's trainer.init_module(empty_init): while the returned guard lives, models built on
  // this thread skip random parameter initialization (null for empty_init=false). Use it when
  // weights are loaded right after. See Note [Empty init] in fsdp/init.h.
  std::unique_ptr<EmptyInitGuard> init_module(bool empty_init = true) const;
  // Runs validation_step / test_step over the loader and returns the epoch-level metrics
  // (mean over batches; sync_dist metrics also averaged over ranks).
  std::map<std::string, double> validate(LightningModule& module, DataLoader& loader);
  std::map<std::string, double> test(LightningModule& module, DataLoader& loader);
  // predict_step outputs of this rank's batches, in order.
  std::vector<at::Tensor> predict(LightningModule& module, DataLoader& loader);

  // Prints on global rank 0 only.
  void print(const std::string& text) const;

  int global_rank() const { return launch_.rank; }
  int local_rank() const { return launch_.local_rank; }
  int node_rank() const { return launch_.node_rank; }
  int world_size() const { return launch_.world_size; }
  bool is_global_zero() const { return launch_.rank == 0; }
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return current_epoch_; }

  const TrainerOptions& options() const { return options_; }
  const StrategyPtr& strategy() const { return strategy_; }
  const ProcessGroupPtr& world() const { return world_; }
  const LaunchInfo& launch_info() const { return launch_; }
  const FitResults& results() const { return results_; }
  // The seed this Trainer gave seed_everything before configure_model (TrainerOptions::seed),
  // or nullopt when it seeded nothing (yet).
  std::optional<uint64_t> seed() const { return seed_; }
  // Latest value of every logged metric during fit (step metrics after each optimizer step,
  // validation metrics after each validation, epoch metrics at epoch end), as Lightning's
  // trainer.callback_metrics. sync_dist metrics are equal on every rank; others are this rank's.
  const std::map<std::string, double>& callback_metrics() const { return callback_metrics_; }
  // "16-mixed": the loss scaler of the current/last fit (null for other precisions).
  const ShardedGradScaler* grad_scaler() const { return grad_scaler_.get(); }

  // Names accepted by TrainerOptions::precision / accelerator.
  static std::vector<std::string> precision_names();
  static std::vector<std::string> accelerator_names();

 private:
  // configure_model under the strategy, precision, setup_module (once per module).
  void setup_model(LightningModule& module);
  std::map<std::string, double> evaluate(LightningModule& module, DataLoader& loader,
                                         const std::string& stage);

  // The fit loop, in the step's parts (src/train/trainer.cpp).
  struct FitLoop;
  void fit_impl(LightningModule& module, DataLoader& train_loader, DataLoader* val_loader);
  std::unique_ptr<FitLoop> setup_fit(LightningModule& module, DataLoader& train_loader,
                                     DataLoader* val_loader);
  void train_micro_batch(FitLoop& loop, const Batch& batch, int64_t batch_idx, bool boundary);
  void optimizer_step(FitLoop& loop);
  void report_step(FitLoop& loop);
  void validate_during_fit(FitLoop& loop);
  void finish_fit(FitLoop& loop);

  TrainerOptions options_;
  // The environment's settings as this Trainer's constructor read them (before launching).
  std::unique_ptr<const detail::Settings> settings_;
  LaunchInfo launch_;
  ProcessGroupPtr world_;
  StrategyPtr strategy_;
  LightningModule* configured_module_ = nullptr;  // configure_model + setup_module done
  // bf16-mixed / 16-mixed that the strategy leaves to the Trainer: the autocast dtype (on the
  // device's type: CPU or CUDA autocast).
  std::optional<at::ScalarType> cpu_autocast_;
  // The device this rank trains on (accelerator; src/common/device_choice.h).
  c10::Device device_{c10::kCPU};
  // The batch on device_ (the loader's tensors are host tensors).
  Batch on_device(const Batch& batch) const;
  int64_t global_step_ = 0;
  int64_t current_epoch_ = 0;
  FitResults results_;
  // Checkpoint state (src/ckpt/trainer_checkpoint.cpp).
  void resume_from_checkpoint();
  void setup_callbacks();  // fit_callbacks_ from options_ (checkpoint_dir sugar included)
  std::string resume_path_;
  LightningModule* fit_module_ = nullptr;
  OptimizerConfig fit_opt_;
  int64_t next_epoch_ = 0;  // position of the next training micro-batch
  int64_t next_batch_ = 0;
  std::map<std::string, double> callback_metrics_;
  std::vector<CallbackPtr> fit_callbacks_;  // options_.callbacks + the checkpoint_dir sugar
  std::unique_ptr<ShardedGradScaler> grad_scaler_;  // "16-mixed" only
  std::optional<uint64_t> seed_;
};

}  // namespace fsdp
