"""Reference tree_mask: ancestor masks and depths of token trees by pointer jumping.

Parents follow verify_tree: ``parents[b, 0] = -1`` (root); for i >= 1 a parent in [0, i),
or -1 for a padding node.  Node i sees itself and its ancestors; ``depth`` counts the edges
to the root (0 at the root and at padding nodes, which see only themselves).

Every backend treats a parent outside [0, i) as -1 (what the validated public op never
passes, but what a kernel sees when value checks are off), so all of them agree on any
input.  Pointer jumping: ``anc[i]`` covers the path from i up to (excluding) ``jump[i]``,
``depth[i]`` is its length; each round appends ``jump[i]``'s segment and doubles the jump,
so ``ceil(log2(N))`` rounds reach every root.
"""

from __future__ import annotations

import torch

from .pack_mask import pack_mask


def clamp_parents(parents: torch.Tensor) -> torch.Tensor:
    """int64 parents with every value outside [0, i) replaced by -1."""
    par = parents.long()
    idx = torch.arange(par.shape[-1], device=par.device)
    return torch.where((par >= 0) & (par < idx), par, torch.full_like(par, -1))


def rounds(nodes: int) -> int:
    """Pointer-jumping rounds that reach depth nodes - 1: bit_length(nodes - 1)."""
    return max(0, int(nodes) - 1).bit_length()


def tree_mask(parents: torch.Tensor):
    """parents int [B, N] -> (words int32 [B, N, ceil(N / 32)], depth int64 [B, N])."""
    batch, nodes = parents.shape
    jump = clamp_parents(parents)
    dev = jump.device
    anc = torch.eye(nodes, dtype=torch.bool, device=dev).expand(batch, nodes, nodes).clone()
    depth = (jump >= 0).long()
    for _ in range(rounds(nodes)):
        live = jump >= 0
        at = jump.clamp(min=0)
        anc_j = anc.gather(1, at[..., None].expand(batch, nodes, nodes))
        anc = anc | (anc_j & live[..., None])
        depth = depth + torch.where(live, depth.gather(1, at), torch.zeros_like(depth))
        jump = torch.where(live, jump.gather(1, at), jump)
    return pack_mask(anc), depth
