"""verify_chain and verify_tree: fused acceptance with residual resampling."""

from __future__ import annotations

import math

import torch

from .. import _library, _validate
from ..reference import verify as _reference
from ..types import TreeVerifyOutput, VerifyOutput
from . import _sampling_params

PROVIDED = ("torch", "triton", "cuda", "cpp")
_RULES = ("token", "block")  # verify_chain's acceptance rules


def _temperature(value) -> float:
    value = _validate.real("temperature", value, what="a number (<= 0 for greedy)")
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"temperature must be finite (<= 0 for greedy), got {value!r}")
    return value


def _uniforms(name: str, t, shape: tuple, device) -> torch.Tensor:
    _validate.tensor(name, t, dim=len(shape), dtypes=_validate.FLOAT_DTYPES)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _validate.same_device(device, "the logits", **{name: t})
    if t.numel() and _validate.value_checks_enabled(t):
        bad = ~((t >= 0) & (t < 1))
        if bool(bad.any()):
            raise ValueError(f"{name} must hold uniforms in [0, 1); found {int(bad.sum())} outside")
    return t.float()


def _randomness(generator, coins, uniforms, coin_shape, batch, device):
    if coins is None:
        coins = torch.rand(coin_shape, generator=generator, device=device)
    else:
        coins = _uniforms("coins", coins, coin_shape, device)
    if uniforms is None:
        uniforms = torch.rand((batch,), generator=generator, device=device)
    else:
        uniforms = _uniforms("sample_uniforms", uniforms, (batch,), device)
    return coins, uniforms


def _ids_in_vocab(name: str, ids: torch.Tensor, used, vocab: int) -> None:
    """``used``: a callable giving the bool [B, ...] mask of the slots to check (built only
    when value checks run, so a sync-free call does no work here)."""
    if ids.numel() and _validate.value_checks_enabled(ids):
        bad = used() & ((ids < 0) | (ids >= vocab))
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab}): {int(ids[tuple(at)])} at {at}")


def _probability_values(draft_probs: torch.Tensor) -> None:
    """``draft_probs`` [B, *, V] holds probabilities in [0, 1] (checked while value checks run)."""
    if draft_probs.numel() and _validate.value_checks_enabled(draft_probs):
        bad = ~((draft_probs >= 0) & (draft_probs <= 1))  # NaN fails both
        if bool(bad.any()):
            b, i, v = bad.nonzero()[0].tolist()
            raise ValueError(
                f"draft_probs must hold probabilities in [0, 1] (finite); "
                f"draft_probs[{b}, {i}, {v}] = {float(draft_probs[b, i, v])}"
            )


def _drafts_end_at_placeholder(draft_tokens: torch.Tensor, num_drafts):
    """(drafts, num_drafts int64 [B]) with each row's drafts ending at its first -1.

    Engines pad a row's drafts with -1 placeholders; a row's count becomes the index of its
    first -1 (L if none), combined with a given ``num_drafts`` by min, and every -1 becomes
    id 0 so no backend gathers at -1 (the slot lies past the row's count, so the id is never
    compared nor emitted).  Device ops only: no host synchronisation.  Inside dspec's own
    decode loops (:func:`dspec._validate.decode_values_trusted`) the drafts are dspec's, which
    never carry -1 (a non-finite drafter row stops the call first): the ~50 us of these ops
    is skipped there.
    """
    if _validate.in_trusted_decode():
        return draft_tokens, (None if num_drafts is None else num_drafts.long())
    real = draft_tokens != -1
    leading = real.cumprod(-1).sum(-1)  # the first -1's index, L if none
    n = leading if num_drafts is None else torch.minimum(leading, num_drafts.long())
    return draft_tokens.where(real, 0), n


def _tree_without_placeholders(tokens: torch.Tensor, parents: torch.Tensor):
    """(tokens, parents) with every -1 node made padding (parent -1, safe id 0).

    A -1 node is no node: never accepted, so nothing below it is reached either (every
    backend walks only from accepted nodes to their children).  Device ops only; skipped in
    dspec's own decode loops, as :func:`_drafts_end_at_placeholder` is.
    """
    if _validate.in_trusted_decode():
        return tokens, parents
    real = tokens != -1
    return tokens.where(real, 0), parents.where(real, -1)


