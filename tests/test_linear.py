"""dspec._C.linear (the small-row projection of csrc/linear_cpu.cpp) and ``dense``, the
projection every model forward uses, against float64 matmul and torch's F.linear."""

import pytest
import torch
import torch.nn.functional as F

from dspec import _backend
from dspec.models import dense as dense_mod
from dspec.models.dense import dense, packed_path

pytestmark = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")

CODES = _backend.FLOAT_CODE
HAS_AVX512 = _backend.cpp_available() and _backend.extension().linear_isa(CODES[torch.float32]) in ("avx512", "amx")


_LEVELS = ("generic", "avx2", "avx512", "amx")


def isas(dtype):
    """Every tile code ``linear`` has for this dtype on this CPU (under the ISA cap)."""
    best = _backend.extension().linear_isa(CODES[dtype])
    return list(_LEVELS[: _LEVELS.index(best) + 1])


def pack(w, threads=2):
    """w [N, K] (any row stride, unit stride along K) in the launcher's panel layout."""
    ext = _backend.extension()
    n, k = w.shape
    packed = torch.full((ext.linear_packed_size(n, k, CODES[w.dtype]),), float("nan"), dtype=w.dtype)
    ext.linear_pack(w.data_ptr(), packed.data_ptr(), CODES[w.dtype], n, k, w.stride(0), threads)
    return packed


def run(x, w, bias=None, *, threads=2, isa="auto", out=None):
    """The raw launcher on [M, K] x [N, K] (rows with any stride, unit stride along K)."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    packed = pack(w)  # kept alive across the call
    _backend.extension().linear(
        x.data_ptr(),
        packed.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        CODES[x.dtype],
        m,
        k,
        n,
        x.stride(0),
        out.stride(0),
        threads,
        isa,
    )
    return out


def reference(x, w, bias=None):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def check_close(got, x, w, bias=None):
    """Within twice torch's own error in this dtype (plus a float32-sized slack), measured
    against float64: the accumulation orders differ, the precision must not."""
    ref = reference(x, w, bias)
    torch_err = (
        (F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype).double() - ref)
        .abs()
        .max()
        .item()
        if x.numel() and w.numel()
        else 0.0
    )
    err = (got.double() - ref).abs().max().item() if got.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert err <= 2 * torch_err + 1e-5 * (1 + scale), (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 576, 192),
        (7, 576, 13),
        (6, 32, 4),
        (13, 100, 9),
        (64, 17, 5),
        (2, 1, 3),
        (5, 1536, 576),
        (1, 33, 1),
        (19, 63, 65),
        (12, 2, 48),
        (3, 7, 130),
        (160, 64, 128),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64(dtype, m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    for isa in isas(dtype):
        check_close(run(x, w, bias, isa=isa), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m, k, n",
    [
        (23, 576, 1000),
        (37, 100, 130),  # k = 100: AMX's padded copy
        (150, 576, 200),
        (131, 64, 256),  # m >= 128: AMX row-block pairs
        (300, 96, 200),
    ],
)  # m >= 256: rows split over threads
def test_linear_is_batch_and_thread_invariant(dtype, m, k, n):
    """A row's result does not depend on the other rows or on the thread split: a
    verification forward gives each token the bits of a one-token step (on AMX too, whose
    16-row blocks, paired blocks of long inputs, padded last block and padded k must not
    show in a row's bits)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    for isa in isas(dtype):
        whole = run(x, w, threads=2, isa=isa)
        for i in (0, 5, 6, 22, m // 2, m - 1):
            assert torch.equal(run(x[i : i + 1], w, threads=1, isa=isa), whole[i : i + 1])
        assert torch.equal(run(x[3:17], w, threads=1, isa=isa), whole[3:17])
        assert torch.equal(run(x[1:m], w, threads=2, isa=isa), whole[1:m])


def test_amx_isa_is_strict():
    """isa='amx' is bfloat16 on a CPU with AMX-BF16 only; elsewhere a ValueError names it."""
    ext = _backend.extension()
    with pytest.raises(ValueError, match="amx"):  # float32 has no AMX tiles
        ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 0, 1, 8, 4, 8, 4, 1, "amx")
    if ext.linear_isa(2) != "amx":
        with pytest.raises(ValueError, match="amx"):
            ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 2, 1, 8, 4, 8, 4, 1, "amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_prefetch_distance_changes_no_bit(dtype):
    """linear_prefetch_steps tunes how far ahead the tiles prefetch the packed weight; the
    results are the same bits at any distance (0 = a prefetch of the current step)."""
    ext = _backend.extension()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 300, generator=g).to(dtype)
    w = (torch.randn(200, 300, generator=g) / 17).to(dtype)
    old = ext.linear_prefetch_steps()
    try:
        want = run(x, w)
        for steps in (0, 1, 64, 1000):
            assert ext.linear_prefetch_steps(steps) >= 0
            assert ext.linear_prefetch_steps() == steps
            assert torch.equal(run(x, w), want)
    finally:
        ext.linear_prefetch_steps(old)
    assert ext.linear_prefetch_steps() == old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 12, 13, 20])
