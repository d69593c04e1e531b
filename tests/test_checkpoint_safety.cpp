// Checkpoint safety: writers never destroy what they did not create (Note [Writers never
// destroy] in src/ckpt/output.h), through fsdp-ckpt convert and save_checkpoint; damaged or
// mixed checkpoint files are found on load and by fsdp-ckpt verify/inspect (Note [Checkpoint
// identity] in src/ckpt/identity.h).
#include "ckpt/identity.h"
#include "ckpt/metadata.h"
#include "ckpt/run_records.h"
#include "ckpt/safetensors.h"
#include "fsdp/checkpoint.h"
#include "fully_shard_common.h"
#include "cli_test_util.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <sys/resource.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;
using fsdp::testing::run_process;

namespace {

std::string scratch(const std::string& name) {
  return (fs::path(FSDP_BIN_DIR) / ".." / "ckpt-test-safety" / name).lexically_normal().string();
}

// Parent-only setup (children re-run the test body up to their run_ranks call).
void fresh_dir(const std::string& dir) {
  if (fsdp::testing::in_child_rank()) return;
  fs::remove_all(dir);
  fs::create_directories(dir);
}

// An FSDP TinyLM at `world` ranks saved at `step` (one optimizer step taken) to `dir`, and at
// each of `more` (dir, step) after it, in the same run.
void save_tiny(const std::string& dir, int world, const std::string& backend, int64_t step,
               fsdp::StateDictType type = fsdp::StateDictType::kSharded,
               const std::vector<std::pair<std::string, int64_t>>& more = {}) {
  fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup&) {
    fsdp::FSDPOptions o;
    o.auto_wrap_policy =
        fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
    fsdp::testing::TinyLM lm;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    auto opt = lm.configure_optimizers().optimizer;
    strategy->setup_optimizer(*opt);
    const int64_t local = 6 / strategy->world_size();  // one optimizer step: Adam state
    fsdp::Batch mb = fsdp::testing::slice(fsdp::testing::global_batch(0, 6),
                                          strategy->rank() * local, local);
    strategy->pre_forward(lm, true);
    strategy->backward(lm.training_step(mb, 0));
    strategy->post_backward(lm, true);
    strategy->optimizer_step(*opt);
    fsdp::TrainingProgress p;
    p.global_step = step;
    fsdp::save_checkpoint(dir, *strategy, lm, opt.get(), p, type);
    for (const auto& [d, s] : more) {
      p.global_step = s;
      fsdp::save_checkpoint(d, *strategy, lm, opt.get(), p, type);
    }
  });
}

using fsdp::testing::snapshot;  // "nothing lost" compares two of these

fsdp::testing::ProcResult ckpt_tool(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-ckpt")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 120);
}

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

// Names in `dir` that a writer left behind (staging directories, temporary files).
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(".staging-") != std::string::npos || n.find(".tmp.") != std::string::npos ||
        n.find(".partial") != std::string::npos || n.find(".old") != std::string::npos) {
      out.push_back(n);
    }
  }
  return out;
}

}  // namespace

