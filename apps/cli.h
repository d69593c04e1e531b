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

// See Note [One sentence per bad flag]: every numeric option gets at least the type check.
inline void add_number_checks(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (has_own_check(o)) continue;
    const std::string type = o->get_type_name();
    if (type == "INT") o->check(number<int64_t>());
    if (type == "UINT") o->check(number<uint64_t>());
    if (type == "FLOAT") o->check(number<double>());
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_number_checks(*sub);
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

// Parses argv. Returns std::nullopt to go on, or the exit status to return at once: 0 after
// --help (printed), 2 after a bad flag or value (one line on stderr).
inline std::optional<int> parse(CLI::App& app, int argc, const char* const* argv,
                                const std::string& prog) {
  detail::add_number_checks(app);
  try {
    app.parse(argc, argv);
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

}  // namespace fsdp::cli
