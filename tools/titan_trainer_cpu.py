"""torchtitan 0.3.0's own trainer (``torchtitan.train.main`` -> ``Trainer``) on the CPU,
with gloo, for a tiny Qwen3 MoE; LRMoE comes in only through torchtitan's override
mechanism (``--override.imports 'lrmoe.integrations.torchtitan_override.lrmoe_moe=...'``).

This is a launcher, not a trainer: it makes the CPU adaptations below, then calls
``torchtitan.train.main()``, which parses the command line with torchtitan's
``ConfigManager`` (``--module titan_trainer_cpu --config qwen3_moe_tiny_cpu`` selects the
config function of this file, every other flag is torchtitan's own) and runs its
``Trainer`` (meta-device build, ``parallelize_qwen3`` with FSDP2 / EP, init, AdamW, the
DCP ``CheckpointManager``, its data loader and tokenizer) unchanged.

CPU adaptations (none changes torchtitan's files; each is needed on a CPU-only torch):

* device type: ``torchtitan.tools.utils`` sets ``device_type = _get_available_device_type()
  or "cuda"`` at import, so on a CPU-only torch the trainer would ``set_device`` "cuda",
  build "cuda" meshes and pick the NCCL backend. :func:`point_torchtitan_at_cpu` sets
  ``device_type`` / ``device_module`` to "cpu" / ``torch.cpu`` in ``torchtitan.tools.utils``
  and in every loaded torchtitan module that imported those names (``torch.cpu`` with the
  memory-statistics calls of torchtitan's ``DeviceMemoryMonitor`` added, which it lacks:
  :class:`_CpuDeviceModule`);
* gloo: follows from the device type (``torchtitan.distributed.utils.init_distributed``
  takes ``torch.distributed.Backend.default_device_backend_map["cpu"]``, i.e. gloo);
* FSDP2's gradient reduction: ``apply_fsdp_to_decoder`` calls
  ``disable_fsdp_gradient_division`` (``set_gradient_divide_factor(1.0)``: torchtitan
  scales the loss by the global token count itself), which FSDP2 does as a
  ``ReduceOp.PREMUL_SUM`` reduce-scatter, which gloo lacks ("Cannot use
  ReduceOp.PREMUL_SUM with Gloo"). The config's ``parallelize_fn`` is torchtitan's
  ``parallelize_qwen3`` followed by ``set_force_sum_reduction_for_comms(True)`` on every
  FSDP module (a SUM with factor 1: the same numbers);
* attention: FlexAttention (torchtitan's LM default) has no CPU backward, and
  ``get_attention_config("sdpa")`` is refused for language models. The config sets each
  block's ``inner_attention`` to torchtitan's own ``ScaledDotProductAttention.Config()``,
  which the trainer treats as a maskless backend (no ``attention_masks``; causal over the
  whole packed sequence, so documents packed into one sequence see each other, unlike
  flex's block-causal mask; RoPE still gets the per-document positions);
* SPMD backend "partial_dtensor": under torchtitan's default "spmd_types" its own
  unswapped model fails in ``fully_shard`` on this torch ("When dp_mesh_dims is provided,
  all parameters must be DTensors on the full SPMD mesh ... Got plain tensor for parameter
  'weight'", torchtitan/distributed/fsdp.py:195);
* not CPU-specific: after the first step the trainer calls ``torch.distributed.set_timeout``
  (torchtitan/distributed/utils.py:595, from trainer.py:1062), which torch 2.13 does not
  have ("module 'torch.distributed' has no attribute 'set_timeout'"); where it is missing
  :func:`point_torchtitan_at_cpu` aliases it to torch's private
  ``distributed_c10d._set_pg_timeout(timeout, group)``, the same call;
* EP: with ``--parallelism.expert_parallel_degree 2`` torchtitan's config validation
  refuses its default CUDA-graph setting ("CUDA graphs support only expert parallel token
  ..."); add ``--training.disable_cuda_graphs`` (a torchtitan flag; eager on the CPU anyway);
* initialisation: DTensor's random init has no CPU support (``torch.cpu`` lacks
  ``set_rng_state``; "DTensor random operators may not have complete support on cpu"), so a
  sharded meta-device init gives every FSDP rank's shard the same values (experts e and
  e + 4 identical, router rows tied). tools/titan_trainer_cpu.sh therefore makes
  torchtitan's own seed checkpoint on one rank (``--checkpoint.create_seed_checkpoint``)
  and starts every run from it (``--checkpoint.initial_load_path``);
* fp32 throughout: ``training.mixed_precision_param float32`` (bf16 FSDP2 parameters on
  the CPU would make the with/without-override comparison a bf16 one).

Reference (not an adaptation): ``--override.imports titan_trainer_cpu.fp32_grouped_experts``
makes torchtitan's own ``GroupedExperts`` compute in fp32 (its forward without the
``.bfloat16()`` casts), the torchtitan side of the fp32 comparison with LRMoE's
``expert_dtype="input"``.

Observation only: with ``TITAN_CPU_LOSS_LOG=PATH`` rank 0 appends one JSON line per
logged step (step, loss, grad_norm as Python floats, i.e. the exact float32 values
torchtitan's ``MetricsProcessor.log`` receives) and at exit the lrmoe diagnostics of the
swapped layers (pairs kept per layer).

Prepare the data and tokenizer first: ``python tools/titan_trainer_cpu.py prepare OUT``
(``OUT/corpus/train.jsonl``: GCIDE entries when the dictionary is found, else the
paragraphs of this repository's docs/*.md; ``OUT/tokenizer``: a 512-token byte-level BPE
trained on that corpus, tokenizer.json + tokenizer_config.json). Then e.g.::

    PYTHONPATH=.:tools:DEPS torchrun --nproc-per-node 2 tools/titan_trainer_cpu.py \\
        --module titan_trainer_cpu --config qwen3_moe_tiny_cpu \\
        --hf-assets-path OUT/tokenizer --dataloader.dataset-path OUT/corpus \\
        --override.imports 'lrmoe.integrations.torchtitan_override.lrmoe_moe={"recalibration_rate": 0.3}'

``tools/titan_trainer_cpu.sh`` runs the whole comparison.
"""
from __future__ import annotations

