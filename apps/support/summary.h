// --summary-json: what a run did, as one JSON object rank 0 writes after fit. The keys every
// program writes come from run_summary(); each program adds its own (model, precision, ...).
#pragma once

#include <fsdp/fsdp.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::app {

// Bytes this rank passed to collectives in each optimizer step, as counted by the process groups
// the strategy communicates on (Strategy::comm_bytes: DDP's gradient buckets and its comm hook's
// subgroups, the model averager, the Trainer's loss all-reduce).
class CommBytesRecorder : public Callback {
 public:
  void on_fit_start(Trainer& t, LightningModule&) override;
  void on_train_batch_end(Trainer& t, LightningModule&, int64_t) override;
  const std::vector<int64_t>& per_step() const { return per_step_; }

 private:
  int64_t last_ = 0;
  int64_t last_step_ = 0;
  std::vector<int64_t> per_step_;
};

// Where a step's CPU time goes besides the math: getrusage over the optimizer steps after the
// first (the ones it/s times), per rank. Minor page faults count memory the kernel had to map
// in (the block cache), sys seconds the time in the kernel. Collective at the end of training
// (every rank runs the callback).
class StepCosts : public Callback {
 public:
  void on_train_batch_end(Trainer& trainer, LightningModule&, int64_t) override;
  void on_train_end(Trainer& trainer, LightningModule&) override;
  // Per rank, per step; empty with fewer than two steps.
  std::vector<double> faults, user_seconds, sys_seconds;

 private:
  struct Usage {
    int64_t minor_faults = 0, user_us = 0, sys_us = 0;
  };
  static Usage now();
  int64_t start_step_ = -1;
  Usage start_;
};

// The callbacks run_summary reads, added to `options.callbacks`.
struct RunRecorders {
  std::shared_ptr<CommBytesRecorder> comm_bytes;
  std::shared_ptr<StepCosts> step_costs;
};
RunRecorders add_run_recorders(TrainerOptions& options);

// What every run summary holds: strategy, world_size, params, steps, epochs, skipped_steps,
// seconds, it_per_s, the parts of each step (rank 0), memory peaks per rank (MiB) with the
// training peak's breakdown, per-step costs and communicated bytes, losses, final_loss,
// metrics, log_dir. Call on every rank after fit; rank 0 writes it.
nlohmann::json run_summary(const Trainer& trainer, const RunRecorders& recorders);

// Writes `j` to `path` (indented). An unwritable path is an error naming it.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace fsdp::app
