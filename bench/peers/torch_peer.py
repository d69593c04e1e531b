"""PyTorch itself beside fsdp.cpp: the mirror model (mirror.py) trained with plain PyTorch 2.x on
Gloo, one process per rank on loopback, on the batches of a batch file. Prints one JSON object
(mirror.report) on stdout.

  --strategy single              one process, the whole global batch, no wrapper
  --strategy ddp                 DistributedDataParallel (bucket_cap_mb=25, PyTorch's default)
  --strategy fsdp-full-shard     FSDP2: fully_shard(layer, reshard_after_forward=True) per
                                 encoder/decoder layer, then the root
  --strategy fsdp-shard-grad-op  the same with reshard_after_forward=False
  --precision bf16-mixed         FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16),
                                 what fsdp.cpp's bf16-mixed does (fp32 sharded parameters and
                                 optimizer, bf16 all-gather, compute and reduce-scatter)

Every step: forward, nll_loss, backward, optimizer.step(), zero_grad(set_to_none=True), then the
loss averaged over ranks (mirror.StepClock), as fsdp.cpp's Trainer does.
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mirror  # noqa: E402


def wrap(model, args):
    if args.strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    if args.strategy.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy()
        if args.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        reshard = args.strategy == "fsdp-full-shard"
        for layer in model.layers():
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model


def train(rank, args, port, queue):
    # FSDP2 warns that the root returns a view ((B*T, V) log-probs, a reshape): harmless here,
    # the view goes straight into nll_loss, no in-place op touches it.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(mirror.threads_per_rank(args))
    if args.world > 1:
        mirror.init_process_group(rank, args.world, port)
    batches = mirror.Batches(args.batches)
    model = mirror.build_model(args)
    params = sum(p.numel() for p in model.parameters())
    module = wrap(model, args)
    opt = mirror.make_optimizer(args, module.parameters())
    torch.manual_seed(args.seed + rank)  # dropout: each rank its own stream
    module.train()
    clock = mirror.StepClock(args.world)
    for step in range(args.steps):
        inputs, target = batches.get(step, rank, args.world)
        loss = F.nll_loss(module(inputs, target), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_done(loss)
    rss = mirror.gather_rss(args.world)
    if rank == 0:
        system = {"single": "pytorch", "ddp": "pytorch-ddp"}.get(args.strategy, "pytorch-fsdp2")
        queue.put(mirror.report(args, system, clock, rss, params))
    if args.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main():
    args = mirror.parser(__doc__.splitlines()[0]).parse_args()
    mirror.check_args(args, mirror.Batches(args.batches))
    mirror.run_ranks_and_print(train, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
