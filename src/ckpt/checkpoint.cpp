// save_checkpoint / load_checkpoint / load_weights. See include/fsdp/checkpoint.h and
// Note [Checkpoint layout] in layout.h.
#include "fsdp/checkpoint.h"

#include "ckpt/identity.h"
#include "ckpt/layout.h"
#include "ckpt/output.h"
#include "ckpt/run_records.h"
#include "fsdp/cpu_adam.h"
#include "fsdp/strategy.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace fsdp {

namespace fs = std::filesystem;
using ckpt::json;
using ckpt::optimizer_stats;
using ckpt::state_key;

StateDictType parse_state_dict_type(const std::string& name) {
  if (name == "full") return StateDictType::kFull;
  if (name == "sharded") return StateDictType::kSharded;
  TORCH_CHECK(false, "[checkpoint] unknown state_dict_type '", name,
              "'; valid: full (one consolidated safetensors file), sharded (one file per rank)");
}

const char* to_string(StateDictType type) {
  switch (type) {
    case StateDictType::kFull: return "full";
    case StateDictType::kSharded: return "sharded";
  }
  return "?";
}

namespace ckpt {

// libtorch 2.x keys optimizer state by the parameter's TensorImpl pointer.
void* state_key(const at::Tensor& p) {
  return p.unsafeGetTensorImpl();
}

std::vector<std::pair<std::string, at::Tensor>> optimizer_stats(torch::optim::Optimizer& opt,
                                                                const at::Tensor& p,
                                                                int64_t* step) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto it = opt.state().find(state_key(p));
  if (it == opt.state().end()) return out;
  auto* base = it->second.get();
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(base)) {
    *step = s->step();
    out = {{"exp_avg", s->exp_avg()}, {"exp_avg_sq", s->exp_avg_sq()}};
    if (s->max_exp_avg_sq().defined()) out.emplace_back("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(base)) {
    *step = s->step();
    out = {{"exp_avg", s->exp_avg()}, {"exp_avg_sq", s->exp_avg_sq()}};
    if (s->max_exp_avg_sq().defined()) out.emplace_back("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(base)) {
    *step = 0;
    if (s->momentum_buffer().defined()) out = {{"momentum_buffer", s->momentum_buffer()}};
  }
  return out;
}

}  // namespace ckpt

namespace {

// One tensor as this rank holds it (see Note [Checkpoint layout]).
struct LocalTensor {
  std::string key;
  at::Tensor local;                 // contiguous; full tensor, or this rank's shard (R rows)
  std::vector<int64_t> full_shape;
  int64_t dim0 = 1;
  int64_t shard_rows = 0;           // R (sharded only)
  int64_t row_begin = 0;            // global row of local row 0
  int64_t rows = 0;                 // valid rows held (rows past these are padding)
  bool sharded = false;             // split over the shard group; else every rank holds it all
  // Optimizer state a StreamedOptimizerState holds (Note [Streamed optimizer state]): the
  // tensor the optimizer steps and the statistic's index; `local` is then a meta tensor (shape
  // and dtype, no data).
  at::Tensor streamed;
  int stat = 0;
  // A parameter on disk (Note [Checkpoints of parameters on disk]): the registered tensor the
  // strategy's pager pages; `local`'s storage holds the values only while it is paged in.
  at::Tensor on_disk;
  int64_t row_numel() const {
    int64_t n = 1;
    for (size_t i = 1; i < full_shape.size(); ++i) n *= full_shape[i];
    return n;
  }
  int64_t full_nbytes() const {
    int64_t n = local.element_size();
    for (int64_t d : full_shape) n *= d;
    return n;
  }
};

// Note [Who writes a checkpoint]
// Every replica of the model state holds the same values: DDP and single ranks hold the whole
// model, FSDP ranks one shard group's worth (the shard group is the world for FULL_SHARD and
// SHARD_GRAD_OP, one rank for NO_SHARD, a node for HYBRID_SHARD*). Only the first replica
// (replica_rank 0) writes: shard rank i of it writes file i of shard_world files
// (shard-<i>-of-<shard_world>), file 0 also holds the replicated tensors (buffers, parameters
// FSDP does not manage). Other replicas only join the barriers. Loading does not care who
// wrote: each rank reads the rows it needs.
struct Layout {
  std::vector<LocalTensor> model;      // parameters then buffers
  std::vector<LocalTensor> optimizer;  // optim.<fqn>.<stat>
  ProcessGroupPtr shard_group;         // null: nothing sharded
  int shard_world = 1;
  int shard_rank = 0;
  int replica_rank = 0;                // index of this rank's replica (0 writes)
  std::map<const c10::TensorImpl*, std::string> param_fqn;  // registered tensor -> FQN
  // Parameters held whole whose optimizer state is split (ZeRO stages 1 and 2; LocalShard::param
  // set): registered tensor -> the partition the optimizer steps.
  std::unordered_map<const c10::TensorImpl*, LocalShard> partitions;
  ShardPager* pager = nullptr;  // parameters on disk (LocalShards::pager)
};

// Note [Checkpoints of parameters on disk]
// A run with parameters on disk (an OffloadPolicy with params "nvme": FSDP, or DeepSpeed stage 3
// with offload_param nvme) keeps each unit's shard
// as a swap record; the shards' storages are empty at rest (Note [Parameters on disk]). Its
// checkpoints are the sharded (or full) format of any other run: the writer and the loader
// visit the model tensors in order and hold each parameter on disk only while they copy its
// rows. ResidentWindow::enter(t) pages t in before it pages out the parameter held before, so
// the parameters of one unit (consecutive in the module's order) share one read of its record,
// and at most two units' shards are in RAM, whatever the model's size. A load releases with
// modified = true: each record is written back, with the loaded values, before the next unit
// after it is read. The page-ins are outside the training step: they move neither the
// recorded access order nor its read-ahead. Streamed optimizer state (the moments, which must be on
// disk too) follows as for optimizer-only offload, Note [Streamed optimizer state].
class ResidentWindow {
 public:
  ResidentWindow(ShardPager* pager, bool modifies) : pager_(pager), modifies_(modifies) {}
  ResidentWindow(const ResidentWindow&) = delete;
  ResidentWindow& operator=(const ResidentWindow&) = delete;
  ~ResidentWindow() {
    try {
      close();
    } catch (...) {  // the pager's own error is already on its way (or reported next use)
    }
  }
  // `t`'s values are in its storage until the next enter or close.
  void enter(const LocalTensor& t) {
    if (!t.on_disk.defined()) return;
    pager_->page_in(t.on_disk);
    at::Tensor before = std::exchange(held_, t.on_disk);
    if (before.defined()) pager_->page_out(before, modifies_);
  }
  void close() {
    if (!held_.defined()) return;
    at::Tensor last = std::exchange(held_, at::Tensor());
    pager_->page_out(last, modifies_);
  }

