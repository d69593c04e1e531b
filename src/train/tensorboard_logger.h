// TensorBoard's event file, written without TensorFlow or protobuf (Note [TensorBoard event
// files] in src/train/tensorboard_logger.cpp). Behind fsdp::TensorBoardLogger
// (include/fsdp/logger.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace fsdp::detail {

// CRC-32C (Castagnoli), as TFRecord frames use it; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's masked form: rotate right by 15, add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// One TFRecord: length (u64 LE), masked CRC of the length, data, masked CRC of the data.
std::string tfrecord(const std::string& data);
// `Event` protocol buffers: the first record of a file (file_version "brain.Event:2"), and one
// step's scalars (Summary.Value{tag, simple_value}).
std::string encode_file_version_event(double wall_time);
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::map<std::string, double>& scalars);

// An event file in `dir` named events.out.tfevents.<seconds>.<host>.<pid>.<k>, created
// exclusively (k grows until the name is free: nothing is ever overwritten).
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // Appends one event and hands it to the kernel (a reader sees it at once).
  void write_scalars(int64_t step, const std::map<std::string, double>& scalars);
  void close();
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);

  std::string path_;
  int fd_ = -1;
};

}  // namespace fsdp::detail
