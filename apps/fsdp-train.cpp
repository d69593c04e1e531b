// fsdp-train: train a demo language model with any strategy, from the command line.
//
//   fsdp-train --model transformer-small --strategy ddp --devices 2 --max-steps 100
//   fsdp-train --model custom --nlayers 4 --ninp 256 --nhead 4 --nhid 1024 --data wikitext2 \
//              --data-dir ../shared/data/wikitext-2
//
// Every flag sets a TrainerOptions / FSDPOptions / DDPOptions (and its comm hook's PowerSGDOptions /
// PostLocalSGDOptions) / ModelCheckpointOptions field, or a model/data
// choice (`--help` lists them with their defaults). An unknown flag or a bad value prints one
// line and exits 2; an error during the run prints "[rank R] error: ..." once and exits 1 (all
// ranks stop).
#include <fsdp/checkpoint.h>
#include <fsdp/cpu_adam.h>
#include <fsdp/fsdp.h>

#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <limits>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"

namespace {

// Bytes this rank passed to collectives in each optimizer step, as counted by the process groups
// the strategy communicates on (Strategy::comm_bytes: DDP's gradient buckets and its comm hook's
// subgroups, the model averager, the Trainer's loss all-reduce). For --summary-json.
class CommBytesRecorder : public fsdp::Callback {
 public:
  void on_fit_start(fsdp::Trainer& t, fsdp::LightningModule&) override {
    last_ = t.strategy()->comm_bytes();
    last_step_ = t.global_step();
  }
  void on_train_batch_end(fsdp::Trainer& t, fsdp::LightningModule&, int64_t) override {
    if (t.global_step() == last_step_) return;  // inside an accumulation window
    const int64_t n = t.strategy()->comm_bytes();
    per_step_.push_back(n - last_);
    last_ = n;
    last_step_ = t.global_step();
  }
  const std::vector<int64_t>& per_step() const { return per_step_; }

 private:
  int64_t last_ = 0;
  int64_t last_step_ = 0;
  std::vector<int64_t> per_step_;
};

// --save-initial-weights FILE: the parameters training starts from (after DDP's broadcast from
// rank 0), FQN keys, safetensors, so that a Python peer can start from the same weights
// (bench/peers/ddp_hooks_peer.py --weights).
class InitialWeightsWriter : public fsdp::Callback {
 public:
  explicit InitialWeightsWriter(std::string path) : path_(std::move(path)) {}
  void on_fit_start(fsdp::Trainer& t, fsdp::LightningModule& module) override {
    if (!t.is_global_zero()) return;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value().detach());
    }
    fsdp::save_safetensors(path_, tensors);
  }

 private:
  std::string path_;
};

// The command line. Flags bind straight to the options they set: the library's TrainerOptions,
// FSDPOptions (with --strategy fsdp*) and ModelCheckpointOptions (with --checkpoint-dir); the
// rest are this program's own choices (model, data, optimizer, output).
struct Args {
  fsdp::TrainerOptions trainer;
  fsdp::FSDPOptions fsdp;
  fsdp::ModelCheckpointOptions checkpoint;
  // DDP (--strategy ddp, or auto with more than one rank): DDPOptions, and its comm hook by name
  // with the options of the built-in states (include/fsdp/comm_hooks.h).
  fsdp::DDPOptions ddp;
  std::string ddp_comm_hook = "none";
  std::string ddp_comm_wrapper = "none";
  fsdp::PowerSGDOptions powersgd;
  fsdp::PostLocalSGDOptions post_local_sgd;
  std::vector<CLI::Option*> ddp_flags;  // given with another strategy: an error
  std::string strategy = "auto";       // a registry name; fsdp* names get `fsdp` above
  std::string wrap_policy = "layers";  // FSDPOptions::auto_wrap_policy, from the model's layers
  bool activation_checkpointing = false;  // any strategy: the model's layer types
  // Model
  std::string model = "transformer-tiny";
  int64_t nlayers = 2, nhid = 200, ninp = 200, nhead = 2;
  int64_t vocab_size = 0;
  double dropout = 0.2;
  // Optimizer
  std::string optimizer = "adam";
  double lr = 1e-3;
  double weight_decay = 0;
  double adam_eps = 1e-8;
  // Data
  std::string data = "synthetic";
  std::string data_dir = "data/wikitext-2";
  int64_t batch_size = 4;
  int64_t block_size = 35;
  int64_t num_tokens = 0;
  // Output
  std::string summary_json;
  bool dry_run = false;  // print the parameter count and memory per strategy; allocate nothing
  std::string save_batches;  // write the run's micro-batches (every rank's) here and exit
  std::string save_initial_weights;  // rank 0 writes the weights training starts from here
  std::string ckpt_path;
  std::string deepspeed_config;  // DeepSpeedOptions::config (strategy deepspeed*)
  // The disk tier (strategy deepspeed*): DeepSpeedOptions offload_optimizer_device, nvme_path,
  // sub_group_size and the aio block.
  std::string offload_optimizer_device;  // "" | "cpu" | "nvme"
  std::string nvme_path;
  double sub_group_size = 0;  // 0: the strategy's default
  fsdp::AioOptions aio;
  // Parameters on disk (stage 3): offload_params_device and offload_param's buffer_count,
  // buffer_size, max_in_cpu; 0 / "" = the strategy's default.
  std::string offload_params_device;  // "" | "cpu" | "nvme"
  int64_t params_buffer_count = 0;
  double params_buffer_size = 0;
  double max_in_cpu = -1;
  int64_t persistence_threshold = -1;  // stage3_param_persistence_threshold; -1: the default

  Args() {  // this program's defaults where they differ from the library's
    trainer.max_steps = 100;
    trainer.log_every_n_steps = 10;
    trainer.seed = 42;
    checkpoint.save_top_k = -1;     // keep every checkpoint unless --save-top-k
    checkpoint.every_n_epochs = 0;  // 0: not given (see run())
  }
  int world() const { return trainer.devices * trainer.num_nodes; }
  bool is_ddp() const { return strategy == "ddp" || (strategy == "auto" && world() > 1); }
};

// What the model is made of; built on every rank from the same flags and seed.
struct ModelSpec {
  std::string name;                        // a registry preset, or "custom"
  fsdp::demos::TransformerOptions custom;  // when name == "custom"
  int64_t vocab_size = 0;
  double dropout = 0;
  bool activation_checkpointing = false;  // checkpoint the model's layer types
};

std::shared_ptr<fsdp::nn::Module> build_model(const ModelSpec& spec) {
  if (spec.name == "custom") {
    auto options = spec.custom;
    options.vocab_size = spec.vocab_size;
    options.dropout = spec.dropout;
    return std::make_shared<fsdp::demos::Transformer>(options);
  }
  return fsdp::demos::make_model(spec.name, spec.vocab_size, spec.dropout);
}

// The reference's LanguageModel: the demo model built in configure_model, nll_loss over its
// log-probabilities.
class LanguageModel : public fsdp::LightningModule {
 public:
  LanguageModel(ModelSpec spec, std::string optimizer, double lr, double weight_decay,
                double adam_eps)
      : spec_(std::move(spec)),
        optimizer_(std::move(optimizer)),
        lr_(lr),
        wd_(weight_decay),
        eps_(adam_eps) {}

