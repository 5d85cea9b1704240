"""Attention plans: what one model forward computes.

A plan is DESIGN.md's one shape: a shared prefix (the KV cache, seen by every suffix token)
plus a suffix of N new tokens under a packed mask.

- ``tokens`` [B, N]: the suffix token ids;
- ``positions`` [B, N]: their absolute positions (RoPE), e.g. ``cache.lengths[:, None] +
  dspec.masks.*(...).positions``;
- ``mask``: packed int32 words [N, ceil(N/32)] (shared) or [B, N, ceil(N/32)], bit j of row
  i lets suffix token i see suffix token j (``dspec.pack_mask`` layout); None = every
  suffix token sees every suffix token;
- ``cache``: the ``KVCache`` holding the prefix, or None for no prefix;
- ``lengths`` (optional) [B]: valid suffix tokens per request when rows are right-padded;
  ``logits="last"`` and ``KVCache.append(..., counts=plan.lengths)`` use it.

``AttentionPlan.sequences`` builds the plan of a right-padded ragged batch under a model's
own attention (causal, bidirectional or block-causal), padding excluded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..masks import causal
from ..ops.masks import pack_mask
from .kv_cache import KVCache


@dataclass
class AttentionPlan:
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None = None
    cache: KVCache | None = None
    lengths: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def from_offsets(cls, tokens, offsets, mask=None, cache: KVCache | None = None, *, lengths=None) -> "AttentionPlan":
        """A plan whose positions are offsets from each request's prefix end
        (``dspec.masks`` builders return such offsets): position = cache length + offset."""
        tokens = _as_ids("tokens", tokens)
        offsets = torch.as_tensor(offsets, device=tokens.device)
        if offsets.dim() == 1:
            offsets = offsets.expand(tokens.shape[0], -1)
        base = (
            torch.zeros(tokens.shape[0], dtype=torch.int64, device=tokens.device)
            if cache is None
            else cache.device_lengths.to(tokens.device)
        )  # no host read of the lengths
        positions = base[:, None] + offsets.to(torch.int64)
        return cls(tokens, positions, mask, cache, lengths)

    @classmethod
    def sequences(
        cls,
        seqs,
        *,
        attention: str = "causal",
        block_size: int | None = None,
        cache: KVCache | None = None,
        pad_id: int = 0,
        device=None,
        lengths=None,
    ) -> "AttentionPlan":
        """The plan of a batch of token sequences (ragged: right-padded with ``pad_id``)
        appended after each request's cached prefix, under ``attention``.  ``seqs``: a list of
        id lists, or a [B, N] tensor -- every row valid, or its first ``lengths[b]`` tokens
        (``lengths``: ints [B] in [1, N], on the host; the rest is padding, replaced by
        ``pad_id``), so that a decode loop builds a ragged batch with array ops.

        - "causal": token i sees tokens j <= i;
        - "bidirectional": every valid token sees every valid token;
        - "block_causal": blocks of ``block_size`` aligned on absolute positions
          (position // block_size); a token sees its own block and earlier ones.

        Padding tokens see only themselves and no one sees them.  A ``Model`` passes its own
        attention kind with ``model.plan(seqs, cache)``.

        Reads no device tensor on the host: the decision to share one mask across the batch
        uses only host data (the sequence lengths, and for block-causal attention the
        cache's host length bound when it is exact).
        """
        if attention not in ("causal", "bidirectional", "block_causal"):
            raise ValueError(f"attention must be 'causal', 'bidirectional' or 'block_causal', got {attention!r}")
        if attention == "block_causal" and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_causal attention needs block_size >= 1, got {block_size!r}")
        tokens, lengths = _pad(seqs, pad_id, device, lengths)
        batch, n = tokens.shape
        if cache is not None and cache.batch_size != batch:
            raise ValueError(f"cache holds {cache.batch_size} requests, seqs {batch}")
        dev = tokens.device
        base = torch.zeros(batch, dtype=torch.int64, device=dev) if cache is None else cache.device_lengths.to(dev)
        ar = torch.arange(n, device=dev)
        positions = base[:, None] + ar
        all_valid = lengths.tolist() == [n] * batch  # host data
        if all_valid and attention == "causal":
            return cls(tokens, positions, _causal_words(n, dev), cache, lengths)
        valid = ar[None, :] < lengths.to(dev)[:, None]  # [B, N]
        if attention == "causal":
            dense = (ar[None, :] <= ar[:, None]).expand(batch, n, n)
        elif attention == "bidirectional":
            dense = torch.ones(batch, n, n, dtype=torch.bool, device=dev)
        else:
            blk = positions // block_size
            dense = blk[:, None, :] <= blk[:, :, None]
        dense = dense & valid[:, None, :] & valid[:, :, None]
        dense = dense | (torch.eye(n, dtype=torch.bool, device=dev)[None] & ~valid[:, :, None])
        if all_valid:
            if attention == "bidirectional":
                mask = None
            elif attention == "causal" or batch == 1 or _blocks_aligned_alike(cache, block_size):
                mask = pack_mask(dense[0])
            else:
                mask = pack_mask(dense)
        else:
            mask = pack_mask(dense)
        return cls(tokens, positions, mask, cache, lengths)


_CAUSAL_WORDS: dict = {}


def _causal_words(n: int, device) -> torch.Tensor:
    """The packed causal mask of n suffix tokens, shared by every plan that asks (masks are
    never written in place); a decode step's one-token plan stops re-packing it."""
    key = (n, str(device))
    words = _CAUSAL_WORDS.get(key)
    if words is None:
        words = causal(n, device=device).words
        if n <= 512:  # the sizes decoding repeats; bounded memory
            _CAUSAL_WORDS[key] = words
    return words


def _blocks_aligned_alike(cache: KVCache | None, block_size: int) -> bool:
    """Every request's suffix starts at the same offset inside a block (so one block-causal
    mask serves the batch), decided from host data only: True without a cache; with one,
    only when its host lengths are exact (reading stale ones would sync: a per-request mask
    is as correct, just larger)."""
    if cache is None:
        return True
    if cache._host_lengths is None:
        return False
    return len({length % block_size for length in cache._host_lengths.tolist()}) == 1


def _as_ids(name, t) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids of shape [B, N], got {t.dtype} {list(t.shape)}")
    return t.to(torch.int64)


def _pad(seqs, pad_id: int, device, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A list of id sequences (or a [B, N] / [N] tensor, optionally with valid ``lengths``)
    -> right-padded [B, N] + lengths [B]."""
    if isinstance(seqs, torch.Tensor):
        t = _as_ids("seqs", seqs)
        if lengths is not None:
            lengths = torch.as_tensor(lengths)
            if (
                lengths.shape != (t.shape[0],)
                or lengths.is_floating_point()
                or lengths.dtype == torch.bool
                or lengths.device.type != "cpu"
            ):
                raise ValueError(
                    f"lengths must be host ints of shape [B = {t.shape[0]}], got "
                    f"{lengths.dtype} {list(lengths.shape)} on {lengths.device}"
                )
            lengths = lengths.to(torch.int64)
            if t.shape[1] and (bool((lengths < 1).any()) or bool((lengths > t.shape[1]).any())):
                raise ValueError(f"lengths must lie in [1, N = {t.shape[1]}], got {lengths.tolist()}")
            if bool((lengths < t.shape[1]).any()):
                t = torch.where(
                    torch.arange(t.shape[1], device=t.device)[None] < lengths.to(t.device)[:, None],
                    t,
                    torch.full_like(t, int(pad_id)),
                )
        else:
            lengths = torch.full((t.shape[0],), t.shape[1], dtype=torch.int64)
        if device is not None:
            t = t.to(device)
        return t, lengths
    if lengths is not None:
        raise ValueError("lengths go with a [B, N] tensor of seqs, not with a list of sequences")
    if not isinstance(seqs, Sequence) or isinstance(seqs, (str, bytes)) or not seqs:
        raise ValueError("seqs must be a non-empty list of token-id sequences or a [B, N] tensor")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in seqs):
        seqs = [seqs]
    rows = []
    for b, s in enumerate(seqs):
        if isinstance(s, torch.Tensor):
            s = s.tolist()
        if not isinstance(s, Sequence) or any(isinstance(x, bool) or not isinstance(x, int) for x in s):
            raise ValueError(f"seqs[{b}] must be a sequence of int token ids, got {s!r}")
        if not s:
            raise ValueError(f"seqs[{b}] is empty")
        rows.append(list(s))
    n = max(len(r) for r in rows)
    tokens = torch.full((len(rows), n), int(pad_id), dtype=torch.int64)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return tokens.to(device) if device is not None else tokens, lengths
