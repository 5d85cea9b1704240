"""cascade_attention and merge_states against a float64 explicit-softmax reference."""

import os

import pytest
import torch

import dspec
from conftest import backends_for, device_backends
from dspec import _backend
from dspec.reference import attention as reference, pack_mask as pack_reference

PROVIDED = ("torch", "triton", "cpp")


def make_case(batch, n, hq, hkv, d, prefix_lens, dtype, seed, mask_kind="random"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, hq, d, generator=g)
    k = torch.randn(batch, n, hkv, d, generator=g)
    v = torch.randn(batch, n, hkv, d, generator=g)
    total = sum(prefix_lens)
    pk = torch.randn(total, hkv, d, generator=g)
    pv = torch.randn(total, hkv, d, generator=g)
    indptr = torch.tensor([0] + list(torch.tensor(prefix_lens).cumsum(0).tolist()), dtype=torch.int32)
    if mask_kind == "random":
        dense = torch.rand(batch, n, n, generator=g) < 0.5
        dense |= torch.eye(n, dtype=torch.bool)
    elif mask_kind == "tree":  # ancestor masks of random trees
        parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)] for _ in range(batch)]
        dense = torch.zeros(batch, n, n, dtype=torch.bool)
        for b in range(batch):
            for i in range(n):
                j = i
                while j >= 0:
                    dense[b, i, j] = True
                    j = parents[b][j]
    else:
        dense = None
    if dense is not None and n > 2:
        dense[:, 1] = False  # suffix query 1 sees no suffix key (only its prefix, if any)
    words = None if dense is None else pack_reference.pack_mask(dense)
    cast = lambda t: t.to(dtype)
    return cast(q), cast(k), cast(v), words, cast(pk), cast(pv), indptr


def oracle(q, k, v, words, pk, pv, indptr, **kw):
    return reference.cascade_attention(
        q.double(),
        k.double(),
        v.double(),
        words,
        prefix_k=pk.double(),
        prefix_v=pv.double(),
        prefix_indptr=indptr,
        return_lse=True,
        **kw,
    )


