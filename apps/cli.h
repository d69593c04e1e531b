// Command-line checks shared by every program in apps/ and bench/: a bad flag value is answered
// in one sentence that names the flag ("--devices must be at least 1", "--lr: 'abc' is not a
// number"), never CLI11's range text ("Value 0 not in range 0.000000 to 1797693134862315...").
//
//   app.add_option("--devices", devices, "ranks per node")->check(fsdp::cli::at_least(1));
//   app.add_option("--lr", lr, "learning rate")->check(fsdp::cli::greater_than(0.0));
//   if (auto code = fsdp::cli::parse(app, argc, argv, "fsdp-train")) return *code;
//
// See Note [One sentence per bad flag]. docs/errors.md lists the messages.
#pragma once

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <chrono>
#include <fstream>

#include "cli_markdown.h"
#include "cli_paths.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdp::cli {

// Note [One sentence per bad flag]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CLI11 checks a value with its Validators (on the text, before conversion), then converts it.
// Its stock validators (Range, PositiveNumber, ...) answer with their own wording, and a failed
// conversion says "The value abc is not an allowed value for --lr". So:
//  - every numeric check here first parses the text as the flag's own type and says what is
//    wrong with it ("'abc' is not a number", "'1.5' is not a whole number", "'1e99' is too
//    large"), then checks the bound ("must be at least 1");
//  - parse() adds the type check to every numeric option that has no check of ours (found by
//    CLI11's type name), so a flag without a bound still answers in a sentence;
//  - parse() prints the one line "PROG: error: SENTENCE (see PROG --help)" and returns 2.
// Validators are named "fsdp:..." so parse() can tell them from CLI11's.
constexpr const char* kCheckPrefix = "fsdp:";

namespace detail {

template <typename T>
std::string show(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    std::ostringstream out;
    out << v;  // 0.001, 1e+06: the shortest readable form
    return out.str();
  } else {
    return std::to_string(v);
  }
}

// Parses all of `text` as a T. Returns "" or the reason it is not one.
template <typename T>
std::string parse_as(const std::string& text, T& out) {
  const std::string quoted = "'" + text + "'";
  if (text.empty()) return "needs a value";
  if constexpr (std::is_floating_point_v<T>) {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != '\0') return quoted + " is not a number";
    if (errno == ERANGE && std::abs(v) > 1) return quoted + " is too large";
    if (!std::isfinite(v)) return quoted + " is not a finite number";
    out = static_cast<T>(v);
    return {};
  } else {
    const char* first = text.c_str();
    const char* last = first + text.size();
    if (*first == '+') ++first;
    auto [ptr, ec] = std::from_chars(first, last, out);
    if (ec == std::errc::result_out_of_range) {
      return quoted + " is out of range (" + show(std::numeric_limits<T>::min()) + " to " +
             show(std::numeric_limits<T>::max()) + ")";
    }
    if (ec != std::errc() || ptr != last) {
      char* end = nullptr;
      std::strtod(text.c_str(), &end);
      const bool numeric = end != text.c_str() && *end == '\0';
      return quoted + (numeric ? " is not a whole number" : " is not a number");
    }
    return {};
  }
}

template <typename T>
CLI::Validator numeric_check(std::string description, std::string name,
                             std::function<std::string(T)> bound) {
  return CLI::Validator(
      [bound](std::string& text) -> std::string {
        T v{};
        std::string why = parse_as<T>(text, v);
        if (!why.empty()) return why;
        return bound ? bound(v) : std::string();
      },
      std::move(description), std::string(kCheckPrefix) + name);
}

}  // namespace detail

// The text parses as a T (no bound).
template <typename T>
CLI::Validator number() {
  return detail::numeric_check<T>("", "number", {});
}

template <typename T>
CLI::Validator at_least(T min) {
  return detail::numeric_check<T>(">= " + detail::show(min), "at_least", [min](T v) {
    return v >= min ? std::string() : "must be at least " + detail::show(min);
  });
}

template <typename T>
CLI::Validator greater_than(T min) {
  return detail::numeric_check<T>("> " + detail::show(min), "greater_than", [min](T v) {
    return v > min ? std::string() : "must be greater than " + detail::show(min);
  });
}

template <typename T>
CLI::Validator between(T lo, T hi) {
  return detail::numeric_check<T>(
      "in [" + detail::show(lo) + ", " + detail::show(hi) + "]", "between", [lo, hi](T v) {
        return v >= lo && v <= hi ? std::string()
                                  : "must be between " + detail::show(lo) + " and " +
                                        detail::show(hi);
      });
}

// The value is one of `names` (exactly).
inline CLI::Validator one_of(std::vector<std::string> names) {
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return CLI::Validator(
      [names, list](std::string& text) -> std::string {
        if (std::find(names.begin(), names.end(), text) != names.end()) return {};
        return "'" + text + "' is not one of: " + list;
      },
      "one of: " + list, std::string(kCheckPrefix) + "one_of");
}

