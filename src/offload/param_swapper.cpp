// detail::ParamSwapper: see param_swapper.h and Note [Parameters on disk] in docs/design.md.
#include "offload/param_swapper.h"

#include "fsdp/memory.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace fsdp::detail {

// A unit's record: [header | param 0 | param 1 | ...], each parameter at a 64-byte aligned
// offset, the payload padded to kAioAlignment for O_DIRECT.
struct ParamSwapper::Unit {
  std::string name;
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;  // byte offset of each parameter in the payload
  int64_t numel = 0;
  int64_t payload_bytes = 0;
  int64_t file = -1;         // index into dir_->files(); -1: kept in RAM (max_in_cpu)
  int fd = -1;
  uint64_t generation = 0;   // writes of the record that landed or are in flight
  int refs = 0;              // acquire calls not yet released
  bool resident = true;      // the storages hold the values
  bool dirty = false;        // modified while acquired: written back at the last release
  int read_buffer = -1;      // a buffer holding (or reading) this unit's record
  int write_buffer = -1;     // a buffer whose write of this unit's record may be in flight
};

struct ParamSwapper::Buffer {
  enum class Use { kFree, kReading, kWriting };
  AlignedBuffer mem;
  Use use = Use::kFree;
  size_t unit = 0;
  AioTicket ticket;
};

namespace {

constexpr int64_t kParamAlign = 64;

int64_t param_bytes(const at::Tensor& p) {
  return p.numel() * static_cast<int64_t>(p.element_size());
}

void set_storage_bytes(const at::Tensor& p, int64_t bytes) {
  at::native::resize_bytes_cpu(p.storage().unsafeGetStorageImpl(), static_cast<size_t>(bytes));
}

}  // namespace

ParamDiskPlan ParamSwapper::make_plan(const std::vector<int64_t>& unit_bytes,
                                      const Options& o) {
  TORCH_CHECK(o.buffer_count >= 1, o.who, " offload_param buffer_count must be >= 1, got ",
              o.buffer_count);
  TORCH_CHECK(o.buffer_size >= 1, o.who, " offload_param buffer_size must be >= 1 element, got ",
              o.buffer_size);
  TORCH_CHECK(o.max_in_cpu >= 0, o.who, " offload_param max_in_cpu must be >= 0 elements, got ",
              o.max_in_cpu);
  ParamDiskPlan p;
  p.buffer_count = o.buffer_count;
  p.buffer_numel = o.buffer_size;
  p.units = static_cast<int64_t>(unit_bytes.size());
  int64_t largest_on_disk = 0;
  for (int64_t bytes : unit_bytes) {
    const int64_t numel = bytes / 4;  // fp32 elements (the master copy)
    p.largest_unit_numel = std::max(p.largest_unit_numel, numel);
    if (p.numel_in_cpu + numel <= o.max_in_cpu && p.units_on_disk == 0) {
      p.numel_in_cpu += numel;  // the first units, as long as they fit in max_in_cpu
      p.ram_param_bytes += bytes;
      continue;
    }
    ++p.units_on_disk;
    p.numel_on_disk += numel;
    p.disk_bytes += kAioAlignment + align_up(bytes);
    largest_on_disk = std::max(largest_on_disk, align_up(bytes));
  }
  // Buffers as large as the largest record, never more than buffer_size elements.
  p.buffer_bytes = p.units_on_disk == 0
                       ? 0
                       : std::min<int64_t>(o.buffer_count, p.units_on_disk) *
                             (kAioAlignment + largest_on_disk);
  p.free_bytes = free_disk_bytes(o.nvme_path);
  return p;
}

