"""DiffuSpec's causal-consistency path search: C++ == Python oracle, beam == brute force."""

import itertools
import math

import numpy as np
import pytest
import torch

import dspec
from dspec.decode.ngram import NgramLM
from dspec.decode.path_search import build_lattice, cpp_available, path_search

needs_cpp = pytest.mark.skipif(not cpp_available(), reason="dspec._C built without diffuspec_search")
V, EOS = 16, 2


@pytest.fixture(scope="module")
def lm():
    rng = np.random.default_rng(0)
    return NgramLM.build([rng.integers(0, V, size=int(rng.integers(2, 40))) for _ in range(40)], V)


def random_lattice(rng, B, L, tau=None, M=4):
    logits = torch.from_numpy((rng.normal(size=(B, L, V)) * 2).astype(np.float32))
    tau = tau if tau is not None else float(rng.choice([0.5, 0.8, 0.95]))
    return build_lattice(logits, tau=tau, max_candidates=M, eos_ids=[EOS])


@needs_cpp
@pytest.mark.parametrize("mode", ["beam", "sample"])
def test_cpp_equals_python_on_random_lattices(lm, mode):
    rng = np.random.default_rng(1 if mode == "beam" else 2)
    for trial in range(120):
        B, L = int(rng.integers(1, 4)), int(rng.integers(0, 8))
        tok, lp = random_lattice(rng, B, L)
        lengths = rng.integers(0, L + 1, size=B)
        hist = rng.integers(-1, V, size=(B, 2))
        lam = float(rng.choice([0.0, 0.5, 1.0, rng.random()]))
        ngram = None if (trial % 5 == 0) else lm
        if ngram is None:
            lam = 1.0
        uni = rng.random((B, L)).astype(np.float32) if mode == "sample" else None
        kw = dict(beam=int(rng.integers(1, 6)), lam=lam, uniforms=uni)
        a = path_search(tok, lp, lengths, hist, [EOS], ngram, backend="python", **kw)
        b = path_search(tok, lp, lengths, hist, [EOS], ngram, backend="cpp", **kw)
        for name, x, y in zip(a._fields, a, b):
            assert torch.equal(x, y), (trial, name, x, y)


def brute_force(tok, lp, length, hist, lm, lam):
    """Every path of the lattice (stopping after EOS), scored in full; the best one."""
    best = None
    M = tok.shape[-1]
    for choice in itertools.product(range(M), repeat=length):
        path, score = [], 0.0
        for i, m in enumerate(choice):
            t = int(tok[i, m])
            if t < 0 or lp[i, m] == -math.inf:
                path = None
                break
            u = path[i - 2] if i >= 2 else (hist[0] if i == 0 else hist[1])
            v = path[i - 1] if i >= 1 else hist[1]
            score += lam * float(lp[i, m]) + (1 - lam) * lm.logprob(int(u), int(v), t)
            path.append(t)
            if t == EOS:
                break
        if path is None:
            continue
        if best is None or score > best[0] + 1e-12:
            best = (score, path)
    return best


@pytest.mark.parametrize("backend", ["python", pytest.param("cpp", marks=needs_cpp)])
def test_wide_beam_finds_the_best_path(lm, backend):
    rng = np.random.default_rng(3)
    for _ in range(25):
        L = int(rng.integers(1, 5))
        tok, lp = random_lattice(rng, 1, L, tau=0.9, M=3)
        hist = rng.integers(0, V, size=(1, 2))
        lam = float(rng.random())
        out = path_search(tok, lp, [L], hist, [EOS], lm, beam=4**L, lam=lam, backend=backend)
        score, path = brute_force(tok[0].numpy(), lp[0].numpy(), L, hist[0], lm, lam)
        n = int(out.length[0])
        assert out.tokens[0, :n].tolist() == path
        assert float(out.score[0]) == pytest.approx(score, abs=1e-9)
        assert (out.tokens[0, n:] == -1).all()


def test_beam_one_with_lam_one_is_the_argmax_path_and_stops_after_eos():
    logits = torch.full((1, 4, V), -5.0)
    for i, t in enumerate([7, 9, EOS, 11]):
        logits[0, i, t] = 5.0
    tok, lp = build_lattice(logits, tau=0.5, max_candidates=3, eos_ids=[EOS])
    out = path_search(tok, lp, [4], [[-1, 3]], [EOS], None, beam=1, lam=1.0)
    assert out.tokens[0].tolist() == [7, 9, EOS, -1] and int(out.length[0]) == 3
    # q of a beam path is one-hot on the chosen candidate
    assert out.q[0, :3].sum(-1).tolist() == [1.0, 1.0, 1.0]


