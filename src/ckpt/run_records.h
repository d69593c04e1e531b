// Which run a checkpoint directory's `last` belongs to, and which run staged a DIR.partial.
//
// Note [One last per run]
// -----------------------
// Two jobs saving into one checkpoint directory used to share one `last`, pointing at whichever
// saved most recently, so `--ckpt-path DIR/last` resumed either. Now the directory records its
// owner run in DIR/.fsdp-owner.json (written atomically: run id, host, pid and the pid's start
// time, since when), and rank 0 of ModelCheckpoint decides once per fit, at its first `last`
// update, which link is this run's (claim_last; the other ranks do not touch the directory):
//   no record (a new directory, or one of an older version)  record this run; link `last`
//   the record names this run (a fit resumed from one of its  link `last` (record refreshed)
//     checkpoints)
//   the record names another run, running or not             link `last-<first 8 digits of
//                                                             this run's id>`, and one warning
//                                                             line naming both links and the
//                                                             owner run
// Ownership does not pass to another run when the owner's process ends: a job stopped by a
// preemption and resubmitted with --ckpt-path DIR/last must find its own checkpoint there, not
// that of a run that saved meanwhile. A directory is given to a new run by removing its
// .fsdp-owner.json (or by using a new directory).
// So `DIR/last` always names one run's newest checkpoint, and a run that does not own the
// directory is resumed with --ckpt-path DIR/last-<id> (the warning says which). Nothing is
// deleted: the links are symlinks, and checkpoints stay where they are.
//
// Note [Interrupted saves]
// ------------------------
// save_checkpoint (src/ckpt/checkpoint.cpp) stages into DIR.partial and renames it to DIR; a run
// killed mid-save leaves it. Rank 0 writes a marker into it when it creates it
// (DIR.partial/.fsdp-save.json: run id, the target's name, and the writing process) and removes
// the marker just before publishing. A later save to DIR removes and reuses a DIR.partial only
// when (partial_reusable) its marker names this save's run and target, the process that wrote it
// has ended (or is this process), and it holds nothing but the marker and files a checkpoint
// writer makes (checkpoint_file_name): it is then what this run created, under Note [Writers
// never destroy] in src/ckpt/output.h. Any other DIR.partial (another run's, one without a
// marker, one holding other files) is left alone; ModelCheckpoint then saves to DIR-v1.
#pragma once

#include <filesystem>
#include <string>

namespace fsdp::ckpt {

inline constexpr const char* kOwnerRecordFile = ".fsdp-owner.json";
inline constexpr const char* kPartialMarkerFile = ".fsdp-save.json";

// Note [Interrupted saves]: records in `partial` (a directory this call created) that `run_id`
// stages `target_name` there. Throws FormatError when it cannot be written.
void mark_partial(const std::filesystem::path& partial, const std::string& run_id,
                  const std::string& target_name);
// Removes the marker before `partial` is published.
void unmark_partial(const std::filesystem::path& partial);
// Whether `partial` was left by an interrupted save of `run_id` to `target_name`, and may be
// removed by the next one (Note [Interrupted saves]).
bool partial_reusable(const std::filesystem::path& partial, const std::string& run_id,
                      const std::string& target_name);

struct LastLink {
  std::string name;     // "last" or "last-<run prefix>"
  std::string warning;  // one line for stderr, "" when there is nothing to say
};
// Note [One last per run]: the link `run_id` keeps in `dir`; records the owner when this run
// takes the directory. Throws c10::Error when the record cannot be written.
LastLink claim_last(const std::filesystem::path& dir, const std::string& run_id);

}  // namespace fsdp::ckpt
