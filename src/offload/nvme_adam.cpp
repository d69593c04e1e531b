// detail::NvmeAdam: see nvme_adam.h and Note [Disk tier swapper] in docs/design.md.
#include "offload/nvme_adam.h"

#include "fsdp/cpu_adam.h"
#include "fsdp/memory.h"
#include "optim/cpu_adam_spans.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace fsdp::detail {

struct NvmeAdam::Slot {
  at::Tensor param;   // this rank's partition / shard, contiguous
  int64_t begin = 0;  // its first element in the flat state
  int group = 0;
};

struct NvmeAdam::Buffer {
  AlignedBuffer record;  // header, exp_avg, exp_avg_sq (, max_exp_avg_sq) of one sub-group
  AioTicket read, write;
};

namespace {

// A sub-group's record: [header | exp_avg | exp_avg_sq (| max_exp_avg_sq)], each part aligned
// for O_DIRECT.
int64_t moment_bytes(int64_t n) { return align_up(n * static_cast<int64_t>(sizeof(float))); }
int64_t payload_bytes(int64_t n, int moments) { return moments * moment_bytes(n); }
int64_t record_bytes(int64_t n, int moments) { return kAioAlignment + payload_bytes(n, moments); }

cpu_adam::Hyper group_hyper(torch::optim::OptimizerOptions& options, bool adamw_mode,
                            bool bias_correction, const std::string& who) {
  cpu_adam::Hyper h;
  h.adamw_mode = adamw_mode;
  h.bias_correction = bias_correction;
  auto take = [&](auto* o) {
    h.lr = o->lr();
    h.beta1 = std::get<0>(o->betas());
    h.beta2 = std::get<1>(o->betas());
    h.eps = o->eps();
    h.weight_decay = o->weight_decay();
    h.amsgrad = o->amsgrad();
  };
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    take(o);
  } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    take(o);
  } else {
    TORCH_CHECK(false, who, " offload_optimizer device \"nvme\": a parameter group has options of "
                "another optimizer; the disk tier streams Adam / AdamW state");
  }
  return h;
}

}  // namespace

NvmeAdam::NvmeAdam(torch::optim::Optimizer& optimizer, Options options)
    : options_(std::move(options)) {
  const std::string& who = options_.who;
  if (auto* c = dynamic_cast<fsdp::optim::CPUAdam*>(&optimizer)) {
    adamw_mode_ = c->adamw_mode();
    bias_correction_ = c->bias_correction();
  } else if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    adamw_mode_ = true;
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    adamw_mode_ = false;
  } else {
    TORCH_CHECK(false, who, " offload_optimizer device \"nvme\" streams Adam/AdamW moments "
                "from disk; this optimizer is neither torch::optim::Adam, AdamW nor "
                "fsdp::optim::CPUAdam. HINT: use one of those, or offload_optimizer device "
                "\"cpu\"");
  }
  TORCH_CHECK(optimizer.state().empty(), who, " offload_optimizer device \"nvme\": the "
              "optimizer already holds state; hand the strategy a fresh optimizer (to resume, "
              "load a checkpoint after setup: load_checkpoint streams its state to the disk)");
  int64_t total = 0;
  int gi = 0;
  for (auto& group : optimizer.param_groups()) {
    const bool amsgrad = group_hyper(group.options(), adamw_mode_, bias_correction_, who).amsgrad;
    if (gi == 0) moments_ = amsgrad ? 3 : 2;
    TORCH_CHECK((moments_ == 3) == amsgrad, who, " offload_optimizer device \"nvme\": amsgrad "
                "is on in some parameter groups and off in others; the disk tier streams the "
                "same moments for every group. HINT: set amsgrad the same in every group");
    for (auto& p : group.params()) {
      TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), who, " offload_optimizer device "
                  "\"nvme\": a parameter of shape ", p.sizes(), " is not a contiguous CPU "
                  "tensor");
      const auto dt = p.scalar_type();
      TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, who,
                  " offload_optimizer device \"nvme\": parameters must be float32, bfloat16 or "
                  "float16, got ", dt);
      TORCH_CHECK(slot_index_.emplace(p.unsafeGetTensorImpl(), slots_.size()).second, who,
                  " offload_optimizer device \"nvme\": a parameter of shape ", p.sizes(),
                  " is in two parameter groups");
      slots_.push_back(Slot{p, total, gi});
      total += p.numel();
    }
    ++gi;
  }
  steps_.assign(slots_.size(), 0);

  // Budget first: what goes where, checked before anything is allocated or created.
  plan_ = plan_disk_offload(total, options_.sub_group_size, options_.nvme_path, moments_);
  plan_.dir = options_.nvme_path + "/" + options_.job + "/rank" + std::to_string(options_.rank);
  const int64_t node_bytes = plan_.disk_bytes * std::max(1, options_.ranks_sharing_disk);
  if (plan_.free_bytes >= 0) {
    TORCH_CHECK(node_bytes <= plan_.free_bytes, who, " rank ", options_.rank,
                ": the disk tier needs ", format_bytes(plan_.disk_bytes), " (", plan_.disk_bytes,
                " bytes) of swap files per rank, ", format_bytes(node_bytes), " for the ",
                options_.ranks_sharing_disk, " rank(s) of this node, under '",
                options_.nvme_path, "' but only ", format_bytes(plan_.free_bytes),
                " are free there. HINT: free space, point nvme_path at a larger disk, or spread "
                "the ranks over more nodes");
  }
  const int64_t budget = memory_budget();
  if (budget > 0) {
    const int64_t need = memory_stats().current_bytes + plan_.ram_bytes;
    if (need > budget) {
      throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                             who + " rank " + std::to_string(options_.rank) +
                             ": the disk tier's swap buffers need " +
                             format_bytes(plan_.ram_bytes) + " of RAM on top of " +
                             format_bytes(memory_stats().current_bytes) + " in use, budget " +
                             format_bytes(budget) + ". HINT: lower sub_group_size (three "
                             "sub-groups of " + std::to_string(4 * moments_) +
                             " bytes per element are in RAM)");
    }
  }

  dir_ = std::make_unique<SwapDir>(options_.nvme_path, options_.job, options_.rank);
  engine_ = std::make_unique<AioEngine>(options_.aio);
  generation_.assign(static_cast<size_t>(plan_.num_sub_groups), 0);
  for (int64_t g = 0; g < plan_.num_sub_groups; ++g) {
    const int64_t n = std::min(plan_.sub_group_numel, total - g * plan_.sub_group_numel);
    fds_.push_back(dir_->create("optimizer.subgroup" + std::to_string(g) + ".swp",
                                record_bytes(n, moments_)));
  }
  const int64_t nbuf = std::min<int64_t>(3, plan_.num_sub_groups);
  buffers_.resize(static_cast<size_t>(nbuf));
  for (auto& b : buffers_) b.record = AlignedBuffer(record_bytes(plan_.sub_group_numel, moments_));
}

