"""Per-request temperature / top_k / top_p and per-request generators in verify_chain,
verify_tree and token_stats: batched calls equal row-by-row scalar calls on filtered logits."""

import pytest
import torch

import dspec
from dspec.reference.sampling_params import filter_logits

BACKENDS = ["torch", "cpp"]


def naive_filter(row, t, k, p):
    """One position's kept ids, by plain Python: top-k (ties kept), then top-p."""
    x = [v / t for v in row.tolist()]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if 0 < k < len(x):
        kth = x[order[k - 1]]
        order = [i for i in order if x[i] >= kth]
    if p < 1.0:
        z = torch.tensor([x[i] for i in order]).softmax(0).tolist()
        kept, mass = [], 0.0
        for i, q in zip(order, z):
            if mass >= p:
                break
            kept.append(i)
            mass += q
        order = kept
    return sorted(order)


def params(batch, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(batch, generator=g) * 1.5 + 0.2
    t[::3] = 0.0  # greedy rows
    k = torch.randint(0, 5, (batch,), generator=g)
    p = torch.rand(batch, generator=g) * 0.8 + 0.2
    p[1::4] = 1.0
    return t, k, p


def row_filter(logits, t, k, p):
    return filter_logits(logits, torch.tensor([t]), torch.tensor([k]), torch.tensor([p]))


@pytest.mark.parametrize("seed", [0, 1])
def test_filter_matches_naive(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 3, 9, generator=g).round()  # rounding makes ties
    t, k, p = params(6, seed)
    t = torch.where(t > 0, t, 1.0)
    out = filter_logits(x, t, k, p)
    for b in range(6):
        for i in range(3):
            kept = torch.isfinite(out[b, i]).nonzero()[:, 0].tolist()
            assert kept == naive_filter(x[b, i], float(t[b]), int(k[b]), float(p[b]))


def test_top_k_then_top_p_order():
    x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.15, 0.05]]))
    keep = lambda k, p: torch.isfinite(row_filter(x, 1.0, k, p))[0].nonzero()[:, 0].tolist()
    assert keep(2, 1.0) == [0, 1, 2]  # ties with the k-th value are kept
    assert keep(0, 0.6) == [0, 1]  # tied boundary: the lower id first
    # top-p over the renormalised top-4 set: 0.42, 0.21, 0.21 reach 0.7 (0.4+0.2 alone do not
    # over the full set either, but 0.84 > 0.7 stops at three)
    assert keep(4, 0.7) == [0, 1, 2]
    assert keep(1, 0.01) == [0]
    # order matters: top-p first over the full set would keep [0, 1, 2] with p = 0.55, top-k=2
    # first keeps [0, 1, 2] (ties) then top-p 0.55 over it keeps [0, 1]
    assert keep(2, 0.55) == [0, 1]


def chain_inputs(batch, length, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, length + 1, vocab, generator=g) * 2).to(dtype)
    drafts = torch.where(
        torch.rand(batch, length, generator=g) < 0.6,
        logits.float().argmax(-1)[:, :length],
        torch.randint(0, vocab, (batch, length), generator=g),
    )
    coins = torch.rand(batch, length, generator=g)
    uniforms = torch.rand(batch, generator=g)
    return logits, drafts, coins, uniforms


def tree_inputs(batch, nodes, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=g)
    logits = torch.randn(batch, nodes, vocab, generator=g) * 2
    tokens = torch.where(
        torch.rand(batch, nodes, generator=g) < 0.6,
        logits.argmax(-1).gather(1, parents.clamp(min=0)),
        torch.randint(0, vocab, (batch, nodes), generator=g),
    )
    return tokens, parents, logits, torch.rand(batch, nodes, generator=g), torch.rand(batch, generator=g)


def same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3, 11), (5, 1, 6), (4, 0, 5)])
def test_chain_batched_equals_rows(backend, dtype, shape):
    batch, length, vocab = shape
    logits, drafts, coins, uniforms = chain_inputs(batch, length, vocab, sum(shape), dtype)
    t, k, p = params(batch, length)
    out = dspec.verify_chain(
        drafts, logits, temperature=t, top_k=k, top_p=p, coins=coins, sample_uniforms=uniforms, backend=backend
    )
    for b in range(batch):
        sl = slice(b, b + 1)
        if t[b] <= 0:
            exp = dspec.verify_chain(drafts[sl], logits[sl], temperature=0.0, backend=backend)
        else:
            exp = dspec.verify_chain(
                drafts[sl],
                row_filter(logits[sl], float(t[b]), int(k[b]), float(p[b])),
                temperature=1.0,
                coins=coins[sl],
                sample_uniforms=uniforms[sl],
                backend=backend,
            )
        same([x[b] for x in out], [x[0] for x in exp])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6, 5, 9), (3, 1, 4)])
