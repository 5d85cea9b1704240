"""The fused CPU layer ops of the model forward (dspec._C.rms_norm, dspec._C.rope) against
the torch code they replace (models/transformer.py, used under autograd and on other
devices)."""

import pytest
import torch

from dspec import _backend
from dspec.models.layers import rotate
from dspec.models.transformer import RMSNorm, rope_tables

pytestmark = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")

# (dtype, atol, rtol): RMSNorm's sum of squares runs in another order than torch's, so the
# normalised value may differ by an ulp of float32 before rounding to the dtype
CASES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 1e-2), (torch.float16, 2e-3, 2e-3)]


def torch_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype, atol, rtol", CASES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 5, 17), (1, 300, 96)])
def test_rms_norm_matches_torch(dtype, atol, rtol, shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        fused = norm(x)
    torch.testing.assert_close(fused, torch_rms_norm(x, norm.weight.detach(), 1e-5), atol=atol, rtol=rtol)


def test_rms_norm_keeps_autograd():
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = norm(x)
    assert out.grad_fn is not None  # the torch path ran
    out.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, n, hq, hkv, d", [(1, 1, 9, 3, 64), (2, 5, 4, 4, 32), (3, 2, 8, 2, 128)])
def test_rope_matches_torch(dtype, batch, n, hq, hkv, d):
    torch.manual_seed(1)
    positions = torch.randint(0, 5000, (batch, n))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(positions, inv)
    q = (torch.randn(batch, n, hq, d) * 2).to(dtype)
    k = (torch.randn(batch, n, hkv, d) * 2).to(dtype)
    want_q, want_k = rotate(q, cos, sin), rotate(k, cos, sin)
    ext = _backend.extension()
    got_q, got_k = q.clone(), k.clone()
    ext.rope(
        got_q.data_ptr(),
        got_k.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        _backend.FLOAT_CODE[dtype],
        batch * n,
        hq,
        hkv,
        d,
        2,
    )
    # same float32 operations in the same order: identical
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_layer_ops_reject_bad_arguments():
    ext = _backend.extension()
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="hidden"):
        ext.rms_norm(x.data_ptr(), x.data_ptr(), x.data_ptr(), 0, 2, 0, 1e-6, 1)
    with pytest.raises(ValueError, match="dtype"):
        ext.rms_norm(x.data_ptr(), x.data_ptr(), x.data_ptr(), 7, 2, 8, 1e-6, 1)
    with pytest.raises(ValueError, match="head_dim"):
        ext.rope(x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr(), 0, 1, 1, 1, 3, 1)
    with pytest.raises(ValueError, match="null"):
        ext.rope(0, x.data_ptr(), x.data_ptr(), x.data_ptr(), 0, 1, 1, 1, 4, 1)


