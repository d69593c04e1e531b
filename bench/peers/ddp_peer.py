#!/usr/bin/python3
"""PyTorch DDP peer for `fsdp-bench train`: the same model, data shape and optimizer as
`fsdp-train --model transformer-small --data synthetic`, trained with torch DDP on Gloo.

Runs `--world` processes on loopback (torch.multiprocessing), one intra-op thread each by
default (like fsdp.cpp: cores / local ranks), and prints one JSON object on stdout:
  {"it_per_s": ..., "steps": ..., "warmup": ..., "world_size": ..., "params": ..., ...}
it/s counts optimizer steps after `--warmup` untimed steps, measured on rank 0 between two
barriers. Needs Debian's python3-torch (/usr/bin/python3); the model is written here after
lightning.pytorch.demos.Transformer (embedding * sqrt(ninp) + sinusoidal positions,
nn.Transformer post-norm encoder-decoder with ReLU, causal target mask, linear decoder,
log_softmax), with the positional encoding added as fsdp.cpp's demo does.
"""
import argparse
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: (ninp, nhead, nhid, nlayers)
    "transformer-tiny": (32, 2, 64, 2),
    "transformer-small": (512, 8, 2048, 4),
}


class DemoTransformer(nn.Module):
    def __init__(self, vocab, ninp, nhead, nhid, nlayers, dropout):
        super().__init__()
        self.ninp = ninp
        self.vocab = vocab
        self.embedding = nn.Embedding(vocab, ninp)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model=ninp, nhead=nhead, num_encoder_layers=nlayers, num_decoder_layers=nlayers,
            dim_feedforward=nhid, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(ninp, vocab)
        self.pe_cache = None

    def positions(self, t, like):
        if self.pe_cache is None or self.pe_cache.size(0) < t:
            pos = torch.arange(t, dtype=torch.float).unsqueeze(1)
            div = torch.exp(torch.arange(0, self.ninp, 2, dtype=torch.float)
                            * (-math.log(10000.0) / self.ninp))
            pe = torch.zeros(t, self.ninp)
            pe[:, 0::2] = torch.sin(pos * div)
            pe[:, 1::2] = torch.cos(pos * div)
            self.pe_cache = pe
        return self.pe_cache[:t].to(like.dtype)

    def embed(self, tokens):
        x = self.embedding(tokens) * math.sqrt(self.ninp)
        return self.dropout(x + self.positions(tokens.size(1), x))

    def forward(self, inputs, target):
        t = target.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        out = self.transformer(self.embed(inputs), self.embed(target), tgt_mask=mask)
        return F.log_softmax(self.decoder(out), dim=-1).view(-1, self.vocab)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank, args, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    ninp, nhead, nhid, nlayers = PRESETS[args.model]
    torch.manual_seed(args.seed)
    model = DemoTransformer(args.vocab, ninp, nhead, nhid, nlayers, args.dropout)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    # Synthetic tokens (the timing does not depend on their values), batch first.
    data = torch.randint(args.vocab, (args.warmup + args.steps, args.batch_size, args.block + 1),
                         generator=gen)
    ddp.train()
    loss = None
    t0 = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        batch = data[step]
        inputs, target = batch[:, :-1], batch[:, 1:]
        opt.zero_grad()
        loss = F.nll_loss(ddp(inputs, target), target.reshape(-1))
        loss.backward()
        opt.step()
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        queue.put({
            "it_per_s": args.steps / seconds,
            "seconds": seconds,
            "steps": args.steps,
            "warmup": args.warmup,
            "world_size": args.world,
            "threads_per_rank": args.threads,
            "params": sum(p.numel() for p in model.parameters()),
            "final_loss": float(loss.item()),
            "torch_version": torch.__version__,
            "backend": "gloo",
        })
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer-small", choices=sorted(PRESETS))
    p.add_argument("--vocab", type=int, required=True, help="vocabulary size (the dataset's)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores/world)")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--block", type=int, default=35)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.world)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(run, args=(args, free_port(), queue), nprocs=args.world, join=True)
    print(json.dumps(queue.get(timeout=60)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