  void configure_model() override {
    if (model_) return;  // idempotent, as Lightning asks
    model_ = register_module("model", build_model(spec_));
    if (spec_.activation_checkpointing) {
      // A module transform, so it works under every strategy (under FSDP the model's own
      // choice is respected: FSDPOptions::activation_checkpointing_policy stays empty here).
      fsdp::apply_activation_checkpointing(
          *model_, fsdp::demos::layer_types(spec_.name == "custom" ? "transformer-tiny" : spec_.name));
    }
  }

  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor loss = loss_of(batch);
    // sync_dist: the global mean, carried by the Trainer's one per-step all-reduce.
    fsdp::LogOptions o;
    o.sync_dist = true;
    log("train_loss", loss, o);
    return loss;
  }

  at::Tensor validation_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor loss = loss_of(batch);
    fsdp::LogOptions o;
    o.prog_bar = true;
    o.sync_dist = true;
    log("val_loss", loss, o);
    return loss;
  }

  at::Tensor test_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor loss = loss_of(batch);
    fsdp::LogOptions o;
    o.sync_dist = true;
    log("test_loss", loss, o);
    return loss;
  }

  fsdp::OptimizerConfig configure_optimizers() override {
    if (optimizer_ == "adamw") {
      return {std::make_shared<torch::optim::AdamW>(
          parameters(), torch::optim::AdamWOptions(lr_).weight_decay(wd_).eps(eps_)), nullptr};
    }
    if (optimizer_ == "cpu_adam" || optimizer_ == "cpu_adamw") {
      // fsdp::optim::CPUAdam: libtorch's Adam / AdamW math in one fused vectorized pass.
      fsdp::optim::CPUAdamOptions o;
      o.lr = lr_;
      o.weight_decay = wd_;
      o.adamw_mode = optimizer_ == "cpu_adamw";
      return {std::make_shared<fsdp::optim::CPUAdam>(parameters(), o), nullptr};
    }
    if (optimizer_ == "sgd") {
      return {std::make_shared<torch::optim::SGD>(
          parameters(), torch::optim::SGDOptions(lr_).weight_decay(wd_)), nullptr};
    }
    return {std::make_shared<torch::optim::Adam>(
        parameters(), torch::optim::AdamOptions(lr_).weight_decay(wd_).eps(eps_)), nullptr};
  }

 private:
  at::Tensor loss_of(const fsdp::Batch& batch) {
    at::Tensor logp = (*model_)(batch.input, batch.target);  // (B*T, vocab)
    return at::nll_loss(logp, batch.target.reshape(-1));
  }

  ModelSpec spec_;
  std::string optimizer_;
  double lr_, wd_, eps_;
  std::shared_ptr<fsdp::nn::Module> model_;
};

int64_t preset_vocab(const std::string& model) {
  if (model == "custom") return 0;
  return fsdp::demos::is_transformer_model(model) ? fsdp::demos::transformer_preset(model).vocab_size
                                                  : fsdp::demos::gpt_preset(model).vocab_size;
}

// Where a step's CPU time goes besides the math: getrusage over the optimizer steps after the
// first (the ones it/s times), per rank, for --summary-json. Minor page faults count memory the
// kernel had to map in (README "Memory accounting": the block cache), sys seconds the time in
// the kernel. Collective at the end of training (every rank runs the callback).
class StepCosts : public fsdp::Callback {
 public:
  struct Usage {
    int64_t minor_faults = 0, user_us = 0, sys_us = 0;
  };
  void on_train_batch_end(fsdp::Trainer& trainer, fsdp::LightningModule&, int64_t) override {
    if (start_step_ < 0 && trainer.global_step() >= 1) {
      start_step_ = trainer.global_step();
      start_ = now();
    }
  }
  void on_train_end(fsdp::Trainer& trainer, fsdp::LightningModule&) override {
    const int64_t steps = start_step_ < 0 ? 0 : trainer.global_step() - start_step_;
    const Usage end = now();
    at::Tensor mine = at::tensor({end.minor_faults - start_.minor_faults, end.user_us - start_.user_us,
                                  end.sys_us - start_.sys_us},
                                 at::kLong);
    at::Tensor all = at::empty({3 * trainer.world_size()}, at::kLong);
    trainer.world()->all_gather_into_tensor(all, mine);
    faults_.clear(), user_.clear(), sys_.clear();
    if (steps <= 0) return;
    for (int r = 0; r < trainer.world_size(); ++r) {
      faults_.push_back(all[3 * r].item<int64_t>() / static_cast<double>(steps));
      user_.push_back(all[3 * r + 1].item<int64_t>() * 1e-6 / static_cast<double>(steps));
      sys_.push_back(all[3 * r + 2].item<int64_t>() * 1e-6 / static_cast<double>(steps));
    }
  }
  // Per rank, per step; empty with fewer than two steps.
  std::vector<double> faults_, user_, sys_;

 private:
  static Usage now() {
    struct rusage u {};
    ::getrusage(RUSAGE_SELF, &u);
    Usage s;
    s.minor_faults = u.ru_minflt;
    s.user_us = static_cast<int64_t>(u.ru_utime.tv_sec) * 1000000 + u.ru_utime.tv_usec;
    s.sys_us = static_cast<int64_t>(u.ru_stime.tv_sec) * 1000000 + u.ru_stime.tv_usec;
    return s;
  }
  int64_t start_step_ = -1;
  Usage start_;
};

struct Data {
  std::shared_ptr<const fsdp::TokenBlockDataset> train, val;
  int64_t vocab_size = 0;
};

Data load_data(const Args& a) {
  Data d;
  if (a.data == "wikitext2") {
    auto train = std::make_shared<fsdp::demos::WikiText2>(a.data_dir, "train", a.block_size);
    d.train = train;
    d.vocab_size = train->vocab_size();
    try {
      d.val = std::make_shared<fsdp::demos::WikiText2>(a.data_dir, "valid", a.block_size);
    } catch (const c10::Error&) {
      // no valid.txt: train without validation
    }
    return d;
  }
  // Synthetic: a sparse Markov chain over `vocab` tokens. The vocabulary defaults to the
  // preset's, capped at 1024 so small runs can learn the chain; --vocab-size sets it.
  int64_t vocab = a.vocab_size > 0 ? a.vocab_size : std::min<int64_t>(preset_vocab(a.model), 1024);
  if (vocab <= 0) vocab = 1024;
  int64_t tokens = a.num_tokens;
  if (tokens <= 0) {
    // Enough that one epoch covers max_steps steps (depends only on the global batch, so runs
    // with the same global batch over different worlds read the same corpus), at least 100k,
    // at most 16M tokens (128 MB): longer runs (a soak's --max-steps 100000000) go round it
    // in epochs instead of asking for a corpus larger than memory.
    constexpr int64_t kMaxAutoTokens = int64_t{1} << 24;
    const int64_t world = a.world();
    const int64_t steps = std::min<int64_t>(std::max<int64_t>(a.trainer.max_steps, 0),
                                            kMaxAutoTokens);
    const int64_t samples = steps * a.trainer.accumulate_grad_batches * a.batch_size * world + world;
    tokens = std::min(kMaxAutoTokens, std::max<int64_t>(100000, (samples + 2) * a.block_size));
  }
  // One chain, one token stream: the first 90% trains, the rest validates (a different seed
  // would be a different chain, which no model could predict).
  auto corpus = std::make_shared<fsdp::demos::SyntheticCorpus>(
      vocab, tokens + tokens / 9, static_cast<uint64_t>(a.trainer.seed), a.block_size);
  const at::Tensor& all = corpus->tokens();
  d.train = std::make_shared<fsdp::TokenBlockDataset>(all.narrow(0, 0, tokens), vocab,
                                                      a.block_size);
  d.val = std::make_shared<fsdp::TokenBlockDataset>(
      all.narrow(0, tokens, all.numel() - tokens), vocab, a.block_size);
  d.vocab_size = vocab;
  return d;
}

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

