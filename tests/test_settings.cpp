// Settings: every environment variable parsed from a given environment in one place, with one
// sentence per bad value, one job id, one documented table. Injected hooks: the test-only
// failure and the benchmark-only collectives are reached through hooks a program installs, and
// the variables that once switched them on, left set, change nothing.
#include "common/injected_hooks.h"
#include "common/settings.h"
#include "fsdp/checkpoint.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace {

namespace fs = std::filesystem;
using fsdp::detail::Environment;
using fsdp::detail::parse_settings;

using fsdp::testing::error_of;
using fsdp::testing::ScopedSetenv;

TEST(Settings, ParsesAGivenEnvironment) {
  const Environment env = {{"RANK", "3"},
                           {"WORLD_SIZE", "4"},
                           {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "10.0.0.1"},
                           {"MASTER_PORT", "29500"},
                           {"FSDP_LAUNCHER", "fsdp-run"},
                           {"FSDP_LAUNCH_NOTIFY_FD", "9"},
                           {"FSDP_NUM_THREADS", "3"},
                           {"FSDP_JOB_ID", "job-7"},
                           {"PATH", "/opt/mpi/bin"},
                           {"FSDP_BACKEND", "gloo"},
                           {"FSDP_MEMORY_BUDGET", "12GiB"},
                           {"FSDP_ALLOC_CACHE", "0"},
                           {"FSDP_STDOUT_IS_TERMINAL", "0"},
                           {"FSDP_COLLECTIVE_TIMEOUT_S", "2.5"},
                           {"FSDP_RENDEZVOUS_TIMEOUT_S", "90"},
                           {"FSDP_DEBUG", "DETAIL"},
                           {"FSDP_DEFERRED_INIT", "0"},
                           {"PL_DEEPSPEED_CONFIG_PATH", "/tmp/ds.json"},
                           {"GLOO_SOCKET_IFNAME", "eth1"},
                           {"TORCH_CPP_LOG_LEVEL", "INFO"},
                           {"TORCH_SHOW_CPP_STACKTRACES", "1"}};
  const auto s = parse_settings(env);
  EXPECT_EQ(s.launch.source, "fsdp-run");
  EXPECT_EQ(s.launch.rank, 3);
  EXPECT_EQ(s.launch.world_size, 4);
  EXPECT_EQ(s.launch.local_rank, 1);
  EXPECT_EQ(s.launch.local_world_size, 2);
  EXPECT_EQ(s.launch.num_nodes, 2);
  EXPECT_EQ(s.launch.node_rank, 1);
  EXPECT_EQ(s.launch.master_addr, "10.0.0.1");
  EXPECT_EQ(s.launch.master_port, 29500);
  EXPECT_EQ(s.launched_by, "fsdp-run");
  EXPECT_EQ(s.notify_fd, 9);
  EXPECT_EQ(s.num_threads, 3);
  EXPECT_EQ(s.job_id, "job-7");
  EXPECT_EQ(s.path, "/opt/mpi/bin");
  EXPECT_EQ(s.backend, "gloo");
  EXPECT_EQ(s.memory_budget, int64_t{12} << 30);
  EXPECT_EQ(s.alloc_cache_bytes, 0);
  EXPECT_EQ(s.stdout_is_terminal, false);
  EXPECT_EQ(s.collective_timeout_s, 2.5);
  EXPECT_EQ(s.rendezvous_timeout_s, 90.0);
  EXPECT_EQ(s.debug, fsdp::detail::DebugLevel::kDetail);
  EXPECT_FALSE(s.deferred_init);
  EXPECT_EQ(s.deepspeed_config_path, "/tmp/ds.json");
  EXPECT_EQ(s.gloo_socket_ifname, "eth1");
  EXPECT_TRUE(s.torch_log_level_set);
  EXPECT_TRUE(s.show_cpp_stacktraces);

  // Nothing set: the defaults. Empty values count as unset.
  for (const Environment& unset :
       {Environment{}, Environment{{"RANK", ""}, {"WORLD_SIZE", ""}, {"FSDP_MEMORY_BUDGET", ""},
                                   {"FSDP_DEBUG", ""}, {"FSDP_DEFERRED_INIT", ""},
                                   {"FSDP_ALLOC_CACHE", ""}, {"FSDP_NUM_THREADS", ""}}}) {
    const auto d = parse_settings(unset);
    EXPECT_EQ(d.launch.source, "none");
    EXPECT_EQ(d.launch.rank, 0);
    EXPECT_EQ(d.launch.world_size, 1);
    EXPECT_EQ(d.launch.master_addr, "127.0.0.1");
    EXPECT_EQ(d.launch.master_port, 0);
    EXPECT_EQ(d.notify_fd, -1);
    EXPECT_FALSE(d.num_threads.has_value());
    EXPECT_EQ(d.job_id, "");
    EXPECT_EQ(d.backend, "");
    EXPECT_FALSE(d.memory_budget.has_value());
    EXPECT_EQ(d.alloc_cache_bytes, int64_t{512} << 20);
    EXPECT_FALSE(d.stdout_is_terminal.has_value());
    EXPECT_FALSE(d.collective_timeout_s.has_value());
    EXPECT_EQ(d.debug, fsdp::detail::DebugLevel::kOff);
    EXPECT_TRUE(d.deferred_init);
    EXPECT_FALSE(d.torch_log_level_set);
  }
}

