// The flags fsdp-train and fsdp-finetune share; see apps/support/flags.h.
#include "flags.h"

#include "../cli.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace fsdp::app {
namespace {

using fsdp::cli::at_least;
using fsdp::cli::between;
using fsdp::cli::greater_than;
using fsdp::cli::one_of;

// A CLI11 transform that parses a flag's value with one of the library's parsers (the one
// place each name is parsed) into the enum the option holds; the parser's error (which lists
// the valid names) becomes the flag error. `only`: the spellings this program accepts (empty:
// every spelling the parser knows).
template <typename Enum>
CLI::Validator parsed_by(Enum (*parse)(const std::string&), const std::string& name,
                         std::vector<std::string> only = {}) {
  return CLI::Validator(
      [parse, only](std::string& value) -> std::string {
        if (!only.empty() && std::find(only.begin(), only.end(), value) == only.end()) {
          std::string valid;
          for (const auto& o : only) valid += (valid.empty() ? "" : ", ") + o;
          return "'" + value + "' is not one of: " + valid;
        }
        try {
          value = std::to_string(static_cast<int>(parse(value)));
          return {};
        } catch (const c10::Error& e) {
          return e.what_without_backtrace();
        }
      },
      name, fsdp::cli::kCheckPrefix + name);
}

// An element count kept as a double (users write 1e8): a whole number in [min, 2^53], the
// range DeepSpeedOptions accepts (src/common/limits.h), so that the conversion to an integer
// count is exact (1.2e19 would wrap to a negative size per rank).
CLI::Validator elements(double min) {
  constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        double v = 0;
        if (std::string why = fsdp::cli::detail::parse_as<double>(text, v); !why.empty()) {
          return why;
        }
        if (v != std::floor(v)) return "'" + text + "' is not a whole number of elements";
        if (v < min || v > kMaxExactInteger) {
          return "must be between " + fsdp::cli::detail::show(min) + " and 2^53 (" +
                 std::to_string(static_cast<int64_t>(kMaxExactInteger)) + ") elements";
        }
        return {};
      },
      "", std::string(fsdp::cli::kCheckPrefix) + "elements");
}

// --deepspeed-config: the JSON object itself, or an existing file (parsed after the command
// line, by parse_deepspeed_config).
CLI::Validator deepspeed_config_text() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const size_t first = text.find_first_not_of(" \t\r\n");
        if (first != std::string::npos && text[first] == '{') {
          return fsdp::cli::detail::text_problem(text);
        }
        std::string path = text;
        return fsdp::cli::input_file()(path);
      },
      "", std::string(fsdp::cli::kCheckPrefix) + "input_file");
}

std::vector<std::string> with_none(std::vector<std::string> names) {
  names.insert(names.begin(), "none");
  return names;
}

// The help's heading for a family's flags: "FSDP (--strategy fsdp, ... or
// fsdp_hybrid_shard_zero2)".
std::string group_of(StrategyFamily family) {
  const char* title = "";
  switch (family) {
    case StrategyFamily::kSingle: title = "Single process"; break;
    case StrategyFamily::kDDP: title = "DDP"; break;
    case StrategyFamily::kFSDP: title = "FSDP"; break;
    case StrategyFamily::kDeepSpeed: title = "DeepSpeed ZeRO"; break;
  }
  return std::string(title) + " (" + strategy_flag_for(family) + ")";
}

}  // namespace

std::string strategy_flag_for(StrategyFamily family) {
  return strategy_flag_for(std::vector<StrategyFamily>{family});
}

std::string strategy_flag_for(const std::vector<StrategyFamily>& families) {
  std::vector<std::string> names;
  for (StrategyFamily family : families) {
    for (std::string& name : strategy_names(family)) names.push_back(std::move(name));
  }
  std::string out = "--strategy ";
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  return out;
}

