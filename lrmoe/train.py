"""``lrmoe train``: train or fine-tune a transformers Qwen3-MoE model whose sparse-MoE blocks
are LRMoE layers (exact forward, planned backward).

Public API:

* :class:`ModelConfig`, :class:`TrainConfig` -- every setting, validated; :data:`PRESETS`
  (``tiny``, ``gpu-small``); :func:`build_config` (preset + YAML + ``key=value`` overrides).
* :func:`train` -- the training loop: AdamW, warm-up + cosine, gradient clipping, bf16
  autocast on CUDA, validation perplexity, metrics JSONL, loss-curve PNG, summary table,
  checkpoints (every ``save_every`` steps, at the end and on Ctrl-C) and exact resume.
* :func:`lr_factor`, :func:`causal_lm_nll`, :func:`evaluate`, :func:`find_checkpoint`,
  :func:`check_resume_compatible`.

Files of a run (``out_dir``):

* ``metrics.jsonl`` -- one JSON object per line: ``{"kind": "train", "step", "loss", "ppl",
  "aux_loss", "lr", "grad_norm", "tokens", "tokens_per_s", "time_s", "dropped_fraction",
  "retained_mass", "load_max_over_mean_before", "load_max_over_mean_after"}`` every
  ``log_every`` steps and ``{"kind": "eval", "step", "val_loss", "val_ppl", "val_tokens"}``
  at step 0, every ``eval_every`` steps and at the end.
* ``loss_curve.png`` -- training and validation loss against the step.
* ``summary.json`` -- the final summary.
* ``checkpoints/step-XXXXXXXX/`` -- ``model.safetensors`` + ``config.json`` (the transformers
  model, loadable with ``from_pretrained`` into an unpatched model), ``tokenizer.json``,
  ``train_config.json`` (the :class:`TrainConfig`), ``trainer_state.pt`` (optimizer,
  scheduler, RNG states, data position, step, LRMoE backward counters) and
  ``metrics.jsonl`` (the log up to that step).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.ops import METRICS, QUOTA_RULES, SELECTIONS

DTYPES = ("auto", "float32", "bfloat16")
PROGRESS = ("auto", "bar", "lines", "none")
CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
TRAIN_CONFIG_FILE = "train_config.json"
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"
SUMMARY_FILE = "summary.json"

#: TrainConfig fields that may differ between a checkpoint and the run that resumes it:
#: they change neither the model, nor the data order, nor the optimisation.
RESUME_MUTABLE_FIELDS = frozenset({
    "steps", "eval_every", "eval_batches", "log_every", "save_every", "keep_checkpoints",
    "out_dir", "device", "torch_threads", "progress", "cache_dir", "record_trace",
    "trace_every"})


# ====================================================================== configuration
@dataclass
class ModelConfig:
    """Architecture of a randomly initialised Qwen3-MoE model (transformers
    ``Qwen3MoeConfig`` fields; the vocabulary size comes from the tokenizer).

    Ignored when :attr:`TrainConfig.init_from` names a checkpoint: the architecture is
    then the checkpoint's ``config.json``.

    Attributes:
        hidden_size: H, model width.
        num_hidden_layers: decoder layers, every one with a sparse-MoE block.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); divides
            ``num_attention_heads``.
        head_dim: width of one attention head.
        intermediate_size: width of the dense MLP (used only by layers that
            ``Qwen3MoeConfig.mlp_only_layers`` makes dense; none here).
        moe_intermediate_size: I, width of each SwiGLU expert.
        num_experts: E routed experts per layer.
        num_experts_per_tok: K, experts per token (top-k), ``1 <= K <= E``.
        norm_topk_prob: renormalise the K routing weights to sum to 1.
        router_aux_loss_coef: weight of the load-balancing loss added to the LM loss.
        max_position_embeddings: longest sequence the rotary embedding is set up for
            (>= :attr:`TrainConfig.seq_len`).
    """

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    max_position_embeddings: int = 2048

    def validate(self) -> None:
        """Raises ValueError naming the field (``model.<name>``) on an invalid value."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)
                                           or value < 1):
                raise ValueError(f"model.{f.name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"model.num_experts={self.num_experts}; choose 1 <= K <= E")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_key_value_heads={self.num_key_value_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}")
        c = self.router_aux_loss_coef
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c) or c < 0:
            raise ValueError(f"model.router_aux_loss_coef must be a finite float >= 0, got {c!r}")


