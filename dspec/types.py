"""Result types returned by the public ops."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Per-row statistics of a logits tensor; every field has the logits' leading shape.

    token (int64; -1 for an invalid row), prob, margin, entropy (nats), lse (natural log):
    float32.
    """

    token: torch.Tensor
    prob: torch.Tensor
    margin: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


class VerifyOutput(NamedTuple):
    """Result of chain verification.

    num_accepted: int64 [B]; tokens: int64 [B, L + 1], the accepted drafts, then the one
    drawn (corrected or bonus) token, then -1.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor


class TreeVerifyOutput(NamedTuple):
    """Result of tree verification.

    num_accepted: int64 [B]; path: int64 [B, N], accepted node indices (root excluded), then
    -1; tokens: int64 [B, N], their tokens, then the final drawn token, then -1.
    """

    num_accepted: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor


class TreeMask(NamedTuple):
    """Result of tree_mask.

    words: int32 [B, N, ceil(N / 32)], node i's ancestors and itself as packed mask bits
    (see dspec.pack_mask); depth: int64 [B, N], edges to the root (0 at the root and at
    padding nodes).
    """

    words: torch.Tensor
    depth: torch.Tensor


class BestFirstTree(NamedTuple):
    """Result of best_first_tree: ``(tokens, parents)``, each [B, N], nodes in best-first
    pop order (it unpacks as a pair, as the contract states).

    tokens: int64, each node's candidate token; parents: int64 in [-1, i), -1 for a child
    of the root, else the index of the parent node.  Attributes beside the pair:
    ``scores`` float32 [B, N], the product of probabilities along the node's path, and
    ``depth`` int64 [B, N] in [1, L], the node's slot + 1 (edges to the root).
    """

    tokens: torch.Tensor
    parents: torch.Tensor

    @classmethod
    def of(cls, tokens, parents, scores, depth) -> "BestFirstTree":
        out = _BestFirstTreeWithScores(tokens, parents)
        out.scores, out.depth = scores, depth
        return out


class _BestFirstTreeWithScores(BestFirstTree):
    """A :class:`BestFirstTree` pair carrying ``scores`` and ``depth`` as attributes."""
