"""A compact 3-gram language model over token ids: DiffuSpec's causal proxy.

DiffuSpec's path search scores a drafted path with ``lam * dLLM log-prob + (1 - lam) *
causal-proxy log-prob``.  The proxy must be cheap (it is queried per candidate per beam per
slot, on the CPU, inside the C++ search), so it is a token-id 3-gram stored in ARPA's
backoff form as sorted arrays:

- ``log p(w | u, v) = trigram_logp[(u, v, w)]`` when the trigram is stored, else
  ``bigram_bow[(u, v)] + log p(w | v)`` (``bow = 0`` when the context ``(u, v)`` is not stored);
- ``log p(w | v) = bigram_logp[(v, w)]`` when stored, else ``unigram_bow[v] + log p(w)``;
- ``log p(w) = unigram_logp[w]``, finite for every id of the vocabulary.

Keys are ``v * V + w`` (bigrams) and ``(u * V + v) * V + w`` (trigrams) in int64, sorted, so
a lookup is a binary search (``numpy.searchsorted`` here, ``std::lower_bound`` in
``csrc/diffuspec_search_cpu.cpp``).  Natural-log probabilities are float32 on disk and are
combined in float64 (``float(bow) + lower``) in both languages, so both give the same bits.
A history token ``-1`` means "unknown" (start of text): the model backs off to the lower
order without a backoff weight.

Two estimators (``method``):

- ``"kneser_ney"`` (default): interpolated Kneser-Ney with one absolute discount per order
  (``D = n1 / (n1 + 2 n2)`` from the count-of-counts, clipped to [0.1, 0.9]); the lower
  orders use continuation counts (distinct left contexts); the unigram continuation
  distribution is add-one smoothed over the whole vocabulary so that every id has a finite
  log-probability.  Interpolation is converted exactly into backoff form (a stored n-gram
  holds its interpolated probability; ``bow`` is the context's leftover mass), so the
  lookup above gives a normalised distribution.
- ``"stupid_backoff"`` (Brants et al. 2007): relative frequencies, ``bow = log 0.4`` on every
  stored context; not normalised (a score, as in the paper).

Build from token-id sequences (:meth:`NgramLM.build`), from texts with a tokenizer
(:meth:`NgramLM.from_texts`), from the package corpora (:func:`default_ngram`, cached under
``~/.cache/dspec/ngram/``), from what the target model generates itself
(:func:`ngram_from_model`: best when the target was trained on text unlike any corpus, e.g.
a tiny random model in tests), or from the data engine's target-generated responses
(:func:`ngram_from_data`).  Saved and loaded as one ``.npz`` file.

DiffuSpec's default proxy (:func:`causal_proxy`) is the shipped 3-gram of the target's own
responses where dspec ships one (``dspec/assets/ngram/<name>-selfgen.npz``: SmolLM2-135M),
else :func:`default_ngram`.  Measured on the e2e grid's prompts (held out of the data
engine), SmolLM2-135M with ``smollm2-135m-bd`` drafting: the corpora 3-gram made CPS accept
*fewer* tokens than the drafter's own argmax (2.53 against 3.66 per verification), the
self-generated one 3.39 (``dspec/assets/ngram/README.md``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..corpora import GeneratedData, documents

METHODS = ("kneser_ney", "stupid_backoff")
FORMAT_VERSION = 1
# what an ngram= option takes (the message for a path that holds no n-gram file)
NGRAM_FORMS = "ngram= takes an NgramLM, the path of one saved with NgramLM.save (.npz), or None"
STUPID_BACKOFF_ALPHA = 0.4
CORPORA = ("sharegpt", "stdlib", "arithmetic")
# n-grams shipped for shipped targets: <shipped_name>.npz (what default_ngram would build)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "ngram"

__all__ = [
    "NgramLM",
    "METHODS",
    "CORPORA",
    "default_ngram",
    "ngram_from_model",
    "ngram_from_data",
    "causal_proxy",
    "cache_dir",
]


class NgramLM:
    """A token-id 3-gram in backoff form (see the module docstring).

    Attributes
    ----------
    vocab_size : int, V.
    method : "kneser_ney" | "stupid_backoff".
    unigram_logp, unigram_bow : float32 [V].
    bigram_keys : int64 [N2] sorted (``v * V + w``); bigram_logp, bigram_bow : float32 [N2].
    trigram_keys : int64 [N3] sorted (``(u * V + v) * V + w``); trigram_logp : float32 [N3].
    meta : dict of provenance (corpus, token count, tokenizer hash, ...).
    """

    def __init__(
        self,
        vocab_size,
        unigram_logp,
        unigram_bow,
        bigram_keys,
        bigram_logp,
        bigram_bow,
        trigram_keys,
        trigram_logp,
        *,
        method="kneser_ney",
        meta=None,
    ):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        vocab_size = int(vocab_size)
        if vocab_size > 2_000_000:
            raise ValueError(f"vocab_size must be <= 2e6 (trigram keys in int64), got {vocab_size}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.vocab_size = vocab_size
        self.method = method
        self.unigram_logp = _array("unigram_logp", unigram_logp, np.float32, vocab_size)
        self.unigram_bow = _array("unigram_bow", unigram_bow, np.float32, vocab_size)
        self.bigram_keys = _array("bigram_keys", bigram_keys, np.int64)
        self.bigram_logp = _array("bigram_logp", bigram_logp, np.float32, len(self.bigram_keys))
        self.bigram_bow = _array("bigram_bow", bigram_bow, np.float32, len(self.bigram_keys))
        self.trigram_keys = _array("trigram_keys", trigram_keys, np.int64)
        self.trigram_logp = _array("trigram_logp", trigram_logp, np.float32, len(self.trigram_keys))
        for name, keys, top in (
            ("bigram_keys", self.bigram_keys, vocab_size**2),
            ("trigram_keys", self.trigram_keys, vocab_size**3),
        ):
            if len(keys) and (keys[0] < 0 or keys[-1] >= top or bool(np.any(keys[1:] <= keys[:-1]))):
                raise ValueError(f"{name} must be strictly increasing in [0, {top})")
        if not np.all(np.isfinite(self.unigram_logp)):
            raise ValueError("unigram_logp must be finite for every id")
        self.meta = dict(meta or {})

    # ------------------------------------------------------------------------ building

    @classmethod
    def build(
        cls, sequences: Iterable, vocab_size: int, *, method: str = "kneser_ney", meta: dict | None = None
    ) -> "NgramLM":
        """Count the 1/2/3-grams of ``sequences`` (lists or 1-D arrays of ids in [0, V); an
        n-gram never crosses two sequences) and estimate the model with ``method``."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        V = int(vocab_size)
        uni_parts, bi_parts, tri_parts = [], [], []
        total = 0
        for i, seq in enumerate(sequences):
            a = np.asarray(seq, dtype=np.int64).reshape(-1)
            if a.size and (a.min() < 0 or a.max() >= V):
                raise ValueError(f"sequences[{i}] holds ids outside [0, vocab_size = {V})")
            total += a.size
            uni_parts.append(a)
            if a.size >= 2:
                bi_parts.append(a[:-1] * V + a[1:])
            if a.size >= 3:
                tri_parts.append((a[:-2] * V + a[1:-1]) * V + a[2:])
        if total == 0:
            raise ValueError("sequences hold no token")
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
        uni_count = np.bincount(cat(uni_parts), minlength=V).astype(np.float64)
        bi_keys, bi_count = np.unique(cat(bi_parts), return_counts=True)
        tri_keys, tri_count = np.unique(cat(tri_parts), return_counts=True)
        bi_count = bi_count.astype(np.float64)
        tri_count = tri_count.astype(np.float64)
        info = dict(meta or {}, tokens=int(total), sequences=len(uni_parts))
        if method == "stupid_backoff":
            return cls._stupid_backoff(V, uni_count, bi_keys, bi_count, tri_keys, tri_count, info)
        return cls._kneser_ney(V, uni_count, bi_keys, bi_count, tri_keys, tri_count, info)

    @classmethod
    def _stupid_backoff(cls, V, uni_count, bi_keys, bi_count, tri_keys, tri_count, meta):
        # unigram: add-one relative frequency (finite for every id)
        uni_logp = np.log((uni_count + 1.0) / (uni_count.sum() + V))
        # bigram: c(v, w) / c(v, .) where c(v, .) counts v as a left context
        ctx = bi_keys // V
        ctx_total = np.bincount(ctx, weights=bi_count, minlength=V)
        bi_logp = np.log(bi_count / ctx_total[ctx])
        tctx = tri_keys // V  # (u * V + v)
        pos = np.searchsorted(bi_keys, tctx)
        tctx_total = _group_sum(tctx, tri_count)
        tri_logp = np.log(tri_count / tctx_total)
        alpha = math.log(STUPID_BACKOFF_ALPHA)
        uni_bow = np.where(ctx_total > 0, alpha, 0.0)
        bi_bow = np.zeros(len(bi_keys))
        bi_bow[np.unique(pos)] = alpha  # every stored (u, v) context
        return cls(
            V,
            uni_logp,
            uni_bow,
            bi_keys,
            bi_logp,
            bi_bow,
            tri_keys,
            tri_logp,
            method="stupid_backoff",
            meta=dict(meta, method="stupid_backoff"),
        )

    @classmethod
    def _kneser_ney(cls, V, uni_count, bi_keys, bi_count, tri_keys, tri_count, meta):
        # --- continuation counts for the lower orders
        # bigram (v, w): number of distinct u with (u, v, w) seen (at least 1 for a seen bigram,
        # so bigrams that only occur at a sequence start keep their mass)
        tri_suffix = tri_keys % (V * V)  # (v, w) of each distinct trigram
        cont_bi = np.bincount(np.searchsorted(bi_keys, tri_suffix), minlength=len(bi_keys)).astype(np.float64)
        cont_bi = np.maximum(cont_bi, 1.0)
        # unigram w: number of distinct v with (v, w) seen, add-one over the vocabulary
        cont_uni = np.bincount(bi_keys % V, minlength=V).astype(np.float64)
        p_uni = (cont_uni + 1.0) / (cont_uni.sum() + V)
        uni_logp = np.log(p_uni)

        # --- bigram level, interpolated with the unigram continuation distribution
        d2 = kneser_ney_discount(cont_bi)
        ctx = bi_keys // V
        w = bi_keys % V
        ctx_total = np.bincount(ctx, weights=cont_bi, minlength=V)
        ctx_types = np.bincount(ctx, minlength=V).astype(np.float64)
        gamma2 = np.where(ctx_total > 0, d2 * ctx_types / np.maximum(ctx_total, 1e-300), 1.0)
        p_bi = np.maximum(cont_bi - d2, 0.0) / ctx_total[ctx] + gamma2[ctx] * p_uni[w]
        bi_logp = np.log(p_bi)
        uni_bow = np.where(ctx_total > 0, np.log(np.maximum(gamma2, 1e-300)), 0.0)

        # --- trigram level (raw counts), interpolated with the bigram distribution
        d3 = kneser_ney_discount(tri_count)
        tctx = tri_keys // V  # (u * V + v) as a bigram key
        tctx_total = _group_sum(tctx, tri_count)
        tctx_types = _group_sum(tctx, np.ones_like(tri_count))
        gamma3 = d3 * tctx_types / tctx_total
        # the bigram p(w | v) under the backoff form (stored or backed off)
        v3 = tctx % V
        w3 = tri_keys % V
        lower = _bigram_logp_array(bi_keys, bi_logp, uni_bow, uni_logp, v3, w3, V)
        p_tri = np.maximum(tri_count - d3, 0.0) / tctx_total + gamma3 * np.exp(lower)
        tri_logp = np.log(p_tri)
        bi_bow = np.zeros(len(bi_keys))
        # (u, v) is always a stored bigram when (u, v, w) is a stored trigram
        pos = np.searchsorted(bi_keys, tctx)
        bi_bow[pos] = np.log(gamma3)
        return cls(
            V,
            uni_logp,
            uni_bow,
            bi_keys,
            bi_logp,
            bi_bow,
            tri_keys,
            tri_logp,
            method="kneser_ney",
            meta=dict(meta, method="kneser_ney", discounts=[d2, d3]),
        )

    @classmethod
    def from_texts(
        cls,
        tokenizer,
        texts: Iterable[str],
        *,
        vocab_size: int | None = None,
        method: str = "kneser_ney",
        meta: dict | None = None,
    ) -> "NgramLM":
        """Tokenize ``texts`` (one sequence each) with ``tokenizer`` (a dspec Tokenizer or
        anything with ``encode_batch`` / ``encode``) and build the model."""
        texts = list(texts)
        if hasattr(tokenizer, "encode_batch"):
            seqs = tokenizer.encode_batch(texts)
        else:
            seqs = [tokenizer.encode(t) for t in texts]
        V = vocab_size if vocab_size is not None else tokenizer.vocab_size
        return cls.build(seqs, V, method=method, meta=meta)

    # ------------------------------------------------------------------------- queries

    def logprob(self, u: int, v: int, w: int) -> float:
        """``log p(w | u, v)`` as a Python float (float64); ``u``/``v`` = -1 for no history.

        This is the exact arithmetic of the C++ search (same lookups, same float64 sums)."""
        V = self.vocab_size
        if v >= 0:
            bow = 0.0
            if u >= 0:
                t = _find(self.trigram_keys, (u * V + v) * V + w)
                if t >= 0:
                    return float(self.trigram_logp[t])
                c = _find(self.bigram_keys, u * V + v)
                if c >= 0:
                    bow = float(self.bigram_bow[c])
            b = _find(self.bigram_keys, v * V + w)
            if b >= 0:
                return bow + float(self.bigram_logp[b])
            return bow + (float(self.unigram_bow[v]) + float(self.unigram_logp[w]))
        return float(self.unigram_logp[w])

    def logprobs(self, u, v, w) -> np.ndarray:
        """Vectorised :meth:`logprob` over broadcastable id arrays (float64)."""
        u, v, w = np.broadcast_arrays(np.asarray(u, np.int64), np.asarray(v, np.int64), np.asarray(w, np.int64))
        out = np.empty(u.shape, np.float64)
        for idx in np.ndindex(u.shape):
            out[idx] = self.logprob(int(u[idx]), int(v[idx]), int(w[idx]))
        return out

    def perplexity(self, sequences: Iterable) -> float:
        """exp(mean negative log-probability per token) of ``sequences`` (first token: unigram)."""
        total, n = 0.0, 0
        for seq in sequences:
            seq = [int(t) for t in seq]
            for i, w in enumerate(seq):
                u = seq[i - 2] if i >= 2 else -1
                v = seq[i - 1] if i >= 1 else -1
                total -= self.logprob(u, v, w)
                n += 1
        if n == 0:
            raise ValueError("sequences hold no token")
        return math.exp(total / n)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self) -> dict[str, np.ndarray]:
        """The tables, contiguous, in the dtypes the C++ search reads."""
        return {
            "unigram_logp": self.unigram_logp,
            "unigram_bow": self.unigram_bow,
            "bigram_keys": self.bigram_keys,
            "bigram_logp": self.bigram_logp,
            "bigram_bow": self.bigram_bow,
            "trigram_keys": self.trigram_keys,
            "trigram_logp": self.trigram_logp,
        }

    def __repr__(self) -> str:
        return (
            f"NgramLM(method={self.method!r}, vocab_size={self.vocab_size}, bigrams={len(self.bigram_keys)}, "
            f"trigrams={len(self.trigram_keys)}, {self.nbytes / 2**20:.1f} MiB)"
        )

    # ----------------------------------------------------------------------------- I/O

    def save(self, path) -> Path:
        """Write one ``.npz`` file (compressed) and return its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = json.dumps(
            {"format": FORMAT_VERSION, "vocab_size": self.vocab_size, "method": self.method, "meta": self.meta}
        )
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, header=np.frombuffer(header.encode(), np.uint8), **self.arrays())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path) -> "NgramLM":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"ngram: no n-gram file at {str(path)!r} ({NGRAM_FORMS})")
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode())
                arrays = {k: z[k] for k in z.files if k != "header"}
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a dspec n-gram file ({e})") from None
        if header.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: n-gram format {header.get('format')}, expected {FORMAT_VERSION}")
        return cls(header["vocab_size"], method=header["method"], meta=header.get("meta"), **arrays)


# ---------------------------------------------------------------------------- helpers


def _array(name, a, dtype, size=None) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a), dtype=dtype).reshape(-1) if np.ndim(a) <= 1 else None
    if a is None:
        raise ValueError(f"{name} must be 1-D")
    if size is not None and a.size != size:
        raise ValueError(f"{name} must have {size} entries, got {a.size}")
    return a


def _find(keys: np.ndarray, key: int) -> int:
    i = int(np.searchsorted(keys, key))
    return i if i < len(keys) and int(keys[i]) == key else -1


def _group_sum(sorted_group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per element, the sum of ``values`` over its group (groups are runs of equal keys)."""
    if sorted_group.size == 0:
        return np.zeros(0)
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    sums = np.add.reduceat(values, starts)
    return np.repeat(sums, np.diff(np.r_[starts, sorted_group.size]))


