"""best_first_tree: the C++ backend equals the torch reference exactly; both equal a brute
force over every path (the same top-N scores, the same node set without boundary ties);
the output is a valid best-first tree; the node set is marginal_tree's; bad inputs raise."""

import doctest
import itertools

import numpy as np
import pytest
import torch

import dspec
from dspec import _backend
from dspec.decode.dflash import marginal_tree
from dspec.ops import tree as tree_ops
from dspec.reference.best_first_tree import num_paths
from dspec.testing import assert_no_host_syncs

needs_cpp = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")
PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(g, batch, slots, k, *, sort=False, dtype=torch.float32, id_dtype=torch.int64, zeros=0.0, ties=False):
    probs = torch.rand(batch, slots, k, generator=g)
    if ties:  # few distinct values: many exact score ties
        probs = (probs * 4).ceil() / 4
    if zeros:
        probs = torch.where(torch.rand(batch, slots, k, generator=g) < zeros, 0.0, probs)
    if sort:
        probs = probs.sort(-1, descending=True).values
    # distinct per (slot, candidate), so a token path names one node
    tokens = torch.randperm(1000, generator=g)[: slots * k].view(1, slots, k).expand(batch, -1, -1)
    return probs.to(dtype), tokens.to(id_dtype).contiguous()


def _random_case(g):
    batch, slots, k = (int(torch.randint(lo, hi + 1, (1,), generator=g)) for lo, hi in ((1, 4), (1, 8), (1, 6)))
    return batch, slots, k, int(torch.randint(1, 65, (1,), generator=g))


def _factors(probs):
    return torch.nan_to_num(probs.float(), nan=0.0).clamp(0, 1).numpy()


def _paths(tree, b):
    """Each node's token path (a tuple), from tokens and parents."""
    out = []
    for tok, par in zip(tree.tokens[b].tolist(), tree.parents[b].tolist()):
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


def _brute_force(probs, tokens, b):
    """{token path: float32 score} over every path, the score multiplied slot by slot."""
    f, t = _factors(probs)[b], tokens[b].tolist()
    slots, k = f.shape
    scores = {}
    for depth in range(1, slots + 1):
        for picks in itertools.product(range(k), repeat=depth):
            s = np.float32(1.0)
            for j, c in enumerate(picks):
                s = np.float32(s * f[j, c])
            scores[tuple(t[j][c] for j, c in enumerate(picks))] = float(s)
    return scores


# ---------------------------------------------------------------------------------- backends


@needs_cpp
@pytest.mark.parametrize("seed", range(24))
def test_cpp_matches_torch_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    batch, slots, k, nodes = _random_case(g)
    probs, tokens = _inputs(
        g,
        batch,
        slots,
        k,
        sort=seed % 2 == 1,
        dtype=PROB_DTYPES[seed % 3],
        id_dtype=(torch.int32, torch.int64)[seed // 3 % 2],
        zeros=0.3 * (seed % 4 == 0),
        ties=seed % 5 == 0,
    )
    ref = dspec.best_first_tree(probs, tokens, nodes, backend="torch")
    got = dspec.best_first_tree(probs, tokens, nodes, backend="cpp")
    assert ref.tokens.shape == (batch, min(nodes, sum(k**d for d in range(1, slots + 1))))
    for name, x, y in zip(ref._fields, ref, got):
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), name


@needs_cpp
def test_cpp_matches_torch_on_unchecked_values(no_value_checks):
    """Values outside [0, 1] and NaN (passed with value checks off) clamp the same way."""
    g = torch.Generator().manual_seed(5)
    probs = torch.randn(3, 5, 4, generator=g)
    probs[0, 1, 2] = float("nan")
    probs[1, 0, 0] = float("inf")
    tokens = torch.randint(0, 50, (3, 5, 4), generator=g)
    ref = dspec.best_first_tree(probs, tokens, 40, backend="torch")
    got = dspec.best_first_tree(probs, tokens, 40, backend="cpp")
    for x, y in zip(ref, got):
        assert torch.equal(x, y)


