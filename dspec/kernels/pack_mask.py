"""Triton pack_mask / unpack_mask (layout: dspec.reference.pack_mask).

pack: each program reads a [ROWS, WORDS * 32] tile of the boolean mask (one byte per key,
contiguous along keys), views it as [ROWS, WORDS, 32] and OR-reduces ``bit << j`` over the
last axis.  Bits are combined in int32 (``1 << 31`` is the sign bit, which is exactly the
two's complement pattern wanted), by OR, so no sum can overflow.
unpack: each program writes a [ROWS, KEYS] tile of bytes, each ``(word >> (k % 32)) & 1``
of its word (an arithmetic shift; only bit 0 survives the mask).

Memory traffic: pack reads rows x K bytes and writes rows x ceil(K/32) x 4; unpack the
reverse.  Both are bandwidth-bound elementwise passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import as_rows, next_pow2


@triton.jit
def _bit_or(a, b):
    return a | b


# grid = (cdiv(rows, ROWS), cdiv(num_words, WORDS)).
@triton.jit
def _pack_mask_kernel(
    mask_ptr, mask_stride, rows, num_keys, num_words, words_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    w0 = tl.program_id(1) * WORDS
    cols = w0 * 32 + tl.arange(0, WORDS * 32)
    ok = (r[:, None] < rows) & (cols[None, :] < num_keys)
    bits = tl.load(mask_ptr + r.to(tl.int64)[:, None] * mask_stride + cols[None, :], mask=ok, other=0)
    bits = (bits != 0).to(tl.int32)
    shift = tl.arange(0, WORDS * 32) % 32
    placed = tl.reshape(bits << shift[None, :], [ROWS, WORDS, 32])
    word = tl.reduce(placed, 2, _bit_or)
    w = w0 + tl.arange(0, WORDS)
    out_ok = (r[:, None] < rows) & (w[None, :] < num_words)
    tl.store(words_ptr + r.to(tl.int64)[:, None] * num_words + w[None, :], word, mask=out_ok)


# grid = (cdiv(rows, ROWS), cdiv(num_keys, KEYS)).
@triton.jit
def _unpack_mask_kernel(words_ptr, words_stride, rows, num_keys, out_ptr, ROWS: tl.constexpr, KEYS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.program_id(1) * KEYS + tl.arange(0, KEYS)
    ok = (r[:, None] < rows) & (k[None, :] < num_keys)
    r64 = r.to(tl.int64)[:, None]
    word = tl.load(words_ptr + r64 * words_stride + (k // 32)[None, :], mask=ok, other=0)
    bit = (word >> (k % 32)[None, :]) & 1
    tl.store(out_ptr + r64 * num_keys + k[None, :], bit.to(tl.uint8), mask=ok)


def pack_mask_triton(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., Q, K] -> int32 [..., Q, ceil(K / 32)]."""
    keys = mask.shape[-1]
    num_words = -(-keys // 32)
    out = torch.empty(*mask.shape[:-1], num_words, dtype=torch.int32, device=mask.device)
    if out.numel() == 0:
        return out
    m = as_rows(mask).view(torch.uint8)
    rows = m.shape[0]
    words = min(next_pow2(num_words), 8)
    block_rows = max(1, min(next_pow2(rows), 4096 // (words * 32)))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(num_words, words))
    _pack_mask_kernel[grid](m, m.stride(0), rows, keys, num_words, out, ROWS=block_rows, WORDS=words, num_warps=4)
    return out


def unpack_mask_triton(words: torch.Tensor, num_keys: int) -> torch.Tensor:
    """int32 [..., Q, W] -> bool [..., Q, num_keys]."""
    out = torch.empty(*words.shape[:-1], num_keys, dtype=torch.bool, device=words.device)
    if out.numel() == 0:
        return out
    w = as_rows(words)
    rows = w.shape[0]
    keys = min(next_pow2(num_keys), 256)
    block_rows = max(1, min(next_pow2(rows), 4096 // keys))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(num_keys, keys))
    _unpack_mask_kernel[grid](
        w, w.stride(0), rows, num_keys, out.view(torch.uint8), ROWS=block_rows, KEYS=keys, num_warps=4
    )
    return out