def check_against_oracle(out, lse, case, dtype, **kw):
    """flash-attention style: the error may be at most twice the torch low-precision error."""
    ref_out, ref_lse = oracle(*case, **kw)
    low_out, low_lse = reference.cascade_attention(
        *case[:4], prefix_k=case[4], prefix_v=case[5], prefix_indptr=case[6], return_lse=True, **kw
    )
    base = (low_out.double() - ref_out).abs().max().item()
    err = (out.double().cpu() - ref_out).abs().max().item()
    slack = 1e-5
    if out.device.type == "cpu" and dtype != torch.float32 and _backend.triton_interpret():
        # the interpreter's float32 -> bf16/fp16 store truncates instead of rounding to
        # nearest: up to one more ulp of the output than a GPU (or torch) would give
        slack += torch.finfo(dtype).eps * ref_out.abs().max().item()
    assert err <= 2 * base + slack, f"out error {err:.3g} vs torch {dtype} error {base:.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "-inf lse pattern differs"
    lse_err = (lse.cpu().double() - ref_lse.double())[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-4, f"lse error {lse_err:.3g}"
    empty = ~finite
    if empty.any():
        assert (out.cpu().float()[empty] == 0).all(), "a query that sees nothing must give 0"


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,prefix_lens", [(1, [3]), (7, [0, 20, 5]), (33, [17]), (64, [40, 0])])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 1)])
def test_matches_float64_reference(device, backend, dtype, n, prefix_lens, hq, hkv):
    batch = len(prefix_lens)
    case = make_case(batch, n, hq, hkv, 32, prefix_lens, dtype, n * 10 + hq)
    dev = [t.to(device) if t is not None else None for t in case]
    out, lse = dspec.cascade_attention(
        *dev[:4], prefix_k=dev[4], prefix_v=dev[5], prefix_indptr=dev[6], return_lse=True, backend=backend
    )
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (batch, n, hq, 32)
    check_against_oracle(out, lse, case, dtype)


@device_backends(PROVIDED)
@pytest.mark.parametrize("n,d,mask_kind", [(130, 64, "tree"), (20, 128, "none"), (9, 80, "random")])
def test_shapes_masks_head_dims(device, backend, n, d, mask_kind):
    case = make_case(2, n, 2, 1, d, [0, 37], torch.float32, n + d, mask_kind)
    dev = [t.to(device) if t is not None else None for t in case]
    out, lse = dspec.cascade_attention(
        *dev[:4], prefix_k=dev[4], prefix_v=dev[5], prefix_indptr=dev[6], return_lse=True, sm_scale=0.3, backend=backend
    )
    check_against_oracle(out, lse, case, torch.float32, sm_scale=0.3)


@device_backends(PROVIDED)
def test_no_prefix_and_empty_queries(device, backend):
    """Without a prefix, a query whose mask row is empty gets out = 0 and lse = -inf."""
    q, k, v, words, *_ = make_case(2, 5, 2, 2, 16, [0, 0], torch.float32, 1)
    out, lse = dspec.cascade_attention(
        q.to(device), k.to(device), v.to(device), words.to(device), return_lse=True, backend=backend
    )
    assert (lse[:, 1] == float("-inf")).all() and (out[:, 1] == 0).all()
    ref = reference.cascade_attention(q.double(), k.double(), v.double(), words, return_lse=True)
    torch.testing.assert_close(out.cpu().double(), ref[0], atol=1e-5, rtol=1e-5)
    # no mask at all: full attention over the suffix
    full = dspec.cascade_attention(q.to(device), k.to(device), v.to(device), backend=backend)
    exp = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ).transpose(1, 2)
    torch.testing.assert_close(full.cpu(), exp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_triton_split_prefix_equals_fused(splits):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in [b for _, b in backends_for(device, PROVIDED)]:
        pytest.skip("no triton backend here")
    from dspec.kernels.cascade_attention import cascade_attention_triton

    case = make_case(3, 6, 4, 2, 32, [50, 0, 23], torch.float32, splits)
    dev = [t.to(device) if t is not None else None for t in case]
    out, lse = cascade_attention_triton(*dev, None, True, num_splits=splits, max_prefix_len=50)
    check_against_oracle(out, lse, case, torch.float32)


def test_choose_splits_schedules(monkeypatch):
    """The split rule on a 132-SM GPU: eager launches split only with >= 4096-row chunks;
    graph capture at batch 1 aims at one program per SM (the measured graph-replay bests:
    B1 P512 -> 2, P4096 -> 4-5, P32768 -> 4-8); capture at batch 8 keeps the eager rule."""
    pytest.importorskip("triton")
    from dspec.kernels import cascade_attention as ca

    monkeypatch.setattr(ca, "parallel_units", lambda device: 132)
    cuda = torch.device("cuda")
    # B1 N64 32/8 heads, 64x64 tiles: 4 query blocks x 8 KV heads = 32 programs
    eager = [ca.choose_splits(1, 4, 8, p, 64, cuda) for p in (512, 4096, 32768)]
    graph = [ca.choose_splits(1, 4, 8, p, 64, cuda, capturing=True) for p in (512, 4096, 32768)]
    assert eager == [1, 1, 8] and graph == [2, 5, 5]
    assert ca.choose_splits(1, 4, 8, 128, 64, cuda, capturing=True) == 1  # 2 tiles: no split
    for p in (4096, 32768):  # B8, 128x64 tiles: 2 query blocks x 8 heads x 8 requests
        assert ca.choose_splits(8, 2, 8, p, 64, cuda, capturing=True) == ca.choose_splits(8, 2, 8, p, 64, cuda)


def test_dense_bool_mask_is_packed():
    q, k, v, words, pk, pv, indptr = make_case(2, 40, 2, 1, 16, [3, 4], torch.float32, 4)
    dense = pack_reference.unpack_mask(words, 40)
    a = dspec.cascade_attention(q, k, v, dense, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
    b = dspec.cascade_attention(q, k, v, words, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
    assert torch.equal(a, b)
    shared = dspec.cascade_attention(q, k, v, words[0])  # one [N, W] mask for the batch
    torch.testing.assert_close(shared[0], dspec.cascade_attention(q[:1], k[:1], v[:1], words[:1])[0])


# -------------------------------------------------------------------------- merge_states
@device_backends(("torch", "triton", "cuda", "cpp"))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_merge_states_matches_reference(device, backend, dtype, atol):
    g = torch.Generator().manual_seed(0)
    o_a = torch.randn(7, 3, 80, generator=g).to(dtype)
    o_b = torch.randn(7, 3, 80, generator=g).to(dtype)
    l_a = torch.randn(7, 3, generator=g) * 3
    l_b = torch.randn(7, 3, generator=g) * 3
    l_a[0, 0] = l_b[0, 0] = float("-inf")  # two empty states
    l_a[1, 0] = float("-inf")  # one empty state: the other passes through
    o, lse = dspec.merge_states(o_a.to(device), l_a.to(device), o_b.to(device), l_b.to(device), backend=backend)
    exp_o, exp_lse = reference.merge_states(o_a, l_a, o_b, l_b)
    torch.testing.assert_close(o.cpu(), exp_o, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.cpu(), exp_lse)
    assert (o[0, 0] == 0).all() and lse[0, 0] == float("-inf")
    torch.testing.assert_close(o[1, 0].cpu(), o_b[1, 0], atol=atol, rtol=atol)


def test_merge_states_equals_attention_over_the_union():
    """Splitting keys into prefix / suffix and merging equals attention over both."""
    q, k, v, words, pk, pv, indptr = make_case(1, 4, 2, 2, 16, [9], torch.float64, 2, "none")
    full, full_lse = reference.cascade_attention(
        q, k, v, None, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr, return_lse=True
    )
    o_s, l_s = reference.cascade_attention(q, k, v, None, return_lse=True)
    # prefix-only state: the suffix fully masked
    none = torch.zeros(4, 1, dtype=torch.int32)
    o_p, l_p = reference.cascade_attention(
        q, k, v, none, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr, return_lse=True
    )
    o, lse = dspec.merge_states(o_p.float(), l_p, o_s.float(), l_s)
    torch.testing.assert_close(o.double(), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
def _args():
    return make_case(2, 3, 4, 2, 16, [2, 3], torch.float32, 0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda a: a.update(k=a["k"][:, :, :1].expand(-1, -1, 3, -1), v=a["v"][:, :, :1].expand(-1, -1, 3, -1)),
            "multiple of the KV heads",
        ),
        (lambda a: a.update(v=a["v"][:, :, :1]), "k and v must have shape"),
        (lambda a: a.update(v=a["v"].half()), "v must have dtype"),
        (lambda a: a.update(q=a["q"][0]), "q must have 4 dimensions"),
        (lambda a: a.update(mask=torch.zeros(3, 2, dtype=torch.int32)), "packed words"),
        (lambda a: a.update(mask=torch.zeros(3, 1, dtype=torch.int64)), "mask must have dtype"),
        (lambda a: a.update(prefix_indptr=torch.tensor([0, 2])), "B \\+ 1"),
        (lambda a: a.update(prefix_indptr=torch.tensor([0, 3, 2])), "never decrease"),
        (lambda a: a.update(prefix_indptr=torch.tensor([0, 2, 9])), "end at most"),
        (lambda a: a.update(prefix_v=None), "given together"),
        (lambda a: a.update(prefix_k=a["prefix_k"][:, :1]), "prefix_k and prefix_v must have shape"),
    ],
)
def test_bad_input(mutate, match):
    q, k, v, words, pk, pv, indptr = _args()
    a = dict(q=q, k=k, v=v, mask=words, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        dspec.cascade_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("mask"), **a)


def test_merge_many_heads_and_odd_head_dim():
    """Any number of heads (flashinfer's MergeState fails above 1024 threads per block)."""
    g = torch.Generator().manual_seed(3)
    o_a, o_b = torch.randn(2, 3, 2048, 33, generator=g), torch.randn(2, 3, 2048, 33, generator=g)
    l_a, l_b = torch.randn(2, 3, 2048, generator=g), torch.randn(2, 3, 2048, generator=g)
    exp = reference.merge_states(o_a, l_a, o_b, l_b)
    for _, backend in backends_for("cpu", ("torch", "cpp")):
        got = dspec.merge_states(o_a, l_a, o_b, l_b, backend=backend)
        torch.testing.assert_close(got[0], exp[0])
        torch.testing.assert_close(got[1], exp[1])


def test_merge_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        dspec.merge_states(torch.zeros(2, 4), torch.zeros(2), torch.zeros(3, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="lse_b must have shape"):
        dspec.merge_states(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="lse_a must have dtype"):
        dspec.merge_states(torch.zeros(2, 4), torch.zeros(2).half(), torch.zeros(2, 4), torch.zeros(2))


@device_backends(PROVIDED)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_prefix_equals_ragged(device, backend, page_size):
    """The paged layout (page table + lengths) gives the ragged layout's result."""
    q, k, v, words, pk, pv, indptr = make_case(3, 6, 4, 2, 32, [13, 0, 30], torch.float32, page_size)
    lens = (indptr[1:] - indptr[:-1]).int()
    max_pages = -(-int(lens.max()) // page_size)
    num_pages = 3 * max_pages + 2
    g = torch.Generator().manual_seed(1)
    cache_k = torch.randn(num_pages, page_size, 2, 32, generator=g)
    cache_v = torch.randn(num_pages, page_size, 2, 32, generator=g)
    table = torch.randperm(num_pages, generator=g)[: 3 * max_pages].reshape(3, max_pages).int()
    for b in range(3):  # scatter each request's rows into its (shuffled) pages
        t = torch.arange(int(lens[b]))
        cache_k[table[b].long()[t // page_size], t % page_size] = pk[int(indptr[b]) + t]
        cache_v[table[b].long()[t // page_size], t % page_size] = pv[int(indptr[b]) + t]
    dev = lambda t: t.to(device)
    paged = dspec.cascade_attention(
        dev(q),
        dev(k),
        dev(v),
        dev(words),
        prefix_k=dev(cache_k),
        prefix_v=dev(cache_v),
        prefix_page_table=dev(table),
        prefix_lens=dev(lens),
        return_lse=True,
        backend=backend,
    )
    check_against_oracle(*paged, (q, k, v, words, pk, pv, indptr), torch.float32)


def test_paged_bad_input():
    q, k, v, words, *_ = make_case(1, 3, 2, 2, 16, [0], torch.float32, 0)
    cache = torch.zeros(4, 8, 2, 16)
    table = torch.tensor([[0, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="is not a page"):
        dspec.cascade_attention(
            q,
            k,
            v,
            prefix_k=cache,
            prefix_v=cache,
            prefix_page_table=table,
            prefix_lens=torch.tensor([12], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="prefix_lens must lie"):
        dspec.cascade_attention(
            q,
            k,
            v,
            prefix_k=cache,
            prefix_v=cache,
            prefix_page_table=table,
            prefix_lens=torch.tensor([17], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="either prefix_indptr"):
        dspec.cascade_attention(
            q,
            k,
            v,
            prefix_k=cache,
            prefix_v=cache,
            prefix_page_table=table,
            prefix_lens=torch.tensor([3], dtype=torch.int32),
            prefix_indptr=torch.tensor([0, 3]),
        )


# ------------------------------------------------------------------- the C++ CPU backend
from dspec.ops import attention as attention_ops  # noqa: E402

HAS_CPP = _backend.cpp_available()
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="dspec._C is not built")
_LEVELS = ("generic", "avx2", "avx512")
# every tile code of this CPU under the ISA cap: the portable loops, then AVX2, AVX-512, AMX
ISAS = (
    list(_LEVELS[: _LEVELS.index(_backend.extension().cascade_attention_isa()) + 1]) if HAS_CPP else ["generic"]
) + (["amx"] if HAS_CPP and _backend.extension().cascade_attention_isa(2, 64) == "amx" else [])


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Every tile code of the cpp backend: the portable loops and, where the CPU has them,
    AVX-512 and AMX-BF16 (which takes the bf16 inputs with D % 32 == 0; the rest run AVX-512)."""
    monkeypatch.setattr(attention_ops, "CPP_ISA", request.param)
    return request.param


def _cpp(case, **kw):
    q, k, v, words, pk, pv, indptr = case
    return dspec.cascade_attention(
        q, k, v, words, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr, return_lse=True, backend="cpp", **kw
    )


@needs_cpp
@pytest.mark.parametrize(
    "n,prefix_lens,hq,hkv,d,dtype,mask_kind",
    [
        (1, [0], 8, 8, 64, torch.float32, "random"),  # no key but itself
        (1, [300], 9, 3, 64, torch.float32, "none"),  # decode, G = 3
        (2, [65, 0], 12, 4, 64, torch.bfloat16, "random"),
        (17, [5, 64, 0], 8, 1, 128, torch.float16, "tree"),  # G = 8
        (63, [129], 6, 2, 40, torch.float32, "random"),  # odd D
        (64, [1, 2], 3, 3, 64, torch.bfloat16, "none"),
        (65, [33], 16, 2, 128, torch.float32, "tree"),
        (130, [0, 7], 4, 1, 64, torch.float32, "tree"),  # several query tiles, 3 key tiles
        (37, [200], 24, 8, 48, torch.bfloat16, "random"),
        (3, [600, 0, 257], 9, 3, 64, torch.bfloat16, "random"),  # prefix chunks of 256 keys, merged
        (1, [1030], 9, 3, 64, torch.float32, "none"),  # decode at a long prefix: 5 chunks
    ],
)
def test_cpp_matches_float64_reference(isa, n, prefix_lens, hq, hkv, d, dtype, mask_kind):
    case = make_case(len(prefix_lens), n, hq, hkv, d, prefix_lens, dtype, n + hq + d, mask_kind)
    out, lse = _cpp(case, sm_scale=0.7 / d**0.5)
    assert out.dtype == dtype and out.shape == case[0].shape and lse.shape == case[0].shape[:3]
    check_against_oracle(out, lse, case, dtype, sm_scale=0.7 / d**0.5)


@needs_cpp
@pytest.mark.parametrize(
    "build",
    [
        lambda: dspec.masks.causal(21),
        lambda: dspec.masks.ssd_copies(6, 3),
        lambda: dspec.masks.s2d2_two_l(9),
        lambda: dspec.masks.spiffy_draft_graph(4, [0, 1], 2),
        lambda: dspec.masks.block_diffusion(33),
        lambda: dspec.masks.tree([-1, 0, 0, 1, 1, 2, 5, 5]),
    ],
    ids=["causal", "ssd", "s2d2", "spiffy", "block", "tree"],
)
def test_cpp_method_masks(isa, build):
    """The suffix masks of every verification shape (dspec.masks), shared by the batch."""
    words = build().words
    n = words.shape[0]
    q, k, v, _, pk, pv, indptr = make_case(2, n, 6, 2, 64, [19, 70], torch.float32, n)
    case = (q, k, v, words, pk, pv, indptr)
    check_against_oracle(*_cpp(case), case, torch.float32)


@needs_cpp
def test_cpp_paged_cache_views_and_strided_inputs(isa):
    """A layer of a KV cache [L, B, cap, Hkv, D] (here stored head-major and transposed: a
    view with a head stride of cap * D) read in place as pages of page_size = cap with the
    page table [[0], [1], [2]]; q, k, v are views into one fused qkv tensor.  Equals the
    ragged layout of the same rows exactly, and the float64 oracle."""
    g = torch.Generator().manual_seed(7)
    batch, n, hq, hkv, d, cap, layers = 3, 5, 8, 2, 64, 80, 2
    lens = torch.tensor([70, 0, 80], dtype=torch.int32)
    store_k = torch.randn(layers, batch, hkv, cap, d, generator=g)
    store_v = torch.randn(layers, batch, hkv, cap, d, generator=g)
    cache_k, cache_v = store_k.transpose(2, 3), store_v.transpose(2, 3)  # [L, B, cap, Hkv, D] views
    qkv = torch.randn(batch, n, hq + 2 * hkv, d, generator=g)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :]
    words = dspec.masks.causal(n).words
    table = torch.arange(batch, dtype=torch.int32)[:, None]
    layer = 1
    paged = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        prefix_k=cache_k[layer],
        prefix_v=cache_v[layer],
        prefix_page_table=table,
        prefix_lens=lens,
        return_lse=True,
        backend="cpp",
    )
    rows_k = torch.cat([cache_k[layer, b, : int(lens[b])] for b in range(batch)])
    rows_v = torch.cat([cache_v[layer, b, : int(lens[b])] for b in range(batch)])
    indptr = torch.tensor([0, 70, 70, 150])
    case = (q.contiguous(), k.contiguous(), v.contiguous(), words, rows_k, rows_v, indptr)
    ragged = _cpp(case)
    assert torch.equal(paged[0], ragged[0]) and torch.equal(paged[1], ragged[1])
    check_against_oracle(*paged, case, torch.float32)
    plan = attention_ops.CascadeAttentionPlan(
        batch, n, hq, hkv, d, torch.float32, "cpu", words, prefix_page_table=table, prefix_lens=lens, backend="cpp"
    )
    for i in range(layers):
        got = plan.run(q, k, v, cache_k[i], cache_v[i], return_lse=True)
        exp = dspec.cascade_attention(
            q,
            k,
            v,
            words,
            prefix_k=cache_k[i].contiguous(),
            prefix_v=cache_v[i].contiguous(),
            prefix_page_table=table,
            prefix_lens=lens,
            return_lse=True,
            backend="cpp",
        )
        assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])


@needs_cpp
def test_cpp_paged_prefix_chunks_equal_ragged(isa):
    """Long paged prefixes are cut into chunks of 256 keys that start inside a page (page
    size 48): the same as the ragged rows bit for bit, and the oracle."""
    g = torch.Generator().manual_seed(3)
    batch, n, hq, hkv, d, page = 2, 3, 6, 2, 64, 48
    lens = torch.tensor([530, 300], dtype=torch.int32)
    pages = [-(-int(x) // page) for x in lens]
    table = torch.full((batch, max(pages)), -1, dtype=torch.int32)
    perm = torch.randperm(sum(pages), generator=g).int()
    table[0, : pages[0]], table[1, : pages[1]] = perm[: pages[0]], perm[pages[0] :]
    cache_k = torch.randn(sum(pages), page, hkv, d, generator=g).bfloat16()
    cache_v = torch.randn(sum(pages), page, hkv, d, generator=g).bfloat16()
    q = torch.randn(batch, n, hq, d, generator=g).bfloat16()
    k, v = torch.randn(2, batch, n, hkv, d, generator=g).bfloat16()
    words = dspec.masks.causal(n).words
    paged = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        prefix_k=cache_k,
        prefix_v=cache_v,
        prefix_page_table=table,
        prefix_lens=lens,
        return_lse=True,
        backend="cpp",
    )
    rows = [torch.arange(int(x)) for x in lens]
    flat = [table[b].long()[r // page] * page + r % page for b, r in enumerate(rows)]
    rows_k = torch.cat([cache_k.flatten(0, 1)[f] for f in flat])
    rows_v = torch.cat([cache_v.flatten(0, 1)[f] for f in flat])
    case = (q, k, v, words, rows_k, rows_v, torch.tensor([0, 530, 830]))
    ragged = _cpp(case)
    assert torch.equal(paged[0], ragged[0]) and torch.equal(paged[1], ragged[1])
    check_against_oracle(*paged, case, torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if HAS_CPP else []))
@pytest.mark.parametrize("layout", ["ragged", "paged", "none"])
def test_plan_run_equals_one_call(backend, layout):
    q, k, v, words, pk, pv, indptr = make_case(2, 9, 6, 3, 32, [11, 40], torch.float32, 5)
    kw, run_prefix = {}, ()
    if layout == "ragged":
        kw, run_prefix = dict(prefix_indptr=indptr), (pk, pv)
    elif layout == "paged":
        table = torch.tensor([[2, 0, 1], [5, 4, 3]], dtype=torch.int32)
        cache_k, cache_v = torch.zeros(6, 16, 3, 32), torch.zeros(6, 16, 3, 32)
        for b, (lo, hi) in enumerate([(0, 11), (11, 51)]):
            t = torch.arange(hi - lo)
            cache_k[table[b].long()[t // 16], t % 16] = pk[lo + t]
            cache_v[table[b].long()[t // 16], t % 16] = pv[lo + t]
        lens = torch.tensor([11, 40], dtype=torch.int32)
        kw, run_prefix = dict(prefix_page_table=table, prefix_lens=lens), (cache_k, cache_v)
    plan = attention_ops.CascadeAttentionPlan(
        2, 9, 6, 3, 32, torch.float32, "cpu", words, sm_scale=0.2, backend=backend, **kw
    )
    assert plan.backend == backend
    one = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        *(),
        sm_scale=0.2,
        return_lse=True,
        backend=backend,
        **dict(zip(("prefix_k", "prefix_v"), run_prefix)),
        **kw,
    )
    got = plan.run(q, k, v, *run_prefix, return_lse=True)
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
    assert torch.equal(plan.run(q, k, v, *run_prefix), one[0])
    if layout != "none":
        check_against_oracle(*got, (q, k, v, words, pk, pv, indptr), torch.float32, sm_scale=0.2)


@needs_cpp
def test_cpp_threads_give_identical_results(isa, monkeypatch):
    """Work is split over threads by (request, KV head group, query tile, prefix chunk at
    fixed key positions); every row's arithmetic is the same whatever the split, so the
    result is bit-identical."""
    case = make_case(2, 40, 8, 2, 64, [300, 129], torch.bfloat16, 11, "tree")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _cpp(case)
        monkeypatch.setenv("DSPEC_CPU_THREADS", "4")
        torch.set_num_threads(4)
        many = _cpp(case)
        single = _cpp(tuple(t[:1] for t in case[:4]) + (case[4], case[5], case[6][:2]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
    assert torch.equal(single[0], one[0][:1])  # B = 1: fewer units, split over heads and query tiles


@needs_cpp
def test_cpp_empty_inputs(isa):
    q, k, v, words, *_ = make_case(2, 5, 4, 2, 16, [0, 0], torch.float32, 3)
    # B = 0
    out, lse = dspec.cascade_attention(q[:0], k[:0], v[:0], words[:0], return_lse=True, backend="cpp")
    assert out.shape == (0, 5, 4, 16) and lse.shape == (0, 5, 4)
    # every prefix empty (T = 0 rows), and rows whose mask row is empty: out = 0, lse = -inf
    empty = torch.zeros(0, 2, 16)
    out, lse = dspec.cascade_attention(
        q,
        k,
        v,
        words,
        prefix_k=empty,
        prefix_v=empty,
        prefix_indptr=torch.zeros(3, dtype=torch.int64),
        return_lse=True,
        backend="cpp",
    )
    assert (lse[:, 1] == float("-inf")).all() and (out[:, 1] == 0).all()
    check_against_oracle(out, lse, (q, k, v, words, empty, empty, torch.zeros(3, dtype=torch.int64)), torch.float32)
    none = torch.zeros(5, 1, dtype=torch.int32)  # nothing visible at all
    out, lse = dspec.cascade_attention(q, k, v, none, return_lse=True, backend="cpp")
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_auto_backend_float64_and_autograd():
    q, k, v, words, pk, pv, indptr = make_case(1, 4, 2, 1, 16, [5], torch.float32, 2)
    kw = dict(prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
    if HAS_CPP:
        assert attention_ops.resolve_backend(None, q.device, q.dtype, False) == "cpp"
        with pytest.raises(ValueError, match="got float64"):
            dspec.cascade_attention(q.double(), k.double(), v.double(), words, backend="cpp")
        with pytest.raises(ValueError, match="no backward"):
            dspec.cascade_attention(q.requires_grad_(), k, v, words, backend="cpp", **kw)
        q = q.detach()
    # auto (and a DSPEC_BACKEND=cpp preference): float64 and calls that autograd records
    # run the torch reference
    out64 = dspec.cascade_attention(q.double(), k.double(), v.double(), words)
    assert out64.dtype == torch.float64
    if HAS_CPP:
        os.environ["DSPEC_BACKEND"] = "cpp"
        try:
            assert dspec.cascade_attention(q.double(), k.double(), v.double(), words).dtype == torch.float64
        finally:
            del os.environ["DSPEC_BACKEND"]
    qg = q.clone().requires_grad_()
    out = dspec.cascade_attention(qg, k, v, words, **kw)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    plan = attention_ops.CascadeAttentionPlan(1, 4, 2, 1, 16, torch.float32, "cpu", words, prefix_indptr=indptr)
    qg.grad = None
    plan.run(qg, k, v, pk, pv).sum().backward()
    assert qg.grad is not None


def test_plan_bad_input():
    q, k, v, words, pk, pv, indptr = make_case(2, 3, 4, 2, 16, [2, 3], torch.float32, 0)
    Plan = attention_ops.CascadeAttentionPlan
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        Plan(2, 3, 4, 3, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="head_dim must be an int"):
        Plan(2, 3, 4, 2, 0, torch.float32, "cpu")
    with pytest.raises(ValueError, match="packed words"):
        Plan(2, 3, 4, 2, 16, torch.float32, "cpu", torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="B \\+ 1"):
        Plan(2, 3, 4, 2, 16, torch.float32, "cpu", words, prefix_indptr=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="never decrease"):
        Plan(2, 3, 4, 2, 16, torch.float32, "cpu", words, prefix_indptr=torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="either prefix_indptr"):
        Plan(2, 3, 4, 2, 16, torch.float32, "cpu", prefix_indptr=indptr, prefix_lens=torch.zeros(2, dtype=torch.int32))
    for backend in ["torch"] + (["cpp"] if HAS_CPP else []):
        plan = Plan(2, 3, 4, 2, 16, torch.float32, "cpu", words, prefix_indptr=indptr, backend=backend)
        with pytest.raises(ValueError, match="the plan takes q"):
            plan.run(q[:1], k, v, pk, pv)
        with pytest.raises(ValueError, match="q must have dtype"):
            plan.run(q.half(), k, v, pk, pv)
        with pytest.raises(ValueError, match="give this layer's prefix_k"):
            plan.run(q, k, v)
        with pytest.raises(ValueError, match="prefix_k and prefix_v must have shape"):
            plan.run(q, k, v, pk[:, :1], pv[:, :1])
        with pytest.raises(ValueError, match="end at most"):
            plan.run(q, k, v, pk[:4], pv[:4])
        with pytest.raises(ValueError, match="has no prefix"):
            Plan(2, 3, 4, 2, 16, torch.float32, "cpu", backend=backend).run(q, k, v, pk, pv)


@needs_cpp
def test_cpp_extension_validates_arguments():
    """dspec._C.cascade_attention checks every argument (and the prefix metadata values)
    before it reads anything."""
    ext = _backend.extension()
    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    out = torch.empty_like(q)
    pk = torch.randn(4, 1, 16)
    ip32 = torch.tensor([0, 4], dtype=torch.int32)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)

    def call(**kw):
        a = dict(
            q=q.data_ptr(),
            k=k.data_ptr(),
            v=v.data_ptr(),
            out=out.data_ptr(),
            lse=0,
            mask=0,
            prefix_k=pk.data_ptr(),
            prefix_v=pk.data_ptr(),
            prefix_indptr=ip32.data_ptr(),
            page_table=0,
            prefix_lens=0,
            dtype=0,
            batch=1,
            n=2,
            hq=2,
            hkv=1,
            head_dim=16,
            sm_scale=0.25,
            q_s0=64,
            q_s1=32,
            q_s2=16,
            k_s0=32,
            k_s1=16,
            k_s2=16,
            v_s0=32,
            v_s1=16,
            v_s2=16,
            out_s0=64,
            out_s1=32,
            out_s2=16,
            mask_s0=0,
            mask_s1=0,
            prefix_k_s0=0,
            prefix_k_s1=16,
            prefix_k_s2=16,
            prefix_v_s0=0,
            prefix_v_s1=16,
            prefix_v_s2=16,
            indptr_dtype=0,
            prefix_rows=4,
            page_size=1,
            max_pages=0,
            page_table_stride=0,
            num_threads=1,
        )
        a.update(kw)
        ext.cascade_attention(**a)

    call()
    torch.testing.assert_close(
        out, dspec.cascade_attention(q, k, v, prefix_k=pk, prefix_v=pk, prefix_indptr=ip32, backend="torch")
    )
    for kw, match in [
        (dict(q=0), "q is a null pointer"),
        (dict(hkv=3, hq=2), "multiple of hkv"),
        (dict(dtype=5), "dtype must be"),
        (dict(q_s1=-1), "strides must be >= 0"),
        (dict(prefix_rows=3), "prefix_indptr must"),
        (dict(indptr_dtype=2), "indptr_dtype must"),
        (dict(isa="sse"), "isa must be"),
        (dict(sm_scale=float("nan")), "sm_scale must be finite"),
        (dict(q_s1=2**63 - 8), "overflows int64"),
        (
            dict(
                prefix_indptr=0,
                page_table=table.data_ptr(),
                prefix_lens=lens.data_ptr(),
                max_pages=1,
                page_size=2,
                prefix_rows=2,
                prefix_k_s0=32,
                prefix_v_s0=32,
            ),
            "prefix_lens\\[0\\] = 3",
        ),
        (
            dict(
                prefix_indptr=0,
                page_table=table.data_ptr(),
                prefix_lens=lens.data_ptr(),
                max_pages=1,
                page_size=4,
                prefix_rows=0,
            ),
            "not a page",
        ),
    ] + ([] if ext.cascade_attention_isa(2, 64) == "amx" else [(dict(isa="amx"), "isa 'amx' needs")]):
        with pytest.raises(ValueError, match=match):
            call(**kw)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plen,n", [(0, 9), (5, 7), (60, 9), (250, 16), (256, 3), (300, 70), (700, 21)])
@pytest.mark.parametrize("threads", [1, 4])
def test_cpp_chain_rows_equal_one_token_calls(isa, monkeypatch, dtype, plen, n, threads):
    """Position invariance: row i of a causal chain of N suffix tokens after a P-key prefix is,
    bit for bit, a one-token call whose prefix holds those P keys and the chain's first i
    (keys tiled and chunked at fixed indices, prefix and suffix alike).  So greedy verification
    of a chain equals one-token decoding in any dtype.  Ragged and paged prefixes, GQA 3."""
    g = torch.Generator().manual_seed(plen * 131 + n)
    hq, hkv, d = 9, 3, 64
    q = torch.randn(1, n, hq, d, generator=g).to(dtype)
    keys = torch.randn(plen + n, hkv, d, generator=g).to(dtype)
    vals = torch.randn(plen + n, hkv, d, generator=g).to(dtype)
    words = dspec.masks.causal(n).words
    before = torch.get_num_threads()
    monkeypatch.setenv("DSPEC_CPU_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        chain = dspec.cascade_attention(
            q,
            keys[None, plen:],
            vals[None, plen:],
            words,
            prefix_k=keys[:plen],
            prefix_v=vals[:plen],
            prefix_indptr=torch.tensor([0, plen]),
            return_lse=True,
            backend="cpp",
        )
        page = 48
        for i in range(n):
            p = plen + i
            one = dspec.cascade_attention(
                q[:, i : i + 1],
                keys[None, p : p + 1],
                vals[None, p : p + 1],
                None,
                prefix_k=keys[:p],
                prefix_v=vals[:p],
                prefix_indptr=torch.tensor([0, p]),
                return_lse=True,
                backend="cpp",
            )
            assert torch.equal(one[0][0, 0], chain[0][0, i]) and torch.equal(one[1][0, 0], chain[1][0, i]), i
            if i in (0, n - 1):  # the same through pages that start anywhere
                pages = -(-p // page) or 1
                cache_k = torch.zeros(pages, page, hkv, d, dtype=dtype)
                cache_v = torch.zeros(pages, page, hkv, d, dtype=dtype)
                cache_k.view(-1, hkv, d)[:p], cache_v.view(-1, hkv, d)[:p] = keys[:p], vals[:p]
                table = torch.arange(pages, dtype=torch.int32)[None]
                paged = dspec.cascade_attention(
                    q[:, i : i + 1],
                    keys[None, p : p + 1],
                    vals[None, p : p + 1],
                    None,
                    prefix_k=cache_k,
                    prefix_v=cache_v,
                    prefix_page_table=table,
                    prefix_lens=torch.tensor([p], dtype=torch.int32),
                    return_lse=True,
                    backend="cpp",
                )
                assert torch.equal(paged[0], one[0]) and torch.equal(paged[1], one[1])
    finally:
        torch.set_num_threads(before)


def _layouts(n, g):
    """Masks [n, n] of the verification layouts whose rows see suffix keys that are not the
    first k: a random draft tree, SSD-style copies (bidirectional blocks of 4, each seeing
    only itself), padding rows that see only themselves, and random rows (each sees itself)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = dspec.masks.tree(torch.tensor(parents)).dense()
    idx = torch.arange(n)
    copies = (idx[:, None] // 4) == (idx[None, :] // 4)
    own = torch.eye(n, dtype=torch.bool) | (torch.tril(torch.ones(n, n, dtype=torch.bool)) & (idx[:, None] < n // 2))
    rand = (torch.rand(n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)
    return {"tree": tree, "copies": copies, "own": own, "random": rand}


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plen,n", [(0, 9), (5, 21), (60, 9), (250, 16), (300, 70), (700, 21)])
@pytest.mark.parametrize("threads", [1, 4])
def test_cpp_rows_depend_only_on_the_keys_they_see(isa, monkeypatch, dtype, plen, n, threads):
    """Compacted rows: a row whose visible suffix keys are not the first k of the suffix (a
    tree node, an SSD copy, a padding row) gets, bit for bit, the call that gives it those
    keys alone, in order, as an all-visible suffix after the same prefix -- the bits of the
    chain or block a one-token / one-block step decodes.  So tree and copy layouts verify
    in bf16 exactly as chains do."""
    g = torch.Generator().manual_seed(plen * 7 + n)
    hq, hkv, d = 9, 3, 64
    q = torch.randn(1, n, hq, d, generator=g).to(dtype)
    keys = torch.randn(plen + n, hkv, d, generator=g).to(dtype)
    vals = torch.randn(plen + n, hkv, d, generator=g).to(dtype)
    before = torch.get_num_threads()
    monkeypatch.setenv("DSPEC_CPU_THREADS", str(threads))
    torch.set_num_threads(threads)
    prefix = dict(prefix_k=keys[:plen], prefix_v=vals[:plen], prefix_indptr=torch.tensor([0, plen]))
    try:
        for name, dense in _layouts(n, g).items():
            words = dspec.ops.pack_mask(dense)
            out, lse = dspec.cascade_attention(
                q, keys[None, plen:], vals[None, plen:], words, return_lse=True, backend="cpp", **prefix
            )
            for i in range(n):
                seen = dense[i].nonzero()[:, 0]
                at = int((seen == i).nonzero()[0, 0])
                sk, sv = keys[plen:][seen][None], vals[plen:][seen][None]
                one, one_lse = dspec.cascade_attention(
                    q[:, seen], sk, sv, None, return_lse=True, backend="cpp", **prefix
                )
                assert torch.equal(one[0, at], out[0, i]) and torch.equal(one_lse[0, at], lse[0, i]), (name, i)
    finally:
        torch.set_num_threads(before)


def test_default_backend_yields_to_sdpa_without_simd_tiles():
    """Measured: the portable loops lose to torch's fused attention past
    GENERIC_CPP_MAX_ROWS suffix rows, so the default backend runs the "sdpa" route there
    (the torch reference when the lse is asked for); an explicit backend='cpp' does not."""
    from dspec.ops import attention as A

    prev = dspec.cpu.set_isa_cap("generic")
    try:
        assert A.backend_for_rows("cpp", None, A.GENERIC_CPP_MAX_ROWS + 1) == "sdpa"
        assert A.backend_for_rows("cpp", "auto", 64) == "sdpa"
        assert A.backend_for_rows("cpp", None, 64, return_lse=True) == "torch"
        assert A.backend_for_rows("cpp", None, A.GENERIC_CPP_MAX_ROWS) == "cpp"
        assert A.backend_for_rows("cpp", "cpp", 64) == "cpp"
        assert A.backend_for_rows("torch", None, 64) == "torch"
        assert A.backend_for_rows("triton", None, 64) == "triton"
    finally:
        dspec.cpu.set_isa_cap(prev)
    if dspec.cpu.isa() != "generic":
        assert A.backend_for_rows("cpp", None, 64) == "cpp"


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layout", ["none", "ragged", "paged"])
def test_sdpa_route_matches_the_reference(dtype, atol, layout):
    """The "sdpa" route (what the default backend runs at the generic level past
    GENERIC_CPP_MAX_ROWS rows) against the float64 reference: grouped heads, a mask with
    queries that see no suffix key (0 without a prefix), ragged and paged prefixes of
    different lengths (one request without one), one-call and plan forms."""

    gen = torch.Generator().manual_seed(7)
    batch, n, hq, hkv, d = 3, 11, 6, 2, 16
    q = torch.randn(batch, n, hq, d, generator=gen)
    k, v = torch.randn(batch, n, hkv, d, generator=gen), torch.randn(batch, n, hkv, d, generator=gen)
    dense = torch.rand(batch, n, n, generator=gen) < 0.4
    dense[:, 3] = False  # a query that sees no suffix key
    lens = [5, 0, 9]
    kw = {}
    if layout == "ragged":
        pk, pv = torch.randn(sum(lens), hkv, d, generator=gen), torch.randn(sum(lens), hkv, d, generator=gen)
        kw = dict(prefix_k=pk, prefix_v=pv, prefix_indptr=torch.tensor([0, 5, 5, 14], dtype=torch.int32))
    elif layout == "paged":
        pages = torch.randn(7, 4, hkv, d, generator=gen), torch.randn(7, 4, hkv, d, generator=gen)
        table = torch.tensor([[6, 0, 0], [0, 0, 0], [2, 5, 1]], dtype=torch.int32)
        kw = dict(
            prefix_k=pages[0],
            prefix_v=pages[1],
            prefix_page_table=table,
            prefix_lens=torch.tensor(lens, dtype=torch.int32),
        )
    ref_kw = {key: (t.double() if key in ("prefix_k", "prefix_v") else t) for key, t in kw.items()}
    want = dspec.cascade_attention(q.double(), k.double(), v.double(), dense, backend="torch", **ref_kw)
    cast = {key: (t.to(dtype) if key in ("prefix_k", "prefix_v") else t) for key, t in kw.items()}
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    prev = dspec.cpu.set_isa_cap("generic")
    try:
        plan_kw = {key: t for key, t in cast.items() if key not in ("prefix_k", "prefix_v")}
        plan = dspec.ops.CascadeAttentionPlan(batch, n, hq, hkv, d, dtype, "cpu", dense, **plan_kw)
        assert plan.backend == ("sdpa" if _backend.cpp_available() else plan.backend)
        out = plan.run(qd, kd, vd, cast.get("prefix_k"), cast.get("prefix_v"))
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=atol)
        out, lse = plan.run(qd, kd, vd, cast.get("prefix_k"), cast.get("prefix_v"), return_lse=True)
        _, want_lse = dspec.cascade_attention(
            q.double(), k.double(), v.double(), dense, backend="torch", return_lse=True, **ref_kw
        )
        torch.testing.assert_close(lse.double(), want_lse.double(), atol=atol, rtol=atol)
        got = dspec.cascade_attention(qd, kd, vd, dense, **cast)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
        if layout == "none":
            assert torch.equal(got[:, 3], torch.zeros_like(got[:, 3]))
    finally:
        dspec.cpu.set_isa_cap(prev)


@pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_one_shot_calls_keep_the_bits_and_see_in_place_changes(dtype):
    """One-shot CPU calls repeating their packed mask and prefix_indptr (the same objects,
    which take a cached plan from the second call on) give the bits of the full path, see
    in-place changes of the mask and indptr, and still raise on bad input."""
    q, k, v, words, pk, pv, indptr = make_case(1, 5, 4, 2, 64, [70], dtype, seed=11)

    def call(m=words, ip=indptr, **kw):
        return dspec.cascade_attention(q, k, v, m, prefix_k=pk, prefix_v=pv, prefix_indptr=ip, **kw)

    def full(**kw):  # new metadata objects: the full path, the default route
        return dspec.cascade_attention(
            q, k, v, words.clone(), prefix_k=pk, prefix_v=pv, prefix_indptr=indptr.clone(), **kw
        )

    with torch.no_grad():
        want = full()
        for _ in range(4):
            assert torch.equal(call(), want)
        want_out, want_lse = full(return_lse=True)
        for _ in range(3):
            out, lse = call(return_lse=True)
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        words[0, 2].fill_(0)  # in place: the next calls see the new values
        indptr[1] = 40
        changed = full()
        assert not torch.equal(changed, want)
        for _ in range(3):
            assert torch.equal(call(), changed)
        dense = torch.ones(1, 5, 5, dtype=torch.bool).tril()  # packed by each call
        for _ in range(3):
            assert torch.equal(call(dense), call(dspec.pack_mask(dense)))
        bad = indptr.clone()
        bad[1] = 1000
        for _ in range(3):
            with pytest.raises(ValueError, match="prefix_indptr"):
                call(ip=bad)
        with pytest.raises(ValueError):
            dspec.cascade_attention(q, k[:, :, :1], v, words, prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