ParamSwapper::ParamSwapper(std::vector<UnitParams> units, Options options)
    : options_(std::move(options)) {
  const std::string& who = options_.who;
  std::vector<int64_t> unit_bytes;
  for (auto& up : units) {
    Unit u;
    u.name = up.name;
    for (auto& p : up.params) {
      if (!p.defined() || p.numel() == 0) continue;
      TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.storage_offset() == 0 &&
                      static_cast<int64_t>(p.storage().nbytes()) == param_bytes(p),
                  who, " offload_param device \"nvme\": a sharded parameter of unit '", up.name,
                  "' (shape ", p.sizes(), ") does not own a contiguous CPU storage of its size");
      TORCH_CHECK(unit_index_.emplace(p.unsafeGetTensorImpl(), units_.size()).second, who,
                  " offload_param device \"nvme\": a parameter of shape ", p.sizes(),
                  " is in two units");
      u.offsets.push_back(u.payload_bytes);
      u.payload_bytes += align_up(param_bytes(p), kParamAlign);
      u.numel += p.numel();
      u.params.push_back(p);
    }
    if (u.params.empty()) continue;
    u.payload_bytes = align_up(u.payload_bytes);
    unit_bytes.push_back(u.payload_bytes);
    units_.push_back(std::move(u));
  }

  // Budget first: what goes where, checked before anything is allocated or created.
  plan_ = make_plan(unit_bytes, options_);
  plan_.dir = options_.nvme_path + "/" + options_.job + "/rank" + std::to_string(options_.rank);
  const int64_t buffer_limit = align_up(options_.buffer_size * 4);
  for (const auto& u : units_) {
    TORCH_CHECK(u.payload_bytes <= buffer_limit, who, " offload_param device \"nvme\": unit '",
                u.name, "' holds ", u.numel, " parameter elements on rank ", options_.rank,
                " (", format_bytes(u.payload_bytes), "), more than one buffer of buffer_size ",
                options_.buffer_size, " elements (", format_bytes(buffer_limit),
                "). HINT: raise offload_param.buffer_size (fsdp-train --params-buffer-size) "
                "to at least ", (u.payload_bytes + 3) / 4, ", or use more ranks");
  }
  const int64_t node_bytes = plan_.disk_bytes * std::max(1, options_.ranks_sharing_disk);
  if (plan_.free_bytes >= 0) {
    TORCH_CHECK(node_bytes <= plan_.free_bytes, who, " rank ", options_.rank,
                ": parameters on disk need ", format_bytes(plan_.disk_bytes), " (",
                plan_.disk_bytes, " bytes) of swap files per rank, ", format_bytes(node_bytes),
                " for the ", options_.ranks_sharing_disk, " rank(s) of this node, under '",
                options_.nvme_path, "' but only ", format_bytes(plan_.free_bytes),
                " are free there. HINT: free space, point nvme_path at a larger disk, or "
                "spread the ranks over more nodes");
  }
  const int64_t budget = memory_budget();
  if (budget > 0) {
    int64_t on_disk_bytes = 0;
    for (size_t i = static_cast<size_t>(units_.size() - plan_.units_on_disk); i < units_.size(); ++i) {
      for (auto& p : units_[i].params) on_disk_bytes += param_bytes(p);
    }
    const int64_t in_use = memory_stats().current_bytes;
    const int64_t need = in_use - on_disk_bytes + plan_.buffer_bytes;
    if (need > budget) {
      throw OutOfMemoryError(
          c10::SourceLocation{__func__, __FILE__, __LINE__},
          who + " rank " + std::to_string(options_.rank) + ": with parameters on disk this rank "
          "needs " + format_bytes(need) + " (" + format_bytes(in_use) + " in use, minus " +
          format_bytes(on_disk_bytes) + " of parameters moved to disk, plus " +
          std::to_string(std::min<int64_t>(options_.buffer_count, plan_.units_on_disk)) +
          " parameter buffers of " +
          format_bytes(plan_.buffer_bytes / std::max<int64_t>(1, std::min<int64_t>(
                                                      options_.buffer_count, plan_.units_on_disk))) +
          ") but the memory budget is " + format_bytes(budget) + ". HINT: lower "
          "offload_param.buffer_count or max_in_cpu, or use more ranks");
    }
  }

  dir_ = std::make_unique<SwapDir>(options_.nvme_path, options_.job, options_.rank);
  engine_ = std::make_unique<AioEngine>(options_.aio);
  const size_t first_on_disk = units_.size() - static_cast<size_t>(plan_.units_on_disk);
  const int64_t nbuf = std::min<int64_t>(options_.buffer_count, plan_.units_on_disk);
  const int64_t buffer_bytes = nbuf == 0 ? 0 : plan_.buffer_bytes / nbuf;
  buffers_.resize(static_cast<size_t>(nbuf));
  // One buffer first: the units go to disk through it one at a time (each freed after its
  // write), so setup's peak is one buffer above what is in use now.
  if (nbuf > 0) buffers_[0].mem = AlignedBuffer(buffer_bytes);
  for (size_t i = first_on_disk; i < units_.size(); ++i) {
    Unit& u = units_[i];
    u.file = static_cast<int64_t>(dir_->files().size());
    u.fd = dir_->create("params.unit" + std::to_string(i) + ".swp",
                        kAioAlignment + u.payload_bytes);
    u.dirty = true;
    write_back(i);
    flush();
  }
  for (auto& b : buffers_) {
    if (b.mem.size() == 0) b.mem = AlignedBuffer(buffer_bytes);
  }
}

