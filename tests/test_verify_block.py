"""verify_chain(rule="block"): block verification (Sun et al., arXiv 2403.10444).

1. The rule itself, proved by exact enumeration on tiny context-dependent tables (float64):
   the joint law of the first n + 1 emitted tokens equals the target's, and the expected
   number of accepted drafts is at least the token rule's.
2. Every backend against a plain float64 Python-loop oracle of the rule (integer outputs
   exactly equal) on random inputs.
3. A statistical test of the backends' output law (100k rows in one call), which
   deliberately broken variants of the rule fail.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspec
from conftest import device_backends
from dspec import _backend

PROVIDED = ("torch", "triton", "cuda", "cpp")
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROOT = Path(__file__).resolve().parents[1]

# ============================================================ 1. the rule, by enumeration
V_ENUM = 3
#: broken variants of the rule; "q_one_hot" (verifying as if the drafter were a point mass
#: at its draft) is no mutation: it is lossless too, and the enumeration shows it
MUTATIONS = ("first_failure", "residual_from_p", "h_without_1_minus_w", "ratio_without_q")


def _dist(rng: random.Random, sharp: float, zeros=()) -> list:
    w = [rng.random() ** sharp + 0.02 for _ in range(V_ENUM)]
    for z in zeros:
        w[z] = 0.0
    s = sum(w)
    return [x / s for x in w]


def enum_tables(seed: int, depth: int, *, edge_cases: bool = True):
    """Target P and drafter q tables {prefix tuple: distribution} for every prefix up to
    ``depth`` tokens; with ``edge_cases``: P == q at one context (h_j's 0 / 0), a zero
    in q at another, a zero in P at a third."""
    rng = random.Random(seed)
    p_tab, q_tab = {}, {}
    for length in range(depth + 1):
        for pre in itertools.product(range(V_ENUM), repeat=length):
            p_tab[pre] = _dist(rng, 2.0)
            q_tab[pre] = _dist(rng, 4.0)
    if edge_cases:
        p_tab[(0,)] = list(q_tab[(0,)])
        q_tab[(1,)] = _dist(rng, 4.0, zeros=(2,))
        p_tab[(2,)] = _dist(rng, 2.0, zeros=(0,))
    return p_tab, q_tab


def enum_outcomes(p_tab, q_tab, xs: tuple, mutation=None):
    """({emitted sequence: probability}, E[accepted]) for one draft block xs, the coins
    integrated analytically: P(tau = t) = h_t prod_{i > t} (1 - h_i)."""
    n = len(xs)

    def q_of(pre):
        if mutation == "q_one_hot":
            return [1.0 if v == xs[len(pre)] else 0.0 for v in range(V_ENUM)]
        return q_tab[pre]

    w = [1.0]
    for j, x in enumerate(xs):
        p_x = p_tab[xs[:j]][x]
        q_x = 1.0 if mutation == "ratio_without_q" else q_of(xs[:j])[x]
        ratio = p_x / q_x if q_x > 0 else (math.inf if p_x > 0 else 0.0)
        w.append(0.0 if w[-1] == 0 else min(w[-1] * ratio, 1.0))
    h = [1.0]
    for j in range(1, n):
        r = sum(max(w[j] * p_tab[xs[:j]][v] - q_of(xs[:j])[v], 0.0) for v in range(V_ENUM))
        den = r + 1.0 if mutation == "h_without_1_minus_w" else r + (1.0 - w[j])
        h.append(1.0 if den <= 0 else r / den)
    h.append(w[n])
    out, expected = {}, 0.0
    for t in range(n + 1):
        if mutation == "first_failure":
            pt = math.prod(h[1 : t + 1]) * ((1 - h[t + 1]) if t < n else 1.0)
        else:
            pt = h[t] * math.prod(1 - h[i] for i in range(t + 1, n + 1))
        expected += t * pt
        if pt == 0:
            continue
        if t == n:
            wt = p_tab[xs]
        else:
            scale = 1.0 if mutation == "residual_from_p" else w[t]
            wt = [max(scale * p_tab[xs[:t]][v] - q_of(xs[:t])[v], 0.0) for v in range(V_ENUM)]
            if sum(wt) <= 0:
                wt = p_tab[xs[:t]]
        total = sum(wt)
        for y in range(V_ENUM):
            if wt[y] > 0:
                seq = xs[:t] + (y,)
                out[seq] = out.get(seq, 0.0) + pt * wt[y] / total
    return out, expected


def enum_law(p_tab, q_tab, n: int, k: int, mutation=None):
    """(joint law of the first k emitted tokens, E[accepted] block, E[accepted] token):
    drafts x_j ~ q(. | x_<j); outputs shorter than k continue with the target's own draws."""
    joint, e_block, e_token = {}, 0.0, 0.0
    for xs in itertools.product(range(V_ENUM), repeat=n):
        pd = math.prod(q_tab[xs[:j]][xs[j]] for j in range(n))
        if pd == 0:
            continue
        out, e = enum_outcomes(p_tab, q_tab, xs, mutation)
        e_block += pd * e
        run = 1.0
        for j in range(n):  # token rule: E[accepted] = sum_t prod_{i < t} min(1, p / q)
            run *= min(1.0, p_tab[xs[:j]][xs[j]] / q_tab[xs[:j]][xs[j]])
            e_token += pd * run
        for seq, mass in out.items():
            stack = [(seq, pd * mass)]
            while stack:
                s, m = stack.pop()
                if len(s) >= k:
                    joint[s[:k]] = joint.get(s[:k], 0.0) + m
                    continue
                stack.extend((s + (v,), m * p_tab[s][v]) for v in range(V_ENUM) if p_tab[s][v] > 0)
    return joint, e_block, e_token


def target_law(p_tab, k: int) -> dict:
    return {s: math.prod(p_tab[s[:i]][s[i]] for i in range(k)) for s in itertools.product(range(V_ENUM), repeat=k)}


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_enumeration_block_rule_is_lossless(n, seed):
    p_tab, q_tab = enum_tables(seed, n + 1)
    joint, e_block, e_token = enum_law(p_tab, q_tab, n, n + 1)
    exp = target_law(p_tab, n + 1)
    err = max(abs(joint.get(s, 0.0) - exp[s]) for s in exp)
    assert err < 1e-12, err
    assert e_block >= e_token - 1e-12, (e_block, e_token)
    print(f"n={n} seed={seed}: E[accepted] block {e_block:.4f} token {e_token:.4f}")


def test_enumeration_q_one_hot_is_lossless_too():
    p_tab, q_tab = enum_tables(0, 3)
    joint, _, _ = enum_law(p_tab, q_tab, 2, 3, "q_one_hot")
    exp = target_law(p_tab, 3)
    assert max(abs(joint.get(s, 0.0) - exp[s]) for s in exp) < 1e-12


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_enumeration_mutations_are_lossy(mutation):
    p_tab, q_tab = enum_tables(0, 3, edge_cases=False)
    joint, _, _ = enum_law(p_tab, q_tab, 2, 2, mutation)
    exp = target_law(p_tab, 2)
    assert max(abs(joint.get(s, 0.0) - exp[s]) for s in exp) > 1e-2


# ========================================================= 2. backends vs a float64 oracle
def _draw64(w: list, u: float) -> int:
    """The draw convention: smallest v with cumsum(w)[v] > u * sum(w), else the largest v
    with w > 0; -1 when sum(w) is not finite or not positive."""
    total = math.fsum(w) if all(math.isfinite(x) for x in w) else math.nan
    if not (math.isfinite(total) and total > 0):
        return -1
    run = 0.0
    for v, x in enumerate(w):
        run += x
        if run > u * total:
            return v
    return max(v for v, x in enumerate(w) if x > 0)


def _probs64(row: torch.Tensor, temperature: float):
    """softmax(row / T) in float64, None for an invalid row (NaN / +inf / only -inf)."""
    x = row.double()
    if bool(torch.isnan(x).any()) or bool((x == math.inf).any()) or bool((x == -math.inf).all()):
        return None
    return torch.softmax(x / temperature, -1).tolist()


def oracle_block(drafts, logits, q, n, temperature, coins, uniforms):
    """The block rule as a plain float64 loop per row (the rule of dspec.verify_chain)."""
    batch, length = drafts.shape
    vocab = logits.shape[-1]
    num = torch.zeros(batch, dtype=torch.int64)
    out = torch.full((batch, length + 1), -1, dtype=torch.int64)
    for b in range(batch):
        nb = length if n is None else int(n[b])
        xs = [int(v) for v in drafts[b, :nb]]
        ps = [_probs64(logits[b, j], temperature) for j in range(nb + 1)]
        n_eff = next((j for j, p in enumerate(ps) if p is None), nb)

        def q_row(j):
            if q is None:
                return [1.0 if v == xs[j] else 0.0 for v in range(vocab)]
            return q[b, j].double().tolist()

        w = [1.0]
        for j in range(n_eff):
            p_x, q_x = ps[j][xs[j]], q_row(j)[xs[j]]
            ratio = p_x / q_x if q_x > 0 else (math.inf if p_x > 0 else 0.0)
            w.append(0.0 if w[-1] == 0 else min(w[-1] * ratio, 1.0))
        tau = 0
        for j in range(1, n_eff + 1):
            if j < n_eff:
                qj = q_row(j)
                r = math.fsum(max(w[j] * ps[j][v] - qj[v], 0.0) for v in range(vocab))
                den = r + (1.0 - w[j])
                h = 1.0 if den <= 0 else r / den
            else:
                h = w[j]
            if float(coins[b, j - 1]) < h:
                tau = j
        if tau == n_eff:
            weights = ps[tau] if ps[tau] is not None else [math.nan] * vocab
        else:
            qt = q_row(tau)
            weights = [max(w[tau] * ps[tau][v] - qt[v], 0.0) for v in range(vocab)]
            if not sum(weights) > 0:
                weights = ps[tau]
        num[b] = tau
        out[b, :tau] = torch.tensor(xs[:tau], dtype=torch.int64)
        out[b, tau] = _draw64(weights, float(uniforms[b]))
    return num, out


def block_case(batch, length, vocab, dtype, seed, *, with_q):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, length + 1, vocab, generator=g) * 2).to(dtype)
    q = torch.softmax(torch.randn(batch, length, vocab, generator=g) * 1.5, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, length)
    # some rows draft the target's argmax, so that w stays large and long blocks pass
    argmax = logits.float().argmax(-1)[:, :length]
    drafts = torch.where(torch.rand(batch, 1, generator=g) < 0.4, argmax, drafts)
    if with_q and length and vocab > 1:
        # q(x) = 0 at a few drafts: the ratio is +inf there
        zero = torch.rand(batch, length, generator=g) < 0.15
        q = q.scatter(-1, drafts[..., None], torch.where(zero[..., None], 0.0, q.gather(-1, drafts[..., None])))
    n = torch.randint(0, length + 1, (batch,), generator=g)
    n[0] = length
    coins = torch.rand(batch, length, generator=g)
    uniforms = torch.rand(batch, generator=g)
    return logits, drafts, (q if with_q else None), n, coins, uniforms


