"""Ragged suffixes of cascade_attention / CascadeAttentionPlan and S-state merge_states."""

import pytest
import torch

import dspec
from conftest import device_backends
from dspec.reference import attention as reference, pack_mask as pack_reference

PROVIDED = ("torch", "triton", "cpp")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_ragged(lens, hq, hkv, d, prefix_lens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total, max_n = sum(lens), max(lens, default=0)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    # random bits over max_n keys (bits past a request's length too: they must be ignored)
    dense = torch.rand(total, max_n, generator=g) < 0.5
    words = pack_reference.pack_mask(dense) if max_n else torch.zeros(total, 0, dtype=torch.int32)
    pk = torch.randn(sum(prefix_lens), hkv, d, generator=g).to(dtype)
    pv = torch.randn(sum(prefix_lens), hkv, d, generator=g).to(dtype)
    cum = lambda xs: torch.tensor([0] + torch.tensor(xs, dtype=torch.int64).cumsum(0).tolist())
    return q, k, v, words, pk, pv, cum(prefix_lens).int(), cum(lens).int()


def separate_calls(q, k, v, words, pk, pv, pind, sind, backend, **kw):
    """B separate calls of the batched cascade_attention, one per request."""
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2])
    bounds = sind.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        m = pack_reference.pack_mask(pack_reference.unpack_mask(words[lo:hi], hi - lo))
        p0, p1 = int(pind[b]), int(pind[b + 1])
        o, s = dspec.cascade_attention(
            q[None, lo:hi],
            k[None, lo:hi],
            v[None, lo:hi],
            m[None],
            prefix_k=pk[p0:p1],
            prefix_v=pv[p0:p1],
            prefix_indptr=torch.tensor([0, p1 - p0]),
            return_lse=True,
            backend=backend,
            **kw,
        )
        out[lo:hi], lse[lo:hi] = o[0], s[0]
    return out, lse


def assert_same(got, exp, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got[0].cpu().float(), exp[0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got[1].cpu(), exp[1], atol=1e-4, rtol=1e-4)


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,prefix_lens,hq,hkv", [([3, 0, 5, 1], [4, 2, 0, 7], 4, 2), ([33, 7], [5, 9], 2, 2), ([1], [3], 8, 1)]
)
def test_ragged_equals_separate_calls(device, backend, dtype, lens, prefix_lens, hq, hkv):
    case = make_ragged(lens, hq, hkv, 16, prefix_lens, dtype, seed=sum(lens))
    q, k, v, words, pk, pv, pind, sind = case
    dev = [t.to(device) for t in case]
    got = dspec.cascade_attention(
        *dev[:4],
        prefix_k=dev[4],
        prefix_v=dev[5],
        prefix_indptr=dev[6],
        suffix_indptr=dev[7],
        return_lse=True,
        backend=backend,
    )
    assert got[0].shape == q.shape and got[1].shape == q.shape[:2]
    assert_same(got, separate_calls(*case, backend=backend), dtype)
    # the plain reference is the same B calls of the reference
    ref = reference.ragged_cascade_attention(
        q, k, v, words, suffix_indptr=sind, prefix_k=pk, prefix_v=pv, prefix_indptr=pind, return_lse=True
    )
    assert_same(got, ref, dtype)
    # without return_lse, and without a mask (all of a request's suffix keys visible)
    out = dspec.cascade_attention(
        *dev[:4], prefix_k=dev[4], prefix_v=dev[5], prefix_indptr=dev[6], suffix_indptr=dev[7], backend=backend
    )
    torch.testing.assert_close(out, got[0], atol=0, rtol=0)
    full = torch.full_like(words, -1)
    nomask = dspec.cascade_attention(
        *dev[:3],
        prefix_k=dev[4],
        prefix_v=dev[5],
        prefix_indptr=dev[6],
        suffix_indptr=dev[7],
        return_lse=True,
        backend=backend,
    )
    assert_same(nomask, separate_calls(q, k, v, full, pk, pv, pind, sind, backend=backend), dtype)


