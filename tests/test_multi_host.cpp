// Multi-host training on test hosts: network namespaces cabled by veth links to one bridge
// (tests/hosts/netns-hosts.sh, made by the ctest fixture MultiHost.SetUpHosts). fsdp-run runs on
// each host with --nnodes 2 --node-rank I --master-addr <host 0>; nothing crosses loopback
// between hosts, and each host's link counts the bytes it sent to the other.
//
// Skips (with the fixture's reason) where namespaces cannot be made.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <sstream>

namespace {
namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

const std::string kScript = std::string(FSDP_SOURCE_DIR) + "/tests/hosts/netns-hosts.sh";

// Why the hosts are not there ("" when they are): not under ctest, or the fixture could not
// make namespaces on this machine (its reason).
std::string hosts_missing_reason() {
  const char* name = std::getenv("FSDP_TEST_HOSTS");
  if (!name || !*name) {
    return "FSDP_TEST_HOSTS is not set: run through ctest, whose MultiHost.SetUpHosts fixture "
           "makes the hosts";
  }
  const char* skip_file = std::getenv("FSDP_TEST_HOSTS_SKIP");
  if (skip_file && fs::exists(skip_file)) {
    std::ifstream in(skip_file);
    std::string why;
    std::getline(in, why);
    return why.empty() ? "the test hosts could not be made" : why;
  }
  return "";
}

#define HOSTS_OR_SKIP(var)                                            \
  if (std::string why = hosts_missing_reason(); !why.empty()) {       \
    GTEST_SKIP() << "[fsdp-skip] " << why;                        \
  }                                                                   \
  const std::string var = std::getenv("FSDP_TEST_HOSTS")

fs::path scratch() {
  static fs::path p = [] {
    fs::path d = fs::temp_directory_path() / ("fsdp_test_multi_host_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return p;
}

std::vector<std::string> train_args(int steps, const std::string& summary) {
  return {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--data", "synthetic",
          "--dropout", "0", "--seed", "7", "--max-steps", std::to_string(steps),
          "--no-progress-bar", "--log-every", "1", "--default-root-dir",
          (scratch() / "logs").string(), "--summary-json", summary};
}

struct LinkBytes {
  int64_t tx = 0, rx = 0;
};

LinkBytes link_bytes(const std::string& hosts, int host) {
  auto r = run_process({kScript, "bytes", hosts, std::to_string(host)});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  LinkBytes b;
  std::istringstream(r.out) >> b.tx >> b.rx;
  return b;
}

struct JobResult {
  std::vector<ProcResult> hosts;
  nlohmann::json summary;            // node 0's --summary-json
  std::vector<int64_t> sent_bytes;   // per host, during the job
};

// One job of 2 hosts x `nproc` ranks: fsdp-run on each host, the training flags `extra`.
JobResult run_two_hosts(const std::string& hosts, int nproc, int steps,
                        const std::vector<std::string>& extra, const std::string& tag) {
  const std::string summary = (scratch() / (tag + ".json")).string();
  fs::remove(summary);
  std::vector<LinkBytes> before = {link_bytes(hosts, 0), link_bytes(hosts, 1)};
  std::vector<std::future<ProcResult>> running;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kScript, "exec", hosts, std::to_string(node),
                                     fsdp::testing::bin_path("fsdp-run"), "-n",
                                     std::to_string(nproc), "--nnodes", "2", "--node-rank",
                                     std::to_string(node), "--master-addr", "10.77.0.1",
                                     "--master-port", "29500", "--job-id", tag, "--"};
    auto train = train_args(steps, summary);
    argv.insert(argv.end(), train.begin(), train.end());
    argv.insert(argv.end(), {"--devices", std::to_string(nproc), "--num-nodes", "2"});
    argv.insert(argv.end(), extra.begin(), extra.end());
    running.push_back(std::async(std::launch::async, [argv] {
      return run_process(argv, {{"FSDP_RENDEZVOUS_TIMEOUT_S", "60"}}, 300);
    }));
  }
  JobResult out;
  for (auto& f : running) out.hosts.push_back(f.get());
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(out.hosts[node].exit_code, 0) << tag << " host " << node << ":\n"
                                            << out.hosts[node].err;
    out.sent_bytes.push_back(link_bytes(hosts, node).tx - before[node].tx);
  }
  std::ifstream in(summary);
  if (in) out.summary = nlohmann::json::parse(in);
  else ADD_FAILURE() << tag << ": no summary " << summary;
  return out;
}

