"""dspec.decode.ngram: the token-id 3-gram that is DiffuSpec's causal proxy."""

import math
from collections import Counter

import numpy as np
import pytest

from dspec.decode.ngram import NgramLM, default_ngram, kneser_ney_discount
from dspec.decode.path_search import cpp_available, path_search


def corpus(seed=0, V=12, n=40):
    rng = np.random.default_rng(seed)
    # a skewed, repetitive source so that the counts have structure
    probs = rng.dirichlet(np.full(V, 0.3))
    return [rng.choice(V, size=int(rng.integers(1, 30)), p=probs) for _ in range(n)], V


def naive_kneser_ney(seqs, V):
    """Interpolated Kneser-Ney spelled out from the formulas, with dictionaries."""
    tri, bi = Counter(), Counter()
    for s in seqs:
        s = [int(x) for x in s]
        bi.update(zip(s, s[1:]))
        tri.update(zip(s, s[1:], s[2:]))
    d3 = kneser_ney_discount(np.array(list(tri.values()), float))
    cont_bi = {k: max(len({u for (u, v, w) in tri if (v, w) == k}), 1) for k in bi}
    d2 = kneser_ney_discount(np.array(list(cont_bi.values()), float))
    cont_uni = Counter(w for (v, w) in bi)
    p1 = {w: (cont_uni[w] + 1) / (len(bi) + V) for w in range(V)}

    def p2(v, w):
        tot = sum(c for (a, _), c in cont_bi.items() if a == v)
        if tot == 0:
            return p1[w]
        types = sum(1 for (a, _) in cont_bi if a == v)
        return max(cont_bi.get((v, w), 0) - d2, 0) / tot + d2 * types / tot * p1[w]

    def p3(u, v, w):
        tot = sum(c for (a, b, _), c in tri.items() if (a, b) == (u, v))
        if tot == 0:
            return p2(v, w)
        types = sum(1 for (a, b, _) in tri if (a, b) == (u, v))
        return max(tri.get((u, v, w), 0) - d3, 0) / tot + d3 * types / tot * p2(v, w)

    return p1, p2, p3


def test_kneser_ney_matches_the_formulas_and_normalises():
    seqs, V = corpus()
    lm = NgramLM.build(seqs, V)
    p1, p2, p3 = naive_kneser_ney(seqs, V)
    for u in [-1] + list(range(V)):
        for v in [-1] + list(range(V)):
            if u >= 0 and v < 0:
                continue
            got = np.exp([lm.logprob(u, v, w) for w in range(V)])
            assert got.sum() == pytest.approx(1.0, abs=1e-5)
            want = [p1[w] if v < 0 else (p2(v, w) if u < 0 else p3(u, v, w)) for w in range(V)]
            np.testing.assert_allclose(got, want, rtol=2e-5)


def test_stupid_backoff_is_relative_frequency_then_backoff():
    seqs = [[0, 1, 2, 0, 1, 3, 0, 1, 2]]
    lm = NgramLM.build(seqs, 5, method="stupid_backoff")
    assert lm.logprob(0, 1, 2) == pytest.approx(math.log(2 / 3), abs=1e-6)
    assert lm.logprob(0, 1, 3) == pytest.approx(math.log(1 / 3), abs=1e-6)
    # unseen trigram (1, 2, 1), seen context (1, 2): log 0.4 + bigram; bigram (2, 1) unseen:
    # log 0.4 + unigram
    want = 2 * math.log(0.4) + math.log((3 + 1) / (9 + 5))  # c(1) = 3, add-one
    assert lm.logprob(1, 2, 1) == pytest.approx(want, abs=1e-6)


