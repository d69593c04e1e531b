// The disk tier (ZeRO-Infinity's NVMe offload of optimizer state): the io_uring swapper's
// round trip; NvmeAdam against torch's Adam/AdamW; ZeRO stage 2 and 3 with
// offload_optimizer_device "nvme" against a single process (losses within 1e-5 relative) at
// worlds 2 and 3 on Gloo and MPI, with the swap files present during training and gone after;
// I/O errors (read-only directory, file size limit as a full disk, a write failing mid-run, a
// corrupted or stale swap file); checkpoints streamed from the swap files (RAM peak, write errors;
// resume parity lives in test_checkpoint.cpp) and amsgrad's third moment.
#include "ckpt/layout.h"
#include "fsdp/checkpoint.h"
#include "fsdp/deepspeed.h"
#include "fsdp/memory.h"
#include "fully_shard_common.h"
#include "offload/aio.h"
#include "offload/nvme_adam.h"
#include "offload/swap_file.h"
#include "disk_test_util.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>

namespace fs = std::filesystem;
using fsdp::testing::LoopConfig;
using fsdp::testing::own_dir;
using fsdp::testing::read_swap_header;
using fsdp::testing::remove_own_dir;
using fsdp::testing::TinyLM;

namespace {

// Corrupts `file` in place: the byte at `offset` XOR `mask`.
void flip_bits(const std::string& file, std::streamoff offset, char mask) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(offset);
  char c = 0;
  io.read(&c, 1);
  c ^= mask;
  io.seekp(offset);
  io.write(&c, 1);
}

// A fresh directory for one test (the same path in every rank of it).
std::string test_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / "fsdp_disk_tests" / name;
  fs::create_directories(d);
  return d.string();
}

// Runs `body` in a forked child (process-wide settings such as rlimits stay there); returns the
// message of the exception it threw ("" when it returned normally). A failed expectation in
// the child fails the test through the exit code.
std::string in_child(const std::function<void()>& body) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg;
    try {
      body();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    if (msg.empty()) msg = "<none>";
    (void)!::write(fds[1], msg.data(), msg.size());
    ::close(fds[1]);
    ::_exit(::testing::Test::HasFailure() ? 3 : 0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child failed: " << out;
  return out == "<none>" ? "" : out;
}

// Root ignores directory permissions (CAP_DAC_OVERRIDE); drop that in this (child) process so a
// 0555 directory is read-only for it, as for any user.
void drop_dac_override() {
  if (::geteuid() != 0) return;
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  ASSERT_EQ(::syscall(SYS_capget, &hdr, data), 0);
  for (int cap : {CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH}) {
    data[cap / 32].effective &= ~(1u << (cap % 32));
  }
  ASSERT_EQ(::syscall(SYS_capset, &hdr, data), 0);
}

fsdp::DeepSpeedOptions nvme_options(int stage, const std::string& nvme_path) {
  fsdp::DeepSpeedOptions o;
  o.stage = stage;
  o.reduce_bucket_size = 6000;
  o.allgather_bucket_size = 9000;
  o.stage3_param_persistence_threshold = 64;
  o.offload_optimizer = true;
  o.offload_optimizer_device = "nvme";
  o.nvme_path = nvme_path;
  o.sub_group_size = 5000;  // transformer-tiny's partition: several sub-groups, split parameters
  o.aio.block_size = 8192;  // several requests per sub-group
  o.aio.queue_depth = 4;
  return o;
}

std::shared_ptr<fsdp::DeepSpeedStrategy> connected(const fsdp::DeepSpeedOptions& o) {
  return fsdp::testing::connect_to_world(std::make_shared<fsdp::DeepSpeedStrategy>(o));
}

void parity_with_disk(int world_size, const std::string& backend) {
  const std::string root = test_dir("parity-" + backend + std::to_string(world_size));
  fsdp::testing::run_ranks(world_size, backend, [&](fsdp::ProcessGroup& pg) {
    for (int stage : {2, 3}) {
      SCOPED_TRACE("ZeRO stage " + std::to_string(stage) + " with optimizer state on disk");
      const std::string job = "job-s" + std::to_string(stage);
      ::setenv("FSDP_JOB_ID", job.c_str(), 1);
      const std::string rank_dir = root + "/" + job + "/rank" + std::to_string(pg.rank());
      LoopConfig cfg;
      cfg.steps = 6;
      TinyLM ref;
      auto want = fsdp::testing::train_reference(ref, cfg);
      {
        TinyLM lm;
        auto strategy = connected(nvme_options(stage, root));
        cfg.after_setup = [&](fsdp::Strategy&, fsdp::LightningModule&) {
          ASSERT_NE(strategy->disk_plan(), nullptr);
          EXPECT_GT(strategy->disk_plan()->num_sub_groups, 1);
          EXPECT_EQ(static_cast<int64_t>(strategy->swap_files().size()),
                    strategy->disk_plan()->num_sub_groups);
        };
        auto got = fsdp::testing::train_with(*strategy, lm, cfg);
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(strategy->gather_full_params(), ref, 1e-5);
        // During training the state is in the swap files: they exist, are sealed records of
        // the last write (one per step, the last ones landed once flushed), and hold the plan's
        // bytes.
        strategy->flush_disk_tier();
        ASSERT_TRUE(fs::is_directory(rank_dir)) << rank_dir;
        int64_t bytes = 0;
        for (const auto& f : strategy->swap_files()) {
          ASSERT_TRUE(fs::exists(f)) << f;
          bytes += static_cast<int64_t>(fs::file_size(f));
          const fsdp::detail::SwapHeader h = read_swap_header(f);
          EXPECT_EQ(std::string(h.magic, 8), "FSDPSWP1") << f;
          EXPECT_EQ(h.generation, static_cast<uint64_t>(cfg.steps)) << f;
        }
        EXPECT_EQ(bytes, strategy->disk_plan()->disk_bytes);
      }
      EXPECT_FALSE(fs::exists(rank_dir)) << "swap directory left after the strategy ended";
    }
  });
}

// Standalone NvmeAdam over a few tensors (no process group).
struct Toy {
  std::vector<at::Tensor> params;
  std::shared_ptr<torch::optim::Optimizer> opt;
  explicit Toy(bool adamw, uint64_t seed = 3, bool amsgrad = false) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    for (int64_t n : {1000, 3001, 17}) {
      params.push_back(at::randn({n}, gen).set_requires_grad(true));
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    if (adamw) {
      groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                          std::make_unique<torch::optim::AdamWOptions>(
                              torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad)));
      groups.emplace_back(std::vector<at::Tensor>{params[2]},
                          std::make_unique<torch::optim::AdamWOptions>(
                              torch::optim::AdamWOptions(1e-2).weight_decay(0).amsgrad(amsgrad)));
      opt = std::make_shared<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-2));
    } else {
      groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                          std::make_unique<torch::optim::AdamOptions>(
                              torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(amsgrad)));
      groups.emplace_back(std::vector<at::Tensor>{params[2]},
                          std::make_unique<torch::optim::AdamOptions>(
                              torch::optim::AdamOptions(1e-2).amsgrad(amsgrad)));
      opt = std::make_shared<torch::optim::Adam>(groups, torch::optim::AdamOptions(1e-2));
    }
  }
  void set_grads(int step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
  }
};