TEST(Settings, ABadValueIsOneSentenceNamingTheVariableItsValueAndWhatIsValid) {
  struct Case {
    const char* name;
    const char* value;
    const char* valid;  // part of what the message offers instead
  };
  for (const Case& c : std::vector<Case>{
           {"FSDP_MEMORY_BUDGET", "lots",
            "a size such as 12GiB, 800MB or 1073741824, or 0 for no budget"},
           {"FSDP_ALLOC_CACHE", "1 bucket",
            "a size such as 12GiB, 800MB or 1073741824, or 0 to turn the cache off"},
           {"FSDP_NUM_THREADS", "0", "a whole number from 1 to 4096"},
           {"FSDP_NUM_THREADS", "four", "a whole number from 1 to 4096"},
           {"FSDP_COLLECTIVE_TIMEOUT_S", "-1", "a number of seconds above 0, such as 600"},
           {"FSDP_RENDEZVOUS_TIMEOUT_S", "1m", "a number of seconds above 0, such as 60"},
           {"FSDP_STDOUT_IS_TERMINAL", "yes", "0 (plain progress lines) or 1 (a redrawn line)"},
           {"FSDP_DEFERRED_INIT", "off", "0 (off) or 1 (on, the default)"},
           {"FSDP_DEBUG", "info", "'off', 'detail'"},
           {"FSDP_BACKEND", "ucc", "'auto', 'gloo', 'mpi', 'nccl'"},
           {"FSDP_LAUNCH_NOTIFY_FD", "pipe", "a whole number from 0"},
           {"MASTER_PORT", "http", "a whole number from 0 to 65535"},
       }) {
    SCOPED_TRACE(std::string(c.name) + "=" + c.value);
    const std::string e = error_of([&] { parse_settings({{c.name, c.value}}); });
    EXPECT_NE(e.find(std::string(c.name) + "='" + c.value + "'"), std::string::npos) << e;
    EXPECT_NE(e.find(std::string("; valid: ") + c.valid), std::string::npos) << e;
    EXPECT_EQ(e.find(". "), std::string::npos) << "more than one sentence: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // A launcher's variables name the launcher that set them.
  std::string e = error_of([] { parse_settings({{"RANK", "one"}, {"WORLD_SIZE", "2"}}); });
  EXPECT_NE(e.find("RANK='one' (set by torchrun-style) is not a non-negative integer"),
            std::string::npos) << e;
  e = error_of([] {
    parse_settings({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "two"}});
  });
  EXPECT_NE(e.find("OMPI_COMM_WORLD_SIZE='two' (set by mpirun (OpenMPI))"), std::string::npos)
      << e;
}

