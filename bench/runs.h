// What the subcommands that run whole programs share (bench/train.cpp, bench/peers.cpp): running
// fsdp-train and the Python peers (bench/peers/*.py) as child processes, reading the JSON they
// print, and turning per-step end times into it/s the same way for every system.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::bench {

// The interpreter with torch 2.x, Lightning, safetensors (CMake's FSDP_PYTHON, the project's
// .venv/bin/python by default) and the folder of the Python peers (bench/peers in the sources).
std::string default_python();
std::string peers_dir();

std::string command_line(const std::vector<std::string>& argv);  // shell-quoted, for reports
std::string read_text(const std::filesystem::path& path);         // "" when unreadable
std::string tail(const std::string& text, size_t max_chars = 1500);

// Runs argv to completion with stdout and stderr going to the two files; after timeout_s
// seconds its whole process group is killed. Returns the exit status (128 + signal when killed
// by one, 124 on timeout, 127 when it could not start).
int run_program(const std::vector<std::string>& argv, const std::filesystem::path& out,
                const std::filesystem::path& err, double timeout_s);

// The last line of `text` that parses as a JSON object (peers print one); null when none does.
nlohmann::json last_json_object(const std::string& text);

// One training run as every system is told it (fsdp-train flags, the peers' flags).
struct TrainRun {
  std::string model = "transformer-small";  // a transformer-* preset
  int64_t vocab_size = 0;                   // 0: the preset's
  int devices = 2;                          // ranks (processes)
  int64_t batch_size = 4;                   // per rank
  int64_t block_size = 35;
  int64_t steps = 7;                        // optimizer steps, warm-up included
  double dropout = 0.2;
  double lr = 1e-3;
  int64_t seed = 42;
  double timeout_s = 1200;                  // per program
  std::filesystem::path dir;                // logs, summaries, the batch file
};

// `fsdp-train --save-batches`: the micro-batches fsdp-train trains on for `run`, every rank's,
// written to dir/batches.safetensors for the peers. Returns {"file", "command"} or {"error"}.
nlohmann::json write_batches(const std::string& fsdp_train, const TrainRun& run);

// fsdp-train with `flags` (--strategy ..., --precision ...) added to the run's; `name` names its
// files in run.dir. Returns the summary's fields (losses, step_end_seconds, peak_rss_mb = each
// rank's lifetime VmHWM, peak_alloc_mb, ...) plus "command", or "error".
nlohmann::json run_fsdp_train(const std::string& fsdp_train, const TrainRun& run,
                              const std::vector<std::string>& flags, const std::string& name);

// A Python peer (`script`: the path of bench/peers/torch_peer.py, ...) with `flags` (--strategy ..., --precision ...) on the
// run's batch file; the model's dimensions come from fsdp::demos::transformer_preset. Returns
// the JSON object it printed plus "command", or "error" (the peer's own or its stderr's tail).
nlohmann::json run_peer(const std::string& python, const std::string& script,
                        const TrainRun& run, const std::vector<std::string>& flags,
                        const std::string& name);

// "/proc/loadavg"'s three load averages ("6.73 7.20 7.11"), for reports.
std::string load_average();
// v with `digits` decimals.
std::string fixed(double v, int digits);
// "a,b,,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& comma_list);
// Seconds since t0 on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// The largest number of a JSON array (0 for an empty one).
double max_of(const nlohmann::json& values);

// The entries of `all` named in `comma_list` (in its order; `name` is each entry's name field),
// or std::nullopt after printing "fsdp-bench <bench>: error: unknown <what> 'x' in <flag>; valid:
// a, b, ..." for a name `all` does not have (the caller then exits 2).
template <typename T>
std::optional<std::vector<T>> pick_by_name(const std::vector<T>& all, std::string T::*name,
                                           const std::string& comma_list,
                                           const std::string& bench, const std::string& what,
                                           const std::string& flag) {
  std::vector<T> picked;
  for (const auto& wanted : split_list(comma_list)) {
    auto it = std::find_if(all.begin(), all.end(), [&](const T& e) { return e.*name == wanted; });
    if (it == all.end()) {
      std::string valid;
      for (const auto& e : all) valid += (valid.empty() ? "" : ", ") + e.*name;
      std::cerr << "fsdp-bench " << bench << ": error: unknown " << what << " '" << wanted
                << "' in " << flag << "; valid: " << valid << "\n";
      return std::nullopt;
    }
    picked.push_back(*it);
  }
  return picked;
}

// Ends a benchmark's report: sets out["load_average_end"] and out["markdown"] =
// markdown_table(out), prints the JSON on stdout and the table on stderr (and into
// markdown_file when not empty). Returns the exit status: 1 when one of fsdp.cpp's own runs
// (out["runs"], system "fsdp.cpp") failed, else 0; a peer's failure is data, in the table.
int print_report(nlohmann::json& out, const std::string& markdown_file,
                 const std::function<std::string(const nlohmann::json&)>& markdown_table);

// Optimizer steps per second after `warmup` steps, from the end times of every step (seconds
// on one clock): (n - warmup) / (end[n-1] - end[warmup-1]). Every system of a benchmark is
// timed with this one function. Needs 1 <= warmup < n; otherwise null.
nlohmann::json it_per_s(const std::vector<double>& step_end_seconds, int warmup);

}  // namespace fsdp::bench