 private:
  ShardPager* pager_;
  bool modifies_;
  at::Tensor held_;
};

// The optimizer-state layout of a parameter: its own (`param`), or its partition's when the
// optimizer steps a partition of a whole parameter (ZeRO stages 1 and 2).
LocalTensor optimizer_layout(const Layout& L, const LocalTensor& param,
                             const at::Tensor& registered, at::Tensor* opt_tensor) {
  auto z = L.partitions.find(registered.unsafeGetTensorImpl());
  if (z == L.partitions.end()) {
    *opt_tensor = registered;
    return param;
  }
  const LocalShard& shard = z->second;
  *opt_tensor = shard.local;
  LocalTensor t = param;
  t.local = shard.local.detach();
  t.shard_rows = shard.shard_rows;
  t.row_begin = shard.rows.begin;
  t.rows = shard.rows.size();
  t.sharded = true;
  return t;
}

std::string optimizer_kind(torch::optim::Optimizer& opt) {
  // fsdp::optim::CPUAdam keeps libtorch's AdamW / Adam state: its checkpoints are theirs.
  if (auto* cpu = dynamic_cast<fsdp::optim::CPUAdam*>(&opt)) return cpu->adamw_mode() ? "adamw" : "adam";
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return "sgd";
  TORCH_CHECK(false, "[checkpoint] optimizer state of this optimizer type is not supported yet "
              "(supported: Adam, AdamW, SGD, fsdp::optim::CPUAdam); save weights only (optimizer = nullptr)");
}

Layout build_layout(Strategy* strategy, torch::nn::Module& module,
                    torch::optim::Optimizer* optimizer, json* optim_meta) {
  Layout L;
  // How the strategy holds the parameters: dim-0 shards with their full shapes and row ranges
  // (FSDP), or every tensor whole (DDP, single; no strategy: load_weights).
  std::unordered_map<const c10::TensorImpl*, LocalShard> shards;
  if (strategy) {
    LocalShards held = strategy->local_shards();
    L.shard_group = held.shard_group;
    L.shard_world = L.shard_group ? L.shard_group->size() : 1;
    L.shard_rank = L.shard_group ? L.shard_group->rank() : 0;
    L.replica_rank = held.replica_rank;
    L.pager = held.pager;
    for (auto& shard : held.params) {
      if (shard.param.defined()) {
        L.partitions.emplace(shard.param.unsafeGetTensorImpl(), std::move(shard));
      } else {
        shards.emplace(shard.local.unsafeGetTensorImpl(), std::move(shard));
      }
    }
  }
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    LocalTensor t;
    t.key = item.key();
    t.local = item.value().detach();
    L.param_fqn[item.value().unsafeGetTensorImpl()] = t.key;
    auto it = shards.find(item.value().unsafeGetTensorImpl());
    if (it != shards.end()) {
      const LocalShard& shard = it->second;
      t.full_shape = shard.full_shape;
      t.dim0 = ckpt::dim0_of(t.full_shape);
      t.shard_rows = shard.shard_rows;
      t.row_begin = shard.rows.begin;
      t.rows = shard.rows.size();
      t.sharded = true;
      if (L.pager && L.pager->pages(item.value())) t.on_disk = item.value();
    } else {
      t.full_shape = t.local.sizes().vec();
      t.dim0 = ckpt::dim0_of(t.full_shape);
      t.rows = t.dim0;
    }
    TORCH_CHECK(t.local.is_contiguous(), "[checkpoint] parameter '", t.key,
                "' is not contiguous; checkpoints need contiguous parameters");
    L.model.push_back(t);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    LocalTensor t;
    t.key = item.key();
    t.local = item.value().detach();
    TORCH_CHECK(t.local.is_contiguous(), "[checkpoint] buffer '", t.key,
                "' is not contiguous; checkpoints need contiguous buffers");
    t.full_shape = t.local.sizes().vec();
    t.dim0 = ckpt::dim0_of(t.full_shape);
    t.rows = t.dim0;
    L.model.push_back(t);
  }
  StreamedOptimizerState* streamed = strategy ? strategy->streamed_optimizer_state() : nullptr;
  if (optimizer) {
    json steps = json::object();
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      int64_t step = 0;
      const LocalTensor* param = nullptr;
      for (const auto& m : L.model) {
        if (m.key == item.key()) param = &m;
      }
      TORCH_INTERNAL_ASSERT(param);
      at::Tensor opt_tensor;
      const LocalTensor p = optimizer_layout(L, *param, item.value(), &opt_tensor);
      if (streamed) {  // See Note [Streamed optimizer state]
        if (!streamed->holds(opt_tensor) || streamed->step_of(opt_tensor) == 0) continue;
        steps[item.key()] = streamed->step_of(opt_tensor);
        const auto names = streamed->stats();
        for (size_t k = 0; k < names.size(); ++k) {
          LocalTensor t = p;
          t.on_disk = at::Tensor();  // the moments stream from their own records
          t.key = std::string(ckpt::kOptimPrefix) + item.key() + "." + names[k];
          t.local = at::empty(p.local.sizes(), at::TensorOptions(at::kFloat).device(at::kMeta));
          t.streamed = opt_tensor;
          t.stat = static_cast<int>(k);
          L.optimizer.push_back(t);
        }
        continue;
      }
      auto stats = optimizer_stats(*optimizer, opt_tensor, &step);
      if (stats.empty()) continue;
      steps[item.key()] = step;
      for (auto& [name, tensor] : stats) {
        LocalTensor t = p;
        t.on_disk = at::Tensor();  // optimizer state in RAM
        t.key = std::string(ckpt::kOptimPrefix) + item.key() + "." + name;
        t.local = tensor.detach().contiguous();
        TORCH_INTERNAL_ASSERT(t.local.numel() == p.local.numel(), "optimizer state '", t.key,
                              "' does not match its parameter's shape");
        L.optimizer.push_back(t);
      }
    }
    if (optim_meta) {
      json lrs = json::array();
      for (auto& g : optimizer->param_groups()) lrs.push_back(g.options().get_lr());
      *optim_meta = {{"kind", optimizer_kind(*optimizer)}, {"lrs", lrs}, {"steps", steps}};
    }
  }
  return L;
}

