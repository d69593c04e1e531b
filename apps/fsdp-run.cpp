// fsdp-run: our torchrun. Starts N local ranks of any program with the launcher environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
// OMP_NUM_THREADS/FSDP_LAUNCH_THREADS), watches them, and ends all of them when one fails.
//
//   fsdp-run -n 4 -- build/bin/fsdp-train --devices 4 ...
//   fsdp-run -n 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -- prog
//   fsdp-run -n 4 --backend mpi -- prog        (runs `mpirun -n 4 ... prog`, see Note [MPI launch])
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "cli.h"
#include "comm/launcher_detail.h"
#include "comm/mpirun_output.h"
#include "comm/rendezvous.h"

namespace {

fsdp::detail::Supervisor* g_sup = nullptr;

void on_stop_signal(int sig) {
  if (g_sup) g_sup->request_stop(sig);
}

// See Note [Rendezvous handshake]. One node: nobody else joins, a random id. More nodes: each
// node's fsdp-run must find the same id by itself, so it is a digest of what they share (the
// command and the master's address), not of what may differ by mistake (-n, --nnodes: those
// mismatches get their own message).
std::string default_job_id(int nnodes, const std::vector<std::string>& command,
                           const std::string& master_addr, int master_port) {
  if (nnodes == 1) return fsdp::detail::random_job_id();
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  for (const auto& a : command) mix(a);
  mix(master_addr);
  mix(std::to_string(master_port));
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fsdp::detail;
  CLI::App app{
      "fsdp-run: start N ranks of a program on this node (our torchrun). One rank failing "
      "stops all ranks; the exit status is the failing rank's."};
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 0;
  std::string master_addr = get_env("MASTER_ADDR", "127.0.0.1");
  std::string backend = "gloo";
  std::vector<std::string> command;
  double grace = 3.0;
  std::string job_id = get_env("FSDP_JOB_ID");
  app.add_option("-n,--nproc-per-node", nproc, "ranks on this node")
      ->required()
      ->check(fsdp::cli::between(1, 4096));
  app.add_option("--nnodes", nnodes, "number of nodes (run fsdp-run on each)")
      ->check(fsdp::cli::between(1, 1 << 20));
  app.add_option("--node-rank", node_rank, "index of this node, 0..nnodes-1")
      ->check(fsdp::cli::at_least(0));
  app.add_option("--master-addr", master_addr, "address of node 0 (rank 0's host)");
  app.add_option("--master-port", master_port,
                 "TCP port on node 0 for the rendezvous (default: MASTER_PORT, or a free port "
                 "when --nnodes 1)")
      ->check(fsdp::cli::between(1, 65535));
  app.add_option("--backend", backend, "gloo (default, spawns ranks) or mpi (runs mpirun)")
      ->check(fsdp::cli::one_of({"gloo", "mpi", "auto"}));
  app.add_option("--kill-grace", grace,
                 "seconds between SIGTERM and SIGKILL when stopping ranks after a failure")
      ->check(fsdp::cli::between(0.0, 3600.0));
  app.add_option("--job-id", job_id,
                 "the job's id, the same on every node: ranks of another job are refused at "
                 "the rendezvous (default: FSDP_JOB_ID; else random with --nnodes 1, a digest "
                 "of the command and master address with more nodes)");
  app.add_option("command", command, "PROGRAM ARGS... (after --)")->required();
  if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-run")) return *code;

  try {
    TORCH_CHECK(node_rank < nnodes, "[fsdp-run] --node-rank ", node_rank,
                " must be below --nnodes ", nnodes);
    TORCH_CHECK(!is_wildcard_address(master_addr),
                wildcard_address_error("[fsdp-run]", "--master-addr (or MASTER_ADDR)", master_addr));
    if (master_port == 0 && has_env("MASTER_PORT")) {
      const std::string text = get_env("MASTER_PORT");
      const std::string why = fsdp::cli::detail::parse_as<int>(text, master_port);
      TORCH_CHECK(why.empty() && master_port >= 1 && master_port <= 65535,
                  "[fsdp-run] MASTER_PORT='", text, "' is not a TCP port (1 to 65535)");
    }
    if (master_port == 0) {
      TORCH_CHECK(nnodes == 1, "[fsdp-run] --nnodes ", nnodes,
                  " needs --master-port (the same "
                  "port on every node; rank 0's node listens on it)");
      master_port = free_port();
    }
    if (job_id.empty()) job_id = default_job_id(nnodes, command, master_addr, master_port);
    int world = nproc * nnodes;
    // Measured before the ranks start, so their start-up is not counted as load.
    int threads = launch_threads(nproc, /*announce=*/true);

    if (backend == "mpi") {
      TORCH_CHECK(nnodes == 1, "[fsdp-run] --backend mpi with --nnodes ", nnodes,
                  ": run mpirun "
                  "yourself with a hostfile (`mpirun -n ",
                  world,
                  " --hostfile hosts prog`); "
                  "the program adopts mpirun's ranks");
      std::vector<std::string> mpi = mpirun_prefix(nproc);
      mpi.insert(mpi.end(), command.begin(), command.end());
      ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
      ::setenv(kEnvLaunchThreads, std::to_string(threads).c_str(), 1);
      if (nproc > available_cores()) ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 1);
      run_mpirun_filtered(mpi);  // See Note [MPI launch output]
    }

    SupervisorOptions sopt;
    sopt.world_size = world;
    sopt.self_rank = -1;
    sopt.forward_stderr = true;
    sopt.kill_grace_s = grace;
    sopt.who = "fsdp-run";
    Supervisor sup(sopt);
    for (int local = 0; local < nproc; ++local) {
      int rank = node_rank * nproc + local;
      std::map<std::string, std::string> env = {
          {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
          {"GROUP_RANK", std::to_string(node_rank)},
          {"MASTER_ADDR", master_addr},
          {"MASTER_PORT", std::to_string(master_port)},
          {"OMP_NUM_THREADS", std::to_string(threads)},
          {kEnvLaunchThreads, std::to_string(threads)},
          {kEnvLauncher, "fsdp-run"},
          {"FSDP_JOB_ID", job_id},
      };
      sup.spawn({rank, command, make_env(env)});
    }
    g_sup = &sup;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
    int code = sup.run();
    g_sup = nullptr;
    return code;
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-run: " << e.what_without_backtrace() << "\n";
    return 2;
  }
}
