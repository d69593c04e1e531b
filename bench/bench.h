// fsdp-bench subcommands. Each bench/<name>.cpp registers one subcommand:
//
//   static fsdp::bench::Registrar reg("comm", "collective bandwidth per backend", run_comm);
//
// A subcommand prints JSON on stdout (and may print a markdown table on stderr) and returns
// the process exit status. Benchmarks measure ratios against a baseline run beside them.
#pragma once

#include <functional>
#include <string>
#include <vector>

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

}  // namespace fsdp::bench
