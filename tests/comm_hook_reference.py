"""PyTorch's own DDP comm hooks on given gradients: the referee of tests/test_ddp_comm_hooks.cpp.

    python comm_hook_reference.py --grads IN.safetensors --out OUT.safetensors --world W \
        --buckets '[[[6,4],[7]], [[16,8],[8]]]' \
        --configs '[{"hook": "powersgd", "rank": 2, "start_iter": 2}, {"hook": "fp16_compress"}]'

IN holds "grads.<b>" of shape (steps, world, numel of bucket b): rank r's flat gradient of
bucket b at each step. For each config (a hook and its PowerSGDState arguments, PyTorch's
defaults for those not given), W processes (Gloo, one thread each) call
torch.distributed.algorithms.ddp_comm_hooks' hook on every bucket of every step, in bucket
order, each waited on before the next (as fsdp.cpp's reducer waits in bucket order), with one
state per process as DDP keeps it. OUT gets "out.<c>.<b>" (steps, world, numel): what each
rank's hook returned for config c. The hooks read only buffer(), index(), is_last() and gradients() of a bucket, so
a plain Python object stands in for dist.GradBucket (which Python cannot construct).
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class Bucket:
    def __init__(self, index, count, buffer, shapes):
        self._index, self._count, self._buffer, self._shapes = index, count, buffer, shapes

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def buffer(self):
        return self._buffer

    def gradients(self):
        out, offset = [], 0
        for shape in self._shapes:
            n = 1
            for d in shape:
                n *= d
            out.append(self._buffer[offset:offset + n].view(shape))
            offset += n
        return out


def rank_main(rank, args, init_file, result_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=args.world)
    buckets = json.loads(args.buckets)
    grads = load_file(args.grads)
    steps = grads["grads.0"].shape[0]
    outs = {}
    for c, config in enumerate(json.loads(args.configs)):
        config = dict(config)
        name = config.pop("hook")
        if name in ("powersgd", "batched_powersgd"):
            state = powerSGD_hook.PowerSGDState(process_group=None, **config)
            hook = (powerSGD_hook.powerSGD_hook if name == "powersgd"
                    else powerSGD_hook.batched_powerSGD_hook)
        else:
            state = None
            hook = {"allreduce": default_hooks.allreduce_hook,
                    "fp16_compress": default_hooks.fp16_compress_hook,
                    "bf16_compress": default_hooks.bf16_compress_hook}[name]
        for b in range(len(buckets)):
            outs[f"out.{c}.{b}"] = []
        for step in range(steps):
            for b, shapes in enumerate(buckets):
                buffer = grads[f"grads.{b}"][step, rank].clone()
                result = hook(state, Bucket(b, len(buckets), buffer, shapes)).wait()
                if isinstance(result, (list, tuple)):
                    result = result[0]
                outs[f"out.{c}.{b}"].append(result.detach().to(torch.float32).clone())
    save_file({k: torch.stack(v) for k, v in outs.items()},
              os.path.join(result_dir, f"rank{rank}.safetensors"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grads", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--buckets", required=True, help="JSON: per bucket, the gradients' shapes")
    p.add_argument("--configs", required=True,
                   help="JSON list of {hook: allreduce | fp16_compress | bf16_compress | "
                        "powersgd | batched_powersgd, PowerSGDState keyword arguments...}")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(rank_main, args=(args, init_file, tmp), nprocs=args.world,
                           start_method="fork")
        per_rank = [load_file(os.path.join(tmp, f"rank{r}.safetensors"))
                    for r in range(args.world)]
        save_file({k: torch.stack([pr[k] for pr in per_rank], dim=1) for k in per_rank[0]},
                  args.out)


if __name__ == "__main__":
    main()
