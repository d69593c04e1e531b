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

}  // namespace fsdp::detail
