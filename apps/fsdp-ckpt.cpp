// fsdp-ckpt: look into and convert checkpoints (see include/fsdp/checkpoint.h).
//
//   fsdp-ckpt inspect ckpt/step-100            tensors, shapes, dtypes, world size, step
//   fsdp-ckpt inspect --json ckpt/step-100
//   fsdp-ckpt verify ckpt/step-100             every file's identity and checksums, no loading
//   fsdp-ckpt convert ckpt/step-100 model.safetensors          consolidate (streaming)
//   fsdp-ckpt convert --to sharded --world 4 ckpt/step-100 ckpt/step-100-w4
//   fsdp-ckpt convert --overwrite ...          replace an existing output of the same kind
//   fsdp-ckpt swap /local_nvme                 the disk tier's swap directories and their jobs
//   fsdp-ckpt swap --remove-stale /local_nvme  remove those of jobs that are not running
//
// Conversion never destroys: an output that exists and is neither an empty directory nor an
// output of the same kind is an error, as is an output inside the input or the reverse (Note
// [Writers never destroy] in src/ckpt/output.h).
//
// Conversion streams one tensor piece at a time: memory stays bounded by the largest piece
// (at most the largest tensor), never the model. Errors print one line and exit 1. inspect and
// verify check every checksum (Note [Checkpoint identity] in src/ckpt/identity.h): a damaged
// checkpoint is an error; one saved without checksums is reported as unverified (exit 0).
#include <fsdp/checkpoint.h>
#include <fsdp/memory.h>

#include "ckpt/tools.h"

#include <nlohmann/json.hpp>

#include "offload/swap_owner.h"

#include <iostream>
#include <string>

#include "cli.h"

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// One line on stderr for a checkpoint that carries no checksums.
void warn_unverified(const std::string& path, const fsdp::ckpt::VerifyReport& v) {
  if (v.checksums) return;
  std::cerr << "fsdp-ckpt: warning: " << path << " was saved without checksums (by an earlier "
            << "fsdp.cpp): its structure is valid but its data cannot be verified; `fsdp-ckpt "
            << "convert --to sharded --world N " << path << " NEW` writes a copy that carries "
            << "them\n";
}

int verify(const std::string& path) {
  const fsdp::ckpt::VerifyReport v = fsdp::ckpt::verify_checkpoint(path);
  warn_unverified(path, v);
  std::cout << path << ": " << v.type << " checkpoint";
  if (!v.run_id.empty()) std::cout << " of run " << v.run_id;
  if (v.type != "safetensors") {
    std::cout << ", step " << v.global_step << ", world size " << v.world_size;
  }
  std::cout << ": " << v.files << " file(s), " << v.tensors << " tensors, " << v.bytes_checked
            << " bytes " << (v.checksums ? "match their checksums" : "read (no checksums)")
            << "\n";
  return 0;
}

int inspect(const std::string& path, bool as_json) {
  const fsdp::ckpt::VerifyReport v = fsdp::ckpt::verify_checkpoint(path, "fsdp-ckpt inspect");
  warn_unverified(path, v);
  fsdp::CheckpointInfo info = fsdp::inspect_checkpoint(path);
  if (as_json) {
    nlohmann::json j = {{"path", path},
                        {"type", info.type},
                        {"world_size", info.world_size},
                        {"strategy", info.strategy},
                        {"global_step", info.progress.global_step},
                        {"epoch", info.progress.epoch},
                        {"batch_in_epoch", info.progress.batch_in_epoch},
                        {"checksums_verified", v.checksums}};
    nlohmann::json ts = nlohmann::json::array();
    for (const auto& t : info.tensors) {
      ts.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"pieces", t.pieces}});
    }
    j["tensors"] = ts;
    std::cout << j.dump(1) << "\n";
    return 0;
  }
  std::cout << path << ": " << info.type << " checkpoint";
  if (info.world_size) std::cout << ", saved at world size " << info.world_size;
  if (!info.strategy.empty()) std::cout << " by strategy " << info.strategy;
  std::cout << "\nstep " << info.progress.global_step << ", epoch " << info.progress.epoch
            << ", next batch " << info.progress.batch_in_epoch << "\n";
  int64_t elements = 0;
  for (const auto& t : info.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    elements += n;
    std::cout << "  " << t.name << "  " << t.dtype << " " << shape_str(t.shape);
    if (t.pieces != 1) std::cout << "  (" << t.pieces << " pieces)";
    std::cout << "\n";
  }
  std::cout << info.tensors.size() << " tensors, " << elements << " elements\n";
  return 0;
}

