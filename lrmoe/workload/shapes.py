"""The one registry of MoE layer shapes: every command that takes a model shape reads
:data:`SHAPES` (``lrmoe bench layer --shapes``, ``lrmoe calibrate --shapes``) or its real
models, :data:`MODELS` (``lrmoe plan --model``, ``lrmoe sim --model``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One MoE model's layer shape, the source of the planner's byte sizes and of the
    benchmark's layer dimensions.

    Attributes:
        name: registry key.
        hidden_size: H.
        moe_intermediate_size: I of one expert (SwiGLU: gate, up, down).
        num_experts: E routed experts per layer.
        top_k: K experts per token.
        moe_layers: MoE layers of the model (for the whole-model notes in docs/planner.md).
        shared_expert_intermediate_size: width of the always-on shared expert, 0 for none
            (the benchmark runs it; the planner's memory model counts routed experts only).
        dense_params: parameters outside the routed experts (attention, norms, routers,
            embeddings and output head; from the model's transformers config), which every
            GPU holds whole and all-reduces each step (``lrmoe sim --scale``'s step terms,
            csrc/sim/step.h); 0 where not worked out (``--dense-params`` then).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    moe_layers: int
    shared_expert_intermediate_size: int = 0
    dense_params: int = 0

    @property
    def dims(self) -> dict:
        """The benchmark's short names: ``hidden``, ``inter``, ``experts``, ``top_k``,
        ``shared`` (a fresh dict; callers may change it)."""
        return dict(hidden=self.hidden_size, inter=self.moe_intermediate_size,
                    experts=self.num_experts, top_k=self.top_k,
                    shared=self.shared_expert_intermediate_size)


#: The paper's models (docs/planner.md "Model presets", from their transformers configs),
#: the ``gpu-small`` training preset (configs/gpu-small.yaml) and ``smoke``, the tiny
#: CPU shape of CI's benchmark runs.
SHAPES: Dict[str, ModelShape] = {s.name: s for s in (
    # dense_params, per layer q/k/v/o H x (32 x 128) + 2 x H x (4 x 128) + (32 x 128) x H,
    # q/k norms 2 x 128, two RMSNorms 2 H, router H x E; x 48 layers, plus untied
    # embeddings and head 2 x 151,936 x H and the final norm H: 1,541,093,376 (with the
    # experts' 28,991,029,248: the model card's 30.5 B)
    ModelShape("qwen3-30b-a3b", 2048, 768, 128, 8, 48, dense_params=1_541_093_376),
    ModelShape("glm-4.5-air", 4096, 1408, 128, 8, 45, shared_expert_intermediate_size=1408),
    # configs/gpu-small.yaml's Qwen3-MoE (12 heads of 64, 4 KV heads, vocabulary 16,384,
    # untied; lrmoe/training/setup.py): 8 x 1,672,832 + 2 x 16,384 x 768 + 768
    ModelShape("gpu-small", 768, 256, 128, 8, 8, dense_params=38_549_248),
    ModelShape("smoke", 64, 32, 8, 2, 1, shared_expert_intermediate_size=32),
)}
#: the shapes of real models, which the planner and the simulator model (``lrmoe plan
#: --model``, ``lrmoe sim --model``, the records ``lrmoe sim --validate`` compares);
#: ``smoke`` is a benchmark shape only
MODELS: Dict[str, ModelShape] = {n: SHAPES[n] for n in ("qwen3-30b-a3b", "glm-4.5-air",
                                                        "gpu-small")}