def same(out, exp, what=""):
    for name, a, e in zip(("num_accepted", "tokens"), out, exp):
        assert a.dtype == torch.int64, name
        assert torch.equal(a.cpu(), e.cpu()), f"{what} {name}:\n{a}\n{e}"


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 300, 5000])
@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "q"])
def test_block_matches_oracle(device, backend, dtype, vocab, with_q):
    """Several (batch, L) shapes per case, ragged num_drafts, int32 / int64 drafts."""
    shapes = [(1, 0), (3, 1), (5, 7), (2, 4)] if vocab < 5000 else [(1, 0), (2, 5), (3, 3)]
    for k, (batch, length) in enumerate(shapes):
        temperature = (1.0, 0.7)[k % 2]
        logits, drafts, q, n, coins, u = block_case(batch, length, vocab, dtype, 1000 * k + vocab, with_q=with_q)
        exp = oracle_block(drafts, logits, q, n, temperature, coins, u)
        ids = drafts.int() if k % 2 else drafts
        to = lambda t: None if t is None else t.to(device)
        out = dspec.verify_chain(
            to(ids),
            to(logits),
            draft_probs=to(q),
            num_drafts=to(n),
            temperature=temperature,
            coins=to(coins),
            sample_uniforms=to(u),
            backend=backend,
            rule="block",
        )
        same(out, exp, f"batch={batch} L={length}")


