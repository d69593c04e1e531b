// Wall-clock timing of one kernel-sized piece of work for the micro-benchmarks (attention,
// precision, optimizer): warm-up runs, then the minimum and the median of `reps` timed runs.
// The minimum is the headline on a shared machine (other processes only ever add time); the
// median shows how noisy the run was. A run that has spent `budget_s` stops early (after at
// least one timed run; warm-up is cut short the same way), so a very slow case (fp16 matmul
// on a CPU without fp16 kernels) reports one or two runs instead of taking minutes.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace fsdp::bench {

struct Timing {
  double min_ms = 0;
  double median_ms = 0;
  int runs = 0;  // timed runs done
};

inline Timing time_it(const std::function<void()>& fn, int warmup, int reps,
                      double budget_s = 1e9) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto spent_s = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  for (int i = 0; i < warmup && spent_s() < budget_s / 2; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps && (ms.empty() || spent_s() < budget_s); ++i) {
    const auto t0 = Clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2], static_cast<int>(ms.size())};
}

}  // namespace fsdp::bench
