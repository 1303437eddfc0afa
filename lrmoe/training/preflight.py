"""The checks of a run's start that read only (step 1 of :mod:`lrmoe.training.trainer`):
input paths, the run directory of a fresh run, the checkpoint of a resumed one. Nothing
here writes, so a start refused by them leaves the run directory as it was.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from lrmoe.utils.paths import check_output
from lrmoe.training import checkpoint as ckpt_io
from lrmoe.training.compose import check_resume_compatible
from lrmoe.training.config import TrainConfig, check_ep_divides
from lrmoe.training.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics
from lrmoe.utils.extras import require


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that trained at least one step (a checkpoint, a
    summary, or a train line in ``metrics.jsonl``); a folder left by a start that failed
    before its first step may be reused."""
    if ckpt_io.list_checkpoints(run_dir) or (run_dir / SUMMARY_FILE).exists():
        return True
    return any(r.get("kind") == "train" for r in read_metrics(run_dir / METRICS_FILE))


def check_inputs(cfg: TrainConfig) -> Optional[str]:
    """Check the input paths and E % EP before any process group, data or model.

    Returns:
        the tokenizer file to use: ``data.tokenizer``, else ``model.init_from``'s
        ``tokenizer.json``, else None (a BPE is trained on the data).

    Raises:
        FileNotFoundError: ``model.init_from`` without ``config.json``, or without a
            tokenizer while ``data.tokenizer`` is unset (the token ids would not match its
            embeddings); a ``data.tokenizer`` that is not a file.
        ValueError: the checkpoint's expert count not divisible by ``parallel.ep_size``;
            a ``run.record_trace`` path that cannot be written.
        ModuleNotFoundError: ``run.tensorboard`` without the tensorboard package (naming
            ``pip install 'lrmoe[train]'``).
    """
    m, d = cfg.model, cfg.data
    if cfg.run.tensorboard:
        require("train", "run.tensorboard (--tensorboard)", ["tensorboard"])
    tokenizer = d.tokenizer
    if m.init_from is not None:
        src = Path(m.init_from)
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"model.init_from {src}: no config.json; expected a "
                                    "transformers checkpoint directory (save_pretrained)")
        hf = json.loads((src / "config.json").read_text())
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if isinstance(experts, int):
            check_ep_divides(experts, cfg.parallel.ep_size, f"num_experts of {src}/config.json")
        if tokenizer is None and (src / "tokenizer.json").is_file():
            tokenizer = str(src / "tokenizer.json")
        if tokenizer is None:
            # a BPE trained now would number its tokens unlike the embeddings of src
            raise FileNotFoundError(
                f"model.init_from {src} has no tokenizer.json and data.tokenizer is "
                "unset: a tokenizer trained on the new data would give token ids that do "
                "not match the model's embeddings; pass the tokenizer the model was "
                "trained with (--tokenizer PATH/tokenizer.json)")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise FileNotFoundError(f"data.tokenizer {tokenizer}: no such file (a tokenizers "
                                "tokenizer.json)")
    if cfg.run.record_trace:  # saved after the last step: checked before the first
        check_output("--record-trace", cfg.run.record_trace, is_dir=False)
    return tokenizer


def read_resume(ckpt: Path, cfg: TrainConfig) -> Tuple[Dict[str, Any], int]:
    """Read the state of the checkpoint a run resumes from and check that ``cfg`` may
    continue it (every rank reads the same checkpoint).

    Args:
        ckpt: the checkpoint directory (``checkpoints/step-XXXXXXXX``). cfg: the resumed
            run's config.

    Returns:
        (the saved training state as ``torch.load`` gives it, the run's lr decay step).

    Raises:
        FileNotFoundError: ``ckpt`` is not a checkpoint.
        ValueError: a checkpoint of an earlier version, or a setting that differs from the
            checkpoint's in a way that breaks the continuation
            (:func:`lrmoe.training.compose.check_resume_compatible` names it).
    """
    if not (ckpt / ckpt_io.STATE_FILE).is_file():
        raise FileNotFoundError(f"{ckpt} is not a checkpoint (no {ckpt_io.STATE_FILE}); "
                                "pass a checkpoint directory (checkpoints/step-XXXXXXXX) "
                                "or a run directory")
    ckpt_io.check_resumable(ckpt)
    saved = ckpt_io.read_checkpoint_config(ckpt)
    state = torch.load(ckpt / ckpt_io.STATE_FILE, map_location="cpu", weights_only=True)
    decay_steps = int(state["lr_decay_steps"])
    check_resume_compatible(saved, cfg, decay_steps)
    return state, decay_steps


def check_fresh(cfg: TrainConfig, out_dir: Path, overwrite: bool) -> int:
    """Check that a fresh run may write its run directory (every rank, before any write).

    Args:
        cfg: the run's config. out_dir: this rank's run directory (under ``run.out_dir``).
        overwrite: the run may replace an earlier run's files.

    Returns:
        the lr decay step (``optim.lr_decay_steps``, else ``run.steps``).

    Raises:
        FileExistsError: ``run.out_dir`` (or ``out_dir``) holds a run and ``overwrite``
            is false; the message names the last checkpoint and the flags that proceed.
        ValueError: ``run.out_dir`` cannot be a writable directory.
    """
    root = check_output("--out", cfg.run.out_dir, is_dir=True)
    if not overwrite and (holds_run(out_dir) or holds_run(root)):
        ckpts = ckpt_io.list_checkpoints(root)
        last = f" (last checkpoint: {ckpts[-1].name})" if ckpts else ""
        raise FileExistsError(f"{root} already holds a run{last}; continue it with "
                              "--resume, start over with --overwrite, or choose another "
                              "--out")
    return cfg.optim.lr_decay_steps or cfg.run.steps
