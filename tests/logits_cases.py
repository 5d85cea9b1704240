"""Shared logits rows of the token_stats and topk_tokens tests: special values, key-scan rows."""

from __future__ import annotations

import torch


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """Overwrite some rows with the hard cases: ties, constants, -inf, NaN, +inf."""
    rows, vocab = x.shape
    x = x.clone()
    if rows >= 7:
        x[0, vocab // 2] = float("nan")  # invalid row
        x[1] = float("-inf")  # invalid row, lse = -inf
        x[2] = 0.5  # all equal: token 0, margin 0
        x[3, ::2] = float("-inf")  # valid with -inf entries
        x[4, -1] = float("inf")  # invalid row, lse = +inf
        if vocab >= 3:  # exact tie for the max
            x[5, 1] = x[5, -1] = x[5].max() + 1
    return x


def key_scan_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows for the CPU kernels' scans on sortable integer keys: signs of zero, a negative
    NaN, ties in one lane and across lanes, lane tails (vocab not a multiple of 16 / 32)."""
    g = torch.Generator().manual_seed(vocab)
    x = -1.0 - torch.rand(7, vocab, generator=g)
    late = vocab * 7 // 10
    x[0, 3], x[0, late] = -0.0, 0.0  # -0 first: its column wins
    x[1, 2], x[1, late] = 0.0, -0.0  # +0 first
    x[2, late] = -float("nan")  # a NaN with the sign bit: invalid row
    x[3, 1] = x[3, -1] = 2.0  # tie across lanes / the tail
    x[4] = float("-inf")
    x[4, late] = -0.0  # one finite element
    x[5, 0] = x[5, min(32, vocab - 1)] = 5.0  # tie in one lane: margin 0
    x[6, -1] = 9.0  # the max in the tail
    return x.to(dtype)