def test_auto_backend():
    probs, tokens = _inputs(torch.Generator().manual_seed(0), 2, 3, 2)
    auto = dspec.best_first_tree(probs, tokens, 5)
    ref = dspec.best_first_tree(probs, tokens, 5, backend="torch")
    for x, y in zip(auto, ref):
        assert torch.equal(x, y)


def test_empty_batch():
    probs, tokens = torch.rand(0, 3, 2), torch.zeros(0, 3, 2, dtype=torch.int64)
    for backend in ("torch", "cpp") if _backend.cpp_available() else ("torch",):
        tree = dspec.best_first_tree(probs, tokens, 4, backend=backend)
        assert [tuple(x.shape) for x in (*tree, tree.scores, tree.depth)] == [(0, 4)] * 4


# ------------------------------------------------------------------------ what the nodes are


@pytest.mark.parametrize("seed", range(16))
def test_brute_force_top_scores_and_set(seed):
    g = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 4, (1,), generator=g))
    slots, k = [(1, 5), (2, 4), (3, 3), (4, 2), (5, 2), (3, 4)][seed % 6]
    nodes = int(torch.randint(1, 45, (1,), generator=g))
    probs, tokens = _inputs(
        g,
        batch,
        slots,
        k,
        sort=seed % 2 == 0,
        dtype=PROB_DTYPES[seed % 3],
        zeros=0.25 * (seed % 3 == 1),
        ties=seed % 4 == 3,
    )
    backends = ("torch", "cpp") if _backend.cpp_available() else ("torch",)
    for backend in backends:
        tree = dspec.best_first_tree(probs, tokens, nodes, backend=backend)
        n = tree.tokens.shape[1]
        for b in range(batch):
            every = _brute_force(probs, tokens, b)
            ranked = sorted(every.values(), reverse=True)
            assert n == min(nodes, len(every))
            assert tree.scores[b].tolist() == ranked[:n]  # the top-N scores, best first
            assert sum(tree.scores[b].tolist()) == sum(ranked[:n])
            paths = _paths(tree, b)
            assert len(set(paths)) == n
            assert all(every[p] == s for p, s in zip(paths, tree.scores[b].tolist()))
            if n == len(ranked) or ranked[n - 1] > ranked[n]:  # no tie at the boundary: one top-N set
                assert set(paths) == {p for p, s in every.items() if s >= ranked[n - 1]}


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_tree_structure(backend):
    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        batch, slots, k, nodes = _random_case(g)
        probs, tokens = _inputs(g, batch, slots, k, zeros=0.2 * (trial % 2), ties=trial % 3 == 0)
        tree = dspec.best_first_tree(probs, tokens, nodes, backend=backend)
        f = _factors(probs)
        cand_of = {(d, int(tokens[0, d, c])): c for d in range(slots) for c in range(k)}
        for b in range(batch):
            par, dep, sc = tree.parents[b].tolist(), tree.depth[b].tolist(), tree.scores[b].tolist()
            for i, (p, d, s) in enumerate(zip(par, dep, sc)):
                assert -1 <= p < i  # a parent precedes its child
                assert d == (1 if p < 0 else dep[p] + 1)
                cand = cand_of[(d - 1, int(tree.tokens[b, i]))]
                parent_score = np.float32(1.0) if p < 0 else np.float32(sc[p])
                assert s == float(np.float32(parent_score * f[b, d - 1, cand]))
            assert all(x >= y for x, y in zip(sc, sc[1:]))  # pops never rise
            assert par[0] == -1 and dep[0] == 1


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_zero_probabilities_come_last_with_score_zero(backend):
    probs = torch.tensor([[[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.2, 0.0, 0.9]]])
    tokens = torch.arange(9).view(1, 3, 3)
    tree = dspec.best_first_tree(probs, tokens, 12, backend=backend)
    # one positive path: (1); then the zeros, still N = 12 nodes, in pop order
    assert tree.tokens.shape == (1, 12)
    assert tree.scores[0, 0] == 0.5 and bool((tree.scores[0, 1:] == 0).all())
    assert tree.tokens[0, 0] == 1 and tree.parents[0, 0] == -1
    # a positive sibling outranks a zero one: rank order within slot 0 is 1, 0, 2
    assert [t for t, p in zip(tree.tokens[0].tolist(), tree.parents[0].tolist()) if p == -1] == [1, 0, 2]