fsdp::detail::NvmeAdam::Options toy_options(const std::string& dir, const std::string& job) {
  fsdp::detail::NvmeAdam::Options o;
  o.nvme_path = dir;
  o.job = job;
  o.sub_group_size = 700;  // 6 sub-groups, boundaries inside parameters
  o.aio.block_size = 4096;
  o.aio.queue_depth = 3;
  o.overlap_last_writes = true;  // reads, flush() and streams after writes left in flight
  return o;
}

}  // namespace

TEST(DiskOffload, SwapperRoundTripsEveryAioSetting) {
  const std::string dir = test_dir("swapper");
  fsdp::detail::SwapDir sd(dir, "job", 0);
  const int64_t bytes = 37 * 4096;
  const int fd = sd.create("x.swp", bytes);
  for (bool single : {false, true}) {
    for (bool overlap : {true, false}) {
      for (int par : {1, 3}) {
        fsdp::AioOptions a;
        a.block_size = 8192;
        a.queue_depth = 2;
        a.intra_op_parallelism = par;
        a.single_submit = single;
        a.overlap_events = overlap;
        fsdp::detail::AioEngine engine(a);
        fsdp::detail::AlignedBuffer out(bytes), in(bytes);
        for (int64_t i = 0; i < bytes; ++i) out.data()[i] = static_cast<char>((i * 31 + par) ^ single);
        engine.wait(engine.write(fd, out.data(), bytes, 0, sd.files()[0]));
        engine.wait(engine.read(fd, in.data(), bytes, 0, sd.files()[0]));
        EXPECT_EQ(std::memcmp(out.data(), in.data(), bytes), 0)
            << "single_submit " << single << " overlap_events " << overlap << " par " << par;
        EXPECT_EQ(engine.bytes_done(), 2 * bytes);
      }
    }
  }
  // Reading past the end of the reserved file is a short read: an error naming the file.
  fsdp::detail::AioEngine engine({});
  fsdp::detail::AlignedBuffer buf(2 * bytes);
  try {
    engine.wait(engine.read(fd, buf.data(), 2 * bytes, 0, sd.files()[0]));
    ADD_FAILURE() << "no error for a short read";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("short read"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(sd.files()[0]), std::string::npos) << e.what();
  }
}

TEST(DiskOffload, NvmeAdamMatchesTorchAdamAndAdamW) {
  const std::string dir = test_dir("adam");
  for (bool adamw : {false, true}) {
    Toy ref(adamw), disk(adamw);
    fsdp::detail::NvmeAdam nvme(*disk.opt, toy_options(dir, adamw ? "adamw" : "adam"));
    EXPECT_EQ(nvme.plan().num_sub_groups, 6);  // ceil(4018 / 700)
    for (int step = 0; step < 5; ++step) {
      ref.set_grads(step);
      disk.set_grads(step);
      if (step == 2) {  // a parameter without a gradient keeps its state and step count
        ref.params[2].mutable_grad() = at::Tensor();
        disk.params[2].mutable_grad() = at::Tensor();
      }
      ref.opt->step();
      nvme.step(*disk.opt);
    }
    EXPECT_TRUE(disk.opt->state().empty()) << "the torch optimizer must not hold the state";
    for (size_t i = 0; i < ref.params.size(); ++i) {
      EXPECT_TRUE(at::allclose(disk.params[i], ref.params[i], 1e-6, 1e-7))
          << (adamw ? "AdamW" : "Adam") << " parameter " << i << " max diff "
          << (disk.params[i] - ref.params[i]).abs().max().item<float>();
    }
    EXPECT_GT(nvme.io_bytes(), 0);
  }
  EXPECT_FALSE(fs::exists(dir + "/adam")) << "swap files left";
}

