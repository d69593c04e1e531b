// Checkpoints through the programs: fsdp-train --checkpoint-dir/--ckpt-path exact resume, a rank
// killed mid-save, a disk-offloaded run killed by SIGKILL and resumed, and fsdp-ckpt
// inspect/convert checked with an independent numpy reader.
#include "ckpt/safetensors.h"
#include "common/injected_hooks.h"
#include "fsdp/checkpoint.h"
#include "cli_test_util.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using fsdp::testing::run_process;
using json = nlohmann::json;

namespace {

std::string scratch(const std::string& name) {
  fs::path p = (fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test-cli" / name).lexically_normal();
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A tiny run: 4 batches per epoch so 6 steps cross an epoch boundary; --num-tokens fixed so the
// corpus does not depend on --max-steps.
std::vector<std::string> train_argv(const std::string& dir, int devices, int batch,
                                    int max_steps, const std::string& strategy) {
  return {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny",
          "--max-steps", std::to_string(max_steps), "--batch-size", std::to_string(batch),
          "--devices", std::to_string(devices), "--strategy", strategy, "--dropout", "0",
          "--seed", "7", "--num-tokens", "20000", "--limit-train-batches", "4",
          "--limit-val-batches", "0", "--no-progress-bar", "--default-root-dir", dir + "/logs"};
}

std::vector<double> run_losses(std::vector<std::string> argv, const std::string& summary,
                               const std::map<std::string, std::string>& env = {}) {
  argv.push_back("--summary-json");
  argv.push_back(summary);
  auto r = run_process(argv, env, 240);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(summary);
  if (!f) return {};
  return json::parse(f)["losses"].get<std::vector<double>>();
}

// The fsdp-train model as a plain module (vocabulary from the checkpoint).
struct PlainLM : fsdp::testing::TinyLM {
  int64_t vocab;
  explicit PlainLM(int64_t v) : vocab(v) {}
  void configure_model() override {
    if (!model) model = register_module("model", fsdp::demos::make_model(model_name, vocab, 0.0));
  }
};

int64_t vocab_of(const std::string& ckpt) {
  for (const auto& t : fsdp::inspect_checkpoint(ckpt).tensors) {
    if (t.name == "model.embedding.weight") return t.shape.at(0);
  }
  ADD_FAILURE() << "no model.embedding.weight in " << ckpt;
  return 0;
}

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Starts `argv` in the background in its own process group, stdout and stderr to `log`;
// returns its pid.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return pid;
}

}  // namespace

// 6 steps straight == 3 steps, save, resume, 3 steps: bitwise at the same world size and
// strategy, within 1e-6 at world 1 with the same global batch.
TEST(CheckpointCli, ExactResumeFsdpBitwiseAndAcrossWorlds) {
  for (std::string type : {"sharded", "full"}) {
    SCOPED_TRACE(type);
    std::string dir = scratch("resume-" + type);
    auto straight = run_losses(train_argv(dir, 2, 2, 6, "fsdp"), dir + "/straight.json");
    ASSERT_EQ(straight.size(), 6u);
    auto first = run_losses(plus(train_argv(dir, 2, 2, 3, "fsdp"),
                                 {"--checkpoint-dir", dir + "/ckpt", "--save-every-n-steps", "3",
                                  "--state-dict-type", type}),
                            dir + "/first.json");
    ASSERT_EQ(first.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(first[i], straight[i]);
    ASSERT_TRUE(fs::exists(dir + "/ckpt/step-3"));
    ASSERT_TRUE(fs::is_symlink(dir + "/ckpt/last"));
    EXPECT_EQ(fs::read_symlink(dir + "/ckpt/last").string(), "step-3");

    auto resumed = run_losses(plus(train_argv(dir, 2, 2, 6, "fsdp"),
                                   {"--ckpt-path", dir + "/ckpt/last"}),
                              dir + "/resumed.json");
    ASSERT_EQ(resumed.size(), 3u) << "--max-steps counts from the start of training";
    for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed[i], straight[3 + i]) << "step " << 3 + i;

    // Another world size, same global batch (1 x 4 == 2 x 2).
    auto single = run_losses(plus(train_argv(dir, 1, 4, 6, "single"),
                                  {"--ckpt-path", dir + "/ckpt/step-3"}),
                             dir + "/single.json");
    ASSERT_EQ(single.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(single[i], straight[3 + i], 1e-6 * std::abs(straight[3 + i])) << i;
    }
  }
}

// --save-top-k 2 --monitor train_loss keeps exactly the two steps with the lowest loss (the
// summary's losses say which); --every-n-epochs saves at epoch ends.
TEST(CheckpointCli, SaveTopKByMonitorAndEveryNEpochs) {
  std::string dir = scratch("topk");
  auto losses = run_losses(plus(train_argv(dir, 2, 2, 6, "fsdp"),
                                {"--checkpoint-dir", dir + "/ckpt", "--save-every-n-steps", "1",
                                 "--monitor", "train_loss", "--mode", "min", "--save-top-k", "2",
                                 "--state-dict-type", "sharded"}),
                           dir + "/topk.json");
  ASSERT_EQ(losses.size(), 6u);
  std::vector<int> order = {0, 1, 2, 3, 4, 5};
  std::sort(order.begin(), order.end(), [&](int a, int b) { return losses[a] < losses[b]; });
  std::set<int64_t> want = {order[0] + 1, order[1] + 1};  // steps are 1-based
  std::set<int64_t> kept;
  for (const auto& e : fs::directory_iterator(dir + "/ckpt")) {
    const std::string name = e.path().filename().string();
    if (name == "last" || name == ".fsdp-owner.json") continue;
    ASSERT_TRUE(name.rfind("step-", 0) == 0 || name.rfind("last-step-6-", 0) == 0) << name;
    EXPECT_NE(name.find("-train_loss="), std::string::npos) << name;
    kept.insert(fsdp::inspect_checkpoint(e.path().string()).progress.global_step);
  }
  if (want.count(6) == 0) want.insert(6);  // the separate `last` entry of step 6
  EXPECT_EQ(kept, want);
  EXPECT_EQ(fsdp::inspect_checkpoint(dir + "/ckpt/last").progress.global_step, 6);

  // 4 batches per epoch, 8 steps: epoch ends at steps 4 and 8, every one kept.
  std::string dir2 = scratch("epochs");
  run_losses(plus(train_argv(dir2, 2, 2, 8, "fsdp"),
                  {"--checkpoint-dir", dir2 + "/ckpt", "--every-n-epochs", "1"}),
             dir2 + "/epochs.json");
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir2 + "/ckpt")) {
    names.insert(e.path().filename().string());
  }
  EXPECT_EQ(names, (std::set<std::string>{"step-4", "step-8", "last", ".fsdp-owner.json"}));

  // The checkpoint flags without a directory are an error, not silently ignored.
  auto r = run_process(plus(train_argv(dir2, 1, 2, 1, "single"), {"--monitor", "val_loss"}), {},
                       60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("need --checkpoint-dir"), std::string::npos) << r.err;
}

