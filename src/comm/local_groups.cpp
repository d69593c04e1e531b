#include "comm/local_groups.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {
namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

class SingleRankGroup final : public ProcessGroup {
 public:
  explicit SingleRankGroup(int world_rank) : world_ranks_{world_rank} {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  // With one rank, gathering and reducing (sum, avg, max over one value) are copies.
  WorkPtr all_gather_into_tensor_async(at::Tensor output, at::Tensor input) override {
    return local_copy("all_gather", output, input, counters_.all_gather_bytes);
  }
  WorkPtr reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp) override {
    return local_copy("reduce_scatter", output, input, counters_.reduce_scatter_bytes);
  }
  WorkPtr all_reduce_async(at::Tensor, ReduceOp) override {
    ++counters_.calls;
    return done_work();
  }
  WorkPtr broadcast_async(at::Tensor, int root) override {
    TORCH_CHECK(root == 0, "[ProcessGroup self] broadcast root ", root,
                " outside a group of one rank");
    return done_work();
  }
  WorkPtr all_to_all_async(at::Tensor output, at::Tensor input) override {
    output.view({-1}).copy_(input.reshape({-1}));
    return done_work();
  }
  WorkPtr barrier_async() override { return done_work(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override {
    TORCH_CHECK(ranks == world_ranks_, "[ProcessGroup self] new_subgroup of a single-rank "
                "group must be that rank");
    return std::make_shared<SingleRankGroup>(world_ranks_.front());
  }

 private:
  WorkPtr local_copy(const char* op, const at::Tensor& output, const at::Tensor& input,
                     int64_t& bytes) {
    TORCH_CHECK(output.numel() == input.numel(), "[ProcessGroup self] ", op, ": output and "
                "input must have the same number of elements in a group of one rank, got ",
                output.numel(), " and ", input.numel());
    bytes += input.numel() * input.element_size();
    ++counters_.calls;
    output.view({-1}).copy_(input.reshape({-1}));
    return done_work();
  }

  std::vector<int> world_ranks_;
};

class ShapeOnlyGroup final : public ProcessGroup {
 public:
  explicit ShapeOnlyGroup(int size) : size_(size) {
    for (int r = 0; r < size; ++r) ranks_.push_back(r);
  }
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return "shape-only"; }
  const std::vector<int>& world_ranks() const override { return ranks_; }
  WorkPtr all_gather_into_tensor_async(at::Tensor, at::Tensor) override { fail(); }
  WorkPtr reduce_scatter_tensor_async(at::Tensor, at::Tensor, ReduceOp) override { fail(); }
  WorkPtr all_reduce_async(at::Tensor, ReduceOp) override { fail(); }
  WorkPtr broadcast_async(at::Tensor, int) override { fail(); }
  WorkPtr all_to_all_async(at::Tensor, at::Tensor) override { fail(); }
  WorkPtr barrier_async() override { fail(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>&) override { fail(); }

 private:
  [[noreturn]] static void fail() {
    TORCH_CHECK(false, "[FSDPStrategy] a planned model (plan_module / estimate_fsdp_memory) "
                "cannot communicate; set up a real model with setup_module to train");
  }
  int size_;
  std::vector<int> ranks_;
};

}  // namespace

WorkPtr done_work() { return std::make_shared<DoneWork>(); }

ProcessGroupPtr make_single_rank_group(int world_rank) {
  return std::make_shared<SingleRankGroup>(world_rank);
}

ProcessGroupPtr make_shape_only_group(int size) { return std::make_shared<ShapeOnlyGroup>(size); }

}  // namespace fsdp::detail