def kneser_ney_discount(counts: np.ndarray) -> float:
    """The absolute discount of one order of the Kneser-Ney model, from its count-of-counts:
    ``n1 / (n1 + 2 n2)`` (Ney's estimate), clamped to [0.1, 0.9] (0.5 with neither)."""
    n1 = float(np.sum(counts == 1))
    n2 = float(np.sum(counts == 2))
    d = n1 / (n1 + 2.0 * n2) if n1 + n2 > 0 else 0.5
    return min(max(d, 0.1), 0.9)


def _bigram_logp_array(bi_keys, bi_logp, uni_bow, uni_logp, v, w, V) -> np.ndarray:
    """log p(w | v) in backoff form for id arrays v, w (float64)."""
    keys = v * V + w
    pos = np.minimum(np.searchsorted(bi_keys, keys), max(len(bi_keys) - 1, 0))
    hit = (bi_keys[pos] == keys) if len(bi_keys) else np.zeros(keys.shape, bool)
    stored = bi_logp[pos].astype(np.float64) if len(bi_keys) else np.zeros(keys.shape)
    backed = uni_bow[v].astype(np.float64) + uni_logp[w].astype(np.float64)
    return np.where(hit, stored, backed)


# ------------------------------------------------------------------ defaults and caching

_LOADED: dict = {}  # (path, mtime, size) -> NgramLM: the last few files read
_LOADED_MAX = 4


