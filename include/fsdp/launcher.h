// Launcher: turns one program into N ranks, or adopts ranks a launcher already gave.
//
//  - Not under a launcher and devices > 1: the program re-executes itself devices-1 times
//    (rank 0 stays the parent) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//    MASTER_ADDR (127.0.0.1 unless set), MASTER_PORT (a free one unless set) and
//    FSDP_NUM_THREADS = cores / local ranks. Rank 0 watches the others: if any rank fails, all
//    ranks are ended within seconds and the program exits non-zero.
//  - Under torchrun-style env (RANK/WORLD_SIZE), SLURM (SLURM_PROCID, SLURM_NTASKS, ...) or
//    mpirun (OMPI_COMM_WORLD_*): adopts the given ranks.
//  - backend "mpi" and not under mpirun: re-executes through `mpirun -n N` (see docs/launching.md).
#pragma once

#include <string>

namespace fsdp {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string source = "none";  // "none" | "spawn" | "fsdp-run" | "env" | "slurm" | "mpirun"
};

struct LaunchOptions {
  int devices = 1;             // ranks per node; <= 0: as many as the launcher started (or 1)
  int num_nodes = 1;
  std::string backend = "auto";
};

// Makes sure this process is one of the requested ranks (spawning or adopting, see above),
// sets the intra-op thread count (from the cores other work leaves free, or FSDP_NUM_THREADS;
// printed once per job, see docs/launching.md "Threads per rank"), and returns this rank's
// info. Returns in every rank.
LaunchInfo launch(const LaunchOptions& options);

// What the environment says right now (no spawning).
LaunchInfo launch_info_from_env();

// Marks the start of a rank's failure: prints "[rank R] error: <what>" once to stderr and ends
// the process with a non-zero status so the watcher stops the other ranks.
[[noreturn]] void fail_rank(const std::string& what, int exit_code = 1);

// Rank 0 of a job spawned by launch(): waits for the other ranks to finish; if one fails,
// reports it and exits with its code. Optional: an exit hook does the same when main returns
// (see docs/launching.md). No-op in every other rank and when nothing was spawned.
void finalize_ranks();

}  // namespace fsdp