def test_linear_avx2_chunk_changes_no_bit(dtype, rows):
    """linear_avx2_chunk_steps sets the k chunk of the AVX2 tiles (float32, and the 16-bit
    dtypes' unwidened passes below the widening row count); every output is one FMA chain
    in k order at any chunk, so the bits never move -- including a chunk of 1 step and one
    longer than k, and k (300 = 37.5 steps of 8) not a multiple of the chunk."""
    ext = _backend.extension()
    sixteen = dtype != torch.float32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 300, generator=g).to(dtype)
    w = (torch.randn(70, 300, generator=g) / 17).to(dtype)
    old = ext.linear_avx2_chunk_steps(sixteen)
    assert old >= 1 and ext.linear_avx2_chunk_steps(not sixteen) >= 1
    try:
        want = run(x, w)
        for steps in (1, 3, 16, 128, 1000):
            assert ext.linear_avx2_chunk_steps(sixteen, steps) >= 1
            assert ext.linear_avx2_chunk_steps(sixteen) == steps
            assert torch.equal(run(x, w), want)
            if "avx2" in isas(dtype):
                assert torch.equal(run(x, w, isa="avx2"), run(x, w, isa="avx2", threads=1))
    finally:
        ext.linear_avx2_chunk_steps(sixteen, old)
    assert ext.linear_avx2_chunk_steps(sixteen) == old


def test_linear_strided_rows_and_output():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9, 80, generator=g)
    x = big[::2, 5:69]  # rows of stride 160, 64 columns
    w_big = torch.randn(12, 70, generator=g)
    w = w_big[:, :64]
    out_big = torch.full((5, 20), 7.0)
    run(x, w, out=out_big[:, 3:15])
    check_close(out_big[:, 3:15], x, w)
    assert (out_big[:, :3] == 7).all() and (out_big[:, 15:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_layout(dtype):
    """Panel p = columns 16p..16p+15 with S elements along k per column (S = 2 for 16-bit
    dtypes), zero padded past N and, for 16-bit dtypes, to K rounded up to 32 (one AMX tile
    depth); groups of 4 panels (the last one: the rest) each [Kp / S][panels in group][16][S]."""
    n, k = 84, 5  # 6 panels: a group of 4, a group of 2
    w = torch.arange(1, n * k + 1, dtype=torch.float32).view(n, k).to(dtype)
    s = 1 if dtype == torch.float32 else 2
    steps = k if dtype == torch.float32 else 32 // s
    padded = torch.zeros(96, steps * s, dtype=dtype)
    padded[:n, :k] = w
    groups = [padded[:64].view(4, 16, steps, s), padded[64:].view(2, 16, steps, s)]
    want = torch.cat([g.permute(2, 0, 1, 3).reshape(-1) for g in groups])
    assert torch.equal(pack(w), want)


def test_linear_empty_and_bad_arguments():
    ext = _backend.extension()
    x = torch.randn(0, 8)
    w = torch.randn(4, 8)
    run(x, w)  # m = 0: nothing to do
    with pytest.raises(ValueError, match="dtype"):
        ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 5, 1, 8, 4, 8, 4)
    with pytest.raises(ValueError, match="ldx"):
        ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 0, 1, 8, 4, 4, 4)
    with pytest.raises(ValueError, match="weight is a null pointer"):
        ext.linear(1 << 12, 0, 0, 1 << 12, 0, 1, 8, 4, 8, 4)
    with pytest.raises(ValueError, match="isa"):
        ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 0, 1, 8, 4, 8, 4, 1, "sse")
    if ext.linear_isa(1) in ("generic", "avx2"):  # float16 has no AVX-512 tiles
        with pytest.raises(ValueError, match="avx512"):
            ext.linear(1 << 12, 1 << 12, 0, 1 << 12, 1, 1, 8, 4, 8, 4, 1, "avx512")
    with pytest.raises(ValueError, match="ldw"):
        ext.linear_pack(1 << 12, 1 << 12, 0, 4, 8, 7)
    with pytest.raises(ValueError, match="packed is a null pointer"):
        ext.linear_pack(1 << 12, 0, 0, 4, 8, 8)
    with pytest.raises(ValueError, match="k"):
        ext.linear_packed_size(4, 0, 2)


