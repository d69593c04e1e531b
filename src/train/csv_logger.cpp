#include "train/csv_logger.h"

#include "fsdp/logger.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

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

std::string create_version_dir(const std::string& root, int64_t version, const char* who) {
  std::error_code ec;
  fs::create_directories(root, ec);
  TORCH_CHECK(!ec, "[", who, "] cannot create log directory '", root, "': ", ec.message(),
              "; set default_root_dir (--default-root-dir) to a writable directory");
  if (version >= 0) {
    fs::path dir = fs::path(root) / ("version_" + std::to_string(version));
    fs::create_directory(dir, ec);
    TORCH_CHECK(!ec, "[", who, "] cannot create '", dir.string(), "': ", ec.message());
    return dir.string();
  }
  int64_t next = 0;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("version_", 0) != 0) continue;
    try {
      next = std::max<int64_t>(next, std::stoll(name.substr(8)) + 1);
    } catch (...) {
    }
  }
  // create_directory is atomic: if another run took version_N first, try the next one.
  for (int64_t v = next;; ++v) {
    fs::path dir = fs::path(root) / ("version_" + std::to_string(v));
    if (fs::create_directory(dir, ec)) return dir.string();
    TORCH_CHECK(!ec, "[", who, "] cannot create '", dir.string(), "': ", ec.message());
  }
}

CsvLogger::CsvLogger(std::string dir) : dir_(std::move(dir)) {
  // O_EXCL: a metrics.csv that exists belongs to another run (or an explicit version reused).
  const int fd = ::open(path().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "[CSVLogger] cannot create '", path(), "': ", std::strerror(errno),
              errno == EEXIST ? "; it belongs to another run: choose another version (or none, "
                                "for the next free one)"
                              : "");
  ::close(fd);
  write_all();  // the header, so the path holds a valid CSV from the start
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

namespace fsdp {

CSVLogger::CSVLogger(std::string save_dir, int64_t version)
    : save_dir_(std::move(save_dir)), version_(version) {}

CSVLogger::~CSVLogger() = default;

void CSVLogger::setup() {
  // A second fit with the same logger keeps appending to its file.
  if (!impl_) {
    impl_ = std::make_unique<detail::CsvLogger>(
        detail::create_version_dir(save_dir_, version_, "CSVLogger"));
  }
}

void CSVLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step,
                            int64_t epoch) {
  TORCH_CHECK(impl_, "[CSVLogger] log_metrics before setup()");
  impl_->log(step, epoch, metrics);
}

std::string CSVLogger::log_dir() const { return impl_ ? impl_->dir() : std::string(); }

}  // namespace fsdp
