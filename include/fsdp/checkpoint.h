// Checkpoints: full and sharded, loadable at any world size and under any strategy.
//
//   trainer.save_checkpoint("ckpt/step-100");                 // collective: every rank calls it
//   trainer.fit(model, loader, "ckpt/step-100");              // resume
//   fsdp::load_weights(plain_model, "ckpt/step-100");         // weights only, no Trainer
//
// Formats (no pickle: tensors in safetensors, metadata in JSON; DESIGN.md §3):
//
//   full     DIR/model.safetensors      standard safetensors, FQN keys, full shapes
//            DIR/optimizer.safetensors  "optim.<fqn>.<stat>" (exp_avg, exp_avg_sq, momentum_buffer)
//            DIR/meta.json              {"type": "full", world_size, strategy, progress, optimizer
//                                        kind/lrs/steps, RNG state}
//            Under FSDP the ranks all-gather one parameter (one optimizer tensor) at a time and
//            rank 0 streams it to disk: its peak stays within its shards plus the largest tensor.
//   sharded  DIR/shard-<r>-of-<W>.safetensors  every rank writes its own rows, in parallel
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
// mid-save leaves DIR (and any earlier checkpoint) as it was.
#pragma once

#include "fsdp/strategy.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
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
};

// Saves module parameters and buffers, optimizer state (Adam/AdamW exp_avg, exp_avg_sq, step,
// max_exp_avg_sq; SGD momentum), learning rates, progress and the CPU RNG state to `dir`.
// Collective over strategy.world(): every rank calls it. optimizer may be null (weights only).
void save_checkpoint(const std::string& dir, Strategy& strategy, torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const TrainingProgress& progress,
                     StateDictType type);

// Loads a checkpoint of either format into a module set up by `strategy` (resharding as
// needed), the optimizer state when optimizer is non-null, and restores the CPU RNG state.
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

}  // namespace fsdp
