"""Reference best_first_tree: DDTree's best-first draft tree, as a frontier of pushes.

A node is a path ``(c_1 .. c_d)``, d <= L, taking candidate c_j at slot j.  Its score is a
float32 product in a fixed order: the parent's score (the root's is 1) times the
candidate's factor, its probability clamped to [0, 1] with NaN as 0.  Each slot's
candidates are ranked by factor, descending, ties to the lower candidate index.

The nodes come out in the pop order of a max-heap seeded with slot 0's best candidate:
popping a node emits it and pushes (a) its next-best sibling (same parent, the next rank of
its slot) and (b) its best child (rank 0 of the next slot).  Equal scores pop in push order.
Every factor is <= 1 and the ranks fall, so no push scores above the node that made it:
pops never rise, and the first N pops are N best nodes (a subtree: a parent precedes its
children).

Here the heap is a frontier tensor [B, 1 + 2N] whose columns are push sequence numbers:
column 0 is the seed, the i-th pop writes its sibling to column 1 + 2 i and its child to
2 + 2 i (score -1 where there is none), and popped columns become -1.  A pop is the first
column of largest score (``argmax`` returns the first maximal index), which is the heap's
tie rule.  The C++ backend numbers its heap entries the same way.
"""

from __future__ import annotations

import torch


def num_paths(slots: int, k: int, cap: int) -> int:
    """``k + k^2 + ... + k^slots``, capped at ``cap``."""
    total, width = 0, 1
    for _ in range(slots):
        if total >= cap:
            break
        width = min(cap, width * k)
        total = min(cap, total + width)
    return total


def ranked(slot_probs: torch.Tensor, slot_tokens: torch.Tensor):
    """Factors float32 [B, L, k] in rank order and their tokens int64 [B, L, k]."""
    factors = torch.nan_to_num(slot_probs.float(), nan=0.0).clamp(0.0, 1.0)
    factors, order = torch.sort(factors, dim=-1, descending=True, stable=True)
    return factors, slot_tokens.long().gather(-1, order)


def best_first_tree(slot_probs: torch.Tensor, slot_tokens: torch.Tensor, num_nodes: int):
    """slot_probs float [B, L, k], slot_tokens int [B, L, k], num_nodes >= 1 ->
    (tokens int64, parents int64, scores float32, depth int64), each [B, N] with
    N = min(num_nodes, k + k^2 + ... + k^L), in pop order."""
    batch, slots, k = slot_probs.shape
    n = num_paths(slots, k, num_nodes)
    dev = slot_probs.device
    factors, tokens = ranked(slot_probs, slot_tokens)
    flat_f = factors.reshape(batch, slots * k)
    flat_t = tokens.reshape(batch, slots * k)
    width = 1 + 2 * n
    score = torch.full((batch, width), -1.0, dtype=torch.float32, device=dev)
    parent_score = torch.ones(batch, width, dtype=torch.float32, device=dev)
    # slot * k + rank of each column's candidate, and its parent's node index (-1: the root)
    where = torch.zeros(batch, width, dtype=torch.int64, device=dev)
    parent = torch.full((batch, width), -1, dtype=torch.int64, device=dev)
    score[:, 0] = parent_score[:, 0] * flat_f[:, 0]
    out = {name: torch.empty(batch, n, dtype=torch.int64, device=dev) for name in ("tokens", "parents", "depth")}
    out_scores = torch.empty(batch, n, dtype=torch.float32, device=dev)
    for i in range(n):
        col = score.argmax(1, keepdim=True)
        s = score.gather(1, col)
        ps = parent_score.gather(1, col)
        at = where.gather(1, col)
        par = parent.gather(1, col)
        score.scatter_(1, col, -1.0)
        depth, rank = at // k, at % k
        out["tokens"][:, i : i + 1] = flat_t.gather(1, at)
        out["parents"][:, i : i + 1] = par
        out["depth"][:, i : i + 1] = depth + 1
        out_scores[:, i : i + 1] = s
        if i == n - 1:
            break
        # (a) the next-best sibling, column 1 + 2 i
        has = rank + 1 < k
        nxt = torch.where(has, at + 1, at)
        score[:, 1 + 2 * i : 2 + 2 * i] = torch.where(has, ps * flat_f.gather(1, nxt), -1.0)
        parent_score[:, 1 + 2 * i : 2 + 2 * i] = ps
        where[:, 1 + 2 * i : 2 + 2 * i] = nxt
        parent[:, 1 + 2 * i : 2 + 2 * i] = par
        # (b) the best child, column 2 + 2 i
        has = depth + 1 < slots
        child = torch.where(has, (depth + 1) * k, at)
        score[:, 2 + 2 * i : 3 + 2 * i] = torch.where(has, s * flat_f.gather(1, child), -1.0)
        parent_score[:, 2 + 2 * i : 3 + 2 * i] = s
        where[:, 2 + 2 * i : 3 + 2 * i] = child
        parent[:, 2 + 2 * i : 3 + 2 * i] = i
    return out["tokens"], out["parents"], out_scores, out["depth"]
