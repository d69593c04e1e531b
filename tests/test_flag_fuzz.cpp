// Every flag of every program, driven with hostile values: empty, negative, zero, NaN, ±inf,
// huge, 20 digits, a word, a fraction, 5,000 characters, non-UTF-8, a missing path, a directory
// where a file goes, a file where a directory goes.
//
// The flags come from the programs themselves (--list-flags, see Note [Checking a command line
// without running it] in apps/cli.h), so a new flag is fuzzed without a change here. Each case
// runs through --check-flags-batch: a child forked per command line parses it with
// --check-flags and goes through the program's own checks, as a process started with it would,
// without starting any work. Asserted for every case:
//  - no signal, no C++ backtrace, no CLI11 range text;
//  - a refusal is one line (and exits non-zero);
//  - a value that can never be right for the flag's kind (its checks: a number, a name from a
//    list, an input path, an output file, an output directory, free text) is refused, in a
//    line that names the flag;
//  - nothing is left behind: no file or directory appears in the scratch directory, and the
//    missing paths the cases named still do not exist.
// A value the flag's kind may accept (a negative seed, a long job name, a missing output
// directory) may be accepted: then only the first two points hold.
#include <gtest/gtest.h>

#include "testing.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <sstream>

namespace {
namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

fs::path scratch() {
  static fs::path p = [] {
    fs::path d = fs::temp_directory_path() / ("fsdp_flag_fuzz_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d / "adir");
    std::ofstream(d / "afile") << "not a checkpoint\n";
    return d;
  }();
  return p;
}

struct Flag {
  std::string sub;  // "-" for the program itself
  std::string name;
  std::string type;    // INT, UINT, FLOAT, TEXT, ... or FLAG
  std::string checks;  // comma separated (our check names), "-" for none
  bool has(const std::string& check) const {
    return ("," + checks + ",").find("," + check + ",") != std::string::npos;
  }
  bool positional() const { return name.empty() || name[0] != '-'; }
};

std::vector<Flag> list_flags(const std::vector<std::string>& argv) {
  std::vector<std::string> a = argv;
  a.push_back("--list-flags");
  ProcResult r = run_process(a, {}, 60);
  EXPECT_EQ(r.exit_code, 0) << a[0] << " --list-flags: " << r.err;
  std::vector<Flag> out;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    Flag f;
    std::getline(fields, f.sub, '\t');
    std::getline(fields, f.name, '\t');
    std::getline(fields, f.type, '\t');
    std::getline(fields, f.checks, '\t');
    if (!f.name.empty()) out.push_back(f);
  }
  return out;
}

// The hostile values, and for each whether a flag of a given kind must refuse it.
enum class V {
  kEmpty, kNegative, kZero, kNan, kInf, kMinusInf, kHuge, kTwentyDigits, kWord, kFraction,
  kLong, kNotUtf8, kMissingPath, kDirectory, kFile
};
const std::vector<V> kValues = {V::kEmpty, V::kNegative, V::kZero, V::kNan, V::kInf,
                                V::kMinusInf, V::kHuge, V::kTwentyDigits, V::kWord,
                                V::kFraction, V::kLong, V::kNotUtf8, V::kMissingPath,
                                V::kDirectory, V::kFile};

std::string text_of(V v, int index) {
  switch (v) {
    case V::kEmpty: return "";
    case V::kNegative: return "-1";
    case V::kZero: return "0";
    case V::kNan: return "nan";
    case V::kInf: return "inf";
    case V::kMinusInf: return "-inf";
    case V::kHuge: return "1e400";
    case V::kTwentyDigits: return "12345678901234567890";
    case V::kWord: return "abc";
    case V::kFraction: return "1.5";
    case V::kLong: return std::string(5000, 'a');
    case V::kNotUtf8: return "\xff\xfe";
    // One per case, so a leftover names its case.
    case V::kMissingPath: return (scratch() / ("missing-" + std::to_string(index)) / "x").string();
    case V::kDirectory: return (scratch() / "adir").string();
    case V::kFile: return (scratch() / "afile").string();
  }
  return {};
}

bool numeric(const Flag& f) {
  return f.type == "INT" || f.type == "UINT" || f.type == "FLOAT" || f.has("number") ||
         f.has("at_least") || f.has("greater_than") || f.has("between") || f.has("elements");
}
bool whole(const Flag& f) { return f.type == "INT" || f.type == "UINT"; }
bool path_kind(const Flag& f) {
  return f.has("input_file") || f.has("input_dir") || f.has("input_path") ||
         f.has("output_file") || f.has("output_dir");
}

// Whether every flag of `f`'s kind must refuse `v`.
bool must_refuse(const Flag& f, V v) {
  if (v == V::kEmpty || v == V::kNotUtf8) return true;  // every kind
  if (numeric(f)) {
    switch (v) {
      case V::kNan: case V::kInf: case V::kMinusInf: case V::kHuge: case V::kWord:
      case V::kLong: case V::kMissingPath: case V::kDirectory: case V::kFile:
        return true;
      case V::kTwentyDigits: case V::kFraction:
        return whole(f);
      default:
        return false;
    }
  }
  if (path_kind(f)) {
    if (v == V::kLong) return true;
    const bool missing = v == V::kMissingPath;
    if (f.has("input_file")) return missing || v == V::kDirectory;
    if (f.has("input_dir")) return missing || v == V::kFile;
    if (f.has("input_path")) return missing;
    if (f.has("output_file")) return missing || v == V::kDirectory;
    if (f.has("output_dir")) return v == V::kFile;
  }
  if (f.has("one_of")) return v != V::kNegative && v != V::kZero;  // no list has these names
  return false;  // free text: a word, a number, a long name may all be fine
}

struct Case {
  std::string what;  // for messages
  Flag flag;
  V value;
  std::vector<std::string> args;
};

// A program's cases: `base(flag)` gives the command line around the flag and its value.
struct Program {
  std::vector<std::string> argv;  // the program (and a fsdp-bench subcommand)
  std::function<std::vector<std::string>(const Flag&, const std::string&)> command_line;
};

std::vector<std::string> with_flag(std::vector<std::string> base, const Flag& f,
                                   const std::string& value) {
  base.push_back(f.name);
  base.push_back(value);
  return base;
}

Program fsdp_train() {
  return {{fsdp::testing::bin_path("fsdp-train")},
          [](const Flag& f, const std::string& v) { return with_flag({}, f, v); }};
}

Program fsdp_finetune() {
  return {{fsdp::testing::bin_path("fsdp-finetune")}, [](const Flag& f, const std::string& v) {
            // A model is required: a preset, unless the flag is one of the two ways to name it.
            std::vector<std::string> base;
            if (f.name != "--model-dir" && f.name != "--preset") base = {"--preset", "llama-tiny"};
            return with_flag(base, f, v);
          }};
}

Program fsdp_run() {
  return {{fsdp::testing::bin_path("fsdp-run")}, [](const Flag& f, const std::string& v) {
            std::vector<std::string> base;
            if (f.name != "--nproc-per-node") base = {"-n", "1"};
            auto out = with_flag(base, f, v);
            out.insert(out.end(), {"--", "true"});
            return out;
          }};
}

Program fsdp_ckpt() {
  return {{fsdp::testing::bin_path("fsdp-ckpt")}, [](const Flag& f, const std::string& v) {
            const std::string in = (scratch() / "adir").string();
            const std::string out = (scratch() / "never-written").string();
            if (f.sub == "inspect") {
              return f.positional() ? std::vector<std::string>{"inspect", v}
                                    : with_flag({"inspect", in}, f, v);
            }
            if (f.name == "input") return std::vector<std::string>{"convert", v, out};
            if (f.name == "output") return std::vector<std::string>{"convert", in, v};
            return with_flag({"convert", in, out}, f, v);
          }};
}

Program fsdp_bench(const std::string& sub) {
  return {{fsdp::testing::bin_path("fsdp-bench"), sub},
          [](const Flag& f, const std::string& v) { return with_flag({}, f, v); }};
}

std::string join(const std::vector<std::string>& args) {
  std::string out;
  for (const auto& a : args) {
    out += (out.empty() ? "" : " ") + (a.size() > 40 ? a.substr(0, 20) + "...(" +
                                                          std::to_string(a.size()) + " bytes)"
                                                    : a);
  }
  return out;
}

int lines(const std::string& s) {
  int n = 0;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("[fsdp] backend ", 0) != 0) ++n;  // --backend auto's note, not an error
  }
  return n;
}

