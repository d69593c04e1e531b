// The CUDA path on a real device (ctest label `gpu`; scripts/gpu-check.sh): the NCCL process
// group at world 1, Gloo staging CUDA tensors, device memory statistics, training on cuda
// against the same run on the CPU (fsdp-train, every strategy that runs on CUDA, at world 1
// over NCCL and at worlds 2 and 3 sharing one GPU over Gloo), checkpoints across devices, and
// the refusal of what is not on CUDA yet. Every test skips with [fsdp-skip] where no CUDA
// device is visible.
#include "cuda/cuda_api.h"
#include "cuda/nccl_process_group.h"
#include "fsdp/comm.h"
#include "fsdp/memory.h"
#include "fsdp/trainer.h"
#include "launch_test_util.h"
#include "testing.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <signal.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using fsdp::testing::error_of;
using fsdp::testing::fsdp_train_summary;
using nlohmann::json;

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

// --- Gloo staging CUDA tensors (Note [Staging device tensors]).

TEST(GpuGloo, CollectivesOnCudaTensorsAcrossThreeRanks) {
  SKIP_WITHOUT_GPU();
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup& g) {
    c10::cuda::CUDAGuard guard(0);
    const int r = g.rank();
    at::Tensor x = at::full({5}, static_cast<double>(r + 1), on_gpu(at::kFloat));
    at::Tensor all = at::zeros({15}, on_gpu(at::kFloat));
    g.all_gather_into_tensor(all, x);
    EXPECT_EQ(all.sum().item<double>(), 5.0 * (1 + 2 + 3));
    EXPECT_TRUE(all.is_cuda());
    at::Tensor in = at::ones({6}, on_gpu(at::kBFloat16));
    at::Tensor out = at::zeros({2}, on_gpu(at::kBFloat16));
    g.reduce_scatter_tensor(out, in, fsdp::ReduceOp::kSum);
    EXPECT_EQ(out.sum().item<float>(), 6.0f);
    at::Tensor v = at::full({3}, static_cast<double>(r), on_gpu(at::kFloat));
    g.all_reduce(v, fsdp::ReduceOp::kMax);
    EXPECT_EQ(v.sum().item<float>(), 6.0f);
    at::Tensor b = at::full({2}, static_cast<double>(r + 10), on_gpu(at::kLong));
    g.broadcast(b, 2);
    EXPECT_EQ(b.sum().item<int64_t>(), 24);
    // In place: the output is the input.
    at::Tensor io = at::full({3}, 2.0, on_gpu(at::kFloat));
    g.all_reduce_async(io, fsdp::ReduceOp::kSum)->wait();
    EXPECT_EQ(io.sum().item<float>(), 18.0f);
    EXPECT_EQ(fsdp::all_gather_values(g, {r * 7}).at(2), 14);
  });
}

// --- Training on cuda against the same run on the CPU (fsdp-train, transformer-tiny, 10 steps,
// dropout 0: the same batches and initial weights on both).

std::vector<double> losses_of(const json& j) {
  return j.contains("losses") ? j["losses"].get<std::vector<double>>() : std::vector<double>{};
}

// fp32: relative 1e-5 per step (cuBLAS and the CPU's BLAS sum in different orders).
void expect_same_losses(const json& gpu, const json& cpu, double rel, const std::string& what) {
  const auto g = losses_of(gpu), c = losses_of(cpu);
  ASSERT_EQ(g.size(), 10u) << what;
  ASSERT_EQ(c.size(), 10u) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_TRUE(std::isfinite(g[i])) << what << " step " << i;
    EXPECT_NEAR(g[i], c[i], rel * std::abs(c[i])) << what << " step " << i;
  }
}

struct Parity {
  std::vector<std::string> flags;  // strategy and its options
  int devices;
  const char* backend;  // on cuda: nccl (world 1) or gloo (ranks sharing the GPU)
};

void run_parity(const Parity& p, const std::string& tag, double rel = 1e-5,
                const std::vector<std::string>& precision = {}) {
  std::vector<std::string> common = p.flags;
  common.insert(common.end(), {"--devices", std::to_string(p.devices)});
  common.insert(common.end(), precision.begin(), precision.end());
  std::vector<std::string> cpu = common, gpu = common;
  cpu.insert(cpu.end(), {"--accelerator", "cpu", "--backend", "gloo"});
  gpu.insert(gpu.end(), {"--accelerator", "cuda", "--backend", p.backend});
  const json on_cpu = fsdp_train_summary(cpu, tag + "_cpu");
  const json on_gpu = fsdp_train_summary(gpu, tag + "_gpu");
  std::string what = tag;
  for (const auto& f : gpu) what += " " + f;
  expect_same_losses(on_gpu, on_cpu, rel, what);
  // The CPU run of this CUDA build, on a machine with a GPU, has no device peak.
  for (const auto& mb : on_cpu["device_peak_mb"]) {
    EXPECT_TRUE(mb.is_null()) << what << ": the CPU run reports a device peak of " << mb;
  }
  ASSERT_TRUE(on_gpu.contains("device_peak_mb")) << what;
  for (const auto& mb : on_gpu["device_peak_mb"]) {
    ASSERT_FALSE(mb.is_null()) << what << ": a rank without a device peak";
    EXPECT_GT(mb.get<double>(), 0.0) << what;
  }
}

