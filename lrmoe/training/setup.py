"""What a run of ``lrmoe train`` is built from, before the loop: the device and its
precision, the data (loaded, reported, checked against a checkpoint's) and the model
(from a checkpoint, ``model.init_from`` or a random Qwen3-MoE of the ``model`` section).
:class:`lrmoe.training.trainer.Trainer` calls these in this order.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

from lrmoe.data import LMData, load_data
from lrmoe.training import checkpoint as ckpt_io
from lrmoe.training.config import TrainConfig
from lrmoe.training.distributed import log


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when torch sees it, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: a CUDA device asked for where torch sees none, or an index past the
            devices it sees (naming ``run.device`` and the fix).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"run.device={name!r} but torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda}); use "
                         "--device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"run.device={name!r} but torch sees {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return dev


def cache_dir(cfg: TrainConfig) -> str:
    """``data.cache_dir``, else ``$LRMOE_CACHE_DIR``, else ``~/.cache/lrmoe``."""
    return cfg.data.cache_dir or os.environ.get("LRMOE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "lrmoe")


def configure_device(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """Threads, the bound CUDA device, TF32 and the peak-memory counter; quiet
    transformers logging. Returns the autocast dtype: bfloat16 (``run.dtype`` bfloat16, or
    auto on CUDA) or None (float32)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    return (None if cfg.run.dtype == "float32" or (
        cfg.run.dtype == "auto" and device.type != "cuda") else torch.bfloat16)


def load_run_data(cfg: TrainConfig, tokenizer: Optional[str]) -> LMData:
    """The ``data`` section's source, read, split, tokenized and packed
    (:func:`lrmoe.data.load_data`, cached). The trainer runs it on rank 0 first (which
    fills the cache), then on the others, and then :func:`report_run_data` on every rank.

    Raises:
        ValueError, FileNotFoundError: what :func:`lrmoe.data.load_data` raises (a bad
            argument, a missing source).
    """
    d = cfg.data
    return load_data(d.source, seq_len=d.seq_len, cache_dir=cache_dir(cfg), tokenizer=tokenizer,
                     vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                     max_records=d.max_records,
                     seed=cfg.run.seed if d.split_seed is None else d.split_seed)


def report_run_data(cfg: TrainConfig, data: LMData, seconds: float) -> None:
    """Log the data report and check the splits against the run, on every rank (each
    raises the same error alike, so no rank reports another's failure).

    Raises:
        ValueError: fewer training sequences than ``data.batch_size``, or an empty
            validation split.
    """
    d = cfg.data
    for line in data.report.lines():
        log(line)
    log(f"data ready in {seconds:.1f} s: {len(data.train)} training "
        f"and {len(data.val)} validation sequences of {d.seq_len} tokens, vocab "
        f"{data.vocab_size}")
    if len(data.train) < d.batch_size:
        raise ValueError(f"the training split has {len(data.train)} sequences, fewer "
                         f"than data.batch_size={d.batch_size}; lower it or add data")
    if len(data.val) == 0:
        raise ValueError("the validation split is empty; raise data.val_fraction or add "
                         "data")


def data_fingerprint(data: LMData) -> Dict[str, Any]:
    """What a checkpoint records of its data: split sizes, the tokenizer file's SHA-256
    and the sums of the token ids of each split (a changed file changes one of them)."""
    return {"train_sequences": len(data.train), "val_sequences": len(data.val),
            "tokenizer_sha256": ckpt_io.file_sha256(data.tokenizer_path),
            "train_ids_sum": int(data.train.input_ids.sum()),
            "val_ids_sum": int(data.val.input_ids.sum())}


def check_same_data(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """A resume reads the data its checkpoint trained on.

    Raises:
        ValueError: every field of :func:`data_fingerprint` that differs, both values named.
    """
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in now.items()
             if saved.get(k) != v]
    if diffs:
        raise ValueError("cannot resume: the data differ from the checkpoint's (the "
                         "data files or the tokenizer changed):\n  " + "\n  ".join(diffs))