def load_cached(path) -> NgramLM:
    """:meth:`NgramLM.load` of ``path``, kept in memory while the file is unchanged (the few
    most recent files): decoding calls ``generate`` once per prompt, and decompressing the
    SmolLM2 proxy (29 MiB of arrays) took ~90 ms of every DiffuSpec call."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        raise ValueError(f"ngram: no n-gram file at {str(path)!r} ({NGRAM_FORMS})") from None
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    lm = _LOADED.pop(key, None)
    if lm is None:
        lm = NgramLM.load(path)
    _LOADED[key] = lm  # most recent last
    while len(_LOADED) > _LOADED_MAX:
        _LOADED.pop(next(iter(_LOADED)))
    return lm


def cache_dir() -> Path:
    """``$DSPEC_CACHE/ngram`` or ``~/.cache/dspec/ngram``."""
    root = os.environ.get("DSPEC_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "dspec") / "ngram"


def _tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's full definition.  Serialising and hashing SmolLM2's
    takes ~19 ms, which every DiffuSpec ``generate`` call paid to pick its proxy, so the hash
    is kept on the tokenizer object while its vocabulary size (added tokens included) is the
    same."""
    inner = getattr(tokenizer, "inner", tokenizer)
    size_of = getattr(inner, "get_vocab_size", None)
    size = size_of(with_added_tokens=True) if size_of is not None else None
    kept = getattr(tokenizer, "_dspec_fingerprint", None)
    if kept is not None and size is not None and kept[0] == size:
        return kept[1]
    try:
        text = inner.to_str()
    except AttributeError:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        tokenizer._dspec_fingerprint = (size, digest)
    except AttributeError:
        pass  # a tokenizer object without attributes: hash each time
    return digest


