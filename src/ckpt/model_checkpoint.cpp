// ModelCheckpoint: when to save, what to keep (top-k by a monitored metric), `last`.
// See the comment above ModelCheckpointOptions in include/fsdp/checkpoint.h.
#include "fsdp/checkpoint.h"
#include "fsdp/trainer.h"

#include "ckpt/identity.h"
#include "ckpt/run_records.h"
#include "ckpt/safetensors.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>

#include <unistd.h>

namespace fsdp {

namespace fs = std::filesystem;

namespace {

std::string sanitize(std::string s) {
  for (char& c : s) {
    if (c == '/') c = '_';
  }
  return s;
}

// Points dir/link at `target` (a name inside dir) atomically: a symlink under a temporary name,
// renamed over the old one. A `last` that is a real directory (written by an older version) is
// moved away first.
void point_symlink(const fs::path& dir, const std::string& link, const std::string& target) {
  const fs::path dst = dir / link;
  std::error_code ec;
  // Only a link is replaced: a real file or directory under that name is not this callback's
  // (Note [Writers never destroy] in src/ckpt/output.h).
  const fs::file_status st = fs::symlink_status(dst, ec);
  TORCH_CHECK(!fs::exists(st) || fs::is_symlink(st), "[ModelCheckpoint] ", dst.string(),
              " is a ", fs::is_directory(st) ? "directory" : "file",
              ", not the link this callback keeps pointing at the newest checkpoint; move it "
              "away (it is never removed) and save again");
  const fs::path tmp = dir / ("." + link + ".tmp." + std::to_string(::getpid()));
  fs::remove(tmp, ec);
  fs::create_directory_symlink(target, tmp, ec);
  TORCH_CHECK(!ec, "[ModelCheckpoint] cannot create symlink ", tmp.string(), ": ", ec.message(),
              "; check that ", dir.string(), " is writable");
  TORCH_CHECK(std::rename(tmp.c_str(), dst.c_str()) == 0, "[ModelCheckpoint] cannot update ",
              dst.string(), ": ", std::strerror(errno));
  ckpt::fsync_dir(dir.string());
}

// Deletes a published entry: renamed to a hidden name first (one atomic step: the entry is
// either complete under its name or gone), then removed.
void delete_entry(const std::string& path) {
  const fs::path p(path);
  const fs::path hidden = p.parent_path() / ("." + p.filename().string() + ".deleting");
  std::error_code ec;
  fs::remove_all(hidden, ec);
  fs::rename(p, hidden, ec);
  if (ec) return;  // already gone
  ckpt::fsync_dir(p.parent_path().string());
  fs::remove_all(hidden, ec);
}

}  // namespace

ModelCheckpoint::ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(!o.dirpath.empty(), "[ModelCheckpoint] dirpath is empty; set "
              "ModelCheckpointOptions::dirpath (fsdp-train: --checkpoint-dir)");
  TORCH_CHECK(o.mode == "min" || o.mode == "max", "[ModelCheckpoint] mode '", o.mode,
              "' is not valid; use 'min' (lower is better, e.g. a loss) or 'max'");
  TORCH_CHECK(o.save_top_k >= -1, "[ModelCheckpoint] save_top_k = ", o.save_top_k,
              " is not valid; use -1 (keep all), 0 (none) or k > 0 (the best k)");
  TORCH_CHECK(!o.monitor.empty() || o.save_top_k == -1 || o.save_top_k == 0 ||
                  o.save_top_k == 1,
              "[ModelCheckpoint] save_top_k = ", o.save_top_k, " without a monitor is not a "
              "valid configuration: there is no quantity to rank checkpoints by. Set monitor "
              "(fsdp-train: --monitor NAME) or use save_top_k -1 / 1");
  TORCH_CHECK(o.every_n_train_steps >= 0, "[ModelCheckpoint] every_n_train_steps must be >= 0, "
              "got ", o.every_n_train_steps);
  TORCH_CHECK(o.every_n_epochs >= -1, "[ModelCheckpoint] every_n_epochs must be >= 0 (or -1 "
              "for the default), got ", o.every_n_epochs);
  every_n_epochs_ = o.every_n_epochs >= 0 ? o.every_n_epochs
                                          : (o.every_n_train_steps > 0 ? 0 : 1);
  best_model_score_ = std::numeric_limits<double>::quiet_NaN();
}

