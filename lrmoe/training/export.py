"""``lrmoe export RUN_DIR OUT``: a run's checkpoint as a plain transformers checkpoint.

OUT gets ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` above ``max_shard_size``), ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``: what
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
read, with no lrmoe installed (the patched model keeps the block's own parameter names, so
its state-dict keys are the transformers ones).

A checkpoint's weights are in its DCP ``state/`` folder (:mod:`lrmoe.training.checkpoint`),
sharded by whatever EP / DP size wrote them; export reads every tensor whole from it in
one process (``torch.distributed.checkpoint`` without a process group: the expert rows
of all ep ranks joined in order), so it needs no torchrun and no knowledge of the ranks.
A single-process checkpoint of an earlier version (``model.safetensors``) is re-written
by transformers itself.

The weights are written by transformers' own ``save_pretrained`` (sharding, index, the
reverse of its in-memory expert fusion), from a model skeleton on the meta device, so the
export allocates nothing beyond the gathered tensors.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor

from lrmoe.data.tokenizer import TOKENIZER_CONFIG_FILE, write_tokenizer_config
from lrmoe.training import checkpoint as ckpt_io

#: where the trainer exports a finished run (``run.export``), under ``run.out_dir``
EXPORT_DIR = "export"
#: the Hugging Face Hub's usual shard size
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE = re.compile(r"^\s*\d+\s*(KB|MB|GB|TB)?\s*$", re.IGNORECASE)


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """The checkpoint ``source`` names: itself when it holds ``trainer_state.pt``, else
    the newest checkpoint of the run directory ``source``.

    Raises:
        FileNotFoundError: ``source`` does not exist, or holds no checkpoint (naming
            RUN_DIR, what was expected and the fix).
        ValueError: ``source`` is a checkpoint of an lrmoe version before format 2 with
            per-rank shards.
    """
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"RUN_DIR {path} does not exist; give the run directory of lrmoe train (its "
            f"--out) or one of its checkpoints/{ckpt_io.CHECKPOINT_PREFIX}XXXXXXXX folders")
    if (path / ckpt_io.STATE_FILE).is_file():
        ckpt = path
    else:
        ckpts = ckpt_io.list_checkpoints(path)
        if not ckpts:
            raise FileNotFoundError(
                f"RUN_DIR {path} holds no checkpoint (expected {path}/checkpoints/"
                f"{ckpt_io.CHECKPOINT_PREFIX}XXXXXXXX/{ckpt_io.STATE_FILE}); give the run "
                "directory of a run that saved one (lrmoe train --out) or a checkpoint folder")
        ckpt = ckpts[-1]
    if not ckpt_io.is_sharded_checkpoint(ckpt) and not (ckpt / "model.safetensors").is_file():
        raise ValueError(
            f"RUN_DIR {ckpt} holds neither a {ckpt_io.STATE_DIR}/ folder nor model.safetensors "
            "(per-rank shards of an lrmoe version before checkpoint format 2); export it "
            "with the lrmoe version that wrote it")
    return ckpt


def full_state(ckpt: Path, shapes: Dict[str, torch.Size]) -> Dict[str, Tensor]:
    """Every model tensor of the format-2 checkpoint ``ckpt``, whole, on the CPU.

    Args:
        ckpt: the checkpoint folder. shapes: the model's tensor shapes by name (a
            meta-device skeleton's ``state_dict``).

    Raises:
        FileNotFoundError: a chunk file of the state missing (naming it).
        ValueError: the stored tensors do not fit the model of ``config.json`` (naming
            them).
    """
    from lrmoe.parallel.state import MODEL_PREFIX, load_whole, read_metadata

    meta = read_metadata(str(ckpt / ckpt_io.STATE_DIR))
    stored = {k[len(MODEL_PREFIX):]: m for k, m in meta.items() if k.startswith(MODEL_PREFIX)}
    missing = sorted(set(shapes) - set(stored))
    unexpected = sorted(set(stored) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{ckpt}: its tensors do not match config.json's model (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}); the checkpoint folder "
                         "was changed or mixed with another run's")
    state = {k: torch.empty(tuple(shapes[k]), dtype=stored[k].properties.dtype)
             for k in shapes}
    load_whole(str(ckpt / ckpt_io.STATE_DIR), state)
    return state


def _check_out(out: Path, read: List[Path], overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, non-empty without ``overwrite``, or holds one of
    the checkpoint folders ``read`` (``--overwrite`` would delete what is exported)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT {out} is a file; give a folder to write the model into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"OUT {out} exists and is not empty; pass --overwrite to "
                              "replace it, or choose another OUT")
    o = out.resolve()
    for c in read:
        if o == c.resolve() or o in c.resolve().parents:
            raise ValueError(f"OUT {out} holds the checkpoint {c} that is exported; choose "
                             "a folder outside the run's checkpoints (e.g. RUN_DIR/export)")


def _check_size(max_shard_size: str | int) -> None:
    ok = (isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool)
          and max_shard_size > 0) or (isinstance(max_shard_size, str)
                                      and _SIZE.match(max_shard_size) is not None)
    if not ok:
        raise ValueError(f"--max-shard-size must be a byte count or a size such as 500MB or "
                         f"5GB (units KB, MB, GB, TB), got {max_shard_size!r}")


def export_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *,
                      overwrite: bool = False,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a plain transformers checkpoint of the run or checkpoint ``source`` into
    ``out`` (see the module docstring for the files and the expert-parallel gathering).

    The folder is written beside ``out`` and renamed into place, so an interrupted export
    leaves ``out`` as it was. Weights keep their stored dtype (float32 for lrmoe runs).

    Args:
        source: a run directory (``lrmoe train --out``; its newest checkpoint is taken) or
            a checkpoint folder ``checkpoints/step-XXXXXXXX``.
        out: the folder to write; created (with its parents) when missing.
        overwrite: replace a non-empty ``out``.
        max_shard_size: largest safetensors file before the weights are split in shards
            with an index (``save_pretrained``'s argument: bytes or e.g. ``"5GB"``).

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: no run or checkpoint at ``source``.
        FileExistsError: ``out`` is a file, or a non-empty folder without ``overwrite``.
        ValueError: a checkpoint of an earlier format, tensors that do not fit
            ``config.json``, ``out`` inside the checkpoint, a bad ``max_shard_size``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    _check_size(max_shard_size)
    ckpt = resolve_checkpoint(source)
    out = Path(out)
    tokenizer = ckpt / "tokenizer.json"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"RUN_DIR {ckpt} has no tokenizer.json; copy the run's "
                                "tokenizer.json into it (data.tokenizer or the cached one)")
    sharded = ckpt_io.is_sharded_checkpoint(ckpt)
    _check_out(out, [ckpt], overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" would go to every log
    try:
        if sharded:
            config = AutoConfig.from_pretrained(ckpt)
            with torch.device("meta"):  # names and shapes only: nothing allocated
                skeleton = AutoModelForCausalLM.from_config(config)
            if (ckpt / "generation_config.json").is_file():
                skeleton.generation_config = GenerationConfig.from_pretrained(ckpt)
            state = full_state(ckpt, {k: v.shape for k, v in skeleton.state_dict().items()})
            skeleton.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        else:  # a transformers checkpoint already: transformers reads and rewrites it
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto")
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        write_tokenizer_config(tmp / "tokenizer.json", tmp)
        if out.exists():
            trash = out.parent / f".old-{out.name}-{os.getpid()}"
            os.replace(out, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            hf_logging.enable_progress_bar()
    return out


def describe(out: Path) -> str:
    """One line naming the files of an export folder ``out`` (for the command's report)."""
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    rest = [n for n in names if not n.endswith(".safetensors")]
    weights = shards[0] if len(shards) == 1 else f"{len(shards)} safetensors shards"
    return f"{weights} + {', '.join(rest)}"


__all__ = ["EXPORT_DIR", "DEFAULT_MAX_SHARD_SIZE", "export_checkpoint", "resolve_checkpoint",
           "full_state", "describe", "TOKENIZER_CONFIG_FILE"]
