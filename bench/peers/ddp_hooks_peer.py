"""PyTorch DDP with a communication hook beside fsdp.cpp's (`fsdp-bench ddp-hooks`): the mirror
model (mirror.py) under torch.nn.parallel.DistributedDataParallel on Gloo with PyTorch's own
hook registered, as Lightning's DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...,
ddp_comm_wrapper=..., model_averaging_period=...) would, on the batches of a batch file.
Prints one JSON object (mirror.report plus comm_bytes_per_step) on stdout.

  --hook allreduce | fp16_compress | bf16_compress | powersgd | batched_powersgd | post_local_sgd
  --wrapper none | fp16 | bf16

Bytes per step are counted where the collectives are called: every torch.distributed.all_reduce
call (the hooks', the model averager's and the step clock's loss average) adds its tensor's
bytes, as fsdp.cpp's process group counts the tensors passed to it. DDP's own C++ all-reduce is
not visible from Python, so "allreduce" registers PyTorch's allreduce_hook, which DDP documents
as equivalent to no hook.

PyTorch 2.13's batched_powerSGD_hook raises AssertionError at its first compressing step (it
passes the bucket's 2-D Q to _orthogonalize, which accepts only batches of 3-D): the run stops
there and reports the error, with the step and PyTorch's source line, as its JSON "error" (the
row stays in the benchmark table as that error; nothing is patched).
PyTorch 2.13 refuses bf16_compress_hook (and the bf16 wrapper) unless CUDA 11+ with NCCL 2.10+
or XPU with XCCL is present: on this CPU build register_comm_hook raises TypeError, reported the
same way (fsdp.cpp's bf16 rows then have no PyTorch row to compare with).
post_localSGD_hook with subgroup=None calls dist.new_subgroups(), which needs CUDA to pick a
size; the subgroups are made here with the given --subgroup-size.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mirror  # noqa: E402

HOOKS = ("allreduce", "fp16_compress", "bf16_compress", "powersgd", "batched_powersgd",
         "post_local_sgd")


class ByteCounter:
    """Wraps torch.distributed.all_reduce (the hooks look it up at call time) and counts the
    bytes of every tensor passed to it."""

    def __init__(self):
        self.bytes = 0
        self._all_reduce = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted


def describe_failure(exc, when):
    """One line: the exception, when it happened ("at step 3") and the innermost PyTorch source
    line it came from."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torch" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = " in %s:%d (%s: `%s`)" % (f.filename.split("site-packages/")[-1], f.lineno,
                                           f.name, (f.line or "").strip())
    return "PyTorch %s raised %s%s %s%s" % (
        torch.__version__, type(exc).__name__, (": " + str(exc)) if str(exc) else "", when, where)


def register(ddp, args):
    """Registers the hook as Lightning's _register_ddp_comm_hook does; returns the averager."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as L
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.distributed.algorithms.model_averaging import averagers

    state, averager = None, None
    if args.hook == "allreduce":
        hook = D.allreduce_hook
    elif args.hook == "fp16_compress":
        hook = D.fp16_compress_hook
    elif args.hook == "bf16_compress":
        hook = D.bf16_compress_hook
    elif args.hook in ("powersgd", "batched_powersgd"):
        state = P.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.start_powersgd_iter,
            min_compression_rate=args.min_compression_rate)
        hook = P.powerSGD_hook if args.hook == "powersgd" else P.batched_powerSGD_hook
    else:
        subgroup, _ = dist.new_subgroups(group_size=args.subgroup_size)
        state = L.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                    start_localSGD_iter=args.start_local_sgd_iter)
        hook = L.post_localSGD_hook
        averager = averagers.PeriodicModelAverager(period=args.model_averaging_period,
                                                   warmup_steps=args.start_local_sgd_iter)
    if args.wrapper == "fp16":
        hook = D.fp16_compress_wrapper(hook)
    elif args.wrapper == "bf16":
        hook = D.bf16_compress_wrapper(hook)
    ddp.register_comm_hook(state, hook)
    return averager


def train(rank, args, port, queue):
    torch.set_num_threads(mirror.threads_per_rank(args))
    mirror.init_process_group(rank, args.world, port)
    counter = ByteCounter()
    batches = mirror.Batches(args.batches)
    model = mirror.build_model(args)
    params = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    try:
        averager = register(ddp, args)
    except Exception as e:  # PyTorch refuses the hook here (bf16 on a CPU build): report it
        if rank == 0:
            queue.put({"system": "pytorch-ddp", "hook": args.hook, "wrapper": args.wrapper,
                       "error": describe_failure(e, "at register_comm_hook"),
                       "losses": [], "comm_bytes_per_step": []})
        return
    opt = mirror.make_optimizer(args, ddp.parameters())
    torch.manual_seed(args.seed + rank)
    ddp.train()
    clock = mirror.StepClock(args.world)
    per_step = []
    for step in range(args.steps):
        before = counter.bytes
        inputs, target = batches.get(step, rank, args.world)
        loss = F.nll_loss(ddp(inputs, target), target.reshape(-1))
        try:
            loss.backward()  # runs the hook
        except Exception as e:  # every rank fails in the same step (the hook is deterministic)
            if rank == 0:
                queue.put({"system": "pytorch-ddp", "hook": args.hook, "wrapper": args.wrapper,
                           "error": describe_failure(e, "at step %d" % (step + 1)),
                           "losses": clock.losses,
                           "comm_bytes_per_step": per_step})
            return
        opt.step()
        if averager is not None:  # Lightning's DDPStrategy.optimizer_step
            averager.average_parameters(
                iter([p for g in opt.param_groups for p in g["params"] if p.grad is not None]))
        opt.zero_grad(set_to_none=True)
        clock.step_done(loss)
        per_step.append(counter.bytes - before)
    rss = mirror.gather_rss(args.world)
    if rank == 0:
        queue.put(mirror.report(args, "pytorch-ddp", clock, rss, params, {
            "hook": args.hook, "wrapper": args.wrapper, "comm_bytes_per_step": per_step}))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = mirror.parser(__doc__.splitlines()[0])
    p.add_argument("--hook", choices=HOOKS, required=True)
    p.add_argument("--wrapper", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--start-powersgd-iter", type=int, default=1000)
    p.add_argument("--min-compression-rate", type=float, default=2)
    p.add_argument("--start-local-sgd-iter", type=int, default=0)
    p.add_argument("--subgroup-size", type=int, default=1)
    p.add_argument("--model-averaging-period", type=int, default=4)
    args = p.parse_args()
    mirror.check_args(args, mirror.Batches(args.batches))
    if args.strategy != "ddp" or args.world < 2:
        raise SystemExit("[ddp_hooks_peer] pass --strategy ddp and --world >= 2")
    mirror.run_ranks_and_print(train, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
