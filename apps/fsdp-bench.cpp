// fsdp-bench: benchmarks that print JSON. Subcommands live in bench/*.cpp.
#include <cstdio>
#include <iostream>

#include "../bench/bench.h"

namespace fsdp::bench {

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

Registrar::Registrar(const std::string& name, const std::string& help, Command command) {
  registry().push_back({name, help, std::move(command)});
}

}  // namespace fsdp::bench

int main(int argc, char** argv) {
  using fsdp::bench::registry;
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
