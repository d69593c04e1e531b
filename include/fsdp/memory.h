// Memory accounting: a tracking CPU allocator (the CPU analogue of
// torch.cuda.max_memory_allocated), peak RSS, and an optional memory budget.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp {

class ProcessGroup;

// Note [Memory categories]
// ------------------------
// Where do the peak's bytes go? Every allocation through the tracking allocator is charged to
// the calling thread's current category (a thread-local, set by MemoryCategoryGuard around the
// code that allocates), recorded in the block's header so that its free is charged back to the
// same category. Per-category current bytes are kept beside the total, and each time the total
// reaches a new peak the per-category bytes are copied: memory_stats().peak_by_category is the
// breakdown of the peak at the moment it happened (the copy is skipped when another thread is
// copying at that instant, so under concurrent allocation it may describe a moment a few
// allocations away from the exact peak). The categories say who allocated, not what a tensor
// is: a category is set by
//   kParameters   the Trainer around setup (configure_model, sharding, optimizer creation):
//                 model parameters and their FSDP shards (trainable and frozen, fp or not)
//   kQuantized    NF4 packed weights and quantization state (Linear4bit, FSDP shards of uint8
//                 parameters)
//   kGathered     FSDP all-gather buffers and unsharded parameters (unshard, copy-out)
//   kActivations  the Trainer around training_step (forward: activations, logits, loss)
//   kDequantized  Linear4bit's dequantized weights (forward, recomputation and backward)
//   kBackward     the Trainer around backward: activation gradients, recomputed activations
//                 (activation checkpointing), parameter gradients before reduction
//   kGradients    FSDP reduce-scatter buffers and sharded gradients
//   kOptimizer    the Trainer around the optimizer step (state, temporaries)
//   kOther        anything else (data loading, reporting, allocations outside these scopes)
// Threads that never set a category (intra-op pool, communication threads) charge kOther;
// their allocations are few and short-lived on this CPU path.
enum class MemoryCategory : uint8_t {
  kOther = 0,
  kParameters,
  kQuantized,
  kGathered,
  kActivations,
  kDequantized,
  kBackward,
  kGradients,
  kOptimizer,
};
constexpr int kNumMemoryCategories = 9;
// "other", "parameters", "quantized", "gathered", "activations", "dequantized", "backward",
// "gradients", "optimizer".
const char* to_string(MemoryCategory category);

MemoryCategory current_memory_category();  // this thread's

// Charges this thread's allocations to `category` while it lives (nests: restores the previous
// category on destruction).
class MemoryCategoryGuard {
 public:
  explicit MemoryCategoryGuard(MemoryCategory category);
  ~MemoryCategoryGuard();
  MemoryCategoryGuard(const MemoryCategoryGuard&) = delete;
  MemoryCategoryGuard& operator=(const MemoryCategoryGuard&) = delete;

 private:
  MemoryCategory previous_;
};

struct MemoryStats {
  int64_t current_bytes = 0;   // tensor bytes alive now (through the CPU allocator)
  int64_t peak_bytes = 0;      // max of current_bytes since start / last reset
  int64_t num_allocs = 0;      // allocations since start / last reset
  int64_t num_frees = 0;
  int64_t budget_bytes = 0;    // 0 = no budget
  // Index = MemoryCategory. See Note [Memory categories].
  std::array<int64_t, kNumMemoryCategories> current_by_category{};
  std::array<int64_t, kNumMemoryCategories> peak_by_category{};  // at the moment of the peak
};
// {category name: bytes} of a by-category array (categories with 0 bytes left out).
std::map<std::string, int64_t> by_category_map(const std::array<int64_t, kNumMemoryCategories>& bytes);

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

// The bytes one rank's model state (parameters, gradients, optimizer state, buffers) may take
// where it lives: what DDP, FSDP and the ZeRO stages check their estimate against before
// allocating it (Note [Model-state budget] in src/memory/state_budget.cpp).
struct ModelStateBudget {
  int64_t bytes = 0;  // 0: no budget
  std::string what;   // "the memory budget", "cuda:0's memory (79.19 GiB, 2 ranks share it)"
  std::string more;   // how to get more of it, for a HINT ("or raise FSDP_MEMORY_BUDGET")
};
// For a rank on `device`, `local_world_size` ranks on its node (rank r on cuda:(r % GPUs)). On
// the CPU: memory_budget(). On a CUDA device: the device's total memory (the driver's) divided
// by the ranks sharing it. No budget when memory_budget() is 0 (FSDP_MEMORY_BUDGET=0).
ModelStateBudget model_state_budget(c10::Device device, int local_world_size);
// The same for a plan made before any Trainer set the budget (fsdp-train --dry-run): the host
// budget is FSDP_MEMORY_BUDGET when set, else default_memory_budget(local_world_size).
ModelStateBudget planned_model_state_budget(c10::Device device, int local_world_size);

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
  // The CUDA caching allocator's peak and current allocated bytes of the rank's current
  // device (torch.cuda.max_memory_allocated / memory_allocated); -1 on a rank without one.
  std::vector<int64_t> device_peak_bytes;
  std::vector<int64_t> device_current_bytes;
  // The caching allocator's peak reserved bytes (torch.cuda.max_memory_reserved: what the
  // process took from the driver, caching included); -1 without a device.
  std::vector<int64_t> device_peak_reserved_bytes;
};
RankMemory gather_memory(ProcessGroup& group);

}  // namespace fsdp
