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
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    moe_layers: int
    shared_expert_intermediate_size: int = 0

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
    ModelShape("qwen3-30b-a3b", 2048, 768, 128, 8, 48),
    ModelShape("glm-4.5-air", 4096, 1408, 128, 8, 45, shared_expert_intermediate_size=1408),
    ModelShape("gpu-small", 768, 256, 128, 8, 8),
    ModelShape("smoke", 64, 32, 8, 2, 1, shared_expert_intermediate_size=32),
)}
#: the shapes of real models, which the planner and the simulator model (``lrmoe plan
#: --model``, ``lrmoe sim --model``, the records ``lrmoe sim --validate`` compares);
#: ``smoke`` is a benchmark shape only
MODELS: Dict[str, ModelShape] = {n: SHAPES[n] for n in ("qwen3-30b-a3b", "glm-4.5-air",
                                                        "gpu-small")}
