// fsdp-bench comm: algorithmic bandwidth of all-gather, reduce-scatter and all-reduce per
// backend, world size and message size, against single-process memcpy measured in the same run.
//
//   fsdp-bench comm [--json] [--backends gloo,mpi] [--worlds 2,4] [--sizes-mib 1,16,64]
//
// Size = the full buffer: the all-gather output, the reduce-scatter input, the all-reduce
// tensor (fp32). algbw = size / time (the nccl-tests convention); time is the slowest rank's
// mean over the timed iterations. memcpy = one thread copying `size` bytes between two buffers,
// size / time. The parent launches the ranks itself: it re-executes this program with
// `comm --worker` (gloo: one process per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT;
// mpi: under mpirun) and reads rank 0's result line. Stdout: one JSON object; stderr: a table.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "../bench/bench.h"
#include "../bench/runs.h"
#include "comm/launcher_detail.h"
#include "fsdp/comm.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
constexpr const char* kResultMarker = "FSDP_BENCH_COMM_RESULT ";

// Single-thread memcpy of `bytes`, best of a few repetitions: GB/s (1e9 bytes/s).
double memcpy_gbps(int64_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  int reps = bytes >= (int64_t(16) << 20) ? 5 : 30;
  for (int i = 0; i < reps + 1; ++i) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    double t = fsdp::bench::seconds_since(t0);
    if (i > 0) best = std::min(best, t);  // first one touches pages
    a[i % bytes] = b[(i * 7) % bytes];     // keep the copies observable
  }
  return static_cast<double>(bytes) / best / 1e9;
}

// Mean time per op over the slowest rank, after warm-up.
double time_op(fsdp::ProcessGroup& pg, const std::function<void()>& op, double budget_s) {
  auto slowest = [&](double t) {
    auto tt = at::full({1}, t, at::kDouble);
    pg.all_reduce(tt, fsdp::ReduceOp::kMax);
    return tt.item<double>();
  };
  op();  // warm-up
  pg.barrier();
  auto t0 = Clock::now();
  op();
  // Every rank must run the same number of collectives: derive it from the agreed time.
  const double once = slowest(fsdp::bench::seconds_since(t0));
  const int iters = std::clamp(static_cast<int>(budget_s / std::max(once, 1e-6)), 2, 50);
  pg.barrier();
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  return slowest(fsdp::bench::seconds_since(t0) / iters);
}

// Async overlap: all-gather of 16 MiB while the caller runs matmuls of about the same duration.
json measure_overlap(fsdp::ProcessGroup& pg) {
  const int w = pg.size();
  const int64_t total = (int64_t(16) << 20) / 4;
  auto in = at::ones({total / w});
  auto out = at::empty({total / w * w});
  auto comm = [&] { pg.all_gather_into_tensor(out, in); };
  double t_comm = time_op(pg, comm, 0.3);
  auto a = at::rand({384, 384});
  auto b = at::rand({384, 384});
  auto t0 = Clock::now();
  for (int i = 0; i < 5; ++i) b = at::mm(a, b).div_(384);
  double t_mm = fsdp::bench::seconds_since(t0) / 5;
  int k = std::max(1, static_cast<int>(t_comm / t_mm));
  auto compute = [&] {
    for (int i = 0; i < k; ++i) b = at::mm(a, b).div_(384);
  };
  double t_compute = time_op(pg, compute, 0.3);
  double t_both = time_op(pg, [&] {
    auto work = pg.all_gather_into_tensor_async(out, in);
    compute();
    work->wait();
  }, 0.3);
  double hidden = (t_comm + t_compute - t_both) / std::min(t_comm, t_compute);
  return json{{"op", "all_gather 16 MiB fp32 async + matmul"},
              {"comm_ms", t_comm * 1e3},
              {"compute_ms", t_compute * 1e3},
              {"both_ms", t_both * 1e3},
              {"hidden_fraction", hidden}};
}