// amsgrad streams a third moment (max_exp_avg_sq) and matches torch; read_state hands out
// exactly torch's state (every statistic of every parameter), and write_state of torch's state
// into a fresh disk tier continues the run as torch does.
TEST(DiskOffload, AmsgradAndStreamedStateMatchTorch) {
  const std::string dir = test_dir("amsgrad");
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adam");
    Toy ref(false, 3, amsgrad), disk(false, 3, amsgrad), resumed(false, 3, amsgrad);
    fsdp::detail::NvmeAdam nvme(*disk.opt, toy_options(dir, "a"));
    EXPECT_EQ(nvme.plan().moments, amsgrad ? 3 : 2);
    EXPECT_EQ(nvme.stats().size(), amsgrad ? 3u : 2u);
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(nvme.files()[0])),
              4096 + (amsgrad ? 3 : 2) * 4096);  // 700 fp32 elements per moment, aligned
    // Steps [from, to) of torch's optimizer and of the disk tier: the same parameters.
    auto same_steps = [&](Toy& toy, fsdp::detail::NvmeAdam& tier, int from, int to) {
      for (int step = from; step < to; ++step) {
        ref.set_grads(step);
        toy.set_grads(step);
        ref.opt->step();
        tier.step(*toy.opt);
      }
      for (size_t i = 0; i < ref.params.size(); ++i) {
        EXPECT_TRUE(at::allclose(toy.params[i], ref.params[i], 1e-6, 1e-7))
            << "parameter " << i << " after step " << to;
      }
    };
    same_steps(disk, nvme, 0, 4);
    // read_state: every element of every statistic once, equal to torch's.
    std::map<std::pair<const c10::TensorImpl*, int>, at::Tensor> seen;
    nvme.read_state([&](const at::Tensor& p, int stat, int64_t offset, float* data, int64_t n) {
      at::Tensor& t = seen[{p.unsafeGetTensorImpl(), stat}];
      if (!t.defined()) t = at::full({p.numel()}, std::nanf(""), at::kFloat);
      EXPECT_TRUE(at::isnan(t.narrow(0, offset, n)).all().item<bool>()) << "visited twice";
      t.narrow(0, offset, n).copy_(at::from_blob(data, {n}, at::kFloat));
    });
    EXPECT_EQ(seen.size(), 3u * nvme.stats().size());
    for (size_t i = 0; i < ref.params.size(); ++i) {
      int64_t step = 0;
      auto want = fsdp::ckpt::optimizer_stats(*ref.opt, ref.params[i], &step);
      ASSERT_EQ(want.size(), nvme.stats().size());
      EXPECT_EQ(nvme.step_of(disk.params[i]), step);
      for (size_t k = 0; k < want.size(); ++k) {
        EXPECT_EQ(want[k].first, nvme.stats()[k]);
        const at::Tensor& got = seen[{disk.params[i].unsafeGetTensorImpl(), static_cast<int>(k)}];
        EXPECT_TRUE(at::allclose(got, want[k].second.reshape({-1}), 1e-5, 1e-8))
            << want[k].first << " of parameter " << i;
      }
    }
    // write_state: torch's state into a fresh disk tier (as load_checkpoint does), then both
    // take the same steps.
    for (size_t i = 0; i < ref.params.size(); ++i) {
      resumed.params[i].detach().copy_(ref.params[i].detach());
    }
    fsdp::detail::NvmeAdam again(*resumed.opt, toy_options(dir, "b"));
    for (size_t i = 0; i < ref.params.size(); ++i) {
      int64_t step = 0;
      fsdp::ckpt::optimizer_stats(*ref.opt, ref.params[i], &step);
      again.set_step(resumed.params[i], step);
    }
    std::map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < ref.params.size(); ++i) index[resumed.params[i].unsafeGetTensorImpl()] = i;
    again.write_state([&](const at::Tensor& p, int stat, int64_t offset, float* data, int64_t n) {
      int64_t step = 0;
      auto st = fsdp::ckpt::optimizer_stats(*ref.opt, ref.params[index.at(p.unsafeGetTensorImpl())], &step);
      std::memcpy(data, st.at(stat).second.reshape({-1}).narrow(0, offset, n).const_data_ptr<float>(),
                  static_cast<size_t>(n) * sizeof(float));
    });
    same_steps(resumed, again, 4, 7);
  }
  // amsgrad in some groups only is refused: the swap files hold the same moments for all.
  Toy mixed(true, 3, false);
  static_cast<torch::optim::AdamWOptions&>(mixed.opt->param_groups()[1].options()).amsgrad(true);
  try {
    fsdp::detail::NvmeAdam bad(*mixed.opt, toy_options(dir, "mixed"));
    ADD_FAILURE() << "mixed amsgrad accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad is on in some parameter groups"),
              std::string::npos) << e.what();
  }
}

TEST(DiskOffload, CorruptedOrStaleSwapFileIsDetected) {
  const std::string dir = test_dir("corrupt");
  for (const std::string how : {"flip", "stale", "truncate"}) {
    SCOPED_TRACE(how);
    Toy toy(true);
    fsdp::detail::NvmeAdam nvme(*toy.opt, toy_options(dir, "job-" + how));
    toy.set_grads(0);
    nvme.step(*toy.opt);
    nvme.flush();  // the step's last writes may still be in flight
    const std::string f = nvme.files()[3];
    const std::string saved = dir + "/saved.bin";
    fs::copy_file(f, saved, fs::copy_options::overwrite_existing);
    toy.set_grads(1);
    nvme.step(*toy.opt);
    nvme.flush();
    if (how == "flip") {  // one bit of exp_avg_sq flipped on disk
      flip_bits(f, 4096 + 3000, 0x10);
    } else if (how == "stale") {  // the previous step's record: a write that did not land
      fs::copy_file(saved, f, fs::copy_options::overwrite_existing);
    } else {
      fs::resize_file(f, 4096 * 2);
    }
    toy.set_grads(2);
    try {
      nvme.step(*toy.opt);
      ADD_FAILURE() << "a " << how << " swap file was used";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(f), std::string::npos) << msg;
      const char* want = how == "flip"    ? "data checksum"
                         : how == "stale" ? "older or newer write"
                                          : "short read";
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
    }
    // Stopped for good: no later step uses state it could not read.
    EXPECT_THROW(nvme.step(*toy.opt), c10::Error);
  }
}

TEST(DiskOffload, ReadOnlyDirectoryIsOneClearError) {
  const std::string dir = test_dir("readonly");
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                           fs::perms::group_exec | fs::perms::others_read |
                           fs::perms::others_exec);
  const std::string msg = in_child([&] {
    drop_dac_override();
    Toy toy(true);
    fsdp::detail::NvmeAdam nvme(*toy.opt, toy_options(dir, "job"));
  });
  fs::permissions(dir, fs::perms::owner_all);
  EXPECT_NE(msg.find("cannot create the swap directory '" + dir + "/job'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir + "/job"));
}

// A full disk, simulated without root: RLIMIT_FSIZE below the swap files' size (SIGXFSZ
// ignored, so the write returns EFBIG as a full disk returns ENOSPC). The reservation at setup
// fails with the path and the bytes needed, and nothing is left behind.
TEST(DiskOffload, FullDiskAtSetupNamesPathAndBytes) {
  const std::string dir = test_dir("full");
  const std::string msg = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{16384, 16384};
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    Toy toy(true);
    fsdp::detail::NvmeAdam nvme(*toy.opt, toy_options(dir, "job"));  // records of ~9.2 KB: ok
    auto big = toy_options(dir, "job-big");
    big.sub_group_size = 100000;  // one record of 4096 + 2 * 16 KiB > 16 KiB
    Toy toy2(true);
    fsdp::detail::NvmeAdam nvme2(*toy2.opt, big);
  });
  EXPECT_NE(msg.find("cannot reserve 36864 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir + "/job-big/rank0/optimizer.subgroup0.swp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("file size limit"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir + "/job-big")) << "swap files left after the error";
  EXPECT_FALSE(fs::exists(dir + "/job")) << "swap files left after the error";
}

