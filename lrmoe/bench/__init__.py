"""Benchmarks run by ``lrmoe bench``: :mod:`lrmoe.bench.layer`."""
