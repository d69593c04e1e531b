// detail::ParamSwapper: parameters on disk (ZeRO-Infinity's offload_param to NVMe, ZeRO stage 3).
// Each unit's shard of the parameters (this rank's sharded parameters of the unit) is one
// checksummed swap record under nvme_path/<job>/rank<r>/; while it is on disk the parameters'
// storages are 0 bytes (the tensors, their identity for the optimizer, and their gradients
// stay). acquire reads the record through one of buffer_count aligned buffers of buffer_size
// elements and copies it into the storages; the last release frees them again, writing the
// record back first when the values were modified (the optimizer step). Reads are prefetched in
// the recorded order of acquisitions (forward, backward, optimizer step). See Note [Parameters
// on disk] in docs/design.md.
#pragma once

#include "fsdp/offload.h"
#include "offload/aio.h"
#include "offload/param_residency.h"
#include "offload/swap_file.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp::detail {

class ParamSwapper : public ParamResidency {
 public:
  struct Options {
    std::string nvme_path;
    std::string job;  // the same on every rank: nvme_path/<job>/rank<r>/
    int rank = 0;
    int ranks_sharing_disk = 1;
    int64_t buffer_count = 5;           // offload_param.buffer_count
    int64_t buffer_size = 100000000;    // offload_param.buffer_size: elements per buffer
    int64_t max_in_cpu = 1000000000;    // offload_param.max_in_cpu: elements kept in RAM
    AioOptions aio;
    std::string who = "[deepspeed]";
  };
  // A unit's sharded parameters (contiguous CPU tensors with their own storage).
  struct UnitParams {
    std::string name;
    std::vector<at::Tensor> params;
  };

  // The plan alone (no files, nothing allocated): what setup and --dry-run print.
  static ParamDiskPlan make_plan(const std::vector<int64_t>& unit_bytes, const Options& options);
  // Checks the plan (a unit larger than buffer_size, free disk, memory budget) before it
  // allocates; then writes every unit past max_in_cpu to its swap file and frees its storages.
  ParamSwapper(std::vector<UnitParams> units, Options options);
  ~ParamSwapper() override;

  bool manages(const at::Tensor& param) const override;
  void acquire(const at::Tensor& param) override;
  void release(const at::Tensor& param, bool modified) override;
  void acquire_outside_step(const at::Tensor& param) override;
  // The first call ends the recording of the access order that prefetching follows (after the
  // first optimizer step, so one recorded step covers forward, backward and the step).
  void end_step();
  // Waits for every write in flight.
  void flush();

  const ParamDiskPlan& plan() const { return plan_; }
  const std::vector<std::string>& files() const { return dir_->files(); }
  // Units whose parameters are in RAM right now (acquired, or kept by max_in_cpu).
  int64_t resident_units() const;
  int64_t io_bytes() const { return engine_->bytes_done(); }

 private:
  struct Unit;
  struct Buffer;
  Unit& unit_of(const at::Tensor& param);
  void acquire(const at::Tensor& param, bool in_step);
  int take_buffer();
  void free_done_writes();
  void load(size_t u);
  void write_back(size_t u);
  void note_access(size_t u);
  void prefetch();
  void issue_read(size_t u, int b);
  void fail(const std::exception& e);

  Options options_;
  ParamDiskPlan plan_;
  std::vector<Unit> units_;
  std::unordered_map<const c10::TensorImpl*, size_t> unit_index_;
  std::vector<Buffer> buffers_;
  std::unique_ptr<SwapDir> dir_;
  std::unique_ptr<AioEngine> engine_;
  // Note [Parameter prefetch order]: acquisitions of the first step, then a cursor into them.
  std::vector<size_t> order_;
  bool order_frozen_ = false;
  size_t cursor_ = 0;
  std::string failed_;
};

}  // namespace fsdp::detail