// The disk fills up during training: the write fails with the file, the bytes and the errno
// text, the optimizer refuses to step again, and no checkpoint is published.
TEST(DiskOffload, WriteFailingMidRunStopsTrainingClearly) {
  const std::string dir = test_dir("midrun");
  const std::string msg = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    Toy toy(true);
    fsdp::detail::NvmeAdam nvme(*toy.opt, toy_options(dir, "job"));
    toy.set_grads(0);
    nvme.step(*toy.opt);
    nvme.flush();  // step 0's last writes land before the limit
    rlimit lim{4096, 4096};  // now every payload write goes past the limit
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    toy.set_grads(1);
    try {
      nvme.step(*toy.opt);
    } catch (const c10::Error& e) {
      EXPECT_THROW(nvme.step(*toy.opt), c10::Error);  // stopped for good
      throw;
    }
  });
  EXPECT_NE(msg.find("writing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("File too large"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir + "/job/rank0/optimizer.subgroup"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir + "/job"));
}

TEST(DiskOffload, ParityStage2And3GlooWorld2) { parity_with_disk(2, "gloo"); }
TEST(DiskOffload, ParityStage2And3GlooWorld3) { parity_with_disk(3, "gloo"); }
TEST(DiskOffload, ParityStage2And3MpiWorld2) { parity_with_disk(2, "mpi"); }
TEST(DiskOffload, ParityStage2And3MpiWorld3) { parity_with_disk(3, "mpi"); }

fsdp::DeepSpeedOptions params_nvme_options(const std::string& nvme_path) {
  fsdp::DeepSpeedOptions o = nvme_options(3, nvme_path);
  o.offload_parameters = true;
  o.offload_params_device = "nvme";
  o.params_buffer_count = 3;
  o.params_buffer_size = 1e6;
  o.max_in_cpu = 0;  // every unit on disk
  return o;
}

// Stage 3 with parameters and optimizer state on disk against a single process (Note
// [Parameters on disk]); persistence_threshold 0: no parameter stays whole, and the model is
// built sharded (deferred init), as a model larger than RAM needs.
void parity_params_on_disk(int world_size, const std::string& backend,
                           int64_t persistence_threshold = 64) {
  const std::string root = own_dir("params-" + backend + std::to_string(world_size) + "-t" +
                                   std::to_string(persistence_threshold));
  fsdp::testing::run_ranks(world_size, backend, [&](fsdp::ProcessGroup&) {
    auto options = params_nvme_options(root);
    options.stage3_param_persistence_threshold = persistence_threshold;
    ::setenv("FSDP_JOB_ID", "job-params", 1);
    fsdp::testing::expect_params_on_disk_parity<fsdp::DeepSpeedStrategy>(
        [&] { return connected(options); }, root, "job-params",
        /*whole_numel=*/persistence_threshold, /*expect_deferred=*/persistence_threshold == 0,
        [](fsdp::DeepSpeedStrategy& s) {
          fsdp::FSDPStrategy* engine = s.stage3_engine();
          return engine ? engine->num_deferred_units() : 0;
        });
  });
  remove_own_dir(root);
}

TEST(DiskOffload, ParamsOnDiskParityGlooWorld2) { parity_params_on_disk(2, "gloo"); }
TEST(DiskOffload, ParamsOnDiskParityGlooWorld3) { parity_params_on_disk(3, "gloo"); }
TEST(DiskOffload, ParamsOnDiskParityMpiWorld2) { parity_params_on_disk(2, "mpi"); }
TEST(DiskOffload, ParamsOnDiskParityMpiWorld3) { parity_params_on_disk(3, "mpi"); }
TEST(DiskOffload, ParamsOnDiskDeferredInitParityGlooWorld2) { parity_params_on_disk(2, "gloo", 0); }
TEST(DiskOffload, ParamsOnDiskDeferredInitParityMpiWorld3) { parity_params_on_disk(3, "mpi", 0); }

// Bad configurations of parameters on disk: one clear error each, at setup, on every rank.
TEST(DiskOffload, ParamsOnDiskBadConfigurations) {
  const std::string root = own_dir("params-bad");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    // A unit larger than buffer_size: the sizes and the flag to change.
    auto o = params_nvme_options(root);
    o.params_buffer_size = 100;
    TinyLM lm;
    auto strategy = connected(o);
    fsdp::configure_model_with(*strategy, lm);
    try {
      strategy->setup_module(lm);
      ADD_FAILURE() << "a unit larger than buffer_size was accepted";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("more than one buffer of buffer_size 100 elements"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("--params-buffer-size"), std::string::npos) << msg;
    }
  });
  // Without the optimizer on nvme (checked when the strategy is made, before any rank starts).
  auto o = params_nvme_options(root);
  o.offload_optimizer_device = "cpu";
  EXPECT_THROW(fsdp::DeepSpeedStrategy{o}, c10::Error);
  // One rank: nothing is sharded, so nothing is all-gathered from disk.
  fsdp::testing::run_ranks(1, "gloo", [&](fsdp::ProcessGroup&) {
    TinyLM lm;
    auto strategy = connected(params_nvme_options(root));
    fsdp::configure_model_with(*strategy, lm);
    try {
      strategy->setup_module(lm);
      ADD_FAILURE() << "parameters on disk at world 1 accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("need at least 2 ranks"), std::string::npos)
          << e.what();
    }
  });
  remove_own_dir(root);
}

// A model set up under a disk-tier strategy, stepped on this rank's share of the global batches.
struct DiskRun {
  TinyLM lm;
  std::shared_ptr<fsdp::DeepSpeedStrategy> strategy;
  std::shared_ptr<torch::optim::Optimizer> opt;
  int next_step = 0;
  explicit DiskRun(const fsdp::DeepSpeedOptions& o) : strategy(connected(o)) {
    lm.optimizer = "adamw";
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    opt = lm.configure_optimizers().optimizer;
    strategy->setup_optimizer(*opt);
  }
  void train(int steps) {
    LoopConfig cfg;
    const int64_t local = cfg.global_batch / strategy->world_size();
    for (int i = 0; i < steps; ++i, ++next_step) {
      fsdp::Batch g = fsdp::testing::global_batch(next_step, cfg.global_batch);
      strategy->pre_forward(lm, true);
      at::Tensor loss = lm.training_step(
          fsdp::testing::slice(g, strategy->rank() * local, local), next_step);
      strategy->backward(loss);
      strategy->post_backward(lm, true);
      strategy->optimizer_step(*opt);
      strategy->zero_grad(*opt);
    }
  }
  void save(const std::string& dir) {
    fsdp::TrainingProgress p;
    p.global_step = next_step;
    fsdp::save_checkpoint(dir, *strategy, lm, opt.get(), p, fsdp::StateDictType::kSharded);
  }
};

