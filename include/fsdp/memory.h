// Memory accounting: a tracking CPU allocator (the CPU analogue of
// torch.cuda.max_memory_allocated), peak RSS, and an optional memory budget.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

class ProcessGroup;

struct MemoryStats {
  int64_t current_bytes = 0;   // tensor bytes alive now (through the CPU allocator)
  int64_t peak_bytes = 0;      // max of current_bytes since start / last reset
  int64_t num_allocs = 0;      // allocations since start / last reset
  int64_t num_frees = 0;
  int64_t budget_bytes = 0;    // 0 = no budget
};

// Installs the tracking allocator with c10::SetCPUAllocator (idempotent). Called by
// init_process_group and the Trainer; call it yourself before allocating if you use neither.
// Reads FSDP_MEMORY_BUDGET (e.g. "12GiB", "800MB", "1073741824") on first install.
void install_tracking_allocator();
bool tracking_allocator_installed();

MemoryStats memory_stats();
void reset_peak_memory_stats();  // peak := current, counters := 0

int64_t current_rss_bytes();  // from /proc/self/statm
int64_t peak_rss_bytes();     // VmHWM from /proc/self/status
// Resets VmHWM to the current RSS (writes 5 to /proc/self/clear_refs); false when the kernel
// does not allow it. The Trainer calls it after setup so training peaks are not setup peaks.
bool reset_peak_rss();

// Allocations that would push current_bytes above the budget throw OutOfMemoryError and leave
// the process usable. 0 removes the budget.
void set_memory_budget(int64_t bytes);
int64_t memory_budget();
// MemAvailable (/proc/meminfo) divided by the ranks sharing this machine: the budget the Trainer
// sets when FSDP_MEMORY_BUDGET is unset, so a configuration that cannot fit is refused up front
// with its computed need instead of swapping the machine. FSDP_MEMORY_BUDGET=0 means no budget.
int64_t default_memory_budget(int local_ranks);

// Thrown by the tracking allocator when the budget would be exceeded, and by strategies that
// refuse a configuration up front ("DDP needs 31.2 GiB per rank, budget 12 GiB").
class OutOfMemoryError : public c10::Error {
 public:
  using c10::Error::Error;
};

// "12GiB", "1.5 GB", "800MB", "4096" -> bytes. Throws c10::Error naming the bad text.
int64_t parse_bytes(const std::string& text);
// 1536 -> "1.50 KiB"
std::string format_bytes(int64_t bytes);

// A readable table for this rank: peak allocated, current, allocation count, peak RSS, budget.
std::string memory_summary();
// Per-rank table gathered over `group` (collective: every rank calls it; rank 0 gets the table,
// others get an empty string).
std::string memory_summary(ProcessGroup& group);

// Per-rank peak tensor bytes and peak RSS gathered over `group` (collective), index = rank.
struct RankMemory {
  std::vector<int64_t> peak_bytes;
  std::vector<int64_t> peak_rss_bytes;
  std::vector<int64_t> current_bytes;
  std::vector<int64_t> current_rss_bytes;
};
RankMemory gather_memory(ProcessGroup& group);

}  // namespace fsdp