// Run by CheckpointCli.RankKilledMidSaveLeavesPreviousCheckpoint in a fresh process, with this
// binary's own flags: a two-rank FSDP fit (the Trainer launches rank 1 by running this binary
// again, with the same flags) up to --max-steps, saving sharded checkpoints to --ckpt-dir every
// 2 steps when given, resumed from --resume when given; rank 0 writes the losses to --losses. With
// --crash-during-save=R:S rank R ends itself (exit status 86) in the middle of writing step S,
// through the hook a test installs (the library reads no variable for it).
TEST(CheckpointCrash, DISABLED_FitSavingEveryTwoSteps) {
  using fsdp::testing::command_line_flag;
  if (auto crash = command_line_flag("crash-during-save")) {
    const int rank = std::stoi(crash->substr(0, crash->find(':')));
    const int64_t step = std::stoll(crash->substr(crash->find(':') + 1));
    fsdp::detail::InjectedHooks hooks;
    hooks.during_checkpoint_save = [rank, step](int r, int64_t s) {
      if (r != rank || s != step) return;
      std::fprintf(stderr, "[test] injected crash: rank %d exits mid-save (step %lld)\n", r,
                   static_cast<long long>(s));
      std::fflush(stderr);
      ::_exit(86);
    };
    fsdp::detail::install_injected_hooks(hooks);
  }
  fsdp::TrainerOptions o;
  o.devices = 2;
  o.strategy = "fsdp";
  o.max_steps = std::stoll(command_line_flag("max-steps").value_or("6"));
  o.limit_train_batches = 4;
  o.limit_val_batches = 0;
  o.seed = 7;
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.logger = false;
  o.checkpoint_dir = command_line_flag("ckpt-dir").value_or("");
  o.save_every_n_steps = o.checkpoint_dir.empty() ? 0 : 2;
  o.state_dict_type = "sharded";
  fsdp::Trainer trainer(o);
  auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(fsdp::testing::kVocab, 20000, 7,
                                                             fsdp::testing::kSeq);
  fsdp::DataLoader loader(data, 2, fsdp::DistributedSampler(data->size()));
  fsdp::testing::TinyLM lm;
  if (auto resume = command_line_flag("resume")) {
    trainer.fit(lm, loader, *resume);
  } else {
    trainer.fit(lm, loader);
  }
  if (trainer.is_global_zero()) {
    std::ofstream(command_line_flag("losses").value()) << json{{"losses", trainer.results().losses}};
  }
}

