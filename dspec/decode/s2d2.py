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

    The same forward also runs a *speculative block*: the current block with the drafts in
    place, bidirectional within itself, after the committed prefix (SSD's trick of merging
    the next state into the current forward).  When every draft passes, it is exactly the
    block as it now stands (with the bonus slot still [MASK]), so its logits serve as the
    next drafting step and that forward is saved; when the drafts also complete the block,
    it *is* the finished block and its KV is committed directly, saving the commit forward.
    On a rejection it is discarded.  (With a bonus token, the reused drafting step has not
    seen the bonus: verification stays exact since any fixed q is a valid proposal, but a
    fallback step right after commits diffusion choices made one token earlier.)

``commit``
    a block completed otherwise (by the fallback, or by a rejected / bonus token) is
    *pending*: it rides in front of the next block's first drafting forward (bidirectional
    within itself, the new block seeing it, as ``diffusion`` commits it), which appends its
    KV (exact: the rows of a separate commit forward, at the same key indices) and takes its
    last logits as the right-shifted model's prediction for the new block's slot 0.  The
    last block is never forwarded again.

Rows in different states share a forward: the suffix is as wide as the widest row (a
block, two with a pending block; ``u + 2L + 1 + block_size`` for a position-aligned
verification, ``u + L + block_size`` for a right-shifted one), narrower rows are padded
with tokens that see only themselves, and the LM head runs on ``block_size + 1`` gathered rows per sequence
(``2 block_size + 1`` when a row verifies).  So a batch costs one forward per
iteration whatever its rows do, and a sequence's tokens are those of its single run.

Losslessness: for the verified slots, the committed tokens are exact samples of the
block-size-1 distribution given everything before them (drafts are sampled from the very
``q`` given to the verifier).  With policy ``always`` and greedy decoding every token is
the AR argmax, so the output is that of block-size-1 greedy decoding of the model over the
block-mode KV of the finished blocks (:func:`block_size_one_greedy` in the tests),
whatever ``draft_len`` or ``threshold``.  With policy ``never`` it is exactly the
``diffusion`` method with the same ``threshold``, greedy or sampled (same forwards, same
random draws).

Host synchronisation: one small read per iteration (each row's state and suffix width, to
size the suffix), one flag vector after the forward (which rows finished their block, for
the output and the next block), and the token lists of a finished block; the drafting, routing, verification
and commit arithmetic is vectorised over the batch on the device.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ..models import AttentionPlan
from ..ops import pack_mask, token_stats, verify_chain
from .diffusion import PromptTails, prefill_prompt_blocks
from .outputs import OutputBuffer
from .unmask import choose, pick_slots, rank_masked
from ._selfspec import check_common
from .routing import ESTIMATORS, POLICIES, RoutingFeatures, make_router, span_score

OPTIONS = ("block_size", "threshold", "policy", "min_span", "score_threshold", "hysteresis",
           "ucb_c", "estimator", "draft_len")
DRAFTER = False

# COMMIT marks a row whose block is complete, between its transition and ``commit``: a
# row never forwards in it (the block rides in front of the next one's drafting forward)
DRAFT, VERIFY, COMMIT, DONE = 0, 1, 2, 3

DEFAULTS = {"threshold": 0.9, "policy": "min_span", "min_span": 2, "score_threshold": 1.0,
            "hysteresis": (1.5, 0.75), "ucb_c": 1.0, "estimator": "product"}
# which option tunes which policy (giving one to another policy is a mistake worth a ValueError)
_POLICY_OPTION = {"min_span": "min_span", "score_threshold": ("score", "score_dynamic"),
                  "hysteresis": "hysteresis", "ucb_c": "ucb"}


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