def test_ties_pop_in_push_order():
    """Equal scores: the earlier push first (a node's sibling is pushed before its child)."""
    probs = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]])
    tokens = torch.tensor([[[10, 11], [20, 21]]])
    for backend in ("torch", "cpp") if _backend.cpp_available() else ("torch",):
        tree = dspec.best_first_tree(probs, tokens, 6, backend=backend)
        # pop 10 (pushes 11 as 1, its child 20 as 2); pop 11 (pushes its child 20 as 4); pop 20
        # under 10 (pushes 21 as 5); pop 20 under 11 (pushes 21 as 7); pop 21 under 10, then under 11
        assert tree.tokens.tolist() == [[10, 11, 20, 20, 21, 21]]
        assert tree.parents.tolist() == [[-1, -1, 0, 1, 0, 1]]


@pytest.mark.parametrize("seed", range(10))
def test_same_node_set_as_marginal_tree(seed):
    g = torch.Generator().manual_seed(300 + seed)
    batch, slots, k, nodes = _random_case(g)
    probs, tokens = _inputs(g, batch, slots, k, sort=seed % 2 == 0)
    tree = dspec.best_first_tree(probs, tokens, nodes)
    more = dspec.best_first_tree(probs, tokens, nodes + 1)
    m_tok, m_par, m_dep, _ = marginal_tree(probs, tokens, nodes)
    n = tree.tokens.shape[1]
    assert m_tok.shape[1] == n
    checked = 0
    for b in range(batch):
        if more.tokens.shape[1] > n and more.scores[b, n] >= more.scores[b, n - 1] * (1 - 1e-5):
            continue  # a near tie at the boundary: float32 vs float64 may differ
        marginal = []
        for tok, par in zip(m_tok[b].tolist(), m_par[b].tolist()):
            marginal.append((marginal[par - 1] if par > 0 else ()) + (tok,))
        assert set(_paths(tree, b)) == set(marginal)
        assert sorted(tree.depth[b].tolist()) == sorted(m_dep[b].tolist())
        checked += 1
    assert checked or batch == 1


# --------------------------------------------------------------------------- validation, ops


def test_num_paths():
    assert num_paths(3, 2, 100) == 14 and num_paths(3, 2, 5) == 5 and num_paths(40, 7, 31) == 31
    assert num_paths(1, 1, 9) == 1 and num_paths(5, 1, 9) == 5


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p, t: dspec.best_first_tree(p.numpy(), t, 3), "slot_probs must be a torch.Tensor"),
        (lambda p, t: dspec.best_first_tree(p[0], t, 3), "slot_probs must have 3 dimensions"),
        (lambda p, t: dspec.best_first_tree(p.double(), t, 3), "slot_probs must have dtype"),
        (lambda p, t: dspec.best_first_tree(p, t.float(), 3), "slot_tokens must have dtype"),
        (lambda p, t: dspec.best_first_tree(p, t[:, :2], 3), "slot_tokens must have slot_probs' shape"),
        (lambda p, t: dspec.best_first_tree(p[:, :0], t[:, :0], 3), "slot_probs must have L >= 1"),
        (lambda p, t: dspec.best_first_tree(p[:, :, :0], t[:, :, :0], 3), "slot_probs must have L >= 1"),
        (lambda p, t: dspec.best_first_tree(p, t, 0), "num_nodes must be >= 1"),
        (lambda p, t: dspec.best_first_tree(p, t, 2.0), "num_nodes must be an int"),
        (lambda p, t: dspec.best_first_tree(p, t, True), "num_nodes must be an int"),
        (lambda p, t: dspec.best_first_tree(p * 2, t, 3), "slot_probs must hold probabilities"),
        (lambda p, t: dspec.best_first_tree(p - 1, t, 3), "slot_probs must hold probabilities"),
        (
            lambda p, t: dspec.best_first_tree(p.masked_fill(p > 0.5, float("nan")), t, 3),
            "slot_probs must hold probabilities",
        ),
        (lambda p, t: dspec.best_first_tree(p, t.to("meta"), 3), "slot_tokens is a meta tensor"),
        (lambda p, t: dspec.best_first_tree(p, t, 3, backend="triton"), "no 'triton' backend"),
        (lambda p, t: dspec.best_first_tree(p, t, 3, backend="bogus"), "backend must be one of"),
    ],
)
def test_bad_inputs(call, match):
    probs, tokens = _inputs(torch.Generator().manual_seed(0), 2, 3, 4)
    with pytest.raises(ValueError, match=match):
        call(probs, tokens)


