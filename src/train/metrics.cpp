#include "train/metrics.h"

#include <vector>

namespace fsdp::detail {

void MetricTracker::start_epoch() {
  epoch_.clear();
  pending_step_.clear();
}

std::string MetricTracker::step_name(const std::string& n, const LogOptions& o) {
  return o.on_epoch.value_or(false) ? n + "_step" : n;
}

std::string MetricTracker::epoch_name(const std::string& n, const LogOptions& o) {
  return o.on_step.value_or(false) ? n + "_epoch" : n;
}

void MetricTracker::collect(std::map<std::string, LightningModule::LoggedValue>& logged,
                            bool training) {
  for (auto& [name, lv] : logged) {
    LogOptions o = lv.options;
    if (!o.on_step) o.on_step = training;
    if (!o.on_epoch) o.on_epoch = !training;
    const double v = lv.value.item<double>();
    if (*o.on_step && training) pending_step_[name] = Pending{v, o};
    if (*o.on_epoch) {
      EpochSum& e = epoch_[name];
      e.sum += v;
      e.count += 1;
      e.options = o;
    }
  }
  logged.clear();
}

void MetricTracker::collect_training(std::map<std::string, LightningModule::LoggedValue>& l) {
  collect(l, /*training=*/true);
}

void MetricTracker::collect_eval(std::map<std::string, LightningModule::LoggedValue>& l) {
  collect(l, /*training=*/false);
}

double MetricTracker::finish_step(double local_loss) {
  // Pack [loss, sync_dist step metrics...] so that one all-reduce serves them all.
  std::vector<double> packed{local_loss};
  std::vector<std::string> synced;
  for (const auto& [name, p] : pending_step_) {
    if (p.options.sync_dist) {
      packed.push_back(p.value);
      synced.push_back(name);
    }
  }
  std::vector<double> reduced = packed;
  if (strategy_.world_size() > 1) {
    at::Tensor t = at::tensor(packed, at::kDouble).to(at::kFloat);
    t = strategy_.reduce(t, ReduceOp::kAvg).to(at::kDouble).contiguous();
    const double* d = t.data_ptr<double>();
    reduced.assign(d, d + t.numel());
  }
  step_values_.clear();
  size_t j = 1;
  for (const auto& [name, p] : pending_step_) {
    const double v = p.options.sync_dist ? reduced[j++] : p.value;
    const std::string n = step_name(name, p.options);
    step_values_[n] = v;
    prog_bar_[n] = p.options.prog_bar;
    rank0_only_[n] = !p.options.sync_dist && strategy_.world_size() > 1;
  }
  pending_step_.clear();
  return reduced[0];
}

std::map<std::string, double> MetricTracker::finish_epoch() {
  std::vector<double> synced;
  for (const auto& [name, e] : epoch_) {
    if (e.options.sync_dist) synced.push_back(e.sum / e.count);
  }
  if (!synced.empty() && strategy_.world_size() > 1) {
    at::Tensor t = at::tensor(synced, at::kDouble).to(at::kFloat);
    t = strategy_.reduce(t, ReduceOp::kAvg).to(at::kDouble).contiguous();
    const double* d = t.data_ptr<double>();
    synced.assign(d, d + t.numel());
  }
  std::map<std::string, double> out;
  size_t j = 0;
  for (const auto& [name, e] : epoch_) {
    const double v = e.options.sync_dist ? synced[j++] : e.sum / e.count;
    const std::string n = epoch_name(name, e.options);
    out[n] = v;
    prog_bar_[n] = e.options.prog_bar;
    rank0_only_[n] = !e.options.sync_dist && strategy_.world_size() > 1;
  }
  epoch_values_ = out;
  epoch_.clear();
  return out;
}

std::map<std::string, double> MetricTracker::progress_bar_values() const {
  std::map<std::string, double> out;
  auto add = [&](const std::map<std::string, double>& values) {
    for (const auto& [n, v] : values) {
      auto it = prog_bar_.find(n);
      if (it == prog_bar_.end() || !it->second) continue;
      auto r0 = rank0_only_.find(n);
      out[r0 != rank0_only_.end() && r0->second ? n + " (rank 0)" : n] = v;
    }
  };
  add(epoch_values_);
  add(step_values_);
  for (const auto& kv : extra_) out[kv.first] = kv.second;
  return out;
}

bool MetricTracker::has_training_progress_bar_metric() const {
  for (const auto* values : {&epoch_values_, &step_values_}) {
    for (const auto& [n, v] : *values) {
      auto it = prog_bar_.find(n);
      if (it != prog_bar_.end() && it->second) return true;
    }
  }
  return false;
}

std::map<std::string, double> MetricTracker::last_values() const {
  std::map<std::string, double> out = epoch_values_;
  for (const auto& kv : step_values_) out[kv.first] = kv.second;
  return out;
}

void MetricTracker::set_progress_bar_extra(const std::map<std::string, double>& values) {
  extra_ = values;
}

}  // namespace fsdp::detail
