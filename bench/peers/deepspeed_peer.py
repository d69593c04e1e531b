"""DeepSpeed's own ZeRO beside fsdp.cpp's: the mirror model (mirror.py) trained by
`deepspeed.initialize` on the CPU accelerator (DS_ACCELERATOR=cpu) over Gloo, one process per
rank on loopback, on the batches of a batch file. Prints one JSON object (mirror.report) on
stdout; on an error {"error": "<Type>: <message>", "system": "deepspeed", ...} and exits 1.

  --strategy deepspeed-stage-1|2|3   zero_optimization.stage N, DeepSpeed's defaults otherwise
                                     (as a config with only the stage), the mirror's Adam as a
                                     client optimizer (zero_allow_untested_optimizer)

Not used: DeepSpeed's shared-memory all-reduce op (deepspeed_shm_comm), which the CPU
accelerator JIT-compiles at init_distributed (minutes, and it blocks on a file lock while
another build runs); collectives go through torch.distributed on Gloo, like the other peers.
Every step: forward, nll_loss, engine.backward, engine.step (which zeroes the gradients),
then the loss averaged over ranks (mirror.StepClock).
"""
import json
import os
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mirror  # noqa: E402


def train(rank, args, port, queue):
    try:
        torch.set_num_threads(mirror.threads_per_rank(args))
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                          LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        import deepspeed
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the docstring
        deepspeed.init_distributed(dist_backend="gloo")
        batches = mirror.Batches(args.batches)
        model = mirror.build_model(args)
        params = sum(p.numel() for p in model.parameters())
        stage = int(args.strategy.rsplit("-", 1)[1])
        config = {"train_micro_batch_size_per_gpu": batches.input.size(1) // args.world,
                  "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=mirror.make_optimizer(args, model.parameters()), config=config)
        torch.manual_seed(args.seed + rank)
        engine.train()
        clock = mirror.StepClock(args.world)
        for step in range(args.steps):
            inputs, target = batches.get(step, rank, args.world)
            loss = F.nll_loss(engine(inputs, target), target.reshape(-1))
            engine.backward(loss)
            engine.step()
            clock.step_done(loss)
        rss = mirror.gather_rss(args.world)
        if rank == 0:
            queue.put(mirror.report(args, "deepspeed", clock, rss, params,
                                    {"deepspeed_version": deepspeed.__version__}))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the error is the result
        queue.put({"error": f"{type(e).__name__}: {e}", "system": "deepspeed",
                   "rank": rank, "traceback": traceback.format_exc()[-2000:]})
        raise SystemExit(1)


def main():
    args = mirror.parser(__doc__.splitlines()[0]).parse_args()
    mirror.check_args(args, mirror.Batches(args.batches))
    results = mp.get_context("spawn").Queue()
    try:
        mp.spawn(train, args=(args, mirror.free_port(), results), nprocs=args.world, join=True)
    except Exception:  # noqa: BLE001 - a rank failed: its error is in the queue
        pass
    out = results.get(timeout=60)
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