// Note [Per-rank RNG state]
// Every rank's CPU generator state is saved ("rng_cpu_per_rank", rank 0's also as "rng_cpu"),
// and on CUDA its device's generator too ("rng_cuda_per_rank", "rng_cuda"):
// with dropout each rank draws its own masks, so exact resume needs each rank's own stream.
// Loading at the world size of the save restores each rank's own state; at another world size
// every rank gets rank 0's (the ranks' streams depend on the world size anyway, so exact resume
// across world sizes needs dropout 0).
at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const std::vector<uint8_t>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), t.data_ptr<uint8_t>());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

// The CUDA generator of a rank's device (dropout and every other random op on the GPU draw from
// it), reached through ATen's context so this file needs no CUDA header: saved and restored as
// the CPU generator is (Note [Per-rank RNG state]), when the ranks train on CUDA.
at::Tensor cuda_rng_state(c10::Device device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cuda_rng_state(c10::Device device, const std::vector<uint8_t>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), t.data_ptr<uint8_t>());
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

std::string hex_of(const at::Tensor& bytes) {
  at::Tensor b = bytes.contiguous();
  return ckpt::to_hex(b.data_ptr<uint8_t>(), static_cast<size_t>(b.numel()));
}

std::vector<ckpt::TensorSpec> full_specs(const std::vector<LocalTensor>& ts) {
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& t : ts) {
    specs.push_back({t.key, ckpt::to_dtype(t.local.scalar_type()), t.full_shape});
  }
  return specs;
}

// Full format: every rank joins the all-gather of each sharded tensor; rank 0 streams the rows
// to `file`. Peak: the shards plus one gathered tensor.
// Returns "" or why this rank's writing failed (a full disk): a writer that fails stops writing
// but still joins every all-gather, so that every rank reaches agree_on_save, which tells all of
// them (a throw here would leave the other ranks in an all-gather this rank never joins).
std::string write_full(const std::string& file, const std::vector<LocalTensor>& ts,
                       const Layout& L, int rank, int64_t step, ckpt::Identity id) {
  if (L.replica_rank != 0) return "";  // See Note [Who writes a checkpoint]
  std::unique_ptr<ckpt::SafetensorsWriter> w;
  std::string error;
  auto writing = [&](const std::function<void()>& f) {
    if (!error.empty()) return;
    try {
      f();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) w.reset();  // removes its temporary file
  };
  id.shard = 0;
  id.shards = 1;
  if (L.shard_rank == 0) {
    writing([&] {
      w = std::make_unique<ckpt::SafetensorsWriter>(file, full_specs(ts),
                                                    ckpt::identity_metadata(id),
                                                    /*checksums=*/true);
    });
  }
  ResidentWindow window(L.pager, /*modifies=*/false);
  for (size_t i = 0; i < ts.size(); ++i) {
    const LocalTensor& t = ts[i];
    window.enter(t);
    if (t.sharded) {
      at::Tensor in = t.local.reshape({-1});
      const int64_t padded = t.shard_rows * t.row_numel();
      if (in.numel() < padded) {  // a partition holds its rows only: pad for the all-gather
        at::Tensor full = at::zeros({padded}, in.options());
        full.narrow(0, 0, in.numel()).copy_(in);
        in = full;
      }
      at::Tensor out = at::empty({in.numel() * L.shard_world}, in.options());
      L.shard_group->all_gather_into_tensor(out, in);
      if (w) {
        const at::Tensor host = out.cpu();  // device tensors: copied to the host, a tensor at a time
        writing([&] { w->write(host.data_ptr(), static_cast<size_t>(t.full_nbytes())); });
      }
    } else if (w) {
      const at::Tensor host = t.local.cpu();
      writing([&] { w->write(host.data_ptr(), static_cast<size_t>(t.full_nbytes())); });
    }
    if (i == 0) ckpt::maybe_crash_during_save(rank, step);
  }
  window.close();
  if (w) writing([&] { w->commit(); });
  return error;
}

