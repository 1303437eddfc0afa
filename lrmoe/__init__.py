"""lrmoe: LRMoE Mixture-of-Experts training -- exact forward, planned (selective) backward.

Public API: :class:`LRMoEConfig` (its planned backward a :class:`BackwardConfig`),
:class:`LRMoELayer`, and the ops in :mod:`lrmoe.ops`.
"""
from lrmoe.moe.config import BackwardConfig, LRMoEConfig
from lrmoe.layer import LRMoELayer

__version__ = "0.1.0"
__all__ = ["BackwardConfig", "LRMoEConfig", "LRMoELayer", "__version__"]
