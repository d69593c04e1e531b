// DDPStrategy::save_extra_state / load_extra_state: the comm hook's state (PowerSGD's error
// feedback, P and Q, counters and RNG; post-local SGD's counter), the model averager's step and,
// with post-local SGD, this rank's replica (parameters and optimizer state) in checkpoints, one
// safetensors file per rank. See docs/ddp_comm_hooks.md "Checkpoints".
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
// This rank's replica: "replica.<FQN>" and "replica.optim.<FQN>.<stat>".
constexpr const char* kReplicaPrefix = "replica.";

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

// Note [Per-rank replicas in checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A DDP checkpoint holds rank 0's parameters and optimizer state, which every rank loads: right
// for DDP, whose replicas are identical after every step. Post-local SGD's are not: after
// start_local_sgd_iter each rank (or subgroup) steps on its own gradients, so its parameters
// differ until the next model averaging and its optimizer state (momentum, Adam moments) differs
// for good. Resuming from rank 0's alone changed the losses after a resume (3.29188 against
// 3.27177 at step 5 in CommHookResume.PostLocalSGD*). So with post-local SGD (or any model
// averaging) every rank also writes its own parameters and optimizer state into its comm-state
// file, and load_extra_state, which runs after the model and optimizer are loaded, overwrites
// them with this rank's (same world size only; another world size keeps rank 0's, with a note).
bool replicas_differ(const CommHookState& state, const PeriodicModelAverager* averager) {
  return averager != nullptr || state.kind() == "post_local_sgd";
}

void add_replica(torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                 std::vector<std::pair<std::string, at::Tensor>>& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    out.emplace_back(kReplicaPrefix + item.key(), item.value().detach().contiguous());
    if (!optimizer) continue;
    int64_t step = 0;
    for (const auto& [stat, t] : ckpt::optimizer_stats(*optimizer, item.value(), &step)) {
      out.emplace_back(std::string(kReplicaPrefix) + ckpt::kOptimPrefix + item.key() + "." + stat,
                       t.detach().contiguous());
    }
  }
}

// Copies this rank's saved replica (see add_replica) into the parameters and the optimizer state
// load_checkpoint has just restored from rank 0's files.
void restore_replica(const std::map<std::string, at::Tensor>& saved, const std::string& path,
                     torch::nn::Module& module, torch::optim::Optimizer* optimizer) {
  at::NoGradGuard no_grad;
  auto copy_from = [&](const std::string& key, const at::Tensor& dst) {
    auto it = saved.find(key);
    TORCH_CHECK(it != saved.end(), "[ddp] ", path, " lacks '", key, "': the checkpoint was "
                "saved with another model or optimizer than this run's; resume with the saved "
                "configuration");
    TORCH_CHECK(it->second.sizes() == dst.sizes(), "[ddp] ", path, ": '", key, "' has shape ",
                it->second.sizes(), ", this run's ", dst.sizes());
    dst.detach().copy_(it->second);
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    copy_from(kReplicaPrefix + item.key(), item.value());
    if (!optimizer) continue;
    int64_t step = 0;
    for (const auto& [stat, t] : ckpt::optimizer_stats(*optimizer, item.value(), &step)) {
      copy_from(std::string(kReplicaPrefix) + ckpt::kOptimPrefix + item.key() + "." + stat, t);
    }
  }
}

}  // namespace

void DDPStrategy::save_extra_state(const std::string& dir, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(reducer_, "[ddp] save_checkpoint before setup_module");
  CommHookStateDict d = comm_state_->state_dict();
  const bool replicas = replicas_differ(*comm_state_, averager_.get());
  if (d.tensors.empty() && d.values.empty() && !replicas) return;  // nothing to keep

  std::map<std::string, std::string> meta;
  meta[kKind] = comm_state_->kind();
  for (const auto& [k, v] : d.values) meta[kValuePrefix + k] = v;
  if (averager_) meta[kAveragerStep] = std::to_string(averager_->step());
  std::vector<std::pair<std::string, at::Tensor>> tensors(d.tensors.begin(), d.tensors.end());
  for (const auto& [k, t] : tensors) {
    TORCH_INTERNAL_ASSERT(k.rfind(kReplicaPrefix, 0) != 0, "comm state key ", k);
  }
  // See Note [Per-rank replicas in checkpoints].
  if (replicas) add_replica(module, optimizer, tensors);
  const std::string path = (fs::path(dir) / file_name(rank(), world_size())).string();
  try {
    save_safetensors(path, tensors, meta);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[ddp] rank ", rank(), ": cannot write the comm hook state to ", path,
                ": ", e.what());
  }
}

void DDPStrategy::load_extra_state(const std::string& dir, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(reducer_, "[ddp] load_checkpoint before setup_module");
  const auto files = state_files(dir);
  if (files.empty()) return;  // saved without hook state: the hook starts fresh
  // This run keeps no hook state (plain DDP resuming a PowerSGD run, say): nothing to restore.
  const bool replicas = replicas_differ(*comm_state_, averager_.get());
  if (comm_state_->state_dict().values.empty() && !replicas) return;
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
  std::map<std::string, at::Tensor> replica;
  std::map<std::string, std::string> meta;
  try {
    ckpt::SafetensorsReader reader(path);
    meta = reader.header().metadata;
    if (same_world) {
      for (const auto& e : reader.header().tensors) {
        at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(ckpt::to_scalar_type(e.dtype)));
        reader.read(e.name, t.data_ptr(), static_cast<size_t>(t.nbytes()));
        // The hook's state lives where the buckets do (the rank's device); replicas are
        // copied into the parameters and optimizer state wherever those are.
        if (e.name.rfind(kReplicaPrefix, 0) == 0) {
          replica[e.name] = t;
        } else {
          d.tensors[e.name] = t.to(device());
        }
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
  if (replicas && same_world) {
    // See Note [Per-rank replicas in checkpoints].
    TORCH_CHECK(!replica.empty(), "[ddp] ", path, " holds no per-rank replica (parameters and "
                "optimizer state) but this run's ranks keep their own (post-local SGD); it was "
                "saved by a run without post-local SGD or by an older fsdp.cpp: resume with the "
                "saved --ddp-comm-hook");
    restore_replica(replica, path, module, optimizer);
  }
  if (!same_world && rank() == 0) {
    std::cerr << "[ddp] note: " << dir << " was saved at world size " << saved_world
              << ", this run has " << world << ": the comm hook's per-rank state (PowerSGD "
              << "error feedback, P and Q; post-local SGD's per-rank parameters and optimizer "
              << "state) starts from rank 0's; its counters continue" << std::endl;
  }
}

}  // namespace fsdp