std::vector<double> single_process_losses(int steps, int64_t batch) {
  const std::string summary = (scratch() / ("single" + std::to_string(steps) + ".json")).string();
  auto argv = train_args(steps, summary);
  argv.insert(argv.end(), {"--strategy", "single", "--devices", "1", "--batch-size",
                           std::to_string(batch)});
  auto r = run_process(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(summary);
  if (!in) return {};
  return nlohmann::json::parse(in).at("losses").get<std::vector<double>>();
}

void expect_same_losses(const std::vector<double>& got, const std::vector<double>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << what << " step " << i;
  }
}

constexpr int kSteps = 4;

// The harness's promises: each host has only its loopback and its link, no route out of the
// test network, and the machine's own namespace holds none of the test interfaces.
TEST(MultiHost, HostsAreIsolatedNamespaces) {
  HOSTS_OR_SKIP(hosts);
  for (int node = 0; node < 2; ++node) {
    auto links = run_process({kScript, "exec", hosts, std::to_string(node), "ip", "-o", "link"});
    ASSERT_EQ(links.exit_code, 0) << links.err;
    EXPECT_EQ(std::count(links.out.begin(), links.out.end(), '\n'), 2) << links.out;
    EXPECT_NE(links.out.find(" lo:"), std::string::npos) << links.out;
    EXPECT_NE(links.out.find(" eth0@"), std::string::npos) << links.out;
    auto routes = run_process({kScript, "exec", hosts, std::to_string(node), "ip", "route"});
    EXPECT_EQ(routes.out.find("default"), std::string::npos) << "a route out: " << routes.out;
    auto name = run_process({kScript, "exec", hosts, std::to_string(node), "hostname"});
    EXPECT_EQ(name.out, hosts + "-h" + std::to_string(node) + "\n");
  }
  auto own = run_process({"ip", "-o", "link"});
  for (const char* made : {" h0@", " h1@", " br0:"}) {
    EXPECT_EQ(own.out.find(made), std::string::npos) << made << " leaked into the machine's "
                                                       "namespace:\n" << own.out;
  }
}

TEST(MultiHost, FullShardAndDdpTwoHostsByTwoRanksMatchOneProcess) {
  HOSTS_OR_SKIP(hosts);
  const auto single = single_process_losses(kSteps, 8);
  auto fsdp = run_two_hosts(hosts, 2, kSteps,
                            {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD",
                             "--batch-size", "2"},
                            "full_shard");
  EXPECT_EQ(fsdp.summary.value("world_size", 0), 4);
  expect_same_losses(fsdp.summary.value("losses", std::vector<double>{}), single,
                     "FULL_SHARD 2 hosts x 2 ranks");
  auto ddp = run_two_hosts(hosts, 2, kSteps, {"--strategy", "ddp", "--batch-size", "2"}, "ddp");
  expect_same_losses(ddp.summary.value("losses", std::vector<double>{}), single,
                     "DDP 2 hosts x 2 ranks");
  // The ranks really talked across the link (not loopback): both hosts sent bytes.
  for (int node = 0; node < 2; ++node) {
    EXPECT_GT(fsdp.sent_bytes[node], 0) << "host " << node;
    EXPECT_GT(ddp.sent_bytes[node], 0) << "host " << node;
  }
}

