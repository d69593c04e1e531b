// Small text helpers shared by every layer of src/ (header-only, no dependencies).
#pragma once

#include <string>
#include <vector>

namespace fsdp::detail {

// "'a', 'b', 'c'": the list of valid values an error message offers.
inline std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "'" : ", '") + name + "'";
  return out;
}

// The text up to its first newline (all of it when there is none).
inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace fsdp::detail