ParamSwapper::~ParamSwapper() {
  for (auto& b : buffers_) {
    try {
      AioEngine::wait(b.ticket);
    } catch (...) {
    }
    b.ticket.reset();
    if (b.use == Buffer::Use::kWriting) units_[b.unit].write_buffer = -1;
    if (b.use == Buffer::Use::kReading) units_[b.unit].read_buffer = -1;
    b.use = Buffer::Use::kFree;
  }
  // The model outlives the strategy: its parameters come back to RAM (what setup held), so
  // they stay usable. A record that cannot be read leaves its parameters empty (0 elements),
  // never a tensor whose storage is smaller than its shape.
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = units_[i];
    if (u.resident || u.file < 0) continue;
    bool ok = failed_.empty();
    if (ok) {
      try {
        load(i);
      } catch (...) {
        ok = false;
      }
    }
    if (!ok) {
      for (auto& p : u.params) p.set_data(at::empty({0}, p.options()));
    }
  }
  engine_.reset();
}

bool ParamSwapper::manages(const at::Tensor& param) const {
  auto it = unit_index_.find(param.unsafeGetTensorImpl());
  return it != unit_index_.end() && units_[it->second].file >= 0;
}

ParamSwapper::Unit& ParamSwapper::unit_of(const at::Tensor& param) {
  auto it = unit_index_.find(param.unsafeGetTensorImpl());
  TORCH_INTERNAL_ASSERT(it != unit_index_.end(), "ParamSwapper: a parameter of shape ",
                        param.sizes(), " is not one of its units'");
  return units_[it->second];
}

int64_t ParamSwapper::resident_units() const {
  int64_t n = 0;
  for (const auto& u : units_) n += u.resident ? 1 : 0;
  return n;
}

void ParamSwapper::fail(const std::exception& e) {
  if (failed_.empty()) failed_ = e.what();
}

// Buffers whose write landed become free (a failed write throws here).
void ParamSwapper::free_done_writes() {
  for (auto& b : buffers_) {
    if (b.use != Buffer::Use::kWriting || !AioEngine::done(b.ticket)) continue;
    AioEngine::wait(b.ticket);
    b.ticket.reset();
    units_[b.unit].write_buffer = -1;
    b.use = Buffer::Use::kFree;
  }
}

// A buffer for a read or write: a free one, else the oldest write (waited for), else a
// prefetched read no acquire has claimed (dropped; its unit is read again when needed).
int ParamSwapper::take_buffer() {
  free_done_writes();
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i].use == Buffer::Use::kFree) return static_cast<int>(i);
  }
  for (auto use : {Buffer::Use::kWriting, Buffer::Use::kReading}) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      Buffer& b = buffers_[i];
      if (b.use != use) continue;
      AioEngine::wait(b.ticket);
      b.ticket.reset();
      Unit& u = units_[b.unit];
      if (use == Buffer::Use::kWriting) {
        u.write_buffer = -1;
      } else {
        u.read_buffer = -1;
      }
      b.use = Buffer::Use::kFree;
      return static_cast<int>(i);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "ParamSwapper: no buffer");
  return -1;
}

void ParamSwapper::issue_read(size_t i, int b) {
  Unit& u = units_[i];
  Buffer& buf = buffers_[static_cast<size_t>(b)];
  buf.use = Buffer::Use::kReading;
  buf.unit = i;
  buf.ticket = engine_->read(u.fd, buf.mem.data(), kAioAlignment + u.payload_bytes, 0,
                             dir_->files()[static_cast<size_t>(u.file)]);
  u.read_buffer = b;
}