@device_backends(PROVIDED)
def test_block_accepts_past_a_failure(device, backend):
    """One-hot drafts, position 1's h small, position 2's large: tau = 2 after a failure."""
    logits = torch.full((1, 3, 4), -3.0)
    logits[0, 0, 1] = 3.0  # p_0(x_0 = 1) ~ 0.98: w_1 ~ 0.98
    logits[0, 1, 2] = 0.5  # x_1 = 2 unlikely-ish: h_1 = R / (R + 1 - w)
    logits[0, 2, 0] = 3.0
    coins = torch.tensor([[0.999, 0.01]])  # position 1 fails, position 2 succeeds
    u = torch.tensor([0.3])
    drafts = torch.tensor([[1, 2]])
    exp = oracle_block(drafts, logits, None, None, 1.0, coins, u)
    assert exp[0].tolist() == [2]
    out = dspec.verify_chain(
        drafts.to(device),
        logits.to(device),
        temperature=1.0,
        coins=coins.to(device),
        sample_uniforms=u.to(device),
        backend=backend,
        rule="block",
    )
    same(out, exp)
    token = dspec.verify_chain(
        drafts.to(device),
        logits.to(device),
        temperature=1.0,
        coins=coins.to(device),
        sample_uniforms=u.to(device),
        backend=backend,
    )
    assert token.num_accepted.tolist() == [0]  # the token rule stops at draft 0


