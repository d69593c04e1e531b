#!/usr/bin/env python3
"""The Python side of the Hugging Face interop tests (tests/test_llama.cpp, ...).

Runs transformers / PEFT / bitsandbytes / tokenizers in the project's environment and exchanges
tensors with the C++ tests through safetensors files. Several commands may run in one process
(importing transformers costs seconds), separated by a ";" argument:

  hf_reference.py make-llama DIR --tied ";" llama-logits DIR IN OUT

Commands:

  make-llama DIR --vocab V --hidden C --inter I --layers L --heads H --kv-heads K
             [--tied] [--dtype float32|bfloat16] [--rope-llama3] [--max-shard-size S] [--seed N]
      A random LlamaForCausalLM written with save_pretrained (safetensors).
  llama-logits DIR IN OUT
      IN holds input_ids (B, T) int64 and optionally attention_mask (B, T); OUT gets logits (B, T, V)
      fp32 of transformers' LlamaForCausalLM loaded from DIR in fp32 (eager attention off: the
      default sdpa).
  tokenizer DIR --style gpt2|llama3 --vocab N --train FILE --encode FILE [--lines N]
      Trains a byte-level BPE tokenizer with `tokenizers` on FILE (GPT-2's ByteLevel
      pre-tokenizer, or Llama 3's Split regex + ByteLevel with ignore_merges and a BOS template),
      writes DIR/tokenizer.json and DIR/tokenizer_config.json, and encodes the first N lines of
      --encode (each line, and the whole text once) into DIR/ids.safetensors: "ids" (flat int64)
      and "offsets" (int64, line i is ids[offsets[i]:offsets[i+1]]).
  peft-make BASE ADAPTER --r R --alpha A --targets T1,T2 [--seed N]
      get_peft_model on the fp32 base with random (not zero) lora_A and lora_B, save_pretrained.
  peft-logits BASE ADAPTER IN OUT [--4bit] [--merge]
      PeftModel.from_pretrained(base, ADAPTER) logits for IN's input_ids; with --4bit the base
      is loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute); with
      --merge, the logits of merge_and_unload() (a target tied to the embeddings, lm_head with
      tie_word_embeddings, is merged into the shared table: the input embeddings change too).
  bnb IN OUT
      bitsandbytes on every tensor "w.<name>" of IN: quantize_4bit(nf4, blocksize 64,
      compress_statistics True and False) -> "<name>.packed", ".absmax", ".nested_absmax",
      ".offset", ".absmax_single", dequantize_4bit -> ".deq" (fp32), ".deq_bf16"; every
      "x8.<name>": quantize_blockwise(dynamic, 256) -> ".q8", ".q8_absmax"; the dynamic maps
      "dynamic_signed", "dynamic_unsigned"; with "lin.w" and "lin.x": bnb.nn.Linear4bit (nf4,
      double quant, compute bf16, no bias) forward "lin.y" and input gradient of sum(y * lin.g)
      "lin.gx"; with "opt.p" and "opt.g<k>" (k = 0..): AdamW8bit (lr, betas, eps, weight_decay
      from "opt.hparams") steps with those gradients -> "opt.p<k>" after each step and the final
      "opt.state1", "opt.state2", "opt.absmax1", "opt.absmax2".
"""
import argparse
import json
import sys

import torch


