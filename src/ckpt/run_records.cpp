// The owner record of a checkpoint directory and the marker of a staged save. See Note [One
// last per run] and Note [Interrupted saves] in run_records.h.
#include "ckpt/run_records.h"

#include "ckpt/output.h"
#include "ckpt/safetensors.h"
#include "common/process.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct RunRecord {
  std::string run_id;
  std::string target;  // the marker's: the name the staged save publishes to
  std::string since;
  detail::ProcessId process;
};

json to_json(const std::string& run_id, const std::string& target) {
  const detail::ProcessId p = detail::this_process();
  json j = {{"run_id", run_id}, {"host", p.host},   {"boot_id", p.boot},
            {"pid", p.pid},     {"pid_start", p.start}, {"since", detail::utc_now()}};
  if (!target.empty()) j["target"] = target;
  return j;
}

// False when `file` is absent or is not a record.
bool read_record(const fs::path& file, RunRecord* out) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return false;
  json j;
  try {
    j = json::parse(read_file(file.string()), nullptr, /*allow_exceptions=*/false);
  } catch (const std::exception&) {
    return false;
  }
  if (!j.is_object()) return false;
  auto str = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto num = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : int64_t{0};
  };
  out->run_id = str("run_id");
  out->target = str("target");
  out->since = str("since");
  out->process = {str("host"), str("boot_id"), num("pid"), num("pid_start")};
  return !out->run_id.empty();
}

std::string prefix(const std::string& run_id) { return run_id.substr(0, 8); }

// "run 1a2b3c4d (pid 123 on host node7, since 2026-11-27T22:10:00Z)".
std::string describe(const RunRecord& r) {
  return "run " + prefix(r.run_id) + " (pid " + std::to_string(r.process.pid) + " on host " +
         r.process.host + ", since " + r.since + ")";
}

}  // namespace

void mark_partial(const fs::path& partial, const std::string& run_id,
                  const std::string& target_name) {
  write_file_atomic((partial / kPartialMarkerFile).string(), to_json(run_id, target_name).dump());
}

void unmark_partial(const fs::path& partial) {
  std::error_code ec;
  if (fs::remove(partial / kPartialMarkerFile, ec)) fsync_dir(partial.string());
}

bool partial_reusable(const fs::path& partial, const std::string& run_id,
                      const std::string& target_name) {
  RunRecord r;
  if (run_id.empty() || !read_record(partial / kPartialMarkerFile, &r)) return false;
  if (r.run_id != run_id || r.target != target_name || !detail::ended_or_this(r.process)) {
    return false;
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(partial, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != kPartialMarkerFile && !(entry.is_regular_file(ec) && checkpoint_file_name(name))) {
      return false;
    }
  }
  return !ec;
}

LastLink claim_last(const fs::path& dir, const std::string& run_id) {
  const fs::path file = dir / kOwnerRecordFile;
  RunRecord owner;
  const bool owned = read_record(file, &owner);
  LastLink out{"last", ""};
  if (owned && owner.run_id != run_id) {
    out.name = "last-" + prefix(run_id);
    out.warning = "[ModelCheckpoint] warning: " + dir.string() + " belongs to another " +
                  describe(owner) + ", whose newest checkpoint " + (dir / "last").string() +
                  " names; this run (" + prefix(run_id) + ") keeps " +
                  (dir / out.name).string() + " instead: resume it with --ckpt-path " +
                  (dir / out.name).string() + ", the other run with --ckpt-path " +
                  (dir / "last").string();
    return out;
  }
  try {
    write_file_atomic(file.string(), to_json(run_id, "").dump(1));
  } catch (const FormatError& e) {
    TORCH_CHECK(false, "[ModelCheckpoint] cannot record the owner of ", dir.string(), ": ",
                e.what(), "; check that it is writable");
  }
  // Two runs taking a new directory at one instant: the record last renamed in wins, the other
  // run sees it here and keeps a link of its own.
  RunRecord now;
  if (read_record(file, &now) && now.run_id != run_id) return claim_last(dir, run_id);
  return out;
}

}  // namespace fsdp::ckpt
