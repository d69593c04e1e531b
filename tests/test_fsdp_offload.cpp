// FSDPStrategy's OffloadPolicy (include/fsdp/offload.h): the disk tier reached through
// FSDPOptions::offload_policy, tested as ZeRO-3's is (test_disk_offload.cpp): parameters and
// optimizer state on disk, or only the optimizer state, against a single process at worlds 2
// and 3 on Gloo and MPI (losses and final parameters within 1e-5), with the swap files present
// during training and gone after; and every policy that cannot work refused with one sentence.
// Checkpoints of these runs are tested in test_checkpoint.cpp (Checkpoint.Fsdp*OnDisk*).
#include "disk_test_util.h"
#include "fsdp/fsdp_strategy.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <string>

namespace fs = std::filesystem;
using fsdp::testing::LoopConfig;
using fsdp::testing::TinyLM;

namespace {

// The disk tier over transformer-tiny: several sub-groups and split parameters, every unit on
// disk, the swap files under root/job.
fsdp::FSDPOptions fsdp_on_disk(const std::string& root, const std::string& job, bool params) {
  fsdp::FSDPOptions o;
  o.auto_wrap_policy =
      fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  o.offload_policy = fsdp::OffloadPolicy::nvme(root, params);
  o.offload_policy.disk.job = job;
  o.offload_policy.disk.sub_group_size = 5000;
  o.offload_policy.disk.aio.block_size = 8192;
  o.offload_policy.disk.aio.queue_depth = 4;
  o.offload_policy.disk.params_buffer_count = 3;
  o.offload_policy.disk.params_buffer_size = 1000000;
  o.offload_policy.disk.max_in_cpu = 0;
  return o;
}

std::shared_ptr<fsdp::FSDPStrategy> connected(const fsdp::FSDPOptions& o) {
  return fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
}

// Parameters and optimizer state on disk. FULL_SHARD with deferred init (the default at 2+
// ranks) builds every unit sharded inside configure_model; SHARD_GRAD_OP without it shards the
// whole model at setup.
void params_on_disk_parity(int world, const std::string& backend, fsdp::ShardingStrategy ss,
                           bool deferred) {
  const std::string root = fsdp::testing::own_dir("fsdp-params-" + backend +
                                                  std::to_string(world) + to_string(ss));
  fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup&) {
    fsdp::FSDPOptions o = fsdp_on_disk(root, "job-fsdp", /*params=*/true);
    o.sharding_strategy = ss;
    o.deferred_init = deferred;
    fsdp::testing::expect_params_on_disk_parity<fsdp::FSDPStrategy>(
        [&] { return connected(o); }, root, "job-fsdp", /*whole_numel=*/0, deferred,
        [](fsdp::FSDPStrategy& s) { return s.num_deferred_units(); });
  });
  fsdp::testing::remove_own_dir(root);
}

}  // namespace

TEST(FsdpOffload, ParamsOnDiskParityGlooWorld2) {
  params_on_disk_parity(2, "gloo", fsdp::ShardingStrategy::kFullShard, true);
}
TEST(FsdpOffload, ParamsOnDiskParityMpiWorld3) {
  params_on_disk_parity(3, "mpi", fsdp::ShardingStrategy::kFullShard, true);
}
TEST(FsdpOffload, ParamsOnDiskShardGradOpEagerParityGlooWorld3) {
  params_on_disk_parity(3, "gloo", fsdp::ShardingStrategy::kShardGradOp, false);
}

