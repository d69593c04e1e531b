// Loggers: where a fit's logged metrics go, as Lightning's loggers (docs/logging.md).
//
//   fsdp::TrainerOptions o;
//   o.loggers = {std::make_shared<fsdp::CSVLogger>("logs"),
//                std::make_shared<fsdp::TensorBoardLogger>("logs")};
//
// With TrainerOptions::loggers empty (the default) and TrainerOptions::logger true, a fit writes
// both a CSV file and a TensorBoard event file into one <default_root_dir>/version_N directory.
//
// The Trainer calls a logger on global rank 0 only. A logger's constructor touches no file, so
// every rank can build the same TrainerOptions; setup() creates the output on rank 0.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

namespace fsdp {

namespace detail {
class CsvLogger;        // src/train/csv_logger.h
class EventFileWriter;  // src/train/tensorboard_logger.h
}  // namespace detail

class Logger {
 public:
  virtual ~Logger() = default;
  // Creates the output before the first logged value (global rank 0, once per fit; a logger
  // reused by a second fit keeps its directory).
  virtual void setup() = 0;
  // One row of metrics at an optimizer step (the step's values, or a validation's).
  virtual void log_metrics(const std::map<std::string, double>& metrics, int64_t step,
                           int64_t epoch) = 0;
  // End of fit (also when it ends with an error): everything logged is on disk after it.
  virtual void finalize() {}
  // The directory written to ("" before setup()).
  virtual std::string log_dir() const = 0;
};
using LoggerPtr = std::shared_ptr<Logger>;

// <save_dir>/version_N/metrics.csv: columns `step`, `epoch`, then every metric name ever logged,
// sorted; a row leaves the metrics it does not have empty. version < 0: the next free N (a
// concurrent run gets another one); version >= 0: exactly version_<version>, which must not
// hold a metrics.csv already (a logger never overwrites a file it did not create).
class CSVLogger : public Logger {
 public:
  explicit CSVLogger(std::string save_dir, int64_t version = -1);
  ~CSVLogger() override;
  void setup() override;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step,
                   int64_t epoch) override;
  std::string log_dir() const override;

 private:
  std::string save_dir_;
  int64_t version_;
  std::unique_ptr<detail::CsvLogger> impl_;
};

// <save_dir>/version_N/events.out.tfevents.<seconds>.<host>.<pid>.<k>: TensorBoard's event
// file (TFRecord framing with masked CRC-32C, `Event` protocol buffers holding scalar
// `simple_value`s), read by `tensorboard --logdir <save_dir>` and its Python EventAccumulator.
// Every metric becomes a scalar named as logged, plus `epoch`, at the optimizer step. version as
// CSVLogger's, except that an existing version_<version> may hold other files: the event file
// gets a name no other file has.
class TensorBoardLogger : public Logger {
 public:
  explicit TensorBoardLogger(std::string save_dir, int64_t version = -1);
  ~TensorBoardLogger() override;
  void setup() override;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step,
                   int64_t epoch) override;
  void finalize() override;
  std::string log_dir() const override;
  std::string path() const;  // the event file ("" before setup())

 private:
  std::string save_dir_;
  int64_t version_;
  std::string dir_;
  std::unique_ptr<detail::EventFileWriter> writer_;
};

}  // namespace fsdp
