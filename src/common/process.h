// Which process wrote an owner record, and whether it still runs: host name, pid and the pid's
// start time (a pid reused by a later process is not mistaken for the writer). Used by the
// checkpoint directory's owner record and the staging marker (src/ckpt/run_records.h) and the
// disk tier's owner lock (src/offload/swap_owner.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

// gethostname(2), "unknown" when it fails.
std::string host_name();
// Now, UTC, as "2026-11-27T22:10:00Z".
std::string utc_now();

struct ProcessId {
  std::string host;
  std::string boot;   // /proc/sys/kernel/random/boot_id ("" where unknown)
  int64_t pid = 0;
  int64_t start = 0;  // the process's start time in clock ticks since boot (/proc/<pid>/stat)
};

// This process.
ProcessId this_process();
// True when `p` is this process, or a process of this host (and boot) that has ended; false for
// a process that runs, and for one of another host, whose state cannot be seen from here.
bool ended_or_this(const ProcessId& p);

}  // namespace fsdp::detail
