// Where a checkpoint writer may write, and how it publishes what it wrote.
//
// Note [Writers never destroy]
// ----------------------------
// save_checkpoint and `fsdp-ckpt convert` write into a directory (or a file) that may already
// exist. Before anything is written, check_output decides:
//   absent                          written
//   an empty directory              written (the new checkpoint takes its place)
//   an output of the same kind      a checkpoint directory that holds only files a checkpoint
//                                   writer makes (checkpoint_file_name), or a safetensors file:
//                                   replaced only when the caller asked to (save_checkpoint:
//                                   always, as Lightning's save; `fsdp-ckpt convert`: --overwrite)
//   anything else                   an error naming what is there; nothing is written
// An output inside the input, or an input inside the output, is an error whatever exists.
// What the writer stages goes to a directory it creates in this call (StagingDir: a fresh
// sibling of the output, never a name that already exists), and only that directory is ever
// removed by it -- or, for save_checkpoint, a DIR.partial that an interrupted save of the same
// run created: what the same run made counts as made by this writer, and its marker says so
// (Note [Interrupted saves] in run_records.h; nothing without that marker is removed); publishing swaps it with the output in one rename (renameat2 RENAME_EXCHANGE,
// or two renames where the filesystem lacks it), so a crash leaves the old output whole.
#pragma once

#include <filesystem>
#include <string>

namespace fsdp::ckpt {

enum class OutputKind { kCheckpointDir, kSafetensorsFile };

// True for the names a checkpoint directory holds (meta.json, metadata.json, model/optimizer
// .safetensors, shard-<i>-of-<S>.safetensors, a strategy's extra state such as
// ddp_comm_state-<i>-of-<S>.safetensors, and the writers' temporary files of those).
bool checkpoint_file_name(const std::string& name);

// "" when `out` may receive an output of `kind` written from `input` ("" = none) under the rules
// of Note [Writers never destroy]; otherwise one sentence saying what is wrong and what to do.
// `overwrite_flag` names how the caller asks to replace an output of the same kind ("" = it
// always may).
std::string output_problem(const std::filesystem::path& input, const std::filesystem::path& out,
                           OutputKind kind, bool overwrite, const std::string& overwrite_flag);

// A directory created by this call next to `target`, for staging a checkpoint. Removed (it and
// only it) when destroyed unless published.
class StagingDir {
 public:
  // Throws c10::Error prefixed with `who` when the parent of `target` cannot hold it.
  StagingDir(const std::filesystem::path& target, const std::string& who);
  ~StagingDir();
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Moves the staged directory to `target` (absent, an empty directory, or a checkpoint
  // check_output allowed to replace); the replaced checkpoint is removed after the swap.
  void publish();

 private:
  std::filesystem::path target_;
  std::filesystem::path path_;
  std::string who_;
  bool published_ = false;
};

// Moves the directory `staged` onto `target` as StagingDir::publish does (target absent, an
// empty directory, or a directory to be replaced, removed after the swap); throws c10::Error
// prefixed with `who`.
void publish_dir(const std::filesystem::path& staged, const std::filesystem::path& target,
                 const std::string& who);

}  // namespace fsdp::ckpt
