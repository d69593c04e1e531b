"""Lightning beside fsdp.cpp: the mirror model (mirror.py) in a LightningModule, trained by
`lightning.Trainer(accelerator="cpu", devices=N, strategy=...)` on the batches of a batch file.
Prints one JSON object (mirror.report) on stdout from global rank 0; on an error, every rank
that saw it prints {"error": "<Type>: <message>", ...} and exits 1.

  --strategy ddp                 strategy=DDPStrategy(process_group_backend="gloo")
  --strategy fsdp-full-shard     strategy=FSDPStrategy(sharding_strategy="FULL_SHARD",
                                 auto_wrap_policy={TransformerEncoderLayer, TransformerDecoderLayer})
                                 (Lightning 2.6's FSDPStrategy is FSDP1, FullyShardedDataParallel)
  --strategy fsdp-shard-grad-op  the same with sharding_strategy="SHARD_GRAD_OP"
  --precision bf16-mixed         Trainer(precision="bf16-mixed")

Lightning starts the other ranks itself (its subprocess launcher runs this script again with
LOCAL_RANK set). Data: each rank's batches in file order (use_distributed_sampler=False; the
batch file already holds every rank's share). Timing and RSS: a callback around Lightning's loop
with mirror.StepClock (loss averaged over ranks after each optimizer step) and VmHWM per rank.
"""
import json
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mirror  # noqa: E402

import lightning  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy  # noqa: E402


class RankBatches(torch.utils.data.Dataset):
    """This rank's batches, one per item (the loader does not batch again: batch_size=None)."""

    def __init__(self, batches, steps, rank, world):
        self.batches, self.steps, self.rank, self.world = batches, steps, rank, world

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.batches.get(i, self.rank, self.world)


class PeerModule(LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = None
        self.full_params = 0

    def configure_model(self):
        if self.model is None:  # idempotent, as Lightning asks
            self.model = mirror.build_model(self.args)
            self.full_params = sum(p.numel() for p in self.model.parameters())

    def setup(self, stage):
        torch.set_num_threads(mirror.threads_per_rank(self.args))

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))

    def configure_optimizers(self):
        return mirror.make_optimizer(self.args, self.parameters())

    def train_dataloader(self):
        data = RankBatches(mirror.Batches(self.args.batches), self.args.steps,
                           self.trainer.global_rank, self.trainer.world_size)
        return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)


class Measure(Callback):
    def __init__(self, seed):
        self.seed = seed
        self.clock = None
        self.rss = None

    def on_train_start(self, trainer, pl_module):
        torch.manual_seed(self.seed + trainer.global_rank)  # dropout: each rank its own stream
        self.clock = mirror.StepClock(trainer.world_size)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.step_done(outputs["loss"])

    def on_train_end(self, trainer, pl_module):
        self.rss = mirror.gather_rss(trainer.world_size)


def make_strategy(args):
    timeout = timedelta(seconds=300)  # a failed rank ends the others instead of a 30-min hang
    if args.strategy == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    sharding = {"fsdp-full-shard": "FULL_SHARD", "fsdp-shard-grad-op": "SHARD_GRAD_OP"}
    if args.strategy in sharding:
        return FSDPStrategy(sharding_strategy=sharding[args.strategy],
                            auto_wrap_policy=mirror.DemoTransformer.layer_types(),
                            process_group_backend="gloo", timeout=timeout)
    raise SystemExit(f"[lightning_peer] strategy {args.strategy} is not a Lightning "
                     "configuration of the bench (ddp, fsdp-full-shard, fsdp-shard-grad-op)")


def main():
    args = mirror.parser(__doc__.splitlines()[0]).parse_args()
    mirror.check_args(args, mirror.Batches(args.batches))
    os.environ.setdefault("OMP_NUM_THREADS", str(mirror.threads_per_rank(args)))
    torch.set_num_threads(mirror.threads_per_rank(args))
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    system = "lightning-" + ("ddp" if args.strategy == "ddp" else "fsdp")
    measure = Measure(args.seed)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    try:
        trainer = Trainer(accelerator="cpu", devices=args.world, strategy=make_strategy(args),
                          precision=args.precision, max_steps=args.steps, max_epochs=1,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0,
                          limit_val_batches=0, use_distributed_sampler=False,
                          callbacks=[measure])
        module = PeerModule(args)
        trainer.fit(module)
        rank = trainer.global_rank
        params = module.full_params
    except Exception as e:  # noqa: BLE001 - reported as data, the bench shows it
        print(json.dumps({"system": system, "strategy": args.strategy,
                          "precision": args.precision, "world_size": args.world,
                          "rank": rank, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    if rank == 0:
        extra = {"lightning_version": lightning.__version__}
        print(json.dumps(mirror.report(args, system, measure.clock, measure.rss, params,
                                       extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