int run_worker(const std::vector<int>& sizes_mib) {
  at::set_num_threads(1);
  fsdp::ProcessGroupOptions options;
  options.backend = "auto";  // mpi under mpirun, gloo otherwise
  auto pg = fsdp::init_process_group(options);
  const int w = pg->size();
  json results = json::array();
  for (int mib : sizes_mib) {
    const int64_t numel = (int64_t(mib) << 20) / 4;
    const int64_t chunk = numel / w;
    const int64_t bytes = chunk * w * 4;
    auto full = at::ones({chunk * w});
    auto shard = at::ones({chunk});
    double budget = mib >= 64 ? 1.0 : 0.5;
    double t_ag = time_op(*pg, [&] { pg->all_gather_into_tensor(full, shard); }, budget);
    double t_rs = time_op(
        *pg, [&] { pg->reduce_scatter_tensor(shard, full, fsdp::ReduceOp::kSum); }, budget);
    double t_ar = time_op(*pg, [&] { pg->all_reduce(full, fsdp::ReduceOp::kSum); }, budget);
    for (auto [op, t] : {std::pair<const char*, double>{"all_gather", t_ag},
                         {"reduce_scatter", t_rs},
                         {"all_reduce", t_ar}}) {
      results.push_back(json{{"op", op},
                             {"size_mib", mib},
                             {"bytes", bytes},
                             {"time_ms", t * 1e3},
                             {"algbw_gbps", static_cast<double>(bytes) / t / 1e9}});
    }
  }
  json overlap = measure_overlap(*pg);
  if (pg->rank() == 0) {
    json out{{"backend", pg->backend()}, {"world", w}, {"results", results}, {"overlap", overlap}};
    std::cout << kResultMarker << out.dump() << std::endl;
  }
  fsdp::destroy_process_group();
  return 0;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Runs the ranks of one (backend, world) configuration and returns rank 0's result.
json run_config(const std::string& backend, int world, const std::string& sizes_csv) {
  const std::string exe = fsdp::detail::self_exe();
  std::ostringstream cmd;
  const std::string worker =
      shell_quote(exe) + " comm --worker --sizes-mib " + shell_quote(sizes_csv);
  if (backend == "mpi") {
    cmd << "OMPI_MCA_mpi_yield_when_idle=1 ";
    for (const auto& a : fsdp::detail::mpirun_prefix(world)) cmd << shell_quote(a) << " ";
    cmd << worker;
  } else {
    int port = fsdp::detail::free_port();
    cmd << "( ";
    for (int r = 0; r < world; ++r) {
      cmd << "env -u OMPI_COMM_WORLD_SIZE RANK=" << r << " WORLD_SIZE=" << world
          << " LOCAL_RANK=" << r << " LOCAL_WORLD_SIZE=" << world
          << " MASTER_ADDR=127.0.0.1 MASTER_PORT=" << port << " " << worker << " & ";
    }
    cmd << "wait )";
  }
  FILE* pipe = ::popen(cmd.str().c_str(), "r");
  TORCH_CHECK(pipe != nullptr, "[fsdp-bench comm] could not start: ", cmd.str());
  std::string line;
  json result;
  char buf[1 << 16];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    line = buf;
    if (line.rfind(kResultMarker, 0) == 0) {
      result = json::parse(line.substr(std::strlen(kResultMarker)));
    }
  }
  int status = ::pclose(pipe);
  TORCH_CHECK(!result.is_null(), "[fsdp-bench comm] backend ", backend, " at world ", world,
              " produced no result (exit status ", status, "); command: ", cmd.str());
  return result;
}

