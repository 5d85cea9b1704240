"""verify_tree with draft probabilities (``draft_probs`` / ``draft_sampling``), every backend.

1. exactness: every backend (torch, cpp, triton, the CUDA kernels in the host simulator of
   tests/cuda_sim) equals a plain float64 loop over rows and nodes of the documented rules,
   with given coins and uniforms.  The coins and uniforms are kept 1e-5 (relative) away from
   every comparison and draw boundary the float64 walk meets, so float32 rounding cannot flip
   an outcome and the integer outputs are compared exactly.
2. losslessness per scheme: children drawn by the scheme from q in the test, 200k rounds in
   one vectorised call, the joint law of the first two emitted tokens against the target's
   law (6 sigma per cell).
3. broken variants of the rule (a vectorised float64 walk with one mistake each) fail that
   test.
4. the expected accepted length with q is at least that of the same trees verified one-hot.
5. bad input raises ValueError naming the argument.
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

import dspec
from conftest import backends_for
from dspec import _backend, _validate
from dspec.reference import verify as reference

ROOT = Path(__file__).resolve().parents[1]
SIM_DIR = ROOT / "tests" / "cuda_sim"
SCHEMES = ("independent", "without_replacement")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_CODE = {torch.int32: 0, torch.int64: 1}
SLACK = 1e-5
BACKENDS = [b for _, b in backends_for("cpu")] + ["sim"]


# ------------------------------------------------------------------------------ inputs
def tree_case(batch, nodes, vocab, seed, shape="random"):
    """Trees with padding nodes, repeated siblings, deep chains or wide fans; q rows with
    zeros (some children hold a token q gives 0: skipped), children mostly drawn from their
    parent's q, target logits close to log q so that children are often accepted.
    "distinct": a fan of distinct tokens drawn without replacement from a peaked q_0 and a
    target farther from q (many rejections in a row)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        if shape == "chain":
            parents[:, i] = i - 1
        elif shape in ("fan", "distinct"):
            parents[:, i] = 0
        else:
            parents[:, i] = torch.randint(0, i, (batch,), generator=g)
    if shape == "random" and nodes > 3:
        parents[:, -1] = -1  # padding nodes
        parents[1::2, -2] = -1
        parents[:, 1:][parents[:, 1:] >= nodes - 2] = 0  # no child of a padding node
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=g) * 1.5, -1)
    if vocab > 2:
        zero = torch.rand(batch, nodes, vocab, generator=g) < 0.3
        zero[..., 0] = False
        q = q.masked_fill(zero, 0.0)
        q = q / q.sum(-1, keepdim=True)
    logits = torch.log(q + 1e-3) * 0.8 + torch.randn(batch, nodes, vocab, generator=g) * 0.7
    q_parent = q.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab))
    drawn = torch.multinomial(q_parent.reshape(-1, vocab), 1, generator=g).reshape(batch, nodes)
    any_id = torch.randint(0, vocab, (batch, nodes), generator=g)
    tokens = torch.where(torch.rand(batch, nodes, generator=g) < 0.85, drawn, any_id)
    if nodes > 4:
        same = parents[:, 3] == parents[:, 4]
        tokens[:, 4] = torch.where(same, tokens[:, 3], tokens[:, 4])  # repeated siblings
    if shape == "distinct":  # peaked q: removing a tried token changes q_cur a lot
        q = torch.softmax(torch.randn(batch, nodes, vocab, generator=g) * 3.0, -1)
        logits = torch.randn(batch, nodes, vocab, generator=g)
        tokens[:, 1:] = torch.multinomial(q[:, 0], nodes - 1, replacement=False, generator=g)
    tokens[:, 0] = 0
    coins = torch.rand(batch, nodes, generator=g)
    uniforms = torch.rand(batch, generator=g)
    return tokens, parents, logits, q, coins, uniforms