bool ModelCheckpoint::better(double a, double b) const {
  return options_.mode == "min" ? a < b : a > b;
}

std::string ModelCheckpoint::format_checkpoint_name(
    int64_t epoch, int64_t step, const std::map<std::string, double>& metrics) const {
  const std::string tmpl = options_.filename.empty() ? "{epoch}-{step}" : options_.filename;
  std::string out;
  size_t i = 0;
  while (i < tmpl.size()) {
    if (tmpl[i] != '{') {
      out.push_back(tmpl[i++]);
      continue;
    }
    const size_t close = tmpl.find('}', i);
    TORCH_CHECK(close != std::string::npos, "[ModelCheckpoint] filename '", tmpl,
                "' has an unclosed '{'");
    std::string field = tmpl.substr(i + 1, close - i - 1);
    std::string spec;
    if (auto colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    TORCH_CHECK(!field.empty(), "[ModelCheckpoint] filename '", tmpl, "' has an empty {}");
    char buf[64];
    if (field == "epoch" || field == "step") {
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(field == "epoch" ? epoch
                                                                                    : step));
    } else {
      auto it = metrics.find(field);
      const double v = it == metrics.end() ? 0.0 : it->second;
      if (spec.empty()) spec = ".4f";
      TORCH_CHECK(spec.find_first_not_of("0123456789.-+ #") == spec.size() - 1 &&
                      std::string("eEfFgG").find(spec.back()) != std::string::npos,
                  "[ModelCheckpoint] format '", spec, "' for '", field, "' in filename '", tmpl,
                  "' is not a floating-point format such as .3f or .4g");
      std::snprintf(buf, sizeof buf, ("%" + spec).c_str(), v);
    }
    if (options_.auto_insert_metric_name) out += sanitize(field) + "=";
    out += buf;
    i = close + 1;
  }
  return sanitize(out);
}

// A name not used yet in dirpath (Lightning appends -v1, -v2, ... on a collision). Rank 0
// looks at the directory and broadcasts the version, so every rank saves to the same path.
// A name whose .partial this run left (Note [Interrupted saves] in src/ckpt/run_records.h) is
// free: the save removes and reuses it.
std::string ModelCheckpoint::unique_path(Trainer& trainer, const std::string& name) const {
  const fs::path dir(options_.dirpath);
  int64_t version = 0;
  if (trainer.is_global_zero()) {
    std::error_code ec;
    const std::string& run = ckpt::current_or_new_run_id();
    auto taken = [&](const std::string& n) {
      const fs::path partial = dir / (n + ".partial");
      return fs::exists(fs::symlink_status(dir / n, ec)) ||
             (fs::exists(fs::symlink_status(partial, ec)) &&
              !ckpt::partial_reusable(partial, run, n));
    };
    while (taken(version == 0 ? name : name + "-v" + std::to_string(version))) ++version;
  }
  if (trainer.world_size() > 1) {
    at::Tensor v = at::tensor({version}, at::kLong);
    broadcast_host(*trainer.world(), v, 0);
    version = v.item<int64_t>();
  }
  return (dir / (version == 0 ? name : name + "-v" + std::to_string(version))).string();
}

void ModelCheckpoint::on_fit_start(Trainer& trainer, LightningModule&) {
  // A resumed fit does not save the step it resumed from again.
  last_global_step_saved_ = trainer.global_step();
  validated_epoch_ = -1;
  last_link_.clear();  // claimed at this fit's first save (Note [One last per run])
  if (trainer.is_global_zero()) {
    std::error_code ec;
    fs::create_directories(options_.dirpath, ec);
    TORCH_CHECK(!ec, "[ModelCheckpoint] cannot create dirpath ", options_.dirpath, ": ",
                ec.message());
  }
}

void ModelCheckpoint::on_train_batch_end(Trainer& trainer, LightningModule&, int64_t) {
  const int64_t n = options_.every_n_train_steps;
  if (n <= 0 || trainer.global_step() % n != 0) return;
  save_now(trainer);  // skips a step already saved (micro-batches inside one step)
}

