"""fsdp.cpp's GPT-2 (src/models/gpt.cpp, the `gpt2-*` presets) in PyTorch, for the peers that
measure it beside fsdp-train (bench/gpu_bench.py).

The same architecture and parameter names as fsdp::demos::GPT, so a state dict written by
fsdp.cpp loads with strict=True:
  - wte (vocab, C) token embedding, tied: the head multiplies by wte.weight (no lm_head);
    the vocabulary is the preset's own (50257 for gpt2-124m, not padded);
  - wpe (block_size, C) learned positions;
  - h.{i}: pre-LN blocks, x + attn(ln_1(x)), x + mlp_proj(gelu_tanh(mlp_fc(ln_2(x))));
    attention has one in-projection (attn.in_proj_weight (3C, C), attn.in_proj_bias (3C)) and
    attn.out_proj, as torch.nn.MultiheadAttention and fsdp.cpp's MultiheadAttention name them;
    causal attention through F.scaled_dot_product_attention(is_causal=True) (fsdp.cpp hands its
    causal mask to SDPA as is_causal too: src/models/attention.cpp);
  - ln_f, LayerNorm eps 1e-5 everywhere;
  - GPT-2 init: N(0, 0.02) weights, zero biases, residual projections N(0, 0.02/sqrt(2 L)).
The loss is cross-entropy over the logits computed in fp32 (fsdp.cpp computes the head's loss
in fp32 chunks, fsdp::linear_cross_entropy; the result is the same, the memory is not).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The gpt2-* presets of src/models/registry.cpp: (vocab, block_size, n_layer, n_head, n_embd).
PRESETS = {
    "gpt2-tiny": (128, 64, 2, 2, 32),
    "gpt2-mini": (128, 128, 4, 4, 256),
    "gpt2-124m": (50257, 1024, 12, 12, 768),
}


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.in_proj_weight = nn.Parameter(torch.empty(3 * n_embd, n_embd))  # (3C, C)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * n_embd))           # (3C)
        self.out_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):  # (B, T, C)
        b, t, c = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)           # (B, T, 3C)
        q, k, v = qkv.view(b, t, 3, self.n_head, c // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)  # (B, H, T, D)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        residual_std = 0.02 / math.sqrt(2.0 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            elif name.endswith("out_proj.weight") or name.endswith("mlp_proj.weight"):
                nn.init.normal_(p, 0.0, residual_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def layers(self):
        """The FSDP units below the root, as fsdp.cpp's `layers` wrap policy picks them."""
        return list(self.h)

    def forward(self, idx, target):  # (B, T) token ids -> scalar loss
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)                  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, self.vocab), target.reshape(-1))


def build(preset, device, n_layer=None, vocab=None):
    """GPT for a preset, built on `device`; n_layer and vocab replace the preset's (for
    rehearsals at small shapes)."""
    preset_vocab, block, layers, heads, embd = PRESETS[preset]
    with torch.device(device):
        return GPT(vocab or preset_vocab, block, n_layer or layers, heads, embd)


def parameter_count(vocab, block, n_layer, n_embd):
    """As fsdp::demos::parameter_count(GPTOptions) for the tied model."""
    c = n_embd
    per_block = 2 * c + 3 * c * c + 3 * c + c * c + c + 2 * c + 4 * c * c + 4 * c + 4 * c * c + c
    return vocab * c + block * c + n_layer * per_block + 2 * c
