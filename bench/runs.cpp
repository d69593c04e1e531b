// Child processes and their JSON for the benchmarks that run whole programs. See runs.h.
#include "runs.h"

#include "fsdp/models.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace fsdp::bench {

namespace fs = std::filesystem;

std::string default_python() { return FSDP_PYTHON; }

std::string peers_dir() { return (fs::path(FSDP_SOURCE_DIR) / "bench" / "peers").string(); }

std::string command_line(const std::vector<std::string>& argv) {
  std::string cmd;
  for (const auto& a : argv) {
    const bool plain = !a.empty() && a.find_first_of(" \t\n'\"\\$`;&|<>*?()") == std::string::npos;
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    cmd += (cmd.empty() ? "" : " ") + (plain ? a : q + "'");
  }
  return cmd;
}

std::string read_text(const fs::path& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& text, size_t max_chars) {
  return text.size() <= max_chars ? text : "..." + text.substr(text.size() - max_chars);
}

int run_program(const std::vector<std::string>& argv, const fs::path& out, const fs::path& err,
                double timeout_s) {
  const pid_t pid = ::fork();
  if (pid < 0) return 127;
  if (pid == 0) {
    ::setpgid(0, 0);  // its own group: a timeout kills the ranks it started as well
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0) ::_exit(127);
    ::dup2(o, STDOUT_FILENO);
    ::dup2(e, STDERR_FILENO);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(-pid, SIGKILL);  // ranks a failed launcher left behind
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

nlohmann::json last_json_object(const std::string& text) {
  std::istringstream lines(text);
  nlohmann::json last;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) last = std::move(j);
  }
  return last;
}

namespace {

int64_t vocab_of(const TrainRun& run) {
  return fsdp::demos::is_transformer_model(run.model)
             ? fsdp::demos::transformer_preset(run.model, run.vocab_size).vocab_size
             : fsdp::demos::gpt_preset(run.model, run.vocab_size).vocab_size;
}

std::string num(double v) {  // all digits that matter (std::to_string(1e-8) is "0.000000")
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.12g", v);
  return buf;
}

fs::path batch_file(const TrainRun& run) { return run.dir / "batches.safetensors"; }

// The flags fsdp-train takes for the run's model and data (training and --save-batches alike).
std::vector<std::string> fsdp_train_argv(const std::string& fsdp_train, const TrainRun& run) {
  return {fsdp_train,
          "--model", run.model,
          "--data", "synthetic",
          "--vocab-size", std::to_string(vocab_of(run)),
          "--devices", std::to_string(run.devices),
          "--batch-size", std::to_string(run.batch_size),
          "--block-size", std::to_string(run.block_size),
          "--max-steps", std::to_string(run.steps),
          "--seed", std::to_string(run.seed)};
}

std::string error_text(const std::string& what, int code, const fs::path& err) {
  return what + " exited with status " + std::to_string(code) + ": " + tail(read_text(err));
}

}  // namespace

nlohmann::json write_batches(const std::string& fsdp_train, const TrainRun& run) {
  std::vector<std::string> argv = fsdp_train_argv(fsdp_train, run);
  argv.push_back("--save-batches");
  argv.push_back(batch_file(run).string());
  const fs::path out = run.dir / "batches.out", err = run.dir / "batches.err";
  const int code = run_program(argv, out, err, run.timeout_s);
  nlohmann::json r = {{"file", batch_file(run).string()}, {"command", command_line(argv)}};
  if (code != 0) r["error"] = error_text("fsdp-train --save-batches", code, err);
  return r;
}