@device_backends(PROVIDED)
def test_block_invalid_rows(device, backend):
    """A NaN / +inf / all -inf target row cuts the row's drafts there; reaching it: -1."""
    logits, drafts, _, _, coins, u = block_case(4, 4, 30, torch.float32, 3, with_q=False)
    drafts[:] = logits.argmax(-1)[:, :4]
    logits[0, 2, 3] = float("nan")
    logits[1, 2, 5] = float("inf")
    logits[2, 2] = float("-inf")
    logits[3, 0, 1] = float("nan")
    for c in (torch.zeros_like(coins), coins):
        exp = oracle_block(drafts, logits, None, None, 1.0, c, u)
        out = dspec.verify_chain(
            drafts.to(device),
            logits.to(device),
            temperature=1.0,
            coins=c.to(device),
            sample_uniforms=u.to(device),
            backend=backend,
            rule="block",
        )
        same(out, exp)
    assert exp[0].tolist()[3] == 0 and exp[1][3, 0] == -1  # row 0 invalid: -1
    out = dspec.verify_chain(
        drafts, logits, temperature=1.0, coins=torch.zeros_like(coins), sample_uniforms=u, rule="block", backend="torch"
    )
    assert out.num_accepted[:3].tolist() == [2, 2, 2] and out.tokens[:3, 2].tolist() == [-1] * 3


@device_backends(PROVIDED)
@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_block_is_token(device, backend, with_q):
    logits, drafts, q, n, coins, u = block_case(5, 6, 50, torch.float32, 9, with_q=with_q)
    to = lambda t: None if t is None else t.to(device)
    kw = dict(draft_probs=to(q), num_drafts=to(n), temperature=0.0, backend=backend)
    same(
        dspec.verify_chain(to(drafts), to(logits), rule="block", **kw), dspec.verify_chain(to(drafts), to(logits), **kw)
    )


# ------------------------------------------- the CUDA kernels in the host simulator
SIM_DIR = ROOT / "tests" / "cuda_sim"
FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_CODE = {torch.int32: 0, torch.int64: 1}