std::string what_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// --dry-run: the model is built on the meta device (shapes only, see fsdp/init.h) and every
// strategy's per-rank model-state estimate is printed; no rank is started, nothing trains.
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

int dry_run(const Args& a, const ModelSpec& spec_in) {
  ModelSpec spec = spec_in;
  if (a.data == "wikitext2") {
    spec.vocab_size = load_data(a).vocab_size;
  } else {  // the synthetic vocabulary load_data would use
    spec.vocab_size = a.vocab_size > 0 ? a.vocab_size : std::min<int64_t>(preset_vocab(a.model), 1024);
    if (spec.vocab_size <= 0) spec.vocab_size = 1024;
  }
  std::shared_ptr<fsdp::nn::Module> model;
  {
    fsdp::MetaInitGuard meta;  // shapes only: no storage, no init
    model = build_model(spec);
  }
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const int world = a.world();
  const int devices = a.trainer.devices;
  // The presets with a published vocabulary keep it (see fsdp/models.h).
  int64_t vocab = spec.vocab_size;
  if (spec.name != "custom") {
    vocab = fsdp::demos::is_transformer_model(spec.name)
                ? fsdp::demos::transformer_preset(spec.name, spec.vocab_size).vocab_size
                : fsdp::demos::gpt_preset(spec.name, spec.vocab_size).vocab_size;
  }

  struct Row {
    std::string name;
    int64_t params = 0, grads = 0, optimizer = 0, extra = 0;  // extra: buckets / unsharded units
    int64_t total() const { return params + grads + optimizer + extra; }
  };
  std::vector<Row> rows;
  {
    const fsdp::DDPMemoryEstimate e = fsdp::estimate_ddp_memory(*model, fsdp::DDPOptions{});
    rows.push_back({"ddp", e.param_bytes, e.grad_bytes, e.optimizer_bytes, e.bucket_bytes});
  }
  std::vector<fsdp::ShardingStrategy> strategies = {fsdp::ShardingStrategy::kNoShard,
                                                    fsdp::ShardingStrategy::kShardGradOp,
                                                    fsdp::ShardingStrategy::kFullShard};
  const int shard_size = a.fsdp.hybrid_shard_size > 0 ? a.fsdp.hybrid_shard_size : devices;
  if (a.trainer.num_nodes > 1 ||
      (shard_size > 1 && shard_size < world && world % shard_size == 0)) {
    strategies.push_back(fsdp::ShardingStrategy::kHybridShard);  // meaningful: > 1 shard group
  }
  for (auto ss : strategies) {
    fsdp::FSDPOptions o;
    o.sharding_strategy = ss;
    o.auto_wrap_policy = fsdp::parse_wrap_policy(
        a.wrap_policy, fsdp::demos::layer_types(a.model == "custom" ? "transformer-tiny" : a.model));
    o.hybrid_shard_size = a.fsdp.hybrid_shard_size;
    const fsdp::FSDPMemoryEstimate e = fsdp::estimate_fsdp_memory(*model, o, world, devices);
    rows.push_back({std::string("fsdp ") + fsdp::to_string(ss), e.sharded_param_bytes,
                    e.sharded_grad_bytes, e.optimizer_bytes, e.unsharded_peak_bytes});
  }

  std::cout << "[fsdp-train] dry run: model " << a.model << ", " << with_commas(params)
            << " parameters (" << fsdp::format_bytes(params * 4) << " fp32), vocab "
            << vocab << ", world " << world << " (" << devices << " per node), "
            << "wrap policy " << a.wrap_policy << "; nothing allocated (meta device)\n";
  std::printf("%-20s %12s %12s %12s %14s %12s\n", "strategy", "params/rank", "grads/rank",
              "Adam state", "buffers/units", "total/rank");
  for (const auto& r : rows) {
    std::printf("%-20s %12s %12s %12s %14s %12s\n", r.name.c_str(),
                fsdp::format_bytes(r.params).c_str(), fsdp::format_bytes(r.grads).c_str(),
                fsdp::format_bytes(r.optimizer).c_str(), fsdp::format_bytes(r.extra).c_str(),
                fsdp::format_bytes(r.total()).c_str());
  }
  // The disk tier (--offload-optimizer-device nvme): rank 0's ZeRO partition (the largest) of
  // the Adam moments goes to swap files; the plan is the one DeepSpeedStrategy checks at setup.
  bool disk_fits = true;
  if (a.offload_optimizer_device == "nvme") {
    int64_t part = 0;
    for (const auto& p : model->parameters()) {
      if (!p.requires_grad()) continue;
      const int64_t dim0 = p.dim() >= 2 ? p.size(0) : p.numel();
      const int64_t row = dim0 == 0 ? 0 : p.numel() / dim0;
      part += (dim0 + world - 1) / world * row;
    }
    const std::string nvme = a.nvme_path.empty() ? fsdp::DeepSpeedOptions{}.nvme_path : a.nvme_path;
    const double sub = a.sub_group_size > 0 ? a.sub_group_size : fsdp::DeepSpeedOptions{}.sub_group_size;
    fsdp::DiskPlan plan = fsdp::plan_disk_offload(part, static_cast<int64_t>(sub), nvme);
    plan.dir = nvme + "/<job>/rank<r>";
    const int64_t node_disk = plan.disk_bytes * devices;
    disk_fits = plan.free_bytes < 0 || node_disk <= plan.free_bytes;
    std::cout << "disk tier (offload_optimizer nvme), per rank: the Adam state column above "
                 "goes to disk instead of RAM\n"
              << plan.describe() << "  this node (" << devices << " rank(s)): "
              << fsdp::format_bytes(node_disk) << " on disk: "
              << (disk_fits ? "fits" : "does NOT fit; setup would refuse it") << "\n";
  }
  // Parameters on disk (--offload-params-device nvme, stage 3): each unit (a module with
  // parameters above stage3_param_persistence_threshold) puts this rank's shard in one record.
  if (a.offload_params_device == "nvme" || a.strategy == "deepspeed_stage_3_offload_nvme") {
    fsdp::DeepSpeedOptions d;
    if (a.persistence_threshold >= 0) d.stage3_param_persistence_threshold = a.persistence_threshold;
    std::vector<int64_t> unit_bytes;
    for (const auto& m : model->modules(/*include_self=*/true)) {
      int64_t bytes = 0;
      for (const auto& p : m->named_parameters(/*recurse=*/false)) {
        const at::Tensor& t = p.value();
        if (t.numel() <= d.stage3_param_persistence_threshold) continue;
        const int64_t dim0 = t.dim() >= 1 ? t.size(0) : 1;
        bytes += (dim0 + world - 1) / world * (t.numel() / std::max<int64_t>(dim0, 1)) * 4;
      }
      if (bytes > 0) unit_bytes.push_back(bytes);
    }
    const std::string nvme = a.nvme_path.empty() ? d.nvme_path : a.nvme_path;
    fsdp::ParamDiskPlan plan = fsdp::plan_param_offload(
        unit_bytes, a.params_buffer_count > 0 ? a.params_buffer_count : d.params_buffer_count,
        static_cast<int64_t>(a.params_buffer_size > 0 ? a.params_buffer_size : d.params_buffer_size),
        static_cast<int64_t>(a.max_in_cpu >= 0 ? a.max_in_cpu : d.max_in_cpu), nvme);
    plan.dir = nvme + "/<job>/rank<r>";
    const int64_t node_disk = plan.disk_bytes * devices;
    const bool fits = plan.free_bytes < 0 || node_disk <= plan.free_bytes;
    const bool buffer_ok = plan.largest_unit_numel <= plan.buffer_numel;
    disk_fits = disk_fits && fits && buffer_ok;
    std::cout << "parameters on disk (offload_param nvme), per rank: the parameter column of "
                 "stage 3 goes to disk, except the persistent parameters (<= "
              << d.stage3_param_persistence_threshold << " elements)\n"
              << plan.describe() << "  this node (" << devices << " rank(s)): "
              << fsdp::format_bytes(node_disk) << " on disk: "
              << (fits ? "fits" : "does NOT fit; setup would refuse it")
              << (buffer_ok ? "" : "; the largest unit's shard exceeds buffer_size: setup would "
                                   "refuse it (raise --params-buffer-size)")
              << "\n";
  }
  const int64_t rss = fsdp::peak_rss_bytes();
  std::cout << "model state only (fp32 params, grads, 2 Adam moments; DDP: + bucket buffers; "
               "FSDP: + root unit and the two largest units unsharded); activations not "
               "included. Peak RSS of this dry run: "
            << fsdp::format_bytes(rss) << std::endl;
  if (!a.summary_json.empty()) {
    nlohmann::json j;
    j["model"] = a.model;
    j["params"] = params;
    j["vocab_size"] = vocab;
    j["world_size"] = world;
    j["peak_rss_bytes"] = rss;
    for (const auto& r : rows) {
      j["strategies"].push_back({{"name", r.name}, {"param_bytes", r.params},
                                 {"grad_bytes", r.grads}, {"optimizer_bytes", r.optimizer},
                                 {"extra_bytes", r.extra}, {"total_bytes", r.total()}});
    }
    std::ofstream f(a.summary_json);
    TORCH_CHECK(f, "[fsdp-train] cannot write --summary-json '", a.summary_json, "'");
    f << j.dump(2) << "\n";
  }
  return disk_fits ? 0 : 1;
}

