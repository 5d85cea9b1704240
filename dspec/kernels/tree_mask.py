"""Triton tree_mask: ancestor bitsets and depths of whole token trees by pointer jumping.

One program per tree (grid = (B,)), everything in registers: ``anc`` [NP, WP] int32 words
(NP = next_pow2(N) <= 256 nodes, WP = next_pow2(ceil(N / 32)) <= 8 words), ``jump`` and
``depth`` [NP].  Round r (of log2(NP), enough to cover depth N - 1) gathers the row of
``jump[i]`` with ``tl.gather`` and does, for every live node at once,
``anc[i] |= anc[jump[i]]; depth[i] += depth[jump[i]]; jump[i] = jump[jump[i]]``.
Parents outside [0, i) count as -1 (see dspec.reference.tree_mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

MAX_NODES = 256


@triton.jit
def _tree_mask_kernel(
    par_ptr,
    par_stride,
    nodes,
    num_words,
    words_ptr,
    depth_ptr,
    NP: tl.constexpr,
    WP: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    w = tl.arange(0, WP)
    p = tl.load(par_ptr + b * par_stride + i, mask=i < nodes, other=-1)
    jump = tl.where((p >= 0) & (p < i), p, -1).to(tl.int32)  # range check before narrowing
    depth = (jump >= 0).to(tl.int32)
    # node i's own bit: word i // 32, bit i % 32 (1 << 31 is the int32 sign bit)
    anc = tl.where(w[None, :] == (i // 32)[:, None], (1 << (i % 32))[:, None], 0)
    anc = anc.to(tl.int32)
    for _ in tl.static_range(ROUNDS):
        live = jump >= 0
        at = tl.where(live, jump, 0)
        anc_j = tl.gather(anc, tl.broadcast_to(at[:, None], (NP, WP)), 0)
        depth_j = tl.gather(depth, at, 0)
        jump_j = tl.gather(jump, at, 0)
        anc = tl.where(live[:, None], anc | anc_j, anc)
        depth = tl.where(live, depth + depth_j, depth)
        jump = tl.where(live, jump_j, jump)
    row = b * nodes + i
    tl.store(
        words_ptr + row[:, None] * num_words + w[None, :], anc, mask=(i[:, None] < nodes) & (w[None, :] < num_words)
    )
    tl.store(depth_ptr + row, depth.to(tl.int64), mask=i < nodes)


def tree_mask_triton(parents: torch.Tensor):
    """parents int32/int64 [B, N] (N <= 256) -> (words int32 [B, N, W], depth int64 [B, N])."""
    batch, nodes = parents.shape
    if nodes > MAX_NODES:
        raise ValueError(f"tree_mask: the triton backend takes N <= {MAX_NODES} nodes, got {nodes}")
    num_words = -(-nodes // 32)
    dev = parents.device
    words = torch.empty(batch, nodes, num_words, dtype=torch.int32, device=dev)
    depth = torch.empty(batch, nodes, dtype=torch.int64, device=dev)
    if batch == 0 or nodes == 0:
        return words, depth
    par = parents if parents.stride(-1) == 1 else parents.contiguous()
    np_ = next_pow2(nodes)
    wp = next_pow2(num_words)
    rounds = max(0, nodes - 1).bit_length()
    _tree_mask_kernel[(batch,)](
        par,
        par.stride(0),
        nodes,
        num_words,
        words,
        depth,
        NP=np_,
        WP=wp,
        ROUNDS=rounds,
        num_warps=4 if np_ >= 128 else 1,
    )
    return words, depth