def test_dense_routes_packed_rows_and_keeps_autograd(monkeypatch):
    w = torch.randn(6, 10)
    b = torch.randn(6)
    x = torch.randn(2, 3, 10)
    assert packed_path(x, w) == (dense_mod.linear_isa(torch.float32) != "generic")
    torch.testing.assert_close(dense(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert not packed_path(x.transpose(0, 1), w)  # not contiguous: the library GEMM
    assert not packed_path(x.double(), w.double())
    wg = w.clone().requires_grad_()
    y = dense(x, wg, b)
    assert y.grad_fn is not None  # training: F.linear, recorded
    monkeypatch.setitem(dense_mod.PACKED_MAX_ROWS, torch.float32, 5)
    assert not packed_path(x, w)  # 6 rows > 5
    assert dense(torch.randn(0, 10), w).shape == (0, 6)


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512", "amx"])
def test_dense_dispatch_follows_the_isa_table(level):
    """At each ISA level of this CPU (set_isa_cap), ``dense`` takes the packed tiles where
    the measured table says they beat torch (every SIMD level) and F.linear where dspec has
    no SIMD code (generic); the results agree with F.linear either way."""
    from dspec import cpu

    ext = _backend.extension()
    if _LEVELS.index(level) > _LEVELS.index(ext.cpu_isa_of_cpu()):
        pytest.skip(f"this CPU has no {level} code path")
    old = cpu.set_isa_cap(level)
    try:
        w = torch.randn(40, 24)
        x = torch.randn(5, 24)
        for dtype in (torch.float32, torch.bfloat16):
            packed = packed_path(x.to(dtype), w.to(dtype))
            assert packed == (dense_mod.PACKED_MAX_ROWS_BY_ISA[dense_mod.linear_isa(dtype)][dtype] != 0)
            assert packed == (level != "generic")
            y = dense(x.to(dtype), w.to(dtype))
            check_close(y, x.to(dtype), w.to(dtype))
    finally:
        cpu.set_isa_cap(old)
    assert ext.cpu_isa() == ext.cpu_isa_of_cpu() or old != "amx"


def test_cpu_isa_cap_is_validated(monkeypatch):
    """$DSPEC_CPU_ISA and set_isa_cap take the four level names only (ValueError naming
    them); the cap never raises the level above the CPU's."""
    from dspec import cpu

    monkeypatch.setenv("DSPEC_CPU_ISA", "sse4")
    with pytest.raises(ValueError, match="DSPEC_CPU_ISA"):
        _backend.check_cpu_isa_env()
    monkeypatch.setenv("DSPEC_CPU_ISA", "AVX2")
    assert _backend.check_cpu_isa_env() == "avx2"
    monkeypatch.delenv("DSPEC_CPU_ISA")
    assert _backend.check_cpu_isa_env() is None
    with pytest.raises(ValueError, match="level"):
        cpu.set_isa_cap("avx3")
    ext = _backend.extension()
    old = cpu.set_isa_cap("amx")
    try:
        assert ext.cpu_isa() == ext.cpu_isa_of_cpu()
        cpu.set_isa_cap("generic")
        assert ext.cpu_isa() == "generic" and cpu.isa() == "generic"
        assert ext.linear_isa(0) == "generic" and ext.cascade_attention_isa() == "generic"
    finally:
        cpu.set_isa_cap(old)


def test_packed_weight_is_kept_and_follows_in_place_updates():
    """Packed once per weight; an in-place update (an optimizer step, load_state_dict)
    repacks it."""
    from dspec.models.dense import packed_weight

    w = torch.randn(33, 40)
    x = torch.randn(3, 40)
    first = packed_weight(w)
    assert packed_weight(w) is first
    torch.testing.assert_close(dense(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        w.mul_(-2)
    assert packed_weight(w) is not first
    torch.testing.assert_close(dense(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "bad",
    [torch.randn(8, 4, device="meta"), torch.randn(8, 4).t(), torch.randn(8, 4, dtype=torch.float16), torch.randn(8)],
)
def test_packed_weight_refuses_what_the_kernel_cannot_read(bad):
    """A weight the C++ packing cannot read (another device -- a CUDA model once reached it
    and crashed --, strided columns, another dtype, not 2-D) is a ValueError naming it."""
    from dspec.models.dense import packed_weight

    with pytest.raises(ValueError, match="weight"):
        packed_weight(bad)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("k, n, rank", [(40, 24, 5), (576, 1536, 16), (17, 7, 3)])
def test_mask_lora_matches_the_torch_update(dtype, atol, k, n, rank):
    """dspec._C.mask_lora = MaskLoraLinear's torch update: y.index_add(0, rows, (scale *
    B A x[rows]).to(dtype)); a row's bits do not depend on the other rows."""
    g = torch.Generator().manual_seed(3)
    total, scale = 11, 2.5
    x = torch.randn(total, k, generator=g).to(dtype)
    y = torch.randn(total, n, generator=g).to(dtype)
    a = torch.randn(rank, k, generator=g) / 6
    b = torch.randn(n, rank, generator=g) / 3
    rows = torch.tensor([0, 4, 10, 7])
    delta = F.linear(F.linear(x.index_select(0, rows).float(), a), b) * scale
    want = y.index_add(0, rows, delta.to(dtype))
    got = y.clone()
    bt = b.t().contiguous()  # the kernel reads B^T [rank, n]
    _backend.extension().mask_lora(
        got.data_ptr(),
        x.data_ptr(),
        rows.data_ptr(),
        a.data_ptr(),
        bt.data_ptr(),
        scale,
        CODES[dtype],
        rows.numel(),
        total,
        k,
        n,
        rank,
    )
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    untouched = [i for i in range(total) if i not in rows.tolist()]
    assert torch.equal(got[untouched], y[untouched])
    alone = y.clone()
    _backend.extension().mask_lora(
        alone.data_ptr(),
        x.data_ptr(),
        rows[2:3].data_ptr(),
        a.data_ptr(),
        bt.data_ptr(),
        scale,
        CODES[dtype],
        1,
        total,
        k,
        n,
        rank,
    )
    assert torch.equal(alone[10], got[10])
    split = y.clone()  # rows over two threads: the same bits
    _backend.extension().mask_lora(
        split.data_ptr(),
        x.data_ptr(),
        rows.data_ptr(),
        a.data_ptr(),
        bt.data_ptr(),
        scale,
        CODES[dtype],
        rows.numel(),
        total,
        k,
        n,
        rank,
        2,
    )
    assert torch.equal(split, got)
    with pytest.raises(ValueError, match="rows must lie"):
        bad = torch.tensor([total])
        _backend.extension().mask_lora(
            got.data_ptr(),
            x.data_ptr(),
            bad.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            scale,
            CODES[dtype],
            1,
            total,
            k,
            n,
            rank,
        )
    with pytest.raises(ValueError, match="weight_dtype"):
        _backend.extension().mask_lora(
            got.data_ptr(),
            x.data_ptr(),
            rows.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            scale,
            CODES[dtype],
            rows.numel(),
            total,
            k,
            n,
            rank,
            1,
            1,
        )
    # A and B^T held in bf16 (weight_dtype 2): the bits of the float32 call on the same values
    a16, bt16 = a.bfloat16(), bt.bfloat16()
    wide, narrow = y.clone(), y.clone()
    a32, bt32 = a16.float(), bt16.float()
    _backend.extension().mask_lora(
        wide.data_ptr(),
        x.data_ptr(),
        rows.data_ptr(),
        a32.data_ptr(),
        bt32.data_ptr(),
        scale,
        CODES[dtype],
        rows.numel(),
        total,
        k,
        n,
        rank,
        1,
        0,
    )
    _backend.extension().mask_lora(
        narrow.data_ptr(),
        x.data_ptr(),
        rows.data_ptr(),
        a16.data_ptr(),
        bt16.data_ptr(),
        scale,
        CODES[dtype],
        rows.numel(),
        total,
        k,
        n,
        rank,
        1,
        2,
    )
    assert torch.equal(narrow, wide)


@pytest.mark.skipif(not HAS_AVX512, reason="needs AVX-512")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("weight_dtype", [0, 2])
@pytest.mark.parametrize(
    "k, n, rank, rows",
    [(576, 1536, 16, 13), (17, 7, 3, 5), (33, 40, 20, 9), (1536, 576, 16, 1), (64, 50, 16, 21), (16, 16, 1, 4)],
)
def test_mask_lora_avx512_and_generic_agree_and_each_is_batch_invariant(dtype, atol, weight_dtype, k, n, rank, rows):
    """The AVX-512 update (blocks of up to 8 rows sharing each load of A and B^T, fused
    multiply-adds) and the portable loops (separate multiplies and adds) agree to rounding,
    'auto' is the AVX-512 code, and in each a row's bits depend on that row alone (a row
    updated alone, or in another block position, or over two threads): ragged k / n tails,
    odd ranks and ranks above 16, row blocks of 1 to 8 rows and a partial block after full ones."""
    g = torch.Generator().manual_seed(k * n + rank)
    total, scale = rows + 3, 1.75
    x = torch.randn(total, k, generator=g).to(dtype)
    y = torch.randn(total, n, generator=g).to(dtype)
    wt = torch.bfloat16 if weight_dtype == 2 else torch.float32
    a = (torch.randn(rank, k, generator=g) / 5).to(wt)
    bt = (torch.randn(rank, n, generator=g) / 3).to(wt)
    index = torch.randperm(total, generator=g)[:rows]

    def update(isa, idx, threads=1):
        out = y.clone()
        _backend.extension().mask_lora(
            out.data_ptr(),
            x.data_ptr(),
            idx.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            scale,
            CODES[dtype],
            idx.numel(),
            total,
            k,
            n,
            rank,
            threads,
            weight_dtype,
            isa,
        )
        return out

    out = {isa: update(isa, index) for isa in ("generic", "avx512", "auto")}
    assert torch.equal(out["auto"], out["avx512"]) and not torch.equal(out["generic"], y)
    torch.testing.assert_close(out["avx512"].float(), out["generic"].float(), atol=atol, rtol=atol)
    for isa in ("generic", "avx512"):
        assert torch.equal(update(isa, index, threads=2), out[isa])
        last = index[-1:].contiguous()
        assert torch.equal(update(isa, last)[last], out[isa][last])
        flipped = index.flip(0).contiguous()
        assert torch.equal(update(isa, flipped), out[isa])
    with pytest.raises(ValueError, match="isa"):
        _backend.extension().mask_lora(
            y.data_ptr(),
            x.data_ptr(),
            index.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            scale,
            CODES[dtype],
            rows,
            total,
            k,
            n,
            rank,
            1,
            weight_dtype,
            "amx",
        )


HAS_LORA_AMX = (
    _backend.cpp_available()
    and hasattr(_backend.extension(), "mask_lora_has_amx")
    and _backend.extension().mask_lora_has_amx(CODES[torch.bfloat16], 16)
)


def _packed_adapter(a, bt):
    ext = _backend.extension()
    rank, k = a.shape
    n = bt.shape[1]
    packed = torch.full((ext.mask_lora_packed_size(k, n),), float("nan"), dtype=torch.bfloat16)
    ext.mask_lora_pack(a.data_ptr(), bt.data_ptr(), packed.data_ptr(), rank, k, n, CODES[a.dtype])
    return packed


@pytest.mark.skipif(not HAS_LORA_AMX, reason="needs AMX-BF16")
@pytest.mark.parametrize(
    "k, n, rank, rows",
    [
        (576, 1536, 16, 13),
        (1536, 576, 16, 1),
        (17, 7, 3, 5),
        (64, 50, 16, 21),
        (40, 33, 1, 16),
        (576, 192, 16, 40),
        (100, 20, 9, 17),
    ],
)
def test_mask_lora_amx_matches_the_reference_and_is_batch_invariant(k, n, rank, rows):
    """The tile-unit update (bf16 x / y, an adapter packed by mask_lora_pack) is the float64
    update to bf16 rounding -- h carried as bf16 hi + lo parts -- and a row's bits depend on
    that row alone: alone, in another order, in another group of 16, over two threads;
    'auto' with the packed adapter is the AMX code.  Ragged k (padded to 32) and n (to 16),
    ranks 1..16, partial and several row groups."""
    ext = _backend.extension()
    g = torch.Generator().manual_seed(k * n + rank)
    total, scale = rows + 5, 1.75
    x = torch.randn(total, k, generator=g).bfloat16()
    y = torch.randn(total, n, generator=g).bfloat16()
    a = (torch.randn(rank, k, generator=g) / 5).bfloat16()
    bt = (torch.randn(rank, n, generator=g) / 3).bfloat16()
    index = torch.randperm(total, generator=g)[:rows]
    packed = _packed_adapter(a, bt)
    assert not packed.isnan().any()  # every element written (zeros in the padding)

    def update(isa, idx, threads=1):
        out = y.clone()
        ext.mask_lora(
            out.data_ptr(),
            x.data_ptr(),
            idx.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            scale,
            CODES[torch.bfloat16],
            idx.numel(),
            total,
            k,
            n,
            rank,
            threads,
            2,
            isa,
            packed.data_ptr(),
        )
        return out

    got = update("amx", index)
    delta = F.linear(F.linear(x[index].double(), a.double()), bt.double().t()) * scale
    want = y.index_add(0, index, delta.to(torch.bfloat16))
    # one bf16 rounding of the delta or of the sum apart at most
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(got[untouched], y[untouched])
    assert torch.equal(update("auto", index), got)
    assert torch.equal(update("amx", index, threads=2), got)
    assert torch.equal(update("amx", index.flip(0).contiguous()), got)
    last = index[-1:].contiguous()
    assert torch.equal(update("amx", last)[last], got[last])
    # float32 weights are packed rounded to bf16: the same packed bytes from the same values
    assert torch.equal(_packed_adapter(a.float(), bt.float()), packed)


@pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")
def test_mask_lora_pack_and_amx_refuse_what_they_cannot_take():
    ext = _backend.extension()
    a, bt = torch.zeros(17, 32, dtype=torch.bfloat16), torch.zeros(17, 16, dtype=torch.bfloat16)
    packed = torch.zeros(ext.mask_lora_packed_size(32, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rank must be <= 16"):
        ext.mask_lora_pack(a.data_ptr(), bt.data_ptr(), packed.data_ptr(), 17, 32, 16, 2)
    with pytest.raises(ValueError, match="weight_dtype"):
        ext.mask_lora_pack(a.data_ptr(), bt.data_ptr(), packed.data_ptr(), 16, 32, 16, 1)
    x, y, rows = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16), torch.tensor([1])
    with pytest.raises(ValueError, match="isa 'amx' needs"):  # no packed adapter
        ext.mask_lora(
            y.data_ptr(),
            x.data_ptr(),
            rows.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            1.0,
            2,
            1,
            2,
            32,
            16,
            16,
            1,
            2,
            "amx",
        )
    with pytest.raises(ValueError, match="isa 'amx' needs"):  # float32 activations
        ext.mask_lora(
            y.float().data_ptr(),
            x.float().data_ptr(),
            rows.data_ptr(),
            a.data_ptr(),
            bt.data_ptr(),
            1.0,
            0,
            1,
            2,
            32,
            16,
            16,
            1,
            2,
            "amx",
            packed.data_ptr(),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_group_equals_one_call_per_weight(dtype):
    """q / k / v (or gate / up) in one call: each output bit-identical to its own call."""
    from dspec.models.dense import dense_many

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 72, generator=g).to(dtype)
    ws = [(torch.randn(n, 72, generator=g) / 9).to(dtype) for n in (40, 13, 13)]
    bs = [None, torch.randn(13, generator=g).to(dtype), None]
    ext = _backend.extension()
    outs = [torch.empty(2, 5, w.shape[0], dtype=dtype) for w in ws]
    packed = [pack(w) for w in ws]
    ext.linear_group(
        x.data_ptr(),
        CODES[dtype],
        10,
        72,
        [p.data_ptr() for p in packed],
        [0 if b is None else b.data_ptr() for b in bs],
        [o.data_ptr() for o in outs],
        [w.shape[0] for w in ws],
        2,
    )
    for w, b, o in zip(ws, bs, outs):
        assert torch.equal(o.view(10, -1), run(x.view(10, 72), w, b, threads=1))
    many = dense_many(x, ws, bs)  # the model's entry point (fp16: F.linear each)
    for w, b, o in zip(ws, bs, many):
        torch.testing.assert_close(o, F.linear(x, w, b), atol=2e-2, rtol=2e-2)
        if dtype != torch.float16 and dense_mod.linear_isa(dtype) != "generic":  # generic: torch runs
            assert torch.equal(o.view(10, -1), run(x.view(10, 72), w, b, threads=1))
    with pytest.raises(ValueError, match="same length"):
        ext.linear_group(x.data_ptr(), CODES[dtype], 10, 72, [packed[0].data_ptr()], [], [outs[0].data_ptr()], [40])
    with pytest.raises(ValueError, match=r"ns\[0\]"):
        ext.linear_group(x.data_ptr(), CODES[dtype], 10, 72, [packed[0].data_ptr()], [0], [outs[0].data_ptr()], [0])