void ModelCheckpoint::on_validation_end(Trainer& trainer, LightningModule&) {
  // Epoch-end validation is followed by on_train_epoch_end, which saves; validation inside an
  // epoch (val_check_interval > 0) saves here, as Lightning's ModelCheckpoint does.
  if (trainer.options().val_check_interval <= 0) return;
  validated_epoch_ = trainer.current_epoch();
  save_epoch_based(trainer);
}

void ModelCheckpoint::on_train_epoch_end(Trainer& trainer, LightningModule&) {
  if (validated_epoch_ == trainer.current_epoch()) return;
  save_epoch_based(trainer);
}

void ModelCheckpoint::save_epoch_based(Trainer& trainer) {
  if (every_n_epochs_ <= 0 || (trainer.current_epoch() + 1) % every_n_epochs_ != 0) return;
  save_now(trainer);
}

void ModelCheckpoint::update_best() {
  best_model_path_.clear();
  kth_best_model_path_.clear();
  best_model_score_ = std::numeric_limits<double>::quiet_NaN();
  if (options_.monitor.empty()) return;
  double worst = 0;
  for (const auto& [path, score] : best_k_models_) {
    if (best_model_path_.empty() || better(score, best_model_score_)) {
      best_model_path_ = path;
      best_model_score_ = score;
    }
    if (kth_best_model_path_.empty() || better(worst, score)) {
      kth_best_model_path_ = path;
      worst = score;
    }
  }
}

// Note [ModelCheckpoint is collective]
// Every rank runs the same decisions on the same inputs (global step, epoch, and the monitored
// value broadcast from rank 0), so every rank calls Trainer::save_checkpoint for the same
// entries. Only rank 0 touches the directory (symlinks, deletions).
void ModelCheckpoint::save_now(Trainer& trainer) {
  const auto& o = options_;
  const int64_t step = trainer.global_step();
  if (step == last_global_step_saved_) return;
  last_global_step_saved_ = step;
  const bool zero = trainer.is_global_zero();
  const std::map<std::string, double>& metrics = trainer.callback_metrics();

  // The monitored value, identical on every rank.
  bool have = false;
  double current = 0;
  if (!o.monitor.empty()) {
    auto it = metrics.find(o.monitor);
    at::Tensor v = at::tensor({it != metrics.end() ? 1.0 : 0.0,
                               it != metrics.end() ? it->second : 0.0}, at::kDouble);
    if (trainer.world_size() > 1) broadcast_host(*trainer.world(), v, 0);
    have = v[0].item<double>() != 0;
    current = v[1].item<double>();
    if (!have) {
      std::string names;
      for (const auto& kv : metrics) names += (names.empty() ? "" : ", ") + kv.first;
      TORCH_CHECK(!o.monitor.empty() && o.monitor.rfind("val", 0) == 0 &&
                      o.every_n_train_steps > 0,
                  "[ModelCheckpoint] monitor '", o.monitor, "' is not among the logged metrics "
                  "at step ", step, " (", names.empty() ? std::string("none") : names,
                  "). HINT: log it in the LightningModule (log(\"", o.monitor, "\", value, "
                  "{.sync_dist = true})) or monitor one of those names");
      if (zero) {
        std::cerr << "[ModelCheckpoint] step " << step << ": monitor '" << o.monitor
                  << "' not logged yet (validation has not run); top-k skipped for this save\n";
      }
    }
    if (have && std::isnan(current)) {
      current = o.mode == "min" ? std::numeric_limits<double>::infinity()
                                : -std::numeric_limits<double>::infinity();
    }
  }

  auto metrics_for_name = metrics;
  if (have) metrics_for_name[o.monitor] = current;
  const std::string name = format_checkpoint_name(trainer.current_epoch(), step,
                                                  metrics_for_name);
  // Decide first and update the state, so that the checkpoint written below holds the state
  // that includes itself (it is what a fit resuming from it continues with).
  std::string saved;                 // top-k entry written at this step
  std::string own_last;              // separate `last` entry written at this step
  std::vector<std::string> evicted;  // deleted after `last` moved

  if (o.save_top_k != 0) {
    if (o.monitor.empty()) {
      saved = unique_path(trainer, name);
      if (o.save_top_k == 1) {
        evicted = saved_no_monitor_;
        saved_no_monitor_ = {saved};
      } else {
        saved_no_monitor_.push_back(saved);
      }
      best_model_path_ = saved;
    } else if (have) {
      const bool room = o.save_top_k == -1 ||
                        static_cast<int64_t>(best_k_models_.size()) < o.save_top_k;
      if (room || better(current, best_k_models_.at(kth_best_model_path_))) {
        saved = unique_path(trainer, name);
        best_k_models_[saved] = current;
        if (o.save_top_k > 0 && static_cast<int64_t>(best_k_models_.size()) > o.save_top_k) {
          evicted.push_back(kth_best_model_path_);
          best_k_models_.erase(kth_best_model_path_);
        }
        update_best();
      }
    }
  }
  if (o.save_last) {
    const std::string old_own = own_last_entry_;
    if (saved.empty()) {
      own_last = unique_path(trainer, "last-" + name);
      own_last_entry_ = own_last;
    } else {
      own_last_entry_.clear();
    }
    if (!old_own.empty()) evicted.push_back(old_own);
  }
  if (!saved.empty() || !own_last.empty()) last_model_path_ = saved.empty() ? own_last : saved;

  if (!saved.empty()) trainer.save_checkpoint(saved);
  if (!own_last.empty()) trainer.save_checkpoint(own_last);
  if (zero && o.save_last && !last_model_path_.empty() && (!saved.empty() || !own_last.empty())) {
    if (last_link_.empty()) {  // See Note [One last per run] in src/ckpt/run_records.h.
      ckpt::LastLink link = ckpt::claim_last(o.dirpath, ckpt::current_or_new_run_id());
      if (!link.warning.empty()) std::cerr << link.warning << "\n";
      last_link_ = link.name;
    }
    point_symlink(o.dirpath, last_link_, fs::path(last_model_path_).filename().string());
  }
  if (zero) {
    for (const auto& path : evicted) delete_entry(path);
  }
}