def _check_options(model, block_size, threshold, policy, min_span, score_threshold, hysteresis,
                   ucb_c, estimator, draft_len) -> dict:
    bs = check_common(model, "s2d2", block_size)
    if policy is None:
        policy = DEFAULTS["policy"]
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    given = {"min_span": min_span, "score_threshold": score_threshold, "hysteresis": hysteresis,
             "ucb_c": ucb_c}
    for opt, value in given.items():
        owners = _POLICY_OPTION[opt]
        owners = owners if isinstance(owners, tuple) else (owners,)
        if value is not None and policy not in owners:
            raise ValueError(f"{opt} tunes policy {' / '.join(map(repr, owners))}, not {policy!r}")
    threshold = _real("threshold", DEFAULTS["threshold"] if threshold is None else threshold, 0.0, 1.0,
                      lo_open=True)
    if draft_len is None:
        draft_len = bs
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"draft_len must be an int >= 1, got {draft_len!r}")
    draft_len = min(draft_len, bs)
    min_span = DEFAULTS["min_span"] if min_span is None else min_span
    if isinstance(min_span, bool) or not isinstance(min_span, int) or min_span < 1:
        raise ValueError(f"min_span must be an int >= 1, got {min_span!r}")
    score_threshold = _real("score_threshold", DEFAULTS["score_threshold"] if score_threshold is None
                            else score_threshold)
    hysteresis = DEFAULTS["hysteresis"] if hysteresis is None else hysteresis
    if isinstance(hysteresis, str):              # the CLI's --option hysteresis=1.5,0.75
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
    return dict(block_size=bs, threshold=threshold, policy=policy, min_span=min_span,
                score_threshold=score_threshold, hysteresis=(on, off), ucb_c=ucb_c,
                estimator=estimator, draft_len=draft_len)


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


def _verify_width(span_start, span_len, *, bs, shifted, speculative):
    """Suffix tokens of a verifying row: chain (+ L + 1 copies) (+ the speculative block)."""
    return span_start + (span_len if shifted else 2 * span_len + 1) + (bs if speculative else 0)


