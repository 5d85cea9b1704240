"""Property-based fuzzing of every public op: hypothesis draws shapes, dtypes, ids, masks,
NaN / inf rows and malformed trees (invalid inputs included on purpose), and each call
must either raise ValueError or equal the torch oracle (``backend="torch"``) -- never any
other exception.  Seeded (derandomize) and bounded: FUZZ_EXAMPLES cases per op.
"""

import json
import math
import os
import time

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import dspec  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("DSPEC_FUZZ_EXAMPLES", "2000"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIAL = (float("nan"), float("inf"), float("-inf"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def floats(data, shape, dtype, *, special=True, low=-8.0, high=8.0):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * (high - low) + low
    if special and x.numel() and data.draw(st.booleans(), label="inject special"):
        flat = x.view(-1)
        for _ in range(data.draw(st.integers(1, 3))):
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(st.sampled_from(SPECIAL))
    return x.to(dtype)


def same(got, want, *, atol=1e-3, rtol=1e-3):
    if isinstance(got, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
        if got.dtype.is_floating_point:
            assert torch.isclose(got.float(), want.float(), atol=atol, rtol=rtol, equal_nan=True).all(), (got, want)
        else:
            assert torch.equal(got, want), (got, want)
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        same(g, w, atol=atol, rtol=rtol)


def call(fn, *args, **kwargs):
    """The op's result, or None when it raised ValueError (any other exception fails)."""
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return None


def check(op, *args, atol=1e-3, rtol=1e-3, **kwargs):
    got = call(op, *args, **kwargs)
    want = call(op, *args, backend="torch", **kwargs)
    if got is None or want is None:
        assert got is None and want is None, "one backend raised ValueError, the other did not"
        return
    same(got, want, atol=atol, rtol=rtol)


def logits_case(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    lead = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=2))
    vocab = data.draw(st.integers(0, 70))
    return floats(data, (*lead, vocab), dtype), vocab


def temperature(data):
    return data.draw(st.one_of(st.floats(1e-3, 10.0), st.sampled_from([0.0, -1.0, float("nan"), float("inf")])))


@FUZZ
@given(st.data())
def test_token_stats(data):
    x, _ = logits_case(data)
    check(dspec.token_stats, x, temperature=temperature(data), atol=2e-3)


@FUZZ
@given(st.data())
def test_topk_and_mass(data):
    x, vocab = logits_case(data)
    k = data.draw(st.integers(-1, vocab + 1))
    t = temperature(data)
    check(dspec.topk_tokens, x, k, temperature=t, atol=2e-3)
    tau = data.draw(st.one_of(st.floats(0.0, 1.2), st.just(float("nan"))))
    got = call(dspec.mass_candidates, x, tau, k, temperature=t)
    want = call(dspec.mass_candidates, x, tau, k, temperature=t, backend="torch")
    assert (got is None) == (want is None)
    if got is not None:
        # count may differ where the running mass is within float rounding of tau
        near = torch.zeros_like(want[2], dtype=torch.bool)
        if want[1].numel():
            mass = torch.exp(torch.nan_to_num(want[1].float(), neginf=-math.inf)).cumsum(-1)
            near = ((mass - tau).abs() < 1e-4).any(-1)
        ok = ~near
        same(got[2][ok], want[2][ok])
        same(got[0][ok], want[0][ok])
        same(got[1][ok], want[1][ok], atol=2e-3)


@FUZZ
@given(st.data())
def test_boundary_ops(data):
    batch, length = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 9))
    conf = floats(data, (batch, length), torch.float32, low=-0.2, high=1.2)
    check(dspec.boundary_posterior, conf, atol=1e-5)
    check(dspec.expected_accept_length, conf, atol=1e-5)
    check(dspec.rejection_boundaries, conf, data.draw(st.integers(-1, length + 1)), atol=1e-5)


@FUZZ
@given(st.data())
def test_pack_unpack(data):
    shape = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    keys = data.draw(st.integers(0, 70))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    mask = torch.rand((*shape, keys), generator=g) < 0.5
    if data.draw(st.booleans()):
        mask = mask.to(data.draw(st.sampled_from([torch.int32, torch.float32, torch.uint8])))
    check(dspec.pack_mask, mask)
    words = torch.randint(-(2**31), 2**31 - 1, (*shape, max(1, (keys + 31) // 32)), generator=g, dtype=torch.int64).to(
        data.draw(st.sampled_from([torch.int32, torch.int64]))
    )
    check(dspec.unpack_mask, words, data.draw(st.integers(-1, 80)))


def parents_case(data, batch, nodes):
    rows = []
    for _ in range(batch):
        row = [data.draw(st.sampled_from([-1, 0, 1]))] if nodes else []
        for i in range(1, nodes):
            row.append(data.draw(st.one_of(st.integers(0, i - 1), st.integers(-2, nodes + 1))))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).view(batch, nodes)


@FUZZ
@given(st.data())
def test_tree_mask(data):
    batch, nodes = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 40))
    parents = parents_case(data, batch, nodes).to(data.draw(st.sampled_from([torch.int32, torch.int64])))
    check(dspec.tree_mask, parents)


