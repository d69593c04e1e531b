// Offloading sharded state to slower memory: the OffloadPolicy a strategy is built with, the
// disk tier's asynchronous I/O settings, and the per-rank plan of what lives in RAM and what on
// disk. Users set these through FSDPOptions::offload_policy, fsdp::DeepSpeedOptions
// (offload_optimizer_device = "nvme", nvme_path, aio) or DeepSpeed's JSON config
// (zero_optimization.offload_optimizer.device = "nvme", the "aio" block); see docs/offload.md.
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

// --- OffloadPolicy: where the sharded state lives between uses -------------------------------
//
// A value given to a strategy when it is built (FSDPOptions::offload_policy; DeepSpeedStrategy
// derives one from its offload_* options for its stage-3 engine), as FSDP2's OffloadPolicy is an
// argument of fully_shard: nothing reaches into the engine afterwards.
//
//   kNone  on the compute device (the CPU today: the state is in host memory already)
//   kCpu   in host memory, the optimizer step there (FSDP2 CPUOffloadPolicy, DeepSpeed
//          offload_* "cpu"). On a CPU device this is kNone: setup says so once and moves
//          nothing; from an accelerator it is an error (not implemented)
//   kNvme  on disk, in checksummed swap files under disk.path/<job>/rank<r>/ (ZeRO-Infinity):
//          parameters: each unit's shard is one swap record, read before its all-gather and
//          streamed through the optimizer step (needs the optimizer on disk too, and a shard
//          group of 2+ ranks); optimizer: Adam's moments stream from swap files one sub-group
//          at a time (Adam / AdamW / CPUAdam only). See docs/offload.md.
enum class OffloadDevice { kNone, kCpu, kNvme };
// "none", "cpu", "nvme"; anything else is an error listing them.
OffloadDevice parse_offload_device(const std::string& name);
const char* to_string(OffloadDevice device);

// The disk tier's settings (DeepSpeed's offload_param / offload_optimizer "nvme" fields and its
// "aio" block, same defaults), used where an OffloadPolicy says kNvme.
struct NvmeOffloadOptions {
  std::string path;  // required: swap files go to path/<job>/rank<r>/
  // The job's directory under path: empty = the launcher's job id when it set one, else rank
  // 0's pid and start time (the same on every rank; concurrent jobs do not collide).
  std::string job;
  AioOptions aio;
  // Parameters on disk: buffer_count buffers of buffer_size elements read units ahead and
  // write them back (a unit's shard larger than buffer_size is refused at setup); the first
  // units, up to max_in_cpu elements, stay in RAM.
  int64_t params_buffer_count = 5;
  int64_t params_buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  // Optimizer on disk: elements streamed per sub-group (three sub-group buffers in RAM).
  int64_t sub_group_size = 1000000000000;
};

struct OffloadPolicy {
  OffloadDevice params = OffloadDevice::kNone;     // sharded parameters (and their gradients)
  OffloadDevice optimizer = OffloadDevice::kNone;  // optimizer state and its step
  // kCpu from an accelerator: page-locked host buffers (nothing to pin on a CPU device).
  bool pin_memory = true;
  NvmeOffloadOptions disk;  // the kNvme tiers' settings

  static OffloadPolicy none() { return {}; }
  // FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step in host memory.
  static OffloadPolicy cpu(bool pin_memory = true);
  // The optimizer state on disk; with params = true the parameters too (ZeRO-Infinity).
  static OffloadPolicy nvme(std::string path, bool params = true);

  bool params_on_disk() const { return params == OffloadDevice::kNvme; }
  bool optimizer_on_disk() const { return optimizer == OffloadDevice::kNvme; }
  bool any() const { return params != OffloadDevice::kNone || optimizer != OffloadDevice::kNone; }
};

// Refuses a policy that cannot work, naming the field (`who` prefixes the message): parameters
// on disk without the optimizer on disk, kNvme without nvme.path, non-positive buffer sizes.
void check_offload_policy(const OffloadPolicy& policy, const std::string& who);

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
