// fsdp::Trainer: option checks, launch, and the fit / validate / test / predict loops.
// The strategy is driven exactly in the order of the comment at the top of fsdp/strategy.h.
#include "fsdp/trainer.h"
#include "fsdp/offload.h"

#include "comm/backend_choice.h"
#include "common/device_choice.h"
#include "common/settings.h"
#include "common/text.h"
#include "cuda/cuda_api.h"
#include "fsdp/comm.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/cpu_adam.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/memory.h"
#include "fsdp/optim8bit.h"
#include "fsdp/precision.h"
#include "train/metrics.h"
#include "train/progress_bar.h"

#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <tuple>

namespace fsdp {
namespace {

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

void check_precision(const std::string& p) { check_precision_supported(parse_precision(p)); }

// The device rules live in src/common/device_choice.h; checked here for local rank 0 before
// launching, so a bad accelerator fails once. Returns the choice.
detail::DeviceChoice check_accelerator(const TrainerOptions& o, const std::string& backend) {
  const detail::DeviceFacts facts{detail::cuda_built(), detail::cuda_device_count()};
  return detail::choose_device(o.accelerator, /*local_rank=*/0, std::max(o.devices, 1), backend,
                               facts);
}

// Note [Moving the model to the device]
// --------------------------------------
// configure_model builds the model on the host; the Trainer moves it to the rank's CUDA device
// (torch::nn::Module::to: every parameter and buffer keeps its identity) before the strategy
// sets it up, so DDP's buckets and FSDP's shards are allocated on the device from then on.
// With FSDP's deferred init (FULL_SHARD / SHARD_GRAD_OP, ZeRO-3, at 2+ ranks) the units'
// shards went to the device while configure_model built them (Note [Deferred init onto the
// device] in src/shard/deferred_init.cpp), and only the rest moves here; otherwise the whole
// model passes through the device once. What is not on CUDA yet is
// refused here, never run on the host behind the user's back: QLoRA's 4-bit layers (uint8
// parameters or buffers) and host-only optimizers (checked after configure_optimizers).
void move_to_device(torch::nn::Module& module, c10::Device device, int local_world_size) {
  auto refuse_uint8 = [](const char* kind, const auto& named) {
    for (const auto& t : named) {
      TORCH_CHECK(t.value().scalar_type() != at::kByte, "[Trainer] ", kind, " '", t.key(),
                  "' is uint8 (a 4-bit quantized layer): QLoRA's 4-bit layers are not on CUDA "
                  "yet (docs/gpu.md); use accelerator='cpu'");
    }
  };
  refuse_uint8("parameter", module.named_parameters(/*recurse=*/true));
  refuse_uint8("buffer", module.named_buffers(/*recurse=*/true));
  // What is still on the host moves whole: refuse what cannot fit there before copying (Note
  // [Model-state budget] in src/memory/state_budget.cpp). Shards already on the device count.
  int64_t bytes = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) bytes += p.nbytes();
  for (const auto& b : module.buffers(/*recurse=*/true)) bytes += b.nbytes();
  const ModelStateBudget budget = model_state_budget(device, local_world_size);
  if (budget.bytes > 0 && bytes > budget.bytes) {
    std::ostringstream os;
    os << "[Trainer] the model's parameters and buffers on " << device << " would take "
       << format_bytes(bytes) << " per rank before the strategy sets them up, but "
       << budget.what << " is " << format_bytes(budget.bytes) << " per rank. HINT: strategy "
       << "'fsdp' (FULL_SHARD or SHARD_GRAD_OP) or 'deepspeed_stage_3' at 2+ ranks, which "
       << "shard each layer onto the device while configure_model builds it (the model calls "
       << "fsdp::nn::built or fsdp::wrap for its layers); more GPUs; a smaller model; "
       << budget.more;
    throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, os.str());
  }
  module.to(device);
}

// Optimizers whose step runs on host memory only.
void check_optimizer_on_cuda(torch::optim::Optimizer& optimizer) {
  const char* name =
      dynamic_cast<optim::CPUAdam*>(&optimizer) ? "fsdp::optim::CPUAdam (--optimizer cpu_adam)"
      : dynamic_cast<AdamW8bit*>(&optimizer)    ? "fsdp::AdamW8bit (--optim adamw_8bit)"
                                                : nullptr;
  TORCH_CHECK(!name, "[Trainer] the optimizer ", name, " steps host memory and is not on CUDA "
              "yet (docs/gpu.md); use torch::optim::Adam / AdamW on CUDA, or accelerator='cpu'");
}

