// Trainer, single process: the loop against a hand-written libtorch loop, accumulation,
// clipping, limits, validation, loggers (CSV, TensorBoard, user-defined), option errors, the
// strategy registry.
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "testing.h"
#include "train/progress_bar.h"
#include "train/tensorboard_logger.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <tuple>

namespace {
namespace fs = std::filesystem;

constexpr int64_t kVocab = 32;
constexpr int64_t kBlock = 8;

// A tiny language model: embedding -> linear -> log_softmax. Fast enough to take many steps.
struct TinyLM : fsdp::LightningModule {
  double lr = 0.05;
  std::string optimizer = "adam";
  int configure_calls = 0;
  std::function<void(torch::optim::Optimizer&)> before_step;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};

  void configure_model() override {
    ++configure_calls;
    if (emb) return;
    emb = register_module("emb", torch::nn::Embedding(kVocab, 16));
    head = register_module("head", torch::nn::Linear(16, kVocab));
  }
  at::Tensor loss_of(const fsdp::Batch& b) {
    at::Tensor logp = at::log_softmax(head(emb(b.input)), -1).reshape({-1, kVocab});
    return at::nll_loss(logp, b.target.reshape(-1));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor loss = loss_of(b);
    fsdp::LogOptions o;
    o.prog_bar = true;
    log("train_loss", loss, o);
    log("tokens", static_cast<double>(b.input.numel()));
    return loss;
  }
  at::Tensor validation_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor loss = loss_of(b);
    log("val_loss", loss);
    return loss;
  }
  at::Tensor predict_step(const fsdp::Batch& b, int64_t) override {
    return head(emb(b.input)).argmax(-1);
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    if (optimizer == "sgd") {
      return {std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(lr))};
    }
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(lr))};
  }
  void on_before_optimizer_step(torch::optim::Optimizer& o) override {
    if (before_step) before_step(o);
  }
};

std::shared_ptr<fsdp::demos::SyntheticCorpus> corpus(int64_t tokens = 20000) {
  return std::make_shared<fsdp::demos::SyntheticCorpus>(kVocab, tokens, /*seed=*/1, kBlock);
}

fsdp::DataLoader loader(const fsdp::DatasetPtr& data, int64_t batch = 4, bool shuffle = true) {
  return fsdp::DataLoader(data, batch,
                          fsdp::DistributedSampler(data->size(), 1, 0, shuffle, /*seed=*/3),
                          /*drop_last=*/true);
}

std::string temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("fsdp_test_trainer_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

fsdp::TrainerOptions quiet_options(const std::string& name) {
  fsdp::TrainerOptions o;
  o.enable_progress_bar = false;
  o.enable_summary = false;
  o.default_root_dir = temp_dir(name);
  o.seed = 5;
  return o;
}

using fsdp::testing::error_of;

// metrics.csv as {column: [(step, value)]}, empty cells left out.
std::map<std::string, std::vector<std::pair<int64_t, double>>> read_metrics_csv(
    const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f) << path;
  std::string line;
  std::getline(f, line);
  std::vector<std::string> cols;
  {
    std::stringstream ss(line);
    for (std::string c; std::getline(ss, c, ',');) cols.push_back(c);
  }
  std::map<std::string, std::vector<std::pair<int64_t, double>>> out;
  while (std::getline(f, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string c; std::getline(ss, c, ',');) cells.push_back(c);
    cells.resize(cols.size());
    const int64_t step = std::stoll(cells[0]);
    for (size_t i = 2; i < cols.size(); ++i) {
      if (!cells[i].empty()) out[cols[i]].push_back({step, std::stod(cells[i])});
    }
  }
  return out;
}


TEST(Trainer, FitRunsMaxStepsAndRecordsFiniteLosses) {
  auto data = corpus();
  auto train = loader(data);
  TinyLM model;
  auto o = quiet_options("max_steps");
  o.max_steps = 7;
  fsdp::Trainer trainer(o);
  EXPECT_EQ(trainer.strategy()->name(), "single");  // "auto" with one rank
  EXPECT_EQ(trainer.world_size(), 1);
  EXPECT_TRUE(trainer.is_global_zero());
  trainer.fit(model, train);
  const auto& r = trainer.results();
  EXPECT_EQ(r.steps, 7);
  EXPECT_EQ(trainer.global_step(), 7);
  ASSERT_EQ(r.losses.size(), 7u);
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_EQ(r.params, kVocab * 16 + 16 * kVocab + kVocab);
  EXPECT_GT(r.it_per_s, 0);
  ASSERT_EQ(r.peak_alloc_bytes.size(), 1u);
  EXPECT_GT(r.peak_alloc_bytes[0], 0);
  EXPECT_EQ(model.configure_calls, 1);
  EXPECT_EQ(model.trainer(), &trainer);
}

