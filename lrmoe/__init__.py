"""lrmoe: LRMoE Mixture-of-Experts training -- exact forward, planned (selective) backward."""
__version__ = "0.1.0"