// Note [Streamed optimizer state]: saving and loading the moments of a disk-offloaded run
// stream them through the swap buffers, so the tracked peak of either grows by less than one
// sub-group's record while the state is many records; a full checkpoint is refused clearly.
TEST(DiskOffload, CheckpointStreamsOneSubGroupAtATime) {
  const std::string root = test_dir("ckpt-peak");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup& pg) {
    fsdp::install_tracking_allocator();
    for (int stage : {2, 3}) {
      SCOPED_TRACE("stage " + std::to_string(stage));
      const std::string ckpt = root + "/ckpt-s" + std::to_string(stage);
      auto o = nvme_options(stage, root);
      o.sub_group_size = 2048;
      const int64_t record = 4096 + 2 * 8192;  // header + two fp32 moments of 2048 elements
      int64_t state_bytes = 0;
      {
        DiskRun run(o);
        run.train(2);
        state_bytes = run.strategy->disk_plan()->state_numel * 8;
        ASSERT_GT(state_bytes, 4 * record) << "the bound would not tell a record from the state";
        const int64_t before = fsdp::memory_stats().current_bytes;
        fsdp::reset_peak_memory_stats();
        run.save(ckpt);
        const int64_t save_peak = fsdp::memory_stats().peak_bytes - before;
        std::cerr << "rank " << pg.rank() << " stage " << stage << ": state " << state_bytes
                  << " B, save peak +" << save_peak << " B\n";
        EXPECT_LE(save_peak, record);
        try {
          fsdp::save_checkpoint(ckpt + "-full", *run.strategy, run.lm, run.opt.get(), {},
                                fsdp::StateDictType::kFull);
          ADD_FAILURE() << "a full checkpoint of the disk tier was written";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("sharded format only"), std::string::npos)
              << e.what();
        }
      }
      EXPECT_FALSE(fs::exists(ckpt + "-full"));
      DiskRun resumed(o);
      const int64_t before = fsdp::memory_stats().current_bytes;
      fsdp::reset_peak_memory_stats();
      auto p = fsdp::load_checkpoint(ckpt, *resumed.strategy, resumed.lm, resumed.opt.get());
      const int64_t load_peak = fsdp::memory_stats().peak_bytes - before;
      std::cerr << "rank " << pg.rank() << " stage " << stage << ": load peak +" << load_peak
                << " B\n";
      EXPECT_EQ(p.global_step, 2);
      EXPECT_GT(load_peak, 0) << "nothing tracked: the test is blind";
      EXPECT_LE(load_peak, record);
    }
  });
}

// Note [Checkpoints of parameters on disk]: a save of a run with its parameters on disk holds at
// most two units' shards in RAM (plus one moment record streaming), reads the records without
// writing them, and leaves every shard on disk; a load writes each record once or twice (a unit
// whose parameters are not consecutive in the module's order is entered twice) and leaves them
// on disk too. A weights-only checkpoint in the full format gathers one parameter at a time and
// holds the trained weights.
TEST(DiskOffload, ParamsOnDiskCheckpointHoldsAtMostTwoUnits) {
  const std::string root = test_dir("params-ckpt-peak");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup& pg) {
    ::setenv("FSDP_JOB_ID", "job-params-ckpt", 1);
    fsdp::install_tracking_allocator();
    auto o = params_nvme_options(root);
    o.sub_group_size = 2048;
    const int64_t record = 4096 + 2 * 8192;  // header + two fp32 moments of 2048 elements
    const std::string ckpt = root + "/ckpt";
    auto on_disk = [](TinyLM& lm) {
      int64_t resident = 0, n = 0;
      for (auto& p : lm.parameters(true)) {
        if (p.numel() <= 64) continue;  // persistent: whole, in RAM
        ++n;
        if (p.storage().nbytes() > 0) ++resident;
      }
      EXPECT_GT(n, 4);
      return resident == 0;
    };
    auto generations = [](fsdp::DeepSpeedStrategy& s) {
      s.flush_disk_tier();
      std::vector<uint64_t> g;
      for (const auto& f : s.param_swap_files()) g.push_back(read_swap_header(f).generation);
      return g;
    };
    int64_t bound = 0;
    {
      DiskRun run(o);
      run.train(2);
      const fsdp::ParamDiskPlan* plan = run.strategy->param_disk_plan();
      ASSERT_NE(plan, nullptr);
      bound = 2 * plan->largest_unit_numel * 4 + record;
      ASSERT_GT(plan->numel_on_disk * 4, 2 * bound)
          << "the bound would not tell two units from the whole model";
      ASSERT_TRUE(on_disk(run.lm));
      const auto before_gen = generations(*run.strategy);
      const int64_t before = fsdp::memory_stats().current_bytes;
      fsdp::reset_peak_memory_stats();
      run.save(ckpt);
      const int64_t save_peak = fsdp::memory_stats().peak_bytes - before;
      std::cerr << "rank " << pg.rank() << ": " << plan->numel_on_disk * 4 << " B of shards on "
                << "disk in " << plan->units_on_disk << " units (largest "
                << plan->largest_unit_numel * 4 << " B), save peak +" << save_peak << " B\n";
      EXPECT_GT(save_peak, 0) << "nothing tracked: the test is blind";
      EXPECT_LE(save_peak, bound);
      EXPECT_TRUE(on_disk(run.lm)) << "the save left shards in RAM";
      EXPECT_EQ(generations(*run.strategy), before_gen) << "the save wrote parameter records";

      // Weights only, full format: one gathered parameter at a time, equal to the weights.
      fsdp::save_checkpoint(root + "/full", *run.strategy, run.lm, nullptr, {},
                            fsdp::StateDictType::kFull);
      EXPECT_TRUE(on_disk(run.lm)) << "the full save left shards in RAM";
      auto full = run.strategy->gather_full_params();
      if (pg.rank() == 0) {
        TinyLM plain;
        plain.configure_model();
        fsdp::load_weights(plain, root + "/full");
        auto saved = plain.named_parameters();
        ASSERT_EQ(full.size(), saved.size());
        for (const auto& [name, value] : full) {
          ASSERT_TRUE(saved.contains(name)) << name;
          EXPECT_TRUE(at::equal(saved[name], value)) << name;
        }
      }
      pg.barrier();
    }
    DiskRun resumed(o);
    const auto before_gen = generations(*resumed.strategy);
    const int64_t before = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    auto p = fsdp::load_checkpoint(ckpt, *resumed.strategy, resumed.lm, resumed.opt.get());
    const int64_t load_peak = fsdp::memory_stats().peak_bytes - before;
    std::cerr << "rank " << pg.rank() << ": load peak +" << load_peak << " B\n";
    EXPECT_EQ(p.global_step, 2);
    EXPECT_GT(load_peak, 0) << "nothing tracked: the test is blind";
    EXPECT_LE(load_peak, bound);
    EXPECT_TRUE(on_disk(resumed.lm)) << "the load left shards in RAM";
    const auto after_gen = generations(*resumed.strategy);
    ASSERT_EQ(after_gen.size(), before_gen.size());
    for (size_t i = 0; i < after_gen.size(); ++i) {
      EXPECT_TRUE(after_gen[i] == before_gen[i] + 1 || after_gen[i] == before_gen[i] + 2)
          << "record " << i << ": generation " << before_gen[i] << " -> " << after_gen[i];
    }
  });
  std::error_code ec;
  if (!fsdp::testing::in_child_rank()) fs::remove_all(root, ec);
}