// A rank that dies in the middle of writing step 4 leaves step-2 and `last` loadable.
TEST(CheckpointCli, RankKilledMidSaveLeavesPreviousCheckpoint) {
  auto child = [](const std::vector<std::string>& flags,
                  const std::map<std::string, std::string>& env = {}) {
    return run_process(plus({"/proc/self/exe",
                             "--gtest_filter=CheckpointCrash.DISABLED_FitSavingEveryTwoSteps",
                             "--gtest_also_run_disabled_tests"},
                            flags),
                       env, 240);
  };
  std::string dir = scratch("crash");
  auto r = child({"--ckpt-dir=" + dir + "/ckpt", "--crash-during-save=1:4",
                  "--losses=" + dir + "/crashed.json"});
  EXPECT_NE(r.exit_code, 0) << "the run should fail when rank 1 dies";
  EXPECT_NE(r.err.find("injected crash: rank 1 exits mid-save (step 4)"), std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step-2/metadata.json"));
  EXPECT_FALSE(fs::exists(dir + "/ckpt/step-4")) << "an incomplete save was published";
  EXPECT_EQ(fs::read_symlink(dir + "/ckpt/last").string(), "step-2");
  // `last` loads and resumes.
  r = child({"--resume=" + dir + "/ckpt/last", "--max-steps=4", "--losses=" + dir + "/resumed.json"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream resumed(dir + "/resumed.json");
  ASSERT_TRUE(resumed) << r.out << r.err;
  EXPECT_EQ(json::parse(resumed)["losses"].size(), 2u);
  auto info = fsdp::inspect_checkpoint(dir + "/ckpt/last");
  EXPECT_EQ(info.progress.global_step, 2);

  // The run's next save of step 4 removes and reuses the step-4.partial its interrupted save
  // left (Note [Interrupted saves] in src/ckpt/run_records.h); it used to stay for ever, and the
  // save went to step-4-v1.
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step-4.partial/.fsdp-save.json"));
  r = child({"--resume=" + dir + "/ckpt/last", "--ckpt-dir=" + dir + "/ckpt", "--max-steps=4",
             "--losses=" + dir + "/resaved.json"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step-4/metadata.json"));
  EXPECT_FALSE(fs::exists(dir + "/ckpt/step-4.partial"));
  EXPECT_FALSE(fs::exists(dir + "/ckpt/step-4-v1"));
  EXPECT_EQ(fs::read_symlink(dir + "/ckpt/last").string(), "step-4");
  EXPECT_EQ(fsdp::inspect_checkpoint(dir + "/ckpt/last").progress.global_step, 4);

  // A variable that once made the library crash a rank, left set in the environment, does
  // nothing: only the test's own flag installs the hook.
  const std::string left_set = scratch("crash-variable-left-set");
  r = child({"--ckpt-dir=" + left_set + "/ckpt", "--losses=" + left_set + "/losses.json"},
            {{"FSDP_TEST_CRASH_DURING_SAVE", "1:4"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(left_set + "/ckpt/step-4/metadata.json"));
  EXPECT_TRUE(fs::exists(left_set + "/ckpt/step-6/metadata.json"));
}

namespace {

// The run that saved a checkpoint (its metadata's integrity record; "" when it has none).
std::string run_of(const std::string& ckpt) {
  for (const char* meta : {"/metadata.json", "/meta.json"}) {
    std::ifstream in(ckpt + meta);
    if (!in) continue;
    json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.contains("integrity")) return j["integrity"].value("run_id", "");
  }
  return "";
}

// The lines of `text` that contain `what`.
std::vector<std::string> lines_with(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find(what) != std::string::npos) out.push_back(line);
  }
  return out;
}

std::string link_of(const std::string& path) {
  std::error_code ec;
  return fs::read_symlink(path, ec).string();
}

// Note [One last per run] in src/ckpt/run_records.h: a second run saving into a checkpoint
// directory keeps its own last-<run> and says so in one line; `last` stays the first run's, also
// when each of them resumes. Both used to move one `last`, so `--ckpt-path DIR/last` resumed
// whichever had saved most recently.
void one_last_per_run(int devices, const std::string& backend) {
  const std::string dir = scratch("owner-" + backend + std::to_string(devices));
  const std::string ck = dir + "/ckpt";
  auto fit = [&](int max_steps, const std::vector<std::string>& more) {
    auto r = run_process(plus(plus(train_argv(dir, devices, 2, max_steps, "fsdp"),
                                   {"--checkpoint-dir", ck, "--save-every-n-steps", "2",
                                    "--backend", backend}),
                              more),
                         {}, 240);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return lines_with(r.err, "[ModelCheckpoint] warning");
  };
  EXPECT_EQ(fit(2, {}).size(), 0u);
  ASSERT_EQ(link_of(ck + "/last"), "step-2");
  const std::string run_a = run_of(ck + "/step-2");
  ASSERT_FALSE(run_a.empty());

  // Another run in the same directory: its step-2 is step-2-v1, its link last-<its run>.
  auto warned = fit(4, {});
  const std::string run_b = run_of(ck + "/step-4");
  ASSERT_FALSE(run_b.empty());
  ASSERT_NE(run_a, run_b);
  const std::string own = "last-" + run_b.substr(0, 8);
  EXPECT_EQ(link_of(ck + "/last"), "step-2") << "the second run moved the first run's last";
  EXPECT_EQ(link_of(ck + "/" + own), "step-4");
  ASSERT_EQ(warned.size(), 1u);
  EXPECT_NE(warned[0].find("run " + run_a.substr(0, 8)), std::string::npos) << warned[0];
  EXPECT_NE(warned[0].find("--ckpt-path " + ck + "/" + own), std::string::npos) << warned[0];
  EXPECT_NE(warned[0].find("--ckpt-path " + ck + "/last"), std::string::npos) << warned[0];

  // Each resumes its own checkpoint and moves its own link.
  EXPECT_EQ(fit(4, {"--ckpt-path", ck + "/last"}).size(), 0u);
  EXPECT_EQ(link_of(ck + "/last"), "step-4-v1");
  EXPECT_EQ(run_of(ck + "/last"), run_a);
  EXPECT_EQ(fit(6, {"--ckpt-path", ck + "/" + own}).size(), 1u);
  EXPECT_EQ(link_of(ck + "/" + own), "step-6");
  EXPECT_EQ(run_of(ck + "/" + own), run_b);
  EXPECT_EQ(link_of(ck + "/last"), "step-4-v1");
}

// A full disk under --state-dict-type full (the file size limit as a full disk, as in
// test_disk_offload.cpp): one error line per rank -- the writing rank names the file and the
// error, the others the rank that failed and its error --, no stack trace, no staging directory
// left, and the previous checkpoint and `last` as they were. The failed write used to end rank 0
// inside the all-gathers, leaving an empty step-N.partial and a TCPStore stack trace on the other ranks.
void full_disk_under_full_format(int devices) {
  const std::string dir = scratch("full-disk-" + std::to_string(devices));
  const std::string ck = dir + "/ckpt";
  const auto flags = std::vector<std::string>{"--checkpoint-dir", ck, "--save-every-n-steps",
                                              "2", "--state-dict-type", "full", "--backend",
                                              "gloo"};
  auto r = run_process(plus(train_argv(dir, devices, 2, 2, "fsdp"), flags), {}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto before = fsdp::testing::snapshot(ck + "/step-2");
  const auto limit_kib = fs::file_size(ck + "/step-2/model.safetensors") / 2048;
  ASSERT_GT(limit_kib, 4u);
  r = run_process(plus({"/bin/bash", "-c",
                        "ulimit -f " + std::to_string(limit_kib) + " && trap '' XFSZ && "
                        "exec \"$@\"",
                        "bash"},
                       plus(train_argv(dir, devices, 2, 4, "fsdp"),
                            plus(flags, {"--ckpt-path", ck + "/last"}))),
                  {}, 240);
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  // The launcher shows the first rank that stops (and stops the others): whichever it is, its
  // line names the file and the error.
  const auto errors = lines_with(r.err, "[checkpoint]");
  EXPECT_GE(errors.size(), 1u) << r.err;
  EXPECT_LE(errors.size(), static_cast<size_t>(devices)) << r.err;
  for (const auto& line : errors) {
    EXPECT_NE(line.find("[checkpoint] saving " + ck + "/step-4 failed on "), std::string::npos)
        << line;
    EXPECT_NE(line.find("rank 0: " + ck + "/step-4.partial/model.safetensors"),
              std::string::npos) << line;
    EXPECT_NE(line.find("File too large"), std::string::npos) << line;
    EXPECT_NE(line.find("nothing was published"), std::string::npos) << line;
  }
  for (const char* trace : {"TCPStore", "Exception raised from", "frame #"}) {
    EXPECT_EQ(r.err.find(trace), std::string::npos) << trace << " in\n" << r.err;
  }
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(ck)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"step-2", "last", ".fsdp-owner.json"}));
  EXPECT_EQ(link_of(ck + "/last"), "step-2");
  EXPECT_EQ(fsdp::testing::snapshot(ck + "/step-2"), before);
}

}  // namespace

TEST(CheckpointCli, OneLastPerRunInASharedDirectoryGlooWorld2) { one_last_per_run(2, "gloo"); }
TEST(CheckpointCli, OneLastPerRunInASharedDirectoryGlooWorld3) { one_last_per_run(3, "gloo"); }
TEST(CheckpointCli, OneLastPerRunInASharedDirectoryMpiWorld3) { one_last_per_run(3, "mpi"); }
TEST(CheckpointCli, FullDiskUnderFullFormatIsOneLinePerRankGlooWorld2) {
  full_disk_under_full_format(2);
}
TEST(CheckpointCli, FullDiskUnderFullFormatIsOneLinePerRankGlooWorld3) {
  full_disk_under_full_format(3);
}

// fsdp-ckpt: inspect, consolidate a sharded checkpoint (read back with numpy), reshard to 3.
TEST(CheckpointCli, InspectAndConvertCheckedWithNumpy) {
  std::string dir = scratch("convert");
  auto losses = run_losses(plus(train_argv(dir, 2, 2, 2, "fsdp"),
                                {"--checkpoint-dir", dir + "/ckpt", "--save-every-n-steps", "2",
                                 "--state-dict-type", "sharded"}),
                           dir + "/s.json");
  ASSERT_EQ(losses.size(), 2u);
  const std::string ckpt = dir + "/ckpt/step-2";
  const std::string tool = fsdp::testing::bin_path("fsdp-ckpt");

  auto ins = run_process({tool, "inspect", "--json", ckpt});
  ASSERT_EQ(ins.exit_code, 0) << ins.err;
  auto info = json::parse(ins.out);
  EXPECT_EQ(info["type"], "sharded");
  EXPECT_EQ(info["world_size"], 2);
  EXPECT_EQ(info["global_step"], 2);
  EXPECT_GT(info["tensors"].size(), 4u);

  const std::string out = dir + "/model.safetensors";
  auto conv = run_process({tool, "convert", ckpt, out});
  ASSERT_EQ(conv.exit_code, 0) << conv.err;

  // Reference values: the sharded checkpoint loaded into a plain module.
  PlainLM lm(vocab_of(ckpt));
  lm.configure_model();
  fsdp::load_weights(lm, ckpt);
  auto py = run_process({FSDP_PYTHON, std::string(FSDP_SOURCE_DIR) +
                                                 "/tests/read_safetensors.py", out});
  ASSERT_EQ(py.exit_code, 0) << py.err;
  auto doc = json::parse(py.out)["tensors"];
  auto params = lm.named_parameters();
  ASSERT_EQ(doc.size(), params.size());
  for (auto& item : params) {
    ASSERT_TRUE(doc.contains(item.key())) << item.key();
    auto& t = doc[item.key()];
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), item.value().sizes().vec()) << item.key();
    auto flat = item.value().detach().reshape({-1});
    auto values = t["values"].get<std::vector<double>>();
    ASSERT_EQ(static_cast<int64_t>(values.size()), flat.numel());
    const float* p = flat.data_ptr<float>();
    for (int64_t i = 0; i < flat.numel(); ++i) {
      ASSERT_EQ(static_cast<float>(values[i]), p[i]) << item.key() << "[" << i << "]";
    }
  }

  // Reshard to 3 and back: identical weights.
  auto resh = run_process({tool, "convert", "--to", "sharded", "--world", "3", ckpt,
                           dir + "/w3"});
  ASSERT_EQ(resh.exit_code, 0) << resh.err;
  EXPECT_TRUE(fs::exists(dir + "/w3/shard-2-of-3.safetensors"));
  PlainLM lm3(lm.vocab);
  lm3.configure_model();
  for (auto& p : lm3.parameters()) {
    torch::NoGradGuard g;
    p.zero_();
  }
  fsdp::load_weights(lm3, dir + "/w3");
  auto p3 = lm3.named_parameters();
  for (auto& item : params) EXPECT_TRUE(at::equal(item.value(), p3[item.key()])) << item.key();
  // The resharded checkpoint keeps the optimizer state and progress.
  EXPECT_EQ(fsdp::inspect_checkpoint(dir + "/w3").progress.global_step, 2);

  // Errors: one line, exit 1.
  auto bad = run_process({tool, "inspect", dir});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("not a checkpoint"), std::string::npos) << bad.err;
}

