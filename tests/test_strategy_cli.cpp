// Strategies on the command line: fsdp-train and fsdp-finetune take every strategy name, and the
// flags that apply to it, from the registry (include/fsdp/strategy_registry.h) through the
// shared flags (apps/support/flags.h). A strategy registered by library code (here: by this
// test) is accepted by --strategy, listed by --help and built with its family's flags, with no
// change to the programs; a family's flag beside a strategy of another family is one sentence.
#include <gtest/gtest.h>

#include "cli.h"
#include "support/flags.h"
#include "testing.h"

#include <fsdp/fsdp.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <optional>

namespace {

using fsdp::StrategyFamily;
using fsdp::testing::error_of;
using fsdp::testing::run_process;

// A strategy the programs have never heard of: FSDP's engine under a name that does not start
// with "fsdp", so nothing but its registered family can give it the FSDP flags.
constexpr const char* kTwin = "twin_of_fsdp";
constexpr const char* kTwinHelp = "an FSDP strategy registered by tests/test_strategy_cli.cpp";

void register_twin() {
  static std::once_flag once;
  std::call_once(once, [] {
    fsdp::register_strategy({kTwin, kTwinHelp, StrategyFamily::kFSDP,
                             [](const fsdp::StrategyOptions& o) {
                               auto s = fsdp::make_fsdp_strategy("fsdp", o.fsdp);
                               s->set_name(kTwin);
                               return s;
                             }});
  });
}

// `names` without the strategy this test registers (absent from the programs it runs).
std::vector<std::string> built_in(std::vector<std::string> names) {
  names.erase(std::remove(names.begin(), names.end(), kTwin), names.end());
  return names;
}

// The shared flags as a program adds them, parsed from `args` (argv without the program name).
struct Cli {
  explicit Cli(fsdp::app::CommonFlagsSpec spec = {})
      : app("test program"), flags(app, args, std::move(spec)) {}

  // fsdp::cli::parse's exit status (nullopt: parsed) and, after a parse, CommonFlags::check's
  // sentence in `error`.
  std::optional<int> parse(std::vector<std::string> argv) {
    argv.insert(argv.begin(), "test-program");
    std::vector<const char*> c;
    for (const auto& a : argv) c.push_back(a.c_str());
    ::testing::internal::CaptureStderr();
    auto code = fsdp::cli::parse(app, static_cast<int>(c.size()), c.data(), "test-program");
    stderr_text = ::testing::internal::GetCapturedStderr();
    if (!code) error = flags.check();
    return code;
  }

  CLI::App app;
  fsdp::app::CommonArgs args;
  fsdp::app::CommonFlags flags;
  std::string error, stderr_text;
};

fsdp::app::CommonFlagsSpec finetune_spec() {
  fsdp::app::CommonFlagsSpec spec;
  spec.families = {StrategyFamily::kSingle, StrategyFamily::kDDP, StrategyFamily::kFSDP};
  spec.family_flags = false;
  return spec;
}

TEST(StrategyRegistry, EveryNameHasTheFamilyItsParserKnowsAndBuildsFromItsOptions) {
  EXPECT_EQ(built_in(fsdp::strategy_names(StrategyFamily::kFSDP)), fsdp::fsdp_strategy_names());
  EXPECT_EQ(fsdp::strategy_names(StrategyFamily::kDeepSpeed), fsdp::deepspeed_strategy_names());
  EXPECT_EQ(fsdp::strategy_names(StrategyFamily::kDDP), std::vector<std::string>{"ddp"});
  EXPECT_EQ(fsdp::strategy_names(StrategyFamily::kSingle), std::vector<std::string>{"single"});
  for (const auto& e : fsdp::strategy_entries()) {
    EXPECT_FALSE(e.help.empty()) << e.name;
    EXPECT_EQ(fsdp::strategy_entry(e.name).family, e.family) << e.name;
  }

  fsdp::StrategyOptions o;
  o.ddp.bucket_cap_mb = 5;
  o.fsdp.limit_all_gathers = true;
  o.deepspeed.reduce_bucket_size = 1234;
  using std::dynamic_pointer_cast;
  auto ddp = dynamic_pointer_cast<fsdp::DDPStrategy>(fsdp::make_strategy("ddp", o));
  ASSERT_TRUE(ddp);
  EXPECT_EQ(ddp->options().bucket_cap_mb, 5);
  auto fsdp_s = dynamic_pointer_cast<fsdp::FSDPStrategy>(fsdp::make_strategy("fsdp_no_shard", o));
  ASSERT_TRUE(fsdp_s);
  EXPECT_TRUE(fsdp_s->options().limit_all_gathers);
  EXPECT_EQ(fsdp_s->options().sharding_strategy, fsdp::ShardingStrategy::kNoShard);
  auto ds =
      dynamic_pointer_cast<fsdp::DeepSpeedStrategy>(fsdp::make_strategy("deepspeed_stage_1", o));
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->options().reduce_bucket_size, 1234);
  EXPECT_EQ(ds->options().stage, 1);
  EXPECT_EQ(fsdp::make_strategy("single")->name(), "single");