def build_model(cfg: TrainConfig, data: LMData, source: Optional[Path], *,
                load_weights: bool = True) -> nn.Module:
    """The float32 transformers model: from ``source`` (``model.init_from`` or the
    checkpoint a run resumes: a transformers checkpoint, or an lrmoe checkpoint whose
    weights are in its DCP ``state/`` folder), else a ``Qwen3MoeForCausalLM`` of the
    ``model`` section at ``run.seed`` with the data's vocabulary and special tokens. Not
    yet patched by LRMoE.

    Args:
        load_weights: False builds ``source``'s architecture at ``run.seed`` without its
            weights (a resume loads them after the experts are sharded).

    Raises:
        ValueError: the tokenizer has more tokens than ``source``'s embeddings.
    """
    from transformers import (AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    m = cfg.model
    if source is not None and (ckpt_io.is_sharded_checkpoint(source) or not load_weights):
        torch.manual_seed(cfg.run.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                                 dtype=torch.float32)
        if load_weights:  # every tensor whole, read by this process alone
            from lrmoe.parallel.state import load_whole

            with torch.no_grad():
                load_whole(str(Path(source) / ckpt_io.STATE_DIR), model.state_dict())
    elif source is not None:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if source is not None:
        if data.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {data.vocab_size} tokens but the model "
                             f"{source} only {model.config.vocab_size} embeddings; use the "
                             "model's tokenizer (--tokenizer DIR/tokenizer.json)")
        log(f"model: {type(model).__name__} from {source}")
    else:
        torch.manual_seed(cfg.run.seed)
        hf = Qwen3MoeConfig(
            vocab_size=data.vocab_size, hidden_size=m.hidden_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
            router_aux_loss_coef=m.router_aux_loss_coef,
            max_position_embeddings=m.max_position_embeddings,
            pad_token_id=data.pad_id, eos_token_id=data.eos_id,
            bos_token_id=None, tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(hf)
        log("model: Qwen3MoeForCausalLM, random init")
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    return model


#: the dense children of a transformers decoder layer that :func:`compile_dense` compiles
DENSE_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm")


def compile_dense(model: nn.Module) -> int:
    """``torch.compile`` (in place, ``nn.Module.compile``) the dense modules of every decoder
    layer of a transformers causal LM -- :data:`DENSE_CHILDREN` -- and its final norm.

    Why these and not the whole layer: the MoE block is lrmoe's own kernels and autograd
    (nothing for inductor to fuse, and data-dependent shapes), while around the attention
    transformers runs a chain of small memory-bound ops -- RMSNorm's fp32 casts, q/k norms,
    RoPE on transposed views, the casts autocast inserts -- that a profile of the
    ``qwen3-slice`` step shows as a large share of its copies (docs/results.md).
    Parameter names, the state dict and checkpoints are unchanged (the modules keep their
    parameters; only their call goes through the compiled graph).

    Args:
        model: a transformers ``*ForCausalLM`` whose decoder layers are
            ``model.model.layers`` (Qwen3-MoE, Mixtral, GLM-4 MoE, ...).

    Returns:
        The number of modules compiled.

    Raises:
        ValueError: the model has no ``model.layers`` or a layer none of
            :data:`DENSE_CHILDREN` (naming ``run.compile``).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"run.compile: {type(model).__name__} has no model.layers to "
                         "compile; set run.compile=false")
    n = 0
    for index, layer in enumerate(layers):
        found = [getattr(layer, name) for name in DENSE_CHILDREN if hasattr(layer, name)]
        if not found:
            raise ValueError(f"run.compile: decoder layer {index} has none of "
                             f"{', '.join(DENSE_CHILDREN)}; set run.compile=false")
        for module in found:
            module.compile()
            n += 1
    norm = getattr(model.model, "norm", None)
    if isinstance(norm, nn.Module):
        norm.compile()
        n += 1
    return n
