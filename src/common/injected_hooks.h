// Injected hooks: failure injection for tests and collectives for benchmarks, installed by the
// program that needs them. See Note [Injected hooks].
#pragma once

#include <cstdint>
#include <functional>

namespace fsdp::detail {

// Note [Injected hooks]
// ~~~~~~~~~~~~~~~~~~~~~
// A crash-safety test needs a rank to die in the middle of writing a checkpoint, and `fsdp-bench
// overlap` needs FSDP's collectives to move no data (or to be waited for at once). Neither may be
// reachable by a user: a variable left set in a shell would make training exit or compute wrong
// values. So they are hooks in this internal header (not installed with the library), which
// only a test binary or fsdp-bench installs, from code, before training starts -- typically
// from a command-line flag of its own, which the ranks it launches inherit with the rest of
// its argv. The library never reads them from the environment or a file, and with nothing
// installed every hook is a no-op.
//
// Install before any rank trains: the hooks are read without synchronization.

// How FSDP's all-gathers and reduce-scatters run. See Note [Benchmark collectives] in
// src/shard/collectives.cpp.
enum class BenchCollectives {
  kReal,    // the real asynchronous collectives (always, unless fsdp-bench says otherwise)
  kLocal,   // no communication: each rank's output is made from its own input (wrong values)
  kSerial,  // the real collectives, each waited for as soon as it is issued
};

struct InjectedHooks {
  // Called by every rank after it wrote the first tensor of a checkpoint save, before the
  // checkpoint is published: (rank, the step being saved). A test ends the process here.
  std::function<void(int rank, int64_t step)> during_checkpoint_save;
  BenchCollectives collectives = BenchCollectives::kReal;
};

// Replaces the installed hooks (tests and fsdp-bench only; see the Note).
void install_injected_hooks(InjectedHooks hooks);
// The installed hooks (all no-ops unless a test or fsdp-bench installed some).
const InjectedHooks& injected_hooks();

}  // namespace fsdp::detail