// Sharded format: this rank's unpadded rows of its sharded tensors, plus (rank 0) the
// replicated ones. Streamed optimizer state comes last: the strategy's store visits it one
// buffer at a time and each piece goes to its place in the file.
void write_shard(const std::string& file, const Layout& L, int rank, int64_t step,
                 StreamedOptimizerState* streamed, ckpt::Identity id) {
  if (L.replica_rank != 0) return;  // See Note [Who writes a checkpoint]
  std::vector<const LocalTensor*> mine;
  for (const auto* group : {&L.model, &L.optimizer}) {
    for (const auto& t : *group) {
      if (t.sharded ? t.rows > 0 : L.shard_rank == 0) mine.push_back(&t);
    }
  }
  std::vector<ckpt::TensorSpec> specs;
  for (const auto* t : mine) {
    specs.push_back({t->key, ckpt::to_dtype(t->local.scalar_type()),
                     ckpt::piece_shape(t->full_shape, t->rows)});
  }
  id.shard = L.shard_rank;
  id.shards = L.shard_world;
  ckpt::SafetensorsWriter w(file, specs, ckpt::identity_metadata(id), /*checksums=*/true);
  std::map<std::pair<const c10::TensorImpl*, int>, size_t> pieces;  // (tensor, stat) -> index
  ResidentWindow window(L.pager, /*modifies=*/false);
  for (size_t i = 0; i < mine.size(); ++i) {
    const LocalTensor* t = mine[i];
    if (t->streamed.defined()) {
      pieces[{t->streamed.unsafeGetTensorImpl(), t->stat}] = i;
      continue;
    }
    TORCH_INTERNAL_ASSERT(pieces.empty(), "streamed optimizer state must come last");
    window.enter(*t);
    const at::Tensor host = t->local.cpu();  // device tensors: copied to the host, one at a time
    w.write(host.data_ptr(),
            static_cast<size_t>(t->rows * t->row_numel() * t->local.element_size()));
    if (i == 0) ckpt::maybe_crash_during_save(rank, step);
  }
  window.close();  // the last unit leaves RAM before the moments stream through
  if (!pieces.empty()) {
    TORCH_INTERNAL_ASSERT(streamed);
    streamed->read_state([&](const at::Tensor& param, int stat, int64_t offset, float* data,
                             int64_t numel) {
      auto it = pieces.find({param.unsafeGetTensorImpl(), stat});
      if (it == pieces.end()) return;  // no state yet, or rows another rank writes
      const LocalTensor* t = mine[it->second];
      const int64_t valid = t->rows * t->row_numel();  // elements past these are padding
      if (offset >= valid) return;
      const int64_t n = std::min(numel, valid - offset);
      w.write_at(it->second, static_cast<uint64_t>(offset) * sizeof(float), data,
                 static_cast<size_t>(n) * sizeof(float));
    });
  }
  w.commit();
}

// The errors of a save on every rank: how many ranks failed, and the first failing rank's
// error as "rank R: ERROR" ("" when none failed). Every rank names the cause, since a launcher
// may show only the first rank that exits.
std::pair<int, std::string> gather_save_errors(Strategy& strategy, const std::string& error) {
  const int world = strategy.world_size();
  if (world == 1) {
    return {error.empty() ? 0 : 1, error.empty() ? "" : "rank 0: " + error};
  }
  const std::string mine_text = error.substr(0, 4096);
  const std::vector<int64_t> sizes =
      all_gather_values(*strategy.world(), {static_cast<int64_t>(mine_text.size())});
  int failed = 0, first = -1;
  for (int r = 0; r < world; ++r) {
    if (sizes[r] == 0) continue;
    ++failed;
    if (first < 0) first = r;
  }
  if (failed == 0) return {0, ""};
  at::Tensor bytes = at::empty({sizes[first]}, at::kByte);
  if (strategy.rank() == first) std::copy(mine_text.begin(), mine_text.end(), bytes.data_ptr<uint8_t>());
  broadcast_host(*strategy.world(), bytes, first);
  return {failed, "rank " + std::to_string(first) + ": " +
                      std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                                  static_cast<size_t>(bytes.numel()))};
}

// A save fails on a rank (full disk, read-only directory): every rank learns it, throws, and
// nothing is published; the one that failed says why, the others name it and its error.
// `partial` (rank 0: the directory this save created; else empty) is removed.
void agree_on_save(Strategy& strategy, const std::string& error, const fs::path& target,
                   const fs::path& partial) {
  const auto [n, first] = gather_save_errors(strategy, error);
  if (n == 0) return;
  if (!partial.empty()) {
    std::error_code ec;
    fs::remove_all(partial, ec);
  }
  // A refused output (Note [Writers never destroy]) already says what to do.
  const bool refused = error.find("nothing was written") != std::string::npos ||
                       error.find("did not create") != std::string::npos;
  TORCH_CHECK(error.empty() || !refused, "[checkpoint] cannot save ", target.string(), " on rank ",
              strategy.rank(), ": ", error);
  TORCH_CHECK(error.empty(), "[checkpoint] saving ", target.string(), " failed on rank ",
              strategy.rank(), ": ", error, "; nothing was published (", target.string(),
              " is as it was). HINT: free space or make the checkpoint directory writable");
  TORCH_CHECK(false, "[checkpoint] saving ", target.string(), " failed on ", n, " other rank(s) "
              "(", first, "); nothing was published (", target.string(), " is as it was)");
}

