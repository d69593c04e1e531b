// CSV logger behind fsdp::CSVLogger (include/fsdp/logger.h): `<dir>/metrics.csv`. Columns are
// `step`, `epoch`, then every metric name ever logged, sorted; a row leaves the metrics it does
// not have empty. Global rank 0 only (the Trainer decides).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

class CsvLogger {
 public:
  // Creates <dir>/metrics.csv, which must not exist yet (a logger never overwrites a file it
  // did not create); dir exists (create_version_dir).
  explicit CsvLogger(std::string dir);

  void log(int64_t step, int64_t epoch, const std::map<std::string, double>& metrics);

  const std::string& dir() const { return dir_; }
  std::string path() const { return dir_ + "/metrics.csv"; }

 private:
  struct Row {
    int64_t step;
    int64_t epoch;
    std::map<std::string, double> metrics;
  };
  void write_all() const;
  void append(const Row& row) const;

  std::string dir_;
  std::vector<std::string> columns_;  // metric columns, sorted
  std::vector<Row> rows_;
};

// <root>/version_<version>, created if missing (version >= 0), or <root>/version_N with N the
// next free version, created atomically so that concurrent runs get different ones (version <
// 0). `who` names the logger in errors.
std::string create_version_dir(const std::string& root, int64_t version, const char* who);

}  // namespace fsdp::detail