@FUZZ
@given(st.data())
def test_verify_chain(data):
    batch, length = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6))
    vocab = data.draw(st.integers(1, 40))
    dtype = data.draw(st.sampled_from(DTYPES))
    logits = floats(data, (batch, length + 1, vocab), dtype)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    drafts = torch.randint(-1, vocab + 1, (batch, length), generator=g)
    num = torch.randint(-1, length + 2, (batch,), generator=g) if data.draw(st.booleans()) else None
    t = data.draw(st.sampled_from([0.0, 0.7, 1.0]))
    q = None
    if t > 0 and data.draw(st.booleans()):
        q = torch.softmax(torch.randn(batch, length, vocab, generator=g), -1)
        if data.draw(st.booleans()) and q.numel():
            q.view(-1)[0] = data.draw(st.sampled_from([float("nan"), 2.0, -0.5]))
    coins, uni = torch.rand(batch, length, generator=g), torch.rand(batch, generator=g)
    check(
        dspec.verify_chain,
        drafts,
        logits,
        draft_probs=q,
        num_drafts=num,
        temperature=t,
        coins=coins,
        sample_uniforms=uni,
    )


@FUZZ
@given(st.data())
def test_verify_tree(data):
    batch, nodes = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 8))
    vocab = data.draw(st.integers(1, 30))
    logits = floats(data, (batch, nodes, vocab), data.draw(st.sampled_from(DTYPES)))
    parents = parents_case(data, batch, nodes)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    tokens = torch.randint(-1, vocab + 1, (batch, nodes), generator=g)
    t = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    check(
        dspec.verify_tree,
        tokens,
        parents,
        logits,
        temperature=t,
        coins=torch.rand(batch, nodes, generator=g),
        sample_uniforms=torch.rand(batch, generator=g),
    )


