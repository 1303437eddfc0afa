"""Composing the settings of ``lrmoe train``: presets, YAML files, ``--set key=value``,
direct flags, and whether a checkpoint may resume under new settings.

Order: a preset (or a checkpoint's settings on ``--resume``), then the YAML file, then
``--set`` items, then the direct flags; keys are dotted (``optim.lr``) or flat (``lr``),
see :mod:`lrmoe.training.config`.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from lrmoe.training.config import (SECTIONS, DataConfig, ModelConfig, OptimConfig, RunConfig,
                                   TrainConfig)
from lrmoe.training.keys import flatten, mapping_keys, resolve_key, set_key
from lrmoe.training.distributed import log

#: Fields that may differ between a checkpoint and the run that resumes it: they change
#: neither the model, nor the data order, nor the optimisation.
RESUME_MUTABLE_FIELDS = frozenset({
    "run.steps", "run.eval_every", "run.eval_batches", "run.log_every", "run.save_every",
    "run.keep_checkpoints", "run.out_dir", "run.device", "run.torch_threads", "run.progress",
    "data.cache_dir", "run.record_trace", "run.trace_every", "run.tensorboard",
    "run.time_moe", "run.export", "run.attention", "run.checkpoints", "run.compile"})
#: may change on resume together, as long as the global batch (their product, in
#: micro-batches of data.batch_size) stays: the checkpoint re-shards (lrmoe.parallel.state)
RESUME_LAYOUT_FIELDS = ("parallel.ep_size", "parallel.dp_size", "data.grad_accum")



# ====================================================================== presets
def _preset_tiny() -> TrainConfig:
    # one torch thread: on a 2-core machine that runs anything else, two threads spend
    # most of their time waiting for each other in every parallel region
    return TrainConfig(data=DataConfig(vocab_size=2048, max_records=8000),
                       run=RunConfig(steps=500, torch_threads=1))


def _preset_gpu_small() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                          num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                          moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8,
                          router_aux_loss_coef=0.01, max_position_embeddings=4096),
        data=DataConfig(vocab_size=16384, max_records=None, seq_len=1024, batch_size=16),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100),
        run=RunConfig(steps=1500, eval_every=100, eval_batches=32, save_every=500,
                      out_dir="runs/gpu-small"))


def _preset_qwen3_slice() -> TrainConfig:
    # the Qwen3-30B-A3B layer (H 2048, 32 query / 4 kv heads of 128, E 128, K 8, I 768)
    # in 4 layers, 32k tokens a step: the shape where issue 28 measures the whole step;
    # flex attention is 1.16x sdpa's step there, and run.compile 1.46x the eager step
    # (H100, docs/results.md)
    g = _preset_gpu_small()
    return g.replace(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                     moe_intermediate_size=768, seq_len=2048, batch_size=16,
                     attention="flex_attention", compile=True, out_dir="runs/qwen3-slice")


#: Named starting points; ``lrmoe train --preset NAME``. ``configs/<name>.yaml`` spell them
#: out as YAML.
PRESETS: Dict[str, Callable[[], TrainConfig]] = {
    "tiny": _preset_tiny,
    "gpu-small": _preset_gpu_small,
    "qwen3-slice": _preset_qwen3_slice,
}


def get_preset(name: str) -> TrainConfig:
    """The preset ``name``.

    Raises:
        ValueError: unknown name (listing the presets).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


# ====================================================================== composition
def parse_set(item: str) -> Tuple[str, Any]:
    """``"key=value"`` -> (key, value) with the value read by ``yaml.safe_load``.

    Raises:
        ValueError: no ``=`` or an unparsable value.
    """
    import yaml

    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r} (e.g. --set optim.lr=1e-3)")
    key, text = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {key}: cannot parse {text!r} as a YAML value ({exc})") from None
    return key, value


