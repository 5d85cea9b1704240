"""Lossless self-speculative decoding for block-causal dLLMs: the engine of ``ssd`` and ``spiffy``.

The reference is ``diffusion`` with one token per step (block-causal path): at a *state*
(the current block's tokens, [MASK] where undecided, the committed prefix in the KV cache)
the model forwards the block; every masked slot gets a choice (argmax, or a draw of the
shared sampler) and a confidence (the choice's probability); the *step* unmasks the most
confident masked slot (ties to the lower slot).  A complete block's KV is committed by the
next block's first forward (its last logits are the carry of right-shifted models); the
request's final block is never forwarded again.

Self-speculation walks that same sequence of states several steps per forward.  A state S
whose logits are known (from the previous forward) gives:

- its exact step (slot ranked 0, its choice): node ``(0, 0)``, the *root* c0 = S + step(S);
- candidate steps ``(i, j)``: the slot of confidence rank i at S (among S's masked slots)
  set to its j-th candidate token at S (j = 0: S's choice; j >= 1: S's most likely tokens
  other than the choice, in order).

A *draft graph* (a DAG) holds states c0 + a set of candidate steps; node ``{(0,0), a, b}``
is a child of ``{(0,0), a}`` and of ``{(0,0), b}`` when both are in the graph (multi-parent).
SSD's graph is the chain {(0,0)}, {(0,0),(1,0)}, ... (plus, with ``mixed_order``, the
swapped siblings c_k + (k+2, 0), which reach c_{k+2} when two drafts come out of order);
Spiffy's graph is calibrated offline (:mod:`dspec.decode.spiffy_graph`) and pruned online.

One forward evaluates every kept node as its own copy of the block (bidirectional within
itself, seeing only the committed prefix: :func:`dspec.masks.ssd_copies`), plus -- when a
kept node completes the block -- the next block's all-[MASK] first state attached to that
*anchor* node (it sees the anchor copy as its preceding block, as the model's block-causal
attention would see the committed block).  Verification walks the graph from the root: at
node u (an exact state, its logits computed in this forward) the reference's real step is
computed exactly as ``diffusion`` computes it (argmax, or a fresh draw of the shared
sampler); if u has a kept child whose added step equals it, that child is the exact next
state and the walk moves on; else it stops at u.  Stopping at u costs nothing: u's logits
are known, so u is the next round's S (its step is the next round's root: no extra draft
forward).  Reaching the anchor moves on to the next block's first state, and the anchor
copy's KV (bit-for-bit the keys/values of a commit forward of that block) and last logits
(the carry) are committed.  A greedy request whose state is one step from completing the
block that ends it finishes without a forward: that step is S's choice at its last masked
slot, and nothing would read the block's KV (so no method forwards more than ``diffusion``).

Sampling (temperature > 0): each verified node's step is a fresh draw with the shared
sampler (a token per masked slot from softmax(logits / T), then the most confident slot),
independent of the drafts; the child is accepted only when that draw equals its step.  So
every committed step is drawn from the reference's own conditional distribution at the
true state, and the output has exactly the distribution of one-token-per-step sampling
diffusion (the draws differ from ``diffusion``'s own, the distribution does not).

Batch: every request keeps its own state, graph walk, block position and cache length;
rows advance by different amounts and leave the batch when done.

Host syncs per round: one small read before the forward (how many copies to forward and
whether a next-block state is needed: forwarding the worst case instead would avoid it at
the price of compute) and one after it (accepted steps and committed blocks, for the
output lists, EOS and the cache commit, whose index lives on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .. import _backend
from ..masks import ssd_copies
from ..models import AttentionPlan
from ..ops import topk_tokens
from ..ops.masks import pack_mask
from .diffusion import PromptTails, prefill_prompt_blocks
from .outputs import OutputBuffer
from .sampling import non_finite_error, request_streams, require_finite
from .unmask import choose, log_probs, rank_masked

Step = tuple[int, int]


@dataclass(frozen=True)
class DraftGraph:
    """A draft graph over candidate steps ``(i, j)`` (position rank, candidate rank).

    nodes : tuple of nodes, each a sorted tuple of distinct-``i`` steps containing
        ``(0, 0)``; node 0 is the root ``((0, 0),)``; parents come before children.
    Edges are implied: node b is a child of node a when b = a + one step.
    """

    nodes: tuple[tuple[Step, ...], ...]
    counts: tuple[int, ...] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        nodes = self.nodes
        if not nodes or tuple(nodes[0]) != ((0, 0),):
            raise ValueError("nodes[0] must be the root ((0, 0),)")
        seen = {}
        for n, node in enumerate(nodes):
            node = tuple(tuple(int(x) for x in s) for s in node)
            if any(len(s) != 2 or s[0] < 0 or s[1] < 0 for s in node):
                raise ValueError(f"nodes[{n}] must hold (i, j) steps with i, j >= 0, got {node}")
            ranks = [s[0] for s in node]
            if len(set(ranks)) != len(ranks) or (0, 0) not in node:
                raise ValueError(f"nodes[{n}] must contain (0, 0) and distinct position ranks, got {node}")
            key = frozenset(node)
            if key in seen:
                raise ValueError(f"nodes[{n}] repeats nodes[{seen[key]}]")
            if n and not any(key - {s} in seen for s in key if s != (0, 0)):
                raise ValueError(f"nodes[{n}] = {node} has no parent among the nodes before it")
            seen[key] = n
        if self.counts is not None and len(self.counts) != len(nodes):
            raise ValueError("counts must have one entry per node")

    # ------------------------------------------------------------------ derived tables
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def max_rank(self) -> int:
        """1 + the largest position rank used."""
        return 1 + max(s[0] for node in self.nodes for s in node)

    @property
    def num_candidates(self) -> int:
        """1 + the largest candidate rank used (J)."""
        return 1 + max(s[1] for node in self.nodes for s in node)

    @property
    def depth(self) -> int:
        """Longest path from the root, in edges."""
        return max(len(node) for node in self.nodes) - 1

    def parents(self) -> list[list[int]]:
        index = {frozenset(node): n for n, node in enumerate(self.nodes)}
        return [
            [index[frozenset(node) - {s}] for s in node if s != (0, 0) and frozenset(node) - {s} in index]
            for node in self.nodes
        ]

    def tables(self, device) -> dict:
        """Tensors the engine needs, cached per device.

        assign [M, I]: candidate rank j of position rank i in the node, or -1;
        size [M]: steps in the node; top_rank [M]: its largest position rank;
        next_node [M, I, J]: the child reached by adding step (i, j), or -1.
        """
        key = str(device)
        if key in self._cache:
            return self._cache[key]
        m, big_i, big_j = self.num_nodes, self.max_rank, self.num_candidates
        assign = torch.full((m, big_i), -1, dtype=torch.int64)
        nxt = torch.full((m, big_i, big_j), -1, dtype=torch.int64)
        index = {frozenset(node): n for n, node in enumerate(self.nodes)}
        for n, node in enumerate(self.nodes):
            for i, j in node:
                assign[n, i] = j
            for s in node:
                if s != (0, 0):
                    parent = index.get(frozenset(node) - {s})
                    if parent is not None:
                        nxt[parent, s[0], s[1]] = n
        size = torch.tensor([len(node) for node in self.nodes], dtype=torch.int64)
        top = torch.tensor([max(i for i, _ in node) for node in self.nodes], dtype=torch.int64)
        out = {k: v.to(device) for k, v in dict(assign=assign, size=size, top_rank=top, next_node=nxt).items()}
        out["parents"] = parents = self.parents()
        # the same tables packed for dspec._C.selfspec_* (parents as CSR)
        ptr = torch.tensor([0] + [len(p) for p in parents], dtype=torch.int64).cumsum(0)
        idx = torch.tensor([q for p in parents for q in p], dtype=torch.int64)
        out["packed"] = torch.cat([assign.reshape(-1), size, top, nxt.reshape(-1), ptr, idx])
        out["num_parents"] = int(idx.numel())
        self._cache[key] = out
        return out


def chain_graph(draft_len: int, mixed_order: bool = False) -> DraftGraph:
    """SSD's graph: c_k = {(0,0), ..., (k,0)} for k = 0..draft_len; with ``mixed_order`` also
    s_k = c_k + (k+2, 0) for k = 0..draft_len-2, the state after two drafts came out of order
    (c_k -> s_k -> c_{k+2}: a node verifies its grandchild)."""
    chain = [tuple((i, 0) for i in range(k + 1)) for k in range(draft_len + 1)]
    nodes = [chain[0]]
    for k in range(1, draft_len + 1):
        if mixed_order and k >= 2:
            nodes.append(chain[k - 2] + ((k, 0),))  # s_{k-2}: a parent of c_k
        nodes.append(chain[k])
    return DraftGraph(tuple(nodes))


def candidates(logits: torch.Tensor, choice: torch.Tensor, num: int, temperature: float):
    """Candidate tokens per slot: the choice, then the most likely other tokens.

    logits [..., V], choice [...] -> (tokens [..., num], log-probabilities [..., num]).
    """
    if num == 1:
        return choice[..., None], log_probs(logits, choice[..., None], temperature)
    top, _ = topk_tokens(logits.float(), min(num, logits.shape[-1]))
    is_choice = top == choice[..., None]
    # drop the choice from the top list (stable: keeps probability order), put it first
    rest = top.gather(-1, torch.sort(is_choice.to(torch.int8), dim=-1, stable=True).indices)
    cand = torch.cat([choice[..., None], rest[..., : num - 1]], -1)
    return cand, log_probs(logits, cand, temperature)


_MASKS: dict = {}


def _copies_mask(block_size: int, copies: int, device) -> torch.Tensor:
    """Dense bool mask of :func:`dspec.masks.ssd_copies` (cached: built once per shape)."""
    key = (block_size, copies, str(device))
    if key not in _MASKS:
        _MASKS[key] = ssd_copies(block_size, copies, device=device).dense()
    return _MASKS[key]


def _choose(logits_of, masked: torch.Tensor, temperature: float, uniforms=None):
    """Every masked slot's choice and confidence, exactly as ``diffusion`` computes them
    (at T > 0 with ``uniforms`` [..., bs], one per slot).

    logits_of(rows) -> [K, V]: the logits of the flat slots ``rows`` (int64 [K]; None: every
    slot); masked [..., bs] -> (choice [..., bs] int64, confidence [..., bs], -1 where
    not masked).  On the CPU only the masked rows are scored (the rows are independent, so
    the values are those of scoring everything); on an accelerator every row is scored,
    which avoids the host sync of selecting them.
    """
    need = masked.reshape(-1)
    choice = torch.zeros(need.shape, dtype=torch.int64, device=masked.device)
    conf = torch.full(need.shape, -1.0, device=masked.device)
    if masked.device.type == "cpu":
        rows = need.nonzero()[:, 0]
        if rows.numel():
            u = None if uniforms is None else uniforms.reshape(-1).index_select(0, rows)
            choice[rows], conf[rows] = choose(logits_of(rows), temperature, uniforms=u)
    else:
        choice, every = choose(logits_of(None), temperature, uniforms=uniforms)
        conf = torch.where(need, every, conf)
    return choice.view(masked.shape), conf.view(masked.shape)


@dataclass
class SelfSpecStats:
    rounds: int = 0
    steps: int = 0
    verify_rows: int = 0
    drafts: int = 0
    accepted_drafts: int = 0
    histogram: dict = field(default_factory=dict)
    nodes_forwarded: int = 0
    free_steps: int = 0  # last steps of a request's final block, taken without a forward


def check_common(model, method: str, block_size):
    if model.mask_token_id is None:
        raise ValueError(f"method {method!r} needs a masked-diffusion model; {model.family!r} has no mask token")
    if model.attention != "block_causal":
        raise ValueError(
            f"method {method!r} runs block-causal models (SDAR, Fast-dLLM v2) with an exact "
            f"KV cache; {model.family!r} attends {model.attention!r}"
        )
    bs = block_size if block_size is not None else model.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"block_size must be an int >= 1, got {bs!r}")
    return bs


class SelfSpecEngine:
    """The batch's state (rows = requests still running) and one round of the engine per
    :meth:`round`: expand the draft graph at each row's state, forward the kept nodes, walk
    the graph along the real steps, commit, and account."""

    def __init__(
        self,
        model,
        prompts,
        *,
        graph,
        prune_to,
        max_new_tokens,
        temperature,
        generator,
        eos_ids,
        progress,
        block_size,
        trace,
        num_candidates,
    ):
        dev = self.dev = model.device
        bs = self.bs = block_size
        self.model, self.graph, self.prune_to = model, graph, prune_to
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.progress, self.trace, self.prompts = progress, trace, prompts
        batch = self.batch = len(prompts)
        self.streams = request_streams(generator, batch, dev)  # one random stream per request
        self.mask_id, self.vocab = model.mask_token_id, model.config.vocab_size
        self.tab = graph.tables(dev)
        self.num_nodes, self.big_j = graph.num_nodes, max(graph.num_candidates, num_candidates)
        self.ranks_used = min(graph.max_rank, bs)
        self.slots = torch.arange(bs, device=dev)
        self.node_ids = torch.arange(self.num_nodes, device=dev)

        self.cache = model.new_cache(batch)
        plen = torch.tensor([len(p) for p in prompts], device=dev)
        start = (plen // bs) * bs  # first position of each request's first block
        self.carry, self.forwards = prefill_prompt_blocks(model, prompts, self.cache, bs)
        self.suffix_tokens = 0  # block tokens forwarded after the prefill (compute proxy)

        self.tokens, in_prompt = PromptTails(prompts, self.mask_id, bs, dev).block(start)
        self.masked = ~in_prompt
        self.known = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.choice = torch.zeros(batch, bs, dtype=torch.int64, device=dev)
        self.conf = torch.full((batch, bs), -1.0, device=dev)
        self.cand = torch.zeros(batch, bs, self.big_j, dtype=torch.int64, device=dev)
        self.cand_logp = torch.zeros(batch, bs, self.big_j, device=dev)
        self.rows = np.arange(batch)  # live batch row -> request index
        self.prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
        self.outputs = OutputBuffer(batch, max_new_tokens, eos_ids)
        self.shown = np.zeros(batch, dtype=np.int64)  # steps reported to the progress bar per request
        self.st = SelfSpecStats()
        # greedy on the CPU: the round's host-side work in three compiled calls (the torch
        # composition below is their reference, and the path for sampling and tracing)
        ext = _backend.extension()
        self.native = (
            ext
            if dev.type == "cpu"
            and temperature <= 0
            and trace is None
            and ext is not None
            and hasattr(ext, "selfspec_expand")
            and model.dtype in _backend.FLOAT_CODE
            else None
        )
        self.ws = None
        if self.native is not None:
            self.carry = self.carry.float().contiguous().clone()  # updated in place

    def _native_workspace(self) -> SimpleNamespace:
        """Buffers of the compiled round for the current rows (rebuilt when rows leave)."""
        a_rows, bs, m, big_j, dev = len(self.rows), self.bs, self.num_nodes, self.big_j, self.dev
        if self.ws is not None and self.ws.rows == a_rows:
            return self.ws
        n_max = (m + 1) * bs
        nbytes = self.native.selfspec_workspace_bytes(a_rows, bs, m, big_j)
        i64 = dict(dtype=torch.int64, device=dev)
        self.ws = SimpleNamespace(
            rows=a_rows,
            nbytes=nbytes,
            scratch=torch.empty(nbytes, dtype=torch.uint8, device=dev),
            suffix=torch.empty(a_rows * n_max, **i64),
            positions=torch.empty(a_rows * n_max, **i64),
            words=torch.empty(a_rows * n_max * ((n_max + 31) // 32), dtype=torch.int32, device=dev),
            logp=torch.empty(a_rows * n_max, device=dev),
            conf=torch.empty(a_rows * n_max, device=dev),
            host=torch.empty(a_rows, 2 * bs + 4, **i64),
            keep=torch.empty(a_rows, bs, **i64),
            spare=dict(
                tokens=torch.empty(a_rows, bs, **i64),
                masked=torch.empty(a_rows, bs, dtype=torch.bool),
                known=torch.empty(a_rows, dtype=torch.bool),
                choice=torch.empty(a_rows, bs, **i64),
                conf=torch.empty(a_rows, bs),
                cand=torch.empty(a_rows, bs, big_j, **i64),
                cand_logp=torch.empty(a_rows, bs, big_j),
            ),
        )
        return self.ws

    def _native_round(self) -> np.ndarray:
        """One round through dspec._C.selfspec_expand / _score / _advance (greedy, CPU): the
        same transitions as expand / forward / walk / advance; returns which rows finished
        (bool [A])."""
        ext, tab, bs, a_rows, big_j = self.native, self.tab, self.bs, len(self.rows), self.big_j
        graph = self.graph
        ws = self._native_workspace()
        g_args = (
            tab["packed"].data_ptr(),
            graph.num_nodes,
            graph.max_rank,
            graph.num_candidates,
            graph.depth,
            tab["num_parents"],
        )
        state = (
            self.conf.data_ptr(),
            self.masked.data_ptr(),
            self.known.data_ptr(),
            self.tokens.data_ptr(),
            self.cand.data_ptr(),
            self.cand_logp.data_ptr(),
        )
        lengths = self.cache.lengths
        copies, need_next = ext.selfspec_expand(
            *g_args,
            *state,
            lengths.data_ptr(),
            a_rows,
            bs,
            big_j,
            -1 if self.prune_to is None else self.prune_to,
            self.mask_id,
            ws.scratch.data_ptr(),
            ws.nbytes,
            ws.suffix.data_ptr(),
            ws.positions.data_ptr(),
            ws.words.data_ptr(),
        )
        segments = copies + int(need_next)
        n = segments * bs
        plan = AttentionPlan(
            ws.suffix[: a_rows * n].view(a_rows, n),
            ws.positions[: a_rows * n].view(a_rows, n),
            ws.words[: a_rows * n * ((n + 31) // 32)].view(a_rows, n, -1),
            self.cache,
        )
        out = self.model(plan, return_kv=True)
        self.forwards += 1
        self.suffix_tokens += a_rows * n
        logits = out.logits
        if logits.stride(-1) != 1 or logits.stride(0) != n * logits.stride(1):
            logits = logits.contiguous()
        vocab, dtype = logits.shape[-1], _backend.FLOAT_CODE[logits.dtype]
        ext.selfspec_score(
            ws.scratch.data_ptr(),
            ws.nbytes,
            a_rows,
            bs,
            graph.num_nodes,
            big_j,
            copies,
            need_next,
            logits.data_ptr(),
            dtype,
            logits.stride(1),
            vocab,
            self.carry.data_ptr(),
            self.model.shifted,
            ws.logp.data_ptr(),
        )
        # a non-finite logits row scores NaN (its choice is the ops' -1 mark): stop here, as
        # the torch path's choose does (require_finite), before the round commits anything
        if bool(torch.isnan(ws.logp[: a_rows * n]).any()):
            raise non_finite_error()
        # the confidences as the torch path computes them (one vectorised exp, no other copy)
        torch.exp(ws.logp[: a_rows * n], out=ws.conf[: a_rows * n])
        new = ws.spare
        committed = ext.selfspec_advance(
            *g_args,
            *state,
            a_rows,
            bs,
            big_j,
            copies,
            need_next,
            self.mask_id,
            ws.conf.data_ptr(),
            logits.data_ptr(),
            dtype,
            logits.stride(1),
            vocab,
            self.carry.data_ptr(),
            ws.scratch.data_ptr(),
            ws.nbytes,
            new["conf"].data_ptr(),
            new["masked"].data_ptr(),
            new["known"].data_ptr(),
            new["tokens"].data_ptr(),
            new["choice"].data_ptr(),
            new["cand"].data_ptr(),
            new["cand_logp"].data_ptr(),
            ws.host.data_ptr(),
            ws.keep.data_ptr(),
        )
        ws.spare = {name: getattr(self, name) for name in new}
        for name, t in new.items():
            setattr(self, name, t)
        require_finite(self.tokens)  # a row of +inf scores no NaN but steps to the -1 mark
        if committed:
            self.cache.append(out.suffix_kv, keep=ws.keep)
        return self.account(SimpleNamespace(base=lengths), ws.host.numpy(), (self.tokens.numpy(), self.masked.numpy()))

    def round(self) -> bool:
        """One forward and every row's transition; False when no row is left."""
        finished = self._native_round() if self.native is not None else self._torch_round()
        self.st.rounds += 1
        if finished.any():
            self.drop(finished)
        return len(self.rows) > 0

    def _torch_round(self) -> np.ndarray:
        """One round as torch ops (the compiled round's reference); returns which rows
        finished (bool [A])."""
        r = self.expand()
        self.forward(r)
        self.walk(r)
        return self.account(r, self.advance(r))

    def expand(self) -> SimpleNamespace:
        """Each row's graph nodes at its state S (tokens, masks, validity), pruned online;
        the anchor (a kept node completing the block) and the copies to forward."""
        tab, bs, dev, big_j, num_nodes = self.tab, self.bs, self.dev, self.big_j, self.num_nodes
        tokens, masked, known, slots = self.tokens, self.masked, self.known, self.slots
        r = SimpleNamespace(a_rows=len(self.rows))
        a_rows = r.a_rows
        _, r.order, r.rank = rank_masked(self.conf, masked)  # [A, bs]
        mcount = masked.sum(1)
        r.cand_r = self.cand.gather(1, r.order[..., None].expand(-1, -1, big_j))  # by rank
        logp_r = self.cand_logp.gather(1, r.order[..., None].expand(-1, -1, big_j))
        node_tokens = tokens[:, None, :].expand(a_rows, num_nodes, bs)
        filled = torch.zeros(a_rows, num_nodes, bs, dtype=torch.bool, device=dev)
        logp_sum = torch.zeros(a_rows, num_nodes, device=dev)
        for i in range(self.ranks_used):
            j = tab["assign"][:, i]
            has = j >= 0
            jc = j.clamp(min=0)
            put = has[None, :, None] & (slots[None, None, :] == r.order[:, i, None, None])
            node_tokens = torch.where(put, r.cand_r[:, i, :][:, jc][:, :, None], node_tokens)
            filled |= put
            logp_sum = logp_sum + torch.where(has[None], logp_r[:, i, :][:, jc], 0.0)
        # a row whose logits are unknown forwards its state itself as node 0
        r.node_tokens = torch.where(known[:, None, None], node_tokens, tokens[:, None, :])
        filled &= known[:, None, None]
        r.node_masked = masked[:, None, :] & ~filled
        fits = (tab["top_rank"] < bs)[None] & (tab["top_rank"][None] < mcount[:, None])
        valid = torch.where(known[:, None], fits, self.node_ids[None] == 0)
        r.complete = valid & known[:, None] & (tab["size"][None] == mcount[:, None])

        # online pruning: geometric-mean probability, made monotone along paths
        score = torch.where(valid, logp_sum / tab["size"][None].float(), float("-inf"))
        if self.prune_to is not None and self.prune_to < num_nodes - 1:
            closed = score.clone()
            closed[:, 0] = float("inf")
            for n in range(1, num_nodes):
                par = tab["parents"][n]
                best = closed[:, par].max(1).values
                closed[:, n] = torch.minimum(score[:, n], best)
            top = torch.sort(closed, dim=1, descending=True, stable=True).indices[:, : self.prune_to + 1]
            r.kept = torch.zeros_like(valid).scatter_(1, top, True) & valid
        else:
            closed = score
            r.kept = valid
        anchor_ok = r.complete & r.kept
        r.has_anchor = anchor_ok.any(1)
        r.anchor = torch.where(anchor_ok, closed, float("-inf")).argmax(1)  # first best
        r.num_kept = r.kept.sum(1)
        info = torch.stack([r.num_kept.max(), r.has_anchor.any().to(torch.int64)]).tolist()  # host sync 1
        r.copies, r.need_next = int(info[0]), bool(info[1])
        return r

    def forward(self, r) -> None:
        """Forward the kept nodes as copies of the block (kept first, node order), plus the
        next block's first state after the anchor copy; each copy's choices and confidences."""
        bs, dev, a_rows, copies, vocab = self.bs, self.dev, r.a_rows, r.copies, self.vocab
        copy_node = torch.sort((~r.kept).to(torch.int8), dim=1, stable=True).indices[:, :copies]
        r.node_copy = torch.full((a_rows, self.num_nodes), -1, dtype=torch.int64, device=dev)
        r.node_copy.scatter_(1, copy_node, torch.arange(copies, device=dev).expand(a_rows, -1))
        r.node_copy = torch.where(r.kept, r.node_copy, -1)
        suffix = r.node_tokens.gather(1, copy_node[..., None].expand(-1, -1, bs))  # [A, K, bs]
        cmasked = r.node_masked.gather(1, copy_node[..., None].expand(-1, -1, bs))
        segments = copies + int(r.need_next)
        dense = _copies_mask(bs, segments, dev).expand(a_rows, -1, -1).clone()
        offsets = self.slots.repeat(segments)
        anchor_copy = r.node_copy.gather(1, r.anchor[:, None])[:, 0].clamp(min=0)
        if r.need_next:
            suffix = torch.cat([suffix, torch.full((a_rows, 1, bs), self.mask_id, dtype=torch.int64, device=dev)], 1)
            cmasked = torch.cat([cmasked, torch.ones(a_rows, 1, bs, dtype=torch.bool, device=dev)], 1)
            offsets = offsets.clone()
            offsets[copies * bs :] += bs
            # the next block's state sees its anchor copy as the committed block before it
            key_copy = torch.arange(segments * bs, device=dev) // bs
            sees = (key_copy[None] == anchor_copy[:, None]) & r.has_anchor[:, None]  # [A, N]
            dense[:, copies * bs :, :] |= sees[:, None, :]
        r.base = self.cache.lengths.to(dev)
        plan = AttentionPlan(
            suffix.reshape(a_rows, segments * bs), r.base[:, None] + offsets, pack_mask(dense), self.cache
        )
        r.out = self.model(plan, return_kv=True)
        self.forwards += 1
        self.suffix_tokens += a_rows * segments * bs
        # the logits stay as the model gives them; only the rows a step reads are taken
        # (slot_logits): a float32 copy of every row cost more than the steps' own work at
        # dozens of rows x the vocabulary
        r.raw = r.out.logits.view(a_rows, segments, bs, vocab)
        r.anchor_copy, r.segments = anchor_copy, segments
        u = None
        if self.streams is not None:
            # a row's draw: the next block's state in its first bs uniforms, copy k in the
            # (k + 1)-th bs, so a row's uniforms do not move with the batch's copy count
            drawn = self.streams.uniforms(self.rows, (copies + 1) * bs).view(a_rows, copies + 1, bs)
            u = torch.cat([drawn[:, 1:], drawn[:, :1]], 1) if r.need_next else drawn[:, 1:]
        r.c_choice, c_conf = _choose(lambda rows: self.slot_logits(r, rows), cmasked, self.temperature, u)
        r.c_conf = torch.where(cmasked, c_conf, torch.full_like(c_conf, -1.0))
        step_slot = r.c_conf.argmax(-1)  # first max: lower slot
        r.step_slot, r.step_tok = step_slot, r.c_choice.gather(-1, step_slot[..., None])[..., 0]

    def slot_logits(self, r, rows: torch.Tensor | None) -> torch.Tensor:
        """The logits that score block slots of this round's copies, [K, V]: ``rows`` index the
        flat [A, segments, bs] slots (None: all).  A right-shifted model scores slot j with row
        j - 1 of its copy and slot 0 with the carry -- for the next block's state, the last row
        of its anchor copy.  On the CPU in the model's dtype (the C++ scoring kernels widen
        bf16 exactly: the values ``diffusion`` scores after its float32 copy, tested), on
        other devices in float32 as ``diffusion`` has them."""
        bs, seg = self.bs, r.segments
        flat = r.raw.reshape(-1, self.vocab)
        if flat.device.type != "cpu":
            flat = flat.float()
        if rows is None:
            rows = torch.arange(flat.shape[0], device=self.dev)
        if not self.model.shifted:
            return flat.index_select(0, rows)
        out = flat.index_select(0, (rows - 1).clamp(min=0))
        first = (rows % bs == 0).nonzero()[:, 0]
        if first.numel():
            at = rows.index_select(0, first)
            a, s = at // (seg * bs), at // bs % seg
            carry = self.carry.index_select(0, a).to(out.dtype)  # exact: widened model logits
            if r.need_next:
                last = flat.index_select(0, (a * seg + r.anchor_copy.index_select(0, a)) * bs + bs - 1)
                carry = torch.where((s == r.copies)[:, None], last, carry)
            out.index_copy_(0, first, carry)
        return out

    def walk(self, r) -> None:
        """Walk the graph from the root along the real steps: the last exact node u."""
        graph, tab, big_j, known = self.graph, self.tab, self.big_j, self.known
        u = torch.zeros(r.a_rows, dtype=torch.int64, device=self.dev)
        for _ in range(graph.depth):
            c = r.node_copy.gather(1, u[:, None])[:, 0].clamp(min=0)
            slot = r.step_slot.gather(1, c[:, None])[:, 0]
            tok = r.step_tok.gather(1, c[:, None])[:, 0]
            i = r.rank.gather(1, slot[:, None])[:, 0]
            hit = self.cand.gather(1, slot[:, None, None].expand(-1, 1, big_j))[:, 0] == tok[:, None]
            j = torch.where(hit.any(1), hit.to(torch.int8).argmax(1), -1)
            ok = (i < graph.max_rank) & (j >= 0) & (j < graph.num_candidates) & known
            ok &= ~r.complete.gather(1, u[:, None])[:, 0]
            nxt = tab["next_node"][u, i.clamp(max=graph.max_rank - 1), j.clamp(min=0, max=graph.num_candidates - 1)]
            ok &= nxt >= 0
            ok &= r.kept.gather(1, nxt.clamp(min=0)[:, None])[:, 0]
            u = torch.where(ok, nxt, u)
        r.u = u
        r.final_copy = r.node_copy.gather(1, u[:, None])[:, 0]
        r.done_block = r.complete.gather(1, u[:, None])[:, 0]
        r.went_next = r.done_block & (u == r.anchor) & r.has_anchor
        r.steps = torch.where(known, tab["size"][u], 0)

    def advance(self, r) -> np.ndarray:
        """The next state of every row (u, or the next block's first state after the anchor),
        its candidates, the committed blocks' KV and carry; returns the round's host rows
        [A, 2 bs + 4] (see :meth:`account`)."""
        bs, vocab, u = self.bs, self.vocab, r.u
        done_block = r.done_block
        src = torch.where(r.went_next, r.copies, r.final_copy)
        pick = src[:, None, None]
        new_tokens = r.node_tokens.gather(1, u[:, None, None].expand(-1, 1, bs))[:, 0]
        new_masked = r.node_masked.gather(1, u[:, None, None].expand(-1, 1, bs))[:, 0]
        block_tokens = new_tokens
        new_tokens = torch.where(done_block[:, None], self.mask_id, new_tokens)
        new_masked = new_masked | done_block[:, None]
        self.choice = r.c_choice.gather(1, pick.expand(-1, 1, bs))[:, 0]
        conf = r.c_conf.gather(1, pick.expand(-1, 1, bs))[:, 0]
        arange = torch.arange(r.a_rows, device=self.dev)
        src_rows = ((arange * r.segments + src)[:, None] * bs + self.slots).reshape(-1)
        src_logits = self.slot_logits(r, src_rows).view(r.a_rows, bs, vocab)
        self.cand, self.cand_logp = candidates(src_logits, self.choice, self.big_j, self.temperature)
        self.conf = torch.where(new_masked, conf, torch.full_like(conf, -1.0))
        new_known = ~done_block | r.went_next
        # commit complete blocks: the KV and last logits of their copy
        commit_copy = r.final_copy.clamp(min=0)
        new_carry = r.raw[arange, commit_copy, bs - 1].float()
        self.carry = torch.where(done_block[:, None], new_carry, self.carry)

        # greedy: a known state one step from its block's end already holds that block (the
        # step is the choice at its last masked slot, as the next forward's root would pick)
        last_step = new_known & (new_masked.sum(1) == 1) & (self.temperature == 0)
        filled = torch.where(new_masked, self.choice, new_tokens)
        host = (
            torch.cat(
                [
                    done_block[:, None].to(torch.int64),
                    r.steps[:, None],
                    block_tokens,
                    r.num_kept[:, None],
                    last_step[:, None].to(torch.int64),
                    filled,
                    new_tokens,
                    new_masked.to(torch.int64),
                ],
                1,
            )
            .cpu()
            .numpy()
        )  # host sync 2
        if self.trace is not None:
            self.trace(
                dict(
                    rows=self.rows.tolist(),
                    known=self.known.tolist(),
                    tokens=self.tokens.tolist(),
                    order=r.order.tolist(),
                    cand=r.cand_r.tolist(),
                    host=host[:, : bs + 3].tolist(),
                )
            )
        keep = torch.where(done_block[:, None], commit_copy[:, None] * bs + self.slots, -1)
        if host[:, 0].any():
            self.cache.append(r.out.suffix_kv, keep=keep.cpu())
        self.tokens, self.masked, self.known = new_tokens, new_masked, new_known
        return host

    def account(self, r, host: np.ndarray, state=None) -> np.ndarray:
        """Statistics, progress and output tokens of the round; returns which rows finished
        (bool [A]).  ``host`` [A, 2 bs + 4]: committed, steps, the committed block, nodes kept,
        then (greedy) whether the next state is one step from its block's end and that
        block (the torch round appends the next state's block and mask, [A, 2 bs], which
        ``state`` otherwise gives); ``r.base``: each row's block start (cache length) before
        the round."""
        if state is None:
            bs = self.bs
            state = host[:, 2 * bs + 4 : 3 * bs + 4], host[:, 3 * bs + 4 :] != 0
        st, bs, req = self.st, self.bs, self.rows
        commit, n_steps, block, kept = host[:, 0] != 0, host[:, 1], host[:, 2 : 2 + bs], host[:, bs + 2]
        last_step, last_block = host[:, bs + 3] != 0, host[:, bs + 4 : 2 * bs + 4]
        st.nodes_forwarded += int(kept.sum())
        verified = n_steps > 0  # a verification round of a state with logits
        st.verify_rows += int(verified.sum())
        st.steps += int(n_steps.sum())
        st.drafts += int((kept[verified] - 1).sum())
        st.accepted_drafts += int((n_steps[verified] - 1).sum())
        for n, count in zip(*np.unique(n_steps[verified], return_counts=True)):  # histogram bins
            st.histogram[int(n)] = st.histogram.get(int(n), 0) + int(count)
        self._show(req[verified], n_steps[verified])
        base, plen = r.base.cpu().numpy(), self.prompt_len[req]
        finished = np.zeros(len(req), dtype=bool)
        c = np.flatnonzero(commit)
        if len(c):
            finished[c] = self.outputs.extend_block(req[c], block[c], base[c], plen[c])
        # no forward for a block that ends the request: nothing would read its KV
        f = np.flatnonzero(last_step & ~finished)
        if len(f):
            ends = self.outputs.extend_block(req[f], last_block[f], base[f] + bs * commit[f], plen[f], only_done=True)
            st.free_steps += int(ends.sum())
            self._show(req[f[ends]], np.ones(int(ends.sum()), dtype=np.int64))
            finished[f[ends]] = True
        # a block whose committed run already ends the request (an EOS, max_new_tokens) is
        # output as it stands: its later slots would never be output
        e = np.flatnonzero(~finished)
        if len(e):
            tokens, masked = state
            start = base + bs * commit
            e = e[self.outputs.block_ends(req[e], tokens[e], ~masked[e], start[e], plen[e])]
            if len(e):
                finished[e] = self.outputs.extend_block(req[e], tokens[e], start[e], plen[e])
        return finished

    def _show(self, requests: np.ndarray, steps: np.ndarray) -> None:
        """Advance the progress bar by each request's steps, never past max_new_tokens."""
        if self.progress is not None and len(requests):
            delta = np.minimum(steps, self.max_new_tokens - self.shown[requests])
            self.shown[requests] += delta
            self.progress.update(int(delta.sum()) / self.batch)

    @property
    def generated(self) -> list[list[int]]:
        return self.outputs.generated

    def drop(self, finished: np.ndarray) -> None:
        """Remove the finished rows (bool [A]) from the batch state and the cache."""
        stay = np.flatnonzero(~finished)
        self.rows = self.rows[stay]
        if not len(stay):
            return
        idx = torch.from_numpy(stay).to(self.dev)
        self.cache = self.cache.select(stay.tolist())
        for name in ("tokens", "masked", "known", "choice", "conf", "cand", "cand_logp", "carry"):
            setattr(self, name, getattr(self, name)[idx])

    def stats(self) -> dict:
        st = self.st
        return {
            "nfe": {"target": self.forwards},
            "mean_accepted": st.steps / max(st.verify_rows, 1),
            "accepted_hist": dict(sorted(st.histogram.items())),
            "drafts": st.drafts,
            "accepted_drafts": st.accepted_drafts,
            "free_steps": st.free_steps,
            "rounds": st.rounds,
            "suffix_tokens": self.suffix_tokens,
            "block_size": self.bs,
        }


