"""The one unmasking rule of block diffusion, shared by `diffusion`, `ssd` / `spiffy` (the
self-speculative engine) and `s2d2`.

A step proposes a token per masked slot (``next_tokens``: argmax, or a draw at T > 0) with
its confidence (the probability of that token under softmax(logits / T), T = 1 when
greedy), ranks the masked slots by confidence (highest first, ties to the lower slot: a
stable sort) and picks either the top ``per_step`` (static schedule) or every slot at or
above ``threshold`` plus the top one (dynamic schedule).  SSD's and Spiffy's losslessness
against one-token-per-step `diffusion` rests on every method applying exactly this rule,
hence one copy.
"""

from __future__ import annotations

import torch

from ..ops import token_stats
from .sampling import next_tokens, require_finite


def log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of ``tokens`` [..., K] under softmax(logits [..., V] / T) (T = 1 when
    greedy), float32 [..., K]: ``logit / T - lse`` with the row's log-normaliser from one
    vectorised ``token_stats`` pass (a float32 ``log_softmax`` of every row cost ~0.1 ms a row
    on the CPU, more than the forward's share of that row).  Every method ranks slots with
    this one function, so their confidences stay bit-identical to each other."""
    t = temperature if temperature > 0 else 1.0
    lse = token_stats(logits, temperature=t).lse
    return logits.gather(-1, tokens).float() / t - lse[..., None]


def confidence(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probability of ``tokens`` [...] under softmax(logits [..., V] / T) (T = 1 when greedy)."""
    return log_probs(logits, tokens[..., None], temperature)[..., 0].exp()


def choose(
    logits: torch.Tensor, temperature: float, generator=None, uniforms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's proposal and its confidence: ``next_tokens``' choice (the argmax, or a draw
    at T > 0, with ``uniforms`` [...] one per slot when given, else from ``generator``) and
    ``confidence`` of it.  logits [..., V] (float32, or bf16 on the CPU, whose
    kernels widen it exactly) -> (tokens int64 [...], confidence float32 [...]).  Greedy takes both from one
    ``token_stats`` pass (the argmax and the normaliser of the same call ``confidence`` would make: the same
    bits).  A row holding NaN or inf raises ValueError (:func:`dspec.decode.sampling.require_finite`)."""
    if temperature <= 0:
        stats = token_stats(logits)
        tokens = require_finite(stats.token)
        return tokens, (logits.gather(-1, tokens[..., None]).float()[..., 0] - stats.lse).exp()
    tokens = next_tokens(
        logits.reshape(-1, logits.shape[-1]), temperature, generator, None if uniforms is None else uniforms.reshape(-1)
    ).view(logits.shape[:-1])
    return tokens, confidence(logits, tokens, temperature)


def rank_masked(conf: torch.Tensor, masked: torch.Tensor):
    """Rank the slots of each row by confidence, masked slots first.

    conf, masked : [R, S].  Returns (conf_m, order, rank): ``conf_m`` is conf with unmasked
    slots at -1, ``order[r, i]`` the slot of rank i (highest confidence first, ties to the
    lower slot), ``rank[r, s]`` the rank of slot s.
    """
    conf_m = torch.where(masked, conf, torch.full_like(conf, -1.0))
    order = torch.sort(conf_m, dim=-1, descending=True, stable=True).indices
    slots = torch.arange(conf.shape[-1], device=conf.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, slots)
    return conf_m, order, rank


def pick_slots(
    masked: torch.Tensor, conf_m: torch.Tensor, rank: torch.Tensor, *, threshold: float | None = None, per_step: int = 1
) -> torch.Tensor:
    """The slots one step unmasks, bool [R, S]: with ``threshold``, every masked slot at or
    above it plus the most confident one; else the ``per_step`` most confident."""
    if threshold is not None:
        return masked & ((conf_m >= threshold) | (rank == 0))
    return masked & (rank < per_step)