@device_backends(("torch", "cpp"))
def test_ragged_paged_prefix_and_no_prefix(device, backend):
    lens, prefix_lens = [2, 0, 6], [5, 3, 9]
    q, k, v, words, pk, pv, pind, sind = make_ragged(lens, 4, 1, 8, prefix_lens, torch.float32, 3)
    page_size = 4
    pages = [(n + page_size - 1) // page_size for n in prefix_lens]
    table = torch.zeros(3, max(pages), dtype=torch.int32)
    pool_k = torch.zeros(sum(pages) + 1, page_size, 1, 8)
    pool_v = torch.zeros_like(pool_k)
    nxt = sum(pages)  # pages handed out from the end, so the table is not the identity
    for b, n in enumerate(prefix_lens):
        rows_k, rows_v = pk[pind[b] : pind[b + 1]], pv[pind[b] : pind[b + 1]]
        for i in range(pages[b]):
            table[b, i] = nxt
            chunk = slice(i * page_size, min(n, (i + 1) * page_size))
            pool_k[nxt, : chunk.stop - chunk.start] = rows_k[chunk]
            pool_v[nxt, : chunk.stop - chunk.start] = rows_v[chunk]
            nxt -= 1
    got = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        prefix_k=pool_k,
        prefix_v=pool_v,
        prefix_page_table=table,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        suffix_indptr=sind,
        return_lse=True,
        backend=backend,
    )
    assert_same(got, separate_calls(q, k, v, words, pk, pv, pind, sind, backend=backend), torch.float32)
    # no prefix at all: the empty prefix of every request
    got = dspec.cascade_attention(q, k, v, words, suffix_indptr=sind.long(), return_lse=True, backend=backend)
    empty = torch.zeros(0, 1, 8)
    exp = separate_calls(q, k, v, words, empty, empty, torch.zeros(4, dtype=torch.int32), sind, backend)
    assert_same(got, exp, torch.float32)


@device_backends(PROVIDED)
def test_ragged_empty(device, backend):
    e, ek = torch.zeros(0, 2, 8), torch.zeros(0, 1, 8)
    out, lse = dspec.cascade_attention(
        e, ek, ek, suffix_indptr=torch.tensor([0, 0, 0]), return_lse=True, backend=backend
    )
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)
    assert dspec.cascade_attention(e, ek, ek, suffix_indptr=torch.tensor([0]), backend=backend).shape == (0, 2, 8)


def test_ragged_autograd_matches_separate_calls():
    q, k, v, words, pk, pv, pind, sind = make_ragged([2, 3], 2, 1, 8, [1, 4], torch.float64, 5)
    q.requires_grad_()
    out = dspec.cascade_attention(
        q, k, v, words, prefix_k=pk, prefix_v=pv, prefix_indptr=pind, suffix_indptr=sind, backend="torch"
    )
    (g,) = torch.autograd.grad(out.sum(), q)
    q2 = q.detach().requires_grad_()
    exp = separate_calls(q2, k, v, words, pk, pv, pind, sind, backend="torch")[0]
    (g2,) = torch.autograd.grad(exp.sum(), q2)
    torch.testing.assert_close(g, g2)


@device_backends(("torch", "cpp"))
@pytest.mark.parametrize("layout", ["ragged", "paged", "none"])
def test_plan_ragged_equals_call(device, backend, layout):
    lens, prefix_lens = [4, 0, 1, 7], [3, 6, 0, 2]
    q, k, v, words, pk, pv, pind, sind = make_ragged(lens, 4, 2, 16, prefix_lens, torch.float32, 11)
    kw, run_prefix = {}, ()
    if layout == "ragged":
        kw, run_prefix = dict(prefix_indptr=pind), (pk, pv)
    elif layout == "paged":  # one page per request: page_size = the longest prefix
        size = max(prefix_lens)
        pool_k, pool_v = torch.zeros(4, size, 2, 16), torch.zeros(4, size, 2, 16)
        for b, n in enumerate(prefix_lens):
            pool_k[b, :n], pool_v[b, :n] = pk[pind[b] : pind[b + 1]], pv[pind[b] : pind[b + 1]]
        kw = dict(
            prefix_page_table=torch.arange(4, dtype=torch.int32)[:, None],
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        )
        run_prefix = (pool_k, pool_v)
    plan = dspec.ops.CascadeAttentionPlan(
        4, sum(lens), 4, 2, 16, torch.float32, device, words, suffix_indptr=sind, sm_scale=0.3, backend=backend, **kw
    )
    for _ in range(2):  # the plan is reusable (one call per layer)
        got = plan.run(q, k, v, *run_prefix, return_lse=True)
    one = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        suffix_indptr=sind,
        sm_scale=0.3,
        return_lse=True,
        backend=backend,
        **kw,
        **dict(zip(("prefix_k", "prefix_v"), run_prefix)),
    )
    torch.testing.assert_close(got[0], one[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], one[1], atol=0, rtol=0)
    assert torch.equal(plan.run(q, k, v, *run_prefix), one[0])
    with pytest.raises(ValueError, match="the plan takes"):
        plan.run(q[:-1], k, v, *run_prefix)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(suffix_indptr=torch.tensor([0, 3, 2, 6], dtype=torch.int32)), "suffix_indptr"),
        (lambda a: a.update(suffix_indptr=torch.tensor([1, 3, 4, 6], dtype=torch.int32)), "suffix_indptr"),
        (lambda a: a.update(suffix_indptr=torch.tensor([0, 3, 4, 5], dtype=torch.int32)), "suffix_indptr"),
        (lambda a: a.update(suffix_indptr=torch.tensor([0.0, 3, 4, 6])), "suffix_indptr"),
        (lambda a: a.update(suffix_indptr=torch.tensor([[0, 3, 4, 6]], dtype=torch.int32)), "suffix_indptr"),
        (lambda a: a.update(mask=torch.zeros(6, 2, dtype=torch.int32)), "mask"),
        (lambda a: a.update(mask=torch.zeros(5, 1, dtype=torch.int32)), "mask"),
        (lambda a: a.update(mask=torch.zeros(6, 3, dtype=torch.bool)), "mask"),
        (lambda a: a.update(k=a["k"][:5]), "k and v"),
        (lambda a: a.update(v=a["v"][:, :, :4]), "k and v"),
        (lambda a: a.update(q=a["q"][None]), "q"),
        (lambda a: a.update(prefix_indptr=torch.tensor([0, 2, 4])), "prefix_indptr"),
    ],
)
def test_ragged_bad_input(mutate, match):
    q, k, v, words, pk, pv, pind, sind = make_ragged([3, 1, 2], 2, 1, 8, [2, 2, 2], torch.float32, 1)
    args = dict(q=q, k=k, v=v, mask=words, prefix_k=pk, prefix_v=pv, prefix_indptr=pind, suffix_indptr=sind)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        dspec.cascade_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("mask"), **args)


