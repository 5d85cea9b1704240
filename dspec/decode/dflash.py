"""DFlash: a block drafter conditioned on the target's hidden states, verified as a chain.

Per cycle, for every unfinished request of the batch (ragged: each at its own length):

1. **draft** -- one drafter forward over ``[anchor, MASK x (gamma-1)]`` at positions
   ``p .. p+gamma-1`` (p = committed length; the anchor is the last committed token, not
   yet run by the target), attending to the drafter-side context cache (the projected
   target hidden states of positions < p).  Greedy: the drafts are the drafter's argmax;
   temperature T > 0: they are drawn from ``q = softmax(drafter logits / T)``.
2. **verify** -- one target forward of ``[anchor, d_1 .. d_{gamma-1}]`` (causal, after the
   target KV cache) returning the logits and the hidden states at the drafter's
   ``target_layer_ids``; ``dspec.verify_chain(drafts, logits, draft_probs=q)`` accepts a
   prefix and draws the next token (greedy: exact argmax matching, so the output equals
   ``ar`` token for token; sampling: lossless speculative sampling).
3. **commit** -- the anchor and the accepted drafts: their target KV
   (``KVCache.append(counts=1 + accepted)``) and their projected features in the drafter
   context cache; the drawn token is the next anchor.

Host syncs: one per cycle (the accepted counts and tokens come back to the host to extend
the outputs and to set the caches' host-side lengths); the draft and verify forwards
themselves have none.  A request leaves the batch (``KVCache.select``) after its EOS or
``max_new_tokens``; rows never interact, so a batch decodes exactly as single requests.

``draft_len`` is the number of tokens drafted per cycle (DESIGN.md's common meaning):
the drafter fills a block of gamma = draft_len + 1 slots (the anchor plus the drafts) and a
cycle commits between 1 and gamma tokens.

``row_cost`` (adaptive verification length): where a verification forward costs more with
every row (a CPU's projections are compute-bound above a few rows: each verified row adds
~6 % of a one-token step on an AVX512_BF16 EPYC), verify only the first n drafts, n
maximising the expected tokens per cycle per cost, ``(1 + sum_{j<=n} prod_{i<=j} p_i) /
(1 + row_cost * n)``, with p_i the drafter's probability of its i-th draft taken as its
acceptance rate (:func:`verify_length`).  The output is unchanged (fewer drafts are
verified, the target still decides every token); ``None`` verifies every draft.

``tree`` (tree verification): the drafter's slots are predicted in parallel, so each slot's
runner-up candidates are as cheap as its argmax.  With ``tree = N`` a cycle
verifies up to N draft nodes as one token tree instead of the chain: a node is a path
``(c_1 .. c_d)`` of candidates among each slot's ``TREE_TOP_K`` most probable, scored
``prod_j q_j(c_j)`` (the drafter's estimate of its chance of acceptance, slots taken as
independent), and the tree keeps the N best nodes (:func:`marginal_tree`; scores fall
along every path, so they form a subtree).  One target forward under the tree mask,
``dspec.verify_tree`` (greedy: equals ``ar``), and the root and accepted path are
committed (``keep=[0] + path``).  At T > 0 the tree's shape is the same function of the
drafter's probabilities, but its tokens are *drawn*: the children of a node at depth d are
draws without replacement from the drafter's slot-d distribution q_d
(:func:`sampled_draft_tree`), and ``verify_tree(draft_probs=, draft_sampling=
"without_replacement")`` verifies them against q (recursive rejection sampling: lossless,
and the first children form a chain drawn exactly as the chain's drafts, so a tree never
accepts less than the chain).  A lookup graft at T > 0 keeps one-hot verification.  With ``row_cost`` the tree
keeps the n <= N best nodes maximising ``(1 + sum of their scores) / (1 + row_cost * n)``.
Teacher-forced on 2,048 held-out blocks of the round-7 SmolLM2-135M drafter: tokens per
cycle 2.05 (chain of 7) -> 2.37 / 2.57 / 2.72 with 7 / 15 / 31 tree nodes.  The default
``"auto"`` verifies 7 nodes (the chain's 8 rows) on a CPU model decoding greedily -- there
it measured 1.20-1.22x ``ar`` against the chain's 1.15-1.19x -- and the chain otherwise
(``tree=None`` asks for the chain, DFlash as published).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from .. import _backend
from ..masks import causal
from ..models import AttentionPlan
from ..models.dflash import MASK, BlockDrafter, resolve_drafter
from ..ops import token_stats, topk_tokens, tree_mask, verify_chain, verify_tree
from .bounds import MAX_DRAFT_LEN, check_max, check_rows
from .cpu_cost import drafter_cost, forward_cost, resolve_ar_fallback, resolve_lookup, resolve_row_cost, resolve_tree
from .lookup import PromptLookup, graft_chain
from .outputs import OutputBuffer
from .sampling import RequestStreams, next_tokens, non_finite_error, request_streams, require_finite, sample_from


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA only): the draft / verify time split of a
    cycle (here and in d2sd, which runs these cycles) needs it finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_verify_rule(rule) -> str:
    """``verify_rule`` as ``dflash`` takes it: "token" or "block"."""
    if rule not in ("token", "block"):
        raise ValueError(f"verify_rule must be 'token' or 'block', got {rule!r}")
    return rule


def check_draft_len(draft_len, drafter: BlockDrafter, name: str = "draft_len") -> int:
    """gamma, the drafter's block (anchor + drafts), from ``draft_len`` = drafts per cycle
    (default: the drafter's block size minus the anchor)."""
    if draft_len is None:
        return drafter.block_size
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"{name} must be an int >= 1 (tokens drafted per cycle), got {draft_len!r}")
    check_max(name, draft_len, MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    return draft_len + 1


def check_cycle_rows(model, drafter, prompts, draft_len, gamma: int, tree, lookup) -> None:
    """The context bound of a DFlash cycle (:mod:`dspec.decode.bounds`): the drafter's block
    (gamma rows) and the verification (the chain's gamma rows, or the tree's root, its
    ``tree`` nodes and the ``lookup`` chain) each after the longest prompt must fit the
    target's and the drafter's context."""
    name, value = ("draft_len", draft_len) if draft_len is not None else ("drafter", f"a block of {gamma}")
    check_rows(model, prompts, name, value, gamma, "draft_len + 1", drafter=drafter)
    if tree is not None:
        check_rows(
            model,
            prompts,
            "tree",
            tree,
            1 + tree + (lookup or 0),
            "1 + tree" + (" + lookup" if lookup else ""),
            drafter=drafter,
        )


class SpeculativeRun:
    """The state both DFlash and D2SD keep per batch: target KV cache, one drafter context
    cache per drafter, the anchors, the outputs and the counters.

    ``rows`` maps the live batch rows to request indices; finished requests are dropped
    from every cache after each commit.
    """

    def __init__(self, model, drafters: dict, prompts, *, max_new_tokens, eos_ids, progress):
        self.model = model
        self.drafters = drafters  # role -> BlockDrafter
        ids = []
        for d in drafters.values():
            ids += [i for i in d.target_layer_ids if i not in ids]
        self.layer_ids = ids
        self.pick = {role: [ids.index(i) for i in d.target_layer_ids] for role, d in drafters.items()}
        self.outputs = OutputBuffer(len(prompts), max_new_tokens, eos_ids, progress)
        self.rows = np.arange(len(prompts))  # live batch row -> request index
        self.nfe = {"target": 0, **{role: 0 for role in drafters}}
        self.cycles = 0  # drafting cycles x live requests
        self.committed = 0  # tokens those cycles produced (accepted + 1 each)
        self.verify_forwards = 0
        self.target_steps = 0  # verification forwards without drafts (``ar_fallback``)
        self.time = {"draft_s": 0.0, "verify_s": 0.0}
        dev = model.device
        batch = len(prompts)
        self.cache = model.new_cache(batch)
        self.contexts = {role: d.new_cache(batch) for role, d in drafters.items()}
        self.pending = []  # (hidden states, positions) of target-only steps not yet in the contexts
        plan = model.plan(prompts, self.cache)
        out = model(plan, logits="last", hidden_states=self.layer_ids)
        self.nfe["target"] += 1
        self.cache.append(out.suffix_kv, counts=plan.lengths)
        self._commit_context(out.hidden, plan.positions, counts=plan.lengths)
        self.anchor = None
        self._first_logits = out.logits[:, -1]
        self.device = dev

    def start(self, temperature, generator) -> bool:
        """Pick the first token from the prefill logits; False when every request is done."""
        u = generator.uniforms(self.rows, 1)[:, 0] if isinstance(generator, RequestStreams) else None
        first = next_tokens(self._first_logits, temperature, generator, uniforms=u, who="target model")
        self._first_logits = None
        return self._extend(first[:, None].cpu(), torch.ones(len(self.rows), dtype=torch.int64), first)

    # ------------------------------------------------------------------ per cycle

    @property
    def lengths(self) -> torch.Tensor:
        """Committed length per live row (= the anchor's position), int64 [B] on device."""
        return self.cache.lengths.to(self.device)

    def _commit_context(self, hidden, positions, *, counts=None, keep=None):
        for role, drafter in self.drafters.items():
            kv = drafter.context_kv([hidden[j] for j in self.pick[role]], positions)
            self.contexts[role].append(kv, keep, counts=counts)

    def commit(self, out, positions, *, counts=None, keep=None) -> None:
        """Commit a verification forward's rows (target KV + drafter context)."""
        self.cache.append(out.suffix_kv, keep, counts=counts)
        self._commit_context(out.hidden, positions, counts=counts, keep=keep)

    def commit_deferred(self, out, positions) -> None:
        """Commit a one-row forward per request (a target-only step): its target KV now, its
        drafter context at the next :meth:`flush_context`, where the steps since the last
        drafter forward project as one call instead of one small call a step (the same bits
        on dspec's CPU tiles, whose projections are row-invariant)."""
        self.cache.append(out.suffix_kv)
        self.pending.append(([h.clone() for h in out.hidden], positions))

    def flush_context(self) -> None:
        """Project the deferred steps' hidden states into the drafter contexts."""
        if self.pending:
            hidden = [torch.cat([p[0][j] for p in self.pending], 1) for j in range(len(self.layer_ids))]
            positions = torch.cat([p[1] for p in self.pending], 1)
            self.pending = []
            self._commit_context(hidden, positions)

    def verify_tree_cycle(self, tokens, parents, positions, words, temperature, generator, *, draft_probs=None) -> bool:
        """One target forward over a token tree (``tokens`` / ``parents`` [B, N], node 0 the
        anchor; absolute ``positions`` [B, N]; ``words`` its ``tree_mask``), ``verify_tree``
        (``draft_probs`` [B, N, V]: the distributions each node's children were drawn from
        without replacement; None: one-hot drafts), the root and accepted path committed
        (``keep=[0] + path``) and the outputs extended (:meth:`finish_cycle`).  False when
        every request is done."""
        out = self.model(AttentionPlan(tokens, positions, words, self.cache), hidden_states=self.layer_ids)
        self.nfe["target"] += 1
        rand = {"generator": generator}
        if temperature > 0 and isinstance(generator, RequestStreams):  # each request's own stream
            rand = generator.tree(self.rows, tokens.shape[1])
        scheme = {} if draft_probs is None else {"draft_probs": draft_probs, "draft_sampling": "without_replacement"}
        ver = verify_tree(tokens, parents, out.logits, temperature=temperature, **scheme, **rand)
        host = self.fetch(ver.num_accepted, ver.tokens)
        path = ver.path.cpu()
        self.commit(out, positions, keep=torch.cat([torch.zeros(path.shape[0], 1, dtype=torch.int64), path], 1))
        return self.finish_cycle(host)

    def fetch(self, num_accepted: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The cycle's one host sync: [B, 1 + W] int64 on the CPU, column 0 the accepted
        counts, then the verify output's tokens."""
        return torch.cat([num_accepted[:, None].to(torch.int64), tokens], 1).cpu()

    def finish_cycle(self, host: torch.Tensor, *, drafted: bool = True) -> bool:
        """Extend the outputs with each row's accepted drafts + drawn token (``host`` from
        :meth:`fetch`); the drawn token becomes the anchor.  ``drafted``: a drafting cycle,
        counted in ``cycles`` / ``mean_accepted`` (False: a target-only step, counted in
        ``target_steps``).  False when all are done."""
        n = host[:, 0] + 1
        drawn = host[:, 1:].gather(1, host[:, :1])[:, 0]
        if bool((drawn < 0).any()):  # the ops' -1 mark: a non-finite target row
            raise non_finite_error("target model")
        self.verify_forwards += 1
        if drafted:
            self.cycles += len(self.rows)
            self.committed += int(n.sum())
        else:
            self.target_steps += 1
        anchor = drawn.to(self.device)
        return self._extend(host[:, 1:], n, anchor)

    @property
    def generated(self) -> list[list[int]]:
        """Each request's generated tokens (up to and including EOS)."""
        return self.outputs.generated

    def _extend(self, tokens: torch.Tensor, counts: torch.Tensor, anchor) -> bool:
        """Append each live row's first counts[r] tokens (host tensors [A, W], [A]) to the
        outputs (:class:`OutputBuffer`); drop the finished rows from every cache.  False when
        all are done."""
        req = self.rows
        done = self.outputs.extend(req, tokens.numpy(), counts.numpy())
        if not done.any():
            self.anchor = anchor
            return True
        keep = np.flatnonzero(~done)
        if not len(keep):
            return False
        self.cache = self.cache.select(keep.tolist())
        self.contexts = {role: c.select(keep.tolist()) for role, c in self.contexts.items()}
        if self.pending:
            rows = torch.from_numpy(keep).to(self.device)
            self.pending = [
                ([h.index_select(0, rows) for h in hid], p.index_select(0, rows)) for hid, p in self.pending
            ]
        self.anchor = anchor.index_select(0, torch.from_numpy(keep).to(anchor.device))
        self.rows = req[keep]
        return True

    def stats(self, **extra) -> dict:
        s = {
            "nfe": dict(self.nfe),
            "mean_accepted": self.committed / self.cycles if self.cycles else 0.0,
            "verify_forwards": self.verify_forwards,
            "target_steps": self.target_steps,
            "cycles": self.cycles,
            **self.time,
        }
        s.update(extra)
        return s


class DrafterGate:
    """When a cycle runs the drafter (``ar_fallback``): a drafting cycle costs the drafter's
    forward plus a verification forward of 1 + n rows (n drafts or tree nodes),
    ``drafter_cost + forward_cost(1 + n)`` one-row target forwards, and earns its committed
    tokens per request; a target-only step (an ``ar`` step) costs 1 and earns 1.  The gate
    keeps an exponential average (weight ``ALPHA``) of each drafting cycle's earnings minus
    its cost; while that is below 0 it runs ``wait`` target-only steps, then one drafting
    cycle as a probe.  A probe after which the average is still below 0 doubles ``wait`` (up
    to ``MAX_WAIT``); one after which it is not resets it to 1.  Every decision
    follows from the tokens committed, never from timings, so a seeded call stays
    reproducible; the output is unchanged (a target-only step is ``ar``'s, and the drafter's
    context takes its hidden states).

    Example
    -------
    >>> gate = DrafterGate(0.35, lambda rows: 1.0 + 0.2 * (rows - 1))
    >>> gate.draft(), gate.update(tokens=1.0, drafts=3), gate.draft(), gate.draft()
    (True, None, False, True)
    """

    ALPHA = 0.25
    MAX_WAIT = 16

    def __init__(self, drafter_cost: float, forward_cost):
        self.drafter_cost = float(drafter_cost)
        self.forward_cost = forward_cost  # rows -> one forward's cost in one-row forwards
        self.score = 0.0
        self.wait = 1
        self.skip = 0  # target-only steps left before the next probe
        self.probe = False

    def draft(self) -> bool:
        """Whether the next cycle drafts (False: one target-only step, counted)."""
        if self.skip:
            self.skip -= 1
            self.probe = not self.skip
            return False
        return True

    def update(self, tokens: float, drafts: float) -> None:
        """A drafting cycle committed ``tokens`` per request (accepted + 1, the batch's
        mean) verifying ``drafts`` drafts (or tree nodes) per request."""
        gain = tokens - self.drafter_cost - self.forward_cost(1 + drafts)
        self.score = (1.0 - self.ALPHA) * self.score + self.ALPHA * gain
        if self.score < 0:
            if self.probe:
                self.wait = min(2 * self.wait, self.MAX_WAIT)
            self.skip = self.wait
        else:
            self.wait = 1
        self.probe = False


def target_step(run: SpeculativeRun, temperature, generator, chains: dict) -> bool:
    """One target forward over the anchors alone (an ``ar`` step, no drafter forward), its
    hidden states kept for the drafter contexts (:meth:`SpeculativeRun.commit_deferred`), the
    next token drawn as ``verify_chain`` draws it after no drafts (greedy: the argmax).
    Returns whether any request is still live."""
    dev = run.device
    t0 = time.perf_counter()
    if 1 not in chains:
        chains[1] = causal(1, device=dev).words
    positions = run.lengths[:, None]
    out = run.model(AttentionPlan(run.anchor[:, None], positions, chains[1], run.cache), hidden_states=run.layer_ids)
    run.nfe["target"] += 1
    drafts = torch.empty(len(run.rows), 0, dtype=torch.int64, device=dev)
    rand = generator.chain(run.rows, 0) if temperature > 0 and generator is not None else {}
    ver = verify_chain(drafts, out.logits, temperature=temperature, **rand)
    host = run.fetch(ver.num_accepted, ver.tokens)
    run.commit_deferred(out, positions)
    live = run.finish_cycle(host, drafted=False)
    sync_device(dev)
    run.time["verify_s"] += time.perf_counter() - t0
    return live


def verify_length(probs: torch.Tensor, row_cost: float) -> int:
    """How many drafts to verify: probs [B, L], the drafter's probability of each draft ->
    the n in [1, L] maximising ``(1 + sum_{j<=n} prod_{i<=j} probs_i) / (1 + row_cost * n)``
    per request, the largest over the batch (one suffix length for all; verifying more of
    a request's drafts never changes its output)."""
    return best_count(probs.double().cumprod(1), row_cost)


def best_count(reach: torch.Tensor, row_cost: float) -> int:
    """reach [B, M]: each row's node probabilities of acceptance, best first -> the n in
    [1, M] maximising ``(1 + sum_{j<=n} reach_j) / (1 + row_cost * n)`` per row, the largest
    over the batch."""
    gain = reach.double().cumsum(1) + 1.0  # expected tokens, n = 1..M
    n = torch.arange(1, reach.shape[1] + 1, device=reach.device, dtype=torch.float64)
    return int((gain / (1.0 + row_cost * n)).argmax(1).max()) + 1


#: candidates per slot a draft tree picks from (a slot rarely needs more than its top 4)
TREE_TOP_K = 4


def marginal_tree(probs: torch.Tensor, tokens: torch.Tensor, nodes: int):
    """The best ``nodes`` draft paths over a block drafter's per-slot candidates.

    Parameters
    ----------
    probs : float [B, L, k], each drafted slot's k best candidates' probabilities, and
    tokens : int64 [B, L, k] their ids.  A node is a path ``(c_1 .. c_d)``, d <= L, taking
        candidate c_j at slot j; its score is ``prod_j probs[:, j, c_j]``.
    nodes : N >= 1, how many nodes to keep.

    Returns
    -------
    (tokens, parents, depth, scores), each [B, N'] with N' = min(N, k + k^2 + ... + k^L), the
    nodes best first (ties: the shallower first): ``parents`` indexes the tree whose node 0
    is the root (0 for a depth-1 node, else 1 + the parent's column, always < 1 + own
    column), ``depth`` in [1, L].  The best N' nodes of every path form a subtree (a score
    never rises along a path), so every prefix of the columns is one too.  A beam of N per
    depth finds them exactly: a child's score is its parent's times a factor that depends
    only on the slot and candidate, so the best N at depth d extend the best N at d - 1.

    Example
    -------
    >>> import torch
    >>> p = torch.tensor([[[0.6, 0.3], [0.9, 0.1]]]); t = torch.tensor([[[5, 7], [8, 9]]])
    >>> tok, par, dep, _ = marginal_tree(p, t, 3)
    >>> tok.tolist(), par.tolist(), dep.tolist()
    ([[5, 8, 7]], [[0, 1, 0]], [[1, 2, 1]])
    """
    batch, depth_max, k = probs.shape
    factors = probs.double().clamp(0.0, 1.0)  # <= 1: a score never rises along a path
    scores, picks = [], []
    prev = factors.new_ones(batch, 1)
    for d in range(depth_max):  # the beam: 3 ops per depth, the rest after
        s, idx = (prev[:, :, None] * factors[:, d, None, :]).flatten(1).topk(min(nodes, prev.shape[1] * k), dim=1)
        scores.append(s)
        picks.append(idx)
        prev = s
    depth, prev_start, slot_base = _tree_columns(tuple(s.shape[1] for s in scores), k, str(probs.device))
    flat_scores = torch.cat(scores, 1)  # [B, M], depth-major
    flat_idx = torch.cat(picks, 1)
    flat_parent = flat_idx // k + prev_start  # < 0: the root
    flat_tokens = tokens.reshape(batch, depth_max * k).gather(1, slot_base + flat_idx % k)
    # stable: on equal scores the shallower (earlier) node ranks first, so a parent precedes its children
    order = flat_scores.sort(dim=1, descending=True, stable=True).indices[:, :nodes]
    column = torch.empty_like(flat_idx).scatter_(
        1, order, torch.arange(1, order.shape[1] + 1, device=order.device).expand_as(order)
    )
    parent_flat = flat_parent.gather(1, order)
    parent = torch.where(parent_flat >= 0, column.gather(1, parent_flat.clamp_min(0)), 0)
    return flat_tokens.gather(1, order), parent, depth[order], flat_scores.gather(1, order).float()


def draft_tree(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    nodes: int,
    root_tokens: torch.Tensor,
    root_positions: torch.Tensor,
    row_cost: float | None = None,
):
    """A cycle's draft tree: the best ``nodes`` paths (:func:`marginal_tree`), pruned with
    ``row_cost`` (:func:`best_count`), under a root per request.

    Parameters
    ----------
    probs : float [B, L, k], tokens : int64 [B, L, k] -- as :func:`marginal_tree`.
    nodes : N >= 1.
    root_tokens, root_positions : int64 [B], each request's anchor and its position.
    row_cost : None, or >= 0: keep the n best nodes maximising ``(1 + sum of their
        scores) / (1 + row_cost * n)``, the largest n over the batch.

    Returns
    -------
    (tokens, parents, positions) int64 [B, 1 + n] (column 0 the root: parent -1, position
    ``root_positions``; a node's position is the root's + its depth) and ``words`` int32
    [B, 1 + n, ceil((1 + n) / 32)], the ``tree_mask`` of ``parents``.

    On the CPU one ``dspec._C.draft_tree`` call (the composition below took ~45 small torch
    ops, ~0.6 ms of a SmolLM2 cycle); elsewhere the composition, which is its reference
    (tested equal; they may order nodes differently only where scores tie exactly).

    Example
    -------
    >>> import torch
    >>> p = torch.tensor([[[0.6, 0.3], [0.9, 0.1]]]); t = torch.tensor([[[5, 7], [8, 9]]])
    >>> tok, par, pos, words = draft_tree(p, t, 3, torch.tensor([1]), torch.tensor([10]))
    >>> tok.tolist(), par.tolist(), pos.tolist()
    ([[1, 5, 8, 7]], [[-1, 0, 1, 0]], [[10, 11, 12, 11]])
    """
    batch, slots, k = probs.shape
    ext = _backend.extension()
    if probs.is_cpu and ext is not None and hasattr(ext, "draft_tree") and batch:
        paths, width = 0, 1
        for _ in range(slots):
            width = min(nodes, width * k)
            paths += width
        cap = min(nodes, paths)
        probs = probs.to(torch.float32).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        roots = root_tokens.to(torch.int64).contiguous()
        root_pos = root_positions.to(torch.int64).contiguous()
        out = torch.empty(3, batch, 1 + cap, dtype=torch.int64)
        words = torch.empty(batch * (1 + cap) * _mask_words(1 + cap), dtype=torch.int32)
        n = ext.draft_tree(
            probs.data_ptr(),
            tokens.data_ptr(),
            roots.data_ptr(),
            root_pos.data_ptr(),
            batch,
            slots,
            k,
            nodes,
            -1.0 if row_cost is None else float(row_cost),
            cap,
            out[0].data_ptr(),
            out[1].data_ptr(),
            out[2].data_ptr(),
            words.data_ptr(),
        )
        cols = 1 + n
        return (
            out[0, :, :cols],
            out[1, :, :cols],
            out[2, :, :cols],
            words[: batch * cols * _mask_words(cols)].view(batch, cols, _mask_words(cols)),
        )
    tok, par, depth, scores = marginal_tree(probs, tokens, nodes)
    n = tok.shape[1] if row_cost is None else best_count(scores, float(row_cost))
    root = torch.zeros(batch, 1, dtype=torch.int64, device=tok.device)
    parents = torch.cat([root - 1, par[:, :n]], 1)
    positions = torch.cat([root, depth[:, :n]], 1).add_(root_positions[:, None])
    return torch.cat([root_tokens[:, None], tok[:, :n]], 1), parents, positions, tree_mask(parents).words


def sampled_draft_tree(
    q: torch.Tensor,
    nodes: int,
    root_tokens: torch.Tensor,
    root_positions: torch.Tensor,
    uniforms: torch.Tensor,
    row_cost: float | None = None,
    k: int = TREE_TOP_K,
):
    """A cycle's draft tree at T > 0 whose children are DRAWN from the drafter, without
    replacement, so ``verify_tree(..., draft_probs=, draft_sampling="without_replacement")``
    verifies it losslessly against the drafter's own distributions.

    The shape (which nodes, under which parents) is :func:`draft_tree`'s over each slot's
    ``k`` largest probabilities -- a function of q alone, fixed before any draw.  The r-th
    child (in index order) of a parent u at depth d holds the r-th of k draws without
    replacement from ``q[:, d]`` (the parent's slot: the distribution its children are
    drawn from), so the verifier tries the draws in the order they were made.
    Where q has fewer than r + 1 positive entries the node repeats the parent's first draw:
    its q at the token is then 0 after that draw is tried, so the verifier skips it (and
    what hangs below it) -- the rule stays exact.  A slot without a distribution (NaN)
    gives -1 draws.

    Parameters
    ----------
    q : float [B, L, V'], the drafter's per-slot distributions (rows sum to 1).
    nodes, root_tokens, root_positions, row_cost : as :func:`draft_tree`.
    uniforms : float32 [B, >= (1 + nodes) * k] in [0, 1), the draws' randomness (each
        request's own stream).

    Returns
    -------
    (columns, parents, positions, words, slots): ``columns`` int64 [B, 1 + n], node 0 the root
    (``root_tokens``), the others q's column ids (map them with :func:`vocab_ids`);
    ``parents``, ``positions``, ``words`` as :func:`draft_tree`; ``slots`` int64 [B, 1 + n],
    the slot of q each node's children are drawn from (its depth, clamped to L - 1).

    Example
    -------
    >>> import torch
    >>> q = torch.tensor([[[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]]])
    >>> cols, par, pos, words, slots = sampled_draft_tree(q, 3, torch.tensor([9]), torch.tensor([4]),
    ...                                                  torch.full((1, 16), 0.5), k=2)
    >>> par.tolist(), pos.tolist(), slots.tolist()
    ([[-1, 0, 1, 1]], [[4, 5, 6, 6]], [[0, 1, 1, 1]])
    >>> cols.tolist()       # u = 0.5: q[0] draws 0; q[1] draws 1, then 0 without 1
    [[9, 0, 1, 0]]
    """
    batch, slots_n, vocab = q.shape
    k = max(1, min(k, vocab))
    top = q.topk(k, dim=-1).values
    ranks = torch.arange(k, device=q.device).expand(batch, slots_n, k)
    _, parents, positions, words = draft_tree(top, ranks, nodes, root_tokens, root_positions, row_cost)
    width = parents.shape[1]
    depth = positions - root_positions[:, None]
    slot = depth.clamp(max=slots_n - 1)
    # a node's draw is its ordinal among its parent's children in index order -- the order
    # the verifier tries siblings in (ties in the shape's scores can reorder ranks)
    same = parents[:, :, None] == parents[:, None, :]  # [B, W, W]
    earlier = torch.ones(width, width, dtype=torch.bool, device=q.device).tril(-1)
    ordinal = (same & earlier).sum(-1).clamp(max=k - 1)
    # draws only at the nodes that are some row's parent, only as many as the most children
    is_parent = (parents[:, :, None] == torch.arange(width, device=q.device)).any(1).any(0)  # [W]
    used = is_parent.nonzero()[:, 0]
    if not used.numel():  # the root alone: nothing to draw
        return root_tokens[:, None].clone(), parents, positions, words, slot
    rounds = int(ordinal[:, 1:].max()) + 1 if width > 1 else 1
    at = torch.zeros(width, dtype=torch.int64, device=q.device)
    at[used] = torch.arange(used.numel(), device=q.device)
    pick = slot[:, used]
    w = q.float().gather(1, pick[:, :, None].expand(batch, used.numel(), vocab)).clone()  # [B, P, V']
    u = uniforms[:, : width * k].reshape(batch, width, k)[:, used, :rounds]
    draws = torch.empty(batch, used.numel(), rounds, dtype=torch.int64, device=q.device)
    for r in range(rounds):
        x = _draw_rows(w, u[:, :, r])
        draws[:, :, r] = torch.where(x >= 0, x, draws[:, :, 0]) if r else x  # -1: a row without a distribution
        w.scatter_(-1, draws[:, :, r : r + 1].clamp(min=0), 0.0)
    parent = at[parents.clamp(min=0)]
    cols = draws.gather(1, parent[:, :, None].expand(batch, width, rounds)).gather(
        2, ordinal.clamp(max=rounds - 1)[:, :, None]
    )[..., 0]
    cols[:, 0] = root_tokens
    return cols, parents, positions, words, slot


def _draw_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from weights w [..., V] with uniforms u [...]: the smallest v with
    ``cumsum(w)[v] > u * total`` (total the cumsum's last value; the largest v with w > 0
    where rounding leaves none), -1 where the total is 0 or not finite.  Two passes over V
    (a cumsum and a binary search), where :func:`sample_from` takes five."""
    c = torch.cumsum(w, -1)
    total = c[..., -1]
    x = torch.searchsorted(c, (u.float() * total)[..., None].contiguous(), right=True)[..., 0]
    vocab = w.shape[-1]
    if bool((x >= vocab).any()):
        last = torch.where(w > 0, torch.arange(vocab, device=w.device), -1).amax(-1)
        x = torch.where(x >= vocab, last, x)
    return torch.where(torch.isfinite(total) & (total > 0), x, torch.full_like(x, -1))


def _mask_words(nodes: int) -> int:
    return (nodes + 31) // 32


@functools.lru_cache(maxsize=64)
def _tree_columns(widths: tuple, k: int, device: str):
    """Per column of :func:`marginal_tree`'s depth-major candidate list (levels of
    ``widths``): its depth, the first column of the level above (negative at depth 1: the
    parent is the root) and ``(depth - 1) * k`` (its slot's first candidate)."""
    depth, prev_start, slot_base = [], [], []
    start = 0
    for d, w in enumerate(widths):
        depth += [d + 1] * w
        prev_start += [start - (widths[d - 1] if d else sum(widths) + 1)] * w
        slot_base += [d * k] * w
        start += w
    return tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in (depth, prev_start, slot_base))


def draft_block(
    drafter: BlockDrafter, context, anchor: torch.Tensor, positions: torch.Tensor, gamma: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One DFlash forward: ``[anchor, MASK x (gamma-1)]`` -> (drafter logits of the gamma-1
    drafted slots [B, gamma-1, V'] float32, the ids of their columns: the drafter's draft
    vocabulary, or None for the whole vocabulary)."""
    batch = anchor.shape[0]
    block = torch.full((batch, gamma), MASK, dtype=torch.int64, device=anchor.device)
    block[:, 0] = anchor
    logits = drafter(block, positions, context, logits_from=1, draft_vocab=True).float()
    return logits, drafter.draft_vocab


def vocab_ids(columns: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Logit columns -> token ids (``vocab`` from :func:`draft_block`)."""
    return columns if vocab is None else vocab[columns]


def draft_columns(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The inverse of :func:`vocab_ids`: every target id's column in draft vocabulary
    ``vocab`` (int [V']), -1 for an id outside it -> int64 [vocab_size] on ``vocab``'s device."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64, device=vocab.device)
    index[vocab.long()] = torch.arange(vocab.numel(), device=vocab.device)
    return index


def full_vocab_probs(q: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A draft distribution over ``vocab``'s ids [..., V'] as one over every id [..., V]
    (zero outside the draft vocabulary), what ``verify_chain`` compares against."""
    if vocab is None:
        return q
    full = q.new_zeros(q.shape[:-1] + (vocab_size,))
    return full.index_copy_(-1, vocab, q)


@torch.no_grad()
def decode_dflash(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_ids=(),
    progress=None,
    drafter=None,
    draft_len: int | None = None,
    row_cost: float | str | None = "auto",
    tree: int | str | None = "auto",
    lookup: int | str | None = "auto",
    verify_rule: str = "token",
    ar_fallback: bool | str = "auto",
):
    """DFlash speculative decoding of a ragged batch with an AR target.

    Parameters
    ----------
    model : the AR target (``dspec.models.Model``, causal attention).
    prompts : B lists of token ids.
    max_new_tokens, temperature, generator, eos_ids, progress : as ``dspec.generate``.
    drafter : a :class:`~dspec.models.dflash.BlockDrafter` of kind "dflash", a drafter
        directory or shipped name, or None for the one dspec ships for ``model``.
    draft_len : tokens drafted per cycle (gamma - 1; default: the drafter's
        training block size minus the anchor), at most ``MAX_DRAFT_LEN``.  The drafter's block
        (draft_len + 1 rows) and the verification (the chain's draft_len + 1 rows, or 1 +
        ``tree`` + ``lookup`` tree nodes) after the longest prompt must fit the target's (and
        the drafter's) ``max_position_embeddings`` (:mod:`dspec.decode.bounds`).
    row_cost : None (verify every draft) or the cost of one more verified row relative to
        a one-row forward (>= 0): verify the drafts that maximise the expected tokens per
        cost (:func:`verify_length`; one more host read per cycle); "auto" (default): the
        measured row cost of the CPU's class for a CPU model (``cpu_cost.row_cost_of``: 0.02
        on AMX / AVX-512 tiles, the AVX2 forwards' slope there), None elsewhere.  With a
        row cost the verified length (``tree``: node count) is one for the whole batch, so
        at T > 0 a seeded batch is sure to equal its seeded single calls with ``row_cost=None``.
    tree : None (verify a chain of drafts, DFlash as published) or N >= 1: verify up to N
        draft nodes as a token tree over each slot's ``TREE_TOP_K`` best candidates
        (:func:`marginal_tree`; with ``row_cost``, the best n <= N of them); "auto"
        (default): ``cpu_cost.CPU_TREE_NODES`` (7, measured) for a CPU model of the AMX /
        AVX-512 tiles decoding greedily, the chain otherwise (on AVX2 a tree's rows cost more
        than they win: ``cpu_cost.resolve_tree``).
    lookup : None / 0 (off) or K >= 1: graft a prompt-lookup chain of up to K tokens
        (:mod:`dspec.decode.lookup`: what followed the latest earlier occurrence of the
        text's last 3- or 2-gram, prompt and output alike) onto each cycle's tree, sharing
        the tree's nodes where they agree; needs ``tree``.  "auto" (default):
        ``cpu_cost.CPU_LOOKUP_DRAFTS`` (7) for a CPU model decoding greedily with a tree,
        at most ``CPU_LOOKUP_MAX_BATCH`` (4) requests; off otherwise.  The output is
        unchanged (the target verifies every node); the graft runs on the host (on a GPU:
        one more synchronisation a cycle).
    verify_rule : "token" (default) or "block": how a chain cycle at T > 0 is verified
        (``verify_chain(rule=)``: token-wise speculative sampling, or block verification,
        which is as lossless and accepts at least as much).  Greedy cycles and trees ignore it.
    ar_fallback : True: while the drafting cycles earn fewer tokens than they cost (the
        drafter's forward, ``cpu_cost.drafter_cost``, plus the verification forward's
        measured price, ``cpu_cost.forward_cost``, in one-row target forwards), decode
        target-only steps (``ar``'s) and probe the drafter again after 1, 2, 4 .. 16 of
        them (:class:`DrafterGate`; decided per batch, from the committed tokens only);
        needs a CPU model and a row cost.  The output is unchanged.
        "auto" (default): on for a CPU model of the "avx2" cost class with a row cost
        (``cpu_cost.resolve_ar_fallback``), off elsewhere.

    Returns
    -------
    (tokens per request, stats) with stats ``nfe`` {"target": forwards incl. the prefill,
    "drafter": drafter forwards}, ``mean_accepted`` = tokens committed per request per
    drafting cycle (accepted drafts + the drawn token, averaged over every (request, cycle)
    pair; 1.0 = no draft ever accepted; at most gamma), ``draft_s`` /
    ``verify_s`` (wall time of the drafter forwards / target forwards + verification +
    commit), ``draft_len``, ``verify_forwards``, ``cycles``, ``verified_drafts`` (drafts or
    tree nodes verified per request per cycle, lookup nodes included), ``tree`` (the node cap
    used, None: a chain), ``lookup`` (the lookup drafts cap, None: off), ``target_steps``
    (verification forwards without a drafter forward, ``ar_fallback``; not in ``cycles``:
    ``verify_forwards`` counts both).
    """
    if model.attention != "causal":
        raise ValueError(f"method 'dflash' needs an AR (causal) target; {model.family!r} attends {model.attention!r}")
    check_verify_rule(verify_rule)
    tree = resolve_tree(model, tree, temperature)
    lookup = resolve_lookup(model, lookup, tree=tree is not None, temperature=temperature, batch=len(prompts))
    drafter = resolve_drafter(drafter, model, "dflash")
    gamma = check_draft_len(draft_len, drafter)
    check_cycle_rows(model, drafter, prompts, draft_len, gamma, tree, lookup)
    row_cost = resolve_row_cost(model, row_cost)
    ar_fallback = resolve_ar_fallback(model, ar_fallback, row_cost=row_cost)
    run = SpeculativeRun(
        model, {"drafter": drafter}, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, progress=progress
    )
    gate = None
    if ar_fallback:
        gate = DrafterGate(drafter_cost(model, drafter, gamma), functools.partial(forward_cost, model))
    dev = model.device
    generator = request_streams(generator, len(prompts), dev)  # one random stream per request
    offsets = torch.arange(gamma, device=dev)
    chains = {}
    verified = 0
    finder = PromptLookup(prompts, run.outputs, num_drafts=lookup) if lookup else None
    live = run.start(temperature, generator)
    while live:
        if gate is not None and not gate.draft():
            live = target_step(run, temperature, generator, chains)
            continue
        t0 = time.perf_counter()
        run.flush_context()
        rows, committed = len(run.rows), run.committed
        positions = run.lengths[:, None] + offsets
        logits, vocab = draft_block(drafter, run.contexts["drafter"], run.anchor, positions, gamma)
        run.nfe["drafter"] += 1
        if tree is not None:
            live, nodes = tree_cycle(
                run, logits, vocab, positions[:, 0], tree, row_cost, temperature, generator, t0, finder
            )
        else:
            live, nodes = chain_cycle(
                run, logits, vocab, positions, row_cost, temperature, generator, t0, chains, verify_rule
            )
        verified += nodes
        if gate is not None:
            gate.update((run.committed - committed) / rows, nodes / rows)
    return run.generated, run.stats(
        draft_len=gamma - 1,
        tree=tree,
        lookup=lookup,
        row_cost=row_cost,
        verify_rule=verify_rule,
        ar_fallback=ar_fallback,
        verified_drafts=verified / run.cycles if run.cycles else 0.0,
    )


def chain_cycle(
    run: SpeculativeRun,
    logits,
    vocab,
    positions,
    row_cost,
    temperature,
    generator,
    t0: float,
    chains: dict,
    rule: str = "token",
) -> tuple[bool, int]:
    """A cycle's chain verification (DFlash as published): the drafts (greedy: the drafter's
    argmax; T > 0: sampled from its q) cut to ``verify_length`` with ``row_cost``, one target
    forward over ``[anchor, drafts]`` at ``positions`` [B, gamma], ``verify_chain`` (at T > 0
    against q), commit.  ``chains`` caches the causal mask words per length.  Returns (any
    request still live, drafts verified summed over the cycle's requests)."""
    dev = run.device
    if temperature > 0:
        q = torch.softmax(logits / temperature, dim=-1)
        u = generator.uniforms(run.rows, q.shape[1]) if generator is not None else torch.rand(q.shape[:-1], device=dev)
        picked = require_finite(sample_from(q, u), "drafter")
        probs = q.gather(-1, picked[..., None])[..., 0]
        drafts = vocab_ids(picked, vocab)
    else:
        q = None
        stats = token_stats(logits)
        probs, drafts = stats.prob, vocab_ids(require_finite(stats.token, "drafter"), vocab)
    n = drafts.shape[1] if row_cost is None else verify_length(probs, float(row_cost))
    if n < drafts.shape[1]:
        drafts, positions = drafts[:, :n], positions[:, : n + 1]
        q = None if q is None else q[:, :n]
    if q is not None:
        q = full_vocab_probs(q, vocab, run.model.config.vocab_size)
    if n + 1 not in chains:
        chains[n + 1] = causal(n + 1, device=dev).words
    sync_device(dev)
    t1 = time.perf_counter()
    suffix = torch.cat([run.anchor[:, None], drafts], 1)
    out = run.model(AttentionPlan(suffix, positions, chains[n + 1], run.cache), hidden_states=run.layer_ids)
    run.nfe["target"] += 1
    rand = generator.chain(run.rows, drafts.shape[1]) if temperature > 0 and generator is not None else {}
    extra = {"rule": rule} if rule != "token" and temperature > 0 else {}
    ver = verify_chain(drafts, out.logits, draft_probs=q, temperature=temperature, **extra, **rand)
    host = run.fetch(ver.num_accepted, ver.tokens)
    run.commit(out, positions, counts=host[:, 0] + 1)
    live = run.finish_cycle(host)
    sync_device(dev)
    t2 = time.perf_counter()
    run.time["draft_s"] += t1 - t0
    run.time["verify_s"] += t2 - t1
    return live, n * drafts.shape[0]


def tree_cycle(
    run: SpeculativeRun,
    logits,
    vocab,
    root_positions,
    nodes: int,
    row_cost,
    temperature,
    generator,
    t0: float,
    finder: PromptLookup | None = None,
    top=None,
) -> tuple[bool, int]:
    """A cycle's tree verification (``tree``): the best nodes over each slot's candidates
    under the anchors (at ``root_positions`` [B]), with ``finder``'s lookup chains grafted
    on, one target forward under the tree mask, ``verify_tree``, commit of the accepted path.
    ``top``: the draft's (target-vocabulary ids, probabilities) top-``TREE_TOP_K`` where the
    caller has them already (D2SD's gate scored them). Returns (any request still live,
    draft nodes verified summed over the cycle's requests)."""
    q = None
    if temperature > 0 and top is None and finder is None:
        # the children are drawn from the drafter without replacement and verified against
        # its q (lossless and never behind the chain, whose drafts are the first children)
        q = torch.softmax(logits / temperature, dim=-1)
        width = (1 + nodes) * TREE_TOP_K
        u = (
            generator.uniforms(run.rows, width)
            if generator is not None
            else torch.rand(q.shape[0], width, device=q.device)
        )
        cols, parents, positions, words, slots = sampled_draft_tree(q, nodes, run.anchor, root_positions, u, row_cost)
        tokens = torch.cat([cols[:, :1], vocab_ids(require_finite(cols[:, 1:], "drafter"), vocab)], 1)
        q = full_vocab_probs(
            q.gather(1, slots[:, :, None].expand(-1, -1, q.shape[-1])), vocab, run.model.config.vocab_size
        )
    else:
        if top is None:
            top_i, top_p = topk_tokens(
                logits, min(TREE_TOP_K, logits.shape[-1]), temperature=temperature if temperature > 0 else 1.0
            )
            require_finite(top_i[..., 0], "drafter")  # a row's best candidate: -1 where it is not finite
            top = vocab_ids(top_i, vocab), top_p
        tokens, parents, positions, words = draft_tree(top[1], top[0], nodes, run.anchor, root_positions, row_cost)
    if finder is not None:
        chain, counts = finder.drafts(run.rows)
        if counts.any():
            tokens, parents, positions = (
                torch.from_numpy(a).to(run.device)
                for a in graft_chain(*(t.cpu().numpy() for t in (tokens, parents, positions)), chain, counts)
            )
            words = tree_mask(parents).words
    sync_device(run.device)
    t1 = time.perf_counter()
    live = run.verify_tree_cycle(tokens, parents, positions, words, temperature, generator, draft_probs=q)
    sync_device(run.device)
    run.time["draft_s"] += t1 - t0
    run.time["verify_s"] += time.perf_counter() - t1
    return live, (tokens.shape[1] - 1) * tokens.shape[0]


OPTIONS = ("draft_len", "row_cost", "tree", "lookup", "verify_rule", "ar_fallback")
#: ``preset="paper"``: DFlash as published -- the drafter's whole block verified as a chain,
#: token-wise, no prompt-lookup branch, every cycle drafting
PAPER = dict(row_cost=None, tree=None, lookup=None, verify_rule="token", ar_fallback=False)
DRAFTER = "block"  # a BlockDrafter, its directory or a shipped drafter name (see resolve_drafter)
decode = decode_dflash