// A load fails on a rank (a damaged file): every rank learns it and throws; the ones that read
// the damage say what it is.
void agree_on_load(Strategy& strategy, const std::string& error, const std::string& dir) {
  at::Tensor failed = at::tensor({error.empty() ? 0.0f : 1.0f});
  failed = strategy.reduce(failed, ReduceOp::kSum);
  const int n = static_cast<int>(failed.item<float>());
  if (n == 0) return;
  TORCH_CHECK(error.empty(), error);
  TORCH_CHECK(false, "[checkpoint] loading ", dir, " failed on ", n, " other rank(s) (their "
              "errors say why); nothing was resumed");
}

// See Note [Checkpoint identity]: checkpoints written before it load, unverified, with a warning.
void warn_unverified(const ckpt::Source& src) {
  if (src.has_integrity() || src.type() == "safetensors") return;
  std::cerr << "[checkpoint] warning: " << src.path() << " was saved without checksums (by an "
            << "earlier fsdp.cpp): its data is loaded unverified; `fsdp-ckpt convert --to "
            << "sharded --world N " << src.path() << " NEW` writes a copy that carries them\n";
}

json sharded_tensor_table(const Layout& L) {
  const int files = L.shard_world;
  json out = json::object();
  for (const auto* group : {&L.model, &L.optimizer}) {
    for (const auto& t : *group) {
      json pieces = json::array();
      if (t.sharded) {
        for (int r = 0; r < L.shard_world; ++r) {
          const RowRange rows = shard_row_range(t.dim0, t.shard_rows, r);
          if (rows.size() > 0) {
            pieces.push_back(json{{"file", ckpt::shard_file_name(r, files)},
                                  {"rows", {rows.begin, rows.end}}});
          }
        }
      } else if (t.dim0 > 0) {
        pieces.push_back(json{{"file", ckpt::shard_file_name(0, files)}, {"rows", {int64_t{0}, t.dim0}}});
      }
      out[t.key] = {{"shape", t.full_shape},
                    {"dtype", ckpt::dtype_name(ckpt::to_dtype(t.local.scalar_type()))},
                    {"pieces", pieces}};
    }
  }
  return out;
}

// Checks the checkpoint against the model before any data is read; names the first mismatch.
void check_matches(const ckpt::Source& src, const std::vector<LocalTensor>& model) {
  for (const auto& t : model) {
    const ckpt::SourceTensor* s = src.find(t.key);
    if (!s) {
      std::string some;
      int n = 0;
      for (const auto& [k, v] : src.tensors()) {
        if (k.rfind(ckpt::kOptimPrefix, 0) == 0) continue;
        if (n++ < 6) some += (some.empty() ? "" : ", ") + k;
      }
      TORCH_CHECK(false, "[checkpoint] ", src.path(), " has no tensor '", t.key,
                  "' (the model expects ", ckpt::shape_str(t.full_shape), "); it holds: ", some,
                  n > 6 ? ", ..." : "", ". Was it saved from a different model?");
    }
    TORCH_CHECK(s->shape == t.full_shape, "[checkpoint] checkpoint has ", t.key, " ",
                ckpt::shape_str(s->shape), ", the model expects ", ckpt::shape_str(t.full_shape),
                " (", src.path(), "); build the model with the configuration the checkpoint was "
                "saved with");
  }
  std::map<std::string, bool> known;
  for (const auto& t : model) known[t.key] = true;
  for (const auto& [k, v] : src.tensors()) {
    if (k.rfind(ckpt::kOptimPrefix, 0) == 0) continue;
    TORCH_CHECK(known.count(k), "[checkpoint] ", src.path(), " holds tensor '", k, "' ",
                ckpt::shape_str(v.shape), " that the model does not have; it was saved from a "
                "different model");
  }
}

void read_local(const ckpt::Source& src, const LocalTensor& t, const at::Tensor& dst) {
  at::NoGradGuard no_grad;
  at::Tensor flat = dst.view({-1});
  if (t.rows > 0) {
    src.read_rows(t.key, t.row_begin, t.rows, flat.narrow(0, 0, t.rows * t.row_numel()));
  }
}

// A parameter's optimizer state to load.
struct OptLoad {
  std::string fqn;
  at::Tensor param;    // what the optimizer steps: as registered (sharded under FSDP), or the
                       // partition of a whole parameter (ZeRO stages 1 and 2)
  LocalTensor layout;  // its rows
};