def test_save_load_roundtrip_and_bad_files(tmp_path):
    seqs, V = corpus(1)
    lm = NgramLM.build(seqs, V, meta={"note": "x"})
    path = lm.save(tmp_path / "lm.npz")
    back = NgramLM.load(path)
    assert back.meta["note"] == "x" and back.method == lm.method and back.vocab_size == V
    for k, a in lm.arrays().items():
        np.testing.assert_array_equal(a, back.arrays()[k])
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    with pytest.raises(ValueError):
        NgramLM.load(tmp_path / "junk.npz")
    with pytest.raises(ValueError):
        NgramLM.load(tmp_path / "missing.npz")


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="outside"):
        NgramLM.build([[0, 5]], 5)
    with pytest.raises(ValueError, match="no token"):
        NgramLM.build([[]], 5)
    with pytest.raises(ValueError, match="method"):
        NgramLM.build([[0, 1]], 5, method="witten_bell")
    with pytest.raises(ValueError, match="vocab_size"):
        NgramLM.build([[0, 1]], 0)


def test_a_trained_model_beats_uniform_on_its_corpus():
    seqs, V = corpus(2, V=20, n=80)
    lm = NgramLM.build(seqs, V)
    assert lm.perplexity(seqs[:10]) < 0.8 * V


@pytest.mark.skipif(not cpp_available(), reason="dspec._C built without diffuspec_search")
def test_cpp_lookup_equals_python_bit_for_bit():
    seqs, V = corpus(3)
    for method in ("kneser_ney", "stupid_backoff"):
        lm = NgramLM.build(seqs, V, method=method)
        rng = np.random.default_rng(0)
        n = 300
        hist = np.stack([rng.integers(-1, V, n), rng.integers(-1, V, n)], 1)
        hist[hist[:, 1] < 0, 0] = -1
        w = rng.integers(0, V, n)
        # one slot, one candidate with dLLM log-prob 0, lam = 0: the score is the proxy log-prob
        out = path_search(
            w[:, None, None],
            np.zeros((n, 1, 1), np.float32),
            np.ones(n, np.int64),
            hist,
            [],
            lm,
            beam=1,
            lam=0.0,
            backend="cpp",
        )
        want = [lm.logprob(int(a), int(b), int(c)) for (a, b), c in zip(hist, w)]
        assert out.score.tolist() == want


def test_default_ngram_is_built_once_and_cached(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dspec.models import Tokenizer as DTok

    monkeypatch.setenv("DSPEC_CACHE", str(tmp_path))
    vocab = {c: i for i, c in enumerate("<unk> 0 1 2 3 4 5 6 7 8 9 + - * = Compute:".split())}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")

    class FakeModel:
        tokenizer = DTok(inner)
        shipped_name = None

        class config:
            vocab_size = len(vocab)

    lm = default_ngram(FakeModel(), corpora=("arithmetic",), max_chars=20_000)
    files = list((tmp_path / "ngram").glob("*.npz"))
    assert len(files) == 1 and lm.meta["corpora"] == ["arithmetic"]
    assert lm.logprob(-1, vocab["="], vocab[" "] if " " in vocab else 0) < 0
    again = default_ngram(FakeModel(), corpora=("arithmetic",), max_chars=20_000)
    np.testing.assert_array_equal(again.trigram_keys, lm.trigram_keys)
    with pytest.raises(ValueError, match="corpora"):
        default_ngram(FakeModel(), corpora=("wikipedia",))


def test_load_cached_keeps_a_file_until_it_changes(tmp_path):
    from dspec.decode.ngram import load_cached

    path = tmp_path / "lm.npz"
    NgramLM.build([[0, 1, 2, 1, 0]], 5).save(path)
    first = load_cached(path)
    assert load_cached(path) is first  # unchanged file: the same object
    NgramLM.build([[3, 4, 3, 4]], 5).save(path)  # replaced: read again
    again = load_cached(path)
    assert again is not first and again.logprob(3, 4, 3) > first.logprob(3, 4, 3)
    with pytest.raises(ValueError, match="no n-gram file"):
        load_cached(tmp_path / "missing.npz")
