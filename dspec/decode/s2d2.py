"""S2D2: self-speculative decoding for block-diffusion models (Han et al., 2026).

A block-diffusion model drafts in diffusion mode and verifies itself in block-size-1
(autoregressive) mode.  Each sequence of the batch runs its own little state machine; one
model forward per iteration serves the whole batch, every row with its own suffix layout
under a per-row packed mask (DESIGN.md's one attention shape):

``draft``
    the usual diffusion step on the current block (bidirectional within it, the committed
    prefix from the KV cache): drafts ``x_i`` and draft distributions ``q_i`` for every
    masked slot (position-aligned models such as SDAR predict slot i from slot i; right-
    shifted ones such as Fast-dLLM v2 from slot i - 1, slot 0 from the last committed
    position).  The row's router (:mod:`dspec.decode.routing`) then decides:

    - verify: the first contiguous masked span of the block (from the first masked slot
      to the first unmasked one, the block end, or ``draft_len`` slots) goes to ``verify``;
    - fall back: confidence-threshold decoding (Fast-dLLM dynamic schedule, exactly the
      ``diffusion`` method's ``threshold`` rule) commits the slots whose confidence reaches
      ``threshold`` (at least the most confident one).

``verify``
    the block-size-1 view of the span: the block's tokens before the span (``u`` of them)
    and the L drafts as one token-causal chain, and, for position-aligned models, L + 1
    [MASK] copies at slots ``s .. s + L`` (the 2L mask of :func:`dspec.masks.s2d2_two_l`
    plus the chain's leading context and one bonus copy): copy j sees the context, drafts
    ``0 .. j-1`` and itself, so its logits are ``p_AR(x_{s+j} | x_{<s+j})``, exactly those
    of running the model with block size 1 (the committed blocks as cached).  Right-shifted
    models need no copies: in the plain causal view the logits of slot i - 1 predict slot i.
    ``dspec.verify_chain`` then accepts draft j with probability ``min(1, p_j(x_j) /
    q_j(x_j))`` (greedy: while the draft equals the AR argmax), resamples from
    ``max(p - q, 0)`` at the first rejection, or draws a bonus token from ``p_L`` when all
    are accepted and slot ``s + L`` is still masked inside the block.  The accepted drafts
    and the drawn token are committed into the block; decoding continues on the rest.

    The same forward also runs the *redraft blocks* (``redraft=True``; the default "auto" on
    a CPU model decoding one request, and on other devices): for
    every outcome r = 0 .. L (the first r drafts pass, draft r is rejected; r = L: all
    pass), the block as it would then stand -- drafts before slot s + r in place, the span
    from s + r on [MASK] --, bidirectional within itself after the committed prefix (SSD's
    trick of merging the next state into the current forward, once per rejection point).
    Whatever the verification decides, the block of its outcome holds the block as it now
    stands but for the drawn token, still [MASK] there: its logits are the next drafts, and
    the drafting forward that would follow the verification is saved.  Those drafts are
    proposals (any fixed q keeps the verification exact), not a diffusion state: a row
    drafting from them verifies (a fallback would commit diffusion choices made without the
    drawn token; it takes a drafting forward instead).  When the span ends the block, the
    next block's all-[MASK] first state rides too, attending to the block with every draft
    in place: if they all pass, that block is finished, its KV is committed from this
    forward and the next block's first drafts are already computed.  A model whose clean
    rows attend causally (``clean_causal``) shares the chain's rows before each redraft
    block's first [MASK] (the same keys, bit for bit), so the blocks cost only their
    [MASK] rows, and skips the outcome r = 0 when the span's first draft came from a clean
    row (right-shifted: the very logits the verification recomputes) and the outcome that
    fills the block's last masked slot; at block size 4 a verification then forwards at
    most 13 rows.  ``redraft=False`` runs S2D2's *speculative block* alone: the block with
    every draft in place, reused when every draft passes (after a bonus token, which it has
    not seen, like a redraft block: the row verifies or takes a drafting forward).

    The *boundary state* (``boundary``; on wherever the redraft blocks share the chain's
    rows on a right-shifted model, but on a CPU): the outcome that fills the block's last
    slot with a drawn token (the last draft rejected) left no next-block drafts, so a
    drafting forward followed -- 22 % of all forwards of ``smollm2-135m-bd`` at block size 4.  When the span
    ends the block, the verification forward also forwards that slot as [MASK] again with
    the next block's all-[MASK] state behind it, one bidirectional run of bs + 1 rows after
    the chain (at block size 4: 18 rows in all after an exact first draft).  On that
    outcome its logits draft the next block (proposals: they have not seen the drawn
    token), and the finished block, pending, rides at the head of the next
    *verification's* token-causal chain instead of a drafting forward: its last row gives
    slot 0's block-size-1 logits, its KV is appended from that forward (with the new
    block's, when the new drafts all pass).

``commit``
    a block completed otherwise (by the fallback, or by a rejected / bonus token) is
    *pending*: it rides in front of the next block's first drafting forward (bidirectional
    within itself, the new block seeing it, as ``diffusion`` commits it), which appends its
    KV (exact: the rows of a separate commit forward, at the same key indices) and takes its
    last logits as the right-shifted model's prediction for the new block's slot 0.  The
    last block is never forwarded again, and it ends as soon as its committed run from its
    first generated slot holds an EOS or reaches ``max_new_tokens`` (its later slots are never
    output): a request costs no forward past its last token.

Rows in different states share a forward: the suffix is as wide as the widest row (a
block, two with a pending block; a verification's chain, its 2L copies for a
position-aligned model, its redraft blocks), narrower rows are padded with tokens that see
only themselves, and the LM head runs once, on ``block_size + 1`` gathered rows per
sequence plus a verifying row's redraft rows that predict a masked slot.  So a batch costs
one forward per iteration whatever its rows do, and a sequence's tokens are those of its
single run.

Losslessness: for the verified slots, the committed tokens are exact samples of the
block-size-1 distribution given everything before them (drafts are sampled from the very
``q`` given to the verifier).  With policy ``always`` and greedy decoding every token is
the AR argmax, so the output is that of block-size-1 greedy decoding of the model over the
block-mode KV of the finished blocks (:func:`block_size_one_greedy` in the tests),
whatever ``draft_len`` or ``threshold``.  With policy ``never`` it is exactly the
``diffusion`` method with the same ``threshold``, greedy or sampled (same forwards, same
random draws).

The compiled step: greedy decoding with policy ``always`` on the CPU runs each iteration's
host-side work -- the layout above, the argmax of every logit row, the acceptance, the
redraft block of the outcome, the next drafts and the block openings -- in three calls of
``dspec._C`` (``s2d2_plan`` / ``s2d2_advance`` / ``s2d2_open``, csrc/s2d2_cpu.cpp) instead
of several hundred small torch ops (~4 ms a step against a ~15 ms forward of SmolLM2-135M);
the torch composition below is their reference (tests/test_s2d2_native.py: every forward's
inputs and every row's state equal, step by step) and the path for sampling, the other
policies and other devices.

Host synchronisation (torch step): one small read per iteration (each row's state, suffix
width and redraft logit rows, to size the suffix), one flag vector after the forward (which
rows finished their block, for the output and the next block), and the token lists of a
finished block; with redraft blocks, after each verification forward one flag (did a
finished block's next-block drafts ride along) and, if so, the flag vector of that drafting
step.  The drafting, routing, verification and commit arithmetic is vectorised over the
batch on the device.
"""

from __future__ import annotations

import math
import numbers
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from .. import _backend
from ..models import AttentionPlan
from ..ops import pack_mask, token_stats, verify_chain
from .bounds import check_rows
from .cpu_cost import resolve_boundary, resolve_redraft
from .diffusion import PromptTails, prefill_prompt_blocks
from .outputs import OutputBuffer
from .routing import ESTIMATORS, POLICIES, RoutingFeatures, make_router, span_score
from .sampling import request_streams, require_finite
from .selfspec import check_common
from .unmask import choose, pick_slots, rank_masked

OPTIONS = (
    "block_size",
    "threshold",
    "policy",
    "min_span",
    "score_threshold",
    "hysteresis",
    "ucb_c",
    "estimator",
    "draft_len",
    "redraft",
    "boundary",
)
#: ``preset="paper"``: S2D2 as published -- the speculative block alone, no redraft blocks
#: (and so no boundary state)
PAPER = {"redraft": False}
DRAFTER = False

# COMMIT marks a row whose block is complete, between its transition and ``commit``: a
# row never forwards in it (the block rides in front of the next one's drafting forward)
DRAFT, VERIFY, COMMIT, DONE = 0, 1, 2, 3

# policy: "always" with redraft blocks (a verification costs no forward of its own) or where
# the compiled step runs it, else "min_span" (a verification costs the forward after it;
# :func:`decode_s2d2`)
DEFAULTS = {
    "threshold": 0.9,
    "policy": "always",
    "min_span": 2,
    "score_threshold": 1.0,
    "hysteresis": (1.5, 0.75),
    "ucb_c": 1.0,
    "estimator": "product",
}
# which option tunes which policy (giving one to another policy is a mistake worth a ValueError)
_POLICY_OPTION = {
    "min_span": "min_span",
    "score_threshold": ("score", "score_dynamic"),
    "hysteresis": "hysteresis",
    "ucb_c": "ucb",
}


