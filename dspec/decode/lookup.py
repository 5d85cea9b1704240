"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's
last n-gram (Saxena 2023, "prompt lookup decoding"; vLLM's and SGLang's n-gram speculators).

Free to compute (host array ops over the request's tokens, no model), right exactly where a
small drafter is weakest: code that repeats its prompt's names, a math answer that restates
the problem, and the loops a small model falls into.  Used as one more branch of the
verification tree of ``dflash`` / ``d2sd`` / ``diffuspec`` (``lookup=K``), merged with the
drafters' nodes where they agree (:func:`graft_chain`, or D2SD's ``padded_prefix_tree``), so
the target verifies everything in one forward and the output is unchanged.

Measured before building it (bench/results/cpu/amx/lookup_estimate.md): on 8 grid prompts per
set, DFlash's own cycles with the best of (its accepted drafts, the lookup chain's matching
prefix) would commit 4.77 / 4.06 / 2.43 tokens per cycle on HumanEval / MATH500 / MT-Bench
against 2.26 / 2.09 / 1.75.
"""

from __future__ import annotations

import numpy as np

from .outputs import OutputBuffer

__all__ = ["MIN_NGRAM", "suffix_match_drafts", "PromptLookup", "graft_chain"]


#: the shortest n-gram matched by the decode methods: unigram matches add proposals (each up
#: to ``num_drafts`` verified rows) and almost no accepted tokens
#: (bench/results/cpu/amx/lookup_estimate.md)
MIN_NGRAM = 2


def suffix_match_drafts(
    history: np.ndarray,
    lengths: np.ndarray,
    *,
    offsets: np.ndarray | None = None,
    max_ngram: int = 3,
    min_ngram: int = 1,
    num_drafts: int = 7,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the tokens after the latest earlier occurrence of its last n-gram.

    Parameters
    ----------
    history : int64 [A, L]; row a's text is ``history[a, o : o + lengths[a]]``,
        o = ``offsets[a]`` (0 without ``offsets``): what lies outside is never matched.
    lengths : int64 [A]; offsets : int64 [A] or None; o + lengths[a] <= L.
    max_ngram, min_ngram : the n-gram sizes tried, longest first (1 <= min <= max).
    num_drafts : K >= 1, the most tokens drafted.

    Returns
    -------
    (drafts int64 [A, K] (-1 past a row's count), counts int64 [A]): with n the longest size
    whose last n tokens occur earlier in the text (the occurrence starting at column s, the
    latest such s with at least one token after it), ``drafts[a, :counts[a]] =
    history[a, s + n : s + n + K]`` cut at the text's end; count 0 where no size matches.

    Example
    -------
    >>> import numpy as np
    >>> d, c = suffix_match_drafts(np.array([[5, 6, 7, 8, 5, 6]]), np.array([6]), num_drafts=3)
    >>> d.tolist(), c.tolist()
    ([[7, 8, 5]], [3])
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    history = np.asarray(history, dtype=np.int64)
    rows, width = history.shape
    first = np.zeros(rows, dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
    end = first + np.asarray(lengths, dtype=np.int64)  # one past each text's last column
    begin = np.full(rows, -1, dtype=np.int64)  # where the drafts begin, -1: none yet
    r = np.arange(rows)
    for n in range(max_ngram, min_ngram - 1, -1):
        if width < n + 1:
            continue
        windows = width - n + 1  # window s covers history[:, s : s + n]
        tail = history[r[:, None], np.clip(end[:, None] - n + np.arange(n), 0, width - 1)]
        equal = np.ones((rows, windows), dtype=bool)
        for k in range(n):  # n <= max_ngram compares of [A, L]
            equal &= history[:, k : k + windows] == tail[:, k : k + 1]
        s = np.arange(windows)
        equal &= (s >= first[:, None]) & (s < (end - n)[:, None])  # earlier, >= 1 token after
        found = equal.any(1) & (begin < 0)
        latest = windows - 1 - np.argmax(equal[:, ::-1], 1)
        begin = np.where(found, latest + n, begin)
    counts = np.where(begin >= 0, np.minimum(num_drafts, end - begin), 0)
    cols = np.arange(num_drafts)
    take = cols < counts[:, None]
    drafts = np.where(take, history[r[:, None], np.clip(begin[:, None] + cols, 0, width - 1)], -1)
    return drafts, counts


class PromptLookup:
    """Each request's text (prompt + generated so far) as one host array, and its lookup
    drafts per decode cycle (:func:`suffix_match_drafts`).

    ``outputs`` is the decode's :class:`OutputBuffer`; the generated tokens are copied in
    when drafts are asked for, so the caller only keeps extending ``outputs``.  n-grams 3..2
    by default (``MIN_NGRAM``).
    """

    def __init__(
        self, prompts, outputs: OutputBuffer, *, num_drafts: int = 7, max_ngram: int = 3, min_ngram: int = MIN_NGRAM
    ):
        self.prompt_lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(self.prompt_lengths.max(initial=0)) + outputs.max_new_tokens
        self.text = np.full((len(prompts), width), -1, dtype=np.int64)
        r, c = np.nonzero(np.arange(width) < self.prompt_lengths[:, None])
        self.text[r, c] = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]) if len(r) else []
        self.outputs = outputs
        self.num_drafts, self.max_ngram, self.min_ngram = num_drafts, max_ngram, min_ngram

    def drafts(self, requests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts int64 [A, K] and counts [A] for ``requests`` (request indices [A])."""
        gen = self.outputs.lengths[requests]
        p = self.prompt_lengths[requests]
        r, c = np.nonzero(np.arange(self.outputs.tokens.shape[1]) < gen[:, None])
        self.text[requests[r], p[r] + c] = self.outputs.tokens[requests[r], c]
        return suffix_match_drafts(
            self.text[requests], p + gen, max_ngram=self.max_ngram, min_ngram=self.min_ngram, num_drafts=self.num_drafts
        )


