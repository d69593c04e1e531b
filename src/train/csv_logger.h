// CSV logger: `<root>/version_N/metrics.csv`, N the next free version (as Lightning's
// CSVLogger). Columns are `step`, `epoch`, then every metric name ever logged, sorted; a row
// leaves the metrics it does not have empty. Global rank 0 only (the Trainer decides).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

class CsvLogger {
 public:
  // Creates <root>/version_N (atomically: concurrent runs get different versions).
  explicit CsvLogger(const std::string& root);

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

}  // namespace fsdp::detail
