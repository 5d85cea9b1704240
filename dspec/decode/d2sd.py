"""D2SD: DFlash's first draft plus K re-drafts at its likely rejection points, verified as
one prefix tree in one target forward.

Per cycle, for every unfinished request (ragged batch, per-request acceptance):

1. **first draft** -- one DFlash forward over ``[anchor, MASK x (gamma-1)]``: drafts
   ``d_1 .. d_L`` (L = gamma - 1, the drafter's argmax) and their confidences
   ``c_i = q_i(d_i)`` (at the decoding temperature, 1 when greedy).
2. **boundaries** -- ``dspec.rejection_boundaries(c, K)``: the K prefix lengths n_k in
   [0, L-1] most likely to be exactly where the target stops accepting
   (``r_n = prod_{i<=n} c_i * (1 - c_{n+1})``).
3. **re-draft** -- ONE forward of the variable-prefix drafter (VP-drafter) over the K
   blocks ``[anchor, d_1 .. d_{n_k}, MASK ...]`` side by side (``dspec.masks.ssd_copies``
   mask: each block bidirectional within itself, none across; every block reads the
   request's drafter context once).  Branch k keeps ``d_1 .. d_{n_k}`` and continues with
   the VP-drafter's argmax, the rejected token ``d_{n_k + 1}`` excluded at the first
   re-drafted slot (the branch exists for the case where it is rejected).
   ``prior_weight`` (dspec's default 1, where the paper's D2SD is 0) adds the first drafter's
   log-probabilities to the VP-drafter's at that slot: the first drafter has seen where its
   own draft goes wrong, the VP-drafter what came before it.  ``boundary_pool`` (off by
   default) re-drafts at more boundaries and keeps the K likeliest.
   ``branches="resample"`` is the naive control: K branches drawn independently from the
   first draft's distribution q (temperature T, 1 when greedy), no second forward.
4. **verify** -- the K+1 branches merged as one prefix tree (``dspec.masks.d2sd_branches``
   / ``prefix_tree``: shared prefixes are one set of nodes), one target forward over the
   tree (``cascade_attention`` under the tree mask, the committed prefix read once for all
   nodes), ``dspec.verify_tree`` (greedy: equals ``ar``; sampling: lossless for any
   siblings).  With ``tree = N`` the first draft enters as DFlash's draft tree (its N best
   paths over each slot's top candidates, :func:`dspec.decode.dflash.draft_tree`, whose best
   path is the first draft) instead of a chain, and the K re-drafted branches and the
   lookup chain are grafted onto it (:func:`dspec.decode.lookup.graft_chain`): the tree
   verifies everything ``dflash`` would plus the re-drafts.
5. **commit** -- the root and the accepted path: ``KVCache.append(keep=[0] + path)`` in the
   target cache and the drafter context caches; the drawn token is the next anchor.

``row_cost`` (adaptive tree, as ``dflash``'s adaptive verification length): every tree
node gets the probability of lying on the accepted path as the drafters estimate it -- a
first-draft node ``prod_{i<=j} c_i``; a branch node ``prod_{i<=n} c_i (1 - c_{n+1})``
times the VP-drafter's probabilities of the branch's tokens up to it (its first token's
renormalised without the rejected one) -- and the tree keeps the m most probable nodes, m
maximising ``(1 + sum of their probabilities) / (1 + row_cost * m)`` (:func:`prune_tree`;
the probabilities fall along every path, so the kept nodes form a subtree).  The output is
unchanged (the target decides every token); ``None`` verifies every branch in full.

``redraft_min`` (the re-draft gate): step 3 runs for a request only in cycles where its K
boundaries carry probability ``sum_k r_{n_k} >= redraft_min`` -- where the first draft is
confident the re-drafts cannot pay for their forward, which on a CPU costs a sizeable part
of a cycle -- and a cycle where no request passes is DFlash's own cycle (``dflash``'s
chain, verified against the drafter's q at T > 0, or its draft tree with the lookup chain;
no VP-drafter forward).  0 re-drafts in every cycle, as the paper does.

Host work: one sync per cycle for the draft tokens and boundaries (the prefix tree is built
on the host from <= (K+1)(gamma-1) tokens per request) and one for the accepted path, like
DFlash's.  ``stats`` adds ``k``, ``branches``, ``tree_nodes`` (mean nodes per request per
cycle, root included) and ``tree_s`` (host tree construction).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..masks import padded_prefix_tree, ssd_copies
from ..models.dflash import MASK, resolve_drafter
from ..ops import rejection_boundaries, token_stats, topk_tokens, tree_mask
from .bounds import check_rows
from .cpu_cost import resolve_lookup, resolve_redraft_min, resolve_row_cost, resolve_tree
from .dflash import (
    TREE_TOP_K,
    SpeculativeRun,
    chain_cycle,
    check_cycle_rows,
    check_draft_len,
    draft_block,
    draft_columns,
    draft_tree,
    sync_device,
    tree_cycle,
    vocab_ids,
)
from .lookup import PromptLookup, graft_chain
from .sampling import RequestStreams, request_streams, require_finite, sample_from

BRANCH_MODES = ("vp", "resample")
# The first drafter's weight at a branch's first re-drafted slot (``prior_weight``), measured
# (bench/results/cpu/amx/ab_d2sd_pool_prior_full.json, ab_d2sd_prior_weight_full.json: SmolLM2-135M,
# DFlash round 9b + VP round 3, 32 grid prompts, every node verified): K = 2 chain mean accepted
# 2.653 at 0, 2.724 at 0.5, 2.745 at 1 and at 2 (DFlash's chain 2.399); on DFlash's tree with
# the lookup branch 3.558 -> 3.570.
PRIOR_WEIGHT = 1.0


def redraft(
    vp_drafter,
    context,
    anchor,
    first,
    lengths,
    positions,
    gamma,
    *,
    with_probs: bool = False,
    prior: torch.Tensor | None = None,
):
    """One VP-drafter forward re-drafting K branches per request.

    anchor [B], first [B, L] (the first draft), lengths [B, K] (prefix lengths in [0, L-1]),
    positions [B, gamma] (the block's absolute positions) -> branches [B, K, L]: branch k
    is ``first[:n_k]`` followed by the VP-drafter's argmax at slots n_k+1 .. L, where slot
    n_k + 1 never repeats the rejected ``first[n_k]``.  ``with_probs``: also the
    VP-drafter's probability of each re-drafted token [B, K, L] (float32; at slot n_k + 1
    renormalised without the rejected token; meaningless at the given slots).  ``prior``
    [B, L, V'] (over the VP-drafter's columns): log-weights added to its log-probabilities
    at slot n_k + 1 only (:func:`first_prior`: the first drafter's opinion there).
    """
    batch, k = lengths.shape
    dev = first.device
    slot = torch.arange(1, gamma, device=dev)  # draft slots 1..L
    given = slot[None, None, :] <= lengths[..., None]  # [B, K, L]
    block = torch.where(given, first[:, None, :], torch.full_like(given, MASK, dtype=torch.int64))
    block = torch.cat([anchor[:, None, None].expand(batch, k, 1), block], 2)  # [B, K, gamma]
    sm = ssd_copies(gamma, k, device=dev)
    vocab = vp_drafter.draft_vocab
    logits = (
        vp_drafter(block.reshape(batch, k * gamma), positions.repeat(1, k), context, mask=sm.words, draft_vocab=True)
        .float()
        .view(batch, k, gamma, -1)[:, :, 1:]
    )
    # the branch exists because d_{n+1} may be rejected: never propose it again there
    first_redrafted = slot[None, None, :] == lengths[..., None] + 1
    rejected = first.gather(1, lengths.clamp_max(first.shape[1] - 1))  # [B, K]
    if vocab is None:
        banned = rejected[..., None] == torch.arange(logits.shape[-1], device=dev)
    else:
        banned = rejected[..., None] == vocab  # [B, K, V']
    ban = banned[:, :, None, :] & first_redrafted[..., None]
    if prior is not None:
        logits = torch.where(first_redrafted[..., None], logits.log_softmax(-1) + prior[:, None], logits)
    logits = logits.masked_fill(ban, float("-inf"))
    stats = token_stats(logits)
    # (the ban leaves every other token of a finite row: -1 marks a non-finite one)
    branches = torch.where(given, first[:, None, :], vocab_ids(require_finite(stats.token, "VP-drafter"), vocab))
    return (branches, stats.prob) if with_probs else branches


def vocab_map(source: torch.Tensor | None, dest: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """For every column of draft vocabulary ``dest`` (None: the whole vocabulary), its
    column in ``source`` or -1 where ``source`` lacks the id: int64 [V'_dest]."""
    dest_ids = torch.arange(vocab_size) if dest is None else dest.cpu().long()
    return dest_ids if source is None else draft_columns(source.cpu(), vocab_size)[dest_ids]


def first_prior(logits: torch.Tensor, columns: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight`` x the first drafter's log-probabilities [B, L, V] moved to another
    drafter's columns (``columns`` from :func:`vocab_map`); an id it lacks gets its row's
    lowest log-probability."""
    logp = logits.log_softmax(-1)
    moved = logp[..., columns.clamp_min(0)]
    moved = torch.where(columns >= 0, moved, logp.amin(-1, keepdim=True))
    return weight * moved


def prune_tree(
    first_probs: torch.Tensor, branch_probs: torch.Tensor, lengths: torch.Tensor, row_cost: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The D2SD tree's nodes worth verifying at ``row_cost`` per node.

    first_probs [B, L]: c_i, the first drafter's probability of its draft i; branch_probs
    [B, K, L]: the VP-drafter's probability of branch k's token at each slot past its
    prefix; lengths [B, K]: the prefixes n_k.  A node's reach probability (the module
    docstring) falls along every path, so the m most probable nodes -- all nodes at or above
    the m-th probability, m per request maximising ``(1 + their sum) / (1 + row_cost * m)``
    -- form a subtree.  Returns (first_keep [B]: first-draft slots kept, a prefix of the
    draft; branch_keep [B, K]: re-drafted slots kept per branch, a prefix of each).
    """
    batch, k, slots = branch_probs.shape
    c = first_probs.double()
    chain = c.cumprod(1)  # [B, L]
    n = lengths.long()
    before = torch.where(n > 0, chain.gather(1, (n - 1).clamp_min(0)), torch.ones_like(c[:, :1]))
    base = before * (1.0 - c.gather(1, n.clamp_max(slots - 1)))  # [B, K]
    own = torch.arange(slots, device=c.device) >= n[..., None]  # slot index j >= n_k
    branch = base[..., None] * torch.where(own, branch_probs.double(), 1.0).cumprod(-1)
    branch = torch.where(own, branch, -1.0)  # given slots: not nodes
    reach = torch.cat([chain, branch.flatten(1)], 1)  # [B, L + K L]
    ordered = reach.sort(1, descending=True).values
    count = torch.arange(1, ordered.shape[1] + 1, device=c.device, dtype=torch.float64)
    gain = (1.0 + ordered.clamp_min(0).cumsum(1)) / (1.0 + row_cost * count)
    gain = torch.where(ordered >= 0, gain, -1.0)
    threshold = ordered.gather(1, gain.argmax(1, keepdim=True))  # [B, 1]
    first_keep = (chain >= threshold).sum(1)
    branch_keep = ((branch >= threshold[..., None]) & own).sum(-1)
    return first_keep, branch_keep


def union_tree(first_tree, branch_tokens: torch.Tensor, branch_len: torch.Tensor, chain, counts):
    """DFlash's draft tree of the first draft (``first_tree``: numpy tokens, parents,
    absolute positions [B, W]) with the re-drafted branches (``branch_tokens`` [B, K, L],
    ``branch_len`` [B, K]) and the lookup chain (``chain`` [B, K'], ``counts`` [B], or None)
    grafted on as tries: a branch continues in the tree's nodes as long as it agrees with
    them, then adds its own."""
    tokens, parents, positions = first_tree
    grafts = [(branch_tokens[:, j].numpy(), branch_len[:, j].numpy()) for j in range(branch_tokens.shape[1])]
    if chain is not None:
        grafts.append((chain, counts))
    for toks, lens in grafts:
        if lens.any():
            tokens, parents, positions = graft_chain(tokens, parents, positions, toks, lens)
    return tokens, parents, positions


@torch.no_grad()
def decode_d2sd(
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
    k: int = 2,
    branches: str = "vp",
    row_cost: float | str | None = "auto",
    lookup: int | str | None = "auto",
    tree: int | str | None = "auto",
    redraft_min: float | str = "auto",
    boundary_pool: int | None = None,
    prior_weight: float | None = None,
):
    """D2SD speculative decoding of a ragged batch with an AR target.

    Parameters
    ----------
    model : the AR target (causal attention).
    prompts, max_new_tokens, temperature, generator, eos_ids, progress : as ``dspec.generate``.
    drafter : None (the drafters dspec ships for ``model``), a dict ``{"dflash": d,
        "vp": d}`` or a pair ``(dflash, vp)`` of BlockDrafters / directories / shipped
        names (a string "DFLASH_DIR,VP_DIR" from the CLI), or a single "dflash" drafter
        (the VP-drafter is then the shipped one; ``branches="resample"`` needs none).
    draft_len : tokens drafted per cycle, gamma - 1 (default: the DFlash drafter's block
        size minus the anchor), at most ``MAX_DRAFT_LEN``.  Context bound
        (:mod:`dspec.decode.bounds`): after the longest prompt, the re-draft forward
        (``boundary_pool * (draft_len + 1)`` rows) and the verification tree (1 + the first
        draft's ``draft_len`` nodes or ``tree`` + ``k * draft_len`` + ``lookup``) must fit
        ``max_position_embeddings``.
    k : K, re-drafted branches (1 <= K <= gamma - 1); the tree holds K + 1 branches.
    branches : "vp" (D2SD) or "resample" (K branches sampled from the first draft's q).
    row_cost : None (verify every branch in full) or the cost of one more tree node
        relative to a one-row forward (>= 0): keep the nodes that maximise the expected
        tokens per cost (:func:`prune_tree`; "vp" branches only); "auto" (default): the
        CPU class's measured row cost for a CPU model with "vp" branches
        (``cpu_cost.row_cost_of``: 0.02 on AMX / AVX-512 tiles), None otherwise.  At T > 0
        a seeded batch is sure to equal its seeded single calls with ``row_cost=None`` (a DFlash cycle
        and ``tree`` prune to one size for the whole batch).
    lookup : None / 0 (off) or K' >= 1: one more branch, the prompt-lookup chain of up to
        K' tokens (:mod:`dspec.decode.lookup`), merged into the tree like the others;
        "auto" (default): ``cpu_cost.CPU_LOOKUP_DRAFTS`` (7) for a CPU model decoding
        greedily a batch of at most ``CPU_LOOKUP_MAX_BATCH`` (4) requests, off otherwise.
    tree : None (the first draft verified as a chain) or N >= 1: the first draft's N best
        paths over each slot's ``TREE_TOP_K`` candidates (``dflash``'s ``tree``, pruned with
        ``row_cost`` as there), the branches grafted on; "auto" (default): as ``dflash``'s
        (``cpu_cost.resolve_tree``: CPU_TREE_NODES on AMX / AVX-512 tiles decoding greedily,
        None otherwise).
    redraft_min : re-draft a request only in cycles where its K boundaries' probabilities
        ``sum_k r_{n_k}`` (the first drafter's estimate that the target stops at one of them)
        reach this value; a cycle where no request does is ``dflash``'s cycle (no
        VP-drafter forward).  0 re-drafts every cycle (the paper's D2SD), inf never;
        "auto" (default): ``cpu_cost.CPU_REDRAFT_MIN`` for a CPU model with "vp" branches,
        0 otherwise.  The output is unchanged (the target decides every token).  At T > 0 a
        gate > 0 makes a cycle where no row of the batch re-drafts DFlash's own, so a seeded
        batch equals its seeded single calls with ``redraft_min`` 0 (or inf).
    boundary_pool : None (= k, the paper's) or P in [k, draft_len]: the VP-drafter re-drafts
        at the P likeliest boundaries (one forward over P blocks) and the tree keeps the k
        branches most likely to be accepted past their boundary, ``r_{n} x`` the
        VP-drafter's probability of its first re-drafted token ("vp" branches only).
    prior_weight : w >= 0: at each branch's first re-drafted slot the VP-drafter's
        log-probabilities plus w x the first drafter's there (the rejected token stays
        banned; ids outside the first drafter's vocabulary get its lowest log-probability);
        0 is the paper's D2SD.  None (default): ``PRIOR_WEIGHT`` with "vp" branches, 0 with
        "resample".  Both options change only which branches are verified.

    Returns
    -------
    (tokens per request, stats): ``nfe`` {"target", "drafter" (first drafts), "vp_drafter"
    (re-drafts)}, ``mean_accepted`` = tokens committed per request per verification forward
    (accepted path + the drawn token, averaged over (request, cycle) pairs), ``draft_s``
    (both drafter forwards and the boundary scoring), ``tree_s``, ``verify_s``, ``k``,
    ``branches``, ``draft_len``, ``tree_nodes``, ``lookup``, ``tree``, ``redraft_min`` (the
    gate used; None where it never re-drafts, e.g. the CPU default inf: stats hold no
    inf / NaN, so they are strict JSON) and ``redraft_rate`` (share of (request, cycle)
    pairs re-drafted).
    """
    if model.attention != "causal":
        raise ValueError(f"method 'd2sd' needs an AR (causal) target; {model.family!r} attends {model.attention!r}")
    if branches not in BRANCH_MODES:
        raise ValueError(f"branches must be one of {BRANCH_MODES}, got {branches!r}")
    row_cost = resolve_row_cost(model, row_cost, prunes=branches == "vp")
    redraft_min = resolve_redraft_min(model, redraft_min, redrafts=branches == "vp")
    lookup = resolve_lookup(model, lookup, tree=True, temperature=temperature, batch=len(prompts))
    if row_cost is not None and branches != "vp":
        raise ValueError("row_cost prunes the VP-drafter's branches: it needs branches='vp'")
    if isinstance(drafter, str) and "," in drafter:  # the CLI's --drafter DFLASH,VP
        drafter = tuple(drafter.split(","))
    if isinstance(drafter, (tuple, list)):
        if len(drafter) != 2:
            raise ValueError(f"drafter as a sequence must be (dflash drafter, vp drafter), got {len(drafter)} items")
        drafter = {"dflash": drafter[0], "vp": drafter[1]}
    if isinstance(drafter, dict):
        unknown = set(drafter) - {"dflash", "vp"}
        if unknown:
            raise ValueError(f"drafter as a dict takes keys 'dflash' and 'vp', got {sorted(unknown)}")
        first_drafter = resolve_drafter(drafter.get("dflash"), model, "dflash")
        vp = drafter.get("vp")
    else:
        first_drafter = resolve_drafter(drafter, model, "dflash")
        vp = None
    gamma = check_draft_len(draft_len, first_drafter)
    tree = resolve_tree(model, tree, temperature)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= gamma - 1:
        raise ValueError(f"k must be an int in [1, draft_len = {gamma - 1}], got {k!r}")
    pool = k if boundary_pool is None else boundary_pool
    if isinstance(pool, bool) or not isinstance(pool, int) or not k <= pool <= gamma - 1:
        raise ValueError(
            f"boundary_pool must be None or an int in [k = {k}, draft_len = {gamma - 1}], got {boundary_pool!r}"
        )
    if prior_weight is None:
        prior_weight = PRIOR_WEIGHT if branches == "vp" else 0.0
    if (
        isinstance(prior_weight, bool)
        or not isinstance(prior_weight, (int, float))
        or not 0 <= prior_weight < float("inf")
    ):
        raise ValueError(f"prior_weight must be a finite float >= 0, got {prior_weight!r}")
    if branches != "vp" and (pool != k or prior_weight):
        raise ValueError("boundary_pool and prior_weight shape the VP-drafter's re-drafts: they need branches='vp'")
    # the context bound: the first draft, the re-draft forward (pool blocks) and the tree
    # (the first draft's chain or tree, K branches of up to draft_len nodes, the lookup chain)
    check_cycle_rows(model, first_drafter, prompts, draft_len, gamma, tree, lookup)
    check_rows(
        model,
        prompts,
        "k",
        k,
        1 + (tree if tree is not None else gamma - 1) + k * (gamma - 1) + (lookup or 0),
        f"1 + {'tree' if tree is not None else 'draft_len'} + k * draft_len" + (" + lookup" if lookup else ""),
        drafter=first_drafter,
    )
    if branches == "vp" and redraft_min != float("inf"):
        check_rows(
            model,
            prompts,
            "boundary_pool" if boundary_pool is not None else "k",
            pool,
            pool * gamma,
            "boundary_pool * (draft_len + 1)",
            drafter=first_drafter,
        )
    roles = {"drafter": first_drafter}
    columns = None
    if branches == "vp":
        vp_drafter = resolve_drafter(vp, model, "vp")  # resolved (and checked) even when gated off
        if prior_weight:
            columns = vocab_map(first_drafter.draft_vocab, vp_drafter.draft_vocab, model.config.vocab_size).to(
                model.device
            )
        if redraft_min != float("inf"):
            # (a VP-drafter that never re-drafts needs no context: its per-token commits would cost)
            roles["vp_drafter"] = vp_drafter
    run = SpeculativeRun(model, roles, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, progress=progress)
    run.time["tree_s"] = 0.0
    dev = model.device
    offsets = torch.arange(gamma, device=dev)
    generator = request_streams(generator, len(prompts), dev)  # one random stream per request
    resample_gen = generator
    if branches == "resample" and generator is None:
        # greedy decoding still needs random branches: fixed private streams, reproducible
        resample_gen = RequestStreams.seeded(0, len(prompts), dev)
    nodes_total = redrafted = pairs = 0
    chains = {}  # DFlash's causal masks, for cycles that do not re-draft
    finder = PromptLookup(prompts, run.outputs, num_drafts=lookup) if lookup else None

    def dflash_cycle(logits, vocab, positions, t0, top=None) -> bool:
        nonlocal nodes_total, pairs
        if tree is None:
            alive, drafts = chain_cycle(run, logits, vocab, positions, row_cost, temperature, generator, t0, chains)
        else:
            alive, drafts = tree_cycle(
                run, logits, vocab, positions[:, 0], tree, row_cost, temperature, generator, t0, finder, top
            )
        nodes_total += drafts + len(positions)
        pairs += len(positions)
        return alive

    live = run.start(temperature, generator)
    while live:
        t0 = time.perf_counter()
        positions = run.lengths[:, None] + offsets
        logits, vocab = draft_block(first_drafter, run.contexts["drafter"], run.anchor, positions, gamma)
        run.nfe["drafter"] += 1
        if redraft_min == float("inf"):  # never re-drafts: nothing to score
            live = dflash_cycle(logits, vocab, positions, t0)
            continue
        scale = temperature if temperature > 0 else 1.0
        if tree is None:
            stats = token_stats(logits, temperature=scale)
            first, first_probs = vocab_ids(require_finite(stats.token, "drafter"), vocab), stats.prob  # [B, L]
        else:
            top_i, top_p = topk_tokens(logits, min(TREE_TOP_K, logits.shape[-1]), temperature=scale)
            require_finite(top_i[..., 0], "drafter")
            top_i = vocab_ids(top_i, vocab)
            first, first_probs = top_i[..., 0], top_p[..., 0]
        # requests re-drafted this cycle (all of them unless redraft_min gates)
        wanted = torch.ones(first.shape[0], dtype=torch.bool, device=dev)
        if branches == "vp":
            lengths, reach = rejection_boundaries(first_probs, pool)
            if redraft_min > 0:
                wanted = reach[:, :k].sum(1) >= redraft_min
                if not bool(wanted.any()):  # nobody re-drafts: DFlash's own cycle
                    live = dflash_cycle(logits, vocab, positions, t0, None if tree is None else (top_i, top_p))
                    continue
            prior = first_prior(logits, columns, float(prior_weight)) if prior_weight else None
            alt, alt_probs = redraft(
                roles["vp_drafter"],
                run.contexts["vp_drafter"],
                run.anchor,
                first,
                lengths,
                positions,
                gamma,
                with_probs=True,
                prior=prior,
            )
            run.nfe["vp_drafter"] += 1
            if pool > k:  # keep the k branches most likely to be accepted past their boundary
                head = alt_probs.gather(2, lengths[..., None]).squeeze(-1)
                keep = (reach * head).topk(k, dim=1).indices
                lengths = lengths.gather(1, keep)
                alt = alt.gather(1, keep[..., None].expand(-1, -1, alt.shape[2]))
                alt_probs = alt_probs.gather(1, keep[..., None].expand(-1, -1, alt_probs.shape[2]))
            if redraft_min > 0:  # a request not re-drafted has no branch nodes to prune
                alt_probs = alt_probs * wanted[:, None, None]
            if row_cost is not None:
                first_keep, branch_keep = prune_tree(first_probs, alt_probs, lengths, float(row_cost))
        else:
            q = torch.softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            u = resample_gen.uniforms(run.rows, k * q.shape[1]).view(q.shape[0], k, q.shape[1])
            alt = vocab_ids(require_finite(sample_from(q[:, None].expand(-1, k, -1, -1), u), "drafter"), vocab)
            lengths = torch.zeros(q.shape[0], k, dtype=torch.int64, device=dev)
        if tree is not None:
            first_tree = tuple(
                t.cpu().numpy() for t in draft_tree(top_p, top_i, tree, run.anchor, positions[:, 0], row_cost)[:3]
            )
        parts = [run.anchor[:, None], first, lengths, alt.flatten(1)]
        if row_cost is not None:
            parts += [first_keep[:, None], branch_keep]
        parts.append(wanted[:, None].long())
        host = torch.cat(parts, 1).cpu()
        sync_device(dev)
        t1 = time.perf_counter()
        # branch 0 the first draft, branch 1 + j the j-th re-draft (its first n_j tokens the
        # first draft's), as one [B, K + 1, L] array; lengths cut them where pruning did
        big_l = gamma - 1
        anchors, prefix = host[:, 0], host[:, gamma : gamma + k]
        branch_tokens = torch.cat(
            [host[:, None, 1:gamma], host[:, gamma + k : gamma + k + k * big_l].view(-1, k, big_l)], 1
        )
        branch_len = torch.full((host.shape[0], k + 1), big_l, dtype=torch.int64)
        if row_cost is not None:
            # kept nodes only; a branch with no kept node shrinks to a path of the kept draft
            keep_first, keep_branch = host[:, -k - 2], host[:, -k - 1 : -1]
            branch_len[:, 0] = keep_first
            # (a union tree holds the first draft's kept path already: nothing to add)
            fallback = torch.minimum(prefix, keep_first[:, None]) if tree is None else torch.zeros_like(prefix)
            branch_len[:, 1:] = torch.where(keep_branch > 0, prefix + keep_branch, fallback)
        skipped = host[:, -1] == 0
        branch_len[:, 1:][skipped] = 0
        redrafted += int(host.shape[0] - skipped.sum())
        pairs += host.shape[0]
        chain = counts = None
        if finder is not None:
            chain, counts = finder.drafts(run.rows)
        if tree is None:
            if chain is not None:
                width = max(big_l, chain.shape[1])
                branch_tokens = torch.cat(
                    [
                        nn.functional.pad(branch_tokens, (0, width - big_l)),
                        nn.functional.pad(torch.from_numpy(chain).clamp_(min=0), (0, width - chain.shape[1]))[:, None],
                    ],
                    1,
                )
                branch_len = torch.cat([branch_len, torch.from_numpy(counts)[:, None]], 1)
            merged = padded_prefix_tree(branch_tokens, branch_len, anchors, device=dev)
            tree_tokens, tree_parents, tree_words = merged.tokens, merged.parents, merged.words
            tree_pos = run.lengths[:, None] + merged.positions
        else:
            tree_tokens, tree_parents, tree_pos = union_tree(
                first_tree, branch_tokens[:, 1:], branch_len[:, 1:], chain, counts
            )
            tree_tokens, tree_parents, tree_pos = (
                torch.from_numpy(a).to(dev) for a in (tree_tokens, tree_parents, tree_pos)
            )
            tree_words = tree_mask(tree_parents).words
        t2 = time.perf_counter()
        nodes_total += int((tree_parents >= 0).sum()) + len(anchors)
        live = run.verify_tree_cycle(tree_tokens, tree_parents, tree_pos, tree_words, temperature, generator)
        sync_device(dev)
        t3 = time.perf_counter()
        run.time["draft_s"] += t1 - t0
        run.time["tree_s"] += t2 - t1
        run.time["verify_s"] += t3 - t2
    if branches == "vp":
        run.nfe.setdefault("vp_drafter", 0)  # reported 0 where the gate kept it off
    return run.generated, run.stats(
        k=k,
        branches=branches,
        draft_len=gamma - 1,
        lookup=lookup,
        tree=tree,
        row_cost=row_cost,
        boundary_pool=pool,
        prior_weight=float(prior_weight),
        tree_nodes=nodes_total / run.cycles if run.cycles else 0.0,
        redraft_min=None if redraft_min == float("inf") else redraft_min,
        redraft_rate=redrafted / pairs if pairs else 0.0,
    )


OPTIONS = ("draft_len", "k", "branches", "row_cost", "lookup", "tree", "redraft_min", "boundary_pool", "prior_weight")
#: ``preset="paper"``: D2SD as published -- the VP drafter re-drafts at the top-K boundaries in
#: every cycle, the first draft a chain, every branch verified in full, no prompt-lookup branch,
#: no first-drafter prior
PAPER = dict(branches="vp", row_cost=None, lookup=None, tree=None, redraft_min=0, boundary_pool=None, prior_weight=0.0)
DRAFTER = "block"  # a BlockDrafter, its directory or a shipped drafter name (see resolve_drafter)
decode = decode_d2sd