// Note [Streamed optimizer state]: the checkpoint's statistics go into the strategy's store one
// piece (part of a streaming buffer) at a time; a piece's rows are read into a temporary of at
// most the piece plus two partial rows. Everything is checked before the first piece is written.
void load_streamed(const ckpt::Source& src, const std::string& dir,
                   const std::vector<OptLoad>& loads, const ckpt::CheckpointMeta& info,
                   StreamedOptimizerState& store) {
  const auto names = store.stats();
  std::unordered_map<const c10::TensorImpl*, const OptLoad*> by_param;
  for (const auto& ol : loads) {
    if (!store.holds(ol.param)) continue;
    for (const auto& name : names) {
      const std::string key = std::string(ckpt::kOptimPrefix) + ol.fqn + "." + name;
      const ckpt::SourceTensor* s = src.find(key);
      TORCH_CHECK(s, "[checkpoint] ", dir, " lacks optimizer tensor '", key, "'",
                  name == "max_exp_avg_sq" ? " (saved without amsgrad; this optimizer uses it)"
                                           : "");
      TORCH_CHECK(s->shape == ol.layout.full_shape, "[checkpoint] ", key, " is ",
                  ckpt::shape_str(s->shape), ", its parameter ",
                  ckpt::shape_str(ol.layout.full_shape));
    }
    by_param[ol.param.unsafeGetTensorImpl()] = &ol;
  }
  for (const auto& [impl, ol] : by_param) store.set_step(ol->param, info.optimizer_steps.at(ol->fqn));
  store.write_state([&](const at::Tensor& param, int stat, int64_t offset, float* data,
                        int64_t numel) {
    auto it = by_param.find(param.unsafeGetTensorImpl());
    if (it == by_param.end()) return;  // not in the checkpoint: keeps its state
    const LocalTensor& t = it->second->layout;
    const int64_t rn = t.row_numel();
    const int64_t valid = std::clamp<int64_t>(t.rows * rn - offset, 0, numel);
    std::fill(data + valid, data + numel, 0.0f);  // padding rows
    if (valid == 0) return;
    const int64_t r0 = offset / rn, r1 = (offset + valid + rn - 1) / rn;
    at::Tensor rows = at::empty({(r1 - r0) * rn}, at::kFloat);
    src.read_rows(std::string(ckpt::kOptimPrefix) + it->second->fqn + "." + names[stat],
                  t.row_begin + r0, r1 - r0, rows);
    std::copy_n(rows.const_data_ptr<float>() + (offset - r0 * rn), valid, data);
  });
}

}  // namespace