// HYBRID_SHARD 2 x 2: shard inside a host, replicate across. Per optimizer step the only
// cross-host traffic is the all-reduce of gradient shards over the replicate groups: each rank's
// shard is ~P/2 floats and a 2-rank all-reduce sends one shard's worth, so a host sends ~4 P
// bytes per step. FULL_SHARD all-gathers (twice) and reduce-scatters across hosts: ~3x that.
// Per-step bytes are the difference between a long and a short run (setup cancels out).
TEST(MultiHost, HybridShardCrossesHostsOnlyWithTheShardAllReduce) {
  HOSTS_OR_SKIP(hosts);
  auto per_step = [&](const std::string& strategy) {
    const std::vector<std::string> args = {"--strategy", "fsdp", "--sharding-strategy", strategy,
                                           "--batch-size", "2"};
    auto shorter = run_two_hosts(hosts, 2, 2, args, strategy + "_2");
    auto longer = run_two_hosts(hosts, 2, 6, args, strategy + "_6");
    std::vector<double> bytes;
    for (int node = 0; node < 2; ++node) {
      bytes.push_back((longer.sent_bytes[node] - shorter.sent_bytes[node]) / 4.0);
    }
    return std::make_pair(bytes, longer.summary.value("params", int64_t{0}));
  };
  auto [hybrid, params] = per_step("HYBRID_SHARD");
  auto [full, params_full] = per_step("FULL_SHARD");
  ASSERT_GT(params, 0);
  const double expected = 4.0 * static_cast<double>(params);  // bytes per host per step
  for (int node = 0; node < 2; ++node) {
    std::cout << "[ measured ] host " << node << " sent per step: HYBRID_SHARD " << hybrid[node]
              << " B, FULL_SHARD " << full[node] << " B; all-reduce of shards = " << expected
              << " B (params " << params << ")" << std::endl;
    // TCP/IP headers and the per-step loss all-reduce add a few percent.
    EXPECT_GT(hybrid[node], 0.9 * expected) << "host " << node;
    EXPECT_LT(hybrid[node], 1.25 * expected) << "host " << node;
    EXPECT_GT(full[node], 2.0 * hybrid[node]) << "host " << node;
  }
}

// MPI across hosts: mpirun on host 0 starts the ranks of host 1 through its launch agent,
// `netns-hosts.sh mpi-agent`, which enters that host's namespace (OpenMPI's plm_rsh_agent).
TEST(MultiHost, MpiFullShardTwoHostsByTwoRanksMatchesOneProcess) {
  HOSTS_OR_SKIP(hosts);
  const std::string mpirun = "/usr/bin/mpirun";
  if (!fs::exists(mpirun)) GTEST_SKIP() << "[fsdp-skip] mpirun is not installed";
  const auto single = single_process_losses(kSteps, 8);
  const fs::path hostfile = scratch() / "mpi_hosts";
  std::ofstream(hostfile) << hosts << "-h0 slots=2\n" << hosts << "-h1 slots=2\n";
  const std::string summary = (scratch() / "mpi.json").string();
  std::vector<std::string> argv = {kScript, "exec", hosts, "0", mpirun, "--allow-run-as-root",
                                   "--oversubscribe", "--bind-to", "none", "-n", "4",
                                   "--hostfile", hostfile.string(), "--mca", "plm_rsh_agent",
                                   kScript + " mpi-agent", "--mca", "oob_tcp_if_include", "eth0",
                                   "--mca", "btl_tcp_if_include", "eth0", "--mca", "btl",
                                   "self,vader,tcp"};
  auto train = train_args(kSteps, summary);
  argv.insert(argv.end(), train.begin(), train.end());
  argv.insert(argv.end(), {"--backend", "mpi", "--devices", "2", "--num-nodes", "2",
                           "--strategy", "fsdp", "--batch-size", "2"});
  const LinkBytes before = link_bytes(hosts, 1);
  auto r = run_process(argv, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GT(link_bytes(hosts, 1).tx - before.tx, 0) << "host 1 sent nothing across its link";
  std::ifstream in(summary);
  ASSERT_TRUE(in) << r.err;
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.value("world_size", 0), 4);
  expect_same_losses(j.value("losses", std::vector<double>{}), single, "MPI FULL_SHARD 2 hosts x 2 ranks");
}