// The Trainer with accumulate_grad_batches = k must equal the textbook loop: every micro-batch's
// loss divided by k before backward, one optimizer step per k micro-batches.
TEST(Trainer, AccumulateGradBatchesMatchesHandWrittenLoop) {
  constexpr int64_t k = 3, steps = 4;
  auto data = corpus();

  TinyLM model;
  {
    auto train = loader(data);
    auto o = quiet_options("accumulate");
    o.max_steps = steps;
    o.accumulate_grad_batches = k;
    fsdp::Trainer trainer(o);
    trainer.fit(model, train);
    EXPECT_EQ(trainer.results().micro_batches, k * steps);
  }

  TinyLM ref;
  fsdp::seed_everything(5);  // what the Trainer does before configure_model (seed = 5)
  ref.configure_model();
  auto opt = ref.configure_optimizers().optimizer;
  auto ref_loader = loader(data);
  ref_loader.set_epoch(0);
  std::vector<double> ref_losses;
  for (int64_t s = 0; s < steps; ++s) {
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      at::Tensor loss = ref.loss_of(ref_loader.batch(s * k + j));
      (loss / static_cast<double>(k)).backward();
      sum += loss.item<double>();
    }
    opt->step();
    opt->zero_grad();
    ref_losses.push_back(sum / k);
  }

  auto p = model.named_parameters();
  auto q = ref.named_parameters();
  ASSERT_EQ(p.size(), q.size());
  for (const auto& kv : p) {
    EXPECT_TRUE(at::allclose(kv.value(), q[kv.key()], 1e-6, 1e-7)) << kv.key();
  }
}

TEST(Trainer, AccumulatedLossesEqualHandWrittenLoop) {
  constexpr int64_t k = 2, steps = 3;
  auto data = corpus();
  TinyLM model;
  auto train = loader(data);
  auto o = quiet_options("accumulate_losses");
  o.max_steps = steps;
  o.accumulate_grad_batches = k;
  fsdp::Trainer trainer(o);
  trainer.fit(model, train);
  const auto losses = trainer.results().losses;

  TinyLM ref;
  fsdp::seed_everything(5);
  ref.configure_model();
  auto opt = ref.configure_optimizers().optimizer;
  auto ref_loader = loader(data);
  ASSERT_EQ(losses.size(), static_cast<size_t>(steps));
  for (int64_t s = 0; s < steps; ++s) {
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      at::Tensor loss = ref.loss_of(ref_loader.batch(s * k + j));
      (loss / static_cast<double>(k)).backward();
      sum += loss.item<double>();
    }
    opt->step();
    opt->zero_grad();
    EXPECT_NEAR(losses[s], sum / k, 1e-6 * std::abs(sum / k)) << "step " << s;
  }
}

// With plain SGD (lr 1) the update is minus the clipped gradient: its norm must be the clip
// value and its direction the unclipped gradient's.
TEST(Trainer, GradientClippingClipsToTheGlobalNorm) {
  auto data = corpus();
  auto train = loader(data);
  TinyLM model;
  model.optimizer = "sgd";
  model.lr = 1.0;
  const double clip = 0.05;
  std::vector<at::Tensor> before, grads;
  double unclipped_norm = 0;
  model.before_step = [&](torch::optim::Optimizer&) {
    double sq = 0;
    for (auto& p : model.parameters()) {
      before.push_back(p.detach().clone());
      grads.push_back(p.grad().detach().clone());
      sq += p.grad().pow(2).sum().item<double>();
    }
    unclipped_norm = std::sqrt(sq);
  };
  auto o = quiet_options("clip");
  o.max_steps = 1;
  o.gradient_clip_val = clip;
  fsdp::Trainer trainer(o);
  trainer.fit(model, train);

  ASSERT_GT(unclipped_norm, 4 * clip) << unclipped_norm;  // the test only means something if clipping happens
  double delta_sq = 0;
  auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor delta = before[i] - params[i].detach();
    delta_sq += delta.pow(2).sum().item<double>();
    // atol: the update is read back as a difference of fp32 parameters of magnitude ~1.
    EXPECT_TRUE(at::allclose(delta, grads[i] * (clip / unclipped_norm), 1e-3, 1e-6));
  }
  EXPECT_NEAR(std::sqrt(delta_sq), clip, 1e-3 * clip);
}