NvmeAdam::~NvmeAdam() {
  // Transfers still in flight target our buffers and files: let them land first.
  for (auto& b : buffers_) {
    for (auto* t : {&b.read, &b.write}) {
      try {
        AioEngine::wait(*t);
      } catch (...) {
      }
    }
  }
  engine_.reset();
}

void NvmeAdam::load(int64_t g, Buffer& b) {
  AioEngine::wait(b.write);  // the buffer's previous sub-group is on disk
  b.write.reset();
  const int64_t n = std::min(plan_.sub_group_numel, plan_.state_numel - g * plan_.sub_group_numel);
  if (generation_[g] == 0) {  // never written: the moments start at zero, as torch's Adam
    std::memset(b.record.data() + kAioAlignment, 0, payload_bytes(n, moments_));
    b.read.reset();
    return;
  }
  b.read = engine_->read(fds_[g], b.record.data(), record_bytes(n, moments_), 0,
                         dir_->files()[g]);
}

void NvmeAdam::step_sub_group(int64_t g, Buffer& b) {
  const int64_t lo = g * plan_.sub_group_numel;
  const int64_t n = std::min(plan_.sub_group_numel, plan_.state_numel - lo);
  const int64_t hi = lo + n;
  AioEngine::wait(b.read);
  b.read.reset();
  if (generation_[g] > 0) {
    verify_swap_record(b.record.data(), generation_[g], payload_bytes(n, moments_), n,
                       dir_->files()[g]);
  }
  auto* exp_avg = reinterpret_cast<float*>(b.record.data() + kAioAlignment);
  auto* exp_avg_sq = reinterpret_cast<float*>(b.record.data() + kAioAlignment + moment_bytes(n));
  auto* max_exp_avg_sq = moments_ < 3 ? nullptr
                                      : reinterpret_cast<float*>(b.record.data() + kAioAlignment +
                                                                 2 * moment_bytes(n));
  std::vector<cpu_adam::Span> spans;
  // The parameters overlapping [lo, hi): slots_ is sorted by begin.
  auto it = std::upper_bound(slots_.begin(), slots_.end(), lo,
                             [](int64_t x, const Slot& s) { return x < s.begin; });
  size_t i = it == slots_.begin() ? 0 : static_cast<size_t>(it - slots_.begin()) - 1;
  for (; i < slots_.size() && slots_[i].begin < hi; ++i) {
    const Slot& s = slots_[i];
    const at::Tensor& grad = s.param.grad();
    const int64_t x = std::max(lo, s.begin), y = std::min(hi, s.begin + s.param.numel());
    if (x >= y || !grad.defined()) continue;
    const int64_t esz = s.param.element_size();
    cpu_adam::Span span;
    span.s = cpu_adam::make_scalars(hypers_[s.group], steps_[i]);
    span.param = static_cast<char*>(s.param.data_ptr()) + (x - s.begin) * esz;
    span.grad = static_cast<const char*>(grad.const_data_ptr()) + (x - s.begin) * esz;
    span.exp_avg = exp_avg + (x - lo);
    span.exp_avg_sq = exp_avg_sq + (x - lo);
    if (max_exp_avg_sq) span.max_exp_avg_sq = max_exp_avg_sq + (x - lo);
    span.numel = y - x;
    span.dtype = s.param.scalar_type();
    spans.push_back(span);
  }
  cpu_adam::run_spans(spans);
  seal_swap_record(b.record.data(), generation_[g] + 1, payload_bytes(n, moments_), n);
  ++generation_[g];
  b.write = engine_->write(fds_[g], b.record.data(), record_bytes(n, moments_), 0,
                           dir_->files()[g]);
}