// A host lost mid-training: every process on host 1 is SIGKILLed after the second sharded
// checkpoint. The survivors on host 0 stop by themselves, naming the lost host and its ranks;
// then host 0 alone (world 2) resumes from the last sharded checkpoint and continues the loss
// curve of one uninterrupted process (same global batch, same corpus).
TEST(MultiHost, LostHostStopsSurvivorsNamingItAndHostZeroResumesAtWorldTwo) {
  HOSTS_OR_SKIP(hosts);
  const fs::path ckpt = scratch() / "lost_host_ckpt";
  fs::remove_all(ckpt);
  const std::vector<std::string> corpus = {"--num-tokens", "100000"};
  constexpr int kRefSteps = 16;
  auto ref_args = train_args(kRefSteps, (scratch() / "lost_ref.json").string());
  ref_args.insert(ref_args.end(), {"--strategy", "single", "--devices", "1", "--batch-size", "8"});
  ref_args.insert(ref_args.end(), corpus.begin(), corpus.end());
  auto ref_run = run_process(ref_args, {}, 300);
  ASSERT_EQ(ref_run.exit_code, 0) << ref_run.err;
  std::ifstream ref_in(scratch() / "lost_ref.json");
  const auto ref = nlohmann::json::parse(ref_in).at("losses").get<std::vector<double>>();

  // The job: 2 hosts x 2 ranks, sharded checkpoints every 2 steps, far more steps than it lives.
  std::vector<std::future<ProcResult>> running;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kScript, "exec", hosts, std::to_string(node),
                                     fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--nnodes",
                                     "2", "--node-rank", std::to_string(node), "--master-addr",
                                     "10.77.0.1", "--master-port", "29500", "--job-id", "lost",
                                     "--"};
    auto train = train_args(400, (scratch() / "lost.json").string());
    argv.insert(argv.end(), train.begin(), train.end());
    argv.insert(argv.end(), {"--devices", "2", "--num-nodes", "2", "--strategy", "fsdp",
                             "--batch-size", "2", "--checkpoint-dir", ckpt.string(),
                             "--save-every-n-steps", "2", "--state-dict-type", "sharded"});
    argv.insert(argv.end(), corpus.begin(), corpus.end());
    running.push_back(std::async(std::launch::async, [argv] {
      return run_process(argv, {{"FSDP_RENDEZVOUS_TIMEOUT_S", "60"}}, 300);
    }));
  }
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + std::chrono::seconds(240);
  while (!fs::exists(ckpt / "step-4") && Clock::now() < give_up &&
         running[0].wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
  }
  ASSERT_TRUE(fs::exists(ckpt / "step-4")) << "no second checkpoint; host 0:\n"
                                           << running[0].get().err;
  auto killed = run_process({kScript, "kill", hosts, "1"});
  const auto t_kill = Clock::now();
  ASSERT_EQ(killed.exit_code, 0) << killed.err;
  running[0].wait();
  const double exit_s = std::chrono::duration<double>(Clock::now() - t_kill).count();
  ProcResult host0 = running[0].get();
  running[1].get();
  std::cout << "[ measured ] host 0's ranks exited " << exit_s
            << " s after host 1 was killed (spec: within 10 s)" << std::endl;
  EXPECT_NE(host0.exit_code, 0) << host0.err;
  EXPECT_NE(host0.err.find("is host " + hosts + "-h1 (ranks 2,3)"), std::string::npos)
      << "the survivors' error should name the lost host and ranks:\n" << host0.err;

  // Resume on host 0 alone at world 2 (batch 4: the same global batch of 8).
  auto info = run_process({fsdp::testing::bin_path("fsdp-ckpt"), "inspect", "--json",
                           (ckpt / "last").string()});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const int64_t step = nlohmann::json::parse(info.out).at("global_step").get<int64_t>();
  ASSERT_GE(step, 4);
  ASSERT_LE(step + 4, kRefSteps) << "the job ran too far before the kill";
  const std::string resumed_json = (scratch() / "lost_resumed.json").string();
  std::vector<std::string> argv = {kScript, "exec", hosts, "0", fsdp::testing::bin_path("fsdp-run"),
                                   "-n", "2", "--"};
  auto train = train_args(static_cast<int>(step) + 4, resumed_json);
  argv.insert(argv.end(), train.begin(), train.end());
  argv.insert(argv.end(), {"--devices", "2", "--strategy", "fsdp", "--batch-size", "4",
                           "--ckpt-path", (ckpt / "last").string()});
  argv.insert(argv.end(), corpus.begin(), corpus.end());
  auto resumed = run_process(argv, {}, 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  std::ifstream rin(resumed_json);
  const auto losses = nlohmann::json::parse(rin).at("losses").get<std::vector<double>>();
  ASSERT_EQ(losses.size(), 4u) << "steps after the checkpoint";
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], ref[step + i], 1e-5 * std::abs(ref[step + i]))
        << "step " << step + i << " after resuming at world 2";
  }
}

