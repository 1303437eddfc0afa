"""The sections of ``lrmoe train``'s settings, one dataclass each, validated once
(:class:`lrmoe.training.config.TrainConfig` gathers them; the module docstring of
:mod:`lrmoe.training.config` describes the names).
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

# the ``lrmoe`` section is the layer's own schema: one definition, one validation
from lrmoe.moe.config import SEED_LIMIT, BackwardConfig

DTYPES = ("auto", "float32", "bfloat16")
PROGRESS = ("auto", "bar", "lines", "none")
#: transformers attention implementations ``run.attention`` takes
ATTENTION = ("sdpa", "flex_attention")
SECTIONS = ("model", "data", "optim", "lrmoe", "parallel", "run")


# ====================================================================== checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(key: str, value: Any, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < low:
        kind = {0: "an int >= 0", 1: "a positive int"}.get(low, f"an int >= {low}")
        raise ValueError(f"{key} must be {kind}{' or null' if optional else ''}, got {value!r}")


def _number(key: str, value: Any, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{key} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")


def _choice(key: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


def _path(key: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty path{' or null' if optional else ''}, "
                         f"got {value!r}")


# ====================================================================== sections
@dataclass
class ModelConfig:
    """``model``: the architecture of a randomly initialised Qwen3-MoE model (transformers
    ``Qwen3MoeConfig`` fields; the vocabulary size comes from the tokenizer), or the
    checkpoint to fine-tune.

    Attributes:
        hidden_size: H, model width.
        num_hidden_layers: decoder layers, every one with a sparse-MoE block.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); divides
            ``num_attention_heads``.
        head_dim: width of one attention head.
        intermediate_size: width of the dense MLP (only layers that
            ``Qwen3MoeConfig.mlp_only_layers`` makes dense use it; none here).
        moe_intermediate_size: I, width of each SwiGLU expert.
        num_experts: E routed experts per layer.
        num_experts_per_tok: K, experts per token (top-k), ``1 <= K <= E``.
        norm_topk_prob: renormalise the K routing weights to sum to 1.
        router_aux_loss_coef: weight of the load-balancing loss added to the LM loss.
        max_position_embeddings: longest sequence the rotary embedding is set up for
            (>= ``data.seq_len``).
        init_from: directory of a transformers checkpoint (``config.json`` +
            ``*.safetensors``) to fine-tune; its architecture then replaces the fields
            above and its ``tokenizer.json`` is used unless ``data.tokenizer`` is set
            (one of the two must exist: a newly trained tokenizer would not match the
            embeddings). None: random initialisation.
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
    init_from: Optional[str] = None

    def validate(self) -> None:
        """Raises ValueError naming ``model.<field>`` on an invalid value."""
        for f in dataclasses.fields(self):
            if f.type in ("int", int):
                _int(f"model.{f.name}", getattr(self, f.name), 1)
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"model.norm_topk_prob must be true or false, got "
                             f"{self.norm_topk_prob!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"model.num_experts={self.num_experts}; choose 1 <= K <= E")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_key_value_heads={self.num_key_value_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}")
        _number("model.router_aux_loss_coef", self.router_aux_loss_coef)
        _path("model.init_from", self.init_from)


