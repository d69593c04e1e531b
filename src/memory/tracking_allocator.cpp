// The tracking CPU allocator: current/peak tensor bytes, allocation counts, memory budget.
//
// Note [Tracking allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Installed with c10::SetCPUAllocator at a priority above the default allocator's (0), so every
// CPU tensor storage created afterwards (at::empty, resize, copies, autograd buffers) comes
// from here. Each block is 64-byte aligned (c10's alignment) and carries a 64-byte header in
// front of the data holding its size, so the deleter needs only the data pointer: the DataPtr's
// context is the data pointer itself, which keeps raw_allocate/raw_deallocate working.
// Counters are atomics (allocations happen on intra-op and autograd threads). The budget is
// checked by reserving first (fetch_add) and undoing on refusal, so concurrent allocations
// cannot overshoot it together. Storages allocated before installation keep the default
// allocator's deleter and are not counted (neither their allocation nor their free). Large
// blocks come from and go back to a cache of freed blocks (Note [Block cache]). The header also
// holds the block's memory category (byte 8), so its free is charged back to the category its
// allocation was charged to (Note [Memory categories] in fsdp/memory.h).
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "common/settings.h"
#include "fsdp/memory.h"
#include "memory/block_cache.h"

namespace fsdp {

namespace {

constexpr size_t kHeader = 64;  // keeps the data 64-byte aligned

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocs{0};
std::atomic<int64_t> g_frees{0};
std::atomic<int64_t> g_budget{0};
std::atomic<bool> g_installed{false};

// See Note [Memory categories].
thread_local MemoryCategory t_category = MemoryCategory::kOther;
std::array<std::atomic<int64_t>, kNumMemoryCategories> g_current_by{};
std::array<std::atomic<int64_t>, kNumMemoryCategories> g_peak_by{};
std::atomic_flag g_snapshot_busy = ATOMIC_FLAG_INIT;

// Copies the per-category current bytes as the breakdown of the peak (skipped when another
// thread is copying right now: the next new peak copies again).
void snapshot_peak_breakdown(bool wait = false) {
  while (g_snapshot_busy.test_and_set(std::memory_order_acquire)) {
    if (!wait) return;
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    g_peak_by[c].store(g_current_by[c].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  g_snapshot_busy.clear(std::memory_order_release);
}

void update_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak) {
    if (g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
      snapshot_peak_breakdown();
      return;
    }
  }
}

void tracking_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t size = *reinterpret_cast<int64_t*>(base);
  const uint8_t category = *reinterpret_cast<uint8_t*>(base + 8);
  g_current_by[category].fetch_sub(size, std::memory_order_relaxed);
  g_current.fetch_sub(size, std::memory_order_relaxed);
  g_frees.fetch_add(1, std::memory_order_relaxed);
  detail::block_free(base, static_cast<size_t>(size) + kHeader);
}

[[noreturn]] void throw_budget_error(int64_t requested, int64_t in_use, int64_t budget) {
  std::ostringstream msg;
  msg << "out of memory: allocating " << format_bytes(requested) << " with " << format_bytes(in_use)
      << " in use would exceed the budget of " << format_bytes(budget)
      << " (FSDP_MEMORY_BUDGET or fsdp::set_memory_budget). ---> HINT: reduce the batch size, "
         "use a sharding strategy that shards more (FULL_SHARD / ZeRO-3), enable activation "
         "checkpointing or CPU offload, or raise the budget";
  // No C++ backtrace in the message: this is a user-facing condition, not a bug.
  throw OutOfMemoryError(msg.str());
}

class TrackingAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &tracking_delete, at::Device(at::DeviceType::CPU)};
    const int64_t n = static_cast<int64_t>(nbytes);
    const int64_t now = g_current.fetch_add(n, std::memory_order_relaxed) + n;
    const int64_t budget = g_budget.load(std::memory_order_relaxed);
    if (budget > 0 && now > budget) {
      g_current.fetch_sub(n, std::memory_order_relaxed);
      throw_budget_error(n, now - n, budget);
    }
    void* base = nullptr;
    try {
      base = detail::block_alloc(nbytes + kHeader);  // Note [Block cache]
    } catch (...) {
      g_current.fetch_sub(n, std::memory_order_relaxed);
      throw;
    }
    *static_cast<int64_t*>(base) = n;
    const auto category = static_cast<uint8_t>(t_category);
    *(static_cast<uint8_t*>(base) + 8) = category;
    g_current_by[category].fetch_add(n, std::memory_order_relaxed);
    update_peak(now);
    g_allocs.fetch_add(1, std::memory_order_relaxed);
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &tracking_delete, at::Device(at::DeviceType::CPU)};
  }

  at::DeleterFnPtr raw_deleter() const override { return &tracking_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Above the default CPU allocator (priority 0): later SetCPUAllocator calls with a lower
// priority are ignored.
constexpr uint8_t kPriority = 100;

}  // namespace

void install_tracking_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (auto budget = detail::read_settings().memory_budget) g_budget.store(*budget);
    static TrackingAllocator allocator;  // lives until exit: storages point at it
    c10::SetCPUAllocator(&allocator, kPriority);
    TORCH_INTERNAL_ASSERT(c10::GetCPUAllocator() == &allocator,
                          "another CPU allocator with a higher priority is installed");
    g_installed.store(true);
  });
}

bool tracking_allocator_installed() {
  return g_installed.load();
}

const char* to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kOther: return "other";
    case MemoryCategory::kParameters: return "parameters";
    case MemoryCategory::kQuantized: return "quantized";
    case MemoryCategory::kGathered: return "gathered";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kDequantized: return "dequantized";
    case MemoryCategory::kBackward: return "backward";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kOptimizer: return "optimizer";
  }
  return "?";
}

MemoryCategory current_memory_category() {
  return t_category;
}

MemoryCategoryGuard::MemoryCategoryGuard(MemoryCategory category) : previous_(t_category) {
  t_category = category;
}

MemoryCategoryGuard::~MemoryCategoryGuard() {
  t_category = previous_;
}

std::map<std::string, int64_t> by_category_map(const std::array<int64_t, kNumMemoryCategories>& bytes) {
  std::map<std::string, int64_t> out;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    if (bytes[c] != 0) out[to_string(static_cast<MemoryCategory>(c))] = bytes[c];
  }
  return out;
}

MemoryStats memory_stats() {
  MemoryStats s;
  s.current_bytes = g_current.load();
  const int64_t peak = g_peak.load();
  s.peak_bytes = std::max(peak, s.current_bytes);
  s.num_allocs = g_allocs.load();
  s.num_frees = g_frees.load();
  s.budget_bytes = g_budget.load();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    s.current_by_category[c] = g_current_by[c].load();
    s.peak_by_category[c] = peak >= s.current_bytes ? g_peak_by[c].load() : s.current_by_category[c];
  }
  return s;
}

void reset_peak_memory_stats() {
  g_peak.store(g_current.load());
  snapshot_peak_breakdown(/*wait=*/true);
  g_allocs.store(0);
  g_frees.store(0);
}

void set_memory_budget(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "[memory] budget must be >= 0 bytes (0 = none), got ", bytes);
  g_budget.store(bytes);
}

int64_t memory_budget() {
  return g_budget.load();
}

int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

int64_t default_memory_budget(int local_ranks) {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream in(line.substr(13));
      int64_t kb = 0;
      in >> kb;
      return kb * 1024 / std::max(1, local_ranks);
    }
  }
  return 0;  // unknown: no budget
}

bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return false;
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream in(line.substr(6));
      int64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

}  // namespace fsdp
