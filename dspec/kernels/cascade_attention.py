"""Triton cascade attention: a shared prefix read once per KV group + a masked suffix.

Query rows are (suffix token, query head of a KV group) pairs, so one program's BLOCK_M rows
hold every query head that shares a KV head (GQA) and as many suffix tokens (branches) as
fit: each prefix tile is loaded once and used by all of them.  Flash-attention online
softmax in base 2; masked / empty rows are guarded so a query that sees no key ends with
out = 0 and lse = -inf.

Two schedules (``num_splits``):
- fused (1): grid (m_blocks, Hkv, B); a program streams its request's prefix rows, then the
  suffix keys under the packed mask, and writes the final output: one launch.
- split (S > 1): the prefix is cut into S chunks and the suffix is one more part; grid
  (m_blocks, Hkv * (S + 1), B) writes float32 partial (o, lse) and ``_merge_parts_kernel``
  combines them.  This fills the GPU when B * Hkv * m_blocks is small and the prefix long.

Memory traffic: q + out (B N Hq D), the suffix K/V (B N Hkv D) and each request's prefix
K/V once per m-block (once in total when N * Hq / Hkv <= BLOCK_M), + partials when split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpret
from ._utils import next_pow2, parallel_units

_LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, k_tile, v_tile, visible, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """One key tile of online softmax: scores, guarded rescale, P @ V.  Float32 operands
    take IEEE products: Triton's float32 dot on a GPU defaults to TF32 (a 10-bit mantissa),
    which put 2e-3 errors into float32 outputs on an H100."""
    if UPCAST:
        s = tl.dot(q, tl.trans(k_tile.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k_tile))
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v_tile.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile)
    return m_new, l_i, acc


# grid = (m_blocks, Hkv * parts, B).  Program (mb, kvh + Hkv * part, b) owns query rows
# [mb * BLOCK_M, (mb + 1) * BLOCK_M) of (token, head-in-group) pairs for KV head kvh of
# request b.  Fused (parts == 1): whole prefix, then the suffix.  Split: part < NUM_SPLITS is
# one prefix chunk, part == NUM_SPLITS the suffix; partial (o, lse) go to the workspace.
@triton.jit
def _cascade_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pk_ptr,
    pv_ptr,
    indptr_ptr,
    table_ptr,
    mask_ptr,
    out_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    n,
    num_kv_heads,
    group,
    scale_log2,
    chunk,
    sq_b,
    sq_n,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    spk_page,
    spk_t,
    spk_h,
    spv_page,
    spv_t,
    spv_h,
    s_table,
    sm_b,
    sm_n,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SUFFIX_PART: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    mb = tl.program_id(0)
    kvh = tl.program_id(1) % num_kv_heads
    part = tl.program_id(1) // num_kv_heads
    b = tl.program_id(2).to(tl.int64)
    num_q_heads = num_kv_heads * group

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n * group
    qn = rows // group
    head = kvh * group + rows % group
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * sq_b + qn[:, None].to(tl.int64) * sq_n + head[:, None] * sq_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    keys = tl.arange(0, BLOCK_N)

    # fused: one part (0) does prefix and suffix; split: parts 0..S-1 prefix, S the suffix
    if HAS_PREFIX:
        if part < NUM_SPLITS:
            if PAGE_SIZE > 0:  # paged: logical rows 0..len, indptr_ptr holds the lengths
                p_lo = tl.load(indptr_ptr + b) * 0
                p_hi = tl.load(indptr_ptr + b)
            else:  # ragged: rows indptr[b]..indptr[b + 1] of prefix_k
                p_lo = tl.load(indptr_ptr + b)
                p_hi = tl.load(indptr_ptr + b + 1)
            if NUM_SPLITS > 1:
                p_lo = tl.minimum(p_lo + part * chunk, p_hi)
                p_hi = tl.minimum(p_lo + chunk, p_hi)
            for start in range(p_lo, p_hi, BLOCK_N):
                t = (start + keys).to(tl.int64)
                t_ok = t < p_hi
                kv_mask = t_ok[:, None] & d_ok[None, :]
                if PAGE_SIZE > 0:
                    page = tl.load(table_ptr + b * s_table + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
                    k_rows = page * spk_page + (t % PAGE_SIZE) * spk_t
                    v_rows = page * spv_page + (t % PAGE_SIZE) * spv_t
                else:
                    k_rows = t * spk_t
                    v_rows = t * spv_t
                k_tile = tl.load(pk_ptr + k_rows[:, None] + kvh * spk_h + d[None, :], mask=kv_mask, other=0.0)
                v_tile = tl.load(pv_ptr + v_rows[:, None] + kvh * spv_h + d[None, :], mask=kv_mask, other=0.0)
                visible = row_ok[:, None] & t_ok[None, :]
                m_i, l_i, acc = _attend(q, k_tile, v_tile, visible, m_i, l_i, acc, scale_log2, UPCAST)
    if part == SUFFIX_PART:
        for start in range(0, n, BLOCK_N):
            j = start + keys
            j_ok = j < n
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k_tile = tl.load(
                k_ptr + b * sk_b + j[:, None].to(tl.int64) * sk_n + kvh * sk_h + d[None, :], mask=kv_mask, other=0.0
            )
            v_tile = tl.load(
                v_ptr + b * sv_b + j[:, None].to(tl.int64) * sv_n + kvh * sv_h + d[None, :], mask=kv_mask, other=0.0
            )
            visible = row_ok[:, None] & j_ok[None, :]
            if HAS_MASK:
                # bit (qn, j) of the packed words: word j // 32 of row qn
                words = tl.load(mask_ptr + b * sm_b + qn[:, None] * sm_n + (j[None, :] >> 5), mask=visible, other=0)
                visible = visible & (((words >> (j[None, :] & 31)) & 1) != 0)
            m_i, l_i, acc = _attend(q, k_tile, v_tile, visible, m_i, l_i, acc, scale_log2, UPCAST)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    flat = (b * n + qn) * num_q_heads + head  # (b, token, head) row of out / lse
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + flat[:, None] * HEAD_DIM + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        if WRITE_LSE:
            tl.store(lse_ptr + flat, lse, mask=row_ok)
    else:
        slot = flat * (NUM_SPLITS + 1) + part
        tl.store(part_o_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + slot, lse, mask=row_ok)


@triton.jit
def _merge_pair(o, lse, o_b, lse_b):
    """Combine two normalised partial states; two empty states stay (0, -inf)."""
    m = tl.maximum(lse, lse_b)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    wa = tl.exp(lse - m_safe)
    wb = tl.exp(lse_b - m_safe)
    total = wa + wb
    o = (wa[:, None] * o + wb[:, None] * o_b) / tl.where(empty, 1.0, total)[:, None]
    return o, tl.where(empty, m, m_safe + tl.log(total))


# grid = (cdiv(rows, BLOCK_R),).  Each program folds the PARTS partial states of BLOCK_R
# (token, head) rows into the final output.
@triton.jit
def _merge_parts_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_rows,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ok = rows < num_rows
    d = tl.arange(0, D_PAD)
    io_mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    lse = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for p in range(PARTS):
        slot = rows * PARTS + p
        o_p = tl.load(part_o_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=io_mask, other=0.0)
        lse_p = tl.load(part_lse_ptr + slot, mask=ok, other=float("-inf"))
        o, lse = _merge_pair(o, lse, o_p, lse_p)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)
    if WRITE_LSE:
        tl.store(lse_ptr + rows, lse, mask=ok)


# grid = (cdiv(rows, BLOCK_R),): merge_states on [rows, D] views.
@triton.jit
def _merge_states_kernel(
    oa_ptr,
    la_ptr,
    ob_ptr,
    lb_ptr,
    out_ptr,
    lse_ptr,
    num_rows,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ok = rows < num_rows
    d = tl.arange(0, D_PAD)
    io_mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    at = rows[:, None] * HEAD_DIM + d[None, :]
    o_a = tl.load(oa_ptr + at, mask=io_mask, other=0.0).to(tl.float32)
    o_b = tl.load(ob_ptr + at, mask=io_mask, other=0.0).to(tl.float32)
    l_a = tl.load(la_ptr + rows, mask=ok, other=float("-inf")).to(tl.float32)
    l_b = tl.load(lb_ptr + rows, mask=ok, other=float("-inf")).to(tl.float32)
    o, lse = _merge_pair(o_a, l_a, o_b, l_b)
    tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    tl.store(lse_ptr + rows, lse, mask=ok)


def choose_splits(batch, m_blocks, num_kv_heads, max_prefix, block_n, device, min_tiles=None, capturing=False):
    """Prefix chunks so that small batches with long prefixes still fill the GPU.

    A split costs a second launch (the merge) and float32 partials: on an H100 with eager
    launches (bench/results/gpu/h100-2026-11-27/tune_cascade.json) it paid only when every
    chunk held about 4096 prefix rows -- B1 P4096 N64: fused 69 us, 2 to 16 splits 108-117 us;
    B1 P32768 N64: fused 425 us, 4 splits 123 us -- so a CUDA chunk is at least 4096 rows.

    ``capturing`` (a CUDA graph is being recorded) at batch 1: replays launch the merge with
    no host cost, and the few programs of one request leave most SMs idle.  Measured under
    graph replay (64x64 tiles, 32 programs, 132 SMs; bench/results/gpu/
    h100-2026-11-27-token-stats/tune_cascade_graph.json, h200-2026-11-28/tune_cascade_graph2.json):
    P512: 1 split 21.7 us, 2 18.6; P4096: 1 65.2, 2 31.4, 4 33.3, 8 40.5; P32768: 4 118,
    8 124 -- about one program per SM, every chunk at least 4 tiles.  Larger batches keep
    the eager rule: it was the best schedule, or within 1 %, in their four measured cases.
    """
    programs = batch * m_blocks * num_kv_heads
    tiles = -(-max_prefix // block_n)
    if capturing and batch == 1 and min_tiles is None:
        splits = min(-(-parallel_units(device) // max(programs, 1)), tiles // 4)
        return splits if splits >= 2 else 1
    if min_tiles is None:
        min_tiles = max(4, 4096 // block_n) if device.type == "cuda" else 4
    want = -(-2 * parallel_units(device) // max(programs, 1))
    splits = min(want, tiles // min_tiles)
    return splits if splits >= 2 else 1


def cascade_attention_triton(
    q,
    k,
    v,
    mask,
    prefix_k,
    prefix_v,
    prefix_indptr,
    sm_scale,
    return_lse,
    *,
    prefix_page_table=None,
    prefix_lens=None,
    max_prefix_len=None,
    num_splits=None,
    block_m=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
):
    """Ragged prefix (prefix_k [T, Hkv, D] + prefix_indptr) or paged prefix (prefix_k
    [pages, page_size, Hkv, D] + prefix_page_table [B, max_pages] + prefix_lens [B]).
    ``num_splits`` / ``block_m`` / ``block_n`` / ``num_warps`` / ``num_stages``: None picks
    the defaults below; set, they pin the schedule (bench/tune_cascade_gpu.py sweeps them)."""
    batch, n, hq, head_dim = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    dev = q.device
    upcast = triton_interpret() or q.dtype == torch.float32
    interp = triton_interpret()
    # tiles: 16-bit inputs use tensor cores with 64/128-row query blocks; float32 (upcast)
    # tiles are twice the bytes, so smaller key tiles keep shared memory under ~100 KB
    # (measured ahead of time for sm_90: fp32 d128 64x64 would take 180 KB).
    # 16-bit tiles as measured on an H100 (bench/results/gpu/h100-2026-11-27/tune_cascade.json,
    # 216 schedules x 7 cases): 128x64 / 8 warps / 3 stages once the 128-row blocks alone give
    # half the SMs a program (B64 P4096 N64: 801 us; the old 2 stages 1054), else 64x64 /
    # 4 warps / 4 stages, twice the programs (B1 P4096 N64: 69 us; the old 128x64 with its
    # 16 splits 118, fused 135).
    if interp:
        default_m, default_n, warps, stages = 16, 16, 1, 1
    elif upcast:
        default_m, default_n, warps, stages = 64, 32, 4, 2
    elif n * group <= 64 or batch * hkv * triton.cdiv(n * group, 128) < parallel_units(dev) // 2:
        default_m, default_n, warps, stages = 64, 64, 4, 4
    else:
        default_m, default_n, warps, stages = 128, 64, 8, 3
    block_m = block_m or default_m
    block_n = block_n or default_n
    warps = num_warps or warps
    stages = num_stages or stages
    d_pad = max(16, next_pow2(head_dim))
    m_blocks = triton.cdiv(n * group, block_m)
    has_prefix = prefix_k is not None
    paged = prefix_page_table is not None
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if has_prefix and max_prefix_len is None:
        if paged:  # an upper bound without reading the lengths when capturing
            max_prefix_len = (
                prefix_page_table.shape[1] * prefix_k.shape[1] if capturing else int(prefix_lens.max()) if batch else 0
            )
        else:
            max_prefix_len = (
                prefix_k.shape[0] if capturing or batch == 1 else int((prefix_indptr[1:] - prefix_indptr[:-1]).max())
            )
    if has_prefix and num_splits is None:
        num_splits = choose_splits(batch, m_blocks, hkv, max_prefix_len, block_n, dev, capturing=capturing)
    num_splits = num_splits if has_prefix else 1
    chunk = 0
    if num_splits > 1:
        chunk = triton.cdiv(triton.cdiv(max(max_prefix_len, 1), num_splits), block_n) * block_n

    out = torch.empty(batch, n, hq, head_dim, dtype=q.dtype, device=dev)
    lse = torch.empty(batch, n, hq, dtype=torch.float32, device=dev)
    if batch == 0 or n == 0:
        return (out, lse) if return_lse else out
    parts = num_splits + 1 if num_splits > 1 else 1
    if parts > 1:
        part_o = torch.empty(batch * n * hq * parts, head_dim, dtype=torch.float32, device=dev)
        part_lse = torch.empty(batch * n * hq * parts, dtype=torch.float32, device=dev)
    else:
        part_o = part_lse = lse  # unused
    if mask is not None:
        sm_b = mask.stride(0) if mask.dim() == 3 else 0
        sm_n = mask.stride(-2)
    else:
        mask, sm_b, sm_n = lse, 0, 0
    pk = prefix_k if has_prefix else k
    pv = prefix_v if has_prefix else v
    if paged:  # [pages, page_size, Hkv, D]
        indptr, table = prefix_lens, prefix_page_table
        pk_strides = (pk.stride(0), pk.stride(1), pk.stride(2))
        pv_strides = (pv.stride(0), pv.stride(1), pv.stride(2))
        page_size, s_table = prefix_k.shape[1], table.stride(0)
    else:  # [T, Hkv, D]
        indptr, table = (prefix_indptr if has_prefix else lse), lse
        pk_strides = (0, pk.stride(0), pk.stride(1))
        pv_strides = (0, pv.stride(0), pv.stride(1))
        page_size, s_table = 0, 0
    grid = (m_blocks, hkv * parts, batch)
    _cascade_kernel[grid](
        q,
        k,
        v,
        pk,
        pv,
        indptr,
        table,
        mask,
        out,
        lse,
        part_o,
        part_lse,
        n,
        hkv,
        group,
        (sm_scale if sm_scale is not None else head_dim**-0.5) * _LOG2E,
        chunk,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *pk_strides,
        *pv_strides,
        s_table,
        sm_b,
        sm_n,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        SUFFIX_PART=parts - 1,
        HAS_PREFIX=has_prefix,
        PAGE_SIZE=page_size,
        HAS_MASK=mask is not lse,
        WRITE_LSE=return_lse or parts > 1,
        UPCAST=upcast,
        num_warps=warps,
        num_stages=stages,
    )
    if parts > 1:
        rows = batch * n * hq
        block_r = 16
        _merge_parts_kernel[(triton.cdiv(rows, block_r),)](
            part_o,
            part_lse,
            out,
            lse,
            rows,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            PARTS=parts,
            BLOCK_R=block_r,
            WRITE_LSE=return_lse,
            num_warps=4 if not interp else 1,
        )
    return (out, lse) if return_lse else out


def merge_states_triton(o_a, lse_a, o_b, lse_b):
    head_dim = o_a.shape[-1]
    rows = lse_a.numel()
    oa = o_a.reshape(rows, head_dim).contiguous()
    ob = o_b.reshape(rows, head_dim).contiguous()
    out = torch.empty_like(oa)
    lse = torch.empty(rows, dtype=torch.float32, device=o_a.device)
    if rows:
        block_r = 16
        _merge_states_kernel[(triton.cdiv(rows, block_r),)](
            oa,
            lse_a.reshape(rows).contiguous(),
            ob,
            lse_b.reshape(rows).contiguous(),
            out,
            lse,
            rows,
            HEAD_DIM=head_dim,
            D_PAD=next_pow2(head_dim),
            BLOCK_R=block_r,
            num_warps=4 if not triton_interpret() else 1,
        )
    return out.reshape(o_a.shape), lse.reshape(lse_a.shape)