def verify_chain(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    draft_probs=None,
    num_drafts=None,
    temperature: float = 0.0,
    coins=None,
    sample_uniforms=None,
    generator: torch.Generator | None = None,
    top_k=0,
    top_p=1.0,
    backend: str | None = None,
    rule: str = "token",
) -> VerifyOutput:
    """Verify a chain of drafted tokens against the target's logits in one fused pass.

    Parameters
    ----------
    draft_tokens : int32/int64 [B, L]. -1 ends a row's drafts: row b's drafts stop at its
        first -1 (as if ``num_drafts[b]`` were that index, combined with a given
        ``num_drafts`` by min), so engines' -1 placeholders after a row's real drafts are
        never accepted nor emitted; the draft probabilities there are ignored.
    target_logits : float32/float16/bfloat16 [B, L + 1, V]; row i is the target's
        distribution for the token after i accepted drafts (row L gives the bonus token).
    draft_probs : float [B, L, V], optional. The drafter's distributions; one-hot on the
        draft tokens when None.
    num_drafts : int [B], optional. Row b uses its first ``num_drafts[b]`` (<= L) drafts.
    temperature : float. <= 0 is greedy (exact argmax matching); > 0 samples from
        ``softmax(target_logits / temperature)`` with speculative acceptance
        ``coins * q(x) < p(x)`` and residual resampling from ``max(p - q, 0)``.
    coins : float32 [B, L] in [0, 1), sample_uniforms : float32 [B] in [0, 1), optional.
        With both given the result is a pure function of the inputs; otherwise they are
        drawn on the device from ``generator`` (no host synchronisation).
    temperature, top_k, top_p, generator : per request.  ``temperature`` may be a float
        tensor [B] (rows with T_b <= 0 greedy, the others sampled, in one call); ``top_k`` an
        int or int tensor [B] (0 = off), ``top_p`` a float or float tensor [B] in (0, 1]
        (1.0 = off); ``generator`` a list of B generators (row b's coins [1, L] and uniform
        [1] drawn from generator b as a one-row call draws them; greedy rows draw nothing).
        Anything beyond a scalar temperature makes p for sampled rows the softmax of the
        filtered scaled logits (``dspec.reference.sampling_params.filter_logits``: logits /
        T_b, top-k first, then the smallest top set reaching top_p, -inf elsewhere): tokens
        outside the set have p = 0 in acceptance and are never emitted.  Greedy rows ignore
        top_k / top_p.  A float tensor temperature with one generator draws coins [B, L] and
        uniforms [B] for the whole batch.
    rule : "token" (default) or "block". Both are lossless and identical when greedy.
        "token" accepts drafts one by one (above) and stops at the first rejection.
        "block" is block verification (Sun et al., arXiv 2403.10444), which accepts at
        least as many drafts as "token" in expectation.  For row b with n drafts x_j,
        ``p_j = softmax(target_logits[b, j] / T)`` and q_j the draft distribution:
        ``w_0 = 1``, ``w_{j+1} = min(w_j p_j(x_j) / q_j(x_j), 1)`` (where ``q_j(x_j) = 0``
        the ratio is +inf if ``p_j(x_j) > 0``, so ``w_{j+1} = 1`` unless ``w_j = 0``, and 0
        if ``p_j(x_j) = 0``); for ``1 <= j < n``, ``R_j = sum_v max(w_j p_j(v) - q_j(v), 0)``
        and ``h_j = R_j / (R_j + 1 - w_j)`` (1 when that denominator is <= 0);
        ``h_n = w_n``.  ``num_accepted`` is the largest j in 1..n with
        ``coins[b, j - 1] < h_j`` (0 if none; a later position can succeed after an
        earlier one failed), and the final token is drawn from p_n when all n are
        accepted, else from ``max(w_j p_j - q_j, 0)`` at the accepted count j (one-hot
        q: p_j without x_j), or from p_j when that residual is all zero.  A row's first
        invalid target row (NaN/+inf/only -inf) cuts its drafts there: reaching it gives
        final token -1, as with "token".

    Returns
    -------
    VerifyOutput(num_accepted int64 [B], tokens int64 [B, L + 1]): the accepted drafts, the
    one drawn token, then -1.  A target row with NaN/+inf (or only -inf) stops the row there
    with final token -1.

    Example
    -------
    >>> import torch, dspec
    >>> logits = torch.full((1, 3, 5), -10.0); logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 10.0
    >>> dspec.verify_chain(torch.tensor([[2, 3]]), logits).tokens.tolist()
    [[2, 4, -1]]
    >>> out = dspec.verify_chain(torch.tensor([[2, 3]]), logits, temperature=torch.tensor([0.8]), top_k=1,
    ...                          generator=[torch.Generator().manual_seed(0)])
    >>> out.tokens.tolist()
    [[2, 4, -1]]
    >>> # block verification: draft 1 (id 3) is rejected, yet with q = the target's own
    >>> # distributions (h_j = 1: the draft is right in distribution) both drafts are accepted
    >>> p = torch.softmax(logits.float(), -1)
    >>> out = dspec.verify_chain(torch.tensor([[2, 3]]), logits, draft_probs=p[:, :2],
    ...                          temperature=1.0, coins=torch.tensor([[0.5, 0.5]]),
    ...                          sample_uniforms=torch.tensor([0.5]), rule="block")
    >>> out.num_accepted.tolist(), out.tokens.tolist()
    ([2], [[2, 3, 1]])
    """
    if not isinstance(rule, str) or rule not in _RULES:
        raise ValueError(f"rule must be one of {list(_RULES)}, got {rule!r}")
    _validate.tensor("draft_tokens", draft_tokens, dim=2, dtypes=_validate.ID_DTYPES)
    _validate.tensor("target_logits", target_logits, dim=3, dtypes=_validate.FLOAT_DTYPES)
    batch, length = draft_tokens.shape
    vocab = target_logits.shape[-1]
    if tuple(target_logits.shape[:2]) != (batch, length + 1):
        raise ValueError(
            f"target_logits must have shape [B, L + 1, V] = [{batch}, {length + 1}, V] "
            f"for draft_tokens [{batch}, {length}], got {list(target_logits.shape)}"
        )
    if vocab == 0:
        raise ValueError("target_logits has an empty vocabulary (last dimension is 0)")
    device = target_logits.device
    if draft_probs is not None:
        _validate.tensor("draft_probs", draft_probs, dim=3, dtypes=_validate.FLOAT_DTYPES)
    if num_drafts is not None:
        _validate.tensor("num_drafts", num_drafts, dim=1, dtypes=_validate.ID_DTYPES)
    _validate.same_device(
        device, "the logits", draft_tokens=draft_tokens, draft_probs=draft_probs, num_drafts=num_drafts
    )
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (batch, length, vocab):
            raise ValueError(
                f"draft_probs must have shape [B, L, V] = [{batch}, {length}, {vocab}], got {list(draft_probs.shape)}"
            )
        _probability_values(draft_probs)
    if num_drafts is not None:
        if num_drafts.shape[0] != batch:
            raise ValueError(f"num_drafts must have shape [B] = [{batch}], got {list(num_drafts.shape)}")
        if batch and _validate.value_checks_enabled(num_drafts):
            lo, hi = int(num_drafts.min()), int(num_drafts.max())
            if lo < 0 or hi > length:
                raise ValueError(f"num_drafts must lie in [0, L] = [0, {length}], got values in [{lo}, {hi}]")
    if _sampling_params.engaged(temperature, top_k, top_p, generator):
        return _sampling_params.verify(
            verify_chain,
            target_logits,
            temperature,
            top_k,
            top_p,
            generator,
            coins,
            sample_uniforms,
            (batch, length),
            backend,
            draft_tokens=draft_tokens,
            draft_probs=draft_probs,
            num_drafts=num_drafts,
            rule=rule,
        )
    temperature = _temperature(temperature)
    _validate.generator(generator, device)
    safe_drafts, num_drafts = _drafts_end_at_placeholder(draft_tokens, num_drafts)
    _ids_in_vocab(
        "draft_tokens", draft_tokens, lambda: torch.arange(length, device=device)[None, :] < num_drafts[:, None], vocab
    )
    draft_tokens = safe_drafts
    if temperature > 0:
        coins, sample_uniforms = _randomness(generator, coins, sample_uniforms, (batch, length), batch, device)
    else:
        coins = sample_uniforms = None  # greedy reads neither
    name = _library.resolve("verify_chain", backend, device, PROVIDED)
    if temperature <= 0:
        rule = "token"  # greedy: both rules are exact argmax matching
    args = (draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, name, rule)
    if _library.call_directly(draft_tokens, target_logits, draft_probs, num_drafts, coins, sample_uniforms):
        return VerifyOutput(*_verify_chain_impl(*args))
    return VerifyOutput(*_library.verify_chain(*args))


