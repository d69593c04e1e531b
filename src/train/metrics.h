// Metrics logged with LightningModule::log, as the Trainer aggregates them.
//
// Defaults follow Lightning: in training, on_step=true and on_epoch=false; in validation/test,
// on_step=false and on_epoch=true. A metric with both is reported as `<name>_step` and
// `<name>_epoch`. Epoch values are the mean over the epoch's micro-batches. sync_dist metrics are
// averaged over ranks: step metrics in the one per-step all-reduce that also carries the loss,
// epoch metrics in one all-reduce at epoch end. Every rank must log the same sync_dist names
// (collectives must match across ranks).
#pragma once

#include "fsdp/lightning.h"
#include "fsdp/strategy.h"

#include <map>
#include <string>

namespace fsdp::detail {

class MetricTracker {
 public:
  explicit MetricTracker(Strategy& strategy) : strategy_(strategy) {}

  void start_epoch();
  // Takes (and clears) the values logged during one micro-batch / evaluation batch.
  void collect_training(std::map<std::string, LightningModule::LoggedValue>& logged);
  void collect_eval(std::map<std::string, LightningModule::LoggedValue>& logged);

  // Collective: averages `local_loss` and the sync_dist step metrics over ranks (one
  // all-reduce) and returns the global mean loss.
  double finish_step(double local_loss);
  // Collective when any epoch metric is sync_dist. Returns the epoch values.
  std::map<std::string, double> finish_epoch();

  // Values of the last optimizer step (names already suffixed).
  const std::map<std::string, double>& step_values() const { return step_values_; }
  // What the progress bar shows: the prog_bar metrics (a name logged without sync_dist at world
  // > 1 gets " (rank 0)": it is rank 0's value) and the extra entries.
  std::map<std::string, double> progress_bar_values() const;
  // Whether a training metric (step or epoch) is logged with prog_bar.
  bool has_training_progress_bar_metric() const;
  // Latest value of everything reported (step and epoch).
  std::map<std::string, double> last_values() const;
  // Extra entries shown on the progress bar (e.g. the last validation metrics).
  void set_progress_bar_extra(const std::map<std::string, double>& values);

 private:
  struct Pending {
    double value = 0;
    LogOptions options;
  };
  struct EpochSum {
    double sum = 0;
    int64_t count = 0;
    LogOptions options;
  };
  void collect(std::map<std::string, LightningModule::LoggedValue>& logged, bool training);
  static std::string step_name(const std::string& n, const LogOptions& o);
  static std::string epoch_name(const std::string& n, const LogOptions& o);

  Strategy& strategy_;
  std::map<std::string, Pending> pending_step_;  // logged since the last optimizer step
  std::map<std::string, EpochSum> epoch_;
  std::map<std::string, double> step_values_;
  std::map<std::string, double> epoch_values_;
  std::map<std::string, bool> prog_bar_;    // reported name -> shown on the bar
  std::map<std::string, bool> rank0_only_;  // reported name -> rank 0's value at world > 1
  std::map<std::string, double> extra_;
};

}  // namespace fsdp::detail
