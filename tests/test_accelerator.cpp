// Device selection (src/common/device_choice.h) and the CUDA path's presence in a build: the
// rules of a CUDA build are checked here too, with its facts given as arguments; what needs a
// GPU is in tests/gpu/.
#include "common/device_choice.h"
#include "cuda/cuda_api.h"
#include "fsdp/comm.h"
#include "fsdp/memory.h"
#include "fsdp/trainer.h"
#include "memory/state_budget.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <utility>
#include <vector>

using fsdp::detail::choose_device;
using fsdp::detail::DeviceFacts;
using fsdp::testing::error_of;

namespace {

const DeviceFacts kCpuBuild{false, 0};
const DeviceFacts kOneGpu{true, 1};
const DeviceFacts kFourGpus{true, 4};

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(Accelerator, CpuBuildRefusesCudaAndNamesTheBuildPage) {
  for (const char* name : {"cuda", "gpu"}) {
    const std::string e = error_of([&] { choose_device(name, 0, 1, "gloo", kCpuBuild); });
    EXPECT_TRUE(has(e, "has no CUDA")) << e;
    EXPECT_TRUE(has(e, "docs/gpu.md")) << e;
    EXPECT_TRUE(has(e, "accelerator='cpu'")) << e;
  }
  EXPECT_FALSE(choose_device("auto", 0, 1, "gloo", kCpuBuild).cuda);
  EXPECT_FALSE(choose_device("cpu", 0, 1, "gloo", kOneGpu).cuda);
  EXPECT_FALSE(choose_device("auto", 0, 1, "gloo", DeviceFacts{true, 0}).cuda);
  const std::string e = error_of([] { choose_device("tpu", 0, 1, "gloo", kOneGpu); });
  EXPECT_TRUE(has(e, "unknown accelerator 'tpu'")) << e;
  EXPECT_TRUE(has(e, "'gpu'")) << e;  // lists the valid names
}

TEST(Accelerator, CudaBuildWithoutVisibleDeviceFailsClearly) {
  const std::string e = error_of([] { choose_device("cuda", 0, 1, "gloo", DeviceFacts{true, 0}); });
  EXPECT_TRUE(has(e, "no CUDA device is visible")) << e;
  EXPECT_TRUE(has(e, "CUDA_VISIBLE_DEVICES")) << e;
}

TEST(Accelerator, RankUsesLocalRankModuloVisibleDevices) {
  for (int local = 0; local < 8; ++local) {
    const auto c = choose_device("gpu", local, 8, "gloo", kFourGpus);
    EXPECT_TRUE(c.cuda);
    EXPECT_EQ(c.index, local % 4) << "local rank " << local;
  }
  const auto c = choose_device("auto", 2, 3, "nccl", kFourGpus);
  EXPECT_TRUE(c.cuda);
  EXPECT_EQ(c.index, 2);
  EXPECT_TRUE(c.notice.empty()) << c.notice;  // as many devices as ranks: nothing to say
}

TEST(Accelerator, SharedDevicesAllowedOverGlooAndMpiRefusedOverNccl) {
  for (const char* backend : {"gloo", "mpi", "auto"}) {
    const auto c = choose_device("cuda", 2, 3, backend, kOneGpu);
    EXPECT_EQ(c.index, 0);
    EXPECT_TRUE(has(c.notice, "3 ranks share 1 CUDA device")) << backend << ": " << c.notice;
  }
  const std::string e = error_of([] { choose_device("cuda", 1, 3, "nccl", kOneGpu); });
  EXPECT_TRUE(has(e, "NCCL allows one rank per device")) << e;
  EXPECT_TRUE(has(e, "Duplicate GPU detected")) << e;
  EXPECT_TRUE(has(e, "'gloo'")) << e;
}

// The Trainer of this build: CUDA refused with the build's reason; "auto" trains on CPU here.
TEST(Accelerator, TrainerInThisBuild) {
  if (fsdp::detail::cuda_built()) {
    GTEST_SKIP() << "[fsdp-skip] a CUDA build: tests/gpu/ checks its Trainer";
  }
  const std::string e = error_of([] {
    fsdp::TrainerOptions o;
    o.accelerator = "gpu";
    fsdp::Trainer t(o);
  });
  EXPECT_TRUE(has(e, "accelerator 'gpu'")) << e;
  EXPECT_TRUE(has(e, "has no CUDA")) << e;
  EXPECT_TRUE(has(e, "docs/gpu.md")) << e;
  EXPECT_EQ(error_of([] {
              fsdp::TrainerOptions o;
              o.accelerator = "auto";
              fsdp::Trainer t(o);
            }),
            "");
}

TEST(Accelerator, NcclBackendInCpuBuildNamesTheCudaBuild) {
  if (fsdp::detail::cuda_built()) GTEST_SKIP() << "[fsdp-skip] a CUDA build";
  EXPECT_EQ(fsdp::detail::cuda_device_count(), 0);
  EXPECT_FALSE(fsdp::detail::device_memory_stats().has_value());
  const std::string e = error_of([] {
    fsdp::ProcessGroupOptions o;
    o.backend = "nccl";
    o.rank = 0;
    o.world_size = 1;
    fsdp::init_process_group(o);
  });
  EXPECT_TRUE(has(e, "backend 'nccl'")) << e;
  EXPECT_TRUE(has(e, "has no CUDA")) << e;
  EXPECT_TRUE(has(e, "docs/gpu.md")) << e;
  EXPECT_EQ(fsdp::world_group(), nullptr);
}

// Note [CUDA type-check] in cmake/cuda.cmake: a CPU build compiles every src/cuda/*.cpp.
TEST(Accelerator, CpuBuildTypeChecksEveryCudaSource) {
#if FSDP_CUDA_TYPECHECK
  namespace fs = std::filesystem;
  const fs::path build = fs::path(FSDP_BIN_DIR).parent_path();
  // The CUDA path's sources, and the GPU tests (tests/CMakeLists.txt).
  const std::vector<std::pair<fs::path, fs::path>> checked = {
      {fs::path(FSDP_SOURCE_DIR) / "src/cuda", build / "CMakeFiles/fsdp_cuda_typecheck.dir/src/cuda"},
      {fs::path(FSDP_SOURCE_DIR) / "tests/gpu",
       build / "tests/CMakeFiles/fsdp_gpu_tests_typecheck.dir/gpu"}};
  int n = 0;
  for (const auto& [sources, objects] : checked) {
    for (const auto& entry : fs::directory_iterator(sources)) {
      if (entry.path().extension() != ".cpp") continue;
      ++n;
      const fs::path object = objects / (entry.path().filename().string() + ".o");
      ASSERT_TRUE(fs::exists(object)) << object << " is missing: " << entry.path()
                                      << " is not type-checked";
      EXPECT_GE(fs::last_write_time(object), fs::last_write_time(entry.path()))
          << object << " is older than its source";
    }
  }
  EXPECT_GE(n, 3);
#else
  GTEST_SKIP() << "[fsdp-skip] this build does not type-check the CUDA sources (a CUDA build, "
                  "or no CUDA toolkit / nccl.h at configure time: see the configure output)";
#endif
}

// Note [Model-state budget]: on a GPU the budget of a rank's model state is the device's total
// memory over the local ranks that share it (rank r on r % GPUs); on the CPU, the memory budget.
TEST(Accelerator, ModelStateBudgetIsTheDevicesShareOrTheHostBudget) {
  using fsdp::detail::ranks_sharing_device;
  EXPECT_EQ(ranks_sharing_device(3, 2, 0), 2);  // ranks 0 and 2
  EXPECT_EQ(ranks_sharing_device(3, 2, 1), 1);
  EXPECT_EQ(ranks_sharing_device(8, 1, 0), 8);
  EXPECT_EQ(ranks_sharing_device(2, 4, 3), 0);
  EXPECT_EQ(ranks_sharing_device(8, 8, 5), 1);

  const int64_t gib = int64_t(1) << 30;
  const c10::Device cuda0(c10::kCUDA, 0);
  auto shared = fsdp::detail::device_state_budget(cuda0, 80 * gib, 2);
  EXPECT_EQ(shared.bytes, 40 * gib);
  EXPECT_EQ(shared.what, "cuda:0's memory (80.00 GiB, 2 ranks share it)");
  EXPECT_EQ(shared.more, "or fewer ranks per GPU");
  auto alone = fsdp::detail::device_state_budget(cuda0, 80 * gib, 1);
  EXPECT_EQ(alone.bytes, 80 * gib);
  EXPECT_EQ(alone.what, "cuda:0's memory (80.00 GiB)");

  const int64_t before = fsdp::memory_budget();
  fsdp::set_memory_budget(3 * gib);
  auto host = fsdp::model_state_budget(c10::Device(c10::kCPU), 2);
  EXPECT_EQ(host.bytes, 3 * gib);
  EXPECT_EQ(host.what, "the memory budget");
  if (!fsdp::detail::cuda_built()) {  // no device to ask: no device budget
    EXPECT_EQ(fsdp::model_state_budget(cuda0, 1).bytes, 0);
  }
  fsdp::set_memory_budget(0);  // FSDP_MEMORY_BUDGET=0: neither
  EXPECT_EQ(fsdp::model_state_budget(c10::Device(c10::kCPU), 2).bytes, 0);
  EXPECT_EQ(fsdp::model_state_budget(cuda0, 1).bytes, 0);
  fsdp::set_memory_budget(before);
}
