// Checkpoints: full and sharded round trips, resharding W -> W' under fsdp/ddp/single (model and
// optimizer state), exact resume, clear errors for damaged files and shape mismatches.
//
// A "reference" run trains N steps, saves, and trains N more steps, recording those losses;
// a "resume" run (other world size or strategy) loads the checkpoint and trains the same N
// steps on the same global batches: its losses must match (bitwise at the same world size and
// strategy, within 1e-6 relative elsewhere). Runs pass data through files in a scratch directory.
// A kind ending in "+nvme" is a DeepSpeed stage with its optimizer state on disk (the disk
// tier): its checkpoints stream the moments from the swap files and resume into either tier.
// "+nvme+params" puts the parameters on disk too (stage 3): each unit's shard is read from its
// swap record while the checkpoint writes or loads it.
#include "fsdp/checkpoint.h"
#include "fsdp/deepspeed.h"
#include "fsdp/memory.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>

namespace fs = std::filesystem;
using fsdp::testing::TinyLM;
using json = nlohmann::json;

namespace {

constexpr int64_t kGlobalBatch = 12;  // divisible by worlds 1, 2, 3, 4

std::string scratch(const std::string& name) {
  return (fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test" / name).lexically_normal().string();
}

// The disk tier's swap directory: one per test, because ctest runs tests in parallel and each
// disk test checks that its own runs left no swap files (a shared directory saw the other
// test's live files). The child ranks run the same test, so they compute the same path.
fs::path nvme_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path d = fs::temp_directory_path() / "fsdp_ckpt_nvme" / (info ? info->name() : "no-test");
  fs::create_directories(d);  // nvme_path must exist (the swapper creates only <job>/ in it)
  return d;
}

// Parent-only setup (children re-run the test body up to their run_ranks call).
void fresh_dir(const std::string& dir) {
  if (fsdp::testing::in_child_rank()) return;
  fs::remove_all(dir);
  fs::create_directories(dir);
}

struct Run {
  std::shared_ptr<fsdp::Strategy> strategy;
  TinyLM lm;
  std::shared_ptr<torch::optim::Optimizer> opt;

  // The disk tier's settings of the "+nvme" kinds: several sub-groups with boundaries inside
  // parameters; with "+params" every unit on disk.
  static fsdp::OffloadPolicy nvme_policy(bool params) {
    fsdp::OffloadPolicy p = fsdp::OffloadPolicy::nvme(nvme_dir().string(), params);
    p.disk.sub_group_size = 5000;
    p.disk.aio.block_size = 8192;
    p.disk.aio.queue_depth = 4;
    p.disk.params_buffer_count = 3;
    p.disk.params_buffer_size = 1000000;
    p.disk.max_in_cpu = 0;
    return p;
  }

  // kind: a strategy name, "hybrid", "hybrid_zero2", and "fsdp" or a "deepspeed*" name with
  // "+nvme" (the optimizer on disk) or "+nvme+params" (the parameters too).
  Run(const std::string& kind, const std::string& optimizer = "adamw") {
    const size_t nvme = kind.find("+nvme");
    const bool params_on_disk = kind.find("+params") != std::string::npos;
    const std::string base = kind.substr(0, nvme);
    if (base == "fsdp" || base == "hybrid" || base == "hybrid_zero2") {
      fsdp::FSDPOptions o;
      o.auto_wrap_policy =
          fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
      if (base != "fsdp") {  // 2 x 2 at world 4: shard groups {0,1}, {2,3}
        o.sharding_strategy = base == "hybrid" ? fsdp::ShardingStrategy::kHybridShard
                                               : fsdp::ShardingStrategy::kHybridShardZero2;
        o.hybrid_shard_size = 2;
      }
      if (nvme != std::string::npos) o.offload_policy = nvme_policy(params_on_disk);
      strategy = std::make_shared<fsdp::FSDPStrategy>(o);
    } else if (kind.rfind("deepspeed", 0) == 0) {
      // Small buckets (several per model) and most stage-3 parameters sharded (the 1-d ones
      // persistent), so every code path of the stages is in the checkpoint.
      fsdp::DeepSpeedOptions o;
      o.reduce_bucket_size = 6000;
      o.allgather_bucket_size = 9000;
      o.stage3_param_persistence_threshold = 64;
      if (nvme != std::string::npos) {  // the same settings as FSDP's policy, DeepSpeed's names
        const fsdp::OffloadPolicy p = nvme_policy(params_on_disk);
        o.offload_optimizer = true;
        o.offload_optimizer_device = "nvme";
        o.nvme_path = p.disk.path;
        o.sub_group_size = static_cast<double>(p.disk.sub_group_size);
        o.aio = p.disk.aio;
        if (params_on_disk) {
          o.offload_parameters = true;
          o.offload_params_device = "nvme";
          o.params_buffer_count = p.disk.params_buffer_count;
          o.params_buffer_size = static_cast<double>(p.disk.params_buffer_size);
          o.max_in_cpu = static_cast<double>(p.disk.max_in_cpu);
        }
      }
      strategy = fsdp::make_deepspeed_strategy(base, o);
    } else {
      strategy = fsdp::make_strategy(kind);
    }
    fsdp::testing::connect_to_world(strategy);
    lm.optimizer = optimizer;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    opt = lm.configure_optimizers().optimizer;
    strategy->setup_optimizer(*opt);
  }

