// Progress bar for the training loop (global rank 0 only; the Trainer decides who owns one).
//
// On a terminal it redraws one line in place (at most 10 times a second and on the last step):
//   epoch 0 | 37/100 [=======>           ]  37% | 12.3 it/s | loss 2.345 | ETA 00:05
// One loss column: the Trainer passes its loss (the mean over ranks) only when the module shows
// no training metric of its own (Trainer::FitLoop::draw_progress in src/train/trainer.cpp).
// When stdout is not a terminal (CI logs, pipes), it prints one plain line every
// `log_every` steps and on the last step instead, so logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>

namespace fsdp::detail {

class ProgressBar {
 public:
  // total_steps < 0: unknown (no percentage, no ETA).
  ProgressBar(std::ostream& out, bool is_terminal, int64_t total_steps, int64_t log_every);

  // `step` optimizer steps are done; metrics are shown in map order after the loss.
  void update(int64_t step, int64_t epoch, double loss,
              const std::map<std::string, double>& metrics);
  // Ends the in-place line (terminal) so later output starts on a fresh line.
  void finish();

  // Steps per second after the first step (its time is warm-up: allocation, first
  // collectives), or over all steps when only one step ran.
  double steps_per_second(int64_t step) const;

  // Whether stdout redraws a line: `told` (FSDP_STDOUT_IS_TERMINAL, which the launcher sets
  // before it re-executes through mpirun, whose children see a pseudo-terminal whatever the
  // user's stdout is) when set, else isatty(stdout).
  static bool stdout_is_terminal(std::optional<bool> told);
  static std::string format_duration(double seconds);  // "00:05", "1:02:03"

 private:
  std::string render(int64_t step, int64_t epoch, double loss,
                     const std::map<std::string, double>& metrics) const;

  using Clock = std::chrono::steady_clock;
  std::ostream& out_;
  bool terminal_;
  int64_t total_;
  int64_t log_every_;
  Clock::time_point start_;
  Clock::time_point first_step_done_;
  Clock::time_point last_draw_;
  int64_t first_step_ = -1;  // the step number when timing (after warm-up) started
  bool drawn_ = false;
  size_t last_width_ = 0;
};

}  // namespace fsdp::detail
