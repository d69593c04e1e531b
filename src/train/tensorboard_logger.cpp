// Note [TensorBoard event files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TensorBoard reads a directory's `events.out.tfevents.*` files: a sequence of TFRecords, each
// an `Event` protocol buffer (tensorflow/core/util/event.proto). The few fields a scalar needs
// are written by hand here, so the library needs neither TensorFlow nor protobuf:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
//             Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first event of a file carries file_version "brain.Event:2" (what TensorBoard checks);
// every later one a step's scalars. TFRecord framing: u64 length (little-endian), the masked
// CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data. Each record goes to the
// kernel with one write() as it is logged: a crash loses nothing logged before it, and a live
// TensorBoard shows it at once. tests/test_loggers.cpp reads the files back with TensorBoard's
// own EventAccumulator.
#include "train/tensorboard_logger.h"

#include "fsdp/logger.h"
#include "common/process.h"
#include "train/csv_logger.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace fsdp::detail {

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 and aarch64 Linux are little-endian
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const auto table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string header;
  put_le<uint64_t>(header, data.size());
  std::string out = header;
  put_le<uint32_t>(out, masked_crc32c(header.data(), header.size()));
  out += data;
  put_le<uint32_t>(out, masked_crc32c(data.data(), data.size()));
  return out;
}

std::string encode_file_version_event(double wall_time) {
  std::string e;
  e.push_back(0x09);  // field 1, 64-bit
  put_le<double>(e, wall_time);
  put_bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::map<std::string, double>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes_field(v, 1, tag);
    v.push_back(0x15);  // field 2, 32-bit
    put_le<float>(v, static_cast<float>(value));
    put_bytes_field(summary, 1, v);
  }
  std::string e;
  e.push_back(0x09);
  put_le<double>(e, wall_time);
  e.push_back(0x10);  // field 2, varint
  put_varint(e, static_cast<uint64_t>(step));
  put_bytes_field(e, 5, summary);
  return e;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  const std::string stem = dir + "/events.out.tfevents." +
                           std::to_string(static_cast<int64_t>(now_seconds())) + "." +
                           host_name() + "." + std::to_string(::getpid()) + ".";
  for (int k = 0; fd_ < 0; ++k) {
    path_ = stem + std::to_string(k);
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    TORCH_CHECK(fd_ >= 0 || errno == EEXIST, "[TensorBoardLogger] cannot create '", path_,
                "': ", std::strerror(errno));
  }
  write_record(encode_file_version_event(now_seconds()));
}

EventFileWriter::~EventFileWriter() { close(); }

void EventFileWriter::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void EventFileWriter::write_scalars(int64_t step, const std::map<std::string, double>& scalars) {
  write_record(encode_scalars_event(now_seconds(), step, scalars));
}

void EventFileWriter::write_record(const std::string& event) {
  TORCH_CHECK(fd_ >= 0, "[TensorBoardLogger] '", path_, "' is closed");
  const std::string rec = tfrecord(event);
  size_t done = 0;
  while (done < rec.size()) {
    const ssize_t n = ::write(fd_, rec.data() + done, rec.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "[TensorBoardLogger] cannot write '", path_, "': ",
                std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

}  // namespace fsdp::detail

namespace fsdp {

TensorBoardLogger::TensorBoardLogger(std::string save_dir, int64_t version)
    : save_dir_(std::move(save_dir)), version_(version) {}

TensorBoardLogger::~TensorBoardLogger() = default;

void TensorBoardLogger::setup() {
  // A second fit with the same logger keeps its directory and starts a new event file there.
  if (dir_.empty()) dir_ = detail::create_version_dir(save_dir_, version_, "TensorBoardLogger");
  if (!writer_ || !writer_->is_open()) writer_ = std::make_unique<detail::EventFileWriter>(dir_);
}

void TensorBoardLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step,
                                    int64_t epoch) {
  TORCH_CHECK(writer_ && writer_->is_open(), "[TensorBoardLogger] log_metrics before setup()");
  auto scalars = metrics;
  scalars.emplace("epoch", static_cast<double>(epoch));  // as Lightning logs it
  writer_->write_scalars(step, scalars);
}

void TensorBoardLogger::finalize() {
  if (writer_) writer_->close();
}

std::string TensorBoardLogger::log_dir() const { return dir_; }

std::string TensorBoardLogger::path() const { return writer_ ? writer_->path() : std::string(); }

}  // namespace fsdp