// A host that vanishes without a word (cable pulled, power lost): host 1's switch port goes
// down mid-training, so its packets disappear and no connection is reset. Nothing fails fast;
// host 0's ranks must stop at the collective timeout (10 s here) with an error that names the
// collective and its sequence number, instead of hanging. The port is brought back up for the
// tests after this one.
TEST(MultiHost, SilentLinkLossTimesOutNamingTheCollective) {
  HOSTS_OR_SKIP(hosts);
  const fs::path ckpt = scratch() / "cut_ckpt";
  fs::remove_all(ckpt);
  std::vector<std::future<ProcResult>> running;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kScript, "exec", hosts, std::to_string(node),
                                     fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--nnodes",
                                     "2", "--node-rank", std::to_string(node), "--master-addr",
                                     "10.77.0.1", "--master-port", "29500", "--job-id", "cut",
                                     "--"};
    auto train = train_args(100000, (scratch() / "cut.json").string());
    argv.insert(argv.end(), train.begin(), train.end());
    argv.insert(argv.end(), {"--devices", "2", "--num-nodes", "2", "--strategy", "fsdp",
                             "--batch-size", "2", "--num-tokens", "100000", "--checkpoint-dir",
                             ckpt.string(), "--save-every-n-steps", "2", "--save-top-k", "1",
                             "--state-dict-type", "sharded"});
    running.push_back(std::async(std::launch::async, [argv] {
      return run_process(argv, {{"FSDP_RENDEZVOUS_TIMEOUT_S", "60"},
                                {"FSDP_COLLECTIVE_TIMEOUT_S", "10"}},
                         300);
    }));
  }
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + std::chrono::seconds(240);
  while (!fs::exists(ckpt / "step-2") && Clock::now() < give_up &&
         running[0].wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
  }
  ASSERT_TRUE(fs::exists(ckpt / "step-2")) << "the job did not train; host 0:\n"
                                           << running[0].get().err;
  auto cut = run_process({kScript, "cut", hosts, "1"});
  const auto t_cut = Clock::now();
  ASSERT_EQ(cut.exit_code, 0) << cut.err;
  running[0].wait();
  const double exit_s = std::chrono::duration<double>(Clock::now() - t_cut).count();
  ProcResult host0 = running[0].get();
  auto mend = run_process({kScript, "mend", hosts, "1"});
  EXPECT_EQ(mend.exit_code, 0) << mend.err;
  // Host 1's ranks cannot reach anyone either: they time out the same way (or are stopped).
  running[1].get();
  std::cout << "[ measured ] host 0's ranks exited " << exit_s
            << " s after host 1's link went silent (collective timeout 10 s)" << std::endl;
  EXPECT_NE(host0.exit_code, 0) << host0.err;
  if (auto at = host0.err.find("timed out after"); at != std::string::npos) {
    const auto from = host0.err.rfind('\n', at);
    std::cout << "[ measured ] " << host0.err.substr(from == std::string::npos ? 0 : from + 1,
                                                      host0.err.find('\n', at) - from)
              << std::endl;
  }
  EXPECT_NE(host0.err.find("timed out after"), std::string::npos)
      << "host 0 should stop at the collective timeout:\n" << host0.err;
  const bool names_collective = host0.err.find("all_gather #") != std::string::npos ||
                                host0.err.find("reduce_scatter #") != std::string::npos ||
                                host0.err.find("all_reduce #") != std::string::npos ||
                                host0.err.find("broadcast #") != std::string::npos;
  EXPECT_TRUE(names_collective) << "the error should name the collective:\n" << host0.err;
  // ... and says the ranks went silent, where they are, and what to do.
  EXPECT_NE(host0.err.find("ranks 2,3 have not been heard from"), std::string::npos) << host0.err;
  EXPECT_NE(host0.err.find("host " + hosts + "-h1 at 10.77.0.2"), std::string::npos) << host0.err;
  EXPECT_NE(host0.err.find("--ckpt-path DIR/last"), std::string::npos) << host0.err;
  // No wall-time assertion: a hang would end at run_process's 300 s limit and fail above.
}

}  // namespace
