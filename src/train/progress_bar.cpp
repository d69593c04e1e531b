#include "train/progress_bar.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <ostream>
#include <sstream>

namespace fsdp::detail {

ProgressBar::ProgressBar(std::ostream& out, bool is_terminal, int64_t total_steps,
                         int64_t log_every)
    : out_(out),
      terminal_(is_terminal),
      total_(total_steps),
      log_every_(log_every > 0 ? log_every : 1),
      start_(Clock::now()),
      last_draw_(start_) {}

bool ProgressBar::stdout_is_terminal(std::optional<bool> told) {
  if (told) return *told;
  return isatty(fileno(stdout)) == 1;
}

std::string ProgressBar::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%02lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

double ProgressBar::steps_per_second(int64_t step) const {
  auto now = Clock::now();
  if (first_step_ >= 0 && step > first_step_) {
    double dt = std::chrono::duration<double>(now - first_step_done_).count();
    return dt > 0 ? static_cast<double>(step - first_step_) / dt : 0.0;
  }
  double dt = std::chrono::duration<double>(now - start_).count();
  return dt > 0 && step > 0 ? static_cast<double>(step) / dt : 0.0;
}

std::string ProgressBar::render(int64_t step, int64_t epoch, double loss,
                                const std::map<std::string, double>& metrics) const {
  std::ostringstream os;
  os << "epoch " << epoch << " | ";
  if (total_ > 0) {
    os << step << "/" << total_;
    if (terminal_) {
      constexpr int kWidth = 20;
      int filled = static_cast<int>(kWidth * std::min<double>(1.0, double(step) / total_));
      os << " [" << std::string(filled, '=') << (filled < kWidth ? ">" : "")
         << std::string(std::max(0, kWidth - filled - 1), ' ') << "]";
    }
    os << " " << std::setw(3) << (100 * step / total_) << "%";
  } else {
    os << "step " << step;
  }
  double rate = steps_per_second(step);
  os << std::fixed << std::setprecision(2) << " | " << rate << " it/s";
  os << std::setprecision(4);
  if (std::isfinite(loss)) os << " | loss " << loss;
  for (const auto& [name, value] : metrics) os << " | " << name << " " << value;
  if (total_ > 0) {
    double eta = rate > 0 ? double(total_ - step) / rate : NAN;
    os << " | ETA " << format_duration(eta);
  }
  return os.str();
}

void ProgressBar::update(int64_t step, int64_t epoch, double loss,
                         const std::map<std::string, double>& metrics) {
  auto now = Clock::now();
  if (first_step_ < 0) {
    first_step_ = step;  // timing for it/s starts once the first step (warm-up) is done
    first_step_done_ = now;
  }
  const bool last = total_ > 0 && step >= total_;
  if (terminal_) {
    if (!last && drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    std::string line = render(step, epoch, loss, metrics);
    size_t pad = last_width_ > line.size() ? last_width_ - line.size() : 0;
    out_ << "\r" << line << std::string(pad, ' ') << std::flush;
    last_width_ = line.size();
  } else {
    if (!last && step % log_every_ != 0 && step != 1) return;
    out_ << render(step, epoch, loss, metrics) << "\n" << std::flush;
  }
  drawn_ = true;
  last_draw_ = now;
}

void ProgressBar::finish() {
  if (terminal_ && drawn_) out_ << "\n" << std::flush;
  drawn_ = false;
  last_width_ = 0;
}

}  // namespace fsdp::detail