// Note [Out of memory during fit]
// -------------------------------
// The strategies refuse model state that cannot fit before allocating it (Note [Model-state
// budget] in src/memory/state_budget.cpp), but activations, the unsharded units in flight and
// the allocator's fragmentation are only known when the step runs. When the CUDA caching
// allocator runs out (c10::OutOfMemoryError) anywhere in fit, the Trainer rethrows it as
// fsdp::OutOfMemoryError with one sentence: the rank, the device, what the loop was doing
// (setup, the forward / backward / optimizer step of step N, validation), the allocator's own
// first sentence ("Tried to allocate ..."), and the changes that would fit for this run's
// configuration (a smaller batch, FULL_SHARD, activation checkpointing, bf16-mixed). The host's
// tracking allocator already throws fsdp::OutOfMemoryError with its own sentence.
[[noreturn]] void throw_out_of_memory(const c10::OutOfMemoryError& e, const std::string& phase,
                                     int rank, c10::Device device, const TrainerOptions& options,
                                     const Strategy* strategy, LightningModule& module) {
  std::string allocator = e.what_without_backtrace();
  allocator = allocator.substr(0, allocator.find('\n'));
  if (allocator.size() > 400) allocator = allocator.substr(0, 397) + "...";
  std::vector<std::string> hints;
  hints.push_back("a smaller batch size (accumulate_grad_batches / --accumulate-grad-batches "
                  "keeps the effective batch)");
  const auto* fsdp = dynamic_cast<const FSDPStrategy*>(strategy);
  const auto* zero = dynamic_cast<const DeepSpeedStrategy*>(strategy);
  const bool fully_sharded =
      (fsdp && fsdp->options().sharding_strategy == ShardingStrategy::kFullShard) ||
      (zero && zero->options().stage == 3);
  if (!fully_sharded) {
    hints.push_back("strategy 'fsdp' with FULL_SHARD (or 'deepspeed_stage_3'), which shards "
                    "parameters, gradients and optimizer state over the ranks");
  }
  if (count_activation_checkpointed(module) == 0) {
    hints.push_back("activation checkpointing (fsdp::apply_activation_checkpointing; "
                    "fsdp-train --activation-checkpointing)");
  }
  const Precision precision = parse_precision(options.precision);
  if (precision == Precision::k32True || precision == Precision::k64True) {
    hints.push_back("precision 'bf16-mixed'");
  }
  hints.push_back("more devices");
  std::ostringstream os;
  os << "[Trainer] rank " << rank << " ran out of memory on " << device << " during "
     << phase << ": " << allocator << " HINT: ";
  for (size_t i = 0; i < hints.size(); ++i) {
    os << (i == 0 ? "" : i + 1 == hints.size() ? "; or " : "; ") << hints[i];
  }
  os << " (docs/memory.md).";
  throw OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, os.str());
}

void check_limit(const char* name, double v) {
  TORCH_CHECK(std::isfinite(v), "[Trainer] ", name, " must be a finite number, got ", v);
  if (v >= 1) {
    TORCH_CHECK(v == std::floor(v), "[Trainer] ", name, " = ", v,
                ": values >= 1 are batch counts and must be whole numbers; use a value in "
                "(0, 1) for a fraction of the epoch");
  }
}

// TrainerOptions::process_group_backend; "auto" defers to FSDP_BACKEND when set (the settings
// checked its value).
std::string resolve_backend(const std::string& option, const detail::Settings& settings) {
  const std::string b = option == "auto" && !settings.backend.empty() ? settings.backend : option;
  TORCH_CHECK(b == "auto" || b == "gloo" || b == "mpi" || b == "nccl",
              "[Trainer] unknown process group backend '", b,
              "'; valid values: 'auto', 'gloo', 'mpi', 'nccl'");
  return b;
}

// The backend choice is said once per job: by the process that launches (before spawning or
// re-running through mpirun), or by rank 0 of ranks another launcher started. Ranks that
// fsdp::launch started itself ("spawn", "mpirun") stay quiet: their launcher said it.
bool announces_backend(const detail::Settings& settings) {
  const LaunchInfo& launch = settings.launch;
  if (launch.source == "none") return true;
  return launch.rank == 0 && settings.launched_by != "spawn" && settings.launched_by != "mpirun";
}

void check_options(const TrainerOptions& o) {
  check_accelerator(o, o.process_group_backend);
  check_precision(o.precision);
  TORCH_CHECK(o.devices >= 1, "[Trainer] devices must be >= 1, got ", o.devices);
  TORCH_CHECK(o.num_nodes >= 1, "[Trainer] num_nodes must be >= 1, got ", o.num_nodes);
  TORCH_CHECK(o.max_epochs >= -1, "[Trainer] max_epochs must be >= 0 (or -1 for unset), got ",
              o.max_epochs);
  TORCH_CHECK(o.max_steps >= -1, "[Trainer] max_steps must be >= 0 (or -1 for unset), got ",
              o.max_steps);
  TORCH_CHECK(o.accumulate_grad_batches >= 1,
              "[Trainer] accumulate_grad_batches must be >= 1, got ", o.accumulate_grad_batches);
  TORCH_CHECK(std::isfinite(o.gradient_clip_val) && o.gradient_clip_val >= 0,
              "[Trainer] gradient_clip_val must be >= 0 (0 = no clipping), got ",
              o.gradient_clip_val);
  TORCH_CHECK(o.log_every_n_steps >= 1, "[Trainer] log_every_n_steps must be >= 1, got ",
              o.log_every_n_steps);
  check_limit("limit_train_batches", o.limit_train_batches);
  check_limit("limit_val_batches", o.limit_val_batches);
  check_limit("val_check_interval", o.val_check_interval);
  const std::string& s = o.strategy.name();
  if (!o.strategy.object() && s != "auto" && !contains(strategy_names(), s)) {
    make_strategy(s);  // throws the registry's error, which lists the valid names
  }
}

// Batches of an epoch to use given a limit (see TrainerOptions::limit_train_batches).
int64_t limited_batches(int64_t available, double limit) {
  if (limit < 0) return available;
  if (limit == 0) return 0;
  if (limit < 1) return std::max<int64_t>(1, static_cast<int64_t>(available * limit));
  return std::min<int64_t>(available, static_cast<int64_t>(limit));
}

