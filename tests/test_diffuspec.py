"""method "diffuspec": a block-diffusion drafter for an AR target, lossless.

Tiny random pairs that share one tokenizer: a right-shifted Fast-dLLM v2 drafter with the
weights of its Qwen2 target (attention and MLP outputs damped so the two agree often and
drafts do get accepted), and a non-shifted SDAR drafter for a Qwen3 target.
"""

import math
import shutil

import pytest
import torch

import dspec
from dspec.decode.diffuspec import AdaptiveDraftLength
from dspec.decode.ngram import ngram_from_model
from tiny_checkpoints import write_checkpoint

PROMPTS = [[5, 9, 11, 4, 7], [8], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
NEW = 14


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def damp(scale):
    def hook(w):
        for k in w:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                w[k] = w[k] * scale
        return w

    return hook


def make_pair(root, target_family, drafter_family, *, seed=3, scale=0.3, **shape):
    t = write_checkpoint(root / "target", target_family, seed=seed, weights_hook=damp(scale), **shape)
    d = write_checkpoint(root / "drafter", drafter_family, seed=seed, weights_hook=damp(scale), **shape)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # one tokenizer for both
        shutil.copy(d / f, t / f)
    return dspec.load(t), dspec.load(d)


@pytest.fixture(scope="module", params=[("qwen2", "fast_dllm_v2"), ("qwen3", "sdar")], ids=["shifted", "plain"])
def pair(request, tmp_path_factory):
    target, drafter = make_pair(tmp_path_factory.mktemp(request.param[1]), *request.param)
    lm = ngram_from_model(target, num_sequences=16, length=24)
    ar = [dspec.generate(target, p, method="ar", max_new_tokens=NEW).tokens for p in PROMPTS]
    return target, drafter, lm, ar


@pytest.mark.parametrize(
    "opts",
    [dict(), dict(cps=False, adaptive=False, draft_len=4), dict(draft_len=3, beam=2, lam=0.7)],
    ids=["cps+adl", "plain", "cps-fixed"],
)
def test_greedy_equals_ar_batch_and_single(pair, opts):
    target, drafter, lm, ar = pair
    batch = dspec.generate(target, PROMPTS, method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, **opts)
    assert [g.tokens for g in batch] == ar
    single = dspec.generate(
        target, PROMPTS[0], method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, **opts
    )
    assert single.tokens == ar[0]
    s = batch[0].stats
    assert s["nfe"]["target"] >= 1 and s["nfe"]["drafter"] >= 1
    assert s["nfe"]["target"] <= NEW + 1
    assert s["adaptive"] == ("draft_len" not in opts)  # an explicit draft_len alone is fixed
    if not s["adaptive"]:
        assert s["mean_draft_len"] <= opts["draft_len"]
    for key in ("time_draft_s", "time_search_s", "time_verify_s", "mean_draft_len", "mean_accepted"):
        assert s[key] >= 0
    if target.family == "qwen2":  # the damped shifted pair agrees often
        assert s["mean_accepted"] > 1.2


def test_cpu_adl_bounds_are_the_default_unless_one_is_given(pair, monkeypatch):
    """A CPU model's ADL runs in CPU_ADL's bounds by default; any of k_min / k_max / delta
    given restores the paper's others; outputs stay ar's either way."""
    from dspec.decode import diffuspec

    target, drafter, lm, ar = pair
    made = []
    real = diffuspec.AdaptiveDraftLength
    monkeypatch.setattr(diffuspec, "AdaptiveDraftLength", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    got = dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm)
    assert got.tokens == ar[0] and got.stats["adaptive"]
    assert {k: made[-1][k] for k in ("k_min", "k_max", "delta")} == diffuspec.CPU_ADL
    assert got.stats["mean_draft_len"] <= diffuspec.CPU_ADL["k_max"]
    paper = dspec.generate(
        target, PROMPTS[0], method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, delta=10
    )
    assert paper.tokens == ar[0]
    assert (made[-1]["k_min"], made[-1]["k_max"]) == (diffuspec.DEFAULTS["k_min"], diffuspec.DEFAULTS["k_max"])


def test_eos_stops_like_ar(tmp_path):
    # a target whose argmax is EOS after a few tokens: make EOS likely by its output bias
    def hook(w):
        w = damp(0.3)(w)
        w["lm_head.weight"][2] *= 3.0
        return w

    t = write_checkpoint(tmp_path / "t", "qwen2", seed=7, weights_hook=hook)
    d = write_checkpoint(tmp_path / "d", "fast_dllm_v2", seed=7, weights_hook=hook)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(d / f, t / f)
    target, drafter = dspec.load(t), dspec.load(d)
    prompts = [[i, i + 3] for i in range(4, 40, 6)]
    ar = [dspec.generate(target, p, method="ar", max_new_tokens=12).tokens for p in prompts]
    assert any(2 in a for a in ar), "the test needs an EOS inside the budget"
    got = dspec.generate(target, prompts, method="diffuspec", max_new_tokens=12, drafter=drafter, lam=1.0)
    assert [g.tokens for g in got] == ar


@pytest.mark.parametrize("opts", [dict(), dict(cps=False, adaptive=False, draft_len=4)], ids=["cps+adl", "plain"])
def test_draft_vocabulary_keeps_greedy_equal_to_ar(pair, opts):
    target, drafter, lm, ar = pair
    v = min(target.config.vocab_size, drafter.config.vocab_size)
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(0))[: v // 2]
    got = dspec.generate(
        target, PROMPTS, method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, draft_vocab=ids, **opts
    )
    assert [g.tokens for g in got] == ar
    s = got[0].stats
    # EOS ids join the draft vocabulary, the [MASK] leaves it
    mask_in = int(drafter.mask_token_id in ids.tolist())
    eos_added = len({e for e in target.eos_token_ids if e < v} - set(ids.tolist()))
    assert s["draft_vocab"] == v // 2 - mask_in + eos_added
    # "auto": a drafter that ships no draft vocabulary drafts over the whole vocabulary
    full = dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, **opts)
    assert full.stats["draft_vocab"] is None and full.tokens == ar[0]