  EXPECT_EQ(fsdp::resolve_strategy_name("auto", 1), "single");
  EXPECT_EQ(fsdp::resolve_strategy_name("auto", 3), "ddp");
  EXPECT_EQ(fsdp::resolve_strategy_name("fsdp", 3), "fsdp");
  const std::string e = error_of([] { fsdp::strategy_entry("dpp"); });
  EXPECT_NE(e.find("unknown strategy 'dpp'"), std::string::npos) << e;
}

TEST(StrategyRegistry, RegistrationRefusesTakenEmptyAndIncompleteEntries) {
  register_twin();
  const auto make = [](const fsdp::StrategyOptions&) -> fsdp::StrategyPtr { return nullptr; };
  std::string e =
      error_of([&] { fsdp::register_strategy({"ddp", "again", StrategyFamily::kDDP, make}); });
  EXPECT_NE(e.find("'ddp' is already registered"), std::string::npos) << e;
  e = error_of([&] { fsdp::register_strategy({kTwin, "again", StrategyFamily::kFSDP, make}); });
  EXPECT_NE(e.find("already registered"), std::string::npos) << e;
  e = error_of([&] { fsdp::register_strategy({"auto", "", StrategyFamily::kDDP, make}); });
  EXPECT_NE(e.find("cannot name a strategy"), std::string::npos) << e;
  e = error_of([&] { fsdp::register_strategy({"", "", StrategyFamily::kDDP, make}); });
  EXPECT_NE(e.find("cannot name a strategy"), std::string::npos) << e;
  e = error_of([] { fsdp::register_strategy({"no_make", "", StrategyFamily::kDDP, nullptr}); });
  EXPECT_NE(e.find("has no make function"), std::string::npos) << e;
  const auto names = fsdp::strategy_names();
  EXPECT_EQ(std::count(names.begin(), names.end(), "ddp"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "no_make"), 0);
  EXPECT_EQ(names.back(), kTwin);  // after the built-in ones
}

// The claim of the registry: a new strategy needs no change to the programs.
TEST(StrategyCli, RegisteredStrategyIsAcceptedListedAndBuiltWithItsFamilysFlags) {
  register_twin();
  Cli cli;
  ASSERT_EQ(cli.parse({"--strategy", kTwin, "--devices", "2", "--limit-all-gathers",
                       "--sharding-strategy", "SHARD_GRAD_OP", "--wrap-policy", "size:1000",
                       "--hybrid-shard-size", "2"}),
            std::nullopt)
      << cli.stderr_text;
  EXPECT_EQ(cli.error, "");
  EXPECT_EQ(cli.flags.strategy_name(), kTwin);
  EXPECT_EQ(cli.flags.family(), StrategyFamily::kFSDP);
  auto s = std::dynamic_pointer_cast<fsdp::FSDPStrategy>(
      cli.flags.make_strategy(cli.flags.strategy_options({})));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->name(), kTwin);
  EXPECT_TRUE(s->options().limit_all_gathers);
  EXPECT_EQ(s->options().sharding_strategy, fsdp::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(s->options().hybrid_shard_size, 2);
  EXPECT_EQ(s->options().auto_wrap_policy.kind, fsdp::AutoWrapPolicy::Kind::kSize);
  EXPECT_EQ(s->options().auto_wrap_policy.min_num_params, 1000);

  // --help lists it with its line, and among the strategies the FSDP flags apply to.
  const std::string help = cli.app.help();
  EXPECT_NE(help.find(std::string(kTwin) + " "), std::string::npos) << help;
  EXPECT_NE(help.find(kTwinHelp), std::string::npos) << help;
  EXPECT_NE(help.find("or " + std::string(kTwin) + ")"), std::string::npos) << help;

  // Another family's flag with it is refused, naming the strategies that take the flag.
  Cli ddp_flag;
  ASSERT_EQ(ddp_flag.parse({"--strategy", kTwin, "--bucket-cap-mb", "5"}), std::nullopt);
  EXPECT_EQ(ddp_flag.error, "--bucket-cap-mb applies to --strategy ddp (got --strategy " +
                                std::string(kTwin) + " with 1 rank(s))");

  // fsdp-finetune offers the FSDP family: the new strategy too.
  Cli finetune(finetune_spec());
  ASSERT_EQ(finetune.parse({"--strategy", kTwin}), std::nullopt) << finetune.stderr_text;
  EXPECT_EQ(finetune.flags.family(), StrategyFamily::kFSDP);
}