def test_lattice_always_keeps_eos_once():
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(rng.normal(size=(2, 5, V)).astype(np.float32))
    logits[0, 0, EOS] = 20.0  # EOS already the top candidate there
    tok, lp = build_lattice(logits, tau=0.6, max_candidates=3, eos_ids=[EOS])
    assert tok.shape == (2, 5, 4)
    assert ((tok == EOS).sum(-1) == 1).all()
    full = torch.log_softmax(logits, -1)
    valid = tok >= 0
    torch.testing.assert_close(lp[valid], full.gather(-1, tok.clamp(min=0))[valid])
    mt, mlp, cnt = dspec.mass_candidates(logits, 0.6, 3)
    assert torch.equal(tok[..., :3], mt)


def test_sampled_paths_follow_q():
    """The first slot's draws follow the q the search returns (what verification needs)."""
    rng = np.random.default_rng(5)
    tok, lp = random_lattice(rng, 1, 1, tau=0.99, M=5)
    lm = NgramLM.build([rng.integers(0, V, size=30) for _ in range(5)], V)
    n = 4000
    uni = rng.random((n, 1)).astype(np.float32)
    out = path_search(
        tok.expand(n, -1, -1),
        lp.expand(n, -1, -1),
        np.ones(n, np.int64),
        np.tile([[1, 4]], (n, 1)),
        [EOS],
        lm,
        lam=0.5,
        uniforms=uni,
    )
    q = out.q[0, 0]
    assert q.sum().item() == pytest.approx(1.0, abs=1e-6)
    # q is the normalised mix of dLLM and proxy log-probs over the usable candidates
    valid = tok[0, 0] >= 0
    s = torch.tensor(
        [
            0.5 * float(lp[0, 0, m]) + 0.5 * lm.logprob(1, 4, int(tok[0, 0, m])) if valid[m] else -math.inf
            for m in range(tok.shape[-1])
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(q.double(), torch.softmax(s, 0), atol=1e-6, rtol=0)
    picked = out.tokens[:, 0]
    for m in range(tok.shape[-1]):
        if valid[m]:
            freq = (picked == tok[0, 0, m]).double().mean().item()
            assert abs(freq - q[m].item()) < 4 * math.sqrt(q[m].item() * (1 - q[m].item()) / n) + 1e-3


def test_lam_one_sampling_is_the_renormalised_drafter():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -9.0, -9.0]]])
    tok, lp = build_lattice(logits, tau=0.9, max_candidates=3, eos_ids=[])
    out = path_search(tok, lp, [1], [[-1, -1]], [], None, lam=1.0, uniforms=[[0.3]])
    p = torch.softmax(logits[0, 0], 0)
    kept = tok[0, 0][tok[0, 0] >= 0]
    want = p[kept] / p[kept].sum()
    torch.testing.assert_close(out.q[0, 0, : len(kept)], want.float())


def test_bad_input_raises_value_error(lm):
    tok, lp = random_lattice(np.random.default_rng(6), 2, 3)
    ok = dict(lengths=[3, 3], history=[[0, 1], [1, 2]])

    def run(**kw):
        a = dict(cand_tokens=tok, cand_logprobs=lp, eos_ids=[EOS], ngram=lm, **ok)
        a.update(kw)
        return path_search(
            a["cand_tokens"],
            a["cand_logprobs"],
            a["lengths"],
            a["history"],
            a["eos_ids"],
            a["ngram"],
            **{k: v for k, v in a.items() if k in ("beam", "lam", "uniforms", "backend")},
        )

    run()
    for kw, msg in [
        (dict(cand_tokens=tok[0]), "cand_tokens"),
        (dict(cand_logprobs=lp[:, :2]), "cand_logprobs"),
        (dict(lengths=[4, 0]), "lengths"),
        (dict(history=[[0, 1]]), "history"),
        (dict(beam=0), "beam"),
        (dict(lam=1.5), "lam"),
        (dict(ngram=None), "lam"),
        (dict(uniforms=np.ones((2, 3), np.float32)), "uniforms"),
        (dict(backend="gpu"), "backend"),
        (dict(cand_tokens=tok + 100), "vocab_size"),
        (dict(history=[[0, 99], [0, 1]]), "history"),
        (dict(cand_logprobs=torch.full_like(lp, float("nan"))), "NaN"),
        (dict(cand_tokens=tok.float()), "cand_tokens"),
    ]:
        with pytest.raises(ValueError, match=msg):
            run(**kw)


@needs_cpp
def test_raw_binding_validates():
    from dspec import _C

    z = np.zeros(4, np.int64)
    f = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="lam"):
        _C.diffuspec_search(
            z.ctypes.data,
            f.ctypes.data,
            z.ctypes.data,
            z.ctypes.data,
            0,
            0,
            1,
            1,
            1,
            1,
            0.5,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            z.ctypes.data,
            z.ctypes.data,
            z.ctypes.data,
            f.ctypes.data,
        )
    with pytest.raises(ValueError, match="lengths"):
        lens = np.array([5], np.int64)
        _C.diffuspec_search(
            z.ctypes.data,
            f.ctypes.data,
            lens.ctypes.data,
            z.ctypes.data,
            0,
            0,
            1,
            1,
            1,
            1,
            1.0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            z.ctypes.data,
            z.ctypes.data,
            z.ctypes.data,
            f.ctypes.data,
        )
