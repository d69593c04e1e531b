// Checkpoints: full and sharded, loadable at any world size and under any strategy.
//
//   trainer.save_checkpoint("ckpt/step-100");                 // collective: every rank calls it
//   trainer.fit(model, loader, "ckpt/step-100");              // resume
//   fsdp::load_weights(plain_model, "ckpt/step-100");         // weights only, no Trainer
//
// Formats (no pickle: tensors in safetensors, metadata in JSON; docs/design.md, "Decisions"):
//
//   full     DIR/model.safetensors      standard safetensors, FQN keys, full shapes
//            DIR/optimizer.safetensors  "optim.<fqn>.<stat>" (exp_avg, exp_avg_sq, momentum_buffer)
//            DIR/meta.json              {"type": "full", world_size, strategy, progress, optimizer
//                                        kind/lrs/steps, every rank's CPU RNG state}
//            Under FSDP the ranks all-gather one parameter (one optimizer tensor) at a time and
//            rank 0 streams it to disk: its peak stays within its shards plus the largest tensor.
//   sharded  DIR/shard-<i>-of-<S>.safetensors  the S ranks of the first replica (S = shard group
//                                        size; HYBRID_SHARD: a node) write their rows in parallel
//            DIR/metadata.json          {"type": "sharded", ..., "tensors": {key: {shape, dtype,
//                                        pieces: [{file, rows: [begin, end)}]}}} (unpadded rows)
//
// Loading detects the format (meta.json vs metadata.json), validates every file header and the
// shapes against the model before reading any data, and then each rank reads only the row
// ranges its tensors need (pread), so a checkpoint saved at world W loads at any world W' and
// under any strategy (single, ddp, fsdp). See Note [Checkpoint layout] in src/ckpt/layout.h.
//
// Saving is crash-safe: files go to DIR.partial, every file is written atomically, and only when
// every rank is done does rank 0 write the metadata and rename DIR.partial to DIR. A rank dying
// mid-save leaves DIR (and any earlier checkpoint) as it was; a sharded save that fails on a
// rank (full disk, read-only directory) is an error on every rank and publishes nothing.
//
// Optimizer state a strategy keeps outside the optimizer (the disk tier: Strategy::
// streamed_optimizer_state) is streamed to and from the sharded files one buffer at a time,
// in the same tensors a RAM run writes; the full format is an error for such runs.
#pragma once

#include "fsdp/callback.h"
#include "fsdp/strategy.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp {

enum class StateDictType { kFull, kSharded };
// "full" | "sharded"; anything else is an error listing both.
StateDictType parse_state_dict_type(const std::string& name);
const char* to_string(StateDictType type);

// Where training stands; saved with the tensors so that resuming continues the same run.
struct TrainingProgress {
  int64_t global_step = 0;     // optimizer steps taken
  int64_t epoch = 0;           // epoch of the next batch
  int64_t batch_in_epoch = 0;  // index (in that epoch) of the next micro-batch
  int64_t scheduler_steps = 0; // LR scheduler step() calls so far
  // Callback states (JSON object text: state_key -> state; "" = none). See fsdp/callback.h.
  std::string callback_states;
};

// Saves module parameters and buffers, optimizer state (Adam/AdamW exp_avg, exp_avg_sq, step,
// max_exp_avg_sq; SGD momentum), learning rates, progress and every rank's CPU RNG state to `dir`.
// Collective over strategy.world(): every rank calls it. optimizer may be null (weights only).
void save_checkpoint(const std::string& dir, Strategy& strategy, torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const TrainingProgress& progress,
                     StateDictType type);

// Loads a checkpoint of either format into a module set up by `strategy` (resharding as
// needed), the optimizer state when optimizer is non-null, and restores the CPU RNG state (each
// rank its own at the world size of the save, rank 0's at another world size).
// Replays `scheduler_steps` scheduler steps when scheduler is non-null. Collective.
TrainingProgress load_checkpoint(const std::string& dir, Strategy& strategy,
                                 torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                                 torch::optim::LRScheduler* scheduler = nullptr);

// Weights only into a plain (not sharded) module, e.g. for fine-tuning or inference: `path` is a
// checkpoint directory (full or sharded) or a .safetensors file with FQN keys. Every parameter
// and buffer of the module must be present with the same shape.
void load_weights(torch::nn::Module& module, const std::string& path);

// What `fsdp-ckpt inspect` prints.
struct CheckpointTensorInfo {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t pieces = 1;  // files holding its rows
};
struct CheckpointInfo {
  std::string type;  // "full" | "sharded" | "safetensors" (a bare file)
  int world_size = 0;
  std::string strategy;
  TrainingProgress progress;
  std::vector<CheckpointTensorInfo> tensors;
};
CheckpointInfo inspect_checkpoint(const std::string& path);

// Consolidates a checkpoint (sharded or full) into one standard safetensors file of the model
// weights, tensor by tensor: memory stays bounded by the largest tensor.
void convert_to_safetensors(const std::string& checkpoint_dir, const std::string& out_file);
// Rewrites a checkpoint (either format) as a sharded one for `world_size` ranks, streaming
// (one tensor piece at a time). The result loads like one saved by `world_size` FSDP ranks.
void convert_to_sharded(const std::string& checkpoint_dir, const std::string& out_dir,
                        int world_size);