def make_llama(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    kwargs = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, tie_word_embeddings=a.tied,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    if a.rope_llama3:
        kwargs["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}
    config = LlamaConfig(**kwargs)
    model = LlamaForCausalLM(config)
    # Non-trivial norm weights (HF initializes them to one).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, a.dtype))
    save_kwargs = {}
    if a.max_shard_size:
        save_kwargs["max_shard_size"] = a.max_shard_size
    model.save_pretrained(a.dir, **save_kwargs)


def llama_logits(a):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(a.dir, dtype=torch.float32)
    model.eval()
    inputs = load_file(a.inp)
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
    save_file({"logits": out.logits.float().contiguous()}, a.out)


def load_base(path, four_bit):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(dtype=torch.float32)
    if four_bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = "cpu"
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def peft_make(a):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(a.seed)
    base = load_base(a.base, False)
    config = LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=a.targets.split(","),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(a.adapter)


def peft_logits(a):
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    base = load_base(a.base, a.four_bit)
    model = PeftModel.from_pretrained(base, a.adapter)
    # train() keeps bitsandbytes' CPU Linear4bit on the dequantize + matmul path (in eval mode
    # it repacks the weight for its AVX512-BF16 inference kernel); nothing here uses dropout.
    model.train()
    if a.merge:
        model = model.merge_and_unload()
    ids = load_file(a.inp)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_file({"logits": logits.float().contiguous()}, a.out)


def bnb_reference(a):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from safetensors.torch import load_file, save_file

    inp = load_file(a.inp)
    out = {"dynamic_signed": F.create_dynamic_map(signed=True),
           "dynamic_unsigned": F.create_dynamic_map(signed=False)}
    for key, w in inp.items():
        if key.startswith("w."):
            name = key[2:]
            q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            out[name + ".packed"] = q.reshape(-1)
            out[name + ".absmax"] = st.absmax
            out[name + ".nested_absmax"] = st.state2.absmax
            out[name + ".offset"] = st.offset.reshape(1).float()
            st.dtype = torch.float32  # (the state records the input's dtype)
            out[name + ".deq"] = F.dequantize_4bit(q, st)
            st.dtype = torch.bfloat16
            out[name + ".deq_bf16"] = F.dequantize_4bit(q, st)
            _, single = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
            out[name + ".absmax_single"] = single.absmax
        elif key.startswith("u."):
            # Widths that are not a multiple of the block (64): the generic (pure torch)
            # dequantization, what bitsandbytes' quantizer's flat blocks mean, and the native
            # CPU kernel F.dequantize_4bit runs for an even last dimension.
            from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
            from bitsandbytes.backends.utils import _get_4bit_code
            name = key[2:]
            q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            absmax = F.dequantize_blockwise(st.absmax, st.state2) + st.offset
            code = _get_4bit_code("nf4", q.device)
            for dt, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
                out[name + ".generic" + suffix] = _dequantize_4bit_compute(
                    q.reshape(-1), absmax, code, 64, tuple(w.shape), dt).reshape(-1)
            st.dtype = torch.float32
            out[name + ".cpu_kernel"] = F.dequantize_4bit(q, st).reshape(-1)
            out[name + ".packed"] = q.reshape(-1)
        elif key.startswith("x8."):
            name = key[3:]
            q, st = F.quantize_blockwise(w, blocksize=256)
            out[name + ".q8"] = q
            out[name + ".q8_absmax"] = st.absmax
    if "lin.w" in inp:
        w = inp["lin.w"]
        layer = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
        layer = layer.to("cpu")
        layer.train()
        x = inp["lin.x"].clone().requires_grad_(True)
        y = layer(x)
        (y * inp["lin.g"]).sum().backward()
        out["lin.y"] = y.detach()
        out["lin.gx"] = x.grad
    if "opt.p" in inp:
        lr, b1, b2, eps, wd = inp["opt.hparams"].tolist()
        p = torch.nn.Parameter(inp["opt.p"].clone())
        opt = bnb.optim.AdamW8bit([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        k = 0
        while f"opt.g{k}" in inp:
            p.grad = inp[f"opt.g{k}"].clone()
            opt.step()
            out[f"opt.p{k}"] = p.detach().clone()
            k += 1
        st = opt.state[p]
        out["opt.state1"] = st["state1"]
        out["opt.state2"] = st["state2"]
        if "absmax1" in st:
            out["opt.absmax1"] = st["absmax1"]
            out["opt.absmax2"] = st["absmax2"]
    save_file({k: v.contiguous() for k, v in out.items()}, a.out)


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer(a):
    import os

    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    with open(a.train, encoding="utf-8") as f:
        train = f.read().splitlines()
    if a.style == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train, trainer)
    if a.style == "llama3":
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          special_tokens=[("<|begin_of_text|>", 0)])])
    os.makedirs(a.dir, exist_ok=True)
    tok.save(os.path.join(a.dir, "tokenizer.json"))
    with open(os.path.join(a.dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": False,
                   "add_eos_token": False}, f)
    with open(a.encode, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()[:a.lines]
    # Special tokens inside text are cut out as single ids.
    lines.append("before<|end_of_text|>after <|begin_of_text|> x")
    lines.append("\n".join(lines[:200]))
    ids, offsets = [], [0]
    for line in lines:
        ids.extend(tok.encode(line).ids)
        offsets.append(len(ids))
    save_file({"ids": torch.tensor(ids, dtype=torch.int64),
               "offsets": torch.tensor(offsets, dtype=torch.int64)},
              os.path.join(a.dir, "ids.safetensors"))
    with open(os.path.join(a.dir, "lines.json"), "w", encoding="utf-8") as f:
        json.dump(lines, f, ensure_ascii=False)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-llama")
    m.add_argument("dir")
    for name, default in [("vocab", 96), ("hidden", 64), ("inter", 96), ("layers", 2), ("heads", 4),
                          ("kv-heads", 2), ("seed", 0)]:
        m.add_argument("--" + name, type=int, default=default)
    m.add_argument("--tied", action="store_true")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--rope-llama3", action="store_true")
    m.add_argument("--max-shard-size", default="")
    m.set_defaults(fn=make_llama)
    lg = sub.add_parser("llama-logits")
    lg.add_argument("dir")
    lg.add_argument("inp")
    lg.add_argument("out")
    lg.set_defaults(fn=llama_logits)
    pm = sub.add_parser("peft-make")
    pm.add_argument("base")
    pm.add_argument("adapter")
    pm.add_argument("--r", type=int, default=4)
    pm.add_argument("--alpha", type=float, default=8)
    pm.add_argument("--targets", default="q_proj,v_proj")
    pm.add_argument("--seed", type=int, default=0)
    pm.set_defaults(fn=peft_make)
    pl = sub.add_parser("peft-logits")
    pl.add_argument("base")
    pl.add_argument("adapter")
    pl.add_argument("inp")
    pl.add_argument("out")
    pl.add_argument("--4bit", dest="four_bit", action="store_true")
    pl.add_argument("--merge", action="store_true")
    pl.set_defaults(fn=peft_logits)
    bn = sub.add_parser("bnb")
    bn.add_argument("inp")
    bn.add_argument("out")
    bn.set_defaults(fn=bnb_reference)
    tk = sub.add_parser("tokenizer")
    tk.add_argument("dir")
    tk.add_argument("--style", choices=["gpt2", "llama3"], required=True)
    tk.add_argument("--vocab", type=int, default=2000)
    tk.add_argument("--train", required=True)
    tk.add_argument("--encode", required=True)
    tk.add_argument("--lines", type=int, default=1000000)
    tk.set_defaults(fn=tokenizer)
    argv = sys.argv[1:]
    commands = [[]]
    for arg in argv:
        if arg == ";":
            commands.append([])
        else:
            commands[-1].append(arg)
    for command in commands:
        if command:
            a = p.parse_args(command)
            a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
