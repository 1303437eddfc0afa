"""Checkpoints of a run: ``run.out_dir/checkpoints/step-XXXXXXXX/``, written atomically
by all ranks together.

A checkpoint (format 2) holds:

* ``state/`` -- the model and optimizer tensors through ``torch.distributed.checkpoint``
  (DCP; :mod:`lrmoe.parallel.state`): sharded, each chunk written by one rank (an expert
  shard by its ep rank, a dense tensor or a dp replica once), with global shapes, so a
  run resumes at another EP / DP size (E divisible by the new EP size) and each rank
  reads only its rows;
* ``trainer_state.pt`` -- rank 0: step, scheduler, data position (global batches),
  optimizer hyper-parameter groups (by parameter name), LRMoE backward counters, the
  placement's loads, counters and the sizes it was written with;
* ``ranks/rank-r.pt`` + ``ranks/metrics-rank-r.jsonl`` -- every rank's RNG states and
  its log up to the step;
* ``config.json`` (the transformers model config), ``tokenizer.json`` +
  ``tokenizer_config.json`` (so ``transformers.AutoTokenizer`` loads it with the
  trainer's ids and pad / eos tokens), ``train_config.json``
  (:class:`lrmoe.training.config.TrainConfig`) and ``metrics.jsonl`` (rank 0's log).

Every rank must see the same ``run.out_dir`` (one filesystem, as DCP's file writer
needs). ``lrmoe export`` (:mod:`lrmoe.training.export`) turns a checkpoint into one plain
transformers checkpoint; ``model.init_from`` reads one directly.

Checkpoints of earlier versions (format 1: ``model.safetensors`` of a single-process
run, or per-rank ``model-ep-rank-e.safetensors`` files) are not resumed; a
single-process one is a transformers checkpoint that ``model.init_from`` and
``lrmoe export`` still read.

Rank folders (:func:`rank_dir`) keep each rank's logs: ep rank 0 in ``out_dir``, ep rank
e > 0 in ``out_dir/ep-rank-e``, dp rank d > 0 of DP x EP in ``<that>/dp-rank-d``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from lrmoe.data.tokenizer import write_tokenizer_config
from lrmoe.training.compose import read_config_json
from lrmoe.training.config import TrainConfig

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
TRAIN_CONFIG_FILE = "train_config.json"
#: Folders a save in progress writes (``.tmp-step-*``) or is replacing (``.old-step-*``).
STALE_PREFIXES = (".tmp-", ".old-")
#: the DCP folder of a checkpoint and the folder of the ranks' own files
STATE_DIR, RANKS_DIR = "state", "ranks"


def rank_dir(out_dir: str | os.PathLike, ep_rank: int = 0, dp_rank: int = 0) -> Path:
    """The folder of one rank's files: ``out_dir`` for (ep 0, dp 0), ``out_dir/ep-rank-e``
    for ep rank e > 0, and ``<that>/dp-rank-d`` for a dp rank d > 0 of DP x EP."""
    path = Path(out_dir)
    if ep_rank > 0:
        path = path / f"ep-rank-{ep_rank}"
    return path / f"dp-rank-{dp_rank}" if dp_rank > 0 else path


def list_checkpoints(run_dir: str | os.PathLike) -> List[Path]:
    """Complete checkpoints of ``run_dir`` (``checkpoints/step-*``), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name[len(CHECKPOINT_PREFIX):]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found)]


def find_checkpoint(path: Optional[str | os.PathLike], out_dir: str | os.PathLike) -> Path:
    """The checkpoint to resume: ``path`` itself when it is one, the newest checkpoint of
    the run directory ``path``, or (``path`` None/empty) the newest one in ``out_dir``.

    Raises:
        FileNotFoundError: nothing to resume, naming where it looked.
    """
    where = Path(path) if path else Path(out_dir)
    if (where / STATE_FILE).is_file():
        return where
    ckpts = list_checkpoints(where)
    if not ckpts:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {where} (expected {where}/checkpoints/"
            f"{CHECKPOINT_PREFIX}XXXXXXXX/{STATE_FILE}); pass --resume DIR or the run's --out")
    return ckpts[-1]