@pytest.fixture(scope="module")
def block_sim(tmp_path_factory):
    """csrc/verify.cu (with token_stats.cu) built for the host simulator of tests/cuda_sim."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")) or cxx is None:
        pytest.skip("the CUDA simulator needs Linux (x86-64 / aarch64) and a C++17 compiler")
    lib_path = tmp_path_factory.mktemp("block_sim") / "libverify_block_sim.so"
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
    lib.dspec_sim_block_workspace_bytes.restype = i64
    lib.dspec_sim_block_workspace_bytes.argtypes = [i64, i64, i64, i, i, i64]
    lib.dspec_sim_verify_chain_rule.argtypes = [
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
        i,
        ctypes.c_char_p,
        i,
    ]
    return lib


def _ptr(t):
    return None if t is None else t.data_ptr()


def sim_block_chain(lib, drafts, logits, q, n, temperature, coins, u, *, rule=1, ts_splits=1, draw_splits=1):
    batch, length = drafts.shape
    x = logits.reshape(-1, logits.shape[-1]).contiguous()
    vocab = x.shape[-1]
    num = torch.full((batch,), -9, dtype=torch.int64)
    out = torch.full((batch, length + 1), -9, dtype=torch.int64)
    # a workspace of garbage: every value must be written before it is read
    ws = torch.full(
        (lib.dspec_sim_block_workspace_bytes(batch, length + 1, vocab, FLOAT_CODE[x.dtype], 1, ts_splits) + 16,),
        0xAB,
        dtype=torch.uint8,
    )
    err = ctypes.create_string_buffer(512)
    nd = None if n is None else n.long().contiguous()
    drafts = drafts.contiguous()
    rc = lib.dspec_sim_verify_chain_rule(
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
        _ptr(coins.contiguous()),
        _ptr(u.contiguous()),
        float(temperature),
        _ptr(num),
        _ptr(out),
        ts_splits,
        draw_splits,
        _ptr(ws),
        rule,
        err,
        512,
    )
    assert rc == 0, err.value.decode()
    return num, out


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 300, 5000])
@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "q"])
def test_sim_block_matches_oracle(block_sim, dtype, vocab, with_q):
    shapes = [(1, 0), (3, 1), (5, 7), (2, 4)] if vocab < 5000 else [(1, 0), (2, 5), (3, 3)]
    for k, (batch, length) in enumerate(shapes):
        temperature = (1.0, 0.7)[k % 2]
        logits, drafts, q, n, coins, u = block_case(batch, length, vocab, dtype, 1000 * k + vocab, with_q=with_q)
        exp = oracle_block(drafts, logits, q, n, temperature, coins, u)
        ids = drafts.int() if k % 2 else drafts
        same(
            sim_block_chain(
                block_sim, ids, logits, q, n, temperature, coins, u, ts_splits=1 + k % 2, draw_splits=1 + k
            ),
            exp,
            f"batch={batch} L={length}",
        )


def test_sim_block_invalid_rows_and_token_rule(block_sim):
    logits, drafts, _, _, coins, u = block_case(4, 4, 30, torch.float32, 3, with_q=False)
    drafts[:] = logits.argmax(-1)[:, :4]
    logits[0, 2, 3] = float("nan")
    logits[1, 2, 5] = float("inf")
    logits[2, 2] = float("-inf")
    logits[3, 0, 1] = float("nan")
    for c in (torch.zeros_like(coins), coins):
        same(
            sim_block_chain(block_sim, drafts, logits, None, None, 1.0, c, u),
            oracle_block(drafts, logits, None, None, 1.0, c, u),
        )
    # rule 0 through the same entry point is the token rule
    from dspec.reference import verify as reference

    logits, drafts, q, n, coins, u = block_case(5, 6, 300, torch.float32, 5, with_q=True)
    same(
        sim_block_chain(block_sim, drafts, logits, q, n, 0.9, coins, u, rule=0),
        reference.verify_chain(
            drafts, logits, draft_probs=q, num_drafts=n, temperature=0.9, coins=coins, sample_uniforms=u
        ),
    )


# ============================================================ 3. statistics and mutations
N_STAT = 100_000
L_STAT = 2


def _stat_inputs(seed: int = 0):
    """N_STAT rows drafted from the seed-0 tables (depth 2, V = 3): logits [N, 3, 3] = log P
    of each row's contexts, draft_probs [N, 2, 3], coins, uniforms, and the tables."""
    p_tab, q_tab = enum_tables(0, L_STAT + 1, edge_cases=False)
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(N_STAT, L_STAT, dtype=torch.int64)
    p_rows = torch.zeros(N_STAT, L_STAT + 1, V_ENUM, dtype=torch.float64)
    q_rows = torch.zeros(N_STAT, L_STAT, V_ENUM, dtype=torch.float64)

    def gather(tab, prefix_ids):  # prefix_ids [N, j] -> [N, V] rows of the table
        j = prefix_ids.shape[1]
        keys = list(itertools.product(range(V_ENUM), repeat=j))
        table = torch.tensor([tab[k] for k in keys], dtype=torch.float64)
        code = torch.zeros(N_STAT, dtype=torch.int64)
        for i in range(j):
            code = code * V_ENUM + prefix_ids[:, i]
        return table[code]

    for j in range(L_STAT + 1):
        p_rows[:, j] = gather(p_tab, x[:, :j])
        if j < L_STAT:
            q_rows[:, j] = gather(q_tab, x[:, :j])
            x[:, j] = torch.multinomial(q_rows[:, j], 1, generator=g)[:, 0]
    coins = torch.rand(N_STAT, L_STAT, generator=g)
    uniforms = torch.rand(N_STAT, generator=g)
    second = torch.rand(N_STAT, generator=g)  # for the target's own second token
    return p_tab, x, p_rows, q_rows, coins, uniforms, second


