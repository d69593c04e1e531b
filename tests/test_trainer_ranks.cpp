// Trainer at world 3, launched the way users launch it: the test re-runs this binary as a
// program whose Trainer(devices = 3) spawns the other ranks (fsdp::launch), so every rank runs
// the test body. Checks the global-mean loss, sync_dist metrics, per-rank memory results and
// rank-0-only logging.
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "testing.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>

namespace {
namespace fs = std::filesystem;

constexpr const char* kEnvInner = "FSDP_TEST_TRAINER_RANKS";
constexpr int64_t kVocab = 32;

struct RankLM : fsdp::LightningModule {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  void configure_model() override {
    if (emb) return;
    emb = register_module("emb", torch::nn::Embedding(kVocab, 16));
    head = register_module("head", torch::nn::Linear(16, kVocab));
  }
  at::Tensor loss_of(const fsdp::Batch& b) {
    return at::nll_loss(at::log_softmax(head(emb(b.input)), -1).reshape({-1, kVocab}),
                        b.target.reshape(-1));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor loss = loss_of(b);
    const double rank = trainer()->global_rank();
    fsdp::LogOptions synced, on_bar;
    synced.sync_dist = true;
    on_bar.prog_bar = true;
    log("loss_local", loss, on_bar);
    log("loss_synced", loss, synced);
    log("rank_local", rank);
    log("rank_synced", rank, synced);
    return loss;
  }
  at::Tensor validation_step(const fsdp::Batch& b, int64_t) override {
    fsdp::LogOptions synced;
    synced.sync_dist = true;
    synced.prog_bar = true;
    log("val_rank", static_cast<double>(trainer()->global_rank()), synced);
    log("val_rank_local", static_cast<double>(trainer()->global_rank()));
    return loss_of(b);
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01))};
  }
};

// The body every rank runs (inside the re-executed program).
void run_rank_body() {
  auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(kVocab, 20000, 1, 8);
  fsdp::DataLoader train(data, 2, fsdp::DistributedSampler(data->size(), 1, 0, true, 3), true);
  fsdp::DataLoader val(data, 2, fsdp::DistributedSampler(data->size(), 1, 0, false, 3), true);
  fsdp::TrainerOptions o;
  o.devices = 3;
  o.strategy = "ddp";
  o.max_steps = 3;
  o.limit_val_batches = 2;
  o.val_check_interval = 3;
  o.log_every_n_steps = 1;
  o.enable_progress_bar = true;
  o.seed = 5;
  o.default_root_dir = std::getenv(kEnvInner);
  fsdp::Trainer trainer(o);
  RankLM model;
  // Rank 0 draws the progress bar on stdout (plain lines: not a terminal here).
  std::ostringstream bar;
  std::streambuf* const saved = std::cout.rdbuf(bar.rdbuf());
  trainer.fit(model, train, val);
  std::cout.rdbuf(saved);

  const int rank = trainer.global_rank();
  const auto& r = trainer.results();
  EXPECT_EQ(trainer.world_size(), 3);
  ASSERT_EQ(r.losses.size(), 3u);
  EXPECT_EQ(r.peak_alloc_bytes.size(), 3u);
  EXPECT_EQ(r.peak_rss_bytes.size(), 3u);
  EXPECT_EQ(r.log_dir.empty(), rank != 0);  // CSV on rank 0 only

  // sync_dist averages over ranks; plain metrics stay local.
  EXPECT_NEAR(r.metrics.at("rank_synced"), 1.0, 1e-6);
  EXPECT_EQ(r.metrics.at("rank_local"), rank);
  EXPECT_NEAR(r.metrics.at("val_rank"), 1.0, 1e-6);
  EXPECT_EQ(r.metrics.at("val_rank_local"), rank);

  // The recorded loss is the global mean of the ranks' losses of the last step.
  at::Tensor local = at::tensor({r.metrics.at("loss_local")}, at::kFloat);
  trainer.world()->all_reduce(local, fsdp::ReduceOp::kSum);
  const double mean = local.item<double>() / 3;
  EXPECT_NEAR(r.losses.back(), mean, 1e-5 * mean);
  EXPECT_NEAR(r.metrics.at("loss_synced"), mean, 1e-5 * mean);
  // Ranks see different data: the local losses differ from the mean somewhere.
  at::Tensor spread = at::tensor({std::abs(r.metrics.at("loss_local") - mean)}, at::kFloat);
  trainer.world()->all_reduce(spread, fsdp::ReduceOp::kMax);
  EXPECT_GT(spread.item<double>(), 0);

  // The progress bar: one loss column. The module puts loss_local (logged without sync_dist) on
  // the bar, so the Trainer's own mean loss is not shown beside it, and the bar says the value is
  // rank 0's; the last line, drawn after the validation at that step, shows its metric.
  if (rank == 0) {
    const std::string out = bar.str();
    EXPECT_NE(out.find("| loss_local (rank 0) "), std::string::npos) << out;
    EXPECT_EQ(out.find("| loss "), std::string::npos) << out;
    const std::string last = out.substr(out.rfind("3/3"));
    EXPECT_NE(last.find("| val_rank 1"), std::string::npos) << out;
  }

  // Every rank's expectations, reported by rank 0 (which the outer test reads).
  at::Tensor failed = at::tensor({::testing::Test::HasFailure() ? 1L : 0L}, at::kLong);
  trainer.world()->all_reduce(failed, fsdp::ReduceOp::kSum);
  EXPECT_EQ(failed.item<int64_t>(), 0) << "ranks with failed expectations (see their output)";
}

TEST(TrainerRanks, GlobalLossSyncDistAndPerRankResultsAtWorld3) {
  if (const char* inner = std::getenv(kEnvInner); inner && *inner) {
    run_rank_body();
    return;
  }
  fs::path dir = fs::temp_directory_path() / ("fsdp_test_trainer_ranks_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto r = fsdp::testing::run_process(
      {self, "--gtest_filter=TrainerRanks.GlobalLossSyncDistAndPerRankResultsAtWorld3"},
      {{kEnvInner, dir.string()}, {"FSDP_NUM_THREADS", "1"}, {"GTEST_COLOR", "no"}}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out << r.err;
  EXPECT_TRUE(fs::exists(dir / "version_0" / "metrics.csv"));
  EXPECT_FALSE(fs::exists(dir / "version_1"));  // one logger for the run, not one per rank
  int event_files = 0;  // TensorBoard's, beside the CSV: rank 0's only
  for (const auto& e : fs::directory_iterator(dir / "version_0")) {
    event_files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  EXPECT_EQ(event_files, 1);
}

}  // namespace
