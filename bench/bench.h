// fsdp-bench subcommands. Each bench/<name>.cpp registers one subcommand:
//
//   static fsdp::bench::Registrar reg("comm", "collective bandwidth per backend", run_comm);
//
// A subcommand prints JSON on stdout (and may print a markdown table on stderr) and returns
// the process exit status. Benchmarks measure ratios against a baseline run beside them.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace fsdp::bench {

using Command = std::function<int(const std::vector<std::string>& args)>;

struct Registrar {
  Registrar(const std::string& name, const std::string& help, Command command);
};

struct Entry {
  std::string name;
  std::string help;
  Command command;
};
std::vector<Entry>& registry();

// Parses a subcommand's arguments: std::nullopt to go on, or the status to return at once
// (0 after --help, 2 after printing one line for a bad flag or value).
std::optional<int> parse_args(CLI::App& app, const std::string& subcommand,
                              const std::vector<std::string>& args);
// Directory of the running fsdp-bench, where the other programs (fsdp-train, ...) are built.
std::filesystem::path self_dir();
// Bytes read + written per second by an in-place fp32 stream (a += b over 256 MiB, best of 3)
// at the current at::get_num_threads(): the bandwidth an in-place optimizer pass gets
// (bench/bandwidth.cpp says why not at::copy_).
double update_bandwidth();

}  // namespace fsdp::bench