// --save-batches FILE: the micro-batches this run would train on, every rank's, so that other
// systems (bench/peers/*.py) read the same samples in the same order. safetensors
// {"input", "target"}: int64 (micro_batches, world * batch_size, block_size); rows
// [r*B, (r+1)*B) of micro-batch i are rank r's batch i, drawn from the loader the Trainer gives
// rank r (see Note [Sampler striding]). Covers the first epoch; nothing trains.
int save_batches(const Args& a) {
  const uint64_t seed = static_cast<uint64_t>(a.trainer.seed);
  fsdp::seed_everything(seed);
  Data data = load_data(a);
  const int64_t world = a.world(), B = a.batch_size;
  const int64_t micro = a.trainer.max_steps * a.trainer.accumulate_grad_batches;
  TORCH_CHECK(a.trainer.max_steps > 0, "[fsdp-train] --save-batches needs --max-steps > 0 (how many "
              "steps' batches to write)");
  std::vector<fsdp::DataLoader> loaders;
  for (int64_t r = 0; r < world; ++r) {  // what the Trainer's distribute() gives rank r
    loaders.emplace_back(data.train, B,
                         fsdp::DistributedSampler(data.train->size(), world, r, /*shuffle=*/true,
                                                  seed),
                         /*drop_last=*/true);
  }
  TORCH_CHECK(micro <= loaders[0].num_batches(), "[fsdp-train] --save-batches writes one epoch: ",
              micro, " micro-batches asked (--max-steps x --accumulate-grad-batches), the epoch "
              "has ", loaders[0].num_batches(), " per rank; lower --max-steps or add data "
              "(--num-tokens)");
  at::Tensor input = at::empty({micro, world * B, a.block_size}, at::kLong);  // (I, N*B, T)
  at::Tensor target = at::empty_like(input);
  for (int64_t i = 0; i < micro; ++i) {
    for (int64_t r = 0; r < world; ++r) {
      const fsdp::Batch b = loaders[r].batch(i);
      input[i].narrow(0, r * B, B).copy_(b.input);
      target[i].narrow(0, r * B, B).copy_(b.target);
    }
  }
  fsdp::save_safetensors(a.save_batches, {{"input", input}, {"target", target}},
                         {{"world_size", std::to_string(world)},
                          {"batch_size_per_rank", std::to_string(B)},
                          {"vocab_size", std::to_string(data.vocab_size)},
                          {"layout", "micro-batch i, rows [r*B, (r+1)*B): rank r's batch i"}});
  std::cout << "[fsdp-train] wrote " << micro << " micro-batches of " << world << " x " << B
            << " samples (" << a.block_size << " tokens, vocab " << data.vocab_size << ") to "
            << a.save_batches << std::endl;
  return 0;
}