// A write that fails during the save (the file size limit as a full disk; a read-only
// directory) is one clear error on every rank naming the checkpoint, nothing is published, the
// previous checkpoint stays and loads, and training goes on (the swap files are intact).
// `options(root)`: the disk tier's configuration, its swap files under root.
void write_error_publishes_nothing(
    const std::string& root,
    const std::function<fsdp::DeepSpeedOptions(const std::string&)>& options) {
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup& pg) {
    ::signal(SIGXFSZ, SIG_IGN);
    DiskRun run(options(root));
    const std::string ckpt = root + "/ckpt";
    run.train(1);
    run.save(ckpt);
    run.train(1);
    // Every swap write stays below the limit (their records were reserved at setup), every
    // checkpoint file goes past it.
    int64_t swap = 0;
    for (const auto& f : run.strategy->swap_files()) {  // both tiers' files
      swap = std::max<int64_t>(swap, static_cast<int64_t>(fs::file_size(f)));
    }
    ASSERT_GT(run.strategy->disk_plan()->state_numel * 4, swap);
    rlimit old{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    rlimit lim = old;
    lim.rlim_cur = static_cast<rlim_t>(swap);
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    try {
      run.save(ckpt);
      ADD_FAILURE() << "a save past the file size limit succeeded";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("[checkpoint] saving " + ckpt + " failed on rank " +
                         std::to_string(pg.rank())), std::string::npos) << msg;
      EXPECT_NE(msg.find("File too large"), std::string::npos) << msg;
      EXPECT_NE(msg.find("nothing was published"), std::string::npos) << msg;
    }
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
    pg.barrier();
    EXPECT_FALSE(fs::exists(ckpt + ".partial"));
    EXPECT_EQ(fsdp::inspect_checkpoint(ckpt).progress.global_step, 1);
    run.train(1);  // the swap files were only read: training goes on
    // The previous checkpoint loads (into the running disk tier) and the run continues from it.
    EXPECT_EQ(fsdp::load_checkpoint(ckpt, *run.strategy, run.lm, run.opt.get()).global_step, 1);
    run.train(1);

    // A read-only checkpoint directory: rank 0 cannot create it, every rank says so.
    const std::string ro = root + "/readonly";
    if (pg.rank() == 0) {
      fs::create_directories(ro);
      fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    }
    pg.barrier();
    drop_dac_override();
    try {
      run.save(ro + "/ckpt");
      ADD_FAILURE() << "a save into a read-only directory succeeded";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("saving " + ro + "/ckpt failed"), std::string::npos) << msg;
      if (pg.rank() == 0) {
        EXPECT_NE(msg.find("cannot create " + ro + "/ckpt.partial"), std::string::npos) << msg;
        EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
      } else {
        EXPECT_NE(msg.find("failed on 1 other rank(s)"), std::string::npos) << msg;
      }
    }
    pg.barrier();
    if (pg.rank() == 0) fs::permissions(ro, fs::perms::owner_all);
    EXPECT_FALSE(fs::exists(ro + "/ckpt"));
  });
}

TEST(DiskOffload, CheckpointWriteErrorPublishesNothing) {
  write_error_publishes_nothing(test_dir("ckpt-error"),
                                [](const std::string& root) { return nvme_options(2, root); });
}

// The same with the parameters on disk too: the unit a failed save was reading is released,
// its record untouched (Note [Checkpoints of parameters on disk]).
TEST(DiskOffload, ParamsOnDiskCheckpointWriteErrorPublishesNothing) {
  write_error_publishes_nothing(test_dir("params-ckpt-error"), params_nvme_options);
}