def test_plan_ragged_bad_input():
    sind = torch.tensor([0, 3, 5], dtype=torch.int32)
    make = dspec.ops.CascadeAttentionPlan
    with pytest.raises(ValueError, match="suffix_indptr"):
        make(3, 5, 2, 1, 8, torch.float32, suffix_indptr=sind)  # B + 1 entries
    with pytest.raises(ValueError, match="suffix_indptr"):
        make(2, 6, 2, 1, 8, torch.float32, suffix_indptr=sind)  # ends at T = n
    with pytest.raises(ValueError, match="mask"):
        make(2, 5, 2, 1, 8, torch.float32, "cpu", torch.zeros(5, 2, dtype=torch.int32), suffix_indptr=sind)


def fold_pairwise(v, lse):
    o, s = v.select(-3, 0), lse.select(-2, 0)
    for i in range(1, v.shape[-3]):
        o, s = dspec.merge_states(o, s, v.select(-3, i), lse.select(-2, i), backend="torch")
    return o, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_states", [1, 2, 5])
def test_merge_states_many_equals_folding(dtype, num_states):
    g = torch.Generator().manual_seed(num_states)
    v = torch.randn(3, 2, num_states, 4, 7, generator=g).to(dtype)
    lse = torch.randn(3, 2, num_states, 4, generator=g) * 3
    lse[0, 0, 0] = float("-inf")  # one empty state
    lse[1, 1, :, 2] = float("-inf")  # a head with no keys in any state
    o, s = dspec.merge_states(v, lse)
    assert o.shape == (3, 2, 4, 7) and o.dtype == dtype and s.shape == (3, 2, 4) and s.dtype == torch.float32
    exp_o, exp_s = fold_pairwise(v, lse)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    if num_states == 1:  # the state as given
        assert torch.equal(o, v[:, :, 0]) and torch.equal(s, lse[:, :, 0])
        return
    torch.testing.assert_close(o.float(), exp_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(s, exp_s, atol=1e-5, rtol=1e-5)
    assert (s[1, 1, 2] == float("-inf")) and (o[1, 1, 2] == 0).all()
    ref = reference.merge_states_many(v, lse)
    assert torch.equal(o, ref[0]) and torch.equal(s, ref[1])


def test_merge_states_many_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k0, v0 = torch.randn(3, 1, 3, 2, 8, generator=g, dtype=torch.float64)
    keys, vals = torch.randn(2, 10, 2, 8, generator=g, dtype=torch.float64)
    hidden = torch.zeros(3, 1, dtype=torch.int32)  # the suffix keys stay invisible

    def attend(lo, hi):
        return reference.cascade_attention(
            q,
            k0,
            v0,
            hidden,
            prefix_k=keys[lo:hi],
            prefix_v=vals[lo:hi],
            prefix_indptr=torch.tensor([0, hi - lo]),
            return_lse=True,
        )

    full, full_lse = attend(0, 10)
    parts = [attend(lo, hi) for lo, hi in [(0, 4), (4, 4), (4, 5), (5, 10)]]  # (4, 4): an empty part
    o, s = dspec.merge_states(torch.stack([p[0].float() for p in parts], -3), torch.stack([p[1] for p in parts], -2))
    torch.testing.assert_close(o.double(), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), full_lse.double(), atol=1e-5, rtol=1e-5)


def test_merge_states_many_bad_input():
    v, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lse"):
        dspec.merge_states(v, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lse"):
        dspec.merge_states(v, lse.double())
    with pytest.raises(ValueError, match="v"):
        dspec.merge_states(torch.zeros(3, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="S >= 1"):
        dspec.merge_states(torch.zeros(0, 3, 4), torch.zeros(0, 3))
    with pytest.raises(ValueError, match="o_b and lse_b"):
        dspec.merge_states(v, lse, v)
    with pytest.raises(ValueError):
        dspec.merge_states(v, lse, backend="nope")