// Lightning's convention: batch size is per rank, and each rank reads its own stride of one
// shared permutation. A loader whose sampler was built for another world/rank (typically the
// default world 1) gets an equivalent sampler for this rank. See Note [Sampler striding].
void distribute(DataLoader& loader, int world, int rank) {
  const DistributedSampler& s = loader.sampler();
  if (s.world() == world && s.rank() == rank) return;
  TORCH_CHECK(s.world() == 1, "[Trainer] the data loader's sampler is set up for world ",
              s.world(), " rank ", s.rank(), ", but this run has world ", world, " rank ", rank,
              "; build the loader with DistributedSampler(size, 1, 0, ...) and let the "
              "Trainer distribute it");
  DistributedSampler sampler(s.dataset_size(), world, rank, s.shuffle(), s.seed(),
                             s.drop_last());
  sampler.set_epoch(s.epoch());
  loader = DataLoader(loader.dataset(), loader.batch_size(), sampler, loader.drop_last());
}

using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
double seconds_since(Clock::time_point t) { return seconds_between(t, Clock::now()); }

}  // namespace

void seed_everything(uint64_t seed) {
  torch::manual_seed(seed);
  std::srand(static_cast<unsigned>(seed));
}

std::vector<std::string> Trainer::precision_names() { return fsdp::precision_names(); }

std::vector<std::string> Trainer::accelerator_names() { return detail::kAcceleratorNames; }

Trainer::Trainer(TrainerOptions options) : options_(std::move(options)) {
  // Checked before launching, so a bad option or setting fails once in the parent, not in
  // every rank. The environment is read here, once (src/common/settings.h).
  check_options(options_);
  auto settings = std::make_unique<const detail::Settings>(detail::read_settings());
  const std::string requested = resolve_backend(options_.process_group_backend, *settings);
  // See Note [Backend auto] in comm/backend_choice.cpp.
  const detail::BackendFacts facts =
      detail::backend_facts(requested, options_.devices, options_.num_nodes, *settings);
  detail::BackendChoice choice = detail::choose_backend(facts);
  // On CUDA devices "auto" is NCCL, one rank per GPU; ranks sharing a GPU (NCCL refuses two
  // ranks of one communicator on one device) use Gloo, staging CUDA tensors through host memory.
  const detail::DeviceChoice device0 = check_accelerator(options_, requested);
  if (device0.cuda && requested == "auto") {
    const int visible = detail::cuda_device_count();
    choice.relaunch_through_mpirun = false;
    if (options_.devices <= visible) {
      choice.backend = "nccl";
      choice.reason = "CUDA devices, one per rank";
    } else {
      choice.backend = "gloo";
      choice.reason = std::to_string(options_.devices) + " ranks share " +
                      std::to_string(visible) + " CUDA device(s): NCCL allows one rank per "
                      "device, so Gloo with CUDA tensors staged through host memory";
    }
  }
  const std::string& backend = choice.backend;
  TORCH_CHECK(backend != "nccl" || device0.cuda, "[Trainer] backend 'nccl' moves CUDA tensors, "
              "but this run trains on the CPU (accelerator '", options_.accelerator, "'); use "
              "accelerator 'cuda' in a CUDA build (docs/gpu.md), or backend 'gloo' or 'mpi'");
  if (requested == "auto" && facts.world_size > 1 && announces_backend(*settings)) {
    std::cerr << detail::describe(choice, requested) << std::endl;
  }

  LaunchOptions lo;
  lo.devices = options_.devices;
  lo.num_nodes = options_.num_nodes;
  lo.backend = backend;
  launch_ = launch(lo);  // devices > 1: from here on this code runs in every rank
  {
    // This rank's device: cuda:(local_rank % visible devices), or the CPU.
    const detail::DeviceChoice d = detail::choose_device(
        options_.accelerator, launch_.local_rank, std::max(launch_.local_world_size, 1), backend,
        detail::DeviceFacts{detail::cuda_built(), detail::cuda_device_count()});
    if (d.cuda) {
      detail::set_cuda_device(d.index);
      device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.index));
      if (launch_.rank == 0 && !d.notice.empty()) std::cerr << "[fsdp] " << d.notice << std::endl;
    }
  }
  if (launch_.rank == 0 && !device_.is_cuda()) {  // a warning about the CPU's fp16 kernels
    if (auto warning = precision_performance_warning(parse_precision(options_.precision))) {
      std::cerr << *warning << std::endl;
    }
  }
  install_tracking_allocator();
  // No budget given: this rank's share of the memory available now (see memory.h).
  if (!settings->memory_budget && memory_budget() == 0) {
    set_memory_budget(default_memory_budget(launch_.local_world_size));
  }
  settings_ = std::move(settings);
  world_ = world_group();
  if (!world_) {
    ProcessGroupOptions pgo;
    pgo.backend = backend;
    world_ = init_process_group(pgo);
  }
  TORCH_CHECK(world_->size() == launch_.world_size, "[Trainer] the world process group has ",
              world_->size(), " ranks but this run asks for ", launch_.world_size,
              " (devices x num_nodes); one process can hold one world: create one Trainer per "
              "program, or Trainers with the same devices/num_nodes");

  if (options_.strategy.object()) {
    strategy_ = options_.strategy.object();
  } else {
    std::string name = options_.strategy.name();
    if (name == "auto") name = world_->size() > 1 ? "ddp" : "single";
    strategy_ = make_strategy(name);
  }
  // A strategy's own configuration (a DeepSpeed JSON config) may fix precision, clipping,
  // accumulation: applied, then checked like the user's options.
  strategy_->configure_trainer(options_);
  check_options(options_);
  strategy_->connect(world_, launch_);
  strategy_->set_device(device_);
}