  // Optimizer steps [from, to) on this rank's share of each global batch.
  std::vector<double> train(int from, int to) {
    const int world = strategy->world_size();
    const int64_t local = kGlobalBatch / world;
    std::vector<double> losses;
    for (int step = from; step < to; ++step) {
      fsdp::Batch g = fsdp::testing::global_batch(step, kGlobalBatch);
      fsdp::Batch mb = fsdp::testing::slice(g, strategy->rank() * local, local);
      strategy->pre_forward(lm, true);
      at::Tensor loss = lm.training_step(mb, step);
      strategy->backward(loss);
      strategy->post_backward(lm, true);
      losses.push_back(strategy->reduce(loss.detach(), fsdp::ReduceOp::kAvg).item<double>());
      strategy->optimizer_step(*opt);
      strategy->zero_grad(*opt);
    }
    return losses;
  }

  fsdp::TrainingProgress progress(int step) const {
    fsdp::TrainingProgress p;
    p.global_step = step;
    return p;
  }
};

void write_json(const std::string& path, const json& j) { std::ofstream(path) << j.dump(); }
json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// Reference: train 3 steps at `world` with `kind`, save (`type`), train 3 more; rank 0 writes
// the last 3 losses to dir/ref.json.
void make_reference(const std::string& dir, int world, const std::string& backend,
                    const std::string& kind, fsdp::StateDictType type,
                    const std::string& optimizer = "adamw") {
  fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup&) {
    Run run(kind, optimizer);
    run.train(0, 3);
    fsdp::save_checkpoint(dir + "/ckpt", *run.strategy, run.lm, run.opt.get(), run.progress(3),
                          type);
    auto after = run.train(3, 6);
    if (run.strategy->rank() == 0) write_json(dir + "/ref.json", {{"losses", after}});
  });
}

// Loads dir/ckpt at `world` with `kind`, trains steps 3..5 and compares with dir/ref.json.
void check_resume(const std::string& dir, int world, const std::string& backend,
                  const std::string& kind, double rtol, const std::string& optimizer = "adamw") {
  SCOPED_TRACE(kind + " at world " + std::to_string(world) + " (" + backend + ")");
  fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup&) {
    Run run(kind, optimizer);
    auto p = fsdp::load_checkpoint(dir + "/ckpt", *run.strategy, run.lm, run.opt.get());
    EXPECT_EQ(p.global_step, 3);
    auto got = run.train(3, 6);
    auto want = read_json(dir + "/ref.json")["losses"].get<std::vector<double>>();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (rtol == 0) {
        EXPECT_EQ(got[i], want[i]) << "step " << 3 + i << " not bitwise equal";
      } else {
        EXPECT_NEAR(got[i], want[i], rtol * std::abs(want[i])) << "step " << 3 + i;
      }
    }
  });
}

}  // namespace