struct Outcome {
  int code = -1;
  int signal = 0;
  std::string err;
};

// Runs the cases through `program --check-flags-batch`, in the scratch directory.
std::vector<Outcome> run_batch(const Program& p, const std::vector<Case>& cases, int first) {
  const fs::path file = fs::temp_directory_path() /
                        ("fsdp_flag_fuzz_cases_" + std::to_string(::getpid()) + "_" +
                         std::to_string(first) + ".txt");
  {
    std::ofstream f(file, std::ios::binary);
    for (const Case& c : cases) {
      for (size_t i = 0; i < c.args.size(); ++i) f << (i ? "\x1f" : "") << c.args[i];
      f << "\n";
    }
  }
  std::vector<std::string> argv = p.argv;
  argv.insert(argv.end(), {"--check-flags-batch", file.string()});
  ProcResult r = run_process(argv, {}, 300);  // in scratch(): see the test
  fs::remove(file);
  EXPECT_EQ(r.exit_code, 0) << join(argv) << ": " << r.err;
  std::vector<Outcome> out;
  std::istringstream in(r.out);
  std::string head;
  while (std::getline(in, head)) {
    std::istringstream h(head);
    std::string tag;
    int index = 0;
    size_t bytes = 0;
    Outcome o;
    h >> tag >> index >> o.code >> o.signal >> bytes;
    if (tag != "CASE") break;
    o.err.resize(bytes);
    in.read(o.err.data(), static_cast<std::streamsize>(bytes));
    in.ignore(1);  // the newline after the bytes
    out.push_back(o);
  }
  EXPECT_EQ(out.size(), cases.size()) << join(argv) << ": " << r.err;
  return out;
}