def _row_layout(phase, tokens, drafts_in_block, span_start, span_len, block_start, *, bs, shifted,
                mask_id, width, speculative, pending=None, prev_tokens=None):
    """Per-row suffix tokens [B, W], positions [B, W], dense mask [B, W, W] and the offset
    [B] of each verifying row's speculative block (see the module doc).

    Drafting rows: the block, bidirectional; a drafting row whose previous block
    is ``pending`` (finished, not yet in the cache) puts that block first (``prev_tokens``,
    bidirectional within itself) and the new one after it, seeing both.  Verifying rows: the token-causal
    chain (block slots before the span + drafts), then (position-aligned models) the L + 1
    [MASK] copies, then with ``speculative`` the block with the drafts in place,
    bidirectional within itself and seeing nothing else of the suffix.  Finished rows and
    padding: tokens that see only themselves.
    """
    dev = tokens.device
    verify = phase == VERIFY
    block_rows = phase == DRAFT
    if pending is None:
        pending = torch.zeros_like(verify)
    pend = pending & (phase == DRAFT)
    chain_len = torch.where(block_rows, torch.where(pend, 2 * bs, bs), torch.where(verify, span_start + span_len, 0))
    n_copies = torch.where(verify & (not shifted), span_len + 1, 0)
    spec_off = chain_len + n_copies
    n_spec = torch.where(verify, bs, 0) if speculative else torch.zeros_like(chain_len)
    i = torch.arange(width, device=dev)[None]                           # [1, W]
    cl, so, s = chain_len[:, None], spec_off[:, None], span_start[:, None]
    in_chain = i < cl
    in_copies = (i >= cl) & (i < so)
    in_spec = (i >= so) & (i < so + n_spec[:, None])
    q_chain, k_chain = in_chain[:, :, None], in_chain[:, None, :]
    q_spec, k_spec = in_spec[:, :, None], in_spec[:, None, :]
    q, k = i[:, :, None], i[:, None, :]
    pair = (k // bs <= q // bs) | ~pend[:, None, None]           # a pending block, then the new one
    chain_part = q_chain & k_chain & ((block_rows[:, None, None] & pair) | (k <= q))
    copy_part = in_copies[:, :, None] & ((k < s[:, :, None] + (q - cl[:, :, None])) | (k == q))
    valid = in_chain | in_copies | in_spec
    dense = chain_part | copy_part | (q_spec & k_spec) | ((k == q) & ~valid[:, :, None])
    in_prev = pend[:, None] & (i < bs)
    slot = torch.where(in_chain, i, torch.where(in_copies, s + i - cl, torch.where(in_spec, i - so, 0)))
    slot = torch.where(pend[:, None] & in_chain, slot - bs, slot)            # prev block: -bs .. -1
    source = torch.where(verify[:, None], drafts_in_block, tokens)
    suffix_tokens = source.gather(1, slot.clamp(0, bs - 1))
    if prev_tokens is not None:
        suffix_tokens = torch.where(in_prev, prev_tokens.gather(1, (slot + bs).clamp(0, bs - 1)), suffix_tokens)
    suffix_tokens = torch.where(in_chain | in_spec, suffix_tokens, mask_id)
    return suffix_tokens, block_start[:, None] + slot.clamp(-bs, bs), dense, spec_off


def _logit_rows(phase, span_start, span_len, spec_off, *, bs, shifted, speculative, pending=None):
    """Suffix indices [B, bs + 1] (+ [B, bs] of the speculative block) whose logits each row
    needs (see the module doc); a drafting row with a pending block: its new block's rows,
    then the pending block's last row (the carry)."""
    dev = phase.device
    j = torch.arange(bs + 1, device=dev)[None]
    block = j.clamp(max=bs - 1)
    if pending is not None:
        block = torch.where(pending[:, None] & (phase == DRAFT)[:, None], torch.where(j < bs, bs + j, bs - 1), block)
    chain = (span_start + span_len)[:, None]
    if shifted:
        ver = (span_start[:, None] - 1 + j).clamp(min=0)
        ver = torch.minimum(ver, (chain - 1).clamp(min=0))
    else:
        ver = torch.minimum(chain + j, chain + span_len[:, None])
    block = torch.where((phase == DONE)[:, None], 0, block)          # a finished row: one padding token
    rows = torch.where((phase == VERIFY)[:, None], ver, block.expand(len(phase), -1))
    if not speculative:
        return rows
    spec = torch.where((phase == VERIFY)[:, None], spec_off[:, None] + j[:, :bs], 0)
    return torch.cat([rows, spec], 1)


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
    width = int(_verify_width(span_start, span_len, bs=bs, shifted=model.shifted, speculative=False).max())
    tokens, positions, dense, spec_off = _row_layout(
        phase, block_tokens, block_tokens, span_start, span_len, block_start.to(dev), bs=bs,
        shifted=model.shifted, mask_id=model.mask_token_id, width=width, speculative=False)
    rows = _logit_rows(phase, span_start, span_len, spec_off, bs=bs, shifted=model.shifted, speculative=False)
    out = model(AttentionPlan(tokens, positions, pack_mask(dense), cache), logits=rows, return_kv=False)
    logits = out.logits.float()
    if model.shifted:
        first = torch.where((span_start == 0)[:, None], carry.float(), logits[:, 0])
        logits = torch.cat([first[:, None], logits[:, 1:]], 1)
    return logits


def accept_span(tokens, masked, drafts, target_logits, span_start, span_len, *, draft_probs=None,
                temperature=0.0, coins=None, sample_uniforms=None, generator=None):
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
    res = verify_chain(drafts, target_logits, draft_probs=draft_probs, num_drafts=span_len,
                       temperature=temperature, coins=coins, sample_uniforms=sample_uniforms,
                       generator=generator)
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


class _Batch:
    """The batch's S2D2 state machine: per row its phase, block, drafted span and the logits
    carried from the last committed block; one :meth:`step` = one model forward."""

    def __init__(self, model, prompts, opt, *, max_new_tokens, temperature, generator, eos_ids, progress):
        self.model, self.opt = model, opt
        self.bs, self.thr, self.L_max = opt["block_size"], opt["threshold"], opt["draft_len"]
        self.shifted = bool(model.shifted)
        self.clean_causal = bool(getattr(model.config, "clean_causal", False))
        self.max_new_tokens, self.temperature, self.generator = max_new_tokens, temperature, generator
        self.progress = progress
        dev = self.dev = model.device
        batch = self.batch = len(prompts)
        bs = self.bs
        self.mask_id, self.vocab = model.mask_token_id, model.config.vocab_size
        self.router = make_router(opt["policy"], batch, dev, min_span=opt["min_span"],
                                  score_threshold=opt["score_threshold"], hysteresis=opt["hysteresis"],
                                  ucb_c=opt["ucb_c"], max_score=float(self.L_max))

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
        self.drafts = torch.zeros(batch, bs, dtype=torch.int64, device=dev)    # span drafts, left-aligned
        self.draft_probs = None                                               # [B, bs, V] when sampling
        self.span_start = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.span_len = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.outputs = OutputBuffer(batch, max_new_tokens, eos_ids)
        # a block finished but not in the cache: it rides in front of the next block's first
        # drafting forward, which appends its KV and carries its last logits
        self.pending = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.prev_tokens = torch.zeros(batch, bs, dtype=torch.int64, device=dev)
        self.hist = torch.zeros(self.L_max + 1, dtype=torch.int64, device=dev)
        self.kinds = {"draft": 0, "verify": 0, "commit": 0}
        # verifications, tokens they committed, accepted drafts, verified drafts, reused / final spec blocks
        self.stats_dev = torch.zeros(6, dtype=torch.int64, device=dev)
        self.shown = 0.0                                 # progress shown (tokens per request)

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
        if not self.read_phases():
            return False
        out, logits = self.forward()
        if self.any_pending and self.shifted:          # the pending block's last row predicts slot 0
            self.carry = torch.where(self.pending[:, None], logits[:, self.bs], self.carry)
        nxt = self.phase.clone()
        reuse = spec_final = self.chain_final = torch.zeros_like(self.is_verify)
        if self.has["verify"]:
            reuse, spec_final = self.verify(logits, nxt)
        if self.has["draft"] or self.has["verify"]:
            self.draft(logits, reuse, nxt)
        self.commit(out, logits, spec_final, nxt)
        self.phase = nxt
        return True

    def read_phases(self) -> bool:
        """The one host read per iteration: row states and the suffix width they need."""
        width_row = torch.where(self.phase == VERIFY,
                                _verify_width(self.span_start, self.span_len, bs=self.bs, shifted=self.shifted,
                                              speculative=True),
                                torch.where(self.phase == DONE, 1, torch.where(self.pending, 2 * self.bs, self.bs)))
        host = torch.stack([self.phase, width_row, self.pending.long()]).tolist()
        self.phases, self.width, self.any_pending = host[0], max(host[1]), any(host[2])
        if all(p == DONE for p in self.phases):
            return False
        self.has = {"draft": DRAFT in self.phases, "verify": VERIFY in self.phases, "commit": self.any_pending}
        self.spec = self.has["verify"]
        self.is_draft, self.is_verify = self.phase == DRAFT, self.phase == VERIFY
        return True

    def forward(self):
        """Every row's suffix in one forward: plain blocks, or per-row layouts when one verifies."""
        bs, slots = self.bs, self.slots
        if all(p == DRAFT for p in self.phases) and not self.any_pending:
            # every row forwards its plain block: diffusion's own plan (shared mask, all logits)
            self.spec_off = torch.zeros_like(self.span_start)
            plan = AttentionPlan(self.tokens, self.block_start[:, None] + slots, self.block_mask_words, self.cache)
            rows = "all"
        else:
            in_block = self.tokens
            if self.spec:
                rel = slots[None] - self.span_start[:, None]
                in_span = (rel >= 0) & (rel < self.span_len[:, None])
                in_block = torch.where(in_span, self.drafts.gather(1, rel.clamp(0, bs - 1)), self.tokens)
            suffix, positions, dense, self.spec_off = _row_layout(
                self.phase, self.tokens, in_block, self.span_start, self.span_len, self.block_start, bs=bs,
                shifted=self.shifted, mask_id=self.mask_id, width=self.width, speculative=self.spec,
                pending=self.pending, prev_tokens=self.prev_tokens)
            rows = _logit_rows(self.phase, self.span_start, self.span_len, self.spec_off, bs=bs,
                               shifted=self.shifted, speculative=self.spec, pending=self.pending)
            plan = AttentionPlan(suffix, positions, pack_mask(dense), self.cache)
        out = self.model(plan, logits=rows, return_kv=self.has["commit"] or self.spec)
        self.forwards += 1
        for k in self.kinds:
            self.kinds[k] += self.has[k]
        return out, out.logits.float()                       # [B, bs (+ 1 (+ bs)), V]

    def verify(self, logits, nxt):
        """Accept each verifying row's span against its block-size-1 logits; returns the rows
        whose speculative block is the next drafting step (reuse) / the finished block."""
        bs, is_verify = self.bs, self.is_verify
        target = logits[:, :bs + 1]
        if self.shifted:
            first = torch.where((self.span_start == 0)[:, None], self.carry, target[:, 0])
            target = torch.cat([first[:, None], target[:, 1:]], 1)
        num = torch.where(is_verify, self.span_len, 0)
        self.tokens, self.masked, committed, acc = accept_span(
            self.tokens, self.masked, self.drafts, target, self.span_start, num,
            draft_probs=self.draft_probs if self.temperature > 0 else None, temperature=self.temperature,
            generator=self.generator)
        # every draft accepted: the speculative block holds the block as it now stands
        # (but for a bonus token, still [MASK] there), so its logits are the next
        # drafting step; with no bonus and nothing left masked it is the finished block
        all_in = is_verify & (acc == self.span_len)
        left = self.masked.any(1)
        reuse = all_in & left
        spec_final = all_in & ~left & (committed == acc)
        if self.clean_causal:
            # a chain covering the whole block is that block's causal forward, key for key
            # where the commit forward would put it: commit those rows, not the speculative
            # block's (the same values, rounded at other key indices in bf16)
            self.chain_final = spec_final & (self.span_start + self.span_len == bs)
        self.router.observe(is_verify, True, committed, torch.where(reuse | spec_final, 1, 2))
        L_max = self.L_max
        self.hist += torch.bincount(torch.where(is_verify, acc, L_max + 1), minlength=L_max + 2)[:L_max + 1]
        self.stats_dev += torch.stack([is_verify.sum(), committed.sum(), torch.where(is_verify, acc, 0).sum(),
                                       num.sum(), reuse.sum(), spec_final.sum()])
        self.advance(float(committed.sum()) / self.batch)
        nxt.copy_(torch.where(is_verify, torch.where(left, DRAFT, COMMIT), nxt))
        return reuse, spec_final

    def draft(self, logits, reuse, nxt):
        """Drafting rows (and verified rows whose speculative block is reused): draft every
        masked slot, route, and either keep the span for verification or fall back to the
        confidence-threshold step."""
        bs, slots, temperature, opt = self.bs, self.slots, self.temperature, self.opt
        drafting = self.is_draft | reuse
        block_logits = logits[:, :bs]
        if self.shifted:
            block_logits = torch.cat([self.carry[:, None], block_logits[:, :-1]], 1)
        if self.spec:
            spec_logits = logits[:, bs + 1:]
            if self.shifted:
                spec_logits = torch.cat([self.carry[:, None], spec_logits[:, :-1]], 1)
            block_logits = torch.where(reuse[:, None, None], spec_logits, block_logits)
        masked = self.masked
        choice, conf = choose(block_logits, temperature, self.generator)
        active = drafting & masked.any(1)
        # fallback: diffusion's threshold rule (ties to the lower slot)
        conf_m, _, rank = rank_masked(conf, masked)
        pick = pick_slots(masked, conf_m, rank, threshold=self.thr) & drafting[:, None]
        # the first contiguous masked span, capped at draft_len
        first = torch.where(masked.any(1), masked.long().argmax(1), 0)
        run = masked.gather(1, (first[:, None] + slots[None]).clamp(max=bs - 1)) \
            & (first[:, None] + slots[None] < bs)
        length = run.long().cumprod(1).sum(1).clamp(max=self.L_max)
        if opt["policy"] in ("always", "never", "min_span"):
            score = length.float()           # not used by these policies: no scoring pass
        else:
            tstats = token_stats(block_logits, temperature=temperature if temperature > 0 else 1.0)
            score = span_score(tstats, conf, first, length, opt["estimator"])
        verify = self.router.decide(RoutingFeatures(active, length, score, pick.sum(1)))
        fall = pick & (active & ~verify)[:, None]
        self.tokens = torch.where(fall, choice, self.tokens)
        self.masked = masked = masked & ~fall
        self.router.observe(active & ~verify, False, pick.sum(1), 1)
        self.advance(float(fall.sum()) / self.batch)
        # verifying rows keep their span drafts (and q rows when sampling), left-aligned
        src = (first[:, None] + slots[None]).clamp(max=bs - 1)
        self.drafts = torch.where(verify[:, None], choice.gather(1, src), self.drafts)
        if temperature > 0 and opt["policy"] != "never":
            q = torch.softmax(block_logits / temperature, dim=-1)
            q = q.gather(1, src[..., None].expand(-1, -1, self.vocab))
            self.draft_probs = q if self.draft_probs is None else torch.where(verify[:, None, None], q,
                                                                              self.draft_probs)
        self.span_start = torch.where(verify, first, self.span_start)
        self.span_len = torch.where(verify, length, self.span_len)
        nxt.copy_(torch.where(drafting, torch.where(verify, VERIFY, torch.where(masked.any(1), DRAFT, COMMIT)),
                              nxt))

    def commit(self, out, logits, spec_final, nxt):
        """Append the KV of the blocks committed by this forward (a pending block: the rows in
        front of its successor; a verified row: its chain or speculative block) and carry the
        latter's last logits; output the blocks finished in this iteration and open their
        successors (a block finished by fallback or by a rejection / bonus token is pending:
        its KV rides in front of the next block's first drafting forward; the last one is
        never forwarded again)."""
        bs, slots = self.bs, self.slots
        appended = self.pending | spec_final
        if self.any_pending or self.spec:
            keep_off = torch.where(self.pending | self.chain_final, 0, self.spec_off)
            keep = torch.where(appended[:, None], keep_off[:, None] + slots[None], -1)
            if bool(appended.any()):
                self.cache.append(out.suffix_kv, keep=keep.cpu())
            # logits row of slot bs - 1: the chain's last (verification row bs), the spec block's
            last = torch.where(self.chain_final, bs, 2 * bs)
            self.carry = torch.where(spec_final[:, None],
                                     logits.gather(1, last.clamp(max=logits.shape[1] - 1)[:, None, None]
                                                   .expand(-1, 1, self.vocab))[:, 0], self.carry)
        self.pending = torch.zeros_like(self.pending)
        complete = (nxt == COMMIT) & ~spec_final            # finished, KV not appended above
        finishing = complete | spec_final
        fin_host = finishing.cpu().numpy()
        if not fin_host.any():
            return
        done = torch.zeros(self.batch, dtype=torch.bool)
        done[self.emit(fin_host)] = True
        done = done.to(self.dev)
        self.prev_tokens = torch.where(complete[:, None], self.tokens, self.prev_tokens)
        self.pending = complete & ~done
        self.block_start = torch.where(finishing, self.block_start + bs, self.block_start)
        new_tokens, new_masked = self.fresh_block(self.block_start)
        self.tokens = torch.where(finishing[:, None], new_tokens, self.tokens)
        self.masked = torch.where(finishing[:, None], new_masked, self.masked)
        nxt.copy_(torch.where(finishing, torch.where(done, DONE, DRAFT), nxt))

    def emit(self, fin_host: np.ndarray) -> torch.Tensor:
        """Output the finished blocks (rows ``fin_host``, bool [B]) generated tokens; returns
        the rows now done."""
        rows = np.flatnonzero(fin_host)
        done = self.outputs.extend_block(rows, self.tokens.cpu().numpy()[rows],
                                         self.block_start.cpu().numpy()[rows], self.plen_host[rows])
        return torch.from_numpy(rows[done])

    @property
    def generated(self) -> list[list[int]]:
        return self.outputs.generated

    def stats(self) -> dict:
        n_verify, n_committed_by_verify, n_accepted, n_drafted, reused, from_spec = self.stats_dev.tolist()
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
            "spec_block_drafts": reused, "spec_block_commits": from_spec,
            "router": self.router.stats(),
            "block_size": self.bs, "threshold": self.thr, "draft_len": self.L_max, "policy": opt["policy"],
            "estimator": opt["estimator"],
        }


