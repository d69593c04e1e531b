"""fsdp.cpp on one GPU against PyTorch and llm.c, measured in one run; prints one JSON object.

  python3 bench/gpu_bench.py [--out FILE] [--fsdp-train PATH] [--llmc-src DIR] ...
  python3 bench/gpu_bench.py --rehearse     # no GPU: every path at tiny shapes, GPU rows "not run"

Rows (each in a process of its own, under a time limit; a row that fails records its error and
the run goes on; rows the deadline leaves no time for say "not run: ..."):
  device          peak bf16 matmul rate (torch.mm), device copy bandwidth, the transformer-1b
                  step's matmuls at their own shapes, a fused AdamW step: the floors' inputs
  gpt2/*          GPT-2 124M (src/models/gpt.cpp, mirrored in bench/peers/gpt2_mirror.py),
                  bf16-mixed, B x T tokens a step:
                    pytorch-eager    torch.autocast(bf16), fp32 parameters, fused AdamW
                    pytorch-compile  the same under torch.compile (inductor)
                    pytorch-fsdp2    fully_shard per block + root, world 1, MixedPrecisionPolicy
                                     (bf16 parameters and reduction), NCCL
                    llmc             llm.c's train_gpt2cu (bf16, its defaults otherwise), built here
                                     with nvcc from sources carried in gpu-deps/llmc, on random
                                     weights and tokens written in its file formats
                    fsdp.cpp-fsdp    fsdp-train --strategy fsdp --backend nccl --devices 1
                    fsdp.cpp-single  fsdp-train --strategy single (CUDA autocast)
  transformer-1b/*  the encoder-decoder demo Transformer (bench/peers/mirror.py), FULL_SHARD,
                  world 1, bf16-mixed: pytorch-fsdp2 and fsdp.cpp-fsdp
Every system runs the same number of steps; the first --warmup steps are not timed. Tokens/s is
B x T / mean timed step. MFU: llm.c's FLOPs per token (6 N + 6 L C T) over the matmul rate
measured in the device row. Device peak: the CUDA caching allocator's peak from after setup
to the end (torch.cuda.max_memory_allocated; fsdp-train's --summary-json device_peak_mb).
Progress goes to stderr; the JSON to stdout and --out.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))

# src/models/registry.cpp: transformer presets (vocab, ninp, nhead, nhid, nlayers).
TRANSFORMERS = {"transformer-1b": (33278, 1024, 64, 4096, 32)}
GOAL_TOKENS_OVER_EAGER = 1.1
GOAL_TOKENS_OVER_LLMC = 0.8
GOAL_STEP_OVER_FLOOR = 1.3


def log(msg):
    print(f"[gpu-bench] {msg}", file=sys.stderr, flush=True)


def tail(text, n=1500):
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return None


# ---------------------------------------------------------------------------------------------
# Rows that run in this interpreter's torch (each in its own process: `--row NAME`).

def device_of(cfg):
    import torch
    if cfg["cuda"]:
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)  # an index: init_process_group's device_id needs one
    return torch.device("cpu")


def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn, dev, reps):
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def linear_shapes(vocab, ninp, nhid, nlayers, tokens):
    """The Linears of a transformer-* step, as bench/floor.cpp counts them: (name, m, in, out,
    count per step)."""
    d, f, L = ninp, nhid, nlayers
    return [("attn in-proj (enc+dec self)", tokens, d, 3 * d, 2 * L),
            ("attn out-proj (enc+dec self+cross)", tokens, d, d, 3 * L),
            ("cross-attn q", tokens, d, d, L),
            ("cross-attn k,v", tokens, d, 2 * d, L),
            ("ffn up", tokens, d, f, 2 * L),
            ("ffn down", tokens, f, d, 2 * L),
            ("output", tokens, d, vocab, 1)]


def row_device(cfg):
    """The rates the floors and MFU divide by, measured on this device now."""
    import torch
    import mirror
    dev = device_of(cfg)
    dt = getattr(torch, cfg["rate_dtype"])  # bfloat16 on a GPU
    out = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__}
    if dev.type == "cuda":
        out["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
        out["device_total_mb"] = torch.cuda.get_device_properties(0).total_memory / 2**20
    # Peak bf16 matmul: the best of a few square sizes, 10 products a timing.
    best = 0.0
    sizes = cfg["matmul_sizes"]
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        s = best_seconds(lambda: [torch.mm(a, b) for _ in range(10)], dev, 3) / 10
        best = max(best, 2.0 * n ** 3 / s)
        del a, b
    out["matmul_bf16_tflops" if dt == torch.bfloat16 else "matmul_tflops_" + cfg["rate_dtype"]] = (
        best / 1e12)
    out["matmul_sizes"] = sizes
    # Device copy bandwidth: read + write bytes of a large copy_.
    n = cfg["copy_bytes"] // 4
    src = torch.empty(n, device=dev, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    s = best_seconds(lambda: dst.copy_(src), dev, 5)
    out["copy_gbps"] = 2.0 * n * 4 / s / 1e9
    out["copy_bytes"] = n * 4
    del src, dst
    # A fused AdamW step on fp32 parameters, per element (the record beside the bandwidth floor).
    n = cfg["adam_elements"]
    p = torch.zeros(n, device=dev, requires_grad=True)
    p.grad = torch.randn(n, device=dev)
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0, fused=True)
        kind = "fused"
        s = best_seconds(opt.step, dev, 3)
    except (RuntimeError, TypeError):  # no fused AdamW for this device
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
        kind = "foreach"
        s = best_seconds(opt.step, dev, 3)
    out["adamw_seconds_per_element"] = s / n
    out["adamw_kind"] = kind
    del p, opt
    # transformer-1b: the step's matmuls, each Linear's forward, input and weight gradient timed
    # at its own shape in bf16 (bench/floor.cpp's compute floor, on this device).
    vocab, ninp, nhead, nhid, nlayers = cfg["tb_dims"]
    tokens = cfg["tb_batch"] * cfg["tb_block"]
    rows, seconds, flops = [], 0.0, 0.0
    for name, m, i, o, count in linear_shapes(vocab, ninp, nhid, nlayers, tokens):
        x = torch.randn(m, i, device=dev, dtype=dt)
        w = torch.randn(o, i, device=dev, dtype=dt)
        dy = torch.randn(m, o, device=dev, dtype=dt)
        t = (best_seconds(lambda: torch.mm(x, w.t()), dev, 3) +
             best_seconds(lambda: torch.mm(dy, w), dev, 3) +
             best_seconds(lambda: torch.mm(dy.t(), x), dev, 3)) * count
        f = 6.0 * m * i * o * count
        seconds += t
        flops += f
        rows.append({"linear": name, "m": m, "in": i, "out": o, "per_step": count,
                     "seconds": t, "tflops": f / t / 1e12})
        del x, w, dy
    with torch.device("meta"):
        params = sum(p.numel() for p in mirror.DemoTransformer(
            vocab, ninp, nhead, nhid, nlayers, 0.0).parameters())
    out["transformer_1b"] = {
        "params": params, "tokens_per_step": tokens,
        "matmul_seconds": seconds, "matmul_flops": flops,
        "attention_flops_not_counted": 3.0 * 4.0 * tokens * cfg["tb_block"] * ninp * 3 * nlayers,
        "linears": rows}
    return out


def batches(cfg, vocab, batch, block, dev):
    import torch
    g = torch.Generator().manual_seed(cfg["seed"])
    data = torch.randint(0, vocab, (cfg["steps"], batch, block + 1), generator=g)
    return data[:, :, :-1].contiguous().to(dev), data[:, :, 1:].contiguous().to(dev)


def init_world_1(dev):
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, **kwargs)
    return backend


def fsdp2_wrap(model):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model.layers():
        fully_shard(layer, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, reshard_after_forward=True, mp_policy=policy)
    return model


def train_steps(cfg, dev, model, loss_fn, opt, autocast):
    """Runs cfg["steps"] steps; returns per-step seconds, losses and the device peak."""
    import contextlib
    import torch
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))  # a synchronization point, as fsdp-train's step end
        times.append(time.perf_counter() - t0)
        log(f"  step {step + 1}/{cfg['steps']}: {times[-1] * 1e3:.1f} ms, loss {losses[-1]:.4f}")
    out = {"step_seconds_each": times, "losses": losses}
    if dev.type == "cuda":
        out["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["device_peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def row_gpt2_torch(cfg, mode):
    import torch
    import gpt2_mirror
    dev = device_of(cfg)
    torch.manual_seed(cfg["seed"])
    model = gpt2_mirror.build("gpt2-124m", dev, cfg.get("gpt2_layers"), cfg.get("gpt2_vocab"))
    vocab = model.vocab
    params = sum(p.numel() for p in model.parameters())
    x, y = batches(cfg, vocab, cfg["gpt2_batch"], cfg["gpt2_block"], dev)
    out = {"params": params}
    if mode == "fsdp2":
        out["backend"] = init_world_1(dev)
        model = fsdp2_wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        out["optimizer"] = "AdamW (foreach), lr 1e-4, weight decay 0"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                fused=dev.type == "cuda")
        out["optimizer"] = "AdamW (%s), lr 1e-4, weight decay 0" % (
            "fused" if dev.type == "cuda" else "foreach")
    if mode == "compile":
        model = torch.compile(model, backend=cfg["compile_backend"])
        out["compile_backend"] = cfg["compile_backend"]
    out.update(train_steps(cfg, dev, model, lambda i: model(x[i], y[i]), opt,
                           autocast=mode != "fsdp2"))
    return out


def row_tb_fsdp2(cfg):
    import torch
    import torch.nn.functional as F
    import mirror
    dev = device_of(cfg)
    vocab, ninp, nhead, nhid, nlayers = cfg["tb_dims"]
    torch.manual_seed(cfg["seed"])
    with torch.device(dev):
        model = mirror.DemoTransformer(vocab, ninp, nhead, nhid, nlayers, 0.0)
    params = sum(p.numel() for p in model.parameters())
    out = {"params": params, "backend": init_world_1(dev)}
    model = fsdp2_wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    out["optimizer"] = "AdamW (foreach), lr 1e-4, weight decay 0"
    x, y = batches(cfg, vocab, cfg["tb_batch"], cfg["tb_block"], dev)
    out.update(train_steps(
        cfg, dev, model, lambda i: F.nll_loss(model(x[i], y[i]), y[i].reshape(-1)), opt,
        autocast=False))
    return out


ROWS_IN_PROCESS = {
    "device": row_device,
    "gpt2/pytorch-eager": lambda c: row_gpt2_torch(c, "eager"),
    "gpt2/pytorch-compile": lambda c: row_gpt2_torch(c, "compile"),
    "gpt2/pytorch-fsdp2": lambda c: row_gpt2_torch(c, "fsdp2"),
    "transformer-1b/pytorch-fsdp2": row_tb_fsdp2,
}


def run_row_here(name, cfg):
    import warnings
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    out = ROWS_IN_PROCESS[name](cfg)
    out["peak_rss_mb"] = peak_rss_mb()
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the measurement is done; teardown must not lose it
        pass
    print("GPU_BENCH_ROW " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver: subprocesses under limits.

class Clock:
    def __init__(self, deadline_s):
        self.start = time.monotonic()
        self.deadline_s = deadline_s

    def left(self):
        return self.deadline_s - (time.monotonic() - self.start)


def run(argv, limit_s, log_path, cwd=None, env=None):
    """Runs argv with stdout+stderr to log_path; returns (exit code or 'timeout', seconds)."""
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                             start_new_session=True)
        try:
            code = p.wait(timeout=max(1, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = "timeout"
    return code, time.monotonic() - t0


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def not_run(reason):
    return {"status": "not run: " + reason}


def timed(row, warmup, tokens_per_step):
    """Adds step_seconds (mean of the steps after warm-up) and tokens_per_s to a row."""
    each = row.get("step_seconds_each") or []
    if len(each) <= warmup:
        row["status"] = "error"
        row.setdefault("error", f"{len(each)} steps measured, {warmup} warm-up: none timed")
        return row
    timed_steps = each[warmup:]
    row["step_seconds"] = sum(timed_steps) / len(timed_steps)
    row["timed_steps"] = len(timed_steps)
    if tokens_per_step:
        row["tokens_per_s"] = tokens_per_step / row["step_seconds"]
    return row


def python_row(name, cfg, a, clock, limit_s):
    left = clock.left()
    if left < 20:
        return not_run("out of time (the run's deadline)")
    path = os.path.join(a.work_dir, name.replace("/", "_") + ".log")
    argv = [sys.executable, os.path.abspath(__file__), "--row", name, "--config", json.dumps(cfg)]
    log(f"{name} (limit {min(limit_s, left - 5):.0f} s)...")
    code, secs = run(argv, min(limit_s, left - 5), path)
    text = read(path)
    rows = [line for line in text.splitlines() if line.startswith("GPU_BENCH_ROW ")]
    if code != 0 or not rows:
        return {"status": "error", "seconds": secs,
                "error": f"exited {code}: " + tail("\n".join(
                    l for l in text.splitlines() if not l.startswith("[gpu-bench]")))}
    out = json.loads(rows[-1][len("GPU_BENCH_ROW "):])
    out["status"] = "ran"
    out["seconds"] = secs
    return out


def fsdp_train_row(model, strategy, batch, block, a, cfg, clock, limit_s, accelerator, backend):
    name = f"{model}_{strategy}_{accelerator}"
    summary = os.path.join(a.work_dir, name + ".json")
    argv = [a.fsdp_train, "--model", model, "--data", "synthetic", "--vocab-size",
            str(cfg["vocab"][model]), "--devices", "1", "--accelerator", accelerator,
            "--strategy", strategy, "--backend", backend, "--precision", "bf16-mixed",
            "--batch-size", str(batch), "--block-size", str(block),
            "--max-steps", str(cfg["steps"]), "--seed", str(cfg["seed"]), "--dropout", "0",
            "--optimizer", "adamw", "--lr", "1e-4", "--weight-decay", "0",
            "--limit-val-batches", "0", "--no-progress-bar", "--logger", "none",
            "--default-root-dir", os.path.join(a.work_dir, "logs"), "--summary-json", summary]
    out = {"command": " ".join(argv)}
    if not os.access(a.fsdp_train, os.X_OK):
        out.update(not_run(f"no fsdp-train at {a.fsdp_train} (scripts/gpu-check.sh builds it)"))
        return out
    left = clock.left()
    if left < 20:
        out.update(not_run("out of time (the run's deadline)"))
        return out
    if os.path.exists(summary):
        os.remove(summary)
    log(f"fsdp-train {model} {strategy} {accelerator}/{backend} (limit {min(limit_s, left - 5):.0f} s)...")
    path = os.path.join(a.work_dir, name + ".log")
    code, secs = run(argv, min(limit_s, left - 5), path)
    out["seconds"] = secs
    if code != 0 or not os.path.exists(summary):
        out["status"] = "error"
        out["error"] = f"fsdp-train exited {code}: " + tail(read(path))
        return out
    s = json.loads(read(summary))
    ends = s.get("step_end_seconds") or []
    out["status"] = "ran"
    out["step_seconds_each"] = [e - b for b, e in zip([0.0] + ends[:-1], ends)]
    for key in ("params", "losses", "it_per_s", "device_peak_mb", "peak_alloc_mb",
                "peak_breakdown_mb"):
        if key in s:
            out[key] = s[key]
    w = cfg["warmup"]
    for phase in ("forward", "backward", "optimizer", "comm"):
        v = (s.get(phase + "_seconds") or [])[w:]
        if v:
            out[phase + "_seconds"] = sum(v) / len(v)
    rss = [max(x, y) for x, y in zip(s.get("peak_rss_mb", []), s.get("setup_peak_rss_mb", []))]
    out["peak_rss_mb"] = rss[0] if rss else None
    dp = s.get("device_peak_mb") or [None]
    out["device_peak_mb"] = dp[0]
    return out


# ---------------------------------------------------------------------------------------------
# llm.c: build train_gpt2cu from carried sources, write its files, run it.

def find_cublas(a):
    """(include dir, lib dir) holding cublas_v2.h and libcublas.so*, or None: --cublas-root, the
    CUDA toolkit, then the torch venv's nvidia wheels (nvidia/cu13 or nvidia/cublas)."""
    roots = [a.cublas_root] if a.cublas_root else []
    roots.append(a.cuda_home)
    try:
        import site
        for sp in site.getsitepackages():
            roots += sorted(glob.glob(os.path.join(sp, "nvidia", "*")))
    except Exception:  # noqa: BLE001 - a venv without site.getsitepackages
        pass
    for r in roots:
        inc = os.path.join(r, "include")
        if not os.path.exists(os.path.join(inc, "cublas_v2.h")):
            continue
        for lib in ("lib", "lib64", "targets/x86_64-linux/lib"):
            d = os.path.join(r, lib)
            if glob.glob(os.path.join(d, "libcublas.so*")) and glob.glob(
                    os.path.join(d, "libcublasLt.so*")):
                return inc, d
    return None