TEST(GpuTraining, WorldOneOverNcclMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "single"}, 1, "nccl"}, "single");
  run_parity({{"--strategy", "fsdp"}, 1, "nccl"}, "fsdp");
  run_parity({{"--strategy", "ddp"}, 1, "nccl"}, "ddp");
}

TEST(GpuTraining, TwoRanksSharingTheGpuOverGlooMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "fsdp_full_shard"}, 2, "gloo"}, "full_shard2");
  run_parity({{"--strategy", "fsdp_shard_grad_op"}, 2, "gloo"}, "shard_grad_op2");
  run_parity({{"--strategy", "fsdp_no_shard"}, 2, "gloo"}, "no_shard2");
  run_parity({{"--strategy", "ddp"}, 2, "gloo"}, "ddp2");
  run_parity({{"--strategy", "ddp", "--ddp-comm-hook", "fp16_compress"}, 2, "gloo"}, "ddp_fp16");
}

TEST(GpuTraining, ThreeRanksSharingTheGpuOverGlooMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "fsdp_full_shard"}, 3, "gloo"}, "full_shard3");
  run_parity({{"--strategy", "fsdp_hybrid_shard", "--hybrid-shard-size", "3"}, 3, "gloo"},
             "hybrid3");
}

// bf16-mixed: the GPU's bf16 matmuls and the CPU's round differently; the bound is what 10 steps
// of a tiny model in bf16 allow (the loss moves by ~1e-1 over the run).
// ZeRO stages 1-3 in device memory (the DeepSpeed strategies without offload).
TEST(GpuTraining, ZeroStagesSharingTheGpuOverGlooMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "deepspeed_stage_1"}, 2, "gloo"}, "zero1_2");
  run_parity({{"--strategy", "deepspeed_stage_2"}, 2, "gloo"}, "zero2_2");
  run_parity({{"--strategy", "deepspeed_stage_3"}, 3, "gloo"}, "zero3_3");
}

TEST(GpuTraining, ZeroStagesAtWorldOneOverNcclMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "deepspeed_stage_2"}, 1, "nccl"}, "zero2_1");
  run_parity({{"--strategy", "deepspeed_stage_3"}, 1, "nccl"}, "zero3_1");
}

TEST(GpuTraining, Bf16MixedStaysCloseToTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "fsdp"}, 1, "nccl"}, "fsdp_bf16", 2e-2,
             {"--precision", "bf16-mixed"});
  run_parity({{"--strategy", "ddp"}, 1, "nccl"}, "ddp_bf16", 2e-2,
             {"--precision", "bf16-mixed"});
}

TEST(GpuTraining, ActivationCheckpointingOnCudaMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  run_parity({{"--strategy", "fsdp", "--activation-checkpointing"}, 1, "nccl"}, "fsdp_ac");
}

// FULL_SHARD holds a quarter of the parameters, gradients and Adam state per rank at world 2
// (half of each), DDP all of it: FSDP's device peak is lower.
TEST(GpuMemory, FullShardDevicePeakIsBelowDdpsAtWorldTwo) {
  SKIP_WITHOUT_GPU();
  // (fsdp_train_summary already gives --max-steps 10; a flag given twice is an error.)
  const std::vector<std::string> common = {"--model", "transformer-small", "--devices", "2",
                                           "--accelerator", "cuda", "--backend", "gloo"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), common.begin(), common.end());
    return flags;
  };
  const json fsdp = fsdp_train_summary(with({"--strategy", "fsdp"}), "peak_fsdp");
  const json ddp = fsdp_train_summary(with({"--strategy", "ddp"}), "peak_ddp");
  ASSERT_EQ(fsdp["device_peak_mb"].size(), 2u);
  ASSERT_EQ(ddp["device_peak_mb"].size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_LT(fsdp["device_peak_mb"][r].get<double>(), ddp["device_peak_mb"][r].get<double>())
        << "rank " << r;
  }
}

