// Path checks for command-line flags (header-only, as apps/cli.h): a path flag is checked when
// the command line is parsed, before any work starts, and nothing is created by the check.
//
//   app.add_option("--summary-json", path, "...")->check(fsdp::cli::output_file());
//   app.add_option("--checkpoint-dir", dir, "...")->check(fsdp::cli::output_dir());
//   app.add_option("--model-dir", dir, "...")->check(fsdp::cli::input_dir());
//
// See Note [Paths on the command line]. docs/errors.md lists the messages.
#pragma once

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

namespace fsdp::cli {

// Note [Paths on the command line]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every path a program reads or writes is checked at parse time, so that a bad one is refused
// before the ranks start, not after training (a summary JSON whose directory does not exist) or
// halfway (a checkpoint directory under a file). The checks only look: nothing is created.
//  - The text itself: not empty (an empty --nvme-path would mean the current directory's
//    parent), UTF-8 (paths are recorded in JSON: checkpoint metadata, summaries, adapters), at
//    most PATH_MAX - 1 bytes with no name longer than NAME_MAX.
//  - An input must exist and be of the right kind (file or directory).
//  - An output file must not be a directory and its directory must exist and be writable; an
//    output directory must be a directory or creatable: its nearest existing ancestor is a
//    writable directory. (access(2) answers for the real user, and reports a read-only file
//    system even to root.)
// Messages are printed after the flag's name: "--summary-json: directory '/nonexistent' does
// not exist".

namespace detail {

// Bytes that are not printable ASCII as \xNN, long texts shortened: the path as one readable
// line, whatever it holds.
inline std::string printable(const std::string& text, size_t max = 120) {
  std::string out;
  for (size_t i = 0; i < text.size() && out.size() < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (out.size() >= max) out += "...";
  return "'" + out + "'";
}

inline bool is_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    size_t len = 1;
    uint32_t cp = 0, min_cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f, min_cp = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f, min_cp = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07, min_cp = 0x10000;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    // Overlong forms, surrogates, beyond U+10FFFF.
    if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

// "" or why `text` cannot be a value: empty, not UTF-8. See Note [Paths on the command line].
inline std::string text_problem(const std::string& text) {
  if (text.empty()) return "needs a value";
  if (!is_utf8(text)) return printable(text) + " is not valid UTF-8";
  return {};
}

// "" or why `text` cannot be a path at all.
inline std::string path_problem(const std::string& text) {
  if (auto why = text_problem(text); !why.empty()) return why;
  if (text.size() >= PATH_MAX) {
    return "a path of " + std::to_string(text.size()) + " bytes is too long (at most " +
           std::to_string(PATH_MAX - 1) + ")";
  }
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('/', start);
    if (end == std::string::npos) end = text.size();
    if (end - start > NAME_MAX) {
      return "a name of " + std::to_string(end - start) + " bytes in " + printable(text) +
             " is too long (at most " + std::to_string(NAME_MAX) + " per name)";
    }
    start = end + 1;
  }
  return {};
}

// The nearest existing ancestor of `p` (p itself when it exists), or "" when none is found.
inline std::filesystem::path nearest_existing(std::filesystem::path p) {
  std::error_code ec;
  p = std::filesystem::absolute(p, ec);
  if (ec) return {};
  while (true) {
    if (std::filesystem::exists(std::filesystem::symlink_status(p, ec)) && !ec) return p;
    if (!p.has_parent_path() || p.parent_path() == p) return {};
    p = p.parent_path();
  }
}

inline bool writable_dir(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_directory(p, ec) && ::access(p.c_str(), W_OK | X_OK) == 0;
}

inline CLI::Validator path_check(std::string name, std::function<std::string(const std::string&)> f) {
  return CLI::Validator(
      [f](std::string& text) -> std::string {
        if (auto why = path_problem(text); !why.empty()) return why;
        return f(text);
      },
      "", std::string("fsdp:") + name);
}

}  // namespace detail

// An existing file (or a link to one).
inline CLI::Validator input_file() {
  return detail::path_check("input_file", [](const std::string& text) -> std::string {
    std::error_code ec;
    const auto st = std::filesystem::status(text, ec);
    if (!std::filesystem::exists(st)) return detail::printable(text) + " does not exist";
    if (std::filesystem::is_directory(st)) return detail::printable(text) + " is a directory, not a file";
    return {};
  });
}

// An existing file or directory.
inline CLI::Validator input_path() {
  return detail::path_check("input_path", [](const std::string& text) -> std::string {
    std::error_code ec;
    if (!std::filesystem::exists(text, ec)) return detail::printable(text) + " does not exist";
    return {};
  });
}

// An existing directory.
inline CLI::Validator input_dir() {
  return detail::path_check("input_dir", [](const std::string& text) -> std::string {
    std::error_code ec;
    const auto st = std::filesystem::status(text, ec);
    if (!std::filesystem::exists(st)) return detail::printable(text) + " does not exist";
    if (!std::filesystem::is_directory(st)) return detail::printable(text) + " is not a directory";
    return {};
  });
}

// A file this program may create or replace: not a directory, in an existing writable directory.
inline CLI::Validator output_file() {
  return detail::path_check("output_file", [](const std::string& text) -> std::string {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(text, ec)) return detail::printable(text) + " is a directory, not a file";
    fs::path dir = fs::absolute(fs::path(text), ec).parent_path();
    if (ec) return detail::printable(text) + " is not a usable path";
    if (!fs::exists(dir, ec)) return "directory " + detail::printable(dir.string()) + " does not exist";
    if (!fs::is_directory(dir, ec)) return detail::printable(dir.string()) + " is not a directory";
    if (!detail::writable_dir(dir)) return "directory " + detail::printable(dir.string()) + " is not writable";
    return {};
  });
}

// A directory this program may create or write into: a directory, or creatable (the nearest
// existing ancestor is a writable directory).
inline CLI::Validator output_dir() {
  return detail::path_check("output_dir", [](const std::string& text) -> std::string {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path at = detail::nearest_existing(text);
    if (at.empty()) return detail::printable(text) + " is not a usable path";
    if (!fs::is_directory(at, ec)) {
      return at == fs::absolute(fs::path(text), ec)
                 ? detail::printable(text) + " exists and is not a directory"
                 : detail::printable(text) + " cannot be created: " +
                       detail::printable(at.string()) + " is not a directory";
    }
    if (!detail::writable_dir(at)) return "directory " + detail::printable(at.string()) + " is not writable";
    return {};
  });
}

}  // namespace fsdp::cli
