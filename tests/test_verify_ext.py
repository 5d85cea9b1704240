"""verify_chain / verify_tree in dspec._C: the C++ CPU code ("cpp") beyond what
test_verify.py covers (several vocabulary tiles, threads, strides, dtypes, edge cases), the
launchers' argument validation (ValueError before anything is written), and the CUDA
kernels of csrc/verify.cu run without a GPU by the host simulator of tests/cuda_sim (the
kernel and launcher code compiled as plain C++: fibers for threads, barriers for
__syncthreads / __syncwarp / shuffles).  On a machine with a GPU, test_verify.py runs the
real CUDA backend against the reference as well.
"""

from __future__ import annotations

import ctypes
import math
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspec
from dspec import _backend
from dspec.reference import verify as reference
from verify_cases import chain_case, random_tree, same

_C = _backend.extension()
needs_ext = pytest.mark.skipif(_C is None, reason="dspec._C is not built (pip install -e .)")
ROOT = Path(__file__).resolve().parents[1]
FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_CODE = {torch.int32: 0, torch.int64: 1}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


# ------------------------------------------------------------------------ cpp vs reference
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("batch,length,vocab", [(3, 4, 5000), (2, 3, 70001), (5, 40, 70), (4, 0, 100)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.3, 5.0])
@pytest.mark.parametrize("with_q", [False, True])
def test_cpp_chain_several_tiles(dtype, batch, length, vocab, temperature, with_q):
    if with_q and (temperature <= 0 or length == 0):
        pytest.skip("draft_probs matter only when sampling (and the reference needs L >= 1)")
    logits, drafts, q, n, coins, u = chain_case(batch, length, vocab, dtype, batch + length + vocab, with_q=with_q)
    exp = reference.verify_chain(
        drafts, logits, draft_probs=q, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
    )
    out = dspec.verify_chain(
        drafts.int(),
        logits,
        draft_probs=q,
        num_drafts=n,
        temperature=temperature,
        coins=coins,
        sample_uniforms=u,
        backend="cpp",
    )
    same(out, exp)


@needs_ext
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cpp_chain_strides_and_dtypes(temperature):
    """Non-contiguous logits / draft_probs, draft_probs in another dtype, no num_drafts."""
    logits, drafts, q, _, coins, u = chain_case(6, 5, 3001, torch.float32, 4, with_q=True)
    wide = torch.randn(6, 6, 3003)
    wide[..., 1:3002] = logits
    logits_view = wide[..., 1:3002]  # rows not 16-byte aligned, row stride 3003
    q_wide = torch.zeros(6, 5, 2, 3001, dtype=torch.bfloat16)
    q_wide[:, :, 1] = q.to(torch.bfloat16)
    q_view = q_wide[:, :, 1]  # strides (30010, 6002, 1)
    for dq in (None, q_view):
        exp = reference.verify_chain(
            drafts, logits, draft_probs=dq, temperature=temperature, coins=coins, sample_uniforms=u
        )
        out = dspec.verify_chain(
            drafts, logits_view, draft_probs=dq, temperature=temperature, coins=coins, sample_uniforms=u, backend="cpp"
        )
        same(out, exp)


@needs_ext
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cpp_threaded_rows(temperature, monkeypatch):
    """B * V >= 2^18: rows spread over threads (any thread count gives the same result)."""
    logits, drafts, q, n, coins, u = chain_case(48, 3, 20000, torch.bfloat16, 8, with_q=True)
    exp = reference.verify_chain(
        drafts, logits, draft_probs=q, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
    )
    for threads in ("1", "3"):
        monkeypatch.setenv("DSPEC_CPU_THREADS", threads)
        out = dspec.verify_chain(
            drafts,
            logits,
            draft_probs=q,
            num_drafts=n,
            temperature=temperature,
            coins=coins,
            sample_uniforms=u,
            backend="cpp",
        )
        same(out, exp)
    tokens, parents, tlogits, tcoins, tu = random_tree(40, 9, 9000, 3)
    exp = reference.verify_tree(tokens, parents, tlogits, temperature=temperature, coins=tcoins, sample_uniforms=tu)
    same(
        dspec.verify_tree(
            tokens, parents, tlogits, temperature=temperature, coins=tcoins, sample_uniforms=tu, backend="cpp"
        ),
        exp,
    )