TEST(DiskOffload, OptionsAndConfig) {
  // Parameters on disk need the optimizer state on disk too (as DeepSpeed requires) and stage 3.
  fsdp::DeepSpeedOptions p;
  p.stage = 3;
  p.offload_parameters = true;
  p.offload_params_device = "nvme";
  p.nvme_path = "/tmp/x";
  try {
    fsdp::DeepSpeedStrategy s(p);
    ADD_FAILURE() << "offload_params_device nvme without the optimizer on nvme accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("need the optimizer state on disk too"),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offload_optimizer_device=\"nvme\""),
              std::string::npos) << e.what();
  }
  p.offload_optimizer = true;
  p.offload_optimizer_device = "nvme";
  EXPECT_NO_THROW(fsdp::DeepSpeedStrategy{p});
  p.stage = 2;
  EXPECT_THROW(fsdp::DeepSpeedStrategy{p}, c10::Error);
  // Lightning's name offloads both to nvme.
  auto named = fsdp::make_deepspeed_strategy("deepspeed_stage_3_offload_nvme");
  EXPECT_EQ(named->options().stage, 3);
  EXPECT_EQ(named->options().offload_params_device, "nvme");
  EXPECT_EQ(named->options().offload_optimizer_device, "nvme");
  // offload_param in the JSON config.
  auto c = fsdp::parse_deepspeed_config(R"({
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/y"},
      "offload_param": {"device": "nvme", "nvme_path": "/tmp/y", "buffer_count": 3,
                        "buffer_size": 5e5, "max_in_cpu": 0}}})");
  EXPECT_TRUE(c.offload_parameters);
  EXPECT_EQ(c.offload_params_device, "nvme");
  EXPECT_EQ(c.params_buffer_count, 3);
  EXPECT_EQ(c.params_buffer_size, 5e5);
  EXPECT_EQ(c.max_in_cpu, 0);
  EXPECT_NO_THROW(fsdp::DeepSpeedStrategy{c});
  // The JSON config: offload_optimizer on nvme with the aio block.
  auto o = fsdp::parse_deepspeed_config(R"({
    "zero_optimization": {"stage": 2, "sub_group_size": 1000,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 4,
                            "pin_memory": true},
      "offload_param": {"device": "none", "buffer_count": 6, "buffer_size": 1e7,
                        "max_in_cpu": 2e9}},
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2,
            "single_submit": true, "overlap_events": false}})");
  EXPECT_TRUE(o.offload_optimizer);
  EXPECT_EQ(o.offload_optimizer_device, "nvme");
  EXPECT_EQ(o.nvme_path, "/tmp/x");
  EXPECT_EQ(o.aio.block_size, 262144);
  EXPECT_EQ(o.aio.queue_depth, 16);
  EXPECT_EQ(o.aio.intra_op_parallelism, 2);
  EXPECT_TRUE(o.aio.single_submit);
  EXPECT_FALSE(o.aio.overlap_events);
  EXPECT_EQ(o.params_buffer_count, 6);
  EXPECT_EQ(o.max_in_cpu, 2e9);
  EXPECT_FALSE(o.offload_parameters);
  EXPECT_THROW(fsdp::parse_deepspeed_config(R"({"aio": {"block_sz": 1}})"), c10::Error);
  EXPECT_THROW(fsdp::parse_deepspeed_config(R"({"aio": {"queue_depth": "8"}})"), c10::Error);
}

// fsdp-train end to end: --offload-optimizer-device nvme trains the same losses as the state in
// RAM, with a lower tracked peak (the moments are on disk, three sub-group buffers in RAM), and
// leaves nothing under --nvme-path; --dry-run prints the per-rank plan.
TEST(DiskOffload, FsdpTrainStage2NvmeMatchesRamAndLowersPeak) {
  const std::string nvme = test_dir("cli");
  const std::vector<std::string> common = {"--devices", "2", "--backend", "gloo", "--strategy",
                                           "deepspeed_stage_2", "--vocab-size", "1024"};
  auto ram = fsdp::testing::fsdp_train_summary(common, "disk-ram");
  auto with = common;
  for (const char* f : {"--offload-optimizer-device", "nvme", "--nvme-path", nvme.c_str(),
                        "--sub-group-size", "4096"}) {
    with.emplace_back(f);
  }
  auto disk = fsdp::testing::fsdp_train_summary(with, "disk-nvme");
  ASSERT_TRUE(ram.contains("losses") && disk.contains("losses")) << ram << disk;
  const auto& a = ram["losses"];
  const auto& b = disk["losses"];
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i].get<double>(), a[i].get<double>(), 1e-5 * std::abs(a[i].get<double>()))
        << "step " << i;
  }
  // transformer-tiny at vocabulary 1024: ~109k parameters, a partition of ~55k: 0.42 MiB of
  // moments in RAM without offload, 3 x 36 KiB of sub-group buffers with it.
  for (size_t r = 0; r < 2; ++r) {
    const double pr = ram["peak_alloc_mb"][r].get<double>();
    const double pd = disk["peak_alloc_mb"][r].get<double>();
    std::cerr << "rank " << r << " tracked peak: RAM " << pr << " MB, disk tier " << pd << " MB\n";
    EXPECT_LT(pd, pr - 0.2) << "rank " << r;
  }
  EXPECT_TRUE(fs::is_empty(nvme)) << "swap files left under " << nvme;

  // A memory budget between the two peaks (and above both setups'): the disk tier trains under
  // it, the same run with the moments in RAM is refused by the tracking allocator.
  const double budget_mb = (ram["peak_alloc_mb"][0].get<double>() +
                            disk["peak_alloc_mb"][0].get<double>()) / 2;
  for (const char* key : {"setup_peak_alloc_mb", "peak_alloc_mb"}) {
    for (size_t r = 0; r < 2; ++r) {
      ASSERT_LT(disk[key][r].get<double>(), budget_mb) << key << " rank " << r;
    }
  }
  const std::map<std::string, std::string> env = {
      {"FSDP_MEMORY_BUDGET", std::to_string(static_cast<int64_t>(budget_mb * 1024 * 1024))}};
  auto run = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--model",
                                     "transformer-tiny", "--data", "synthetic", "--dropout", "0",
                                     "--seed", "7", "--max-steps", "10", "--no-progress-bar",
                                     "--default-root-dir", nvme + "/../cli-logs"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return fsdp::testing::run_process(argv, env);
  };
  const auto under = run(with);
  EXPECT_EQ(under.exit_code, 0) << "budget " << budget_mb << " MB\n" << under.err;
  const auto over = run(common);
  EXPECT_NE(over.exit_code, 0) << "the state in RAM fit the budget " << budget_mb << " MB";
  EXPECT_NE(over.err.find("budget"), std::string::npos) << over.err;
  EXPECT_TRUE(fs::is_empty(nvme)) << "swap files left under " << nvme;

  const auto dry = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--devices", "2",
       "--dry-run", "--offload-optimizer-device", "nvme", "--nvme-path", nvme});
  EXPECT_EQ(dry.exit_code, 0) << dry.out << dry.err;
  EXPECT_NE(dry.out.find("disk tier (offload_optimizer nvme), per rank"), std::string::npos)
      << dry.out;
  EXPECT_NE(dry.out.find("fits"), std::string::npos) << dry.out;
}

