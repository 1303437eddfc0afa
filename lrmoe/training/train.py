"""``lrmoe train``: train or fine-tune a transformers Qwen3-MoE model whose sparse-MoE blocks
are LRMoE layers (exact forward, planned backward).

The entry point :func:`train` and the names the command line and users need; the parts
live in :mod:`lrmoe.training` (settings in :mod:`lrmoe.training.config`, the loop in
:mod:`lrmoe.training.trainer`).

Files of a run (``run.out_dir``): ``metrics.jsonl`` (:mod:`lrmoe.training.metrics`),
``loss_curve.png``, ``summary.json``, ``tensorboard/`` (with ``run.tensorboard``),
``checkpoints/step-XXXXXXXX/`` (:mod:`lrmoe.training.checkpoint`), ``export/`` (a plain
transformers checkpoint of the last step, ``run.export``; :mod:`lrmoe.training.export`)
and, under expert parallelism, ``ep-rank-r/`` with the same files of rank r.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from lrmoe.utils.extras import TRAIN_CORE, require

# the entry of the trainer (lrmoe train and users import it): before the imports that need
# transformers and tokenizers, a missing package is one line naming the extra
require("train", "lrmoe's trainer (lrmoe train)", TRAIN_CORE)

from lrmoe.training.checkpoint import (find_checkpoint, list_checkpoints,
                                       read_checkpoint_config)
from lrmoe.training.compose import (PRESETS, RESUME_MUTABLE_FIELDS, build_config,
                                    check_resume_compatible, config_yaml, get_preset,
                                    parse_set)
from lrmoe.training.config import (FLAT_KEYS, SECTIONS, DataConfig, BackwardConfig,
                                   ModelConfig, OptimConfig, ParallelConfig, RunConfig,
                                   TrainConfig, config_keys)
from lrmoe.training.loss import causal_lm_nll, evaluate
from lrmoe.training.metrics import print_summary, read_metrics, write_loss_curve
from lrmoe.training.optim import lr_factor
from lrmoe.training.trainer import Trainer, TrainResult

__all__ = [
    "train", "Trainer", "TrainResult", "TrainConfig", "ModelConfig", "DataConfig",
    "OptimConfig", "BackwardConfig", "ParallelConfig", "RunConfig", "PRESETS", "SECTIONS",
    "FLAT_KEYS", "RESUME_MUTABLE_FIELDS", "build_config", "config_keys", "config_yaml",
    "get_preset", "parse_set", "check_resume_compatible", "find_checkpoint",
    "list_checkpoints", "read_checkpoint_config", "lr_factor", "causal_lm_nll", "evaluate",
    "read_metrics", "write_loss_curve", "print_summary"]


def train(cfg: TrainConfig, *, resume: Optional[str | os.PathLike] = None,
          overwrite: bool = False,
          step_callback: Optional[Callable[[Trainer, int], None]] = None) -> TrainResult:
    """Train (or fine-tune) a Qwen3-MoE model with LRMoE layers.

    The model is built from ``cfg.model`` (random init, seed ``cfg.run.seed``) or loaded
    from ``cfg.model.init_from``; every sparse-MoE block is replaced by an LRMoE layer
    holding the same parameters (``lrmoe.integrations.transformers.patch_moe_blocks``).
    Loss = mean next-token NLL over the loss tokens of the step's micro-batches +
    router_aux_loss_coef * the load-balancing loss over the real (non-padding) tokens
    (:func:`lrmoe.training.loss.lm_forward`). SIGINT (Ctrl-C) finishes the current step,
    saves a checkpoint and returns with ``interrupted=True``; a second SIGINT raises
    KeyboardInterrupt. Nothing is written into the run directory before set-up (data,
    model, optimizer) succeeded.

    Resume is exact: a run resumed from a checkpoint produces the same losses (bitwise on
    the CPU) and the same ``metrics.jsonl`` records (up to the timing fields) as one run
    straight through.

    Args:
        cfg: the run's :class:`TrainConfig`.
        resume: a checkpoint directory (``find_checkpoint`` resolves run directories), or
            None for a fresh run.
        overwrite: let a fresh run replace the run files already in ``cfg.run.out_dir``.
        step_callback: ``f(trainer, step)`` after every step.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: invalid or resume-incompatible config, unusable data, bad device.
        FileExistsError: ``out_dir`` holds a run and neither ``resume`` nor ``overwrite``.
        FileNotFoundError: missing checkpoint, init_from, tokenizer or data.
    """
    return Trainer(cfg, resume=resume, overwrite=overwrite, step_callback=step_callback).run()