def load_yaml_config(path: str | os.PathLike) -> Dict[str, Any]:
    """Read a YAML mapping: sections (``optim: {lr: ...}``), dotted or flat keys, and an
    optional ``preset:``.

    Raises:
        FileNotFoundError: no such file. ValueError: not YAML or not a mapping.
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {p}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {p}: expected a mapping of config keys, got "
                         f"{type(data).__name__}")
    return data


def build_config(preset: Optional[str] = None, config_file: Optional[str | os.PathLike] = None,
                 sets: Sequence[str] = (), overrides: Optional[Mapping[str, Any]] = None,
                 base: Optional[TrainConfig] = None) -> TrainConfig:
    """Compose a :class:`TrainConfig`: base (``base``, else the preset named by ``preset``,
    else by the YAML file's ``preset:`` key, else ``tiny``), then the YAML file, then
    ``--set key=value`` items, then ``overrides`` (None values skipped).

    Keys are dotted (``optim.lr``) or flat (``lr``); a YAML file nests them by section.
    Flat keys in a YAML file are read with a note on stderr naming their nested names; a
    file that sets one key twice (nested and flat) is refused.

    Args:
        preset: preset name (wins over the YAML file's ``preset:``).
        config_file: YAML mapping (see :func:`load_yaml_config`).
        sets: ``key=value`` strings; values parsed with ``yaml.safe_load`` and coerced to
            the field type.
        overrides: ``{key: value}`` from direct command-line flags.
        base: start from this config instead of a preset (used by ``--resume``).

    Raises:
        ValueError: unknown preset or key (with close matches), one key set twice in the
            YAML file (naming both spellings), wrong type, invalid value.
        FileNotFoundError: missing YAML file.
    """
    file_data = load_yaml_config(config_file) if config_file else {}
    file_preset = file_data.pop("preset", None)
    if base is not None and preset is None and file_preset is None:
        d = base.to_dict()
    else:
        d = get_preset(preset or file_preset or "tiny").to_dict()
    flat = []
    for dotted, key, value in mapping_keys(file_data, f"--config {config_file}"):
        if dotted != key:
            flat.append(f"{key} -> {dotted}")
        set_key(d, dotted, value)
    if flat:
        log(f"note: --config {config_file} uses flat keys of earlier versions, read as "
            f"{', '.join(flat)}; nest them by section (lrmoe train --print-config shows the "
            "layout)")
    for item in sets:
        key, value = parse_set(item)
        set_key(d, resolve_key(key), value)
    for key, value in (overrides or {}).items():
        if value is not None:
            set_key(d, resolve_key(key), value)
    return TrainConfig.from_dict(d)


def config_yaml(cfg: TrainConfig) -> str:
    """The config as nested YAML (what ``--print-config`` prints and ``--config`` reads)."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def read_config_json(path: str | os.PathLike) -> TrainConfig:
    """A checkpoint's ``train_config.json`` (nested, or the flat form of earlier versions,
    which is noted)."""
    data = json.loads(Path(path).read_text())
    if any(k not in SECTIONS for k in data) or isinstance(data.get("data"), str):
        log(f"note: {path} holds the flat settings of an earlier version; read as nested "
            "sections")
    section = data.get("data")
    if "split_seed" not in data and not (isinstance(section, dict) and "split_seed" in section):
        # written before data.split_seed existed: its split was salted by run.seed, and a
        # resume must read the same split (the default of 0 would move it for seed != 0)
        data = dict(data)
        if isinstance(section, dict):
            data["data"] = {**section, "split_seed": None}
        else:
            data["split_seed"] = None
    return TrainConfig.from_dict(data)


def check_resume_compatible(saved: TrainConfig, new: TrainConfig,
                            saved_decay_steps: Optional[int] = None) -> None:
    """Refuse to resume a run under settings that change the model, data or optimisation.

    Allowed to differ: :data:`RESUME_MUTABLE_FIELDS` (``run.steps``, the eval/log/save
    cadence, ``run.out_dir``, ``run.device``, ...), and the EP size, DP size and
    gradient accumulation (:data:`RESUME_LAYOUT_FIELDS`) when their product, the global
    batch in micro-batches, stays the same. ``optim.lr_decay_steps`` = None in
    ``new`` inherits the checkpoint's schedule (``saved_decay_steps``).

    Raises:
        ValueError: naming every differing field with both values.
    """
    a, b = flatten(saved.to_dict()), flatten(new.to_dict())
    diffs = []
    was = [int(a[k]) for k in RESUME_LAYOUT_FIELDS]
    now = [int(b[k]) for k in RESUME_LAYOUT_FIELDS]
    if math.prod(was) != math.prod(now):
        ep, dp, accum = now
        fix = (f"; keep it with --set data.grad_accum={math.prod(was) // (ep * dp)}"
               if math.prod(was) % (ep * dp) == 0 else "")
        diffs.append(f"the global batch: checkpoint ep_size x dp_size x grad_accum = "
                     f"{' x '.join(map(str, was))} = {math.prod(was)} micro-batches, now "
                     f"{' x '.join(map(str, now))} = {math.prod(now)}{fix}")
    for key in a:
        if key in RESUME_MUTABLE_FIELDS or key in RESUME_LAYOUT_FIELDS:
            continue
        va, vb = a[key], b.get(key)
        if key == "optim.lr_decay_steps":
            va = saved_decay_steps if saved_decay_steps is not None else va
            if vb is None:
                continue
        if va != vb:
            diffs.append(f"{key}: checkpoint {va!r}, now {vb!r}")
    if diffs:
        raise ValueError(
            "cannot resume: the config differs from the checkpoint's in fields that change "
            "the model, the data or the optimisation:\n  " + "\n  ".join(diffs) +
            "\n(only " + ", ".join(sorted(RESUME_MUTABLE_FIELDS)) + " may change on resume; "
            "start a new run with another --out to train under new settings)")