TEST(Trainer, LimitTrainBatchesAndMaxEpochs) {
  auto data = corpus();
  auto train = loader(data);
  TinyLM model;
  auto o = quiet_options("limit");
  o.max_epochs = 2;
  o.limit_train_batches = 3;
  fsdp::Trainer trainer(o);
  trainer.fit(model, train);
  EXPECT_EQ(trainer.results().epochs, 2);
  EXPECT_EQ(trainer.results().steps, 6);
  EXPECT_EQ(trainer.results().micro_batches, 6);

  // Accumulation across an epoch boundary: 5 batches per epoch, k = 2 -> steps at batches
  // 2, 4 and the epoch's last one (Lightning steps at the end of an epoch).
  TinyLM model2;
  auto o2 = quiet_options("limit_acc");
  o2.max_epochs = 2;
  o2.limit_train_batches = 5;
  o2.accumulate_grad_batches = 2;
  fsdp::Trainer trainer2(o2);
  trainer2.fit(model2, train);
  EXPECT_EQ(trainer2.results().steps, 6);
  EXPECT_EQ(trainer2.results().micro_batches, 10);
}

TEST(Trainer, ValidateReturnsTheMeanOfLoggedMetrics) {
  auto data = corpus();
  auto val = loader(data, 4, /*shuffle=*/false);
  TinyLM model;
  auto o = quiet_options("validate");
  o.limit_val_batches = 5;
  fsdp::Trainer trainer(o);
  auto metrics = trainer.validate(model, val);
  ASSERT_EQ(metrics.count("val_loss"), 1u);

  torch::NoGradGuard g;
  double sum = 0;
  for (int i = 0; i < 5; ++i) sum += model.loss_of(val.batch(i)).item<double>();
  EXPECT_NEAR(metrics["val_loss"], sum / 5, 1e-6);
  EXPECT_TRUE(model.is_training());  // validate restores the mode it found
}