def link_flag(lib_dir, name):
    """-l for an unversioned library, -l:file for a versioned one (wheels ship only .so.N)."""
    if os.path.exists(os.path.join(lib_dir, f"lib{name}.so")):
        return f"-l{name}"
    found = sorted(glob.glob(os.path.join(lib_dir, f"lib{name}.so.*")), key=len)
    return "-l:" + os.path.basename(found[0])


def nvml_flags(cuda_home):
    """llm.c's mfu.h uses NVML when <nvml.h> is on the include path: link it then."""
    if not os.path.exists(os.path.join(cuda_home, "include", "nvml.h")):
        return []
    for d in (os.path.join(cuda_home, "lib64", "stubs"),
              os.path.join(cuda_home, "targets", "x86_64-linux", "lib", "stubs"),
              "/usr/lib/x86_64-linux-gnu", "/usr/lib64"):
        if glob.glob(os.path.join(d, "libnvidia-ml.so*")):
            return ["-L" + d, link_flag(d, "nvidia-ml")]
    return ["-lnvidia-ml"]


# CUDA 13 changed cudaMemAdvise's last argument from a device id to a cudaMemLocation; llm.c
# calls it once, on its out-of-memory fallback to managed memory.
LLMC_PATCHES = [("llmc/cuda_utils.cuh",
                 "cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)",
                 "cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, "
                 "cudaMemLocation{cudaMemLocationTypeHost, 0})")]