TEST(StrategyCli, FamilyFlagsAreRefusedBesideAnotherFamilysStrategy) {
  const std::string fsdp_names = fsdp::app::strategy_flag_for(StrategyFamily::kFSDP);
  const std::string ds_names = fsdp::app::strategy_flag_for(StrategyFamily::kDeepSpeed);
  EXPECT_NE(fsdp_names.find("--strategy fsdp, fsdp_full_shard, "), std::string::npos) << fsdp_names;
  EXPECT_NE(ds_names.find("deepspeed_stage_3_offload_nvme"), std::string::npos) << ds_names;
  struct Case {
    std::vector<std::string> argv;
    std::string error;  // "" = accepted
  };
  const std::string config = R"({"zero_optimization": {"stage": 2}})";
  const std::vector<Case> cases = {
      {{"--strategy", "ddp", "--devices", "2", "--wrap-policy", "none"},
       "--wrap-policy applies to " + fsdp_names + " (got --strategy ddp with 2 rank(s))"},
      {{"--forward-prefetch"}, "--forward-prefetch applies to " + fsdp_names +
                                   " (got --strategy auto with 1 rank(s))"},
      {{"--strategy", "deepspeed_stage_3", "--sharding-strategy", "NO_SHARD"},
       "--sharding-strategy applies to " + fsdp_names},
      {{"--strategy", "fsdp", "--offload-optimizer-device", "nvme"},
       "--offload-optimizer-device applies to " + ds_names + " (got --strategy fsdp"},
      {{"--strategy", "ddp", "--devices", "2", "--deepspeed-config", config},
       "--deepspeed-config applies to " + ds_names},
      {{"--strategy", "deepspeed", "--ddp-comm-hook", "fp16_compress"},
       "--ddp-comm-hook applies to --strategy ddp (got --strategy deepspeed with 1 rank(s))"},
      {{"--strategy", "single", "--static-graph"}, "--static-graph applies to --strategy ddp"},
      // Each family's own flags.
      {{"--strategy", "fsdp_hybrid_shard", "--hybrid-shard-size", "1", "--wrap-policy", "none"},
       ""},
      {{"--devices", "2", "--bucket-cap-mb", "5", "--ddp-comm-hook", "fp16_compress"}, ""},
      {{"--strategy", "deepspeed_stage_3", "--offload-params-device", "nvme",
        "--offload-optimizer-device", "nvme", "--nvme-path", "/tmp"}, ""},
      {{"--deepspeed-config", config}, ""},  // auto with a config: deepspeed
      // The dry run plans FSDP and the disk tier whatever --strategy says; not DDP's hooks.
      {{"--dry-run", "--wrap-policy", "none", "--offload-optimizer-device", "nvme"}, ""},
      {{"--dry-run", "--bucket-cap-mb", "5"}, "--bucket-cap-mb applies to --strategy ddp"},
      // DDP's own combinations.
      {{"--devices", "2", "--ddp-comm-hook", "post_local_sgd"},
       "--ddp-comm-hook post_local_sgd needs --start-local-sgd-iter N"},
      {{"--devices", "2", "--model-averaging-period", "2"},
       "--model-averaging-period applies to --ddp-comm-hook post_local_sgd"},
  };
  for (const Case& c : cases) {
    Cli cli;
    std::string what;
    for (const auto& a : c.argv) what += a + " ";
    ASSERT_EQ(cli.parse(c.argv), std::nullopt) << what << cli.stderr_text;
    if (c.error.empty()) {
      EXPECT_EQ(cli.error, "") << what;
    } else {
      EXPECT_EQ(cli.error.find(c.error), 0u) << what << "\nexpected: " << c.error
                                             << "\ngot: " << cli.error;
    }
  }
  Cli with_config;
  ASSERT_EQ(with_config.parse({"--deepspeed-config", config}), std::nullopt);
  EXPECT_EQ(with_config.flags.strategy_name(), "deepspeed");
  EXPECT_EQ(with_config.flags.family(), StrategyFamily::kDeepSpeed);
}