Trainer::~Trainer() = default;

void Trainer::print(const std::string& text) const {
  if (!is_global_zero()) return;
  std::cout << text << (text.empty() || text.back() != '\n' ? "\n" : "") << std::flush;
}

void Trainer::setup_model(LightningModule& module) {
  module.attach_trainer(this);
  if (configured_module_ == &module) return;
  if (options_.seed >= 0) {
    seed_ = static_cast<uint64_t>(options_.seed);
    seed_everything(*seed_);
  }
  // Precision (fsdp/precision.h), before configure_model (which may already shard): a strategy
  // may carry it out itself (FSDP: bf16-mixed / 16-mixed is its MixedPrecisionPolicy);
  // otherwise bf16-mixed / 16-mixed run the steps under CPU autocast, and bf16-true / 16-true /
  // 64-true build the model in that dtype.
  const Precision precision = parse_precision(options_.precision);
  cpu_autocast_ = strategy_->connect_precision(precision) ? std::optional<at::ScalarType>()
                                                          : autocast_dtype(precision);
  const std::optional<at::ScalarType> true_dtype = true_precision_dtype(precision);
  {
    DefaultDtypeGuard default_dtype(true_dtype);
    // Resuming (fit with ckpt_path): the checkpoint overwrites every parameter and restores the
    // RNG state, so random init is skipped (Lightning's init_module(empty_init=True)).
    // See Note [Empty init] in fsdp/init.h.
    auto empty_init = fsdp::init_module(!resume_path_.empty());
    configure_model_with(*strategy_, module);
  }
  if (true_dtype) {  // parameters created with an explicit dtype: cast before sharding
    at::NoGradGuard no_grad;
    for (auto& t : module.parameters()) {
      if (t.is_floating_point() && t.scalar_type() != *true_dtype) t.set_data(t.to(*true_dtype));
    }
    for (auto& t : module.buffers()) {
      if (t.is_floating_point() && t.scalar_type() != *true_dtype) t.set_data(t.to(*true_dtype));
    }
  }
  if (device_.is_cuda()) move_to_device(module, device_, launch_.local_world_size);
  strategy_->setup_module(module);
  // Full shapes (FSDP's deferred init shards units inside configure_model already).
  std::tie(results_.params, results_.trainable_params) = strategy_->parameter_counts(module);
  configured_module_ = &module;
}

Batch Trainer::on_device(const Batch& batch) const {
  if (!device_.is_cuda()) return batch;
  Batch b = batch;
  if (b.input.defined()) b.input = b.input.to(device_);
  if (b.target.defined()) b.target = b.target.to(device_);
  return b;
}

std::unique_ptr<EmptyInitGuard> Trainer::init_module(bool empty_init) const {
  return fsdp::init_module(empty_init);
}

void Trainer::fit(LightningModule& module, DataLoader& train_loader) {
  fit_impl(module, train_loader, nullptr);
}

void Trainer::fit(LightningModule& module, DataLoader& train_loader, DataLoader& val_loader) {
  fit_impl(module, train_loader, &val_loader);
}

// One fit's loop state: what the step's parts below share.
struct Trainer::FitLoop {
  LightningModule& module;
  DataLoader& train_loader;
  DataLoader* val_loader;
  OptimizerConfig opt;
  // Shape of the run.
  int64_t accumulate = 1;         // micro-batches per optimizer step (k)
  int64_t batches_per_epoch = 0;  // after limit_train_batches
  int64_t max_epochs = -1;        // -1: unlimited
  int64_t total_steps = -1;       // optimizer steps to take (-1: unlimited)
  int64_t val_every = 0;          // validate after every val_every training batches (0: epoch end)
  bool run_val = false;
  // Where the loop starts (after a resume) and what it measured.
  int64_t start_epoch = 0;
  int64_t start_batch = 0;
  int64_t start_step = 0;
  int64_t setup_peak_alloc = 0;
  int64_t setup_peak_rss = 0;
  Clock::time_point loop_start;
  Clock::time_point first_step_done;
  // Reporting.
  std::vector<LoggerPtr> loggers;  // global rank 0 only
  std::unique_ptr<detail::ProgressBar> bar;
  detail::MetricTracker metrics;

  FitLoop(LightningModule& m, DataLoader& train, DataLoader* val, OptimizerConfig o,
          Strategy& strategy)
      : module(m), train_loader(train), val_loader(val), opt(std::move(o)), metrics(strategy) {}
  // Also when fit ends with an error: what was logged is on disk.
  ~FitLoop() {
    for (const auto& l : loggers) {
      try {
        l->finalize();
      } catch (const std::exception&) {
      }
    }
  }
  FitLoop(const FitLoop&) = delete;
  FitLoop& operator=(const FitLoop&) = delete;

