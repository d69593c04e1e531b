// fsdp::ProcessGroup — the small collective interface every strategy talks to.
//
// Three backends implement it: "gloo" (c10d ProcessGroupGloo, TCP, works across hosts), "mpi"
// (OpenMPI called directly; shared memory on one host) and, in a CUDA build, "nccl" (CUDA
// tensors on the rank's device, src/cuda/). Gloo and MPI support fp32, bf16, fp16 and int64 for
// every op; where Gloo lacks an op or dtype (reduce-scatter, bf16, AVG) the backend emulates it
// exactly. Gloo and MPI take CUDA tensors too, staged through host memory (Note [Staging device
// tensors] in src/comm/process_group_impl.cpp). See docs/process_groups.md and docs/gpu.md.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

// kAvg = sum / group size: in fp32 for bf16/fp16 (one rounding), truncating integer division
// for int32/int64.
enum class ReduceOp { kSum, kAvg, kMax };

const char* to_string(ReduceOp op);

// Handle for an asynchronous collective. wait() blocks until the output tensors hold the
// result (or throws the collective's error); is_completed() never blocks.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Bytes each op moved through this group (input bytes per rank), for tests and benchmarks
// (e.g. bf16-mixed must halve all-gather bytes).
struct CommCounters {
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t all_to_all_bytes = 0;
  int64_t calls = 0;
};
// Every op's bytes together.
inline int64_t total_bytes(const CommCounters& c) {
  return c.all_gather_bytes + c.reduce_scatter_bytes + c.all_reduce_bytes + c.broadcast_bytes +
         c.all_to_all_bytes;
}

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "gloo" | "mpi" | "nccl"; groups without peers: "self" (one rank), "shape-only" (planning)
  virtual std::string backend() const = 0;
  // Where this group's tensors live natively: the CPU for gloo and mpi (which stage CUDA
  // tensors through host memory), the rank's CUDA device for nccl (which refuses host
  // tensors). Small exchanges of host values (metrics, memory tables) allocate here.
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }
  // Ranks of this group in the world group, index = rank in this group.
  virtual const std::vector<int>& world_ranks() const = 0;

  // --- asynchronous collectives. Tensors must be contiguous, on the group's device (gloo and
  // mpi: CPU or CUDA; nccl: its CUDA device), and stay alive until wait() returns. All ranks
  // of the group call the same ops in the same order.

  // output (size()*input.numel() elements, same dtype) = concat over ranks of input.
  virtual WorkPtr all_gather_into_tensor_async(at::Tensor output, at::Tensor input) = 0;
  // input has size()*output.numel() elements; rank r receives reduce over ranks of chunk r.
  virtual WorkPtr reduce_scatter_tensor_async(at::Tensor output, at::Tensor input,
                                              ReduceOp op) = 0;
  virtual WorkPtr all_reduce_async(at::Tensor tensor, ReduceOp op) = 0;
  virtual WorkPtr broadcast_async(at::Tensor tensor, int root) = 0;
  // Equal splits: input and output have size()*k elements; chunk j of input goes to rank j,
  // chunk i of output came from rank i.
  virtual WorkPtr all_to_all_async(at::Tensor output, at::Tensor input) = 0;
  virtual WorkPtr barrier_async() = 0;

  // --- blocking forms (async + wait).
  void all_gather_into_tensor(at::Tensor output, at::Tensor input) {
    all_gather_into_tensor_async(std::move(output), std::move(input))->wait();
  }
  void reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op) {
    reduce_scatter_tensor_async(std::move(output), std::move(input), op)->wait();
  }
  void all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum) {
    all_reduce_async(std::move(tensor), op)->wait();
  }
  void broadcast(at::Tensor tensor, int root = 0) {
    broadcast_async(std::move(tensor), root)->wait();
  }
  void all_to_all(at::Tensor output, at::Tensor input) {
    all_to_all_async(std::move(output), std::move(input))->wait();
  }
  void barrier() { barrier_async()->wait(); }

  // A group of the given world ranks (sorted, unique). Collective over *this* group: every
  // rank of this group calls it with the same list; non-members get nullptr.
  virtual std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) = 0;

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = CommCounters{}; }

 protected:
  CommCounters counters_;
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

struct ProcessGroupOptions {
  std::string backend = "auto";  // "gloo" | "mpi" | "auto" (mpi when launched by mpirun)
  // A collective not finished within this time fails on every surviving rank, naming the op,
  // its sequence number and the ranks that did not arrive. Env: FSDP_COLLECTIVE_TIMEOUT_S.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Rank/world/master address come from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
  // MASTER_PORT, or OMPI_COMM_WORLD_* under mpirun); the launcher sets them.
  // Explicit values below win over the environment (-1 / "" / 0 = take it from the env).
  int rank = -1;
  int world_size = -1;
  std::string master_addr;
  int master_port = 0;
};

// Seconds this process's communication threads have spent running collectives (every group,
// every op, from the moment an op starts to the moment it finishes; queued time excluded).
// Monotonic over the process; callers take differences (the Trainer's per-step comm_seconds).
double comm_busy_seconds();

// Creates the world group from the environment. World size 1 without any env is fine.
ProcessGroupPtr init_process_group(const ProcessGroupOptions& options = {});

// The world group created by init_process_group (nullptr before).
ProcessGroupPtr world_group();

// Small exchanges of host values that work over every backend (nccl, which takes tensors on its
// device only: through the group's device). Collective. all_gather_host: every rank's `host`
// (the same shape and dtype everywhere) concatenated in rank order, on the host;
// all_gather_values: the same for numbers; broadcast_host: rank `root`'s values into `host`.
at::Tensor all_gather_host(ProcessGroup& group, const at::Tensor& host);
std::vector<int64_t> all_gather_values(ProcessGroup& group, const std::vector<int64_t>& values);
void broadcast_host(ProcessGroup& group, at::Tensor& host, int root);

// Shuts down every group (queued work finishes first) and forgets the world group. Called at
// process exit too; init_process_group may be called again afterwards (gloo; MPI itself can be
// initialised only once per process, so its world group is re-created on the same MPI).
void destroy_process_group();

// 2-D device mesh for hybrid sharding: ranks laid out as [replicate][shard], shard_size
// consecutive ranks form a shard group (typically one node), ranks with the same index in
// each shard group form a replicate group.
struct DeviceMesh {
  ProcessGroupPtr shard_group;
  ProcessGroupPtr replicate_group;
  int shard_size = 1;
  int replicate_size = 1;
};
DeviceMesh make_2d_mesh(const ProcessGroupPtr& world, int shard_size);

}  // namespace fsdp