void save_checkpoint(const std::string& dir, Strategy& strategy, torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const TrainingProgress& progress,
                     StateDictType type) {
  const int rank = strategy.rank();
  const int world = strategy.world_size();
  StreamedOptimizerState* streamed = optimizer ? strategy.streamed_optimizer_state() : nullptr;
  TORCH_CHECK(!streamed || type == StateDictType::kSharded, "[checkpoint] ", dir, ": the "
              "optimizer state of this run is kept outside RAM (", strategy.name(), ": "
              "offload_optimizer_device nvme) and is saved streamed, in the sharded format only; "
              "the full format would gather every optimizer tensor whole on rank 0. HINT: "
              "state_dict_type \"sharded\" (fsdp-train --state-dict-type sharded); it reloads "
              "under any strategy and world size, and `fsdp-ckpt convert` consolidates the "
              "weights");
  json optim_meta;
  Layout L = build_layout(&strategy, module, optimizer, &optim_meta);

  // Note [Crash-safe save]: everything goes to DIR.partial; rank 0 publishes it (metadata last,
  // then rename) only after every rank has committed its files.
  const fs::path target = fs::path(dir).lexically_normal();
  const fs::path partial = target.string() + ".partial";
  std::string error;
  bool created_partial = false;  // rank 0: DIR.partial is this call's (and may be removed)
  if (rank == 0) {
    // See Note [Writers never destroy] in output.h: a checkpoint at DIR is replaced (a save
    // overwrites, as Lightning's), anything else there is left alone.
    error = ckpt::output_problem("", target, ckpt::OutputKind::kCheckpointDir,
                                 /*overwrite=*/true, "");
    std::error_code ec;
    const std::string& run = ckpt::current_or_new_run_id();
    if (error.empty() && fs::exists(fs::symlink_status(partial, ec))) {
      // See Note [Interrupted saves] in run_records.h: this run's own leftover is reused.
      if (ckpt::partial_reusable(partial, run, target.filename().string())) {
        fs::remove_all(partial, ec);
        if (ec) error = "cannot remove " + partial.string() + " (left by an interrupted save of "
                        "this run): " + ec.message();
      } else {
        error = partial.string() + " exists (left by an interrupted save of another run?) and "
                "this save does not remove what it did not create; remove it, or save to "
                "another directory";
      }
    }
    if (error.empty()) {
      fs::create_directories(partial.parent_path().empty() ? "." : partial.parent_path(), ec);
      created_partial = !ec && fs::create_directory(partial, ec);
      if (!created_partial) error = "cannot create " + partial.string() + ": " + ec.message();
    }
    if (created_partial) {
      try {
        ckpt::mark_partial(partial, run, target.filename().string());
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  agree_on_save(strategy, error, target, created_partial ? partial : fs::path());

  // See Note [Checkpoint identity] and Note [Run identity]: rank 0's ids, on every rank.
  ckpt::Identity id;
  {
    std::string& run = ckpt::current_run_id();
    std::string ids = (run.empty() ? ckpt::random_id() : run) + ckpt::random_id();
    if (world > 1) {
      at::Tensor bytes = at::empty({static_cast<int64_t>(ids.size())}, at::kByte);
      std::copy(ids.begin(), ids.end(), bytes.data_ptr<uint8_t>());
      broadcast_host(*strategy.world(), bytes, 0);
      ids.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), ids.size());
    }
    run = ids.substr(0, ids.size() / 2);
    id.run_id = run;
    id.save_id = ids.substr(ids.size() / 2);
    id.step = progress.global_step;
    id.world_size = world;
  }
  json meta = {{"format", "fsdp.cpp checkpoint"},
               {"format_version", ckpt::kFormatVersion},
               {"type", to_string(type)},
               {"world_size", world},
               {"strategy", strategy.name()},
               {"progress",
                {{"global_step", progress.global_step},
                 {"epoch", progress.epoch},
                 {"batch_in_epoch", progress.batch_in_epoch},
                 {"scheduler_steps", progress.scheduler_steps}}},
               {"rng_cpu", ""},
               {"integrity", {{"checksum", "crc32"}, {"run_id", id.run_id},
                              {"save_id", id.save_id}}}};
  if (optimizer) meta["optimizer"] = optim_meta;
  if (!progress.callback_states.empty()) {
    json cbs = json::parse(progress.callback_states, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK(cbs.is_object(), "[checkpoint] callback states are not a JSON object: ",
                progress.callback_states);
    meta["callbacks"] = cbs;
  }
  {
    // See Note [Per-rank RNG state].
    auto save_rng = [&](const at::Tensor& mine, const char* one_key, const char* per_rank_key) {
      const at::Tensor all = world > 1 ? all_gather_host(*strategy.world(), mine) : mine;
      json per_rank = json::array();
      for (int r = 0; r < world; ++r) {
        per_rank.push_back(hex_of(all.narrow(0, r * mine.numel(), mine.numel())));
      }
      meta[one_key] = per_rank[0];
      meta[per_rank_key] = per_rank;
    };
    save_rng(cpu_rng_state(), "rng_cpu", "rng_cpu_per_rank");
    if (strategy.device().is_cuda()) {
      save_rng(cuda_rng_state(strategy.device()), "rng_cuda", "rng_cuda_per_rank");
    }
  }

  if (type == StateDictType::kFull) {
    // Collective (all-gathers): a failed write comes back as `error` on the writing rank, after
    // every all-gather, so that every rank gets to agree_on_save.
    error = write_full((partial / ckpt::kModelFile).string(), L.model, L, rank,
                       progress.global_step, id);
    if (optimizer) {
      std::string e = write_full((partial / ckpt::kOptimizerFile).string(), L.optimizer, L, rank,
                                 progress.global_step, id);
      if (error.empty()) error = e;
    }
    try {  // no collective inside
      if (error.empty()) strategy.save_extra_state(partial.string(), module, optimizer);
    } catch (const std::exception& e) {
      error = e.what();
    }
  } else {
    try {  // no collective inside: every rank gets to agree_on_save
      write_shard((partial / ckpt::shard_file_name(L.shard_rank, L.shard_world)).string(), L,
                  rank, progress.global_step, streamed, id);
      strategy.save_extra_state(partial.string(), module, optimizer);  // e.g. DDP's comm hooks
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (rank == 0) meta["tensors"] = sharded_tensor_table(L);
  }
  agree_on_save(strategy, error, target, created_partial ? partial : fs::path());

  if (rank == 0) {
    const char* meta_file = type == StateDictType::kFull ? ckpt::kFullMetaFile
                                                          : ckpt::kShardedMetaFile;
    ckpt::write_file_atomic((partial / meta_file).string(), meta.dump(1));
    ckpt::unmark_partial(partial);
    ckpt::publish_dir(partial, target, "[checkpoint]");
  }
  strategy.barrier();
}

TrainingProgress load_checkpoint(const std::string& dir, Strategy& strategy,
                                 torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                                 torch::optim::LRScheduler* scheduler) {
  std::unique_ptr<ckpt::Source> src;
  try {
    src = std::make_unique<ckpt::Source>(dir);
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[checkpoint] ", e.what());
  }
  TORCH_CHECK(src->type() != "safetensors", "[checkpoint] ", dir, " is a bare safetensors file: "
              "it has weights only; use fsdp::load_weights for it, or pass a checkpoint "
              "directory to resume training");
  Layout L = build_layout(&strategy, module, nullptr, nullptr);
  check_matches(*src, L.model);
  const ckpt::CheckpointMeta& info = src->info();
  if (strategy.rank() == 0) warn_unverified(*src);

  // Optimizer: state for every parameter the checkpoint has state for.
  std::vector<OptLoad> opt_loads;
  if (optimizer) {
    TORCH_CHECK(info.has_optimizer, "[checkpoint] ", dir, " has no optimizer state (it "
                "was saved without an optimizer); load the weights with fsdp::load_weights");
    const std::string kind = optimizer_kind(*optimizer);
    TORCH_CHECK(info.optimizer_kind == kind, "[checkpoint] ", dir, " holds ",
                info.optimizer_kind, " optimizer state but the optimizer is ", kind,
                "; configure the optimizer the checkpoint was saved with");
    TORCH_CHECK(info.lrs.size() == optimizer->param_groups().size(),
                "[checkpoint] ", dir, " has ", info.lrs.size(), " optimizer param groups, the "
                "optimizer ", optimizer->param_groups().size(), "; configure the optimizer's "
                "parameter groups as when the checkpoint was saved");
    for (const auto& item : module.named_parameters(true)) {
      if (!info.optimizer_steps.count(item.key())) continue;
      const LocalTensor* lt = nullptr;
      for (const auto& m : L.model) {
        if (m.key == item.key()) lt = &m;
      }
      TORCH_INTERNAL_ASSERT(lt);
      at::Tensor opt_tensor;
      LocalTensor layout = optimizer_layout(L, *lt, item.value(), &opt_tensor);
      opt_loads.push_back({item.key(), opt_tensor, layout});
    }
  }

  // Data. A damaged file is found by the ranks that read it: every rank learns it and stops.
  std::string load_error;
  try {
    // Data.
    {
      ResidentWindow window(L.pager, /*modifies=*/true);
      for (const auto& t : L.model) {
        window.enter(t);
        read_local(*src, t, t.local);
      }
      window.close();
    }
    StreamedOptimizerState* streamed = optimizer ? strategy.streamed_optimizer_state() : nullptr;
    if (streamed) {
      load_streamed(*src, dir, opt_loads, info, *streamed);
    } else if (optimizer) {
      const std::string& kind = info.optimizer_kind;
      for (const auto& ol : opt_loads) {
        auto stat = [&](const std::string& name, bool required) -> at::Tensor {
          std::string key = std::string(ckpt::kOptimPrefix) + ol.fqn + "." + name;
          const ckpt::SourceTensor* s = src->find(key);
          TORCH_CHECK(s || !required, "[checkpoint] ", dir, " lacks optimizer tensor '", key, "'");
          if (!s) return {};
          TORCH_CHECK(s->shape == ol.layout.full_shape, "[checkpoint] ", key, " is ",
                      ckpt::shape_str(s->shape), ", its parameter ",
                      ckpt::shape_str(ol.layout.full_shape));
          at::Tensor t = at::zeros_like(ol.param.detach(), at::MemoryFormat::Contiguous);
          LocalTensor lt = ol.layout;
          lt.key = key;
          read_local(*src, lt, t);
          return t;
        };
        const int64_t step = info.optimizer_steps.at(ol.fqn);
        std::unique_ptr<torch::optim::OptimizerParamState> st;
        if (kind == "adamw") {
          auto s = std::make_unique<torch::optim::AdamWParamState>();
          s->step(step).exp_avg(stat("exp_avg", true)).exp_avg_sq(stat("exp_avg_sq", true));
          if (auto m = stat("max_exp_avg_sq", false); m.defined()) s->max_exp_avg_sq(m);
          st = std::move(s);
        } else if (kind == "adam") {
          auto s = std::make_unique<torch::optim::AdamParamState>();
          s->step(step).exp_avg(stat("exp_avg", true)).exp_avg_sq(stat("exp_avg_sq", true));
          if (auto m = stat("max_exp_avg_sq", false); m.defined()) s->max_exp_avg_sq(m);
          st = std::move(s);
        } else {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          if (auto m = stat("momentum_buffer", false); m.defined()) s->momentum_buffer(m);
          st = std::move(s);
        }
        optimizer->state()[state_key(ol.param)] = std::move(st);
      }
    }
  } catch (const c10::Error& e) {
    load_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    load_error = std::string("[checkpoint] ") + e.what();
  }
  agree_on_load(strategy, load_error, dir);
  // See Note [Run identity]: a resumed fit continues the run it resumes.
  if (!src->run_id().empty()) ckpt::current_run_id() = src->run_id();

  TrainingProgress progress;
  progress.global_step = info.global_step;
  progress.epoch = info.epoch;
  progress.batch_in_epoch = info.batch_in_epoch;
  progress.scheduler_steps = info.scheduler_steps;
  progress.callback_states = info.callback_states;
  if (scheduler) {
    for (int64_t i = 0; i < progress.scheduler_steps; ++i) scheduler->step();
  }
  if (optimizer) {
    auto& groups = optimizer->param_groups();
    for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(info.lrs[i]);
  }
  strategy.load_extra_state(dir, module, optimizer);
  // See Note [Per-rank RNG state].
  // A checkpoint saved on the CPU has no CUDA state: the CUDA generator keeps the seed's stream.
  const int rank = strategy.rank();
  auto load_rng = [&](const char* kind, const std::vector<uint8_t>& one,
                      const std::vector<std::vector<uint8_t>>& per_rank, const auto& set) {
    try {
      if (info.world_size == strategy.world_size() &&
          static_cast<int>(per_rank.size()) == strategy.world_size()) {
        set(per_rank[rank]);
      } else if (!one.empty()) {
        set(one);
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "[checkpoint] ", dir, ": the saved ", kind, " RNG state does not fit "
                  "this libtorch's generator (", e.what_without_backtrace(), "); was it saved "
                  "by another libtorch version?");
    }
  };
  load_rng("CPU", info.rng_cpu, info.rng_cpu_per_rank, set_cpu_rng_state);
  if (strategy.device().is_cuda()) {
    load_rng("CUDA", info.rng_cuda, info.rng_cuda_per_rank,
             [&](const std::vector<uint8_t>& b) { set_cuda_rng_state(strategy.device(), b); });
  }
  strategy.barrier();
  return progress;
}

void load_weights(torch::nn::Module& module, const std::string& path) {
  std::unique_ptr<ckpt::Source> src;
  try {
    src = std::make_unique<ckpt::Source>(path);
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[load_weights] ", e.what());
  }
  Layout L = build_layout(nullptr, module, nullptr, nullptr);
  check_matches(*src, L.model);
  warn_unverified(*src);
  try {
    for (const auto& t : L.model) read_local(*src, t, t.local);
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[load_weights] ", e.what());
  }
}

}  // namespace fsdp
