// fsdp-bench offload: the disk tier's I/O against the disk itself, in one run:
//
//   fsdp-bench offload [--dir /tmp] [--numel 67108864] [--sub-group-size 8388608]
//                      [--block-size 1048576] [--queue-depth 8] [--intra-op-parallelism 1]
//                      [--steps 3] [--forward-ms 150]
//
//   disk        O_DIRECT sequential write, then read, of a file as large as the swap files
//               (2 moments x numel x 4 B), one block_size request at a time (pwrite/pread):
//               the disk's bandwidth at this block size, with no asynchronous I/O
//   swapper     the same bytes through detail::AioEngine (io_uring, queue_depth in flight)
//   step        detail::NvmeAdam over numel fp32 parameters: one Adam step streams every
//               sub-group's moments in (read) and out (write) while it steps; after a warm-up
//               step (the first writes only), the median of --steps steps
//   fraction    (read bytes / disk read bandwidth + written bytes / disk write bandwidth) /
//               step time: the share of the disk's bandwidth the pipelined step achieves
//               (goal >= 0.5; compute that the pipeline does not hide counts against it)
//   overlap     step + --forward-ms of matmuls standing in for the next forward, --steps
//               times, with the step's last writes waited for at its end ("wait") vs left in
//               flight over the compute ("overlap", off by default): median step + forward
//               time of each and their ratio ("speedup")
//   stage3      with --stage3-model M (e.g. transformer-small): fsdp-train at world 2 on MPI,
//               deepspeed_stage_3 in RAM vs optimizer state on disk vs parameters + optimizer
//               state on disk (--stage3-steps steps, first excluded from it/s): it/s and its
//               ratio to RAM, tracked peak and peak RSS per rank, seconds per step blocked on
//               the disk, and the largest relative loss difference to the RAM run
// Prints JSON on stdout and the load average at start and end (the numbers depend on it).
#include "../apps/cli.h"
#include "bench.h"
#include "runs.h"

#include "offload/aio.h"
#include "offload/nvme_adam.h"
#include "offload/swap_file.h"

#include <filesystem>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct OffloadOptions {
  std::string dir = "/tmp";
  int64_t numel = 67108864;          // 64 Mi fp32 parameters: 512 MiB of moments on disk
  int64_t sub_group_size = 8388608;  // 8 Mi elements: 64 MiB records
  fsdp::AioOptions aio;
  int steps = 3;
  double forward_ms = 150;  // compute standing in for the next forward (overlap part)
  std::string stage3_model;  // "": no stage-3 part
  int stage3_steps = 8;
  int stage3_params_buffer_count = 5;  // offload_param.buffer_count (DeepSpeed's default 5)
  bool only_stage3 = false;
};

// Synchronous O_DIRECT sequential write then read of `bytes`, one block per call.
json disk_baseline(const std::string& path, int64_t bytes, int64_t block) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  TORCH_CHECK(fd >= 0, "[fsdp-bench offload] cannot open '", path, "' with O_DIRECT: ",
              std::strerror(errno));
  fsdp::detail::AlignedBuffer buf(block);
  std::memset(buf.data(), 0x5a, block);
  TORCH_CHECK(::posix_fallocate(fd, 0, bytes) == 0, "[fsdp-bench offload] cannot reserve ",
              bytes, " bytes in '", path, "'");
  auto t0 = Clock::now();
  for (int64_t off = 0; off < bytes; off += block) {
    TORCH_CHECK(::pwrite(fd, buf.data(), block, off) == block, "[fsdp-bench offload] pwrite: ",
                std::strerror(errno));
  }
  ::fdatasync(fd);
  const double tw = fsdp::bench::seconds_since(t0);
  t0 = Clock::now();
  for (int64_t off = 0; off < bytes; off += block) {
    TORCH_CHECK(::pread(fd, buf.data(), block, off) == block, "[fsdp-bench offload] pread: ",
                std::strerror(errno));
  }
  const double tr = fsdp::bench::seconds_since(t0);
  ::close(fd);
  ::unlink(path.c_str());
  return {{"write_gb_s", bytes / tw / 1e9}, {"read_gb_s", bytes / tr / 1e9},
          {"write_s", tw}, {"read_s", tr}};
}