def test_rope_tables_on_the_cpu_are_the_formula_gathered():
    """The CPU table (kept with inv_freq, grown by doubling) gives the formula's bits for
    any positions; negative positions and table=False take the formula."""
    from dspec.models.transformer import ROPE_TABLE_ATTR, rope_formula

    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for shape, high in (((1, 1), 10), ((2, 16), 300), ((3, 5, 7), 5000), ((1, 3), 4096)):
        positions = torch.randint(0, high, shape)
        got, want = rope_tables(positions, inv), rope_formula(positions, inv)
        assert got[0].shape == want[0].shape == shape + (1, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert getattr(inv, ROPE_TABLE_ATTR)[1].shape[0] == 8192  # grown to a power of two
    negative = torch.tensor([[-3, 0, 2]])
    assert torch.equal(rope_tables(negative, inv)[1], rope_formula(negative, inv)[1])
    fresh = inv.clone()
    rope_tables(torch.tensor([[1, 2]]), fresh, table=False)
    assert not hasattr(fresh, ROPE_TABLE_ATTR)
    assert rope_tables(torch.zeros(0, 4, dtype=torch.int64), inv)[0].shape == (0, 4, 1, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "groups, src_rows, dst_rows, width, count",
    [(1, 5, 9, 3, 4), (30, 9, 600, 192, 9), (4, 1, 2, 1, 1), (3, 40, 40, 64, 40)],
)
def test_move_rows_matches_index_copy(dtype, groups, src_rows, dst_rows, width, count):
    from dspec.models.kv_cache import move_rows

    g = torch.Generator().manual_seed(groups * 100 + count)
    # group strides wider than the rows: the KV cache's views are strided by layer / request
    src = torch.randn(groups, src_rows + 2, width, generator=g).to(dtype)[:, 1:-1]
    dst = torch.randn(groups, dst_rows + 3, width, generator=g).to(dtype)[:, :dst_rows]
    s_idx = torch.randint(0, src_rows, (count,), generator=g)
    d_idx = torch.randperm(dst_rows, generator=g)[:count]
    want = dst.clone().index_copy_(1, d_idx, src.index_select(1, s_idx))
    move_rows(src, dst, s_idx, d_idx)
    assert torch.equal(dst, want)


def test_copy_rows_rejects_bad_indices_before_copying():
    ext = _backend.extension()
    src, dst = torch.randn(2, 4, 8), torch.zeros(2, 6, 8)
    s_idx, d_idx = torch.tensor([0, 3]), torch.tensor([1, 6])  # 6 is past dst's 6 rows
    args = (src.data_ptr(), dst.data_ptr(), 2, 4 * 8 * 4, 6 * 8 * 4, 4, 6, 2, s_idx.data_ptr(), d_idx.data_ptr(), 32, 1)
    with pytest.raises(ValueError, match=r"dst_rows\[1\] = 6"):
        ext.copy_rows(*args)
    assert not dst.any()  # nothing moved
    s_idx[1] = -1
    with pytest.raises(ValueError, match=r"src_rows\[1\] = -1"):
        ext.copy_rows(*args)
    with pytest.raises(ValueError, match="row_bytes"):
        ext.copy_rows(*args[:10], 0, 1)
    with pytest.raises(ValueError, match="dst_group_stride overlaps"):
        ext.copy_rows(*args[:4], 8, *args[5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_isa_level_gives_the_same_bits(dtype):
    """RMSNorm and RoPE run a copy compiled per instruction-set level (DSPEC_CPU_MULTI), picked
    by the capped level at each call: every level this CPU has gives the same bits (no FMA
    contraction in any copy), and the cap really switches the copy without changing them."""
    from dspec import cpu

    levels = ("generic", "avx2", "avx512", "amx")
    ext = _backend.extension()
    mine = levels[: levels.index(ext.cpu_isa_of_cpu()) + 1]
    torch.manual_seed(2)
    x = (torch.randn(37, 576) * 3).to(dtype)
    w = torch.randn(576).to(dtype)
    q, k = (torch.randn(5, 9, 64) * 2).to(dtype), (torch.randn(5, 3, 64) * 2).to(dtype)
    cos, sin = rope_tables(torch.arange(5)[None], 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    results = {}
    old = cpu.set_isa_cap("amx")
    try:
        for level in mine:
            cpu.set_isa_cap(level)
            assert ext.cpu_isa() == level
            out = torch.empty_like(x)
            ext.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), _backend.FLOAT_CODE[dtype], 37, 576, 1e-5, 1)
            rq, rk = q.clone(), k.clone()
            ext.rope(
                rq.data_ptr(),
                rk.data_ptr(),
                cos.contiguous().data_ptr(),
                sin.contiguous().data_ptr(),
                _backend.FLOAT_CODE[dtype],
                5,
                9,
                3,
                64,
                1,
            )
            results[level] = (out, rq, rk)
    finally:
        cpu.set_isa_cap(old)
    first = results[mine[0]]
    for level in mine[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, results[level])), level
