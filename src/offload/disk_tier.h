// The disk tier's per-job settings: where a rank's swap files go and the options of its two
// swappers, derived from an OffloadPolicy's NvmeOffloadOptions (include/fsdp/offload.h). Every
// strategy with a kNvme tier (FSDPStrategy, DeepSpeedStrategy's stages 1 and 2) builds its
// swappers through these, so they agree on the directory layout.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/offload.h"
#include "offload/nvme_adam.h"
#include "offload/param_swapper.h"

#include <string>

namespace fsdp::detail {

// Where one rank's swap files go: disk.path/<job>/rank<rank>/.
struct DiskPlacement {
  std::string job;             // the same on every rank of the job
  int rank = 0;
  int ranks_sharing_disk = 1;  // ranks of this node: their swap files share the disk
  std::string who;             // message prefix, e.g. "[deepspeed]"
};

// The job's directory name: disk.job, else the job id (Settings::job_id: FSDP_JOB_ID, torchrun's
// or SLURM's), else rank 0's pid and start time broadcast over `world` (a collective when it has
// 2+ ranks and no name is given), so every rank of the job uses the same directory and
// concurrent jobs do not collide.
std::string disk_job_name(const NvmeOffloadOptions& nvme, ProcessGroup* world);

NvmeAdam::Options nvme_adam_options(const NvmeOffloadOptions& nvme, const DiskPlacement& at);
ParamSwapper::Options param_swapper_options(const NvmeOffloadOptions& nvme,
                                            const DiskPlacement& at);

}  // namespace fsdp::detail