// The record into the storages: from the buffer still holding its last write, from a
// prefetched read, or read now.
void ParamSwapper::load(size_t i) {
  Unit& u = units_[i];
  TORCH_INTERNAL_ASSERT(!u.resident && u.file >= 0);
  int b = u.write_buffer >= 0 ? u.write_buffer : u.read_buffer;
  if (b < 0) {
    b = take_buffer();
    issue_read(i, b);
  }
  Buffer& buf = buffers_[static_cast<size_t>(b)];
  const bool reading = buf.use == Buffer::Use::kReading;
  if (reading) {
    AioEngine::wait(buf.ticket);
    buf.ticket.reset();
    verify_swap_record(buf.mem.data(), u.generation, u.payload_bytes, u.numel,
                       dir_->files()[static_cast<size_t>(u.file)]);
  }
  const char* payload = buf.mem.data() + kAioAlignment;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const at::Tensor& p = u.params[k];
    set_storage_bytes(p, param_bytes(p));
    std::memcpy(p.data_ptr(), payload + u.offsets[k], static_cast<size_t>(param_bytes(p)));
  }
  if (reading) {
    buf.use = Buffer::Use::kFree;
    u.read_buffer = -1;
  }
  u.resident = true;
}

// The storages into a record (written when dirty), then freed.
void ParamSwapper::write_back(size_t i) {
  Unit& u = units_[i];
  TORCH_INTERNAL_ASSERT(u.resident && u.file >= 0);
  if (u.dirty) {
    if (u.write_buffer >= 0) {  // an older write of this record: let it land first
      Buffer& old = buffers_[static_cast<size_t>(u.write_buffer)];
      AioEngine::wait(old.ticket);
      old.ticket.reset();
      old.use = Buffer::Use::kFree;
      u.write_buffer = -1;
    }
    const int b = take_buffer();
    Buffer& buf = buffers_[static_cast<size_t>(b)];
    char* payload = buf.mem.data() + kAioAlignment;
    std::memset(payload, 0, static_cast<size_t>(u.payload_bytes));
    for (size_t k = 0; k < u.params.size(); ++k) {
      const at::Tensor& p = u.params[k];
      std::memcpy(payload + u.offsets[k], p.const_data_ptr(), static_cast<size_t>(param_bytes(p)));
    }
    seal_swap_record(buf.mem.data(), u.generation + 1, u.payload_bytes, u.numel);
    ++u.generation;
    buf.use = Buffer::Use::kWriting;
    buf.unit = i;
    buf.ticket = engine_->write(u.fd, buf.mem.data(), kAioAlignment + u.payload_bytes, 0,
                                dir_->files()[static_cast<size_t>(u.file)]);
    u.write_buffer = b;
    u.dirty = false;
  }
  for (auto& p : u.params) set_storage_bytes(p, 0);
  u.resident = false;
}

// Note [Parameter prefetch order]
// -------------------------------
// The first step's acquisitions (forward: units in forward order; backward: reverse; the
// optimizer step: the optimizer's parameter order) are recorded; end_step freezes them. From
// then on each acquisition moves a cursor to its next occurrence in the recording, and the
// records of the units that follow are read ahead into free buffers, keeping one buffer for a
// read on demand (or a write-back). Units whose last write is still in a buffer need no read.
// A step that departs from the recording (an evaluation step) finds no match and prefetches
// nothing; prefetched reads nobody claims are dropped when their buffer is needed.
void ParamSwapper::note_access(size_t i) {
  if (!order_frozen_) {
    order_.push_back(i);
    return;
  }
  const size_t n = order_.size();
  for (size_t k = 1; k <= n; ++k) {
    const size_t at = (cursor_ + k) % n;
    if (order_[at] == i) {
      cursor_ = at;
      return;
    }
  }
}

void ParamSwapper::prefetch() {
  if (!order_frozen_ || order_.empty() || buffers_.size() < 2) return;
  free_done_writes();
  const size_t n = order_.size();
  const size_t ahead = buffers_.size() - 1;
  size_t issued = 0;
  for (size_t k = 1; k <= std::min(n, 4 * buffers_.size()) && issued < ahead; ++k) {
    const size_t i = order_[(cursor_ + k) % n];
    Unit& u = units_[i];
    if (u.file < 0 || u.resident || u.read_buffer >= 0 || u.write_buffer >= 0) continue;
    int in_use = 0, free = -1;
    for (size_t b = 0; b < buffers_.size(); ++b) {
      if (buffers_[b].use == Buffer::Use::kReading) ++in_use;
      if (buffers_[b].use == Buffer::Use::kFree && free < 0) free = static_cast<int>(b);
    }
    if (free < 0 || in_use >= static_cast<int>(ahead)) return;
    issue_read(i, free);
    ++issued;
  }
}