// Writes named tensors to one standard safetensors file, atomically (any dtype the format has;
// non-contiguous tensors are copied first). For data other tools read, e.g. the batches
// `fsdp-train --save-batches` writes for Python peers (safetensors.torch.load_file reads it).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// --- ModelCheckpoint: Lightning's checkpoint callback (fsdp/callback.h).
//
//   fsdp::ModelCheckpointOptions mc;
//   mc.dirpath = "ckpt";
//   mc.monitor = "val_loss";            // a metric the LightningModule logs
//   mc.mode = "min";
//   mc.save_top_k = 2;                  // keep the 2 best entries, delete the rest
//   mc.save_last = true;                // ckpt/last -> the newest save
//   auto cb = std::make_shared<fsdp::ModelCheckpoint>(mc);
//   options.callbacks = {cb};
//   trainer.fit(model, train, val);
//   trainer.fit(model2, train, val, cb->best_model_path());   // resume from the best
//
// When it saves (the same rules as Lightning):
//   every_n_train_steps > 0   after every that many optimizer steps (on_train_batch_end)
//   every_n_epochs > 0        at the end of every that many epochs: on_train_epoch_end (after
//                             the epoch-end validation), or on_validation_end when validation
//                             runs inside the epoch (val_check_interval > 0)
//   defaults                  every_n_epochs = 1 unless every_n_train_steps is set
//   never twice at the same global step, and not at the step a fit resumed from.
// Each save is a checkpoint directory (Trainer::save_checkpoint, options' state_dict_type)
// named by `filename` (see format_checkpoint_name). Which ones are kept:
//   save_top_k = -1  all;  0  none (save_last still works);  k > 0 with a monitor: the k best
//   by the monitored metric (mode "min" or "max"; NaN counts as worst; a tie does not replace);
//   1 without a monitor: only the newest. Other k without a monitor is an error.
// An entry pushed out of the top k is deleted (renamed away first, then removed) only after
// the new entry is complete, so a crash mid-save leaves the old set intact.
// save_last: `dirpath/last` is a symlink, replaced atomically, to the newest save (a top-k
// entry of that step, else a separate "last-<name>" entry that replaces the previous one).
// One run owns `last` (dirpath/.fsdp-owner.json records it): another run that is still running
// keeps its own `last-<first 8 digits of its run id>` instead, and says so in one warning line.
// The monitored value is rank 0's (broadcast), so every rank makes the same decision; log it
// with sync_dist = true so that it means the global value.
struct ModelCheckpointOptions {
  std::string dirpath;                // required: where the checkpoint directories go
  // Name template: "{epoch}", "{step}" and "{<metric>}" (optionally "{<metric>:.3f}", a printf
  // format for metrics). Default "{epoch}-{step}"; with auto_insert_metric_name a field is
  // written as "name=value" ("epoch=2-step=30-val_loss=0.4210"). '/' in names becomes '_'.
  std::string filename;
  std::string monitor;                // metric name in Trainer::callback_metrics(); "" = none
  std::string mode = "min";           // "min" | "max"
  int64_t save_top_k = 1;
  bool save_last = false;
  int64_t every_n_train_steps = 0;
  int64_t every_n_epochs = -1;        // -1: 1 when every_n_train_steps == 0, else 0 (off)
  bool auto_insert_metric_name = true;
};

class ModelCheckpoint : public Callback {
 public:
  // Throws for an invalid combination (empty dirpath, unknown mode, save_top_k < -1, top-k > 1
  // without a monitor).
  explicit ModelCheckpoint(ModelCheckpointOptions options);

  void on_fit_start(Trainer& trainer, LightningModule& module) override;
  void on_train_batch_end(Trainer& trainer, LightningModule& module, int64_t batch_idx) override;
  void on_validation_end(Trainer& trainer, LightningModule& module) override;
  void on_train_epoch_end(Trainer& trainer, LightningModule& module) override;
  // Saved with each checkpoint: the top-k list, best/last paths. Restored when dirpath is the
  // same (entries that no longer exist are dropped), so a resumed fit keeps the same top k.
  std::string state_key() const override;
  std::string state_dict() const override;
  void load_state_dict(const std::string& state) override;

  // Path of the best entry by the monitored metric ("" before any; the newest save without a
  // monitor), and its score.
  const std::string& best_model_path() const { return best_model_path_; }
  double best_model_score() const { return best_model_score_; }
  // The worst of the kept top-k entries, and the newest save of any kind.
  const std::string& kth_best_model_path() const { return kth_best_model_path_; }
  const std::string& last_model_path() const { return last_model_path_; }
  // Kept top-k entries: path -> monitored score (NaN without a monitor).
  const std::map<std::string, double>& best_k_models() const { return best_k_models_; }
  const ModelCheckpointOptions& options() const { return options_; }

  // The entry name for these values ("epoch=1-step=8-val_loss=0.5000"); missing metrics are 0,
  // as Lightning's.
  std::string format_checkpoint_name(int64_t epoch, int64_t step,
                                     const std::map<std::string, double>& metrics) const;

 private:
  void save_epoch_based(Trainer& trainer);
  void save_now(Trainer& trainer);
  bool better(double a, double b) const;  // a strictly better than b in `mode`
  std::string unique_path(Trainer& trainer, const std::string& name) const;
  void update_best();

  ModelCheckpointOptions options_;
  int64_t every_n_epochs_ = 0;
  int64_t last_global_step_saved_ = -1;
  int64_t validated_epoch_ = -1;        // epoch of the last mid-epoch validation save
  std::map<std::string, double> best_k_models_;
  std::string best_model_path_;
  double best_model_score_ = 0;
  std::string kth_best_model_path_;
  std::string last_model_path_;
  std::string own_last_entry_;          // the separate "last-*" entry `last` points to, if any
  std::string last_link_;  // rank 0: this fit's `last` link, "last" or "last-<run>" ("" = not
                           // decided yet; Note [One last per run] in src/ckpt/run_records.h)
  std::vector<std::string> saved_no_monitor_;  // save_top_k == 1 without a monitor
};

}  // namespace fsdp
