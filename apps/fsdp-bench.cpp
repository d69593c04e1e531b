// fsdp-bench: benchmarks that print JSON. Subcommands live in bench/*.cpp.

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "../bench/bench.h"
#include "cli.h"

namespace fsdp::bench {

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

std::optional<int> parse_args(CLI::App& app, const std::string& subcommand,
                              const std::vector<std::string>& args) {
  const std::string prog = "fsdp-bench " + subcommand;
  std::vector<const char*> argv = {prog.c_str()};
  for (const auto& a : args) argv.push_back(a.c_str());
  return fsdp::cli::parse(app, static_cast<int>(argv.size()), argv.data(), prog);
}

std::filesystem::path self_dir() {
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::current_path() : exe.parent_path();
}

Registrar::Registrar(const std::string& name, const std::string& help, Command command) {
  registry().push_back({name, help, std::move(command)});
}

}  // namespace fsdp::bench

int main(int argc, char** argv) {
  using fsdp::bench::registry;
  // By name: the order of the files' registrations depends on how they were compiled and linked.
  std::sort(registry().begin(), registry().end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  auto usage = [] {
    std::cerr << "usage: fsdp-bench SUBCOMMAND [ARGS...]   (SUBCOMMAND --help for its flags)\n"
                 "subcommands:\n";
    for (const auto& e : registry()) std::cerr << "  " << e.name << "  " << e.help << "\n";
  };
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  std::string name = argv[1];
  if (name == "--list-subcommands") {  // hidden: the fuzz test's list (tests/test_flag_fuzz.cpp)
    for (const auto& e : registry()) std::cout << e.name << "\n";
    return 0;
  }
  for (const auto& e : registry()) {
    if (e.name == name) {
      std::vector<std::string> args(argv + 2, argv + argc);
      try {
        return e.command(args);
      } catch (const std::exception& ex) {
        std::cerr << "fsdp-bench " << name << ": error: " << ex.what() << "\n";
        return 1;
      }
    }
  }
  std::cerr << "fsdp-bench: unknown subcommand '" << name << "'\n";
  usage();
  return 2;
}