def test_tree_batched_equals_rows(backend, shape):
    batch, nodes, vocab = shape
    tokens, parents, logits, coins, uniforms = tree_inputs(batch, nodes, vocab, nodes)
    t, k, p = params(batch, vocab)
    out = dspec.verify_tree(
        tokens, parents, logits, temperature=t, top_k=k, top_p=p, coins=coins, sample_uniforms=uniforms, backend=backend
    )
    for b in range(batch):
        sl = slice(b, b + 1)
        if t[b] <= 0:
            exp = dspec.verify_tree(tokens[sl], parents[sl], logits[sl], temperature=0.0, backend=backend)
        else:
            exp = dspec.verify_tree(
                tokens[sl],
                parents[sl],
                row_filter(logits[sl], float(t[b]), int(k[b]), float(p[b])),
                temperature=1.0,
                coins=coins[sl],
                sample_uniforms=uniforms[sl],
                backend=backend,
            )
        same([x[b] for x in out], [x[0] for x in exp])


@pytest.mark.parametrize("backend", BACKENDS)
def test_generator_list_equals_single_calls(backend):
    logits, drafts, _, _ = chain_inputs(5, 4, 8, 3)
    t, k, p = params(5, 2)
    gens = [torch.Generator().manual_seed(100 + b) for b in range(5)]
    out = dspec.verify_chain(drafts, logits, temperature=t, top_k=k, top_p=p, generator=gens, backend=backend)
    for b in range(5):
        sl = slice(b, b + 1)
        exp = dspec.verify_chain(
            drafts[sl],
            logits[sl],
            temperature=t[sl],
            top_k=k[sl],
            top_p=p[sl],
            generator=[torch.Generator().manual_seed(100 + b)],
            backend=backend,
        )
        same([x[b] for x in out], [x[0] for x in exp])
    # scalar temperature, no filters: each row as a plain one-generator call
    out = dspec.verify_chain(
        drafts, logits, temperature=0.8, generator=[torch.Generator().manual_seed(b) for b in range(5)], backend=backend
    )
    for b in range(5):
        exp = dspec.verify_chain(
            drafts[b : b + 1],
            logits[b : b + 1],
            temperature=0.8,
            generator=torch.Generator().manual_seed(b),
            backend=backend,
        )
        same([x[b] for x in out], [x[0] for x in exp])
    # a tree, too
    tokens, parents, tl, _, _ = tree_inputs(4, 6, 7, 5)
    out = dspec.verify_tree(
        tokens,
        parents,
        tl,
        temperature=torch.tensor([0.5, 0.0, 1.0, 2.0]),
        top_p=0.8,
        generator=[torch.Generator().manual_seed(b) for b in range(4)],
        backend=backend,
    )
    for b in range(4):
        exp = dspec.verify_tree(
            tokens[b : b + 1],
            parents[b : b + 1],
            tl[b : b + 1],
            temperature=torch.tensor([[0.5, 0.0, 1.0, 2.0][b]]),
            top_p=0.8,
            generator=[torch.Generator().manual_seed(b)],
            backend=backend,
        )
        same([x[b] for x in out], [x[0] for x in exp])


def test_greedy_rows_leave_their_generator_untouched():
    logits, drafts, _, _ = chain_inputs(2, 3, 6, 9)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    state = gens[0].get_state()
    dspec.verify_chain(drafts, logits, temperature=torch.tensor([0.0, 1.0]), generator=gens)
    assert torch.equal(gens[0].get_state(), state)


def test_scalar_path_unchanged():
    logits, drafts, coins, uniforms = chain_inputs(6, 4, 10, 4)
    for kw in ({}, {"top_k": 0, "top_p": 1.0}):
        a = dspec.verify_chain(
            drafts, logits, temperature=0.7, coins=coins, sample_uniforms=uniforms, backend="cpp", **kw
        )
        b = dspec.verify_chain(drafts, logits, temperature=0.7, coins=coins, sample_uniforms=uniforms, backend="cpp")
        same(a, b)
    x = torch.randn(3, 8)
    same(dspec.token_stats(x, temperature=0.5, top_k=0, top_p=1.0), dspec.token_stats(x, temperature=0.5))