def test_draft_vocabulary_checks(pair):
    target, drafter, lm, _ = pair
    kw = dict(method="diffuspec", max_new_tokens=4, drafter=drafter, ngram=lm)
    for bad, match in [
        ([0, 0, 1], "distinct"),
        ([-1, 2], r"\[0, "),
        (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
        ("all", "'auto'"),
        ([0.5, 1.0], "token ids"),
        ([], "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            dspec.generate(target, PROMPTS[0], draft_vocab=bad, **kw)


def exact_two_token_distribution(target, prompt, T):
    """P(first two generated tokens) of the target at temperature T (EOS stops: (eos, -1))."""
    V = target.config.vocab_size
    eos = set(target.eos_token_ids)
    logits = target(target.plan([prompt]), logits="last").logits[0, -1].float()
    p1 = torch.softmax(logits / T, -1).double()
    seqs = [prompt + [a] for a in range(V)]
    p2 = torch.softmax(target(target.plan(seqs), logits="last").logits[:, -1].float() / T, -1).double()
    dist = {}
    for a in range(V):
        if a in eos:
            dist[(a, -1)] = float(p1[a])
        else:
            for b in range(V):
                dist[(a, b)] = float(p1[a] * p2[a, b])
    return dist


@pytest.mark.parametrize(
    "cps, draft_vocab", [(True, None), (False, None), (True, [0, 2, 3, 5, 7, 8]), (False, [1, 2, 4, 5, 6, 9])]
)
def test_sampling_preserves_the_target_distribution(tmp_path, cps, draft_vocab):
    target, drafter = make_pair(tmp_path, "qwen2", "fast_dllm_v2", seed=11, scale=0.5, vocab=10)
    prompt = [5, 7, 4]
    T = 1.0
    exact = exact_two_token_distribution(target, prompt, T)
    lm = ngram_from_model(target, num_sequences=10, length=12)
    n = 2000
    # 4 new tokens: the first from the prefill, then a cycle that drafts 2 (the budget left
    # minus the verify's own token); the second token is a verified draft or its correction
    gens = dspec.generate(
        target,
        [prompt] * n,
        method="diffuspec",
        max_new_tokens=4,
        drafter=drafter,
        ngram=lm,
        temperature=T,
        seed=0,
        cps=cps,
        adaptive=False,
        draft_len=2,
        tau=0.9,
        draft_vocab=draft_vocab,
    )
    assert gens[0].stats["mean_accepted_drafts"] > 0.2  # drafts were really accepted
    assert gens[0].stats["mean_draft_len"] > 1.0
    counts = {}
    for g in gens:
        key = (g.tokens[0], g.tokens[1] if len(g.tokens) > 1 else -1)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    # chi-square over the cells with expected count >= 5 (the rest pooled)
    chi, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for key, p in exact.items():
        e, o = n * p, counts.get(key, 0)
        if e >= 5:
            chi += (o - e) ** 2 / e
            dof += 1
        else:
            pooled_e += e
            pooled_o += o
    if pooled_e > 0:
        chi += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    # p < 1e-4 would fail: the chi-square quantile, by the Wilson-Hilferty approximation
    z = 3.72
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi < limit, (chi, limit, dof)


def test_adaptive_draft_length_controller():
    c = AdaptiveDraftLength(3, k_min=20, k_max=30, delta=10, rho=0.5)
    assert c.k.tolist() == [30, 30, 30]
    k = c.update([30, 30, 25], [30, 2, 25])  # full, partial, full (EOS-shortened)
    assert k.tolist() == [30, 20, 30]  # grow / ceil(2) + 10 = 12 -> k_min / 25 + 10 -> k_max
    k = c.update([30, 20, 30], [5, 20, 14])
    # ema_acc: 0.5*30 + 0.5*5 = 17.5 -> 28 ; full: ema_gen 0.5*30+0.5*20 = 25 -> 30 (clip) ;
    # ema_acc 0.5*25 + 0.5*14 = 19.5 -> 30
    assert k.tolist() == [28, 30, 30]
    c.select([0, 2])
    assert c.k.tolist() == [28, 30]
    assert AdaptiveDraftLength(2, k_min=4, k_max=8, delta=1, rho=0.5, k_init=2).k.tolist() == [4, 4]
    c2 = AdaptiveDraftLength(1, k_min=2, k_max=8, delta=1, rho=0.0)
    assert c2.update([8], [0]).tolist() == [2] and c2.update([2], [2]).tolist() == [3]
    for kw in (
        dict(k_min=0, k_max=4),
        dict(k_min=5, k_max=4),
        dict(k_min=1, k_max=4, delta=-1),
        dict(k_min=1, k_max=4, rho=1.0),
    ):
        full = dict(delta=1, rho=0.5) | kw
        with pytest.raises(ValueError):
            AdaptiveDraftLength(1, **full)
    with pytest.raises(ValueError, match="accepted"):
        AdaptiveDraftLength(1, k_min=1, k_max=4, delta=1, rho=0.5).update([2], [3])


def test_drafter_checks(pair, tmp_path, monkeypatch):
    target, drafter, lm, _ = pair
    with pytest.raises(ValueError, match="needs drafter"):
        dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=4)
    monkeypatch.setenv("DSPEC_ASSETS", str(tmp_path / "no-assets"))  # an installation without the adapter
    target.shipped_name = "smollm2-135m"
    try:
        with pytest.raises(ValueError, match="no DiffuSpec drafter ships for 'smollm2-135m'"):
            dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=4)
    finally:
        target.shipped_name = None
    with pytest.raises(ValueError, match="block-diffusion"):
        dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=4, drafter=target)
    with pytest.raises(ValueError, match="autoregressive target"):
        dspec.generate(drafter, PROMPTS[0], method="diffuspec", max_new_tokens=4, drafter=drafter)
    other = dspec.load(write_checkpoint(tmp_path / "other", "sdar", seed=1))  # its own tokenizer
    if target.tokenizer.inner.get_vocab() != other.tokenizer.inner.get_vocab():
        with pytest.raises(ValueError, match="tokenizer"):
            dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=4, drafter=other)
    for bad in (
        dict(tau=0.0),
        dict(lam=2.0),
        dict(beam=0),
        dict(draft_len=0),
        dict(cps="yes"),
        dict(k_min=5, k_max=3),
        dict(ngram=3),
    ):
        with pytest.raises(ValueError):
            dspec.generate(target, PROMPTS[0], method="diffuspec", max_new_tokens=4, drafter=drafter, **bad)