// The same bytes through the swapper's engine (one transfer each way).
json swapper_raw(const std::string& dir, int64_t bytes, const fsdp::AioOptions& aio) {
  fsdp::detail::SwapDir sd(dir, "fsdp-bench-offload-raw", 0);
  const int fd = sd.create("raw.swp", bytes);
  fsdp::detail::AioEngine engine(aio);
  fsdp::detail::AlignedBuffer buf(bytes);
  std::memset(buf.data(), 0x3c, bytes);
  auto t0 = Clock::now();
  engine.wait(engine.write(fd, buf.data(), bytes, 0, sd.files()[0]));
  ::fdatasync(fd);
  const double tw = fsdp::bench::seconds_since(t0);
  t0 = Clock::now();
  engine.wait(engine.read(fd, buf.data(), bytes, 0, sd.files()[0]));
  const double tr = fsdp::bench::seconds_since(t0);
  return {{"write_gb_s", bytes / tw / 1e9}, {"read_gb_s", bytes / tr / 1e9}};
}

// Step + compute standing in for the next forward, with the step's last writes waited for at
// its end vs left in flight over the compute (NvmeAdam::Options::overlap_last_writes), the
// same optimizer, one run after the other.
json overlap_last_writes(const OffloadOptions& o, torch::optim::Optimizer& opt,
                         fsdp::detail::NvmeAdam::Options no) {
  at::Tensor a = at::randn({384, 384}), b = at::randn({384, 384});
  auto t0 = Clock::now();
  int64_t calib = 0;
  while (fsdp::bench::seconds_since(t0) < 0.2) {
    at::mm_out(b, a, a);
    ++calib;
  }
  const int64_t mms = std::max<int64_t>(
      1, static_cast<int64_t>(calib * o.forward_ms / 1000.0 / fsdp::bench::seconds_since(t0)));
  json out = {{"forward_matmuls", mms}, {"forward_ms_target", o.forward_ms}};
  for (bool overlap : {false, true}) {
    no.job = overlap ? "fsdp-bench-offload-overlap" : "fsdp-bench-offload-wait";
    no.overlap_last_writes = overlap;
    fsdp::detail::NvmeAdam nvme(opt, no);
    nvme.step(opt);  // warm-up: the first step writes only
    std::vector<double> times, forwards;
    for (int i = 0; i < o.steps; ++i) {
      auto t1 = Clock::now();
      nvme.step(opt);
      auto t2 = Clock::now();
      for (int64_t k = 0; k < mms; ++k) at::mm_out(b, a, a);
      forwards.push_back(fsdp::bench::seconds_since(t2));
      times.push_back(fsdp::bench::seconds_since(t1));
    }
    nvme.flush();
    std::sort(times.begin(), times.end());
    std::sort(forwards.begin(), forwards.end());
    out[overlap ? "overlap" : "wait"] = {{"median_step_plus_forward_s", times[times.size() / 2]},
                                         {"median_forward_s", forwards[forwards.size() / 2]},
                                         {"seconds", times}};
  }
  out["speedup"] = out["wait"]["median_step_plus_forward_s"].get<double>() /
                   out["overlap"]["median_step_plus_forward_s"].get<double>();
  return out;
}