@dataclass
class DataConfig:
    """``data``: what is read and how it is cut into batches.

    Attributes:
        source: ``gcide`` (Alpaca-style definitions built from Debian's ``dict-gcide``),
            ``alpaca:PATH`` (JSON list or JSONL with instruction / input / output) or
            ``text:PATH`` (a plain-text file or a folder of them). Flat name: ``data``.
        tokenizer: path of a ``tokenizer.json``; None trains a byte-level BPE on the
            training split (cached in ``cache_dir``).
        vocab_size: vocabulary size of a trained tokenizer.
        max_records: use at most this many records (None: all).
        val_fraction: share of records held out for validation, in (0, 1).
        cache_dir: where tokenizers and tokenised data are cached; None:
            ``$LRMOE_CACHE_DIR`` or ``~/.cache/lrmoe``.
        seq_len: S, tokens per training sequence (block).
        batch_size: B, sequences per micro-batch (per rank under expert parallelism).
        grad_accum: micro-batches per optimizer step.
        isolate_examples: the examples packed into one block do not attend to each other
            and their positions restart at 0 (docs/training.md "Your own data or model");
            False: a block is one causal sequence.
        split_seed: salt of the record selection and train/validation split hashes. Fixed
            (0) by default, so that every ``run.seed`` (which moves initialisation and batch
            order) evaluates on the same held-out set and the differences between two
            settings of one seed are paired. None: ``run.seed``, the behaviour before this
            field existed (what a checkpoint without it reads as).
    """

    source: str = "gcide"
    tokenizer: Optional[str] = None
    vocab_size: int = 4096
    max_records: Optional[int] = None
    val_fraction: float = 0.02
    cache_dir: Optional[str] = None
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    isolate_examples: bool = True
    split_seed: Optional[int] = 0

    def validate(self) -> None:
        """Raises ValueError naming ``data.<field>`` on an invalid value."""
        if not isinstance(self.source, str) or not (
                self.source == "gcide" or self.source.startswith(("alpaca:", "text:"))):
            raise ValueError(f"data.source must be gcide, alpaca:PATH or text:PATH; got "
                             f"{self.source!r}")
        for name in ("vocab_size", "seq_len", "batch_size", "grad_accum"):
            _int(f"data.{name}", getattr(self, name), 1)
        _int("data.max_records", self.max_records, 1, optional=True)
        _int("data.split_seed", self.split_seed, 0, optional=True)
        _number("data.val_fraction", self.val_fraction)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        _path("data.tokenizer", self.tokenizer)
        _path("data.cache_dir", self.cache_dir)
        if not isinstance(self.isolate_examples, bool):
            raise ValueError(f"data.isolate_examples must be true or false, got "
                             f"{self.isolate_examples!r}")


@dataclass
class OptimConfig:
    """``optim``: AdamW and the learning-rate schedule (:mod:`lrmoe.training.optim`).

    Attributes:
        lr: peak learning rate (after warm-up).
        min_lr: final learning rate of the cosine decay.
        warmup_steps: linear warm-up from lr / warmup_steps to lr over this many steps.
        lr_decay_steps: step at which the cosine reaches ``min_lr`` (it stays there after);
            None: ``run.steps`` of the run that started the schedule (a resume keeps it).
        weight_decay: AdamW decoupled weight decay (not applied to norms and biases).
        betas: AdamW (beta1, beta2).
        adam_eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this value; 0 disables clipping (the
            norm is still logged).
    """

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: Optional[int] = None
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0

    def validate(self) -> None:
        """Raises ValueError naming ``optim.<field>`` on an invalid value."""
        _number("optim.lr", self.lr, positive=True)
        for name in ("min_lr", "weight_decay", "adam_eps", "grad_clip"):
            _number(f"optim.{name}", getattr(self, name))
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} exceeds optim.lr={self.lr}; the "
                             "cosine decays from lr to min_lr")
        _int("optim.warmup_steps", self.warmup_steps, 0)
        _int("optim.lr_decay_steps", self.lr_decay_steps, 1, optional=True)
        if self.lr_decay_steps is not None and self.lr_decay_steps < self.warmup_steps:
            raise ValueError(f"optim.lr_decay_steps={self.lr_decay_steps} is smaller than "
                             f"optim.warmup_steps={self.warmup_steps}")
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2 or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                for b in self.betas)):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")