// The job id has one answer, which the rendezvous and the disk tier both use.
TEST(Settings, OneJobId) {
  auto job = [](Environment env) { return parse_settings(env).job_id; };
  EXPECT_EQ(job({{"FSDP_JOB_ID", "a"}, {"TORCHELASTIC_RUN_ID", "b"}, {"SLURM_JOB_ID", "c"}}), "a");
  const Environment torchrun = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  Environment e = torchrun;
  e["TORCHELASTIC_RUN_ID"] = "b";
  EXPECT_EQ(job(e), "b");
  e["TORCHELASTIC_RUN_ID"] = "none";  // torchrun's default --rdzv-id in every job
  EXPECT_EQ(job(e), "");
  const Environment srun = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "42"}};
  EXPECT_EQ(job(srun), "42");
  e = srun;
  e["SLURM_STEP_ID"] = "3";
  EXPECT_EQ(job(e), "42.3");
  // A program inside an allocation that starts its own ranks is a job of its own.
  EXPECT_EQ(job({{"SLURM_JOB_ID", "42"}, {"TORCHELASTIC_RUN_ID", "b"}}), "");
}

// Every variable the settings read has a row in docs/environment.md's table.
TEST(Settings, EveryVariableIsInTheTable) {
  std::ifstream in(std::string(FSDP_SOURCE_DIR) + "/docs/environment.md");
  ASSERT_TRUE(in) << "docs/environment.md is missing";
  std::string rows;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| ", 0) == 0) rows += line + "\n";
  }
  for (const auto& name : fsdp::detail::setting_names()) {
    EXPECT_NE(rows.find("`" + name + "`"), std::string::npos)
        << name << " is read by src/common/settings.cpp but has no row in docs/environment.md";
  }
}

TEST(Settings, ReadFromTheProcessAsItIsNow) {
  {
    ScopedSetenv cache("FSDP_ALLOC_CACHE", "1MiB");
    EXPECT_EQ(fsdp::detail::read_settings().alloc_cache_bytes, int64_t{1} << 20);
  }
  ScopedSetenv cache("FSDP_ALLOC_CACHE", "2MiB");
  EXPECT_EQ(fsdp::detail::read_settings().alloc_cache_bytes, int64_t{2} << 20);
}

// A bad setting stops a Trainer before it launches anything, also one that used to be taken
// for its default silently.
TEST(Settings, TheTrainerChecksTheEnvironmentFirst) {
  for (const auto& [name, value] : std::vector<std::pair<const char*, const char*>>{
           {"FSDP_DEFERRED_INIT", "off"}, {"FSDP_DEBUG", "info"}, {"FSDP_STDOUT_IS_TERMINAL", "yes"}}) {
    ScopedSetenv bad(name, value);
    const std::string e = error_of([] {
      fsdp::TrainerOptions o;
      o.enable_progress_bar = false;
      fsdp::Trainer trainer(o);
    });
    EXPECT_NE(e.find(std::string(name) + "='" + value + "'"), std::string::npos) << e;
  }
}

// --- Injected hooks ---------------------------------------------------------------------

// Installs hooks for one scope, then the no-op ones again.
struct HooksGuard {
  explicit HooksGuard(fsdp::detail::InjectedHooks hooks) {
    fsdp::detail::install_injected_hooks(std::move(hooks));
  }
  ~HooksGuard() { fsdp::detail::install_injected_hooks({}); }
};

fsdp::testing::LoopConfig short_loop() {
  fsdp::testing::LoopConfig cfg;
  cfg.steps = 3;
  return cfg;
}

std::shared_ptr<fsdp::FSDPStrategy> fsdp_by_layers() {
  fsdp::FSDPOptions o;
  o.auto_wrap_policy =
      fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  return fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
}

std::vector<double> reference_losses() {
  fsdp::testing::TinyLM reference;
  return fsdp::testing::train_reference(reference, short_loop());
}

