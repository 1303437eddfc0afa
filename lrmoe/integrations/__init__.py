"""Integrations of LRMoE with model libraries.

* :mod:`lrmoe.integrations.transformers` -- swap the sparse-MoE blocks of a Hugging Face
  transformers model (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4-MoE; transformers 5.17.0) for
  LRMoE layers holding the same parameters: ``patch_moe_blocks``, ``set_recalibration``,
  ``collect_diagnostics``.
* :mod:`lrmoe.integrations.torchtitan` -- run the routed experts of torchtitan's MoE
  models (Qwen3 MoE, DeepSeek-V3; torchtitan 0.3.0) through LRMoE on torchtitan's own
  weights: ``LRMoETitanConfig``, ``swap_moe``, ``set_recalibration``,
  ``collect_diagnostics``; :mod:`lrmoe.integrations.torchtitan_override` does it from
  torchtitan's config (``--override.imports``).

Nothing is imported here eagerly, so ``import lrmoe`` never needs transformers or torchtitan.
"""
