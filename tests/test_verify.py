"""verify_chain / verify_tree: exactness against the reference, invariants, losslessness."""

import math

import pytest
import torch

import dspec
from conftest import DEVICES, backends_for, device_backends
from dspec.reference import verify as reference
from verify_cases import chain_case, random_tree, same

PROVIDED = ("torch", "triton", "cuda", "cpp")
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------------- inputs


# ------------------------------------------------------------------------------ exactness
@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("batch,length,vocab", [(1, 1, 1), (1, 4, 97), (7, 5, 300), (7, 16, 77)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("with_q", [False, True])
def test_chain_matches_reference(device, backend, dtype, batch, length, vocab, temperature, with_q):
    if with_q and temperature <= 0:
        pytest.skip("draft_probs only matter when sampling")
    logits, drafts, q, n, coins, u = chain_case(batch, length, vocab, dtype, batch * length + vocab, with_q=with_q)
    exp = reference.verify_chain(
        drafts, logits, draft_probs=q, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
    )
    to = lambda t: None if t is None else t.to(device)
    out = dspec.verify_chain(
        to(drafts).int(),
        to(logits),
        draft_probs=to(q),
        num_drafts=to(n),
        temperature=temperature,
        coins=to(coins),
        sample_uniforms=to(u),
        backend=backend,
    )
    same(out, exp)


@device_backends(PROVIDED)
@pytest.mark.parametrize("batch,nodes,vocab", [(1, 1, 5), (1, 6, 97), (7, 9, 300), (7, 33, 50)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_tree_matches_reference(device, backend, batch, nodes, vocab, temperature):
    tokens, parents, logits, coins, u = random_tree(batch, nodes, vocab, nodes * vocab)
    exp = reference.verify_tree(tokens, parents, logits, temperature=temperature, coins=coins, sample_uniforms=u)
    out = dspec.verify_tree(
        tokens.to(device),
        parents.int().to(device),
        logits.to(device),
        temperature=temperature,
        coins=coins.to(device),
        sample_uniforms=u.to(device),
        backend=backend,
    )
    same(out, exp)
    if batch > 1:
        assert int(exp.num_accepted.max()) >= 1  # the cases do exercise acceptance


def test_triton_small_tiles_and_splits():
    """Several vocabulary tiles and splits in the draw (the GPU layout, at test size)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in [b for _, b in backends_for(device, PROVIDED)]:
        pytest.skip("no triton backend here")
    from dspec.kernels.verify import verify_chain_triton, verify_tree_triton

    logits, drafts, q, n, coins, u = chain_case(7, 6, 1000, torch.float32, 11, with_q=True)
    for qq in (None, q):
        exp = reference.verify_chain(
            drafts, logits, draft_probs=qq, num_drafts=n, temperature=0.8, coins=coins, sample_uniforms=u
        )
        dev = lambda t: None if t is None else t.to(device)
        same(verify_chain_triton(dev(drafts), dev(logits), dev(qq), dev(n), 0.8, dev(coins), dev(u), block=64), exp)
    tokens, parents, logits, coins, u = random_tree(7, 12, 700, 5)
    exp = reference.verify_tree(tokens, parents, logits, temperature=0.8, coins=coins, sample_uniforms=u)
    same(
        verify_tree_triton(
            tokens.to(device), parents.to(device), logits.to(device), 0.8, coins.to(device), u.to(device), block=64
        ),
        exp,
    )


# ----------------------------------------------------------------------------- invariants
@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chain_invariants(device, backend, temperature):
    logits, drafts, q, n, coins, u = chain_case(7, 8, 64, torch.float32, 3, with_q=True)
    out = dspec.verify_chain(
        drafts.to(device),
        logits.to(device),
        draft_probs=q.to(device),
        num_drafts=n.to(device),
        temperature=temperature,
        coins=coins.to(device),
        sample_uniforms=u.to(device),
        backend=backend,
    )
    num, tokens = out.num_accepted.cpu(), out.tokens.cpu()
    assert tokens.shape == (7, 9)
    for b in range(7):
        j = int(num[b])
        assert 0 <= j <= int(n[b])
        assert tokens[b, :j].tolist() == drafts[b, :j].tolist()  # contiguous acceptance
        assert 0 <= int(tokens[b, j]) < 64  # exactly one drawn token
        assert (tokens[b, j + 1 :] == -1).all()  # then -1


@device_backends(PROVIDED)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_invariants(device, backend, temperature):
    tokens, parents, logits, coins, u = random_tree(7, 16, 40, 9)
    out = dspec.verify_tree(
        tokens.to(device),
        parents.to(device),
        logits.to(device),
        temperature=temperature,
        coins=coins.to(device),
        sample_uniforms=u.to(device),
        backend=backend,
    )
    for b in range(7):
        j = int(out.num_accepted[b])
        path = out.path[b].cpu()
        prev = 0
        for d in range(j):
            node = int(path[d])
            assert int(parents[b, node]) == prev  # each step goes to a child
            assert int(out.tokens[b, d]) == int(tokens[b, node])
            prev = node
        assert (path[j:] == -1).all()
        assert 0 <= int(out.tokens[b, j]) < 40
        assert (out.tokens[b, j + 1 :] == -1).all()


def test_greedy_semantics():
    logits = torch.full((2, 4, 6), -5.0)
    for i, t in enumerate([3, 1, 4, 5]):
        logits[:, i, t] = 5.0
    out = dspec.verify_chain(torch.tensor([[3, 1, 4], [3, 2, 4]]), logits)
    assert out.num_accepted.tolist() == [3, 1]
    assert out.tokens.tolist() == [[3, 1, 4, 5], [3, 1, -1, -1]]
    out = dspec.verify_chain(torch.tensor([[3, 1, 4], [3, 1, 4]]), logits, num_drafts=torch.tensor([2, 0]))
    assert out.tokens.tolist() == [[3, 1, 4, -1], [3, -1, -1, -1]]
    # tree: the lowest-index matching child wins
    tl = torch.zeros(1, 4, 6)
    tl[0, 0, 2] = tl[0, 2, 0] = tl[0, 3, 1] = 9.0
    out = dspec.verify_tree(torch.tensor([[0, 2, 2, 0]]), torch.tensor([[-1, 0, 0, 1]]), tl)
    assert out.path.tolist() == [[1, 3, -1, -1]] and out.tokens.tolist() == [[2, 0, 1, -1]]


@device_backends(PROVIDED)
def test_nan_logits_documented_outcome(device, backend):
    """A NaN target row stops the row there with final token -1; nothing crashes."""
    logits, drafts, _, _, coins, u = chain_case(3, 4, 30, torch.float32, 1, with_q=False)
    drafts[:] = logits.argmax(-1)[:, :4]
    logits[:, 2, 7] = float("nan")
    for t in (0.0, 1.0):
        out = dspec.verify_chain(
            drafts.to(device),
            logits.to(device),
            temperature=t,
            coins=torch.zeros_like(coins).to(device),
            sample_uniforms=u.to(device),
            backend=backend,
        )
        assert out.num_accepted.tolist() == [2, 2, 2]
        assert out.tokens[:, 2].tolist() == [-1, -1, -1]


def test_generator_draws_on_device_and_is_reproducible():
    logits, drafts, q, n, _, _ = chain_case(4, 5, 50, torch.float32, 2, with_q=True)
    a = dspec.verify_chain(drafts, logits, draft_probs=q, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = dspec.verify_chain(drafts, logits, draft_probs=q, temperature=1.0, generator=torch.Generator().manual_seed(5))
    same(a, b)


# ---------------------------------------------------------------------------- bad inputs
def _chain_args():
    return torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, 10)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda d, l: dspec.verify_chain(d.float(), l), "draft_tokens must have dtype"),
        (lambda d, l: dspec.verify_chain(d, l[:, :3]), r"\[B, L \+ 1, V\]"),
        (lambda d, l: dspec.verify_chain(d, l[..., :0]), "empty vocabulary"),
        (lambda d, l: dspec.verify_chain(d + 10, l), "outside the vocabulary"),
        (lambda d, l: dspec.verify_chain(d - 2, l), "outside the vocabulary"),
        (lambda d, l: dspec.verify_chain(d, l, num_drafts=torch.tensor([1, 4])), r"num_drafts must lie in \[0, L\]"),
        (lambda d, l: dspec.verify_chain(d, l, num_drafts=torch.tensor([1])), "num_drafts must have shape"),
        (lambda d, l: dspec.verify_chain(d, l, draft_probs=torch.zeros(2, 3, 9)), "draft_probs must have shape"),
        (lambda d, l: dspec.verify_chain(d, l, temperature=1.0, coins=torch.zeros(2, 2)), "coins must have shape"),
        (lambda d, l: dspec.verify_chain(d, l, temperature=1.0, coins=torch.ones(2, 3)), r"\[0, 1\)"),
        (
            lambda d, l: dspec.verify_chain(d, l, temperature=1.0, sample_uniforms=torch.zeros(3)),
            "sample_uniforms must have shape",
        ),
        (lambda d, l: dspec.verify_chain(d, l, temperature=float("nan")), "temperature"),
    ],
)
def test_chain_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_chain_args())


@pytest.mark.parametrize(
    "parents,match",
    [
        ([[0, 0, 1]], "must be -1"),
        ([[-1, 1, 0]], "not a topologically ordered tree"),
        ([[-1, 0, 5]], "not a topologically ordered tree"),
        ([[-1, -2, 0]], "not a topologically ordered tree"),
        ([[-1, -1, 1]], "padding node"),
    ],
)
def test_tree_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        dspec.verify_tree(torch.zeros(1, 3, dtype=torch.int64), torch.tensor(parents), torch.zeros(1, 3, 8))


def test_tree_bad_tokens_and_shapes():
    par = torch.tensor([[-1, 0, 0]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dspec.verify_tree(torch.tensor([[0, 8, 1]]), par, torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="shape of tokens"):
        dspec.verify_tree(torch.zeros(1, 3, dtype=torch.int64), par[:, :2], torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match=r"\[B, N, V\]"):
        dspec.verify_tree(torch.zeros(1, 3, dtype=torch.int64), par, torch.zeros(1, 2, 8))
    # a padding node's token is ignored (it may be anything)
    dspec.verify_tree(torch.tensor([[0, 1, -7]]), torch.tensor([[-1, 0, -1]]), torch.zeros(1, 3, 8))


# ------------------------------------------------------------------------ losslessness
# A Markov "target model" p(next | prev) and "drafter" q(next | prev) over a small
# vocabulary.  Speculative rounds run until every trial has emitted K tokens; the joint law of
# those K tokens must be the target's p^K, whatever the drafter.  200k trials, chi-square.
VOCAB, K_TOKENS, TRIALS = 4, 3, 200_000


def _markov(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, -1)
    return p, q


def _chi_square_threshold(df, z=4.753):  # upper 1e-6 quantile, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _joint_chi_square(seqs, p, start):
    counts = torch.zeros(VOCAB**K_TOKENS, dtype=torch.float64)
    index = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for k in range(K_TOKENS):
        index = index * VOCAB + seqs[:, k]
    counts += torch.bincount(index, minlength=VOCAB**K_TOKENS).double()
    expected = torch.ones(VOCAB**K_TOKENS, dtype=torch.float64)
    for cell in range(VOCAB**K_TOKENS):
        prev, prob, digits = start, 1.0, []
        for k in range(K_TOKENS):
            digits.append((cell // VOCAB ** (K_TOKENS - 1 - k)) % VOCAB)
        for t in digits:
            prob *= float(p[prev, t])
            prev = t
        expected[cell] = prob * seqs.shape[0]
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    return chi2, _chi_square_threshold(VOCAB**K_TOKENS - 1)


def _speculate_chain(p, q, verify, *, length, use_q, device, seed, bad=None):
    g = torch.Generator(device=device).manual_seed(seed)
    start = 0
    log_p = p.log().to(device)
    out = torch.full((TRIALS, K_TOKENS + length + 1), -1, dtype=torch.int64, device=device)
    filled = torch.zeros(TRIALS, dtype=torch.int64, device=device)
    last = torch.full((TRIALS,), start, dtype=torch.int64, device=device)
    qd = q.to(device)
    while bool((filled < K_TOKENS).any()):
        drafts, probs, prev = [], [], last
        for _ in range(length):
            dist = qd[prev]
            tok = torch.multinomial(dist, 1, generator=g)[:, 0]
            drafts.append(tok)
            probs.append(dist)
            prev = tok
        drafts = torch.stack(drafts, 1)
        ctx = torch.cat([last[:, None], drafts], 1)  # token before each position
        logits = log_p[ctx]  # [T, L + 1, V]
        coins = torch.rand(TRIALS, length, generator=g, device=device)
        if bad == "coins_zero":
            coins = torch.zeros_like(coins)
        res = verify(
            drafts,
            logits,
            draft_probs=torch.stack(probs, 1) if use_q else None,
            temperature=1.0,
            coins=coins,
            sample_uniforms=torch.rand(TRIALS, generator=g, device=device),
        )
        emitted = res.num_accepted + 1
        cols = torch.arange(length + 1, device=device)
        rows = torch.arange(TRIALS, device=device)[:, None].expand(-1, length + 1)
        dest = (filled[:, None] + cols).clamp(max=out.shape[1] - 1)
        take = (cols[None, :] < emitted[:, None]) & (filled[:, None] < K_TOKENS)
        out[rows[take], dest[take]] = res.tokens[take]
        last = res.tokens.gather(1, res.num_accepted[:, None])[:, 0]
        filled = torch.where(filled < K_TOKENS, filled + emitted, filled)
    return out[:, :K_TOKENS].cpu(), start


def _chain_verifier(backend):
    return lambda *a, **k: dspec.verify_chain(*a, backend=backend, **k)


def _frequency_pairs():
    pairs = [("cpu", "torch")] + [p for p in backends_for("cpu", ("cpp",))]  # C++: fast enough
    if "cuda" in DEVICES:
        pairs += [p for p in backends_for("cuda", PROVIDED)]
    return pytest.mark.parametrize("device,backend", pairs, ids=[f"{d}-{b}" for d, b in pairs])


@_frequency_pairs()
@pytest.mark.parametrize("use_q", [False, True])
def test_chain_is_lossless(device, backend, use_q):
    p, q = _markov(0)
    seqs, start = _speculate_chain(p, q, _chain_verifier(backend), length=3, use_q=use_q, device=device, seed=1)
    chi2, limit = _joint_chi_square(seqs, p, start)
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f}: verification is not lossless"


def test_known_bad_variants_fail_the_frequency_test():
    """The test has teeth: accepting every draft (coins = 0), or resampling from p instead of
    the residual, changes the output law and is caught."""
    p, q = _markov(0)
    seqs, start = _speculate_chain(
        p, q, _chain_verifier("torch"), length=3, use_q=True, device="cpu", seed=1, bad="coins_zero"
    )
    chi2, limit = _joint_chi_square(seqs, p, start)
    assert chi2 > limit

    def resample_from_p(drafts, logits, **kw):
        """Right acceptance test, wrong correction: the token after a rejection is drawn from
        p instead of the residual max(p - q, 0)."""
        out = dspec.verify_chain(drafts, logits, backend="torch", **kw)
        rows = torch.arange(drafts.shape[0])
        p_j = torch.softmax(logits[rows, out.num_accepted].float(), -1)
        redraw = torch.multinomial(p_j, 1, generator=torch.Generator().manual_seed(7))[:, 0]
        rejected = out.num_accepted < drafts.shape[1]
        out.tokens[rows, out.num_accepted] = torch.where(rejected, redraw, out.tokens[rows, out.num_accepted])
        return out

    seqs, start = _speculate_chain(p, q, resample_from_p, length=3, use_q=True, device="cpu", seed=2)
    chi2, limit = _joint_chi_square(seqs, p, start)
    assert chi2 > limit


def _speculate_tree(p, q, backend, *, distinct, device, seed):
    """Rounds of a 2-wide, 2-deep tree: two depth-1 siblings (repeated or distinct), each
    with one child; the emitted tokens must follow p^K."""
    g = torch.Generator(device=device).manual_seed(seed)
    start = 0
    log_p, qd = p.log().to(device), q.to(device)
    out = torch.full((TRIALS, K_TOKENS + 3), -1, dtype=torch.int64, device=device)
    filled = torch.zeros(TRIALS, dtype=torch.int64, device=device)
    last = torch.full((TRIALS,), start, dtype=torch.int64, device=device)
    parents = torch.tensor([-1, 0, 0, 1, 2], device=device).expand(TRIALS, -1).contiguous()
    while bool((filled < K_TOKENS).any()):
        if distinct:
            a = torch.multinomial(qd[last], 2, replacement=False, generator=g)
        else:
            a = torch.multinomial(qd[last], 2, replacement=True, generator=g)
        c1 = torch.multinomial(qd[a[:, 0]], 1, generator=g)[:, 0]
        c2 = torch.multinomial(qd[a[:, 1]], 1, generator=g)[:, 0]
        tokens = torch.stack([last, a[:, 0], a[:, 1], c1, c2], 1)
        res = dspec.verify_tree(
            tokens,
            parents,
            log_p[tokens],
            temperature=1.0,
            coins=torch.rand(TRIALS, 5, generator=g, device=device),
            sample_uniforms=torch.rand(TRIALS, generator=g, device=device),
            backend=backend,
        )
        emitted = res.num_accepted + 1
        cols = torch.arange(3, device=device)
        rows = torch.arange(TRIALS, device=device)[:, None].expand(-1, 3)
        dest = (filled[:, None] + cols).clamp(max=out.shape[1] - 1)
        take = (cols[None, :] < emitted[:, None]) & (filled[:, None] < K_TOKENS)
        out[rows[take], dest[take]] = res.tokens[:, :3][take]
        last = res.tokens.gather(1, res.num_accepted[:, None])[:, 0]
        filled = torch.where(filled < K_TOKENS, filled + emitted, filled)
    return out[:, :K_TOKENS].cpu(), start


@_frequency_pairs()
@pytest.mark.parametrize("distinct", [False, True])
def test_tree_is_lossless(device, backend, distinct):
    p, q = _markov(3)
    seqs, start = _speculate_tree(p, q, backend, distinct=distinct, device=device, seed=4)
    chi2, limit = _joint_chi_square(seqs, p, start)
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f}: tree verification is not lossless"


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_padding_at_temperature_on_every_backend(backend):
    """-1 past num_drafts (chain) and padding nodes with ids >= V (tree) at T > 0: every
    backend, the torch oracle included, takes them and agrees."""
    from dspec import _backend

    if backend == "cpp" and not _backend.cpp_available():
        pytest.skip("dspec._C not built")
    torch.manual_seed(0)
    B, L, V = 3, 4, 11
    logits = torch.randn(B, L + 1, V)
    drafts = torch.randint(0, V, (B, L))
    num = torch.tensor([4, 2, 0])
    drafts[1, 2:] = -1
    drafts[2, :] = -1
    coins, uni = torch.rand(B, L), torch.rand(B)
    got = dspec.verify_chain(
        drafts, logits, num_drafts=num, temperature=1.0, coins=coins, sample_uniforms=uni, backend=backend
    )
    want = dspec.verify_chain(
        drafts, logits, num_drafts=num, temperature=1.0, coins=coins, sample_uniforms=uni, backend="torch"
    )
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.tokens, want.tokens)
    tokens = torch.tensor([[0, 3, 5, V + 7], [0, 2, -1, 1]])
    parents = torch.tensor([[-1, 0, 0, -1], [-1, 0, -1, -1]])
    tl = torch.randn(2, 4, V)
    tc, tu = torch.rand(2, 4), torch.rand(2)
    got = dspec.verify_tree(tokens, parents, tl, temperature=0.7, coins=tc, sample_uniforms=tu, backend=backend)
    want = dspec.verify_tree(tokens, parents, tl, temperature=0.7, coins=tc, sample_uniforms=tu, backend="torch")
    assert torch.equal(got.path, want.path) and torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("value", [5.0, -0.1, float("nan"), float("inf")])
def test_draft_probs_values_checked(value):
    drafts = torch.tensor([[1, 2]])
    logits = torch.randn(1, 3, 4)
    probs = torch.full((1, 2, 4), 0.25)
    probs[0, 1, 3] = value
    with pytest.raises(ValueError, match=r"draft_probs\[0, 1, 3\]"):
        dspec.verify_chain(drafts, logits, draft_probs=probs, temperature=1.0)
