"""Benchmarks run by ``lrmoe bench``.

``lrmoe bench layer``: :mod:`lrmoe.bench.layer` (one device) and
:mod:`lrmoe.bench.layer_ep` (expert parallel), over the cases of
:mod:`lrmoe.bench.cases`, the methods of :mod:`lrmoe.bench.methods` (the baselines
:mod:`lrmoe.bench.baselines.dropless` and :mod:`lrmoe.bench.baselines.torchtitan_moe` among them), the
measurements of :mod:`lrmoe.bench.timing` and the reports of :mod:`lrmoe.bench.report`
(targets in the package data file ``targets.json``); options in :mod:`lrmoe.bench.cli`.
"""