def _shipped(name):
    try:
        return dspec.load(name)
    except ValueError:
        return None


def test_shipped_pair_tiny_ar_with_tiny_bd():
    target = _shipped("tiny-ar")
    if target is None or _shipped("tiny-bd") is None:
        pytest.skip("tiny-ar / tiny-bd are not shipped in this checkout")
    from dspec.tasks import arithmetic

    prompts = [p.prompt for p in arithmetic(3, seed=0)]
    ar = [g.tokens for g in dspec.generate(target, prompts, method="ar", max_new_tokens=8)]
    for opts in (dict(), dict(cps=False, draft_len=4)):
        got = dspec.generate(target, prompts, method="diffuspec", max_new_tokens=8, **opts)  # drafter: tiny-bd
        assert [g.tokens for g in got] == ar
        assert got[0].stats["nfe"]["drafter"] >= 1


@pytest.mark.parametrize("opts", [dict(), dict(cps=False, adaptive=False, draft_len=5)], ids=["cps+adl", "plain"])
def test_a_mask_adapted_target_drafts_against_the_targets_cache(tmp_path, monkeypatch, opts):
    from dspec.decode import diffuspec
    from tiny_checkpoints import trained_looking_mask_adapter

    target = dspec.load(write_checkpoint(tmp_path / "t", "llama", seed=7, weights_hook=damp(0.3)), dtype="float32")
    drafter = trained_looking_mask_adapter(target, mask_token_id=5)
    lm = ngram_from_model(target, num_sequences=16, length=24)
    ar = [dspec.generate(target, p, method="ar", max_new_tokens=NEW).tokens for p in PROMPTS]
    kw = dict(method="diffuspec", max_new_tokens=NEW, drafter=drafter, ngram=lm, **opts)
    shared = dspec.generate(target, PROMPTS, **kw)
    assert [g.tokens for g in shared] == ar and shared[0].stats["shared_cache"] is True
    # a drafter with its own cache computes the same keys and values (batched into other
    # forwards: equal up to the last bit, which can flip a near-tie of this random drafter)
    monkeypatch.setattr(diffuspec, "shares_target_cache", lambda model, drafter: False)
    own = dspec.generate(target, PROMPTS, **kw)
    assert [g.tokens for g in own] == ar and own[0].stats["shared_cache"] is False
    assert shared[0].stats["mean_accepted"] > 1.0 and own[0].stats["mean_accepted"] > 1.0
    assert abs(shared[0].stats["mean_accepted"] - own[0].stats["mean_accepted"]) < 0.3


def test_shares_target_cache_needs_the_targets_weights(tmp_path):
    from dspec.decode.diffuspec import shares_target_cache
    from tiny_checkpoints import trained_looking_mask_adapter

    target = dspec.load(write_checkpoint(tmp_path / "t", "llama", seed=7), dtype="float32")
    drafter = trained_looking_mask_adapter(target, mask_token_id=5)
    assert shares_target_cache(target, drafter)
    other = dspec.load(write_checkpoint(tmp_path / "o", "llama", seed=8), dtype="float32")
    assert not shares_target_cache(other, drafter)  # another base
    changed = trained_looking_mask_adapter(target, mask_token_id=5)
    with torch.no_grad():
        changed.norm.weight[0] += 1.0
    assert not shares_target_cache(target, changed)
    assert not shares_target_cache(target, target)  # not a mask-adapted model