@needs_ext
@pytest.mark.parametrize("batch,nodes,vocab", [(7, 9, 5000), (3, 33, 20000), (16, 64, 50), (2, 1, 10)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("ids", ["int64", "int32"])
def test_cpp_tree_matches_reference(batch, nodes, vocab, temperature, ids):
    tokens, parents, logits, coins, u = random_tree(batch, nodes, vocab, nodes + vocab)
    logits = logits.to(torch.bfloat16)
    exp = reference.verify_tree(tokens, parents, logits, temperature=temperature, coins=coins, sample_uniforms=u)
    cast = (lambda t: t.int()) if ids == "int32" else (lambda t: t)
    out = dspec.verify_tree(
        cast(tokens), parents.int(), logits, temperature=temperature, coins=coins, sample_uniforms=u, backend="cpp"
    )
    same(out, exp)


def wide_root_tree(batch, nodes, vocab, seed, *, distinct=True):
    """Every node a child of the root, coins near 1: most siblings are rejected, so the final
    draw excludes up to nodes - 1 tokens (more than the CUDA kernels cache in shared memory)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.zeros(batch, nodes, dtype=torch.int64)
    parents[:, 0] = -1
    if distinct:
        tokens = torch.stack([torch.randperm(vocab, generator=g)[:nodes] for _ in range(batch)])
    else:
        tokens = torch.randint(0, 4, (batch, nodes), generator=g)
    logits = torch.randn(batch, nodes, vocab, generator=g)
    logits[:, 0, : nodes * 2] += 3.0  # the rejected siblings carry real mass
    coins = 1 - torch.rand(batch, nodes, generator=g) * 1e-3
    coins[:, -1] = torch.rand(batch, generator=g)  # the last sibling may be accepted
    uniforms = torch.rand(batch, generator=g)
    return tokens, parents, logits, coins, uniforms


@needs_ext
@pytest.mark.parametrize("distinct", [True, False])
def test_cpp_tree_many_rejected_siblings(distinct):
    tokens, parents, logits, coins, u = wide_root_tree(6, 100, 400, 1, distinct=distinct)
    exp = reference.verify_tree(tokens, parents, logits, temperature=1.0, coins=coins, sample_uniforms=u)
    out = dspec.verify_tree(tokens, parents, logits, temperature=1.0, coins=coins, sample_uniforms=u, backend="cpp")
    same(out, exp)
    assert int((exp.num_accepted == 0).sum()) >= 3


@needs_ext
def test_cpp_edge_cases():
    for t in (0.0, 1.0):
        out = dspec.verify_chain(
            torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 4, 10), temperature=t, backend="cpp"
        )
        assert out.num_accepted.shape == (0,) and out.tokens.shape == (0, 4)
        logits = torch.randn(3, 1, 7)
        kw = dict(temperature=t, coins=torch.zeros(3, 0), sample_uniforms=torch.tensor([0.1, 0.5, 0.9]))
        same(
            dspec.verify_chain(torch.zeros(3, 0, dtype=torch.int64), logits, backend="cpp", **kw),
            reference.verify_chain(torch.zeros(3, 0, dtype=torch.int64), logits, **kw),
        )
        logits = torch.randn(2, 1, 5)
        kw = dict(temperature=t, coins=torch.rand(2, 1), sample_uniforms=torch.rand(2))
        tok, parents = torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), -1)
        same(
            dspec.verify_tree(tok, parents, logits, backend="cpp", **kw),
            reference.verify_tree(tok, parents, logits, **kw),
        )
    # invalid rows: NaN, +inf, all -inf -> the row stops there with final token -1
    logits, drafts, _, _, coins, u = chain_case(3, 4, 30, torch.float32, 1, with_q=False)
    drafts[:] = logits.argmax(-1)[:, :4]
    logits[0, 1, 3] = float("nan")
    logits[1, 1, 5] = float("inf")
    logits[2, 1] = float("-inf")
    for t in (0.0, 1.0):
        out = dspec.verify_chain(
            drafts, logits, temperature=t, coins=torch.zeros_like(coins), sample_uniforms=u, backend="cpp"
        )
        assert out.num_accepted.tolist() == [1, 1, 1] and out.tokens[:, 1].tolist() == [-1, -1, -1]


@needs_ext
def test_cpp_nan_draft_probs_give_minus_one():
    """The wrapper rejects NaN draft_probs while value checks are on; with them off (an
    engine loop) the kernel still gives the documented -1."""
    logits, drafts, q, _, coins, u = chain_case(4, 3, 50, torch.float32, 2, with_q=True)
    q[:, 0, :] = float("nan")
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_chain(drafts, logits, draft_probs=q, temperature=1.0, backend="cpp")
    dspec.config.validate_values = False
    try:
        out = dspec.verify_chain(
            drafts, logits, draft_probs=q, temperature=1.0, coins=coins, sample_uniforms=u, backend="cpp"
        )
    finally:
        dspec.config.validate_values = True
    exp = reference.verify_chain(drafts, logits, draft_probs=q, temperature=1.0, coins=coins, sample_uniforms=u)
    same(out, exp)
    assert out.tokens[:, 0].tolist() == [-1] * 4


@needs_ext
def test_cpp_ids_outside_vocab_without_value_checks():
    """With value checks off, ids outside [0, V) are never read: such a draft is rejected."""
    logits = torch.randn(2, 3, 10)
    drafts = torch.tensor([[3, 99], [-5, 1]])
    dspec.config.validate_values = False
    try:
        for t in (0.0, 1.0):
            out = dspec.verify_chain(
                drafts, logits, temperature=t, coins=torch.zeros(2, 2), sample_uniforms=torch.rand(2), backend="cpp"
            )
            assert int(out.num_accepted[1]) == 0 and int(out.num_accepted[0]) <= 1
            assert ((out.tokens >= -1) & (out.tokens < 10)).all()
        out = dspec.verify_tree(
            torch.tensor([[0, 77, -3]]),
            torch.tensor([[-1, 0, 0]]),
            torch.randn(1, 3, 10),
            temperature=1.0,
            coins=torch.zeros(1, 3),
            sample_uniforms=torch.rand(1),
            backend="cpp",
        )
        assert out.num_accepted.tolist() == [0] and 0 <= int(out.tokens[0, 0]) < 10
    finally:
        dspec.config.validate_values = True


def test_auto_on_cpu_picks_cpp_for_verify():
    from dspec.ops import verify as ops_verify

    expected = "cpp" if _backend.cpp_available() else "torch"
    assert _backend.resolve("verify_chain", None, torch.device("cpu"), ops_verify.PROVIDED) == expected


# --------------------------------------------------------------------- launcher validation
def _chain_kwargs(batch=3, length=4, vocab=11, temperature=1.0):
    logits = torch.randn(batch * (length + 1), vocab)
    drafts = torch.randint(0, vocab, (batch, length))
    ndraft = torch.full((batch,), length, dtype=torch.int64)
    q = torch.softmax(torch.randn(batch, length, vocab), -1)
    coins, uniforms = torch.rand(batch, length), torch.rand(batch)
    num = torch.full((batch,), -7, dtype=torch.int64)
    tokens = torch.full((batch, length + 1), -7, dtype=torch.int64)
    ws = torch.empty(_C.verify_chain_workspace_bytes(batch, length, vocab, 0, temperature > 0), dtype=torch.uint8)
    keep = (logits, drafts, ndraft, q, coins, uniforms, ws)
    kwargs = dict(
        logits_ptr=logits.data_ptr(),
        dtype=0,
        batch=batch,
        length=length,
        vocab=vocab,
        row_stride=vocab,
        drafts_ptr=drafts.data_ptr(),
        draft_dtype=1,
        num_drafts_ptr=ndraft.data_ptr(),
        q_ptr=q.data_ptr(),
        q_dtype=0,
        q_stride_b=q.stride(0),
        q_stride_l=q.stride(1),
        coins_ptr=coins.data_ptr(),
        uniforms_ptr=uniforms.data_ptr(),
        temperature=temperature,
        num_accepted_ptr=num.data_ptr(),
        tokens_ptr=tokens.data_ptr(),
        device="cpu",
        stream=0,
        ts_splits=1,
        draw_splits=1,
        workspace_ptr=ws.data_ptr(),
        workspace_bytes=ws.numel(),
    )
    return kwargs, (num, tokens), keep


CHAIN_BAD = [
    ("logits_ptr", dict(logits_ptr=0)),
    ("logits_ptr", dict(logits_ptr="+2")),
    ("dtype", dict(dtype=3)),
    ("batch", dict(batch=-1)),
    ("length", dict(length=-1)),
    ("vocab", dict(vocab=0)),
    ("vocab", dict(vocab=1 << 31, row_stride=1 << 31)),
    ("row_stride", dict(row_stride=5)),
    ("row_stride", dict(row_stride=-1)),
    ("drafts_ptr", dict(drafts_ptr=0)),
    ("drafts_ptr", dict(drafts_ptr="+4")),
    ("draft_dtype", dict(draft_dtype=2)),
    ("num_drafts_ptr", dict(num_drafts_ptr="+4")),
    ("q_dtype", dict(q_dtype=5)),
    ("q_ptr", dict(q_ptr="+2")),
    ("q_stride", dict(q_stride_b=-1)),
    ("q strides", dict(q_stride_b=1 << 62)),
    ("coins_ptr", dict(coins_ptr=0)),
    ("uniforms_ptr", dict(uniforms_ptr=0)),
    ("uniforms_ptr", dict(uniforms_ptr="+2")),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=1e-300)),
    ("num_accepted_ptr", dict(num_accepted_ptr=0)),
    ("tokens_ptr", dict(tokens_ptr=0)),
    ("tokens_ptr", dict(tokens_ptr="+4")),
    ("workspace_ptr", dict(workspace_ptr=0)),
    ("workspace_ptr", dict(workspace_ptr="+8")),
    ("workspace_bytes", dict(workspace_bytes=16)),
    ("ts_splits", dict(ts_splits=0)),
    ("draw_splits", dict(draw_splits=0)),
    ("device", dict(device="gpu")),
]


def _apply(kwargs, bad):
    for key, value in bad.items():  # "+k": the valid pointer moved by k bytes (misaligned)
        kwargs[key] = kwargs[key] + int(value[1:]) if isinstance(value, str) and value[:1] == "+" else value
    return kwargs


@needs_ext
@pytest.mark.parametrize("name,bad", CHAIN_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CHAIN_BAD)])
def test_verify_chain_bad_arguments_raise_before_any_write(name, bad):
    kwargs, outs, _keep = _chain_kwargs()
    with pytest.raises(ValueError, match=name):
        _C.verify_chain(**_apply(dict(kwargs), bad))
    assert all(bool((t == -7).all()) for t in outs)
    _C.verify_chain(**kwargs)  # the valid call works
    assert not bool((outs[1] == -7).any())


@needs_ext
def test_verify_chain_greedy_needs_no_randomness_nor_q():
    kwargs, outs, _keep = _chain_kwargs(temperature=0.0)
    kwargs.update(coins_ptr=0, uniforms_ptr=0, q_ptr=0, num_drafts_ptr=0)
    _C.verify_chain(**kwargs)
    assert not bool((outs[1] == -7).any())
    kwargs, outs, _keep = _chain_kwargs(temperature=-math.inf)  # -inf is greedy too
    _C.verify_chain(**kwargs)
    # batch 0: nothing is read, null pointers are fine
    _C.verify_chain(0, 0, 0, 4, 11, 11, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, "cpu")


def _tree_kwargs(batch=3, nodes=5, vocab=11, temperature=1.0):
    logits = torch.randn(batch * nodes, vocab)
    tokens = torch.randint(0, vocab, (batch, nodes))
    parents = torch.tensor([-1, 0, 0, 1, 1]).expand(batch, -1).contiguous()
    coins, uniforms = torch.rand(batch, nodes), torch.rand(batch)
    num = torch.full((batch,), -7, dtype=torch.int64)
    path = torch.full((batch, nodes), -7, dtype=torch.int64)
    out = torch.full((batch, nodes), -7, dtype=torch.int64)
    ws = torch.empty(_C.verify_tree_workspace_bytes(batch, nodes, vocab, 0, temperature > 0), dtype=torch.uint8)
    keep = (logits, tokens, parents, coins, uniforms, ws)
    kwargs = dict(
        logits_ptr=logits.data_ptr(),
        dtype=0,
        batch=batch,
        nodes=nodes,
        vocab=vocab,
        row_stride=vocab,
        tokens_ptr=tokens.data_ptr(),
        token_dtype=1,
        parents_ptr=parents.data_ptr(),
        parent_dtype=1,
        coins_ptr=coins.data_ptr(),
        uniforms_ptr=uniforms.data_ptr(),
        temperature=temperature,
        num_accepted_ptr=num.data_ptr(),
        path_ptr=path.data_ptr(),
        out_ptr=out.data_ptr(),
        device="cpu",
        stream=0,
        ts_splits=1,
        draw_splits=1,
        workspace_ptr=ws.data_ptr(),
        workspace_bytes=ws.numel(),
    )
    return kwargs, (num, path, out), keep


TREE_BAD = [
    ("logits_ptr", dict(logits_ptr=0)),
    ("nodes", dict(nodes=0)),
    ("vocab", dict(vocab=0)),
    ("row_stride", dict(row_stride=3)),
    ("tokens_ptr", dict(tokens_ptr=0)),
    ("token_dtype", dict(token_dtype=7)),
    ("parents_ptr", dict(parents_ptr=0)),
    ("parents_ptr", dict(parents_ptr="+4")),
    ("parent_dtype", dict(parent_dtype=-1)),
    ("coins_ptr", dict(coins_ptr=0)),
    ("uniforms_ptr", dict(uniforms_ptr=0)),
    ("num_accepted_ptr", dict(num_accepted_ptr=0)),
    ("path_ptr", dict(path_ptr=0)),
    ("out_ptr", dict(out_ptr="+4")),
    ("workspace_bytes", dict(workspace_bytes=0)),
    ("temperature", dict(temperature=math.nan)),
    ("device", dict(device="")),
]


@needs_ext
@pytest.mark.parametrize("name,bad", TREE_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TREE_BAD)])
def test_verify_tree_bad_arguments_raise_before_any_write(name, bad):
    kwargs, outs, _keep = _tree_kwargs()
    with pytest.raises(ValueError, match=name):
        _C.verify_tree(**_apply(dict(kwargs), bad))
    assert all(bool((t == -7).all()) for t in outs)
    _C.verify_tree(**kwargs)
    assert not bool((outs[2] == -7).any())


@needs_ext
def test_workspace_queries():
    assert _C.verify_draw_tile(0) == 1024 and _C.verify_draw_tile(1) == _C.verify_draw_tile(2) == 2048
    greedy = _C.verify_chain_workspace_bytes(4, 3, 1000, 0, False)
    sampling = _C.verify_chain_workspace_bytes(4, 3, 1000, 0, True)
    assert 0 < greedy < sampling
    assert _C.verify_chain_workspace_bytes(4, 3, 1000, 0, True, 8) > sampling  # token_stats partials
    assert _C.verify_tree_workspace_bytes(4, 9, 1000, 2, True) > 0
    for call, match in [
        (lambda: _C.verify_chain_workspace_bytes(-1, 3, 10, 0, True), "batch"),
        (lambda: _C.verify_chain_workspace_bytes(1, -1, 10, 0, True), "length"),
        (lambda: _C.verify_chain_workspace_bytes(1, 3, 0, 0, True), "vocab"),
        (lambda: _C.verify_chain_workspace_bytes(1, 3, 10, 9, True), "dtype"),
        (lambda: _C.verify_chain_workspace_bytes(1, 3, 10, 0, True, 0), "ts_splits"),
        (lambda: _C.verify_tree_workspace_bytes(1, 0, 10, 0, True), "nodes"),
        (lambda: _C.verify_tree_workspace_bytes(1 << 40, 1 << 20, 10, 0, True), "too large|overflow"),
        (lambda: _C.verify_draw_tile(4), "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


@needs_ext
@pytest.mark.skipif(_C is not None and _C.with_cuda, reason="built with CUDA")
def test_cuda_device_without_cuda_build():
    kwargs, _outs, _keep = _chain_kwargs()
    kwargs["device"] = "cuda"
    with pytest.raises(ValueError, match="built without CUDA"):
        _C.verify_chain(**kwargs)


# ----------------------------------------------------- CUDA kernels in the host simulator
SIM_DIR = ROOT / "tests" / "cuda_sim"
_sim_supported = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    """csrc/verify.cu and csrc/token_stats.cu (kernels and launchers: all four stages)
    built for the host simulator, via ctypes."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not _sim_supported or cxx is None:
        pytest.skip("the CUDA simulator needs Linux (x86-64 / aarch64) and a C++17 compiler")
    lib_path = tmp_path_factory.mktemp("cuda_sim") / "libverify_sim.so"
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-U_FORTIFY_SOURCE",
        "-w",
        "-fPIC",
        "-shared",
        "-pthread",
        "-ffp-contract=off",
        f"-I{ROOT / 'csrc'}",
        f"-I{SIM_DIR}",
        str(SIM_DIR / "verify_sim.cpp"),
        "-o",
        str(lib_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    i64, vp, i, d = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.dspec_sim_workspace_bytes.restype = i64
    lib.dspec_sim_workspace_bytes.argtypes = [i64, i64, i64, i, i64, i, i64]
    lib.dspec_sim_verify_chain.argtypes = [
        vp,
        i,
        i64,
        i64,
        i64,
        i64,
        vp,
        i,
        vp,
        vp,
        i,
        i64,
        i64,
        vp,
        vp,
        d,
        vp,
        vp,
        i64,
        i64,
        vp,
        ctypes.c_char_p,
        i,
    ]
    lib.dspec_sim_verify_tree.argtypes = [
        vp,
        i,
        i64,
        i64,
        i64,
        i64,
        vp,
        i,
        vp,
        i,
        vp,
        vp,
        d,
        vp,
        vp,
        vp,
        i64,
        i64,
        vp,
        ctypes.c_char_p,
        i,
    ]
    return lib


def _rows(logits):
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def sim_chain(lib, drafts, logits, q, n, temperature, coins, u, *, ts_splits=1, draw_splits=1, rows=None):
    batch, length = drafts.shape
    x = _rows(logits) if rows is None else rows
    vocab = x.shape[-1]
    num = torch.full((batch,), -9, dtype=torch.int64)
    out = torch.full((batch, length + 1), -9, dtype=torch.int64)
    sampling = temperature > 0
    ws = torch.empty(
        lib.dspec_sim_workspace_bytes(batch, length + 1, vocab, FLOAT_CODE[x.dtype], 1, int(sampling), ts_splits) + 16,
        dtype=torch.uint8,
    )
    err = ctypes.create_string_buffer(512)
    nd = None if n is None else n.long().contiguous()
    drafts = drafts.contiguous()
    rc = lib.dspec_sim_verify_chain(
        _ptr(x),
        FLOAT_CODE[x.dtype],
        batch,
        length,
        vocab,
        x.stride(0),
        _ptr(drafts),
        ID_CODE[drafts.dtype],
        _ptr(nd),
        _ptr(q),
        FLOAT_CODE[q.dtype] if q is not None else 0,
        q.stride(0) if q is not None else 0,
        q.stride(1) if q is not None else 0,
        _ptr(coins) if sampling else None,
        _ptr(u) if sampling else None,
        float(temperature),
        _ptr(num),
        _ptr(out),
        ts_splits,
        draw_splits,
        _ptr(ws),
        err,
        512,
    )
    assert rc == 0, err.value.decode()
    return dspec.VerifyOutput(num, out)


def sim_tree(lib, tokens, parents, logits, temperature, coins, u, *, ts_splits=1, draw_splits=1):
    batch, nodes = tokens.shape
    x = _rows(logits)
    vocab = x.shape[-1]
    num = torch.full((batch,), -9, dtype=torch.int64)
    path = torch.full((batch, nodes), -9, dtype=torch.int64)
    out = torch.full((batch, nodes), -9, dtype=torch.int64)
    sampling = temperature > 0
    ws = torch.empty(
        lib.dspec_sim_workspace_bytes(batch, nodes, vocab, FLOAT_CODE[x.dtype], nodes, int(sampling), ts_splits) + 16,
        dtype=torch.uint8,
    )
    err = ctypes.create_string_buffer(512)
    tokens, parents = tokens.contiguous(), parents.contiguous()
    rc = lib.dspec_sim_verify_tree(
        _ptr(x),
        FLOAT_CODE[x.dtype],
        batch,
        nodes,
        vocab,
        x.stride(0),
        _ptr(tokens),
        ID_CODE[tokens.dtype],
        _ptr(parents),
        ID_CODE[parents.dtype],
        _ptr(coins) if sampling else None,
        _ptr(u) if sampling else None,
        float(temperature),
        _ptr(num),
        _ptr(path),
        _ptr(out),
        ts_splits,
        draw_splits,
        _ptr(ws),
        err,
        512,
    )
    assert rc == 0, err.value.decode()
    return dspec.TreeVerifyOutput(num, path, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("batch,length,vocab", [(1, 1, 1), (7, 5, 300), (3, 4, 5000), (2, 40, 70)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("with_q", [False, True])
def test_sim_chain_matches_reference(sim, dtype, batch, length, vocab, temperature, with_q):
    if with_q and temperature <= 0:
        pytest.skip("draft_probs only matter when sampling")
    logits, drafts, q, n, coins, u = chain_case(batch, length, vocab, dtype, batch * length + vocab, with_q=with_q)
    exp = reference.verify_chain(
        drafts, logits, draft_probs=q, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
    )
    # one split, and several splits of token_stats and of the draw tiles
    for ts_splits, draw_splits in ((1, 1), (3, 4)):
        same(
            sim_chain(
                sim, drafts.int(), logits, q, n, temperature, coins, u, ts_splits=ts_splits, draw_splits=draw_splits
            ),
            exp,
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_sim_chain_misaligned_rows(sim, dtype, offset):
    """Rows off a 16-byte boundary (scalar loads), a vocabulary not a multiple of the vector,
    draft_probs in another dtype with odd strides."""
    logits, drafts, q, n, coins, u = chain_case(4, 3, 2053, dtype, 7 + offset, with_q=True)
    wide = torch.zeros(4 * 4, 2053 + 5, dtype=dtype)
    wide[:, offset : offset + 2053] = logits.reshape(-1, 2053)
    rows = wide[:, offset : offset + 2053]
    q_wide = torch.zeros(4, 3, 2053 + 1, dtype=torch.float16)
    q_wide[..., 1:] = q.half()
    qv = q_wide[..., 1:]
    for temperature in (0.0, 0.9):
        for dq in (None, qv):
            exp = reference.verify_chain(
                drafts, logits, draft_probs=dq, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
            )
            same(sim_chain(sim, drafts, logits, dq, n, temperature, coins, u, rows=rows, draw_splits=2), exp)


@pytest.mark.parametrize("batch,nodes,vocab", [(1, 1, 5), (7, 9, 300), (7, 33, 50), (3, 12, 5000), (2, 70, 40)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_sim_tree_matches_reference(sim, batch, nodes, vocab, temperature):
    tokens, parents, logits, coins, u = random_tree(batch, nodes, vocab, nodes * vocab)
    exp = reference.verify_tree(tokens, parents, logits, temperature=temperature, coins=coins, sample_uniforms=u)
    same(sim_tree(sim, tokens, parents.int(), logits, temperature, coins, u, ts_splits=2, draw_splits=3), exp)


@pytest.mark.parametrize("distinct", [True, False])
def test_sim_tree_many_rejected_siblings(sim, distinct):
    """More excluded tokens than the kernels cache in shared memory (64)."""
    tokens, parents, logits, coins, u = wide_root_tree(3, 100, 400, 1, distinct=distinct)
    exp = reference.verify_tree(tokens, parents, logits, temperature=1.0, coins=coins, sample_uniforms=u)
    same(sim_tree(sim, tokens, parents, logits, 1.0, coins, u), exp)


def test_sim_invalid_rows_and_nan_q(sim):
    logits, drafts, q, _, coins, u = chain_case(3, 4, 30, torch.float32, 1, with_q=True)
    drafts[:] = logits.argmax(-1)[:, :4]
    logits[0, 1, 3] = float("nan")
    logits[1, 1, 5] = float("inf")
    logits[2, 1] = float("-inf")
    for t in (0.0, 1.0):
        out = sim_chain(sim, drafts, logits, None, None, t, torch.zeros_like(coins), u)
        assert out.num_accepted.tolist() == [1, 1, 1] and out.tokens[:, 1].tolist() == [-1, -1, -1]
    logits, drafts, q, _, coins, u = chain_case(4, 3, 50, torch.float32, 2, with_q=True)
    q[:, 0, :] = float("nan")
    out = sim_chain(sim, drafts, logits, q, None, 1.0, coins, u)
    assert out.tokens[:, 0].tolist() == [-1] * 4


@needs_ext
def test_sim_agrees_with_cpp(sim):
    """The kernels (float32 tree sums) and the C++ code (double sums) share the element math;
    their integer results agree on a larger random set (tolerating rare rounding ties)."""
    logits, drafts, q, n, coins, u = chain_case(64, 4, 3000, torch.bfloat16, 21, with_q=True)
    for qq in (None, q):
        a = sim_chain(sim, drafts, logits, qq, n, 0.7, coins, u, draw_splits=2)
        b = dspec.verify_chain(
            drafts, logits, draft_probs=qq, num_drafts=n, temperature=0.7, coins=coins, sample_uniforms=u, backend="cpp"
        )
        assert torch.equal(a.num_accepted, b.num_accepted)
        assert int((a.tokens != b.tokens).any(-1).sum()) <= 1
    tokens, parents, tlogits, tcoins, tu = random_tree(64, 12, 2000, 5)
    a = sim_tree(sim, tokens, parents, tlogits, 0.7, tcoins, tu)
    b = dspec.verify_tree(tokens, parents, tlogits, temperature=0.7, coins=tcoins, sample_uniforms=tu, backend="cpp")
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.path, b.path)
    assert int((a.tokens != b.tokens).any(-1).sum()) <= 1


# ------------------------------------------------------- the real CUDA kernels (GPU only)
def close(out, exp, *, max_rows=1):
    """Acceptance exact; a final draw may differ in a rare rounding tie (float32 tree sums over
    a large vocabulary vs the reference's sums): at most max_rows rows, and only there."""
    assert torch.equal(out.num_accepted.cpu(), exp.num_accepted)
    if hasattr(exp, "path"):
        assert torch.equal(out.path.cpu(), exp.path)
    rows = (out.tokens.cpu() != exp.tokens).any(-1)
    assert int(rows.sum()) <= max_rows, (out.tokens.cpu()[rows], exp.tokens[rows])
    final = exp.num_accepted[:, None] == torch.arange(exp.tokens.shape[1])[None, :]
    assert torch.equal(out.tokens.cpu()[~final], exp.tokens[~final])


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _backend.cuda_available()), reason="needs dspec._C built with CUDA and a GPU"
)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("batch,length,vocab", [(3, 4, 5000), (2, 3, 151936), (64, 16, 32000), (5, 40, 70)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_cuda_chain_several_tiles_and_splits(dtype, batch, length, vocab, temperature):
    logits, drafts, q, n, coins, u = chain_case(batch, length, vocab, dtype, batch + vocab, with_q=True)
    for qq in (None, q) if temperature > 0 else (None,):
        exp = reference.verify_chain(
            drafts, logits, draft_probs=qq, num_drafts=n, temperature=temperature, coins=coins, sample_uniforms=u
        )
        dev = lambda t: None if t is None else t.cuda()
        out = dspec.verify_chain(
            dev(drafts),
            dev(logits),
            draft_probs=dev(qq),
            num_drafts=dev(n),
            temperature=temperature,
            coins=dev(coins),
            sample_uniforms=dev(u),
            backend="cuda",
        )
        close(out, exp)


@needs_cuda
@pytest.mark.parametrize("batch,nodes,vocab", [(7, 9, 5000), (3, 70, 20000), (2, 100, 400)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_tree_several_tiles(batch, nodes, vocab, temperature):
    if nodes == 100:
        tokens, parents, logits, coins, u = wide_root_tree(batch, nodes, vocab, 2)
    else:
        tokens, parents, logits, coins, u = random_tree(batch, nodes, vocab, nodes + vocab)
    exp = reference.verify_tree(tokens, parents, logits, temperature=temperature, coins=coins, sample_uniforms=u)
    out = dspec.verify_tree(
        tokens.cuda(),
        parents.int().cuda(),
        logits.cuda(),
        temperature=temperature,
        coins=coins.cuda(),
        sample_uniforms=u.cuda(),
        backend="cuda",
    )
    close(out, exp)


@needs_cuda
def test_cuda_graph_capture():
    """No host sync and no allocation inside the launch: it can be captured and replayed."""
    logits, drafts, q, n, coins, u = chain_case(8, 4, 5000, torch.float32, 3, with_q=True)
    args = [t.cuda() for t in (drafts, logits, q, n, coins, u)]
    dspec.config.validate_values = False
    try:
        run = lambda: dspec.verify_chain(
            args[0],
            args[1],
            draft_probs=args[2],
            num_drafts=args[3],
            temperature=1.0,
            coins=args[4],
            sample_uniforms=args[5],
            backend="cuda",
        )
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        dspec.config.validate_values = True
    close(
        out,
        reference.verify_chain(
            drafts, logits, draft_probs=q, num_drafts=n, temperature=1.0, coins=coins, sample_uniforms=u
        ),
    )