def _law_z(p_tab, tokens, num, second_u) -> float:
    """Largest |frequency - probability| / sigma over the 9 cells of the first two emitted
    tokens (the second drawn from the target after the first when only one is emitted)."""
    s0 = tokens[:, 0]
    p_after = torch.tensor([p_tab[(v,)] for v in range(V_ENUM)], dtype=torch.float64)[s0]
    s1_target = (torch.cumsum(p_after, -1) <= second_u[:, None].double()).sum(-1).clamp(max=V_ENUM - 1)
    s1 = torch.where(num >= 1, tokens[:, 1], s1_target)
    counts = torch.bincount(s0 * V_ENUM + s1, minlength=V_ENUM * V_ENUM).double()
    exp = torch.tensor(
        [p_tab[()][a] * p_tab[(a,)][c] for a in range(V_ENUM) for c in range(V_ENUM)], dtype=torch.float64
    )
    sigma = torch.sqrt(exp * (1 - exp) / N_STAT)
    return float(((counts / N_STAT - exp).abs() / sigma).max())


def mutant_chain(p_rows, q_rows, x, coins, uniforms, mutation=None):
    """The block rule vectorised in float64 (mutation None), or a broken variant of it."""
    batch, length = x.shape
    rows = torch.arange(batch)
    p_x = p_rows[:, :length].gather(-1, x[..., None])[..., 0]
    q_x = q_rows.gather(-1, x[..., None])[..., 0]
    if mutation == "ratio_without_q":
        q_x = torch.ones_like(q_x)
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=1e-300), torch.where(p_x > 0, math.inf, 0.0))
    w = [torch.ones(batch, dtype=torch.float64)]
    for j in range(length):
        w.append(torch.where(w[-1] == 0, 0.0, (w[-1] * ratio[:, j]).clamp(max=1.0)))
    w = torch.stack(w, -1)
    h = w.clone()
    for j in range(1, length):
        r = (w[:, j, None] * p_rows[:, j] - q_rows[:, j]).clamp(min=0).sum(-1)
        den = r + 1.0 if mutation == "h_without_1_minus_w" else r + (1.0 - w[:, j])
        h[:, j] = torch.where(den <= 0, 1.0, r / den.clamp(min=1e-300))
    ok = coins < h[:, 1:]
    pos = torch.arange(1, length + 1)
    if mutation == "first_failure":
        tau = ok.long().cumprod(-1).sum(-1)
    else:
        tau = torch.where(ok, pos, 0).amax(-1)
    p_t = p_rows[rows, tau]
    scale = torch.ones(batch, dtype=torch.float64) if mutation == "residual_from_p" else w[rows, tau]
    q_t = q_rows[rows, tau.clamp(max=length - 1)]
    resid = (scale[:, None] * p_t - q_t).clamp(min=0)
    resid = torch.where((resid.sum(-1, keepdim=True) > 0) & (tau < length)[:, None], resid, p_t)
    cdf = torch.cumsum(resid, -1)
    final = (cdf <= (uniforms.double() * cdf[:, -1])[:, None]).sum(-1).clamp(max=V_ENUM - 1)
    tokens = torch.cat([x, torch.full((batch, 1), -1)], -1)
    tokens = torch.where(torch.arange(length + 1)[None] < tau[:, None], tokens, -1)
    tokens[rows, tau] = final
    return tau, tokens


@pytest.fixture(scope="module")
def stat_inputs():
    return _stat_inputs()


def test_statistical_vectorised_rule_and_mutations(stat_inputs):
    p_tab, x, p_rows, q_rows, coins, u, second = stat_inputs
    num, tokens = mutant_chain(p_rows, q_rows, x, coins, u)
    assert _law_z(p_tab, tokens, num, second) < 6.0
    for mutation in MUTATIONS:
        num, tokens = mutant_chain(p_rows, q_rows, x, coins, u, mutation)
        z = _law_z(p_tab, tokens, num, second)
        assert z > 6.0, (mutation, z)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_statistical_backend_law_and_margin(stat_inputs, backend):
    if backend == "cpp" and not _backend.cpp_available():
        pytest.skip("dspec._C is not built")
    p_tab, x, p_rows, q_rows, coins, u, second = stat_inputs
    logits = p_rows.log().float()
    q = q_rows.float()
    kw = dict(draft_probs=q, temperature=1.0, coins=coins, sample_uniforms=u, backend=backend)
    block = dspec.verify_chain(x, logits, rule="block", **kw)
    z = _law_z(p_tab, block.tokens, block.num_accepted, second)
    assert z < 6.0, z
    token = dspec.verify_chain(x, logits, **kw)
    mb, mt = block.num_accepted.double().mean(), token.num_accepted.double().mean()
    diff = block.num_accepted.double() - token.num_accepted.double()
    se = float(diff.std()) / math.sqrt(N_STAT)
    _, e_block, e_token = enum_law(*enum_tables(0, L_STAT + 1, edge_cases=False), L_STAT, 1)
    print(
        f"{backend}: mean accepted block {float(mb):.4f} token {float(mt):.4f} "
        f"margin {float(mb - mt):.4f} +- {se:.4f} (exact {e_block:.4f} vs {e_token:.4f})"
    )
    assert float(mb - mt) > -3 * se, (float(mb), float(mt), se)
    assert abs(float(mb) - e_block) < 6 * float(block.num_accepted.double().std()) / math.sqrt(N_STAT)