import json
import os
import sys

VOCAB = 512
SEQ_LEN = 64


# --------------------------------------------------------------------------- config

def _cpu_parallelize(model, *, parallel_dims, **kwargs):
    """torchtitan's ``parallelize_qwen3``, then SUM reductions on every FSDP module
    (gloo has no PREMUL_SUM; module docstring)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.qwen3 import parallelize_qwen3
    model = parallelize_qwen3(model, parallel_dims=parallel_dims, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def qwen3_moe_tiny_cpu():
    """``Trainer.Config`` for torchtitan's Qwen3 MoE at a tiny size on the CPU: 2 layers,
    dim 64, 4 heads (2 KV) of 32, 8 experts of hidden 64, top-2, softmax router with
    route_norm (torchtitan's ``_build_qwen3_moe_layers``, as its ``debugmodel_moe``),
    SDPA attention, vocab 512, 2 x 64 tokens a rank, AdamW lr 1e-3, fp32 FSDP2, no AC,
    "partial_dtensor", checkpointing off unless ``--checkpoint.enable``."""
    import dataclasses

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models import qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    dim, head_dim, n_layers = 64, 32, 2
    layers = q3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2,
        head_dim=head_dim, moe_hidden_dim=64, num_experts=8, top_k=2,
        attn_backend="flex",  # replaced by SDPA just below
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ_LEN, theta=1e6),
        moe_comm_backend="standard")
    for layer in layers:
        # torchtitan's own SDPA module (FlexAttention has no CPU backward)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = q3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=q3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=q3._LINEAR_INIT),
        layers=layers)
    base = q3.model_registry("debugmodel_moe")  # torchtitan's hooks for Qwen3 MoE
    spec = dataclasses.replace(base, flavor="tiny_moe_cpu", model=model,
                               parallelize_fn=_cpu_parallelize)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(
            global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path="./titan_cpu/tokenizer",
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=spec,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                    dataset_path="./titan_cpu/corpus"),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=2, seq_len=SEQ_LEN, steps=10,
                                mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=5, last_save_model_only=False),
        activation_checkpoint=None,  # no activation checkpointing
        debug=DebugConfig(seed=0),
    )


# ------------------------------------------------------------------- fp32 reference

def _fp32_grouped_experts_classes():
    """``FP32GroupedExperts``: torchtitan 0.3.0's ``GroupedExperts`` whose forward is its
    own code without the three ``.bfloat16()`` casts (the reference of the fp32
    comparison; tests/python/integrations/test_torchtitan.py's ``fp32_grouped_experts``)."""
    global FP32GroupedExperts
    if "FP32GroupedExperts" in globals():
        return FP32GroupedExperts
    from dataclasses import dataclass

    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class FP32GroupedExperts(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD, num_tokens_per_expert_E):
            w1, w2, w3 = self.w1_EFD, self.w2_EDF, self.w3_EFD
            if isinstance(w1, DTensor):  # as GroupedExperts.forward under EP
                w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            mm = self._grouped_mm
            h_RF = F.silu(mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
            h_RF = h_RF * mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
            return mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offs).type_as(x_RD)

    return FP32GroupedExperts


def _register_fp32_override():
    import dataclasses

    from torchtitan.config import override
    from torchtitan.models.common.moe import GroupedExperts

    @override(target=GroupedExperts.Config, exact=True,
              description="reference: torchtitan's GroupedExperts in fp32")
    def fp32_grouped_experts(cfg):
        """``GroupedExperts.Config`` -> ``FP32GroupedExperts.Config`` (same fields)."""
        cls = _fp32_grouped_experts_classes()
        return cls.Config(**{f.name: getattr(cfg, f.name)
                             for f in dataclasses.fields(cfg) if f.init})

    return fp32_grouped_experts


if __name__ != "__main__":  # imported by --override.imports / --module: register it
    try:
        fp32_grouped_experts = _register_fp32_override()
    except ImportError:  # torchtitan missing: prepare still works
        pass


# --------------------------------------------------------------------- CPU adaptations

class _CpuDeviceModule:
    """``torch.cpu`` plus the accelerator-module calls torchtitan makes on
    ``device_module`` and ``torch.cpu`` lacks (``DeviceMemoryMonitor``,
    torchtitan/components/metrics.py:42: ``get_device_name``, ``get_device_properties``,
    ``memory_stats``, ``reset_peak_memory_stats``, ``empty_cache``): the CPU has no
    allocator statistics, so the memory numbers torchtitan logs are -1 / 0. And
    ``current_device`` is 0, not ``torch.cpu``'s "cpu": torchtitan passes it to
    ``barrier(device_ids=[...])`` (torchtitan/distributed/utils.py:586), which takes ints.
    """

    @staticmethod
    def current_device() -> int:
        return 0

    def __getattr__(self, name):
        import torch
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        import platform
        return platform.processor() or "cpu"

    @staticmethod
    def get_device_properties(device=None):
        import types
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def point_torchtitan_at_cpu() -> None:
    """Device type "cpu" in ``torchtitan.tools.utils`` and every loaded torchtitan module
    that imported ``device_type`` / ``device_module`` (module docstring)."""
    import torchtitan.components.checkpoint  # noqa: F401  (import the holders first)
    import torchtitan.components.metrics  # noqa: F401
    import torchtitan.distributed.parallel_dims  # noqa: F401
    import torchtitan.distributed.utils  # noqa: F401
    import torchtitan.models.common.token_dispatcher  # noqa: F401
    import torchtitan.tools.utils as utils
    import torchtitan.trainer  # noqa: F401
    import torch.distributed as dist
    if not hasattr(dist, "set_timeout"):  # torch 2.13 lacks it (module docstring)
        from torch.distributed.distributed_c10d import _set_pg_timeout
        dist.set_timeout = _set_pg_timeout
    old_type, old_module = utils.device_type, utils.device_module
    cpu_module = _CpuDeviceModule()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) is old_type and isinstance(old_type, str):
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is old_module:
            mod.device_module = cpu_module


def _record_losses(path: str) -> None:
    """Rank 0 appends torchtitan's logged loss of each step to ``path`` (observation)."""
    import torch.distributed as dist
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    log_fn = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss),
                                    "max_loss": float(global_max_loss),
                                    "grad_norm": float(grad_norm)}) + "\n")
        return log_fn(self, step, global_avg_loss, global_max_loss, grad_norm,
                      extra_metrics=extra_metrics)

    MetricsProcessor.log = log
    close_fn = Trainer.close

    def close(self):
        if not dist.is_initialized() or dist.get_rank() == 0:
            from lrmoe.integrations.torchtitan import collect_diagnostics, swapped_layers
            diag = {}
            for part in self.model_parts:
                for name, d in collect_diagnostics(part).items():
                    diag[name] = {k: (float(v) if isinstance(v, (int, float)) else str(v))
                                  for k, v in d.items()}
            n_swapped = sum(len(list(swapped_layers(p))) for p in self.model_parts)
            with open(path, "a") as f:
                f.write(json.dumps({"swapped_layers": n_swapped, "diagnostics": diag,
                                    "final_step": self.step}) + "\n")
        return close_fn(self)

    Trainer.close = close


