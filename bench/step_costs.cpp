// fsdp-bench faults / overlap: where a training step's time goes besides the math, measured on
// training runs that differ in one thing, all in one invocation. Each prints one JSON object.
//
//   fsdp-bench faults   minor page faults, kernel (sys) and user CPU seconds per step, it/s and
//                       peak memory with the block cache off (FSDP_ALLOC_CACHE=0) and on, for
//                       FULL_SHARD and DDP (Note [Block cache] in src/memory/block_cache.cpp);
//                       also FULL_SHARD / DDP peak tensor bytes.
//   fsdp-bench overlap  the FULL_SHARD step with real collectives, with collectives that move
//                       no data between ranks ("local"), and with every collective waited for
//                       at once ("serial"): hidden fraction = 1 - (t_real - t_local) /
//                       (t_serial - t_local) (Note [Benchmark collectives] in
//                       src/shard/collectives.cpp); with and without --forward-prefetch. Each
//                       run is `fsdp-bench overlap-run` (bench/overlap_run.cpp), which trains in
//                       its own process and installs the collectives' mode as an injected hook.
// Step times are 1 / it/s after the first step (runs.h it_per_s); faults and CPU seconds are
// getrusage over the same steps, averaged over ranks (fsdp-train --summary-json).
#include "../apps/cli.h"
#include "bench.h"
#include "runs.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <cmath>
#include <numeric>
#include <optional>
#include <utility>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Common {
  fsdp::bench::TrainRun run;
  std::string fsdp_train, work_dir, backend = "auto";
};

void add_common(CLI::App& app, Common& c) {
  app.add_option("--model", c.run.model, "a transformer-* preset")->capture_default_str();
  app.add_option("--vocab-size", c.run.vocab_size, "synthetic vocabulary (0: the preset's)")
      ->capture_default_str();
  app.add_option("--devices", c.run.devices, "ranks")->capture_default_str();
  app.add_option("--batch-size", c.run.batch_size, "per rank")->capture_default_str();
  app.add_option("--steps", c.run.steps, "optimizer steps per run, the first one not timed")
      ->check(fsdp::cli::between(int64_t{3}, int64_t{100000}))
      ->capture_default_str();
  app.add_option("--backend", c.backend, "auto | gloo | mpi")
      ->check(fsdp::cli::one_of({"auto", "gloo", "mpi"}))
      ->capture_default_str();
  app.add_option("--fsdp-train", c.fsdp_train,
                 "path of fsdp-train, for faults (default: beside fsdp-bench)");
  app.add_option("--work-dir", c.work_dir, "where logs and summaries go (default: /tmp)");
}

bool prepare(Common& c, const std::string& name, bool runs_fsdp_train) {
  if (c.fsdp_train.empty()) c.fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  c.run.dir = c.work_dir.empty() ? fs::temp_directory_path() /
                                       ("fsdp-bench-" + name + "-" + std::to_string(getpid()))
                                 : fs::path(c.work_dir);
  fs::create_directories(c.run.dir);
  if (runs_fsdp_train && !fs::exists(c.fsdp_train)) {
    std::cerr << "fsdp-bench " << name << ": error: " << c.fsdp_train
              << " not found; build it or pass --fsdp-train PATH\n";
    return false;
  }
  return true;
}

double mean(const json& values) {
  if (!values.is_array() || values.empty()) return 0;
  double s = 0;
  for (const auto& v : values) s += v.get<double>();
  return s / static_cast<double>(values.size());
}

double max_of_array(const json& values) {
  double m = 0;
  if (values.is_array()) {
    for (const auto& v : values) m = std::max(m, v.get<double>());
  }
  return m;
}

// Sets environment variables for the runs started while it lives (fsdp-train inherits them;
// with --backend mpi its ranks do too), then restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_.push_back({k, old ? std::optional<std::string>(old) : std::nullopt});
      ::setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A run's summary (fsdp-train --summary-json, or fsdp-bench overlap-run's), reduced to the
