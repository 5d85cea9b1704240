"""Triton fused boundary kernel: boundary_posterior, rejection_boundaries, expected_accept_length.

With ``C_i = sum_{j<i} log conf_j``: ``log r_i = C_i + log1p(-conf_i)`` (i < L),
``log r_L = C_L``, ``E[accepted] = sum_{i=1..L} exp(C_i)``.  Working in log space keeps the
ranking exact where r underflows (L up to 64 and beyond).  One program handles ROWS rows of
``conf`` (a few hundred bytes each): the kernel is launch-bound, so all three outputs come
from one launch and one read of ``conf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2


@triton.jit
def _log1p_neg(c):
    """log(1 - c), accurate for tiny c (Goldberg's trick; Triton has no portable log1p)."""
    u = 1.0 - c
    return tl.where(u == 1.0, -c, tl.log(u) * (-c) / (u - 1.0))


# grid = (cdiv(B, ROWS),).  Program p reads conf rows [p*ROWS, (p+1)*ROWS) once and writes
# whichever outputs the constexpr flags ask for.
@triton.jit
def _boundary_kernel(
    conf_ptr,
    conf_stride,
    batch,
    length,
    r_ptr,
    len_ptr,
    rtop_ptr,
    exp_ptr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    LP: tl.constexpr,
    WANT_R: tl.constexpr,
    WANT_TOP: tl.constexpr,
    WANT_EXP: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slots = tl.arange(0, LP)
    row_ok = rows < batch
    base = conf_ptr + rows.to(tl.int64)[:, None] * conf_stride
    has_conf = row_ok[:, None] & (slots[None, :] < length)
    conf = tl.load(base + slots[None, :], mask=has_conf, other=1.0).to(tl.float32)
    prev_ok = row_ok[:, None] & (slots[None, :] >= 1) & (slots[None, :] <= length)
    prev = tl.load(base + slots[None, :] - 1, mask=prev_ok, other=1.0).to(tl.float32)
    exclusive = tl.cumsum(tl.log(prev), 1)  # C_i: log-probability that the first i drafts pass
    log_r = exclusive + tl.where(has_conf, _log1p_neg(conf), 0.0)
    in_range = slots[None, :] <= length
    if WANT_R:
        r_at = rows.to(tl.int64)[:, None] * (length + 1) + slots[None, :]
        tl.store(r_ptr + r_at, tl.exp(log_r), mask=row_ok[:, None] & in_range)
    if WANT_EXP:
        inclusive = tl.cumsum(tl.log(conf), 1)
        tl.store(exp_ptr + rows, tl.sum(tl.where(has_conf, tl.exp(inclusive), 0.0), 1), mask=row_ok)
    if WANT_TOP:
        # k largest log r over i in [0, L-1], ties to the smaller i; NaN ranks as -inf
        avail = (slots[None, :] < length) & (slots[None, :] >= 0) & row_ok[:, None]
        score = tl.where(log_r == log_r, log_r, float("-inf"))
        for t in range(K):
            cand = tl.where(avail, score, float("-inf"))
            top = tl.max(cand, 1)
            pick = tl.min(tl.where(avail & (cand == top[:, None]), slots[None, :], LP), 1)
            avail = avail & (slots[None, :] != pick[:, None])
            top_at = rows.to(tl.int64) * K + t
            tl.store(len_ptr + top_at, pick.to(tl.int64), mask=row_ok)
            tl.store(rtop_ptr + top_at, tl.exp(top), mask=row_ok)


def boundary_triton(conf: torch.Tensor, k: int = 0, *, want_r: bool = False, want_expected: bool = False):
    """Returns (r[B, L+1] | None, lengths[B, k] | None, r_top[B, k] | None, expected[B] | None)."""
    batch, length = conf.shape
    if conf.stride(-1) != 1:
        conf = conf.contiguous()
    dev = conf.device
    r = torch.empty(batch, length + 1, dtype=torch.float32, device=dev) if want_r else None
    lengths = torch.empty(batch, k, dtype=torch.int64, device=dev) if k else None
    r_top = torch.empty(batch, k, dtype=torch.float32, device=dev) if k else None
    expected = torch.empty(batch, dtype=torch.float32, device=dev) if want_expected else None
    if batch:
        lp = next_pow2(length + 1)
        rows = max(1, min(16, 2048 // lp))
        dummy = conf
        _boundary_kernel[(triton.cdiv(batch, rows),)](
            conf,
            conf.stride(0),
            batch,
            length,
            r if r is not None else dummy,
            lengths if k else dummy,
            r_top if k else dummy,
            expected if expected is not None else dummy,
            K=k,
            ROWS=rows,
            LP=lp,
            WANT_R=want_r,
            WANT_TOP=k > 0,
            WANT_EXP=want_expected,
            num_warps=1 if lp <= 64 else 2,
        )
    return r, lengths, r_top, expected