TEST(Checkpoint, SingleFullAndShardedResumeBitwise) {
  for (auto type : {fsdp::StateDictType::kFull, fsdp::StateDictType::kSharded}) {
    std::string dir = scratch(std::string("single-") + fsdp::to_string(type));
    fresh_dir(dir);
    make_reference(dir, 1, "gloo", "single", type);
    check_resume(dir, 1, "gloo", "single", 0);
    if (!fsdp::testing::in_child_rank()) {
      EXPECT_TRUE(fs::exists(dir + "/ckpt/" + (type == fsdp::StateDictType::kFull
                                                   ? "model.safetensors"
                                                   : "shard-0-of-1.safetensors")));
      EXPECT_FALSE(fs::exists(dir + "/ckpt.partial"));
    }
  }
}

TEST(Checkpoint, SgdMomentumResumesBitwise) {
  std::string dir = scratch("sgd");
  fresh_dir(dir);
  make_reference(dir, 1, "gloo", "single", fsdp::StateDictType::kFull, "sgd");
  check_resume(dir, 1, "gloo", "single", 0, "sgd");
}

TEST(Checkpoint, FsdpShardedSaveAt4ReshardsTo1_2_3AndOtherStrategies) {
  std::string dir = scratch("fsdp4");
  fresh_dir(dir);
  make_reference(dir, 4, "gloo", "fsdp", fsdp::StateDictType::kSharded);
  if (!fsdp::testing::in_child_rank()) {
    // One file per rank plus the metadata; rows are unpadded.
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(fs::exists(dir + "/ckpt/shard-" + std::to_string(r) + "-of-4.safetensors"));
    }
    json meta = read_json(dir + "/ckpt/metadata.json");
    EXPECT_EQ(meta["type"], "sharded");
    EXPECT_EQ(meta["world_size"], 4);
    EXPECT_EQ(meta["strategy"], "fsdp");
    EXPECT_EQ(meta["progress"]["global_step"], 3);
    ASSERT_TRUE(meta["tensors"].is_object());
    for (auto& [key, t] : meta["tensors"].items()) {
      int64_t dim0 = t["shape"].empty() ? 1 : t["shape"][0].get<int64_t>();
      EXPECT_EQ(t["pieces"].back()["rows"][1].get<int64_t>(), dim0) << key;
    }
  }
  check_resume(dir, 4, "gloo", "fsdp", 0);  // same world: bitwise
  for (int w : {1, 2, 3}) check_resume(dir, w, "gloo", "fsdp", 1e-6);
  check_resume(dir, 2, "gloo", "ddp", 1e-6);
  check_resume(dir, 1, "gloo", "single", 1e-6);
}

TEST(Checkpoint, FsdpFullSaveAt2LoadsAt4AndSingle) {
  std::string dir = scratch("fsdp2full");
  fresh_dir(dir);
  make_reference(dir, 2, "gloo", "fsdp", fsdp::StateDictType::kFull);
  check_resume(dir, 2, "gloo", "fsdp", 0);
  check_resume(dir, 4, "gloo", "fsdp", 1e-6);
  check_resume(dir, 1, "gloo", "single", 1e-6);
  if (!fsdp::testing::in_child_rank()) {
    // A full checkpoint's model file loads into a plain module (weights only).
    TinyLM plain;
    plain.configure_model();
    TinyLM other;
    other.configure_model();
    for (auto& p : other.parameters()) {
      torch::NoGradGuard g;
      p.zero_();
    }
    fsdp::load_weights(other, dir + "/ckpt/model.safetensors");
    fsdp::load_weights(plain, dir + "/ckpt");
    auto a = plain.named_parameters();
    auto b = other.named_parameters();
    for (auto& item : a) EXPECT_TRUE(at::equal(item.value(), b[item.key()])) << item.key();
  }
}

TEST(Checkpoint, FsdpShardedSaveAt2ReshardsTo4) {
  std::string dir = scratch("fsdp2sharded");
  fresh_dir(dir);
  make_reference(dir, 2, "gloo", "fsdp", fsdp::StateDictType::kSharded);
  check_resume(dir, 4, "gloo", "fsdp", 1e-6);
  check_resume(dir, 3, "gloo", "ddp", 1e-6);
}