// `fsdp-ckpt convert --to sharded --world 2 ck/step-4 ck` used to replace ck (its input
// included) with the output; an output holding a user's files had them deleted; an output
// inside the input overwrote the input's shards; OUT.partial and OUT.old of the user's were
// removed. Each is now an error (or left alone), and nothing is changed.
TEST(CheckpointSafety, ConvertRefusesToDestroy) {
  const std::string dir = scratch("convert");
  fresh_dir(dir);
  const std::string ck = dir + "/ck";
  save_tiny(ck + "/step-4", 2, "gloo", 4);
  if (fsdp::testing::in_child_rank()) return;
  write_text(ck + "/notes.txt", "mine");
  const auto before = snapshot(ck);

  auto expect_refused = [&](const std::vector<std::string>& args, const std::string& what) {
    SCOPED_TRACE(what);
    auto r = ckpt_tool(args);
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("nothing was written"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(snapshot(ck), before) << "the checkpoint directory changed";
    EXPECT_TRUE(leftovers(dir).empty()) << leftovers(dir).front();
    EXPECT_TRUE(leftovers(ck).empty()) << leftovers(ck).front();
  };
  // The issue's reproducer: the input inside the output.
  expect_refused({"convert", "--to", "sharded", "--world", "2", ck + "/step-4", ck},
                 "is inside the output");
  expect_refused({"convert", "--to", "sharded", "--world", "2", "--overwrite", ck + "/step-4", ck},
                 "is inside the output");
  // The output inside the input, and the input itself.
  expect_refused({"convert", "--to", "sharded", "--world", "3", ck + "/step-4", ck + "/step-4/w3"},
                 "is inside the input");
  expect_refused({"convert", ck + "/step-4", ck + "/step-4/model.safetensors"},
                 "is inside the input");
  expect_refused({"convert", "--to", "sharded", "--world", "3", "--overwrite", ck + "/step-4",
                  ck + "/step-4"},
                 "is the input");

  // An output holding a user's files, or a file where a directory goes.
  write_text(dir + "/user/keep.txt", "keep");
  expect_refused({"convert", "--to", "sharded", "--world", "3", ck + "/step-4", dir + "/user"},
                 "holds 'keep.txt'");
  expect_refused({"convert", "--to", "sharded", "--world", "3", "--overwrite", ck + "/step-4",
                  dir + "/user"},
                 "holds 'keep.txt'");
  EXPECT_EQ(snapshot(dir + "/user").at("keep.txt"), "keep");
  expect_refused({"convert", "--to", "sharded", "--world", "3", ck + "/step-4", ck + "/notes.txt"},
                 "is not a directory");
  expect_refused({"convert", ck + "/step-4", ck + "/notes.txt"}, "is not a safetensors file");

  // A new output, then the same output again: refused without --overwrite, replaced with it.
  auto r = ckpt_tool({"convert", "--to", "sharded", "--world", "3", ck + "/step-4", dir + "/w3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto w3 = snapshot(dir + "/w3");
  expect_refused({"convert", "--to", "sharded", "--world", "3", ck + "/step-4", dir + "/w3"},
                 "pass --overwrite");
  EXPECT_EQ(snapshot(dir + "/w3"), w3);
  r = ckpt_tool({"convert", "--to", "sharded", "--world", "2", "--overwrite", ck + "/step-4",
                 dir + "/w3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/w3/shard-1-of-2.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/w3/shard-2-of-3.safetensors"));
  r = ckpt_tool({"convert", ck + "/step-4", dir + "/model.safetensors"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_refused({"convert", ck + "/step-4", dir + "/model.safetensors"}, "pass --overwrite");
  r = ckpt_tool({"convert", "--overwrite", ck + "/step-4", dir + "/model.safetensors"});
  EXPECT_EQ(r.exit_code, 0) << r.err;

  // An empty directory is a fine output; the user's OUT.partial and OUT.old are not touched.
  fs::create_directories(dir + "/empty");
  write_text(dir + "/empty.partial/mine.txt", "p");
  write_text(dir + "/w3.old/mine.txt", "o");
  r = ckpt_tool({"convert", "--to", "sharded", "--world", "2", ck + "/step-4", dir + "/empty"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/empty/metadata.json"));
  r = ckpt_tool({"convert", "--to", "sharded", "--world", "2", "--overwrite", ck + "/step-4",
                 dir + "/w3"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/empty.partial/mine.txt"));
  EXPECT_TRUE(fs::exists(dir + "/w3.old/mine.txt"));
  EXPECT_EQ(snapshot(ck), before);
}

// save_checkpoint replaces a checkpoint (as Lightning's save does) but refuses a directory that
// holds anything else, and a DIR.partial it did not create; at world 3 every rank says so.
TEST(CheckpointSafety, SaveRefusesToDestroyGlooWorld3) {
  const std::string dir = scratch("save");
  if (!fsdp::testing::in_child_rank()) {
    fresh_dir(dir);
    write_text(dir + "/user/keep.txt", "keep");
    write_text(dir + "/other.partial/keep.txt", "keep");
  }
  save_tiny(dir + "/ck", 3, "gloo", 1);  // a checkpoint
  save_tiny(dir + "/ck", 3, "gloo", 2);  // replaced by the next save
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup& world) {
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>());
    fsdp::testing::TinyLM lm;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    fsdp::TrainingProgress p;
    std::string err = fsdp::testing::error_of([&] {
      fsdp::save_checkpoint(dir + "/user", *strategy, lm, nullptr, p,
                            fsdp::StateDictType::kSharded);
    });
    if (world.rank() == 0) {
      EXPECT_NE(err.find("holds 'keep.txt'"), std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("failed on 1 other rank"), std::string::npos) << err;
    }
    err = fsdp::testing::error_of([&] {
      fsdp::save_checkpoint(dir + "/other", *strategy, lm, nullptr, p,
                            fsdp::StateDictType::kSharded);
    });
    if (world.rank() == 0) {
      EXPECT_NE(err.find("other.partial exists"), std::string::npos) << err;
    }
    EXPECT_FALSE(err.empty());
  });
  if (fsdp::testing::in_child_rank()) return;
  EXPECT_EQ(snapshot(dir + "/user").at("keep.txt"), "keep");
  EXPECT_EQ(snapshot(dir + "/other.partial").at("keep.txt"), "keep");
  EXPECT_FALSE(fs::exists(dir + "/other"));
  EXPECT_EQ(fsdp::inspect_checkpoint(dir + "/ck").progress.global_step, 2);
  EXPECT_TRUE(leftovers(dir).size() == 1 && leftovers(dir)[0] == "other.partial");
}

namespace {

// XORs `mask` into the byte at `offset` of the data section of a safetensors file.
void flip_data_byte(const std::string& file, uint64_t offset, char mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);  // little-endian header length
  f.seekg(static_cast<std::streamoff>(8 + n + offset));
  char c = 0;
  f.read(&c, 1);
  f.seekp(static_cast<std::streamoff>(8 + n + offset));
  c ^= mask;
  f.write(&c, 1);
}

void copy_dir(const std::string& from, const std::string& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

}  // namespace

// One flipped exponent bit in a shard's data, a shard from another step of the same run and a
// shard from another run used to load silently (losses of 3e35, or wrong losses and exit 0).
// Now the load fails on every rank (world 3) naming the file, the tensor and what is wrong;
// fsdp-ckpt verify and inspect say the same without loading; the intact checkpoint verifies.
TEST(CheckpointSafety, DamagedOrMixedShardsAreFoundGlooWorld3) {
  const std::string dir = scratch("integrity");
  fresh_dir(dir);
  save_tiny(dir + "/a", 3, "gloo", 4, fsdp::StateDictType::kSharded, {{dir + "/b", 6}});
  if (!fsdp::testing::in_child_rank()) fsdp::ckpt::current_run_id().clear();  // another run
  save_tiny(dir + "/c", 3, "gloo", 4);
  if (!fsdp::testing::in_child_rank()) {
    copy_dir(dir + "/a", dir + "/flip");
    flip_data_byte(dir + "/flip/shard-1-of-3.safetensors", 3, 0x40);
    copy_dir(dir + "/a", dir + "/step");
    fs::copy_file(dir + "/b/shard-1-of-3.safetensors", dir + "/step/shard-1-of-3.safetensors",
                  fs::copy_options::overwrite_existing);
    copy_dir(dir + "/a", dir + "/run");
    fs::copy_file(dir + "/c/shard-2-of-3.safetensors", dir + "/run/shard-2-of-3.safetensors",
                  fs::copy_options::overwrite_existing);
  }
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup& world) {
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>());
    fsdp::testing::TinyLM lm;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    auto load = [&](const std::string& d) {
      return fsdp::testing::error_of([&] { fsdp::load_checkpoint(d, *strategy, lm, nullptr); });
    };
    EXPECT_EQ(load(dir + "/a"), "");
    const std::string err = load(dir + "/flip");
    if (world.rank() == 1) {  // the rank that reads the flipped piece
      EXPECT_NE(err.find("flip/shard-1-of-3.safetensors: tensor '"), std::string::npos) << err;
      EXPECT_NE(err.find("does not match its checksum"), std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("failed on 1 other rank"), std::string::npos) << err;
    }
    std::string mixed = load(dir + "/step");
    EXPECT_NE(mixed.find("step/shard-1-of-3.safetensors: belongs to another checkpoint"),
              std::string::npos) << mixed;
    EXPECT_NE(mixed.find(" step 6,"), std::string::npos) << mixed;
    mixed = load(dir + "/run");
    EXPECT_NE(mixed.find("run/shard-2-of-3.safetensors: belongs to another checkpoint"),
              std::string::npos) << mixed;
  });
  if (fsdp::testing::in_child_rank()) return;

  // Without loading: verify and inspect.
  auto r = ckpt_tool({"verify", dir + "/a"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("match their checksums"), std::string::npos) << r.out;
  for (const std::string sub : {"verify", "inspect"}) {
    r = ckpt_tool({sub, dir + "/flip"});
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.err.find("shard-1-of-3.safetensors: tensor '"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("does not match its checksum"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  r = ckpt_tool({"verify", dir + "/step"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("belongs to another checkpoint"), std::string::npos) << r.err;
  // A consolidated file carries checksums too.
  r = ckpt_tool({"convert", dir + "/a", dir + "/model.safetensors"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  flip_data_byte(dir + "/model.safetensors", 7, 0x01);
  r = ckpt_tool({"verify", dir + "/model.safetensors"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("does not match its checksum"), std::string::npos) << r.err;
}

// A checkpoint written before checksums (no "integrity" record, no checksums in its files)
// still loads, with a one-line warning, and verify says it cannot check the data.
TEST(CheckpointSafety, CheckpointWithoutChecksumsLoadsWithWarning) {
  const std::string dir = scratch("old");
  fresh_dir(dir);
  save_tiny(dir + "/new", 2, "gloo", 3, fsdp::StateDictType::kFull);
  if (fsdp::testing::in_child_rank()) return;
  // Rewrite it as an earlier version wrote it: the same tensors, no checksums, no identity.
  fs::create_directories(dir + "/old");
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    fsdp::ckpt::SafetensorsReader in(dir + "/new/" + f);
    std::vector<fsdp::ckpt::TensorSpec> specs(in.header().tensors.begin(),
                                              in.header().tensors.end());
    fsdp::ckpt::SafetensorsWriter out(dir + "/old/" + f, specs);
    for (const auto& e : in.header().tensors) {
      std::string bytes(e.end - e.begin, '\0');
      in.read(e.name, bytes.data(), bytes.size());
      out.write(bytes.data(), bytes.size());
    }
    out.commit();
  }
  std::ifstream meta_in(dir + "/new/meta.json");
  nlohmann::json meta = nlohmann::json::parse(meta_in);
  meta.erase("integrity");
  std::ofstream(dir + "/old/meta.json") << meta.dump();

  auto r = ckpt_tool({"verify", dir + "/old"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("saved without checksums"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  fsdp::testing::TinyLM lm;
  lm.configure_model();
  EXPECT_EQ(fsdp::testing::error_of([&] { fsdp::load_weights(lm, dir + "/old"); }), "");
  // The converted copy carries them.
  r = ckpt_tool({"convert", "--to", "sharded", "--world", "2", dir + "/old", dir + "/copy"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = ckpt_tool({"verify", dir + "/copy"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("match their checksums"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");
}

// Note [Interrupted saves] in src/ckpt/run_records.h: the DIR.partial an interrupted save of
// this run left (its marker, a torn shard) is removed and reused by the run's next save of DIR,
// which used to fail (or, under ModelCheckpoint, go to DIR-v1) and leave it for ever. A
// DIR.partial of another run, one holding a file no checkpoint writer makes, and one this run
// staged for another name are left alone.
TEST(CheckpointSafety, InterruptedSaveOfThisRunIsReusedGlooWorld3) {
  namespace ckpt = fsdp::ckpt;
  const std::string dir = scratch("interrupted");
  fresh_dir(dir);
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup& world) {
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>());
    fsdp::testing::TinyLM lm;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    fsdp::TrainingProgress p;
    p.global_step = 1;
    fsdp::save_checkpoint(dir + "/step-1", *strategy, lm, nullptr, p,
                          fsdp::StateDictType::kSharded);
    const std::string run = ckpt::current_run_id();
    ASSERT_FALSE(run.empty());
    if (world.rank() == 0) {
      // What a save interrupted in this process leaves, and three that are not this save's.
      auto staged = [&](const std::string& name, const std::string& marker_run,
                        const std::string& marker_target, const std::string& file) {
        fs::create_directories(dir + "/" + name + ".partial");
        ckpt::mark_partial(dir + "/" + name + ".partial", marker_run, marker_target);
        write_text(dir + "/" + name + ".partial/" + file, "torn");
      };
      staged("step-2", run, "step-2", "shard-0-of-3.safetensors");
      staged("step-3", ckpt::random_id(), "step-3", "shard-0-of-3.safetensors");
      staged("step-4", run, "step-4", "keep.txt");
      staged("step-5", run, "step-9", "shard-0-of-3.safetensors");
    }
    world.barrier();
    p.global_step = 2;
    EXPECT_EQ(fsdp::testing::error_of([&] {
      fsdp::save_checkpoint(dir + "/step-2", *strategy, lm, nullptr, p,
                            fsdp::StateDictType::kSharded);
    }), "");
    for (const std::string name : {"step-3", "step-4", "step-5"}) {
      const std::string err = fsdp::testing::error_of([&] {
        fsdp::save_checkpoint(dir + "/" + name, *strategy, lm, nullptr, p,
                              fsdp::StateDictType::kSharded);
      });
      if (world.rank() == 0) {
        EXPECT_NE(err.find(name + ".partial exists"), std::string::npos) << err;
      } else {
        EXPECT_NE(err.find("failed on 1 other rank"), std::string::npos) << err;
      }
    }
  });
  if (fsdp::testing::in_child_rank()) return;
  EXPECT_EQ(fsdp::inspect_checkpoint(dir + "/step-2").progress.global_step, 2);
  EXPECT_FALSE(fs::exists(dir + "/step-2/.fsdp-save.json")) << "the marker was published";
  std::vector<std::string> left = leftovers(dir);
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-3.partial", "step-4.partial",
                                            "step-5.partial"}));
  for (const auto& [name, file] : std::map<std::string, std::string>{
           {"step-3", "shard-0-of-3.safetensors"}, {"step-4", "keep.txt"},
           {"step-5", "shard-0-of-3.safetensors"}}) {
    const auto files = snapshot(dir + "/" + name + ".partial");
    EXPECT_EQ(files.size(), 2u) << name;
    EXPECT_EQ(files.at(file), "torn") << name;
    EXPECT_TRUE(files.count(".fsdp-save.json")) << name;
  }
}

// A write error in the full format (the file size limit as a full disk, as in
// test_disk_offload.cpp) is one error per rank: the writing rank names the file and the error,
// the others that rank and its error; nothing is published, the previous checkpoint stays. The
// write happens inside all-gathers: the writer used to throw out of them, leaving the other
// ranks in an all-gather it never joined.
TEST(CheckpointSafety, FullFormatWriteErrorIsOneErrorPerRankGlooWorld3) {
  const std::string dir = scratch("full-write-error");
  fresh_dir(dir);
  const std::string ck = dir + "/ck";
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup& world) {
    ::signal(SIGXFSZ, SIG_IGN);
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>());
    fsdp::testing::TinyLM lm;
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    fsdp::TrainingProgress p;
    p.global_step = 1;
    fsdp::save_checkpoint(ck, *strategy, lm, nullptr, p, fsdp::StateDictType::kFull);
    rlimit old{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    rlimit lim = old;
    lim.rlim_cur = static_cast<rlim_t>(fs::file_size(ck + "/model.safetensors") / 2);
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    p.global_step = 2;
    const std::string err = fsdp::testing::error_of([&] {
      fsdp::save_checkpoint(ck, *strategy, lm, nullptr, p, fsdp::StateDictType::kFull);
    });
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
    const std::string cause = ck + ".partial/model.safetensors";
    if (world.rank() == 0) {
      EXPECT_NE(err.find("[checkpoint] saving " + ck + " failed on rank 0: " + cause),
                std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("[checkpoint] saving " + ck + " failed on 1 other rank(s) (rank 0: " +
                         cause), std::string::npos) << err;
    }
    EXPECT_NE(err.find("File too large"), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    world.barrier();
  });
  if (fsdp::testing::in_child_rank()) return;
  EXPECT_EQ(fsdp::inspect_checkpoint(ck).progress.global_step, 1);
  EXPECT_TRUE(leftovers(dir).empty());
}

// Note [Per-rank RNG state]: the CUDA generators' states ("rng_cuda", "rng_cuda_per_rank", saved
// when the ranks train on CUDA) are read and checked as the CPU ones are: one hex string per
// rank of world_size, or the checkpoint is named as damaged.
TEST(CheckpointSafety, CudaRngStatesAreCheckedAsTheCpuOnes) {
  const nlohmann::json meta = nlohmann::json::parse(R"({"type": "sharded", "world_size": 2,
      "rng_cpu": "00ff", "rng_cpu_per_rank": ["00ff", "0102"],
      "rng_cuda": "0a0b0c", "rng_cuda_per_rank": ["0a0b0c", "ffeedd"]})");
  const auto m = fsdp::ckpt::parse_checkpoint_meta(meta, "ckpt");
  ASSERT_EQ(m.rng_cuda_per_rank.size(), 2u);
  EXPECT_EQ(m.rng_cuda, (std::vector<uint8_t>{0x0a, 0x0b, 0x0c}));
  EXPECT_EQ(m.rng_cuda_per_rank[1], (std::vector<uint8_t>{0xff, 0xee, 0xdd}));
  EXPECT_EQ(m.rng_cpu_per_rank[1], (std::vector<uint8_t>{0x01, 0x02}));

  auto error_with = [&](const char* key, nlohmann::json value) {
    nlohmann::json bad = meta;
    bad[key] = std::move(value);
    try {
      fsdp::ckpt::parse_checkpoint_meta(bad, "ckpt");
    } catch (const fsdp::ckpt::FormatError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  std::string e = error_with("rng_cuda_per_rank", {"0a0b0c"});
  EXPECT_NE(e.find("\"rng_cuda_per_rank\" is not an array of world_size (2)"), std::string::npos)
      << e;
  e = error_with("rng_cuda_per_rank", {"0a0b0c", 7});
  EXPECT_NE(e.find("\"rng_cuda_per_rank\" holds a non-string"), std::string::npos) << e;
  e = error_with("rng_cuda", "0x0g");
  EXPECT_NE(e.find("rng_cuda"), std::string::npos) << e;
  EXPECT_EQ(e.find("(accepted)"), std::string::npos) << e;
}
