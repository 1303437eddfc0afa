"""Checkpoints of a run: ``out_dir/checkpoints/step-XXXXXXXX/``, written atomically.

A checkpoint holds ``model.safetensors`` + ``config.json`` (a plain transformers
checkpoint; under expert parallelism with more than one rank, each rank's
``model-ep-rank-r.safetensors`` with its expert shard instead), ``tokenizer.json`` +
``tokenizer_config.json`` (so ``transformers.AutoTokenizer`` loads it with the trainer's
ids and pad / eos tokens), ``train_config.json`` (:class:`lrmoe.training.config.TrainConfig`),
``trainer_state.pt`` (optimizer, scheduler, RNG states, data position, step, LRMoE backward
counters) and ``metrics.jsonl`` (the log up to that step).

``lrmoe export`` (:mod:`lrmoe.training.export`) turns a checkpoint of any EP size into one
plain transformers checkpoint.

Where each rank keeps its files (:func:`rank_dir`): ep rank 0 in ``out_dir``, ep rank
e > 0 in ``out_dir/ep-rank-e``; under DP x EP only dp rank 0 of each ep shard writes
checkpoints there, dp rank d > 0 keeps its logs (no checkpoint) in ``<that>/dp-rank-d``
and resumes from its ep shard's checkpoint (:func:`shard_checkpoint`).
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
from torch import Tensor, nn

from lrmoe.data.tokenizer import write_tokenizer_config
from lrmoe.training.compose import read_config_json
from lrmoe.training.config import TrainConfig

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
TRAIN_CONFIG_FILE = "train_config.json"
#: Folders a save in progress writes (``.tmp-step-*``) or is replacing (``.old-step-*``).
STALE_PREFIXES = (".tmp-", ".old-")


def rank_dir(out_dir: str | os.PathLike, ep_rank: int = 0, dp_rank: int = 0) -> Path:
    """The folder of one rank's files: ``out_dir`` for (ep 0, dp 0), ``out_dir/ep-rank-e``
    for ep rank e > 0, and ``<that>/dp-rank-d`` for a dp rank d > 0 of DP x EP."""
    path = Path(out_dir)
    if ep_rank > 0:
        path = path / f"ep-rank-{ep_rank}"
    return path / f"dp-rank-{dp_rank}" if dp_rank > 0 else path


def shard_checkpoint(ckpt: str | os.PathLike, ep_rank: int) -> Path:
    """Ep shard ``ep_rank``'s copy of the checkpoint ``ckpt`` of ep rank 0: the same step
    under ``ep-rank-e`` (``out/checkpoints/step-X`` -> ``out/ep-rank-e/checkpoints/step-X``);
    ``ckpt`` itself for ep rank 0."""
    c = Path(ckpt)
    if ep_rank == 0:
        return c
    return rank_dir(c.parent.parent, ep_rank) / c.parent.name / c.name


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
    killed during a save left behind. Returns the removed paths."""
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


def save_checkpoint(run_dir: Path, step: int, *, model: nn.Module, cfg: TrainConfig,
                    state: Mapping[str, Any], tokenizer_path: Path, metrics_path: Path,
                    sharded_rank: Optional[int], keep: int) -> Path:
    """Write ``run_dir/checkpoints/step-<step>`` atomically (a ``.tmp-`` folder renamed
    into place) and keep the newest ``keep`` checkpoints.

    Args:
        run_dir: this rank's run directory.
        step: optimizer steps done.
        model: the (patched) transformers model.
        cfg: written as ``train_config.json``.
        state: ``trainer_state.pt`` contents (tensors, numbers, lists, dicts).
        tokenizer_path, metrics_path: copied in (flush the metrics file first); the
            tokenizer's ``tokenizer_config.json`` is written beside it.
        sharded_rank: None writes a transformers checkpoint (``save_pretrained``); a rank
            writes its raw state dict (its expert shard + the dense weights) as
            ``model-ep-rank-<rank>.safetensors``, which only a resume reads.
        keep: checkpoints to keep (>= 1).

    Returns:
        The checkpoint directory.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if sharded_rank is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        from safetensors.torch import save_file

        model.config.save_pretrained(tmp)
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
                  str(tmp / f"model-ep-rank-{sharded_rank}.safetensors"))
    shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    # without it AutoTokenizer picks the model type's tokenizer class, whose own
    # pre-tokenizer gives other ids, and uses eos as pad (issue 27)
    write_tokenizer_config(tmp / "tokenizer.json", tmp)
    (tmp / TRAIN_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    shutil.copyfile(metrics_path, tmp / metrics_path.name)
    torch.save(dict(state), tmp / STATE_FILE)
    if final.exists():
        trash = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_ep_weights(model: nn.Module, ckpt: Path) -> None:
    """Load this rank's ``model-ep-rank-r.safetensors`` into the (sharded) model.

    Raises:
        FileNotFoundError: no weights in ``ckpt``.
        ValueError: the weights do not fit this rank's shard (another EP size).
    """
    from safetensors.torch import load_file

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no *.safetensors weights of this EP rank")
    weights: Dict[str, Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    own = model.state_dict()
    bad = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in weights and not k.endswith("rotary_emb.inv_freq")]
    if bad or missing:
        raise ValueError(f"{ckpt}: weights do not fit this rank's expert shard "
                         f"(shape mismatch: {bad[:3]}, missing: {missing[:3]}); resume "
                         "with the same parallel.ep_size")
    model.load_state_dict(weights, strict=False)
