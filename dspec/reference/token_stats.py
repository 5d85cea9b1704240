"""Reference token_stats: argmax, its probability, top-1 minus top-2 probability, entropy, logsumexp.

Semantics every backend follows (float32 math on the upcast logits, ``x = logits / T``):

- ``token``: argmax id, the lowest index among ties (int64).
- ``prob``: softmax probability of that token; ``margin``: top-1 minus top-2 probability
  (the top-2 value may equal the top-1 on ties, giving 0; with V = 1 it is ``prob``).
- ``entropy``: ``-sum p log p`` in nats; ``lse``: ``logsumexp(x)``.
- A row is *invalid* when it holds a NaN, a +inf, or only -inf: then ``token = -1`` and
  ``prob = margin = entropy = NaN``; ``lse`` is NaN (NaN present), +inf (+inf present) or
  -inf (all -inf).  -inf entries in a valid row simply have probability 0.

The shift by the row maximum happens before the division by T, so a tiny temperature never
overflows an intermediate (only ``lse`` itself may be +-inf when its true value is).
"""

from __future__ import annotations

import torch

from ..types import TokenStats


def token_stats(logits: torch.Tensor, temperature: float = 1.0) -> TokenStats:
    x = logits.float()
    inv_t = 1.0 / temperature
    has_nan = torch.isnan(x).any(-1)
    x_clean = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    top1, token = x_clean.max(-1)  # first maximal index on ties (documented torch behaviour)
    if x.shape[-1] > 1:
        top2 = x_clean.topk(2, dim=-1).values[..., 1]
    else:
        top2 = torch.full_like(top1, float("-inf"))
    valid = ~has_nan & torch.isfinite(top1)
    m = torch.where(valid, top1, torch.zeros_like(top1))
    t = (x_clean - m[..., None]) * inv_t
    e = torch.exp(t)
    s = e.sum(-1)
    a = torch.where(e > 0, e * t, torch.zeros_like(t)).sum(-1)
    log_s = torch.log(s)
    nan = torch.full_like(top1, float("nan"))
    prob = torch.where(valid, 1.0 / s, nan)
    margin = torch.where(valid, (1.0 - torch.exp((top2 - m) * inv_t)) / s, nan)
    entropy = torch.where(valid, log_s - a / s, nan)
    lse = torch.where(valid, m * inv_t + log_s, torch.where(has_nan, nan, top1))
    token = torch.where(valid, token, torch.full_like(token, -1))
    return TokenStats(token, prob, margin, entropy, lse)
