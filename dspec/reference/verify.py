"""Reference verify_chain and verify_tree (DESIGN.md "Verification").

Probabilities are ``p = exp((logit - max) / T) / sum`` in float32, the same formula every
backend uses.  A draw from weights ``w`` with uniform ``u`` is the smallest id v with
``cumsum(w)[v] > u * sum(w)`` (the largest id with ``w > 0`` if rounding leaves none).

Invalid positions: a target row holding a NaN or +inf, or only -inf, has no distribution.
Verification stops there: the draft at that position is rejected and the final token is -1
(greedy: the argmax is -1, which matches no draft).  NaN in ``draft_probs`` (which the
public wrapper rejects while value checks are on) likewise rejects and gives -1.  Nothing
crashes; the -1 is the documented signal.

``verify_chain(rule="block")`` is block verification (Sun et al., arXiv 2403.10444; see
:func:`_block_accept`): a row's first invalid target row cuts its drafts there, so a row that
reaches it gets final token -1 as with the token rule.
"""

from __future__ import annotations

import torch

from ..types import TreeVerifyOutput, VerifyOutput
from .token_stats import token_stats


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 via the shared formula; invalid rows become NaN."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    e = torch.exp((x - m) * (1.0 / temperature))
    return e / e.sum(-1, keepdim=True)


def draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from weights w [R, V] with uniforms u [R].

    The smallest v with ``cumsum(w)[v] > u * sum(w)``; the largest v with ``w > 0`` when
    rounding leaves none; -1 when ``sum(w)`` is 0 or not finite.
    """
    total = w.sum(-1)
    above = torch.cumsum(w, -1) > (u.float() * total)[:, None]
    first = above.int().argmax(-1)
    vocab = torch.arange(w.shape[-1], device=w.device)
    last_nonzero = torch.where(w > 0, vocab, -1).amax(-1)
    out = torch.where(above.any(-1), first, last_nonzero)
    return torch.where(torch.isfinite(total) & (total > 0), out, torch.full_like(out, -1))


def _residual_or_p(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Residual weights, or p itself where the residual is all zero (a valid, empty residual)."""
    total = w.sum(-1, keepdim=True)
    return torch.where((total > 0) | ~torch.isfinite(total), w, p)


def block_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """p(x) / q(x) of the block rule: +inf where q(x) = 0 < p(x), 0 where both are 0."""
    zero_q = torch.where(p_x > 0, torch.full_like(p_x, float("inf")), p_x * 0)
    return torch.where(q_x == 0, zero_q, p_x / torch.where(q_x == 0, 1.0, q_x))