def build_llmc(a, clock):
    src = a.llmc_src
    if not os.path.exists(os.path.join(src, "train_gpt2.cu")):
        return not_run(f"no llm.c sources in {src} (FSDP_LLMC_DIR=<llm.c checkout> "
                       "scripts/gpu-deps.sh copies them)")
    nvcc = os.path.join(a.cuda_home, "bin", "nvcc")
    if not os.access(nvcc, os.X_OK):
        return not_run(f"no nvcc at {nvcc}")
    cublas = find_cublas(a)
    if not cublas:
        return not_run("no cuBLAS (cublas_v2.h and libcublas.so*) in --cublas-root, the CUDA "
                       "toolkit or the venv's nvidia wheels")
    inc, lib = cublas
    work = os.path.join(a.work_dir, "llmc")
    shutil.rmtree(os.path.join(work, "src"), ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    shutil.copytree(src, os.path.join(work, "src"))
    applied = []
    version = nvcc_version(nvcc)
    if version and version[0] >= 13:
        for rel, old, new in LLMC_PATCHES:
            p = os.path.join(work, "src", rel)
            text = read(p)
            if text.count(old) == 1:
                with open(p, "w") as f:
                    f.write(text.replace(old, new))
                applied.append(f"{rel}: cudaMemAdvise takes a cudaMemLocation (CUDA 13)")
    exe = os.path.join(work, "train_gpt2cu")
    arch = a.llmc_arch
    argv = [nvcc, "--threads=0", "--use_fast_math", "-std=c++17", "-O3", "-DENABLE_BF16",
            f"--generate-code=arch=compute_{arch},code=[compute_{arch},sm_{arch}]",
            "-I" + os.path.join(work, "src"), "-I" + inc,
            os.path.join(work, "src", "train_gpt2.cu"),
            "-L" + lib, link_flag(lib, "cublas"), link_flag(lib, "cublasLt"),
            "-Xlinker", "-rpath=" + lib] + nvml_flags(a.cuda_home) + ["-o", exe]
    out = {"build_command": " ".join(argv), "patches": applied,
           "nvcc": ".".join(map(str, version)) if version else None, "cublas": lib}
    left = clock.left()
    if left < 30:
        out.update(not_run("out of time (the run's deadline) before building llm.c"))
        return out
    log(f"building llm.c's train_gpt2cu with nvcc (sm_{arch})...")
    code, secs = run(argv, min(240, left - 5), os.path.join(work, "build.log"))
    out["build_seconds"] = secs
    if code != 0 or not os.path.exists(exe):
        out["status"] = "error"
        out["error"] = f"nvcc exited {code}: " + tail(read(os.path.join(work, "build.log")))
        return out
    out["exe"] = exe
    return out


def gpu_arch():
    """The GPU's compute capability as nvcc spells it ("90"), from nvidia-smi: the driver
    process makes no CUDA context of its own (it would hold device memory all run long)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
        m = re.match(r"\s*(\d+)\.(\d+)", text)
        if m:
            return m.group(1) + m.group(2)
    except (OSError, subprocess.SubprocessError):
        pass
    return "90"


def nvcc_version(nvcc):
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def write_llmc_files(work, batch, block, steps, seed):
    """llm.c's files (train_gpt2.cu, llmc/dataloader.h): a bf16 model file (header of 256 int32:
    magic 20240326, version 5, maxT, V, L, NH, C, Vp; then the parameters in llm.c's order) with
    GPT-2's init, and train / val token files (header of 256 int32: magic 20240520, version 1,
    count; then uint16 tokens)."""
    import torch
    V, maxT, L, NH, C = 50257, 1024, 12, 12, 768
    Vp = (V + 127) // 128 * 128  # 50304, llm.c's padding
    header = torch.zeros(256, dtype=torch.int32)
    header[:8] = torch.tensor([20240326, 5, maxT, V, L, NH, C, Vp], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    resid = 0.02 / (2 * L) ** 0.5
    # (shape, init): wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb,
    # fcprojw, fcprojb, lnfw, lnfb (llm.c's fill_in_parameter_sizes order)
    tensors = [((Vp, C), 0.02), ((maxT, C), 0.02), ((L, C), 1.0), ((L, C), 0.0),
               ((L, 3 * C, C), 0.02), ((L, 3 * C), 0.0), ((L, C, C), resid), ((L, C), 0.0),
               ((L, C), 1.0), ((L, C), 0.0), ((L, 4 * C, C), 0.02), ((L, 4 * C), 0.0),
               ((L, C, 4 * C), resid), ((L, C), 0.0), ((C,), 1.0), ((C,), 0.0)]
    model = os.path.join(work, "gpt2_124M_bf16.bin")
    count = 0
    with open(model, "wb") as f:
        f.write(header.numpy().tobytes())
        for shape, init in tensors:
            if init in (0.0, 1.0):
                t = torch.full(shape, init)
            else:
                t = torch.randn(shape, generator=g) * init
            count += t.numel()
            f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    files = {"model": model, "params": count}
    for split, n in (("train", max(1 << 20, batch * block * (steps + 4))),
                     ("val", batch * block * 2 + 1)):
        h = torch.zeros(256, dtype=torch.int32)
        h[:3] = torch.tensor([20240520, 1, n], dtype=torch.int32)
        tokens = torch.randint(0, V, (n,), generator=g, dtype=torch.int32)
        path = os.path.join(work, f"tokens_{split}.bin")
        with open(path, "wb") as f:
            f.write(h.numpy().tobytes())
            f.write(tokens.numpy().astype("<u2").tobytes())  # uint16: V < 2^16
        files[split] = path
        files[split + "_tokens"] = n
    return files


STEP_RE = re.compile(r"step\s+(\d+)/(\d+) \| loss ([0-9.naninf-]+) .*?\| ([0-9.]+) ms \|")


def run_llmc(built, files, a, cfg, clock):
    argv = [built["exe"], "-i", files["train"], "-j", files["val"], "-e", files["model"],
            "-b", str(cfg["gpt2_batch"]), "-t", str(cfg["gpt2_block"]),
            "-x", str(cfg["steps"]), "-l", "1e-4", "-c", "0",
            "-v", "1000000", "-m", "1", "-s", "0", "-n", "0", "-h", "0"]
    out = {"command": " ".join(argv)}
    if not a.cuda:
        out.update(not_run("no CUDA device"))
        return out
    left = clock.left()
    if left < 20:
        out.update(not_run("out of time (the run's deadline)"))
        return out
    log(f"llm.c train_gpt2cu, {cfg['steps']} steps (limit {min(120, left - 5):.0f} s)...")
    path = os.path.join(a.work_dir, "llmc", "run.log")
    code, secs = run(argv, min(120, left - 5), path, cwd=os.path.join(a.work_dir, "llmc"))
    text = read(path)
    steps = [m for m in STEP_RE.finditer(text)]
    out["seconds"] = secs
    if code != 0 or len(steps) < cfg["steps"]:
        out["status"] = "error"
        out["error"] = f"train_gpt2cu exited {code} after {len(steps)} steps: " + tail(text)
        return out
    out["status"] = "ran"
    out["step_seconds_each"] = [float(m.group(4)) / 1e3 for m in steps]
    out["losses"] = [float(m.group(3)) for m in steps]
    out["params"] = files["params"]
    m = re.search(r"device memory usage: (\d+) MiB", text)
    if m:  # cudaMemGetInfo after its allocations: includes the CUDA context, not a caching peak
        out["device_used_mb_incl_context"] = int(m.group(1))
    out["note"] = ("llm.c's defaults otherwise: bf16 with fp32 master weights, GELU recompute, "
                   "gradient clipping at 1.0, padded vocabulary 50304; step time from its own "
                   "CUDA events")
    return out


# ---------------------------------------------------------------------------------------------

def finite(x):
    """JSON has no NaN or infinity: a diverged loss is written as null."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def goal(name, value, baseline, target, cmp, unit, why_missing):
    g = {"goal": name, "target": target}
    if value is None or baseline is None:
        g["status"] = "not run: " + why_missing
        return g
    ratio = value / baseline
    g.update({"value": value, "baseline": baseline, "ratio": ratio, "unit": unit,
              "status": "met" if (ratio >= target if cmp == ">=" else ratio <= target) else
              "not met"})
    return g


