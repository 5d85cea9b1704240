"""-1 draft placeholders: a row's drafts end at its first -1, identically on every backend.

Engines (vLLM) pad each row's drafts with -1 after its real drafts.  verify_chain treats the
first -1 of a row as the end of its drafts (as ``num_drafts``, combined with a given one by
min); verify_tree treats a -1 node as padding.  With value checks on or off, every backend
gives exactly the outputs of the same call with the drafts cut.
"""

import pytest
import torch

import dspec
from conftest import device_backends

PROVIDED = ("torch", "triton", "cuda", "cpp")


@pytest.fixture(params=[True, False], ids=["checks-on", "checks-off"])
def value_checks(request):
    saved = dspec.config.validate_values
    dspec.config.validate_values = request.param
    yield request.param
    dspec.config.validate_values = saved


def same(out, exp):
    assert type(out) is type(exp)
    for name, a, e in zip(exp._fields, out, exp):
        assert a.dtype == e.dtype, name
        assert torch.equal(a.cpu(), e.cpu()), f"{name}:\n{a}\n{e}"


def chain_case(batch, length, vocab, seed):
    """Logits, drafts (most rows the target's argmax, so acceptance would run through a
    placeholder slot), draft probabilities, coins and uniforms."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length + 1, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(batch, length, vocab, generator=g), -1)
    drafts = torch.randint(0, vocab, (batch, length), generator=g)
    follow = torch.rand(batch, 1, generator=g) < 0.7
    drafts = torch.where(follow, logits.argmax(-1)[:, :length], drafts)
    coins = torch.rand(batch, length, generator=g) * 0.3  # mostly accepting when sampling
    uniforms = torch.rand(batch, generator=g)
    return logits, drafts, q, coins, uniforms


def verify(device, backend, drafts, logits, temperature, q, coins, u, num_drafts=None):
    to = lambda t: None if t is None else t.to(device)
    sampling = temperature > 0
    return dspec.verify_chain(
        to(drafts),
        to(logits),
        draft_probs=to(q) if sampling else None,
        num_drafts=to(num_drafts),
        temperature=temperature,
        coins=to(coins) if sampling else None,
        sample_uniforms=to(u) if sampling else None,
        backend=backend,
    )


# ------------------------------------------------------------------------------ chain
@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_chain_placeholder_tails_equal_cut_drafts(device, backend, temperature, with_q, id_dtype, value_checks):
    if with_q and temperature <= 0:
        pytest.skip("draft_probs only matter when sampling")
    batch, length, vocab = 8, 6, 53
    logits, drafts, q, coins, u = chain_case(batch, length, vocab, seed=length * vocab + with_q)
    q = q if with_q else None
    cut = torch.tensor([0, length, 1, 3, 5, 2, 4, 0])  # row 0 and 7: all -1; row 1: none
    pos = torch.arange(length)[None, :]
    tail = pos >= cut[:, None]
    padded = drafts.masked_fill(tail, -1).to(id_dtype)
    # the drafter's probabilities at placeholder slots are ignored (NaN once checks are off)
    q_padded = None
    if q is not None:
        junk = torch.full_like(q, float("nan")) if not value_checks else torch.roll(q, 1, -1)
        q_padded = torch.where(tail[..., None], junk, q)
    exp = verify(device, backend, drafts.to(id_dtype), logits, temperature, q, coins, u, num_drafts=cut)
    same(verify(device, backend, padded, logits, temperature, q_padded, coins, u), exp)
    # a given num_drafts combines with the placeholders by min
    given = torch.tensor([3, 2, 6, 0, 6, 1, 4, 6])
    exp = verify(
        device, backend, drafts.to(id_dtype), logits, temperature, q, coins, u, num_drafts=torch.minimum(cut, given)
    )
    same(verify(device, backend, padded, logits, temperature, q_padded, coins, u, num_drafts=given), exp)
    # the placeholders really cut: the full drafts accept past some row's cut
    full = verify(device, backend, drafts, logits, temperature, q, coins, u)
    assert bool((full.num_accepted.cpu() > cut).any())


@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chain_drafts_end_at_first_placeholder(device, backend, temperature, value_checks):
    """A -1 in the middle ends the row even though real ids (the target's argmax) follow."""
    batch, length, vocab = 3, 6, 40
    logits, drafts, q, coins, u = chain_case(batch, length, vocab, seed=7)
    drafts = logits.argmax(-1)[:, :length]  # every draft would be accepted greedily
    padded = drafts.clone()
    padded[0, 2] = -1
    padded[1, 0] = -1
    padded[2, 4] = padded[2, 5] = -1
    padded[0, 4] = -1  # a second -1 changes nothing
    cut = torch.tensor([2, 0, 4])
    exp = verify(device, backend, drafts, logits, temperature, None, coins, u, num_drafts=cut)
    out = verify(device, backend, padded, logits, temperature, None, coins, u)
    same(out, exp)
    if temperature <= 0:
        assert out.num_accepted.tolist() == cut.tolist()
        assert (out.tokens.cpu() >= -1).all() and (out.tokens.cpu()[:, :length] != -1).sum(-1).tolist() == [3, 1, 5]


@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chain_engine_padded_row(device, backend, temperature, value_checks):
    """Drafts [1, 99, -1], the target agreeing with 1 and 99: two accepted, then the target's token."""
    vocab = 128
    logits = torch.full((1, 4, vocab), -30.0)
    logits[0, 0, 1] = logits[0, 1, 99] = logits[0, 2, 7] = logits[0, 3, 5] = 30.0
    coins = torch.zeros(1, 3)
    u = torch.full((1,), 0.5)
    out = verify(device, backend, torch.tensor([[1, 99, -1]]), logits, temperature, None, coins, u)
    assert out.num_accepted.tolist() == [2]
    assert out.tokens.tolist() == [[1, 99, 7, -1]]


@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chain_row_of_placeholders(device, backend, temperature, value_checks):
    logits, drafts, q, coins, u = chain_case(2, 5, 31, seed=3)
    padded = drafts.clone()
    padded[1] = -1
    out = verify(device, backend, padded, logits, temperature, q, coins, u)
    exp = verify(device, backend, drafts, logits, temperature, q, coins, u, num_drafts=torch.tensor([5, 0]))
    same(out, exp)
    assert int(out.num_accepted[1]) == 0 and 0 <= int(out.tokens[1, 0]) < 31
    assert (out.tokens[1, 1:] == -1).all()


@pytest.mark.parametrize("bad", [-2, -7, 31])
def test_chain_ids_outside_vocab_still_raise(bad):
    logits, drafts, _, _, _ = chain_case(2, 5, 31, seed=3)
    drafts[1, 1] = bad
    drafts[1, 3] = -1
    with pytest.raises(ValueError, match="draft_tokens"):
        dspec.verify_chain(drafts, logits)
    drafts[1, 1] = -1  # past the first -1: not a draft
    drafts[1, 2] = bad
    dspec.verify_chain(drafts, logits)


# ------------------------------------------------------------------------------- tree
def tree_case(batch, nodes, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(max(0, i - 3), i, (batch,), generator=g)  # deep trees
    logits = torch.randn(batch, nodes, vocab, generator=g) * 2
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g)
    parent_argmax = logits.argmax(-1).gather(1, parents.clamp(min=0))
    follow = torch.rand(batch, nodes, generator=g) < 0.8
    tokens = torch.where(follow & (parents >= 0), parent_argmax, tokens)
    coins = torch.rand(batch, nodes, generator=g) * 0.3
    uniforms = torch.rand(batch, generator=g)
    return tokens, parents, logits, coins, uniforms


def subtree(parents_row, root):
    inside = {root}
    for c in range(root + 1, len(parents_row)):
        if int(parents_row[c]) in inside:
            inside.add(c)
    return sorted(inside)


@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_placeholder_node_is_padding(device, backend, temperature, value_checks):
    """A -1 node is no node: the outputs equal the tree with it and its subtree as padding."""
    batch, nodes, vocab = 4, 10, 37
    tokens, parents, logits, coins, u = tree_case(batch, nodes, vocab, seed=11)
    holes = {0: [1], 1: [3, 7], 2: [], 3: [9]}
    padded, pruned = tokens.clone(), parents.clone()
    for b, where in holes.items():
        for c in where:
            padded[b, c] = -1
            pruned[b, subtree(parents[b], c)] = -1
    to = lambda t: t.to(device)
    kw = dict(temperature=temperature, coins=to(coins), sample_uniforms=to(u), backend=backend)
    exp = dspec.verify_tree(to(tokens), to(pruned), to(logits), **kw)
    same(dspec.verify_tree(to(padded), to(parents), to(logits), **kw), exp)
    same(
        dspec.verify_tree(to(padded).int(), to(parents).int(), to(logits), **kw),
        dspec.verify_tree(to(tokens).int(), to(pruned).int(), to(logits), **kw),
    )
    full = dspec.verify_tree(to(tokens), to(parents), to(logits), **kw)
    assert not torch.equal(full.num_accepted.cpu(), exp.num_accepted.cpu())


def test_tree_ids_outside_vocab_still_raise():
    tokens, parents, logits, _, _ = tree_case(2, 6, 20, seed=2)
    tokens[1, 2] = -1
    tokens[1, 4] = -3
    with pytest.raises(ValueError, match="tokens"):
        dspec.verify_tree(tokens, parents, logits)