// The text that must never reach a user.
const std::vector<std::string> kNever = {
    "frame #",           "Exception raised from", "terminate called", "Aborted",
    "not in range",      "17976931348623157",     "Failed parsing",   "Number less or equal",
    "not an allowed value", "Could not convert",  "json.exception",   "filesystem error"};

struct Tally {
  int cases = 0, refused = 0, accepted = 0;
};

// `first`: the index of the program's first case (the missing paths are numbered by it).
Tally fuzz(const Program& p, const std::vector<Flag>& flags, int first) {
  Tally tally;
  std::vector<Case> cases;
  for (const Flag& f : flags) {
    if (f.type == "FLAG") continue;  // no value to give
    if (f.positional() && f.sub == "-" && f.name == "command") continue;  // fsdp-run's program
    for (V v : kValues) {
      const int index = first + static_cast<int>(cases.size());
      Case c{"", f, v, p.command_line(f, text_of(v, index))};
      c.what = join(p.argv) + " " + join(c.args);
      cases.push_back(std::move(c));
    }
  }
  if (cases.empty()) return tally;
  const std::vector<Outcome> outcomes = run_batch(p, cases, first);
  for (size_t i = 0; i < outcomes.size() && i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Outcome& o = outcomes[i];
    ++tally.cases;
    (o.code == 0 ? tally.accepted : tally.refused)++;
    EXPECT_EQ(o.signal, 0) << c.what << ": killed by signal " << o.signal << "\n" << o.err;
    for (const std::string& never : kNever) {
      EXPECT_EQ(o.err.find(never), std::string::npos) << c.what << ": '" << never << "' in\n"
                                                      << o.err;
    }
    if (o.code != 0) EXPECT_EQ(lines(o.err), 1) << c.what << ": not one line\n" << o.err;
    if (must_refuse(c.flag, c.value)) {
      EXPECT_NE(o.code, 0) << c.what << ": accepted (" << c.flag.type << ", checks "
                           << c.flag.checks << ")\n" << o.err;
      EXPECT_NE(o.err.find(c.flag.name), std::string::npos)
          << c.what << ": the error does not name " << c.flag.name << "\n" << o.err;
    }
  }
  return tally;
}

// Nothing left behind: the scratch directory holds what it held, no missing path appeared.
void expect_nothing_left_behind() {
  std::set<std::string> found;
  for (const auto& e : fs::recursive_directory_iterator(scratch())) {
    found.insert(fs::relative(e.path(), scratch()).string());
  }
  EXPECT_EQ(found, (std::set<std::string>{"adir", "afile"}));
}

TEST(FlagFuzz, EveryFlagOfEveryProgramRefusesHostileValuesCleanly) {
  const auto start = std::chrono::steady_clock::now();
  Tally tally;
  std::vector<Program> programs = {fsdp_train(), fsdp_ckpt(), fsdp_run()};
  if (fs::exists(fsdp::testing::bin_path("fsdp-finetune"))) programs.push_back(fsdp_finetune());
  if (fs::exists(fsdp::testing::bin_path("fsdp-bench"))) {
    ProcResult subs = run_process({fsdp::testing::bin_path("fsdp-bench"), "--list-subcommands"});
    ASSERT_EQ(subs.exit_code, 0) << subs.err;
    std::istringstream in(subs.out);
    std::string sub;
    while (std::getline(in, sub)) programs.push_back(fsdp_bench(sub));
  }
  int flag_count = 0;
  const fs::path here = fs::current_path();
  fs::current_path(scratch());  // a relative path a case creates lands here
  // Two programs at a time (the suite runs on 2 cores); each batch is one process.
  std::vector<std::future<Tally>> running;
  int first = 0;
  for (const Program& p : programs) {
    const std::vector<Flag> flags = list_flags(p.argv);
    EXPECT_FALSE(flags.empty()) << join(p.argv);
    flag_count += static_cast<int>(flags.size());
    if (running.size() == 2) {
      const Tally t = running.front().get();
      running.erase(running.begin());
      tally.cases += t.cases, tally.refused += t.refused, tally.accepted += t.accepted;
    }
    running.push_back(std::async(std::launch::async, fuzz, p, flags, first));
    first += static_cast<int>(flags.size() * kValues.size());
  }
  for (auto& r : running) {
    const Tally t = r.get();
    tally.cases += t.cases, tally.refused += t.refused, tally.accepted += t.accepted;
  }
  fs::current_path(here);
  expect_nothing_left_behind();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[flag fuzz] " << programs.size() << " programs, " << flag_count << " flags, "
            << tally.cases << " cases (" << tally.refused << " refused, " << tally.accepted
            << " accepted) in " << s << " s" << std::endl;
  EXPECT_GT(tally.cases, 1000);
}

}  // namespace