# ------------------------------------------------------------------------------- options


def _real(name, value, lo=None, hi=None, *, lo_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    v = float(value)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return v


def verify_rows(bs: int, draft_len: int, *, shifted: bool, redraft: bool, boundary: bool) -> tuple[int, str]:
    """The most suffix rows one forward carries (a verification's worst case: a pending block
    at the chain's head, the chain, the L + 1 copies of a position-aligned model, the redraft
    blocks -- or the speculative block --, the next block and the boundary state) and the
    formula, for the context bound."""
    blocks = (draft_len + 1) * bs if redraft else bs
    rows = 2 * bs + (0 if shifted else draft_len + 1) + blocks + bs + (bs if boundary else 0)
    formula = (
        f"{4 if boundary else 3} * block_size{'' if shifted else ' + draft_len + 1'}"
        f"{' + (draft_len + 1) * block_size' if redraft else ' + block_size'}"
    )
    return rows, formula


def resolve_options(
    model,
    block_size,
    threshold,
    policy,
    min_span,
    score_threshold,
    hysteresis,
    ucb_c,
    estimator,
    draft_len,
    redraft="auto",
    batch: int = 1,
    temperature: float = 0.0,
    boundary=None,
    prompt_len: int = 0,
) -> dict:
    """Every S2D2 option of one call checked (ValueError naming the option) and resolved:
    ``None`` / "auto" to the default for this model, device, batch and temperature.  Returns
    the dict :class:`S2D2Run` takes (block_size, threshold, policy, min_span, score_threshold,
    hysteresis, ucb_c, estimator, draft_len, redraft, boundary)."""
    bs = check_common(model, "s2d2", block_size)
    check_rows(model, prompt_len, "block_size", bs, 3 * bs, "3 * block_size")  # before anything sized by it
    redraft = resolve_redraft(model, redraft, batch=batch)
    boundary = resolve_boundary(model, boundary, redraft=redraft)
    if policy is None:
        compiled = native_extension(model, bs, temperature) is not None
        policy = DEFAULTS["policy"] if redraft or compiled else "min_span"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    given = {"min_span": min_span, "score_threshold": score_threshold, "hysteresis": hysteresis, "ucb_c": ucb_c}
    for opt, value in given.items():
        owners = _POLICY_OPTION[opt]
        owners = owners if isinstance(owners, tuple) else (owners,)
        if value is not None and policy not in owners:
            raise ValueError(f"{opt} tunes policy {' / '.join(map(repr, owners))}, not {policy!r}")
    threshold = _real("threshold", DEFAULTS["threshold"] if threshold is None else threshold, 0.0, 1.0, lo_open=True)
    if draft_len is None:
        draft_len = bs
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"draft_len must be an int >= 1, got {draft_len!r}")
    draft_len = min(draft_len, bs)
    rows, formula = verify_rows(bs, draft_len, shifted=bool(model.shifted), redraft=redraft, boundary=boundary)
    check_rows(model, prompt_len, "block_size", bs, rows, f"{formula} with draft_len = {draft_len}")
    min_span = DEFAULTS["min_span"] if min_span is None else min_span
    if isinstance(min_span, bool) or not isinstance(min_span, int) or min_span < 1:
        raise ValueError(f"min_span must be an int >= 1, got {min_span!r}")
    score_threshold = _real(
        "score_threshold", DEFAULTS["score_threshold"] if score_threshold is None else score_threshold
    )
    hysteresis = DEFAULTS["hysteresis"] if hysteresis is None else hysteresis
    if isinstance(hysteresis, str):  # the CLI's --option hysteresis=1.5,0.75
        try:
            hysteresis = tuple(float(x) for x in hysteresis.split(","))
        except ValueError:
            raise ValueError(f"hysteresis must be 'on,off' numbers, got {hysteresis!r}") from None
    if isinstance(hysteresis, (str, bytes)) or not hasattr(hysteresis, "__len__") or len(hysteresis) != 2:
        raise ValueError(f"hysteresis must be a pair (on, off) of numbers, got {hysteresis!r}")
    on = _real("hysteresis[0] (on)", hysteresis[0])
    off = _real("hysteresis[1] (off)", hysteresis[1])
    if off > on:
        raise ValueError(f"hysteresis must be (on, off) with on >= off, got {tuple(hysteresis)!r}")
    ucb_c = _real("ucb_c", DEFAULTS["ucb_c"] if ucb_c is None else ucb_c, 0.0)
    estimator = DEFAULTS["estimator"] if estimator is None else estimator
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    return dict(
        block_size=bs,
        threshold=threshold,
        policy=policy,
        min_span=min_span,
        score_threshold=score_threshold,
        hysteresis=(on, off),
        ucb_c=ucb_c,
        estimator=estimator,
        draft_len=draft_len,
        redraft=redraft,
        boundary=boundary,
    )


# ------------------------------------------------------------------------------- the plan


def two_l_dense(context: int, span: int, copies: int | None = None) -> torch.Tensor:
    """The dense position-aligned verification mask with a leading causal context.

    Rows/keys: ``context`` block tokens before the span, the ``span`` drafts (together one
    token-causal chain), then ``copies`` (default ``span``) [MASK] copies at the slots of
    drafts 0, 1, ...; copy j sees the context, drafts ``0 .. j-1`` and itself.  With
    ``context = 0`` and ``copies = span`` this is :func:`dspec.masks.s2d2_two_l`.
    """
    copies = span if copies is None else copies
    chain = context + span
    n = chain + copies
    idx = torch.arange(n)
    q, k = idx[:, None], idx[None, :]
    chain_part = (q < chain) & (k <= q)
    copy_part = (q >= chain) & ((k < context + (q - chain)) | (k == q))
    return chain_part | copy_part


NO_BLOCKS, SPEC_BLOCK, REDRAFT = "none", "spec", "redraft"


class _Blocks(NamedTuple):
    """The redraft blocks of each verifying row of one forward (:func:`_redraft_blocks`)."""

    used: torch.Tensor  # [B, bs + 1] bool, block r forwarded
    sizes: torch.Tensor  # [B, bs + 1] its own suffix rows
    first: torch.Tensor  # [B, bs + 1] the block slot of its first own row
    has_next: torch.Tensor  # [B] bool, the next block's all-[MASK] state rides too
    logit_rows: torch.Tensor  # [B, bs + 1] its rows that predict a slot the outcome r leaves masked
    logit_extra: torch.Tensor  # [B] the carry row (right-shifted) and the next block's predicting rows
    has_boundary: torch.Tensor  # [B] bool, the next block's state behind redraft block L - 1 rides too


def _redraft_blocks(
    verify, span_start, span_len, *, bs, shifted, blocks, share_prefix, skip=None, boundary=False
) -> _Blocks:
    """Per verifying row (``verify`` [B]), the redraft blocks of a verification forward:
    block r is the block as it stands if the first r drafts pass and draft r is rejected
    (r = L: all pass); its first own row is at slot 0, or with ``share_prefix`` at s + r,
    the slots before it read from the chain.  Its logit rows are those that predict its
    slots after s + r (every slot the outcome r leaves masked lies there); the extra rows are
    the finished block's last row (its carry, right-shifted models) and the next block's
    rows that predict its slots.  ``skip`` [B, bs + 1]: redraft blocks not worth forwarding
    (the last one, r = L, is always forwarded: it is the finished block when every draft
    passes).  ``boundary`` (right-shifted, shared prefix): where the span ends the block and
    redraft block L - 1 (the block's last slot [MASK] again) is forwarded, the next block's
    all-[MASK] state rides behind it too -- the *boundary state*, whose logits draft the next
    block when the last draft is rejected (its extra logit rows: block L - 1's row and the
    boundary state's first bs - 1 rows)."""
    r = torch.arange(bs + 1, device=span_start.device)[None]
    s, n = span_start[:, None], span_len[:, None]
    if blocks == REDRAFT:
        used = r <= n
    elif blocks == SPEC_BLOCK:
        used = r == n
    else:
        used = torch.zeros_like(r, dtype=torch.bool)
    used = used & verify[:, None]
    if skip is not None:
        used = used & (~skip | (r == n))
    first = (s + r).clamp(max=bs) if share_prefix and blocks == REDRAFT else torch.zeros_like(s + r)
    sizes = torch.where(used, bs - first, 0)
    has_next = verify & (span_start + span_len == bs) if blocks == REDRAFT else torch.zeros_like(verify)
    logit_rows = torch.where(used, (bs - 1 - s - r).clamp(min=0), 0)
    has_boundary = has_next & used.gather(1, (n - 1).clamp(min=0))[:, 0] if boundary else torch.zeros_like(has_next)
    extra = int(shifted) + has_next.long() * (bs - 1 if shifted else bs) + has_boundary.long() * bs
    return _Blocks(used, sizes, first, has_next, logit_rows, torch.where(used.any(1), extra, 0), has_boundary)