// fsdp-train end to end with parameters and optimizer state on disk: the same losses as
// stage 3 in RAM; under a memory budget smaller than this rank's model state in RAM (fp32
// parameter shard + gradient shard + two Adam moments = 16 bytes x parameters / ranks) the run
// trains with its tracked peak under the budget while the same run in RAM is refused; nothing
// is left under --nvme-path; --dry-run prints both plans. The model: 4 layers of width 256
// (units above the default persistence threshold of 1e5 elements), tiny batches so that
// parameters, not activations, dominate.
TEST(DiskOffload, FsdpTrainParamsOnDiskUnderBudget) {
  const std::string nvme = own_dir("cli");
  const std::string work = own_dir("cli-work");
  const std::vector<std::string> common = {
      "--model", "custom", "--nlayers", "4", "--ninp", "256", "--nhead", "4", "--nhid", "1024",
      "--vocab-size", "1024", "--batch-size", "1", "--block-size", "8", "--devices", "2",
      "--backend", "gloo", "--strategy", "deepspeed_stage_3", "--data", "synthetic",
      "--dropout", "0", "--seed", "7", "--max-steps", "10", "--no-progress-bar"};
  auto with = common;
  for (const char* f : {"--offload-optimizer-device", "nvme", "--offload-params-device", "nvme",
                        "--nvme-path", nvme.c_str(), "--sub-group-size", "16384",
                        "--params-buffer-count", "2", "--max-in-cpu", "0"}) {
    with.emplace_back(f);
  }
  auto train = [&](const std::vector<std::string>& flags, const std::string& tag,
                   const std::map<std::string, std::string>& env,
                   fsdp::testing::ProcResult* result) {
    std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--default-root-dir",
                                     work + "/logs-" + tag, "--summary-json",
                                     work + "/" + tag + ".json"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    *result = fsdp::testing::run_process(argv, env);
    nlohmann::json j = nlohmann::json::object();
    std::ifstream f(work + "/" + tag + ".json");
    if (result->exit_code == 0 && f.good()) j = nlohmann::json::parse(f);
    return j;
  };
  fsdp::testing::ProcResult r;
  auto ram = train(common, "ram", {}, &r);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto disk = train(with, "disk", {}, &r);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("parameters on disk (offload_param device nvme)"), std::string::npos)
      << r.err;
  ASSERT_TRUE(ram.contains("losses") && disk.contains("losses")) << ram << disk;
  const auto& a = ram["losses"];
  const auto& b = disk["losses"];
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i].get<double>(), a[i].get<double>(), 1e-5 * std::abs(a[i].get<double>()))
        << "step " << i;
  }
  EXPECT_TRUE(fs::is_empty(nvme)) << "swap files left under " << nvme;
  ASSERT_TRUE(disk.contains("disk_wait_seconds")) << disk;
  const double state_mb = 16.0 * disk["params"].get<double>() / 2 / 1048576.0;
  double disk_peak = 0;
  for (const char* key : {"setup_peak_alloc_mb", "peak_alloc_mb"}) {
    for (size_t k = 0; k < 2; ++k) disk_peak = std::max(disk_peak, disk[key][k].get<double>());
  }
  const double budget_mb = disk_peak * 1.1;
  std::cerr << "model state per rank in RAM " << state_mb << " MB; tracked peak: RAM "
            << ram["peak_alloc_mb"][0].get<double>() << " MB, disk " << disk_peak
            << " MB; budget " << budget_mb << " MB\n";
  ASSERT_LT(budget_mb, state_mb) << "the budget would not be smaller than the model state";
  const std::map<std::string, std::string> env = {
      {"FSDP_MEMORY_BUDGET", std::to_string(static_cast<int64_t>(budget_mb * 1024 * 1024))}};
  auto under = train(with, "under", env, &r);
  ASSERT_EQ(r.exit_code, 0) << "budget " << budget_mb << " MB\n" << r.err;
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_LT(under["peak_alloc_mb"][k].get<double>(), budget_mb) << "rank " << k;
  }
  train(common, "over", env, &r);
  EXPECT_NE(r.exit_code, 0) << "stage 3 in RAM fit the budget " << budget_mb << " MB";
  EXPECT_NE(r.err.find("budget"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(nvme)) << "swap files left under " << nvme;

  const auto dry = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-small", "--devices", "2",
       "--strategy", "deepspeed_stage_3", "--dry-run", "--offload-optimizer-device", "nvme",
       "--offload-params-device", "nvme", "--nvme-path", nvme});
  EXPECT_EQ(dry.exit_code, 0) << dry.out << dry.err;
  EXPECT_NE(dry.out.find("parameters on disk (offload_param nvme), per rank"), std::string::npos)
      << dry.out;
  EXPECT_NE(dry.out.find("parameter buffer(s)"), std::string::npos) << dry.out;
  // A wrong flag value: one sentence naming the flag.
  const auto bad = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--devices", "2",
       "--strategy", "deepspeed_stage_3", "--offload-params-device", "disk"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("--offload-params-device"), std::string::npos)
      << bad.out << bad.err;
  remove_own_dir(work);
  remove_own_dir(nvme);
}

// A parameter record changed on disk behind the swapper's back (one bit flipped) is detected at
// its next read: an error naming the file, and the tier refuses to go on, on every rank.
TEST(DiskOffload, ParamsOnDiskCorruptRecordIsDetected) {
  const std::string root = own_dir("params-corrupt");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup& pg) {
    ::setenv("FSDP_JOB_ID", "job-corrupt", 1);
    DiskRun run(params_nvme_options(root));
    run.train(1);
    run.strategy->flush_disk_tier();
    const auto files = run.strategy->param_swap_files();
    ASSERT_FALSE(files.empty());
    for (const auto& f : files) {  // every record: whichever unit is read first finds it
      flip_bits(f, 4096 + 40, 0x04);
    }
    pg.barrier();
    try {
      run.train(1);
      ADD_FAILURE() << "a corrupted parameter record was used";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("data checksum"), std::string::npos) << msg;
      EXPECT_NE(msg.find(root + "/job-corrupt/rank" + std::to_string(pg.rank()) + "/params.unit"),
                std::string::npos) << msg;
    }
    try {
      run.train(1);
      ADD_FAILURE() << "training went on after a corrupted parameter record";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("stopped after an error"), std::string::npos)
          << e.what();
    }
  });
  remove_own_dir(root);
}
