// NCCL backend (CUDA build): fsdp::ProcessGroup over one NCCL communicator per group, NCCL called
// directly. See Note [NCCL streams], Note [NCCL memory protection] and Note [NCCL watchdog] in
// src/cuda/nccl_process_group.cpp, and docs/design.md.
#pragma once

#include "cuda/cuda_api.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

class Monitor;  // comm/process_group_impl.h: the heartbeats that name a missing rank

// How a group of 2+ ranks notices a collective that never completes (Note [NCCL watchdog]).
struct NcclWatchOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // 0: no watchdog
  std::shared_ptr<Monitor> monitor;  // names the ranks that did not join; may be null
  std::string uid;                   // this group's key in the Monitor, the same on every rank
};

class NcclGroup final : public ProcessGroup, public std::enable_shared_from_this<NcclGroup> {
 public:
  // Takes ownership of comm (a communicator of `world_ranks.size()` ranks on `device`).
  NcclGroup(ncclComm_t comm, int rank, std::vector<int> world_ranks, c10::Device device,
            std::string name, NcclWatchOptions watch = {});
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

  // Raises the communicator's asynchronous error, if any (aborting the communicator first), or
  // the watchdog's timeout error once it aborted the communicator.
  void check_async_error();

  struct Watch;  // the watchdog's state (nccl_process_group.cpp)

 private:
  enum class Lane { kAllGather, kReduceScatter };  // which stream; see Note [NCCL streams]
  // Orders `lane`'s stream after the caller's current stream, runs `launch` on it, and returns
  // a Work whose end event is recorded there. `tensors` stay referenced by the Work. `code`:
  // the op's number for the Monitor (CollectiveOp).
  WorkPtr issue(const char* op, int64_t code, Lane lane, std::vector<at::Tensor> tensors,
                const std::function<void(cudaStream_t)>& launch, bool host_wait = false);
  void check_tensor(const char* op, const char* what, const at::Tensor& t) const;
  // Throws the watchdog's error once it has aborted the communicator.
  void check_not_aborted() const;
  // The watchdog thread's loop (Note [NCCL watchdog]).
  void watch();
  void abort_after_timeout(const std::string& message);

  ncclComm_t comm_;
  int rank_;
  std::vector<int> world_ranks_;
  c10::Device device_;
  std::string name_;
  c10::cuda::CUDAStream all_gather_stream_;
  c10::cuda::CUDAStream reduce_scatter_stream_;
  // One NCCL launch at a time: issue order is the same on every rank. Timed: the watchdog
  // tells a launch blocked inside NCCL from one about to start (Note [NCCL watchdog]).
  std::timed_mutex issue_mutex_;
  bool aborted_ = false;  // by an asynchronous error (check_async_error)
  NcclWatchOptions watch_options_;
  int64_t seq_ = 0;  // collectives issued (under issue_mutex_)
  std::shared_ptr<std::atomic<int64_t>> issued_;  // (seq << 4) | op, read by the Monitor
  std::shared_ptr<Watch> watch_;
};

}  // namespace fsdp::detail