def test_never_emits_filtered_tokens():
    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 400
    logits = torch.randn(1, 2, vocab, generator=g).expand(n, 2, vocab).contiguous()
    drafts = torch.randint(0, vocab, (n, 1), generator=g)
    kept = set(torch.isfinite(row_filter(logits[:1], 1.3, 5, 0.8))[0, 0].nonzero()[:, 0].tolist())
    kept_bonus = set(torch.isfinite(row_filter(logits[:1], 1.3, 5, 0.8))[0, 1].nonzero()[:, 0].tolist())
    out = dspec.verify_chain(
        drafts,
        logits,
        temperature=torch.full((n,), 1.3),
        top_k=5,
        top_p=0.8,
        generator=torch.Generator().manual_seed(1),
        backend="cpp",
    )
    first = out.tokens[:, 0].tolist()
    assert set(first) <= kept
    bonus = out.tokens[out.num_accepted == 1, 1].tolist()
    assert set(bonus) <= kept_bonus
    # an unfiltered call (what a broken filter does) emits tokens outside the set
    loose = dspec.verify_chain(
        drafts, logits, temperature=torch.full((n,), 1.3), generator=torch.Generator().manual_seed(1), backend="cpp"
    )
    assert not set(loose.tokens[:, 0].tolist()) <= kept


def test_token_stats_filtered():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 10, generator=g)
    t = torch.tensor([0.0, 0.7, 1.0, 2.0])
    k = torch.tensor([0, 3, 0, 1])
    p = torch.tensor([1.0, 0.9, 0.5, 1.0])
    for backend in BACKENDS:
        s = dspec.token_stats(x, temperature=t, top_k=k, top_p=p, backend=backend)
        for b in range(1, 4):
            e = dspec.token_stats(row_filter(x[b : b + 1], float(t[b]), int(k[b]), float(p[b])), backend=backend)
            for a, f in zip(s, e):
                assert torch.equal(a[b], f[0])
        assert torch.equal(s.token[0], x[0].argmax(-1))
        assert torch.equal(s.prob[0], torch.ones(3)) and torch.equal(s.entropy[0], torch.zeros(3))
        assert torch.equal(s.lse[0], x[0].amax(-1))
        assert torch.equal(s.prob[3], torch.ones(3))  # top-1: all mass on the argmax


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda l, d: dspec.verify_chain(d, l, temperature=torch.ones(2)), "temperature"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=torch.ones(3, dtype=torch.int64)), "temperature"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=torch.tensor([1.0, float("nan"), 1.0])), "temperature"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_k=-1), "top_k"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_k=2.5), "top_k"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_k=torch.ones(3)), "top_k"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_k=torch.ones(2, dtype=torch.int64)), "top_k"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_p=0.0), "top_p"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, top_p=torch.tensor([0.5, 1.5, 1.0])), "top_p"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, generator=[torch.Generator()]), "generator"),
        (lambda l, d: dspec.verify_chain(d, l, temperature=1.0, generator=[1, 2, 3]), "generator"),
        (
            lambda l, d: dspec.verify_tree(
                torch.zeros(3, 2, dtype=torch.int64), torch.tensor([[-1, 0]] * 3), l, top_k=-2
            ),
            "top_k",
        ),
        (lambda l, d: dspec.token_stats(l, temperature=torch.ones(2)), "temperature"),
        (lambda l, d: dspec.token_stats(l[0, 0], top_k=2), "logits"),
        (lambda l, d: dspec.token_stats(l, temperature=0.0, top_k=2), "temperature"),
    ],
)
def test_bad_inputs(call, name):
    logits, drafts, _, _ = chain_inputs(3, 1, 5, 0)
    with pytest.raises(ValueError, match=name):
        call(logits, drafts)


def test_top_k_alone_takes_no_sort_and_keeps_ties():
    """Without top-p the top-k set comes from the k-th largest value (topk, no sort over V):
    every value tied with it is kept, as the sorted reference keeps it."""
    from dspec.reference.sampling_params import filter_logits

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 3, 50, generator=g) * 2).round()  # many ties
    k = torch.tensor([0, 1, 3, 7, 50, 60])
    t = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0, 0.7])
    out = filter_logits(x, t, k, torch.ones(6))
    for b in range(6):
        xs = x[b] / t[b]
        kk = int(k[b])
        if not 0 < kk < 50:
            expected = xs
        else:
            kth = xs.sort(-1, descending=True).values[:, kk - 1 : kk]
            expected = torch.where(xs >= kth, xs, torch.tensor(float("-inf")))
        assert torch.equal(out[b], expected), b