// Lightning's key: the options that define what the callback tracks.
std::string ModelCheckpoint::state_key() const {
  return "ModelCheckpoint{monitor=" + options_.monitor + ", mode=" + options_.mode +
         ", every_n_train_steps=" + std::to_string(options_.every_n_train_steps) +
         ", every_n_epochs=" + std::to_string(every_n_epochs_) + "}";
}

std::string ModelCheckpoint::state_dict() const {
  nlohmann::json best_k = nlohmann::json::object();
  for (const auto& [path, score] : best_k_models_) best_k[path] = score;
  nlohmann::json st = {{"dirpath", fs::path(options_.dirpath).lexically_normal().string()},
                       {"best_model_path", best_model_path_},
                       {"last_model_path", last_model_path_},
                       {"own_last_entry", own_last_entry_},
                       {"saved_no_monitor", saved_no_monitor_},
                       {"best_k_models", best_k}};
  return st.dump();
}

void ModelCheckpoint::load_state_dict(const std::string& state) {
  nlohmann::json st = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  if (!st.is_object()) return;
  auto str = [&](const char* key) {
    auto it = st.find(key);
    return it != st.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  // Another dirpath: the entries are not ours to manage (Lightning does the same).
  if (str("dirpath") != fs::path(options_.dirpath).lexically_normal().string()) return;
  std::error_code ec;
  auto present = [&](const std::string& p) { return !p.empty() && fs::exists(p, ec); };
  best_k_models_.clear();
  if (auto it = st.find("best_k_models"); it != st.end() && it->is_object()) {
    for (auto e = it->begin(); e != it->end(); ++e) {
      if (e.value().is_number() && present(e.key())) best_k_models_[e.key()] = e.value();
    }
  }
  saved_no_monitor_.clear();
  if (auto it = st.find("saved_no_monitor"); it != st.end() && it->is_array()) {
    for (const auto& p : *it) {
      if (p.is_string() && present(p.get<std::string>())) saved_no_monitor_.push_back(p);
    }
  }
  own_last_entry_ = present(str("own_last_entry")) ? str("own_last_entry") : "";
  last_model_path_ = present(str("last_model_path")) ? str("last_model_path") : "";
  update_best();
  if (options_.monitor.empty() && present(str("best_model_path"))) {
    best_model_path_ = str("best_model_path");
  }
}

}  // namespace fsdp