// The disk tier's rank directories under `nvme_path` (Note [Swap directory ownership] in
// src/offload/swap_owner.cpp); with `remove_stale`, removes those whose job is not running.
int swap(const std::string& nvme_path, bool remove_stale) {
  namespace d = fsdp::detail;
  if (remove_stale) {
    const d::StaleSwapRemoval r = d::remove_stale_swap_dirs(nvme_path);
    for (const auto& dir : r.removed_dirs) std::cout << "removed " << dir << "\n";
    for (const auto& f : r.kept_files) {
      std::cout << "kept " << f << " (not written by the disk tier)\n";
    }
    std::cout << r.removed_dirs.size() << " stale swap directories removed, "
              << fsdp::format_bytes(r.removed_bytes)
              << " freed\n";
    return 0;
  }
  const auto entries = d::list_swap_dirs(nvme_path);
  int stale = 0;
  for (const auto& e : entries) {
    std::cout << e.path << ": " << (e.running ? "in use by " : "stale, ");
    if (e.has_owner) {
      std::cout << (e.running ? "" : "left by ") << d::describe(e.owner);
    } else {
      std::cout << "left by a process that recorded no owner";
    }
    std::cout << "; " << e.swap_files << " swap files, " << fsdp::format_bytes(e.swap_bytes);
    if (!e.other_files.empty()) std::cout << "; " << e.other_files.size() << " other files";
    std::cout << "\n";
    stale += e.running ? 0 : 1;
  }
  std::cout << entries.size() << " swap directories, " << stale << " stale";
  if (stale) std::cout << " (remove with: fsdp-ckpt swap --remove-stale " << nvme_path << ")";
  std::cout << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdp-ckpt: inspect and convert fsdp.cpp checkpoints; list and clean swap directories"};
  app.require_subcommand(1);
  std::string path, in, out, to = "safetensors";
  bool as_json = false, overwrite = false;
  int world = 0;
  auto* ins = app.add_subcommand("inspect", "tensors, shapes, dtypes, world size, step");
  ins->add_option("path", path, "checkpoint directory or .safetensors file")
      ->required()
      ->check(fsdp::cli::input_path());
  ins->add_flag("--json", as_json, "print JSON");
  auto* ver = app.add_subcommand("verify", "check every file's identity and checksums without "
                                 "loading the checkpoint");
  ver->add_option("path", path, "checkpoint directory or .safetensors file")
      ->required()
      ->check(fsdp::cli::input_path());
  auto* conv = app.add_subcommand("convert", "consolidate to one safetensors file, or reshard");
  conv->add_option("--to", to, "safetensors (one file of model weights) | sharded")
      ->check(fsdp::cli::one_of({"safetensors", "sharded"}));
  // A world beyond any launch (fsdp-run: 4096 ranks per node) would write that many shard files.
  conv->add_option("--world", world, "--to sharded: ranks to shard for")
      ->check(fsdp::cli::at_least(1))
      ->check(fsdp::cli::between(1, 65536));
  conv->add_flag("--overwrite", overwrite,
                 "replace an existing output of the same kind (a checkpoint directory, or a "
                 "safetensors file)");
  conv->add_option("input", in, "checkpoint directory (full or sharded)")
      ->required()
      ->check(fsdp::cli::input_path());
  conv->add_option("output", out, "output .safetensors file (or directory for --to sharded)")
      ->required();
  std::string nvme_path;
  bool remove_stale = false;
  auto* sw = app.add_subcommand(
      "swap", "list the disk tier's swap directories under an nvme_path and the jobs owning them");
  sw->add_option("nvme_path", nvme_path, "the --nvme-path the jobs ran with")
      ->required()
      ->check(fsdp::cli::input_dir());
  sw->add_flag("--remove-stale", remove_stale,
               "remove the swap files of jobs that are not running (nothing else)");
  if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-ckpt")) return *code;
  try {
    if (ins->parsed()) return inspect(path, as_json);
    if (ver->parsed()) return verify(path);
    if (sw->parsed()) return swap(nvme_path, remove_stale);
    if (to == "sharded") {
      if (world <= 0) {
        std::cerr << "fsdp-ckpt convert: --to sharded needs --world N\n";
        return 2;
      }
      fsdp::ckpt::convert_to_sharded(in, out, world, overwrite);
      std::cout << "wrote sharded checkpoint for world " << world << " to " << out << "\n";
    } else {
      fsdp::ckpt::convert_to_safetensors(in, out, overwrite);
      std::cout << "wrote " << out << "\n";
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    // c10::Error appends a C++ backtrace line; keep the first line.
    auto nl = msg.find("\nException raised from");
    if (nl != std::string::npos) msg = msg.substr(0, nl);
    std::cerr << "fsdp-ckpt: error: " << msg << "\n";
    return 1;
  }
  return 0;
}
