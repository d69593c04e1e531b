// A program for tests/test_launcher.cpp: becomes N ranks through fsdp::launch (or adopts
// fsdp-run's / mpirun's ranks), prints what each rank sees, and lets one rank fail in a chosen
// way while the others wait (as ranks blocked in a collective would).
//
//   helper_launch --devices 3 --fail-rank 2 --how throw|abort|sigkill|exit|segv|fail_rank|oom|stop
//   helper_launch --devices 2 --launch-twice     (fsdp::launch called twice, as two Trainers do)
//   helper_launch ... --collective --cuda        (the ranks' collectives on CUDA tensors of
//                                                 cuda:0, staged by Gloo/MPI: tests/gpu/)
//
// stop: the rank stops itself (SIGSTOP), as a rank frozen by a debugger, a job-control signal or
// a host that stops scheduling it; it never resumes.
// oom: the rank touches 64 MiB blocks until the kernel kills it (run it in a memory cgroup).
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/launcher.h"

int main(int argc, char** argv) {
  fsdp::LaunchOptions options;
  options.devices = 0;
  int fail_rank = -1;
  std::string how = "throw";
  double delay_s = 0.3;
  double survivor_s = 60;  // how long the other ranks wait before exiting 0 by themselves
  int rank0_status = 0;
  bool collective = false;  // survivors wait in a barrier (as real ranks would) instead of sleeping
  bool launch_twice = false;  // call fsdp::launch a second time, as a program with two Trainers
  bool cuda = false;  // with --collective: all-reduce a CUDA tensor instead of the barrier
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (a == "--devices")
      options.devices = std::atoi(next().c_str());
    else if (a == "--backend")
      options.backend = next();
    else if (a == "--fail-rank")
      fail_rank = std::atoi(next().c_str());
    else if (a == "--how")
      how = next();
    else if (a == "--delay")
      delay_s = std::atof(next().c_str());
    else if (a == "--survivor-wait")
      survivor_s = std::atof(next().c_str());
    else if (a == "--rank0-status")
      rank0_status = std::atoi(next().c_str());
    else if (a == "--collective")
      collective = true;
    else if (a == "--launch-twice")
      launch_twice = true;
    else if (a == "--cuda")
      cuda = true;
    else {
      std::fprintf(stderr, "helper_launch: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  fsdp::LaunchInfo info = fsdp::launch(options);
  if (launch_twice) info = fsdp::launch(options);
  std::printf("rank %d world %d local %d/%d node %d/%d source %s threads %d pid %d port %d\n",
              info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank,
              info.num_nodes, info.source.c_str(), at::get_num_threads(),
              static_cast<int>(::getpid()), info.master_port);
  std::fflush(stdout);

  fsdp::ProcessGroupPtr group;
  // The collective the ranks meet in: a barrier, or with --cuda an all-reduce of a tensor on
  // cuda:0 (Gloo and MPI stage it through host memory).
  auto meet = [&] {
    if (!cuda) {
      group->barrier();
      return;
    }
    at::Tensor t = at::ones({4}, at::TensorOptions().device(at::Device(at::kCUDA, 0)));
    group->all_reduce_async(t, fsdp::ReduceOp::kSum)->wait();
  };
  if (collective) {
    fsdp::ProcessGroupOptions pgo;
    pgo.backend = options.backend;
    group = fsdp::init_process_group(pgo);
    meet();
    std::printf("rank %d joined the group\n", info.rank);
    std::fflush(stdout);
  }
  auto sleep_s = [](double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); };
  if (info.rank == fail_rank) {
    sleep_s(delay_s);
    std::printf("rank %d fails at %lld ms\n", info.rank,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count()));
    std::fflush(stdout);
    if (how == "throw")
      throw std::runtime_error("helper: rank " + std::to_string(info.rank) + " throws on purpose");
    if (how == "fail_rank") fsdp::fail_rank("helper: rank fails on purpose", 3);
    if (how == "abort") std::abort();
    if (how == "sigkill") ::raise(SIGKILL);
    if (how == "segv") ::raise(SIGSEGV);
    if (how == "stop") {
      ::raise(SIGSTOP);
      std::fprintf(stderr, "helper: rank %d was continued\n", info.rank);
      return 8;
    }
    if (how == "oom") {
      std::vector<std::unique_ptr<char[]>> blocks;
      for (int i = 0; i < 128; ++i) {  // 8 GiB at most
        blocks.emplace_back(new char[64 << 20]);
        std::memset(blocks.back().get(), i + 1, 64 << 20);
      }
      std::fprintf(stderr, "helper: rank %d holds 8 GiB and was not killed\n", info.rank);
      return 9;
    }
    if (how == "exit") {
      std::fprintf(stderr, "helper: rank %d exits with status 7\n", info.rank);
      return 7;
    }
  } else if (fail_rank >= 0) {
    // A survivor: would be blocked in a collective; when the launcher kills it, it never
    // reaches the message below.
    if (group) {
      meet();  // never completes: the failing rank does not arrive
    } else {
      sleep_s(survivor_s);
    }
    std::fprintf(stderr, "helper: rank %d secondary error after waiting %.0f s\n", info.rank,
                 survivor_s);
    return 5;
  }
  if (group) meet();
  if (info.rank == 0 && rank0_status != 0) return rank0_status;
  return 0;
}