namespace detail {

inline bool has_own_check(CLI::Option* o) {
  for (int i = 0;; ++i) {
    CLI::Validator* v = nullptr;
    try {
      v = o->get_validator(i);
    } catch (const CLI::OptionNotFound&) {
      return false;
    }
    if (v->get_name().rfind(kCheckPrefix, 0) == 0) return true;
  }
}

// See Note [One sentence per bad flag]: every numeric option gets at least the type check, every
// text option the text check (not empty, UTF-8: see Note [Paths on the command line]).
inline void add_value_checks(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (o->get_items_expected_max() == 0 || has_own_check(o)) continue;
    const std::string type = o->get_type_name();
    if (type == "INT") o->check(number<int64_t>());
    if (type == "UINT") o->check(number<uint64_t>());
    if (type == "FLOAT") o->check(number<double>());
    // One value per occurrence (a command after "--" may hold empty arguments).
    if (type == "TEXT" && o->get_items_expected_max() == 1) {
      o->check(CLI::Validator([](std::string& text) { return text_problem(text); }, "",
                              std::string(kCheckPrefix) + "text"));
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_value_checks(*sub);
}

// Note [Checking a command line without running it]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// parse() gives every program hidden flags (not in --help):
//  --check-flags  check the command line (every value, path and config the program checks
//                 before it starts work) and exit 0, or fail as the real run would;
//  --check-flags-batch FILE  the check of many command lines at process-start cost each
//                 (forked children; see detail::run_check_batch), for the fuzz test;
//  --list-flags   print the flags, one per line: "SUBCOMMAND<TAB>NAME<TAB>TYPE<TAB>CHECKS"
//                 (SUBCOMMAND "-" for the program itself; TYPE is CLI11's (INT, FLOAT, TEXT) or
//                 FLAG for a flag without a value; CHECKS the names of our checks, comma
//                 separated), and exit 0;
//  --help-markdown  print --help as Markdown (Note [Generated CLI reference] in
//                 apps/cli_markdown.h) and exit 0.
// tests/test_flag_fuzz.cpp drives every listed flag with hostile values through --check-flags,
// so a new flag is covered without a change there.
inline bool& check_flags_given() {
  static bool given = false;
  return given;
}

inline void add_hidden_flags(CLI::App& app) {
  if (app.get_option_no_throw("--check-flags") == nullptr) {  // once, if parse() runs again
    app.add_flag("--check-flags", check_flags_given(), "")->group("");
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_hidden_flags(*sub);
}

inline std::string checks_of(CLI::Option* o) {
  std::string out;
  for (int i = 0;; ++i) {
    CLI::Validator* v = nullptr;
    try {
      v = o->get_validator(i);
    } catch (const CLI::OptionNotFound&) {
      break;
    }
    const std::string& name = v->get_name();
    if (name.rfind(kCheckPrefix, 0) != 0) continue;
    out += (out.empty() ? "" : ",") + name.substr(std::string(kCheckPrefix).size());
  }
  return out.empty() ? "-" : out;
}

inline void list_flags(CLI::App& app, const std::string& sub, std::ostream& out) {
  for (CLI::Option* o : app.get_options()) {
    if (o->get_group().empty() || o->get_name() == "--help" || o->get_name() == "--help-all") {
      continue;  // hidden, or help
    }
    std::string name = o->get_lnames().empty() ? o->get_name() : "--" + o->get_lnames().front();
    if (name.empty() && !o->get_snames().empty()) name = "-" + o->get_snames().front();
    // CLI11's type name, without the checks' descriptions it appends ("INT:>= 1").
    const std::string full = o->get_type_name();
    const std::string type =
        o->get_items_expected_max() == 0 ? "FLAG" : full.substr(0, full.find(':'));
    out << (sub.empty() ? "-" : sub) << "\t" << name << "\t" << type << "\t" << checks_of(o)
        << "\n";
  }
  for (CLI::App* s : app.get_subcommands([](CLI::App*) { return true; })) {
    list_flags(*s, s->get_name(), out);
  }
}

inline std::string replace_first(std::string s, const std::string& from, const std::string& to) {
  auto at = s.find(from);
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

}  // namespace detail

// The one sentence for a CLI11 parse error.
inline std::string sentence(const CLI::ParseError& e) {
  std::string msg = e.what();
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  // Our checks: "--devices: must be at least 1" reads better without the colon.
  msg = detail::replace_first(msg, ": must be", " must be");
  msg = detail::replace_first(msg, ": needs a value", " needs a value");
  // A conversion CLI11 did itself (a value beyond the option's type that our type check let
  // through, e.g. an int flag given 3000000000): "The value X is not an allowed value for --f".
  const std::string conv = "The value ", allowed = " is not an allowed value for ";
  if (msg.rfind(conv, 0) == 0 && msg.find(allowed) != std::string::npos) {
    auto at = msg.find(allowed);
    std::string value = msg.substr(conv.size(), at - conv.size());
    std::string flag = msg.substr(at + allowed.size());
    return flag + ": '" + value + "' is out of range for this flag";
  }
  const std::string could = "Could not convert: ";
  if (msg.rfind(could, 0) == 0 && msg.find(" = ") != std::string::npos) {
    auto eq = msg.find(" = ");
    return msg.substr(could.size(), eq - could.size()) + ": '" + msg.substr(eq + 3) +
           "' is out of range for this flag";
  }
  // "--devices: 1 required INT missing" (a flag at the end of the line without its value).
  if (msg.find(" required ") != std::string::npos && msg.find(" missing") != std::string::npos) {
    auto colon = msg.find(':');
    if (colon != std::string::npos) return msg.substr(0, colon) + " needs a value";
  }
  return msg;
}

namespace detail {

// --check-flags-batch FILE: see Note [Checking a command line without running it]. Each line of
// FILE is one command line (its arguments separated by \x1f); for each, a child forked here
// parses it with --check-flags and goes on through the program's own checks, as a process
// started with that command line would. Returns in the children (with the case's argv) and
// ends the parent, which prints, per case, "CASE <i> <exit status> <signal> <bytes>\n" and
// the child's stderr.
inline std::vector<std::string> batch_case(const std::string& line) {
  std::vector<std::string> args;
  size_t start = 0;
  while (true) {
    const size_t end = line.find('\x1f', start);
    args.push_back(line.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return args;
    start = end + 1;
  }
}

// In the parent: runs every case and exits. In a child: stores the case's arguments in `args`
// and returns.
inline void run_check_batch(const std::string& file, std::vector<std::string>& args) {
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    std::cerr << "--check-flags-batch: cannot read " << file << std::endl;
    std::exit(2);
  }
  std::string line;
  for (int index = 0; std::getline(in, line); ++index) {
    int fds[2];
    if (::pipe(fds) != 0) std::exit(3);
    std::cout.flush();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      ::dup2(fds[1], 2);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::close(fds[1]);
      args = batch_case(line);
      check_flags_given() = true;
      // The child ends as the process would, with its status and output, but without running
      // libtorch's static destructors (a third of a second each, the cost of a case).
      ::on_exit(
          [](int status, void*) {
            std::cout.flush();
            std::cerr.flush();
            std::fflush(nullptr);
            ::_exit(status);
          },
          nullptr);
      return;
    }
    ::close(fds[1]);
    std::string err;
    char buf[4096];
    // A check never waits: 20 s without the child ending is reported as signal 9 (killed).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    bool killed = false;
    while (true) {
      pollfd p{fds[0], POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) {
        ::kill(pid, SIGKILL);
        killed = true;
        break;
      }
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;
      err.append(buf, static_cast<size_t>(n));
    }
    ::close(fds[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const int sig = killed ? SIGKILL : WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    std::cout << "CASE " << index << " " << code << " " << sig << " " << err.size() << "\n"
              << err << "\n";
  }
  std::cout.flush();
  ::_exit(0);
}

}  // namespace detail

// When a program ends --check-flags (Note [Checking a command line without running it]).
enum class CheckFlags {
  kAtParse,      // parse() returns 0 after a good command line: the program checks nothing more
  kByTheProgram  // parse() returns nullopt; the program checks the rest, then returns
                 // check_only_exit() where its work would start
};

// Parses argv. Returns std::nullopt to go on, or the exit status to return at once: 0 after
// --help (printed), 2 after a bad flag or value (one line on stderr).
inline std::optional<int> parse(CLI::App& app, int argc, const char* const* argv,
                                const std::string& prog,
                                CheckFlags check_flags = CheckFlags::kAtParse) {
  detail::add_value_checks(app);
  // Before parsing: the list needs no valid command line (required flags may be missing).
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--list-flags") {
      detail::list_flags(app, "", std::cout);
      return 0;
    }
    if (std::string(argv[i]) == "--help-markdown") {  // Note [Generated CLI reference]
      detail::help_markdown(app, prog, std::cout);
      return 0;
    }
  }
  detail::add_hidden_flags(app);
  std::vector<std::string> batch_args;  // a --check-flags-batch case, in the child
  std::vector<const char*> batch_argv;
  if (argc == 3 && std::string(argv[1]) == "--check-flags-batch") {
    detail::run_check_batch(argv[2], batch_args);  // returns in a child only
    batch_argv.push_back(argv[0]);
    for (const auto& a : batch_args) batch_argv.push_back(a.c_str());
    argc = static_cast<int>(batch_argv.size());
    argv = batch_argv.data();
  }
  try {
    app.parse(argc, argv);
    if (detail::check_flags_given() && check_flags == CheckFlags::kAtParse) return 0;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return 0;
    std::cerr << prog << ": error: " << sentence(e) << " (see " << prog << " --help)"
              << std::endl;
    return 2;
  }
  return std::nullopt;
}

// Whether --check-flags was given (see CheckFlags::kByTheProgram).
inline bool check_only() { return detail::check_flags_given(); }

}  // namespace fsdp::cli