def reason(row):
    if not row:
        return "row not selected"
    s = row.get("status", "")
    if s.startswith("not run"):
        return s[len("not run: "):]
    if s != "error":
        return s
    # the first line that says "error", else the start of the text
    text = row.get("error", "error")
    lines = [l for l in text.splitlines() if "error" in l.lower()] or [text]
    return lines[0][:400]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--rehearse", action="store_true",
                   help="no GPU: tiny shapes on the CPU, GPU rows 'not run' (automatic "
                        "without CUDA)")
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--work-dir", default="", help="scratch (default: a new folder in /tmp)")
    p.add_argument("--fsdp-train", default=os.path.join(ROOT, "build-gpu", "bin", "fsdp-train"))
    p.add_argument("--llmc-src", default=os.path.join(ROOT, "gpu-deps", "llmc"),
                   help="llm.c's train_gpt2.cu and llmc/ (scripts/gpu-deps.sh copies them)")
    p.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    p.add_argument("--cublas-root", default=os.environ.get("FSDP_CUBLAS_ROOT", ""),
                   help="a folder with include/cublas_v2.h and lib/libcublas.so* (default: "
                        "the toolkit, then the venv's nvidia wheels)")
    p.add_argument("--llmc-arch", default="", help="compute capability, e.g. 90 (default: the "
                   "GPU's; 90 without one)")
    p.add_argument("--steps", type=int, default=0, help="steps per system (default 10; 3 "
                   "rehearsing)")
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    p.add_argument("--gpt2-batch", type=int, default=16)
    p.add_argument("--gpt2-block", type=int, default=1024)
    p.add_argument("--tb-batch", type=int, default=4)
    p.add_argument("--tb-block", type=int, default=1024)
    p.add_argument("--rows", default="", help="comma-separated rows to run (default: all)")
    p.add_argument("--deadline-s", type=float, default=220,
                   help="rows that would start after this many seconds are 'not run'")
    a = p.parse_args()
    if a.row:
        run_row_here(a.row, json.loads(a.config))
        return 0

    import torch
    a.cuda = torch.cuda.is_available() and not a.rehearse
    rehearse = not a.cuda
    steps = a.steps or (3 if rehearse else 10)
    if steps <= a.warmup:
        p.error(f"--steps {steps} leaves no step after --warmup {a.warmup}")
    # Absolute paths: llm.c runs in a folder of its own.
    a.work_dir = os.path.abspath(a.work_dir or f"/tmp/fsdp-gpu-bench-{os.getpid()}")
    a.fsdp_train = os.path.abspath(a.fsdp_train)
    a.llmc_src = os.path.abspath(a.llmc_src)
    os.makedirs(a.work_dir, exist_ok=True)
    if not a.llmc_arch:
        a.llmc_arch = gpu_arch() if a.cuda else "90"
    clock = Clock(a.deadline_s)
    # Shapes: the goals' on a GPU; a rehearsal keeps the widths and cuts depth, batch and tokens.
    cfg = {"cuda": a.cuda, "seed": 42, "steps": steps, "warmup": a.warmup,
           "gpt2_batch": a.gpt2_batch, "gpt2_block": a.gpt2_block,
           "tb_batch": a.tb_batch, "tb_block": a.tb_block, "tb_dims": TRANSFORMERS["transformer-1b"],
           "vocab": {"gpt2-124m": 50257, "transformer-1b": 33278, "gpt2-tiny": 128},
           "matmul_sizes": [4096, 8192], "copy_bytes": 1 << 30, "adam_elements": 1 << 28,
           "compile_backend": "inductor", "rate_dtype": "bfloat16"}
    if rehearse:
        # bf16 matmuls run at ~1 GFLOP/s on a CPU without bf16 units: the rehearsal keeps the
        # models' widths and bf16, and cuts depth, vocabulary and tokens.
        _, e, h, f, _ = TRANSFORMERS["transformer-1b"]
        cfg.update({"gpt2_layers": 1, "gpt2_vocab": 512, "gpt2_batch": 1, "gpt2_block": 32,
                    "tb_dims": (512, e, h, f, 1), "tb_batch": 1, "tb_block": 8,
                    "matmul_sizes": [256], "copy_bytes": 64 << 20, "adam_elements": 1 << 22,
                    "rate_dtype": "float32"})
    wanted = set(filter(None, a.rows.split(",")))

    def want(name):
        return not wanted or name in wanted or name.split("/")[0] in wanted

    result = {
        "bench": "gpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": "rehearsal (no CUDA device): CPU, rehearsal shapes" if rehearse else "gpu",
        "torch": torch.__version__,
        "config": {k: cfg[k] for k in ("steps", "warmup", "gpt2_batch", "gpt2_block",
                                       "tb_batch", "tb_block", "tb_dims")},
        "rows": {}}
    if rehearse:
        result["config"]["rehearsal_shapes"] = (
            "gpt2: 1 of 12 layers, vocabulary 512, B 1, T 32; transformer-1b: 1 of 32 layers, "
            "vocabulary 512, B 1, T 8; device rates in fp32 at small sizes on the CPU; the "
            "fsdp-train parse check trains gpt2-tiny on the CPU. No number here is a GPU's.")
    rows = result["rows"]
    gpt2_tokens = cfg["gpt2_batch"] * cfg["gpt2_block"]
    tb_tokens = cfg["tb_batch"] * cfg["tb_block"]

    def add(name, row, tokens):
        if row.get("status") == "ran":
            timed(row, a.warmup, tokens)
        rows[name] = row
        log(f"{name}: {row.get('status')}" + (
            f", {row['step_seconds'] * 1e3:.1f} ms/step" if "step_seconds" in row else "") + (
            f" ({reason(row)[:200]})" if row.get("status") == "error" else ""))

    # 1. the device's rates
    if want("device"):
        rows["device"] = python_row("device", cfg, a, clock, 120)
        log(f"device: {rows['device'].get('status')}")
    # 2. GPT-2 124M
    for name, limit in (("gpt2/pytorch-eager", 90),):
        if want(name):
            add(name, python_row(name, cfg, a, clock, limit), gpt2_tokens)
    gpu_or_cpu = ("cuda", "nccl")
    for strategy in ("fsdp", "single"):
        name = f"gpt2/fsdp.cpp-{strategy}"
        if want(name):
            add(name, fsdp_train_row("gpt2-124m", strategy, cfg["gpt2_batch"], cfg["gpt2_block"],
                                     a, cfg, clock, 120, *gpu_or_cpu), gpt2_tokens)
    if want("gpt2/llmc"):
        built = build_llmc(a, clock)
        if "exe" in built:
            files = write_llmc_files(os.path.join(a.work_dir, "llmc"), cfg["gpt2_batch"],
                                     cfg["gpt2_block"], steps, cfg["seed"])
            built["files"] = files
            built.update(run_llmc(built, files, a, cfg, clock))
        add("gpt2/llmc", built, gpt2_tokens)
    if want("gpt2/pytorch-fsdp2"):
        add("gpt2/pytorch-fsdp2", python_row("gpt2/pytorch-fsdp2", cfg, a, clock, 90),
            gpt2_tokens)
    # 3. transformer-1b FULL_SHARD
    if want("transformer-1b/fsdp.cpp-fsdp"):
        add("transformer-1b/fsdp.cpp-fsdp",
            fsdp_train_row("transformer-1b", "fsdp", cfg["tb_batch"], cfg["tb_block"], a, cfg,
                           clock, 150, *gpu_or_cpu), tb_tokens)
    if want("transformer-1b/pytorch-fsdp2"):
        add("transformer-1b/pytorch-fsdp2",
            python_row("transformer-1b/pytorch-fsdp2", cfg, a, clock, 150), tb_tokens)
    # 4. torch.compile last: its compilation is the longest and it is a second PyTorch row
    if want("gpt2/pytorch-compile"):
        add("gpt2/pytorch-compile", python_row("gpt2/pytorch-compile", cfg, a, clock, 150),
            gpt2_tokens)
    if rehearse and want("parse-check"):
        # fsdp-train on the CPU at rehearsal shapes: proves the summary is read as on a GPU.
        # Not a GPU number; no goal reads it.
        add("rehearsal/fsdp.cpp-fsdp-cpu-gpt2-tiny",
            fsdp_train_row("gpt2-tiny", "fsdp", 1, 32, a, cfg, clock, 120, "cpu", "gloo"), 32)

    # Derived: MFU, the floor, goals.
    dev = rows.get("device", {})
    peak = dev.get("matmul_bf16_tflops") if dev.get("status") == "ran" else None
    g2_params = 124439808  # fsdp::demos::parameter_count(gpt2-124m), tied, vocab 50257
    L, C, T = 12, 768, cfg["gpt2_block"]
    flops_per_token = 6 * g2_params + 6 * L * C * T
    result["mfu_basis"] = {
        "flops_per_token": flops_per_token,
        "formula": "6 N + 6 L C T (llm.c's gpt2_estimate_mfu), N = 124,439,808, for every row",
        "peak_bf16_tflops_measured": peak}
    for name, row in rows.items():
        if name.startswith("gpt2/") and "tokens_per_s" in row and peak and not rehearse:
            row["mfu"] = row["tokens_per_s"] * flops_per_token / (peak * 1e12)
    floor = None
    if dev.get("status") == "ran":
        tb = dev["transformer_1b"]
        opt_s = 28.0 * tb["params"] / (dev["copy_gbps"] * 1e9)
        floor = {"seconds": tb["matmul_seconds"] + opt_s,
                 "matmul_seconds": tb["matmul_seconds"],
                 "optimizer_seconds": opt_s,
                 "optimizer_basis": "28 B per fp32 parameter (read p, g, m, v; write p, m, v) "
                                    "at the measured copy bandwidth",
                 "measured_adamw_seconds": dev["adamw_seconds_per_element"] * tb["params"],
                 "attention_flops_not_counted": tb["attention_flops_not_counted"]}
        result["transformer_1b_floor"] = floor

    def val(row_name, key):
        r = rows.get(row_name) or {}
        return r.get(key) if r.get("status") == "ran" else None

    def why(*names):
        parts = [f"{n}: {reason(rows.get(n))}" for n in names
                 if (rows.get(n) or {}).get("status") != "ran"]
        return "; ".join(parts) or "a value is missing"

    ours_g, ours_t = "gpt2/fsdp.cpp-fsdp", "transformer-1b/fsdp.cpp-fsdp"
    goals = [
        goal("GPT-2 124M tokens/s, fsdp.cpp FULL_SHARD world 1 / PyTorch eager",
             val(ours_g, "tokens_per_s"), val("gpt2/pytorch-eager", "tokens_per_s"),
             GOAL_TOKENS_OVER_EAGER, ">=", "tokens/s", why(ours_g, "gpt2/pytorch-eager")),
        goal("GPT-2 124M tokens/s, fsdp.cpp / llm.c train_gpt2cu",
             val(ours_g, "tokens_per_s"), val("gpt2/llmc", "tokens_per_s"),
             GOAL_TOKENS_OVER_LLMC, ">=", "tokens/s", why(ours_g, "gpt2/llmc")),
        goal("transformer-1b FULL_SHARD step / floor (matmuls + optimizer traffic)",
             val(ours_t, "step_seconds"), floor["seconds"] if floor else None,
             GOAL_STEP_OVER_FLOOR, "<=", "s", why(ours_t, "device")),
        goal("GPT-2 124M device peak, fsdp.cpp / PyTorch eager",
             val(ours_g, "device_peak_mb"), val("gpt2/pytorch-eager", "device_peak_mb"),
             1.0, "<=", "MiB", why(ours_g, "gpt2/pytorch-eager")),
        goal("transformer-1b device peak, fsdp.cpp / PyTorch FSDP2",
             val(ours_t, "device_peak_mb"), val("transformer-1b/pytorch-fsdp2", "device_peak_mb"),
             1.0, "<=", "MiB", why(ours_t, "transformer-1b/pytorch-fsdp2")),
    ]
    result["goals"] = goals
    # Ratios beside the goals (no target): every GPT-2 row against eager, 1b step vs FSDP2.
    ratios = {}
    base = val("gpt2/pytorch-eager", "tokens_per_s")
    for name in rows:
        v = val(name, "tokens_per_s")
        if name.startswith("gpt2/") and v and base:
            ratios[f"{name} tokens/s / gpt2/pytorch-eager"] = v / base
    v, b = val(ours_t, "step_seconds"), val("transformer-1b/pytorch-fsdp2", "step_seconds")
    if v and b:
        ratios["transformer-1b step, fsdp.cpp / PyTorch FSDP2"] = v / b
    result["ratios"] = ratios
    result["seconds"] = time.monotonic() - clock.start
    result["work_dir"] = a.work_dir
    text = json.dumps(finite(result), indent=2, allow_nan=False)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    for g in goals:
        log(f"goal: {g['goal']}: {g['status']}" + (
            f" ({g['ratio']:.3f}, target {g['target']})" if "ratio" in g else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