  void log_row(const std::map<std::string, double>& row, int64_t step, int64_t epoch) {
    if (row.empty()) return;
    for (const auto& l : loggers) l->log_metrics(row, step, epoch);
  }
  double loss_sum = 0;  // this rank's undivided training losses since the last step
  // This step's parts so far (FitResults::forward_seconds ...) and the comm-thread clock at the
  // end of the last step.
  double step_forward = 0;
  double step_backward = 0;
  double step_optimizer = 0;
  double comm_mark = 0;
  double disk_mark = 0;
  int64_t loss_count = 0;
  double last_loss = NAN;  // the last step's loss, mean over ranks
  bool stop = false;
  // What the loop is doing, for an out-of-memory sentence (Note [Out of memory during fit]).
  std::string phase = "the first step";

  // The progress bar after a step (global rank 0 only). One loss column: the Trainer's loss
  // (the mean over ranks) unless the module puts its own training metrics on the bar, as
  // Lightning shows only what the module logs with prog_bar (a metric logged without sync_dist
  // at world > 1 is labelled as rank 0's by MetricTracker::progress_bar_values).
  void draw_progress(int64_t step, int64_t epoch) {
    if (!bar) return;
    const double shown = metrics.has_training_progress_bar_metric() ? NAN : last_loss;
    bar->update(step, epoch, shown, metrics.progress_bar_values());
  }
};

// The fit loop, as torchtitan's train -> train_step -> forward_backward_step: setup, then per
// epoch and micro-batch train_micro_batch, at a boundary optimizer_step and report_step, then
// validate when due; finish_fit gathers the results.
void Trainer::fit_impl(LightningModule& module, DataLoader& train_loader,
                       DataLoader* val_loader) {
  // A CUDA out-of-memory anywhere in fit becomes one sentence: Note [Out of memory during fit].
  std::unique_ptr<FitLoop> loop;
  try {
    loop = setup_fit(module, train_loader, val_loader);
    FitLoop& L = *loop;
    const int64_t k = L.accumulate;

    module.train();
    module.on_fit_start();
    module.on_train_start();
    for (const auto& cb : fit_callbacks_) cb->on_fit_start(*this, module);

    L.loop_start = Clock::now();
    L.comm_mark = comm_busy_seconds();
    L.disk_mark = disk_wait_seconds();
    L.stop = L.total_steps >= 0 && global_step_ >= L.total_steps;
    L.phase = "the first step";
    for (int64_t epoch = L.start_epoch; !L.stop && (L.max_epochs < 0 || epoch < L.max_epochs);
         ++epoch) {
      current_epoch_ = epoch;
      results_.epochs = epoch + 1;
      train_loader.set_epoch(epoch);
      module.on_train_epoch_start();
      L.metrics.start_epoch();
      L.loss_sum = 0;
      L.loss_count = 0;

      for (int64_t batch_idx = epoch == L.start_epoch ? L.start_batch : 0;
           batch_idx < L.batches_per_epoch; ++batch_idx) {
        const bool last_batch = batch_idx + 1 == L.batches_per_epoch;
        const bool boundary = (batch_idx + 1) % k == 0 || last_batch;
        train_micro_batch(L, on_device(train_loader.batch(batch_idx)), batch_idx, boundary);
        if (boundary) {
          optimizer_step(L);
          report_step(L);
          next_epoch_ = last_batch ? epoch + 1 : epoch;
          next_batch_ = last_batch ? 0 : batch_idx + 1;
        }
        for (const auto& cb : fit_callbacks_) cb->on_train_batch_end(*this, module, batch_idx);
        if (L.run_val && ((L.val_every > 0 && (batch_idx + 1) % L.val_every == 0) ||
                          (L.val_every == 0 && last_batch))) {
          validate_during_fit(L);
        }
        // After this step's validation, so its line shows this step's val metrics.
        if (boundary) L.draw_progress(global_step_, current_epoch_);
        if (L.stop) break;
      }

      auto epoch_values = L.metrics.finish_epoch();
      L.log_row(epoch_values, global_step_, epoch);
      for (const auto& kv : epoch_values) results_.metrics[kv.first] = kv.second;
      for (const auto& kv : epoch_values) callback_metrics_[kv.first] = kv.second;
      for (const auto& cb : fit_callbacks_) cb->on_train_epoch_end(*this, module);
      module.on_train_epoch_end();
    }
    module.on_train_end();
    for (const auto& cb : fit_callbacks_) cb->on_train_end(*this, module);
    if (L.bar) L.bar->finish();
    finish_fit(L);
  } catch (const c10::OutOfMemoryError& e) {
    throw_out_of_memory(e, loop ? loop->phase
                                : "setup (configure_model, the strategy's setup, the optimizer)",
                        launch_.rank, device_, options_, strategy_.get(), module);
  }
}