std::string scratch(const std::string& name) {
  const fs::path p = (fs::path(FSDP_BIN_DIR) / ".." / "settings-test" / name).lexically_normal();
  if (!fsdp::testing::in_child_rank()) {
    fs::remove_all(p);
    fs::create_directories(p);
  }
  return p.string();
}

// FSDP_BENCH_COLLECTIVES=local once made FSDP's collectives move no data (and train to wrong
// values); FSDP_TEST_CRASH_DURING_SAVE=<rank> once made that rank exit in the middle of a
// checkpoint. Left set in the environment of every rank, they now change nothing.
TEST(InjectedHooks, VariablesLeftSetChangeNothing) {
  ScopedSetenv bench("FSDP_BENCH_COLLECTIVES", "local");
  ScopedSetenv crash("FSDP_TEST_CRASH_DURING_SAVE", "1");
  const std::vector<double> reference = reference_losses();
  const std::string dir = scratch("left-set");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    auto strategy = fsdp_by_layers();
    fsdp::testing::TinyLM lm;
    fsdp::testing::expect_losses_close(fsdp::testing::train_with(*strategy, lm, short_loop()),
                                       reference);
    fsdp::TrainingProgress progress;
    progress.global_step = 3;
    fsdp::save_checkpoint(dir + "/ckpt", *strategy, lm, nullptr, progress,
                          fsdp::StateDictType::kSharded);
  });
  EXPECT_TRUE(fs::exists(dir + "/ckpt/metadata.json"));
}

// What fsdp-bench installs reaches FSDP's collectives: "serial" trains to the same values,
// "local" (no data between ranks) to wrong ones.
TEST(InjectedHooks, BenchCollectivesReachFsdp) {
  const std::vector<double> reference = reference_losses();
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    for (auto mode : {fsdp::detail::BenchCollectives::kSerial, fsdp::detail::BenchCollectives::kLocal}) {
      fsdp::detail::InjectedHooks hooks;
      hooks.collectives = mode;
      HooksGuard guard(hooks);
      auto strategy = fsdp_by_layers();
      fsdp::testing::TinyLM lm;
      const auto losses = fsdp::testing::train_with(*strategy, lm, short_loop());
      if (mode == fsdp::detail::BenchCollectives::kSerial) {
        fsdp::testing::expect_losses_close(losses, reference);
      } else {
        double largest = 0;
        for (size_t i = 0; i < losses.size(); ++i) {
          largest = std::max(largest, std::abs(losses[i] - reference[i]));
        }
        EXPECT_GT(largest, 1e-3) << "collectives that move no data trained to the right values";
      }
    }
  });
}

// The checkpoint hook runs on every rank once per save, after the rank wrote its first tensor
// and before the checkpoint is published.
TEST(InjectedHooks, CheckpointHookRunsMidSaveOnEveryRank) {
  const std::string dir = scratch("hook");
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup& world) {
    std::vector<std::pair<int, int64_t>> calls;
    bool published_during_hook = false;
    fsdp::detail::InjectedHooks hooks;
    hooks.during_checkpoint_save = [&](int rank, int64_t step) {
      calls.emplace_back(rank, step);
      published_during_hook |= fs::exists(dir + "/ckpt/metadata.json");
    };
    HooksGuard guard(hooks);
    auto strategy = fsdp_by_layers();
    fsdp::testing::TinyLM lm;
    fsdp::testing::LoopConfig cfg = short_loop();
    cfg.steps = 1;
    fsdp::testing::train_with(*strategy, lm, cfg);
    fsdp::TrainingProgress progress;
    progress.global_step = 5;
    fsdp::save_checkpoint(dir + "/ckpt", *strategy, lm, nullptr, progress,
                          fsdp::StateDictType::kSharded);
    EXPECT_EQ(calls, (std::vector<std::pair<int, int64_t>>{{world.rank(), 5}}));
    EXPECT_FALSE(published_during_hook);
  });
  EXPECT_TRUE(fs::exists(dir + "/ckpt/metadata.json"));
}

}  // namespace
