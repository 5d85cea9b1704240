"""Routing policies for S2D2: when is a block-size-1 verification worth its forward?

After every diffusion (drafting) forward, each sequence of the batch that is drafting
decides on its own whether to verify the first contiguous masked span of its block with the
autoregressive (block-size-1) view of the same model (one extra forward, commits the
accepted drafts plus one resampled / bonus token), or to fall back to confidence-threshold
decoding (commits the slots whose confidence reaches ``threshold``, at least one, with no
extra forward).  A router turns per-sequence :class:`RoutingFeatures` into that decision.

Policies (``make_router(policy, ...)``):

- ``"always"`` / ``"never"``: verify every time / never (``never`` = pure
  confidence-threshold decoding, the fallback itself);
- ``"min_span"``: verify when the first masked span holds at least ``min_span`` slots;
- ``"score"``: static threshold, verify when the estimated number of accepted drafts
  ``score >= score_threshold``;
- ``"score_dynamic"``: a cost-aware threshold that moves with the fallback: verify when
  the verification's expected tokens per forward beat the fallback's by the factor
  ``score_threshold``: ``(score + 1) / 2 >= score_threshold * fallback_tokens`` (a
  verification commits about ``score + 1`` tokens for two forwards, the drafting one and
  its own; the fallback commits ``fallback_tokens`` for the drafting forward alone), so
  the bar rises when the draft is already confident enough for the threshold rule;
- ``"hysteresis"``: per-sequence on/off state; off -> on when ``score >= on``, on -> off
  when ``score < off`` (``on >= off``), so one noisy step does not flip the mode;
- ``"ucb"``: a UCB1 contextual bandit with two arms (fallback, verify) per context bin of
  the score; the reward of a decision is the tokens it committed per forward it cost
  (fallback: ``fallback_tokens / 1``, the next drafting forward; verify: ``committed / 2``,
  the verification forward plus the next drafting one, or ``committed / 1`` when every
  draft passed and the verification forward's speculative block serves as the next
  drafting step or as the finished block).  The statistics are shared by the batch (every sequence
  teaches the same bandit); the decisions are per sequence.

Estimators of the expected number of accepted drafts (:func:`span_score`), from the per-slot
statistics of the drafting forward (``dspec.token_stats`` gives all of them in one read):

- ``"product"``: ``expected_accept_length(q(x_i))`` with ``q(x_i)`` the drafter's
  probability of its own draft (the S2D2 estimate: acceptance of draft i needs every
  earlier one accepted);
- ``"margin"``: the same with the top-1 minus top-2 margin as the per-slot proxy;
- ``"entropy"``: the same with ``exp(-entropy)`` (inverse perplexity) as the proxy.

All decisions run on the device without host synchronisation (vectorised over the batch);
only ``stats()`` reads values back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops import expected_accept_length

POLICIES = ("always", "never", "min_span", "score", "score_dynamic", "hysteresis", "ucb")
ESTIMATORS = ("product", "margin", "entropy")

ARM_FALLBACK, ARM_VERIFY = 0, 1


@dataclass
class RoutingFeatures:
    """What a router sees for each sequence of the batch, all tensors [B] on one device.

    active : bool, the sequences deciding now (drafting, with a masked slot left).
    span_len : int64, length of the first contiguous masked span (capped at ``draft_len``).
    score : float32, estimated number of accepted drafts of that span (:func:`span_score`).
    fallback_tokens : int64, tokens the confidence-threshold fallback would commit now (>= 1).
    """

    active: torch.Tensor
    span_len: torch.Tensor
    score: torch.Tensor
    fallback_tokens: torch.Tensor


def span_score(
    stats, draft_conf: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Estimated accepted length of each sequence's span: float32 [B].

    Parameters
    ----------
    stats : TokenStats of the drafting logits, fields [B, S] (S slots of the block).
    draft_conf : float [B, S], the drafter's probability of each drafted token.
    span_start, span_len : int64 [B]; slots ``span_start .. span_start + span_len - 1``.
    estimator : one of :data:`ESTIMATORS`.
    """
    if estimator == "product":
        proxy = draft_conf
    elif estimator == "margin":
        proxy = stats.margin
    elif estimator == "entropy":
        proxy = torch.exp(-stats.entropy)
    else:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    slots = proxy.shape[1]
    rel = torch.arange(slots, device=proxy.device)[None, :]
    where = (span_start[:, None] + rel).clamp(max=slots - 1)
    left = proxy.float().gather(1, where)
    # outside the span the proxy is 0, so the running product (and the sum) stops there
    left = torch.where(rel < span_len[:, None], left.nan_to_num(0.0).clamp(0.0, 1.0), 0.0)
    return expected_accept_length(left)


class Router:
    """Base class: ``decide(features) -> bool [B]``, ``observe(...)`` the outcome, ``stats()``.

    Subclasses implement ``_decide``; the base masks inactive rows and counts decisions.
    """

    name = "router"

    def __init__(self, batch_size: int, device):
        self.batch_size = batch_size
        self.device = torch.device(device)
        self._decisions = torch.zeros((), dtype=torch.int64, device=self.device)
        self._verifies = torch.zeros((), dtype=torch.int64, device=self.device)

    def decide(self, features: RoutingFeatures) -> torch.Tensor:
        """Which active sequences verify now: bool [B] (False for inactive rows)."""
        verify = self._decide(features) & features.active
        self._decisions += features.active.sum()
        self._verifies += verify.sum()
        return verify

    def _decide(self, features: RoutingFeatures) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, rows: torch.Tensor, verified: bool, tokens: torch.Tensor, forwards) -> None:
        """Outcome of the decisions of ``rows`` (bool [B]): ``tokens`` [B] committed for
        ``forwards`` (an int or [B]) model forwards until the sequence's next decision.
        Only the bandit learns from it."""

    def stats(self) -> dict:
        return {"policy": self.name, "decisions": int(self._decisions), "verify_decisions": int(self._verifies)}