TEST(Trainer, PredictReturnsOneOutputPerBatchWithoutGrad) {
  auto data = corpus(400);  // 49 blocks of 8 -> 12 full batches of 4
  auto l = loader(data, 4, false);
  TinyLM model;
  fsdp::Trainer trainer(quiet_options("predict"));
  auto out = trainer.predict(model, l);
  ASSERT_EQ(static_cast<int64_t>(out.size()), l.num_batches());
  EXPECT_EQ(out.size(), 12u);
  EXPECT_EQ(out[0].sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_TRUE(trainer.test(model, l).empty());  // no test_step: nothing logged
}

TEST(Trainer, FitValidatesAtTheConfiguredInterval) {
  auto data = corpus();
  auto train = loader(data);
  auto val = loader(data, 4, false);
  TinyLM model;
  auto o = quiet_options("val_interval");
  o.max_steps = 4;
  o.val_check_interval = 2;
  o.limit_val_batches = 2;
  o.log_every_n_steps = 1;
  fsdp::Trainer trainer(o);
  trainer.fit(model, train, val);
  const auto& r = trainer.results();
  ASSERT_EQ(r.metrics.count("val_loss"), 1u);
  const auto val_rows = read_metrics_csv(r.log_dir + "/metrics.csv")["val_loss"].size();
  EXPECT_EQ(val_rows, 2u);  // after training batches 2 and 4
}

TEST(Trainer, CsvLoggerWritesLoggedColumnsInNewVersions) {
  auto data = corpus();
  auto train = loader(data);
  auto o = quiet_options("csv");
  o.max_steps = 6;
  o.log_every_n_steps = 2;
  std::string first_dir;
  for (int run = 0; run < 2; ++run) {
    TinyLM model;
    fsdp::Trainer trainer(o);
    trainer.fit(model, train);
    const std::string dir = trainer.results().log_dir;
    EXPECT_EQ(fs::path(dir).filename().string(), "version_" + std::to_string(run));
    std::ifstream f(dir + "/metrics.csv");
    ASSERT_TRUE(f) << dir;
    std::string header;
    std::getline(f, header);
    EXPECT_EQ(header, "step,epoch,tokens,train_loss");
    std::vector<std::string> rows;
    for (std::string line; std::getline(f, line);) rows.push_back(line);
    ASSERT_EQ(rows.size(), 3u);  // steps 2, 4, 6
    EXPECT_EQ(rows[0].rfind("2,0,32,", 0), 0u) << rows[0];
    // The logged train_loss at step 6 is the last micro-batch's loss there.
    double logged = std::stod(rows[2].substr(rows[2].rfind(',') + 1));
    EXPECT_NEAR(logged, trainer.results().losses[5], 1e-6);
  }
}

TEST(Loggers, Crc32cIsCastagnoli) {
  // The check value of CRC-32C (RFC 3720, B.4), and TFRecord's mask of it.
  EXPECT_EQ(fsdp::detail::crc32c("123456789", 9), 0xE3069283u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(fsdp::detail::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
  EXPECT_EQ(fsdp::detail::crc32c("", 0), 0u);
}

// The default loggers write one version_N holding metrics.csv and a TensorBoard event file;
// TensorBoard's own EventAccumulator reads every logged value back at its step (as float32),
// and every record's framing CRCs are checked independently of the writer.
TEST(Loggers, DefaultCsvAndTensorBoardAgreeAndTensorBoardReadsThem) {
  auto data = corpus();
  auto train = loader(data);
  auto val = loader(data, 4, false);
  TinyLM model;
  auto o = quiet_options("tensorboard");
  o.max_steps = 6;
  o.log_every_n_steps = 2;
  o.val_check_interval = 3;
  o.limit_val_batches = 2;
  fsdp::Trainer trainer(o);
  trainer.fit(model, train, val);
  const std::string dir = trainer.results().log_dir;
  ASSERT_FALSE(dir.empty());
  auto csv = read_metrics_csv(dir + "/metrics.csv");
  ASSERT_EQ(csv.count("train_loss"), 1u);
  ASSERT_EQ(csv.count("val_loss"), 1u);
  EXPECT_EQ(csv["train_loss"].size(), 3u);  // steps 2, 4, 6
  EXPECT_EQ(csv["val_loss"].size(), 2u);    // after training batches 3 and 6

  auto res = fsdp::testing::run_process(
      {FSDP_PYTHON, std::string(FSDP_SOURCE_DIR) + "/tests/read_tensorboard.py", dir});
  ASSERT_EQ(res.exit_code, 0) << res.err;
  auto doc = nlohmann::json::parse(res.out);
  ASSERT_EQ(doc["records"].size(), 1u) << res.out;  // one event file
  size_t csv_rows = 0;
  {
    std::ifstream f(dir + "/metrics.csv");
    for (std::string line; std::getline(f, line);) ++csv_rows;
  }
  // The file_version event, then one event per CSV row (the header is not a row).
  EXPECT_EQ(doc["records"].begin()->get<size_t>(), csv_rows) << res.out;
  const auto& scalars = doc["scalars"];
  for (const auto& [name, points] : csv) {
    ASSERT_TRUE(scalars.contains(name)) << name << " missing from " << res.out;
    const auto& tb = scalars[name];
    ASSERT_EQ(tb.size(), points.size()) << name;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(tb[i][0].get<int64_t>(), points[i].first) << name << " #" << i;
      EXPECT_EQ(tb[i][1].get<float>(), static_cast<float>(points[i].second)) << name << " #" << i;
    }
  }
  ASSERT_TRUE(scalars.contains("epoch"));
  EXPECT_EQ(scalars["epoch"].size(), csv_rows - 1);
  EXPECT_EQ(scalars.size(), csv.size() + 1) << res.out;  // nothing else
}

// A user-defined logger, as Lightning's Logger: the Trainer calls every logger in
// TrainerOptions::loggers with the same rows, sets each up once and finalizes each at the end;
// the default directory is not created then. logger = false calls none.
struct RecordingLogger : fsdp::Logger {
  std::string dir;
  int setups = 0;
  int finalizes = 0;
  std::vector<std::tuple<int64_t, int64_t, std::map<std::string, double>>> rows;
  explicit RecordingLogger(std::string d) : dir(std::move(d)) {}
  void setup() override { ++setups; }
  void log_metrics(const std::map<std::string, double>& m, int64_t step, int64_t epoch) override {
    rows.emplace_back(step, epoch, m);
  }
  void finalize() override { ++finalizes; }
  std::string log_dir() const override { return dir; }
};

TEST(Loggers, EveryLoggerInTheListGetsEveryRow) {
  auto data = corpus();
  auto train = loader(data);
  auto o = quiet_options("user_loggers");
  o.max_steps = 4;
  o.log_every_n_steps = 2;
  auto a = std::make_shared<RecordingLogger>("dir-a");
  auto b = std::make_shared<RecordingLogger>("dir-b");
  o.loggers = {a, b};
  {
    TinyLM model;
    fsdp::Trainer trainer(o);
    trainer.fit(model, train);
    EXPECT_EQ(trainer.results().log_dir, "dir-a");
    ASSERT_EQ(a->rows.size(), 2u);  // steps 2 and 4
    EXPECT_EQ(std::get<0>(a->rows[0]), 2);
    EXPECT_EQ(std::get<0>(a->rows[1]), 4);
    EXPECT_NEAR(std::get<2>(a->rows[1]).at("train_loss"), trainer.results().losses[3], 1e-6);
    EXPECT_EQ(a->rows, b->rows);
    EXPECT_EQ(a->setups, 1);
    EXPECT_EQ(b->finalizes, 1);
    EXPECT_FALSE(fs::exists(o.default_root_dir));  // no default logger wrote there
  }
  o.logger = false;
  {
    TinyLM model;
    fsdp::Trainer trainer(o);
    trainer.fit(model, train);
    EXPECT_EQ(trainer.results().log_dir, "");
    EXPECT_EQ(a->rows.size(), 2u);
    EXPECT_EQ(a->setups, 1);
  }
}

// A logger never overwrites a file it did not create: a CSVLogger pointed at an existing
// version's metrics.csv refuses before the first step, naming the file; TensorBoard's event file
// takes a name nothing else has.
TEST(Loggers, ExplicitVersionNeverOverwritesAnotherRunsFiles) {
  auto data = corpus();
  auto train = loader(data);
  auto o = quiet_options("explicit_version");
  const fs::path v0 = fs::path(o.default_root_dir) / "version_0";
  fs::create_directories(v0);
  { std::ofstream(v0 / "metrics.csv") << "step,epoch,theirs\n1,0,42\n"; }
  o.max_steps = 2;
  o.log_every_n_steps = 1;
  o.loggers = {std::make_shared<fsdp::CSVLogger>(o.default_root_dir, 0)};
  TinyLM model;
  fsdp::Trainer trainer(o);
  std::string e = error_of([&] { trainer.fit(model, train); });
  EXPECT_NE(e.find((v0 / "metrics.csv").string()), std::string::npos) << e;
  EXPECT_NE(e.find("another run"), std::string::npos) << e;
  std::ifstream f(v0 / "metrics.csv");
  std::stringstream kept;
  kept << f.rdbuf();
  EXPECT_EQ(kept.str(), "step,epoch,theirs\n1,0,42\n");

  // Two TensorBoard loggers on one explicit version: two event files, neither overwritten.
  auto tb1 = std::make_shared<fsdp::TensorBoardLogger>(o.default_root_dir, 0);
  auto tb2 = std::make_shared<fsdp::TensorBoardLogger>(o.default_root_dir, 0);
  tb1->setup();
  tb2->setup();
  EXPECT_NE(tb1->path(), tb2->path());
  EXPECT_EQ(fs::path(tb1->path()).parent_path(), v0);
  tb1->log_metrics({{"x", 1.0}}, 1, 0);
  tb2->finalize();
  tb1->finalize();
  EXPECT_GT(fs::file_size(tb1->path()), fs::file_size(tb2->path()));
  fs::remove_all(o.default_root_dir);  // this test's own directory (temp_dir made it)
}

// A single-device strategy that records what the model's construction tells it.
struct RecordingStrategy : fsdp::SingleDeviceStrategy {
  std::vector<const torch::nn::Module*> built, wrapped;
  void on_module_built(torch::nn::Module& module) override { built.push_back(&module); }
  void on_module_wrapped(fsdp::nn::Module& module) override { wrapped.push_back(&module); }
};

struct Identity : fsdp::nn::Module {
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override { return inputs.at(0); }
};

// fsdp::nn::built and fsdp::wrap reach the strategy running configure_model -- the Trainer's
// own -- and nothing outside configure_model.
TEST(Trainer, ConfigureModelRunsUnderItsStrategy) {
  struct Probe : TinyLM {
    std::shared_ptr<Identity> unit;
    void configure_model() override {
      TinyLM::configure_model();
      fsdp::nn::built(emb.ptr());
      if (!unit) unit = register_module("unit", fsdp::wrap(std::make_shared<Identity>()));
    }
  };
  auto data = corpus();
  auto train = loader(data);
  Probe model;
  auto o = quiet_options("active");
  o.max_steps = 1;
  auto strategy = std::make_shared<RecordingStrategy>();
  o.strategy = strategy;
  fsdp::Trainer trainer(o);
  auto outside = std::make_shared<Identity>();
  fsdp::nn::built(outside);
  fsdp::wrap(outside);
  EXPECT_TRUE(strategy->built.empty() && strategy->wrapped.empty()) << "before configure_model";
  trainer.fit(model, train);
  EXPECT_EQ(strategy->built, std::vector<const torch::nn::Module*>{model.emb.get()});
  EXPECT_EQ(strategy->wrapped, std::vector<const torch::nn::Module*>{model.unit.get()});
  fsdp::nn::built(outside);
  fsdp::wrap(outside);
  EXPECT_EQ(strategy->built.size(), 1u) << "after configure_model";
  EXPECT_EQ(strategy->wrapped.size(), 1u) << "after configure_model";

  // A strategy driven by hand (configure_model_with) gets them just the same; nesting is refused.
  RecordingStrategy by_hand;
  Probe other;
  fsdp::configure_model_with(by_hand, other);
  EXPECT_EQ(by_hand.built, std::vector<const torch::nn::Module*>{other.emb.get()});
  EXPECT_EQ(strategy->built.size(), 1u) << "the Trainer's strategy heard another model";
  struct Nesting : TinyLM {
    RecordingStrategy* inner = nullptr;
    void configure_model() override {
      TinyLM nested;
      fsdp::configure_model_with(*inner, nested);
    }
  } nesting;
  RecordingStrategy inner;
  nesting.inner = &inner;
  std::string e = error_of([&] { fsdp::configure_model_with(by_hand, nesting); });
  EXPECT_NE(e.find("must not nest"), std::string::npos) << e;
  // The failed call left no scope behind.
  fsdp::nn::built(outside);
  EXPECT_EQ(by_hand.built.size(), 1u);
}

TEST(Trainer, UnsupportedPrecisionAndAcceleratorFailClearly) {
  auto with = [](auto set) {
    return error_of([&] {
      fsdp::TrainerOptions o;
      set(o);
      fsdp::Trainer t(o);
    });
  };
  // "16-mixed" / "16-true" run on libtorch 2.x; a libtorch without CPU matmul in a precision's
  // dtype is refused by the probe tested in test_precision.cpp (CpuMatmulProbe...).
  std::string e = with([](fsdp::TrainerOptions& o) { o.precision = "bf17"; });
  EXPECT_NE(e.find("unknown precision 'bf17'"), std::string::npos) << e;
  EXPECT_NE(e.find("bf16-mixed"), std::string::npos) << e;  // lists the valid names

  if (!torch::cuda::is_available()) {
    e = with([](fsdp::TrainerOptions& o) { o.accelerator = "cuda"; });
    EXPECT_NE(e.find("torch::cuda::is_available() is false"), std::string::npos) << e;
    EXPECT_NE(e.find("accelerator='cpu'"), std::string::npos) << e;
  }
  e = with([](fsdp::TrainerOptions& o) { o.accelerator = "tpu"; });
  EXPECT_NE(e.find("unknown accelerator 'tpu'"), std::string::npos) << e;

  e = with([](fsdp::TrainerOptions& o) { o.accumulate_grad_batches = 0; });
  EXPECT_NE(e.find("accumulate_grad_batches"), std::string::npos) << e;
  e = with([](fsdp::TrainerOptions& o) { o.limit_train_batches = 2.5; });
  EXPECT_NE(e.find("whole numbers"), std::string::npos) << e;
}

TEST(ProgressBar, PlainLinesEveryLogEveryStepsWhenNotATerminal) {
  std::ostringstream os;
  fsdp::detail::ProgressBar bar(os, /*is_terminal=*/false, /*total_steps=*/10, /*log_every=*/4);
  for (int64_t s = 1; s <= 10; ++s) bar.update(s, 0, 2.5, {{"acc", 0.5}});
  bar.finish();
  const std::string out = os.str();
  EXPECT_EQ(out.find('\r'), std::string::npos);
  std::vector<std::string> lines;
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u) << out;  // steps 1, 4, 8 and the last
  EXPECT_NE(lines[1].find("4/10"), std::string::npos) << lines[1];
  EXPECT_NE(lines[3].find("10/10"), std::string::npos) << lines[3];
  EXPECT_NE(lines[3].find("100%"), std::string::npos) << lines[3];
  EXPECT_NE(lines[3].find("loss 2.5"), std::string::npos) << lines[3];
  EXPECT_NE(lines[3].find("acc 0.5"), std::string::npos) << lines[3];
  EXPECT_NE(lines[3].find("it/s"), std::string::npos) << lines[3];
  EXPECT_NE(lines[1].find("ETA"), std::string::npos) << lines[1];
}

TEST(ProgressBar, RedrawsInPlaceOnATerminal) {
  std::ostringstream os;
  fsdp::detail::ProgressBar bar(os, /*is_terminal=*/true, /*total_steps=*/3, /*log_every=*/1);
  for (int64_t s = 1; s <= 3; ++s) bar.update(s, 0, 1.0, {});
  bar.finish();
  const std::string out = os.str();
  EXPECT_EQ(out.front(), '\r');
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;  // only finish() ends the line
  EXPECT_NE(out.find("3/3 [===================="), std::string::npos) << out;
  EXPECT_EQ(fsdp::detail::ProgressBar::format_duration(3723), "1:02:03");
  EXPECT_EQ(fsdp::detail::ProgressBar::format_duration(65), "01:05");
}

TEST(StrategyRegistry, KnowsSingleAndDdpAndListsNamesOnError) {
  auto names = fsdp::strategy_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "single"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "ddp"), names.end());
  EXPECT_EQ(fsdp::make_strategy("single")->name(), "single");
  EXPECT_EQ(fsdp::make_strategy("ddp")->name(), "ddp");
  std::string e = error_of([] { fsdp::make_strategy("dpp"); });
  EXPECT_NE(e.find("unknown strategy 'dpp'"), std::string::npos) << e;
  for (const auto& n : names) EXPECT_NE(e.find("'" + n + "'"), std::string::npos) << e;

  // A Trainer with a misspelled strategy fails before launching anything.
  e = error_of([] {
    fsdp::TrainerOptions o;
    o.strategy = "dpp";
    fsdp::Trainer t(o);
  });
  EXPECT_NE(e.find("unknown strategy 'dpp'"), std::string::npos) << e;
}

