"""The shared byte-level BPE tokenizer of dspec's trained models (``tiny-ar``, ``tiny-bd``).

One tokenizer serves every model that ``dspec.train`` builds from scratch, so a block-
diffusion drafter and an autoregressive target trained side by side speak the same ids.

Layout of the vocabulary: the special tokens first, in :data:`SPECIAL_TOKENS` order
(``<|endoftext|>`` = 0 ends a document and a generation, ``<|MASK|>`` = 1 is the
masked-diffusion mask, ``<|pad|>`` = 2), then the 256 byte symbols, then the merges.
Digits are pre-split one by one (as Llama / Qwen tokenizers do) so numbers are spelled
digit by digit and arithmetic stays learnable by a tiny model.

:func:`save_tokenizer` writes ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json`` in the Hugging Face layout that ``dspec.models.Tokenizer`` (and
transformers' ``PreTrainedTokenizerFast``) read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._cli import dumps

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN)

__all__ = [
    "EOS_TOKEN",
    "MASK_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "train_tokenizer",
    "save_tokenizer",
    "load_tokenizer",
]


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts``.

    Parameters
    ----------
    texts : iterable of str, the training corpus (documents).
    vocab_size : total vocabulary size including the specials and the 256 byte symbols
        (>= 256 + len(SPECIAL_TOKENS) + 1).
    min_frequency : a pair must occur this often to be merged.

    Returns
    -------
    tokenizers.Tokenizer with ids 0 = EOS, 1 = MASK, 2 = PAD.  Deterministic in its input.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = 256 + len(SPECIAL_TOKENS) + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise ValueError(f"vocab_size must be an int >= {floor}, got {vocab_size!r}")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:  # the trainer puts specials first
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def save_tokenizer(tok, directory) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    ``tok`` is a ``tokenizers.Tokenizer`` from :func:`train_tokenizer` (or one loaded back);
    returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    specials = {"eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN, "pad_token": PAD_TOKEN}
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "unk_token": None,
        "added_tokens_decoder": added,
        **specials,
    }
    (directory / "tokenizer_config.json").write_text(dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(dumps(specials, indent=2) + "\n")
    return directory


def load_tokenizer(directory):
    """The ``dspec.models.Tokenizer`` of a directory written by :func:`save_tokenizer`."""
    from ..models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(directory)
    if tok is None:
        raise ValueError(f"{directory}: no tokenizer.json")
    return tok