namespace {

// A disk-offloaded run (`on_disk(max_steps)`: its argv, swap files under `nvme`) checkpointing
// every 2 steps is killed by SIGKILL once it has checkpointed twice: `last` is a complete
// checkpoint streamed from the swap files, and resuming from it gives the loss curve of a run
// that was never killed. The finished runs leave no swap files.
void kill_and_resume(const std::string& dir, const std::string& nvme,
                     const std::function<std::vector<std::string>(int)>& on_disk) {
  const pid_t pid = spawn(plus(on_disk(100000), {"--checkpoint-dir", dir + "/ckpt",
                                                 "--save-every-n-steps", "2"}),
                          dir + "/killed.log");
  ASSERT_GT(pid, 0);
  // Kill it once `last` is at step 4 or later (a checkpoint has replaced another).
  const auto start = std::chrono::steady_clock::now();
  bool ready = false;
  while (!ready && std::chrono::steady_clock::now() - start < std::chrono::seconds(120)) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) break;  // ended early: reported below
    try {
      ready = fs::exists(dir + "/ckpt/last") &&
              fsdp::inspect_checkpoint(dir + "/ckpt/last").progress.global_step >= 4;
    } catch (const std::exception&) {  // `last` being replaced right now
    }
    if (!ready) ::usleep(20000);
  }
  // fsdp-train spawned rank 1 (Gloo) with PR_SET_PDEATHSIG: it dies with rank 0. The whole
  // process group gets the signal too, in case.
  ::kill(-pid, SIGKILL);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(ready) << "no checkpoint at step >= 4 in 120 s:\n"
                     << fsdp::ckpt::read_file(dir + "/killed.log");
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  // SIGKILL runs no cleanup: the killed job's swap files stay behind (rank 1 dies with rank 0).
  EXPECT_FALSE(fs::is_empty(nvme)) << "the killed run left no swap files";
  ::usleep(200000);
  fs::remove_all(nvme);
  fs::create_directories(nvme);

  const int64_t k = fsdp::inspect_checkpoint(dir + "/ckpt/last").progress.global_step;
  EXPECT_EQ(k % 2, 0);
  ::usleep(500000);
  ASSERT_EQ(fsdp::inspect_checkpoint(dir + "/ckpt/last").progress.global_step, k)
      << "the killed job is still saving";
  auto straight = run_losses(on_disk(static_cast<int>(k) + 3), dir + "/straight.json");
  ASSERT_EQ(straight.size(), static_cast<size_t>(k + 3));
  auto resumed = run_losses(plus(on_disk(static_cast<int>(k) + 3),
                                 {"--ckpt-path", dir + "/ckpt/last"}),
                            dir + "/resumed.json");
  ASSERT_EQ(resumed.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i], straight[k + i]) << "step " << k + i << " (resumed from step " << k << ")";
  }
  EXPECT_TRUE(fs::is_empty(nvme)) << "swap files left by the finished runs";
}

}  // namespace

