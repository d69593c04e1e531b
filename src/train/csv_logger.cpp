#include "train/csv_logger.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <sstream>

namespace fsdp::detail {
namespace fs = std::filesystem;

namespace {

std::string csv_escape(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += (c == '"') ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace

CsvLogger::CsvLogger(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  TORCH_CHECK(!ec, "[CsvLogger] cannot create log directory '", root, "': ", ec.message(),
              "; set default_root_dir (--default-root-dir) to a writable directory");
  int next = 0;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("version_", 0) != 0) continue;
    try {
      next = std::max(next, std::stoi(name.substr(8)) + 1);
    } catch (...) {
    }
  }
  // create_directory is atomic: if another run took version_N first, try the next one.
  for (int v = next;; ++v) {
    fs::path dir = fs::path(root) / ("version_" + std::to_string(v));
    if (fs::create_directory(dir, ec)) {
      dir_ = dir.string();
      break;
    }
    TORCH_CHECK(!ec, "[CsvLogger] cannot create '", dir.string(), "': ", ec.message());
  }
  write_all();  // an empty file with the header, so the path exists from the start
}

void CsvLogger::log(int64_t step, int64_t epoch, const std::map<std::string, double>& metrics) {
  Row row{step, epoch, metrics};
  bool new_column = false;
  for (const auto& kv : metrics) {
    if (!std::binary_search(columns_.begin(), columns_.end(), kv.first)) {
      columns_.insert(std::upper_bound(columns_.begin(), columns_.end(), kv.first), kv.first);
      new_column = true;
    }
  }
  rows_.push_back(std::move(row));
  if (new_column) {
    write_all();  // the header changed: rewrite (rare: the first rows of a run)
  } else {
    append(rows_.back());
  }
}

void CsvLogger::append(const Row& row) const {
  std::ofstream f(path(), std::ios::app);
  TORCH_CHECK(f, "[CsvLogger] cannot write '", path(), "': ", std::strerror(errno));
  f << row.step << "," << row.epoch;
  f << std::setprecision(std::numeric_limits<double>::max_digits10);
  for (const auto& c : columns_) {
    f << ",";
    auto it = row.metrics.find(c);
    if (it != row.metrics.end()) f << it->second;
  }
  f << "\n";
}

void CsvLogger::write_all() const {
  {
    std::ofstream f(path(), std::ios::trunc);
    TORCH_CHECK(f, "[CsvLogger] cannot write '", path(), "': ", std::strerror(errno));
    f << "step,epoch";
    for (const auto& c : columns_) f << "," << csv_escape(c);
    f << "\n";
  }
  for (const auto& row : rows_) append(row);
}

}  // namespace fsdp::detail