void NvmeAdam::step(torch::optim::Optimizer& optimizer) {
  const std::string& who = options_.who;
  TORCH_CHECK(failed_.empty(), who, " the disk tier stopped after an error and cannot step "
              "again: ", failed_);
  at::NoGradGuard no_grad;
  hypers_.clear();
  for (auto& group : optimizer.param_groups()) {
    hypers_.push_back(group_hyper(group.options(), adamw_mode_, bias_correction_, who));
    TORCH_CHECK(hypers_.back().amsgrad == (moments_ == 3), who, " offload_optimizer device "
                "\"nvme\": amsgrad changed after setup; the swap files hold ", moments_,
                " moments per element");
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    const at::Tensor& grad = slots_[i].param.grad();
    if (!grad.defined()) continue;
    TORCH_CHECK(grad.is_contiguous() && grad.scalar_type() == slots_[i].param.scalar_type() &&
                    grad.numel() == slots_[i].param.numel(),
                who, " offload_optimizer device \"nvme\": the gradient of a parameter of shape ",
                slots_[i].param.sizes(), " is not a contiguous ", slots_[i].param.scalar_type(),
                " tensor of its size");
    ++steps_[i];
  }
  const int64_t G = plan_.num_sub_groups;
  const int64_t nb = static_cast<int64_t>(buffers_.size());
  if (G == 0) return;
  // Parameters on disk: each parameter with a gradient is acquired before the first sub-group
  // that touches it and released (modified: written back) after its last. See Note
  // [Parameters on disk] in docs/design.md.
  std::vector<char> held(residency_ ? slots_.size() : 0, 0);
  auto slots_of = [&](int64_t g, const std::function<void(size_t)>& f) {
    const int64_t lo = g * plan_.sub_group_numel;
    const int64_t hi = std::min(plan_.state_numel, lo + plan_.sub_group_numel);
    auto it = std::upper_bound(slots_.begin(), slots_.end(), lo,
                               [](int64_t x, const Slot& s) { return x < s.begin; });
    size_t i = it == slots_.begin() ? 0 : static_cast<size_t>(it - slots_.begin()) - 1;
    for (; i < slots_.size() && slots_[i].begin < hi; ++i) {
      if (slots_[i].begin + slots_[i].param.numel() > lo) f(i);
    }
  };
  auto acquire = [&](int64_t g) {
    if (!residency_) return;
    slots_of(g, [&](size_t i) {
      const Slot& s = slots_[i];
      if (held[i] || !s.param.grad().defined() || !residency_->manages(s.param)) return;
      residency_->acquire(s.param);
      held[i] = 1;
    });
  };
  auto release = [&](int64_t g) {
    if (!residency_) return;
    const int64_t hi = std::min(plan_.state_numel, (g + 1) * plan_.sub_group_numel);
    slots_of(g, [&](size_t i) {
      const Slot& s = slots_[i];
      if (!held[i] || s.begin + s.param.numel() > hi) return;
      residency_->release(s.param, /*modified=*/true);
      held[i] = 0;
    });
  };
  try {
    // Note [Disk tier swapper]: read g+1 and write g-1 while g steps.
    load(0, buffers_[0]);
    for (int64_t g = 0; g < G; ++g) {
      if (g + 1 < G) load(g + 1, buffers_[(g + 1) % nb]);
      acquire(g);
      step_sub_group(g, buffers_[g % nb]);
      release(g);
    }
  } catch (const std::exception& e) {
    failed_ = e.what();
    throw;
  }
  // Note [Disk tier swapper]: sub-group g always uses buffer g % nb and a buffer is refilled
  // only after its previous write landed, so the next read of any sub-group waits for its
  // write; the last writes can overlap the next forward.
  if (!options_.overlap_last_writes) flush();
}