def block_w_next(w: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``min(w * ratio, 1)``, 0 where w is 0 (even for an infinite ratio), NaN kept."""
    return torch.where(w == 0, w, torch.clamp(w * ratio, max=1.0))


def block_h(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``r / (r + (1 - w))``, 1 where that denominator is <= 0 (NaN kept)."""
    den = r + (1.0 - w)
    return torch.where(den <= 0, torch.ones_like(den), r / torch.where(den <= 0, 1.0, den))


def _block_accept(p, xg, p_x, q_x, draft_probs, n, coins):
    """Block verification (Sun et al., arXiv 2403.10444) of every row: (tau, w_tau, n_eff).

    ``n_eff`` is a row's draft count cut at its first invalid target row (that row then
    plays the bonus row's part, whose draw gives -1).  ``w_0 = 1``, ``w_{j+1} =
    min(w_j p_j(x_j) / q_j(x_j), 1)``; for ``1 <= j < n_eff`` ``h_j = R_j / (R_j + 1 - w_j)``
    with ``R_j = sum_v max(w_j p_j(v) - q_j(v), 0)`` (one-hot q: ``w_j (1 - p_j(x_j))``),
    ``h_{n_eff} = w_{n_eff}``; tau is the largest j with ``coins[:, j - 1] < h_j`` (0 if none).
    """
    batch, length = xg.shape
    dev = xg.device
    pos = torch.arange(length + 1, device=dev)
    invalid = torch.isnan(p[:, :, 0])  # p is all NaN on an invalid row
    first_invalid = torch.where(invalid, pos, length + 1).amin(-1)
    n_eff = torch.minimum(n, first_invalid)
    ratio = block_ratio(p_x, q_x)
    ws = [torch.ones(batch, device=dev)]
    for j in range(length):
        ws.append(block_w_next(ws[-1], ratio[:, j]))
    w = torch.stack(ws, -1)  # [B, L + 1]
    h = w.clone()
    for j in range(1, length):
        if draft_probs is None:
            r = w[:, j] * (1.0 - p_x[:, j])
        else:
            r = torch.clamp(w[:, j, None] * p[:, j] - draft_probs[:, j].float(), min=0.0).sum(-1)
        h[:, j] = torch.where(j < n_eff, block_h(r, w[:, j]), w[:, j])
    ok = torch.zeros(batch, length + 1, dtype=torch.bool, device=dev)
    if length:
        ok[:, 1:] = (coins.float() < h[:, 1:]) & (pos[None, 1:] <= n_eff[:, None])
    tau = torch.where(ok, pos, 0).amax(-1)
    return tau, w.gather(1, tau[:, None])[:, 0], n_eff


def verify_chain(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    draft_probs=None,
    num_drafts=None,
    temperature: float = 0.0,
    coins=None,
    sample_uniforms=None,
    rule: str = "token",
) -> VerifyOutput:
    """``rule="token"``: token-wise acceptance; ``"block"``: block verification (see
    :func:`_block_accept`), the final token drawn from ``max(w_tau p_tau - q_tau, 0)``."""
    batch, length = draft_tokens.shape
    dev = draft_tokens.device
    x = draft_tokens.long()
    n = torch.full((batch,), length, dtype=torch.int64, device=dev) if num_drafts is None else num_drafts.long()
    pos = torch.arange(length + 1, device=dev)
    in_draft = pos[None, :length] < n[:, None]
    rows = torch.arange(batch, device=dev)
    if temperature <= 0:
        argmax = token_stats(target_logits).token  # -1 at invalid positions
        ok = (x == argmax[:, :length]) & in_draft
        num_accepted = ok.long().cumprod(-1).sum(-1)
        final = argmax[rows, num_accepted]
    else:
        p = _probs(target_logits, temperature)
        # slots past num_drafts[b] may hold anything (-1 typically): gather at a valid id,
        # the in_draft mask discards them
        xg = x.clamp(0, p.shape[-1] - 1)
        p_x = p[:, :length].gather(-1, xg[..., None])[..., 0]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.float().gather(-1, xg[..., None])[..., 0]
        if rule == "block":
            num_accepted, w_tau, n_eff = _block_accept(p, xg, p_x, q_x, draft_probs, n, coins)
        else:
            ok = (coins.float() * q_x < p_x) & in_draft
            num_accepted = ok.long().cumprod(-1).sum(-1)
            w_tau, n_eff = None, n
        j = num_accepted
        p_j = p[rows, j]
        rejected = (j < n_eff)[:, None]
        if draft_probs is None:  # one-hot q: the residual is p without the rejected token
            x_j = xg[rows, j.clamp(max=length - 1)] if length else j
            w = p_j.scatter(-1, x_j[:, None], 0.0)
        else:
            q_j = draft_probs.float()[rows, j.clamp(max=length - 1)] if length else torch.zeros_like(p_j)
            w = torch.clamp((p_j if w_tau is None else w_tau[:, None] * p_j) - q_j, min=0.0)
        w = torch.where(rejected, _residual_or_p(w, p_j), p_j)
        final = draw(w, sample_uniforms)
    tokens = torch.where(pos[None, :] < num_accepted[:, None], torch.cat([x, x.new_full((batch, 1), -1)], -1), -1)
    tokens[rows, num_accepted] = final
    return VerifyOutput(num_accepted, tokens)


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    draft_probs=None,
    draft_sampling: str = "independent",
    temperature: float = 0.0,
    coins=None,
    sample_uniforms=None,
) -> TreeVerifyOutput:
    """Walk every row's tree in one forward sweep over node indices.

    Children have larger indices than their parent, so scanning c = 1..N-1 in order visits
    the current node's children in index order and, after a move, the new node's children.
    With ``draft_probs`` (and sampling) the walk is :func:`_verify_tree_q`'s.
    """
    if draft_probs is not None and temperature > 0:
        return _verify_tree_q(
            tokens,
            parents,
            target_logits,
            draft_probs,
            draft_sampling == "without_replacement",
            temperature,
            coins,
            sample_uniforms,
        )
    batch, nodes = tokens.shape
    dev = tokens.device
    tok = tokens.long()
    par = parents.long()
    rows = torch.arange(batch, device=dev)
    greedy = temperature <= 0
    if greedy:
        argmax = token_stats(target_logits).token
    else:
        p = _probs(target_logits, temperature)
        w = p[:, 0].clone()
    node = torch.zeros(batch, dtype=torch.int64, device=dev)
    depth = torch.zeros(batch, dtype=torch.int64, device=dev)
    path = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    out = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    for c in range(1, nodes):
        child = par[:, c] == node
        t = tok[:, c]
        if greedy:
            move = child & (t == argmax[rows, node])
        else:
            tg = t.clamp(0, w.shape[-1] - 1)[:, None]  # padding nodes may hold any id
            w_t = w.gather(-1, tg)[:, 0]
            move = child & (coins[:, c].float() < w_t / w.sum(-1))
            reject = child & ~move
            w = torch.where(reject[:, None], w.scatter(-1, tg, 0.0), w)
            w = torch.where(move[:, None], p[:, c], w)
        # write at each moving row's depth without boolean indexing (no host sync)
        at = depth[:, None]
        path.scatter_(1, at, torch.where(move[:, None], c, path.gather(1, at)))
        out.scatter_(1, at, torch.where(move[:, None], t[:, None], out.gather(1, at)))
        node = torch.where(move, c, node)
        depth = depth + move.long()
    if greedy:
        final = argmax[rows, node]
    else:
        final = draw(_residual_or_p(w, p[rows, node]), sample_uniforms)
    out[rows, depth] = final
    return TreeVerifyOutput(depth, path, out)