TEST(StrategyRegistry, SingleRefusesMoreThanOneRank) {
  fsdp::SingleDeviceStrategy s;
  fsdp::LaunchInfo info;
  info.world_size = 2;
  std::string e = error_of([&] { s.connect(nullptr, info); });
  EXPECT_NE(e.find("[strategy 'single']"), std::string::npos) << e;
  EXPECT_NE(e.find("2 ranks"), std::string::npos) << e;
}

TEST(Trainer, StrategyObjectIsUsedAsGiven) {
  auto single = std::make_shared<fsdp::SingleDeviceStrategy>();
  auto o = quiet_options("object");
  o.strategy = single;
  fsdp::Trainer trainer(o);
  EXPECT_EQ(trainer.strategy().get(), single.get());
}

TEST(Trainer, SeedEverythingMakesInitReproducible) {
  TinyLM a, b;
  fsdp::seed_everything(11);
  a.configure_model();
  fsdp::seed_everything(11);
  b.configure_model();
  EXPECT_TRUE(at::equal(a.emb->weight, b.emb->weight));
}

// The seed is the Trainer's: it seeds with it before configure_model and reports it, and a
// second Trainer in the same process that seeds nothing reports no seed.
TEST(Trainer, HoldsTheSeedItGaveAndTwoTrainersDoNotShareIt) {
  auto data = corpus();
  auto val = loader(data);
  TinyLM reference;
  fsdp::seed_everything(11);
  reference.configure_model();

  auto o = quiet_options("seed");
  o.seed = 11;
  o.limit_val_batches = 2;
  TinyLM seeded;
  fsdp::Trainer first(o);
  EXPECT_FALSE(first.seed().has_value()) << "nothing seeded before configure_model";
  torch::manual_seed(12345);  // whatever the process's generator holds, the Trainer seeds it
  first.validate(seeded, val);
  EXPECT_EQ(first.seed(), std::optional<uint64_t>(11));
  EXPECT_TRUE(at::equal(seeded.emb->weight, reference.emb->weight));

  o.seed = -1;
  TinyLM unseeded;
  fsdp::Trainer second(o);
  second.validate(unseeded, val);
  EXPECT_FALSE(second.seed().has_value());
  EXPECT_EQ(first.seed(), std::optional<uint64_t>(11));
}

}  // namespace

