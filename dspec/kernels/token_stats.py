"""Triton token_stats: argmax, top-1/top-2 probability, entropy and logsumexp in one read.

Every lane of a program keeps its own online state over the elements it owns
(``lane, lane + BLOCK, lane + 2 BLOCK, ...``): the running max ``m1`` and its index, the
runner-up ``m2``, ``S = sum exp((x - m1) / T)`` and ``A = sum exp((x - m1) / T) (x - m1) / T``.
A new element costs one exp: whichever of (old max, element) is smaller is rescaled.
Entropy is ``log S - A / S`` and logsumexp ``m1 / T + log S``; no softmax is materialised.
Lanes (and vocabulary splits) are merged once at the end with the same algebra.

Memory traffic: one read of the logits (rows x V x itemsize) + 24 bytes per row written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import as_rows, next_pow2, vocab_splits

_NEG_INF = float("-inf")
_BIG_INDEX = 2147483647


@triton.jit
def _merge_lanes(m1, i1, m2, s, a, inv_t):
    """Reduce per-lane online states (vectors) to one state (scalars).

    The winner is the largest m1, lowest index among ties; the runner-up is the largest of
    every lane's m2 and every other lane's m1 (a tie across lanes gives m2 == m1).
    """
    big_m = tl.max(m1, 0)
    idx = tl.min(tl.where(m1 == big_m, i1, 2147483647), 0)
    others = tl.where(i1 == idx, float("-inf"), m1)
    runner = tl.maximum(tl.max(m2, 0), tl.max(others, 0))
    d = (m1 - big_m) * inv_t
    live = m1 > float("-inf")
    c = tl.where(live, tl.exp(d), 0.0)
    s_tot = tl.sum(tl.where(c > 0.0, s * c, 0.0), 0)
    # c == 0 also when d overflows to -inf (huge logits or tiny T): 0 * -inf would be NaN
    a_tot = tl.sum(tl.where(c > 0.0, c * (a + d * s), 0.0), 0)
    return big_m, idx, runner, s_tot, a_tot


@triton.jit
def _finalize(row, big_m, idx, runner, s, a, nan_count, inv_t,
              token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr):
    # invalid rows: a NaN, a +inf, or nothing but -inf (see dspec.reference.token_stats)
    valid = (nan_count == 0) & (big_m < float("inf")) & (big_m > float("-inf"))
    log_s = tl.log(s)
    nan = float("nan")
    tl.store(token_ptr + row, tl.where(valid, idx.to(tl.int64), -1))
    tl.store(prob_ptr + row, tl.where(valid, 1.0 / s, nan))
    tl.store(margin_ptr + row, tl.where(valid, (1.0 - tl.exp((runner - big_m) * inv_t)) / s, nan))
    tl.store(entropy_ptr + row, tl.where(valid, log_s - a / s, nan))
    lse = tl.where(valid, big_m * inv_t + log_s, tl.where(nan_count > 0, nan, big_m))
    tl.store(lse_ptr + row, lse)


# grid = (rows, NUM_SPLITS).  Program (r, p) streams columns
# [p * cols_per_split, (p + 1) * cols_per_split) of row r in BLOCK-wide tiles.  With one
# split it writes the final outputs; otherwise its merged state goes to the partials buffer
# for _token_stats_merge_kernel.
@triton.jit
def _token_stats_kernel(logits_ptr, row_stride, vocab, cols_per_split, inv_t,
                        part_f_ptr, part_i_ptr,
                        token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr,
                        BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row * row_stride
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, vocab)

    m1 = tl.full([BLOCK], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK], float("-inf"), tl.float32)
    i1 = tl.full([BLOCK], 2147483647, tl.int32)
    s = tl.zeros([BLOCK], tl.float32)
    a = tl.zeros([BLOCK], tl.float32)
    nan_count = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        nan_count += is_nan.to(tl.int32)
        x = tl.where(is_nan, float("-inf"), x)
        live = x > float("-inf")
        gt = x > m1
        # one exp per element: rescale whichever of (running max, x) is smaller
        diff = tl.where(gt, m1 - x, x - m1) * inv_t
        e = tl.where(live, tl.exp(diff), 0.0)
        s_gt = s * e + 1.0
        a_gt = tl.where(e > 0.0, e * (a + diff * s), 0.0)  # e == 0: old state negligible
        s_le = s + e
        a_le = a + tl.where(e > 0.0, e * diff, 0.0)
        s = tl.where(live, tl.where(gt, s_gt, s_le), s)
        a = tl.where(live, tl.where(gt, a_gt, a_le), a)
        m2 = tl.where(gt, m1, tl.maximum(m2, x))
        i1 = tl.where(gt, cols, i1)
        m1 = tl.where(gt, x, m1)

    big_m, idx, runner, s_tot, a_tot = _merge_lanes(m1, i1, m2, s, a, inv_t)
    nan_tot = tl.sum(nan_count, 0)
    if NUM_SPLITS == 1:
        _finalize(row, big_m, idx, runner, s_tot, a_tot, nan_tot, inv_t,
                  token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr)
    else:
        slot = row * NUM_SPLITS + split
        tl.store(part_f_ptr + slot * 4 + 0, big_m)
        tl.store(part_f_ptr + slot * 4 + 1, runner)
        tl.store(part_f_ptr + slot * 4 + 2, s_tot)
        tl.store(part_f_ptr + slot * 4 + 3, a_tot)
        tl.store(part_i_ptr + slot * 2 + 0, idx)
        tl.store(part_i_ptr + slot * 2 + 1, nan_tot)


# grid = (rows,).  Merges the NUM_SPLITS partial states of one row (one lane per split).
@triton.jit
def _token_stats_merge_kernel(part_f_ptr, part_i_ptr, inv_t,
                              token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr,
                              NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, SPLITS_PAD)
    ok = lanes < NUM_SPLITS
    slot = row * NUM_SPLITS + lanes
    m1 = tl.load(part_f_ptr + slot * 4 + 0, mask=ok, other=float("-inf"))
    m2 = tl.load(part_f_ptr + slot * 4 + 1, mask=ok, other=float("-inf"))
    s = tl.load(part_f_ptr + slot * 4 + 2, mask=ok, other=0.0)
    a = tl.load(part_f_ptr + slot * 4 + 3, mask=ok, other=0.0)
    i1 = tl.load(part_i_ptr + slot * 2 + 0, mask=ok, other=2147483647)
    nan_count = tl.load(part_i_ptr + slot * 2 + 1, mask=ok, other=0)
    big_m, idx, runner, s_tot, a_tot = _merge_lanes(m1, i1, m2, s, a, inv_t)
    _finalize(row, big_m, idx, runner, s_tot, a_tot, tl.sum(nan_count, 0), inv_t,
              token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr)


def token_stats_triton(logits: torch.Tensor, temperature: float = 1.0, *,
                       num_splits: int | None = None, block: int | None = None):
    """Run the Triton kernel; returns (token, prob, margin, entropy, lse) shaped logits[:-1]."""
    lead = logits.shape[:-1]
    x = as_rows(logits)
    rows, vocab = x.shape
    dev = x.device
    block = block or min(next_pow2(vocab), 1024)
    if num_splits is None:
        num_splits = vocab_splits(rows, vocab, block, dev)
    num_splits = max(1, min(int(num_splits), -(-vocab // block)))
    tiles_per_split = -(-(-(-vocab // block)) // num_splits)
    cols_per_split = tiles_per_split * block
    token = torch.empty(rows, dtype=torch.int64, device=dev)
    prob, margin, entropy, lse = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(4))
    if rows:
        if num_splits > 1:
            part_f = torch.empty(rows * num_splits * 4, dtype=torch.float32, device=dev)
            part_i = torch.empty(rows * num_splits * 2, dtype=torch.int32, device=dev)
        else:
            part_f = part_i = prob  # unused
        inv_t = 1.0 / temperature
        num_warps = 4 if block >= 512 else 1
        _token_stats_kernel[(rows, num_splits)](
            x, x.stride(0), vocab, cols_per_split, inv_t, part_f, part_i,
            token, prob, margin, entropy, lse,
            BLOCK=block, NUM_SPLITS=num_splits, num_warps=num_warps)
        if num_splits > 1:
            _token_stats_merge_kernel[(rows,)](
                part_f, part_i, inv_t, token, prob, margin, entropy, lse,
                NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits), num_warps=1)
    return tuple(t.reshape(lead) for t in (token, prob, margin, entropy, lse))