// Model (configure_model + the strategy's setup), optimizer, loaders, callbacks, resume, and
// the shape of the run.
std::unique_ptr<Trainer::FitLoop> Trainer::setup_fit(LightningModule& module,
                                                     DataLoader& train_loader,
                                                     DataLoader* val_loader) {
  const TrainerOptions& o = options_;
  results_ = FitResults{};
  global_step_ = 0;
  current_epoch_ = 0;
  // Parameters, shards and everything else setup allocates (Note [Memory categories]).
  MemoryCategoryGuard setup_category(MemoryCategory::kParameters);

  setup_model(module);
  OptimizerConfig opt = module.configure_optimizers();
  strategy_->configure_optimizers(module, opt);
  TORCH_CHECK(opt.optimizer, "[Trainer.fit] configure_optimizers() returned no optimizer; "
              "return {std::make_shared<torch::optim::Adam>(parameters(), ...)}");
  const Precision precision = parse_precision(o.precision);
  check_optimizer_precision(*opt.optimizer, precision);
  if (device_.is_cuda()) check_optimizer_on_cuda(*opt.optimizer);
  strategy_->setup_optimizer(*opt.optimizer);
  // 16-mixed: dynamic loss scaling over the world (found-inf agreed by every rank), resumed
  // from the checkpoint below.
  grad_scaler_.reset();
  if (uses_grad_scaler(precision)) grad_scaler_ = std::make_unique<ShardedGradScaler>(world_);

  distribute(train_loader, world_size(), global_rank());
  if (val_loader) distribute(*val_loader, world_size(), global_rank());

  // Checkpoints (src/ckpt/trainer_checkpoint.cpp): resume sets global_step_ and the position.
  fit_module_ = &module;
  fit_opt_ = opt;
  next_epoch_ = 0;
  next_batch_ = 0;
  callback_metrics_.clear();
  setup_callbacks();  // options_.callbacks + the checkpoint_dir sugar (trainer_checkpoint.cpp)
  if (!resume_path_.empty()) resume_from_checkpoint();  // also restores callback states

  auto loop = std::make_unique<FitLoop>(module, train_loader, val_loader, opt, *strategy_);
  FitLoop& L = *loop;
  // Setup is done: remember its peaks and measure training on its own (see FitResults).
  L.setup_peak_alloc = memory_stats().peak_bytes;
  L.setup_peak_rss = peak_rss_bytes();
  reset_peak_memory_stats();
  reset_peak_rss();
  if (device_.is_cuda()) detail::reset_device_peak(device_.index());
  L.start_epoch = next_epoch_;
  current_epoch_ = next_epoch_;  // on_fit_start sees the resumed epoch, as in Lightning
  L.start_batch = next_batch_;
  L.start_step = global_step_;  // > 0 when resumed

  L.accumulate = o.accumulate_grad_batches;
  L.batches_per_epoch = limited_batches(train_loader.num_batches(), o.limit_train_batches);
  // Lightning steps at the last batch of an epoch even when fewer than k were accumulated.
  const int64_t steps_per_epoch = (L.batches_per_epoch + L.accumulate - 1) / L.accumulate;
  L.max_epochs = (o.max_epochs < 0 && o.max_steps < 0) ? 1000 : o.max_epochs;
  if (o.max_steps >= 0) L.total_steps = o.max_steps;
  if (L.max_epochs >= 0) {
    const int64_t by_epochs = L.max_epochs * steps_per_epoch;
    L.total_steps = L.total_steps < 0 ? by_epochs : std::min(L.total_steps, by_epochs);
  }
  TORCH_CHECK(L.batches_per_epoch > 0 || L.total_steps == 0,
              "[Trainer.fit] the training loader yields no batches on rank ", global_rank(),
              " (num_batches ", train_loader.num_batches(), ", limit_train_batches ",
              o.limit_train_batches, "); give the dataset more samples or a smaller batch size");
  if (o.val_check_interval >= 1) {
    L.val_every = static_cast<int64_t>(o.val_check_interval);
  } else if (o.val_check_interval > 0) {
    L.val_every = std::max<int64_t>(
        1, static_cast<int64_t>(L.batches_per_epoch * o.val_check_interval));
  }
  L.run_val = val_loader != nullptr && o.limit_val_batches != 0;

  if (is_global_zero() && o.logger) {
    if (o.loggers.empty()) {
      // The defaults share one version_N: the CSV logger picks it, TensorBoard's joins it.
      auto csv = std::make_shared<CSVLogger>(o.default_root_dir);
      csv->setup();
      const std::string version = std::filesystem::path(csv->log_dir()).filename().string();
      L.loggers = {csv, std::make_shared<TensorBoardLogger>(
                            o.default_root_dir, std::stoll(version.substr(8)))};
    } else {
      L.loggers = o.loggers;
    }
    for (const auto& l : L.loggers) {
      TORCH_CHECK(l, "[Trainer] TrainerOptions::loggers holds a null logger");
      l->setup();
    }
    results_.log_dir = L.loggers.front()->log_dir();
  }
  if (is_global_zero() && o.enable_progress_bar) {
    L.bar = std::make_unique<detail::ProgressBar>(
        std::cout, detail::ProgressBar::stdout_is_terminal(settings_->stdout_is_terminal),
        L.total_steps, o.log_every_n_steps);
  }
  return loop;
}

