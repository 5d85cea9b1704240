"""Reference cascade_attention and merge_states.

Explicit masked softmax over [prefix keys | suffix keys] per request, in float32 (float64
when the inputs are float64: the tests' oracle).  Query (b, i) sees every prefix row of its
request and the suffix keys j whose mask bit (i, j) is set.  A query that sees no key gets
out = 0 and lse = -inf; a NaN score (a NaN in a query or a visible key) gives a NaN out and
lse for that query.  lse is the natural-log logsumexp of the scaled scores.
"""

from __future__ import annotations

import torch

from .pack_mask import pack_mask, unpack_mask


def cascade_attention(
    q, k, v, mask=None, *, prefix_k=None, prefix_v=None, prefix_indptr=None, sm_scale=None, return_lse=False
):
    batch, n, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else d**-0.5
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dense = None
    if mask is not None:
        dense = unpack_mask(mask, n) if mask.dtype != torch.bool else mask
        if dense.dim() == 2:
            dense = dense.expand(batch, n, n)
    out = torch.empty(batch, n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n, hq, dtype=torch.float32, device=q.device)
    for b in range(batch):
        keys, values = k[b], v[b]
        visible = torch.ones(n, n, dtype=torch.bool, device=q.device) if dense is None else dense[b]
        if prefix_k is not None:
            lo, hi = int(prefix_indptr[b]), int(prefix_indptr[b + 1])
            keys = torch.cat([prefix_k[lo:hi], keys])
            values = torch.cat([prefix_v[lo:hi], values])
            visible = torch.cat([torch.ones(n, hi - lo, dtype=torch.bool, device=q.device), visible], 1)
        # GQA without copying K/V per query head: the rows of a KV head's matmul are the
        # (head-in-group, token) pairs of its query heads
        qg = q[b].to(acc).view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
        scores = torch.matmul(qg, keys.to(acc).permute(1, 2, 0)) * scale  # [Hkv, G*N, S]
        scores = scores.masked_fill(~visible.repeat(group, 1)[None], float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # [Hkv, G*N]; -inf when empty
        # a row that sees no key (lse = -inf) gets 0; a NaN score (a NaN query or key) stays NaN
        probs = torch.exp(scores - row_lse[..., None]).masked_fill((row_lse == float("-inf"))[..., None], 0.0)
        o = torch.matmul(probs, values.to(acc).transpose(0, 1))  # [Hkv, G*N, D]
        out[b] = o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
        lse[b] = row_lse.view(hkv, group, n).permute(2, 0, 1).reshape(n, hq).float()
    return (out, lse) if return_lse else out


def ragged_cascade_attention(
    q,
    k,
    v,
    mask=None,
    *,
    suffix_indptr,
    prefix_k=None,
    prefix_v=None,
    prefix_indptr=None,
    sm_scale=None,
    return_lse=False,
):
    """Ragged suffixes: q [T, Hq, D], k, v [T, Hkv, D], request b's rows
    ``suffix_indptr[b]:suffix_indptr[b + 1]``, mask words [T, ceil(max_n / 32)] (bit j of a
    row of request b: b's suffix key j) -- B separate calls of :func:`cascade_attention`."""
    bounds = [int(x) for x in suffix_indptr]
    hq, d = q.shape[1:]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        n = hi - lo
        if n == 0:
            continue
        words = None
        if mask is not None:
            words = pack_mask(unpack_mask(mask[lo:hi], n))[None]
        kw = {}
        if prefix_k is not None:
            p0, p1 = int(prefix_indptr[b]), int(prefix_indptr[b + 1])
            kw = dict(
                prefix_k=prefix_k[p0:p1],
                prefix_v=prefix_v[p0:p1],
                prefix_indptr=torch.tensor([0, p1 - p0], device=q.device),
            )
        o, s = cascade_attention(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], words, sm_scale=sm_scale, return_lse=True, **kw
        )
        out[lo:hi], lse[lo:hi] = o[0], s[0]
    return (out, lse) if return_lse else out


def gather_pages(prefix_k, prefix_v, page_table, lens):
    """Paged prefix [pages, page_size, Hkv, D] -> the ragged layout (rows back to back + indptr)."""
    page_size = prefix_k.shape[1]
    rows_k, rows_v, indptr = [], [], [0]
    for b in range(page_table.shape[0]):
        t = torch.arange(int(lens[b]), device=prefix_k.device)
        pages = page_table[b].long()[t // page_size]
        rows_k.append(prefix_k[pages, t % page_size])
        rows_v.append(prefix_v[pages, t % page_size])
        indptr.append(indptr[-1] + int(lens[b]))
    return (torch.cat(rows_k), torch.cat(rows_v), torch.tensor(indptr, dtype=torch.int64, device=prefix_k.device))


def merge_states(o_a, lse_a, o_b, lse_b):
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    o = (wa[..., None] * o_a.float() + wb[..., None] * o_b.float()) / torch.where(empty, 1.0, total)[..., None]
    lse = torch.where(empty, m, m_safe + torch.log(total))
    return o.to(o_a.dtype), lse


def merge_states_many(v, lse):
    """S states at once: v [..., S, H, D], lse [..., S, H] -> (o [..., H, D], lse [..., H]),
    the pairwise rule's log-sum-exp over S (all -inf: o = 0, lse = -inf)."""
    ls = lse.float()
    m = ls.amax(-2)  # [..., H]
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(ls - m_safe.unsqueeze(-2))  # [..., S, H]
    total = w.sum(-2)
    o = (w[..., None] * v.float()).sum(-3) / torch.where(empty, 1.0, total)[..., None]
    out_lse = torch.where(empty, m, m_safe + torch.log(total))
    return o.to(v.dtype), out_lse
