// memory_summary(): this rank's table; gather_memory / memory_summary(group): all ranks'.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <sstream>

#include "common/settings.h"
#include "cuda/cuda_api.h"
#include "fsdp/comm.h"
#include "fsdp/memory.h"

namespace fsdp {

namespace {

std::string row(const char* name, const std::string& value) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "  %-18s %s\n", name, value.c_str());
  return buf;
}

int this_rank() {
  if (auto world = world_group()) return world->rank();
  return detail::read_settings().launch.rank;
}

}  // namespace

std::string memory_summary() {
  MemoryStats s = memory_stats();
  std::ostringstream out;
  out << "memory (rank " << this_rank() << ")"
      << (tracking_allocator_installed() ? "" : " [tracking allocator not installed]") << "\n";
  out << row("peak allocated", format_bytes(s.peak_bytes));
  out << row("current allocated", format_bytes(s.current_bytes));
  out << row("allocations",
             std::to_string(s.num_allocs) + " (frees " + std::to_string(s.num_frees) + ")");
  out << row("current RSS", format_bytes(current_rss_bytes()));
  out << row("peak RSS", format_bytes(peak_rss_bytes()));
  out << row("budget", s.budget_bytes > 0 ? format_bytes(s.budget_bytes) : std::string("none"));
  // CUDA build with a visible device: the caching allocator's counters of the current device
  // (torch.cuda.max_memory_allocated's), beside the host figures above.
  if (auto d = detail::device_memory_stats()) {
    const std::string dev = " (cuda:" + std::to_string(d->device) + ")";
    out << row("device peak", format_bytes(d->peak_allocated) + dev);
    out << row("device current", format_bytes(d->current_allocated) + dev);
    out << row("device reserved", format_bytes(d->peak_reserved) + " peak" + dev);
  }
  return out.str();
}

RankMemory gather_memory(ProcessGroup& group) {
  MemoryStats s = memory_stats();
  const std::optional<detail::DeviceMemoryStats> d = detail::device_memory_stats();
  // Read everything before allocating the exchange buffers (they are tracked too).
  constexpr int kFields = 7;
  const std::vector<int64_t> all = all_gather_values(
      group, {s.peak_bytes, peak_rss_bytes(), s.current_bytes, current_rss_bytes(),
              d ? d->peak_allocated : -1, d ? d->current_allocated : -1,
              d ? d->peak_reserved : -1});
  RankMemory m;
  for (int r = 0; r < group.size(); ++r) {
    m.peak_bytes.push_back(all[r * kFields + 0]);
    m.peak_rss_bytes.push_back(all[r * kFields + 1]);
    m.current_bytes.push_back(all[r * kFields + 2]);
    m.current_rss_bytes.push_back(all[r * kFields + 3]);
    m.device_peak_bytes.push_back(all[r * kFields + 4]);
    m.device_current_bytes.push_back(all[r * kFields + 5]);
    m.device_peak_reserved_bytes.push_back(all[r * kFields + 6]);
  }
  return m;
}

std::string memory_summary(ProcessGroup& group) {
  RankMemory m = gather_memory(group);
  if (group.rank() != 0) return "";
  std::ostringstream out;
  char buf[200];
  // Device columns when a rank has a CUDA device (a CUDA build with a visible GPU).
  const bool device = std::any_of(m.device_peak_bytes.begin(), m.device_peak_bytes.end(),
                                  [](int64_t b) { return b >= 0; });
  auto device_cell = [](int64_t b) { return b >= 0 ? format_bytes(b) : std::string("-"); };
  std::snprintf(buf, sizeof(buf), "%-6s %16s %16s %16s %16s", "rank", "peak allocated", "current",
                "peak RSS", "current RSS");
  out << "memory per rank (" << group.size() << " ranks, " << group.backend() << ")\n" << buf;
  if (device) out << "  device peak     device current";
  out << "\n";
  for (int r = 0; r < group.size(); ++r) {
    std::snprintf(buf, sizeof(buf), "%-6d %16s %16s %16s %16s", group.world_ranks()[r],
                  format_bytes(m.peak_bytes[r]).c_str(), format_bytes(m.current_bytes[r]).c_str(),
                  format_bytes(m.peak_rss_bytes[r]).c_str(),
                  format_bytes(m.current_rss_bytes[r]).c_str());
    out << buf;
    if (device) {
      std::snprintf(buf, sizeof(buf), " %12s %18s", device_cell(m.device_peak_bytes[r]).c_str(),
                    device_cell(m.device_current_bytes[r]).c_str());
      out << buf;
    }
    out << "\n";
  }
  int64_t budget = memory_budget();
  if (budget > 0) out << "budget per rank: " << format_bytes(budget) << "\n";
  return out.str();
}

}  // namespace fsdp
