"""The CUDA kernels of csrc/token_stats.cu (token_stats_kernel, token_stats_merge_kernel and
the launcher token_stats_cuda, one or several vocabulary splits) and csrc/merge_states.cu
(merge_states_kernel, merge_states_cuda) run without a GPU by the host simulator of
tests/cuda_sim (cuda_sim.h: a fiber per CUDA thread, barriers for __syncthreads and the warp
shuffles), against the torch references of dspec/reference.  verify.cu (whose stage 1 is
token_stats.cu) runs in the simulator in test_verify_ext.py, pack_mask.cu / tree_mask.cu in
test_pack_mask.py / test_tree_mask.py.

Tolerances, as the tests of the cuda backend state them (test_token_stats.py,
test_cascade_attention.py): integer outputs (token) exactly; floats relative to float32
arithmetic (the kernels sum in float32 trees, the reference in torch's float32 sums, and
expf / logf are glibc's here, CUDA's on a GPU).  token_stats takes no greedy mode (the
temperature is positive; verify's greedy calls it with temperature 1, covered here).
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspec.reference.attention import merge_states as merge_reference
from dspec.reference.token_stats import token_stats as ts_reference
from dspec.types import TokenStats

ROOT = Path(__file__).resolve().parents[1]
SIM_DIR = ROOT / "tests" / "cuda_sim"
FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
TILE = 4096  # kTokenStatsTile (csrc/dspec.h): a split covers whole tiles
TS_ATOL, TS_RTOL = 1e-6, 1e-4  # token_stats floats (float32 sums over V terms)
# merge_states output: float32 math, then one rounding to the output dtype
MS_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="session")
def kernels_sim(tmp_path_factory):
    """csrc/token_stats.cu and csrc/merge_states.cu built for the host simulator, via ctypes."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")) or cxx is None:
        pytest.skip("the CUDA simulator needs Linux (x86-64 / aarch64) and a C++17 compiler")
    lib_path = tmp_path_factory.mktemp("kernels_sim") / "libkernels_sim.so"
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
        str(SIM_DIR / "token_stats_sim.cpp"),
        str(SIM_DIR / "merge_states_sim.cpp"),
        "-o",
        str(lib_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    i64, vp, i, s = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    lib.dspec_sim_token_stats_workspace_bytes.restype = i64
    lib.dspec_sim_token_stats_workspace_bytes.argtypes = [i64, i64]
    lib.dspec_sim_token_stats.argtypes = [vp, i, i64, i64, i64, ctypes.c_float, vp, vp, vp, vp, vp, i64, vp, s, i]
    lib.dspec_sim_merge_states.argtypes = [vp, vp, vp, vp, vp, vp, i, i64, i64, s, i]
    return lib


# --------------------------------------------------------------------------- token_stats
def sim_token_stats(lib, x: torch.Tensor, temperature: float = 1.0, splits: int = 1) -> TokenStats:
    """x [rows, V], unit stride along V, any row stride and element-aligned start."""
    rows, vocab = x.shape
    assert x.stride(1) == 1 or vocab == 1
    token = torch.full((rows,), -9, dtype=torch.int64)
    floats = [torch.full((rows,), 12345.0) for _ in range(4)]
    # a workspace of garbage: every partial state must be written before it is read
    ws = torch.full((max(16, lib.dspec_sim_token_stats_workspace_bytes(rows, splits)),), 0xAB, dtype=torch.uint8)
    err = ctypes.create_string_buffer(512)
    rc = lib.dspec_sim_token_stats(
        x.data_ptr(),
        FLOAT_CODE[x.dtype],
        rows,
        vocab,
        x.stride(0),
        1.0 / temperature,
        token.data_ptr(),
        *(f.data_ptr() for f in floats),
        splits,
        ws.data_ptr(),
        err,
        512,
    )
    assert rc == 0, err.value.decode()
    return TokenStats(token, *floats)


def check_ts(out: TokenStats, x: torch.Tensor, temperature: float, what: str = ""):
    exp = ts_reference(x, temperature)
    assert torch.equal(out.token, exp.token), (what, out.token.tolist(), exp.token.tolist())
    for name in ("prob", "margin", "entropy", "lse"):
        a, e = getattr(out, name), getattr(exp, name)
        ok = torch.isclose(a, e, rtol=TS_RTOL, atol=TS_ATOL, equal_nan=True)
        assert bool(ok.all()), (what, name, (~ok).nonzero().flatten().tolist(), a[~ok].tolist(), e[~ok].tolist())


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows 0..7 (when there are 8) overwritten with the contract's hard cases."""
    rows, vocab = x.shape
    x = x.clone()
    if rows >= 8:
        x[0, vocab // 2] = float("nan")  # invalid: lse NaN
        x[1] = float("-inf")  # invalid: lse -inf
        x[2] = 0.5  # all equal: token 0, margin 0
        x[3, ::2] = float("-inf")  # valid with -inf entries
        x[4, -1] = float("inf")  # invalid: lse +inf
        x[5, 1] = x[5, -1] = x[5].max() + 1  # exact tie for the max: the lower id
        x[6] = float("-inf")  # one finite entry, the last: prob 1, entropy 0
        x[6, -1] = -3.0
        x[7, 0], x[7, -1] = float("inf"), float("nan")  # NaN and +inf: lse NaN
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (2, 7), (8, 1001), (8, 4999), (3, 9001)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1e-4, 1e4])
def test_token_stats_matches_reference(kernels_sim, dtype, rows, vocab, temperature):
    """One split, and three (some empty when V has fewer tiles; 9001 columns cross tiles)."""
    g = torch.Generator().manual_seed(rows * 10007 + vocab)
    x = special_rows(torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    for splits in (1, 3):
        check_ts(sim_token_stats(kernels_sim, x, temperature, splits), x, temperature, f"splits={splits}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_token_stats_tiles_and_splits(kernels_sim, dtype):
    """A vocabulary of several tiles: the unrolled vector loop, split boundaries mid-row,
    more splits than tiles (empty splits merge as identities)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 5 * TILE + 123, generator=g) * 3).to(dtype)
    for splits in (1, 2, 4, 7):
        check_ts(sim_token_stats(kernels_sim, x, 0.8, splits), x, 0.8, f"splits={splits}")


def test_token_stats_merge_kernel_rows_and_many_splits(kernels_sim):
    """The split merge kernel: more rows than warps per block (a partial last block) and
    more splits than lanes (lanes 0..7 fold two partial states each: 35 one-tile splits,
    the last partial, then 5 empty ones)."""
    g = torch.Generator().manual_seed(11)
    x = special_rows(torch.randn(9, 35 * TILE - 5, generator=g) * 2).to(torch.bfloat16)
    x[8, 34 * TILE + 7] = 30.0  # the max in split 34 (lane 2's second state)
    out = sim_token_stats(kernels_sim, x, 1.0, 40)
    assert out.token[8].item() == 34 * TILE + 7
    check_ts(out, x, 1.0, "splits=40")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_token_stats_misaligned_rows_and_strides(kernels_sim, dtype, offset):
    """Rows off a 16-byte boundary (scalar head, vectors, scalar tail), a row stride that
    moves the alignment from row to row, and NaN padding between rows: a read outside a
    row would make it invalid."""
    g = torch.Generator().manual_seed(offset)
    for vocab, splits in ((1003, 1), (2 * TILE + 9, 2)):
        wide = torch.full((5, vocab + 7), float("nan"), dtype=dtype)
        wide[:, offset : offset + vocab] = (torch.randn(5, vocab, generator=g) * 3).to(dtype)
        x = wide[:, offset : offset + vocab]
        check_ts(sim_token_stats(kernels_sim, x, 0.9, splits), x, 0.9, f"vocab={vocab}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_token_stats_ties_across_threads_vectors_and_splits(kernels_sim, dtype):
    """Exact ties for the max in different threads, vectors, tiles and splits: the lowest
    column wins and the margin is exactly 0."""
    vocab = 2 * TILE + 11
    tie_sets = [
        [4095, 4096],
        [vocab - 2, vocab - 1],
        [3, 5000, 8000],
        [TILE + 1, 9, 2 * TILE + 3],
        [0, vocab - 1],
        [513 * 8, 8, 4 * 8],
    ]
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(len(tie_sets), vocab, generator=g).clamp(-4, 4)).to(dtype)
    for r, cols in enumerate(tie_sets):
        x[r, cols] = 10.0
    for splits in (1, 2, 3):
        out = sim_token_stats(kernels_sim, x, 1.0, splits)
        assert out.token.tolist() == [min(c) for c in tie_sets]
        assert bool((out.margin == 0).all())
        check_ts(out, x, 1.0, f"splits={splits}")


def test_token_stats_extreme_magnitudes(kernels_sim):
    """(x - max) / T overflowing to -inf must not turn the entropy into NaN."""
    x = torch.tensor([[3e38, -3e38, 0.0, 1e38], [1.0, 2.0, 3.0, -1e30]])
    for t in (1.0, 1e-30, 1e30):
        for splits in (1, 2):
            check_ts(sim_token_stats(kernels_sim, x, t, splits), x, t, f"T={t}")


# -------------------------------------------------------------------------- merge_states
def sim_merge_states(lib, o_a, lse_a, o_b, lse_b):
    """o_* [rows, D] contiguous, lse_* [rows] float32; checks nothing past the outputs is written."""
    rows, dim = o_a.shape
    guard = 37
    out = torch.full((rows * dim + guard,), 7.0).to(o_a.dtype)
    lse = torch.full((rows + guard,), 7.0)
    err = ctypes.create_string_buffer(512)
    rc = lib.dspec_sim_merge_states(
        o_a.data_ptr(),
        lse_a.data_ptr(),
        o_b.data_ptr(),
        lse_b.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        FLOAT_CODE[o_a.dtype],
        rows,
        dim,
        err,
        512,
    )
    assert rc == 0, err.value.decode()
    assert bool((out[rows * dim :] == 7).all()) and bool((lse[rows:] == 7).all())
    return out[: rows * dim].reshape(rows, dim), lse[:rows]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,dim", [(1, 1), (2, 2), (8, 5), (50, 33), (3, 128), (300, 7)])
def test_merge_states_matches_reference(kernels_sim, dtype, rows, dim):
    """Head dims not a multiple of the 4-element chunk, one and several blocks (the last one
    partial), empty states (-inf), NaN and +inf lse, one weight underflowing to 0."""
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    o_a = torch.randn(rows, dim, generator=g).to(dtype)
    o_b = torch.randn(rows, dim, generator=g).to(dtype)
    l_a = torch.randn(rows, generator=g) * 3
    l_b = torch.randn(rows, generator=g) * 3
    if rows >= 8:
        l_a[0] = l_b[0] = float("-inf")  # two empty states: o = 0, lse = -inf
        l_a[1] = float("-inf")  # one empty state: the other passes through
        l_b[2] = float("-inf")
        l_a[3] = float("nan")  # NaN propagates (as torch.maximum)
        l_b[4] = l_a[4] + 200.0  # e^{-200}: wa underflows to 0
        l_b[5] = l_a[5]  # equal weights
        l_b[6] = float("inf")  # +inf: NaN, as the reference
        l_a[7] = l_b[7] = 80.0  # large lse: the shift by the max keeps it finite
    o, lse = sim_merge_states(kernels_sim, o_a, l_a, o_b, l_b)
    exp_o, exp_lse = merge_reference(o_a, l_a, o_b, l_b)
    assert o.dtype == exp_o.dtype
    tol = MS_TOL[dtype]
    torch.testing.assert_close(o.float(), exp_o.float(), atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(lse, exp_lse, atol=1e-6, rtol=1e-6, equal_nan=True)
    if rows >= 8:
        assert bool((o[0] == 0).all()) and lse[0].item() == float("-inf")
        assert torch.equal(o[1], o_b[1]) and torch.equal(o[2], o_a[2]) and torch.equal(lse[1], l_b[1])
        assert torch.equal(o[4], o_b[4])
        assert bool(o[3].isnan().all()) and lse[3].isnan() and bool(o[6].isnan().all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_token_stats_group_fast_path_cases(kernels_sim, dtype):
    """The kernel folds each 16-byte vector as one group (its max first, the column and the
    runner-up only when the group beats the running max): the runner-up inside the winning
    group, a tie inside one group, a later group equal to the max, two +inf (lse +inf, not
    NaN), a NaN after the max is set, a NaN in an all -inf prefix, and -inf groups between
    finite ones."""
    vocab = TILE + 77
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, vocab, generator=g).clamp(-4, 4)).to(dtype)
    x[0, 16:24] = torch.tensor([1.0, 9.0, 2.0, 8.5, 0.0, 3.0, 1.0, 2.0])  # runner-up in the group
    x[1, 40:48] = torch.tensor([0.0, 9.0, 1.0, 9.0, 2.0, 0.0, 0.0, 0.0])  # tie inside one group
    x[2, 8] = 9.0
    x[2, 3000] = 9.0  # equal, later group
    x[3, 5] = float("inf")
    x[3, 2000] = float("inf")  # two +inf
    x[4, 100] = 12.0
    x[4, 3001] = float("nan")  # NaN after the max
    x[5, :2048] = float("-inf")
    x[5, 700] = float("nan")  # NaN among -inf
    x[6, ::16] = float("-inf")
    x[6, 4:12] = float("-inf")  # -inf groups
    x[7] = float("-inf")
    x[7, 1234] = 1.0
    x[7, 4000] = 1.0  # two finite, tied
    for t in (1.0, 0.5):
        for splits in (1, 2):
            out = sim_token_stats(kernels_sim, x, t, splits)
            assert out.lse[3].item() == float("inf")
            check_ts(out, x, t, f"T={t} splits={splits}")