@dataclass
class ParallelConfig:
    """``parallel``: how the run is spread over processes.

    Attributes:
        ep_size: expert-parallel size (``--ep N``); 1 = one process. N > 1 runs under
            ``torchrun --nproc-per-node N`` (gloo on the CPU, NCCL on GPUs): every MoE
            layer keeps E / N experts per rank (:mod:`lrmoe.parallel`), the rest is data
            parallel, each rank builds and trains on its own batches (a step sees
            N * batch_size sequences); rank 0 writes the run files and rank r > 0 its own
            logs to ``out_dir/ep-rank-r``; checkpoints are written by all ranks together
            into ``out_dir/checkpoints`` (:mod:`lrmoe.training.checkpoint`). May change on
            resume with dp_size and data.grad_accum when their product stays.
        policy, memory_budget, resident_bytes, replica_slots: placement of expert
            instances under EP (``--policy fixed|ultraep|symi|lrmoe``, ``--memory-budget
            80GiB``: an int or a size text, ``--resident-bytes``: None measures
            ``torch.cuda.memory_allocated`` on the GPU, 0 on the CPU, ``--replica-slots``;
            :func:`lrmoe.parallel.placement.placement_from_config`; docs/parallel.md "Placement
            policies and replicas"); policy None: fixed ownership without the planner.
        dp_size: data-parallel size D of a DP x EP run (``--dp D``; 1 = EP over the whole
            world): ``torchrun --nproc-per-node D*ep_size`` ranks on a (dp, ep) mesh,
            experts sharded over ep and replicated over dp, every rank on its own
            batches (a step sees D * ep_size * batch_size sequences); dp rank 0 of each
            ep shard writes its checkpoints, dp ranks d > 0 only their logs, to
            ``.../dp-rank-d`` (docs/parallel.md "DP x EP").
    """

    ep_size: int = 1
    dp_size: int = 1
    policy: Optional[str] = None
    memory_budget: Optional[Any] = None
    resident_bytes: Optional[int] = None
    replica_slots: int = 2

    def validate(self) -> None:
        """Raises ValueError naming the ``parallel.*`` field on an invalid value."""
        from lrmoe.parallel.placement import placement_from_config
        from lrmoe.planner.plan import POLICIES

        _int("parallel.ep_size", self.ep_size, 1)
        _int("parallel.dp_size", self.dp_size, 1)
        _int("parallel.resident_bytes", self.resident_bytes, 0, optional=True)
        _int("parallel.replica_slots", self.replica_slots, 0)
        if self.policy is not None and self.policy not in POLICIES:  # the name before its needs
            raise ValueError(f"parallel.policy must be one of {', '.join(POLICIES)}; got "
                             f"{self.policy!r}")
        if self.policy is not None and self.ep_size < 2:
            raise ValueError(f"parallel.policy={self.policy} places experts over ranks; it "
                             f"needs parallel.ep_size >= 2 (--ep N), got {self.ep_size}")
        # without a policy no plan is made, so a budget would be silently ignored
        for key, flag in (("memory_budget", "--memory-budget"),
                          ("resident_bytes", "--resident-bytes")):
            if self.policy is None and getattr(self, key) is not None:
                raise ValueError(f"parallel.{key} ({flag}) is used by a placement plan "
                                 "only; add --policy fixed|ultraep|symi|lrmoe (with --ep "
                                 f"N), or drop {flag}")
        placement_from_config(self)  # the policy, budget and slots, named as parallel.*


