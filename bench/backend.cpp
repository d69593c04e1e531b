// fsdp-bench backend: does `--backend auto` pick the fastest backend?
//
//   fsdp-bench backend [--model transformer-small] [--devices 2] [--steps 6] [--strategies ddp,fsdp]
//
// For each strategy, fsdp-train runs three times on the same model and batches: --backend gloo,
// --backend mpi and --backend auto. The JSON gives each run's it/s, the backend auto chose (the
// "[fsdp] backend ..." line it prints) and auto's it/s over the fastest explicit backend's
// (goal: 1.0 within noise, i.e. auto chose the fastest). A backend that cannot run is a row with
// its error.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "runs.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

int run_backend(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench backend: --backend auto vs gloo and mpi",
               "fsdp-bench backend"};
  fsdp::bench::TrainRun run;
  run.steps = 6;
  run.vocab_size = 1024;
  std::string strategies = "ddp,fsdp", fsdp_train, work_dir;
  app.add_option("--model", run.model, "transformer-* or gpt2-* preset")->capture_default_str();
  app.add_option("--vocab-size", run.vocab_size, "synthetic vocabulary (0: the preset's)")
      ->capture_default_str();
  app.add_option("--devices", run.devices, "ranks")->capture_default_str();
  app.add_option("--batch-size", run.batch_size, "per rank")->capture_default_str();
  app.add_option("--steps", run.steps, "optimizer steps, the first not timed")->capture_default_str();
  app.add_option("--strategies", strategies, "comma-separated fsdp-train strategies")
      ->capture_default_str();
  app.add_option("--fsdp-train", fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "where logs and summaries go (default: /tmp)");
  if (auto status = fsdp::bench::parse_args(app, "backend", args)) return *status;
  if (fsdp_train.empty()) fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  run.dir = work_dir.empty()
                ? fs::temp_directory_path() / ("fsdp-bench-backend-" + std::to_string(getpid()))
                : fs::path(work_dir);
  fs::create_directories(run.dir);

  json out{{"bench", "backend"},
           {"goal", "auto's it/s / the fastest explicit backend's = 1"},
           {"config", {{"model", run.model}, {"vocab_size", run.vocab_size},
                       {"devices", run.devices}, {"batch_size", run.batch_size},
                       {"steps", run.steps}}}};
  const std::regex choice_re(R"(\[fsdp\] backend (\w+) \(([^\n]*)\))");
  json rows = json::array();
  bool ok = true;
  std::ostringstream t;
  t << std::fixed << std::setprecision(3)
    << "| strategy | gloo it/s | mpi it/s | auto it/s | auto chose | auto / fastest |\n"
    << "|---|---:|---:|---:|---|---:|\n";
  for (const auto& strategy : fsdp::bench::split_list(strategies)) {
    json row{{"strategy", strategy}};
    double best = 0;
    for (const std::string backend : {"gloo", "mpi", "auto"}) {
      const std::string name = strategy + "_" + backend;
      std::cerr << "[fsdp-bench backend] " << strategy << " --backend " << backend << "..."
                << std::endl;
      json r = fsdp::bench::run_fsdp_train(fsdp_train, run,
                                           {"--strategy", strategy, "--backend", backend}, name);
      json cell;
      if (r.contains("error")) {
        cell = {{"error", r["error"]}};
        if (backend == "auto") ok = false;
      } else {
        cell = {{"it_per_s", fsdp::bench::it_per_s(r["step_end_seconds"].get<std::vector<double>>(), 1)},
                {"command", r["command"]}};
        const double v = cell["it_per_s"].is_number() ? cell["it_per_s"].get<double>() : 0.0;
        if (backend != "auto") best = std::max(best, v);
        std::smatch m;
        const std::string text = fsdp::bench::read_text(run.dir / (name + ".out")) +
                                 fsdp::bench::read_text(run.dir / (name + ".err"));
        if (backend == "auto" && std::regex_search(text, m, choice_re)) {
          cell["chose"] = m[1].str();
          cell["reason"] = m[2].str();
        }
      }
      row[backend] = cell;
    }
    if (row["auto"].contains("it_per_s") && best > 0) {
      row["auto_over_fastest"] = row["auto"]["it_per_s"].get<double>() / best;
    }
    auto num = [&](const char* b) {
      return row[b].contains("it_per_s") ? std::to_string(row[b]["it_per_s"].get<double>())
                                         : std::string("error");
    };
    t << "| " << strategy << " | " << num("gloo") << " | " << num("mpi") << " | " << num("auto")
      << " | " << row["auto"].value("chose", std::string("?")) << " | "
      << (row.contains("auto_over_fastest") ? std::to_string(row["auto_over_fastest"].get<double>())
                                           : std::string(""))
      << " |\n";
    rows.push_back(row);
  }
  out["results"] = rows;
  std::cout << out.dump(2) << std::endl;
  std::cerr << t.str();
  return ok ? 0 : 1;
}

fsdp::bench::Registrar reg_backend("backend", "--backend auto vs gloo and mpi", run_backend);

}  // namespace
