"""Shared cases of the verification tests: random chains and trees, an output comparison."""

from __future__ import annotations

import torch


def chain_case(batch, length, vocab, dtype, seed, *, with_q):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, length + 1, vocab, generator=g) * 2).to(dtype)
    q = torch.softmax(torch.randn(batch, length, vocab, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, length)
    # half the rows draft the target's argmax so acceptance runs are long
    argmax = logits.float().argmax(-1)[:, :length]
    keep = torch.rand(batch, 1, generator=g) < 0.5
    drafts = torch.where(keep, argmax, drafts)
    n = torch.randint(0, length + 1, (batch,), generator=g)
    n[0] = length
    coins = torch.rand(batch, length, generator=g)
    uniforms = torch.rand(batch, generator=g)
    return logits, drafts, (q if with_q else None), n, coins, uniforms


def random_tree(batch, nodes, vocab, seed, *, pad=True):
    """Random topological trees with padding nodes, repeated siblings and argmax paths."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=g)
    if pad and nodes > 3:
        parents[:, -1] = -1  # a padding node
        parents[1::2, -2] = -1
        parents[:, 1:][parents[:, 1:] >= nodes - 2] = 0  # no child of a padding node
    logits = torch.randn(batch, nodes, vocab, generator=g) * 2
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g)
    argmax = logits.argmax(-1)
    follow = torch.rand(batch, nodes, generator=g) < 0.6  # many nodes hold their parent's argmax
    parent_argmax = argmax.gather(1, parents.clamp(min=0))
    tokens = torch.where(follow & (parents >= 0), parent_argmax, tokens)
    if nodes > 3:
        tokens[:, 2] = tokens[:, 1]  # a repeated sibling when both hang off one node
    coins = torch.rand(batch, nodes, generator=g)
    uniforms = torch.rand(batch, generator=g)
    return tokens, parents, logits, coins, uniforms


def same(out, exp):
    for name, a, e in zip(exp._fields, out, exp):
        assert a.dtype == torch.int64, name
        assert torch.equal(a.cpu(), e.cpu()), f"{name}:\n{a}\n{e}"