def graft_chain(
    tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, chain: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Insert one chain per row under the root of a draft tree, sharing the tree's nodes where
    the chain's prefix is a path of the tree (a trie insert, batched).

    Parameters
    ----------
    tokens, parents, positions : int64 [A, W], a draft tree per row (column 0 the root,
        parent -1; every node after its parent; a padding node has parent -1 and is never
        verified).
    chain : int64 [A, K]; counts : int64 [A] in [0, K]: row a's chain is
        ``chain[a, :counts[a]]``, tokens that would follow the root.

    Returns
    -------
    (tokens, parents, positions) int64 [A, W + M], M the most nodes a row added: the old
    columns unchanged, then each row's new nodes (position = root's + depth), padding
    (parent -1) after them.  The greedy verification of the result accepts the longest of
    (the tree's accepted path, the chain's matching prefix), since a chain token equal to an
    existing child continues in that child.
    """
    rows, width = tokens.shape
    k = chain.shape[1]
    new_tok = np.zeros((rows, k), dtype=np.int64)
    new_par = np.full((rows, k), -1, dtype=np.int64)
    new_pos = np.zeros((rows, k), dtype=np.int64)
    added = np.zeros(rows, dtype=np.int64)
    node = np.zeros(rows, dtype=np.int64)  # the chain's current node
    on_tree = np.ones(rows, dtype=bool)  # its prefix so far is a tree path
    for d in range(k):  # K <= a few: depth, not requests
        active = d < counts
        t = chain[:, d]
        child = (parents == node[:, None]) & (tokens == t[:, None])
        hit = on_tree & active & child.any(1)
        make = active & ~hit
        m = np.flatnonzero(make)
        new_tok[m, added[m]] = t[m]
        new_par[m, added[m]] = node[m]
        new_pos[m, added[m]] = positions[m, 0] + d + 1
        node = np.where(hit, np.argmax(child, 1), np.where(make, width + added, node))
        on_tree &= hit
        added += make
    extra = int(added.max(initial=0))
    return (
        np.concatenate([tokens, new_tok[:, :extra]], 1),
        np.concatenate([parents, new_par[:, :extra]], 1),
        np.concatenate([positions, new_pos[:, :extra]], 1),
    )