void NvmeAdam::flush() {
  try {
    for (auto& b : buffers_) {
      AioEngine::wait(b.write);
      b.write.reset();
    }
  } catch (const std::exception& e) {
    failed_ = e.what();
    throw;
  }
}

int64_t NvmeAdam::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& b : buffers_) n += b.record.size();
  return n;
}

std::vector<std::string> NvmeAdam::stats() const {
  std::vector<std::string> out = {"exp_avg", "exp_avg_sq"};
  if (moments_ == 3) out.emplace_back("max_exp_avg_sq");
  return out;
}

size_t NvmeAdam::slot_of(const at::Tensor& param) const {
  auto it = slot_index_.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != slot_index_.end(), options_.who, " the disk tier holds no optimizer state "
              "for a parameter of shape ", param.sizes(), " (not one the optimizer steps)");
  return it->second;
}

bool NvmeAdam::holds(const at::Tensor& param) const {
  return slot_index_.count(param.unsafeGetTensorImpl()) > 0;
}

int64_t NvmeAdam::step_of(const at::Tensor& param) const { return steps_[slot_of(param)]; }

void NvmeAdam::set_step(const at::Tensor& param, int64_t step) {
  TORCH_CHECK(step >= 0, options_.who, " a step count must be >= 0, got ", step);
  steps_[slot_of(param)] = step;
}

void NvmeAdam::read_state(const Visitor& visit) { stream(visit, /*write_back=*/false); }
void NvmeAdam::write_state(const Visitor& fill) { stream(fill, /*write_back=*/true); }

// Note [Streamed optimizer state]: the step's pipeline without the Adam update: read g+1 while
// g is visited (and, loading, written back). Only the swap buffers hold state in RAM.
void NvmeAdam::stream(const Visitor& visit, bool write_back) {
  const std::string& who = options_.who;
  TORCH_CHECK(failed_.empty(), who, " the disk tier stopped after an error; its state cannot be ",
              write_back ? "loaded" : "saved", ": ", failed_);
  const int64_t G = plan_.num_sub_groups;
  const int64_t nb = static_cast<int64_t>(buffers_.size());
  bool visiting = false;
  try {
    if (G > 0) load(0, buffers_[0]);
    for (int64_t g = 0; g < G; ++g) {
      if (g + 1 < G) load(g + 1, buffers_[(g + 1) % nb]);
      Buffer& b = buffers_[g % nb];
      const int64_t lo = g * plan_.sub_group_numel;
      const int64_t n = std::min(plan_.sub_group_numel, plan_.state_numel - lo);
      AioEngine::wait(b.read);
      b.read.reset();
      if (generation_[g] > 0) {
        verify_swap_record(b.record.data(), generation_[g], payload_bytes(n, moments_), n,
                           dir_->files()[g]);
      }
      char* payload = b.record.data() + kAioAlignment;
      auto it = std::upper_bound(slots_.begin(), slots_.end(), lo,
                                 [](int64_t x, const Slot& s) { return x < s.begin; });
      size_t i = it == slots_.begin() ? 0 : static_cast<size_t>(it - slots_.begin()) - 1;
      visiting = true;
      for (; i < slots_.size() && slots_[i].begin < lo + n; ++i) {
        const Slot& s = slots_[i];
        const int64_t x = std::max(lo, s.begin), y = std::min(lo + n, s.begin + s.param.numel());
        if (x >= y) continue;
        for (int m = 0; m < moments_; ++m) {
          auto* base = reinterpret_cast<float*>(payload + m * moment_bytes(n));
          visit(s.param, m, x - s.begin, base + (x - lo), y - x);
        }
      }
      visiting = false;
      if (write_back) {
        seal_swap_record(b.record.data(), generation_[g] + 1, payload_bytes(n, moments_), n);
        ++generation_[g];
        b.write = engine_->write(fds_[g], b.record.data(), record_bytes(n, moments_), 0,
                                 dir_->files()[g]);
      }
    }
    for (auto& b : buffers_) {
      AioEngine::wait(b.write);
      b.write.reset();
    }
  } catch (const std::exception& e) {
    // No transfer may land in a buffer after we return.
    for (auto& b : buffers_) {
      for (auto* t : {&b.read, &b.write}) {
        try {
          AioEngine::wait(*t);
        } catch (...) {
        }
        t->reset();
      }
    }
    // A failed save leaves the swap files as they were; a swap I/O error, or a load that
    // stopped halfway (some sub-groups hold the checkpoint's state, some not), does not.
    if (write_back || !visiting) failed_ = e.what();
    throw;
  }
}

}  // namespace fsdp::detail
