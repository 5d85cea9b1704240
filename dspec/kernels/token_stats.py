"""Triton token_stats: argmax, top-1/top-2 probability, entropy and logsumexp in one read.

Every lane of a program keeps its own online state over the groups of 16 bytes it owns
(columns ``[g G, g G + G)``, ``G`` = 8 for 16-bit logits, 4 for float32, then the same
group one tile later): the running max ``m1`` and its index, the runner-up ``m2``,
``S = sum exp((x - m1) / T)`` and ``A = sum exp((x - m1) / T) (x - m1) / T``.  A group is
folded at once: its max, one rescale of the lane's sums, one exp2 per element; the lane
remembers only where its winning group starts, and reads those 16 bytes once more at the end
for the max's column and the runner-up.  Folding element by element (an exp and a chain of
selects each) made the kernel compute-bound at ~40 % of an H100's copy bandwidth.
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
def _finalize(row, big_m, idx, runner, s, a, nan_count, inv_t, token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr):
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
# [p * cols_per_split, (p + 1) * cols_per_split) of row r in BLOCK-wide tiles, each tile as
# BLOCK // GROUP groups of GROUP adjacent columns (16 bytes: one vector load per group).
# With one split it writes the final outputs; otherwise its merged state goes to the
# partials buffer for _token_stats_merge_kernel.
@triton.jit
def _token_stats_kernel(
    logits_ptr,
    row_stride,
    vocab,
    cols_per_split,
    inv_t,
    part_f_ptr,
    part_i_ptr,
    token_ptr,
    prob_ptr,
    margin_ptr,
    entropy_ptr,
    lse_ptr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    groups = tl.arange(0, BLOCK // GROUP)
    within = tl.arange(0, GROUP)[None, :]
    base = logits_ptr + row * row_stride
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, vocab)
    inv_t_log2 = inv_t * 1.4426950408889634

    m1 = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)  # max outside the winning group
    win = tl.full([BLOCK // GROUP], -1, tl.int32)  # first column of that group
    s = tl.zeros([BLOCK // GROUP], tl.float32)
    a = tl.zeros([BLOCK // GROUP], tl.float32)
    nan_count = tl.zeros([BLOCK // GROUP], tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + groups[:, None] * GROUP + within
        x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        # A NaN needs no care here: the max skips it on a GPU (and may return it in the
        # interpreter, which only garbles the state of a row that is invalid anyway); the
        # group's sum below is NaN exactly when the group holds one.
        g_max = tl.max(x, 1)
        beat = g_max > m1  # strictly: an equal later column loses
        new_m = tl.maximum(m1, g_max)
        d = (m1 - new_m) * inv_t  # rescale the sums (d == 0 when m1 holds)
        c = tl.where(m1 > float("-inf"), tl.exp(d), 0.0)
        a = tl.where(c > 0.0, c * (a + d * s), 0.0)  # c == 0: d may be -inf (0 * -inf)
        s = s * c
        m2 = tl.where(beat, m1, tl.maximum(m2, g_max))
        win = tl.where(beat, start + groups * GROUP, win)
        m1 = new_m
        # one exp2 per element, against a finite reference: with an infinite max (all -inf so
        # far, or a +inf: an invalid row whose sums are not read) the reference is 0, so the
        # group's sum is NaN exactly when the group holds a NaN.  The clamp keeps 0 * -inf
        # out of the entropy sum and changes nothing else (2^-256 is 0 in float).
        ref = tl.where(tl.abs(m1) < float("inf"), m1, 0.0)
        d2 = (x - ref[:, None]) * inv_t_log2
        e = tl.exp2(d2)
        g_s = tl.sum(e, 1)
        nan_count += (g_s != g_s).to(tl.int32)
        s += g_s
        a += tl.sum(e * tl.maximum(d2, -256.0), 1) * 0.6931471805599453

    # The winning group's column of the max (the first equal one) and its runner-up, from a
    # second read of that group alone (16 bytes a lane): the loop above only kept its start.
    cols = win[:, None] + within
    x = tl.load(base + cols, mask=(win[:, None] >= 0) & (cols < hi), other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    g_idx = tl.min(tl.where(x == m1[:, None], within, GROUP), 1)
    m2 = tl.maximum(m2, tl.max(tl.where(within == g_idx[:, None], float("-inf"), x), 1))
    i1 = tl.where(win >= 0, win + g_idx, 2147483647)

    big_m, idx, runner, s_tot, a_tot = _merge_lanes(m1, i1, m2, s, a, inv_t)
    nan_tot = tl.sum(nan_count, 0)
    if NUM_SPLITS == 1:
        _finalize(
            row, big_m, idx, runner, s_tot, a_tot, nan_tot, inv_t, token_ptr, prob_ptr, margin_ptr, entropy_ptr, lse_ptr
        )
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
def _token_stats_merge_kernel(
    part_f_ptr,
    part_i_ptr,
    inv_t,
    token_ptr,
    prob_ptr,
    margin_ptr,
    entropy_ptr,
    lse_ptr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
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
    _finalize(
        row,
        big_m,
        idx,
        runner,
        s_tot,
        a_tot,
        tl.sum(nan_count, 0),
        inv_t,
        token_ptr,
        prob_ptr,
        margin_ptr,
        entropy_ptr,
        lse_ptr,
    )


def token_stats_triton(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    num_splits: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
):
    """Run the Triton kernel; returns (token, prob, margin, entropy, lse) shaped logits[:-1].

    ``num_splits``, ``block`` (columns per tile, a power of two) and ``num_warps`` override
    the schedule (bench/tune_token_stats_gpu.py sweeps them)."""
    lead = logits.shape[:-1]
    x = as_rows(logits)
    rows, vocab = x.shape
    dev = x.device
    group = 16 // x.element_size()  # columns per 16-byte load
    # Tiles from bench/tune_token_stats_gpu.py on an H100 (bench/results/gpu/h100-2026-11-27-token-stats):
    # 1024 x 151936 bf16 in 126 us with 2048-column tiles and 8 warps (83 % of copy
    # bandwidth; 1024 columns / 4 warps: 137 us); float32 groups are 4 columns, so twice the
    # columns keep the same bytes per thread.
    widest = 4096 if x.element_size() == 4 else 2048
    block = max(block or min(next_pow2(vocab), widest), group)
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
        num_warps = num_warps or (8 if block >= 2048 else 4 if block >= 512 else 1)
        _token_stats_kernel[(rows, num_splits)](
            x,
            x.stride(0),
            vocab,
            cols_per_split,
            inv_t,
            part_f,
            part_i,
            token,
            prob,
            margin,
            entropy,
            lse,
            BLOCK=block,
            GROUP=group,
            NUM_SPLITS=num_splits,
            num_warps=num_warps,
        )
        if num_splits > 1:
            _token_stats_merge_kernel[(rows,)](
                part_f,
                part_i,
                inv_t,
                token,
                prob,
                margin,
                entropy,
                lse,
                NUM_SPLITS=num_splits,
                SPLITS_PAD=next_pow2(num_splits),
                num_warps=1,
            )
    return tuple(t.reshape(lead) for t in (token, prob, margin, entropy, lse))
