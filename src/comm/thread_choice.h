// How many intra-op threads each rank gets (Note [Threads per rank] in thread_choice.cpp).
// The choice is a pure function of the facts, so it is testable without a busy machine; the
// facts of this process (its cores, the load on them) are measured in comm/launcher_env.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

struct ThreadFacts {
  int cores = 1;        // CPUs this process may run on (its affinity)
  int local_ranks = 1;  // ranks of the job sharing them
  // Of those cores, how many other work kept busy just before the ranks started (a fraction:
  // 1.6 = one and a half cores busy); nullopt when it could not be measured.
  std::optional<double> busy_cores;
  std::optional<int> user_threads;  // FSDP_NUM_THREADS
};

struct ThreadChoice {
  int threads = 1;         // intra-op threads per rank
  bool from_user = false;  // FSDP_NUM_THREADS decided
};

ThreadChoice choose_threads(const ThreadFacts& facts);

// The line a job prints once about the choice, "[fsdp] 2 ranks on 2 cores, 1.6 busy with other
// work: 1 intra-op thread per rank (set FSDP_NUM_THREADS to choose)"; "" when there is nothing
// worth saying (a single process given every core it may use, or the thread count it asked for).
std::string describe(const ThreadFacts& facts, const ThreadChoice& choice);

// --- measuring the load -----------------------------------------------------------------------

// Jiffies a CPU spent working and in all, from one line of /proc/stat.
struct CpuTimes {
  uint64_t busy = 0;
  uint64_t total = 0;
};

// The per-CPU lines ("cpu3 ...") of /proc/stat, by CPU index.
std::map<int, CpuTimes> parse_proc_stat(const std::string& text);

// Cores busy between two snapshots, summed over `cpus` (each CPU counts its busy share of the
// interval); nullopt when a snapshot lacks one of them or no time passed on it.
std::optional<double> busy_cores_between(const std::map<int, CpuTimes>& before,
                                         const std::map<int, CpuTimes>& after,
                                         const std::vector<int>& cpus);

}  // namespace fsdp::detail
