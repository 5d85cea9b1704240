"""The compiled module dspec._C: it imports without torch or a GPU, its C++ CPU token_stats
matches dspec.reference.token_stats, bad arguments raise ValueError before anything runs,
and (only where a GPU and a CUDA build exist) its CUDA kernels match too.

Build it first: ``pip install --no-build-isolation -e .`` (DSPEC_SKIP_CUDA_BUILD=1 to skip
nvcc).  Tests calling _C skip when the module was not built; the import test fails.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dspec.reference.token_stats import token_stats as reference

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _load_ext():
    try:
        return importlib.import_module("dspec._C")
    except ImportError:
        return None


_C = _load_ext()
needs_ext = pytest.mark.skipif(_C is None, reason="dspec._C is not built (pip install -e .)")
HAS_CUDA_RUN = _C is not None and bool(_C.with_cuda) and torch.cuda.is_available()


# ------------------------------------------------------------------------------------------
# import


def test_extension_imports():
    assert _C is not None, "dspec._C is not built: run `pip install --no-build-isolation -e .`"
    assert isinstance(_C.with_cuda, bool)
    assert isinstance(_C.cuda_archs, str)
    assert isinstance(_C.build_info, dict)
    assert _C.build_info["with_cuda"] == _C.with_cuda
    if _C.with_cuda:
        assert _C.cuda_archs
    assert _C.token_stats_workspace_bytes(3, 5) == 3 * 5 * 24
    assert _C.token_stats_workspace_bytes(3, 1) == 0
    assert _C.token_stats_workspace_bytes(0, 4) == 0


def _run_python(code: str) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@needs_ext
def test_extension_does_not_import_torch():
    # Load the extension file by itself (the dspec package's __init__ may import torch).
    out = _run_python("""
        import glob, importlib.machinery, importlib.util, os, sys
        spec = importlib.util.find_spec("dspec")  # does not run dspec/__init__.py
        files = [f for d in spec.submodule_search_locations
                 for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 for f in glob.glob(os.path.join(d, "_C" + suffix))]
        assert files, spec.submodule_search_locations
        loader = importlib.machinery.ExtensionFileLoader("dspec._C", files[0])
        mod_spec = importlib.util.spec_from_file_location("dspec._C", files[0], loader=loader)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        assert "torch" not in sys.modules, "loading dspec._C imported torch"
        print(mod.with_cuda)
    """)
    assert out.strip() == str(_C.with_cuda)


@needs_ext
def test_import_dspec_C_adds_no_torch():
    # `import dspec._C`: whatever the package itself imports, the extension adds no torch.
    _run_python("""
        import sys
        import dspec
        had_torch = "torch" in sys.modules
        import dspec._C
        assert had_torch or "torch" not in sys.modules
    """)


# ------------------------------------------------------------------------------------------
# helpers


def _outputs(rows: int, device="cpu"):
    token = torch.full((rows,), -7, dtype=torch.int64, device=device)
    floats = [torch.full((rows,), 12345.0, dtype=torch.float32, device=device) for _ in range(4)]
    return token, *floats


def run_c(x: torch.Tensor, temperature: float, *, device="cpu", num_splits=1, stream=0):
    """Call _C.token_stats on a [rows, V] tensor with unit stride along V."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, vocab = x.shape
    outs = _outputs(rows, x.device)
    ws = None
    if num_splits > 1:
        ws = torch.empty(max(1, _C.token_stats_workspace_bytes(rows, num_splits)), dtype=torch.uint8, device=x.device)
    _C.token_stats(
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        rows,
        vocab,
        x.stride(0),
        1.0 / temperature,
        *(t.data_ptr() for t in outs),
        device,
        stream,
        num_splits,
        ws.data_ptr() if ws is not None else 0,
    )
    return outs