// One micro-batch, in the strategy's call order (fsdp/strategy.h): forward under the
// strategy's hooks, backward, gradient reduction (none on a non-boundary micro-batch).
void Trainer::train_micro_batch(FitLoop& L, const Batch& batch, int64_t batch_idx,
                                bool boundary) {
  const int64_t k = L.accumulate;
  const auto forward_start = Clock::now();
  L.phase = "the forward of step " + std::to_string(global_step_ + 1);
  {
    MemoryCategoryGuard category(MemoryCategory::kActivations);
    strategy_->pre_forward(L.module, /*sync=*/boundary);
  }
  L.module.logged().clear();
  at::Tensor loss;
  {
    MemoryCategoryGuard category(MemoryCategory::kActivations);  // Note [Memory categories]
    AutocastGuard autocast(device_.type(), cpu_autocast_);
    loss = L.module.training_step(batch, batch_idx);
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "[Trainer.fit] training_step must return the scalar loss (got ",
              loss.defined() ? "a tensor of shape " + c10::str(loss.sizes())
                             : std::string("an undefined tensor"),
              ") at epoch ", current_epoch_, " batch ", batch_idx);
  TORCH_CHECK(loss.requires_grad(), "[Trainer.fit] the loss returned by training_step at "
              "batch ", batch_idx, " does not require grad: it is not connected to any "
              "trainable parameter (was it computed under NoGradGuard or detached?)");
  at::Tensor to_backward = k > 1 ? loss / static_cast<double>(k) : loss;
  if (grad_scaler_) to_backward = grad_scaler_->scale(to_backward);
  const auto backward_start = Clock::now();
  L.step_forward += seconds_between(forward_start, backward_start);
  L.phase = "the backward of step " + std::to_string(global_step_ + 1);
  {
    MemoryCategoryGuard category(MemoryCategory::kBackward);
    strategy_->backward(to_backward);
    strategy_->post_backward(L.module, /*sync=*/boundary);
  }
  L.step_backward += seconds_since(backward_start);
  L.loss_sum += loss.detach().item<double>();
  ++L.loss_count;
  ++results_.micro_batches;
  L.metrics.collect_training(L.module.logged());
}

// One optimizer step: clip, step on the (sharded) parameters, free the gradients, schedule.
// 16-mixed: hooks and clipping see unscaled gradients, and the step is skipped on every rank
// when any rank's gradients hold inf/nan (Lightning's MixedPrecision plugin, in this order).
void Trainer::optimizer_step(FitLoop& L) {
  const auto start = Clock::now();
  L.phase = "the optimizer step of step " + std::to_string(global_step_ + 1);
  MemoryCategoryGuard category(MemoryCategory::kOptimizer);
  if (grad_scaler_) grad_scaler_->unscale(*L.opt.optimizer);
  L.module.on_before_optimizer_step(*L.opt.optimizer);
  if (options_.gradient_clip_val > 0) {
    results_.grad_norms.push_back(strategy_->clip_grad_norm(L.module, options_.gradient_clip_val));
  }
  if (grad_scaler_) {
    grad_scaler_->step(*L.opt.optimizer, [&] { strategy_->optimizer_step(*L.opt.optimizer); });
    grad_scaler_->update();
    results_.skipped_steps = grad_scaler_->skipped_steps();
  } else {
    strategy_->optimizer_step(*L.opt.optimizer);
  }
  strategy_->zero_grad(*L.opt.optimizer);
  if (L.opt.scheduler) L.opt.scheduler->step();
  L.step_optimizer = seconds_since(start);
  ++global_step_;
  if (global_step_ == L.start_step + 1) L.first_step_done = Clock::now();
  if (L.total_steps >= 0 && global_step_ >= L.total_steps) L.stop = true;
}

// After an optimizer step: the global mean loss and sync_dist step metrics (the only per-step
// collective), the progress bar and the CSV row.
void Trainer::report_step(FitLoop& L) {
  const bool log_now = global_step_ % options_.log_every_n_steps == 0;
  const double global_loss = L.metrics.finish_step(L.loss_sum / L.loss_count);
  L.loss_sum = 0;
  L.loss_count = 0;
  results_.losses.push_back(global_loss);
  results_.step_end_seconds.push_back(seconds_since(L.loop_start));
  const double comm_now = comm_busy_seconds();
  results_.forward_seconds.push_back(L.step_forward);
  results_.backward_seconds.push_back(L.step_backward);
  results_.optimizer_seconds.push_back(L.step_optimizer);
  results_.comm_seconds.push_back(comm_now - L.comm_mark);
  L.comm_mark = comm_now;
  const double disk_now = disk_wait_seconds();
  results_.disk_wait_seconds.push_back(disk_now - L.disk_mark);
  L.disk_mark = disk_now;
  L.step_forward = L.step_backward = L.step_optimizer = 0;
  for (const auto& kv : L.metrics.step_values()) callback_metrics_[kv.first] = kv.second;
  results_.steps = global_step_;
  L.last_loss = global_loss;
  if (log_now) L.log_row(L.metrics.step_values(), global_step_, current_epoch_);
}

// Validation inside fit (val_check_interval, or the end of an epoch).
void Trainer::validate_during_fit(FitLoop& L) {
  L.phase = "validation after step " + std::to_string(global_step_);
  auto val = evaluate(L.module, *L.val_loader, "val");
  L.module.on_validation_epoch_end();
  L.module.train();
  L.log_row(val, global_step_, current_epoch_);
  for (const auto& kv : val) results_.metrics[kv.first] = kv.second;
  for (const auto& kv : val) callback_metrics_[kv.first] = kv.second;
  L.metrics.set_progress_bar_extra(val);
  for (const auto& cb : fit_callbacks_) cb->on_validation_end(*this, L.module);
}

