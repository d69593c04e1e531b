// fsdp-bench soak: a long FSDP run with periodic sharded checkpoints, watched from outside.
// Every --sample-s seconds it reads each rank's resident memory, open file
// descriptors and threads from /proc; at the end it prints the curves and, per rank, the growth
// after warm-up (first and last thirds compared, and a least-squares slope per hour).
//
//   fsdp-bench soak [--minutes 30] [--devices 4] [--model transformer-small] [--vocab-size 1024]
//                   [--save-every-n-steps 20] [--sample-s 10] [--work-dir DIR]
//
// The ranks are found as the processes whose command line holds this run's unique work
// directory (fsdp-train re-executes itself, possibly through mpirun). Nothing is asserted: the
// JSON is the result; "flat" means the last third's mean RSS within 2% (and 16 MiB) of the first
// third's after warm-up, and no growth in descriptors or threads.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "runs.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Sample {
  double rss_mb = 0;
  int64_t threads = 0;
  int64_t fds = 0;
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Processes whose command line contains `marker` and that run fsdp-train (not mpirun).
std::vector<int> ranks_of(const std::string& marker) {
  std::vector<int> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::string cmd = read_all(e.path() / "cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find(marker) == std::string::npos) continue;
    const std::string exe0 = cmd.substr(0, cmd.find(' '));
    if (fs::path(exe0).filename() != "fsdp-train") continue;
    pids.push_back(std::stoi(name));
  }
  std::sort(pids.begin(), pids.end());
  return pids;
}

bool sample(int pid, Sample* s) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  if (!f) return false;
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s->rss_mb = std::stod(line.substr(6)) / 1024.0;
    if (line.rfind("Threads:", 0) == 0) s->threads = std::stoll(line.substr(8));
  }
  std::error_code ec;
  int64_t n = 0;
  for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != fs::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  s->fds = n;
  return true;
}

// The training job's process group, stopped with us on Ctrl-C or SIGTERM.
volatile sig_atomic_t g_child = 0;
void stop_child(int sig) {
  if (g_child > 0) kill(-g_child, SIGTERM);
  _exit(128 + sig);
}

double mean(const std::vector<double>& v, size_t a, size_t b) {
  double s = 0;
  for (size_t i = a; i < b; ++i) s += v[i];
  return b > a ? s / static_cast<double>(b - a) : 0;
}

// Least-squares slope of y over t (per unit of t).
double slope(const std::vector<double>& t, const std::vector<double>& y) {
  const size_t n = t.size();
  if (n < 2) return 0;
  const double mt = mean(t, 0, n), my = mean(y, 0, n);
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (t[i] - mt) * (y[i] - my);
    den += (t[i] - mt) * (t[i] - mt);
  }
  return den > 0 ? num / den : 0;
}

