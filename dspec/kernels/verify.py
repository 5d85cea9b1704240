"""Triton verify_chain / verify_tree: fused acceptance with lazy residual resampling.

Four launches, none of which needs the host to look at a value (CUDA-graph safe):

1. ``token_stats`` over every target row [B * P, V] (P = L + 1 or N): argmax and ``1 / S``
   from one read of the logits, the vocabulary split over programs when B is small.
   ``p(v) = exp((logit_v - logit_argmax) / T) / S`` is then one load away for any v.
2. accept (grid B): chain: every position at once (coins * q(x) < p(x), or x == argmax),
   the first failure is the row's length; tree: a scalar walk over the nodes in index order.
   It writes the accepted tokens and, for sampling, a *draw spec*: which target row to draw
   from, whether q is subtracted, and which tokens (rejected siblings) are excluded.
3. draw tiles (grid B x splits): per-tile sums of the residual weights of that one row only
   (lazy: no residual is formed for any other position).
4. draw pick (grid B): prefix over the tile sums finds the tile where ``cumsum > u * sum``;
   one tile is re-read to find the token.

Memory traffic: one read of the target logits (plus the draft_probs row of the rejected
position) + about 1.5 rows of V per sequence for the draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..types import TreeVerifyOutput, VerifyOutput
from ._utils import next_pow2, vocab_splits
from .token_stats import token_stats_triton

MODE_P, MODE_EXCLUDE, MODE_RESIDUAL_Q, MODE_RESID = 0, 1, 2, 3


@triton.jit
def _p_of(logits_row_ptr, ids, top_logit, prob, inv_t, mask):
    """Target probability of ``ids`` given the row's argmax logit and 1 / S."""
    l = tl.load(logits_row_ptr + ids, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.exp((l - top_logit) * inv_t) * prob


# grid = (B,).  Program b decides every chain position of row b at once (LP lanes).
@triton.jit
def _chain_accept_kernel(
    draft_ptr,
    draft_stride,
    ndraft_ptr,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    q_stride_b,
    q_stride_l,
    coins_ptr,
    length,
    inv_t,
    num_ptr,
    out_ptr,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    spec_pos_ptr,
    LP: tl.constexpr,
    GREEDY: tl.constexpr,
    HAS_Q: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, LP)
    positions = length + 1
    n = tl.load(ndraft_ptr + b)
    live = i < n
    x = tl.load(draft_ptr + b * draft_stride + i, mask=live, other=0).to(tl.int64)
    rows = b * positions + i
    top = tl.load(argmax_ptr + rows, mask=i < positions, other=-1)
    if GREEDY:
        ok = (x == top) & live
    else:
        row_ptr = logits_ptr + rows * vocab
        top_logit = tl.load(row_ptr + tl.maximum(top, 0), mask=live, other=0.0).to(tl.float32)
        prob = tl.load(prob_ptr + rows, mask=live, other=0.0)
        p_x = tl.load(row_ptr + x, mask=live, other=0.0).to(tl.float32)
        p_x = tl.where(top >= 0, tl.exp((p_x - top_logit) * inv_t) * prob, float("nan"))
        if HAS_Q:
            q_x = tl.load(q_ptr + b * q_stride_b + i * q_stride_l + x, mask=live, other=1.0).to(tl.float32)
        else:
            q_x = tl.full([LP], 1.0, tl.float32)
        coin = tl.load(coins_ptr + b * length + i, mask=live, other=1.0)
        ok = (coin * q_x < p_x) & live
    j = tl.min(tl.where(ok, LP, i), 0)  # first failing position; <= n
    tl.store(num_ptr + b, j.to(tl.int64))
    out_at = out_ptr + b * positions + i
    tl.store(out_at, tl.where(i < j, x, -1), mask=i < positions)
    if GREEDY:
        tl.store(out_ptr + b * positions + j, tl.load(argmax_ptr + b * positions + j))
    else:
        rejected = j < n
        x_j = tl.sum(tl.where(i == j, x, 0), 0)
        tl.store(spec_row_ptr + b, b * positions + j)
        tl.store(spec_qrow_ptr + b, b * q_stride_b + j * q_stride_l)
        if HAS_Q:
            mode = tl.where(rejected, 2, 0)
        else:
            mode = tl.where(rejected, 1, 0)
        tl.store(spec_mode_ptr + b, mode)
        tl.store(spec_nex_ptr + b, tl.where(mode == 1, 1, 0))
        tl.store(spec_excl_ptr + b, x_j)
        tl.store(spec_pos_ptr + b, b * positions + j)


@triton.jit
def _block_draft_pq(
    draft_ptr,
    draft_stride,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    q_stride_b,
    q_stride_l,
    b,
    j,
    positions,
    inv_t,
    act,
    HAS_Q: tl.constexpr,
):
    """(x_j, p_j(x_j), q_j(x_j)) of row b's draft j (q = 1 without draft_probs); an id
    outside [0, V) gives p = 0, q = 1 (never accepted), as dspec::vf::chain_draft_pq."""
    row = b * positions + j
    x = tl.load(draft_ptr + b * draft_stride + j, mask=act, other=0).to(tl.int64)
    in_vocab = act & (x >= 0) & (x < vocab)
    xs = tl.where(in_vocab, x, 0)
    top = tl.load(argmax_ptr + row, mask=act, other=0)
    top_logit = tl.load(logits_ptr + row * vocab + tl.maximum(top, 0), mask=act, other=0.0).to(tl.float32)
    prob = tl.load(prob_ptr + row, mask=act, other=0.0)
    l_x = tl.load(logits_ptr + row * vocab + xs, mask=in_vocab, other=0.0).to(tl.float32)
    p_x = tl.where(in_vocab, tl.exp((l_x - top_logit) * inv_t) * prob, 0.0)
    if HAS_Q:
        q_x = tl.load(q_ptr + b * q_stride_b + j * q_stride_l + xs, mask=in_vocab, other=1.0).to(tl.float32)
    else:
        q_x = p_x * 0.0 + 1.0
    return x, p_x, q_x


@triton.jit
def _block_w_next(w, p_x, q_x):
    """min(w p / q, 1): p / q is +inf where q = 0 < p, 0 where both are 0; 0 when w is 0."""
    ratio = tl.where(q_x == 0.0, tl.where(p_x > 0.0, float("inf"), p_x * 0.0), p_x / tl.where(q_x == 0.0, 1.0, q_x))
    t = w * tl.where(w == 0.0, 0.0, ratio)
    return tl.where(w == 0.0, w, tl.where(t > 1.0, 1.0, t))


# grid = (B, L).  Program (b, j), 1 <= j < num_drafts[b]: R_j = sum_v max(w_j p_j(v) - q_j(v), 0)
# of the block rule (draft_probs given), w_j recomputed from the drafts before j.
@triton.jit
def _chain_block_sums_kernel(
    draft_ptr,
    draft_stride,
    ndraft_ptr,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    q_stride_b,
    q_stride_l,
    length,
    inv_t,
    r_ptr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    positions = length + 1
    n = tl.load(ndraft_ptr + b)
    if (j >= 1) & (j < n):
        w = tl.load(prob_ptr + b * positions) * 0.0 + 1.0  # float32 scalar
        for i in range(0, j):
            _, p_x, q_x = _block_draft_pq(
                draft_ptr,
                draft_stride,
                logits_ptr,
                vocab,
                argmax_ptr,
                prob_ptr,
                q_ptr,
                q_stride_b,
                q_stride_l,
                b,
                i,
                positions,
                inv_t,
                i >= 0,
                True,
            )
            w = _block_w_next(w, p_x, q_x)
        row = b * positions + j
        top = tl.load(argmax_ptr + row)
        row_ptr = logits_ptr + row * vocab
        top_logit = tl.load(row_ptr + tl.maximum(top, 0)).to(tl.float32)
        prob = tl.where(top >= 0, tl.load(prob_ptr + row), float("nan"))
        q_row_ptr = q_ptr + b * q_stride_b + j * q_stride_l
        lanes = tl.arange(0, BLOCK)
        acc = w * 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            in_row = cols < vocab
            p = _p_of(row_ptr, cols, top_logit, prob, inv_t, in_row)
            q = tl.load(q_row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            acc += tl.sum(tl.where(in_row, tl.maximum(w * p - q, 0.0), 0.0), 0)
        tl.store(r_ptr + b * length + j, acc)


# grid = (B,).  Program b runs the block rule's walk over row b's positions (as
# dspec::vf::chain_block_walk): tau = the largest j in 1..n_eff with coins[j - 1] < h_j.
@triton.jit
def _chain_block_accept_kernel(
    draft_ptr,
    draft_stride,
    ndraft_ptr,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    q_stride_b,
    q_stride_l,
    coins_ptr,
    r_ptr,
    length,
    inv_t,
    num_ptr,
    out_ptr,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    spec_pos_ptr,
    scale_ptr,
    LP: tl.constexpr,
    HAS_Q: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    positions = length + 1
    n = tl.load(ndraft_ptr + b)
    w = tl.load(prob_ptr + b * positions) * 0.0 + 1.0  # float32 scalars
    w_tau = w
    tau = n * 0
    n_eff = n
    alive = n >= 0
    for j in range(0, length):
        act = alive & (j < n)
        top = tl.load(argmax_ptr + b * positions + j)
        invalid = act & (top < 0)
        n_eff = tl.where(invalid, j, n_eff)
        alive = act & (top >= 0)
        _, p_x, q_x = _block_draft_pq(
            draft_ptr,
            draft_stride,
            logits_ptr,
            vocab,
            argmax_ptr,
            prob_ptr,
            q_ptr,
            q_stride_b,
            q_stride_l,
            b,
            j,
            positions,
            inv_t,
            alive,
            HAS_Q,
        )
        if HAS_Q:
            r = tl.load(r_ptr + b * length + j, mask=alive & (j >= 1), other=0.0)
        else:
            r = w * (1.0 - p_x)
        den = r + (1.0 - w)
        h = tl.where(den <= 0.0, 1.0, r / tl.where(den <= 0.0, 1.0, den))
        coin = tl.load(coins_ptr + b * length + j - 1, mask=alive & (j >= 1), other=1.0)
        hit = alive & (j >= 1) & (coin < h)
        tau = tl.where(hit, j, tau)
        w_tau = tl.where(hit, w, w_tau)
        w = tl.where(alive, _block_w_next(w, p_x, q_x), w)
    last_coin = tl.load(coins_ptr + b * length + n_eff - 1, mask=n_eff >= 1, other=1.0)
    hit = (n_eff >= 1) & (last_coin < w)
    tau = tl.where(hit, n_eff, tau)
    w_tau = tl.where(hit, w, w_tau)
    tau = tau.to(tl.int64)
    tl.store(num_ptr + b, tau)
    i = tl.arange(0, LP)
    x = tl.load(draft_ptr + b * draft_stride + i, mask=i < tau, other=0).to(tl.int64)
    tl.store(out_ptr + b * positions + i, tl.where(i < tau, x, -1), mask=i < positions)
    rejected = tau < n_eff
    x_tau = tl.load(draft_ptr + b * draft_stride + tau, mask=rejected, other=-1).to(tl.int64)
    tl.store(spec_row_ptr + b, b * positions + tau)
    tl.store(spec_qrow_ptr + b, b * q_stride_b + tau * q_stride_l)
    if HAS_Q:
        mode = tl.where(rejected, 2, 0)
    else:
        mode = tl.where(rejected, 1, 0)
    tl.store(spec_mode_ptr + b, mode)
    tl.store(spec_nex_ptr + b, tl.where(mode == 1, 1, 0))
    tl.store(spec_excl_ptr + b, x_tau)
    tl.store(spec_pos_ptr + b, b * positions + tau)
    tl.store(scale_ptr + b, w_tau)


# grid = (B,).  Program b walks row b's tree: scanning nodes c = 1..N-1 in index order
# visits the current node's children in order and, after a move, the new node's children
# (they all have larger indices).
@triton.jit
def _tree_walk_kernel(
    tok_ptr,
    par_ptr,
    nodes,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    coins_ptr,
    inv_t,
    num_ptr,
    path_ptr,
    out_ptr,
    spec_row_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    spec_pos_ptr,
    EP: tl.constexpr,
    GREEDY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, EP)
    base = b * nodes
    node = b * 0  # int64 scalar
    depth = b * 0
    top = tl.load(argmax_ptr + base)
    top_logit = tl.load(logits_ptr + base * vocab + tl.maximum(top, 0)).to(tl.float32)
    prob = tl.load(prob_ptr + base)
    excl = tl.full([EP], -1, tl.int64)
    nex = b * 0
    removed = prob * 0.0  # probability mass of the rejected siblings at `node`
    for c in range(1, nodes):
        parent = tl.load(par_ptr + base + c).to(tl.int64)
        t = tl.load(tok_ptr + base + c).to(tl.int64)
        is_child = parent == node
        if GREEDY:
            move = is_child & (t == top)
        else:
            seen = tl.sum((excl == t).to(tl.int32), 0) > 0
            l_t = tl.load(logits_ptr + (base + node) * vocab + tl.maximum(t, 0), mask=is_child, other=float("-inf")).to(
                tl.float32
            )
            p_t = tl.where(top >= 0, tl.exp((l_t - top_logit) * inv_t) * prob, float("nan"))
            w_t = tl.where(seen, 0.0, p_t)
            coin = tl.load(coins_ptr + base + c)
            move = is_child & (coin < w_t / (1.0 - removed))
            drop = is_child & (~move) & (~seen)
            excl = tl.where(drop & (slots == nex), t, excl)
            nex = tl.where(drop, nex + 1, nex)
            removed = tl.where(drop, removed + p_t, removed)
        tl.store(path_ptr + base + depth, b * 0 + c, mask=move)
        tl.store(out_ptr + base + depth, t, mask=move)
        depth = tl.where(move, depth + 1, depth)
        node = tl.where(move, c, node)
        new_top = tl.load(argmax_ptr + base + c, mask=move, other=0)
        top = tl.where(move, new_top, top)
        if not GREEDY:
            new_logit = tl.load(logits_ptr + (base + c) * vocab + tl.maximum(new_top, 0), mask=move, other=0.0).to(
                tl.float32
            )
            top_logit = tl.where(move, new_logit, top_logit)
            prob = tl.where(move, tl.load(prob_ptr + base + c, mask=move, other=0.0), prob)
            excl = tl.where(move, -1, excl)
            nex = tl.where(move, 0, nex)
            removed = tl.where(move, 0.0, removed)
    tl.store(num_ptr + b, depth)
    if GREEDY:
        tl.store(out_ptr + base + depth, top)
    else:
        tl.store(spec_row_ptr + b, base + node)
        tl.store(spec_mode_ptr + b, tl.where(nex > 0, 1, 0))
        tl.store(spec_nex_ptr + b, nex.to(tl.int32))
        tl.store(spec_excl_ptr + b * EP + slots, excl)
        tl.store(spec_pos_ptr + b, base + depth)


# grid = (B,).  The tree walk with draft probabilities q (the rule of
# dspec.reference.verify._verify_tree_q): the residual r of the current node is P until a
# rejection materialises it in row b of ``resid`` [B, V] (one pass over V per rejection,
# unnormalised, with its sum s_r); without replacement the removed tokens are ``excl`` and
# q_cur = q_node / d_q.
@triton.jit
def _tree_walk_q_kernel(
    tok_ptr,
    par_ptr,
    nodes,
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    q_stride_b,
    q_stride_n,
    resid_ptr,
    coins_ptr,
    inv_t,
    num_ptr,
    path_ptr,
    out_ptr,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    spec_pos_ptr,
    EP: tl.constexpr,
    BLOCK: tl.constexpr,
    WOR: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, EP)
    lanes = tl.arange(0, BLOCK)
    base = b * nodes
    resid_row = resid_ptr + b * vocab
    node = b * 0
    depth = b * 0
    top = tl.load(argmax_ptr + base)
    top_logit = tl.load(logits_ptr + base * vocab + tl.maximum(top, 0)).to(tl.float32)
    prob = tl.load(prob_ptr + base)
    excl = tl.full([EP], -1, tl.int64)
    nex = b * 0
    s_r = prob * 0.0 + 1.0
    d_q = prob * 0.0 + 1.0
    has_resid = b * 0  # 1 once the residual row holds r
    for c in range(1, nodes):
        parent = tl.load(par_ptr + base + c).to(tl.int64)
        t = tl.load(tok_ptr + base + c).to(tl.int64)
        is_child = parent == node
        in_vocab = (t >= 0) & (t < vocab)
        tt = tl.minimum(tl.maximum(t, 0), vocab - 1)
        q_row = q_ptr + b * q_stride_b + node * q_stride_n
        q_x = tl.load(q_row + tt, mask=is_child & in_vocab, other=0.0).to(tl.float32)
        if WOR:
            q_x = tl.where(tl.sum((excl == t).to(tl.int32), 0) > 0, 0.0, q_x)
        q_x = tl.where(in_vocab, q_x, 0.0)
        row_ptr = logits_ptr + (base + node) * vocab
        l_t = tl.load(row_ptr + tt, mask=is_child & in_vocab, other=float("-inf")).to(tl.float32)
        p_t = tl.where(top >= 0, tl.exp((l_t - top_logit) * inv_t) * prob, float("nan"))
        r_t = tl.load(resid_row + tt, mask=is_child & in_vocab & (has_resid != 0), other=0.0)
        r_x = tl.where(has_resid != 0, r_t, p_t)
        coin = tl.load(coins_ptr + base + c)
        live = is_child & (q_x != 0.0)
        move = live & (coin * (q_x / d_q) < r_x / s_r)
        reject = live & (~move)
        # the rejection's pass over the vocabulary (no tile when nothing is rejected)
        sum_r = prob * 0.0
        sum_kept = prob * 0.0
        n_tiles = tl.where(reject, tl.cdiv(vocab, BLOCK), 0)
        tl.debug_barrier()  # every thread has read r(x) before the pass overwrites it
        for i in range(0, n_tiles):
            cols = i * BLOCK + lanes
            m = cols < vocab
            q_v = tl.load(q_row + cols, mask=m, other=0.0).to(tl.float32)
            r_v = tl.load(resid_row + cols, mask=m & ((cols * 0 + has_resid) != 0), other=0.0)
            p_v = tl.where(top >= 0, _p_of(row_ptr, cols, top_logit, prob, inv_t, m), float("nan"))
            r_v = tl.where(has_resid != 0, r_v, p_v)
            if WOR:
                gone = tl.sum((cols[:, None] == excl[None, :]).to(tl.int32), 1) > 0
            else:
                gone = cols < 0
            diff = r_v / s_r - tl.where(gone, 0.0, q_v) / d_q
            r_new = tl.where(m, tl.where(diff < 0.0, 0.0, diff), 0.0)  # NaN stays
            tl.store(resid_row + cols, r_new, mask=m)
            sum_r += tl.sum(r_new, 0)
            sum_kept += tl.sum(tl.where(m & (~gone) & (cols != t), q_v, 0.0), 0)
        tl.debug_barrier()  # the pass's stores are seen by the next r(x) load
        filled = (sum_r > 0.0) | (sum_r != sum_r)  # an empty residual: r = P again
        has_resid = tl.where(reject, filled.to(tl.int64), has_resid)
        s_r = tl.where(reject, tl.where(filled, sum_r, 1.0), s_r)
        if WOR:
            excl = tl.where(reject & (slots == nex), t, excl)
            nex = tl.where(reject, nex + 1, nex)
            d_q = tl.where(reject, sum_kept, d_q)
        tl.store(path_ptr + base + depth, b * 0 + c, mask=move)
        tl.store(out_ptr + base + depth, t, mask=move)
        depth = tl.where(move, depth + 1, depth)
        node = tl.where(move, c, node)
        new_top = tl.load(argmax_ptr + base + c, mask=move, other=0)
        top = tl.where(move, new_top, top)
        new_logit = tl.load(logits_ptr + (base + c) * vocab + tl.maximum(new_top, 0), mask=move, other=0.0).to(
            tl.float32
        )
        top_logit = tl.where(move, new_logit, top_logit)
        prob = tl.where(move, tl.load(prob_ptr + base + c, mask=move, other=0.0), prob)
        excl = tl.where(move, -1, excl)
        nex = tl.where(move, 0, nex)
        s_r = tl.where(move, 1.0, s_r)
        d_q = tl.where(move, 1.0, d_q)
        has_resid = tl.where(move, 0, has_resid)
    tl.store(num_ptr + b, depth)
    tl.store(spec_row_ptr + b, base + node)
    tl.store(spec_qrow_ptr + b, b * vocab)
    tl.store(spec_mode_ptr + b, tl.where(has_resid != 0, 3, 0))
    tl.store(spec_nex_ptr + b, (nex * 0).to(tl.int32))
    tl.store(spec_pos_ptr + b, base + depth)


@triton.jit
def _draw_weights(
    row_ptr,
    cols,
    in_row,
    top_logit,
    prob,
    inv_t,
    q_row_ptr,
    mode,
    HAS_Q: tl.constexpr,
    scale=1.0,
    HAS_SCALE: tl.constexpr = False,
    RESID: tl.constexpr = False,
):
    """(w, p) for one tile: w is the residual max(p - q, 0) in mode 2 (``HAS_SCALE``:
    max(scale * p - q, 0), the block rule's draw), the tree walk's residual row (at
    q_row_ptr) in mode 3, else p."""
    p = _p_of(row_ptr, cols, top_logit, prob, inv_t, in_row)
    p = tl.where(in_row, p, 0.0)
    if HAS_Q:
        # the q row exists only for a rejected position (mode 2), not for the bonus
        q_mask = in_row & ((cols * 0 + mode) == 2)
        q = tl.load(q_row_ptr + cols, mask=q_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            w = tl.maximum(scale * p - q, 0.0)
        else:
            w = tl.maximum(p - q, 0.0)
    else:
        w = p
    if RESID:
        r_mask = in_row & ((cols * 0 + mode) == 3)
        w = tl.where(r_mask, tl.load(q_row_ptr + cols, mask=r_mask, other=0.0), w)
    return w, p


@triton.jit
def _spec(
    b,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    logits_ptr,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    vocab,
    HAS_Q: tl.constexpr,
    RESID: tl.constexpr,
):
    row = tl.load(spec_row_ptr + b)
    mode = tl.load(spec_mode_ptr + b)
    row_ptr = logits_ptr + row * vocab
    top = tl.load(argmax_ptr + row)
    top_logit = tl.load(row_ptr + tl.maximum(top, 0)).to(tl.float32)
    prob = tl.where(top >= 0, tl.load(prob_ptr + row), float("nan"))
    if HAS_Q or RESID:
        q_row_ptr = q_ptr + tl.load(spec_qrow_ptr + b)
    else:
        q_row_ptr = q_ptr
    return row_ptr, mode, top_logit, prob, q_row_ptr


# grid = (B, splits).  Program (b, s) writes the weight sums of its tiles of row b's draw
# row: ``tile_w`` (residual, rejected siblings excluded) and ``tile_p`` (plain p: the
# fallback when the residual is empty).
@triton.jit
def _draw_tiles_kernel(
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    inv_t,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    tile_w_ptr,
    tile_p_ptr,
    num_tiles,
    tiles_per_split,
    BLOCK: tl.constexpr,
    EP: tl.constexpr,
    HAS_Q: tl.constexpr,
    scale_ptr=None,
    HAS_SCALE: tl.constexpr = False,
    RESID: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_ptr, mode, top_logit, prob, q_row_ptr = _spec(
        b, spec_row_ptr, spec_qrow_ptr, spec_mode_ptr, logits_ptr, argmax_ptr, prob_ptr, q_ptr, vocab, HAS_Q, RESID
    )
    slots = tl.arange(0, EP)
    nex = tl.load(spec_nex_ptr + b)
    excl = tl.load(spec_excl_ptr + b * EP + slots, mask=slots < nex, other=-1)
    p_excl = tl.where(excl >= 0, _p_of(row_ptr, tl.maximum(excl, 0), top_logit, prob, inv_t, excl >= 0), 0.0)
    scale = tl.load(scale_ptr + b) if HAS_SCALE else 1.0
    lanes = tl.arange(0, BLOCK)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    for tile in range(first, last):
        start = tile * BLOCK
        cols = start + lanes
        w, p = _draw_weights(
            row_ptr, cols, cols < vocab, top_logit, prob, inv_t, q_row_ptr, mode, HAS_Q, scale, HAS_SCALE, RESID
        )
        in_tile = (excl >= start) & (excl < start + BLOCK)
        w_sum = tl.sum(w, 0) - tl.sum(tl.where(in_tile, p_excl, 0.0), 0)
        if RESID:
            w_sum = tl.where(w_sum < 0.0, 0.0, w_sum)  # a NaN residual stays: token -1
        else:
            w_sum = tl.maximum(w_sum, 0.0)
        tl.store(tile_w_ptr + b * num_tiles + tile, w_sum)
        tl.store(tile_p_ptr + b * num_tiles + tile, tl.sum(p, 0))


# grid = (B,).  Program b finds the tile where the running weight passes u * total, then
# the token inside it; writes the final token (-1 when the weights are empty or NaN).
@triton.jit
def _draw_pick_kernel(
    logits_ptr,
    vocab,
    argmax_ptr,
    prob_ptr,
    q_ptr,
    inv_t,
    spec_row_ptr,
    spec_qrow_ptr,
    spec_mode_ptr,
    spec_nex_ptr,
    spec_excl_ptr,
    spec_pos_ptr,
    tile_w_ptr,
    tile_p_ptr,
    num_tiles,
    uniforms_ptr,
    out_ptr,
    BLOCK: tl.constexpr,
    TP: tl.constexpr,
    EP: tl.constexpr,
    HAS_Q: tl.constexpr,
    scale_ptr=None,
    HAS_SCALE: tl.constexpr = False,
    RESID: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    row_ptr, mode, top_logit, prob, q_row_ptr = _spec(
        b, spec_row_ptr, spec_qrow_ptr, spec_mode_ptr, logits_ptr, argmax_ptr, prob_ptr, q_ptr, vocab, HAS_Q, RESID
    )
    tiles = tl.arange(0, TP)
    has_tile = tiles < num_tiles
    tw = tl.load(tile_w_ptr + b * num_tiles + tiles, mask=has_tile, other=0.0)
    tp = tl.load(tile_p_ptr + b * num_tiles + tiles, mask=has_tile, other=0.0)
    total_w = tl.sum(tw, 0)
    use_p = (~(total_w > 0.0)) & (total_w == total_w)  # an empty (not NaN) residual -> p
    ts = tl.where(use_p, tp, tw)
    total = tl.sum(ts, 0)
    target = tl.load(uniforms_ptr + b) * total
    cum = tl.cumsum(ts, 0)
    crossing = tl.min(tl.where((cum > target) & has_tile, tiles, TP), 0)
    last_nonzero = tl.max(tl.where((ts > 0.0) & has_tile, tiles, -1), 0)
    tile = tl.where(crossing < TP, crossing, last_nonzero)
    before = tl.sum(tl.where(tiles < tile, ts, 0.0), 0)

    lanes = tl.arange(0, BLOCK)
    cols = tile.to(tl.int64) * BLOCK + lanes
    in_row = (cols < vocab) & (cols >= 0)  # no tile (tile = -1) -> nothing in the row
    scale = tl.load(scale_ptr + b) if HAS_SCALE else 1.0
    w, p = _draw_weights(row_ptr, cols, in_row, top_logit, prob, inv_t, q_row_ptr, mode, HAS_Q, scale, HAS_SCALE, RESID)
    slots = tl.arange(0, EP)
    nex = tl.load(spec_nex_ptr + b)
    excl = tl.load(spec_excl_ptr + b * EP + slots, mask=slots < nex, other=-1)
    excluded = tl.sum((cols[:, None] == excl[None, :]).to(tl.int32), 1) > 0
    w = tl.where(use_p, p, tl.where(excluded, 0.0, w))
    running = before + tl.cumsum(w, 0)
    hit = tl.min(tl.where((running > target) & in_row, lanes, BLOCK), 0)
    last = tl.max(tl.where((w > 0.0) & in_row, lanes, -1), 0)
    pick = tl.where(hit < BLOCK, hit, last)
    valid = (total > 0.0) & (total < float("inf")) & (pick >= 0)
    token = tl.where(valid, tile.to(tl.int64) * BLOCK + pick, -1)
    tl.store(out_ptr + tl.load(spec_pos_ptr + b), token)


def _draw(logits2d, argmax, prob, q, inv_t, spec, uniforms, out, ep, block, scale=None, resid=None):
    """The draw stages; ``scale``: the block rule's [B] residual scales; ``resid``: the tree
    walk's [B, V] residuals (mode 3 rows), in q's place."""
    batch = uniforms.shape[0]
    vocab = logits2d.shape[1]
    dev = logits2d.device
    num_tiles = triton.cdiv(vocab, block)
    splits = max(1, min(vocab_splits(batch, vocab, block, dev, min_tiles_per_split=2), num_tiles))
    tiles_per_split = triton.cdiv(num_tiles, splits)
    tile_w = torch.empty(batch, num_tiles, dtype=torch.float32, device=dev)
    tile_p = torch.empty_like(tile_w)
    has_q = q is not None
    q_arg = q if has_q else (resid if resid is not None else prob)
    row, qrow, mode, nex, excl, pos = spec
    warps = 4 if block >= 512 else 1
    _draw_tiles_kernel[(batch, splits)](
        logits2d,
        vocab,
        argmax,
        prob,
        q_arg,
        inv_t,
        row,
        qrow,
        mode,
        nex,
        excl,
        tile_w,
        tile_p,
        num_tiles,
        tiles_per_split,
        BLOCK=block,
        EP=ep,
        HAS_Q=has_q,
        scale_ptr=scale,
        HAS_SCALE=scale is not None,
        RESID=resid is not None,
        num_warps=warps,
    )
    _draw_pick_kernel[(batch,)](
        logits2d,
        vocab,
        argmax,
        prob,
        q_arg,
        inv_t,
        row,
        qrow,
        mode,
        nex,
        excl,
        pos,
        tile_w,
        tile_p,
        num_tiles,
        uniforms,
        out,
        BLOCK=block,
        TP=next_pow2(num_tiles),
        EP=ep,
        HAS_Q=has_q,
        scale_ptr=scale,
        HAS_SCALE=scale is not None,
        RESID=resid is not None,
        num_warps=warps,
    )


def _new_spec(batch, ep, dev):
    return (
        torch.zeros(batch, dtype=torch.int64, device=dev),  # target row to draw from
        torch.zeros(batch, dtype=torch.int64, device=dev),  # offset of its q row
        torch.zeros(batch, dtype=torch.int32, device=dev),  # MODE_*
        torch.zeros(batch, dtype=torch.int32, device=dev),  # excluded count
        torch.full((batch, ep), -1, dtype=torch.int64, device=dev),
        torch.zeros(batch, dtype=torch.int64, device=dev),
    )  # where the token goes


def verify_chain_triton(
    draft_tokens,
    target_logits,
    draft_probs,
    num_drafts,
    temperature,
    coins,
    sample_uniforms,
    *,
    block: int | None = None,
    rule: str = "token",
) -> VerifyOutput:
    batch, length = draft_tokens.shape
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    logits = target_logits.contiguous()
    logits2d = logits.view(batch * (length + 1), vocab)
    greedy = temperature <= 0
    block = block or min(next_pow2(vocab), 1024)
    argmax, prob, _, _, _ = token_stats_triton(logits2d, 1.0 if greedy else temperature, block=block)
    ndraft = (
        torch.full((batch,), length, dtype=torch.int64, device=dev)
        if num_drafts is None
        else num_drafts.to(torch.int64)
    )
    num = torch.empty(batch, dtype=torch.int64, device=dev)
    out = torch.empty(batch, length + 1, dtype=torch.int64, device=dev)
    if batch == 0:
        return VerifyOutput(num, out)
    drafts = draft_tokens if draft_tokens.stride(-1) == 1 else draft_tokens.contiguous()
    q = None if draft_probs is None else (draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous())
    spec = _new_spec(batch, 1, dev)
    inv_t = 0.0 if greedy else 1.0 / temperature
    coins_arg = coins.contiguous() if coins is not None else prob
    if rule == "block" and not greedy:
        _verify_chain_block(
            drafts,
            ndraft,
            logits2d,
            argmax,
            prob,
            q,
            coins_arg,
            length,
            inv_t,
            num,
            out,
            spec,
            sample_uniforms.contiguous(),
            block,
        )
        return VerifyOutput(num, out)
    _chain_accept_kernel[(batch,)](
        drafts,
        drafts.stride(0),
        ndraft,
        logits2d,
        vocab,
        argmax,
        prob,
        q if q is not None else prob,
        q.stride(0) if q is not None else 0,
        q.stride(1) if q is not None else 0,
        coins_arg,
        length,
        inv_t,
        num,
        out,
        *spec,
        LP=next_pow2(length + 1),
        GREEDY=greedy,
        HAS_Q=q is not None,
        num_warps=1,
    )
    if not greedy:
        _draw(logits2d, argmax, prob, q, inv_t, spec, sample_uniforms.contiguous(), out, 1, block)
    return VerifyOutput(num, out)


def _verify_chain_block(
    drafts, ndraft, logits2d, argmax, prob, q, coins, length, inv_t, num, out, spec, uniforms, block
):
    """The block rule: R_j per (row, position) (draft_probs only), the walk, then the draw
    from max(w_tau p_tau - q_tau, 0) (one-hot: p_tau without x_tau) or p_tau."""
    batch, vocab = drafts.shape[0], logits2d.shape[1]
    dev = logits2d.device
    q_args = (q if q is not None else prob, q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0)
    r = torch.empty(batch, max(length, 1), dtype=torch.float32, device=dev)
    if q is not None and length > 1:
        _chain_block_sums_kernel[(batch, length)](
            drafts,
            drafts.stride(0),
            ndraft,
            logits2d,
            vocab,
            argmax,
            prob,
            *q_args,
            length,
            inv_t,
            r,
            BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )
    scale = torch.ones(batch, dtype=torch.float32, device=dev)
    _chain_block_accept_kernel[(batch,)](
        drafts,
        drafts.stride(0),
        ndraft,
        logits2d,
        vocab,
        argmax,
        prob,
        *q_args,
        coins,
        r,
        length,
        inv_t,
        num,
        out,
        *spec,
        scale,
        LP=next_pow2(length + 1),
        HAS_Q=q is not None,
        num_warps=1,
    )
    _draw(logits2d, argmax, prob, q, inv_t, spec, uniforms, out, 1, block, scale=scale if q is not None else None)


def verify_tree_triton(
    tokens,
    parents,
    target_logits,
    temperature,
    coins,
    sample_uniforms,
    *,
    block: int | None = None,
    draft_probs=None,
    draft_sampling: str = "independent",
) -> TreeVerifyOutput:
    batch, nodes = tokens.shape
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    logits2d = target_logits.contiguous().view(batch * nodes, vocab)
    greedy = temperature <= 0
    block = block or min(next_pow2(vocab), 1024)
    argmax, prob, _, _, _ = token_stats_triton(logits2d, 1.0 if greedy else temperature, block=block)
    num = torch.empty(batch, dtype=torch.int64, device=dev)
    path = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    out = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    if batch == 0:
        return TreeVerifyOutput(num, path, out)
    ep = next_pow2(nodes)
    spec = _new_spec(batch, ep, dev)
    inv_t = 0.0 if greedy else 1.0 / temperature
    row, qrow, mode, nex, excl, pos = spec
    if draft_probs is not None and not greedy:
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
        resid = torch.empty(batch, vocab, dtype=torch.float32, device=dev)
        wor = draft_sampling == "without_replacement"
        # without replacement a pass compares its columns with the EP removed-token slots
        pass_block = min(block, max(64, 65536 // ep)) if wor else block
        _tree_walk_q_kernel[(batch,)](
            tokens.contiguous(),
            parents.contiguous(),
            nodes,
            logits2d,
            vocab,
            argmax,
            prob,
            q,
            q.stride(0),
            q.stride(1),
            resid,
            coins.contiguous(),
            inv_t,
            num,
            path,
            out,
            row,
            qrow,
            mode,
            nex,
            excl,
            pos,
            EP=ep,
            BLOCK=pass_block,
            WOR=wor,
            num_warps=4 if pass_block >= 512 else 1,
        )
        _draw(logits2d, argmax, prob, None, inv_t, spec, sample_uniforms.contiguous(), out, ep, block, resid=resid)
        return TreeVerifyOutput(num, path, out)
    _tree_walk_kernel[(batch,)](
        tokens.contiguous(),
        parents.contiguous(),
        nodes,
        logits2d,
        vocab,
        argmax,
        prob,
        coins.contiguous() if coins is not None else prob,
        inv_t,
        num,
        path,
        out,
        row,
        mode,
        nex,
        excl,
        pos,
        EP=ep,
        GREEDY=greedy,
        num_warps=1,
    )
    if not greedy:
        _draw(logits2d, argmax, prob, None, inv_t, spec, sample_uniforms.contiguous(), out, ep, block)
    return TreeVerifyOutput(num, path, out)