def _verify_width(span_start, span_len, blk: _Blocks, *, bs, shifted, pending=None):
    """Suffix tokens [B] of each verifying row -- (its pending block +) chain (+ L + 1 copies)
    (+ redraft blocks (+ the next block (+ the boundary state))) -- and the redraft logit
    rows [B] it adds."""
    width = (
        span_start
        + (span_len if shifted else 2 * span_len + 1)
        + blk.sizes.sum(1)
        + bs * (blk.has_next.long() + blk.has_boundary.long())
    )
    if pending is not None:
        width = width + bs * pending.long()
    return width, blk.logit_rows.sum(1) + blk.logit_extra


class _Layout(NamedTuple):
    """Where a forward's verifying rows keep their redraft blocks (see :func:`_row_layout`)."""

    offset: torch.Tensor  # [B] suffix index of the first redraft block
    starts: torch.Tensor  # [B, bs + 1] suffix offset of block r after ``offset``
    first: torch.Tensor  # [B, bs + 1] block slot of block r's first row
    next_off: torch.Tensor  # [B] suffix index of the next block's rows (valid where has_next)
    has_next: torch.Tensor  # [B] bool
    logit_starts: torch.Tensor  # [B, bs + 1] block r's first drafting logit row after the base rows
    logit_blocks: torch.Tensor  # [B] drafting logit rows of all blocks
    verify: torch.Tensor  # [B] bool, the verifying rows
    used: torch.Tensor  # [B, bs + 1] bool, redraft block r forwarded
    lead: torch.Tensor  # [B] chain rows before block slot 0 (a verifying row's pending block)
    has_boundary: torch.Tensor  # [B] bool, the boundary state rides (after the next block's rows)

    def row_of(self, r: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Suffix rows [B, K] of block slots ``slot`` [B, K] in redraft blocks ``r`` [B, K]
        (shared-prefix slots: the chain's rows, which sit at their slot after the lead)."""
        first = self.first.gather(1, r)
        return torch.where(
            slot < first, self.lead[:, None] + slot, self.offset[:, None] + self.starts.gather(1, r) + slot - first
        )

    def block_rows(self, r: torch.Tensor, bs: int) -> torch.Tensor:
        """Suffix rows [B, bs] holding the slots of redraft block r [B]."""
        t = torch.arange(bs, device=r.device)[None]
        return self.row_of(r[:, None].expand(-1, bs), t.expand(len(r), -1))

    def drafting_rows(self, span_start, span_len, count: int, *, bs: int, shifted: bool) -> torch.Tensor:
        """Suffix rows [B, count] whose logits the redraft blocks need, in the order of
        :class:`_Blocks`' logit rows: block 0's, block 1's, ... (the rows predicting its
        slots s + r + 1 ..), then (right-shifted) the last redraft block's slot bs - 1 row,
        then the next block's rows, then (the boundary state) redraft block L - 1's slot
        bs - 1 row and the boundary state's first bs - 1 rows; padding: row 0."""
        k = torch.arange(count, device=span_start.device)[None]
        starts = self.logit_starts
        ends = torch.cat([starts[:, 1:], self.logit_blocks[:, None]], 1)  # [B, R]
        r = (k[..., None] >= ends[:, None, :]).sum(-1).clamp(max=bs)  # [B, K]
        slot = span_start[:, None] + r + (k - starts.gather(1, r)) + (0 if shifted else 1)
        rows = self.row_of(r, slot)
        after = k - self.logit_blocks[:, None]
        if shifted:
            rows = torch.where(after == 0, self.block_rows(span_len, bs)[:, -1:], rows)
            after = after - 1
        rows = torch.where(self.has_next[:, None] & (after >= 0), self.next_off[:, None] + after, rows)
        # the boundary state (right-shifted only): block L - 1's [MASK] row predicts slot 0
        after = after - (bs - 1)
        last_masked = self.row_of((span_len - 1).clamp(min=0)[:, None], torch.full_like(span_len, bs - 1)[:, None])
        rows = torch.where(self.has_boundary[:, None] & (after == 0), last_masked, rows)
        rows = torch.where(self.has_boundary[:, None] & (after > 0), self.next_off[:, None] + bs + after - 1, rows)
        total = (
            self.logit_blocks
            + int(shifted)
            + self.has_next.long() * (bs - int(shifted))
            + self.has_boundary.long() * bs
        )
        return torch.where(self.verify[:, None] & (k < total[:, None]), rows, 0)

    def drafting_index(self, span_start, outcome, *, bs: int, shifted: bool) -> torch.Tensor:
        """Indices [B, 3 * bs] into :meth:`drafting_rows` of the slot-aligned drafting logits of
        redraft block ``outcome`` [B] (valid at the slots after s + outcome), of the next
        block's first state (valid where ``has_next``) and of the boundary state's next block
        (valid where ``has_boundary``)."""
        t = torch.arange(bs, device=span_start.device)[None]
        base = span_start + outcome + 1
        block = self.logit_starts.gather(1, outcome[:, None]) + (t - base[:, None]).clamp(min=0)
        # right-shifted: slot 0 reads the carry row, which comes first
        nxt = self.logit_blocks[:, None] + t
        return torch.cat([block, nxt, nxt + bs], 1)


def _lead(phase, pending, bs: int) -> torch.Tensor:
    """Chain rows [B] before block slot 0: a verifying row's pending block (the boundary
    state drafted its block), 0 otherwise (:class:`_Layout`'s ``lead``)."""
    return torch.where(pending & (phase == VERIFY), bs, 0)


def _row_layout(
    phase,
    tokens,
    drafts_in_block,
    span_start,
    span_len,
    block_start,
    *,
    bs,
    shifted,
    mask_id,
    width,
    blk: _Blocks,
    share_prefix=False,
    pending=None,
    prev_tokens=None,
):
    """Per-row suffix tokens [B, W], positions [B, W], dense mask [B, W, W] and the
    :class:`_Layout` of the verifying rows' redraft blocks ``blk`` (see the module doc).

    Drafting rows: the block, bidirectional; a drafting row whose previous block
    is ``pending`` (finished, not yet in the cache) puts that block first (``prev_tokens``,
    bidirectional within itself) and the new one after it, seeing both.  Verifying rows: the
    token-causal chain (block slots before the span + drafts), then (position-aligned models)
    the L + 1 [MASK] copies, then the redraft blocks (with ``blocks`` "spec" the block with
    every draft in place, "redraft" one block per rejection point r = 0 .. L -- drafts
    before r in place, span slots from r on [MASK] -- and, when the span ends the block, the
    next block's all-[MASK] state), each bidirectional within itself and seeing nothing else of
    the suffix but, with ``share_prefix`` (a model whose clean rows attend causally), the
    chain rows before its first row, and the next block its finished block (the chain with
    ``share_prefix``, else the last redraft block); the boundary state (``blk.has_boundary``)
    comes last and forms one bidirectional [MASK] run with redraft block L - 1 (the block's
    last slot), after the chain before that slot.  A verifying row whose previous block is
    ``pending`` (it finished by a rejected last draft, and the boundary state drafted this
    block) puts that block at the head of its token-causal chain (``_Layout.lead``).
    Finished rows and padding: tokens that see only themselves.
    """
    dev = tokens.device
    verify = phase == VERIFY
    block_rows = phase == DRAFT
    if pending is None:
        pending = torch.zeros_like(verify)
    pend = pending & (phase == DRAFT)
    lead = _lead(phase, pending, bs)
    chain_len = torch.where(
        block_rows, torch.where(pend, 2 * bs, bs), torch.where(verify, lead + span_start + span_len, 0)
    )
    n_copies = torch.where(verify & (not shifted), span_len + 1, 0)
    offset = chain_len + n_copies
    used, sizes, first, has_next = blk.used, blk.sizes, blk.first, blk.has_next
    ends = sizes.cumsum(1)  # [B, R]
    total = ends[:, -1]
    i = torch.arange(width, device=dev)[None]  # [1, W]
    cl, off, s, n = chain_len[:, None], offset[:, None], span_start[:, None], span_len[:, None]
    u = i - off
    in_chain = i < cl
    in_copies = (i >= cl) & (i < off)
    in_red = (u >= 0) & (u < total[:, None])
    in_next = has_next[:, None] & (u >= total[:, None]) & (u < total[:, None] + bs)
    in_bound = blk.has_boundary[:, None] & (u >= total[:, None] + bs) & (u < total[:, None] + 2 * bs)
    rb = (u[..., None] >= ends[:, None, :]).sum(-1).clamp(max=bs)  # redraft block of each row
    red_first = first.gather(1, rb)
    red_slot = red_first + u - (ends - sizes).gather(1, rb)
    q, k = i[:, :, None], i[:, None, :]
    pair = (k // bs <= q // bs) | ~pend[:, None, None]  # a pending block, then the new one
    chain_part = in_chain[:, :, None] & in_chain[:, None, :] & ((block_rows[:, None, None] & pair) | (k <= q))
    ld = lead[:, None, None]
    copy_part = in_copies[:, :, None] & ((k < ld + s[:, :, None] + (q - cl[:, :, None])) | (k == q))
    red_q, red_k = in_red[:, :, None], in_red[:, None, :]
    # a redraft block sees itself and (shared prefix) the chain rows before its first row;
    # block L - 1 with the boundary state behind it is one [MASK] run with it
    red_part = red_q & (
        (red_k & (rb[:, :, None] == rb[:, None, :]))
        | (in_chain[:, None, :] & (k < ld + red_first[:, :, None]))
        | ((rb[:, :, None] == n[:, :, None] - 1) & in_bound[:, None, :])
    )
    if share_prefix:
        finished = in_chain[:, None, :]
    else:
        finished = red_k & (rb[:, None, :] == n[:, :, None])
    next_part = in_next[:, :, None] & (in_next[:, None, :] | finished)
    bound_part = in_bound[:, :, None] & (
        in_bound[:, None, :]
        | (in_chain[:, None, :] & (k < ld + bs - 1))
        | (red_k & (rb[:, None, :] == n[:, :, None] - 1))
    )
    valid = in_chain | in_copies | in_red | in_next | in_bound
    dense = chain_part | copy_part | red_part | next_part | bound_part | ((k == q) & ~valid[:, :, None])
    in_prev = (pend | (lead > 0))[:, None] & (i < bs)
    slot = torch.where(
        in_chain, i - lead[:, None], torch.where(in_copies, s + i - cl, torch.where(in_red, red_slot, 0))
    )
    slot = torch.where(pend[:, None] & in_chain, slot - bs, slot)  # prev block: -bs .. -1
    source = torch.where(verify[:, None], drafts_in_block, tokens)
    suffix_tokens = source.gather(1, slot.clamp(0, bs - 1))
    if prev_tokens is not None:
        suffix_tokens = torch.where(in_prev, prev_tokens.gather(1, (slot + bs).clamp(0, bs - 1)), suffix_tokens)
    # a redraft block: the span's slots from its rejection point on are [MASK] again
    red_keep = ~((red_slot >= s + rb) & (red_slot < s + n))
    suffix_tokens = torch.where(in_chain | (in_red & red_keep), suffix_tokens, mask_id)
    slot = torch.where(in_next, bs + u - total[:, None], slot)
    slot = torch.where(in_bound, u - total[:, None], slot)
    positions = block_start[:, None] + slot.clamp(-bs, 2 * bs - 1)
    per_block = blk.logit_rows
    layout = _Layout(
        offset,
        ends - sizes,
        first,
        offset + total,
        has_next,
        per_block.cumsum(1) - per_block,
        per_block.sum(1),
        verify,
        used,
        lead,
        blk.has_boundary,
    )
    return suffix_tokens, positions, dense, layout


def _logit_rows(phase, span_start, span_len, *, bs, shifted, pending=None):
    """Suffix indices [B, bs + 1] whose logits each row needs (see the module doc): a
    verifying row's block-size-1 rows; a drafting row's block rows (with a pending block: its
    new block's rows, then the pending block's last row, the carry; a verifying row with a
    pending block: its rows shift past it, and the pending block's last row verifies slot
    0).  A verification forward appends its redraft blocks' rows
    (:meth:`_Layout.drafting_rows`)."""
    dev = phase.device
    j = torch.arange(bs + 1, device=dev)[None]
    block = j.clamp(max=bs - 1)
    lead = torch.zeros_like(span_start)
    if pending is not None:
        block = torch.where(pending[:, None] & (phase == DRAFT)[:, None], torch.where(j < bs, bs + j, bs - 1), block)
        lead = _lead(phase, pending, bs)
    chain = (lead + span_start + span_len)[:, None]
    if shifted:
        ver = (lead[:, None] + span_start[:, None] - 1 + j).clamp(min=0)
        ver = torch.minimum(ver, (chain - 1).clamp(min=0))
    else:
        ver = torch.minimum(chain + j, chain + span_len[:, None])
    block = torch.where((phase == DONE)[:, None], 0, block)  # a finished row: one padding token
    return torch.where((phase == VERIFY)[:, None], ver, block.expand(len(phase), -1))


def ar_view_logits(model, cache, block_tokens, block_start, span_start, span_len, *, carry=None):
    """Block-size-1 (AR) logits of each row's span from one verification forward.

    Parameters
    ----------
    model : a block-causal masked-diffusion ``Model``.
    cache : its ``KVCache`` holding each row's committed blocks.
    block_tokens : int64 [B, S], the current block (S = block size) with the drafts in
        place; slots before ``span_start`` are the context.
    block_start : int64 [B], absolute position of slot 0 (= ``cache.lengths``).
    span_start, span_len : int64 [B], the span ``[s, s + L)`` (s + L <= S, L >= 1).
    carry : float [B, V], right-shifted models only: the logits of the last committed
        position (they predict slot 0).

    Returns
    -------
    float32 [B, S + 1, V]: row j < L + 1 is ``p(x_{s+j} | block tokens before s + j)`` in
    block-size-1 mode (row L predicts slot s + L, the bonus); rows past L are filler.
    """
    dev = model.device
    batch, bs = block_tokens.shape
    phase = torch.full((batch,), VERIFY, dtype=torch.int64, device=dev)
    blk = _redraft_blocks(
        phase == VERIFY, span_start, span_len, bs=bs, shifted=model.shifted, blocks=NO_BLOCKS, share_prefix=False
    )
    width = int(_verify_width(span_start, span_len, blk, bs=bs, shifted=model.shifted)[0].max())
    tokens, positions, dense, _ = _row_layout(
        phase,
        block_tokens,
        block_tokens,
        span_start,
        span_len,
        block_start.to(dev),
        bs=bs,
        shifted=model.shifted,
        mask_id=model.mask_token_id,
        width=width,
        blk=blk,
    )
    rows = _logit_rows(phase, span_start, span_len, bs=bs, shifted=model.shifted)
    out = model(AttentionPlan(tokens, positions, pack_mask(dense), cache), logits=rows, return_kv=False)
    logits = out.logits.float()
    if model.shifted:
        first = torch.where((span_start == 0)[:, None], carry.float(), logits[:, 0])
        logits = torch.cat([first[:, None], logits[:, 1:]], 1)
    return logits


def accept_span(
    tokens,
    masked,
    drafts,
    target_logits,
    span_start,
    span_len,
    *,
    draft_probs=None,
    temperature=0.0,
    coins=None,
    sample_uniforms=None,
    generator=None,
):
    """Speculative acceptance of each row's span and its commit into the block.

    Parameters
    ----------
    tokens : int64 [B, S], the block (S slots); masked : bool [B, S], its masked slots.
    drafts : int64 [B, L'] (L' <= S), each row's span drafts, left-aligned.
    target_logits : float [B, L' + 1, V], the block-size-1 logits of slots s .. s + L'.
    span_start : int64 [B]; span_len : int64 [B] (0 = the row verifies nothing).
    draft_probs : float [B, L', V], the drafter's q rows (None: one-hot on the drafts).
    temperature, coins [B, L'], sample_uniforms [B], generator : as ``dspec.verify_chain``.

    Returns
    -------
    (tokens, masked, committed [B], accepted [B]): the accepted drafts and then the drawn
    token go to slots s, s + 1, ...: the residual sample at the first rejection, or the
    bonus sample from ``p_L`` when all L drafts pass and slot ``s + L`` is still masked in
    the block (at the block end or before an unmasked slot there is no bonus: that slot is
    not the span's to fill).  committed = accepted + (1 if a token was drawn and used).
    """
    batch, slots_n = tokens.shape
    res = verify_chain(
        drafts,
        target_logits,
        draft_probs=draft_probs,
        num_drafts=span_len,
        temperature=temperature,
        coins=coins,
        sample_uniforms=sample_uniforms,
        generator=generator,
    )
    acc = res.num_accepted
    active = span_len > 0
    after = (span_start + span_len).clamp(max=slots_n - 1)
    bonus_ok = (span_start + span_len < slots_n) & masked.gather(1, after[:, None])[:, 0]
    committed = torch.where(active, acc + ((acc < span_len) | bonus_ok).long(), 0)
    rel = torch.arange(slots_n, device=tokens.device)[None] - span_start[:, None]
    write = (rel >= 0) & (rel < committed[:, None])
    new = res.tokens.gather(1, rel.clamp(0, res.tokens.shape[1] - 1))
    return torch.where(write, new, tokens), masked & ~write, committed, torch.where(active, acc, 0)


# ------------------------------------------------------------------------------- decode


def native_extension(model, block_size: int, temperature: float):
    """dspec._C where its compiled step (csrc/s2d2.h) runs policy "always" -- greedy, a CPU
    model, a block size it takes --, else None (the torch step)."""
    ext = _backend.extension()
    if (
        ext is None
        or not hasattr(ext, "s2d2_plan")
        or model.device.type != "cpu"
        or temperature > 0
        or block_size > ext.s2d2_max_block
        or model.dtype not in _backend.FLOAT_CODE
    ):
        return None
    return ext


class S2D2Run:
    """The batch's S2D2 state machine: per row its phase, block, drafted span and the logits
    carried from the last committed block; one :meth:`step` = one model forward."""

    def __init__(self, model, prompts, opt, *, max_new_tokens, temperature, generator, eos_ids, progress):
        self.model, self.opt = model, opt
        self.bs, self.thr, self.L_max = opt["block_size"], opt["threshold"], opt["draft_len"]
        self.shifted = bool(model.shifted)
        # redraft blocks share the chain's rows before them where clean rows attend causally
        self.share_prefix = bool(getattr(model.config, "clean_causal", False))
        self.blocks = REDRAFT if opt["redraft"] else SPEC_BLOCK
        # the boundary state: the next block drafted for a rejected last draft (module doc)
        self.boundary = opt["boundary"]
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.progress = progress
        dev = self.dev = model.device
        batch = self.batch = len(prompts)
        # one random stream per request (rows stay in the batch: row b is request b)
        self.streams, self.requests = request_streams(generator, batch, dev), list(range(batch))
        bs = self.bs
        self.mask_id, self.vocab = model.mask_token_id, model.config.vocab_size
        self.router = make_router(
            opt["policy"],
            batch,
            dev,
            min_span=opt["min_span"],
            score_threshold=opt["score_threshold"],
            hysteresis=opt["hysteresis"],
            ucb_c=opt["ucb_c"],
            max_score=float(self.L_max),
        )

        # prefill: the prompts' complete blocks, as ``diffusion`` commits them
        self.cache = model.new_cache(batch)
        self.plen_list = [len(p) for p in prompts]
        self.plen_host = np.array(self.plen_list, dtype=np.int64)
        self.plen = torch.tensor(self.plen_list, device=dev)
        self.tails = PromptTails(prompts, self.mask_id, bs, dev)
        self.carry, self.forwards = prefill_prompt_blocks(model, prompts, self.cache, bs)

        self.slots = torch.arange(bs, device=dev)
        self.block_mask_words = pack_mask(torch.ones(bs, bs, dtype=torch.bool)).to(dev)
        self.block_start = self.cache.lengths.to(dev)
        self.tokens, self.masked = self.fresh_block(self.block_start)
        self.phase = torch.full((batch,), DRAFT, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(batch, bs, dtype=torch.int64, device=dev)  # span drafts, left-aligned
        self.draft_probs = None  # [B, bs, V] when sampling
        self.span_start = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.span_len = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.exact_first = torch.zeros(batch, dtype=torch.bool, device=dev)  # see useless_blocks
        self.outputs = OutputBuffer(batch, max_new_tokens, eos_ids)
        # a block finished but not in the cache: it rides in front of the next block's first
        # drafting forward, which appends its KV and carries its last logits
        self.pending = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.prev_tokens = torch.zeros(batch, bs, dtype=torch.int64, device=dev)
        self.hist = torch.zeros(self.L_max + 1, dtype=torch.int64, device=dev)
        self.kinds = {"draft": 0, "verify": 0, "commit": 0}
        # verifications, tokens they committed, accepted drafts, verified drafts, redraft blocks
        # reused / committed, next blocks drafted in a verification forward (after every draft
        # passed / after the last one was rejected: the boundary state)
        self.stats_dev = torch.zeros(8, dtype=torch.int64, device=dev)
        self.shown = 0.0  # progress shown (tokens per request)
        # greedy "always" on the CPU: the step's host-side work in three compiled calls (the
        # torch composition below is their reference, and the path for everything else)
        self.native = native_extension(model, bs, temperature) if opt["policy"] == "always" else None
        self.nat = None

    def fresh_block(self, start):
        tokens, in_prompt = self.tails.block(start)
        return tokens, ~in_prompt

    def advance(self, step: float) -> None:
        """Advance the progress bar by ``step`` tokens per request, never past
        ``max_new_tokens`` (tokens committed beyond it in the last block are not output)."""
        if self.progress is None:
            return
        new = min(self.shown + step, float(self.max_new_tokens))
        if new > self.shown:
            self.progress.update(new - self.shown)
        self.shown = new

    # ------------------------------------------------------------------ one iteration

    def step(self) -> bool:
        """One forward for the whole batch and every row's transition; False when all are done."""
        if self.native is not None:
            return self.native_step()
        if not self.read_phases():
            return False
        out, logits = self.forward()
        bs = self.bs
        if self.any_pending and self.shifted:  # the pending block's last row predicts slot 0
            self.carry = torch.where((self.pending & self.is_draft)[:, None], logits[:, bs], self.carry)
        nxt = self.phase.clone()
        reuse = spec_final = self.chain_final = self.bounded = torch.zeros_like(self.is_verify)
        next_logits = stale = None
        if self.has["verify"]:
            reuse, spec_final, accepted, stale = self.verify(logits, nxt)
            # a verification whose committed run ends the request: its redraft block is not
            # reused, no drafting decision follows
            ended = self.end_early(nxt, spec_final | ~self.is_verify)
            self.stats_dev[4] -= (reuse & ended).sum()
            reuse = reuse & ~ended
            block_logits, next_logits, boundary_logits = self.redraft_logits(logits, accepted, spec_final)
            if self.has["draft"]:
                block_logits = torch.where(reuse[:, None, None], block_logits, self.shift(logits[:, :bs]))
        else:
            block_logits = self.shift(logits[:, :bs])
        self.draft(block_logits, self.is_draft | reuse, nxt, stale=stale)
        self.append_kv(out, spec_final)
        if self.opt["policy"] != "always":  # a fallback's commits (policy "always" has none)
            self.end_early(nxt, spec_final)
        opened = self.finish_blocks(nxt, spec_final)
        if next_logits is not None:
            # a block its drafts completed: the next block's first drafting step rode along;
            # a block its rejected last draft completed: the boundary state's drafts are
            # proposals (they have not seen the drawn token), verified behind the pending block
            ahead = opened & spec_final & self.layout.has_next
            bounded = opened & self.bounded
            if bool((ahead | bounded).any()):
                self.stats_dev[6] += ahead.sum()
                self.stats_dev[7] += bounded.sum()
                self.draft(
                    torch.where(bounded[:, None, None], boundary_logits, next_logits),
                    ahead | bounded,
                    nxt,
                    stale=bounded,
                )
                self.finish_blocks(nxt, torch.zeros_like(spec_final))
        self.phase = nxt
        return True

    # ------------------------------------------------------------------ the compiled step

    def native_state(self):
        """The row records of dspec._C.s2d2_* (csrc/s2d2.h) from the torch state, and the
        step's buffers."""
        ext, bs, batch = self.native, self.bs, self.batch
        f = ext.s2d2_record_layout(bs)
        state = torch.zeros(batch, f["width"], dtype=torch.int64)
        carry = require_finite(token_stats(self.carry).token) if self.shifted else torch.zeros(batch, dtype=torch.int64)
        fields = {
            "phase": self.phase,
            "span_start": self.span_start,
            "span_len": self.span_len,
            "exact_first": self.exact_first,
            "pending": self.pending,
            "block_start": self.block_start,
            "carry": carry,
            "prompt_len": self.plen,
            "tail_start": self.block_start,
        }
        for name, value in fields.items():
            state[:, f[name]] = value.cpu()
        for name, value in (
            ("tokens", self.tokens),
            ("masked", self.masked),
            ("drafts", self.drafts),
            ("prev", self.prev_tokens),
            ("tail", self.tokens),
        ):
            state[:, f[name] : f[name] + bs] = value.cpu()
        width, words, rows = ext.s2d2_buffer_sizes(bs)
        i64 = dict(dtype=torch.int64)
        flags = (
            int(self.shifted) | 2 * int(self.share_prefix) | 4 * int(self.blocks == REDRAFT) | 8 * int(self.boundary)
        )
        return SimpleNamespace(
            state=state,
            layout=f,
            counter_layout=ext.s2d2_counter_layout(),
            args=(state.data_ptr(), batch, bs, self.L_max, self.mask_id, flags),
            tokens=state[:, f["tokens"] : f["tokens"] + bs],
            block_start=state[:, f["block_start"]],
            finishing=state[:, f["finishing"]],
            suffix=torch.empty(batch * width, **i64),
            positions=torch.empty(batch * width, **i64),
            words=torch.empty(batch * words, dtype=torch.int32),
            rows=torch.empty(batch * rows, **i64),
            argmax=torch.empty(batch * rows, **i64),
            keep=torch.empty(batch, 2 * bs, **i64),
            done=torch.zeros(batch, dtype=torch.bool),
            counters=torch.zeros(ext.s2d2_counter_layout()["hist"] + self.L_max + 1, **i64),
        )

    def native_step(self) -> bool:
        """:meth:`step` through dspec._C.s2d2_plan / _advance / _open (greedy, policy "always",
        CPU): the same forwards, transitions and counters."""
        ext, batch = self.native, self.batch
        if self.nat is None:
            self.nat = self.native_state()
        nat = self.nat
        width, nrows, plain, any_draft, any_verify, any_pending = ext.s2d2_plan(
            *nat.args, nat.suffix.data_ptr(), nat.positions.data_ptr(), nat.words.data_ptr(), nat.rows.data_ptr()
        )
        if width == 0:
            return False
        if plain:  # every row forwards its plain block: diffusion's own plan
            plan = AttentionPlan(
                nat.tokens.contiguous(), nat.block_start[:, None] + self.slots, self.block_mask_words, self.cache
            )
            rows = "all"
        else:
            nw = (width + 31) // 32
            plan = AttentionPlan(
                nat.suffix[: batch * width].view(batch, width),
                nat.positions[: batch * width].view(batch, width),
                nat.words[: batch * width * nw].view(batch, width, nw),
                self.cache,
            )
            rows = nat.rows[: batch * nrows].view(batch, nrows)
        out = self.model(plan, logits=rows, return_kv=any_pending or any_verify)
        self.forwards += 1
        for kind, present in (("draft", any_draft), ("verify", any_verify), ("commit", any_pending)):
            self.kinds[kind] += present
        logits = out.logits
        if logits.stride(-1) != 1 or logits.stride(0) != nrows * logits.stride(1):
            logits = logits.contiguous()
        committed, append, finishing, two_blocks = ext.s2d2_advance(
            *nat.args,
            nrows,
            any_verify,
            any_pending,
            logits.data_ptr(),
            _backend.FLOAT_CODE[logits.dtype],
            logits.stride(1),
            logits.shape[-1],
            nat.argmax.data_ptr(),
            nat.keep.data_ptr(),
            nat.counters.data_ptr(),
        )
        require_finite(nat.argmax[: batch * nrows])  # every logit row's argmax: -1 marks a non-finite row
        if self.progress is not None:
            self.advance(committed / batch)
        if append:
            self.cache.append(out.suffix_kv, keep=nat.keep if two_blocks else nat.keep[:, : self.bs])
        finishing = self.native_end_early() or finishing
        while finishing:
            nat.done.zero_()
            nat.done[self.emit(nat.finishing.numpy().astype(bool), nat.tokens, nat.block_start)] = True
            finishing = ext.s2d2_open(
                *nat.args,
                nrows,
                any_verify,
                any_pending,
                nat.done.data_ptr(),
                nat.argmax.data_ptr(),
                nat.counters.data_ptr(),
            )
        return True

    def native_end_early(self) -> bool:
        """:meth:`end_early` on the compiled step's records: such a row's block is complete
        (s2d2_open then outputs it and ends the request); True when a row ends so."""
        nat, bs = self.nat, self.bs
        f = nat.layout
        st = nat.state.numpy()
        live = (st[:, f["phase"]] != DONE) & (st[:, f["finishing"]] == 0)
        if not live.any():
            return False
        ended = (
            self.outputs.block_ends(
                np.arange(self.batch),
                st[:, f["tokens"] : f["tokens"] + bs],
                st[:, f["masked"] : f["masked"] + bs] == 0,
                st[:, f["block_start"]],
                self.plen_host,
            )
            & live
        )
        if not ended.any():
            return False
        # a row the verification ended drafting from its reused redraft block: neither the
        # reuse nor the drafting decision happen (the torch step makes neither)
        decided = int((st[ended, f["phase"]] == VERIFY).sum())
        c = nat.counter_layout
        for name in ("decisions", "verify_decisions", "reused"):
            nat.counters[c[name]] -= decided
        for name, value in (("phase", COMMIT), ("complete", 1), ("finishing", 1), ("spec_final", 0), ("bounded", 0)):
            st[ended, f[name]] = value
        return True

    def shift(self, block_logits):
        """A right-shifted model's slot logits: slot 0 from the carry, slot i from row i - 1."""
        if not self.shifted:
            return block_logits
        return torch.cat([self.carry[:, None], block_logits[:, :-1]], 1)

    def useless_blocks(self) -> torch.Tensor:
        """Redraft blocks [B, bs + 1] a verifying row need not forward: r = L - 1 when no slot
        after the span is masked (that outcome fills the block), and r = 0 when the span's
        first draft is exact -- drafted from a clean row of a model whose clean rows attend
        causally (right-shifted), i.e. from the very logits the verification recomputes, so
        it is rejected only by rounding; that rare outcome then takes a drafting forward."""
        r = torch.arange(self.bs + 1, device=self.dev)[None]
        n = self.span_len[:, None]
        after = (self.slots[None] >= (self.span_start + self.span_len)[:, None]) & self.masked
        # ... unless the boundary state rides behind it (the span ends the block)
        fills = ~after.any(1, keepdim=True)
        if self.boundary:
            fills &= (self.span_start + self.span_len < self.bs)[:, None]
        useless = (r == n - 1) & fills
        if self.shifted and self.share_prefix:
            useless |= (r == 0) & self.exact_first[:, None]
        return useless

    def read_phases(self) -> bool:
        """The one host read per iteration: row states and the suffix width they need."""
        self.redraft_plan = _redraft_blocks(
            self.phase == VERIFY,
            self.span_start,
            self.span_len,
            bs=self.bs,
            shifted=self.shifted,
            blocks=self.blocks,
            share_prefix=self.share_prefix,
            skip=self.useless_blocks(),
            boundary=self.boundary,
        )
        verify_width, logit_rows = _verify_width(
            self.span_start, self.span_len, self.redraft_plan, bs=self.bs, shifted=self.shifted, pending=self.pending
        )
        width_row = torch.where(
            self.phase == VERIFY,
            verify_width,
            torch.where(self.phase == DONE, 1, torch.where(self.pending, 2 * self.bs, self.bs)),
        )
        host = torch.stack(
            [self.phase, width_row, self.pending.long(), torch.where(self.phase == VERIFY, logit_rows, 0)]
        ).tolist()
        self.phases, self.width, self.any_pending = host[0], max(host[1]), any(host[2])
        self.any_lead = any(p == VERIFY and pend for p, pend in zip(host[0], host[2]))
        self.drafting_rows = max(host[3])
        if all(p == DONE for p in self.phases):
            return False
        self.has = {"draft": DRAFT in self.phases, "verify": VERIFY in self.phases, "commit": self.any_pending}
        self.is_draft, self.is_verify = self.phase == DRAFT, self.phase == VERIFY
        return True

    def forward(self):
        """Every row's suffix in one forward: plain blocks, or per-row layouts when one verifies."""
        bs, slots = self.bs, self.slots
        verifying = self.has["verify"]
        if all(p == DRAFT for p in self.phases) and not self.any_pending:
            # every row forwards its plain block: diffusion's own plan (shared mask, all logits)
            plan = AttentionPlan(self.tokens, self.block_start[:, None] + slots, self.block_mask_words, self.cache)
            rows = "all"
        else:
            in_block = self.tokens
            if verifying:
                rel = slots[None] - self.span_start[:, None]
                in_span = (rel >= 0) & (rel < self.span_len[:, None])
                in_block = torch.where(in_span, self.drafts.gather(1, rel.clamp(0, bs - 1)), self.tokens)
            suffix, positions, dense, self.layout = _row_layout(
                self.phase,
                self.tokens,
                in_block,
                self.span_start,
                self.span_len,
                self.block_start,
                bs=bs,
                shifted=self.shifted,
                mask_id=self.mask_id,
                width=self.width,
                blk=self.redraft_plan,
                share_prefix=self.share_prefix,
                pending=self.pending,
                prev_tokens=self.prev_tokens,
            )
            rows = _logit_rows(
                self.phase, self.span_start, self.span_len, bs=bs, shifted=self.shifted, pending=self.pending
            )
            if verifying:  # the redraft blocks' drafting rows: one LM head call for all
                rows = torch.cat(
                    [
                        rows,
                        self.layout.drafting_rows(
                            self.span_start, self.span_len, self.drafting_rows, bs=bs, shifted=self.shifted
                        ),
                    ],
                    1,
                )
            plan = AttentionPlan(suffix, positions, pack_mask(dense), self.cache)
        out = self.model(plan, logits=rows, return_kv=self.has["commit"] or verifying)
        self.forwards += 1
        for k in self.kinds:
            self.kinds[k] += self.has[k]
        return out, out.logits.float()  # [B, bs (+ 1), V]

    def verify(self, logits, nxt):
        """Accept each verifying row's span against its block-size-1 logits; returns the rows
        whose redraft block is the next drafting step (reuse), whose block is finished and
        committed from this forward (spec_final), the accepted drafts [B] and the reused rows
        whose block has not seen their drawn token (stale)."""
        bs, is_verify = self.bs, self.is_verify
        target = logits[:, : bs + 1]
        if self.shifted:
            # slot 0: the carry, or the last row of a pending block at the chain's head
            lead = self.pending & is_verify
            self.carry = torch.where(lead[:, None], target[:, 0], self.carry)
            first = torch.where(((self.span_start == 0) & ~lead)[:, None], self.carry, target[:, 0])
            target = torch.cat([first[:, None], target[:, 1:]], 1)
        num = torch.where(is_verify, self.span_len, 0)
        rand = (
            {}
            if self.streams is None
            else self.streams.chain(self.requests, self.drafts.shape[1], advance=is_verify.cpu())
        )
        self.tokens, self.masked, committed, acc = accept_span(
            self.tokens,
            self.masked,
            self.drafts,
            target,
            self.span_start,
            num,
            draft_probs=self.draft_probs if self.temperature > 0 else None,
            temperature=self.temperature,
            **rand,
        )
        require_finite(self.tokens)  # a drawn token of a non-finite row is the -1 mark
        # the redraft block of the outcome holds the block as it now stands but for the drawn
        # token (still [MASK] there), so its logits are the next drafting step; with every
        # draft passed, no bonus and nothing left masked it is the finished block
        all_in = is_verify & (acc == self.span_len)
        left = self.masked.any(1)
        reuse = is_verify & left & self.layout.used.gather(1, acc[:, None])[:, 0]
        spec_final = all_in & ~left & (committed == acc)
        self.bounded = is_verify & self.layout.has_boundary & (acc == self.span_len - 1) & ~left
        if self.share_prefix:
            # a chain covering the whole block is that block's causal forward, key for key
            # where the commit forward would put it: its rows are the block's (the redraft
            # blocks' own rows round at other key indices in bf16)
            self.chain_final = spec_final & (self.span_start + self.span_len == bs)
        saved = reuse | spec_final if self.blocks == SPEC_BLOCK else reuse | (spec_final & self.layout.has_next)
        self.router.observe(is_verify, True, committed, torch.where(saved, 1, 2))
        L_max = self.L_max
        self.hist += torch.bincount(torch.where(is_verify, acc, L_max + 1), minlength=L_max + 2)[: L_max + 1]
        self.stats_dev[:6] += torch.stack(
            [
                is_verify.sum(),
                committed.sum(),
                torch.where(is_verify, acc, 0).sum(),
                num.sum(),
                reuse.sum(),
                spec_final.sum(),
            ]
        )
        if self.progress is not None:
            self.advance(float(committed.sum()) / self.batch)
        nxt.copy_(torch.where(is_verify, torch.where(left, DRAFT, COMMIT), nxt))
        # a drawn token the reused block has not seen: its logits are drafts, not a state
        return reuse, spec_final, acc, reuse & (committed > acc)

    def redraft_logits(self, logits, accepted, spec_final):
        """The drafting logits of each verifying row's redraft block for its outcome (slot-
        aligned [B, bs, V], valid at the slots it leaves masked), of the next block's first
        state and of the boundary state's next block (None, None without redraft blocks);
        carries the finished blocks' last logits."""
        bs = self.bs
        base = bs + 1  # the block-size-1 rows come first
        r = torch.where(self.is_verify, accepted, 0)
        idx = self.layout.drafting_index(self.span_start, r, bs=bs, shifted=self.shifted) + base
        picked = logits.gather(1, idx.clamp(max=logits.shape[1] - 1)[..., None].expand(-1, -1, logits.shape[-1]))
        if self.shifted:
            # a chain covering the block is its causal forward: its last row (the verification
            # row L) carries exactly what a commit forward would (redraft rows round otherwise)
            last = logits.gather(1, (base + self.layout.logit_blocks)[:, None, None].expand(-1, 1, logits.shape[-1]))
            last = torch.where(self.chain_final[:, None], logits[:, bs], last[:, 0])
            self.carry = torch.where(spec_final[:, None], last, self.carry)
        if self.blocks != REDRAFT:
            return picked[:, :bs], None, None
        return picked[:, :bs], picked[:, bs : 2 * bs], picked[:, 2 * bs :]

    def draft(self, block_logits, drafting, nxt, stale=None):
        """Rows ``drafting`` [B] (drafting rows, verified rows whose redraft block is reused,
        rows whose next block rode along): draft every masked slot from ``block_logits``
        [B, bs, V] (slot-aligned), route, and either keep the span for verification or fall
        back to the confidence-threshold step.  ``stale`` rows' logits miss a drawn token:
        they draft, but a fallback would commit diffusion choices of a state that is not the
        block's, so those rows take a drafting forward instead."""
        bs, slots, temperature, opt = self.bs, self.slots, self.temperature, self.opt
        masked = self.masked
        active = drafting & masked.any(1)
        # a draw per slot for the rows that draft (the others keep their streams' counters)
        u = None if self.streams is None else self.streams.uniforms(self.requests, bs, advance=active.cpu())
        choice, conf = choose(block_logits, temperature, uniforms=u)
        if opt["policy"] == "always":  # never falls back: nothing to rank
            pick = torch.zeros_like(masked)
        else:  # diffusion's threshold rule (ties to the lower slot)
            conf_m, _, rank = rank_masked(conf, masked)
            pick = pick_slots(masked, conf_m, rank, threshold=self.thr) & drafting[:, None]
        # the first contiguous masked span, capped at draft_len
        first = torch.where(masked.any(1), masked.long().argmax(1), 0)
        run = masked.gather(1, (first[:, None] + slots[None]).clamp(max=bs - 1)) & (first[:, None] + slots[None] < bs)
        length = run.long().cumprod(1).sum(1).clamp(max=self.L_max)
        if opt["policy"] in ("always", "never", "min_span"):
            score = length.float()  # not used by these policies: no scoring pass
        else:
            tstats = token_stats(block_logits, temperature=temperature if temperature > 0 else 1.0)
            score = span_score(tstats, conf, first, length, opt["estimator"])
        verify = self.router.decide(RoutingFeatures(active, length, score, pick.sum(1)))
        falls = active & ~verify if stale is None else active & ~verify & ~stale
        fall = pick & falls[:, None]
        self.tokens = torch.where(fall, choice, self.tokens)
        self.masked = masked = masked & ~fall
        self.router.observe(falls, False, pick.sum(1), 1)
        if self.progress is not None:
            self.advance(float(fall.sum()) / self.batch)
        # verifying rows keep their span drafts (and q rows when sampling), left-aligned
        src = (first[:, None] + slots[None]).clamp(max=bs - 1)
        self.drafts = torch.where(verify[:, None], choice.gather(1, src), self.drafts)
        if temperature > 0 and opt["policy"] != "never":
            q = torch.softmax(block_logits / temperature, dim=-1)
            q = q.gather(1, src[..., None].expand(-1, -1, self.vocab))
            self.draft_probs = (
                q if self.draft_probs is None else torch.where(verify[:, None, None], q, self.draft_probs)
            )
        self.span_start = torch.where(verify, first, self.span_start)
        self.span_len = torch.where(verify, length, self.span_len)
        self.exact_first = torch.where(verify, True if stale is None else ~stale, self.exact_first)
        nxt.copy_(torch.where(drafting, torch.where(verify, VERIFY, torch.where(masked.any(1), DRAFT, COMMIT)), nxt))

    def append_kv(self, out, spec_final):
        """Append the KV of the blocks committed by this forward: a pending block (the rows in
        front of its successor) or a verified row's finished block (its chain, or its last
        redraft block)."""
        bs, slots = self.bs, self.slots
        appended = self.pending | spec_final
        if self.any_pending or self.has["verify"]:
            keep = torch.where(self.pending[:, None], slots[None], -1)  # the pending block, in front
            if self.has["verify"]:
                final_rows = torch.where(
                    self.chain_final[:, None],
                    self.layout.lead[:, None] + slots[None],
                    self.layout.block_rows(torch.where(self.is_verify, self.span_len, 0), bs),
                )
                final_rows = torch.where(spec_final[:, None], final_rows, -1)
                keep = torch.where(self.pending[:, None], keep, final_rows)
                if self.any_lead:  # a verifying row with a pending block may finish its block too
                    keep = torch.cat([keep, torch.where(self.pending[:, None], final_rows, -1)], 1)
            if bool(appended.any()):
                self.cache.append(out.suffix_kv, keep=keep.cpu())
        self.pending = torch.zeros_like(self.pending)

    def end_early(self, nxt, skip) -> torch.Tensor:
        """Rows (but ``skip`` [B]) whose block's committed run already ends the request (an
        EOS, or ``max_new_tokens`` reached: :meth:`OutputBuffer.block_ends`) finish the block
        now (``nxt`` COMMIT): the slots after the run are never output, so no forward decodes
        them.  Returns those rows [B]."""
        live = (nxt != DONE) & (nxt != COMMIT) & ~skip
        host = torch.cat([self.tokens, self.masked.long(), self.block_start[:, None], live.long()[:, None]], 1).cpu()
        bs, rows = self.bs, np.arange(self.batch)
        h = host.numpy()
        ended = self.outputs.block_ends(rows, h[:, :bs], h[:, bs : 2 * bs] == 0, h[:, 2 * bs], self.plen_host)
        ended = torch.from_numpy(ended & (h[:, 2 * bs + 1] == 1)).to(self.dev)
        nxt.copy_(torch.where(ended, COMMIT, nxt))
        return ended

    def finish_blocks(self, nxt, spec_final):
        """Output the blocks finished in this iteration and open their successors (a block
        finished by fallback or by a rejection / bonus token is pending: its KV rides in
        front of the next block's first drafting forward; the last one is never forwarded
        again).  Returns the rows whose next block was opened [B]."""
        bs = self.bs
        complete = (nxt == COMMIT) & ~spec_final  # finished, KV not appended above
        finishing = complete | spec_final
        fin_host = finishing.cpu().numpy()
        if not fin_host.any():
            return finishing
        done = torch.zeros(self.batch, dtype=torch.bool)
        done[self.emit(fin_host)] = True
        done = done.to(self.dev)
        self.prev_tokens = torch.where(complete[:, None], self.tokens, self.prev_tokens)
        self.pending = self.pending | (complete & ~done)
        self.block_start = torch.where(finishing, self.block_start + bs, self.block_start)
        new_tokens, new_masked = self.fresh_block(self.block_start)
        self.tokens = torch.where(finishing[:, None], new_tokens, self.tokens)
        self.masked = torch.where(finishing[:, None], new_masked, self.masked)
        nxt.copy_(torch.where(finishing, torch.where(done, DONE, DRAFT), nxt))
        return finishing & ~done

    def emit(self, fin_host: np.ndarray, tokens=None, block_start=None) -> torch.Tensor:
        """Output the finished blocks (rows ``fin_host``, bool [B]) generated tokens (the
        blocks ``tokens`` [B, bs] at ``block_start`` [B], default the torch state's); returns
        the rows now done."""
        tokens = self.tokens if tokens is None else tokens
        block_start = self.block_start if block_start is None else block_start
        rows = np.flatnonzero(fin_host)
        done = self.outputs.extend_block(
            rows, tokens.cpu().numpy()[rows], block_start.cpu().numpy()[rows], self.plen_host[rows]
        )
        return torch.from_numpy(rows[done])

    @property
    def generated(self) -> list[list[int]]:
        return self.outputs.generated

    def stats(self) -> dict:
        if self.nat is not None:  # the compiled step's counters (csrc/s2d2.h S2D2Counters)
            c, k = self.nat.counters, self.native.s2d2_counter_layout()
            # stats_dev's eight counters, in its order: verifications .. boundary
            self.stats_dev = c[k["verifications"] : k["boundary"] + 1].clone()
            self.hist = c[k["hist"] :].clone()
            self.router._decisions = c[k["decisions"]].clone()
            self.router._verifies = c[k["verify_decisions"]].clone()
        n_verify, n_committed_by_verify, n_accepted, n_drafted, reused, from_spec, ahead, bounded = (
            self.stats_dev.tolist()
        )
        decisions = self.router.stats()["decisions"]
        total = sum(len(g) for g in self.generated)
        opt = self.opt
        return {
            "nfe": {"target": self.forwards},
            "mean_accepted": n_committed_by_verify / n_verify if n_verify else 0.0,
            "verifications": n_verify,
            "verify_rate": n_verify / decisions if decisions else 0.0,
            "acceptance_rate": n_accepted / n_drafted if n_drafted else 0.0,
            "accepted_hist": self.hist.tolist(),
            "tokens_per_forward": total / self.batch / max(self.forwards, 1),
            "forwards_with": self.kinds,
            "spec_block_drafts": reused,
            "spec_block_commits": from_spec,
            "next_block_drafts": ahead,
            "boundary_drafts": bounded,
            "router": self.router.stats(),
            "block_size": self.bs,
            "threshold": self.thr,
            "draft_len": self.L_max,
            "policy": opt["policy"],
            "estimator": opt["estimator"],
            "redraft": opt["redraft"],
            "boundary": opt["boundary"],
        }


@torch.no_grad()
def decode_s2d2(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_ids=(),
    progress=None,
    block_size: int | None = None,
    threshold: float | None = None,
    policy: str | None = None,
    min_span: int | None = None,
    score_threshold: float | None = None,
    hysteresis=None,
    ucb_c: float | None = None,
    estimator: str | None = None,
    draft_len: int | None = None,
    redraft: bool | str = "auto",
    boundary: bool | None = None,
):
    """S2D2 decoding of a ragged batch; returns (tokens per request, stats).

    Parameters
    ----------
    block_size : int, default the model's.
    threshold : float in (0, 1], default 0.9: the confidence-threshold fallback (as
        ``diffusion``'s dynamic schedule).
    policy : one of ``dspec.decode.routing.POLICIES``; default ``"always"`` with redraft
        blocks (every forward then verifies: a verification no longer costs a forward of its
        own) and wherever the compiled step runs it (greedy on the CPU: :func:`native_extension`,
        ~4 ms of host work a step less, measured faster than ``min_span`` at every batch),
        else ``"min_span"`` (robust without calibration: the score policies need
        thresholds matched to the model's confidence).  ``ucb`` learns a verification's cost
        from the forwards it really takes; ``score_dynamic``'s rule assumes two.
    min_span : int >= 1 (policy ``min_span``, default 2).
    score_threshold : float (policies ``score``: the least estimated accepted length;
        ``score_dynamic``: the factor by which verifying's expected tokens per forward must
        beat the fallback's; default 1.0).
    hysteresis : (on, off) with on >= off, or the string "on,off" (policy ``hysteresis``,
        default (1.5, 0.75)).
    ucb_c : float >= 0, the UCB exploration constant (policy ``ucb``, default 1.0).
    estimator : "product" | "margin" | "entropy", the accepted-length estimate the
        score-based policies route on (default "product").
    draft_len : int >= 1, the most drafts one verification checks (default and cap: the
        block size).

    Bounds (:mod:`dspec.decode.bounds`): a verification forward carries up to
    :func:`verify_rows` rows -- with redraft blocks about ``(draft_len + 4) * block_size``
    --, so the longest prompt plus them must fit ``max_position_embeddings``
    (e.g. ``tiny-bd``'s 4096 positions: block sizes up to about 60 with redraft blocks).
    redraft : bool or "auto" (default): True -- a verification forward also forwards the
        block as it would stand at each rejection point (and, when the span ends the block,
        the next block's first state), so whatever the verification decides the next
        drafts are computed and no drafting forward follows it (the module doc); False --
        only the block with every draft in place (S2D2's speculative block), reused when
        every draft passes.  "auto": True but for a CPU model decoding more than
        ``cpu_cost.CPU_REDRAFT_MAX_BATCH`` (2) requests, where the rows are compute.  At
        T > 0 the drafting logits differ between the two, so a seeded batch equals its seeded
        single calls with ``redraft`` given (True or False), not "auto", and a ``policy`` other
        than "ucb" (whose bandit learns from every row of the batch).
    boundary : bool or None (default: True wherever it applies -- redraft blocks on a
        right-shifted model whose clean rows attend causally, such as ``smollm2-135m-bd`` --
        but on a CPU, where its rows cost more than the forwards it saves:
        ``cpu_cost.resolve_boundary``):
        when the span ends the block, the verification forward also forwards the block's
        last slot [MASK] again with the next block's all-[MASK] state behind it (the
        *boundary state*, bs + 1 rows).  A rejected last draft then finishes the block
        without a drafting forward: the boundary state's drafts (proposals that have not
        seen the drawn token) are verified in the next forward behind the finished block,
        which rides at the head of the chain and supplies slot 0's block-size-1 logits.

    Stats
    -----
    nfe {"target": forwards} (prefill, block commits, drafting and verification forwards;
    one forward serves the whole batch); mean_accepted = tokens committed per verification
    of one sequence (accepted drafts + the resampled / bonus token), 0.0 when nothing was
    verified; verify_rate = verifications / routing decisions; acceptance_rate = accepted
    drafts / verified drafts; accepted_hist[n] = verifications that accepted n drafts;
    tokens_per_forward; forwards_with (forwards with at least one sequence drafting /
    verifying / committing a pending block -- the latter are drafting forwards too);
    spec_block_drafts / spec_block_commits / next_block_drafts (verifications whose
    redraft block served as the next drafting step / as the committed block / whose next
    block's first state was drafted along, each a forward saved); boundary_drafts
    (verifications whose rejected last draft finished the block and whose boundary state
    drafted the next one, each a forward saved); router (per-policy counters).
    """
    opt = resolve_options(
        model,
        block_size,
        threshold,
        policy,
        min_span,
        score_threshold,
        hysteresis,
        ucb_c,
        estimator,
        draft_len,
        redraft,
        batch=len(prompts),
        temperature=temperature,
        boundary=boundary,
        prompt_len=max(len(p) for p in prompts),
    )
    run = S2D2Run(
        model,
        prompts,
        opt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        eos_ids=eos_ids,
        progress=progress,
    )
    while run.step():
        pass
    return run.generated, run.stats()


decode = decode_s2d2