# ------------------------------------------------------------------------- prepare

def _corpus_texts(max_docs: int = 400):
    """(source, texts): GCIDE entries (lrmoe.data.gcide) when the dictionary is found,
    else the paragraphs of this repository's docs/*.md."""
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    candidates = [os.environ.get("LRMOE_GCIDE_DIR"), str(repo / "data" / "gcide"),
                  "/work/main/data/gcide", "/usr/share/dictd"]
    from lrmoe.data import gcide
    for cand in candidates:
        if not cand:
            continue
        try:
            index, data = gcide.gcide_files(Path(cand))
        except (FileNotFoundError, OSError):
            continue
        raw = gcide.read_dict(data)
        rows = [r for r in gcide.read_index(index) if not r[0].startswith("00-database")]
        texts = []
        for word, off, length in rows[1000:]:  # skip the numerals at the start
            text = gcide.clean_entry(raw[off:off + length].decode("utf-8", "replace"))
            if len(text) > 80:
                texts.append(" ".join(text.split()))
            if len(texts) >= max_docs:
                break
        return f"GCIDE ({cand}), {len(texts)} entries", texts
    texts = []
    for md in sorted((repo / "docs").glob("*.md")):
        for para in md.read_text().split("\n\n"):
            para = " ".join(para.split())
            if len(para) > 80:
                texts.append(para)
    return f"docs/*.md paragraphs, {len(texts[:max_docs])}", texts[:max_docs]


def prepare(out: str) -> None:
    """Write ``out/corpus/train.jsonl`` and ``out/tokenizer`` (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    source, texts = _corpus_texts()
    os.makedirs(os.path.join(out, "corpus"), exist_ok=True)
    with open(os.path.join(out, "corpus", "train.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tdir = os.path.join(out, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    with open(os.path.join(tdir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1],
                   "add_bos_token": True, "add_eos_token": True}, f, indent=1)
    with open(os.path.join(out, "SOURCE"), "w") as f:
        f.write(source + "\n")
    print(f"corpus: {source}; tokenizer: {tok.get_vocab_size()} tokens -> {out}")


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "prepare":
        prepare(sys.argv[2] if len(sys.argv) > 2 else "titan_cpu")
        return
    point_torchtitan_at_cpu()
    if os.environ.get("TITAN_CPU_LOSS_LOG"):
        _record_losses(os.environ["TITAN_CPU_LOSS_LOG"])
    from torchtitan.train import main as titan_main
    titan_main()


if __name__ == "__main__":
    main()