def check(outs, x: torch.Tensor, temperature: float):
    exp = reference(x.cpu(), temperature)
    token, *floats = (t.cpu() for t in outs)
    assert torch.equal(token, exp.token), (token, exp.token)
    for name, got, want in zip(("prob", "margin", "entropy", "lse"), floats, exp[1:]):
        ok = torch.isclose(got, want, rtol=1e-4, atol=1e-6, equal_nan=True)
        assert bool(ok.all()), f"{name}: got {got[~ok].tolist()} want {want[~ok].tolist()}"


def make_logits(rows: int, vocab: int, dtype, seed: int = 0, special: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rows * 131 + vocab)
    x = torch.randn(rows, vocab, generator=g) * 4
    if special and rows >= 7:
        x[0, vocab // 2] = float("nan")  # invalid: lse NaN
        x[1] = float("-inf")  # invalid: lse -inf
        x[2] = 0.5  # all equal: token 0, margin 0
        x[3, ::2] = float("-inf")  # valid with -inf entries (V=1: invalid)
        x[4, -1] = float("inf")  # invalid: lse +inf
        if vocab >= 3:
            x[5, 1] = x[5, -1] = x[5].max() + 1  # tie for the max: lowest index
        x[6, vocab // 3] = float("inf")  # +inf and NaN in one row
        x[6, vocab - 1] = float("nan")
    return x.to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TEMPS = [1.0, 1e-3, 1e3]


# ------------------------------------------------------------------------------------------
# CPU path vs the reference


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("vocab", [1, 2, 111, 5000])
@pytest.mark.parametrize("temperature", TEMPS)
def test_cpu_matches_reference(dtype, rows, vocab, temperature):
    x = make_logits(rows, vocab, dtype)
    check(run_c(x, temperature), x, temperature)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("temperature", TEMPS)
def test_cpu_strided_rows(dtype, temperature):
    wide = make_logits(7, 5003, dtype, seed=1)
    x = wide[:, 2:4111]  # row_stride 5003, odd offset: rows not 16-byte aligned
    assert x.stride(0) == 5003 and not x.is_contiguous()
    check(run_c(x, temperature), x, temperature)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cpu_special_values(dtype):
    v = 37
    x = torch.randn(12, v)
    x[0] = float("nan")  # all NaN
    x[1] = float("inf")  # all +inf
    x[2] = float("-inf")
    x[2, 5] = 3.0  # single finite value among -inf
    x[3] = 0.0  # all equal
    x[4, :] = float("-inf")
    x[4, -1] = -1e4 if dtype != torch.float16 else -6e4  # very negative, only finite one
    x[5, 3] = float("inf")
    x[5, 9] = float("-inf")
    x[6, 10] = x[6, 20] = x[6, 30] = 50.0  # three-way tie
    x[7, :] = -3.0
    x[7, 36] = -2.0  # max at the last column
    x[8, 0] = 60000.0  # huge (fp16-representable) max
    x[9] = torch.linspace(-1, 1, v)  # distinct increasing
    x[10] = torch.linspace(1, -1, v)
    x[11, ::3] = float("nan")
    x = x.to(dtype)
    for temperature in TEMPS + [0.37]:
        check(run_c(x, temperature), x, temperature)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpu_extreme_magnitudes(dtype):
    # (x - max) / T overflows to -inf: those terms are 0, never 0 * inf = NaN
    big = 3e38
    x = torch.tensor(
        [[-big, big, 0.0, 1.0], [big, -big, 0.0, big], [-big, -big, -big, -big], [1.0, -big, 2.0, 3.0]]
    ).to(dtype)
    for temperature in (1.0, 1e-3, 1e3, 1e-30):
        check(run_c(x, temperature), x, temperature)


@needs_ext
def test_cpu_fp16_decoding_bit_patterns():
    # every fp16 bit pattern (normals, subnormals, +-0, +-inf, NaNs): the kernel's hand
    # written fp16 -> fp32 conversion must agree with torch's
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits.reshape(-1, 1).contiguous()  # V = 1: lse is the value itself (or NaN)
    token, prob, margin, entropy, lse = run_c(x, 1.0)
    want = x.float().reshape(-1)
    assert torch.equal(torch.isnan(lse), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(lse[finite], want[finite])
    bx = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 1).contiguous()
    lse_b = run_c(bx, 1.0)[4]
    want_b = bx.float().reshape(-1)
    assert torch.equal(torch.isnan(lse_b), torch.isnan(want_b))
    assert torch.equal(lse_b[~torch.isnan(want_b)], want_b[~torch.isnan(want_b)])


@needs_ext
@pytest.mark.parametrize("rows,vocab", [(7, 50000), (1, 300001), (3, 151936)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpu_threaded(rows, vocab, dtype):
    # rows * vocab >= 2^18: rows (and, with few rows, column chunks) spread over threads
    x = make_logits(rows, vocab, dtype, seed=3)
    if rows == 1:
        x[0, vocab - 5] = x[0, 17] = x[0].max() + 2  # tie across chunks: lowest index wins
    check(run_c(x, 1.0), x, 1.0)
    check(run_c(x, 0.05), x, 0.05)


@needs_ext
def test_cpu_thread_count_env(monkeypatch):
    x = make_logits(2, 200000, torch.float32, seed=4)
    for n in ("1", "3", "16"):
        monkeypatch.setenv("DSPEC_CPU_THREADS", n)
        check(run_c(x, 1.0), x, 1.0)


@needs_ext
def test_cpu_num_splits_accepted():
    x = make_logits(7, 111, torch.float32)
    check(run_c(x, 1.0, num_splits=4), x, 1.0)


@needs_ext
def test_zero_rows_is_noop():
    for ptr in (0, 1 << 20):
        _C.token_stats(ptr, 0, 0, 10, 10, 1.0, ptr, ptr, ptr, ptr, ptr, "cpu")
        _C.token_stats(ptr, 0, 0, 10, 10, 1.0, ptr, ptr, ptr, ptr, ptr, "cpu", 0, 8, 0)


@needs_ext
def test_single_row_any_stride():
    # torch reports strides like (1, 1) for a [1, V] view; a single row never uses it
    x = torch.randn(50, 1).t()
    assert x.shape == (1, 50) and x.stride() == (1, 1)
    check(run_c(x, 1.0), x, 1.0)


# ------------------------------------------------------------------------------------------
# argument validation


def _valid_args(x, outs, ws):
    rows, vocab = x.shape
    return dict(
        logits_ptr=x.data_ptr(),
        dtype=0,
        rows=rows,
        vocab=vocab,
        row_stride=x.stride(0),
        inv_temperature=1.0,
        token_ptr=outs[0].data_ptr(),
        prob_ptr=outs[1].data_ptr(),
        margin_ptr=outs[2].data_ptr(),
        entropy_ptr=outs[3].data_ptr(),
        lse_ptr=outs[4].data_ptr(),
        device="cpu",
        stream=0,
        num_splits=1,
        workspace_ptr=ws.data_ptr(),
    )


BAD_ARGS = [
    ("logits_ptr", dict(logits_ptr=0)),
    ("token_ptr", dict(token_ptr=0)),
    ("prob_ptr", dict(prob_ptr=0)),
    ("margin_ptr", dict(margin_ptr=0)),
    ("entropy_ptr", dict(entropy_ptr=0)),
    ("lse_ptr", dict(lse_ptr=0)),
    ("rows", dict(rows=-1)),
    ("vocab", dict(vocab=0)),
    ("vocab", dict(vocab=-3)),
    ("vocab", dict(vocab=1 << 31, row_stride=1 << 31)),
    ("row_stride", dict(row_stride=10)),
    ("row_stride", dict(row_stride=-1)),
    ("dtype", dict(dtype=3)),
    ("dtype", dict(dtype=-1)),
    ("inv_temperature", dict(inv_temperature=0.0)),
    ("inv_temperature", dict(inv_temperature=-1.0)),
    ("inv_temperature", dict(inv_temperature=math.inf)),
    ("inv_temperature", dict(inv_temperature=math.nan)),
    ("inv_temperature", dict(inv_temperature=1e300)),  # inf as float32
    ("num_splits", dict(num_splits=0)),
    ("num_splits", dict(num_splits=-2)),
    ("workspace_ptr", dict(num_splits=2, workspace_ptr=0)),
    ("device", dict(device="gpu")),
    ("device", dict(device="")),
    ("token_ptr", dict(token_ptr=None)),  # filled in below: misaligned
]


@needs_ext
@pytest.mark.parametrize("name,bad", BAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ARGS)])
def test_invalid_arguments_raise_before_any_write(name, bad):
    x = torch.randn(3, 11)
    outs = _outputs(3)
    ws = torch.empty(_C.token_stats_workspace_bytes(3, 2), dtype=torch.uint8)
    kwargs = _valid_args(x, outs, ws)
    kwargs.update(bad)
    if kwargs["token_ptr"] is None:
        kwargs["token_ptr"] = outs[0].data_ptr() + 4
    with pytest.raises(ValueError, match=name):
        _C.token_stats(**kwargs)
    assert bool((outs[0] == -7).all()) and all(bool((t == 12345.0).all()) for t in outs[1:])
    # the same call with valid arguments works
    _C.token_stats(**_valid_args(x, outs, ws))
    assert not bool((outs[0] == -7).any())


@needs_ext
def test_invalid_workspace_query():
    with pytest.raises(ValueError, match="rows"):
        _C.token_stats_workspace_bytes(-1, 2)
    with pytest.raises(ValueError, match="num_splits"):
        _C.token_stats_workspace_bytes(4, 0)


@needs_ext
@pytest.mark.skipif(_C is not None and _C.with_cuda, reason="built with CUDA")
def test_cuda_device_without_cuda_build():
    x = torch.randn(3, 11)
    outs = _outputs(3)
    ws = torch.empty(1, dtype=torch.uint8)
    kwargs = _valid_args(x, outs, ws)
    kwargs["device"] = "cuda"
    with pytest.raises(ValueError, match="built without CUDA"):
        _C.token_stats(**kwargs)


# ------------------------------------------------------------------------------------------
# CUDA kernels (need a GPU and a CUDA build; they always compile as part of the build)

needs_cuda = pytest.mark.skipif(not HAS_CUDA_RUN, reason="needs dspec._C built with CUDA and a GPU")


def run_cuda(x, temperature, num_splits=1):
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream(x.device)
        outs = run_c(x, temperature, device="cuda", num_splits=num_splits, stream=stream.cuda_stream)
        stream.synchronize()
    return outs


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("vocab", [1, 2, 111, 5000, 40000])
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cuda_matches_reference(dtype, rows, vocab, temperature, num_splits):
    x = make_logits(rows, vocab, dtype).cuda()
    check(run_cuda(x, temperature, num_splits), x, temperature)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("offset", [0, 1, 3, 5])
@pytest.mark.parametrize("num_splits", [1, 2, 40])
def test_cuda_misaligned_rows(dtype, offset, num_splits):
    # rows starting off a 16-byte boundary: scalar head, vector body, scalar tail
    wide = make_logits(5, 20011, dtype, seed=2).cuda()
    x = wide[:, offset : offset + 19999]
    x[2, 7] = x[2, 19990] = float(x[2].float().max()) + 1  # tie in head / tail
    check(run_cuda(x, 1.0, num_splits), x, 1.0)


@needs_cuda
@pytest.mark.parametrize("vocab", [32000, 151936, 256000])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cuda_real_vocab(vocab, dtype):
    x = make_logits(9, vocab, dtype, seed=5).cuda()
    x[8, 100] = x[8, vocab - 100] = float(x[8].float().max()) + 1
    for num_splits in (1, 8, 64):
        check(run_cuda(x, 1.0, num_splits), x, 1.0)
