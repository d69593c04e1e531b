// OffloadPolicy (include/fsdp/offload.h): parsing and checks, and the disk tier's per-job
// settings that every strategy with a kNvme tier derives from it (offload/disk_tier.h).
#include "fsdp/offload.h"

#include "offload/disk_tier.h"

#include "common/settings.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <ctime>
#include <unistd.h>

namespace fsdp {

OffloadDevice parse_offload_device(const std::string& name) {
  if (name == "none") return OffloadDevice::kNone;
  if (name == "cpu") return OffloadDevice::kCpu;
  if (name == "nvme") return OffloadDevice::kNvme;
  TORCH_CHECK(false, "[offload] unknown offload device '", name,
              "'; valid: none, cpu, nvme");
}

const char* to_string(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

OffloadPolicy OffloadPolicy::cpu(bool pin_memory) {
  OffloadPolicy p;
  p.params = OffloadDevice::kCpu;
  p.optimizer = OffloadDevice::kCpu;
  p.pin_memory = pin_memory;
  return p;
}

OffloadPolicy OffloadPolicy::nvme(std::string path, bool params) {
  OffloadPolicy p;
  p.params = params ? OffloadDevice::kNvme : OffloadDevice::kNone;
  p.optimizer = OffloadDevice::kNvme;
  p.disk.path = std::move(path);
  return p;
}

void check_offload_policy(const OffloadPolicy& policy, const std::string& who) {
  TORCH_CHECK(!policy.params_on_disk() || policy.optimizer_on_disk(), who,
              " parameters on disk (offload params \"nvme\") need the optimizer state on disk "
              "too: the step streams each parameter through it with its moments (as DeepSpeed "
              "requires). HINT: OffloadPolicy::nvme(path), or offload optimizer \"nvme\"");
  if (!policy.params_on_disk() && !policy.optimizer_on_disk()) return;
  TORCH_CHECK(!policy.disk.path.empty(), who,
              " offload to \"nvme\" needs a path (a directory on the disk for the swap files: "
              "nvme_path, fsdp-train --nvme-path)");
  TORCH_CHECK(policy.disk.params_buffer_count >= 1, who,
              " offload_param buffer_count must be >= 1, got ", policy.disk.params_buffer_count);
  TORCH_CHECK(policy.disk.params_buffer_size >= 1, who,
              " offload_param buffer_size must be >= 1 element, got ",
              policy.disk.params_buffer_size);
  TORCH_CHECK(policy.disk.max_in_cpu >= 0, who, " offload_param max_in_cpu must be >= 0, got ",
              policy.disk.max_in_cpu);
  TORCH_CHECK(policy.disk.sub_group_size >= 1, who, " sub_group_size must be >= 1 element, got ",
              policy.disk.sub_group_size);
}

namespace detail {

std::string disk_job_name(const NvmeOffloadOptions& nvme, ProcessGroup* world) {
  if (!nvme.job.empty()) return nvme.job;
  if (std::string id = read_settings().job_id; !id.empty()) return id;
  at::Tensor t = at::tensor({static_cast<int64_t>(::getpid()),
                             static_cast<int64_t>(std::time(nullptr))}, at::kLong);
  if (world && world->size() > 1) world->broadcast(t, 0);
  return "fsdp-job-" + std::to_string(t[0].item<int64_t>()) + "-" +
         std::to_string(t[1].item<int64_t>());
}

namespace {

// The fields both swappers' options share: where the files go, the I/O, the message prefix.
template <typename SwapperOptions>
SwapperOptions placed(const NvmeOffloadOptions& disk, const DiskPlacement& at) {
  SwapperOptions o;
  o.nvme_path = disk.path;
  o.job = at.job;
  o.rank = at.rank;
  o.ranks_sharing_disk = std::max(1, at.ranks_sharing_disk);
  o.aio = disk.aio;
  o.who = at.who;
  return o;
}

}  // namespace

NvmeAdam::Options nvme_adam_options(const NvmeOffloadOptions& disk, const DiskPlacement& at) {
  auto o = placed<NvmeAdam::Options>(disk, at);
  o.sub_group_size = disk.sub_group_size;
  return o;
}

ParamSwapper::Options param_swapper_options(const NvmeOffloadOptions& disk,
                                            const DiskPlacement& at) {
  auto o = placed<ParamSwapper::Options>(disk, at);
  o.buffer_count = disk.params_buffer_count;
  o.buffer_size = disk.params_buffer_size;
  o.max_in_cpu = disk.max_in_cpu;
  return o;
}

}  // namespace detail
}  // namespace fsdp
