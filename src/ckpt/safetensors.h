// safetensors files: reader and streaming, atomic writer. Torch-free on purpose (raw bytes and a
// small tensor-metadata struct) so the libFuzzer target builds it with clang++ alone; the
// at::Tensor adapter lives in src/ckpt/tensor_io.{h,cpp}.
//
// Format (https://github.com/huggingface/safetensors):
//   [8 bytes]  N, unsigned little-endian: length of the JSON header
//   [N bytes]  JSON {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end)}, ...,
//                    "__metadata__": {"key": "string value", ...}}  (padded with spaces to 8)
//   [rest]     data section: raw little-endian tensor bytes at the offsets (relative to its start)
//
// Note [Validate before touching memory]
// --------------------------------------
// A checkpoint is untrusted input (truncated by a crash, corrupted on disk, written by another
// tool). parse_safetensors_header checks, in this order and naming the first problem: the
// header length against the file size, the JSON, every entry's dtype, shape (non-negative, no
// overflow), that shape * itemsize equals the offsets' span, that the offsets lie inside the
// data section, and that no two tensors overlap. Only then does any reader seek or copy bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::ckpt {

// Every malformed-file or mismatch problem; the message says which file, which tensor and what
// to do.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

const char* dtype_name(DType dtype);           // "F32", ...
std::string shape_str(const std::vector<int64_t>& shape);  // "[4096, 1024]"
bool parse_dtype(const std::string& name, DType* out);
int64_t dtype_itemsize(DType dtype);

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_itemsize(dtype); }
  // Bytes of one dim-0 row (nbytes for 0-d tensors).
  int64_t row_nbytes() const;
};

struct TensorEntry : TensorSpec {
  uint64_t begin = 0;  // offsets into the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;            // in data-offset order
  std::map<std::string, std::string> metadata; // "__metadata__"
  uint64_t data_start = 0;                     // 8 + header length
  uint64_t data_size = 0;                      // file size - data_start

  const TensorEntry* find(const std::string& name) const;
};

// Parses and validates a header (see Note [Validate before touching memory]). `prefix` is the
// first min(file_size, 8 + header length) bytes of the file; file_size is the whole file's size.
// `what` names the file in errors. Throws FormatError.
SafetensorsHeader parse_safetensors_header(const uint8_t* prefix, size_t prefix_size,
                                           uint64_t file_size, const std::string& what);
// The whole file in memory (tests, fuzzing).
SafetensorsHeader parse_safetensors_image(const uint8_t* data, size_t size,
                                          const std::string& what);

// Note [Checkpoint checksums]
// ---------------------------
// A writer asked for checksums records in the header's "__metadata__" the CRC-32 of every
// tensor's bytes: kChecksumKey -> 8 lowercase hex digits per tensor, comma-separated, in
// data-offset order (zero-size tensors: 00000000). The CRC is zlib's crc32 (the ISO-HDLC
// polynomial of gzip and PNG): zlib is on every machine that has libtorch, and neither crc32c
// nor xxhash is packaged where fsdp.cpp builds; at several GB/s it costs little beside the
// writes. The header is written first with zeros in their place and rewritten, same length,
// when the file is committed: tensors written in order are summed from the caller's memory,
// tensors placed with write_at are read back from the file. Readers compare what they read with
// the record (SafetensorsReader::recorded_crc32, crc32_of). Other tools ignore the entry.
constexpr const char* kChecksumKey = "fsdp.crc32";
uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes);
std::string crc32_hex(uint32_t crc);

// Reads tensors from a file with pread: only the bytes asked for.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  // The entry, or a FormatError naming the file, the tensor and the names it does hold.
  const TensorEntry& entry(const std::string& name) const;
  // All bytes of `name` into dst (entry.nbytes() bytes).
  void read(const std::string& name, void* dst, size_t dst_size) const;
  // Rows [row_begin, row_begin + rows) of dim 0 into dst.
  void read_rows(const std::string& name, int64_t row_begin, int64_t rows, void* dst,
                 size_t dst_size) const;
  // See Note [Checkpoint checksums]: whether the file records checksums, the one recorded for
  // `name`, and the CRC-32 of its bytes as they are on disk (read in bounded chunks).
  bool has_checksums() const { return header_.metadata.count(kChecksumKey) > 0; }
  uint32_t recorded_crc32(const std::string& name) const;
  uint32_t crc32_of(const std::string& name) const;

 private:
  void pread_exact(void* dst, size_t n, uint64_t offset, const std::string& tensor) const;
  std::string path_;
  int fd_ = -1;
  SafetensorsHeader header_;
  std::map<std::string, uint32_t> crc32_;  // recorded checksums by tensor name
};

// Streams tensors to `path` atomically: the header is written first (all specs are known up
// front), then each tensor's bytes in spec order, in as many write() calls as the caller likes
// (no whole-model buffer). commit() checks every byte arrived, fsyncs, renames the temporary
// file (same directory) onto `path` and fsyncs the directory. Destroying an uncommitted writer
// removes the temporary file: `path` is either the old file or the complete new one.
class SafetensorsWriter {
 public:
  // checksums: record every tensor's CRC-32 (Note [Checkpoint checksums]).
  SafetensorsWriter(std::string path, std::vector<TensorSpec> specs,
                    std::map<std::string, std::string> metadata = {}, bool checksums = false);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes of the current tensor (may span the end of one tensor into the next).
  void write(const void* data, size_t nbytes);
  // Writes bytes [byte_offset, byte_offset + nbytes) of tensor `tensor` in place (pwrite), for
  // data that arrives out of order (optimizer state streamed from the disk tier). Only for
  // tensors that write() does not reach: call write() for the leading tensors first. Every byte
  // must be written exactly once; commit() counts them.
  void write_at(size_t tensor, uint64_t byte_offset, const void* data, size_t nbytes);
  // Index of the tensor the next write() goes to (specs().size() when all are written).
  size_t next_tensor() const;
  const std::vector<TensorSpec>& specs() const { return specs_; }
  void commit();

 private:
  void write_raw(const void* data, size_t n);
  std::string header_text() const;  // padded to a multiple of 8 with the 8 length bytes
  std::string path_;
  std::map<std::string, std::string> metadata_;
  bool checksums_ = false;
  std::vector<uint32_t> crc32_;  // per tensor (write(): running; write_at: at commit)
  std::string tmp_path_;
  std::vector<TensorSpec> specs_;
  std::vector<uint64_t> ends_;  // cumulative end offset per tensor
  uint64_t written_ = 0;        // data-section bytes written by write()
  uint64_t placed_ = 0;         // and by write_at()
  uint64_t data_start_ = 0;     // file offset of the data section
  int fd_ = -1;
  bool committed_ = false;
};

// Atomically replaces `path` with `contents` (temporary file, fsync, rename, fsync directory).
void write_file_atomic(const std::string& path, const std::string& contents);
// fsyncs a directory (after creating or renaming entries in it).
void fsync_dir(const std::string& dir);
// Whole file as a string; FormatError when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace fsdp::ckpt