// Only the optimizer state on disk (OffloadPolicy::nvme(path, false)): the parameters stay in
// RAM, Adam's moments stream from swap files that hold the last step's values.
TEST(FsdpOffload, OptimizerOnDiskParityGlooWorld2AndMpiWorld3) {
  for (const auto& [world, backend] : {std::pair{2, "gloo"}, std::pair{3, "mpi"}}) {
    const std::string root = fsdp::testing::own_dir(std::string("fsdp-optim-") + backend);
    fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup& pg) {
      const std::string rank_dir = root + "/job-optim/rank" + std::to_string(pg.rank());
      LoopConfig cfg;
      cfg.steps = 6;
      TinyLM ref;
      auto want = fsdp::testing::train_reference(ref, cfg);
      {
        TinyLM lm;
        auto strategy = connected(fsdp_on_disk(root, "job-optim", /*params=*/false));
        cfg.after_setup = [&](fsdp::Strategy&, fsdp::LightningModule&) {
          EXPECT_EQ(strategy->param_disk_plan(), nullptr);
          ASSERT_NE(strategy->disk_plan(), nullptr);
          EXPECT_GT(strategy->disk_plan()->num_sub_groups, 1);
          EXPECT_EQ(static_cast<int64_t>(strategy->swap_files().size()),
                    strategy->disk_plan()->num_sub_groups);
          for (auto& p : lm.parameters(true)) EXPECT_GT(p.storage().nbytes(), 0u);
        };
        auto got = fsdp::testing::train_with(*strategy, lm, cfg);
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(strategy->gather_full_params(), ref, 1e-5);
        strategy->flush_disk_tier();
        ASSERT_TRUE(fs::is_directory(rank_dir)) << rank_dir;
        for (const auto& f : strategy->swap_files()) {
          const fsdp::detail::SwapHeader h = fsdp::testing::read_swap_header(f);
          EXPECT_EQ(std::string(h.magic, 8), "FSDPSWP1") << f;
          EXPECT_EQ(h.generation, static_cast<uint64_t>(cfg.steps)) << f;
        }
        EXPECT_NE(strategy->streamed_optimizer_state(), nullptr);
      }
      EXPECT_FALSE(fs::exists(rank_dir)) << "swap directory left after the strategy ended";
    });
    fsdp::testing::remove_own_dir(root);
  }
}

// Policies that cannot work: one sentence each, naming the field and what to do.
TEST(FsdpOffload, ImpossiblePoliciesAreClearErrors) {
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "";
  };
  fsdp::FSDPOptions o;
  o.offload_policy.params = fsdp::OffloadDevice::kNvme;  // the optimizer still in RAM
  o.offload_policy.disk.path = "/tmp";
  std::string e = error_of([&] { fsdp::FSDPStrategy s(o); });
  EXPECT_NE(e.find("need the optimizer state on disk too"), std::string::npos) << e;

  o.offload_policy = fsdp::OffloadPolicy::nvme("");
  e = error_of([&] { fsdp::FSDPStrategy s(o); });
  EXPECT_NE(e.find("needs a path"), std::string::npos) << e;

  o.offload_policy = fsdp::OffloadPolicy::nvme("/tmp");
  o.offload_policy.disk.params_buffer_size = 0;
  e = error_of([&] { fsdp::FSDPStrategy s(o); });
  EXPECT_NE(e.find("buffer_size must be >= 1"), std::string::npos) << e;

  o.offload_policy = fsdp::OffloadPolicy::nvme("/tmp");
  o.sharding_strategy = fsdp::ShardingStrategy::kNoShard;
  e = error_of([&] { fsdp::FSDPStrategy s(o); });
  EXPECT_NE(e.find("NO_SHARD keeps every parameter whole"), std::string::npos) << e;

  e = error_of([] { fsdp::parse_offload_device("ssd"); });
  EXPECT_NE(e.find("valid: none, cpu, nvme"), std::string::npos) << e;
  EXPECT_EQ(fsdp::parse_offload_device("nvme"), fsdp::OffloadDevice::kNvme);
  EXPECT_EQ(std::string(fsdp::to_string(fsdp::OffloadDevice::kCpu)), "cpu");

  // At setup: parameters on disk at world 1 (nothing is sharded), and an optimizer the disk
  // tier cannot step.
  const std::string root = fsdp::testing::own_dir("fsdp-bad");
  fsdp::testing::run_ranks(1, "gloo", [&](fsdp::ProcessGroup&) {
    TinyLM lm;
    auto strategy = connected(fsdp_on_disk(root, "job-bad", /*params=*/true));
    fsdp::configure_model_with(*strategy, lm);
    const std::string msg = error_of([&] { strategy->setup_module(lm); });
    EXPECT_NE(msg.find("need at least 2 ranks"), std::string::npos) << msg;
  });
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    TinyLM lm;
    auto strategy = connected(fsdp_on_disk(root, "job-sgd", /*params=*/false));
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    std::vector<at::Tensor> params;
    for (auto& p : lm.parameters(true)) params.push_back(p);
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
    const std::string msg = error_of([&] { strategy->setup_optimizer(sgd); });
    EXPECT_NE(msg.find("Adam"), std::string::npos) << msg;
    // Without setup_optimizer the disk tier's step is missing: stepping is refused, not run
    // in RAM behind the policy's back.
    const std::string step = error_of([&] { strategy->optimizer_step(sgd); });
    EXPECT_NE(step.find("disk tier was not set up"), std::string::npos) << step;
  });
  fsdp::testing::remove_own_dir(root);
}