TEST(StrategyCli, FinetuneOffersSingleDdpAndFsdpOnly) {
  for (const std::string& name : fsdp::strategy_names()) {
    Cli cli(finetune_spec());
    const bool deepspeed = fsdp::strategy_entry(name).family == StrategyFamily::kDeepSpeed;
    auto code = cli.parse({"--strategy", name});
    EXPECT_EQ(code, deepspeed ? std::optional<int>(2) : std::nullopt) << name << cli.stderr_text;
    if (deepspeed) {
      const std::string refusal =
          "--strategy: '" + name + "' is not one of: auto, single, ddp, fsdp";
      EXPECT_NE(cli.stderr_text.find(refusal), std::string::npos) << cli.stderr_text;
    }
  }
  Cli cli(finetune_spec());  // no family flags in fsdp-finetune: its model picks them
  EXPECT_EQ(cli.parse({"--strategy", "fsdp", "--wrap-policy", "none"}), 2);
  EXPECT_NE(cli.stderr_text.find("--wrap-policy"), std::string::npos) << cli.stderr_text;
}

// --- the programs themselves ---------------------------------------------------------------

int lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n')) +
         (!s.empty() && s.back() != '\n' ? 1 : 0);
}

TEST(StrategyCli, TrainHelpListsEveryRegisteredStrategyWithItsLine) {
  auto r = run_process({fsdp::testing::bin_path("fsdp-train"), "--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const auto& e : fsdp::strategy_entries()) {
    if (e.name == kTwin) continue;
    EXPECT_NE(r.out.find("  " + e.name + " "), std::string::npos) << e.name;
    EXPECT_NE(r.out.find(e.help), std::string::npos) << e.name << ": " << e.help;
  }
  // Each family's flags under a heading that names its strategies.
  for (const char* heading : {"FSDP (--strategy fsdp, fsdp_full_shard, ", "DDP (--strategy ddp):",
                              "DeepSpeed ZeRO (--strategy deepspeed, deepspeed_stage_1, "}) {
    EXPECT_NE(r.out.find(heading), std::string::npos) << heading << "\n" << r.out;
  }
}

TEST(StrategyCli, TrainRefusesAnotherFamilysFlagBeforeStartingAnything) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--strategy", "ddp", "--devices", "2", "--wrap-policy", "none"},
       "fsdp-train: error: --wrap-policy applies to --strategy fsdp, fsdp_full_shard, "},
      {{"--strategy", "ddp", "--devices", "2", "--wrap-policy", "none"},
       " (got --strategy ddp with 2 rank(s))"},
      {{"--strategy", "fsdp", "--offload-optimizer-device", "nvme", "--nvme-path", "/tmp"},
       "fsdp-train: error: --offload-optimizer-device applies to --strategy deepspeed, "
       "deepspeed_stage_1, "},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--max-steps", "1",
                                     "--no-progress-bar"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_process(argv, {}, 120);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos)
        << "expected: " << message << "\ngot: " << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
  }
}

TEST(StrategyCli, FinetuneTakesFsdpStrategiesFromTheRegistry) {
  const std::string finetune = fsdp::testing::bin_path("fsdp-finetune");
  if (!std::filesystem::exists(finetune)) GTEST_SKIP() << "[fsdp-skip] fsdp-finetune is not built";
  auto ok = run_process({finetune, "--preset", "llama-tiny", "--strategy", "fsdp_shard_grad_op",
                         "--devices", "2", "--dry-run"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("fsdp FULL_SHARD"), std::string::npos) << ok.out;
  auto bad = run_process({finetune, "--preset", "llama-tiny", "--strategy", "deepspeed"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--strategy: 'deepspeed' is not one of: auto, single, ddp, fsdp"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(lines(bad.err), 1) << bad.err;
}

}  // namespace