CommonFlags::CommonFlags(CLI::App& app, CommonArgs& a, CommonFlagsSpec spec)
    : a_(a), spec_(std::move(spec)) {
  TrainerOptions& t = a_.trainer;
  std::vector<std::string> names = {"auto"};
  std::ostringstream list;  // the help's list of strategies, from the registry
  list << "\nStrategies (--strategy):\n  " << std::left;
  list.width(32);
  list << "auto" << "single for one rank, ddp for more"
       << (spec_.family_flags && offers(StrategyFamily::kDeepSpeed)
               ? " (deepspeed with --deepspeed-config)\n"
               : "\n");
  for (const StrategyEntry& e : strategy_entries()) {
    if (!offers(e.family)) continue;
    names.push_back(e.name);
    list << "  ";
    list.width(32);
    list << e.name << e.help << "\n";
  }
  app.footer(list.str());

  const std::string trainer = "Trainer";
  app.add_option("--devices", t.devices, "ranks (processes) per node")
      ->check(at_least(1))
      ->group(trainer);
  app.add_option("--strategy", a_.strategy,
                 "auto = single for one rank, ddp for more; every name is listed below")
      ->check(one_of(names))
      ->group(trainer);
  app.add_option("--backend", t.process_group_backend,
                 "process group backend; auto: on CUDA devices nccl (one rank per GPU) or gloo "
                 "(ranks sharing a GPU); on the CPU mpi on one host when built and mpirun is on "
                 "PATH, or under mpirun; else gloo (env FSDP_BACKEND when auto). nccl: a CUDA "
                 "build, --accelerator cuda")
      ->check(one_of({"auto", "gloo", "mpi", "nccl"}))
      ->group(trainer);
  app.add_option("--precision", t.precision, spec_.precision_help)
      ->check(one_of(spec_.precisions))
      ->group(trainer);
  app.add_option("--seed", t.seed, "seed for the model init, data and sampler (same on every rank)")
      ->check(at_least(int64_t{0}))
      ->group(trainer);
  app.add_flag_callback("--no-progress-bar", [&t] { t.enable_progress_bar = false; },
                        "disable the progress bar")
      ->group(trainer);
  app.add_flag("--dry-run", a_.dry_run, spec_.dry_run_help)->group("Output");
  app.add_option("--summary-json", a_.summary_json, spec_.summary_json_help)
      ->check(fsdp::cli::output_file())
      ->group("Output");

  if (!spec_.family_flags) return;
  if (offers(StrategyFamily::kFSDP)) add_fsdp_flags(app);
  if (offers(StrategyFamily::kDDP)) add_ddp_flags(app);
  if (offers(StrategyFamily::kDeepSpeed)) add_deepspeed_flags(app);
  if (offers(StrategyFamily::kFSDP) || offers(StrategyFamily::kDeepSpeed)) add_offload_flags(app);
}

void CommonFlags::add_family(std::vector<StrategyFamily> families,
                             std::vector<CLI::Option*> options, const std::string& title) {
  families.erase(std::remove_if(families.begin(), families.end(),
                                [this](StrategyFamily f) { return !offers(f); }),
                 families.end());
  const std::string heading = families.size() == 1 ? group_of(families.front()) : title;
  for (CLI::Option* o : options) o->group(heading);
  family_flags_.push_back({std::move(families), std::move(options)});
}

bool CommonFlags::offers(StrategyFamily family) const {
  return std::find(spec_.families.begin(), spec_.families.end(), family) != spec_.families.end();
}

void CommonFlags::add_fsdp_flags(CLI::App& app) {
  FSDPOptions& f = a_.options.fsdp;
  add_family({StrategyFamily::kFSDP}, {
      app.add_option("--sharding-strategy", f.sharding_strategy,
                     "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | "
                     "HYBRID_SHARD_ZERO2")
          ->transform(parsed_by(parse_sharding_strategy, "SHARDING_STRATEGY"))
          ->default_str(to_string(f.sharding_strategy)),
      app.add_option("--wrap-policy", a_.wrap_policy, "units: layers | size:N | none"),
      app.add_flag("--limit-all-gathers", f.limit_all_gathers, "at most two units unsharded"),
      app.add_option("--prefetch,--backward-prefetch", f.backward_prefetch,
                     "backward prefetch: pre | post | none")
          ->transform(parsed_by(parse_backward_prefetch, "PREFETCH", {"pre", "post", "none"}))
          ->default_str(to_string(f.backward_prefetch)),
      app.add_flag("--forward-prefetch", f.forward_prefetch,
                   "all-gather the next unit during forward"),
      app.add_option("--hybrid-shard-size", f.hybrid_shard_size,
                     "hybrid: ranks per shard group (0: one node)")
          ->check(at_least(0)),
  });
}