// The optimizer state on disk (ZeRO stage 2, offload_optimizer_device nvme).
TEST(CheckpointCli, DiskOffloadedRunKilledBySigkillResumes) {
  std::string dir = scratch("nvme-kill");
  const std::string nvme = dir + "/nvme";
  kill_and_resume(dir, nvme, [&](int max_steps) {
    return plus(train_argv(dir, 2, 2, max_steps, "deepspeed_stage_2"),
                {"--backend", "gloo", "--offload-optimizer-device", "nvme", "--nvme-path", nvme,
                 "--sub-group-size", "4096", "--state-dict-type", "sharded"});
  });
  if (HasFatalFailure()) return;

  // The full format (fsdp-train's default) would gather the moments whole: refused at setup.
  auto full = run_process(plus(train_argv(dir, 2, 2, 2, "deepspeed_stage_2"),
                               {"--offload-optimizer-device", "nvme", "--nvme-path", nvme,
                                "--checkpoint-dir", dir + "/ckpt-full", "--save-every-n-steps",
                                "1"}),
                          {}, 120);
  EXPECT_NE(full.exit_code, 0);
  EXPECT_NE(full.err.find("sharded format only"), std::string::npos) << full.err;
  EXPECT_NE(full.err.find("--state-dict-type sharded"), std::string::npos) << full.err;
  EXPECT_FALSE(fs::exists(dir + "/ckpt-full/step-1"));
}

// The parameters on disk too (stage 3, offload_params_device nvme; every unit on disk, the
// model built sharded): each checkpoint reads the units' records one at a time.
TEST(CheckpointCli, ParamsOnDiskRunKilledBySigkillResumes) {
  std::string dir = scratch("nvme-params-kill");
  const std::string nvme = dir + "/nvme";
  kill_and_resume(dir, nvme, [&](int max_steps) {
    return plus(train_argv(dir, 2, 2, max_steps, "deepspeed_stage_3"),
                {"--backend", "gloo", "--offload-optimizer-device", "nvme",
                 "--offload-params-device", "nvme", "--nvme-path", nvme, "--sub-group-size",
                 "4096", "--max-in-cpu", "0", "--stage3-param-persistence-threshold", "0",
                 "--state-dict-type", "sharded"});
  });
}

