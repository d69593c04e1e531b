// detail::NvmeAdam: Adam/AdamW whose moments (exp_avg, exp_avg_sq) live in swap files on disk,
// streamed through three RAM buffers one sub-group at a time: read the next sub-group, step the
// current one with the CPU Adam kernel, write the previous one (ZeRO-Infinity's optimizer
// swapper with pipeline_read / pipeline_write). A strategy calls step(optimizer) in place of
// optimizer.step(); the torch optimizer then only carries the parameter groups and
// hyper-parameters (lr from a scheduler included) and never holds state. Checkpoints stream
// the moments through the same buffers (fsdp::StreamedOptimizerState).
// See Note [Disk tier swapper] and Note [Streamed optimizer state] in docs/design.md.
#pragma once

#include "fsdp/offload.h"
#include "fsdp/strategy.h"
#include "offload/aio.h"
#include "offload/param_residency.h"
#include "offload/swap_file.h"
#include "optim/cpu_adam_spans.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp::detail {

class NvmeAdam : public StreamedOptimizerState {
 public:
  struct Options {
    std::string nvme_path;
    std::string job;  // the same on every rank: nvme_path/<job>/rank<r>/
    int rank = 0;
    int ranks_sharing_disk = 1;  // ranks of this node: their swap files share nvme_path's disk
    int64_t sub_group_size = 1000000000;  // elements streamed per sub-group
    AioOptions aio;
    std::string who = "[deepspeed]";  // prefix of messages
    // true: the step's last writes (the final sub-groups) are left in flight, overlapping
    // whatever runs next (the next forward). Off by default: on this 2-core machine the
    // kernel's work for writes in flight slowed the next forward's parallel kernels more than
    // the wait costs (`fsdp-bench offload`, overlap part). See Note [Disk tier swapper].
    bool overlap_last_writes = false;
  };
  // Takes the optimizer's parameters (this rank's partitions or shards, in group order) and
  // checks the plan against the free space under nvme_path and the memory budget before it
  // allocates; then creates the swap files. Refuses an optimizer that is not Adam / AdamW /
  // fsdp::optim::CPUAdam, amsgrad in some parameter groups only, or one that already holds
  // state. With amsgrad a third moment (max_exp_avg_sq) is streamed.
  NvmeAdam(torch::optim::Optimizer& optimizer, Options options);
  ~NvmeAdam() override;

  // One optimizer step of every parameter with a gradient, the moments streamed from and back
  // to disk. After an I/O error or a corrupt record every later call fails too. Its last writes
  // may still be in flight when it returns (Options::overlap_last_writes): a later read of the
  // same sub-group, read_state/write_state and the destructor wait for them; a failure
  // surfaces there.
  void step(torch::optim::Optimizer& optimizer);
  // Waits for every write in flight (the swap files then hold the last step); throws the
  // first failure, after which the tier refuses to go on.
  void flush();
  // Parameters on disk (offload_param nvme): the step acquires each parameter it updates from
  // `residency` before its first sub-group and releases it (modified) after its last, so the
  // parameters stream through the step with their moments. Null: parameters in RAM.
  void set_residency(ParamResidency* residency) { residency_ = residency; }

  const DiskPlan& plan() const { return plan_; }
  const std::vector<std::string>& files() const { return dir_->files(); }
  const std::string& dir() const { return dir_->path(); }
  // Bytes read and written by the swapper so far.
  int64_t io_bytes() const { return engine_->bytes_done(); }
  // RAM of the streaming buffers (what step, read_state and write_state use).
  int64_t buffer_bytes() const;

  // StreamedOptimizerState: checkpoints stream the moments sub-group by sub-group through the
  // step's buffers (reading the next sub-group while the current one is visited).
  std::vector<std::string> stats() const override;
  bool holds(const at::Tensor& param) const override;
  int64_t step_of(const at::Tensor& param) const override;
  void set_step(const at::Tensor& param, int64_t step) override;
  void read_state(const Visitor& visit) override;
  void write_state(const Visitor& fill) override;

 private:
  struct Slot;  // a parameter's place in the flat state
  struct Buffer;
  void load(int64_t g, Buffer& b);
  void step_sub_group(int64_t g, Buffer& b);
  void stream(const Visitor& visit, bool write_back);
  size_t slot_of(const at::Tensor& param) const;

  Options options_;
  DiskPlan plan_;
  bool adamw_mode_ = true;
  bool bias_correction_ = true;
  int moments_ = 2;  // exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)
  std::vector<Slot> slots_;
  std::unordered_map<const c10::TensorImpl*, size_t> slot_index_;
  std::vector<cpu_adam::Hyper> hypers_;  // per parameter group, read at every step
  std::vector<int64_t> steps_;        // per parameter, as torch's state "step"
  std::vector<uint64_t> generation_;  // per sub-group: writes that landed (0: never written)
  std::vector<int> fds_;              // per sub-group
  std::vector<Buffer> buffers_;       // min(3, sub-groups)
  std::unique_ptr<SwapDir> dir_;
  std::unique_ptr<AioEngine> engine_;
  std::string failed_;  // the first I/O or integrity error
  ParamResidency* residency_ = nullptr;
};

}  // namespace fsdp::detail
