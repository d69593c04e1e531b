// Output checks and staging for checkpoint writers. See Note [Writers never destroy] in output.h.
#include "ckpt/output.h"

#include "ckpt/safetensors.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <regex>

#include <fcntl.h>
#include <unistd.h>

namespace fsdp::ckpt {

namespace fs = std::filesystem;

namespace {

fs::path absolute_of(const fs::path& p) {
  std::error_code ec;
  fs::path a = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p).lexically_normal() : a;
}

// `inner` is `outer` or lies below it (both absolute and normalized).
bool within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

}  // namespace

bool checkpoint_file_name(const std::string& name) {
  static const std::regex re(
      "(meta\\.json|metadata\\.json|model\\.safetensors|optimizer\\.safetensors|"
      "(shard|ddp_comm_state)-[0-9]+-of-[0-9]+\\.safetensors)(\\.tmp\\.[0-9]+)?");
  return std::regex_match(name, re);
}

std::string output_problem(const fs::path& input, const fs::path& out, OutputKind kind,
                           bool overwrite, const std::string& overwrite_flag) {
  const fs::path o = absolute_of(out);
  if (!input.empty()) {
    const fs::path i = absolute_of(input);
    if (o == i) {
      return "the output " + out.string() + " is the input; nothing was written: name a new "
             "output";
    }
    if (within(o, i)) {
      return "the output " + out.string() + " is inside the input " + input.string() +
             "; nothing was written: name an output outside the input";
    }
    if (within(i, o)) {
      return "the input " + input.string() + " is inside the output " + out.string() +
             ", which the output would replace; nothing was written: name an output that does "
             "not contain the input";
    }
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out, ec);
  if (!fs::exists(st)) return "";
  const std::string replace = overwrite_flag.empty()
                                  ? ""
                                  : "; nothing was written: pass " + overwrite_flag +
                                        " to replace it, or name a new output";
  if (kind == OutputKind::kSafetensorsFile) {
    if (!fs::is_regular_file(st)) {
      return "the output " + out.string() + " exists and is not a file; nothing was written: "
             "name a new .safetensors file";
    }
    try {
      SafetensorsReader check(out.string());
    } catch (const FormatError&) {
      return "the output " + out.string() + " exists and is not a safetensors file; nothing "
             "was written: name a new .safetensors file";
    }
    if (!overwrite) return "the output " + out.string() + " is an existing safetensors file" + replace;
    return "";
  }
  if (!fs::is_directory(st)) {
    return "the output " + out.string() + " exists and is not a directory; nothing was written: "
           "name a new or empty directory";
  }
  bool empty = true;
  for (const auto& entry : fs::directory_iterator(out, ec)) {
    empty = false;
    const std::string name = entry.path().filename().string();
    if (!checkpoint_file_name(name)) {
      return "the output " + out.string() + " exists and holds '" + name + "', which no "
             "checkpoint writer made; nothing was written: name a new or empty directory";
    }
  }
  if (ec) {
    return "cannot read the output directory " + out.string() + ": " + ec.message();
  }
  if (empty || overwrite) return "";
  return "the output " + out.string() + " is an existing checkpoint" + replace;
}

StagingDir::StagingDir(const fs::path& target, const std::string& who)
    : target_(target.lexically_normal()), who_(who) {
  static std::atomic<int> counter{0};
  fs::path parent = target_.parent_path();
  if (parent.empty()) parent = ".";
  std::error_code ec;
  fs::create_directories(parent, ec);
  TORCH_CHECK(!ec, who_, " cannot create ", parent.string(), ": ", ec.message(),
              "; check the output path");
  for (int attempt = 0;; ++attempt) {
    std::string name = ".";
    name += target_.filename().string();
    name += ".staging-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    const fs::path p = parent / name;
    // create_directory reports false for an existing name: only a directory made here is ours.
    if (fs::create_directory(p, ec)) {
      path_ = p;
      return;
    }
    TORCH_CHECK(!ec && attempt < 100, who_, " cannot create a staging directory in ",
                parent.string(), ": ", ec ? ec.message() : "every name taken",
                "; check that it is writable");
  }
}

StagingDir::~StagingDir() {
  if (published_ || path_.empty()) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void StagingDir::publish() {
  publish_dir(path_, target_, who_);
  published_ = true;
}

void publish_dir(const fs::path& staged, const fs::path& target, const std::string& who) {
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(target, ec));
  const bool empty_dir = exists && fs::is_directory(fs::symlink_status(target, ec)) &&
                         fs::is_empty(target, ec);
  if (!exists || empty_dir) {
    // rename(2) replaces an empty directory.
    TORCH_CHECK(std::rename(staged.c_str(), target.c_str()) == 0, who, " cannot move ",
                staged.string(), " to ", target.string(), ": ", std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(),
                         RENAME_EXCHANGE) == 0) {
    fs::remove_all(staged, ec);  // now the replaced checkpoint
  } else {
    // No RENAME_EXCHANGE on this filesystem: the old output goes to a name made here first,
    // so a crash between the renames leaves both whole.
    fs::path old = staged.string() + ".replaced";
    TORCH_CHECK(std::rename(target.c_str(), old.c_str()) == 0, who, " cannot move ",
                target.string(), " aside: ", std::strerror(errno));
    TORCH_CHECK(std::rename(staged.c_str(), target.c_str()) == 0, who, " cannot move ",
                staged.string(), " to ", target.string(), ": ", std::strerror(errno),
                " (the previous output is in ", old.string(), ")");
    fs::remove_all(old, ec);
  }
  fsync_dir(target.parent_path().empty() ? "." : target.parent_path().string());
}

}  // namespace fsdp::ckpt
