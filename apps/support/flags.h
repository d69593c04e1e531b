// The flags fsdp-train and fsdp-finetune share, and the one way both turn --strategy into a
// strategy: through the registry (include/fsdp/strategy_registry.h), never by matching names.
// A strategy the library registers appears in --strategy, in the help's list, and takes the
// flags of its family (StrategyFamily) with no change here.
//
//   fsdp::app::CommonArgs a;
//   fsdp::app::CommonFlags flags(app, a, spec);  // adds the flags to `app`
//   if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-train")) return *code;
//   if (auto why = flags.check(); !why.empty()) { /* "fsdp-train: error: " + why, exit 2 */ }
//   options.strategy = flags.make_strategy(flags.strategy_options(layer_types));
#pragma once

#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::app {

// The largest learning rate the programs accept (--lr, --learning-rate), the DeepSpeed config's
// bound too (src/common/limits.h): beyond it training only produces inf and nan.
constexpr double kMaxLearningRate = 1e3;

// What the shared flags set. The DeepSpeed flags keep "not given" values (0, -1, "") where the
// strategy's own default (or a --deepspeed-config) applies.
struct CommonArgs {
  TrainerOptions trainer;  // --devices, --backend, --precision, --seed, --no-progress-bar
  std::string strategy = "auto";  // "auto" or a registered name
  bool dry_run = false;
  std::string summary_json;
  // The family flags land here: --sharding-strategy ... in `options.fsdp`, --bucket-cap-mb ...
  // in `options.ddp`; the rest need a step to become options (strategy_options()).
  StrategyOptions options;
  std::string wrap_policy = "layers";  // FSDPOptions::auto_wrap_policy, from the model's layers
  std::string ddp_comm_hook = "none";  // DDPOptions' comm hook by name (include/fsdp/comm_hooks.h)
  std::string ddp_comm_wrapper = "none";
  PowerSGDOptions powersgd;
  PostLocalSGDOptions post_local_sgd;
  std::string deepspeed_config;          // DeepSpeedOptions::config
  // The offload flags, shared by FSDP (FSDPOptions::offload_policy) and DeepSpeed (its
  // offload_* options): "" where not given.
  std::string offload_optimizer_device;  // "" | "cpu" | "nvme"
  std::string offload_params_device;     // "" | "cpu" | "nvme" (FSDP, DeepSpeed stage 3)
  std::string nvme_path;
  AioOptions aio;
  double sub_group_size = 0;
  int64_t params_buffer_count = 0;
  double params_buffer_size = 0;
  double max_in_cpu = -1;
  int64_t persistence_threshold = -1;  // stage3_param_persistence_threshold

  int world() const { return trainer.devices * trainer.num_nodes; }
};

// How a program presents the shared flags.
struct CommonFlagsSpec {
  std::vector<StrategyFamily> families = strategy_families();  // whose strategies it offers
  bool family_flags = true;  // add the FSDP / DDP / DeepSpeed option flags of those families
  std::vector<std::string> precisions = Trainer::precision_names();
  std::string precision_help;
  std::string dry_run_help;
  std::string summary_json_help;
};

class CommonFlags {
 public:
  // Adds --devices, --strategy, --backend, --precision, --seed, --no-progress-bar, --dry-run,
  // --summary-json and the family flags to `app`, and the list of strategies to its help.
  CommonFlags(CLI::App& app, CommonArgs& args, CommonFlagsSpec spec);

  // --- After parsing.
  // The registered strategy --strategy names; "auto" is "deepspeed" with --deepspeed-config
  // (as Lightning's PL_DEEPSPEED_CONFIG_PATH), else single for one rank and ddp for more.
  std::string strategy_name() const;
  StrategyFamily family() const;
  // "" or the one sentence that refuses the command line: a family's flag given with a
  // strategy of another family (the offload flags belong to FSDP and DeepSpeed), or an
  // incomplete post_local_sgd. A dry run plans FSDP and the
  // disk tier whatever --strategy says, so there only the DDP flags are checked.
  std::string check() const;
  // The options the strategy is built from: the FSDP flags (--wrap-policy layers means
  // `layer_types`; the offload flags give its offload_policy), the DDP flags with their comm
  // hook, the DeepSpeed flags. Throws c10::Error for an offload flag beside a --deepspeed-config
  // (the config replaces the options).
  StrategyOptions strategy_options(const nn::ModuleTypes& layer_types) const;
  // The registry's strategy for strategy_name(), built from `options`.
  StrategyPtr make_strategy(const StrategyOptions& options) const;
  // The DeepSpeed config's train_micro_batch_size_per_gpu, when --deepspeed-config gives one.
  // Throws c10::Error for a bad config.
  std::optional<int64_t> deepspeed_micro_batch_size() const;

 private:
  struct FamilyFlags {
    std::vector<StrategyFamily> families;  // the flags apply to these families' strategies
    std::vector<CLI::Option*> options;
  };
  // Flags that apply to `families`' strategies (those this program offers), under a help
  // heading that names them.
  void add_family(std::vector<StrategyFamily> families, std::vector<CLI::Option*> options,
                  const std::string& title = {});
  void add_fsdp_flags(CLI::App& app);
  void add_ddp_flags(CLI::App& app);
  void add_deepspeed_flags(CLI::App& app);
  void add_offload_flags(CLI::App& app);  // FSDP and DeepSpeed
  bool offers(StrategyFamily family) const;

  CommonArgs& a_;
  CommonFlagsSpec spec_;
  std::vector<FamilyFlags> family_flags_;
};

// "--strategy ddp" or "--strategy a, b or c": the registered names of a family, for help
// and messages.
std::string strategy_flag_for(StrategyFamily family);
// The same for several families: "--strategy fsdp, ..., deepspeed, ... or deepspeed_stage_3".
std::string strategy_flag_for(const std::vector<StrategyFamily>& families);

// The loggers a --logger / --report-to choice names, under t.default_root_dir: "csv",
// "tensorboard", "none" (no logger), or both ("csv,tensorboard" / "all": the Trainer's default).
void set_loggers(TrainerOptions& t, const std::string& choice);

// The end of a program's main: returns what `body` returns; an exception ends every rank with
// its message on one line, without a backtrace (fsdp::fail_rank, exit status 1).
int run_or_fail(const std::function<int()>& body);

}  // namespace fsdp::app