@torch.no_grad()
def decode_self_speculative(
    model,
    prompts,
    *,
    graph: DraftGraph,
    prune_to: int | None,
    max_new_tokens: int,
    temperature: float,
    generator,
    eos_ids,
    progress,
    block_size: int,
    trace=None,
    num_candidates: int = 1,
):
    """Run the engine (see the module docstring); returns (tokens per request, stats dict).

    Parameters
    ----------
    graph : the draft graph (node 0 is the root, always forwarded).
    prune_to : keep at most this many non-root nodes per request and round, chosen by the
        geometric mean of their steps' candidate probabilities at S (monotone along paths,
        so the kept set is connected); None keeps every node that fits the block.
    trace : optional callable(event dict) for calibration (per round, on the host): rows
        (request ids), known, tokens / order (of each state S), cand (S's candidates by
        position rank), host (per row: committed flag, steps, block tokens, nodes).
    num_candidates : candidates kept per slot (at least the graph's J), for ``trace``.
    """
    engine = SelfSpecEngine(
        model,
        prompts,
        graph=graph,
        prune_to=prune_to,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        eos_ids=eos_ids,
        progress=progress,
        block_size=block_size,
        trace=trace,
        num_candidates=num_candidates,
    )
    while engine.round():
        pass
    return engine.generated, engine.stats()