// A checkpoint saved by ranks on the GPU resumes on the CPU at another world size, and the
// reverse; the resumed losses continue the uninterrupted run's.
TEST(GpuCheckpoint, SavedOnTheGpuResumesOnTheCpuAndBack) {
  SKIP_WITHOUT_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fsdp_gpu_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::vector<std::string> fsdp = {"--strategy", "fsdp", "--state-dict-type", "sharded"};
  auto flags = [&](std::vector<std::string> f) {
    f.insert(f.begin(), fsdp.begin(), fsdp.end());
    return f;
  };
  const json whole = fsdp_train_summary(flags({"--devices", "2", "--accelerator", "cpu",
                                               "--backend", "gloo"}), "ckpt_whole");
  const auto want = losses_of(whole);
  ASSERT_EQ(want.size(), 10u);
  // Saved on cuda (world 1, NCCL) at step 5, resumed on the CPU at world 2.
  const std::string a = (dir / "a").string();
  fsdp_train_summary(flags({"--devices", "1", "--accelerator", "cuda", "--backend", "nccl",
                            "--checkpoint-dir", a, "--save-every-n-steps", "5"}), "ckpt_a");
  const json on_cpu = fsdp_train_summary(
      flags({"--devices", "2", "--accelerator", "cpu", "--backend", "gloo", "--ckpt-path",
             a + "/step-5"}), "ckpt_a_resume");
  // Saved on the CPU (world 3) at step 5, resumed on cuda at world 2 (Gloo sharing the GPU).
  const std::string b = (dir / "b").string();
  fsdp_train_summary(flags({"--devices", "3", "--accelerator", "cpu", "--backend", "gloo",
                            "--checkpoint-dir", b, "--save-every-n-steps", "5"}), "ckpt_b");
  const json on_gpu = fsdp_train_summary(
      flags({"--devices", "2", "--accelerator", "cuda", "--backend", "gloo", "--ckpt-path",
             b + "/step-5"}), "ckpt_b_resume");
  fs::remove_all(dir);
  for (const json* resumed : {&on_cpu, &on_gpu}) {
    const auto got = losses_of(*resumed);
    ASSERT_EQ(got.size(), 5u);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[5 + i], 1e-4 * std::abs(want[5 + i])) << "resumed step " << 6 + i;
    }
  }
}

// What is not on CUDA yet is one clear error, never a silent CPU fallback.
TEST(GpuTrainer, WhatIsNotOnCudaYetIsRefused) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::vector<std::string> flags;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{
           {{"--strategy", "deepspeed_stage_2_offload"}, "not on CUDA yet"},
           {{"--strategy", "fsdp", "--optimizer", "cpu_adam"}, "not on CUDA"},
           {{"--strategy", "fsdp", "--offload-optimizer-device", "cpu"}, "not on CUDA yet"},
       }) {
    std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--model",
                                     "transformer-tiny", "--data", "synthetic", "--max-steps",
                                     "1", "--no-progress-bar", "--accelerator", "cuda"};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const auto r = fsdp::testing::run_process(argv, {}, 120);
    std::string what;
    for (const auto& f : c.flags) what += f + " ";
    EXPECT_NE(r.exit_code, 0) << what;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << what << ": " << r.err;
  }
}

// With dropout on the GPU, a run resumed from its checkpoint draws the same masks as the run
// that never stopped: each rank's CUDA generator is saved and restored (Note [Per-rank RNG
// state] in src/ckpt/checkpoint.cpp). World 2 over Gloo, both ranks on the one GPU.
TEST(GpuCheckpoint, DropoutResumesExactlyFromTheCudaGenerator) {
  SKIP_WITHOUT_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fsdp_gpu_rng_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto run = [&](const std::string& tag, std::vector<std::string> extra) {
    std::vector<std::string> argv = {
        fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--data",
        "synthetic", "--dropout", "0.2", "--seed", "7", "--max-steps", "10", "--no-progress-bar",
        "--strategy", "fsdp", "--state-dict-type", "sharded", "--devices", "2", "--accelerator",
        "cuda", "--backend", "gloo", "--default-root-dir", (dir / tag / "logs").string(),
        "--summary-json", (dir / tag / "summary.json").string()};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = fsdp::testing::run_process(argv, {}, 300);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream f(dir / tag / "summary.json");
    return f.good() ? losses_of(json::parse(f)) : std::vector<double>{};
  };
  const auto whole = run("whole", {});
  const std::string ckpt = (dir / "ckpt").string();
  run("first", {"--checkpoint-dir", ckpt, "--save-every-n-steps", "5"});
  const auto resumed = run("resumed", {"--ckpt-path", ckpt + "/step-5"});
  fs::remove_all(dir);
  ASSERT_EQ(whole.size(), 10u);
  ASSERT_EQ(resumed.size(), 5u);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_DOUBLE_EQ(resumed[i], whole[5 + i]) << "resumed step " << 6 + i;
  }
}

