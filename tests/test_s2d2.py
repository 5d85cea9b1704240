"""method "s2d2": diffusion drafting verified by the model's own block-size-1 view."""

import math

import pytest
import torch

import dspec
from dspec.decode import routing
from dspec.decode.s2d2 import accept_span, ar_view_logits, two_l_dense
from dspec.models import AttentionPlan
from s2d2_cases import redraft_checks
from stats_cases import chi_square
from tiny_checkpoints import write_checkpoint

BS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return dspec.load(path)


def _run(model, prompt, **kw):
    kw = dict(dict(method="s2d2", max_new_tokens=10, block_size=BS), **kw)
    return dspec.generate(model, prompt, **kw)


def block_size_one_greedy(model, prompt, max_new_tokens, block_size):
    """No-cache reference: every token is the block-size-1 argmax given everything before it.

    Finished blocks attend block-causally (as the block-mode KV the decoder commits); the
    current block's tokens attend causally; a position-aligned model predicts slot t from a
    [MASK] at t, a right-shifted one from the logits at t - 1 (at a block's slot 0: the
    block-mode logits of the previous block's last slot).
    """
    mask = model.mask_token_id

    def logits_at(seq, start, query):
        n = len(seq)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        dense = (j <= i) | ((j // block_size == i // block_size) & (i < start))
        plan = AttentionPlan(torch.tensor([seq]), torch.arange(n)[None], dspec.pack_mask(dense))
        return model(plan).logits[0, query].float()

    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        start = (len(seq) // block_size) * block_size
        plen = len(seq)
        while len(seq) < start + block_size:
            t = len(seq)
            if model.shifted:
                logits = logits_at(seq, start if t > start else t, t - 1)
            else:
                logits = logits_at(seq + [mask], start, t)
            seq.append(int(dspec.token_stats(logits).token))
        for tok in seq[plen:]:
            if len(out) == max_new_tokens:
                break
            out.append(tok)
            if tok in model.eos_token_ids:
                return out
    return out


# ------------------------------------------------------------------------------ 2L view


def test_two_l_dense_is_the_masks_builder():
    for span in (1, 3, 5):
        assert torch.equal(two_l_dense(0, span), dspec.masks.s2d2_two_l(span).dense())
    d = two_l_dense(2, 2, copies=3)  # context c0 c1, drafts d0 d1, copies m0 m1 m2
    assert d[4].tolist() == [True, True, False, False, True, False, False]  # m0: context + itself
    assert d[6].tolist() == [True, True, True, True, False, False, True]  # m2 (bonus): all drafts


def test_two_l_logits_equal_block_size_one_forwards(model):
    """Each verifier row equals a separate causal forward ending at that position."""
    torch.manual_seed(0)
    mask = model.mask_token_id
    prompts = [[5, 17, 42, 9, 11, 3, 8, 2], [7, 1, 30, 12]]
    cache = model.new_cache(2)
    plan = model.plan(prompts, cache)
    out = model(plan, logits="last")
    cache.append(out.suffix_kv, counts=plan.lengths)
    carry = out.logits[:, -1].float()
    block = torch.randint(4, 60, (2, BS))
    span_start = torch.tensor([1, 0])
    span_len = torch.tensor([3, 2])
    got = ar_view_logits(model, cache, block, cache.lengths, span_start, span_len, carry=carry)
    for b in range(2):
        s, n = int(span_start[b]), int(span_len[b])
        sub = cache.select([b])
        for j in range(n + 1):
            slot = s + j
            ctx = block[b, :slot].tolist()
            if model.shifted:
                if slot == 0:
                    want = carry[b]
                else:
                    p = model.plan([ctx], sub, attention="causal")
                    want = model(p, logits="last").logits[0, 0].float()
            else:
                p = model.plan([ctx + [mask]], sub, attention="causal")
                want = model(p, logits="last").logits[0, 0].float()
            torch.testing.assert_close(got[b, j], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_policy_never_equals_diffusion(model, temperature):
    for prompt, thr in (
        ([5, 17, 42], 0.3),
        ([5, 17, 42, 9, 11, 13, 8, 2], 0.05),
        ([7], 0.9),
        ([1, 2, 3, 4, 5, 6], 0.5),
    ):
        kw = dict(max_new_tokens=9, block_size=BS, threshold=thr, temperature=temperature, seed=11)
        got = _run(model, prompt, policy="never", **kw)
        want = dspec.generate(model, prompt, method="diffusion", **kw)
        assert got.tokens == want.tokens
        assert got.stats["nfe"] == want.stats["nfe"]  # both commit a block in the next one's first step
        assert got.stats["verifications"] == 0 and got.stats["verify_rate"] == 0.0


@pytest.mark.parametrize("redraft", [True, False])
@pytest.mark.parametrize("block_size,draft_len", [(BS, 1), (BS, 2), (BS, 3), (BS, BS)])
def test_greedy_always_equals_block_size_one_decoding(model, block_size, draft_len, redraft):
    saved = ahead = 0
    for prompt in ([5, 17, 42], [5, 17, 42, 9, 11, 13, 8, 2], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1]):
        got = _run(
            model,
            prompt,
            policy="always",
            draft_len=draft_len,
            threshold=0.5,
            max_new_tokens=12,
            block_size=block_size,
            redraft=redraft,
        )
        assert got.tokens == block_size_one_greedy(model, prompt, 12, block_size)
        st = got.stats
        assert st["verify_rate"] == 1.0
        assert sum(st["accepted_hist"]) == st["verifications"] > 0
        assert 1.0 <= st["mean_accepted"] <= draft_len + 1
        # one sequence: every forward is the prefill, a drafting or a verifying one (a block
        # finished otherwise than by its drafts rides in front of the next drafting forward),
        # and every verification follows a drafting forward or drafts rode in a verification
        # (policy always)
        kinds = st["forwards_with"]
        assert st["nfe"]["target"] == (len(prompt) >= block_size) + kinds["draft"] + kinds["verify"]
        assert kinds["verify"] == st["verifications"]
        assert (
            kinds["draft"] + st["spec_block_drafts"] + st["next_block_drafts"] + st["boundary_drafts"]
            == st["verifications"]
        )
        ahead += st["next_block_drafts"]
        blocks = -(-(len(prompt) % block_size + 12) // block_size)
        # every block is committed (by a later drafting forward or by its verification) but
        # maybe the last one, which nothing reads
        assert blocks - 1 <= kinds["commit"] + st["spec_block_commits"] <= blocks
        saved += st["spec_block_drafts"] + st["spec_block_commits"]
    assert saved > 0  # the redraft-block path is exercised
    # the next block's first state rides in a verification forward only with redraft blocks
    if not redraft:
        assert ahead == 0


@pytest.mark.parametrize("method", ["s2d2", "diffusion"])
def test_a_request_stops_inside_its_last_block(model, method):
    """Decoding stops once a block's committed run reaches max_new_tokens: the tokens are the
    prefix of a longer run, and the forwards that would decode the block's later slots (never
    output) are not spent."""
    for prompt in ([5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1]):
        for n in (1, 5, 9):
            short = _run(model, prompt, method=method, max_new_tokens=n)
            long = _run(model, prompt, method=method, max_new_tokens=n + 2 * BS)
            assert short.tokens == long.tokens[: len(short.tokens)]
            assert len(short.tokens) == n or set(model.eos_token_ids) & set(short.tokens)
            assert short.stats["nfe"]["target"] <= long.stats["nfe"]["target"]


def test_tiny_bd_at_block_eight_costs_no_more_forwards_than_block_size_one():
    """tiny-bd's drafts rarely pass; its last block used to be decoded to its end (53 forwards
    for these 48 tokens, against 49 for block-size-1 decoding)."""
    bd = dspec.load("tiny-bd")
    prompt = "def fibonacci(n):\n"
    got = dspec.generate(bd, prompt, method="s2d2", max_new_tokens=48)
    one = dspec.generate(bd, prompt, method="diffusion", block_size=1, max_new_tokens=48)
    assert len(got.tokens) == 48
    assert got.stats["nfe"]["target"] <= one.stats["nfe"]["target"]
    assert got.tokens == dspec.generate(bd, prompt, method="s2d2", max_new_tokens=64).tokens[:48]


def test_redraft_blocks_are_the_outcome_states(model, monkeypatch):
    prompts = [[5, 17, 42], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 2, 33, 4, 8]]
    done = redraft_checks(model, prompts, monkeypatch, max_new_tokens=24, block_size=BS, threshold=0.5)
    assert done["reuse"] > 0 and done["stale"] > 0


@pytest.mark.parametrize(
    "policy,extra",
    [
        ("always", {}),
        ("min_span", {"min_span": 3}),
        ("score_dynamic", {"score_threshold": 0.2}),
        ("hysteresis", {"hysteresis": (1.0, 0.3)}),
    ],
)
@pytest.mark.parametrize("redraft", [True, False])
def test_batch_equals_single_runs(model, policy, extra, redraft):
    """Per-sequence routing and acceptance: rows in different states share each forward.
    (``ucb`` is left out on purpose: its bandit statistics are shared by the batch.)"""
    prompts = [[5, 17, 42, 9, 11], [7], [100, 2, 33, 4]]
    kw = dict(max_new_tokens=11, threshold=0.2, policy=policy, redraft=redraft, **extra)
    batch = _run(model, prompts, **kw)
    singles = [_run(model, p, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles]


def test_accept_span_by_hand():
    """Acceptance min(1, p/q), residual at the first rejection, bonus only into a masked slot."""
    tokens = torch.tensor([[9, 3, 3, 3], [9, 9, 3, 3]])  # 3 = [MASK]
    masked = tokens == 3
    drafts = torch.tensor([[0, 1, 2], [2, 0, 0]])
    p = torch.tensor(
        [
            [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.25] * 4],
            [[0.1, 0.1, 0.7, 0.1], [0.4, 0.1, 0.1, 0.4], [0.25] * 4, [0.25] * 4],
        ]
    )
    q = torch.tensor(
        [
            [[0.8, 0.1, 0.05, 0.05], [0.1, 0.3, 0.5, 0.1], [0.1, 0.1, 0.4, 0.4]],
            [[0.1, 0.1, 0.7, 0.1], [0.8, 0.1, 0.05, 0.05], [0.25] * 4],
        ]
    )
    coins = torch.tensor([[0.5, 0.9, 0.0], [0.0, 0.6, 0.0]])
    uniforms = torch.tensor([0.5, 0.3])
    # row 0, span slots 1..3: draft 0: 0.5 * 0.8 = 0.4 < 0.5 accept; draft 1: 0.9 * 0.3 = 0.27 < 0.6
    # accept; draft 2: 0 * 0.4 < 0.1 accept; span reaches the block end: no bonus -> 3 committed.
    # row 1, span slots 2..3 (L = 2): draft 0 (id 2): 0 < 0.7 accept; draft 1 (id 0):
    # 0.6 * 0.8 = 0.48 >= 0.4 reject; residual max(p - q, 0) = [0, 0, 0.05, 0.35] -> u = 0.3:
    # cumsum [0, 0, .05, .4] > 0.3 * 0.4 = 0.12 at id 3.
    out = accept_span(
        tokens,
        masked,
        drafts,
        p.log(),
        torch.tensor([1, 2]),
        torch.tensor([3, 2]),
        draft_probs=q,
        temperature=1.0,
        coins=coins,
        sample_uniforms=uniforms,
    )
    new_tokens, new_masked, committed, accepted = out
    assert new_tokens.tolist() == [[9, 0, 1, 2], [9, 9, 2, 3]]
    assert committed.tolist() == [3, 2] and accepted.tolist() == [3, 1]
    assert not new_masked.any()
    # a bonus token only when the slot after the span is masked: span 1..1 of [9 M M M]
    out = accept_span(
        tokens[:1],
        masked[:1],
        drafts[:1, :1],
        p[:1, :2].log(),
        torch.tensor([1]),
        torch.tensor([1]),
        draft_probs=q[:1, :1],
        temperature=1.0,
        coins=torch.tensor([[0.0]]),
        sample_uniforms=torch.tensor([0.9]),
    )
    # accepted draft 0 at slot 1, bonus from p_1 = [.1 .6 .2 .1] with u = 0.9 -> id 2 at slot 2
    assert out[0].tolist() == [[9, 0, 2, 3]] and out[2].tolist() == [2]
    # greedy: accept while the draft is the argmax; the argmax replaces the first mismatch
    out = accept_span(tokens, masked, drafts, p.log(), torch.tensor([1, 2]), torch.tensor([3, 2]))
    assert out[0].tolist() == [[9, 0, 1, 3], [9, 9, 2, 0]]
    assert out[3].tolist() == [2, 2]  # row 1: p_1 ties 0 and 3, the argmax is 0


def _one_slot_laws(model, prompt, temperature):
    """Block-size-1 logits p and diffusion logits q of the last slot of ``prompt``'s block
    (the prompt fills all but that slot), computed independently of the decoder."""
    mask = model.mask_token_id
    start = (len(prompt) // BS) * BS
    cache = _cache_of(model, prompt[:start])
    block = torch.tensor([prompt[start:] + [mask]])
    ar = model(model.plan(block.tolist(), cache, attention="causal"), logits="last").logits[0, 0]
    dif = model(AttentionPlan(block, torch.arange(start, start + BS)[None], None, cache)).logits[0, -1]
    return ar.float(), dif.float()


def test_sampling_accept_resample_yields_block_size_one_law(tmp_path):
    """Frequency test on a tiny model: drafting from q and accept / resample against the
    2L view's p gives p (the block-size-1 law), not q."""
    from dspec.decode.sampling import next_tokens

    model = dspec.load(write_checkpoint(tmp_path, "sdar", seed=2))
    prompt, temperature, n = [5, 17, 42, 9, 11, 13, 8], 0.7, 40000
    ar, dif = _one_slot_laws(model, prompt, temperature)
    cache = _cache_of(model, prompt[:4])
    view = ar_view_logits(
        model, cache, torch.tensor([prompt[4:] + [0]]), cache.lengths, torch.tensor([3]), torch.tensor([1])
    )
    torch.testing.assert_close(view[0, 0], ar, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(0)
    q_rows = dif[None, None].repeat(n, 1, 1)
    drafts = next_tokens(q_rows[:, 0], temperature, gen)[:, None]
    q = torch.softmax(q_rows / temperature, -1)
    block = torch.tensor(prompt[4:] + [model.mask_token_id]).expand(n, -1)
    tokens, masked, committed, _ = accept_span(
        block,
        block == model.mask_token_id,
        drafts,
        view[:, :2].repeat(n, 1, 1),
        torch.full((n,), 3),
        torch.ones(n, dtype=torch.int64),
        draft_probs=q,
        temperature=temperature,
        generator=gen,
    )
    assert committed.eq(1).all() and not masked.any()
    counts = torch.bincount(tokens[:, 3], minlength=model.config.vocab_size).double()
    p = torch.softmax(ar.double() / temperature, -1)
    q1 = torch.softmax(dif.double() / temperature, -1)
    assert (p - q1).abs().sum() / 2 > 0.05  # the test can tell p from q

    assert chi_square(counts, p).fits, chi_square(counts, p)
    assert not chi_square(counts, q1).fits, chi_square(counts, q1)


def test_sampling_with_redraft_blocks_yields_block_size_one_law(tmp_path):
    """Frequency test of the decoder: two sampled slots of one block, the second drafted from
    a redraft block when the first draft is rejected (a stale proposal) or from the block
    with every draft in place, follow the block-size-1 law p(x1) p(x2 | x1) -- checked on
    both marginals, each of which the test can tell from the diffusion law."""
    model = dspec.load(write_checkpoint(tmp_path, "sdar", seed=2))
    prompt, temperature, n = [5, 17, 42, 9, 11, 13], 0.7, 20000
    vocab = model.config.vocab_size
    mask = model.mask_token_id
    cache = _cache_of(model, prompt[:BS], copies=vocab)
    causal = [prompt[BS:] + [x, mask] for x in range(vocab)]
    p2 = model(model.plan(causal, cache, attention="causal"), logits="last").logits[:, 0].double()
    one = _cache_of(model, prompt[:BS])
    p1 = model(model.plan([prompt[BS:] + [mask]], one, attention="causal"), logits="last").logits[0, 0].double()
    law1 = torch.softmax(p1 / temperature, -1)
    law2 = law1 @ torch.softmax(p2 / temperature, -1)  # the marginal of x2
    # the diffusion law of both slots at the all-[MASK] state: what the drafts follow
    block = torch.tensor([prompt[BS:] + [mask, mask]])
    q = model(AttentionPlan(block, torch.arange(BS, 2 * BS)[None], None, one)).logits[0, 2:].double()
    drafts = torch.softmax(q / temperature, -1)
    got = _run(model, [prompt] * n, max_new_tokens=2, temperature=temperature, seed=7, policy="always", redraft=True)
    assert got[0].stats["spec_block_drafts"] > 0  # redraft blocks were reused
    x = torch.tensor([g.tokens for g in got])

    for slot, law in ((0, law1), (1, law2)):
        counts = torch.bincount(x[:, slot], minlength=vocab).double()
        assert chi_square(counts, law).fits, (slot, chi_square(counts, law))
        assert not chi_square(counts, drafts[slot]).fits, slot  # the test tells the laws apart


def _cache_of(model, tokens, copies=1):
    """A cache holding ``tokens`` committed (``copies`` identical rows)."""
    cache = model.new_cache(copies)
    plan = model.plan([tokens] * copies, cache)
    cache.append(model(plan).suffix_kv, counts=plan.lengths)
    return cache


def test_sampling_decoder_passes_the_drafters_q_and_the_verifiers_p(tmp_path, monkeypatch):
    """In the decoder, the verified slot's q row is the diffusion law of that slot and the
    target row the block-size-1 law (checked against independent forwards)."""
    import dspec.decode.s2d2 as s2d2

    model = dspec.load(write_checkpoint(tmp_path, "sdar", seed=2))
    prompt, temperature = [5, 17, 42, 9, 11, 13, 8], 0.7
    seen = []

    def spy(drafts, target, **kw):
        seen.append((drafts.clone(), target.clone(), kw["draft_probs"].clone(), kw["num_drafts"].clone()))
        return dspec.verify_chain(drafts, target, **kw)

    monkeypatch.setattr(s2d2, "verify_chain", spy)
    _run(model, prompt, max_new_tokens=1, policy="always", temperature=temperature, seed=1)
    assert len(seen) == 1
    drafts, target, q, num = seen[0]
    ar, dif = _one_slot_laws(model, prompt, temperature)
    assert num.tolist() == [1]
    torch.testing.assert_close(q[0, 0], torch.softmax(dif / temperature, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target[0, 0].float(), ar, rtol=1e-5, atol=1e-5)


def test_sampling_runs_and_is_reproducible(model):
    kw = dict(max_new_tokens=8, temperature=0.8, seed=3, policy="min_span", min_span=2)
    a, b = _run(model, [5, 6], **kw), _run(model, [5, 6], **kw)
    assert a.tokens == b.tokens and len(a.tokens) == 8
    # a sampled batch: per-row acceptance, every row decodes its own draws
    prompts = [[5, 17, 42, 9, 11], [7], [5, 17, 42, 9, 11]]
    batch = _run(model, prompts, max_new_tokens=9, temperature=1.5, seed=4, policy="always")
    assert [len(g.tokens) for g in batch] == [9, 9, 9]
    assert batch[0].stats["verifications"] > 0
    assert batch[0].tokens != batch[2].tokens  # same prompt, independent draws


# ------------------------------------------------------------------------------ routing


def _features(span, score, fallback, active=None):
    span, score, fallback = torch.tensor(span), torch.tensor(score), torch.tensor(fallback)
    active = torch.ones_like(span, dtype=torch.bool) if active is None else torch.tensor(active)
    return routing.RoutingFeatures(active, span, score, fallback)


def _router(policy, batch=3, **kw):
    kw = dict(dict(min_span=2, score_threshold=1.0, hysteresis=(1.5, 0.5), ucb_c=1.0, max_score=4.0), **kw)
    return routing.make_router(policy, batch, "cpu", **kw)


def test_simple_policies():
    f = _features([1, 3, 4], [0.2, 1.0, 2.5], [1, 3, 1], active=[True, True, False])
    assert _router("always").decide(f).tolist() == [True, True, False]
    assert _router("never").decide(f).tolist() == [False, False, False]
    assert _router("min_span", min_span=3).decide(f).tolist() == [False, True, False]
    assert _router("score", score_threshold=1.0).decide(f).tolist() == [False, True, False]
    # dynamic: (score + 1) / 2 >= t * fallback: rates [0.6, 1.0, 1.75] vs t * [1, 3, 1]
    assert _router("score_dynamic", score_threshold=0.5).decide(f).tolist() == [True, False, False]
    assert _router("score_dynamic", score_threshold=0.7).decide(f).tolist() == [False, False, False]
    f2 = _features([2, 2], [1.0, 3.0], [1, 2])  # rates 1.0, 2.0 vs fallbacks 1, 2
    assert _router("score_dynamic", batch=2, score_threshold=1.0).decide(f2).tolist() == [True, True]
    assert _router("score_dynamic", batch=2, score_threshold=1.01).decide(f2).tolist() == [False, False]
    r = _router("always")
    r.decide(f)
    assert r.stats()["decisions"] == 2 and r.stats()["verify_decisions"] == 2


def test_hysteresis_switches_with_memory():
    r = _router("hysteresis", batch=1, hysteresis=(1.5, 0.5))
    seq = [1.0, 1.6, 1.0, 0.6, 0.4, 1.0, 1.5]
    got = [bool(r.decide(_features([4], [s], [1]))[0]) for s in seq]
    # off until >= 1.5; then on while >= 0.5; off below 0.5 and stays off at 1.0 (memory)
    assert got == [False, True, True, True, False, False, True]
    assert r.stats()["switches"] == 3
    # an inactive row keeps its mode
    r2 = _router("hysteresis", batch=1, hysteresis=(1.5, 0.5))
    r2.decide(_features([4], [2.0], [1]))
    assert not bool(r2.decide(_features([4], [0.0], [1], active=[False]))[0])
    assert bool(r2.decide(_features([4], [1.0], [1]))[0])


def test_ucb_learns_the_better_arm_per_context():
    torch.manual_seed(0)
    r = _router("ucb", batch=8, ucb_c=0.5, max_score=4.0)
    # synthetic rewards: low-score context (bin 0) -> fallback pays 1.0, verify 0.5;
    # high-score context (bin 3) -> verify pays 2.0, fallback 1.0 (noisy)
    picks = {0: [], 3: []}
    for step in range(300):
        ctx_score = 0.3 if step % 2 == 0 else 3.7
        f = _features([4] * 8, [ctx_score] * 8, [1] * 8)
        v = r.decide(f)
        good_verify = ctx_score > 2
        noise = 0.2 * torch.randn(8)
        reward_v = (2.0 if good_verify else 0.5) + noise
        reward_f = 1.0 + noise
        r.observe(v, True, reward_v * 2, 2)  # tokens = reward * forwards
        r.observe(~v, False, reward_f, 1)
        picks[3 if good_verify else 0].append(v.float().mean().item())
    assert sum(picks[3][-50:]) / 50 > 0.9
    assert sum(picks[0][-50:]) / 50 < 0.1
    st = r.stats()
    assert st["arm_counts"][3][routing.ARM_VERIFY] > st["arm_counts"][3][routing.ARM_FALLBACK]


def test_span_score_estimators():
    stats = dspec.token_stats(torch.tensor([[[4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [9.0, 0.0, 0.0]]]))
    conf = torch.tensor([[0.5, 0.5, 0.9]])
    e = routing.span_score(stats, conf, torch.tensor([0]), torch.tensor([2]), "product")
    assert e.tolist() == pytest.approx([0.5 + 0.25])
    e = routing.span_score(stats, conf, torch.tensor([1]), torch.tensor([2]), "product")
    assert e.tolist() == pytest.approx([0.5 + 0.45])
    m = routing.span_score(stats, conf, torch.tensor([0]), torch.tensor([1]), "margin")
    assert m.tolist() == pytest.approx([float(stats.margin[0, 0])])
    h = routing.span_score(stats, conf, torch.tensor([2]), torch.tensor([1]), "entropy")
    assert h.tolist() == pytest.approx([math.exp(-float(stats.entropy[0, 2]))])


@pytest.mark.parametrize(
    "policy,extra", [("score", {"estimator": "margin"}), ("hysteresis", {"estimator": "entropy"}), ("ucb", {})]
)
def test_every_policy_decodes(model, policy, extra):
    g = _run(model, [5, 17, 42], policy=policy, threshold=0.3, **extra)
    assert len(g.tokens) == 10 and g.stats["router"]["policy"] == policy
    assert g.stats["nfe"]["target"] >= 1


def test_bad_options(model, tmp_path):
    def bad(match, **kw):
        with pytest.raises(ValueError, match=match):
            _run(model, [1, 2], **kw)

    bad("policy", policy="sometimes")
    bad("threshold", threshold=0.0)
    bad("threshold", threshold=1.5)
    bad("draft_len", draft_len=0)
    bad("block_size", block_size=0)
    bad("estimator", estimator="magic")
    bad("min_span", policy="min_span", min_span=0)
    bad("min_span", policy="always", min_span=3)  # an option of another policy
    bad("hysteresis", policy="hysteresis", hysteresis=(0.5, 1.0))
    bad("hysteresis", policy="hysteresis", hysteresis=1.0)
    bad("ucb_c", policy="ucb", ucb_c=-1.0)
    bad("score_threshold", policy="score", score_threshold=float("nan"))
    bad("does not take", tokens_per_step=2)
    bad("redraft", redraft="sometimes")
    bad("redraft", redraft=1)
    bad("boundary", boundary="yes")
    bad("boundary", boundary=True)  # neither tiny model's clean rows attend causally
    bad("boundary", boundary=True, redraft=False)


def test_redraft_auto(model):
    """ "auto": redraft blocks for up to two requests on the CPU (their rows are nearly free),
    S2D2's speculative block alone for a larger batch (the rows are compute); the policy is
    "always" with redraft blocks or where the compiled step runs it (greedy on the CPU), else
    "min_span"."""
    from dspec.decode.s2d2 import resolve_options

    opts = (model, None, None, None, None, None, None, None, None, None)
    one, two = resolve_options(*opts, batch=1), resolve_options(*opts, batch=2)
    many, sampled = resolve_options(*opts, batch=3), resolve_options(*opts, batch=3, temperature=0.7)
    assert (one["redraft"], one["policy"]) == (True, "always")
    assert (two["redraft"], two["policy"]) == (True, "always")
    assert (many["redraft"], many["policy"]) == (False, "always")
    assert (sampled["redraft"], sampled["policy"]) == (False, "min_span")
    assert _run(model, [[5, 6], [7], [8]], max_new_tokens=4)[0].stats["redraft"] is False
    assert not one["boundary"]  # needs causal clean rows (and, on a CPU, is off)


def test_bad_model(tmp_path):
    causal = dspec.load(write_checkpoint(tmp_path, "llama", seed=1))
    with pytest.raises(ValueError, match="masked-diffusion model"):
        dspec.generate(causal, [1, 2], method="s2d2", max_new_tokens=2)