@dataclass
class TrainConfig:
    """Everything that defines a training run of ``lrmoe train``.

    Model:
        model: :class:`ModelConfig` (architecture for a random initialisation).
        init_from: directory of a transformers checkpoint (``config.json`` +
            ``*.safetensors``) to fine-tune, loaded with ``from_pretrained``; None trains
            from a random initialisation of ``model``. Its ``tokenizer.json``, when present,
            is used unless ``tokenizer`` is set.

    Data:
        data: ``gcide`` (Alpaca-style definitions built from the Debian ``dict-gcide``
            dictionary), ``alpaca:PATH`` (JSON list or JSONL with instruction / input /
            output) or ``text:PATH`` (a plain-text file or a folder of them).
        tokenizer: path of a ``tokenizer.json``; None trains a byte-level BPE on the
            training split (cached in ``cache_dir``).
        vocab_size: vocabulary size of a trained tokenizer.
        max_records: use at most this many records (None: all).
        val_fraction: share of records held out for validation, in (0, 1).
        cache_dir: where tokenizers and tokenised data are cached; None:
            ``$LRMOE_CACHE_DIR`` or ``~/.cache/lrmoe``.
        seq_len: S, tokens per training sequence (block).
        batch_size: B, sequences per micro-batch.
        grad_accum: micro-batches per optimizer step (the step sees B * grad_accum
            sequences).

    Optimisation:
        steps: optimizer steps of the run (on resume: the step to stop at; may be raised to
            extend a run).
        lr: peak learning rate (after warm-up).
        min_lr: final learning rate of the cosine decay.
        warmup_steps: linear warm-up from lr / warmup_steps to lr over this many steps.
        lr_decay_steps: step at which the cosine reaches ``min_lr`` (it stays there after);
            None: ``steps`` of the run that started the schedule (a resumed run keeps it).
        weight_decay: AdamW decoupled weight decay (not applied to norms and biases).
        betas: AdamW (beta1, beta2).
        adam_eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this value; 0 disables clipping (the
            norm is still logged).
        seed: seed of the initialisation, the data order, the split and LRMoE's
            ``random`` / ``importance`` selection.

    Hardware:
        dtype: ``auto`` (bf16 autocast on CUDA, float32 on the CPU), ``float32`` or
            ``bfloat16`` (autocast; parameters and optimizer state stay float32).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        torch_threads: CPU threads of torch (0: torch's default).
        ep_size: expert-parallel size (``--ep N``); 1 = one process. N > 1 runs under
            ``torchrun --nproc-per-node N`` (world size N, gloo on the CPU, NCCL on GPUs):
            every MoE layer keeps E / N experts per rank (:mod:`lrmoe.parallel`), the rest
            is data parallel, each rank trains on its own batches (rank-strided: a step
            sees N * batch_size sequences), rank 0 writes the run files and ranks r > 0
            write theirs (expert shards in their checkpoints) to ``out_dir/ep-rank-r``.

    Logging and checkpoints:
        eval_every: validation perplexity every this many steps (also at step 0 and at
            the end); 0 only at the start and the end.
        eval_batches: validation batches per evaluation (0: the whole validation split).
        log_every: a ``metrics.jsonl`` line (with the per-layer LRMoE diagnostics) every
            this many steps.
        save_every: checkpoint every this many steps (0: only at the end and on Ctrl-C).
        keep_checkpoints: keep the newest this many checkpoints.
        out_dir: directory of the run's files.
        progress: ``auto`` (a progress bar on a terminal, else a line every ~2 % of the
            run), ``bar``, ``lines`` (a line every ``log_every`` steps) or ``none``.
        record_trace: write the routed expert ids of every MoE layer to this ``.npz``
            (:class:`lrmoe.trace.RoutingTrace`), replayed by ``lrmoe bench layer
            --routing trace``; None records nothing.
        trace_every: record one optimizer step in this many (each record copies ids to
            the host).

    LRMoE (the planned backward of every MoE layer, :class:`lrmoe.LRMoEConfig`):
        recalibration_rate: c in [0, 1), share of routed pairs whose expert backward is
            dropped (0 = exact training).
        metric: ``lrm``, ``grad_sq``, ``grad_abs`` or ``random``.
        quota_rule: ``proportional`` or ``water_level``.
        selection: ``topk`` or ``importance``.

    Raises:
        ValueError: naming the field, on any invalid value (see :meth:`validate`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    init_from: Optional[str] = None
    data: str = "gcide"
    tokenizer: Optional[str] = None
    vocab_size: int = 4096
    max_records: Optional[int] = None
    val_fraction: float = 0.02
    cache_dir: Optional[str] = None
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 400
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: Optional[int] = None
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    torch_threads: int = 0
    ep_size: int = 1
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 1
    save_every: int = 200
    keep_checkpoints: int = 2
    out_dir: str = "runs/tiny"
    progress: str = "auto"
    record_trace: Optional[str] = None
    trace_every: int = 10
    recalibration_rate: float = 0.0
    metric: str = "lrm"
    quota_rule: str = "proportional"
    selection: str = "topk"

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            self.model = _from_mapping(ModelConfig, self.model, "model.")
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
            ValueError: naming the field, its value and what is accepted.
        """
        self.model.validate()
        positive = ("vocab_size", "seq_len", "batch_size", "grad_accum", "steps", "log_every",
                    "keep_checkpoints", "ep_size")
        non_negative = ("warmup_steps", "seed", "torch_threads", "eval_every", "eval_batches",
                        "save_every")
        for name in positive + non_negative:
            value = getattr(self, name)
            low = 1 if name in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a positive int" if low else "an int >= 0"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
        for name in ("max_records", "lr_decay_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int or null, got {value!r}")
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip", "val_fraction",
                     "recalibration_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} exceeds lr={self.lr}; the cosine decays "
                             "from lr to min_lr")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not 0.0 <= self.recalibration_rate < 1.0:
            raise ValueError(f"recalibration_rate must be in [0, 1), got "
                             f"{self.recalibration_rate!r} (0.1/0.2/0.3 are C10/C20/C30)")
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps < self.warmup_steps:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps} is smaller than "
                             f"warmup_steps={self.warmup_steps}")
        for name, allowed in (("metric", METRICS), ("quota_rule", QUOTA_RULES),
                              ("selection", SELECTIONS), ("dtype", DTYPES),
                              ("progress", PROGRESS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if not (self.device in ("auto", "cpu", "cuda") or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if not isinstance(self.data, str) or not (
                self.data == "gcide" or self.data.startswith(("alpaca:", "text:"))):
            raise ValueError(f"data must be gcide, alpaca:PATH or text:PATH; got {self.data!r}")
        if self.seq_len > self.model.max_position_embeddings and self.init_from is None:
            raise ValueError(f"seq_len={self.seq_len} exceeds model.max_position_embeddings="
                             f"{self.model.max_position_embeddings}; raise the latter")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"out_dir must be a non-empty path, got {self.out_dir!r}")

    @property
    def lrmoe_settings(self) -> Dict[str, Any]:
        """Keyword arguments for ``patch_moe_blocks`` (the planned-backward settings)."""
        return {"recalibration_rate": float(self.recalibration_rate), "metric": self.metric,
                "quota_rule": self.quota_rule, "selection": self.selection, "seed": self.seed}

    def to_dict(self) -> Dict[str, Any]:
        """A JSON/YAML-able nested dict (``model`` is a mapping, ``betas`` a list)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        """Build from a nested mapping (as :meth:`to_dict` writes), coercing types.

        Raises:
            ValueError: an unknown key (with close matches) or a value of the wrong type.
        """
        return _from_mapping(cls, data, "")

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy with top-level ``changes``."""
        return dataclasses.replace(self, **changes)


def _preset_tiny() -> TrainConfig:
    # one torch thread: on a 2-core machine that runs anything else, two threads spend
    # most of their time waiting for each other in every parallel region
    return TrainConfig(vocab_size=2048, max_records=8000, steps=500, torch_threads=1)


def _preset_gpu_small() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                          num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                          moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8,
                          router_aux_loss_coef=0.01, max_position_embeddings=4096),
        vocab_size=16384, max_records=None, seq_len=1024, batch_size=16, grad_accum=1,
        steps=1500, lr=1e-3, min_lr=1e-4, warmup_steps=100, eval_every=100, eval_batches=32,
        log_every=1, save_every=500, out_dir="runs/gpu-small")