// numbers these benchmarks compare.
json reduce_run(const json& r, const std::string& command) {
  json out = {{"command", command}, {"load_average_after", fsdp::bench::load_average()}};
  if (r.contains("error")) {
    out["error"] = r["error"];
    return out;
  }
  json ips = fsdp::bench::it_per_s(r.value("step_end_seconds", std::vector<double>{}), 1);
  out["it_per_s"] = ips;
  if (ips.is_number()) out["seconds_per_step"] = 1.0 / ips.get<double>();
  if (r.contains("minor_faults_per_step")) {  // fsdp-train's getrusage over the steps
    out["minor_faults_per_step"] = mean(r.value("minor_faults_per_step", json::array()));
    out["sys_seconds_per_step"] = mean(r.value("sys_seconds_per_step", json::array()));
    out["user_seconds_per_step"] = mean(r.value("user_seconds_per_step", json::array()));
    const double cpu = out["sys_seconds_per_step"].get<double>() +
                       out["user_seconds_per_step"].get<double>();
    out["sys_fraction_of_cpu"] = cpu > 0 ? out["sys_seconds_per_step"].get<double>() / cpu : 0.0;
  }
  out["peak_alloc_mb"] = max_of_array(r.value("peak_alloc_mb", json::array()));
  out["peak_rss_mb"] = max_of_array(r.value("peak_rss_mb", json::array()));
  out["final_loss"] = r.contains("losses") && !r["losses"].empty() ? r["losses"].back() : json();
  return out;
}

// One fsdp-train run with `env` set for it, reduced.
json measure(const Common& c, const std::vector<std::pair<std::string, std::string>>& env,
             const std::vector<std::string>& flags, const std::string& name) {
  std::vector<std::string> all = flags;
  all.insert(all.end(), {"--backend", c.backend});
  json r;
  {
    ScopedEnv scoped(env);
    r = fsdp::bench::run_fsdp_train(c.fsdp_train, c.run, all, name);
  }
  std::string env_text;
  for (const auto& [k, v] : env) env_text += k + "=" + v + " ";
  return reduce_run(r, env_text + r.value("command", ""));
}

