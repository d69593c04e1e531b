// safetensors reader and writer. See Note [Validate before touching memory] in safetensors.h.
#include "ckpt/safetensors.h"

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdp::ckpt {
namespace {

using json = nlohmann::json;

// The reference implementation refuses headers over 100 MB; so do we (a corrupt length field
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

[[noreturn]] void fail(const std::string& what, const std::string& message) {
  throw FormatError(what + ": " + message);
}

std::string errno_str() { return std::strerror(errno); }

// The checksum record of `n` tensors (Note [Checkpoint checksums]).
std::string checksum_record(const std::vector<uint32_t>& crcs) {
  std::string out;
  for (size_t i = 0; i < crcs.size(); ++i) {
    if (i) out.push_back(',');
    out += crc32_hex(crcs[i]);
  }
  return out;
}

std::string dir_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw FormatError(path + ": write failed: " + errno_str() + " (disk full or read-only?)");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "F64";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

bool parse_dtype(const std::string& name, DType* out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F64", DType::kF64}, {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16},
      {"I64", DType::kI64}, {"I32", DType::kI32}, {"I16", DType::kI16}, {"I8", DType::kI8},
      {"U8", DType::kU8},   {"BOOL", DType::kBool}};
  for (const auto& [n, d] : kNames) {
    if (name == n) {
      *out = d;
      return true;
    }
  }
  return false;
}

int64_t dtype_itemsize(DType dtype) {
  switch (dtype) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kI8: case DType::kU8: case DType::kBool: return 1;
  }
  return 1;
}

int64_t TensorSpec::numel() const {
  for (int64_t d : shape) {
    if (d == 0) return 0;  // before multiplying: a corrupt huge dimension must not overflow
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorSpec::row_nbytes() const {
  if (shape.empty() || shape[0] == 0) return nbytes();
  return nbytes() / shape[0];
}

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* prefix, size_t prefix_size,
                                           uint64_t file_size, const std::string& what) {
  if (file_size < 8 || prefix_size < 8) {
    fail(what, "file has " + std::to_string(file_size) +
                   " bytes, less than the 8-byte header length; the file is truncated or not "
                   "a safetensors file");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes) {
    fail(what, "header length " + std::to_string(n) + " exceeds the 100 MiB limit; the file is "
               "corrupt or not a safetensors file");
  }
  if (n > file_size - 8) {
    fail(what, "header length " + std::to_string(n) + " exceeds the " +
                   std::to_string(file_size - 8) +
                   " bytes after the length field; the file is truncated or corrupt");
  }
  if (prefix_size < 8 + n) {
    fail(what, "internal: header prefix shorter than the header length");
  }
  SafetensorsHeader header;
  header.data_start = 8 + n;
  header.data_size = file_size - header.data_start;

  json doc;
  try {
    doc = json::parse(prefix + 8, prefix + 8 + n);
  } catch (const json::exception& e) {
    fail(what, std::string("header is not valid JSON (") + e.what() +
                   "); the file is truncated or corrupt");
  }
  if (!doc.is_object()) fail(what, "header JSON is not an object; the file is corrupt");

  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(what, "\"__metadata__\" is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          fail(what, "\"__metadata__\" entry '" + m.key() + "' is not a string");
        }
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    std::string where = "tensor '" + name + "'";
    if (!v.is_object()) fail(what, where + " is not an object {dtype, shape, data_offsets}");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end()) {
      fail(what, where + " lacks one of \"dtype\", \"shape\", \"data_offsets\"");
    }
    TensorEntry e;
    e.name = name;
    if (!dt->is_string() || !parse_dtype(dt->get<std::string>(), &e.dtype)) {
      fail(what, where + " has unknown dtype " + dt->dump() +
                     " (known: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
    }
    if (!sh->is_array()) fail(what, where + " shape is not an array");
    // numel * itemsize must fit comfortably: bound by the file size as we go.
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) {
        fail(what, where + " shape " + sh->dump() + " has a non-integer or negative dimension");
      }
      uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
      e.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(dim, INT64_MAX)));
      if (dim != 0 && numel > (1ull << 59) / dim) overflow = true;
      numel = overflow ? numel : numel * dim;
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      fail(what, where + " data_offsets " + off->dump() + " is not [begin, end]");
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.end < e.begin) {
      fail(what, where + " offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                     ") end before they begin; the file is corrupt");
    }
    // A zero-size tensor is fine even with a huge dimension elsewhere; guard the product.
    bool has_zero = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
    if (overflow && !has_zero) {
      fail(what, where + " shape " + shape_str(e.shape) + " is too large; the file is corrupt");
    }
    uint64_t nbytes = has_zero ? 0 : numel * static_cast<uint64_t>(dtype_itemsize(e.dtype));
    if (nbytes != e.end - e.begin) {
      fail(what, where + " shape " + shape_str(e.shape) + " x " + dtype_name(e.dtype) + " is " +
                     std::to_string(nbytes) + " bytes but its offsets [" +
                     std::to_string(e.begin) + ", " + std::to_string(e.end) + ") span " +
                     std::to_string(e.end - e.begin) + "; the file is corrupt");
    }
    if (e.end > header.data_size) {
      fail(what, where + " offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                     ") exceed the data section of " + std::to_string(header.data_size) +
                     " bytes; the file is truncated or corrupt");
    }
    header.tensors.push_back(std::move(e));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < header.tensors.size(); ++i) {
    const auto& a = header.tensors[i - 1];
    const auto& b = header.tensors[i];
    if (b.begin < a.end) {
      fail(what, "tensors '" + a.name + "' [" + std::to_string(a.begin) + ", " +
                     std::to_string(a.end) + ") and '" + b.name + "' [" + std::to_string(b.begin) +
                     ", " + std::to_string(b.end) + ") overlap; the file is corrupt");
    }
  }
  return header;
}

