#!/usr/bin/env python3
"""Bytes moved by copy-like ops in one training step of the qwen3-slice model, by source.

Issue 28 asks where the "copies and casts" of the step profile (docs/results.md, "The whole
step at the Qwen3-30B-A3B layer shape") come from and whether the bf16 weight casts happen
once per step. This counts, under a ``TorchDispatchMode``, every copy-like aten op
(``_to_copy``, ``copy_``, ``clone``, ``cat``, ``index_select``, ``gather``, ...) of one
forward + backward of a transformers ``Qwen3MoeForCausalLM`` patched by lrmoe
(``patch_moe_blocks``) under bf16 autocast on the **CPU**: output bytes, plus the input
bytes of pure copies (read + write), attributed to the innermost module in the forward
(the backward is one bucket). The layer dims are the preset's (H 2048, 32 / 4 heads of 128,
E 128, K 8, I 768, vocab 16,384); tokens and layers are arguments, because the bytes are
affine in both: run two token counts and two layer counts and solve for the per-layer
constant (weights) and the per-token slope (activations).

A copy whose input is not contiguous is marked ``(strided)`` (those are the GPU's
non-vectorised copy kernels). The CPU's autocast and attention paths are not the GPU's (no flex/sdpa mask kernels, CPU
kernels for lrmoe's own ops), so this accounts for the copies that transformers, autocast
and the parameter dtypes cause, not for a CUDA kernel's internals.

Usage: python tools/step_copy_bytes.py --tokens 512 --batch 4 --layers 2 [--top 20]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: aten ops that copy or materialise memory
COPY_OPS = ("_to_copy", "copy_", "clone", "cat", "index_select", "gather", "scatter",
            "index_put", "index_add", "repeat", "stack", "_unsafe_view", "expand_copy",
            "index.Tensor", "masked_fill", "where", "fill_", "zero_", "zeros", "new_zeros",
            "constant_pad")
#: ops whose inputs are read whole (their input bytes count too)
READ_OPS = ("_to_copy", "copy_", "clone", "cat", "index_select", "gather")


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def count(tokens: int, batch: int, layers: int) -> dict:
    """{(phase, op, module): [bytes, calls]} of one fwd + bwd at ``batch`` x ``tokens``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lrmoe.integrations.transformers import patch_moe_blocks

    torch.manual_seed(0)
    hf = Qwen3MoeConfig(vocab_size=16384, hidden_size=2048, num_hidden_layers=layers,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                        num_experts_per_tok=8, max_position_embeddings=4096,
                        tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(hf)
    patch_moe_blocks(model, recalibration_rate=0.0)
    stack, phase = ["(model)"], ["fwd"]

    def enter(module, args, name):
        stack.append(name or "(model)")

    def leave(module, args, output):
        stack.pop()  # returns None: a hook that returned a value would replace the output

    for name, m in model.named_modules():
        m.register_forward_pre_hook(lambda mod, a, n=name: enter(mod, a, n))
        m.register_forward_hook(leave)
    acc: dict = collections.defaultdict(lambda: [0, 0])

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(k in str(func) for k in COPY_OPS):
                op = func.overloadpacket.__name__
                # a copy that reads a non-contiguous tensor (a transpose, a slice) is what
                # the GPU runs as a non-vectorised elementwise kernel
                if op in READ_OPS and any(isinstance(t, torch.Tensor) and not t.is_contiguous()
                                          for t in tree_leaves(args)):
                    op += " (strided)"
                key = (phase[0], op, stack[-1] if phase[0] == "fwd" else "(backward)")
                acc[key][0] += _nbytes(out) + (_nbytes(args) if op in READ_OPS else 0)
                acc[key][1] += 1
            return out

    ids = torch.randint(0, 16384, (batch, tokens))
    pos = torch.arange(tokens).remainder(256).expand(batch, -1)  # packed examples of 256
    with Count():
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(input_ids=ids, position_ids=pos).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, 16384), ids[:, 1:].reshape(-1))
        phase[0] = "bwd"
        loss.backward()
    return dict(acc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--layers", type=int, default=1, help="decoder layers")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    a = p.parse_args()
    for name in ("tokens", "batch", "layers"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    acc = count(a.tokens, a.batch, a.layers)
    total = sum(v[0] for v in acc.values())
    print(f"tokens {a.batch * a.tokens}, layers {a.layers}: copy-like bytes {total / 1e9:.3f} GB")
    for (ph, op, mod), (b, n) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{b / 1e9:9.4f} GB {n:4d}x  {ph} {op} {mod}")


if __name__ == "__main__":
    main()