class AlwaysRouter(Router):
    name = "always"

    def _decide(self, f):
        return torch.ones_like(f.active)


class NeverRouter(Router):
    name = "never"

    def _decide(self, f):
        return torch.zeros_like(f.active)


class MinSpanRouter(Router):
    """Verify when the first masked span has at least ``min_span`` slots."""

    name = "min_span"

    def __init__(self, batch_size, device, min_span: int):
        super().__init__(batch_size, device)
        self.min_span = min_span

    def _decide(self, f):
        return f.span_len >= self.min_span


class ScoreRouter(Router):
    """Static (``score >= t``) or dynamic (``(score + 1) / 2 >= t * fallback_tokens``) threshold."""

    def __init__(self, batch_size, device, score_threshold: float, dynamic: bool):
        super().__init__(batch_size, device)
        self.score_threshold = score_threshold
        self.dynamic = dynamic
        self.name = "score_dynamic" if dynamic else "score"

    def _decide(self, f):
        if self.dynamic:
            verify_rate = (f.score + 1.0) / 2.0  # tokens per forward when verifying
            return verify_rate >= self.score_threshold * f.fallback_tokens.to(f.score.dtype)
        return f.score >= self.score_threshold


class HysteresisRouter(Router):
    """Two thresholds with memory, per sequence: switch on at ``score >= on``, off at
    ``score < off``; between the two the previous mode of that sequence is kept."""

    name = "hysteresis"

    def __init__(self, batch_size, device, on: float, off: float):
        super().__init__(batch_size, device)
        self.on, self.off = on, off
        self.state = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self._switches = torch.zeros((), dtype=torch.int64, device=self.device)

    def _decide(self, f):
        new = torch.where(self.state, f.score >= self.off, f.score >= self.on)
        new = torch.where(f.active, new, self.state)  # inactive rows keep their mode
        self._switches += (new != self.state).sum()
        self.state = new
        return new

    def stats(self):
        return dict(super().stats(), switches=int(self._switches), on=self.on, off=self.off)


class UcbRouter(Router):
    """UCB1 over two arms (fallback, verify) in each context bin of the score.

    Context bin: ``floor(score / max_score * bins)`` clipped to ``[0, bins - 1]``.  An arm
    not yet tried in a bin is tried first (verify before fallback); otherwise the arm with
    the larger ``mean reward + c * sqrt(ln(n_bin) / n_arm)`` is played (ties to fallback).
    """

    name = "ucb"

    def __init__(self, batch_size, device, c: float, max_score: float, bins: int = 4):
        super().__init__(batch_size, device)
        self.c = c
        self.max_score = max(float(max_score), 1e-6)
        self.bins = bins
        self.counts = torch.zeros(bins, 2, dtype=torch.float64, device=self.device)
        self.sums = torch.zeros(bins, 2, dtype=torch.float64, device=self.device)
        self.context = torch.zeros(batch_size, dtype=torch.int64, device=self.device)

    def bin_of(self, score: torch.Tensor) -> torch.Tensor:
        b = torch.floor(score.double() / self.max_score * self.bins).to(torch.int64)
        return b.clamp(0, self.bins - 1)

    def _decide(self, f):
        ctx = self.bin_of(f.score)
        self.context = torch.where(f.active, ctx, self.context)
        n = self.counts[ctx]  # [B, 2]
        total = n.sum(1, keepdim=True)
        mean = self.sums[ctx] / n.clamp(min=1)
        bonus = self.c * torch.sqrt(torch.log(total.clamp(min=1)) / n.clamp(min=1))
        ucb = torch.where(n > 0, mean + bonus, torch.full_like(mean, math.inf))
        untried_verify = torch.isinf(ucb[:, ARM_VERIFY])
        return untried_verify | (ucb[:, ARM_VERIFY] > ucb[:, ARM_FALLBACK])

    def observe(self, rows, verified, tokens, forwards):
        arm = ARM_VERIFY if verified else ARM_FALLBACK
        reward = tokens.double() / torch.as_tensor(forwards, dtype=torch.float64, device=tokens.device)
        w = rows.double()
        self.counts[:, arm].index_add_(0, self.context, w)
        self.sums[:, arm].index_add_(0, self.context, w * reward)

    def stats(self):
        n = self.counts.cpu()
        mean = self.sums.cpu() / n.clamp(min=1)
        return dict(
            super().stats(),
            c=self.c,
            bins=self.bins,
            arm_counts=n.to(torch.int64).tolist(),
            arm_mean_reward=[[round(float(x), 4) for x in row] for row in mean],
        )


def make_router(
    policy: str,
    batch_size: int,
    device,
    *,
    min_span: int,
    score_threshold: float,
    hysteresis: tuple[float, float],
    ucb_c: float,
    max_score: float,
) -> Router:
    """The router of ``policy`` (one of :data:`POLICIES`) for a batch (options validated by
    the caller, ``dspec.decode.s2d2``)."""
    if policy == "always":
        return AlwaysRouter(batch_size, device)
    if policy == "never":
        return NeverRouter(batch_size, device)
    if policy == "min_span":
        return MinSpanRouter(batch_size, device, min_span)
    if policy in ("score", "score_dynamic"):
        return ScoreRouter(batch_size, device, score_threshold, dynamic=policy == "score_dynamic")
    if policy == "hysteresis":
        return HysteresisRouter(batch_size, device, *hysteresis)
    if policy == "ucb":
        return UcbRouter(batch_size, device, ucb_c, max_score)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