SafetensorsHeader parse_safetensors_image(const uint8_t* data, size_t size,
                                          const std::string& what) {
  return parse_safetensors_header(data, size, size, what);
}

// --- reader

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    throw FormatError(path + ": cannot open: " + errno_str() +
                      "; check the checkpoint path");
  }
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw FormatError(path + ": fstat failed: " + errno_str());
    uint64_t file_size = static_cast<uint64_t>(st.st_size);
    uint8_t len_bytes[8] = {};
    size_t got = file_size >= 8 ? 8 : static_cast<size_t>(file_size);
    if (got > 0) pread_exact(len_bytes, got, 0, "");
    if (file_size < 8) {
      parse_safetensors_header(len_bytes, got, file_size, path);  // throws the size error
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
    std::vector<uint8_t> prefix(8);
    std::memcpy(prefix.data(), len_bytes, 8);
    if (n <= kMaxHeaderBytes && n <= file_size - 8) {
      prefix.resize(8 + n);
      if (n > 0) pread_exact(prefix.data() + 8, n, 8, "");
    }
    header_ = parse_safetensors_header(prefix.data(), prefix.size(), file_size, path);
    if (auto it = header_.metadata.find(kChecksumKey); it != header_.metadata.end()) {
      const std::string& rec = it->second;
      size_t at = 0;
      for (const auto& e : header_.tensors) {
        const bool ok = rec.size() >= at + 8 &&
                        rec.find_first_not_of("0123456789abcdef", at) >= at + 8 &&
                        (rec.size() == at + 8 || rec[at + 8] == ',');
        if (!ok) {
          throw FormatError(path + ": the checksum record \"" + std::string(kChecksumKey) +
                            "\" is malformed (expected " + std::to_string(header_.tensors.size()) +
                            " comma-separated 8-digit hex values); the header is corrupt");
        }
        crc32_[e.name] = static_cast<uint32_t>(std::stoul(rec.substr(at, 8), nullptr, 16));
        at += 9;
      }
      if (at < rec.size() + 1 && !(header_.tensors.empty() && rec.empty())) {
        throw FormatError(path + ": the checksum record \"" + std::string(kChecksumKey) +
                          "\" has more values than the file has tensors; the header is corrupt");
      }
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorEntry& SafetensorsReader::entry(const std::string& name) const {
  if (const TensorEntry* e = header_.find(name)) return *e;
  std::string names;
  for (size_t i = 0; i < header_.tensors.size() && i < 8; ++i) {
    names += (i ? ", " : "") + header_.tensors[i].name;
  }
  if (header_.tensors.size() > 8) names += ", ...";
  throw FormatError(path_ + ": has no tensor '" + name + "' (it holds " +
                    std::to_string(header_.tensors.size()) + ": " + names +
                    "); the checkpoint was saved from a different model");
}

void SafetensorsReader::pread_exact(void* dst, size_t n, uint64_t offset,
                                    const std::string& tensor) const {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      throw FormatError(path_ + ": short read" +
                        (tensor.empty() ? std::string() : " of tensor '" + tensor + "'") +
                        " at byte " + std::to_string(offset) +
                        (r < 0 ? ": " + errno_str() : std::string(" (end of file)")) +
                        "; the file was truncated after it was opened");
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

void SafetensorsReader::read(const std::string& name, void* dst, size_t dst_size) const {
  const TensorEntry& e = entry(name);
  if (dst_size != e.end - e.begin) {
    throw FormatError(path_ + ": tensor '" + name + "' has " + std::to_string(e.end - e.begin) +
                      " bytes, the destination " + std::to_string(dst_size));
  }
  if (dst_size) pread_exact(dst, dst_size, header_.data_start + e.begin, name);
}

void SafetensorsReader::read_rows(const std::string& name, int64_t row_begin, int64_t rows,
                                  void* dst, size_t dst_size) const {
  const TensorEntry& e = entry(name);
  int64_t dim0 = e.shape.empty() ? 1 : e.shape[0];
  if (row_begin < 0 || rows < 0 || row_begin + rows > dim0) {
    throw FormatError(path_ + ": rows [" + std::to_string(row_begin) + ", " +
                      std::to_string(row_begin + rows) + ") of tensor '" + name +
                      "' are outside its " + std::to_string(dim0) + " rows");
  }
  uint64_t row = static_cast<uint64_t>(e.row_nbytes());
  if (dst_size != row * static_cast<uint64_t>(rows)) {
    throw FormatError(path_ + ": rows of tensor '" + name + "' need " +
                      std::to_string(row * rows) + " bytes, the destination has " +
                      std::to_string(dst_size));
  }
  if (dst_size) {
    pread_exact(dst, dst_size, header_.data_start + e.begin + row * row_begin, name);
  }
}

uint32_t SafetensorsReader::recorded_crc32(const std::string& name) const {
  auto it = crc32_.find(name);
  if (it == crc32_.end()) {
    throw FormatError(path_ + ": no checksum recorded for tensor '" + name + "'");
  }
  return it->second;
}

uint32_t SafetensorsReader::crc32_of(const std::string& name) const {
  const TensorEntry& e = entry(name);
  std::vector<char> buf(std::min<uint64_t>(e.end - e.begin, 4u << 20));
  uint32_t crc = 0;
  for (uint64_t at = e.begin; at < e.end;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), e.end - at));
    pread_exact(buf.data(), n, header_.data_start + at, name);
    crc = crc32_update(crc, buf.data(), n);
    at += n;
  }
  return crc;
}

uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes) {
  return static_cast<uint32_t>(
      ::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(nbytes)));
}

std::string crc32_hex(uint32_t crc) {
  static const char* digits = "0123456789abcdef";
  std::string out(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) out[static_cast<size_t>(i)] = digits[crc & 0xf];
  return out;
}

// --- writer

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorSpec> specs,
                                     std::map<std::string, std::string> metadata,
                                     bool checksums)
    : path_(std::move(path)), metadata_(std::move(metadata)), checksums_(checksums),
      specs_(std::move(specs)) {
  if (checksums_) crc32_.assign(specs_.size(), 0);
  uint64_t offset = 0;
  std::map<std::string, bool> seen;
  for (const auto& s : specs_) {
    if (s.name == "__metadata__" || seen[s.name]) {
      throw FormatError(path_ + ": tensor name '" + s.name + "' is reserved or repeated");
    }
    seen[s.name] = true;
    for (int64_t d : s.shape) {
      if (d < 0) throw FormatError(path_ + ": tensor '" + s.name + "' has a negative dimension");
    }
    offset += static_cast<uint64_t>(s.nbytes());
    ends_.push_back(offset);
  }
  const std::string text = header_text();

  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid());
  // Read and write: tensors placed with write_at are read back for their checksums.
  fd_ = ::open(tmp_path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw FormatError(tmp_path_ + ": cannot create: " + errno_str() +
                      "; check that the checkpoint directory exists and is writable");
  }
  write_raw(text.data(), text.size());
  data_start_ = text.size();
}

std::string SafetensorsWriter::header_text() const {
  json header = json::object();
  for (size_t i = 0; i < specs_.size(); ++i) {
    const TensorSpec& s = specs_[i];
    const uint64_t begin = i == 0 ? 0 : ends_[i - 1];
    header[s.name] = {{"dtype", dtype_name(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {begin, ends_[i]}}};
  }
  std::map<std::string, std::string> metadata = metadata_;
  if (checksums_) metadata[kChecksumKey] = checksum_record(crc32_);
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + text;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());
}

void SafetensorsWriter::write_raw(const void* data, size_t n) { write_all(fd_, data, n, tmp_path_); }

size_t SafetensorsWriter::next_tensor() const {
  return static_cast<size_t>(std::upper_bound(ends_.begin(), ends_.end(), written_) -
                             ends_.begin());
}