TEST(Checkpoint, MpiShardedSaveAt2ReshardsTo3) {
  std::string dir = scratch("mpi");
  fresh_dir(dir);
  make_reference(dir, 2, "mpi", "fsdp", fsdp::StateDictType::kSharded);
  check_resume(dir, 2, "mpi", "fsdp", 0);
  check_resume(dir, 3, "mpi", "fsdp", 1e-6);
}

// Hybrid sharding (2 x 2 at world 4): only the first replica writes (2 shard files), and the
// checkpoint loads back under hybrid (bitwise), plain FSDP at world 2 and a single process.
TEST(Checkpoint, HybridShardSaveAt2x2ReshardsToFsdp2AndSingle) {
  std::string dir = scratch("hybrid");
  fresh_dir(dir);
  make_reference(dir, 4, "gloo", "hybrid", fsdp::StateDictType::kSharded);
  if (!fsdp::testing::in_child_rank()) {
    std::set<std::string> files;
    for (const auto& e : fs::directory_iterator(dir + "/ckpt")) {
      files.insert(e.path().filename().string());
    }
    EXPECT_EQ(files, (std::set<std::string>{"metadata.json", "shard-0-of-2.safetensors",
                                            "shard-1-of-2.safetensors"}));
    json meta = read_json(dir + "/ckpt/metadata.json");
    EXPECT_EQ(meta["world_size"], 4);
  }
  check_resume(dir, 4, "gloo", "hybrid", 0);
  check_resume(dir, 2, "gloo", "fsdp", 1e-6);
  check_resume(dir, 1, "gloo", "single", 1e-6);
  check_resume(dir, 3, "gloo", "ddp", 1e-6);
}

// HYBRID_SHARD_ZERO2, full format (replica 0 gathers, its rank 0 writes) on MPI; loads at 2.
TEST(Checkpoint, HybridZero2FullSaveMpiLoadsAtFsdp2) {
  std::string dir = scratch("hybrid-zero2");
  fresh_dir(dir);
  make_reference(dir, 4, "mpi", "hybrid_zero2", fsdp::StateDictType::kFull);
  check_resume(dir, 4, "mpi", "hybrid_zero2", 0);
  check_resume(dir, 2, "mpi", "fsdp", 1e-6);
}

