// NCCL backend (CUDA build): fsdp::ProcessGroup over one NCCL communicator per group, NCCL called
// directly. See Note [NCCL streams] and Note [NCCL memory protection] in
// src/cuda/nccl_process_group.cpp, and docs/design.md.
#pragma once

#include "cuda/cuda_api.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

class NcclGroup final : public ProcessGroup, public std::enable_shared_from_this<NcclGroup> {
 public:
  // Takes ownership of comm (a communicator of `world_ranks.size()` ranks on `device`).
  NcclGroup(ncclComm_t comm, int rank, std::vector<int> world_ranks, c10::Device device,
            std::string name);
  ~NcclGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(world_ranks_.size()); }
  std::string backend() const override { return "nccl"; }
  c10::Device device() const override { return device_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  WorkPtr all_gather_into_tensor_async(at::Tensor output, at::Tensor input) override;
  WorkPtr reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr all_reduce_async(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast_async(at::Tensor tensor, int root) override;
  WorkPtr all_to_all_async(at::Tensor output, at::Tensor input) override;
  WorkPtr barrier_async() override;
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override;

  // Raises the communicator's asynchronous error, if any (aborting the communicator first).
  void check_async_error();

 private:
  enum class Lane { kAllGather, kReduceScatter };  // which stream; see Note [NCCL streams]
  // Orders `lane`'s stream after the caller's current stream, runs `launch` on it, and returns
  // a Work whose end event is recorded there. `tensors` stay referenced by the Work.
  WorkPtr issue(const char* op, Lane lane, std::vector<at::Tensor> tensors,
                const std::function<void(cudaStream_t)>& launch, bool host_wait = false);
  void check_tensor(const char* op, const char* what, const at::Tensor& t) const;

  ncclComm_t comm_;
  int rank_;
  std::vector<int> world_ranks_;
  c10::Device device_;
  std::string name_;
  c10::cuda::CUDAStream all_gather_stream_;
  c10::cuda::CUDAStream reduce_scatter_stream_;
  std::mutex issue_mutex_;  // one NCCL launch at a time: issue order is the same on every rank
  bool aborted_ = false;
};

}  // namespace fsdp::detail