@_library.body('verify_chain')
def _verify_chain_impl(
    draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, name, rule="token"
):
    """Body of the ``dspec::verify_chain`` custom op: run backend ``name`` on checked inputs."""
    if name == "torch":
        return _reference.verify_chain(
            draft_tokens,
            target_logits,
            draft_probs=draft_probs,
            num_drafts=num_drafts,
            temperature=temperature,
            coins=coins,
            sample_uniforms=sample_uniforms,
            rule=rule,
        )
    if name in ("cuda", "cpp"):
        from ._verify_ext import verify_chain_ext

        return verify_chain_ext(
            draft_tokens,
            target_logits,
            draft_probs,
            num_drafts,
            temperature,
            coins,
            sample_uniforms,
            cuda=name == "cuda",
            rule=rule,
        )
    from ..kernels.verify import verify_chain_triton

    return verify_chain_triton(
        draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, rule=rule
    )


def _check_tree(parents: torch.Tensor) -> None:
    """Node 0 is the root (-1); node i >= 1 has a parent in [0, i) that is not padding, or is padding (-1)."""
    _validate.tree_parents(parents, "parents")


_TREE_SCHEMES = ("independent", "without_replacement")


def _tree_draft_probs(draft_probs, batch: int, nodes: int, vocab: int):
    """Checks ``draft_probs`` [B, N, V] (values while value checks run); unit stride along V."""
    _validate.tensor("draft_probs", draft_probs, dim=3, dtypes=_validate.FLOAT_DTYPES)
    if tuple(draft_probs.shape) != (batch, nodes, vocab):
        raise ValueError(
            f"draft_probs must have shape [B, N, V] = [{batch}, {nodes}, {vocab}], got {list(draft_probs.shape)}"
        )
    _probability_values(draft_probs)
    return draft_probs if draft_probs.stride(-1) == 1 or vocab == 1 else draft_probs.contiguous()


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
    generator: torch.Generator | None = None,
    top_k=0,
    top_p=1.0,
    backend: str | None = None,
) -> TreeVerifyOutput:
    """Verify a token tree (e.g. D2SD's K+1 branches) and return the accepted path.

    Lossless: with children drawn from the drafter as ``draft_sampling`` says (or fixed, with
    ``draft_probs=None``), the emitted tokens follow the target's law exactly.

    Parameters
    ----------
    tokens : int32/int64 [B, N]; node 0 is the root (the last committed token). -1 ends a
        row's drafts: a node holding -1 is no node (padding, as if its parent were -1), so
        neither it nor anything below it is accepted.
    parents : int32/int64 [B, N]; ``parents[b, 0] = -1``; for i >= 1 a parent in [0, i), or
        -1 for an unused padding node (which may not have children).
    target_logits : float [B, N, V]; row i is the target's distribution after node i.
    draft_probs : float32/float16/bfloat16 [B, N, V], optional; any strides with unit stride
        along V.  ``draft_probs[b, u]`` is the drafter's distribution q_u at node u from which
        u's children were drawn (rows of leaves are never read).  None: the drafts are taken
        as fixed (one-hot q at each child's token; the rule below with w).  Greedy ignores it.
    draft_sampling : "independent" or "without_replacement", how u's children were drawn
        from q_u (with ``draft_probs`` only):

        * "independent" (i.i.d. draws, SpecInfer's multi-step speculative sampling): r = P_u
          (the target's ``softmax(logits[u] / T)``); the children c of u in index order are
          accepted iff ``coins[b, c] * q_u(x_c) < r(x_c)``; a rejection sets
          ``r <- normalise(max(r - q_u, 0))``.
        * "without_replacement" (recursive rejection sampling): as above with q_cur, starting
          at q_u: accepted iff ``coins[b, c] * q_cur(x_c) < r(x_c)``; a rejection sets
          ``r <- normalise(max(r - q_cur, 0))``, then removes x_c from q_cur (renormalised).

        A child whose q (q_u, resp. q_cur) at its token is 0 could not have been drawn: it is
        skipped (neither accepted nor changing r or q_cur).  An accepted child moves the walk
        to it (r = its P, q_cur = its q row); the final token is drawn from r where the walk
        stops.  A rejection that leaves r all zero (p <= q everywhere: rounding) sets r back
        to P_u.
    temperature : float; <= 0 greedy: follow the lowest-index child equal to the argmax.
        > 0 without ``draft_probs``: at node u siblings are tried in index order with
        ``coins[b, c] < w(tok_c) / sum(w)``, w starting at ``softmax(logits[u] / T)`` and
        losing each rejected token; the final token is drawn from the remaining w (from p at
        an accepted leaf).
    coins : float32 [B, N] (entry c is node c's coin), sample_uniforms : float32 [B].
    temperature, top_k, top_p, generator : per request, as in :func:`verify_chain` (a list of
        generators draws row b's coins [1, N] then uniform [1] from generator b); sampled rows
        verify against the softmax of the filtered scaled logits.
        Draws: the smallest v with ``cumsum(w)[v] > u * sum(w)``.

    Returns
    -------
    TreeVerifyOutput(num_accepted [B], path [B, N], tokens [B, N]), int64: accepted node
    indices (root excluded) then -1; their tokens, the final token, then -1.  A target row
    with NaN/+inf (or only -inf), or a NaN in a q row the walk reads (possible with value
    checks off), gives final token -1.

    Example
    -------
    >>> import torch, dspec
    >>> logits = torch.zeros(1, 3, 4); logits[0, 0, 3] = logits[0, 2, 1] = 9.0
    >>> out = dspec.verify_tree(torch.tensor([[0, 2, 3]]), torch.tensor([[-1, 0, 0]]), logits)
    >>> out.path.tolist(), out.tokens.tolist()
    ([[2, -1, -1]], [[3, 1, -1]])

    Two children of the root drawn without replacement from q_0 = (0.5, 0.5, 0, 0), with
    P_0 = (0.1, 0.6, 0.15, 0.15): the first (token 0) is rejected (coin 0.9 * 0.5 >= 0.1),
    so r = max(P_0 - q_0, 0) / 0.4 = (0, 0.25, 0.375, 0.375) and q_cur = (0, 1, 0, 0); the
    second (token 1) is accepted (0.2 * 1 < 0.25), and the final token is drawn from P_2.

    >>> logits = torch.log(torch.tensor([[[.1, .6, .15, .15], [1., 1e-9, 1e-9, 1e-9],
    ...                                    [1e-9, 1e-9, 1e-9, 1.]]]))
    >>> q = torch.tensor([[[.5, .5, 0, 0]]]).expand(1, 3, 4)
    >>> out = dspec.verify_tree(torch.tensor([[0, 0, 1]]), torch.tensor([[-1, 0, 0]]), logits,
    ...                         draft_probs=q, draft_sampling="without_replacement",
    ...                         temperature=1.0, coins=torch.tensor([[0., .9, .2]]),
    ...                         sample_uniforms=torch.tensor([.5]))
    >>> out.path.tolist(), out.tokens.tolist()
    ([[2, -1, -1]], [[1, 3, -1]])
    """
    _validate.tensor("tokens", tokens, dim=2, dtypes=_validate.ID_DTYPES)
    _validate.tensor("parents", parents, dim=2, dtypes=_validate.ID_DTYPES)
    _validate.tensor("target_logits", target_logits, dim=3, dtypes=_validate.FLOAT_DTYPES)
    batch, nodes = tokens.shape
    if nodes == 0:
        raise ValueError("tokens must hold at least the root node (N >= 1)")
    if tuple(parents.shape) != (batch, nodes):
        raise ValueError(f"parents must have the shape of tokens [{batch}, {nodes}], got {list(parents.shape)}")
    if tuple(target_logits.shape[:2]) != (batch, nodes):
        raise ValueError(
            f"target_logits must have shape [B, N, V] = [{batch}, {nodes}, V], got {list(target_logits.shape)}"
        )
    vocab = target_logits.shape[-1]
    if vocab == 0:
        raise ValueError("target_logits has an empty vocabulary (last dimension is 0)")
    device = target_logits.device
    if draft_sampling not in _TREE_SCHEMES:
        raise ValueError(f"draft_sampling must be one of {_TREE_SCHEMES}, got {draft_sampling!r}")
    _validate.same_device(device, "the logits", tokens=tokens, parents=parents, draft_probs=draft_probs)
    if draft_probs is not None:
        draft_probs = _tree_draft_probs(draft_probs, batch, nodes, vocab)
    _check_tree(parents)
    tokens, parents = _tree_without_placeholders(tokens, parents)
    _ids_in_vocab("tokens", tokens, lambda: parents >= 0, vocab)
    if _sampling_params.engaged(temperature, top_k, top_p, generator):
        return _sampling_params.verify(
            verify_tree,
            target_logits,
            temperature,
            top_k,
            top_p,
            generator,
            coins,
            sample_uniforms,
            (batch, nodes),
            backend,
            tokens=tokens,
            parents=parents,
        )
    temperature = _temperature(temperature)
    _validate.generator(generator, device)
    if temperature > 0:
        coins, sample_uniforms = _randomness(generator, coins, sample_uniforms, (batch, nodes), batch, device)
    else:
        coins = sample_uniforms = draft_probs = None  # greedy reads none of them
    name = _library.resolve("verify_tree", backend, device, PROVIDED)
    args = (tokens, parents, target_logits, draft_probs, draft_sampling, temperature, coins, sample_uniforms, name)
    if _library.call_directly(tokens, parents, target_logits, draft_probs, coins, sample_uniforms):
        return TreeVerifyOutput(*_verify_tree_impl(*args))
    return TreeVerifyOutput(*_library.verify_tree(*args))


@_library.body('verify_tree')
def _verify_tree_impl(
    tokens, parents, target_logits, draft_probs, draft_sampling, temperature, coins, sample_uniforms, name
):
    """Body of the ``dspec::verify_tree`` custom op: run backend ``name`` on checked inputs."""
    if name == "torch":
        return _reference.verify_tree(
            tokens,
            parents,
            target_logits,
            draft_probs=draft_probs,
            draft_sampling=draft_sampling,
            temperature=temperature,
            coins=coins,
            sample_uniforms=sample_uniforms,
        )
    if name in ("cuda", "cpp"):
        from ._verify_ext import verify_tree_ext

        return verify_tree_ext(
            tokens,
            parents,
            target_logits,
            temperature,
            coins,
            sample_uniforms,
            cuda=name == "cuda",
            draft_probs=draft_probs,
            draft_sampling=draft_sampling,
        )
    from ..kernels.verify import verify_tree_triton

    return verify_tree_triton(
        tokens,
        parents,
        target_logits,
        temperature,
        coins,
        sample_uniforms,
        draft_probs=draft_probs,
        draft_sampling=draft_sampling,
    )
