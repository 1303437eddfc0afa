"""``lrmoe export RUN_DIR OUT``: a run's checkpoint as a plain transformers checkpoint.

OUT gets ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` above ``max_shard_size``), ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``: what
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
read, with no lrmoe installed (the patched model keeps the block's own parameter names, so
its state-dict keys are the transformers ones).

Expert-parallel checkpoints (``parallel.ep_size`` N > 1) hold one file per ep rank
(:mod:`lrmoe.training.checkpoint`): ``RUN_DIR/checkpoints/step-X/model-ep-rank-0.safetensors``
and ``RUN_DIR/ep-rank-e/checkpoints/step-X/model-ep-rank-e.safetensors``, each with the
dense weights and its E / N experts ``[e*E/N, (e+1)*E/N)``. Export concatenates every
expert tensor over the ranks in rank order into the full (E, ...) tensor and takes the
dense weights from ep rank 0 (after checking the other ranks hold the same). Under DP x EP
only dp rank 0 of each ep shard writes checkpoints, in the same layout, so the same
gathering applies.

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
#: dense copies of the ep ranks differ by rounding at most (they take the same all-reduced
#: gradients and AdamW steps; one training step with another state moves them by ~lr)
_DENSE_RTOL, _DENSE_ATOL = 1e-4, 1e-6


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """The checkpoint ``source`` names: itself when it holds ``trainer_state.pt``, else
    the newest checkpoint of the run directory ``source``.

    Raises:
        FileNotFoundError: ``source`` does not exist, or holds no checkpoint (naming
            RUN_DIR, what was expected and the fix).
        ValueError: ``source`` is the checkpoint of an ep rank > 0 (naming ep rank 0's).
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
    others = sorted(p.name for p in ckpt.glob("model-ep-rank-*.safetensors")
                    if p.name != "model-ep-rank-0.safetensors")
    if others and not (ckpt / "model-ep-rank-0.safetensors").is_file():
        rank = others[0][len("model-ep-rank-"):-len(".safetensors")]
        run = ckpt.parent.parent.parent
        raise ValueError(
            f"RUN_DIR {ckpt} is ep rank {rank}'s checkpoint; give ep rank 0's, the run "
            f"directory {run} or {run / 'checkpoints' / ckpt.name}")
    return ckpt


def _state_fields(ckpt: Path) -> Dict[str, Optional[int]]:
    """``step``, ``ep_size``, ``ep_rank`` (None in checkpoints of earlier versions) of a
    checkpoint's ``trainer_state.pt``, memory-mapped (the optimizer state is not read)."""
    state = torch.load(ckpt / ckpt_io.STATE_FILE, map_location="cpu", weights_only=True,
                       mmap=True)
    ep_size = state.get("ep_size")
    if ep_size is None:  # checkpoints of earlier versions: the run's settings
        ep_size = ckpt_io.read_checkpoint_config(ckpt).parallel.ep_size
    return {"step": int(state["step"]), "ep_size": int(ep_size),
            "ep_rank": int(state["ep_rank"]) if "ep_rank" in state else None}


def shard_files(ckpt: Path, ep_size: int, step: int) -> List[Path]:
    """The ``model-ep-rank-e.safetensors`` of every ep rank e < ``ep_size`` for ep rank
    0's checkpoint ``ckpt`` (``RUN_DIR/checkpoints/step-X``), in rank order.

    Raises:
        FileNotFoundError: a rank's shard is missing (naming the file, the steps that
            rank has, and the fix).
        ValueError: a rank's checkpoint is of another step or EP size than ``ckpt``'s.
    """
    run = ckpt.parent.parent
    files = []
    for e in range(ep_size):
        d = ckpt_io.shard_checkpoint(ckpt, e)
        f = d / f"model-ep-rank-{e}.safetensors"
        if not f.is_file() or not (d / ckpt_io.STATE_FILE).is_file():
            has = [p.name for p in ckpt_io.list_checkpoints(ckpt_io.rank_dir(run, e))
                   if (p / f.name).is_file()]
            if has:
                common = [p.name for p in ckpt_io.list_checkpoints(run) if p.name in has]
                fix = (f"export a step every rank has: lrmoe export "
                       f"{run / 'checkpoints' / common[-1]} OUT" if common else
                       "no step is saved by every rank; resume the run with the same --ep "
                       "to save one")
                hint = (f"ep rank {e} has {', '.join(has)} but not {ckpt.name} (the ranks' "
                        f"checkpoints differ); {fix}")
            else:
                hint = (f"copy the run's {ckpt_io.rank_dir(run, e).name}/ folder from the "
                        f"machine that ran ep rank {e} into {run} (each rank writes its "
                        "expert shard on its own node)")
            raise FileNotFoundError(f"RUN_DIR {run}: ep rank {e}'s expert shard {f} is "
                                    f"missing; {hint}")
        fields = _state_fields(d)
        if fields["ep_rank"] is None:
            fields["ep_rank"] = e
        if (fields["step"], fields["ep_size"], fields["ep_rank"]) != (step, ep_size, e):
            raise ValueError(
                f"RUN_DIR {run}: {d} is step {fields['step']} of ep rank {fields['ep_rank']} "
                f"of {fields['ep_size']}, but ep rank 0's {ckpt} is step {step} of "
                f"{ep_size}; the ranks' checkpoints differ: export a step that every rank "
                "saved in the same run")
        files.append(f)
    return files


def gather_expert_shards(files: List[Path], full: Dict[str, torch.Size]) -> Dict[str, Tensor]:
    """The whole model's state dict from the ep ranks' shard files.

    Args:
        files: ``model-ep-rank-e.safetensors`` of ranks 0..N-1, in rank order.
        full: the whole model's tensor shapes by name (a meta-device skeleton's
            ``state_dict``). A tensor whose shard has ``full[k][0] / N`` rows is an expert
            tensor ((E / N, ...) per rank, concatenated on dim 0 into (E, ...)); one of the
            full shape is dense (ep rank 0's copy is taken). Dtypes as stored.

    Raises:
        ValueError: the shards' names or shapes do not fit the model of ``config.json``,
            or a dense tensor differs between ranks (shards of different training states).
    """
    from safetensors import safe_open

    n = len(files)
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [set(h.keys()) for h in handles]
    want = set(full)
    for f, got in zip(files, names):
        if got != want:
            raise ValueError(
                f"{f}: its tensors do not match config.json's model (missing "
                f"{sorted(want - got)[:3]}, unexpected {sorted(got - want)[:3]}); the "
                "checkpoint folder was changed or mixed with another run's")
    out: Dict[str, Tensor] = {}
    for k in sorted(want):
        shapes = [tuple(h.get_slice(k).get_shape()) for h in handles]
        target = tuple(full[k])
        if all(s == target for s in shapes):
            first = handles[0].get_tensor(k)
            for e in range(1, n):
                other = handles[e].get_tensor(k)
                if not torch.allclose(first, other, rtol=_DENSE_RTOL, atol=_DENSE_ATOL):
                    diff = (first.float() - other.float()).abs().max().item()
                    raise ValueError(
                        f"{files[e]}: dense weight {k} differs from ep rank 0's by up to "
                        f"{diff:.3g}; the shards are not of one training state (a rank's "
                        "folder from another run?); export a checkpoint the run wrote whole")
            out[k] = first
        elif (target and n * shapes[0][0] == target[0]
              and all(s == shapes[0] and s[1:] == target[1:] for s in shapes)):
            out[k] = torch.cat([h.get_tensor(k) for h in handles])
        else:
            raise ValueError(f"{files[0]}: tensor {k} has shard shapes {shapes}, which do not "
                             f"make config.json's {target} over {n} ep ranks")
    return out


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
            a checkpoint folder ``checkpoints/step-XXXXXXXX`` of ep rank 0.
        out: the folder to write; created (with its parents) when missing.
        overwrite: replace a non-empty ``out``.
        max_shard_size: largest safetensors file before the weights are split in shards
            with an index (``save_pretrained``'s argument: bytes or e.g. ``"5GB"``).

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: no run or checkpoint at ``source``, or an ep rank's shard is
            missing (naming the file and the fix).
        FileExistsError: ``out`` is a file, or a non-empty folder without ``overwrite``.
        ValueError: ep ranks' checkpoints of different steps or states, shards that do not
            fit ``config.json``, ``out`` inside the checkpoint, a bad ``max_shard_size``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    _check_size(max_shard_size)
    ckpt = resolve_checkpoint(source)
    out = Path(out)
    fields = _state_fields(ckpt)
    tokenizer = ckpt / "tokenizer.json"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"RUN_DIR {ckpt} has no tokenizer.json; copy the run's "
                                "tokenizer.json into it (data.tokenizer or the cached one)")
    files = (shard_files(ckpt, fields["ep_size"], fields["step"])
             if fields["ep_size"] > 1 else [])
    _check_out(out, [ckpt] + [f.parent for f in files], overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" would go to every log
    try:
        if files:
            config = AutoConfig.from_pretrained(ckpt)
            with torch.device("meta"):  # names and shapes only: nothing allocated
                skeleton = AutoModelForCausalLM.from_config(config)
            if (ckpt / "generation_config.json").is_file():
                skeleton.generation_config = GenerationConfig.from_pretrained(ckpt)
            state = gather_expert_shards(files, {k: v.shape for k, v in
                                                 skeleton.state_dict().items()})
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
           "shard_files", "gather_expert_shards", "describe", "TOKENIZER_CONFIG_FILE"]
