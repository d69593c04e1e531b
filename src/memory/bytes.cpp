#include <c10/util/Exception.h>

#include <cctype>
#include <cmath>
#include <cstdio>

#include "fsdp/memory.h"

namespace fsdp {

int64_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t start = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  TORCH_CHECK(i > start, "cannot read a byte count from '", text,
              "'; write e.g. 12GiB, 800MB or 1073741824");
  double value = std::stod(text.substr(start, i - start));
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) unit += static_cast<char>(std::tolower(text[i]));
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb") mult = 1e3;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb") mult = 1e6;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb") mult = 1e9;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tb") mult = 1e12;
  else if (unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  TORCH_CHECK(mult > 0, "unknown byte unit '", unit, "' in '", text,
              "'; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB");
  return static_cast<int64_t>(std::llround(value * mult));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  else std::snprintf(buf, sizeof(buf), "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace fsdp
