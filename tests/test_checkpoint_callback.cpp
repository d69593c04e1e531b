// ModelCheckpoint through the Trainer, at world 2 (gloo, mpi) and 3 (mpi): top-k keeps exactly
// the best k by a monitored metric (min and max), every_n_epochs, every_n_train_steps with
// save_top_k = 1, save_last, a monitored metric that differs between ranks (rank 0's decides,
// so the collective saves stay matched), resuming from best_model_path gives the straight run's
// remaining losses bitwise, and the top-k list survives a resume (it is saved in the checkpoint).
//
// Like test_trainer_ranks.cpp, each test re-runs this binary as a program whose Trainer spawns
// the ranks; the epoch metric "score" follows a fixed script per epoch, so which entries must
// survive is known.
#include <gtest/gtest.h>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "testing.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

namespace {
namespace fs = std::filesystem;

constexpr const char* kEnvDir = "FSDP_TEST_MC_DIR";
constexpr const char* kEnvBackend = "FSDP_TEST_MC_BACKEND";
constexpr int64_t kVocab = 32;
// score of epoch e (sync_dist); rank_score is kScript on rank 0 and its negation elsewhere.
const std::vector<double> kScript = {5, 3, 4, 1, 2, 6};

struct ScoreLM : fsdp::LightningModule {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  void configure_model() override {
    if (emb) return;
    emb = register_module("emb", torch::nn::Embedding(kVocab, 16));
    head = register_module("head", torch::nn::Linear(16, kVocab));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor loss = at::nll_loss(
        at::log_softmax(head(emb(b.input)), -1).reshape({-1, kVocab}), b.target.reshape(-1));
    const double s = kScript.at(trainer()->current_epoch());
    fsdp::LogOptions epoch_synced;
    epoch_synced.on_step = false;
    epoch_synced.on_epoch = true;
    epoch_synced.sync_dist = true;
    log("score", s, epoch_synced);
    fsdp::LogOptions epoch_local = epoch_synced;
    epoch_local.sync_dist = false;
    log("rank_score", trainer()->global_rank() == 0 ? s : -s, epoch_local);
    return loss;
  }
  // val_score after global step s (validation runs after every training batch in the
  // mid-epoch test).
  at::Tensor validation_step(const fsdp::Batch&, int64_t) override {
    static const std::vector<double> kValScript = {0, 9, 4, 8, 1, 3, 7};
    fsdp::LogOptions synced;
    synced.sync_dist = true;
    log("val_score", kValScript.at(trainer()->global_step()), synced);
    return {};
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01)),
            nullptr};
  }
};

// Where the Trainer says it stands when on_fit_start runs (after a resume: the checkpoint's
// position, as Lightning's trainer.current_epoch / global_step).
struct FitStart : fsdp::Callback {
  int64_t epoch = -1, step = -1;
  void on_fit_start(fsdp::Trainer& t, fsdp::LightningModule&) override {
    epoch = t.current_epoch();
    step = t.global_step();
  }
};

fsdp::TrainerOptions trainer_options(int world, const std::string& backend) {
  fsdp::TrainerOptions o;
  o.devices = world;
  o.strategy = "fsdp";
  o.process_group_backend = backend;
  o.max_epochs = static_cast<int64_t>(kScript.size());
  o.limit_train_batches = 2;  // 2 optimizer steps per epoch
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.logger = false;
  o.seed = 5;
  o.state_dict_type = "sharded";
  return o;
}

struct Data {
  std::shared_ptr<fsdp::demos::SyntheticCorpus> corpus =
      std::make_shared<fsdp::demos::SyntheticCorpus>(kVocab, 2000, 1, 8);
  fsdp::DataLoader train{corpus, 2, fsdp::DistributedSampler(corpus->size(), 1, 0, true, 3), true};
};

// Checkpoint entries in dir (names), and no leftovers of saves or deletions. The directory's
// owner record (Note [One last per run] in src/ckpt/run_records.h) is not an entry.
std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename() != ".fsdp-owner.json") out.insert(e.path().filename().string());
  }
  return out;
}

int64_t saved_step(const std::string& entry) {
  return fsdp::inspect_checkpoint(entry).progress.global_step;
}

void expect_all_ranks_passed(fsdp::Trainer& trainer) {
  at::Tensor failed = at::tensor({::testing::Test::HasFailure() ? 1L : 0L}, at::kLong);
  trainer.world()->all_reduce(failed, fsdp::ReduceOp::kSum);
  EXPECT_EQ(failed.item<int64_t>(), 0) << "ranks with failed expectations (see their output)";
}