int run_soak(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench soak: RSS, descriptors and threads of a long FSDP run with "
               "checkpoints",
               "fsdp-bench soak"};
  double minutes = 30, sample_s = 10;
  int devices = 4;
  std::string model = "transformer-small", fsdp_train, work_dir, backend = "auto";
  int64_t vocab = 1024, every = 20, batch = 4;
  app.add_option("--minutes", minutes, "how long to train")->capture_default_str();
  app.add_option("--devices", devices, "ranks")->capture_default_str();
  app.add_option("--model", model, "demo model preset")->capture_default_str();
  app.add_option("--vocab-size", vocab, "synthetic vocabulary")->capture_default_str();
  app.add_option("--batch-size", batch, "per rank")->capture_default_str();
  app.add_option("--save-every-n-steps", every, "sharded checkpoint period")->capture_default_str();
  app.add_option("--sample-s", sample_s, "seconds between samples")->capture_default_str();
  app.add_option("--backend", backend, "auto | gloo | mpi")->capture_default_str();
  app.add_option("--fsdp-train", fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "checkpoints and logs (default: a fresh /tmp dir)");
  if (auto status = fsdp::bench::parse_args(app, "soak", args)) return *status;
  if (fsdp_train.empty()) fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  const fs::path dir = work_dir.empty()
                           ? fs::temp_directory_path() / ("fsdp-bench-soak-" + std::to_string(getpid()))
                           : fs::path(work_dir);
  fs::create_directories(dir);
  const std::string marker = (dir / "logs").string();

  std::vector<std::string> argv = {
      fsdp_train, "--model", model, "--vocab-size", std::to_string(vocab), "--strategy", "fsdp",
      "--devices", std::to_string(devices), "--backend", backend, "--batch-size",
      std::to_string(batch), "--max-steps", "100000000", "--no-progress-bar",
      "--log-every", "50", "--limit-val-batches", "0", "--default-root-dir", marker,
      "--checkpoint-dir", (dir / "ckpt").string(), "--save-every-n-steps", std::to_string(every),
      "--save-top-k", "1", "--state-dict-type", "sharded"};
  json out{{"bench", "soak"},
           {"command", fsdp::bench::command_line(argv)},
           {"config", {{"minutes", minutes}, {"devices", devices}, {"model", model},
                       {"vocab_size", vocab}, {"batch_size", batch},
                       {"save_every_n_steps", every}, {"sample_s", sample_s}}}};
  std::string load;
  {
    std::ifstream f("/proc/loadavg");
    std::getline(f, load);
  }
  out["load_average_start"] = load;

  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    std::freopen((dir / "train.out").c_str(), "w", stdout);
    std::freopen((dir / "train.err").c_str(), "w", stderr);
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  setpgid(child, child);
  g_child = child;
  std::signal(SIGINT, stop_child);
  std::signal(SIGTERM, stop_child);
  const auto start = Clock::now();
  std::map<int, std::vector<double>> t_of, rss_of, fds_of, thr_of;
  json samples = json::array();
  bool died = false;
  int status = 0;
  while (true) {
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    if (t >= minutes * 60) break;
    if (waitpid(child, &status, WNOHANG) == child) {
      died = true;
      break;
    }
    json row{{"t_s", t}};
    json ranks = json::array();
    for (int pid : ranks_of(marker)) {
      Sample s;
      if (!sample(pid, &s)) continue;
      t_of[pid].push_back(t);
      rss_of[pid].push_back(s.rss_mb);
      fds_of[pid].push_back(static_cast<double>(s.fds));
      thr_of[pid].push_back(static_cast<double>(s.threads));
      ranks.push_back({{"pid", pid}, {"rss_mb", s.rss_mb}, {"fds", s.fds}, {"threads", s.threads}});
    }
    row["ranks"] = ranks;
    int ckpts = 0;
    std::error_code ec;
    for (auto it = fs::directory_iterator(dir / "ckpt", ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      ++ckpts;
    }
    row["checkpoint_entries"] = ckpts;
    samples.push_back(row);
    std::cerr << "\r[fsdp-bench soak] " << static_cast<int>(t) << " s, " << ranks.size()
              << " ranks" << std::flush;
    std::this_thread::sleep_for(std::chrono::duration<double>(sample_s));
  }
  std::cerr << std::endl;
  if (!died) {
    kill(-child, SIGTERM);
    for (int i = 0; i < 50 && waitpid(child, &status, WNOHANG) != child; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    kill(-child, SIGKILL);
    waitpid(child, &status, 0);
  } else {
    out["error"] = "fsdp-train exited early: " + fsdp::bench::tail(fsdp::bench::read_text(dir / "train.err"));
  }
  {
    std::ifstream f("/proc/loadavg");
    std::getline(f, load);
  }
  out["load_average_end"] = load;
  out["samples"] = samples;

  // Steps reached: the newest checkpoint's name (step-<k>).
  int64_t last_step = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir / "ckpt", ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string n = it->path().filename();
    if (n.rfind("step-", 0) == 0) last_step = std::max<int64_t>(last_step, std::stoll(n.substr(5)));
  }
  out["last_checkpoint_step"] = last_step;

  json summary = json::array();
  bool flat = !died;
  for (const auto& [pid, ts] : t_of) {
    const auto& rss = rss_of[pid];
    const size_t n = rss.size(), third = n / 3;
    if (n < 6) continue;
    // warm-up: the first third; compare the middle third's mean with the last third's
    const double first = mean(rss, third, 2 * third), last = mean(rss, 2 * third, n);
    std::vector<double> tt(ts.begin() + third, ts.end()), rr(rss.begin() + third, rss.end());
    std::vector<double> hours;
    for (double x : tt) hours.push_back(x / 3600.0);
    const auto& fd = fds_of[pid];
    const auto& th = thr_of[pid];
    json r{{"pid", pid},
           {"rss_mb_middle_third", first},
           {"rss_mb_last_third", last},
           {"rss_mb_max", *std::max_element(rss.begin(), rss.end())},
           {"rss_slope_mb_per_hour_after_warmup", slope(hours, rr)},
           {"fds_min", *std::min_element(fd.begin() + third, fd.end())},
           {"fds_max", *std::max_element(fd.begin() + third, fd.end())},
           {"threads_min", *std::min_element(th.begin() + third, th.end())},
           {"threads_max", *std::max_element(th.begin() + third, th.end())}};
    const bool rank_flat = last - first <= std::max(16.0, 0.02 * first) &&
                           fd.back() <= fd[third] && th.back() <= th[third];
    r["flat"] = rank_flat;
    flat = flat && rank_flat;
    summary.push_back(r);
  }
  out["per_rank"] = summary;
  out["flat"] = flat;
  std::cout << out.dump(2) << std::endl;
  std::cerr << std::fixed << std::setprecision(1)
            << "| rank pid | RSS MiB middle → last third | slope MiB/h | fds | threads |\n|---|---|---|---|---|\n";
  for (const auto& r : summary) {
    std::cerr << "| " << r["pid"].get<int>() << " | " << r["rss_mb_middle_third"].get<double>()
              << " → " << r["rss_mb_last_third"].get<double>() << " | "
              << r["rss_slope_mb_per_hour_after_warmup"].get<double>() << " | "
              << r["fds_min"].get<double>() << "–" << r["fds_max"].get<double>() << " | "
              << r["threads_min"].get<double>() << "–" << r["threads_max"].get<double>() << " |\n";
  }
  std::cerr << "last checkpoint: step-" << last_step << "\n";
  return died ? 1 : 0;
}

fsdp::bench::Registrar reg_soak("soak", "RSS, descriptors and threads of a long FSDP run",
                           run_soak);

}  // namespace