@dataclass
class RunConfig:
    """``run``: length, seed, hardware, logging and checkpoints of the run.

    Attributes:
        steps: optimizer steps of the run (on resume: the step to stop at; may be raised
            to extend a run).
        seed: int in [0, 2^63): initialisation, data split and order, LRMoE's
            ``random`` / ``importance`` selection (which takes it modulo 2^62, room for
            the per-layer and per-step offsets in int64).
        dtype: ``auto`` (bf16 autocast on CUDA, float32 on the CPU), ``float32`` or
            ``bfloat16`` (autocast; parameters and optimizer state stay float32).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        torch_threads: CPU threads of torch (0: torch's default).
        eval_every: validation every this many steps (also at step 0 and at the end);
            0: only at the start and the end.
        eval_batches: validation batches per evaluation (0: the whole split).
        log_every: a ``metrics.jsonl`` line every this many steps.
        save_every: checkpoint every this many steps (0: only at the end and on Ctrl-C).
        keep_checkpoints: keep the newest this many checkpoints.
        out_dir: directory of the run's files.
        progress: ``auto`` (a bar on a terminal, else a line every ~2 % of the run),
            ``bar``, ``lines`` (a line every ``log_every`` steps) or ``none``.
        record_trace: write the routed expert ids of every MoE layer to this ``.npz``
            (:class:`lrmoe.workload.trace.RoutingTrace`); None records nothing.
        trace_every: record one optimizer step in this many.
        tensorboard: also write the metrics as TensorBoard scalars to
            ``out_dir/tensorboard/`` (needs the ``tensorboard`` package).
        time_moe: log ``moe_time_ms`` (and its ``moe_forward_ms`` / ``moe_backward_ms``
            parts) on every train record: the time of the MoE layers' forward and
            backward in the step, device events around each (``lrmoe.training.moe_timer``);
            the paper's time-to-loss metric.
        attention: transformers' attention implementation: ``sdpa`` (torch's
            ``scaled_dot_product_attention``; with isolated examples it gets the
            block-diagonal mask as a dense boolean tensor) or ``flex_attention`` (torch's
            flex attention with a block mask of the packed examples: only the blocks an
            example covers are computed). The same math; may change on resume.
        compile: ``torch.compile`` the dense part of every decoder layer (its attention
            and both RMSNorms, and the final norm; :func:`lrmoe.training.setup.compile_dense`):
            the casts, norms, RoPE and transposes around the attention fuse into a few
            kernels. The MoE layers stay eager (their kernels are lrmoe's own). The same
            math up to fusion rounding; may change on resume.
        checkpoints: write checkpoints (every ``save_every`` steps, at the end, on
            Ctrl-C) and the export; false for benchmarks that only measure (nothing to
            resume, nothing exported).
        export: when the run reaches ``steps`` (not when it was stopped), ep rank 0
            writes ``out_dir/export/``: the last checkpoint as a plain transformers model +
            tokenizer, every EP shard gathered (``lrmoe export``,
            :mod:`lrmoe.training.export`).
    """

    steps: int = 400
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    torch_threads: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 1
    save_every: int = 200
    keep_checkpoints: int = 2
    out_dir: str = "runs/tiny"
    progress: str = "auto"
    record_trace: Optional[str] = None
    trace_every: int = 10
    tensorboard: bool = False
    time_moe: bool = False
    attention: str = "sdpa"
    compile: bool = False
    checkpoints: bool = True
    export: bool = True

    def validate(self) -> None:
        """Raises ValueError naming ``run.<field>`` on an invalid value."""
        for name in ("steps", "log_every", "keep_checkpoints", "trace_every"):
            _int(f"run.{name}", getattr(self, name), 1)
        for name in ("torch_threads", "eval_every", "eval_batches", "save_every"):
            _int(f"run.{name}", getattr(self, name), 0)
        if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"run.seed must be an int in [0, 2^63), got {self.seed!r} "
                             f"({type(self.seed).__name__})")
        _choice("run.dtype", self.dtype, DTYPES)
        _choice("run.progress", self.progress, PROGRESS)
        _choice("run.attention", self.attention, ATTENTION)
        if not isinstance(self.device, str) or not (
                self.device in ("auto", "cpu", "cuda") or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"run.device must be auto, cpu, cuda or cuda:N; got "
                             f"{self.device!r}")
        _path("run.out_dir", self.out_dir, optional=False)
        _path("run.record_trace", self.record_trace)
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"run.tensorboard must be true or false, got {self.tensorboard!r}")
        if not isinstance(self.time_moe, bool):
            raise ValueError(f"run.time_moe must be true or false, got {self.time_moe!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"run.compile must be true or false, got {self.compile!r}")
        if not isinstance(self.checkpoints, bool):
            raise ValueError(f"run.checkpoints must be true or false, got {self.checkpoints!r}")
        if not isinstance(self.export, bool):
            raise ValueError(f"run.export must be true or false, got {self.export!r}")


SECTION_TYPES: Dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "lrmoe": BackwardConfig,
    "parallel": ParallelConfig, "run": RunConfig}