void CommonFlags::add_ddp_flags(CLI::App& app) {
  DDPOptions& d = a_.options.ddp;
  PowerSGDOptions& ps = a_.powersgd;
  PostLocalSGDOptions& pl = a_.post_local_sgd;
  add_family({StrategyFamily::kDDP}, {
      app.add_option("--bucket-cap-mb", d.bucket_cap_mb, "gradient bucket size in MB")
          ->check(greater_than(0.0)),
      app.add_flag("--find-unused-parameters", d.find_unused_parameters,
                   "allow trainable parameters without a gradient"),
      app.add_flag("--static-graph", d.static_graph,
                   "the same parameters every step; buckets rebuilt in gradient order"),
      app.add_flag("--gradient-as-bucket-view", d.gradient_as_bucket_view,
                   ".grad are views into the buckets (one gradient copy less)"),
      app.add_option("--ddp-comm-hook", a_.ddp_comm_hook,
                     "how gradient buckets are communicated: none (all-reduce) | allreduce | "
                     "fp16_compress | bf16_compress | powersgd | batched_powersgd | "
                     "post_local_sgd")
          ->check(one_of(with_none(comm_hook_names()))),
      app.add_option("--ddp-comm-wrapper", a_.ddp_comm_wrapper,
                     "cast what the hook sends: none | fp16 | bf16")
          ->check(one_of(with_none(comm_wrapper_names()))),
      app.add_option("--powersgd-rank", ps.matrix_approximation_rank,
                     "powersgd: matrix_approximation_rank")
          ->check(at_least(int64_t{1})),
      app.add_option("--start-powersgd-iter", ps.start_powersgd_iter,
                     "powersgd: plain all-reduce for this many steps first (> 1 with error "
                     "feedback or warm start)")
          ->check(at_least(int64_t{0})),
      app.add_option("--min-compression-rate", ps.min_compression_rate,
                     "powersgd: compress a matrix only when it shrinks by more than this")
          ->check(at_least(0.0)),
      app.add_flag_callback("--no-error-feedback", [&ps] { ps.use_error_feedback = false; },
                            "powersgd: use_error_feedback off"),
      app.add_flag_callback("--no-warm-start", [&ps] { ps.warm_start = false; },
                            "powersgd: a new random Q every step"),
      app.add_option("--orthogonalization-epsilon", ps.orthogonalization_epsilon,
                     "powersgd: added to column norms (e.g. 1e-8 if a gradient can be all "
                     "zero)")
          ->check(at_least(0.0)),
      app.add_option("--powersgd-seed", ps.random_seed, "powersgd: random_seed of Q"),
      app.add_flag("--batch-tensors-with-same-shape", ps.batch_tensors_with_same_shape,
                   "powersgd: compress same-shaped matrices in one batched matmul"),
      app.add_option("--start-local-sgd-iter", pl.start_local_sgd_iter,
                     "post_local_sgd: global all-reduce for this many steps, then local "
                     "(required with post_local_sgd)")
          ->check(at_least(int64_t{0})),
      app.add_option("--post-local-sgd-subgroup-size", pl.subgroup_size,
                     "post_local_sgd: ranks that still average gradients together (0: one "
                     "node)")
          ->check(at_least(0)),
      app.add_flag_callback("--no-post-local-gradient-allreduce",
                            [&pl] { pl.post_local_gradient_allreduce = false; },
                            "post_local_sgd: no gradient communication at all after the "
                            "start"),
      app.add_option("--model-averaging-period", d.model_averaging_period,
                     "post_local_sgd: average the parameters every N steps after the start "
                     "(required with post_local_sgd)")
          ->check(at_least(int64_t{0})),
  });
}

void CommonFlags::add_deepspeed_flags(CLI::App& app) {
  add_family({StrategyFamily::kDeepSpeed}, {
      app.add_option("--deepspeed-config", a_.deepspeed_config,
                     "DeepSpeed JSON config (with --strategy auto: deepspeed); replaces the "
                     "strategy's defaults; its bf16, gradient_clipping, "
                     "gradient_accumulation_steps, train_micro_batch_size_per_gpu, "
                     "optimizer and scheduler apply to the run")
          ->check(deepspeed_config_text()),
      app.add_option("--stage3-param-persistence-threshold", a_.persistence_threshold,
                     "stage 3: parameters of at most this many elements stay whole "
                     "(default 1e5); 0 shards every parameter and builds the model sharded "
                     "(deferred init: no rank holds the whole model)")
          ->check(at_least(int64_t{0})),
  });
}

