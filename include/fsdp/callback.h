// Trainer callbacks, as Lightning's `Callback`: objects given in TrainerOptions::callbacks whose
// hooks the Trainer calls at fixed points of fit(), on every rank, in the order given.
//
//   struct PrintLoss : fsdp::Callback {
//     void on_train_epoch_end(fsdp::Trainer& t, fsdp::LightningModule&) override {
//       t.print("epoch " + std::to_string(t.current_epoch()) + " done");
//     }
//   };
//   options.callbacks = {std::make_shared<PrintLoss>(),
//                        std::make_shared<fsdp::ModelCheckpoint>(ckpt_options)};
//
// Hooks run on every rank (a hook may call collectives, e.g. save a checkpoint, as long as every
// rank makes the same calls; Trainer::callback_metrics() is the same on every rank for metrics
// logged with sync_dist). Only the hooks ModelCheckpoint needs exist so far.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

class Trainer;
class LightningModule;

class Callback {
 public:
  virtual ~Callback() = default;
  // Once per fit(), after setup and resume, before the first batch.
  virtual void on_fit_start(Trainer& trainer, LightningModule& module) {}
  // After every training micro-batch (after its optimizer step when it ended an accumulation
  // window: trainer.global_step() then counts it), before any validation it triggers.
  virtual void on_train_batch_end(Trainer& trainer, LightningModule& module, int64_t batch_idx) {}
  // After a validation run (its metrics are in trainer.callback_metrics()).
  virtual void on_validation_end(Trainer& trainer, LightningModule& module) {}
  // After the last batch of an epoch and the epoch-end validation, with the epoch metrics.
  virtual void on_train_epoch_end(Trainer& trainer, LightningModule& module) {}
  // Once per fit(), after the last step.
  virtual void on_train_end(Trainer& trainer, LightningModule& module) {}

  // Callback state saved in checkpoints (Lightning's state_key / state_dict / load_state_dict):
  // a callback with a non-empty state_key has state_dict() (a JSON object as text) stored under
  // that key by Trainer::save_checkpoint, and given back to load_state_dict when a fit resumes
  // from that checkpoint (before on_fit_start), if a callback with the same key is present.
  virtual std::string state_key() const { return ""; }
  virtual std::string state_dict() const { return "{}"; }
  virtual void load_state_dict(const std::string& state) {}
};
using CallbackPtr = std::shared_ptr<Callback>;

}  // namespace fsdp