# ----------------------------------------------------------------- the float64 oracle
def _draw64(w, u):
    """(token, slack): the smallest v with cumsum(w)[v] > u * sum(w); slack: the distance of
    u * sum(w) to the nearest cumsum value, relative to the sum (inf when not drawn)."""
    total = float(w.sum())
    if not (total > 0 and total < float("inf")):
        return -1, float("inf")
    cs = torch.cumsum(w, 0)
    target = u * total
    above = (cs > target).nonzero()
    tok = int(above[0]) if len(above) else int((w > 0).nonzero()[-1])
    return tok, float((cs - target).abs().min()) / total


def oracle(tokens, parents, logits, q, scheme, temperature, coins, uniforms):
    """A plain float64 loop of verify_tree's rules.  Returns ((num, path, out), coin_slack
    [B, N], draw_slack [B]): how close each tested coin and the final uniform came to
    flipping an outcome (relative)."""
    batch, nodes = tokens.shape
    x = logits.double()
    e = torch.exp((x - x.amax(-1, keepdim=True)) / temperature)
    p_all = e / e.sum(-1, keepdim=True)
    qd = q.double()
    num = torch.zeros(batch, dtype=torch.int64)
    path = torch.full((batch, nodes), -1, dtype=torch.int64)
    out = torch.full((batch, nodes), -1, dtype=torch.int64)
    coin_slack = torch.full((batch, nodes), float("inf"), dtype=torch.float64)
    draw_slack = torch.full((batch,), float("inf"), dtype=torch.float64)
    for b in range(batch):
        node, depth = 0, 0
        r, q_cur = p_all[b, 0].clone(), qd[b, 0].clone()
        for c in range(1, nodes):
            if int(parents[b, c]) != node:
                continue
            t = int(tokens[b, c])
            q_x = float(q_cur[t])
            if q_x == 0:  # could not have been drawn
                continue
            lhs, rhs = float(coins[b, c]) * q_x, float(r[t])
            if lhs == lhs and rhs == rhs:
                coin_slack[b, c] = abs(lhs - rhs) / max(rhs, 1e-30)
            if lhs < rhs:
                path[b, depth], out[b, depth] = c, t
                depth, node = depth + 1, c
                r, q_cur = p_all[b, c].clone(), qd[b, c].clone()
                continue
            res = (r - q_cur).clamp(min=0)
            s = float(res.sum())
            r = res / s if s > 0 else (p_all[b, node].clone() if s == 0 else res)
            if scheme == "without_replacement":
                q_cur = q_cur.clone()
                q_cur[t] = 0
                sq = float(q_cur.sum())
                q_cur = q_cur / sq if sq > 0 else q_cur
        num[b] = depth
        out[b, depth], draw_slack[b] = _draw64(r, float(uniforms[b]))
    return (num, path, out), coin_slack, draw_slack


def safe_randomness(tokens, parents, logits, q, scheme, temperature, coins, uniforms, seed):
    """Coins and uniforms resampled until no tested coin and no final draw lies within
    SLACK (relative) of its boundary; returns them and the oracle's outputs."""
    g = torch.Generator().manual_seed(seed)
    coins, uniforms = coins.clone(), uniforms.clone()
    for _ in range(50):
        exp, cs, ds = oracle(tokens, parents, logits, q, scheme, temperature, coins, uniforms)
        bad_c, bad_d = cs < SLACK, ds < SLACK
        if not bool(bad_c.any()) and not bool(bad_d.any()):
            return coins, uniforms, exp
        coins = torch.where(bad_c, torch.rand(coins.shape, generator=g), coins)
        if not bool(bad_c.any()):
            uniforms = torch.where(bad_d, torch.rand(uniforms.shape, generator=g), uniforms)
    raise AssertionError("could not keep the randomness away from the boundaries")


