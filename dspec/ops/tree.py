"""best_first_tree: DDTree's best-first draft tree over a block drafter's per-slot candidates."""

from __future__ import annotations

import torch

from .. import _backend, _library, _validate
from ..reference import best_first_tree as _reference
from ..types import BestFirstTree

PROVIDED = ("torch", "cpp")


def best_first_tree(
    slot_probs: torch.Tensor, slot_tokens: torch.Tensor, num_nodes: int, *, backend: str | None = None
) -> BestFirstTree:
    """The ``num_nodes`` best draft-tree nodes, in DDTree's best-first (max-heap) order.

    A node is a path ``(c_1 .. c_d)``, d <= L, taking candidate c_j of slot j.  Its score
    is the float32 product ``parent score * factor`` (the root's score is 1; the factor is
    the candidate's probability clamped to [0, 1], NaN as 0), computed in that order by
    every backend.  The nodes come out as a max-heap pops them: seeded with slot 0's best
    candidate; popping a node emits it and pushes its next-best sibling (same parent, the
    next candidate of its slot by descending probability, ties to the lower index), then
    its best child (the next slot's best candidate).  Equal scores pop in push order (the
    earlier push first), so the backends agree exactly.  Every factor is <= 1, so the N
    nodes emitted have the N largest scores (the largest score sum of any N nodes), scores
    never rise along the output, and a parent precedes its children: every prefix of the
    output is a subtree.  The node set is that of :func:`dspec.decode.dflash.marginal_tree`
    where no scores tie.

    Parameters
    ----------
    slot_probs : float32 / float16 / bfloat16 [B, L, k], L >= 1, k >= 1
        Each of L slots' k candidates' probabilities, in any order.  Values must lie in
        [0, 1] (checked unless value checks are off; then they are clamped, NaN as 0).
    slot_tokens : int32 / int64 [B, L, k], the candidates' token ids (same device).
    num_nodes : int >= 1
        Nodes to emit (the root excluded).  N = min(num_nodes, k + k^2 + ... + k^L).
    backend : "auto" | "torch" | "cpp", optional.  "auto": C++ on CPU tensors, torch
        elsewhere.

    Returns
    -------
    BestFirstTree(tokens int64 [B, N], parents int64 [B, N]) -- a pair, so ``tokens,
    parents = best_first_tree(...)`` -- with attributes ``scores`` float32 [B, N] and
    ``depth`` int64 [B, N]; node i is the i-th pop.  ``parents[b, i]`` lies in [-1, i):
    -1 for a child of the root (a slot-0 candidate), else the index of its parent node;
    ``depth`` in [1, L] is the node's slot + 1.  Candidates of probability 0 (and paths
    whose product underflows to 0) are never emitted before a node of positive score; when
    fewer than N paths have a positive score the rest still come out, with score 0, in
    the same pop order, so N depends only on the shapes and ``num_nodes``.

    Example
    -------
    >>> import torch, dspec
    >>> p = torch.tensor([[[0.3, 0.6], [0.9, 0.1]]]); t = torch.tensor([[[7, 5], [8, 9]]])
    >>> tree = dspec.best_first_tree(p, t, 3)
    >>> tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    ([[5, 8, 7]], [[-1, 0, -1]], [[1, 2, 1]])
    >>> [round(s, 2) for s in tree.scores[0].tolist()]
    [0.6, 0.54, 0.3]
    """
    _validate.tensor("slot_probs", slot_probs, dim=3, dtypes=_validate.FLOAT_DTYPES)
    _validate.tensor("slot_tokens", slot_tokens, dim=3, dtypes=_validate.ID_DTYPES)
    if slot_tokens.shape != slot_probs.shape:
        raise ValueError(
            f"slot_tokens must have slot_probs' shape {tuple(slot_probs.shape)}, got {tuple(slot_tokens.shape)}"
        )
    _validate.same_device(slot_probs.device, "slot_probs", slot_tokens=slot_tokens)
    if slot_probs.shape[1] < 1 or slot_probs.shape[2] < 1:
        raise ValueError(
            f"slot_probs must have L >= 1 slots and k >= 1 candidates, got shape {tuple(slot_probs.shape)}"
        )
    num_nodes = _validate.positive_int("num_nodes", num_nodes)
    _validate.probabilities("slot_probs", slot_probs)
    name = _library.resolve("best_first_tree", backend, slot_probs.device, PROVIDED)
    if _library.call_directly(slot_probs, slot_tokens):
        return BestFirstTree.of(*_best_first_tree_impl(slot_probs, slot_tokens, num_nodes, name))
    return BestFirstTree.of(*_library.best_first_tree(slot_probs, slot_tokens, num_nodes, name))


@_library.body('best_first_tree')
def _best_first_tree_impl(slot_probs: torch.Tensor, slot_tokens: torch.Tensor, num_nodes: int, name: str):
    """Body of the ``dspec::best_first_tree`` custom op: run backend ``name``."""
    if name == "torch":
        return tuple(_reference.best_first_tree(slot_probs, slot_tokens, num_nodes))
    batch, slots, k = slot_probs.shape
    n = _reference.num_paths(slots, k, num_nodes)
    # four separate tensors: a custom op's outputs may not alias each other
    tokens_out, parents, depth = (torch.empty(batch, n, dtype=torch.int64) for _ in range(3))
    scores = torch.empty(batch, n, dtype=torch.float32)
    if batch:
        probs = slot_probs.contiguous()
        tokens = slot_tokens.contiguous()
        _backend.extension().best_first_tree(
            probs.data_ptr(),
            _backend.FLOAT_CODE[probs.dtype],
            tokens.data_ptr(),
            _backend.ID_CODE[tokens.dtype],
            batch,
            slots,
            k,
            n,
            tokens_out.data_ptr(),
            parents.data_ptr(),
            scores.data_ptr(),
            depth.data_ptr(),
        )
    return tokens_out, parents, scores, depth