// FSDP's offload_policy and DeepSpeed's offload_optimizer / offload_param take the same flags
// (include/fsdp/offload.h: one OffloadPolicy, the same disk tier).
void CommonFlags::add_offload_flags(CLI::App& app) {
  AioOptions& aio = a_.aio;
  add_family({StrategyFamily::kFSDP, StrategyFamily::kDeepSpeed}, {
      app.add_option("--offload-optimizer-device", a_.offload_optimizer_device,
                     "the optimizer state and its step: 'cpu' (host memory, where it already "
                     "is on this device) or 'nvme' (the disk tier: Adam's moments in swap "
                     "files under --nvme-path, streamed through the step)")
          ->check(one_of({"cpu", "nvme"})),
      app.add_option("--offload-params-device", a_.offload_params_device,
                     "FSDP, DeepSpeed stage 3: the parameter shards: 'cpu' (host memory, "
                     "where they already are on this device) or 'nvme' (each unit's shard in "
                     "a swap file under --nvme-path, read before its all-gather and streamed "
                     "through the step; needs --offload-optimizer-device nvme and 2+ devices)")
          ->check(one_of({"cpu", "nvme"})),
      app.add_option("--nvme-path", a_.nvme_path,
                     "the disk tier's directory (swap files go to NVME_PATH/<job>/rank<r>/, "
                     "removed on exit)")
          ->check(fsdp::cli::output_dir()),
      app.add_option("--params-buffer-count", a_.params_buffer_count,
                     "parameters on disk: buffers for reading units ahead and writing them "
                     "back (offload_param.buffer_count, default 5)")
          ->check(at_least(int64_t{1})),
      app.add_option("--params-buffer-size", a_.params_buffer_size,
                     "parameters on disk: elements per buffer; a unit's shard larger than "
                     "this is refused at setup (offload_param.buffer_size, default 1e8)")
          ->check(elements(1)),
      app.add_option("--max-in-cpu", a_.max_in_cpu,
                     "parameters on disk: elements of the first units' shards kept in RAM "
                     "(offload_param.max_in_cpu, default 1e9)")
          ->check(elements(0)),
      app.add_option("--sub-group-size", a_.sub_group_size,
                     "elements of optimizer state stepped (and, on disk, streamed) at a "
                     "time")
          ->check(elements(1)),
      app.add_option("--aio-block-size", aio.block_size, "disk tier: bytes per I/O request")
          ->check(at_least(int64_t{4096})),
      app.add_option("--aio-queue-depth", aio.queue_depth, "disk tier: I/O requests in flight")
          ->check(at_least(1)),
      app.add_option("--aio-intra-op-parallelism", aio.intra_op_parallelism,
                     "disk tier: I/O rings (threads) a transfer is spread over")
          ->check(at_least(1)),
  }, "Offload and the disk tier (FSDP and DeepSpeed strategies)");
}

std::string CommonFlags::strategy_name() const {
  if (a_.strategy == "auto" && !a_.deepspeed_config.empty()) return "deepspeed";
  return resolve_strategy_name(a_.strategy, a_.world());
}

StrategyFamily CommonFlags::family() const { return strategy_entry(strategy_name()).family; }

std::string CommonFlags::check() const {
  const StrategyFamily mine = family();
  for (const FamilyFlags& f : family_flags_) {
    auto has = [&f](StrategyFamily family) {
      return std::find(f.families.begin(), f.families.end(), family) != f.families.end();
    };
    if (has(mine)) continue;
    // See CommonFlags::check in flags.h: the dry run plans FSDP and the disk tier.
    if (a_.dry_run && !has(StrategyFamily::kDDP)) continue;
    for (CLI::Option* o : f.options) {
      if (o->count() == 0) continue;
      return o->get_name() + " applies to " + strategy_flag_for(f.families) + " (got --strategy " +
             a_.strategy + " with " + std::to_string(a_.world()) + " rank(s))";
    }
  }
  if (mine != StrategyFamily::kDDP) return {};
  const int64_t period = a_.options.ddp.model_averaging_period;
  if (a_.ddp_comm_hook == "post_local_sgd" &&
      (a_.post_local_sgd.start_local_sgd_iter < 0 || period == 0)) {
    return "--ddp-comm-hook post_local_sgd needs --start-local-sgd-iter N (global all-reduce for "
           "the first N steps; PyTorch has no default) and --model-averaging-period P (average "
           "the parameters every P steps after that)";
  }
  if (a_.ddp_comm_hook != "post_local_sgd" && period > 0) {
    return "--model-averaging-period applies to --ddp-comm-hook post_local_sgd (got "
           "--ddp-comm-hook " + a_.ddp_comm_hook + ")";
  }
  return {};
}

