// The Trainer's checkpoint hooks: save_checkpoint, periodic saves into a checkpoint directory
// (step-<k> entries plus `last`), and resuming fit from a checkpoint. Trainer members live in
// include/fsdp/trainer.h; fit_impl calls resume_from_checkpoint() and
// on_checkpoint_boundary() (src/train/trainer.cpp).
#include "fsdp/checkpoint.h"
#include "fsdp/trainer.h"

#include "ckpt/safetensors.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>

#include <unistd.h>

namespace fsdp {

namespace fs = std::filesystem;

namespace {
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
  fsdp::save_checkpoint(path, *strategy_, *fit_module_, fit_opt_.optimizer.get(), progress,
                        parse_state_dict_type(options_.state_dict_type));
}

void Trainer::resume_from_checkpoint() {
  TrainingProgress p = load_checkpoint(resume_path_, *strategy_, *fit_module_,
                                       fit_opt_.optimizer.get(), fit_opt_.scheduler.get());
  global_step_ = p.global_step;
  next_epoch_ = p.epoch;
  next_batch_ = p.batch_in_epoch;
  print("[fsdp] resumed from " + resume_path_ + " at step " + std::to_string(global_step_) +
        ", epoch " + std::to_string(next_epoch_) + ", batch " + std::to_string(next_batch_));
}

void Trainer::on_checkpoint_boundary() {
  const TrainerOptions& o = options_;
  if (o.checkpoint_dir.empty() || o.save_every_n_steps <= 0 ||
      global_step_ % o.save_every_n_steps != 0) {
    return;
  }
  const fs::path dir(o.checkpoint_dir);
  const std::string entry = "step-" + std::to_string(global_step_);
  if (is_global_zero()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    TORCH_CHECK(!ec, "[Trainer] cannot create checkpoint directory ", dir.string(), ": ",
                ec.message());
  }
  save_checkpoint((dir / entry).string());
  if (is_global_zero()) {
    // `last` is a relative symlink replaced atomically (symlink to a temporary name, rename).
    const fs::path tmp = dir / ("last.tmp." + std::to_string(::getpid()));
    std::error_code ec;
    fs::remove(tmp, ec);
    fs::create_directory_symlink(entry, tmp, ec);
    TORCH_CHECK(!ec, "[Trainer] cannot create symlink ", tmp.string(), ": ", ec.message());
    TORCH_CHECK(std::rename(tmp.c_str(), (dir / "last").c_str()) == 0, "[Trainer] cannot "
                "update ", (dir / "last").string());
    ckpt::fsync_dir(dir.string());
  }
}

}  // namespace fsdp