void ParamSwapper::acquire(const at::Tensor& param) { acquire(param, /*in_step=*/true); }

void ParamSwapper::acquire_outside_step(const at::Tensor& param) {
  acquire(param, /*in_step=*/false);
}

void ParamSwapper::acquire(const at::Tensor& param, bool in_step) {
  TORCH_CHECK(failed_.empty(), options_.who, " parameters on disk stopped after an error: ",
              failed_);
  auto it = unit_index_.find(param.unsafeGetTensorImpl());
  if (it == unit_index_.end()) return;
  const size_t i = it->second;
  Unit& u = units_[i];
  if (u.file < 0) return;  // kept in RAM (max_in_cpu)
  if (u.refs++ > 0) return;
  try {
    if (in_step) note_access(i);
    load(i);
    if (in_step) prefetch();
  } catch (const std::exception& e) {
    fail(e);
    throw;
  }
}

void ParamSwapper::release(const at::Tensor& param, bool modified) {
  auto it = unit_index_.find(param.unsafeGetTensorImpl());
  if (it == unit_index_.end()) return;
  const size_t i = it->second;
  Unit& u = units_[i];
  if (u.file < 0) return;
  TORCH_INTERNAL_ASSERT(u.refs > 0, "ParamSwapper: unit '", u.name, "' released more often than "
                        "acquired");
  u.dirty = u.dirty || modified;
  if (--u.refs > 0) return;
  try {
    write_back(i);
  } catch (const std::exception& e) {
    fail(e);
    throw;
  }
}

void ParamSwapper::end_step() {
  if (!order_frozen_ && !order_.empty()) {
    order_frozen_ = true;
    cursor_ = order_.size() - 1;
  }
}

void ParamSwapper::flush() {
  try {
    for (auto& b : buffers_) {
      if (b.use != Buffer::Use::kWriting) continue;
      AioEngine::wait(b.ticket);
      b.ticket.reset();
      units_[b.unit].write_buffer = -1;
      b.use = Buffer::Use::kFree;
    }
  } catch (const std::exception& e) {
    fail(e);
    throw;
  }
}

}  // namespace fsdp::detail

namespace fsdp {

ParamDiskPlan plan_param_offload(const std::vector<int64_t>& unit_bytes, int64_t buffer_count,
                                 int64_t buffer_size, int64_t max_in_cpu,
                                 const std::string& nvme_path) {
  detail::ParamSwapper::Options o;
  o.buffer_count = buffer_count;
  o.buffer_size = buffer_size;
  o.max_in_cpu = max_in_cpu;
  o.nvme_path = nvme_path;
  std::vector<int64_t> aligned;
  for (int64_t b : unit_bytes) aligned.push_back(detail::align_up(b));
  return detail::ParamSwapper::make_plan(aligned, o);
}

std::string ParamDiskPlan::describe() const {
  std::ostringstream s;
  s << "  disk (" << dir << "): parameter shards of " << units_on_disk << " of " << units
    << " unit(s), " << numel_on_disk << " elements, one record per unit: "
    << format_bytes(disk_bytes) << " (free there: "
    << (free_bytes < 0 ? std::string("unknown") : format_bytes(free_bytes)) << ")\n"
    << "  RAM: " << std::min<int64_t>(buffer_count, units_on_disk)
    << " parameter buffer(s) (buffer_count " << buffer_count << ", each the largest unit's "
    << "record, at most buffer_size " << buffer_numel << " elements): "
    << format_bytes(buffer_bytes) << "; " << numel_in_cpu << " elements of the first units "
    << "kept in RAM (max_in_cpu): " << format_bytes(ram_param_bytes)
    << "; the units being gathered or stepped, and the gradients, in RAM\n";
  return s.str();
}

}  // namespace fsdp