StrategyOptions CommonFlags::strategy_options(const nn::ModuleTypes& layer_types) const {
  StrategyOptions o = a_.options;
  o.fsdp.auto_wrap_policy = parse_wrap_policy(a_.wrap_policy, layer_types);
  set_comm_hook(o.ddp, a_.ddp_comm_hook, a_.ddp_comm_wrapper, a_.powersgd, a_.post_local_sgd);
  // FSDP: the offload flags are its offload_policy (the library checks it at setup).
  OffloadPolicy& policy = o.fsdp.offload_policy;
  if (!a_.offload_params_device.empty()) {
    policy.params = parse_offload_device(a_.offload_params_device);
  }
  if (!a_.offload_optimizer_device.empty()) {
    policy.optimizer = parse_offload_device(a_.offload_optimizer_device);
  }
  NvmeOffloadOptions& disk = policy.disk;
  disk.path = a_.nvme_path;
  disk.aio = a_.aio;
  if (a_.params_buffer_count > 0) disk.params_buffer_count = a_.params_buffer_count;
  if (a_.params_buffer_size > 0) disk.params_buffer_size = static_cast<int64_t>(a_.params_buffer_size);
  if (a_.max_in_cpu >= 0) disk.max_in_cpu = static_cast<int64_t>(a_.max_in_cpu);
  if (a_.sub_group_size > 0) disk.sub_group_size = static_cast<int64_t>(a_.sub_group_size);

  DeepSpeedOptions& d = o.deepspeed;
  d.config = a_.deepspeed_config;
  d.aio = a_.aio;
  if (!a_.offload_optimizer_device.empty()) {
    TORCH_CHECK(a_.deepspeed_config.empty(), "--offload-optimizer-device with --deepspeed-config: "
                "set zero_optimization.offload_optimizer in the config instead (a config "
                "replaces the strategy's options)");
    d.offload_optimizer = true;
    d.offload_optimizer_device = a_.offload_optimizer_device;
  }
  if (!a_.offload_params_device.empty()) {
    TORCH_CHECK(a_.deepspeed_config.empty(), "--offload-params-device with --deepspeed-config: "
                "set zero_optimization.offload_param in the config instead (a config replaces "
                "the strategy's options)");
    d.offload_parameters = true;
    d.offload_params_device = a_.offload_params_device;
  }
  if (a_.params_buffer_count > 0) d.params_buffer_count = a_.params_buffer_count;
  if (a_.params_buffer_size > 0) d.params_buffer_size = a_.params_buffer_size;
  if (a_.max_in_cpu >= 0) d.max_in_cpu = a_.max_in_cpu;
  if (a_.persistence_threshold >= 0) {
    d.stage3_param_persistence_threshold = a_.persistence_threshold;
  }
  if (!a_.nvme_path.empty()) d.nvme_path = a_.nvme_path;
  if (a_.sub_group_size > 0) d.sub_group_size = a_.sub_group_size;
  return o;
}

StrategyPtr CommonFlags::make_strategy(const StrategyOptions& options) const {
  return fsdp::make_strategy(strategy_name(), options);
}

void set_loggers(TrainerOptions& t, const std::string& choice) {
  if (choice == "none") {
    t.logger = false;
  } else if (choice == "csv") {
    t.loggers = {std::make_shared<CSVLogger>(t.default_root_dir)};
  } else if (choice == "tensorboard") {
    t.loggers = {std::make_shared<TensorBoardLogger>(t.default_root_dir)};
  } else {
    TORCH_CHECK(choice == "csv,tensorboard" || choice == "all", "[flags] unknown logger choice '",
                choice, "'");
  }
}

int run_or_fail(const std::function<int()>& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    fail_rank(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail_rank(e.what());
  }
}

std::optional<int64_t> CommonFlags::deepspeed_micro_batch_size() const {
  if (a_.deepspeed_config.empty()) return std::nullopt;
  DeepSpeedTrainingConfig training;
  parse_deepspeed_config(a_.deepspeed_config, &training);
  return training.train_micro_batch_size_per_gpu;
}

}  // namespace fsdp::app