// Speed, per-rank memory (collective on every rank) and the end-of-run summary.
void Trainer::finish_fit(FitLoop& L) {
  results_.seconds = seconds_since(L.loop_start);
  const int64_t steps = global_step_ - L.start_step;
  if (steps > 1) {
    results_.it_per_s = (steps - 1) / std::max(1e-9, seconds_since(L.first_step_done));
  } else if (steps == 1) {
    results_.it_per_s = 1.0 / std::max(1e-9, results_.seconds);
  }
  for (const auto& kv : L.metrics.last_values()) {
    if (!results_.metrics.count(kv.first)) results_.metrics[kv.first] = kv.second;
  }

  // The training peak's breakdown by category, per rank (read before gathering allocates).
  const MemoryStats stats = memory_stats();
  RankMemory mem = gather_memory(*world_);
  results_.peak_alloc_bytes = mem.peak_bytes;
  {
    const std::vector<int64_t> all = all_gather_values(
        *world_, std::vector<int64_t>(stats.peak_by_category.begin(),
                                      stats.peak_by_category.begin() + kNumMemoryCategories));
    for (int r = 0; r < world_size(); ++r) {
      std::array<int64_t, kNumMemoryCategories> bytes{};
      for (int c = 0; c < kNumMemoryCategories; ++c) bytes[c] = all[r * kNumMemoryCategories + c];
      results_.peak_breakdown_bytes.push_back(by_category_map(bytes));
    }
  }
  results_.peak_rss_bytes = mem.peak_rss_bytes;
  results_.device_peak_bytes = mem.device_peak_bytes;
  results_.device_peak_reserved_bytes = mem.device_peak_reserved_bytes;
  if (!device_.is_cuda()) {
    // A run on the CPU has no device peak (null in --summary-json), even in a CUDA build on a
    // machine with a GPU, where the current device's allocator would answer 0.
    std::fill(results_.device_peak_bytes.begin(), results_.device_peak_bytes.end(), -1);
    std::fill(results_.device_peak_reserved_bytes.begin(),
              results_.device_peak_reserved_bytes.end(), -1);
  }
  {
    const std::vector<int64_t> all =
        all_gather_values(*world_, {L.setup_peak_alloc, L.setup_peak_rss});
    for (int r = 0; r < world_size(); ++r) {
      results_.setup_peak_alloc_bytes.push_back(all[2 * r]);
      results_.setup_peak_rss_bytes.push_back(all[2 * r + 1]);
    }
  }
  if (!options_.enable_summary) return;
  std::string table = memory_summary(*world_);
  if (!is_global_zero()) return;
  std::ostringstream os;
  // Counted from where this fit started: a resumed run reports its own steps.
  const int64_t warm_up = L.start_step + 1;
  os << std::fixed << std::setprecision(2) << "[fsdp] fit done: " << steps << " steps";
  if (L.start_step > 0) {
    os << " (" << warm_up << ".." << global_step_ << ", resumed after step " << L.start_step << ")";
  }
  os << ", " << results_.epochs << " epoch(s), " << results_.seconds << " s; "
     << results_.it_per_s << " it/s ("
     << (steps > 1 ? "steps " + std::to_string(warm_up + 1) + ".." + std::to_string(global_step_) +
                         "; step " + std::to_string(warm_up) + " is warm-up and excluded"
                   : std::string("one step, warm-up included"))
     << "); strategy " << strategy_->name() << ", world " << world_size() << ", "
     << results_.params << " parameters";
  if (!results_.losses.empty()) {
    os << std::setprecision(4) << ", final loss " << results_.losses.back();
  }
  if (!results_.metrics.empty()) {
    os << "\n[fsdp] last logged metrics:";
    for (const auto& [name, value] : results_.metrics) os << " " << name << " " << value;
  }
  os << "\n" << table;
  print(os.str());
}

std::map<std::string, double> Trainer::validate(LightningModule& module, DataLoader& loader) {
  setup_model(module);
  distribute(loader, world_size(), global_rank());
  auto out = evaluate(module, loader, "val");
  module.on_validation_epoch_end();
  return out;
}

std::map<std::string, double> Trainer::test(LightningModule& module, DataLoader& loader) {
  setup_model(module);
  distribute(loader, world_size(), global_rank());
  return evaluate(module, loader, "test");
}

std::map<std::string, double> Trainer::evaluate(LightningModule& module, DataLoader& loader,
                                                const std::string& stage) {
  const bool was_training = module.is_training();
  module.eval();
  torch::NoGradGuard no_grad;
  const int64_t n = stage == "val" ? limited_batches(loader.num_batches(), options_.limit_val_batches)
                                   : loader.num_batches();
  detail::MetricTracker metrics(*strategy_);
  metrics.start_epoch();
  for (int64_t i = 0; i < n; ++i) {
    const Batch batch = on_device(loader.batch(i));
    strategy_->pre_forward(module, /*sync=*/false);
    module.logged().clear();
    AutocastGuard autocast(device_.type(), cpu_autocast_);
    if (stage == "val") {
      module.validation_step(batch, i);
    } else {
      module.test_step(batch, i);
    }
    strategy_->post_eval_step(module);
    metrics.collect_eval(module.logged());
  }
  auto out = metrics.finish_epoch();
  if (was_training) module.train();
  return out;
}

std::vector<at::Tensor> Trainer::predict(LightningModule& module, DataLoader& loader) {
  setup_model(module);
  distribute(loader, world_size(), global_rank());
  const bool was_training = module.is_training();
  module.eval();
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> outputs;
  for (int64_t i = 0; i < loader.num_batches(); ++i) {
    const Batch batch = on_device(loader.batch(i));
    strategy_->pre_forward(module, /*sync=*/false);
    at::Tensor out;
    {
      AutocastGuard autocast(device_.type(), cpu_autocast_);
      out = module.predict_step(batch, i);
    }
    strategy_->post_eval_step(module);
    outputs.push_back(out.defined() ? out.detach() : out);
  }
  if (was_training) module.train();
  return outputs;
}

}  // namespace fsdp
