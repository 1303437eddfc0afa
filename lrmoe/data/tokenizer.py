"""Tokenizers: a byte-level BPE trained on the training split, or a user's tokenizer.json."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Tuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
#: Looked for, in this order, in a user's tokenizer.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<eos>",
                  "[SEP]")
PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "<|padding|>", "[PAD]", "<|finetune_right_pad_id|>")
#: 256 byte symbols + the two special tokens, and a few merges.
MIN_VOCAB = 260
#: Written next to every ``tokenizer.json`` of a checkpoint or an export, for transformers.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenizer and decoder) on ``texts``.

    Ids 0 and 1 are ``<|endoftext|>`` (EOS) and ``<|pad|>``; every byte is in the
    alphabet, so any text encodes without unknown tokens. Nothing is added automatically
    at encoding (callers append EOS themselves).

    Raises:
        ValueError: ``vocab_size`` < 260.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes + 2 special tokens +"
                         f" merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    """Write ``tok`` to ``path`` atomically (temporary file in the same folder, then
    :func:`os.replace`), so an interrupted run never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (Hugging Face ``tokenizers`` format).

    Raises:
        FileNotFoundError: naming ``path`` when it does not exist.
        ValueError: naming ``path`` when it is not a readable tokenizer file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path} (give the path of a "
                                f"tokenizer.json, or leave the tokenizer unset to train one)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({e})") from None


def special_ids(tok: Tokenizer, path: Path | None = None) -> Tuple[int, int]:
    """``(eos_id, pad_id)``: the first of :data:`EOS_CANDIDATES` / :data:`PAD_CANDIDATES`
    present in the vocabulary; pad falls back to eos.

    Raises:
        ValueError: no end-of-text token is found (naming the tokens looked for).
    """
    eos = next((i for t in EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None), None)
    if eos is None:
        raise ValueError(f"tokenizer {path or ''} has none of the end-of-text tokens "
                         f"{', '.join(EOS_CANDIDATES)}; add one to it or train a tokenizer "
                         f"(leave the tokenizer unset)")
    pad = next((i for t in PAD_CANDIDATES if (i := tok.token_to_id(t)) is not None), eos)
    return eos, pad


def tokenizer_config(tok: Tokenizer, path: Path | None = None) -> Dict[str, Any]:
    """The ``tokenizer_config.json`` that makes ``transformers.AutoTokenizer`` load
    ``tok``'s ``tokenizer.json`` as the trainer uses it.

    ``tokenizer_class`` is the generic ``PreTrainedTokenizerFast``: without it,
    AutoTokenizer picks the class of the model type in ``config.json`` (``Qwen2Tokenizer``
    for qwen3_moe), which rebuilds the pre-tokenizer and gives other ids. ``eos_token`` and
    ``pad_token`` are those of :func:`special_ids` (pad = eos when the tokenizer has no
    pad token); there is no BOS (the trainer adds none). Decoding keeps spaces as encoded.

    Raises:
        ValueError: the tokenizer has no end-of-text token (:func:`special_ids`).
    """
    eos, pad = special_ids(tok, path)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
            "eos_token": tok.id_to_token(eos), "pad_token": tok.id_to_token(pad),
            "clean_up_tokenization_spaces": False}


def write_tokenizer_config(tokenizer_json: Path, out_dir: Path) -> Path:
    """Write :func:`tokenizer_config` of the ``tokenizer.json`` at ``tokenizer_json`` as
    ``out_dir/tokenizer_config.json``. Returns its path.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_tokenizer` and :func:`special_ids`.
    """
    config = tokenizer_config(load_tokenizer(Path(tokenizer_json)), Path(tokenizer_json))
    target = Path(out_dir) / TOKENIZER_CONFIG_FILE
    target.write_text(json.dumps(config, indent=2) + "\n")
    return target