def read_checkpoint_config(ckpt: str | os.PathLike) -> TrainConfig:
    """The :class:`TrainConfig` a checkpoint was written under (the flat form of earlier
    versions is read too)."""
    return read_config_json(Path(ckpt) / TRAIN_CONFIG_FILE)


def remove_stale_saves(run_dir: str | os.PathLike) -> List[Path]:
    """Delete the ``checkpoints/.tmp-step-*`` / ``.old-step-*`` folders that a process
    killed during a save left behind (rank 0, before the first save). Returns the
    removed paths."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STALE_PREFIXES)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def rng_state() -> Dict[str, Any]:
    """Python, torch, numpy and (when initialised) CUDA generator states, as tensors and
    lists that ``torch.load(weights_only=True)`` reads back."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {"python": [version, list(internal), gauss],
                             "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss_np = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(gauss_np)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA only on as many devices)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss_np = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss_np))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_sharded_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether ``ckpt`` is a format-2 checkpoint (a DCP ``state/`` folder)."""
    return (Path(ckpt) / STATE_DIR / ".metadata").is_file()


def begin_save(run_dir: Path, step: int) -> Path:
    """Rank 0, before a save: an empty ``run_dir/checkpoints/.tmp-step-<step>`` folder
    (one that an interrupted save left is cleared first). Returns it."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / RANKS_DIR).mkdir(parents=True)
    return tmp


def write_rank_files(tmp: Path, rank: int, metrics_path: Path) -> None:
    """Every rank: its RNG states and a copy of its log (flush the log first)."""
    torch.save({"rng": rng_state(), "metrics_bytes": int(metrics_path.stat().st_size)},
               tmp / RANKS_DIR / f"rank-{rank}.pt")
    shutil.copyfile(metrics_path, tmp / RANKS_DIR / f"metrics-rank-{rank}.jsonl")


def finish_save(tmp: Path, *, model: nn.Module, cfg: TrainConfig, state: Mapping[str, Any],
                tokenizer_path: Path, metrics_path: Path, keep: int) -> Path:
    """Rank 0, after every rank wrote its part into ``tmp``: the run's files, then the
    rename into ``checkpoints/step-<step>`` (replacing one of the same step) and the
    pruning to the newest ``keep`` checkpoints.

    Args:
        tmp: :func:`begin_save`'s folder. model: the transformers model (its config is
            written as ``config.json``, its generation config as ``generation_config.json``). cfg: written as ``train_config.json``. state:
            ``trainer_state.pt`` contents (tensors, numbers, lists, dicts; its ``step``
            names the folder). tokenizer_path, metrics_path: copied in.
        keep: checkpoints to keep (>= 1).

    Returns:
        The checkpoint directory.
    """
    model.config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    # without it AutoTokenizer picks the model type's tokenizer class, whose own
    # pre-tokenizer gives other ids, and uses eos as pad (issue 27)
    write_tokenizer_config(tmp / "tokenizer.json", tmp)
    (tmp / TRAIN_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    shutil.copyfile(metrics_path, tmp / metrics_path.name)
    torch.save(dict(state), tmp / STATE_FILE)
    root = tmp.parent
    final = root / f"{CHECKPOINT_PREFIX}{int(state['step']):08d}"
    if final.exists():
        trash = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_rank_state(ckpt: Path, rank: int) -> Optional[Dict[str, Any]]:
    """``ranks/rank-<rank>.pt`` of ``ckpt`` (RNG states, log length), or None when the
    checkpoint was written by fewer ranks."""
    f = ckpt / RANKS_DIR / f"rank-{rank}.pt"
    return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None


def check_resumable(ckpt: Path) -> None:
    """Refuse a checkpoint that this version cannot resume (format 1), naming the way on.

    Raises:
        ValueError: ``ckpt`` has no DCP ``state/`` folder.
    """
    if is_sharded_checkpoint(ckpt):
        return
    plain = (ckpt / "model.safetensors").is_file()
    raise ValueError(
        f"{ckpt} was written by an earlier lrmoe (no {STATE_DIR}/ folder: "
        + ("a transformers checkpoint" if plain else "per-rank shard files")
        + ") and cannot be resumed; "
        + (f"start a new run from its weights with --set model.init_from={ckpt} "
           "(the optimizer state is not carried over)" if plain else
           "resume it with the lrmoe version that wrote it"))
