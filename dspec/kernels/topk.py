"""Triton topk_tokens and mass_candidates: top-k (k <= 32) of a vocabulary without a sort.

Each logit becomes a 64-bit key ``(orderable float bits << 32) | (2^32 - 1 - id)``, so one
integer max ranks by logit and breaks ties to the lower id, and keys are unique.  A program
keeps the best K keys in a sorted register buffer.  Per tile it counts the keys above the
buffer's k-th key (usually none after the first few tiles) and inserts only those, largest
first, by rank: expected insertions over a row are about ``k ln(V / k)``, not V.
In the same pass it keeps an online ``(max, sum exp)`` per lane for the softmax normaliser.

Memory traffic: one read of the logits + k * 12 bytes per row written (+ partials when the
vocabulary is split over several programs for small batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import as_rows, next_pow2, vocab_splits

# Python-side constexprs: the literal -9223372036854775808 would parse as -(2**63 as uint64).
_KEY_MIN: tl.constexpr = tl.constexpr(-(2**63))
_KEY_MAX: tl.constexpr = tl.constexpr(2**63 - 1)


@triton.jit
def _to_key(x, cols):
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks with +0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))


@triton.jit
def _key_logit(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_token(key):
    return 4294967295 - (key & 4294967295)


@triton.jit
def _insert(best, key, slots, K: tl.constexpr, KP: tl.constexpr):
    """Insert one key into the descending buffer ``best`` (slots >= K stay at the minimum)."""
    pos = tl.sum((best > key).to(tl.int32), 0)
    # shifted[j] = best[j - 1], through a KP x KP selection (no cross-lane shuffle in Triton)
    src = tl.arange(0, KP)
    pick = src[None, :] == (slots[:, None] - 1)
    shifted = tl.max(tl.where(pick, best[None, :], _KEY_MIN), 1)
    out = tl.where(slots < pos, best, tl.where(slots == pos, key, shifted))
    return tl.where(slots < K, out, _KEY_MIN)


@triton.jit
def _merge_softmax(m, s, inv_t):
    big_m = tl.max(m, 0)
    live = m > float("-inf")
    return big_m, tl.sum(tl.where(live, s * tl.exp((m - big_m) * inv_t), 0.0), 0)


@triton.jit
def _finalize(
    row,
    best,
    slots,
    big_m,
    s,
    nan_count,
    inv_t,
    tau,
    token_ptr,
    val_ptr,
    count_ptr,
    K: tl.constexpr,
    MASS: tl.constexpr,
):
    valid = (nan_count == 0) & (big_m < float("inf")) & (big_m > float("-inf"))
    in_k = slots < K
    z = (_key_logit(best) - big_m) * inv_t
    prob = tl.exp(z) / s
    tok = _key_token(best)
    out = row * K + slots
    if MASS:
        reached = (tl.cumsum(prob, 0) >= tau) & in_k
        first = tl.min(tl.where(reached, slots + 1, K), 0)
        nonzero = tl.sum((in_k & (prob > 0.0)).to(tl.int32), 0)
        count = tl.where(valid, tl.minimum(first, nonzero), 0)
        keep = slots < count
        tl.store(token_ptr + out, tl.where(keep, tok, -1), mask=in_k)
        tl.store(val_ptr + out, tl.where(keep, z - tl.log(s), float("-inf")), mask=in_k)
        tl.store(count_ptr + row, count.to(tl.int64))
    else:
        tl.store(token_ptr + out, tl.where(valid, tok, -1), mask=in_k)
        tl.store(val_ptr + out, tl.where(valid, prob, float("nan")), mask=in_k)


# grid = (rows, NUM_SPLITS).  Program (r, p) streams its share of row r in BLOCK tiles,
# keeping the top-K keys and a per-lane online softmax normaliser; one split finalises
# directly, several write partials for _topk_merge_kernel.
@triton.jit
def _topk_kernel(
    logits_ptr,
    row_stride,
    vocab,
    cols_per_split,
    inv_t,
    tau,
    part_key_ptr,
    part_f_ptr,
    token_ptr,
    val_ptr,
    count_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    slots = tl.arange(0, KP)
    base = logits_ptr + row * row_stride
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, vocab)

    best = tl.full([KP], _KEY_MIN, tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    nan_count = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        inside = cols < hi
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        nan_count += is_nan.to(tl.int32)
        x = tl.where(is_nan, float("-inf"), x)
        # online softmax normaliser, one exp per element
        live = x > float("-inf")
        gt = x > m
        e = tl.where(live, tl.exp(tl.where(gt, m - x, x - m) * inv_t), 0.0)
        s = tl.where(live, tl.where(gt, s * e + 1.0, s + e), s)
        m = tl.maximum(m, x)
        # top-K: insert only the keys that beat the current K-th best
        keys = tl.where(inside, _to_key(x, cols), _KEY_MIN)
        kth = tl.min(tl.where(slots < K, best, _KEY_MAX), 0)
        n_new = tl.minimum(tl.sum((keys > kth).to(tl.int32), 0), K)
        for _ in range(n_new):
            top = tl.max(keys, 0)
            keys = tl.where(keys == top, _KEY_MIN, keys)
            best = _insert(best, top, slots, K, KP)

    big_m, s_tot = _merge_softmax(m, s, inv_t)
    nan_tot = tl.sum(nan_count, 0)
    if NUM_SPLITS == 1:
        _finalize(row, best, slots, big_m, s_tot, nan_tot, inv_t, tau, token_ptr, val_ptr, count_ptr, K, MASS)
    else:
        slot = row * NUM_SPLITS + split
        tl.store(part_key_ptr + slot * KP + slots, best)
        tl.store(part_f_ptr + slot * 3 + 0, big_m)
        tl.store(part_f_ptr + slot * 3 + 1, s_tot)
        tl.store(part_f_ptr + slot * 3 + 2, nan_tot.to(tl.float32))


# grid = (rows,).  Merges NUM_SPLITS partial top-K buffers and normalisers of one row.
@triton.jit
def _topk_merge_kernel(
    part_key_ptr,
    part_f_ptr,
    inv_t,
    tau,
    token_ptr,
    val_ptr,
    count_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    slots = tl.arange(0, KP)
    ok = sp < NUM_SPLITS
    slot = row * NUM_SPLITS + sp
    keys = tl.load(part_key_ptr + slot[:, None] * KP + slots[None, :], mask=ok[:, None], other=_KEY_MIN)
    m = tl.load(part_f_ptr + slot * 3 + 0, mask=ok, other=float("-inf"))
    s = tl.load(part_f_ptr + slot * 3 + 1, mask=ok, other=0.0)
    nan_tot = tl.sum(tl.load(part_f_ptr + slot * 3 + 2, mask=ok, other=0.0), 0)
    big_m, s_tot = _merge_softmax(m, s, inv_t)
    best = tl.full([KP], _KEY_MIN, tl.int64)
    for t in range(K):  # extraction in order: the buffer comes out sorted
        top = tl.max(tl.max(keys, 1), 0)
        keys = tl.where(keys == top, _KEY_MIN, keys)
        best = tl.where(slots == t, top, best)
    _finalize(row, best, slots, big_m, s_tot, nan_tot, inv_t, tau, token_ptr, val_ptr, count_ptr, K, MASS)


def _launch(logits, k, temperature, tau, mass, num_splits, block):
    lead = logits.shape[:-1]
    x = as_rows(logits)
    rows, vocab = x.shape
    dev = x.device
    kp = max(2, next_pow2(k))
    block = block or min(next_pow2(vocab), 1024)
    if num_splits is None:
        num_splits = vocab_splits(rows, vocab, block, dev)
    num_splits = max(1, min(int(num_splits), -(-vocab // block)))
    cols_per_split = -(-(-(-vocab // block)) // num_splits) * block
    tokens = torch.empty(rows, k, dtype=torch.int64, device=dev)
    values = torch.empty(rows, k, dtype=torch.float32, device=dev)
    count = torch.empty(rows, dtype=torch.int64, device=dev)
    if rows:
        if num_splits > 1:
            part_key = torch.empty(rows * num_splits * kp, dtype=torch.int64, device=dev)
            part_f = torch.empty(rows * num_splits * 3, dtype=torch.float32, device=dev)
        else:
            part_key, part_f = count, values  # unused
        inv_t = 1.0 / temperature
        _topk_kernel[(rows, num_splits)](
            x,
            x.stride(0),
            vocab,
            cols_per_split,
            inv_t,
            tau,
            part_key,
            part_f,
            tokens,
            values,
            count,
            K=k,
            KP=kp,
            BLOCK=block,
            NUM_SPLITS=num_splits,
            MASS=mass,
            num_warps=4 if block >= 512 else 1,
        )
        if num_splits > 1:
            _topk_merge_kernel[(rows,)](
                part_key,
                part_f,
                inv_t,
                tau,
                tokens,
                values,
                count,
                K=k,
                KP=kp,
                NUM_SPLITS=num_splits,
                SPLITS_PAD=next_pow2(num_splits),
                MASS=mass,
                num_warps=1,
            )
    return tokens.reshape(*lead, k), values.reshape(*lead, k), count.reshape(lead)


def topk_tokens_triton(
    logits: torch.Tensor, k: int, temperature: float = 1.0, *, num_splits: int | None = None, block: int | None = None
):
    tokens, probs, _ = _launch(logits, k, temperature, 1.0, False, num_splits, block)
    return tokens, probs


def mass_candidates_triton(
    logits: torch.Tensor,
    tau: float,
    max_m: int,
    temperature: float = 1.0,
    *,
    num_splits: int | None = None,
    block: int | None = None,
):
    return _launch(logits, max_m, temperature, tau, True, num_splits, block)