nlohmann::json run_fsdp_train(const std::string& fsdp_train, const TrainRun& run,
                              const std::vector<std::string>& flags, const std::string& name) {
  const fs::path summary = run.dir / (name + ".json");
  // cores / ranks threads per rank, as the peers get and the record says, whatever the load
  // (fsdp-train would otherwise choose from the free cores: docs/launching.md).
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency() / run.devices);
  std::vector<std::string> argv = {"env", "FSDP_NUM_THREADS=" + std::to_string(threads)};
  for (const auto& a : fsdp_train_argv(fsdp_train, run)) argv.push_back(a);
  for (const auto& f : flags) argv.push_back(f);
  // The peers run on Gloo: unless `flags` choose, fsdp-train does too (not --backend auto,
  // which would pick MPI on one host), so comparisons hold the backend fixed.
  if (std::find(flags.begin(), flags.end(), "--backend") == flags.end()) {
    argv.insert(argv.end(), {"--backend", "gloo"});
  }
  argv.insert(argv.end(), {"--dropout", num(run.dropout), "--lr", num(run.lr), "--limit-val-batches", "0",
                           "--no-progress-bar", "--default-root-dir", (run.dir / "logs").string(),
                           "--summary-json", summary.string()});
  nlohmann::json r = {{"system", "fsdp.cpp"}, {"command", command_line(argv)}};
  std::error_code ec;
  fs::remove(summary, ec);
  const fs::path out = run.dir / (name + ".out"), err = run.dir / (name + ".err");
  const int code = run_program(argv, out, err, run.timeout_s);
  if (code != 0 || !fs::exists(summary)) {
    r["error"] = error_text("fsdp-train", code, err);
    return r;
  }
  nlohmann::json s = nlohmann::json::parse(read_text(summary));
  std::vector<double> rss;  // lifetime VmHWM per rank = max(setup peak, training peak)
  for (size_t i = 0; i < s["peak_rss_mb"].size(); ++i) {
    rss.push_back(std::max(s["peak_rss_mb"][i].get<double>(),
                           s["setup_peak_rss_mb"][i].get<double>()));
  }
  for (const char* key : {"strategy", "world_size", "params", "steps", "losses",
                          "step_end_seconds", "forward_seconds", "backward_seconds",
                          "optimizer_seconds", "comm_seconds", "disk_wait_seconds",
                          "peak_alloc_mb", "setup_peak_alloc_mb",
                          "minor_faults_per_step", "user_seconds_per_step",
                          "sys_seconds_per_step"}) {
    if (s.contains(key)) r[key] = s[key];
  }
  if (s.contains("comm_bytes_per_step")) r["comm_bytes_per_step"] = s["comm_bytes_per_step"];
  r["peak_rss_mb"] = rss;
  r["threads_per_rank"] = threads;
  return r;
}

nlohmann::json run_peer(const std::string& python, const std::string& script,
                        const TrainRun& run, const std::vector<std::string>& flags,
                        const std::string& name) {
  const auto dims = fsdp::demos::transformer_preset(run.model, run.vocab_size);
  std::vector<std::string> argv = {python, script};
  for (const auto& f : flags) argv.push_back(f);
  argv.insert(argv.end(), {"--world", std::to_string(run.devices),
                           "--batches", batch_file(run).string(),
                           "--steps", std::to_string(run.steps),
                           "--vocab", std::to_string(dims.vocab_size),
                           "--ninp", std::to_string(dims.ninp),
                           "--nhead", std::to_string(dims.nhead),
                           "--nhid", std::to_string(dims.nhid),
                           "--nlayers", std::to_string(dims.nlayers),
                           "--dropout", num(run.dropout),
                           "--lr", num(run.lr),
                           "--seed", std::to_string(run.seed)});
  const fs::path out = run.dir / (name + ".out"), err = run.dir / (name + ".err");
  const int code = run_program(argv, out, err, run.timeout_s);
  nlohmann::json p = last_json_object(read_text(out));
  nlohmann::json r = p.is_object() ? p : nlohmann::json::object();
  r["command"] = command_line(argv);
  const std::string what = fs::path(script).filename().string();
  if (code != 0 && !r.contains("error")) {
    r["error"] = error_text(what, code, err);
  } else if (!p.is_object()) {
    r["error"] = what + " printed no JSON: " + tail(read_text(err));
  }
  return r;
}

std::string load_average() {
  std::istringstream in(read_text("/proc/loadavg"));
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::vector<std::string> split_list(const std::string& comma_list) {
  std::vector<std::string> v;
  std::stringstream in(comma_list);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) v.push_back(item);
  }
  return v;
}

double max_of(const nlohmann::json& values) {
  double m = 0;
  for (const auto& v : values) m = std::max(m, v.get<double>());
  return m;
}

int print_report(nlohmann::json& out, const std::string& markdown_file,
                 const std::function<std::string(const nlohmann::json&)>& markdown_table) {
  out["load_average_end"] = load_average();
  out["markdown"] = markdown_table(out);
  std::cout << out.dump(2) << std::endl;
  std::cerr << out["markdown"].get<std::string>();
  if (!markdown_file.empty()) std::ofstream(markdown_file) << out["markdown"].get<std::string>();
  for (const auto& r : out["runs"]) {
    if (r["system"] == "fsdp.cpp" && r.contains("error")) return 1;
  }
  return 0;
}

nlohmann::json it_per_s(const std::vector<double>& step_end_seconds, int warmup) {
  const int n = static_cast<int>(step_end_seconds.size());
  if (warmup < 1 || warmup >= n) return nullptr;
  const double seconds = step_end_seconds[n - 1] - step_end_seconds[warmup - 1];
  if (!(seconds > 0)) return nullptr;
  return (n - warmup) / seconds;
}

}  // namespace fsdp::bench