# --------------------------------------------------------------------- CUDA simulator
@pytest.fixture(scope="module")
def sim():
    """csrc/verify.cu and csrc/token_stats.cu built for the host simulator, via ctypes."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")) or cxx is None:
        pytest.skip("the CUDA simulator needs Linux (x86-64 / aarch64) and a C++17 compiler")
    import tempfile

    lib_path = Path(tempfile.mkdtemp(prefix="verify_tree_q_sim")) / "libverify_sim.so"
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
    lib.dspec_sim_tree_q_workspace_bytes.restype = i64
    lib.dspec_sim_tree_q_workspace_bytes.argtypes = [i64, i64, i64, i, i, i64]
    lib.dspec_sim_verify_tree_q.argtypes = [
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
        i,
        i64,
        i64,
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


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def sim_tree_q(lib, tokens, parents, logits, q, scheme, temperature, coins, u, *, ts_splits=2, draw_splits=3):
    batch, nodes = tokens.shape
    x = logits.reshape(-1, logits.shape[-1]).contiguous()
    vocab = x.shape[-1]
    num = torch.full((batch,), -9, dtype=torch.int64)
    path = torch.full((batch, nodes), -9, dtype=torch.int64)
    out = torch.full((batch, nodes), -9, dtype=torch.int64)
    nbytes = lib.dspec_sim_tree_q_workspace_bytes(
        batch, nodes, vocab, FLOAT_CODE[x.dtype], int(q is not None), ts_splits
    )
    ws = torch.full((nbytes + 16,), 0xAB, dtype=torch.uint8)  # garbage: written before read
    err = ctypes.create_string_buffer(512)
    tokens, parents = tokens.contiguous(), parents.contiguous()
    rc = lib.dspec_sim_verify_tree_q(
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
        _ptr(q),
        FLOAT_CODE[q.dtype] if q is not None else 0,
        q.stride(0) if q is not None else 0,
        q.stride(1) if q is not None else 0,
        SCHEMES.index(scheme),
        _ptr(coins),
        _ptr(u),
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


def run_backend(backend, request, tokens, parents, logits, q, scheme, temperature, coins, u):
    if backend == "sim":
        return sim_tree_q(request.getfixturevalue("sim"), tokens, parents, logits, q, scheme, temperature, coins, u)
    return dspec.verify_tree(
        tokens,
        parents,
        logits,
        draft_probs=q,
        draft_sampling=scheme,
        temperature=temperature,
        coins=coins,
        sample_uniforms=u,
        backend=backend,
    )


def same(out, exp):
    for name, a, e in zip(("num_accepted", "path", "tokens"), out, exp):
        assert a.dtype == torch.int64, name
        assert torch.equal(a.cpu(), e.cpu()), f"{name}:\n{a}\n{e}"


# ---------------------------------------------------------------------------- 1. exact
CASES = [  # (batch, nodes, vocab, shape)
    (3, 6, 1, "random"),
    (6, 9, 7, "random"),
    (5, 12, 7, "fan"),
    (5, 10, 300, "random"),
    (4, 12, 300, "chain"),
    (4, 9, 5000, "random"),
    (3, 8, 5000, "fan"),
    (6, 40, 50, "random"),
    (2, 70, 40, "fan"),  # more nodes than a warp's 32 lanes
    (8, 9, 30, "distinct"),
    (4, 9, 300, "distinct"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_exact_against_float64_loop(request, backend, scheme, case):
    batch, nodes, vocab, shape = CASES[case]
    dtype, q_dtype = DTYPES[case % 3], DTYPES[(case + 1 + (scheme == SCHEMES[1])) % 3]
    ids = torch.int32 if case % 2 else torch.int64
    temperature = (1.0, 0.7, 1.6)[case % 3]
    tokens, parents, logits, q, coins, u = tree_case(batch, nodes, vocab, 100 * case + len(scheme), shape)
    logits, q = logits.to(dtype), q.to(q_dtype)
    coins, u, exp = safe_randomness(tokens, parents, logits, q, scheme, temperature, coins, u, case)
    out = run_backend(backend, request, tokens.to(ids), parents.to(ids), logits, q, scheme, temperature, coins, u)
    same(out, exp)
    if vocab > 1:  # the walk does something: some rejections, some acceptances
        assert 0 < int(exp[0].sum()) < batch * (nodes - 1)


@pytest.mark.skipif(_backend.extension() is None, reason="dspec._C is not built (pip install -e .)")
def test_cpp_threaded_rows(monkeypatch):
    """B * V >= 2^18: rows spread over threads, each scanning its rows lazily."""
    tokens, parents, logits, q, coins, u = tree_case(40, 9, 9000, 14)
    logits = logits.to(torch.bfloat16)
    for scheme in SCHEMES:
        c, uu, exp = safe_randomness(tokens, parents, logits, q, scheme, 1.0, coins, u, 4)
        for threads in ("1", "3"):
            monkeypatch.setenv("DSPEC_CPU_THREADS", threads)
            same(
                dspec.verify_tree(
                    tokens,
                    parents,
                    logits,
                    draft_probs=q,
                    draft_sampling=scheme,
                    temperature=1.0,
                    coins=c,
                    sample_uniforms=uu,
                    backend="cpp",
                ),
                exp,
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_strided_q_and_edge_rows(request, backend):
    """q as a strided view, q all ones at one node (every residual empty: r back to P), a
    tree of the root alone, and q = one-hot on each child's token (today's one-hot rule)."""
    tokens, parents, logits, q, coins, u = tree_case(4, 9, 300, 7, "fan")
    wide = torch.zeros(4, 9, 2, 301)
    wide[:, :, 1, 1:] = q
    q = wide[:, :, 1, 1:]  # strides (5418, 602, 1), start off 16 bytes
    q[1, 0] = 1.0
    for scheme in SCHEMES:
        c, uu, exp = safe_randomness(tokens, parents, logits, q, scheme, 1.0, coins, u, 3)
        same(run_backend(backend, request, tokens, parents, logits, q, scheme, 1.0, c, uu), exp)
        root = run_backend(
            backend,
            request,
            tokens[:, :1],
            parents[:, :1],
            logits[:, :1],
            q[:, :1].contiguous(),
            scheme,
            1.0,
            c[:, :1],
            uu,
        )
        same(root, oracle(tokens[:, :1], parents[:, :1], logits[:, :1], q[:, :1], scheme, 1.0, c[:, :1], uu)[0])
    # a chain with q_u one-hot at u's only child's token: the rule of draft_probs=None
    tokens, parents, logits, q, coins, u = tree_case(5, 7, 50, 8, "chain")
    onehot = torch.zeros_like(q)
    onehot[:, :-1].scatter_(-1, tokens[:, 1:, None], 1.0)
    for scheme in SCHEMES:
        exp = dspec.verify_tree(
            tokens, parents, logits, temperature=0.9, coins=coins, sample_uniforms=u, backend="torch"
        )
        same(run_backend(backend, request, tokens, parents, logits, onehot, scheme, 0.9, coins, u), exp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_ignores_q_and_none_keeps_today(request, backend):
    tokens, parents, logits, q, coins, u = tree_case(5, 9, 40, 9)
    if backend == "sim":
        pytest.skip("the simulator entry point takes sampling with q; test_verify_ext covers the rest")
    for scheme in SCHEMES:
        exp = reference.verify_tree(tokens, parents, logits)
        same(run_backend(backend, request, tokens, parents, logits, q, scheme, 0.0, coins, u), exp)
        exp = reference.verify_tree(tokens, parents, logits, temperature=1.0, coins=coins, sample_uniforms=u)
        out = dspec.verify_tree(
            tokens,
            parents,
            logits,
            draft_sampling=scheme,
            temperature=1.0,
            coins=coins,
            sample_uniforms=u,
            backend=backend,
        )
        same(out, exp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_rows_and_nan_q_give_minus_one(request, backend, monkeypatch):
    tokens, parents, logits, q, coins, u = tree_case(4, 5, 30, 10, "fan")
    coins[:] = 0.999  # the first child of the root is rejected
    logits[0, 0, 3] = float("nan")  # invalid target rows at the root
    logits[1, 0] = float("-inf")
    q = q.clone()
    q[2, 0, 5] = float("nan")  # NaN in q_0 (value checks off)
    q[2, 0, tokens[2, 1]] = 0.5
    monkeypatch.setattr(_validate.config, "validate_values", False)
    for scheme in SCHEMES:
        out = run_backend(backend, request, tokens, parents, logits, q, scheme, 1.0, coins, u)
        assert out.num_accepted[:3].tolist() == [0, 0, 0]
        assert out.tokens[:3, 0].tolist() == [-1, -1, -1]


# ------------------------------------------------------------ 2-4. the law, mutations
V_STAT = 4
ROUNDS = 200_000


def stat_problem():
    """A target (P_0 and P_1[x] for the token after x) and a drafter (q_0, q_1[x]) on 4 tokens."""
    p0 = torch.tensor([0.45, 0.25, 0.2, 0.1], dtype=torch.float64)
    p1 = torch.tensor(
        [[0.6, 0.1, 0.2, 0.1], [0.1, 0.5, 0.1, 0.3], [0.25, 0.25, 0.4, 0.1], [0.05, 0.15, 0.3, 0.5]],
        dtype=torch.float64,
    )
    q0 = torch.tensor([0.2, 0.4, 0.1, 0.3], dtype=torch.float64)
    q1 = torch.tensor(
        [[0.3, 0.3, 0.3, 0.1], [0.4, 0.2, 0.2, 0.2], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]],
        dtype=torch.float64,
    )
    return p0, p1, q0, q1


def stat_round(scheme, seed, fan=3, sub=2):
    """ROUNDS trees: `fan` children of the root drawn by the scheme from q_0, `sub` children
    below each drawn from q_1[its token]; target logits log P; draft_probs q."""
    p0, p1, q0, q1 = stat_problem()
    g = torch.Generator().manual_seed(seed)
    replacement = scheme == "independent"
    first = torch.multinomial(q0.expand(ROUNDS, -1), fan, replacement=replacement, generator=g)
    second = torch.multinomial(q1[first.reshape(-1)], sub, replacement=replacement, generator=g)
    second = second.reshape(ROUNDS, fan * sub)
    nodes = 1 + fan + fan * sub
    tokens = torch.cat([torch.zeros(ROUNDS, 1, dtype=torch.int64), first, second], 1)
    parents = torch.tensor([-1] + [0] * fan + [1 + k // sub for k in range(fan * sub)]).expand(ROUNDS, -1)
    logits = torch.zeros(ROUNDS, nodes, V_STAT)
    logits[:, 0] = p0.log().float()
    logits[:, 1 : 1 + fan] = p1[first].log().float()
    q = torch.full((ROUNDS, nodes, V_STAT), 0.25)
    q[:, 0] = q0.float()
    q[:, 1 : 1 + fan] = q1[first].float()
    coins = torch.rand(ROUNDS, nodes, generator=g)
    u = torch.rand(ROUNDS, generator=g)
    return tokens, parents.contiguous(), logits, q, coins, u, g


def walk64(tokens, parents, logits, q, scheme, coins, u, mutation=None):
    """The rule vectorised over rows in float64 (T = 1), with one deliberate mistake:
    "residual_from_p" (r <- P_u - q: earlier rejections forgotten), "accept_without_q"
    (accepted iff coin < r(x)), "onehot_residual" (a rejection only removes x from r),
    "keep_r" (a rejection leaves r unchanged), and without replacement "q_not_renormalised",
    "q_not_removed".  (The one-hot rule itself, q ignored altogether, is lossless for any
    drafts, q-drawn ones too: it is no mistake.)"""
    rows_n, nodes = tokens.shape
    p = torch.softmax(logits.double(), -1)
    qd = q.double()
    rows = torch.arange(rows_n)
    node = torch.zeros(rows_n, dtype=torch.int64)
    depth = torch.zeros(rows_n, dtype=torch.int64)
    out = torch.full((rows_n, nodes), -1, dtype=torch.int64)
    r, q_cur = p[:, 0].clone(), qd[:, 0].clone()
    for c in range(1, nodes):
        child = parents[:, c] == node
        t = tokens[:, c, None]
        q_x = q_cur.gather(-1, t)[:, 0]
        live = child & (q_x > 0)
        q_test = torch.ones_like(q_x) if mutation == "accept_without_q" else q_x
        move = live & (coins[:, c].double() * q_test < r.gather(-1, t)[:, 0])
        reject = live & ~move
        base = p[rows, node] if mutation == "residual_from_p" else r
        if mutation == "onehot_residual":
            res = base.scatter(-1, t, 0.0)
        else:
            res = (base - q_cur).clamp(min=0)
        s = res.sum(-1, keepdim=True)
        res = torch.where(s > 0, res / s.clamp(min=1e-300), p[rows, node])
        if mutation != "keep_r":
            r = torch.where(reject[:, None], res, r)
        if scheme == "without_replacement":
            qn = q_cur if mutation == "q_not_removed" else q_cur.scatter(-1, t, 0.0)
            if mutation not in ("q_not_renormalised", "q_not_removed"):
                qn = qn / qn.sum(-1, keepdim=True).clamp(min=1e-300)
            q_cur = torch.where(reject[:, None], qn, q_cur)
        r = torch.where(move[:, None], p[:, c], r)
        q_cur = torch.where(move[:, None], qd[:, c], q_cur)
        out.scatter_(1, depth[:, None], torch.where(move[:, None], t, out.gather(1, depth[:, None])))
        node = torch.where(move, c, node)
        depth = depth + move.long()
    cs = torch.cumsum(r, -1)
    final = (cs > (u.double() * cs[:, -1])[:, None]).int().argmax(-1)
    out[rows, depth] = final
    return dspec.TreeVerifyOutput(depth, torch.zeros_like(out), out)


def law_deviation(out, g):
    """max over (x1, x2) of |count - n P| / sigma for the first two emitted tokens (a 1-token
    output completed with a target draw)."""
    p0, p1, _, _ = stat_problem()
    x1 = out.tokens[:, 0]
    assert bool((x1 >= 0).all())
    completion = torch.multinomial(p1[x1], 1, generator=g)[:, 0]
    x2 = torch.where(out.num_accepted >= 1, out.tokens[:, 1], completion)
    counts = torch.bincount(x1 * V_STAT + x2, minlength=V_STAT * V_STAT).double()
    law = (p0[:, None] * p1).reshape(-1)
    n = out.tokens.shape[0]
    return float(((counts - n * law).abs() / (n * law * (1 - law)).sqrt()).max())


STAT_BACKENDS = [b for b in BACKENDS if b in ("torch", "cpp")]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lossless_and_mutations_fail(scheme):
    tokens, parents, logits, q, coins, u, g = stat_round(scheme, 11 + len(scheme))
    for backend in STAT_BACKENDS:
        out = dspec.verify_tree(
            tokens,
            parents,
            logits,
            draft_probs=q,
            draft_sampling=scheme,
            temperature=1.0,
            coins=coins,
            sample_uniforms=u,
            backend=backend,
        )
        assert law_deviation(out, g) < 6.0, backend
    assert law_deviation(walk64(tokens, parents, logits, q, scheme, coins, u), g) < 6.0
    mutations = ["residual_from_p", "accept_without_q", "onehot_residual", "keep_r"]
    if scheme == "without_replacement":
        mutations += ["q_not_renormalised", "q_not_removed"]
    for mutation in mutations:
        dev = law_deviation(walk64(tokens, parents, logits, q, scheme, coins, u, mutation), g)
        assert dev > 6.0, (mutation, dev)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_q_accepts_more_than_one_hot(scheme):
    tokens, parents, logits, q, coins, u, _ = stat_round(scheme, 5 + len(scheme))
    with_q = dspec.verify_tree(
        tokens, parents, logits, draft_probs=q, draft_sampling=scheme, temperature=1.0, coins=coins, sample_uniforms=u
    )
    one_hot = dspec.verify_tree(tokens, parents, logits, temperature=1.0, coins=coins, sample_uniforms=u)
    gain = float(with_q.num_accepted.double().mean() - one_hot.num_accepted.double().mean())
    sigma = float(with_q.num_accepted.double().std()) / ROUNDS**0.5
    assert gain > 6 * sigma, (gain, sigma)


# ------------------------------------------------------------------------- 5. bad input
def test_bad_input_raises():
    tokens, parents, logits, q, coins, u = tree_case(2, 5, 11, 12)
    kw = dict(temperature=1.0, coins=coins, sample_uniforms=u)
    with pytest.raises(ValueError, match="draft_sampling"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=q, draft_sampling="iid", **kw)
    with pytest.raises(ValueError, match="draft_sampling"):
        dspec.verify_tree(tokens, parents, logits, draft_sampling="iid")
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=q[:, :4], **kw)
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=q[..., :10], **kw)
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=q[0], **kw)
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=q.long(), **kw)
    bad = q.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"draft_probs\[1, 2, 3\]"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=bad, **kw)
    bad[1, 2, 3] = 1.5
    with pytest.raises(ValueError, match="draft_probs"):
        dspec.verify_tree(tokens, parents, logits, draft_probs=bad, **kw)


_C = _backend.extension()


@pytest.mark.skipif(_C is None, reason="dspec._C is not built (pip install -e .)")
@pytest.mark.parametrize(
    "name,bad",
    [
        ("draft_sampling", dict(draft_sampling=2)),
        ("q_dtype", dict(q_dtype=7)),
        ("q_stride", dict(q_stride_b=-1)),
        ("q_ptr", dict(q_ptr="+2")),
        ("workspace_bytes", dict(workspace_bytes="no q")),
    ],
)
def test_extension_rejects_bad_q_arguments_before_any_write(name, bad):
    batch, nodes, vocab = 3, 5, 11
    tokens, parents, logits, q, coins, u = tree_case(batch, nodes, vocab, 13, "fan")
    logits = logits.reshape(-1, vocab).contiguous()
    outs = [torch.full(s, -7, dtype=torch.int64) for s in ((batch,), (batch, nodes), (batch, nodes))]
    ws = torch.empty(_C.verify_tree_workspace_bytes(batch, nodes, vocab, 0, True, 1, True), dtype=torch.uint8)
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
        uniforms_ptr=u.data_ptr(),
        temperature=1.0,
        num_accepted_ptr=outs[0].data_ptr(),
        path_ptr=outs[1].data_ptr(),
        out_ptr=outs[2].data_ptr(),
        device="cpu",
        workspace_ptr=ws.data_ptr(),
        workspace_bytes=ws.numel(),
        q_ptr=q.data_ptr(),
        q_dtype=0,
        q_stride_b=q.stride(0),
        q_stride_n=q.stride(1),
        draft_sampling=1,
    )
    broken = dict(kwargs, **bad)
    if name == "q_ptr":
        broken["q_ptr"] = q.data_ptr() + 2  # not float32-aligned
    if name == "workspace_bytes":  # the size without the residual rows
        broken["workspace_bytes"] = _C.verify_tree_workspace_bytes(batch, nodes, vocab, 0, True)
    with pytest.raises(ValueError, match=name):
        _C.verify_tree(**broken)
    assert all(bool((t == -7).all()) for t in outs)
    _C.verify_tree(**kwargs)
    exp = reference.verify_tree(
        tokens,
        parents,
        logits.reshape(batch, nodes, vocab),
        draft_probs=q,
        draft_sampling="without_replacement",
        temperature=1.0,
        coins=coins,
        sample_uniforms=u,
    )
    same(outs, exp)
