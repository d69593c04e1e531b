// Helpers for tests that run tests/helper_launch as real processes (tests/test_launcher.cpp,
// tests/test_stopped_rank.cpp, tests/test_launch_errors.cpp, tests/test_launch_threads.cpp).
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "comm/launcher_detail.h"

namespace fsdp::testing::launch {

// build/tests/helper_launch, beside this test binary.
inline std::string helper() {
  return (std::filesystem::path(fsdp::detail::self_exe()).parent_path() / "helper_launch").string();
}

// Every "pid N" the ranks printed.
inline std::vector<int> printed_pids(const std::string& out) {
  std::vector<int> pids;
  std::regex re("pid ([0-9]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it)
    pids.push_back(std::stoi((*it)[1]));
  return pids;
}

// A process is gone when /proc has no entry or it is a zombie nobody reaped yet
// (in containers PID 1 may not reap orphans).
inline bool process_gone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

// Polls up to `seconds` for the process to be gone (mpirun can exit a few milliseconds before
// its daemons have reaped the ranks they killed).
inline bool gone_within(int pid, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!process_gone(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

inline size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

// Wall-clock milliseconds since the epoch (what the helper prints when a rank fails).
inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The time the helper's failing rank printed "rank R fails at <ms> ms", or -1.
inline int64_t failed_at_ms(const std::string& out, int rank) {
  std::smatch m;
  std::regex re("rank " + std::to_string(rank) + " fails at ([0-9]+) ms");
  return std::regex_search(out, m, re) ? std::stoll(m[1]) : -1;
}

// The log file a failed MPI launch names on stderr ("... are in /tmp/fsdp-mpirun-XXXXXX.log",
// see Note [MPI launch output]), or "".
inline std::string mpirun_log_named_in(const std::string& err) {
  std::smatch m;
  static const std::regex named(R"(are in (/\S+\.log))");
  return std::regex_search(err, m, named) ? std::string(m[1]) : std::string();
}

// Removes that log: a test leaves nothing behind.
inline void remove_mpirun_log(const std::string& err) {
  const std::string path = mpirun_log_named_in(err);
  if (!path.empty()) std::filesystem::remove(path);
}

// The line a launch prints once about its intra-op threads (Note [Threads per rank] in
// src/comm/thread_choice.cpp): "[fsdp] 2 ranks on 2 cores, ...: 1 intra-op thread per rank ...".
// Group 1: "ranks" or "process"; group 2: the thread count.
inline const std::regex& thread_choice_line() {
  static const std::regex re(
      R"(\[fsdp\] [0-9]+ (ranks|process) on [0-9]+ cores?[^\n]*: ([0-9]+) intra-op threads?[^\n]*)");
  return re;
}

}  // namespace fsdp::testing::launch