int run_comm(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench comm: collective bandwidth per backend vs memcpy", "fsdp-bench comm"};
  bool json_flag = false;
  bool worker = false;
  std::string backends = "gloo,mpi";
  std::string worlds = "2,4";
  std::string sizes = "1,16,64";
  app.add_flag("--json", json_flag, "print the JSON object on stdout (always on; kept for scripts)");
  app.add_option("--backends", backends, "comma-separated backends (gloo, mpi)");
  app.add_option("--worlds", worlds, "comma-separated world sizes");
  app.add_option("--sizes-mib", sizes, "comma-separated full-buffer sizes in MiB");
  app.add_flag("--worker", worker, "internal: run as one rank")->group("");
  if (auto status = fsdp::bench::parse_args(app, "comm", args)) return *status;
  std::vector<int> sizes_mib;
  for (const auto& s : fsdp::bench::split_list(sizes)) sizes_mib.push_back(std::stoi(s));
  TORCH_CHECK(!sizes_mib.empty(), "[fsdp-bench comm] --sizes-mib is empty");
  if (worker) return run_worker(sizes_mib);

  json out{{"benchmark", "comm"},
           {"size_definition", "full buffer: all-gather output, reduce-scatter input, all-reduce "
                               "tensor; fp32; algbw = bytes / time of the slowest rank"},
           {"cores", fsdp::detail::available_cores()}};
  json memcpy_json = json::object();
  std::map<int, double> memcpy_bw;
  for (int mib : sizes_mib) {
    memcpy_bw[mib] = memcpy_gbps(int64_t(mib) << 20);
    memcpy_json[std::to_string(mib)] = memcpy_bw[mib];
  }
  out["memcpy_gbps"] = memcpy_json;
  json rows = json::array();
  json overlaps = json::array();
  for (const auto& backend : fsdp::bench::split_list(backends)) {
    TORCH_CHECK(backend == "gloo" || backend == "mpi", "[fsdp-bench comm] unknown backend '",
                backend, "'; valid: gloo, mpi");
    for (const auto& ws : fsdp::bench::split_list(worlds)) {
      int world = std::stoi(ws);
      json r = run_config(backend, world, sizes);
      for (auto& row : r["results"]) {
        row["backend"] = backend;
        row["world"] = world;
        row["fraction_of_memcpy"] =
            row["algbw_gbps"].get<double>() / memcpy_bw[row["size_mib"].get<int>()];
        rows.push_back(row);
      }
      json ov = r["overlap"];
      ov["backend"] = backend;
      ov["world"] = world;
      overlaps.push_back(ov);
    }
  }
  out["results"] = rows;
  out["overlap"] = overlaps;
  (void)json_flag;
  std::cout << out.dump(2) << std::endl;

  std::ostringstream table;
  table << std::fixed << std::setprecision(2);
  table << "| backend | world | size MiB | op | algbw GB/s | x memcpy | ms |\n"
        << "|---|---|---|---|---|---|---|\n";
  for (const auto& row : rows) {
    table << "| " << row["backend"].get<std::string>() << " | " << row["world"].get<int>()
          << " | " << row["size_mib"].get<int>() << " | " << row["op"].get<std::string>()
          << " | " << row["algbw_gbps"].get<double>() << " | "
          << std::setprecision(3) << row["fraction_of_memcpy"].get<double>()
          << std::setprecision(2) << " | " << row["time_ms"].get<double>() << " |\n";
  }
  table << "\nmemcpy (1 thread):";
  for (const auto& [mib, bw] : memcpy_bw) table << " " << mib << " MiB " << bw << " GB/s;";
  table << "\n\n| backend | world | overlap: comm ms | compute ms | both ms | hidden |\n"
        << "|---|---|---|---|---|---|\n";
  for (const auto& ov : overlaps) {
    table << "| " << ov["backend"].get<std::string>() << " | " << ov["world"].get<int>() << " | "
          << ov["comm_ms"].get<double>() << " | " << ov["compute_ms"].get<double>() << " | "
          << ov["both_ms"].get<double>() << " | " << ov["hidden_fraction"].get<double>()
          << " |\n";
  }
  std::cerr << table.str();
  return 0;
}

fsdp::bench::Registrar registrar("comm", "collective bandwidth per backend vs memcpy", run_comm);

}  // namespace
