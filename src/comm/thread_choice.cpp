// Threads per rank: the choice and the load it is made from. See comm/thread_choice.h.
#include "comm/thread_choice.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace fsdp::detail {

// Note [Threads per rank]
// ~~~~~~~~~~~~~~~~~~~~~~~
// libtorch gives a process one intra-op thread per core. An intra-op loop ends when its slowest
// thread does, so a thread that shares its core with other work (a compiler, another job, a
// sibling rank) makes every op wait for it: on a 2-core machine with one core busy, fsdp-train
// ran 3.3x slower with 2 threads than with 1 (docs/benchmarks/threads_cpu-epyc-2core_2026-11-28.md).
// So each rank gets
//
//   threads = clamp(round(cores - busy) / local_ranks, 1, cores / local_ranks)
//
// where `busy` is how many of this process's cores other work kept busy over a short window
// (comm/launcher_env.cpp reads /proc/stat twice). The free cores are rounded to the nearest
// whole core (a few percent of background noise does not cost a core) and then divided down
// (a thread too many costs far more than a thread too few). The launcher measures once, before
// it starts the ranks, so ranks starting up are not counted as load, and hands the count to
// them (FSDP_LAUNCH_THREADS); under an outside launcher each rank measures for itself while its
// siblings do the same (the window is a sleep, so they do not count each other). FSDP_NUM_THREADS
// is the user's choice and wins; no measurement is made then.

ThreadChoice choose_threads(const ThreadFacts& facts) {
  ThreadChoice choice;
  if (facts.user_threads) {
    choice.threads = *facts.user_threads;
    choice.from_user = true;
    return choice;
  }
  const int ranks = std::max(1, facts.local_ranks);
  const int cores = std::max(1, facts.cores);
  const int most = std::max(1, cores / ranks);
  int free_cores = cores;
  if (facts.busy_cores) {
    const double busy = std::clamp(*facts.busy_cores, 0.0, static_cast<double>(cores));
    free_cores = static_cast<int>(std::lround(cores - busy));
  }
  choice.threads = std::clamp(free_cores / ranks, 1, most);
  return choice;
}

std::string describe(const ThreadFacts& facts, const ThreadChoice& choice) {
  const int ranks = std::max(1, facts.local_ranks);
  const bool several = ranks > 1;
  // A single process says something only when it got fewer threads than its cores.
  if (!several && (choice.from_user || choice.threads >= facts.cores)) return "";
  std::ostringstream os;
  os << "[fsdp] " << ranks << (several ? " ranks" : " process") << " on " << facts.cores
     << (facts.cores == 1 ? " core" : " cores");
  if (facts.busy_cores && !choice.from_user) {
    char busy[32];
    std::snprintf(busy, sizeof(busy), "%.1f", std::max(0.0, *facts.busy_cores));
    os << ", " << busy << " busy with other work";
  }
  os << ": " << choice.threads << " intra-op thread" << (choice.threads == 1 ? "" : "s")
     << (several ? " per rank" : "")
     << (choice.from_user ? " (from FSDP_NUM_THREADS)" : " (set FSDP_NUM_THREADS to choose)");
  return os.str();
}

std::map<int, CpuTimes> parse_proc_stat(const std::string& text) {
  std::map<int, CpuTimes> cpus;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    // "cpuN user nice system idle iowait irq softirq steal guest guest_nice"; the aggregate
    // "cpu " line and everything else are skipped. guest time is already inside user.
    if (line.size() < 4 || line.compare(0, 3, "cpu") != 0 || !std::isdigit(static_cast<unsigned char>(line[3]))) continue;
    std::istringstream fields(line.substr(3));
    int index = -1;
    fields >> index;
    uint64_t v[8] = {};
    int n = 0;
    while (n < 8 && fields >> v[n]) ++n;
    if (index < 0 || n < 4) continue;
    CpuTimes t;
    for (int i = 0; i < n; ++i) t.total += v[i];
    const uint64_t idle = v[3] + (n > 4 ? v[4] : 0);  // idle + iowait
    t.busy = t.total - idle;
    cpus[index] = t;
  }
  return cpus;
}

std::optional<double> busy_cores_between(const std::map<int, CpuTimes>& before,
                                         const std::map<int, CpuTimes>& after,
                                         const std::vector<int>& cpus) {
  if (cpus.empty()) return std::nullopt;
  double busy = 0;
  for (int cpu : cpus) {
    auto b = before.find(cpu);
    auto a = after.find(cpu);
    if (b == before.end() || a == after.end()) return std::nullopt;
    if (a->second.total <= b->second.total || a->second.busy < b->second.busy) {
      return std::nullopt;
    }
    const double total = static_cast<double>(a->second.total - b->second.total);
    busy += std::min(1.0, static_cast<double>(a->second.busy - b->second.busy) / total);
  }
  return busy;
}

}  // namespace fsdp::detail