#: Named starting points; ``lrmoe train --preset NAME``. ``configs/<name>.yaml`` spell them
#: out as YAML.
PRESETS: Dict[str, Callable[[], TrainConfig]] = {
    "tiny": _preset_tiny,
    "gpu-small": _preset_gpu_small,
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


def config_keys() -> List[str]:
    """Every settable key: top-level fields and ``model.<field>``."""
    keys = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    return keys + [f"model.{f.name}" for f in dataclasses.fields(ModelConfig)]


def _unknown_key(key: str, known: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(key, known, n=4, cutoff=0.5)
    bare = key.split(".")[-1]
    close += [k for k in known if k.split(".")[-1] == bare and k not in close]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint} (all keys: lrmoe train --print-config)")


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert a YAML/JSON value to the annotated type ``hint`` (int, float, bool, str,
    Optional[...], Tuple[float, float])."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], key)
    if origin in (tuple, Tuple):
        if isinstance(value, str):
            value = [v for v in value.replace("(", "").replace(")", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list like [0.9, 0.95], got {value!r}")
        args = typing.get_args(hint)
        if len(value) != len(args):
            raise ValueError(f"{key} must have {len(args)} entries, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(f"{key} must be an int, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise ValueError(f"{key} must be an int, got {value!r}") from None
                if f.is_integer():
                    return int(f)
                raise ValueError(f"{key} must be an int, got {value!r}") from None
        if not isinstance(value, int):
            raise ValueError(f"{key} must be an int, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        if not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def _from_mapping(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: Dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(prefix + str(key), config_keys())
        if key == "model" and cls is TrainConfig:
            kwargs[key] = _from_mapping(ModelConfig, value, "model.")
        else:
            kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def _set_key(d: Dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested config dict ``d``; bare model fields work too."""
    known = config_keys()
    if key not in known:
        model_key = f"model.{key}"
        if model_key in known and key not in known:
            key = model_key
        else:
            raise _unknown_key(key, known)
    if key.startswith("model."):
        d.setdefault("model", {})[key[len("model."):]] = value
    else:
        d[key] = value


def parse_set(item: str) -> Tuple[str, Any]:
    """``"key=value"`` -> (key, value) with the value read by ``yaml.safe_load``.

    Raises:
        ValueError: no ``=`` or an unparsable value.
    """
    import yaml

    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r} (e.g. --set lr=1e-3)")
    key, text = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {key}: cannot parse {text!r} as a YAML value ({exc})") from None
    return key, value


def load_yaml_config(path: str | os.PathLike) -> Dict[str, Any]:
    """Read a YAML mapping of TrainConfig fields (``model:`` nested; ``preset:`` allowed).

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
    else by the YAML file's ``preset:`` key, else ``tiny``), then the YAML file's fields,
    then ``--set key=value`` items, then ``overrides`` (dotted keys; None values skipped).

    Args:
        preset: preset name (wins over the YAML file's ``preset:``).
        config_file: YAML mapping of fields (nested ``model:`` or dotted ``model.x`` keys).
        sets: ``key=value`` strings; values parsed with ``yaml.safe_load`` and coerced to
            the field type.
        overrides: ``{key: value}`` from direct command-line flags.
        base: start from this config instead of a preset (used by ``--resume``).

    Raises:
        ValueError: unknown preset or key (with close matches), wrong type, invalid value.
        FileNotFoundError: missing YAML file.
    """
    file_data = load_yaml_config(config_file) if config_file else {}
    file_preset = file_data.pop("preset", None)
    if base is not None and preset is None and file_preset is None:
        d = base.to_dict()
    else:
        d = get_preset(preset or file_preset or "tiny").to_dict()
    for key, value in file_data.items():
        if key == "model" and isinstance(value, Mapping):
            for k, v in value.items():
                _set_key(d, f"model.{k}", v)
        else:
            _set_key(d, str(key), value)
    for item in sets:
        _set_key(d, *parse_set(item))
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_key(d, key, value)
    return TrainConfig.from_dict(d)


def config_yaml(cfg: TrainConfig) -> str:
    """The config as YAML (what ``--print-config`` prints and ``--config`` reads)."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def check_resume_compatible(saved: TrainConfig, new: TrainConfig,
                            saved_decay_steps: Optional[int] = None) -> None:
    """Refuse to resume a run under settings that change the model, data or optimisation.

    Allowed to differ: :data:`RESUME_MUTABLE_FIELDS` (``steps``, the eval/log/save cadence,
    ``out_dir``, ``device``, ...). ``lr_decay_steps`` = None in ``new`` inherits the
    checkpoint's schedule (``saved_decay_steps``).

    Raises:
        ValueError: naming every differing field with both values.
    """
    a, b = _flatten(saved.to_dict()), _flatten(new.to_dict())
    diffs = []
    for key in a:
        if key in RESUME_MUTABLE_FIELDS:
            continue
        va, vb = a[key], b.get(key)
        if key == "lr_decay_steps":
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


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


# ====================================================================== schedule, loss
def lr_factor(step: int, *, lr: float, min_lr: float, warmup_steps: int,
              decay_steps: int) -> float:
    """Multiplier of ``lr`` for the optimizer step with 0-based index ``step``.

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; then cosine
    from lr to min_lr: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / (decay_steps - warmup_steps)`` clipped to [0, 1]
    (min_lr from ``decay_steps`` on). Returns lr(step) / lr.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return value / lr


def causal_lm_nll(logits_BSV: Tensor, labels_BS: Tensor) -> Tuple[Tensor, Tensor]:
    """Summed next-token negative log-likelihood, as transformers' causal-LM loss shifts it.

    Position s predicts ``labels[:, s + 1]``; labels -100 are ignored.

    Args:
        logits_BSV: (B, S, V) logits (any float dtype; computed in float32).
        labels_BS: (B, S) int64 labels, -100 where no loss is taken.

    Returns:
        (nll_sum () float32, count () int64): sum of -log p over loss tokens, their number.
    """
    logits = logits_BSV[:, :-1].float()
    targets = labels_BS[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll, (targets != -100).sum()


@torch.no_grad()
def evaluate(model: nn.Module, blocks: Any, batch_size: int, max_batches: int,
             device: torch.device, autocast_dtype: Optional[torch.dtype]) -> Dict[str, float]:
    """Validation loss over the first ``max_batches`` batches of ``blocks`` in order.

    Args:
        model: a causal LM returning ``.logits`` (B, S, V).
        blocks: TokenBlocks (``input_ids``, ``labels``: (N, S) int64).
        batch_size: sequences per forward.
        max_batches: 0 for all of ``blocks``.
        device: where the model is. autocast_dtype: bf16 autocast, or None.

    Returns:
        ``{"val_loss": mean NLL per loss token (nats), "val_ppl": exp(val_loss),
        "val_tokens": loss tokens counted}``.

    Raises:
        ValueError: the blocks hold no loss token.
    """
    was_training = model.training
    model.eval()
    n = len(blocks)
    num_batches = math.ceil(n / batch_size)
    if max_batches:
        num_batches = min(num_batches, max_batches)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    try:
        for b in range(num_batches):
            ids = blocks.input_ids[b * batch_size:(b + 1) * batch_size].to(device)
            labels = blocks.labels[b * batch_size:(b + 1) * batch_size].to(device)
            with _autocast(device, autocast_dtype):
                out = model(input_ids=ids, use_cache=False)
            s, c = causal_lm_nll(out.logits, labels)
            nll += s.double()
            count += c
    finally:
        model.train(was_training)
    tokens = int(count)
    if tokens == 0:
        raise ValueError("the validation split holds no loss token; raise val_fraction or "
                         "check the data")
    loss = float(nll) / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": tokens}


def _autocast(device: torch.device, dtype: Optional[torch.dtype]):
    if dtype is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=dtype)


# ====================================================================== checkpoints
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
    """The :class:`TrainConfig` a checkpoint was written under."""
    return TrainConfig.from_dict(json.loads((Path(ckpt) / TRAIN_CONFIG_FILE).read_text()))


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"python": _py_state_to_lists(random.getstate()),
                             "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(gauss)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _py_state_to_lists(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _set_rng_state(state: Mapping[str, Any]) -> None:
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


def _file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ====================================================================== the trainer
@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        step: optimizer steps done (counting those before a resume).
        interrupted: stopped by Ctrl-C (a checkpoint was saved).
        out_dir: the run directory. checkpoint: the last checkpoint written (or None).
        summary: the final summary (also in ``summary.json``).
        model: the trained (patched) model.
    """

    step: int
    interrupted: bool
    out_dir: Path
    checkpoint: Optional[Path]
    summary: Dict[str, Any]
    model: Any = None


class _BatchStream:
    """Endless deterministic batches: epoch after epoch of ``lrmoe.data.batches``; its
    position (epoch, index = batches consumed in the epoch) is checkpointed."""

    def __init__(self, blocks: Any, batch_size: int, seed: int, epoch: int = 0,
                 index: int = 0) -> None:
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.epoch, self.index = epoch, index
        self._it: Optional[Iterator] = None

    def next(self) -> Tuple[Tensor, Tensor]:
        from lrmoe.data import batches

        empty_epochs = 0
        while True:
            if self._it is None:
                self._it = iter(batches(self.blocks, self.batch_size, seed=self.seed,
                                        epoch=self.epoch, start=self.index))
            try:
                _, ids, labels = next(self._it)
            except StopIteration:
                if self.index == 0:
                    empty_epochs += 1
                    if empty_epochs > 1:
                        raise ValueError(
                            f"the training split ({len(self.blocks)} sequences) yields no "
                            f"batch of batch_size={self.batch_size}") from None
                self.epoch, self.index, self._it = self.epoch + 1, 0, None
                continue
            self.index += 1
            return ids, labels

    def position(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


class _Progress:
    """A tqdm bar on a terminal, else plain lines to stderr."""

    def __init__(self, mode: str, total: int, initial: int, log_every: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() and _terminal_columns() >= 40 else "lines"
            every = max(log_every, total // 50)
        else:
            every = log_every
        self.mode, self.every, self.bar = mode, max(1, every), None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, step: int, total: int, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and (step % self.every == 0 or step == total):
            _log(f"step {step}/{total}  {text}")

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        elif self.mode != "none":
            _log(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


_QUIET = False  # ranks > 0 of an expert-parallel run print nothing


def _log(text: str) -> None:
    if not _QUIET:
        print(f"[lrmoe] {text}", file=sys.stderr, flush=True)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _expert_parallel(cfg: "TrainConfig") -> bool:
    """True when the run joins a process group: ``ep_size > 1``, or any run launched by
    torchrun (EP size 1 then runs the expert-parallel layer over a group of one, NCCL or
    gloo, and a world size other than ``ep_size`` is refused instead of N processes
    silently training the same model into one folder)."""
    return cfg.ep_size > 1 or _under_torchrun()


def _ep_rank(cfg: "TrainConfig") -> int:
    """This process's rank in an expert-parallel run (torchrun's ``RANK``), else 0."""
    return int(os.environ.get("RANK", "0")) if _expert_parallel(cfg) else 0


def _init_expert_parallel(cfg: "TrainConfig") -> None:
    """Join the torchrun process group (world size must equal ``ep_size``)."""
    from lrmoe.parallel import init_torchrun_group

    backend = init_torchrun_group(cfg.ep_size, torch.cuda.is_available() and cfg.device != "cpu",
                                  f"ep_size={cfg.ep_size}")
    if int(os.environ.get("RANK", "0")) == 0:
        _log(f"expert parallel: EP size {cfg.ep_size} over torch.distributed ({backend})")


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda}); use "
                         "--device cpu")
    return dev


def _resolve_autocast(dtype: str, device: torch.device) -> Optional[torch.dtype]:
    if dtype == "float32" or (dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def _cache_dir(cfg: TrainConfig) -> str:
    if cfg.cache_dir:
        return cfg.cache_dir
    return os.environ.get("LRMOE_CACHE_DIR") or os.path.join(os.path.expanduser("~"),
                                                            ".cache", "lrmoe")


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _param_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or name.endswith(".bias") or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _diagnostics_means(model: nn.Module) -> Dict[str, Optional[float]]:
    from lrmoe.integrations.transformers import collect_diagnostics

    diags = collect_diagnostics(model)
    keys = ("dropped_fraction", "retained_mass", "load_max_over_mean_before",
            "load_max_over_mean_after")
    return {k: _mean([d.get(k) for d in diags.values()]) for k in keys}


class Trainer:
    """One training run; see :func:`train`.

    Args:
        cfg: the run's config.
        resume: checkpoint directory to continue from (see :func:`find_checkpoint`), or
            None for a fresh run.
        overwrite: a fresh run may replace the run files (metrics, checkpoints, plot,
            summary) already in ``cfg.out_dir``.
        step_callback: called as ``step_callback(trainer, step)`` after every step (tests,
            custom logging); ``trainer.request_stop()`` ends the run like Ctrl-C.

    Raises:
        FileExistsError: a fresh run into an ``out_dir`` that holds a run, without
            ``overwrite``.
        ValueError: a config incompatible with the checkpoint (names each field), bad data.
        FileNotFoundError: missing checkpoint, data or tokenizer.
    """

    def __init__(self, cfg: TrainConfig, *, resume: Optional[str | os.PathLike] = None,
                 overwrite: bool = False,
                 step_callback: Optional[Callable[["Trainer", int], None]] = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.ep_rank = _ep_rank(cfg)
        if _expert_parallel(cfg):
            _init_expert_parallel(cfg)  # a wrong world size fails before any file is written
        self.out_dir = Path(cfg.out_dir)
        if self.ep_rank > 0:
            self.out_dir = self.out_dir / f"ep-rank-{self.ep_rank}"
            if resume is not None:  # this rank's shard of the same checkpoint
                ckpt = Path(resume)
                resume = ckpt.parent.parent / f"ep-rank-{self.ep_rank}" / ckpt.parent.name \
                    / ckpt.name
        self.step_callback = step_callback
        self.stop_requested = False
        self._stop_all = False  # expert parallel: some rank asked to stop (agreed)
        self.step = 0
        self.last_checkpoint: Optional[Path] = None
        self._last_saved_step = -1
        self._state: Optional[Dict[str, Any]] = None
        self.resume_from = Path(resume) if resume is not None else None
        if self.resume_from is not None:
            self._prepare_resume()
        else:
            self._prepare_fresh(overwrite)

    # ------------------------------------------------------------------ set-up
    def _prepare_resume(self) -> None:
        ckpt = self.resume_from
        assert ckpt is not None
        if not (ckpt / STATE_FILE).is_file():
            if self.ep_rank > 0:
                raise FileNotFoundError(
                    f"no checkpoint of EP rank {self.ep_rank} at {ckpt}: the checkpoint was "
                    "written with another EP size (or without --ep); resume with the --ep "
                    "it was saved with")
            raise FileNotFoundError(f"{ckpt} is not a checkpoint (no {STATE_FILE}); pass a "
                                    "checkpoint directory (checkpoints/step-XXXXXXXX) or a "
                                    "run directory")
        saved = read_checkpoint_config(ckpt)
        self._state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
        decay = int(self._state["lr_decay_steps"])
        check_resume_compatible(saved, self.cfg, decay)
        self.decay_steps = decay
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def _prepare_fresh(self, overwrite: bool) -> None:
        self.decay_steps = self.cfg.lr_decay_steps or self.cfg.steps
        owned = [self.out_dir / n for n in (METRICS_FILE, CURVE_FILE, SUMMARY_FILE)]
        has_run = any(p.exists() for p in owned) or (self.out_dir / "checkpoints").exists()
        if self.ep_rank > 0 and not overwrite:
            # rank 0 refuses a run dir that holds a run: so does every other rank, before
            # it writes into its ep-rank-r folder (not by metrics.jsonl: rank 0 may have
            # just created it for this run)
            root = self.out_dir.parent
            has_run = has_run or any((root / n).exists()
                                     for n in ("checkpoints", SUMMARY_FILE, CURVE_FILE))
        if has_run:
            if not overwrite:
                where = self.out_dir.parent if self.ep_rank > 0 else self.out_dir
                ckpts = list_checkpoints(where)
                last = f" (last checkpoint: {ckpts[-1].name})" if ckpts else ""
                raise FileExistsError(
                    f"{where} already holds a run{last}; continue it with --resume, "
                    "start over with --overwrite, or choose another --out")
            for p in owned:
                p.unlink(missing_ok=True)
            shutil.rmtree(self.out_dir / "checkpoints", ignore_errors=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / METRICS_FILE).write_text("")

    def _setup(self) -> None:
        from lrmoe.data import load_data

        cfg = self.cfg
        _quiet_transformers()
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.ep_group = None
        # expert shards are saved per rank only when there is more than one rank: at EP
        # size 1 rank 0 holds every expert and writes an ordinary transformers checkpoint
        self.sharded = cfg.ep_size > 1
        if _expert_parallel(cfg):
            import torch.distributed as dist

            global _QUIET
            self.ep_group = dist.group.WORLD  # joined in __init__
            _QUIET = self.ep_rank > 0
            if cfg.device in ("auto", "cuda") and torch.cuda.is_available():
                cfg.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        self.device = _resolve_device(cfg.device)
        self.autocast_dtype = _resolve_autocast(cfg.dtype, self.device)
        if self.device.type == "cuda":
            if self.device.index is not None:
                torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.cuda.reset_peak_memory_stats(self.device)

        tokenizer = cfg.tokenizer
        init_tokenizer = Path(cfg.init_from) / "tokenizer.json" if cfg.init_from else None
        if tokenizer is None and init_tokenizer is not None and init_tokenizer.is_file():
            tokenizer = str(init_tokenizer)
        if tokenizer is not None and not Path(tokenizer).is_file():
            raise FileNotFoundError(f"tokenizer {tokenizer}: no such file (a tokenizers "
                                    "tokenizer.json)")
        t = time.perf_counter()
        if self.ep_group is not None and self.ep_rank > 0:
            torch.distributed.barrier()  # rank 0 fills the data/tokenizer cache first
        self.data = load_data(cfg.data, seq_len=cfg.seq_len, cache_dir=_cache_dir(cfg),
                              tokenizer=tokenizer, vocab_size=cfg.vocab_size,
                              val_fraction=cfg.val_fraction, max_records=cfg.max_records,
                              seed=cfg.seed)
        if self.ep_group is not None and self.ep_rank == 0:
            torch.distributed.barrier()
        for line in self.data.report.lines():
            _log(line)
        _log(f"data ready in {time.perf_counter() - t:.1f} s: {len(self.data.train)} training "
             f"and {len(self.data.val)} validation sequences of {cfg.seq_len} tokens, vocab "
             f"{self.data.vocab_size}")
        if len(self.data.train) < cfg.batch_size:
            raise ValueError(f"the training split has {len(self.data.train)} sequences, fewer "
                             f"than batch_size={cfg.batch_size}; lower batch_size or add data")
        if len(self.data.val) == 0:
            raise ValueError("the validation split is empty; raise val_fraction or add data")
        self.data_fingerprint = {
            "train_sequences": len(self.data.train), "val_sequences": len(self.data.val),
            "tokenizer_sha256": _file_sha256(self.data.tokenizer_path),
            "train_ids_sum": int(self.data.train.input_ids.sum()),
            "val_ids_sum": int(self.data.val.input_ids.sum())}
        if self._state is not None:
            saved = self._state["data_fingerprint"]
            diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
                     for k, v in self.data_fingerprint.items() if saved.get(k) != v]
            if diffs:
                raise ValueError("cannot resume: the data differ from the checkpoint's (the "
                                 "data files or the tokenizer changed):\n  " + "\n  ".join(diffs))

        self.model = self._build_model()
        from lrmoe.integrations.transformers import patch_moe_blocks

        patched = patch_moe_blocks(self.model, ep_group=self.ep_group, **cfg.lrmoe_settings)
        if not patched:
            raise ValueError(f"the model ({type(self.model).__name__}) has no sparse-MoE block "
                             "that lrmoe can replace")
        self.lrmoe_layers = dict(patched)
        if self.sharded and self.resume_from is not None:
            self._load_ep_weights(self.resume_from)
        self.trace = None
        if cfg.record_trace:
            from lrmoe.trace import RoutingTrace
            self.trace = RoutingTrace(cfg.model.num_experts, cfg.model.num_experts_per_tok,
                                      cfg.trace_every)
            for index, (_, layer) in enumerate(patched):
                layer.trace, layer.layer_index = self.trace, index
        self.model.to(self.device)
        self.model.train()
        self.aux_coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0)

        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
            eps=cfg.adam_eps, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, lr=cfg.lr, min_lr=cfg.min_lr,
                                                warmup_steps=cfg.warmup_steps,
                                                decay_steps=self.decay_steps))
        self.stream = _BatchStream(self.data.train, cfg.batch_size, cfg.seed)
        self.tokens_seen = 0
        self.elapsed_before = 0.0
        if self._state is not None:
            self._load_state(self._state)

    def _build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = self.cfg
        source = self.resume_from or (Path(cfg.init_from) if cfg.init_from else None)
        if self.sharded and self.resume_from is not None:
            source = None  # expert-sharded weights: built whole, sharded, then loaded
        if source is not None:
            if not (source / "config.json").is_file():
                raise FileNotFoundError(f"init_from {source}: no config.json; expected a "
                                        "transformers checkpoint directory (save_pretrained)")
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            vocab = model.config.vocab_size
            if self.data.vocab_size > vocab:
                raise ValueError(f"the tokenizer has {self.data.vocab_size} tokens but the model "
                                 f"{source} only {vocab} embeddings; use the model's tokenizer "
                                 "(--tokenizer DIR/tokenizer.json)")
            _log(f"model: {type(model).__name__} from {source}")
        else:
            torch.manual_seed(cfg.seed)
            m = cfg.model
            hf = Qwen3MoeConfig(
                vocab_size=self.data.vocab_size, hidden_size=m.hidden_size,
                num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                intermediate_size=m.intermediate_size,
                moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
                num_experts_per_tok=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
                router_aux_loss_coef=m.router_aux_loss_coef,
                max_position_embeddings=m.max_position_embeddings,
                pad_token_id=self.data.pad_id, eos_token_id=self.data.eos_id,
                bos_token_id=None, tie_word_embeddings=False)
            model = Qwen3MoeForCausalLM(hf)
            _log("model: Qwen3MoeForCausalLM, random init")
        n_params = sum(p.numel() for p in model.parameters())
        _log(f"model: {n_params / 1e6:.2f} M parameters")
        self.num_params = n_params
        return model

    def _load_ep_weights(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        files = sorted(ckpt.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{ckpt}: no *.safetensors weights of this EP rank")
        weights: Dict[str, Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        self.model.load_state_dict(weights, strict=False)
        own = self.model.state_dict()
        missing = [k for k in own if k not in weights and not k.endswith("rotary_emb.inv_freq")]
        bad = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
        if bad or missing:
            raise ValueError(f"{ckpt}: weights do not fit this rank's expert shard "
                             f"(shape mismatch: {bad[:3]}, missing: {missing[:3]}); resume "
                             "with the same ep_size")

    # ------------------------------------------------------------------ state
    def _load_state(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.stream = _BatchStream(self.data.train, self.cfg.batch_size, self.cfg.seed,
                                   **{k: int(v) for k, v in state["data_position"].items()})
        counters = state["lrmoe_backward_steps"]
        for name, layer in self.lrmoe_layers.items():
            layer.stats.backward_steps = int(counters[name])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed_before = float(state["elapsed_s"])
        self._rng_to_restore = state["rng"]
        self._last_saved_step = self.step
        self.last_checkpoint = self.resume_from
        _log(f"resumed from {self.resume_from} at step {self.step} (epoch "
             f"{self.stream.epoch}, batch {self.stream.index})")

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-XXXXXXXX`` atomically (temp dir, then rename) and keep
        the newest ``keep_checkpoints``. Returns the checkpoint directory."""
        root = self.out_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"{CHECKPOINT_PREFIX}{self.step:08d}"
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if not self.sharded:
            self.model.save_pretrained(tmp, safe_serialization=True)
        else:
            # this rank's expert shards + the dense weights, raw state-dict keys (a
            # transformers from_pretrained cannot read a shard; resume reads it)
            from safetensors.torch import save_file

            self.model.config.save_pretrained(tmp)
            save_file({k: v.detach().contiguous().cpu()
                       for k, v in self.model.state_dict().items()},
                      str(tmp / f"model-ep-rank-{self.ep_rank}.safetensors"))
        shutil.copyfile(self.data.tokenizer_path, tmp / "tokenizer.json")
        (tmp / TRAIN_CONFIG_FILE).write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        self._metrics.flush()
        shutil.copyfile(self.out_dir / METRICS_FILE, tmp / METRICS_FILE)
        state = {
            "format": 1,
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            "data_position": self.stream.position(),
            "lrmoe_backward_steps": {n: int(l.stats.backward_steps)
                                     for n, l in self.lrmoe_layers.items()},
            "lr_decay_steps": int(self.decay_steps),
            "tokens_seen": int(self.tokens_seen),
            "elapsed_s": float(self.elapsed_before + time.perf_counter() - self._t_start),
            "metrics_bytes": int((self.out_dir / METRICS_FILE).stat().st_size),
            "data_fingerprint": self.data_fingerprint,
            "ep_size": int(self.cfg.ep_size), "ep_rank": int(self.ep_rank),
        }
        torch.save(state, tmp / STATE_FILE)
        if final.exists():
            trash = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(self.out_dir)[:-self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        self._last_saved_step = self.step
        self.last_checkpoint = final
        return final

    # ------------------------------------------------------------------ signals
    def request_stop(self) -> None:
        """End the run after the current step, with a checkpoint (what Ctrl-C does)."""
        self.stop_requested = True

    def _stop_agreed(self) -> bool:
        """Whether to stop now. Under expert parallelism every rank must stop after the
        same step (a rank that stopped alone would leave the others waiting in the next
        step's all-to-all, and the shards of the last checkpoint would not match): each
        step's loss all-reduce carries the ranks' stop flags (:meth:`_train_step`), so a
        stop on any rank stops all after the same step at no extra collective."""
        return self._stop_all if self.ep_group is not None else self.stop_requested

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.request_stop()
        # a second Ctrl-C aborts at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _log(f"Ctrl-C: stopping after the step in progress ({self.step} done) and saving a "
             "checkpoint (Ctrl-C again aborts without saving)")

    # ------------------------------------------------------------------ the loop
    def _write_metrics(self, record: Mapping[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def _train_step(self) -> Dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        world = cfg.ep_size
        # rank-strided: every rank reads the same stream and keeps every world-th batch
        micro = [[self.stream.next() for _ in range(world)][self.ep_rank]
                 for _ in range(cfg.grad_accum)]
        num_loss = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        denom = max(num_loss, 1)
        self.optimizer.zero_grad(set_to_none=True)
        nll_total = torch.zeros((), dtype=torch.float32, device=self.device)
        aux_total: Optional[Tensor] = None
        for ids, labels in micro:
            ids = ids.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with _autocast(self.device, self.autocast_dtype):
                out = self.model(input_ids=ids, use_cache=False, output_router_logits=True)
            nll, _ = causal_lm_nll(out.logits, labels)
            loss = nll / denom
            aux = getattr(out, "aux_loss", None)
            if isinstance(aux, Tensor):
                loss = loss + self.aux_coef * aux.float() / cfg.grad_accum
                aux_total = aux.detach().float() if aux_total is None else aux_total + aux.detach()
            loss.backward()
            nll_total += nll.detach()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if self.ep_group is not None:
            from lrmoe import parallel

            # loss = mean of the ranks' losses: average dense grads, scale expert grads
            parallel.allreduce_non_expert_grads(self.model, self.ep_group)
            grad_norm = parallel.clip_grad_norm_(self.model, max_norm, self.ep_group)
            # token count and stop flags ride along with the loss (one sync for both)
            totals = torch.cat([nll_total.detach().float().reshape(1), torch.tensor(
                [float(num_loss), float(self.stop_requested)], device=self.device)])
            torch.distributed.all_reduce(totals, group=self.ep_group)
            nll_total = totals[0]
            num_loss, stops = (int(v) for v in totals[1:].tolist())
            if stops:
                self._stop_all = self.stop_requested = True
            denom = max(num_loss, 1)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        if self.trace is not None:
            self.trace.step = self.step
        lm_loss = float(nll_total) / denom
        if not math.isfinite(lm_loss):
            raise FloatingPointError(
                f"step {self.step}: the loss is {lm_loss}; lower lr (now {cfg.lr}) or raise "
                "warmup_steps")
        tokens = sum(ids.numel() for ids, _ in micro) * world
        self.tokens_seen += tokens
        dt = time.perf_counter() - t0
        return {"kind": "train", "step": self.step, "loss": lm_loss,
                "ppl": math.exp(min(lm_loss, 700.0)),
                "aux_loss": None if aux_total is None else float(aux_total) / cfg.grad_accum,
                "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens,
                "loss_tokens": num_loss, "tokens_per_s": tokens / dt if dt > 0 else None,
                "time_s": dt}

    def _evaluate(self, progress: Optional[_Progress]) -> Dict[str, Any]:
        res = evaluate(self.model, self.data.val, self.cfg.batch_size, self.cfg.eval_batches,
                       self.device, self.autocast_dtype)
        record = {"kind": "eval", "step": self.step, **res}
        self._write_metrics(record)
        self._evals.append(record)
        text = f"step {self.step}: validation loss {res['val_loss']:.4f}, ppl {res['val_ppl']:.2f}"
        if progress is not None:
            progress.write(text)
        else:
            _log(text)
        write_loss_curve(self.out_dir / METRICS_FILE, self.out_dir / CURVE_FILE,
                         title=self._plot_title())
        return record

    def _plot_title(self) -> str:
        c = self.cfg
        return f"{Path(c.out_dir).name}: c={c.recalibration_rate:g}, metric={c.metric}"

    def run(self) -> TrainResult:
        """Set up, train to ``cfg.steps`` (or Ctrl-C), save, summarise. torch's thread
        count is restored afterwards."""
        threads = torch.get_num_threads()
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)

    def _run(self) -> TrainResult:
        self._setup()
        cfg = self.cfg
        if self.resume_from is not None and self.step >= cfg.steps:
            # nothing to train: leave the finished run's metrics and summary as they are
            _log(f"the run in {self.out_dir} is complete at step {self.step} (steps="
                 f"{cfg.steps}); pass --steps N with N > {self.step} to train further")
            summary_file = self.out_dir / SUMMARY_FILE
            summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            return TrainResult(self.step, False, self.out_dir, self.resume_from, summary,
                               self.model)
        if self.resume_from is not None:
            # the log up to the checkpoint's step: the resumed file equals a straight run's
            shutil.copyfile(self.resume_from / METRICS_FILE, self.out_dir / METRICS_FILE)
        self._t_start = time.perf_counter()
        self._metrics = open(self.out_dir / METRICS_FILE, "a")
        self._evals: List[Dict[str, Any]] = []
        self._records: List[Dict[str, Any]] = []
        start_step = self.step
        interrupted = False
        old_handler = None
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, self._on_sigint)
        progress: Optional[_Progress] = None
        try:
            if hasattr(self, "_rng_to_restore"):
                _set_rng_state(self._rng_to_restore)
            else:
                self._evaluate(None)
            progress = _Progress(cfg.progress, cfg.steps, self.step, cfg.log_every)
            _log(f"training steps {self.step + 1}..{cfg.steps} on {self.device} "
                 f"({'bf16 autocast' if self.autocast_dtype else 'float32'}); "
                 f"LRMoE c={cfg.recalibration_rate:g} metric={cfg.metric} "
                 f"quota={cfg.quota_rule} selection={cfg.selection}; Ctrl-C saves and stops")
            while self.step < cfg.steps and not self._stop_agreed():
                record = self._train_step()
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    record.update(_diagnostics_means(self.model))
                    self._records.append(record)
                    self._write_metrics(record)
                progress.update(self.step, cfg.steps, _progress_text(record))
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._evaluate(progress)
                if self.step_callback is not None:
                    self.step_callback(self, self.step)
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
            interrupted = self.stop_requested and self.step < cfg.steps
            if self._last_saved_step != self.step:
                self.save_checkpoint()
            if not interrupted and not (self._evals and self._evals[-1]["step"] == self.step):
                self._evaluate(progress)  # after the checkpoint: a resume drops this line
        finally:
            if progress is not None:
                progress.close()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            self._metrics.close()
        if self.trace is not None and self.trace.records:
            _log(f"routing trace: {self.trace.save(cfg.record_trace)}")
        write_loss_curve(self.out_dir / METRICS_FILE, self.out_dir / CURVE_FILE,
                         title=self._plot_title())
        summary = self._summary(start_step, interrupted)
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if not _QUIET:
            print_summary(summary)
        if interrupted:
            launch = (f"torchrun --nproc-per-node {cfg.ep_size} -m lrmoe train --ep "
                      f"{cfg.ep_size}" if self.ep_group is not None else "lrmoe train")
            _log(f"interrupted at step {self.step}; checkpoint {self.last_checkpoint}. "
                 f"Continue with: {launch} --out {cfg.out_dir} --resume")
        return TrainResult(step=self.step, interrupted=interrupted, out_dir=self.out_dir,
                           checkpoint=self.last_checkpoint, summary=summary, model=self.model)

    def _summary(self, start_step: int, interrupted: bool) -> Dict[str, Any]:
        wall = time.perf_counter() - self._t_start
        evals = [r for r in read_metrics(self.out_dir / METRICS_FILE) if r["kind"] == "eval"]
        run_tokens = sum(r["tokens"] for r in self._records)
        steps_run = self.step - start_step
        if self.device.type == "cuda":
            memory = {"peak_cuda_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        else:
            memory = {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        train_time = sum(r["time_s"] for r in self._records)
        return {
            "steps": self.step, "steps_this_run": steps_run, "interrupted": interrupted,
            "tokens": self.tokens_seen, "wall_time_s": wall,
            "tokens_per_s": run_tokens / train_time if train_time > 0 else None,
            "params_millions": self.num_params / 1e6,
            "first_val_ppl": evals[0]["val_ppl"] if evals else None,
            "first_val_step": evals[0]["step"] if evals else None,
            "last_val_ppl": evals[-1]["val_ppl"] if evals else None,
            "last_val_step": evals[-1]["step"] if evals else None,
            "last_train_loss": self._records[-1]["loss"] if self._records else None,
            "dropped_fraction": _mean([r.get("dropped_fraction") for r in self._records]),
            "retained_mass": _mean([r.get("retained_mass") for r in self._records]),
            "device": str(self.device), **memory,
            "recalibration_rate": self.cfg.recalibration_rate, "metric": self.cfg.metric,
            "out_dir": str(self.out_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }


def _progress_text(r: Mapping[str, Any]) -> str:
    parts = [f"loss {r['loss']:.3f}", f"ppl {r['ppl']:.1f}"]
    if r.get("tokens_per_s"):
        parts.append(f"tok/s {r['tokens_per_s']:.0f}")
    if r.get("dropped_fraction") is not None:
        parts.append(f"drop {100 * r['dropped_fraction']:.1f}%")
    if r.get("retained_mass") is not None:
        parts.append(f"rho {r['retained_mass']:.3f}")
    return "  ".join(parts)


def train(cfg: TrainConfig, *, resume: Optional[str | os.PathLike] = None,
          overwrite: bool = False,
          step_callback: Optional[Callable[[Trainer, int], None]] = None) -> TrainResult:
    """Train (or fine-tune) a Qwen3-MoE model with LRMoE layers; see the module docstring
    for the files written.

    The model is built from ``cfg.model`` (random init, seed ``cfg.seed``) or loaded from
    ``cfg.init_from``; every sparse-MoE block is replaced by an LRMoE layer holding the same
    parameters (``lrmoe.integrations.transformers.patch_moe_blocks``). Loss = mean
    next-token NLL over the loss tokens of the step's micro-batches + router_aux_loss_coef
    * the model's load-balancing loss. SIGINT (Ctrl-C) finishes the current step, saves a
    checkpoint and returns with ``interrupted=True``; a second SIGINT raises
    KeyboardInterrupt.

    Resume is exact: a run resumed from a checkpoint produces the same losses (bitwise on
    the CPU) and the same ``metrics.jsonl`` records (up to the timing fields) as one run
    straight through.

    Args:
        cfg: the run's :class:`TrainConfig`.
        resume: a checkpoint directory (``find_checkpoint`` resolves run directories), or
            None for a fresh run.
        overwrite: let a fresh run replace the run files already in ``cfg.out_dir``.
        step_callback: ``f(trainer, step)`` after every step.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: invalid or resume-incompatible config, unusable data.
        FileExistsError: ``out_dir`` holds a run and neither ``resume`` nor ``overwrite``.
        FileNotFoundError: missing checkpoint, init_from, tokenizer or data.
    """
    return Trainer(cfg, resume=resume, overwrite=overwrite, step_callback=step_callback).run()


# ====================================================================== outputs
def read_metrics(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def write_loss_curve(metrics_path: str | os.PathLike, png_path: str | os.PathLike,
                     title: str = "") -> None:
    """Plot training loss (per logged step) and validation loss against the step (PNG, Agg
    backend, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train_r = [r for r in records if r["kind"] == "train"]
    eval_r = [r for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train_r:
        ax.plot([r["step"] for r in train_r], [r["loss"] for r in train_r], lw=0.8,
                alpha=0.8, label="train loss")
    if eval_r:
        ax.plot([r["step"] for r in eval_r], [r["val_loss"] for r in eval_r], "o-", lw=1.5,
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if train_r or eval_r:
        ax.legend()
    fig.tight_layout()
    tmp = Path(str(png_path) + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)


def print_summary(summary: Mapping[str, Any], file: Any = None) -> None:
    """Print the run summary as a table (rich) to stdout."""
    from rich.console import Console
    from rich.table import Table

    def fmt(v: Any, spec: str = "") -> str:
        if v is None:
            return "-"
        return format(v, spec) if spec else str(v)

    rows = [
        ("steps", f"{summary['steps']} ({summary['steps_this_run']} in this run)"
         + (", interrupted" if summary.get("interrupted") else "")),
        ("tokens", fmt(summary["tokens"], ",")),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("tokens/s", fmt(summary["tokens_per_s"], ",.0f")),
        ("parameters", f"{summary['params_millions']:.2f} M"),
        ("val ppl (first)", f"{fmt(summary['first_val_ppl'], '.2f')} at step "
                            f"{fmt(summary['first_val_step'])}"),
        ("val ppl (last)", f"{fmt(summary['last_val_ppl'], '.2f')} at step "
                           f"{fmt(summary['last_val_step'])}"),
        ("dropped fraction", fmt(summary["dropped_fraction"], ".2%")),
        ("retained mass rho", fmt(summary["retained_mass"], ".4f")),
    ]
    if "peak_cuda_memory_gib" in summary:
        rows.append(("peak CUDA memory", f"{summary['peak_cuda_memory_gib']:.2f} GiB"))
    else:
        rows.append(("max RSS", f"{summary['max_rss_gib']:.2f} GiB"))
    rows += [("device", summary["device"]), ("out dir", summary["out_dir"])]
    table = Table(title=f"lrmoe train: c={summary['recalibration_rate']:g}, "
                        f"metric={summary['metric']}")
    table.add_column("")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    Console(file=file or sys.stdout).print(table)
