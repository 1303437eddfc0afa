"""Training data for ``lrmoe train``: sources, tokenizer, packed blocks, batches.

Sources (the ``spec`` of :func:`load_data`):

* ``gcide`` (default): an Alpaca-style instruction set built from the GCIDE dictionary of
  Debian's ``dict-gcide`` package -- one record per headword, instruction
  ``"Define <word>."``, output the cleaned entry text (see :mod:`lrmoe.data.gcide`).
* ``alpaca:PATH``: a Stanford-Alpaca JSON list or JSONL file (instruction/input/output).
* ``text:PATH``: a text file, or a folder of ``*.txt``/``*.md`` files (recursive,
  sorted), packed as one token stream for plain language modelling.

Instruction records are formatted with the Alpaca prompt template; the loss is on the
response and its EOS only. They are packed greedily into ``seq_len`` blocks without ever
splitting an example. Train/validation splits are deterministic hashes (below).

Everything expensive is cached under ``cache_dir``: the trained tokenizer (keyed by the
source's identity and file sizes/mtimes, the split parameters, ``max_records`` and
``vocab_size``) and the tokenized blocks (that key + the tokenizer file's hash +
``seq_len``); a second call with the same arguments only loads two files. Cache files
are written atomically.
"""
from __future__ import annotations

# The pipeline in the order the data flows: prepare (read, select, split) -> tokenizer ->
# packing -> blocks, with load (the driver) and cache beside it.
from lrmoe.data.blocks import TokenBlocks, batches, epoch_permutation, num_batches
from lrmoe.data.load import (PIPELINE_VERSION, SKIP_PROMPT_TOO_LONG, DataReport, LMData,
                             load_data)
from lrmoe.data.packing import IGNORE_INDEX
from lrmoe.data.prepare import BPE_MAX_CHARS, SKIP_OVER_MAX
from lrmoe.data.sources import alpaca_prompt

__all__ = ["TokenBlocks", "DataReport", "LMData", "load_data", "batches", "num_batches",
           "epoch_permutation", "IGNORE_INDEX", "alpaca_prompt", "PIPELINE_VERSION",
           "BPE_MAX_CHARS", "SKIP_OVER_MAX", "SKIP_PROMPT_TOO_LONG"]
