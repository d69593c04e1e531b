// The disk tier (ZeRO-Infinity's NVMe offload): asynchronous I/O settings and the per-rank plan
// of what lives in RAM and what on disk. Users set these through fsdp::DeepSpeedOptions
// (offload_optimizer_device = "nvme", nvme_path, aio) or DeepSpeed's JSON config
// (zero_optimization.offload_optimizer.device = "nvme", the "aio" block); see README "Disk tier
// (NVMe offload)".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

// DeepSpeed's "aio" block, same names and defaults (swap_tensor/constants.py).
struct AioOptions {
  int64_t block_size = 1048576;  // bytes per I/O request (a transfer is split into these)
  int queue_depth = 8;           // requests in flight per ring
  int intra_op_parallelism = 1;  // rings (each with its own thread) a transfer is spread over
  bool single_submit = false;    // true: one submit call per request; false: batched
  bool overlap_events = true;    // true: refill the queue as requests complete; false: in waves
  bool use_gds = false;          // GPUDirect Storage: no GPU here; true is an error
};

// What one rank keeps where for a disk-offloaded optimizer (bytes).
struct DiskPlan {
  std::string dir;            // nvme_path/<job>/rank<r>
  int64_t state_numel = 0;    // optimizer-state elements of this rank (its partition)
  int64_t sub_group_numel = 0;  // elements per sub-group (the streaming unit)
  int64_t num_sub_groups = 0;
  int moments = 2;            // fp32 moments per element: exp_avg, exp_avg_sq (+ max_exp_avg_sq)
  int64_t disk_bytes = 0;     // swap files (the moments, aligned, with headers)
  int64_t ram_bytes = 0;      // swap buffers in RAM (three sub-groups: read, step, write)
  int64_t free_bytes = -1;    // free space under nvme_path (statvfs), -1 unknown
  std::string describe() const;  // one line per item, for setup and --dry-run
};

// The plan for `state_numel` fp32 Adam elements streamed in sub-groups of `sub_group_size`
// elements, with swap files under nvme_path (free space measured with statvfs on nvme_path or
// its closest existing parent); `moments` is 3 with amsgrad.
DiskPlan plan_disk_offload(int64_t state_numel, int64_t sub_group_size,
                           const std::string& nvme_path, int moments = 2);

// Seconds this process spent blocked waiting for the disk tier's I/O (swap reads and writes of
// optimizer state and parameters, checkpoint streaming) since it started; the part of a step's
// time that is disk wait (the Trainer reports it per step: FitResults::disk_wait_seconds).
double disk_wait_seconds();

// What one rank keeps where with parameters on disk (offload_param device "nvme", ZeRO stage 3):
// each unit's shard of the parameters is one swap record (bytes).
struct ParamDiskPlan {
  std::string dir;              // nvme_path/<job>/rank<r>
  int64_t units = 0;            // units with parameters on this rank
  int64_t units_on_disk = 0;    // the others stay in RAM (max_in_cpu)
  int64_t numel_on_disk = 0;    // elements of this rank's shards on disk
  int64_t numel_in_cpu = 0;     // elements kept in RAM (the first units, up to max_in_cpu)
  int64_t largest_unit_numel = 0;
  int64_t buffer_count = 0;
  int64_t buffer_numel = 0;     // buffer_size: elements (fp32) per buffer
  int64_t disk_bytes = 0;       // swap files (records with headers, aligned)
  int64_t buffer_bytes = 0;     // the read/write buffers in RAM
  int64_t ram_param_bytes = 0;  // shards kept in RAM (max_in_cpu)
  int64_t free_bytes = -1;      // free space under nvme_path, -1 unknown
  std::string describe() const;
};

// The plan for units whose shards on this rank take `unit_bytes` (fp32, in unit order) with
// offload_param's buffer_count, buffer_size (elements) and max_in_cpu (elements), swap files
// under nvme_path (free space measured there).
ParamDiskPlan plan_param_offload(const std::vector<int64_t>& unit_bytes, int64_t buffer_count,
                                 int64_t buffer_size, int64_t max_in_cpu,
                                 const std::string& nvme_path);

}  // namespace fsdp
