// --summary-json; see apps/support/summary.h.
#include "summary.h"

#include <sys/resource.h>

#include <fstream>

namespace fsdp::app {

void CommBytesRecorder::on_fit_start(Trainer& t, LightningModule&) {
  last_ = t.strategy()->comm_bytes();
  last_step_ = t.global_step();
}

void CommBytesRecorder::on_train_batch_end(Trainer& t, LightningModule&, int64_t) {
  if (t.global_step() == last_step_) return;  // inside an accumulation window
  const int64_t n = t.strategy()->comm_bytes();
  per_step_.push_back(n - last_);
  last_ = n;
  last_step_ = t.global_step();
}

void StepCosts::on_train_batch_end(Trainer& trainer, LightningModule&, int64_t) {
  if (start_step_ < 0 && trainer.global_step() >= 1) {
    start_step_ = trainer.global_step();
    start_ = now();
  }
}

void StepCosts::on_train_end(Trainer& trainer, LightningModule&) {
  const int64_t steps = start_step_ < 0 ? 0 : trainer.global_step() - start_step_;
  const Usage end = now();
  const std::vector<int64_t> all = all_gather_values(
      *trainer.world(), {end.minor_faults - start_.minor_faults, end.user_us - start_.user_us,
                         end.sys_us - start_.sys_us});
  faults.clear(), user_seconds.clear(), sys_seconds.clear();
  if (steps <= 0) return;
  for (int r = 0; r < trainer.world_size(); ++r) {
    faults.push_back(all[3 * r] / static_cast<double>(steps));
    user_seconds.push_back(all[3 * r + 1] * 1e-6 / static_cast<double>(steps));
    sys_seconds.push_back(all[3 * r + 2] * 1e-6 / static_cast<double>(steps));
  }
}

StepCosts::Usage StepCosts::now() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  Usage s;
  s.minor_faults = u.ru_minflt;
  s.user_us = static_cast<int64_t>(u.ru_utime.tv_sec) * 1000000 + u.ru_utime.tv_usec;
  s.sys_us = static_cast<int64_t>(u.ru_stime.tv_sec) * 1000000 + u.ru_stime.tv_usec;
  return s;
}

RunRecorders add_run_recorders(TrainerOptions& options) {
  RunRecorders r{std::make_shared<CommBytesRecorder>(), std::make_shared<StepCosts>()};
  options.callbacks.push_back(r.comm_bytes);
  options.callbacks.push_back(r.step_costs);
  return r;
}

namespace {

std::vector<double> mib(const std::vector<int64_t>& bytes) {
  std::vector<double> out;
  for (int64_t b : bytes) out.push_back(b / 1048576.0);
  return out;
}

}  // namespace

nlohmann::json run_summary(const Trainer& trainer, const RunRecorders& recorders) {
  const FitResults& r = trainer.results();
  nlohmann::json j;
  j["strategy"] = trainer.strategy()->name();
  j["world_size"] = trainer.world_size();
  j["params"] = r.params;
  j["steps"] = r.steps;
  j["epochs"] = r.epochs;
  j["skipped_steps"] = r.skipped_steps;  // 16-mixed: steps the grad scaler skipped (inf/nan)
  j["seconds"] = r.seconds;
  j["it_per_s"] = r.it_per_s;
  j["it_per_s_note"] = "optimizer steps per second, first step (warm-up) excluded";
  j["step_end_seconds"] = r.step_end_seconds;  // rank 0: loop start to the end of each step
  j["forward_seconds"] = r.forward_seconds;    // rank 0, per step (FitResults)
  j["backward_seconds"] = r.backward_seconds;
  j["optimizer_seconds"] = r.optimizer_seconds;
  j["comm_seconds"] = r.comm_seconds;
  j["disk_wait_seconds"] = r.disk_wait_seconds;  // rank 0, per step: blocked on the disk tier
  j["peak_alloc_mb"] = mib(r.peak_alloc_bytes);  // during training (peaks reset after setup)
  j["peak_rss_mb"] = mib(r.peak_rss_bytes);
  j["setup_peak_alloc_mb"] = mib(r.setup_peak_alloc_bytes);
  j["setup_peak_rss_mb"] = mib(r.setup_peak_rss_bytes);
  // Per rank: the CUDA caching allocator's training peak (null on a rank without a GPU).
  auto device_mib = [](const std::vector<int64_t>& bytes) {
    nlohmann::json out = nlohmann::json::array();
    for (int64_t b : bytes) {
      out.push_back(b >= 0 ? nlohmann::json(b / 1048576.0) : nlohmann::json(nullptr));
    }
    return out;
  };
  j["device_peak_mb"] = device_mib(r.device_peak_bytes);
  j["device_peak_reserved_mb"] = device_mib(r.device_peak_reserved_bytes);
  // Where rank 0 trained, and over what.
  j["device"] = trainer.strategy()->device().str();
  j["backend"] = trainer.strategy()->world() ? trainer.strategy()->world()->backend() : "";
  // Per rank: the training peak by category (Note [Memory categories] in fsdp/memory.h).
  nlohmann::json breakdown = nlohmann::json::array();
  for (const auto& rank : r.peak_breakdown_bytes) {
    nlohmann::json m = nlohmann::json::object();
    for (const auto& [name, bytes] : rank) m[name] = bytes / 1048576.0;
    breakdown.push_back(m);
  }
  j["peak_breakdown_mb"] = breakdown;
  j["minor_faults_per_step"] = recorders.step_costs->faults;  // per rank, steps 2..n
  j["user_seconds_per_step"] = recorders.step_costs->user_seconds;
  j["sys_seconds_per_step"] = recorders.step_costs->sys_seconds;
  j["comm_bytes_per_step"] = recorders.comm_bytes->per_step();
  j["comm_bytes_note"] = "bytes rank 0 passed to collectives in each optimizer step, counted by "
                         "the process groups (gradients, model averaging, the loss all-reduce)";
  j["losses"] = r.losses;
  j["grad_norms"] = r.grad_norms;  // with gradient clipping: the norm before clipping, per step
  j["final_loss"] = r.losses.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.losses.back());
  j["metrics"] = r.metrics;
  j["log_dir"] = r.log_dir;
  return j;
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  TORCH_CHECK(f, "cannot write --summary-json '", path, "'");
  f << j.dump(2) << "\n";
  TORCH_CHECK(f, "cannot write --summary-json '", path, "' (write failed)");
}

}  // namespace fsdp::app