// One `fsdp-bench overlap-run` (this program, training in-process) with FSDP's collectives in
// `mode` ("real" | "local" | "serial"), reduced. The mode is a flag of that run, which installs
// it as an injected hook: no environment variable reaches the library's collectives.
json measure_overlap(const Common& c, const std::string& mode,
                     const std::vector<std::string>& flags, const std::string& name) {
  const fsdp::bench::TrainRun& run = c.run;
  const fs::path summary = run.dir / (name + ".json");
  std::vector<std::string> argv = {
      (fsdp::bench::self_dir() / "fsdp-bench").string(), "overlap-run",
      "--model", run.model, "--vocab-size", std::to_string(run.vocab_size),
      "--devices", std::to_string(run.devices), "--batch-size", std::to_string(run.batch_size),
      "--block-size", std::to_string(run.block_size), "--steps", std::to_string(run.steps),
      "--dropout", std::to_string(run.dropout), "--lr", std::to_string(run.lr),
      "--seed", std::to_string(run.seed), "--backend", c.backend, "--collectives", mode,
      "--summary", summary.string()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  std::error_code ec;
  fs::remove(summary, ec);
  const fs::path out = run.dir / (name + ".out"), err = run.dir / (name + ".err");
  const int code = fsdp::bench::run_program(argv, out, err, run.timeout_s);
  json r;
  if (code != 0 || !fs::exists(summary)) {
    r["error"] = "fsdp-bench overlap-run exited with status " + std::to_string(code) + ": " +
                 fsdp::bench::tail(fsdp::bench::read_text(err));
  } else {
    r = json::parse(fsdp::bench::read_text(summary));
  }
  return reduce_run(r, fsdp::bench::command_line(argv));
}

double ratio(const json& a, const json& b, const char* key) {
  if (!a.contains(key) || !b.contains(key) || !a[key].is_number() || !b[key].is_number()) {
    return std::nan("");
  }
  const double den = b[key].get<double>();
  return den == 0 ? std::nan("") : a[key].get<double>() / den;
}

json config_of(const Common& c) {
  return {{"model", c.run.model},       {"vocab_size", c.run.vocab_size},
          {"devices", c.run.devices},   {"batch_size_per_rank", c.run.batch_size},
          {"steps", c.run.steps},       {"timed_steps", c.run.steps - 1},
          {"backend", c.backend},       {"cores", std::thread::hardware_concurrency()},
          {"load_average_before", fsdp::bench::load_average()}};
}

int run_faults(const std::vector<std::string>& args) {
  Common c;
  c.run.steps = 8;
  CLI::App app{"fsdp-bench faults: page faults and kernel time per step, block cache off vs on"};
  add_common(app, c);
  if (auto status = fsdp::bench::parse_args(app, "faults", args)) return *status;
  if (!prepare(c, "faults", /*runs_fsdp_train=*/true)) return 1;
  json out = {{"bench", "faults"}, {"config", config_of(c)}};
  bool ok = true;
  for (const std::string strategy : {"fsdp", "ddp"}) {
    const std::string label = strategy == "fsdp" ? "full_shard" : "ddp";
    json off =
        measure(c, {{"FSDP_ALLOC_CACHE", "0"}}, {"--strategy", strategy}, label + "-cache-off");
    json on = measure(c, {}, {"--strategy", strategy}, label + "-cache-on");
    ok = ok && !off.contains("error") && !on.contains("error");
    out[label] = {{"cache_off", off},
                  {"cache_on", on},
                  {"faults_on_over_off", ratio(on, off, "minor_faults_per_step")},
                  {"sys_seconds_on_over_off", ratio(on, off, "sys_seconds_per_step")},
                  {"it_per_s_on_over_off", ratio(on, off, "it_per_s")},
                  {"peak_alloc_on_over_off", ratio(on, off, "peak_alloc_mb")},
                  {"peak_rss_on_over_off", ratio(on, off, "peak_rss_mb")}};
  }
  if (ok) {
    out["full_shard_over_ddp_peak_alloc"] =
        ratio(out["full_shard"]["cache_on"], out["ddp"]["cache_on"], "peak_alloc_mb");
    out["full_shard_over_ddp_it_per_s"] =
        ratio(out["full_shard"]["cache_on"], out["ddp"]["cache_on"], "it_per_s");
  }
  out["work_dir"] = c.run.dir.string();
  std::cout << out.dump(2) << std::endl;
  return ok ? 0 : 1;
}

int run_overlap(const std::vector<std::string>& args) {
  Common c;
  c.run.steps = 8;
  bool no_forward_prefetch = false;
  CLI::App app{"fsdp-bench overlap: how much FULL_SHARD collective time compute hides"};
  add_common(app, c);
  app.add_flag("--no-forward-prefetch", no_forward_prefetch,
               "measure the default configuration only");
  if (auto status = fsdp::bench::parse_args(app, "overlap", args)) return *status;
  if (!prepare(c, "overlap", /*runs_fsdp_train=*/false)) return 1;
  json out = {{"bench", "overlap"}, {"config", config_of(c)}};
  bool ok = true;
  std::vector<std::pair<std::string, std::vector<std::string>>> configs = {{"default", {}}};
  if (!no_forward_prefetch) configs.push_back({"forward_prefetch", {"--forward-prefetch"}});
  for (const auto& [label, flags] : configs) {
    json real = measure_overlap(c, "real", flags, label + "-real");
    json local = measure_overlap(c, "local", flags, label + "-local");
    json serial = measure_overlap(c, "serial", flags, label + "-serial");
    json r = {{"real", real}, {"local", local}, {"serial", serial}};
    if (real.contains("seconds_per_step") && local.contains("seconds_per_step") &&
        serial.contains("seconds_per_step")) {
      const double t_real = real["seconds_per_step"], t_local = local["seconds_per_step"],
                   t_serial = serial["seconds_per_step"];
      r["collective_seconds_per_step"] = t_serial - t_local;
      r["exposed_seconds_per_step"] = t_real - t_local;
      r["hidden_fraction"] =
          t_serial > t_local ? 1.0 - (t_real - t_local) / (t_serial - t_local) : std::nan("");
      r["real_over_local_it_per_s"] = t_local / t_real;
    } else {
      ok = false;
    }
    out[label] = r;
  }
  out["note"] =
      "hidden_fraction = 1 - (t_real - t_local) / (t_serial - t_local): 1 = all collective "
      "time hidden behind compute, 0 = none, < 0 = overlapping costs more than running one "
      "after the other (the 2 cores are shared by compute and communication)";
  out["work_dir"] = c.run.dir.string();
  std::cout << out.dump(2) << std::endl;
  return ok ? 0 : 1;
}

fsdp::bench::Registrar reg_faults("faults",
                                  "page faults / kernel time per step, block cache off vs on",
                                  run_faults);
fsdp::bench::Registrar reg_overlap("overlap",
                                   "FULL_SHARD collective time hidden by compute (real vs local "
                                   "vs serial collectives)",
                                   run_overlap);

}  // namespace