int run(const Args& a, const ModelSpec& spec_in) {
  const uint64_t seed = static_cast<uint64_t>(a.trainer.seed);
  fsdp::seed_everything(seed);
  // Data first: a missing file fails once, here, before the other ranks are started.
  Data data = load_data(a);

  fsdp::TrainerOptions t = a.trainer;
  t.strategy = a.strategy;
  if (a.strategy.rfind("fsdp", 0) == 0) {  // FSDP flags; see include/fsdp/fsdp_strategy.h
    fsdp::FSDPOptions o = a.fsdp;
    o.auto_wrap_policy = fsdp::parse_wrap_policy(
        a.wrap_policy, fsdp::demos::layer_types(a.model == "custom" ? "transformer-tiny" : a.model));
    t.strategy = fsdp::make_fsdp_strategy(a.strategy, o);
  }
  if (a.is_ddp()) {  // DDP flags; see include/fsdp/ddp.h and comm_hooks.h
    fsdp::DDPOptions o = a.ddp;
    fsdp::set_comm_hook(o, a.ddp_comm_hook, a.ddp_comm_wrapper, a.powersgd, a.post_local_sgd);
    t.strategy = std::make_shared<fsdp::DDPStrategy>(o);
  }
  TORCH_CHECK((a.offload_optimizer_device.empty() && a.nvme_path.empty() &&
               a.offload_params_device.empty() && a.params_buffer_count == 0 &&
               a.params_buffer_size == 0 && a.max_in_cpu < 0 && a.persistence_threshold < 0) ||
                  a.strategy.rfind("deepspeed", 0) == 0 || !a.deepspeed_config.empty(),
              "[fsdp-train] --offload-optimizer-device / --offload-params-device / --nvme-path / "
              "--params-buffer-count / --params-buffer-size / --max-in-cpu need a DeepSpeed strategy "
              "(--strategy deepspeed_stage_2, deepspeed_stage_3, ...); --strategy ", a.strategy,
              " has no disk tier");
  if (a.strategy.rfind("deepspeed", 0) == 0 || !a.deepspeed_config.empty()) {
    // DeepSpeed ZeRO; see include/fsdp/deepspeed.h. --deepspeed-config with --strategy auto
    // means "deepspeed", as Lightning's PL_DEEPSPEED_CONFIG_PATH with strategy="deepspeed".
    const std::string name = a.strategy == "auto" ? "deepspeed" : a.strategy;
    TORCH_CHECK(name.rfind("deepspeed", 0) == 0, "[fsdp-train] --deepspeed-config needs a "
                "DeepSpeed strategy (--strategy deepspeed, deepspeed_stage_1, ...), got --strategy ",
                a.strategy);
    fsdp::DeepSpeedOptions o;
    o.config = a.deepspeed_config;
    if (!a.offload_optimizer_device.empty()) {
      TORCH_CHECK(a.deepspeed_config.empty(), "[fsdp-train] --offload-optimizer-device with "
                  "--deepspeed-config: set zero_optimization.offload_optimizer in the config "
                  "instead (a config replaces the strategy's options)");
      o.offload_optimizer = true;
      o.offload_optimizer_device = a.offload_optimizer_device;
    }
    if (!a.offload_params_device.empty()) {
      TORCH_CHECK(a.deepspeed_config.empty(), "[fsdp-train] --offload-params-device with "
                  "--deepspeed-config: set zero_optimization.offload_param in the config "
                  "instead (a config replaces the strategy's options)");
      o.offload_parameters = true;
      o.offload_params_device = a.offload_params_device;
    }
    if (a.params_buffer_count > 0) o.params_buffer_count = a.params_buffer_count;
    if (a.params_buffer_size > 0) o.params_buffer_size = a.params_buffer_size;
    if (a.max_in_cpu >= 0) o.max_in_cpu = a.max_in_cpu;
    if (a.persistence_threshold >= 0) o.stage3_param_persistence_threshold = a.persistence_threshold;
    if (!a.nvme_path.empty()) o.nvme_path = a.nvme_path;
    if (a.sub_group_size > 0) o.sub_group_size = a.sub_group_size;
    o.aio = a.aio;
    t.strategy = fsdp::make_deepspeed_strategy(name, o);
  }
  auto comm_bytes = std::make_shared<CommBytesRecorder>();
  t.callbacks.push_back(comm_bytes);
  if (!a.save_initial_weights.empty()) {
    TORCH_CHECK(a.strategy.rfind("fsdp", 0) != 0 && a.strategy.rfind("deepspeed", 0) != 0 &&
                    a.deepspeed_config.empty(),
                "[fsdp-train] --save-initial-weights needs whole parameters on rank 0 (strategy "
                "single or ddp); --strategy ", a.strategy, " shards them");
    t.callbacks.push_back(std::make_shared<InitialWeightsWriter>(a.save_initial_weights));
  }
  const fsdp::ModelCheckpointOptions& c = a.checkpoint;
  TORCH_CHECK(!c.dirpath.empty() || (c.every_n_train_steps == 0 && c.every_n_epochs == 0 &&
                                     c.monitor.empty() && c.save_top_k == -1),
              "[fsdp-train] --save-every-n-steps, --every-n-epochs, --monitor and --save-top-k "
              "need --checkpoint-dir DIR (where the checkpoints go)");
  if (!c.dirpath.empty() &&
      (c.every_n_train_steps > 0 || c.every_n_epochs > 0 || !c.monitor.empty())) {
    // A ModelCheckpoint: DIR/step-<k>[-<monitor>=<value>] entries, DIR/last -> the newest.
    fsdp::ModelCheckpointOptions mc = c;
    mc.filename = "step-{step}";
    if (!c.monitor.empty()) mc.filename += "-" + c.monitor + "={" + c.monitor + "}";
    mc.auto_insert_metric_name = false;
    mc.save_last = true;
    // Lightning's default (-1): every epoch when no step period is given.
    if (mc.every_n_epochs == 0) mc.every_n_epochs = -1;
    t.callbacks.push_back(std::make_shared<fsdp::ModelCheckpoint>(mc));
  }
  auto step_costs = std::make_shared<StepCosts>();
  t.callbacks.push_back(step_costs);
  fsdp::Trainer trainer(t);  // devices > 1: the other ranks start here and run main() again

  ModelSpec spec = spec_in;
  spec.vocab_size = data.vocab_size;
  // Lightning's convention: batch size per rank; the Trainer strides the sampler over ranks.
  fsdp::DataLoader train_loader(
      data.train, a.batch_size,
      fsdp::DistributedSampler(data.train->size(), 1, 0, /*shuffle=*/true, seed), true);
  std::unique_ptr<fsdp::DataLoader> val_loader;
  if (data.val && data.val->size() > 0) {
    val_loader = std::make_unique<fsdp::DataLoader>(
        data.val, a.batch_size,
        fsdp::DistributedSampler(data.val->size(), 1, 0, /*shuffle=*/false, seed), true);
  }

  LanguageModel model(spec, a.optimizer, a.lr, a.weight_decay, a.adam_eps);
  trainer.print("[fsdp-train] model " + a.model + ", vocab " + std::to_string(spec.vocab_size) +
                ", data " + a.data + " (" + std::to_string(data.train->size()) +
                " training blocks of " + std::to_string(a.block_size) + "), strategy " +
                trainer.strategy()->name() + ", world " + std::to_string(trainer.world_size()) +
                ", batch " + std::to_string(a.batch_size) + " per rank" +
                (a.activation_checkpointing ? ", activation checkpointing on" : ""));
  // What the loss means: a model that learned nothing scores ln(vocab) (uniform guess).
  const double uniform_loss = std::log(static_cast<double>(spec.vocab_size));
  {
    std::ostringstream ref;
    ref << std::fixed << std::setprecision(2) << "[fsdp-train] loss reference: uniform guess ln("
        << spec.vocab_size << ") = " << uniform_loss;
    if (a.data == "synthetic") {
      ref << ", a perfect model of the synthetic chain = "
          << fsdp::demos::SyntheticCorpus::entropy_rate();
      // Lightning's demo Transformer feeds the targets to its decoder (causal mask, but position
      // i sees target i), so it can copy and go below the chain's entropy; GPT-2 cannot.
      if (a.model != "custom" && !fsdp::demos::is_transformer_model(a.model)) {
        ref << " (causal: the floor for this model)";
      } else {
        ref << " (Lightning's demo Transformer sees each target in its decoder input and can "
               "copy it, going below that; a gpt2-* model is causal)";
      }
    }
    trainer.print(ref.str());
  }
  if (val_loader && val_loader->num_batches() > 0) {
    if (a.ckpt_path.empty()) {
      trainer.fit(model, train_loader, *val_loader);
    } else {
      trainer.fit(model, train_loader, *val_loader, a.ckpt_path);
    }
  } else if (a.ckpt_path.empty()) {
    trainer.fit(model, train_loader);
  } else {
    trainer.fit(model, train_loader, a.ckpt_path);
  }

  const fsdp::FitResults& r = trainer.results();
  if (r.losses.size() >= 2) {
    std::ostringstream learned;
    learned << std::fixed << std::setprecision(2) << "[fsdp-train] loss " << r.losses.front()
            << " (step 1) -> " << r.losses.back() << " (step " << r.losses.size()
            << "); uniform guess " << uniform_loss;
    trainer.print(learned.str());
  }
  if (trainer.is_global_zero() && !a.summary_json.empty()) {
    nlohmann::json j;
    j["strategy"] = trainer.strategy()->name();
    j["world_size"] = trainer.world_size();
    j["model"] = a.model;
    j["params"] = r.params;
    j["steps"] = r.steps;
    j["epochs"] = r.epochs;
    j["batch_size"] = a.batch_size;
    j["precision"] = t.precision;
    j["skipped_steps"] = r.skipped_steps;  // 16-mixed: steps the grad scaler skipped (inf/nan)
    j["activation_checkpointing"] = a.activation_checkpointing;
    j["seconds"] = r.seconds;
    j["it_per_s"] = r.it_per_s;
    j["it_per_s_note"] = "optimizer steps per second, first step (warm-up) excluded";
    j["step_end_seconds"] = r.step_end_seconds;  // rank 0: loop start to the end of each step
    j["forward_seconds"] = r.forward_seconds;    // rank 0, per step (FitResults)
    j["backward_seconds"] = r.backward_seconds;
    j["optimizer_seconds"] = r.optimizer_seconds;
    j["comm_seconds"] = r.comm_seconds;
    j["disk_wait_seconds"] = r.disk_wait_seconds;  // rank 0, per step: blocked on the disk tier
    std::vector<double> alloc, rss;
    for (auto b : r.peak_alloc_bytes) alloc.push_back(b / 1048576.0);
    for (auto b : r.peak_rss_bytes) rss.push_back(b / 1048576.0);
    j["peak_alloc_mb"] = alloc;  // during training (peaks reset after setup)
    j["peak_rss_mb"] = rss;
    std::vector<double> setup_alloc, setup_rss;
    for (auto b : r.setup_peak_alloc_bytes) setup_alloc.push_back(b / 1048576.0);
    for (auto b : r.setup_peak_rss_bytes) setup_rss.push_back(b / 1048576.0);
    j["setup_peak_alloc_mb"] = setup_alloc;
    j["setup_peak_rss_mb"] = setup_rss;
    j["minor_faults_per_step"] = step_costs->faults_;  // per rank, steps 2..n
    j["user_seconds_per_step"] = step_costs->user_;
    j["sys_seconds_per_step"] = step_costs->sys_;
    j["losses"] = r.losses;
    j["final_loss"] = r.losses.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.losses.back());
    j["metrics"] = r.metrics;
    j["log_dir"] = r.log_dir;
    j["comm_bytes_per_step"] = comm_bytes->per_step();
    j["comm_bytes_note"] = "bytes rank 0 passed to collectives in each optimizer step, counted by "
                           "the process groups (gradients, model averaging, the loss all-reduce)";
    std::ofstream f(a.summary_json);
    TORCH_CHECK(f, "[fsdp-train] cannot write --summary-json '", a.summary_json, "'");
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "fsdp-train: train a demo language model (Lightning's Transformer or a GPT-2) with the "
      "fsdp.cpp Trainer.\nRanks are processes: --devices N re-executes this program N times."};
  app.option_defaults()->always_capture_default();
  app.get_formatter()->column_width(34);

  const std::vector<std::string> models = [] {
    auto v = fsdp::demos::model_names();
    v.push_back("custom");
    return v;
  }();
  const std::vector<std::string> strategies = [] {
    auto v = fsdp::strategy_names();
    v.insert(v.begin(), "auto");
    return v;
  }();

  fsdp::TrainerOptions& t = a.trainer;
  fsdp::FSDPOptions& f = a.fsdp;
  fsdp::ModelCheckpointOptions& c = a.checkpoint;
  using fsdp::cli::at_least;
  using fsdp::cli::between;
  using fsdp::cli::greater_than;
  using fsdp::cli::one_of;

  // Trainer
  app.add_option("--accelerator", t.accelerator, "cpu | auto | cuda | gpu (cuda needs a CUDA build of libtorch)")
      ->check(one_of(fsdp::Trainer::accelerator_names()));
  app.add_option("--devices", t.devices, "ranks (processes) per node")->check(at_least(1));
  app.add_option("--num-nodes", t.num_nodes, "nodes (under SLURM/mpirun/torchrun-style env)")
      ->check(at_least(1));
  app.add_option("--strategy", a.strategy, "auto = single for one rank, ddp for more")
      ->check(one_of(strategies));
  app.add_option("--sharding-strategy", f.sharding_strategy,
                 "fsdp: FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2")
      ->transform(parsed_by(fsdp::parse_sharding_strategy, "SHARDING_STRATEGY"))
      ->default_str(fsdp::to_string(f.sharding_strategy));
  app.add_option("--wrap-policy", a.wrap_policy, "fsdp units: layers | size:N | none");
  app.add_flag("--limit-all-gathers", f.limit_all_gathers, "fsdp: at most two units unsharded");
  app.add_option("--prefetch,--backward-prefetch", f.backward_prefetch,
                 "fsdp backward prefetch: pre | post | none")
      ->transform(parsed_by(fsdp::parse_backward_prefetch, "PREFETCH", {"pre", "post", "none"}))
      ->default_str(fsdp::to_string(f.backward_prefetch));
  app.add_flag("--forward-prefetch", f.forward_prefetch, "fsdp: all-gather the next unit during forward");
  app.add_flag("--activation-checkpointing", a.activation_checkpointing,
               "recompute each layer's activations in backward (any strategy): less activation "
               "memory, about 1/3 more compute");
  app.add_option("--hybrid-shard-size", f.hybrid_shard_size, "fsdp hybrid: ranks per shard group (0: one node)")
      ->check(at_least(0));
  // DDP
  fsdp::DDPOptions& d = a.ddp;
  fsdp::PowerSGDOptions& ps = a.powersgd;
  fsdp::PostLocalSGDOptions& pl = a.post_local_sgd;
  const std::vector<std::string> hooks = [] {
    auto v = fsdp::comm_hook_names();
    v.insert(v.begin(), "none");
    return v;
  }();
  const std::vector<std::string> wrappers = [] {
    auto v = fsdp::comm_wrapper_names();
    v.insert(v.begin(), "none");
    return v;
  }();
  a.ddp_flags = {
      app.add_option("--bucket-cap-mb", d.bucket_cap_mb, "ddp: gradient bucket size in MB")
          ->check(greater_than(0.0)),
      app.add_flag("--find-unused-parameters", d.find_unused_parameters,
                   "ddp: allow trainable parameters without a gradient"),
      app.add_flag("--static-graph", d.static_graph,
                   "ddp: the same parameters every step; buckets rebuilt in gradient order"),
      app.add_flag("--gradient-as-bucket-view", d.gradient_as_bucket_view,
                   "ddp: .grad are views into the buckets (one gradient copy less)"),
      app.add_option("--ddp-comm-hook", a.ddp_comm_hook,
                     "ddp: how gradient buckets are communicated: none (all-reduce) | "
                     "allreduce | fp16_compress | bf16_compress | powersgd | batched_powersgd | "
                     "post_local_sgd")
          ->check(one_of(hooks)),
      app.add_option("--ddp-comm-wrapper", a.ddp_comm_wrapper,
                     "ddp: cast what the hook sends: none | fp16 | bf16")
          ->check(one_of(wrappers)),
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
                     "powersgd: added to column norms (e.g. 1e-8 if a gradient can be all zero)")
          ->check(at_least(0.0)),
      app.add_option("--powersgd-seed", ps.random_seed, "powersgd: random_seed of Q"),
      app.add_flag("--batch-tensors-with-same-shape", ps.batch_tensors_with_same_shape,
                   "powersgd: compress same-shaped matrices in one batched matmul"),
      app.add_option("--start-local-sgd-iter", pl.start_local_sgd_iter,
                     "post_local_sgd: global all-reduce for this many steps, then local "
                     "(required with post_local_sgd)")
          ->check(at_least(int64_t{0})),
      app.add_option("--post-local-sgd-subgroup-size", pl.subgroup_size,
                     "post_local_sgd: ranks that still average gradients together (0: one node)")
          ->check(at_least(0)),
      app.add_flag_callback("--no-post-local-gradient-allreduce",
                            [&pl] { pl.post_local_gradient_allreduce = false; },
                            "post_local_sgd: no gradient communication at all after the start"),
      app.add_option("--model-averaging-period", d.model_averaging_period,
                     "post_local_sgd: average the parameters every N steps after the start "
                     "(required with post_local_sgd)")
          ->check(at_least(int64_t{0})),
  };
  app.add_option("--precision", t.precision,
                 "32-true (fp32); bf16-mixed (FSDP: fp32 master shards, bf16 all-gather/compute/"
                 "reduce-scatter; other strategies: CPU autocast); bf16-true (bf16 everything); "
                 "16-mixed (as bf16-mixed in fp16, with loss scaling); 16-true (fp16 "
                 "everything; with --adam-eps 1e-4); 64-true")
      ->check(one_of(fsdp::Trainer::precision_names()));
  app.add_option("--max-steps", t.max_steps, "optimizer steps to take (-1: until --max-epochs)")
      ->check(at_least(int64_t{-1}));
  app.add_option("--max-epochs", t.max_epochs, "epochs (-1: unlimited; 1000 if --max-steps is -1 too)")
      ->check(at_least(int64_t{-1}));
  app.add_option("--accumulate-grad-batches", t.accumulate_grad_batches,
                 "micro-batches per optimizer step (loss divided by it)")
      ->check(at_least(int64_t{1}));
  app.add_option("--gradient-clip-val", t.gradient_clip_val, "clip to this global L2 norm (0: off)")
      ->check(at_least(0.0));
  app.add_option("--limit-train-batches", t.limit_train_batches,
                 "batches per epoch: <0 all, (0,1) fraction, >=1 count");
  app.add_option("--limit-val-batches", t.limit_val_batches,
                 "validation batches: <0 all, 0 none, (0,1) fraction, >=1 count");
  app.add_option("--val-check-interval", t.val_check_interval,
                 "validate every N training batches (>=1), a fraction of the epoch (0,1), or at epoch end (0)")
      ->check(at_least(0.0));
  app.add_option("--log-every", t.log_every_n_steps, "log_every_n_steps: CSV rows and non-terminal progress lines")
      ->check(at_least(int64_t{1}));
  app.add_option("--default-root-dir", t.default_root_dir, "CSV logs go to DIR/version_N/metrics.csv");
  app.add_option("--backend", t.process_group_backend, "process group backend; auto: mpi on one host when built and mpirun is on PATH, or under mpirun; else gloo (env FSDP_BACKEND when auto)")
      ->check(one_of({"auto", "gloo", "mpi"}));
  app.add_flag_callback("--no-progress-bar", [&t] { t.enable_progress_bar = false; },
                        "disable the progress bar");
  app.add_option("--seed", t.seed, "seed for the model init, data and sampler (same on every rank)")
      ->check(at_least(int64_t{0}));
  // Model
  app.add_option("--model", a.model, "a preset or custom")->check(one_of(models));
  auto* o_nlayers = app.add_option("--nlayers", a.nlayers, "custom: encoder (and decoder) layers")
                        ->check(at_least(int64_t{1}));
  auto* o_nhid = app.add_option("--nhid", a.nhid, "custom: feed-forward width")->check(at_least(int64_t{1}));
  auto* o_ninp = app.add_option("--ninp", a.ninp, "custom: embedding width")->check(at_least(int64_t{1}));
  auto* o_nhead = app.add_option("--nhead", a.nhead, "custom: attention heads")->check(at_least(int64_t{1}));
  app.add_option("--vocab-size", a.vocab_size,
                 "synthetic data vocabulary (0: the preset's, at most 1024); wikitext2 uses its own")
      ->check(at_least(int64_t{0}));
  app.add_option("--dropout", a.dropout, "dropout probability")->check(between(0.0, 1.0));
  // Optimizer
  app.add_option("--optimizer", a.optimizer,
                 "adam | adamw | sgd | cpu_adam | cpu_adamw (fused CPU Adam / AdamW, fsdp::optim::CPUAdam)")
      ->check(one_of({"adam", "adamw", "sgd", "cpu_adam", "cpu_adamw"}));
  app.add_option("--lr", a.lr, "learning rate")->check(greater_than(0.0));
  app.add_option("--weight-decay", a.weight_decay, "weight decay")->check(at_least(0.0));
  app.add_option("--adam-eps", a.adam_eps,
                 "adam/adamw eps (16-true needs one fp16 can hold, e.g. 1e-4)")
      ->check(greater_than(0.0));
  // Data
  app.add_option("--data", a.data, "synthetic (built in, no files) | wikitext2")
      ->check(one_of({"synthetic", "wikitext2"}));
  app.add_option("--data-dir", a.data_dir, "wikitext2: directory with train.txt (valid.txt optional)");
  app.add_option("--batch-size", a.batch_size, "samples per rank per micro-batch")->check(at_least(int64_t{1}));
  app.add_option("--block-size", a.block_size, "tokens per sample")->check(at_least(int64_t{1}));
  app.add_option("--num-tokens", a.num_tokens,
                 "synthetic corpus size for training (0: enough for --max-steps, at least 100000)")
      ->check(at_least(int64_t{0}));
  // Output
  app.add_option("--summary-json", a.summary_json, "write the run summary (losses, it/s, memory) as JSON here");
  app.add_flag("--dry-run", a.dry_run,
               "print the parameter count and per-rank memory of every strategy at --devices, "
               "without allocating the model (meta device), and exit");
  app.add_option("--save-initial-weights", a.save_initial_weights,
                 "rank 0 writes the parameters training starts from to FILE (safetensors, FQN "
                 "keys; strategy single or ddp), e.g. for a Python peer's --weights");
  app.add_option("--save-batches", a.save_batches,
                 "write the micro-batches of the first --max-steps steps, every rank's, to this "
                 "safetensors file (for bench/peers/*.py) and exit without training");
  // Checkpoints
  app.add_option("--checkpoint-dir", c.dirpath,
                 "save DIR/step-<k> every --save-every-n-steps steps (or --every-n-epochs "
                 "epochs), and DIR/last -> the newest");
  app.add_option("--save-every-n-steps", c.every_n_train_steps, "checkpoint period in optimizer steps (0: off)")
      ->check(at_least(int64_t{0}));
  app.add_option("--state-dict-type", t.state_dict_type, "checkpoint format: full | sharded")
      ->check(one_of({"full", "sharded"}));
  app.add_option("--every-n-epochs", c.every_n_epochs,
                 "also save at the end of every N epochs (default with --monitor and no "
                 "--save-every-n-steps: 1)")
      ->check(at_least(int64_t{0}));
  app.add_option("--monitor", c.monitor,
                 "rank checkpoints by this logged metric (train_loss, val_loss) for --save-top-k");
  app.add_option("--mode", c.mode, "min | max: which --monitor values are better")
      ->check(one_of({"min", "max"}));
  app.add_option("--save-top-k", c.save_top_k,
                 "keep the K best checkpoints by --monitor (-1: all; 1 without --monitor: the "
                 "newest); others are deleted once a better one is saved")
      ->check(at_least(int64_t{-1}));
  auto* o_ds = app.add_option(
      "--deepspeed-config", a.deepspeed_config,
      "DeepSpeed JSON config for --strategy deepspeed* (auto: deepspeed); replaces the "
      "strategy's defaults; its bf16, gradient_clipping, gradient_accumulation_steps, "
      "train_micro_batch_size_per_gpu, optimizer and scheduler apply to the run");
  app.add_option("--offload-optimizer-device", a.offload_optimizer_device,
                 "strategy deepspeed*: offload_optimizer to 'cpu' (where the state already is on "
                 "this device) or 'nvme' (the disk tier: Adam's moments in swap files under "
                 "--nvme-path, streamed through the step)")
      ->check(one_of({"cpu", "nvme"}));
  app.add_option("--offload-params-device", a.offload_params_device,
                 "strategy deepspeed_stage_3: offload_param to 'cpu' (where the parameters "
                 "already are on this device) or 'nvme' (each unit's shard in a swap file under "
                 "--nvme-path, read before its all-gather and streamed through the step; needs "
                 "--offload-optimizer-device nvme and 2+ devices)")
      ->check(one_of({"cpu", "nvme"}));
  app.add_option("--params-buffer-count", a.params_buffer_count,
                 "parameters on disk: buffers for reading units ahead and writing them back "
                 "(offload_param.buffer_count, default 5)")
      ->check(at_least(int64_t{1}));
  app.add_option("--params-buffer-size", a.params_buffer_size,
                 "parameters on disk: elements per buffer; a unit's shard larger than this is "
                 "refused at setup (offload_param.buffer_size, default 1e8)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-in-cpu", a.max_in_cpu,
                 "parameters on disk: elements of the first units' shards kept in RAM "
                 "(offload_param.max_in_cpu, default 1e9)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--stage3-param-persistence-threshold", a.persistence_threshold,
                 "strategy deepspeed_stage_3: parameters of at most this many elements stay whole "
                 "(default 1e5); 0 shards every parameter and builds the model sharded (deferred "
                 "init: no rank holds the whole model)")
      ->check(at_least(int64_t{0}));
  app.add_option("--nvme-path", a.nvme_path,
                 "the disk tier's directory (swap files go to NVME_PATH/<job>/rank<r>/, removed "
                 "on exit)");
  app.add_option("--sub-group-size", a.sub_group_size,
                 "strategy deepspeed*: elements of optimizer state stepped (and, on disk, "
                 "streamed) at a time");
  app.add_option("--aio-block-size", a.aio.block_size, "disk tier: bytes per I/O request")
      ->check(at_least(int64_t{4096}));
  app.add_option("--aio-queue-depth", a.aio.queue_depth, "disk tier: I/O requests in flight")
      ->check(at_least(1));
  app.add_option("--aio-intra-op-parallelism", a.aio.intra_op_parallelism,
                 "disk tier: I/O rings (threads) a transfer is spread over")
      ->check(at_least(1));
  auto* o_batch = app.get_option("--batch-size");
  app.add_option("--ckpt-path", a.ckpt_path,
                 "resume from this checkpoint (e.g. DIR/last); --max-steps counts from the start");

  if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-train")) return *code;

  if (o_ds->count() > 0) {
    // train_micro_batch_size_per_gpu is --batch-size (per rank); both given must agree.
    try {
      fsdp::DeepSpeedTrainingConfig dt;
      fsdp::parse_deepspeed_config(a.deepspeed_config, &dt);
      if (dt.train_micro_batch_size_per_gpu) {
        if (o_batch->count() > 0 && a.batch_size != *dt.train_micro_batch_size_per_gpu) {
          std::cerr << "fsdp-train: error: --batch-size " << a.batch_size << " but the DeepSpeed "
                    << "config's train_micro_batch_size_per_gpu is "
                    << *dt.train_micro_batch_size_per_gpu << "; give one of them" << std::endl;
          return 2;
        }
        a.batch_size = *dt.train_micro_batch_size_per_gpu;
      }
    } catch (const c10::Error& e) {
      std::cerr << "fsdp-train: error: " << e.what_without_backtrace() << std::endl;
      return 2;
    }
  }

  ModelSpec spec;
  spec.name = a.model;
  spec.dropout = a.dropout;
  spec.activation_checkpointing = a.activation_checkpointing;
  for (auto* o : {o_nlayers, o_nhid, o_ninp, o_nhead}) {
    if (o->count() > 0 && a.model != "custom") {
      std::cerr << "fsdp-train: error: " << o->get_name() << " only applies to --model custom "
                << "(got --model " << a.model << ")" << std::endl;
      return 2;
    }
  }
  if (a.model == "custom") {
    if (a.ninp % a.nhead != 0) {
      std::cerr << "fsdp-train: error: --ninp " << a.ninp << " must be divisible by --nhead "
                << a.nhead << std::endl;
      return 2;
    }
    spec.custom.nlayers = a.nlayers;
    spec.custom.nhid = a.nhid;
    spec.custom.ninp = a.ninp;
    spec.custom.nhead = a.nhead;
  }
  for (auto* o : a.ddp_flags) {
    if (o->count() > 0 && !a.is_ddp()) {
      std::cerr << "fsdp-train: error: " << o->get_name() << " applies to --strategy ddp (got "
                << "--strategy " << a.strategy << " with " << a.world() << " rank(s))"
                << std::endl;
      return 2;
    }
  }
  if (a.ddp_comm_hook == "post_local_sgd" &&
      (pl.start_local_sgd_iter < 0 || d.model_averaging_period == 0)) {
    std::cerr << "fsdp-train: error: --ddp-comm-hook post_local_sgd needs --start-local-sgd-iter "
                 "N (global all-reduce for the first N steps; PyTorch has no default) and "
                 "--model-averaging-period P (average the parameters every P steps after that)"
              << std::endl;
    return 2;
  }
  if (a.ddp_comm_hook != "post_local_sgd" && d.model_averaging_period > 0) {
    std::cerr << "fsdp-train: error: --model-averaging-period applies to --ddp-comm-hook "
                 "post_local_sgd (got --ddp-comm-hook " << a.ddp_comm_hook << ")" << std::endl;
    return 2;
  }
  if (t.max_steps < 0 && t.max_epochs < 0 && a.data == "synthetic" && a.num_tokens == 0) {
    // Lightning would run 1000 epochs; say so rather than surprise.
    std::cerr << "fsdp-train: note: neither --max-steps nor --max-epochs set: up to 1000 epochs"
              << std::endl;
  }

  try {
    if (a.dry_run) return dry_run(a, spec);
    if (!a.save_batches.empty()) return save_batches(a);
    return run(a, spec);
  } catch (const std::exception& e) {
    fsdp::fail_rank(what_of(e));
  }
}
