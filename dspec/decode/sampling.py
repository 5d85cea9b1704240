"""Next-token choice shared by every method, so that all of them use one sampler.

Greedy is the argmax with ties to the lowest id (``token_stats``); sampling at temperature
T is a draw from ``softmax(logits / T)`` by inverse CDF with one uniform per row, exactly
``verify_chain``'s bonus-token draw.  With the same uniforms the AR baseline and the
speculative methods therefore pick the same token from the same distribution.

A forward whose logits hold NaN or inf stops every method with one ValueError
(:func:`require_finite`, called wherever a method picks tokens) instead of feeding the ops'
-1 mark back to a model.
"""
from __future__ import annotations

import torch

from ..ops import token_stats, verify_chain
from ..reference.verify import draw


def non_finite_error(who: str = "model") -> ValueError:
    """The error every method raises when ``who``'s forward gave a logits row holding NaN or
    +inf (or only -inf): there is no distribution to pick a token from."""
    return ValueError(f"the {who}'s logits hold NaN or inf (a non-finite forward: check its weights, dtype "
                      f"and inputs); decoding stopped")


def require_finite(tokens: torch.Tensor, who: str = "model") -> torch.Tensor:
    """``tokens`` (picked token ids, any shape) unchanged, or ValueError when one of them is
    -1: the mark ``token_stats``, ``topk_tokens``, ``verify_chain`` / ``verify_tree`` and the
    shared draw give a logits row holding NaN or +inf (or only -inf).  Every method checks
    the tokens it picks here, so a non-finite forward stops the call with one clear error
    before a -1 could be fed back to a model as a token.  One host read of one flag."""
    if tokens.numel() and bool((tokens < 0).any()):
        raise non_finite_error(who)
    return tokens


def next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, *,
                who: str = "model", check: bool = True):
    """logits [B, V] -> token ids [B] (int64); ValueError where a row is not finite
    (:func:`require_finite`; ``check=False`` leaves the -1 to the caller)."""
    if temperature <= 0:
        tokens = token_stats(logits).token
    else:
        batch = logits.shape[0]
        empty = torch.zeros(batch, 0, dtype=torch.int64, device=logits.device)
        tokens = verify_chain(empty, logits[:, None], temperature=temperature,
                              generator=generator).tokens[:, 0]
    return require_finite(tokens, who) if check else tokens


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from unnormalised weights probs [..., V] with uniforms [...] in
    [0, 1): ``verify_chain``'s draw rule itself (``dspec.reference.verify.draw``: the smallest
    id v with ``cumsum(probs)[v] > u * sum(probs)``), int64 [...]."""
    vocab = probs.shape[-1]
    return draw(probs.reshape(-1, vocab).float(), uniforms.reshape(-1)).view(uniforms.shape)