// world 2: top-2 by "score" (min), save_last, then resume from best_model_path.
void top_k_body(const std::string& dir, const std::string& backend) {
  Data data;
  fsdp::ModelCheckpointOptions mc;
  mc.dirpath = dir + "/topk";
  mc.filename = "{epoch}-{score:.1f}";
  mc.monitor = "score";
  mc.mode = "min";
  mc.save_top_k = 2;
  mc.save_last = true;
  auto cb = std::make_shared<fsdp::ModelCheckpoint>(mc);
  fsdp::TrainerOptions o = trainer_options(2, backend);
  o.callbacks = {cb};
  std::vector<double> straight;
  {
    fsdp::Trainer trainer(o);
    ScoreLM model;
    trainer.fit(model, data.train);
    straight = trainer.results().losses;
    ASSERT_EQ(straight.size(), 12u);

    // Scores 5 3 4 1 2 6: the best two are epochs 3 (1.0) and 4 (2.0); epoch 5 is `last` only.
    const std::string best = mc.dirpath + "/epoch=3-score=1.0";
    EXPECT_EQ(cb->best_model_path(), best);
    EXPECT_EQ(cb->best_model_score(), 1.0);
    EXPECT_EQ(cb->kth_best_model_path(), mc.dirpath + "/epoch=4-score=2.0");
    EXPECT_EQ(cb->best_k_models().size(), 2u);
    EXPECT_EQ(cb->last_model_path(), mc.dirpath + "/last-epoch=5-score=6.0");
    trainer.world()->barrier();  // rank 0's deletions are done
    EXPECT_EQ(entries(mc.dirpath),
              (std::set<std::string>{"epoch=3-score=1.0", "epoch=4-score=2.0",
                                     "last-epoch=5-score=6.0", "last"}));
    EXPECT_EQ(fs::read_symlink(mc.dirpath + "/last").string(), "last-epoch=5-score=6.0");
    EXPECT_EQ(saved_step(best), 8);                       // end of epoch 3
    EXPECT_EQ(saved_step(mc.dirpath + "/last"), 12);
    expect_all_ranks_passed(trainer);
  }
  {
    // Resume from the best entry: the remaining 4 steps equal the straight run's, bitwise.
    fsdp::TrainerOptions r = trainer_options(2, backend);
    auto start = std::make_shared<FitStart>();
    r.callbacks = {start};
    fsdp::Trainer trainer(r);
    ScoreLM model;
    trainer.fit(model, data.train, cb->best_model_path());
    EXPECT_EQ(start->step, 8);   // saved at the end of epoch 3
    EXPECT_EQ(start->epoch, 4);  // the epoch it continues with
    EXPECT_EQ(trainer.global_step(), 12);
    const auto& got = trainer.results().losses;
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], straight[8 + i]) << "step " << 9 + i << " after resuming from best";
    }
    expect_all_ranks_passed(trainer);
  }
  {
    // The top-k list is part of the checkpoint: 4 epochs, then a fresh callback resuming from
    // `last` for epochs 4 and 5 ends with the same entries as the straight 6 epochs (without the
    // restored list it would keep epochs 1, 3, 4 and 5).
    fsdp::ModelCheckpointOptions mc2 = mc;
    mc2.dirpath = dir + "/topk-resumed";
    auto first_cb = std::make_shared<fsdp::ModelCheckpoint>(mc2);
    fsdp::TrainerOptions a = trainer_options(2, backend);
    a.max_epochs = 4;
    a.callbacks = {first_cb};
    {
      fsdp::Trainer trainer(a);
      ScoreLM model;
      trainer.fit(model, data.train);
    }
    auto second_cb = std::make_shared<fsdp::ModelCheckpoint>(mc2);
    fsdp::TrainerOptions b = trainer_options(2, backend);
    b.callbacks = {second_cb};
    fsdp::Trainer trainer(b);
    ScoreLM model;
    trainer.fit(model, data.train, mc2.dirpath + "/last");
    trainer.world()->barrier();
    EXPECT_EQ(entries(mc2.dirpath),
              (std::set<std::string>{"epoch=3-score=1.0", "epoch=4-score=2.0",
                                     "last-epoch=5-score=6.0", "last"}));
    EXPECT_EQ(second_cb->best_model_path(), mc2.dirpath + "/epoch=3-score=1.0");
    EXPECT_EQ(second_cb->best_k_models().size(), 2u);
    expect_all_ranks_passed(trainer);
  }
}

