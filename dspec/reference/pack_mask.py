"""Reference pack_mask / unpack_mask: boolean attention masks <-> 32-bit words.

Layout every backend follows: ``words[..., q, w]`` (int32) holds keys ``32 w .. 32 w + 31``
of query row q; bit j (value ``1 << j``, two's complement, so bit 31 is the sign bit) is key
``32 w + j``.  Bits past the last key are 0.  A row of K keys takes ``ceil(K / 32)`` words.
"""

from __future__ import annotations

import torch

BITS = 32


def num_words(num_keys: int) -> int:
    return (int(num_keys) + BITS - 1) // BITS


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., Q, K] -> int32 [..., Q, ceil(K / 32)]."""
    keys = mask.shape[-1]
    words = num_words(keys)
    lead = mask.shape[:-1]
    pad = words * BITS - keys
    m = mask.to(torch.int64)
    if pad:
        m = torch.cat([m, m.new_zeros(*lead, pad)], -1)
    m = m.reshape(*lead, words, BITS)
    weights = torch.ones(BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        BITS, dtype=torch.int64, device=mask.device
    )
    value = (m * weights).sum(-1)  # in [0, 2^32): the unsigned word
    value = torch.where(value >= 2**31, value - 2**32, value)  # as two's complement int32
    return value.to(torch.int32)


def unpack_mask(words: torch.Tensor, num_keys: int) -> torch.Tensor:
    """int32 [..., Q, W] -> bool [..., Q, num_keys] (num_keys <= 32 W; later bits ignored)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=words.device)
    bits = (words.to(torch.int32)[..., None] >> shifts) & 1  # arithmetic shift: bit 31 too
    flat = bits.reshape(*words.shape[:-1], words.shape[-1] * BITS)
    return flat[..., :num_keys].bool()