def _verify_tree_q(
    tokens, parents, target_logits, draft_probs, without_replacement: bool, temperature: float, coins, sample_uniforms
) -> TreeVerifyOutput:
    """The walk with draft probabilities: q = ``draft_probs[b, u]`` at the current node u.

    State per row at the current node u: the residual r (unnormalised, float32 [V]) with its
    sum ``s_r`` (r = P_u and s_r = 1 until a rejection), and for sampling without replacement
    the tokens removed from q_u with ``d_q``, the sum of q_u over the others (1 until a
    removal: q_cur = q_u as given).  Child c of u with token x and
    ``q_cur(x) = q_u(x) / d_q`` (0 for a removed token):

    * q_cur(x) == 0: skipped (it could not have been drawn);
    * accepted iff ``coin * q_cur(x) < r(x) / s_r``: the walk moves to c (r = P_c, q_u = q_c);
    * else rejected: ``r <- max(r / s_r - q_cur, 0)`` (P_u again when that is all zero), and
      without replacement x is removed from q_cur (``d_q`` = the sum of q_u over the rest).
    The final token is drawn from r at the node where the walk stops.
    """
    batch, nodes = tokens.shape
    dev = tokens.device
    tok = tokens.long()
    par = parents.long()
    rows = torch.arange(batch, device=dev)
    p = _probs(target_logits, temperature)
    vocab = p.shape[-1]
    q = draft_probs.float()
    node = torch.zeros(batch, dtype=torch.int64, device=dev)
    depth = torch.zeros(batch, dtype=torch.int64, device=dev)
    path = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    out = torch.full((batch, nodes), -1, dtype=torch.int64, device=dev)
    r = p[:, 0].clone()
    s_r = torch.ones(batch, device=dev)
    d_q = torch.ones(batch, device=dev)
    removed = torch.zeros(batch, vocab, dtype=torch.bool, device=dev)
    for c in range(1, nodes):
        child = par[:, c] == node
        t = tok[:, c]
        tg = t.clamp(0, vocab - 1)[:, None]  # padding nodes may hold any id
        q_u = q[rows, node]
        q_cur = q_u.masked_fill(removed, 0.0) if without_replacement else q_u
        q_x = q_cur.gather(-1, tg)[:, 0]
        live = child & (t >= 0) & (t < vocab) & (q_x != 0)
        move = live & (coins[:, c].float() * (q_x / d_q) < r.gather(-1, tg)[:, 0] / s_r)
        reject = live & ~move
        r_new = torch.clamp(r / s_r[:, None] - q_cur / d_q[:, None], min=0.0)  # NaN stays
        s_new = r_new.sum(-1)
        empty = ~(s_new > 0) & (s_new == s_new)
        r_new = torch.where(empty[:, None], p[rows, node], r_new)
        s_new = torch.where(empty, 1.0, s_new)
        r = torch.where(reject[:, None], r_new, r)
        s_r = torch.where(reject, s_new, s_r)
        if without_replacement:
            gone = removed.scatter(-1, tg, True)
            removed = torch.where(reject[:, None], gone, removed)
            d_q = torch.where(reject, q_u.masked_fill(gone, 0.0).sum(-1), d_q)
        r = torch.where(move[:, None], p[:, c], r)
        s_r = torch.where(move, 1.0, s_r)
        d_q = torch.where(move, 1.0, d_q)
        removed = removed & ~move[:, None]
        at = depth[:, None]
        path.scatter_(1, at, torch.where(move[:, None], c, path.gather(1, at)))
        out.scatter_(1, at, torch.where(move[:, None], t[:, None], out.gather(1, at)))
        node = torch.where(move, c, node)
        depth = depth + move.long()
    out[rows, depth] = draw(r, sample_uniforms)
    return TreeVerifyOutput(depth, path, out)