// world 3: three callbacks at once.
void periods_body(const std::string& dir, const std::string& backend) {
  Data data;
  // (1) top-1 by a metric that differs per rank (mode max): rank 0's values decide.
  fsdp::ModelCheckpointOptions a;
  a.dirpath = dir + "/rank0";
  a.monitor = "rank_score";
  a.mode = "max";
  a.save_top_k = 1;
  // (2) every second epoch, all kept, default names.
  fsdp::ModelCheckpointOptions b;
  b.dirpath = dir + "/every2";
  b.every_n_epochs = 2;
  b.save_top_k = -1;
  // (3) every 3 steps, only the newest kept, with `last`.
  fsdp::ModelCheckpointOptions c;
  c.dirpath = dir + "/steps";
  c.filename = "step-{step}";
  c.auto_insert_metric_name = false;
  c.every_n_train_steps = 3;
  c.save_top_k = 1;
  c.save_last = true;
  auto ca = std::make_shared<fsdp::ModelCheckpoint>(a);
  auto cb = std::make_shared<fsdp::ModelCheckpoint>(b);
  auto cc = std::make_shared<fsdp::ModelCheckpoint>(c);
  fsdp::TrainerOptions o = trainer_options(3, backend);
  o.callbacks = {ca, cb, cc};
  fsdp::Trainer trainer(o);
  ScoreLM model;
  trainer.fit(model, data.train);
  trainer.world()->barrier();

  // (1) rank 0's script peaks at epoch 5 (6.0); the other ranks' values peak at epoch 3.
  EXPECT_EQ(entries(a.dirpath), (std::set<std::string>{"epoch=5-step=12"}));
  EXPECT_EQ(ca->best_model_path(), a.dirpath + "/epoch=5-step=12");
  EXPECT_EQ(ca->best_model_score(), 6.0);
  // (2) epochs 1, 3, 5 (every second one), none deleted.
  EXPECT_EQ(entries(b.dirpath), (std::set<std::string>{"epoch=1-step=4", "epoch=3-step=8",
                                                       "epoch=5-step=12"}));
  // (3) steps 3, 6, 9, 12 were saved; only the newest is kept and `last` points at it.
  EXPECT_EQ(entries(c.dirpath), (std::set<std::string>{"step-12", "last"}));
  EXPECT_EQ(fs::read_symlink(c.dirpath + "/last").string(), "step-12");
  EXPECT_EQ(saved_step(c.dirpath + "/last"), 12);
  expect_all_ranks_passed(trainer);
}

// world 2: validation inside the epoch (after every batch) saves on each validation end; top-2
// by val_score (max) keeps steps 1 (9) and 3 (8), which are not epoch ends (saving only at
// epoch ends, steps 2, 4, 6, would keep 6 and 2).
void mid_epoch_val_body(const std::string& dir, const std::string& backend) {
  Data data;
  fsdp::DataLoader val{data.corpus, 2, fsdp::DistributedSampler(data.corpus->size(), 1, 0, false, 3),
                       true};
  fsdp::ModelCheckpointOptions mc;
  mc.dirpath = dir + "/midval";
  mc.filename = "{step}-{val_score:.0f}";
  mc.monitor = "val_score";
  mc.mode = "max";
  mc.save_top_k = 2;
  auto cb = std::make_shared<fsdp::ModelCheckpoint>(mc);
  fsdp::TrainerOptions o = trainer_options(2, backend);
  o.max_epochs = 3;
  o.val_check_interval = 1;
  o.limit_val_batches = 1;
  o.callbacks = {cb};
  fsdp::Trainer trainer(o);
  ScoreLM model;
  trainer.fit(model, data.train, val);
  trainer.world()->barrier();
  EXPECT_EQ(entries(mc.dirpath), (std::set<std::string>{"step=1-val_score=9",
                                                         "step=3-val_score=8"}));
  EXPECT_EQ(cb->best_model_path(), mc.dirpath + "/step=1-val_score=9");
  EXPECT_EQ(saved_step(cb->kth_best_model_path()), 3);
  expect_all_ranks_passed(trainer);
}

