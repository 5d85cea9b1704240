"""Next-token choice shared by every method, so that all of them use one sampler.

Greedy is the argmax with ties to the lowest id (``token_stats``); sampling at temperature
T is a draw from ``softmax(logits / T)`` by inverse CDF with one uniform per row, exactly
``verify_chain``'s bonus-token draw.  With the same uniforms the AR baseline and the
speculative methods therefore pick the same token from the same distribution.
"""
from __future__ import annotations

import torch

from ..ops import token_stats, verify_chain
from ..reference.verify import draw


def next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """logits [B, V] -> token ids [B] (int64)."""
    if temperature <= 0:
        return token_stats(logits).token
    batch = logits.shape[0]
    empty = torch.zeros(batch, 0, dtype=torch.int64, device=logits.device)
    return verify_chain(empty, logits[:, None], temperature=temperature,
                        generator=generator).tokens[:, 0]


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from unnormalised weights probs [..., V] with uniforms [...] in
    [0, 1): ``verify_chain``'s draw rule itself (``dspec.reference.verify.draw``: the smallest
    id v with ``cumsum(probs)[v] > u * sum(probs)``), int64 [...]."""
    vocab = probs.shape[-1]
    return draw(probs.reshape(-1, vocab).float(), uniforms.reshape(-1)).view(uniforms.shape)
