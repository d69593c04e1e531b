// DDPStrategy::save_extra_state / load_extra_state: the comm hook's state (PowerSGD's error
// feedback, P and Q, counters and RNG; post-local SGD's counter) and the model averager's step
// in checkpoints, one safetensors file per rank. See docs/ddp_comm_hooks.md "Checkpoints".
#include "fsdp/ddp.h"

#include "fsdp/checkpoint.h"

#include "ckpt/layout.h"
#include "ckpt/safetensors.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <iostream>
#include <regex>

namespace fsdp {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPrefix = "ddp_comm_state-";
constexpr const char* kKind = "kind";
constexpr const char* kAveragerStep = "averager_step";
constexpr const char* kValuePrefix = "value.";

std::string file_name(int rank, int world) {
  return std::string(kPrefix) + std::to_string(rank) + "-of-" + std::to_string(world) +
         ".safetensors";
}

// (rank, world) of every comm-state file in dir.
std::vector<std::pair<int, int>> state_files(const std::string& dir) {
  std::vector<std::pair<int, int>> out;
  const std::regex re(std::string(kPrefix) + "([0-9]+)-of-([0-9]+)\\.safetensors");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, re)) out.emplace_back(std::stoi(m[1]), std::stoi(m[2]));
  }
  return out;
}

}  // namespace

void DDPStrategy::save_extra_state(const std::string& dir) {
  TORCH_CHECK(reducer_, "[ddp] save_checkpoint before setup_module");
  CommHookStateDict d = comm_state_->state_dict();
  if (d.tensors.empty() && d.values.empty() && !averager_) return;  // nothing to keep

  std::map<std::string, std::string> meta;
  meta[kKind] = comm_state_->kind();
  for (const auto& [k, v] : d.values) meta[kValuePrefix + k] = v;
  if (averager_) meta[kAveragerStep] = std::to_string(averager_->step());
  std::vector<std::pair<std::string, at::Tensor>> tensors(d.tensors.begin(), d.tensors.end());
  const std::string path = (fs::path(dir) / file_name(rank(), world_size())).string();
  try {
    save_safetensors(path, tensors, meta);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[ddp] rank ", rank(), ": cannot write the comm hook state to ", path,
                ": ", e.what());
  }
}

void DDPStrategy::load_extra_state(const std::string& dir) {
  TORCH_CHECK(reducer_, "[ddp] load_checkpoint before setup_module");
  const auto files = state_files(dir);
  if (files.empty()) return;  // saved without hook state: the hook starts fresh
  // This run keeps no hook state (plain DDP resuming a PowerSGD run, say): nothing to restore.
  if (comm_state_->state_dict().values.empty() && !averager_) return;
  const int world = world_size();
  bool same_world = false;
  int saved_world = files.front().second;
  for (const auto& [r, w] : files) {
    if (w == world) same_world = true;
    saved_world = w;
  }
  // The same world: this rank's own file. Another world: rank 0's counters only.
  const std::string path =
      (fs::path(dir) / (same_world ? file_name(rank(), world) : file_name(0, saved_world))).string();
  TORCH_CHECK(fs::exists(path), "[ddp] rank ", rank(), ": ", dir, " holds comm hook state files "
              "but not ", fs::path(path).filename().string(), "; the checkpoint is incomplete");
  CommHookStateDict d;
  std::map<std::string, std::string> meta;
  try {
    ckpt::SafetensorsReader reader(path);
    meta = reader.header().metadata;
    if (same_world) {
      for (const auto& e : reader.header().tensors) {
        at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(ckpt::to_scalar_type(e.dtype)));
        reader.read(e.name, t.data_ptr(), static_cast<size_t>(t.nbytes()));
        d.tensors[e.name] = t;
      }
    }
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[ddp] ", e.what());
  }
  const std::string kind = meta.count(kKind) ? meta.at(kKind) : "";
  TORCH_CHECK(kind == comm_state_->kind(), "[ddp] ", path, " holds the state of a '", kind,
              "' comm hook but this run's comm_state is '", comm_state_->kind(), "'; resume "
              "with the same --ddp-comm-hook (DDPOptions::comm_state) as the saved run");
  const std::string prefix = kValuePrefix;
  for (const auto& [k, v] : meta) {
    if (k.rfind(prefix, 0) == 0) d.values[k.substr(prefix.size())] = v;
  }
  comm_state_->load_state_dict(d, same_world);
  if (averager_) {
    auto it = meta.find(kAveragerStep);
    TORCH_CHECK(it != meta.end(), "[ddp] ", path, " has no model averager step but this run "
                "averages parameters (model_averaging_period); resume with the saved options");
    averager_->set_step(std::stoll(it->second));
  }
  if (!same_world && rank() == 0) {
    std::cerr << "[ddp] note: " << dir << " was saved at world size " << saved_world
              << ", this run has " << world << ": the comm hook's per-rank state (PowerSGD "
              << "error feedback, P and Q) starts fresh; its counters continue" << std::endl;
  }
}

}  // namespace fsdp