// Runs `test` (this binary, one test) as a program with the env set; the Trainer launches the
// ranks from there.
void run_outer(const std::string& test, const std::string& backend) {
  fs::path dir = fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test-callback" / test;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto r = fsdp::testing::run_process({self, "--gtest_color=no", "--gtest_filter=ModelCheckpoint." + test},
                                      {{kEnvDir, dir.string()}, {kEnvBackend, backend},
                                       {"FSDP_NUM_THREADS", "1"}},
                                      300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out << r.err;
}

bool inner(std::string* dir, std::string* backend) {
  const char* d = std::getenv(kEnvDir);
  if (!d || !*d) return false;
  *dir = d;
  *backend = std::getenv(kEnvBackend);
  return true;
}

}  // namespace

TEST(ModelCheckpoint, TopKMinSaveLastAndResumeFromBestGlooWorld2) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return top_k_body(dir, backend);
  run_outer("TopKMinSaveLastAndResumeFromBestGlooWorld2", "gloo");
}

TEST(ModelCheckpoint, TopKMinSaveLastAndResumeFromBestMpiWorld2) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return top_k_body(dir, backend);
  run_outer("TopKMinSaveLastAndResumeFromBestMpiWorld2", "mpi");
}

TEST(ModelCheckpoint, RankLocalMonitorEveryNEpochsEveryNStepsMpiWorld3) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return periods_body(dir, backend);
  run_outer("RankLocalMonitorEveryNEpochsEveryNStepsMpiWorld3", "mpi");
}

TEST(ModelCheckpoint, MidEpochValidationTopKMaxGlooWorld2) {
  std::string dir, backend;
  if (inner(&dir, &backend)) return mid_epoch_val_body(dir, backend);
  run_outer("MidEpochValidationTopKMaxGlooWorld2", "gloo");
}

// A real directory under the name of `last` is not the callback's link: the save refuses,
// naming it, and never removes it or the user's files in it (it was renamed and removed before).
TEST(ModelCheckpoint, LastThatIsARealDirectoryIsNeverRemoved) {
  const fs::path dir =
      fs::temp_directory_path() / ("fsdp_mc_last_dir_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "last");
  { std::ofstream(dir / "last" / "mine.txt") << "keep"; }
  Data data;
  fsdp::ModelCheckpointOptions c;
  c.dirpath = dir.string();
  c.filename = "step-{step}";
  c.auto_insert_metric_name = false;
  c.every_n_train_steps = 1;
  c.save_top_k = -1;
  c.save_last = true;
  fsdp::TrainerOptions o = trainer_options(1, "gloo");
  o.max_epochs = 1;
  o.callbacks = {std::make_shared<fsdp::ModelCheckpoint>(c)};
  fsdp::Trainer trainer(o);
  ScoreLM model;
  std::string e;
  try {
    trainer.fit(model, data.train);
  } catch (const c10::Error& x) {
    e = x.what_without_backtrace();
  }
  EXPECT_NE(e.find((dir / "last").string() + " is a directory"), std::string::npos) << e;
  std::ifstream kept(dir / "last" / "mine.txt");
  std::string text;
  kept >> text;
  EXPECT_EQ(text, "keep");
  fs::remove_all(dir);
}

TEST(ModelCheckpoint, InvalidOptionsAreClearErrors) {
  auto error_of = [](fsdp::ModelCheckpointOptions o) -> std::string {
    try {
      fsdp::ModelCheckpoint cb(o);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  fsdp::ModelCheckpointOptions o;
  EXPECT_NE(error_of(o).find("dirpath is empty"), std::string::npos);
  o.dirpath = "x";
  EXPECT_EQ(error_of(o), "");
  o.save_top_k = 3;
  EXPECT_NE(error_of(o).find("without a monitor"), std::string::npos);
  o.monitor = "val_loss";
  o.mode = "best";
  EXPECT_NE(error_of(o).find("mode 'best'"), std::string::npos);

  // Names: Lightning's auto-inserted "name=value", a printf format, '/' replaced.
  fsdp::ModelCheckpointOptions n;
  n.dirpath = "x";
  n.filename = "{epoch}-{step}-{val/loss:.2f}";
  fsdp::ModelCheckpoint cb(n);
  EXPECT_EQ(cb.format_checkpoint_name(2, 30, {{"val/loss", 0.4567}}),
            "epoch=2-step=30-val_loss=0.46");
  n.filename = "";
  EXPECT_EQ(fsdp::ModelCheckpoint(n).format_checkpoint_name(0, 5, {}), "epoch=0-step=5");
}
