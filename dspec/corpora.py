"""The text dspec's models are trained on, read by training and by decoding's fallbacks.

- :func:`documents`: the documents of a training source (``SOURCES``: Python's standard
  library, ShareGPT turns, solved arithmetic problems; all offline, see :mod:`dspec.tasks`)
  in its train or held-out split (a fixed, content-defined subset: stdlib files and ShareGPT
  turns by a CRC of their text, arithmetic by a separate seed and the held-out problems of
  :func:`is_heldout_problem`).  :mod:`dspec.train.data` packs them into rows; the n-gram
  proxy of :mod:`dspec.decode.ngram` counts them.
- :class:`GeneratedData`: a data-engine directory (``python -m dspec.train.data_engine``:
  a target's own answers to prompts), memory-mapped.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from . import tasks

__all__ = ["SOURCES", "SPLITS", "GeneratedData", "documents", "is_heldout_problem", "is_heldout_text", "read_manifest"]

SOURCES = ("stdlib", "sharegpt", "arithmetic")
SPLITS = ("train", "heldout")
HELDOUT_MODULUS = 50  # 1 in 50 stdlib files / ShareGPT turns is held out
ARITH_TRAIN_SEED = 1000
ARITH_HELDOUT_SEED = 2000

# a data-engine directory: its manifest file and format tag
MANIFEST = "manifest.json"
FORMAT = "dspec-data-1"


def is_heldout_problem(prompt: str) -> bool:
    """True for the tenth of arithmetic problems that training never shows."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def is_heldout_text(text: str) -> bool:
    """Whether a text document is held out of training (CRC32 modulo ``HELDOUT_MODULUS``)."""
    return zlib.crc32(text.encode("utf-8", "replace")) % HELDOUT_MODULUS == 0


def documents(
    source: str, split: str = "train", *, max_chars: int = 6_000_000, arithmetic_problems: int = 120_000
) -> Iterator[str]:
    """Documents (str) of ``source`` in its ``split`` ("train" or "heldout"), in a fixed order,
    up to about ``max_chars`` characters (the held-out split reads the same range and keeps
    its own documents)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    want_heldout = split == "heldout"
    if source == "arithmetic":
        seed = ARITH_HELDOUT_SEED if want_heldout else ARITH_TRAIN_SEED
        n = arithmetic_problems if not want_heldout else max(arithmetic_problems // 20, 200)
        for p in tasks.arithmetic(n, seed=seed):
            if want_heldout or not is_heldout_problem(p.prompt):
                yield p.prompt + p.answer
        return
    if source == "stdlib":
        texts = (f.read_text(encoding="utf-8", errors="replace") for f in tasks.stdlib_sources())
    else:
        texts = tasks.sharegpt_texts()
    seen = 0
    for text in texts:
        if seen >= max_chars:
            return
        seen += len(text)
        if is_heldout_text(text) == want_heldout and text.strip():
            yield text


def read_manifest(out: Path) -> dict | None:
    """The manifest of a data-engine directory ``out`` (None when it has none)."""
    path = out / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


class GeneratedData:
    """The engine's output, memory-mapped.

    ``sequences()`` -> [(token ids list, prompt length)] in shard order (a resumed run only
    appends); ``info`` summarises the manifest.  Trainers split it with :func:`heldout_split`.
    ``shards``: read only the first ``shards`` shards (a prefix of the directory, so a feature
    cache built over it stays valid when more are read later), or ``(start, stop)``: shards
    ``start <= i < stop`` (the rest of a directory whose first shards an earlier entry read,
    appended after other directories without invalidating their cache); None reads all.
    """

    def __init__(self, path, shards: int | tuple[int, int] | None = None):
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None or manifest.get("format") != FORMAT:
            raise ValueError(f"data: {self.path} is not a dspec data-engine directory (no {MANIFEST})")
        if shards is not None:
            have = len(manifest["shards"])
            if isinstance(shards, tuple):
                ok = (
                    len(shards) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in shards)
                    and 0 <= shards[0] < shards[1] <= have
                )
                if not ok:
                    raise ValueError(
                        f"data: a shard range must be (start, stop) with 0 <= start < stop <= {have} "
                        f"for {self.path}, got {shards!r}"
                    )
                start, stop = shards
            elif isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= have:
                raise ValueError(f"data: shards must be an int in [1, {have}] for {self.path}, got {shards!r}")
            else:
                start, stop = 0, shards
            manifest = dict(manifest, shards=manifest["shards"][start:stop])
        self.manifest = manifest
        self.tokens = [np.load(self.path / f"tokens-{s['index']:05d}.npy", mmap_mode="r") for s in manifest["shards"]]
        self.rows = [np.load(self.path / f"rows-{s['index']:05d}.npy") for s in manifest["shards"]]

    @property
    def info(self) -> dict:
        shards = self.manifest["shards"]
        method = self.manifest["config"].get("method", "ar")
        return {
            "source": f"target-generated (dspec {method}, {self.manifest['target']}, {self.manifest['dtype']})",
            "path": str(self.path),
            "shards": len(shards),
            "sequences": sum(s["sequences"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "response_tokens": sum(s["response_tokens"] for s in shards),
            "sources": self.manifest["config"]["sources"],
            "sampled_fraction": self.manifest["config"]["sampled_fraction"],
            "generation_s": round(sum(s["seconds"] for s in shards), 1),
        }

    def __iter__(self) -> Iterator[tuple[list[int], int]]:
        for toks, rows in zip(self.tokens, self.rows):
            for off, n, plen, _, _ in rows:
                yield toks[off : off + n].astype(np.int64).tolist(), int(plen)

    def sequences(self) -> list[tuple[list[int], int]]:
        return list(self)
