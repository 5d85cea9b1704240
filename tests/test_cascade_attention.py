"""cascade_attention and merge_states against a float64 explicit-softmax reference."""
import pytest
import torch

import dspec
from dspec import _backend
from dspec.reference import attention as reference
from dspec.reference import pack_mask as pack_reference
from conftest import backends_for, device_backends

PROVIDED = ("torch", "triton")


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
    cast = (lambda t: t.to(dtype))
    return cast(q), cast(k), cast(v), words, cast(pk), cast(pv), indptr


def oracle(q, k, v, words, pk, pv, indptr, **kw):
    return reference.cascade_attention(q.double(), k.double(), v.double(), words, prefix_k=pk.double(),
                                       prefix_v=pv.double(), prefix_indptr=indptr, return_lse=True, **kw)


def check_against_oracle(out, lse, case, dtype, **kw):
    """flash-attention style: the error may be at most twice the torch low-precision error."""
    ref_out, ref_lse = oracle(*case, **kw)
    low_out, low_lse = reference.cascade_attention(*case[:4], prefix_k=case[4], prefix_v=case[5],
                                                   prefix_indptr=case[6], return_lse=True, **kw)
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
    out, lse = dspec.cascade_attention(*dev[:4], prefix_k=dev[4], prefix_v=dev[5],
                                       prefix_indptr=dev[6], return_lse=True, backend=backend)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (batch, n, hq, 32)
    check_against_oracle(out, lse, case, dtype)


@device_backends(PROVIDED)
@pytest.mark.parametrize("n,d,mask_kind", [(130, 64, "tree"), (20, 128, "none"), (9, 80, "random")])
def test_shapes_masks_head_dims(device, backend, n, d, mask_kind):
    case = make_case(2, n, 2, 1, d, [0, 37], torch.float32, n + d, mask_kind)
    dev = [t.to(device) if t is not None else None for t in case]
    out, lse = dspec.cascade_attention(*dev[:4], prefix_k=dev[4], prefix_v=dev[5],
                                       prefix_indptr=dev[6], return_lse=True, sm_scale=0.3,
                                       backend=backend)
    check_against_oracle(out, lse, case, torch.float32, sm_scale=0.3)


@device_backends(PROVIDED)
def test_no_prefix_and_empty_queries(device, backend):
    """Without a prefix, a query whose mask row is empty gets out = 0 and lse = -inf."""
    q, k, v, words, *_ = make_case(2, 5, 2, 2, 16, [0, 0], torch.float32, 1)
    out, lse = dspec.cascade_attention(q.to(device), k.to(device), v.to(device), words.to(device),
                                       return_lse=True, backend=backend)
    assert (lse[:, 1] == float("-inf")).all() and (out[:, 1] == 0).all()
    ref = reference.cascade_attention(q.double(), k.double(), v.double(), words, return_lse=True)
    torch.testing.assert_close(out.cpu().double(), ref[0], atol=1e-5, rtol=1e-5)
    # no mask at all: full attention over the suffix
    full = dspec.cascade_attention(q.to(device), k.to(device), v.to(device), backend=backend)
    exp = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
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
    l_a[1, 0] = float("-inf")              # one empty state: the other passes through
    o, lse = dspec.merge_states(o_a.to(device), l_a.to(device), o_b.to(device), l_b.to(device),
                                backend=backend)
    exp_o, exp_lse = reference.merge_states(o_a, l_a, o_b, l_b)
    torch.testing.assert_close(o.cpu(), exp_o, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.cpu(), exp_lse)
    assert (o[0, 0] == 0).all() and lse[0, 0] == float("-inf")
    torch.testing.assert_close(o[1, 0].cpu(), o_b[1, 0], atol=atol, rtol=atol)


def test_merge_states_equals_attention_over_the_union():
    """Splitting keys into prefix / suffix and merging equals attention over both."""
    q, k, v, words, pk, pv, indptr = make_case(1, 4, 2, 2, 16, [9], torch.float64, 2, "none")
    full, full_lse = reference.cascade_attention(q, k, v, None, prefix_k=pk, prefix_v=pv,
                                                 prefix_indptr=indptr, return_lse=True)
    o_s, l_s = reference.cascade_attention(q, k, v, None, return_lse=True)
    # prefix-only state: the suffix fully masked
    none = torch.zeros(4, 1, dtype=torch.int32)
    o_p, l_p = reference.cascade_attention(q, k, v, none, prefix_k=pk, prefix_v=pv,
                                           prefix_indptr=indptr, return_lse=True)
    o, lse = dspec.merge_states(o_p.float(), l_p, o_s.float(), l_s)
    torch.testing.assert_close(o.double(), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
def _args():
    return make_case(2, 3, 4, 2, 16, [2, 3], torch.float32, 0)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(k=a["k"][:, :, :1].expand(-1, -1, 3, -1), v=a["v"][:, :, :1].expand(-1, -1, 3, -1)),
     "multiple of the KV heads"),
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
])
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
    table = torch.randperm(num_pages, generator=g)[:3 * max_pages].reshape(3, max_pages).int()
    for b in range(3):  # scatter each request's rows into its (shuffled) pages
        t = torch.arange(int(lens[b]))
        cache_k[table[b].long()[t // page_size], t % page_size] = pk[int(indptr[b]) + t]
        cache_v[table[b].long()[t // page_size], t % page_size] = pv[int(indptr[b]) + t]
    dev = lambda t: t.to(device)  # noqa: E731
    paged = dspec.cascade_attention(dev(q), dev(k), dev(v), dev(words), prefix_k=dev(cache_k),
                                    prefix_v=dev(cache_v), prefix_page_table=dev(table),
                                    prefix_lens=dev(lens), return_lse=True, backend=backend)
    check_against_oracle(*paged, (q, k, v, words, pk, pv, indptr), torch.float32)


def test_paged_bad_input():
    q, k, v, words, *_ = make_case(1, 3, 2, 2, 16, [0], torch.float32, 0)
    cache = torch.zeros(4, 8, 2, 16)
    table = torch.tensor([[0, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="is not a page"):
        dspec.cascade_attention(q, k, v, prefix_k=cache, prefix_v=cache, prefix_page_table=table,
                                prefix_lens=torch.tensor([12], dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_lens must lie"):
        dspec.cascade_attention(q, k, v, prefix_k=cache, prefix_v=cache, prefix_page_table=table,
                                prefix_lens=torch.tensor([17], dtype=torch.int32))
    with pytest.raises(ValueError, match="either prefix_indptr"):
        dspec.cascade_attention(q, k, v, prefix_k=cache, prefix_v=cache, prefix_page_table=table,
                                prefix_lens=torch.tensor([3], dtype=torch.int32),
                                prefix_indptr=torch.tensor([0, 3]))