@torch.no_grad()
def decode_s2d2(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, eos_ids=(), progress=None,
                block_size: int | None = None, threshold: float | None = None, policy: str | None = None,
                min_span: int | None = None, score_threshold: float | None = None, hysteresis=None,
                ucb_c: float | None = None, estimator: str | None = None, draft_len: int | None = None):
    """S2D2 decoding of a ragged batch; returns (tokens per request, stats).

    Parameters
    ----------
    block_size : int, default the model's.
    threshold : float in (0, 1], default 0.9: the confidence-threshold fallback (as
        ``diffusion``'s dynamic schedule).
    policy : one of ``dspec.decode.routing.POLICIES``, default ``"min_span"`` (robust without
        calibration: the score policies need thresholds matched to the model's confidence).
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

    Stats
    -----
    nfe {"target": forwards} (prefill, block commits, drafting and verification forwards;
    one forward serves the whole batch); mean_accepted = tokens committed per verification
    of one sequence (accepted drafts + the resampled / bonus token), 0.0 when nothing was
    verified; verify_rate = verifications / routing decisions; acceptance_rate = accepted
    drafts / verified drafts; accepted_hist[n] = verifications that accepted n drafts;
    tokens_per_forward; forwards_with (forwards with at least one sequence drafting /
    verifying / committing a pending block -- the latter are drafting forwards too);
    spec_block_drafts / spec_block_commits (verifications whose
    speculative block served as the next drafting step / as the committed block, each a
    forward saved); router (per-policy counters).
    """
    opt = _check_options(model, block_size, threshold, policy, min_span, score_threshold, hysteresis,
                         ucb_c, estimator, draft_len)
    run = _Batch(model, prompts, opt, max_new_tokens=max_new_tokens, temperature=temperature,
                 generator=generator, eos_ids=eos_ids, progress=progress)
    while run.step():
        pass
    return run.generated, run.stats()


decode = decode_s2d2