// The device's memory is the budget of model state on a GPU: the dry run plans against the
// driver's total divided by the ranks sharing the device, as setup checks it.
TEST(GpuMemory, DryRunPlansAgainstTheDevicesMemory) {
  SKIP_WITHOUT_GPU();
  const auto info = fsdp::detail::device_memory_info(0);
  ASSERT_TRUE(info.has_value());
  const std::string out_json = (std::filesystem::temp_directory_path() /
                                ("fsdp_gpu_dry_" + std::to_string(::getpid()) + ".json")).string();
  const auto r = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-train"), "--dry-run", "--model", "transformer-1b",
       "--accelerator", "cuda", "--backend", "gloo", "--devices", "8", "--summary-json",
       out_json}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(out_json);
  const json j = json::parse(f);
  std::filesystem::remove(out_json);
  EXPECT_EQ(j["budget"]["bytes"].get<int64_t>(), info->total_bytes / 8) << r.out;
  EXPECT_NE(j["budget"]["what"].get<std::string>().find("cuda:0's memory"), std::string::npos);
  for (const auto& row : j["strategies"]) {
    // transformer-1b: DDP holds ~16 GB of state per rank, more than an eighth of an 80 or 141
    // GB device; FULL_SHARD over 8 ranks ~2 GB.
    if (row["name"] == "ddp") EXPECT_FALSE(row["fits"].get<bool>()) << r.out;
    if (row["name"] == "fsdp FULL_SHARD") EXPECT_TRUE(row["fits"].get<bool>()) << r.out;
  }
  EXPECT_NE(r.out.find("NO (setup refuses it)"), std::string::npos) << r.out;
}

// Note [Deferred init onto the device]: at 2+ ranks FULL_SHARD builds each layer on the host and
// sends only its shards to the device, so the host never holds the model (about 400 MB of fp32
// parameters here: 8 layers of 12.6M) and the losses are the CPU run's.
TEST(GpuInit, DeferredInitSendsShardsToTheDeviceLayerByLayer) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::string> model = {"--model", "custom", "--ninp", "1024", "--nhead", "8",
                                          "--nhid", "4096", "--nlayers", "8", "--vocab-size",
                                          "1024", "--batch-size", "2", "--block-size", "16"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), model.begin(), model.end());
    return flags;
  };
  const std::vector<std::string> gpu = {"--strategy", "fsdp", "--devices", "2", "--accelerator",
                                        "cuda", "--backend", "gloo"};
  const json deferred = fsdp_train_summary(with(gpu), "deferred_gpu");
  const json on_cpu = fsdp_train_summary(
      with({"--strategy", "fsdp", "--devices", "2", "--accelerator", "cpu", "--backend", "gloo"}),
      "deferred_cpu");
  expect_same_losses(deferred, on_cpu, 1e-5, "deferred init on cuda vs cpu");
  const double full_mb = deferred["params"].get<double>() * 4 / 1048576.0;
  ASSERT_GT(full_mb, 300.0);
  for (const auto& mb : deferred["setup_peak_alloc_mb"]) {
    EXPECT_LT(mb.get<double>(), 0.25 * full_mb) << "host setup peak vs the whole model";
  }
}

// A rank that stops (SIGSTOP) while its peers wait in a collective on CUDA tensors (Gloo staging
// them, both ranks on the one GPU) is named at the collective timeout, and the job ends: the
// timeout and culprit machinery of Note [Collective timeouts] holds on the device path.
TEST(GpuGloo, StoppedRankInACudaCollectiveIsNamedAndTheJobEnds) {
  SKIP_WITHOUT_GPU();
  namespace launch = fsdp::testing::launch;
  const auto r = fsdp::testing::run_process(
      {launch::helper(), "--devices", "2", "--backend", "gloo", "--collective", "--cuda",
       "--fail-rank", "1", "--how", "stop", "--survivor-wait", "120"},
      {{"FSDP_COLLECTIVE_TIMEOUT_S", "3"}}, 60);
  const int64_t ended_ms = launch::now_ms();
  const std::vector<int> pids = launch::printed_pids(r.out);
  for (int pid : pids) {
    if (!launch::gone_within(pid, 1.0)) {
      ADD_FAILURE() << "pid " << pid << " survived";
      ::kill(pid, SIGKILL);  // never leave a stopped rank behind
    }
  }
  SCOPED_TRACE("stdout:\n" + r.out + "\nstderr:\n" + r.err);
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("rank 1 has not been heard from"), std::string::npos);
  EXPECT_NE(r.out.find("rank 0 joined the group"), std::string::npos) << "the CUDA all-reduce ran";
  const int64_t stopped_ms = launch::failed_at_ms(r.out, 1);
  ASSERT_GT(stopped_ms, 0);
  EXPECT_LT(static_cast<double>(ended_ms - stopped_ms) / 1000.0, 3 + 5);  // timeout + 5 s
}
