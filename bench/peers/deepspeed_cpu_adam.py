"""DeepSpeedCPUAdam beside fsdp::optim::CPUAdam (fsdp-bench cpu_adam runs this).

Steps DeepSpeed's CPU Adam (adamw_mode=True, weight_decay 0.01, lr 1e-3, fp32 parameters and
state) over --numel parameters split into tensors of --tensor-numel, as bench/cpu_adam.cpp does,
with --threads OpenMP / intra-op threads, and PyTorch's own torch.optim.AdamW(fused=True) on the
same tensors for context. DeepSpeed's op builder compiles csrc/adam/cpu_adam.cpp on first use
(DS_ACCELERATOR=cpu; -march=native -fopenmp, cached under ~/.cache/torch_extensions).

Prints one JSON object: *_step_seconds (timed steps), *_median_s, or "error" with the text of
what failed (the op build, the import, the step).
"""
import argparse
import json
import os
import sys
import time
import traceback


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=104857600)
    ap.add_argument("--tensor-numel", type=int, default=4194304)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    # Before torch / deepspeed load OpenMP: the thread count and the CPU accelerator.
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ["DS_ACCELERATOR"] = "cpu"

    import torch

    torch.set_num_threads(a.threads)
    out = {"threads": a.threads, "numel": a.numel, "torch": torch.__version__}

    params = []
    done = 0
    while done < a.numel:
        n = min(a.tensor_numel, a.numel - done)
        p = torch.empty(n).uniform_(-1, 1).requires_grad_()
        p.grad = torch.empty(n).uniform_(-1e-2, 1e-2)
        params.append(p)
        done += n

    def time_steps(opt):
        for _ in range(a.warmup):
            opt.step()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times, sorted(times)[len(times) // 2]

    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["deepspeed"] = deepspeed.__version__
        t0 = time.perf_counter()
        opt = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
        out["deepspeed_setup_s"] = time.perf_counter() - t0  # includes the op build/load
        with torch.no_grad():
            times, med = time_steps(opt)
        out["deepspeed_cpu_adamw_step_seconds"] = times
        out["deepspeed_cpu_adamw_median_s"] = med
        del opt
    except Exception as e:  # the op builder's compiler output, an import error, ...
        out["error"] = "DeepSpeedCPUAdam: " + "".join(
            traceback.format_exception_only(type(e), e)).strip()[-1500:]

    try:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
        with torch.no_grad():
            times, med = time_steps(opt)
        out["torch_fused_adamw_step_seconds"] = times
        out["torch_fused_adamw_median_s"] = med
    except Exception as e:
        out["torch_fused_adamw_error"] = "".join(
            traceback.format_exception_only(type(e), e)).strip()[-1500:]

    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