TEST(Checkpoint, DamagedFilesAndMismatchesAreClearErrors) {
  std::string dir = scratch("damaged");
  fresh_dir(dir);
  make_reference(dir, 2, "gloo", "fsdp", fsdp::StateDictType::kSharded);
  if (fsdp::testing::in_child_rank()) return;
  auto load_error = [&](const std::string& path) -> std::string {
    TinyLM lm;
    lm.configure_model();
    try {
      fsdp::load_weights(lm, path);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  EXPECT_EQ(load_error(dir + "/ckpt"), "");  // sanity: loads intact

  // Truncated shard: named file, "truncated", no crash.
  fs::copy(dir + "/ckpt", dir + "/trunc", fs::copy_options::recursive);
  std::string shard = dir + "/trunc/shard-1-of-2.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  std::string err = load_error(dir + "/trunc");
  EXPECT_NE(err.find("shard-1-of-2.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;

  // Corrupt header bytes.
  fs::copy(dir + "/ckpt", dir + "/corrupt", fs::copy_options::recursive);
  {
    std::fstream f(dir + "/corrupt/shard-0-of-2.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);
    f.write("\xff\xfe", 2);
  }
  err = load_error(dir + "/corrupt");
  EXPECT_NE(err.find("shard-0-of-2.safetensors"), std::string::npos) << err;

  // Missing shard file.
  fs::copy(dir + "/ckpt", dir + "/missing", fs::copy_options::recursive);
  fs::remove(dir + "/missing/shard-1-of-2.safetensors");
  err = load_error(dir + "/missing");
  EXPECT_NE(err.find("cannot open"), std::string::npos) << err;

  // Corrupt metadata.json.
  fs::copy(dir + "/ckpt", dir + "/badmeta", fs::copy_options::recursive);
  std::ofstream(dir + "/badmeta/metadata.json") << "{\"type\": \"sharded\", \"tens";
  err = load_error(dir + "/badmeta");
  EXPECT_NE(err.find("metadata.json"), std::string::npos) << err;

  // Not a checkpoint at all.
  err = load_error(dir);
  EXPECT_NE(err.find("not a checkpoint"), std::string::npos) << err;

  // Shape mismatch: a bigger vocabulary; names the tensor, both shapes and the fix.
  struct WideLM : TinyLM {
    void configure_model() override {
      if (model) return;
      model = register_module("model", fsdp::demos::make_model(model_name,
                                                               fsdp::testing::kVocab * 2, 0.0));
    }
  } wide;
  wide.configure_model();
  try {
    fsdp::load_weights(wide, dir + "/ckpt");
    ADD_FAILURE() << "shape mismatch accepted";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("checkpoint has "), std::string::npos) << m;
    EXPECT_NE(m.find("the model expects"), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(fsdp::testing::kVocab * 2)), std::string::npos) << m;
    EXPECT_NE(m.find("configuration the checkpoint was saved with"), std::string::npos) << m;
  }
}

// DeepSpeed ZeRO stages write fsdp.cpp's checkpoints: stage 1/2 partitions of the optimizer
// state (every rank its rows), stage 3 FSDP shards plus persistent partitions. They resume
// bitwise at the same world and stage, and within 1e-6 at other worlds, other stages and
// other strategies; other strategies' checkpoints resume under the stages.
TEST(Checkpoint, DeepSpeedStagesResumeAcrossStagesWorldsAndStrategies) {
  std::string dir = scratch("zero2-sharded");
  fresh_dir(dir);
  make_reference(dir, 2, "gloo", "deepspeed_stage_2", fsdp::StateDictType::kSharded);
  if (!fsdp::testing::in_child_rank()) {
    json meta = read_json(dir + "/ckpt/metadata.json");
    EXPECT_EQ(meta["strategy"], "deepspeed_stage_2");
    // Optimizer state is split over the two ranks, the (whole) weights written once.
    int split = 0;
    for (auto& [key, t] : meta["tensors"].items()) {
      if (key.rfind("optim.", 0) == 0 && t["pieces"].size() == 2) ++split;
      if (key.rfind("optim.", 0) != 0) EXPECT_EQ(t["pieces"].size(), 1u) << key;
    }
    EXPECT_GT(split, 0);
  }
  check_resume(dir, 2, "gloo", "deepspeed_stage_2", 0);
  check_resume(dir, 3, "gloo", "deepspeed_stage_1", 1e-6);
  check_resume(dir, 3, "gloo", "deepspeed_stage_3", 1e-6);
  check_resume(dir, 4, "gloo", "fsdp", 1e-6);
  check_resume(dir, 1, "gloo", "single", 1e-6);

  std::string dir3 = scratch("zero3-full");
  fresh_dir(dir3);
  make_reference(dir3, 3, "mpi", "deepspeed_stage_3", fsdp::StateDictType::kFull);
  check_resume(dir3, 3, "mpi", "deepspeed_stage_3", 0);
  check_resume(dir3, 2, "mpi", "deepspeed_stage_1", 1e-6);
  check_resume(dir3, 2, "gloo", "ddp", 1e-6);

  std::string dirf = scratch("fsdp-to-zero");
  fresh_dir(dirf);
  make_reference(dirf, 2, "gloo", "fsdp", fsdp::StateDictType::kSharded);
  check_resume(dirf, 3, "gloo", "deepspeed_stage_2", 1e-6);
  check_resume(dirf, 4, "gloo", "deepspeed_stage_3", 1e-6);

  // fsdp-ckpt convert's library call: one safetensors file equal to the weights, streamed
  // through one buffer: the tracked peak is at most the largest tensor, not the model.
  if (!fsdp::testing::in_child_rank()) {
    int64_t largest = 0, model = 0;
    for (const auto& t : fsdp::inspect_checkpoint(dir + "/ckpt").tensors) {
      if (t.name.rfind("optim.", 0) == 0) continue;
      int64_t n = t.dtype == "F32" ? 4 : 2;
      for (int64_t d : t.shape) n *= d;
      largest = std::max(largest, n);
      model += n;
    }
    ASSERT_GT(model, 4 * largest) << "the bound would not tell largest tensor from model";
    fsdp::install_tracking_allocator();
    const int64_t before = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    fsdp::convert_to_safetensors(dir + "/ckpt", dir + "/model.safetensors");
    EXPECT_LE(fsdp::memory_stats().peak_bytes - before, largest);
    EXPECT_GT(fsdp::memory_stats().peak_bytes - before, 0) << "nothing tracked: test is blind";
    TinyLM a, b;
    a.configure_model();
    b.configure_model();
    fsdp::load_weights(a, dir + "/model.safetensors");
    fsdp::load_weights(b, dir + "/ckpt");
    auto pa = a.named_parameters();
    for (auto& item : b.named_parameters()) {
      EXPECT_TRUE(at::equal(item.value(), pa[item.key()])) << item.key();
    }
  }
}

// The disk tier (offload_optimizer_device "nvme"): a checkpoint streamed from the swap files is
// the format a RAM run writes. Stage 2 and 3 on disk resume bitwise at the same world and tier,
// and load at another world size into RAM, into the disk tier, and under FSDP.
void disk_resume(int world, const std::string& backend) {
  const int other = world == 2 ? 3 : 2;
  for (const std::string stage : {"deepspeed_stage_2", "deepspeed_stage_3"}) {
    std::string dir = scratch("nvme-" + backend + std::to_string(world) + "-" + stage);
    fresh_dir(dir);
    make_reference(dir, world, backend, stage + "+nvme", fsdp::StateDictType::kSharded);
    if (!fsdp::testing::in_child_rank()) {
      // The moments of every trainable parameter, float32, with the parameter's full shape.
      json meta = read_json(dir + "/ckpt/metadata.json");
      int moments = 0;
      for (auto& [key, t] : meta["tensors"].items()) {
        if (key.rfind("optim.", 0) != 0) continue;
        ++moments;
        EXPECT_EQ(t["dtype"], "F32") << key;
        const std::string fqn = key.substr(6, key.rfind('.') - 6);
        ASSERT_TRUE(meta["tensors"].contains(fqn)) << key;
        EXPECT_EQ(t["shape"], meta["tensors"][fqn]["shape"]) << key;
        EXPECT_EQ(meta["optimizer"]["steps"][fqn], 3) << key;
      }
      EXPECT_EQ(moments, 2 * static_cast<int>(meta["optimizer"]["steps"].size()));
      EXPECT_GT(moments, 8);
      EXPECT_FALSE(fs::exists(dir + "/ckpt.partial"));
    }
    check_resume(dir, world, backend, stage + "+nvme", 0);
    check_resume(dir, other, backend, "deepspeed_stage_3", 1e-5);
    check_resume(dir, other, backend, stage + "+nvme", 1e-5);
    if (stage == "deepspeed_stage_2") check_resume(dir, 1, backend, "fsdp", 1e-5);
  }
  if (!fsdp::testing::in_child_rank()) {
    const fs::path d = nvme_dir();
    EXPECT_TRUE(fs::is_empty(d)) << "swap files left after the runs in " << d;
    std::error_code ignored;
    fs::remove(d, ignored);  // the test's own empty directory (fails harmlessly when not empty)
  }
}

// Parameters on disk too (offload_param nvme: DeepSpeed stage 3, or FSDP's OffloadPolicy;
// Note [Checkpoints of parameters on disk]): the checkpoint holds every parameter with its full
// shape, written by the ranks that hold its rows; it resumes bitwise at the same world and
// tier, and at another world size with the parameters on disk (under `kind` and under
// `other_kind`), in RAM (stage 3), and under FSDP in RAM at world 1.
void params_disk_resume(int world, const std::string& backend,
                        const std::string& kind = "deepspeed_stage_3+nvme+params",
                        const std::string& other_kind = "fsdp+nvme+params") {
  const int other = world == 2 ? 3 : 2;
  std::string dir = scratch("nvme-params-" + backend + std::to_string(world) + "-" +
                            kind.substr(0, kind.find('+')));
  fresh_dir(dir);
  make_reference(dir, world, backend, kind, fsdp::StateDictType::kSharded);
  if (!fsdp::testing::in_child_rank()) {
    json meta = read_json(dir + "/ckpt/metadata.json");
    TinyLM plain;
    plain.configure_model();
    int split = 0;
    for (const auto& item : plain.named_parameters()) {
      ASSERT_TRUE(meta["tensors"].contains(item.key())) << item.key();
      const json& t = meta["tensors"][item.key()];
      EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), item.value().sizes().vec()) << item.key();
      if (t["pieces"].size() > 1) ++split;
      EXPECT_TRUE(meta["tensors"].contains("optim." + item.key() + ".exp_avg")) << item.key();
    }
    EXPECT_GT(split, 4) << "few parameters were sharded: the disk path is barely exercised";
    EXPECT_FALSE(fs::exists(dir + "/ckpt.partial"));
  }
  check_resume(dir, world, backend, kind, 0);
  check_resume(dir, other, backend, kind, 1e-5);
  check_resume(dir, other, backend, other_kind, 1e-5);
  check_resume(dir, other, backend, "deepspeed_stage_3", 1e-5);
  check_resume(dir, 1, backend, "fsdp", 1e-5);
  if (!fsdp::testing::in_child_rank()) {
    const fs::path d = nvme_dir();
    EXPECT_TRUE(fs::is_empty(d)) << "swap files left after the runs in " << d;
    std::error_code ignored;
    fs::remove(d, ignored);
  }
}

TEST(Checkpoint, ParamsOnDiskResumeGlooWorld2) { params_disk_resume(2, "gloo"); }
TEST(Checkpoint, ParamsOnDiskResumeGlooWorld3) { params_disk_resume(3, "gloo"); }
TEST(Checkpoint, ParamsOnDiskResumeMpiWorld2) { params_disk_resume(2, "mpi"); }
TEST(Checkpoint, ParamsOnDiskResumeMpiWorld3) { params_disk_resume(3, "mpi"); }
// FSDP with OffloadPolicy::nvme: the same checkpoints, resumed by DeepSpeed stage 3 too.
TEST(Checkpoint, FsdpParamsOnDiskResumeGlooWorld2) {
  params_disk_resume(2, "gloo", "fsdp+nvme+params", "deepspeed_stage_3+nvme+params");
}
TEST(Checkpoint, FsdpParamsOnDiskResumeMpiWorld3) {
  params_disk_resume(3, "mpi", "fsdp+nvme+params", "deepspeed_stage_3+nvme+params");
}
// FSDP with only the optimizer on disk (OffloadPolicy::nvme(path, false)).
TEST(Checkpoint, FsdpOptimizerOnDiskResumeGlooWorld3) {
  params_disk_resume(3, "gloo", "fsdp+nvme", "deepspeed_stage_2+nvme");
}

TEST(Checkpoint, DiskOffloadResumeGlooWorld2) { disk_resume(2, "gloo"); }
TEST(Checkpoint, DiskOffloadResumeGlooWorld3) { disk_resume(3, "gloo"); }
TEST(Checkpoint, DiskOffloadResumeMpiWorld2) { disk_resume(2, "mpi"); }
TEST(Checkpoint, DiskOffloadResumeMpiWorld3) { disk_resume(3, "mpi"); }

// A RAM run's checkpoint resumes in the disk tier (its moments streamed into the swap files,
// and with parameters on disk its weights into the parameter records), at the same and at
// another world size (within 1e-5: CPU Adam kernel vs torch's AdamW).
TEST(Checkpoint, RamCheckpointResumesInDiskTier) {
  std::string dir = scratch("ram-to-nvme");
  fresh_dir(dir);
  make_reference(dir, 2, "gloo", "deepspeed_stage_2", fsdp::StateDictType::kSharded);
  check_resume(dir, 2, "gloo", "deepspeed_stage_2+nvme", 1e-5);
  check_resume(dir, 3, "gloo", "deepspeed_stage_3+nvme", 1e-5);
  check_resume(dir, 3, "gloo", "deepspeed_stage_1+nvme", 1e-5);
  check_resume(dir, 3, "gloo", "deepspeed_stage_3+nvme+params", 1e-5);
  if (!fsdp::testing::in_child_rank()) {
    const fs::path d = nvme_dir();
    EXPECT_TRUE(fs::is_empty(d)) << "swap files left after the runs in " << d;
    std::error_code ignored;
    fs::remove(d, ignored);
  }
}

