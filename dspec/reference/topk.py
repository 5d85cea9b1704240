"""Reference topk_tokens and mass_candidates.

Ranking is by logit (equivalently by probability before float rounding), ties to the lower
id.  Probabilities are ``softmax(logits / T)`` in float32, shifted by the row maximum before
the division so tiny temperatures do not overflow.  Rows that token_stats calls invalid (a
NaN, a +inf, or only -inf) give tokens -1 and probs NaN (topk_tokens), or count 0, tokens -1
and logprobs -inf (mass_candidates).

mass_candidates' count is the smallest m <= max_m whose top-m mass (a float32 running sum
in rank order) reaches tau, never counting tokens whose probability is 0 in float32; when
the mass never reaches tau it is max_m (or the number of nonzero tokens, if fewer).
"""

from __future__ import annotations

import torch


def _row_softmax_parts(x: torch.Tensor, inv_t: float):
    has_nan = torch.isnan(x).any(-1)
    x_clean = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    m = x_clean.amax(-1)
    valid = ~has_nan & torch.isfinite(m)
    m = torch.where(valid, m, torch.zeros_like(m))
    s = torch.exp((x_clean - m[..., None]) * inv_t).sum(-1)
    return x_clean, m, s, valid


def _ranked(x_clean: torch.Tensor, k: int):
    """The k largest values per row and their ids, sorted by value, ties to the lower id.

    Equal to a stable descending sort of the whole row cut at k, without sorting the whole
    vocabulary: keep everything above the k-th value plus the lowest-id ties at it (exactly
    k per row), gather them in id order, then stable-sort only those k.
    """
    kth = torch.topk(x_clean, k, dim=-1).values[..., -1:]
    above = x_clean > kth
    tied = x_clean == kth
    need = k - above.sum(-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, -1) <= need))
    slot = torch.cumsum(keep, -1) - 1  # 0..k-1 on kept ids, in id order
    vocab_ids = torch.arange(x_clean.shape[-1], device=x_clean.device).expand_as(x_clean)
    ids = _scatter_kept(keep, slot, vocab_ids, k)
    values = x_clean.gather(-1, ids)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _scatter_kept(keep, slot, vocab_ids, k):
    # one extra dump column receives the ids that are not kept, then is dropped
    out = torch.zeros(*keep.shape[:-1], k + 1, dtype=torch.int64, device=keep.device)
    out.scatter_(-1, torch.where(keep, slot, torch.full_like(slot, k)), vocab_ids)
    return out[..., :k]


def topk_tokens(logits: torch.Tensor, k: int, temperature: float = 1.0):
    inv_t = 1.0 / temperature
    x_clean, m, s, valid = _row_softmax_parts(logits.float(), inv_t)
    values, ids = _ranked(x_clean, k)
    probs = torch.exp((values - m[..., None]) * inv_t) / s[..., None]
    probs = torch.where(valid[..., None], probs, torch.full_like(probs, float("nan")))
    ids = torch.where(valid[..., None], ids, torch.full_like(ids, -1))
    return ids, probs


def mass_candidates(logits: torch.Tensor, tau: float, max_m: int, temperature: float = 1.0):
    inv_t = 1.0 / temperature
    x_clean, m, s, valid = _row_softmax_parts(logits.float(), inv_t)
    values, ids = _ranked(x_clean, max_m)
    probs = torch.exp((values - m[..., None]) * inv_t) / s[..., None]
    reached = torch.cumsum(probs, -1) >= tau
    # first rank whose running mass reaches tau, +1; max_m when none does
    first = torch.where(reached.any(-1), reached.int().argmax(-1) + 1, torch.full_like(m, max_m, dtype=torch.int64))
    nonzero = (probs > 0).sum(-1)
    count = torch.minimum(first, nonzero)
    count = torch.where(valid, count, torch.zeros_like(count))
    keep = torch.arange(max_m, device=logits.device) < count[..., None]
    logprobs = (values - m[..., None]) * inv_t - torch.log(s)[..., None]
    logprobs = torch.where(keep, logprobs, torch.full_like(logprobs, float("-inf")))
    ids = torch.where(keep, ids, torch.full_like(ids, -1))
    return ids, logprobs, count
