// Helpers of the tests that run the programs with bad input or damaged files
// (test_bad_input.cpp, test_input_checks.cpp, test_checkpoint_safety.cpp): a per-process scratch
// directory, a line count, and a snapshot of a directory's files ("nothing lost" compares two).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace fsdp::testing {

// temp/<prefix><pid>, emptied and created: call it once per test process (keep it in a static).
inline std::filesystem::path fresh_scratch(const std::string& prefix) {
  namespace fs = std::filesystem;
  fs::path d = fs::temp_directory_path() / (prefix + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Lines of `s` (a last line without '\n' counts).
inline int count_lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n')) +
         (!s.empty() && s.back() != '\n' ? 1 : 0);
}

// Every regular file under `dir` (relative name -> contents).
inline std::map<std::string, std::string> snapshot(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    out[fs::relative(e.path(), dir).string()] = ss.str();
  }
  return out;
}

}  // namespace fsdp::testing