// The stage-3 part: three fsdp-train runs of the same model and batches, one after the other.
json stage3_comparison(const OffloadOptions& o) {
  namespace fs = std::filesystem;
  fsdp::bench::TrainRun run;
  run.model = o.stage3_model;
  run.devices = 2;
  run.steps = o.stage3_steps;
  run.dropout = 0;
  run.seed = 7;
  run.dir = fs::path(o.dir) / "fsdp-bench-offload-stage3";
  std::error_code ec;
  fs::remove_all(run.dir, ec);
  fs::create_directories(run.dir);
  const std::string train = (fsdp::bench::self_dir() / "fsdp-train").string();
  const std::string nvme = (run.dir / "nvme").string();
  const std::string sub = std::to_string(o.sub_group_size);
  const std::vector<std::pair<std::string, std::vector<std::string>>> configs = {
      {"ram", {}},
      {"optimizer_on_disk",
       {"--offload-optimizer-device", "nvme", "--nvme-path", nvme, "--sub-group-size", sub}},
      {"params_and_optimizer_on_disk",
       {"--offload-optimizer-device", "nvme", "--nvme-path", nvme, "--sub-group-size", sub,
        "--offload-params-device", "nvme", "--max-in-cpu", "0", "--params-buffer-count",
        std::to_string(o.stage3_params_buffer_count)}}};
  json out = {{"model", run.model}, {"world", run.devices}, {"backend", "mpi"},
              {"steps", run.steps}, {"strategy", "deepspeed_stage_3"},
              {"params_buffer_count", o.stage3_params_buffer_count}};
  json ram;
  for (const auto& [name, extra] : configs) {
    std::vector<std::string> flags = {"--strategy", "deepspeed_stage_3", "--backend", "mpi"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    json r = fsdp::bench::run_fsdp_train(train, run, flags, name);
    if (r.contains("step_end_seconds")) {
      r["it_per_s"] = fsdp::bench::it_per_s(r["step_end_seconds"].get<std::vector<double>>(), 1);
    }
    if (r.contains("disk_wait_seconds")) {
      const auto w = r["disk_wait_seconds"].get<std::vector<double>>();
      double sum = 0;
      for (size_t i = 1; i < w.size(); ++i) sum += w[i];
      r["disk_wait_seconds_per_step"] = w.size() > 1 ? sum / static_cast<double>(w.size() - 1) : 0.0;
    }
    if (name == "ram") {
      ram = r;
    } else if (ram.contains("losses") && r.contains("losses") && ram["it_per_s"].is_number() &&
               r["it_per_s"].is_number()) {
      r["it_per_s_ratio_to_ram"] = r["it_per_s"].get<double>() / ram["it_per_s"].get<double>();
      double worst = 0;
      for (size_t i = 0; i < r["losses"].size() && i < ram["losses"].size(); ++i) {
        const double a = ram["losses"][i].get<double>(), b = r["losses"][i].get<double>();
        worst = std::max(worst, std::abs(a - b) / std::max(std::abs(a), 1e-12));
      }
      r["max_relative_loss_difference_to_ram"] = worst;
    }
    for (const char* k : {"step_end_seconds", "forward_seconds", "backward_seconds",
                          "optimizer_seconds", "comm_seconds"}) {
      r.erase(k);  // keep the report short; the summaries stay in the run's files until removed
    }
    out[name] = r;
  }
  out["nvme_left_after"] = fs::exists(nvme) && !fs::is_empty(nvme);
  fs::remove_all(run.dir, ec);
  return out;
}

int run_offload(const std::vector<std::string>& args) {
  OffloadOptions o;
  CLI::App app{"fsdp-bench offload"};
  app.add_option("--dir", o.dir, "directory on the disk to measure (files removed after)");
  app.add_option("--numel", o.numel, "fp32 parameters the optimizer steps");
  app.add_option("--sub-group-size", o.sub_group_size, "elements per streamed sub-group");
  app.add_option("--block-size", o.aio.block_size, "bytes per I/O request (both measurements)");
  app.add_option("--queue-depth", o.aio.queue_depth, "swapper requests in flight");
  app.add_option("--intra-op-parallelism", o.aio.intra_op_parallelism, "swapper rings");
  app.add_option("--steps", o.steps, "timed optimizer steps");
  app.add_option("--forward-ms", o.forward_ms,
                 "matmul compute after each step, standing in for the next forward (overlap)");
  app.add_option("--stage3-model", o.stage3_model,
                 "also compare fsdp-train deepspeed_stage_3 at world 2 (MPI) on this model: in "
                 "RAM, optimizer state on disk, parameters + optimizer state on disk");
  app.add_option("--stage3-steps", o.stage3_steps, "optimizer steps of each stage-3 run")
      ->check(fsdp::cli::between(2, 1000));
  app.add_option("--stage3-params-buffer-count", o.stage3_params_buffer_count,
                 "parameter buffers of the parameters-on-disk run")
      ->check(fsdp::cli::between(1, 64));
  app.add_flag("--only-stage3", o.only_stage3, "run the stage-3 comparison only");
  if (auto code = fsdp::bench::parse_args(app, "offload", args)) return *code;

  json out;
  out["load_average_start"] = fsdp::bench::load_average();
  out["dir"] = o.dir;
  out["numel"] = o.numel;
  out["sub_group_size"] = o.sub_group_size;
  out["block_size"] = o.aio.block_size;
  out["queue_depth"] = o.aio.queue_depth;
  out["intra_op_parallelism"] = o.aio.intra_op_parallelism;
  out["threads"] = at::get_num_threads();

  if (o.only_stage3) {
    if (o.stage3_model.empty()) {
      std::cerr << "fsdp-bench offload: error: --only-stage3 needs --stage3-model MODEL\n";
      return 2;
    }
    out["stage3"] = stage3_comparison(o);
    out["load_average_end"] = fsdp::bench::load_average();
    std::cout << out.dump(2) << std::endl;
    return 0;
  }
  const fsdp::DiskPlan plan = fsdp::plan_disk_offload(o.numel, o.sub_group_size, o.dir);
  const int64_t bytes = fsdp::detail::align_up(plan.disk_bytes, o.aio.block_size);
  out["disk"] = disk_baseline(o.dir + "/fsdp-bench-offload-disk.bin", bytes, o.aio.block_size);
  out["swapper_raw"] = swapper_raw(o.dir, bytes, o.aio);

  // The optimizer step with its moments on disk.
  at::Tensor p = at::empty({o.numel}).uniform_(-1, 1).requires_grad_();
  p.mutable_grad() = at::empty({o.numel}).uniform_(-1e-2, 1e-2);
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  fsdp::detail::NvmeAdam::Options no;
  no.nvme_path = o.dir;
  no.job = "fsdp-bench-offload";
  no.sub_group_size = o.sub_group_size;
  no.aio = o.aio;
  no.who = "[fsdp-bench offload]";
  no.overlap_last_writes = false;  // every timed step includes all of its writes
  fsdp::detail::NvmeAdam nvme(opt, no);
  nvme.step(opt);  // warm-up: the first step writes only
  std::vector<double> times;
  const int64_t io0 = nvme.io_bytes();
  for (int i = 0; i < o.steps; ++i) {
    auto t0 = Clock::now();
    nvme.step(opt);
    times.push_back(fsdp::bench::seconds_since(t0));
  }
  const int64_t moved = nvme.io_bytes() - io0;  // read + written
  std::sort(times.begin(), times.end());
  const double step_s = times[times.size() / 2];
  const double per_dir = static_cast<double>(moved) / 2 / o.steps;  // read = written per step
  const double ideal_s = per_dir / (out["disk"]["read_gb_s"].get<double>() * 1e9) +
                         per_dir / (out["disk"]["write_gb_s"].get<double>() * 1e9);
  out["step"] = {{"median_s", step_s},
                 {"step_seconds", times},
                 {"bytes_read_and_written_per_step", 2 * per_dir},
                 {"achieved_gb_s", 2 * per_dir / step_s / 1e9},
                 {"disk_time_at_measured_bandwidth_s", ideal_s},
                 {"sub_groups", plan.num_sub_groups},
                 {"swap_buffers_bytes", plan.ram_bytes}};
  out["fraction_of_disk_bandwidth"] = ideal_s / step_s;
  out["goal"] = ">= 0.5";
  out["overlap"] = overlap_last_writes(o, opt, no);
  if (!o.stage3_model.empty()) out["stage3"] = stage3_comparison(o);
  out["load_average_end"] = fsdp::bench::load_average();
  std::cout << out.dump(2) << std::endl;
  return 0;
}

const fsdp::bench::Registrar reg_offload(
    "offload",
    "disk tier: O_DIRECT disk bandwidth vs the io_uring swapper and the pipelined NVMe Adam step",
    run_offload);

}  // namespace