@needs_cpp
def test_extension_checks_its_arguments():
    ext = _backend.extension()
    out = torch.empty(4, 1, 20, dtype=torch.int64)
    p, t = torch.rand(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.int64)
    args = [
        p.data_ptr(),
        0,
        t.data_ptr(),
        1,
        1,
        2,
        2,
        7,
        out[0].data_ptr(),
        out[1].data_ptr(),
        out[2].data_ptr(),
        out[3].data_ptr(),
    ]
    with pytest.raises(ValueError, match="nodes must be <= the number of paths"):
        ext.best_first_tree(*args)
    for at, value, match in (
        (1, 3, "probs_dtype"),
        (3, 2, "tokens_dtype"),
        (5, 0, "slots"),
        (6, 0, "k"),
        (7, 0, "nodes"),
        (0, 0, "probs_ptr is a null pointer"),
    ):
        bad = list(args)
        bad[7] = 4
        bad[at] = value
        with pytest.raises(ValueError, match=match):
            ext.best_first_tree(*bad)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_custom_op(backend):
    probs, tokens = _inputs(torch.Generator().manual_seed(1), 2, 3, 3, dtype=torch.float16, id_dtype=torch.int32)
    tests = (
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        if backend == "torch"
        else ("test_faketensor",)
    )
    torch.library.opcheck(torch.ops.dspec.best_first_tree.default, (probs, tokens, 7, backend), test_utils=tests)
    direct = dspec.best_first_tree(probs, tokens, 7, backend=backend)
    via_op = torch.ops.dspec.best_first_tree(probs, tokens, 7, backend)
    for x, y in zip(direct, via_op):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_sync_free(backend, no_value_checks):
    probs, tokens = _inputs(torch.Generator().manual_seed(2), 2, 4, 3)
    with assert_no_host_syncs(f"best_first_tree ({backend})"):
        dspec.best_first_tree(probs, tokens, 9, backend=backend)


def test_docstring_example():
    assert doctest.testmod(tree_ops, verbose=False).failed == 0


@pytest.fixture
def no_value_checks():
    saved = dspec.config.validate_values
    dspec.config.validate_values = False
    yield
    dspec.config.validate_values = saved


def test_result_unpacks_as_the_contracted_pair():
    probs = torch.tensor([[[0.6, 0.3], [0.9, 0.1]]])
    tokens = torch.tensor([[[5, 7], [8, 9]]])
    tok, par = dspec.best_first_tree(probs, tokens, 3)
    out = dspec.best_first_tree(probs, tokens, 3)
    assert torch.equal(tok, out.tokens) and torch.equal(par, out.parents) and len(out) == 2
    assert out.scores.shape == out.depth.shape == tok.shape
