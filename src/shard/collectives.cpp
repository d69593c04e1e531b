#include "shard/collectives.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {
namespace {

class DoneWork : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

class SingleRankGroup : public ProcessGroup {
 public:
  explicit SingleRankGroup(int world_rank) : world_ranks_{world_rank} {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  WorkPtr all_gather_into_tensor_async(at::Tensor output, at::Tensor input) override {
    TORCH_CHECK(output.numel() == input.numel(), "all_gather: output must have ", input.numel(),
                " elements, got ", output.numel());
    counters_.all_gather_bytes += input.numel() * input.element_size();
    ++counters_.calls;
    output.view({-1}).copy_(input.reshape({-1}));
    return done();
  }
  WorkPtr reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp) override {
    TORCH_CHECK(output.numel() == input.numel(), "reduce_scatter: input must have ",
                output.numel(), " elements, got ", input.numel());
    counters_.reduce_scatter_bytes += input.numel() * input.element_size();
    ++counters_.calls;
    output.view({-1}).copy_(input.reshape({-1}));
    return done();
  }
  WorkPtr all_reduce_async(at::Tensor, ReduceOp) override {
    ++counters_.calls;
    return done();
  }
  WorkPtr broadcast_async(at::Tensor, int root) override {
    TORCH_CHECK(root == 0, "broadcast root ", root, " outside a group of one rank");
    return done();
  }
  WorkPtr all_to_all_async(at::Tensor output, at::Tensor input) override {
    output.view({-1}).copy_(input.reshape({-1}));
    return done();
  }
  WorkPtr barrier_async() override { return done(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override {
    TORCH_CHECK(ranks == world_ranks_, "new_subgroup of a single-rank group must be that rank");
    return std::make_shared<SingleRankGroup>(world_ranks_.front());
  }

 private:
  static WorkPtr done() { return std::make_shared<DoneWork>(); }
  std::vector<int> world_ranks_;
};

}  // namespace

ProcessGroupPtr make_single_rank_group(int world_rank) {
  return std::make_shared<SingleRankGroup>(world_rank);
}

}  // namespace fsdp::detail