def corpus_texts(corpus: str, max_chars: int) -> list[str]:
    """Up to about ``max_chars`` characters of training documents of a :data:`CORPORA`
    source: ``dspec.corpora.documents(corpus, "train")``, the documents dspec's own tiny
    models are trained on (their held-out documents and arithmetic problems excluded, so an
    evaluation on them never sees its answers in the proxy)."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    out, seen = [], 0
    for text in documents(corpus, "train", max_chars=max_chars, arithmetic_problems=max(max_chars // 20, 1)):
        if seen >= max_chars:
            break
        out.append(text)
        seen += len(text)
    return out


def default_ngram(
    model, *, corpora=CORPORA, max_chars: int = 1_500_000, method: str = "kneser_ney", rebuild: bool = False
) -> NgramLM:
    """The causal proxy for ``model``'s tokenizer: a 3-gram over ``max_chars`` characters of
    each corpus in ``corpora``, built once and cached under :func:`cache_dir` (keyed by the
    tokenizer's fingerprint, the corpora, the size and the method).  For a shipped target the
    file ``dspec/assets/ngram/<shipped_name>.npz`` is used when it was built with these same
    settings (``python -m dspec.decode.ngram tiny-ar`` writes it)."""
    if model.tokenizer is None:
        raise ValueError(
            "the target has no tokenizer: build the n-gram with NgramLM.build(...) or "
            "ngram_from_model(...) and pass ngram="
        )
    corpora = tuple(corpora)
    for c in corpora:
        if c not in CORPORA:
            raise ValueError(f"corpora must be drawn from {CORPORA}, got {c!r}")
    fingerprint = _tokenizer_fingerprint(model.tokenizer)
    name = getattr(model, "shipped_name", None)
    if name and not rebuild:
        shipped = SHIPPED_DIR / f"{name}.npz"
        if shipped.is_file():
            lm = load_cached(shipped)
            # only when it is what was asked for (same tokenizer, corpora, size and method)
            if (
                lm.meta.get("tokenizer") == fingerprint
                and lm.meta.get("corpora") == list(corpora)
                and lm.meta.get("max_chars") == max_chars
                and lm.method == method
            ):
                return lm
    key = hashlib.sha256(
        json.dumps(
            [fingerprint, corpora, max_chars, method, model.config.vocab_size, FORMAT_VERSION, "train-docs"]
        ).encode()
    ).hexdigest()[:20]
    path = cache_dir() / f"{key}.npz"
    if path.is_file() and not rebuild:
        return load_cached(path)
    texts = []
    for c in corpora:
        texts += corpus_texts(c, max_chars)
    lm = NgramLM.from_texts(
        model.tokenizer,
        texts,
        vocab_size=model.config.vocab_size,
        method=method,
        meta={"corpora": list(corpora), "max_chars": max_chars, "tokenizer": fingerprint},
    )
    lm.save(path)
    return lm


def ngram_from_model(
    model,
    *,
    num_sequences: int = 64,
    length: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    prompts=None,
    method: str = "kneser_ney",
) -> NgramLM:
    """A 3-gram of text the target itself samples (``ar`` decoding at ``temperature`` from
    ``prompts``, default: each vocabulary id in turn as a one-token prompt).  The proxy then
    models the target's own continuations, which is what the drafts are verified against."""
    import torch

    from .ar import decode_ar

    V = model.config.vocab_size
    if prompts is None:
        prompts = [[i % V] for i in range(num_sequences)]
    gen = torch.Generator(device=model.device).manual_seed(seed)
    out, _ = decode_ar(
        model,
        [list(p) for p in prompts],
        max_new_tokens=length,
        temperature=temperature,
        generator=gen if temperature > 0 else None,
        eos_ids=model.eos_token_ids,
    )
    seqs = [list(p) + list(o) for p, o in zip(prompts, out)]
    return NgramLM.build(
        seqs, V, method=method, meta={"source": "target samples", "temperature": temperature, "seed": seed}
    )


SELFGEN_SUFFIX = "-selfgen"


def ngram_from_data(model, data, *, method: str = "kneser_ney") -> NgramLM:
    """A 3-gram of the responses in a data-engine directory ``data``
    (:class:`dspec.corpora.GeneratedData`: the target's own greedy and sampled
    answers to prompts that exclude every benchmark prompt); prompts are not counted.  The
    proxy then scores a draft by how the target itself continues, which is what verification
    accepts.  ``model`` gives the vocabulary and the tokenizer fingerprint (checked against
    the data's target name when both are known)."""
    gen = GeneratedData(data)
    target = gen.manifest.get("target")
    name = getattr(model, "shipped_name", None)
    if target and name and name not in (target, Path(target).name):  # a shipped name or its directory
        raise ValueError(f"data: {data} was generated by {target!r}, not by {name!r}")
    responses = (np.asarray(ids[plen:], dtype=np.int64) for ids, plen in gen)
    info = gen.info
    meta = {
        "source": "target-generated responses",
        "data": str(Path(data)),
        "target": target,
        "sequences": info["sequences"],
        "response_tokens": info["response_tokens"],
        "prompt_sources": info["sources"],
        "sampled_fraction": info["sampled_fraction"],
    }
    if model.tokenizer is not None:
        meta["tokenizer"] = _tokenizer_fingerprint(model.tokenizer)
    return NgramLM.build(responses, model.config.vocab_size, method=method, meta=meta)


def causal_proxy(model) -> NgramLM:
    """DiffuSpec's default causal proxy for ``model``: the shipped 3-gram of its own responses
    (``dspec/assets/ngram/<shipped name>-selfgen.npz``, built by :func:`ngram_from_data`) when
    dspec ships one for this tokenizer, else :func:`default_ngram`."""
    name = getattr(model, "shipped_name", None)
    path = SHIPPED_DIR / f"{name}{SELFGEN_SUFFIX}.npz" if name else None
    if path is not None and path.is_file() and model.tokenizer is not None:
        lm = load_cached(path)
        if (
            lm.meta.get("tokenizer") == _tokenizer_fingerprint(model.tokenizer)
            and lm.vocab_size >= model.config.vocab_size
        ):
            return lm
    return default_ngram(model)


def main(argv=None) -> None:
    """``python -m dspec.decode.ngram NAME [--from-data DIR] [--out FILE]``: build the default
    n-gram of a shipped target (or checkpoint directory) from the package corpora, or with
    ``--from-data`` the 3-gram of a data-engine directory's responses, and write it (default:
    the shipped location, ``NAME.npz`` / ``NAME-selfgen.npz``)."""
    import argparse

    from ..hub import load

    parser = argparse.ArgumentParser(prog="python -m dspec.decode.ngram", description=main.__doc__)
    parser.add_argument("model", help="a shipped name (tiny-ar, smollm2-135m) or a checkpoint directory")
    parser.add_argument("--out", default=None, help="output .npz (default dspec/assets/ngram/NAME.npz)")
    parser.add_argument("--max-chars", type=int, default=1_500_000)
    parser.add_argument("--method", choices=METHODS, default="kneser_ney")
    parser.add_argument(
        "--from-data",
        default=None,
        metavar="DIR",
        help="a data-engine directory of the target's responses (python -m dspec.train.data_engine)",
    )
    args = parser.parse_args(argv)
    model = load(args.model)
    stem = model.shipped_name or Path(args.model).name
    if args.from_data:
        lm = ngram_from_data(model, args.from_data, method=args.method)
        stem += SELFGEN_SUFFIX
    else:
        lm = default_ngram(model, max_chars=args.max_chars, method=args.method, rebuild=True)
    out = Path(args.out) if args.out else SHIPPED_DIR / f"{stem}.npz"
    lm.save(out)
    print(f"{lm} -> {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
