"""What every Python peer of fsdp.cpp shares: the mirror of the demo Transformer, the batches,
the per-step clock, peak RSS, threads and the command-line arguments.

Used by bench/peers/torch_peer.py (PyTorch single / DDP / FSDP2), bench/peers/lightning_peer.py
(Lightning's Trainer) and so by `fsdp-bench peers` and tests/test_pytorch_parity.cpp.

The mirror: src/models/transformer.cpp + attention.cpp is the Lightning demo Transformer
(lightning.pytorch.demos.Transformer) with three deliberate differences, reproduced here:
  - positions: fsdp.cpp adds the sinusoidal encoding of positions 0..L-1 to the L embeddings
    (the Lightning demo adds row `L` of it to every position, `pe[:, x.size(1)]`, a known slip);
  - one dropout after (embedding * sqrt(E) + positions), as the demo's PositionalEncoding does;
  - log-softmax in fp32 when the logits are bf16 (bf16-mixed).
Everything else is PyTorch's own nn.Transformer (post-norm, ReLU, batch first, LayerNorm eps
1e-5, a final LayerNorm on the encoder and on the decoder, causal mask on the decoder's
self-attention only), so parameter names are the same as fsdp.cpp's and a state dict written
by fsdp.cpp loads with strict=True.

The batches are a safetensors file {"input", "target"}: int64 (micro_batches, world * B, T),
written by `fsdp-train --save-batches` (the batches fsdp-train trains on) or by a test. Row
block [r*B, (r+1)*B) of micro-batch i is rank r's batch i, so every system reads the same
samples in the same order, and one process reading whole rows sees the same global batch.
"""
import argparse
import json
import math
import os
import queue
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class DemoTransformer(nn.Module):
    """fsdp::demos::Transformer in PyTorch (see the module docstring)."""

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

    def layers(self):
        """The FSDP units below the root, as fsdp.cpp's `layers` wrap policy picks them."""
        return list(self.transformer.encoder.layers) + list(self.transformer.decoder.layers)

    @staticmethod
    def layer_types():
        return {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}

    def positions(self, length, like):
        # pe[pos, 2i] = sin(pos * w_i), pe[pos, 2i+1] = cos(pos * w_i), w_i = 10000^(-2i/E),
        # computed in fp32, then cast to the embeddings' dtype (as Transformer::positional_encoding).
        # on the embeddings' device (a GPU run builds them there)
        dev = like.device
        position = torch.arange(length, dtype=torch.float, device=dev).unsqueeze(1)
        div = torch.exp(torch.arange(0, self.ninp, 2, dtype=torch.float, device=dev)
                        * (-math.log(10000.0) / self.ninp))
        pe = torch.zeros(length, self.ninp, device=dev)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div[: self.ninp // 2])
        return pe.to(like.dtype)

    def embed(self, tokens):
        x = self.embedding(tokens) * math.sqrt(self.ninp)
        return self.dropout(x + self.positions(tokens.size(1), x))

    def forward(self, inputs, target):
        t = target.size(1)
        mask = torch.full((t, t), float("-inf"), device=target.device).triu_(1)
        out = self.transformer(self.embed(inputs), self.embed(target), tgt_mask=mask)
        out = self.decoder(out)
        if out.element_size() < 4:
            out = out.float()  # bf16 logits: log-softmax in fp32
        return F.log_softmax(out, dim=-1).reshape(-1, self.vocab)


def build_model(args):
    torch.manual_seed(args.seed)
    model = DemoTransformer(args.vocab, args.ninp, args.nhead, args.nhid, args.nlayers,
                            args.dropout)
    if args.weights:
        load_weights(model, args.weights)
    return model


def load_weights(model, path):
    """Loads a safetensors file of fsdp.cpp's parameters (FQN keys, optionally under one
    prefix such as "model." from a LightningModule) with strict names and shapes."""
    state = load_file(path)
    names = set(model.state_dict())
    prefixes = {k[: len(k) - len(n)] for k in state for n in names if k.endswith(n)}
    for prefix in sorted(prefixes, key=len):
        stripped = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if set(stripped) == names:
            model.load_state_dict(stripped, strict=True)
            return
    missing = sorted(names - set(state))[:5]
    raise SystemExit(f"[mirror] {path} does not hold the mirror's parameters (under any one "
                     f"prefix); e.g. missing {missing}; file keys: {sorted(state)[:5]}...")


class Batches:
    """The batch file (see the module docstring), read once per process."""

    def __init__(self, path):
        tensors = load_file(path)
        self.input, self.target = tensors["input"], tensors["target"]
        if self.input.shape != self.target.shape or self.input.dim() != 3:
            raise SystemExit(f"[mirror] {path}: input {tuple(self.input.shape)} and target "
                             f"{tuple(self.target.shape)} must both be (micro_batches, rows, T)")

    def __len__(self):
        return self.input.size(0)

    def get(self, index, rank, world):
        """Rank `rank`'s batch `index` (rows [rank*B, (rank+1)*B) of a world-`world` file)."""
        rows = self.input.size(1)
        if rows % world:
            raise SystemExit(f"[mirror] {rows} rows per micro-batch do not split over {world} "
                             "ranks")
        b = rows // world
        sl = slice(rank * b, (rank + 1) * b)
        return self.input[index, sl].contiguous(), self.target[index, sl].contiguous()


def peak_rss_bytes():
    """VmHWM of this process (what fsdp::peak_rss_bytes reads for fsdp.cpp's ranks)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class StepClock:
    """End time of every optimizer step, measured as fsdp.cpp's Trainer does: after the step's
    loss is averaged over the ranks (one all-reduce, a synchronization point), in seconds since
    the clock was made. `fsdp-bench peers` turns the list into it/s for every system alike."""

    def __init__(self, world):
        self.world = world
        self.start = time.perf_counter()
        self.ends = []
        self.losses = []

    def step_done(self, loss):
        value = loss.detach().float().reshape(1).clone()
        if self.world > 1:
            dist.all_reduce(value)
            value /= self.world
        self.losses.append(float(value.item()))
        self.ends.append(time.perf_counter() - self.start)


def threads_per_rank(args):
    return args.threads if args.threads > 0 else max(1, (os.cpu_count() or 1) // args.world)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks_and_print(train, args):
    """Runs train(rank, args, port, queue) on args.world processes (in this one for world 1) and
    prints what rank 0 put on the queue as one JSON line."""
    if args.world == 1:
        results = queue.Queue()
        train(0, args, 0, results)
    else:
        results = mp.get_context("spawn").Queue()
        mp.spawn(train, args=(args, free_port(), results), nprocs=args.world, join=True)
    print(json.dumps(results.get(timeout=60)), flush=True)


def gather_rss(world):
    """Every rank's peak RSS in MiB, on every rank (a collective when world > 1)."""
    mine = peak_rss_bytes() / 1048576.0
    if world == 1:
        return [mine]
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def report(args, system, clock, rss_mb, params, extra=None):
    """The one JSON object a peer prints (rank 0), read by fsdp-bench and the parity test."""
    out = {
        "system": system,
        "strategy": args.strategy,
        "precision": args.precision,
        "world_size": args.world,
        "threads_per_rank": torch.get_num_threads(),  # as set on rank 0, not as asked
        "params": params,
        "steps": len(clock.ends),
        "losses": [v if math.isfinite(v) else None for v in clock.losses],  # JSON: NaN -> null
        "step_end_seconds": clock.ends,
        "peak_rss_mb": rss_mb,
        "torch_version": torch.__version__,
        "backend": "gloo" if args.world > 1 else None,
    }
    out.update(extra or {})
    return out


STRATEGIES = ("single", "ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "deepspeed-stage-1",
              "deepspeed-stage-2", "deepspeed-stage-3")  # the last three: deepspeed_peer.py
PRECISIONS = ("32-true", "bf16-mixed")


def add_args(parser):
    """The flags every peer takes (fsdp-bench and the parity test pass them)."""
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--world", type=int, default=1, help="ranks (processes)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per rank (0: cores / world, as fsdp.cpp)")
    parser.add_argument("--batches", required=True, help="safetensors batch file (see mirror.py)")
    parser.add_argument("--steps", type=int, default=0,
                        help="optimizer steps (0: every micro-batch of the file)")
    parser.add_argument("--weights", default="", help="initial weights (safetensors, FQN keys)")
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--ninp", type=int, required=True)
    parser.add_argument("--nhead", type=int, required=True)
    parser.add_argument("--nhid", type=int, required=True)
    parser.add_argument("--nlayers", type=int, required=True)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam's eps")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=42, help="init (without --weights), dropout")


def check_args(args, batches):
    if args.strategy == "single" and args.world != 1:
        raise SystemExit("[mirror] --strategy single runs one process: pass --world 1")
    if args.precision == "bf16-mixed" and not args.strategy.startswith("fsdp"):
        raise SystemExit("[mirror] bf16-mixed is measured under FSDP only (MixedPrecisionPolicy)")
    if args.steps <= 0 or args.steps > len(batches):
        args.steps = len(batches)


def make_optimizer(args, params):
    cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)


def init_process_group(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def parser(description):
    p = argparse.ArgumentParser(description=description)
    add_args(p)
    return p