void SafetensorsWriter::write(const void* data, size_t nbytes) {
  uint64_t total = ends_.empty() ? 0 : ends_.back();
  if (written_ + nbytes > total) {
    throw FormatError(path_ + ": writing " + std::to_string(nbytes) + " bytes past the " +
                      std::to_string(total) + " bytes the header declares");
  }
  write_raw(data, nbytes);
  if (checksums_) {  // the bytes may run from one tensor into the next
    const char* p = static_cast<const char*>(data);
    for (uint64_t pos = written_, left = nbytes; left > 0;) {
      const size_t t = static_cast<size_t>(
          std::upper_bound(ends_.begin(), ends_.end(), pos) - ends_.begin());
      const uint64_t n = std::min<uint64_t>(left, ends_[t] - pos);
      crc32_[t] = crc32_update(crc32_[t], p, static_cast<size_t>(n));
      p += n;
      pos += n;
      left -= n;
    }
  }
  written_ += nbytes;
}

void SafetensorsWriter::write_at(size_t tensor, uint64_t byte_offset, const void* data,
                                 size_t nbytes) {
  if (tensor >= specs_.size() || tensor < next_tensor() ||
      byte_offset + nbytes > static_cast<uint64_t>(specs_[tensor].nbytes())) {
    throw FormatError(path_ + ": positional write of " + std::to_string(nbytes) + " bytes at " +
                      std::to_string(byte_offset) + " of tensor #" + std::to_string(tensor) +
                      " is outside the tensors still to write");
  }
  const uint64_t begin = tensor == 0 ? 0 : ends_[tensor - 1];
  const char* p = static_cast<const char*>(data);
  uint64_t at = data_start_ + begin + byte_offset;
  for (size_t left = nbytes; left > 0;) {
    ssize_t w = ::pwrite(fd_, p, left, static_cast<off_t>(at));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw FormatError(tmp_path_ + ": write failed: " + errno_str() +
                        " (disk full or read-only?)");
    }
    p += w;
    at += static_cast<uint64_t>(w);
    left -= static_cast<size_t>(w);
  }
  placed_ += nbytes;
}

void SafetensorsWriter::commit() {
  uint64_t total = ends_.empty() ? 0 : ends_.back();
  if (written_ + placed_ != total) {
    size_t t = next_tensor();
    throw FormatError(path_ + ": commit after " + std::to_string(written_ + placed_) + " of " +
                      std::to_string(total) + " data bytes (tensor '" +
                      (t < specs_.size() ? specs_[t].name : std::string("?")) +
                      "' incomplete)");
  }
  if (checksums_) {
    // Tensors past what write() wrote were placed with write_at: sum them from the file.
    std::vector<char> buf(4u << 20);
    for (size_t t = 0; t < specs_.size(); ++t) {
      const uint64_t begin = t == 0 ? 0 : ends_[t - 1];
      if (ends_[t] <= written_) continue;
      uint32_t crc = 0;
      for (uint64_t at = begin; at < ends_[t];) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), ends_[t] - at));
        for (size_t got = 0; got < n;) {
          const ssize_t r = ::pread(fd_, buf.data() + got, n - got,
                                    static_cast<off_t>(data_start_ + at + got));
          if (r < 0 && errno == EINTR) continue;
          if (r <= 0) throw FormatError(tmp_path_ + ": read back failed: " + errno_str());
          got += static_cast<size_t>(r);
        }
        crc = crc32_update(crc, buf.data(), n);
        at += n;
      }
      crc32_[t] = crc;
    }
    const std::string text = header_text();
    if (text.size() != data_start_) {
      throw FormatError(path_ + ": the header changed size when its checksums were filled in");
    }
    for (size_t done = 0; done < text.size();) {
      const ssize_t w = ::pwrite(fd_, text.data() + done, text.size() - done,
                                 static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        throw FormatError(tmp_path_ + ": write failed: " + errno_str() +
                          " (disk full or read-only?)");
      }
      done += static_cast<size_t>(w);
    }
  }
  if (::fsync(fd_) != 0) throw FormatError(tmp_path_ + ": fsync failed: " + errno_str());
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    throw FormatError(path_ + ": rename from " + tmp_path_ + " failed: " + errno_str());
  }
  committed_ = true;
  fsync_dir(dir_of(path_));
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems refuse directory fds
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw FormatError(tmp + ": cannot create: " + errno_str() +
                      "; check that the directory exists and is writable");
  }
  try {
    write_all(fd, contents.data(), contents.size(), tmp);
    if (::fsync(fd) != 0) throw FormatError(tmp + ": fsync failed: " + errno_str());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw FormatError(path + ": rename failed: " + errno_str());
  }
  fsync_dir(dir_of(path));
}

std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FormatError(path + ": cannot open: " + errno_str());
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ::close(fd);
      throw FormatError(path + ": read failed: " + errno_str());
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

}  // namespace fsdp::ckpt
