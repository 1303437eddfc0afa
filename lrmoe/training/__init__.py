"""The trainer of ``lrmoe train``, one module per component (the layout follows
torchtitan's ``trainer.py`` + ``components/``):

* :mod:`~lrmoe.training.config` -- settings sections, validation, key names;
* :mod:`~lrmoe.training.compose` -- presets, YAML / ``--set`` composition, resume
  compatibility;
* :mod:`~lrmoe.training.batches` -- token blocks -> batches, each rank's batch stream;
* :mod:`~lrmoe.training.loss` -- LM loss, load-balancing loss over real tokens, validation;
* :mod:`~lrmoe.training.optim` -- AdamW parameter groups, warm-up + cosine schedule;
* :mod:`~lrmoe.training.checkpoint` -- atomic checkpoints, RNG states, EP shards;
* :mod:`~lrmoe.training.metrics` -- metrics.jsonl, TensorBoard, progress, plot, summary;
* :mod:`~lrmoe.training.distributed` -- torchrun / EP join, rank-0 printing, stop agreement;
* :mod:`~lrmoe.training.trainer` -- the :class:`~lrmoe.training.trainer.Trainer`.

``lrmoe.training.train`` is the entry point (:func:`lrmoe.training.train.train`).
"""
