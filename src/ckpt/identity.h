// Which checkpoint a file belongs to, and which run a checkpoint belongs to.
//
// Note [Checkpoint identity]
// --------------------------
// Every safetensors file a checkpoint writer makes records, besides its checksums (Note
// [Checkpoint checksums] in safetensors.h), in its header's "__metadata__":
//   fsdp.run_id      the run that saved it (Note [Run identity])
//   fsdp.save_id     this save: 32 random hex digits, the same in every file of one save
//   fsdp.step        the global step saved
//   fsdp.world_size  the ranks of the run that saved
//   fsdp.shard       "<i>/<S>": file i of the S files of tensors (full format: "0/1")
// and the checkpoint's metadata (meta.json / metadata.json) records
//   "integrity": {"checksum": "crc32", "run_id": ..., "save_id": ...}.
// Opening a checkpoint (ckpt::Source) compares every file's record with the metadata: a file
// of another run, another step or another save (copied in, restored from the wrong backup), a
// file renamed to another shard's name, or a file without checksums in a checkpoint that has
// them is an error naming the file and both identities. Reading a piece checks its bytes against
// the recorded CRC once per Source (the whole piece: a rank reading part of a piece reads the
// rest once for the check). Checkpoints written before this record load with a warning: their
// files carry nothing to check.
//
// Note [Run identity]
// -------------------
// A run is a fit and every fit that resumes from its checkpoints. Its id (32 random hex digits)
// is drawn by rank 0 when it first needs it (its first save, or ModelCheckpoint naming one:
// Note [One last per run], Note [Interrupted saves] in run_records.h) and broadcast with each
// save; load_checkpoint adopts the
// id of the checkpoint it loads, so a resumed fit continues the run; the Trainer starts each fit
// with no id (Trainer::setup_callbacks, trainer_checkpoint.cpp: a fresh run unless it resumes).
// One process holds one current run id (current_run_id): a process runs one fit at a time;
// saves outside a Trainer share the id of the process's first save.
#pragma once

#include "ckpt/safetensors.h"

#include <cstdint>
#include <map>
#include <string>

namespace fsdp::ckpt {

struct Identity {
  std::string run_id;
  std::string save_id;
  int64_t step = 0;
  int64_t world_size = 0;
  int shard = 0;   // file index
  int shards = 1;  // files of tensors in the checkpoint
};

// The "__metadata__" entries of Note [Checkpoint identity].
std::map<std::string, std::string> identity_metadata(const Identity& id);
// "run R step N, shard i/S, save S" of a file's record (for messages); "no identity" when it
// has none.
std::string describe_identity(const SafetensorsHeader& header);

// 32 lowercase hex digits from std::random_device.
std::string random_id();
// This process's run (Note [Run identity]); "" = none yet.
std::string& current_run_id();
// current_run_id(), drawn first when there is none. Rank 0 only: the other ranks learn it from
// rank 0 with the next save.
const std::string& current_or_new_run_id();

}  // namespace fsdp::ckpt