# =================================================================== bad input
@pytest.mark.parametrize("rule", ["Block", 3, None, "tokens"])
def test_bad_rule(rule):
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="rule"):
        dspec.verify_chain(torch.zeros(2, 2, dtype=torch.int64), logits, temperature=1.0, rule=rule)
    with pytest.raises(ValueError, match="rule"):
        dspec.verify_chain(torch.zeros(2, 2, dtype=torch.int64), logits, rule=rule)


def test_generator_path_and_token_rule_unchanged():
    """rule="token" is the default; the generator draws the same randomness for both rules."""
    logits, drafts, q, n, _, _ = block_case(4, 5, 40, torch.float32, 4, with_q=True)
    a = dspec.verify_chain(
        drafts,
        logits,
        draft_probs=q,
        num_drafts=n,
        temperature=0.8,
        generator=torch.Generator().manual_seed(7),
        backend="torch",
    )
    b = dspec.verify_chain(
        drafts,
        logits,
        draft_probs=q,
        num_drafts=n,
        temperature=0.8,
        generator=torch.Generator().manual_seed(7),
        backend="torch",
        rule="token",
    )
    same(a, b)
    g = torch.Generator().manual_seed(7)
    coins, u = torch.rand(4, 5, generator=g), torch.rand(4, generator=g)
    same(
        dspec.verify_chain(
            drafts,
            logits,
            draft_probs=q,
            num_drafts=n,
            temperature=0.8,
            generator=torch.Generator().manual_seed(7),
            rule="block",
        ),
        oracle_block(drafts, logits, q, n, 0.8, coins, u),
    )


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_opcheck_block(backend):
    """The custom op's schema (str rule="token"), fake implementation and AOT dispatch."""
    if backend == "cpp" and not _backend.cpp_available():
        pytest.skip("dspec._C is not built")
    if backend == "triton" and not (_backend.triton_available() and _backend.triton_interpret()):
        pytest.skip("no triton interpreter here")
    logits, drafts, q, n, coins, u = block_case(2, 4, 11, torch.float32, 6, with_q=True)
    tests = (
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        if backend == "torch"
        else ("test_faketensor",)
    )
    for dq in (None, q):
        args = (drafts, logits, dq, n, 0.8, coins, u, backend, "block")
        torch.library.opcheck(torch.ops.dspec.verify_chain.default, args, test_utils=tests)
        same(torch.ops.dspec.verify_chain.default(*args), oracle_block(drafts, logits, dq, n, 0.8, coins, u))


def test_extension_rule_code_checked():
    if not _backend.cpp_available():
        pytest.skip("dspec._C is not built")
    ext = _backend.extension()
    token = ext.verify_chain_workspace_bytes(4, 3, 1000, 0, True)
    assert ext.verify_chain_workspace_bytes(4, 3, 1000, 0, True, 1, 0) == token
    assert ext.verify_chain_workspace_bytes(4, 3, 1000, 0, True, 1, 1) > token  # w_tau and R_j
    assert ext.verify_chain_workspace_bytes(4, 3, 1000, 0, False, 1, 1) == ext.verify_chain_workspace_bytes(
        4, 3, 1000, 0, False
    )  # greedy: no block sections
    with pytest.raises(ValueError, match="rule"):
        ext.verify_chain_workspace_bytes(4, 3, 1000, 0, True, 1, 2)
    with pytest.raises(ValueError, match="rule"):
        ext.verify_chain(0, 0, 1, 2, 11, 11, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, "cpu", rule=3)
