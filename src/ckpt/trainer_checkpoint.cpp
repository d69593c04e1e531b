// The Trainer's checkpoint hooks: save_checkpoint, resuming fit from a checkpoint, and the
// callbacks of a fit (TrainerOptions::callbacks plus the checkpoint_dir sugar, a ModelCheckpoint
// in src/ckpt/model_checkpoint.cpp). Trainer members live in include/fsdp/trainer.h; fit_impl
// calls resume_from_checkpoint() and setup_callbacks() (src/train/trainer.cpp).
#include "fsdp/checkpoint.h"
#include "fsdp/trainer.h"

#include "ckpt/identity.h"
#include "ckpt/safetensors.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>

#include <unistd.h>

namespace fsdp {

namespace fs = std::filesystem;

namespace {
// The "callbacks" entry holding the 16-mixed ShardedGradScaler state (Lightning stores its
// precision plugin's state under the plugin's name, "MixedPrecision").
constexpr const char* kGradScalerStateKey = "MixedPrecision";

// Sets a member for the duration of one call.
struct ResumeGuard {
  std::string& slot;
  ResumeGuard(std::string& s, const std::string& path) : slot(s) {
    TORCH_CHECK(!path.empty(), "[Trainer.fit] ckpt_path is empty; pass the checkpoint to "
                "resume from (e.g. <checkpoint-dir>/last)");
    slot = path;
  }
  ~ResumeGuard() { slot.clear(); }
};
}  // namespace

void Trainer::fit(LightningModule& module, DataLoader& train_loader,
                  const std::string& ckpt_path) {
  ResumeGuard guard(resume_path_, ckpt_path);
  fit_impl(module, train_loader, nullptr);
}

void Trainer::fit(LightningModule& module, DataLoader& train_loader, DataLoader& val_loader,
                  const std::string& ckpt_path) {
  ResumeGuard guard(resume_path_, ckpt_path);
  fit_impl(module, train_loader, &val_loader);
}

void Trainer::save_checkpoint(const std::string& path) {
  TORCH_CHECK(fit_module_ != nullptr, "[Trainer.save_checkpoint] nothing to save yet: call it "
              "during or after fit()");
  TrainingProgress progress;
  progress.global_step = global_step_;
  progress.epoch = next_epoch_;
  progress.batch_in_epoch = next_batch_;
  progress.scheduler_steps = fit_opt_.scheduler ? global_step_ : 0;
  nlohmann::json states = nlohmann::json::object();
  for (const auto& cb : fit_callbacks_) {
    const std::string key = cb->state_key();
    if (key.empty()) continue;
    nlohmann::json st = nlohmann::json::parse(cb->state_dict(), nullptr, false);
    TORCH_CHECK(st.is_object(), "[Trainer.save_checkpoint] callback '", key, "' returned a "
                "state_dict() that is not a JSON object: ", cb->state_dict());
    states[key] = st;
  }
  // 16-mixed: the loss scale and its growth count, under the key Lightning uses for its
  // precision plugin's state, so a resumed run scales (and skips) exactly as the original.
  if (grad_scaler_) states[kGradScalerStateKey] = nlohmann::json::parse(grad_scaler_->state_dict());
  if (!states.empty()) progress.callback_states = states.dump();
  fsdp::save_checkpoint(path, *strategy_, *fit_module_, fit_opt_.optimizer.get(), progress,
                        parse_state_dict_type(options_.state_dict_type));
}

void Trainer::resume_from_checkpoint() {
  TrainingProgress p = load_checkpoint(resume_path_, *strategy_, *fit_module_,
                                       fit_opt_.optimizer.get(), fit_opt_.scheduler.get());
  global_step_ = p.global_step;
  next_epoch_ = p.epoch;
  next_batch_ = p.batch_in_epoch;
  // Callback states (fit_callbacks_ is set up before resuming).
  if (!p.callback_states.empty()) {
    nlohmann::json states = nlohmann::json::parse(p.callback_states, nullptr, false);
    if (states.is_object()) {
      for (const auto& cb : fit_callbacks_) {
        auto it = states.find(cb->state_key());
        if (!cb->state_key().empty() && it != states.end()) cb->load_state_dict(it->dump());
      }
      auto scaler = states.find(kGradScalerStateKey);
      if (grad_scaler_ && scaler != states.end()) grad_scaler_->load_state_dict(scaler->dump());
    }
  }
  print("[fsdp] resumed from " + resume_path_ + " at step " + std::to_string(global_step_) +
        ", epoch " + std::to_string(next_epoch_) + ", batch " + std::to_string(next_batch_));
}

void Trainer::setup_callbacks() {
  ckpt::current_run_id().clear();  // a fresh run unless it resumes (Note [Run identity])
  fit_callbacks_ = options_.callbacks;
  const TrainerOptions& o = options_;
  if (!o.checkpoint_dir.empty() && o.save_every_n_steps > 0) {
    // The checkpoint_dir sugar: <dir>/step-<k> every n steps, all kept, <dir>/last -> newest.
    ModelCheckpointOptions mc;
    mc.dirpath = o.checkpoint_dir;
    mc.filename = "step-{step}";
    mc.auto_insert_metric_name = false;
    mc.every_n_train_steps = o.save_every_n_steps;
    mc.every_n_epochs = 0;
    mc.save_top_k = -1;
    mc.save_last = true;
    fit_callbacks_.push_back(std::make_shared<ModelCheckpoint>(mc));
  }
  // Optimizer state streamed from disk is saved in the sharded format only (Note [Streamed
  // optimizer state]): say so before training rather than at the first save.
  if (strategy_->streamed_optimizer_state() &&
      parse_state_dict_type(o.state_dict_type) == StateDictType::kFull) {
    for (const auto& cb : fit_callbacks_) {
      TORCH_CHECK(!dynamic_cast<ModelCheckpoint*>(cb.get()), "[Trainer] this run's optimizer "
                  "state is on disk (", strategy_->name(), ", offload_optimizer_device nvme): "
                  "its checkpoints are saved in the sharded format only, and state_dict_type is "
                  "\"full\". HINT: state_dict_type \"sharded\" (fsdp-train --state-dict-type "
                  "sharded)");
    }
  }
}

}  // namespace fsdp
