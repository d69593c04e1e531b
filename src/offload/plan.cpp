// fsdp::plan_disk_offload (include/fsdp/offload.h): what one rank keeps in RAM and on disk for a
// disk-offloaded optimizer, computed before anything is allocated. See Note [Disk tier swapper]
// in docs/design.md.
#include "fsdp/offload.h"

#include "fsdp/memory.h"
#include "offload/aio.h"
#include "offload/swap_file.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace fsdp {

DiskPlan plan_disk_offload(int64_t state_numel, int64_t sub_group_size,
                           const std::string& nvme_path, int moments) {
  TORCH_CHECK(sub_group_size >= 1, "[nvme] sub_group_size must be >= 1 element, got ",
              sub_group_size);
  TORCH_CHECK(moments == 2 || moments == 3, "[nvme] Adam streams 2 moments (3 with amsgrad), got ",
              moments);
  DiskPlan p;
  p.state_numel = state_numel;
  p.moments = moments;
  p.sub_group_numel = std::max<int64_t>(1, std::min(sub_group_size, state_numel));
  p.num_sub_groups = (state_numel + p.sub_group_numel - 1) / p.sub_group_numel;
  // Per sub-group record: a header block, then exp_avg and exp_avg_sq (and max_exp_avg_sq with
  // amsgrad), fp32, each aligned.
  auto record = [moments](int64_t n) {
    return detail::kAioAlignment +
           moments * detail::align_up(n * static_cast<int64_t>(sizeof(float)));
  };
  for (int64_t g = 0; g < p.num_sub_groups; ++g) {
    p.disk_bytes += record(std::min(p.sub_group_numel, state_numel - g * p.sub_group_numel));
  }
  p.ram_bytes = std::min<int64_t>(3, p.num_sub_groups) * record(p.sub_group_numel);
  p.free_bytes = detail::free_disk_bytes(nvme_path);
  return p;
}

std::string DiskPlan::describe() const {
  std::ostringstream s;
  s << "  disk (" << dir << "): exp_avg + exp_avg_sq" << (moments == 3 ? " + max_exp_avg_sq" : "")
    << " of " << state_numel << " elements in "
    << num_sub_groups << " sub-group file(s) of up to " << sub_group_numel
    << " elements: " << format_bytes(disk_bytes) << " (free there: "
    << (free_bytes < 0 ? std::string("unknown") : format_bytes(free_bytes)) << ")\n"
    << "  RAM: " << std::min<int64_t>(3, num_sub_groups)
    << " swap buffer(s) (read next, step current, write previous): " << format_bytes(ram_bytes)
    << "; parameters and gradients stay in RAM as without offload\n";
  return s.str();
}

}  // namespace fsdp