// Note [Out of memory during fit]: the caching allocator's c10::OutOfMemoryError, wherever fit
// meets it, becomes one fsdp::OutOfMemoryError sentence with the rank, the device, the step and
// part of it, the allocator's own sentence and the changes that fit this configuration. The
// CUDA allocator is the one that throws it; here the module throws the same type.
TEST(Trainer, OutOfMemoryDuringFitNamesRankStepPartAndWhatWouldFit) {
  constexpr const char* kAllocator =
      "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
      "of which 1.06 GiB is free.\nOf the allocated memory 75.00 GiB is allocated by PyTorch";
  struct OomLM : TinyLM {
    int64_t forward_oom_at = -1;  // global step (0-based) whose training_step throws
    at::Tensor training_step(const fsdp::Batch& b, int64_t i) override {
      if (trainer()->global_step() == forward_oom_at) C10_THROW_ERROR(OutOfMemoryError, kAllocator);
      return TinyLM::training_step(b, i);
    }
  };
  auto data = corpus();
  auto fit_error = [&](auto configure) {
    auto train = loader(data);
    OomLM model;
    fsdp::TrainerOptions o = quiet_options("oom");
    o.max_steps = 5;
    configure(model, o);
    fsdp::Trainer trainer(o);
    std::string message;
    bool typed = false;
    try {
      trainer.fit(model, train);
    } catch (const fsdp::OutOfMemoryError& e) {
      typed = true;
      message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      message = e.what();
    }
    EXPECT_TRUE(typed) << message;
    return message;
  };

  std::string e = fit_error([](OomLM& m, fsdp::TrainerOptions&) { m.forward_oom_at = 2; });
  for (const char* part :
       {"rank 0 ran out of memory on cpu during the forward of step 3: ",
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB",
        "HINT: a smaller batch size", "strategy 'fsdp' with FULL_SHARD",
        "activation checkpointing", "precision 'bf16-mixed'", "or more devices"}) {
    EXPECT_NE(e.find(part), std::string::npos) << part << "\n" << e;
  }
  EXPECT_EQ(e.find("Of the allocated memory"), std::string::npos) << "one sentence: " << e;

  e = fit_error([](OomLM& m, fsdp::TrainerOptions& o) {
    o.precision = "bf16-mixed";
    m.before_step = [&m](torch::optim::Optimizer&) {
      if (m.trainer()->global_step() == 1) C10_THROW_ERROR(OutOfMemoryError, kAllocator);
    };
  });
  EXPECT_NE(e.find("during the optimizer step of step 2: CUDA out of memory"), std::string::npos)
      << e;
  EXPECT_EQ(e.find("precision 'bf16-mixed'"), std::string::npos) << "already bf16: " << e;
}