@FUZZ
@given(st.data())
def test_cascade_attention_and_merge(data):
    batch, n = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 9))
    hkv = data.draw(st.integers(1, 3))
    hq = hkv * data.draw(st.integers(1, 3)) + data.draw(st.sampled_from([0, 0, 0, 1]))
    d = data.draw(st.sampled_from([1, 8, 16, 40]))
    dtype = data.draw(st.sampled_from(DTYPES))
    q = floats(data, (batch, n, hq, d), dtype, special=False)
    k = floats(data, (batch, n, hkv, d), dtype, special=False)
    v = floats(data, (batch, n, hkv, d), dtype, special=False)
    mask = None
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    if data.draw(st.booleans()):
        mask = torch.rand((batch, n, n) if data.draw(st.booleans()) else (n, n), generator=g) < 0.5
    kw = {}
    if data.draw(st.booleans()):
        lens = torch.randint(0, 6, (batch,), generator=g)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        total = int(indptr[-1]) + data.draw(st.integers(-1, 2))
        total = max(total, 0)
        kw = dict(
            prefix_k=floats(data, (total, hkv, d), dtype, special=False),
            prefix_v=floats(data, (total, hkv, d), dtype, special=False),
            prefix_indptr=indptr,
        )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    check(dspec.cascade_attention, q, k, v, mask, return_lse=True, atol=tol, rtol=tol, **kw)
    rows = data.draw(st.integers(0, 5))
    o_a, o_b = floats(data, (rows, d), dtype, special=False), floats(data, (rows, d), dtype, special=False)
    lse_a = floats(data, (rows,), torch.float32, low=-5, high=5)
    lse_b = floats(data, (rows,), torch.float32, low=-5, high=5)
    check(dspec.merge_states, o_a, lse_a, o_b, lse_b, atol=tol, rtol=tol)


# --------------------------------------------------------------------------- dspec.generate's options
#
# Every method's options on the tiny models: any value decodes or raises ValueError -- never
# another exception, a hang (the deadline) or a huge allocation (the size bounds reject the
# huge values before any work).  A few examples per method, so the whole sweep takes seconds.

GENERATE_EXAMPLES = int(os.environ.get("DSPEC_GENERATE_FUZZ_EXAMPLES", "12"))
GENERATE_FUZZ = settings(
    max_examples=GENERATE_EXAMPLES,
    deadline=20_000,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
_MODELS = {}
#: past every size bound of the tiny models (context 4096, MAX_DRAFT_LEN 256, ...)
HUGE = (5000, 10**6, 10**9, 2**62)
ANY_VALUE = st.one_of(
    st.integers(-3, 10),
    st.sampled_from(HUGE),
    st.sampled_from(
        [
            None,
            True,
            False,
            0.0,
            0.5,
            1.0,
            2.5,
            -1.0,
            float("nan"),
            float("inf"),
            "auto",
            "x",
            "1,2",
            [],
            [1, 2],
            {"a": 1},
        ]
    ),
)
#: values that would make ``spiffy`` calibrate a new graph (minutes): only the shipped ones
SHIPPED_ONLY = {("spiffy", "block_size"): (None, 4, 8, 16), ("spiffy", "graph_size"): (None, 16)}


def _tiny(name):
    if name not in _MODELS:
        _MODELS[name] = dspec.load(name)
    return _MODELS[name]


def _option_value(data, method, name):
    if (method, name) in SHIPPED_ONLY:
        return data.draw(
            st.one_of(
                st.sampled_from(SHIPPED_ONLY[method, name]),
                st.sampled_from(HUGE),
                st.sampled_from([-1, 0, 2.5, "x", float("nan")]),
            ),
            label=name,
        )
    return data.draw(ANY_VALUE, label=name)


@pytest.mark.parametrize("method", ["ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd"])
def test_generate_options(method, tmp_path_factory, monkeypatch):
    from dspec.decode.generate import method_module

    monkeypatch.setenv("DSPEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    module = method_module(method)
    model = _tiny("tiny-ar" if method in ("ar", "diffuspec", "dflash", "d2sd") else "tiny-bd")
    names = list(module.OPTIONS)

    @GENERATE_FUZZ
    @given(st.data())
    def run(data):
        chosen = data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True), label="options") if names else []
        options = {name: _option_value(data, method, name) for name in chosen}
        temperature = data.draw(st.sampled_from([0.0, 1.0]), label="temperature")
        start = time.perf_counter()
        try:
            out = dspec.generate(
                model, "def add(a, b):", method=method, max_new_tokens=6, temperature=temperature, seed=0, **options
            )
        except ValueError:
            return
        finally:
            assert time.perf_counter() - start < 15, options
        assert 1 <= len(out.tokens) <= 6
        json.dumps(out.stats, allow_nan=False)

    run()
