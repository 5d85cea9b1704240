"""Reference top-k / top-p filtering of temperature-scaled logits (per request).

``filter_logits`` gives ``logits / T_b`` in float32 with -inf outside request b's kept set:
top-k first (every token tied with the k-th largest value is kept), then top-p over the
renormalised top-k set: tokens in descending order of value (lower id first among equal
values) are kept while the mass before them is below ``top_p``, so the kept set is the
smallest such prefix whose mass reaches ``top_p`` (the top-1 token is always kept).  A row
with a NaN, a +inf or only -inf is returned unfiltered (scaled), so it stays invalid.
"""

from __future__ import annotations

import torch


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits [B, ..., V]; temperature float [B] (> 0); top_k int [B] (0 = off); top_p float [B]
    (>= 1 = off).  Returns float32 [B, ..., V].

    >>> import torch
    >>> x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.15, 0.05]]))
    >>> torch.isfinite(filter_logits(x, torch.ones(1), torch.tensor([4]), torch.tensor([0.7]))).tolist()
    [[True, True, True, False, False]]
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    x = logits.float() / temperature.float().view(shape)
    vocab = x.shape[-1]
    top = x.amax(-1, keepdim=True)
    valid = ~torch.isnan(x).any(-1, keepdim=True) & torch.isfinite(top)
    k = top_k.to(x.device).long().view(shape)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    p = top_p.to(x.device).float().view(shape)
    if not bool((p < 1.0).any()):
        # no top-p: the top-k set is every value >= the k-th largest, whatever the order of
        # ties, so the k-th value from topk gives it without a sort over V
        if not bool((k < vocab).any()):
            return x
        clean = torch.where(valid, x, torch.zeros_like(x))
        k_max = int(k.max())
        kth = clean.topk(k_max, dim=-1).values.gather(-1, (k - 1).expand(*clean.shape[:-1], 1))
        out = torch.where(clean >= kth, x, torch.full_like(x, float("-inf")))
        return torch.where(valid, out, x)
    clean = torch.where(valid, x, torch.zeros_like(x))
    sorted_x, order = torch.sort(clean, dim=-1, descending=True, stable=True)
    kth = sorted_x.gather(-1, (k - 1).expand(*sorted_x.shape[:-1], 1))
    keep = sorted_x >= kth  # ties with the k-th value kept
    masked = torch.where(keep, sorted_x, torch.full_like(sorted_x, float("-inf")))
    probs = torch.softmax(masked, -1)
    cum = torch.cumsum(probs, -1)
    before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)  # mass before each token
    keep = keep & ((before < p) | (p >= 1.0))
    kept = torch.zeros_like(keep).scatter(-1, order, keep)
    out = torch.where(kept, x, torch.full_like(x, float("-inf")))
    return torch.where(valid, out, x)
