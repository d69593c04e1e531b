// The CUDA path on a real device (ctest label `gpu`; scripts/gpu-check.sh): the NCCL process
// group at world 1, device memory statistics, and the Trainer's refusal of what is not on CUDA
// yet. Every test skips with [fsdp-skip] where no CUDA device is visible.
#include "cuda/cuda_api.h"
#include "cuda/nccl_process_group.h"
#include "fsdp/comm.h"
#include "fsdp/memory.h"
#include "fsdp/trainer.h"
#include "testing.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

using fsdp::testing::error_of;

namespace {

#define SKIP_WITHOUT_GPU()                                                            \
  if (fsdp::detail::cuda_device_count() == 0) {                                       \
    GTEST_SKIP() << "[fsdp-skip] no CUDA device visible (cuda_device_count() == 0)"; \
  }

fsdp::ProcessGroupPtr world_one() {
  fsdp::detail::NcclGroupOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  return fsdp::detail::make_nccl_group(o);
}

at::TensorOptions on_gpu(at::ScalarType t) {
  return at::TensorOptions().dtype(t).device(at::Device(at::kCUDA, 0));
}

}  // namespace

TEST(GpuNccl, WorldOneCollectivesOnTheDevice) {
  SKIP_WITHOUT_GPU();
  auto g = world_one();
  ASSERT_EQ(g->backend(), "nccl");
  ASSERT_EQ(g->size(), 1);

  // Written on the current stream, read by the all-gather stream, read back on the current
  // stream after wait(): Note [NCCL streams] orders all three.
  at::Tensor x = at::empty({1 << 20}, on_gpu(at::kFloat));
  x.fill_(3.0);
  at::Tensor out = at::empty_like(x);
  g->all_gather_into_tensor_async(out, x)->wait();
  EXPECT_EQ(out.sum().item<double>(), 3.0 * x.numel());
  EXPECT_EQ(g->counters().all_gather_bytes, x.nbytes());

  at::Tensor rs_in = at::arange(6, on_gpu(at::kFloat));
  at::Tensor rs_out = at::empty({6}, on_gpu(at::kFloat));
  g->reduce_scatter_tensor(rs_out, rs_in, fsdp::ReduceOp::kAvg);
  EXPECT_TRUE(at::equal(rs_out, rs_in));

  at::Tensor ints = at::tensor({5, -7}, at::kLong).to(at::Device(at::kCUDA, 0));
  g->all_reduce(ints, fsdp::ReduceOp::kAvg);  // SUM then truncating division by 1
  EXPECT_EQ(ints.cpu()[1].item<int64_t>(), -7);
  at::Tensor bf = at::full({4}, 1.5, on_gpu(at::kBFloat16));
  g->all_reduce(bf, fsdp::ReduceOp::kMax);
  EXPECT_EQ(bf.sum().item<float>(), 6.0f);

  at::Tensor b = at::full({3}, 2.0, on_gpu(at::kHalf));
  g->broadcast(b, 0);
  EXPECT_EQ(b.sum().item<float>(), 6.0f);

  at::Tensor a2a_in = at::arange(4, on_gpu(at::kInt));
  at::Tensor a2a_out = at::zeros({4}, on_gpu(at::kInt));
  g->all_to_all(a2a_out, a2a_in);
  EXPECT_TRUE(at::equal(a2a_out, a2a_in));
  g->barrier();

  auto sub = g->new_subgroup({0});
  ASSERT_NE(sub, nullptr);
  at::Tensor s = at::ones({2}, on_gpu(at::kFloat));
  sub->all_reduce(s);
  EXPECT_EQ(s.sum().item<float>(), 2.0f);
}

TEST(GpuNccl, HostTensorsAreRefusedWithTheDevice) {
  SKIP_WITHOUT_GPU();
  auto g = world_one();
  at::Tensor cpu = at::ones({4});
  const std::string e = error_of([&] { g->all_reduce(cpu); });
  EXPECT_NE(e.find("is on cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("cuda:0"), std::string::npos) << e;
}

TEST(GpuNccl, InitProcessGroupAtWorldOne) {
  SKIP_WITHOUT_GPU();
  fsdp::ProcessGroupOptions o;
  o.backend = "nccl";
  o.rank = 0;
  o.world_size = 1;
  auto g = fsdp::init_process_group(o);
  EXPECT_EQ(g->backend(), "nccl");
  EXPECT_EQ(fsdp::world_group(), g);
  at::Tensor t = at::ones({8}, on_gpu(at::kFloat));
  g->all_reduce(t);
  EXPECT_EQ(t.sum().item<float>(), 8.0f);
  fsdp::destroy_process_group();
  EXPECT_EQ(fsdp::world_group(), nullptr);
}

TEST(GpuMemory, DevicePeakIsTheCachingAllocatorsPeak) {
  SKIP_WITHOUT_GPU();
  c10::cuda::CUDAGuard guard(0);
  fsdp::detail::reset_device_peak(0);
  const int64_t bytes = int64_t{64} << 20;
  {
    at::Tensor big = at::empty({bytes}, on_gpu(at::kByte));
    auto s = fsdp::detail::device_memory_stats(0);
    ASSERT_TRUE(s.has_value());
    EXPECT_GE(s->peak_allocated, bytes);
    EXPECT_GE(s->current_allocated, bytes);
    const auto ref = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    EXPECT_EQ(s->peak_allocated, ref.allocated_bytes[0].peak);
  }
  const auto after = fsdp::detail::device_memory_stats(0);
  EXPECT_GE(after->peak_allocated, bytes);  // the peak stays after the free
  EXPECT_LT(after->current_allocated, bytes);
  const std::string summary = fsdp::memory_summary();
  EXPECT_NE(summary.find("device peak"), std::string::npos) << summary;
}

TEST(GpuTrainer, TrainingOnCudaIsRefusedAsNotOnCudaYet) {
  SKIP_WITHOUT_GPU();
  for (const char* accelerator : {"cuda", "gpu", "auto"}) {
    const std::string e = error_of([&] {
      fsdp::TrainerOptions o;
      o.accelerator = accelerator;
      fsdp::Trainer t(o);
    });
    EXPECT_NE(e.find("not on CUDA yet"), std::string::npos) << accelerator << ": " << e;
    EXPECT_NE(e.find("cuda:0"), std::string::npos) << accelerator << ": " << e;
  }
}
