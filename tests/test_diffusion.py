"""method "diffusion": block diffusion with an exact KV cache, on tiny block-causal models."""

import pytest
import torch

import dspec
from tiny_checkpoints import write_checkpoint


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return dspec.load(path)


def naive_diffusion(model, prompt, max_new_tokens, block_size):
    """One token per step, recomputing the whole sequence every step (no cache)."""
    mask = model.mask_token_id
    seq = list(prompt)
    out = []
    while len(out) < max_new_tokens:
        start = (len(seq) // block_size) * block_size
        block = seq[start:] + [mask] * (start + block_size - len(seq))
        base = seq[:start]
        while mask in block:
            # block-causal attention at the DECODING block size (the model's may differ)
            full = model(model.plan([base + block], block_size=block_size), logits="all").logits[0].float()
            logits = full[start:]
            if model.shifted:
                prev = full[start - 1] if start > 0 else torch.zeros_like(logits[0])
                logits = torch.cat([prev[None], logits[:-1]])
            probs = torch.softmax(logits, -1)
            conf, tok = probs.max(-1)
            masked = torch.tensor([t == mask for t in block])
            conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
            j = int(torch.sort(conf, descending=True, stable=True).indices[0])
            block[j] = int(tok[j])
        new = block[len(seq) - start :]
        for t in new:
            if len(out) == max_new_tokens:
                break
            out.append(t)
            if t in model.eos_token_ids:
                return out
        seq = base + block
    return out


@pytest.mark.parametrize("prompt", [[5, 17, 42], [5, 17, 42, 9, 11, 3, 8, 2]])
@pytest.mark.parametrize("block_size", [4, 1, 3])  # the tiny models' own block size is 4
def test_one_token_per_step_equals_naive(model, prompt, block_size):
    got = dspec.generate(model, prompt, method="diffusion", max_new_tokens=10, block_size=block_size)
    assert got.tokens == naive_diffusion(model, prompt, 10, block_size)


def test_batch_equals_single_runs(model):
    prompts = [[5, 17, 42, 9, 11], [7], [100, 2, 33, 4]]
    kw = dict(method="diffusion", max_new_tokens=9, block_size=4, threshold=0.05)
    batch = dspec.generate(model, prompts, **kw)
    singles = [dspec.generate(model, p, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles]


def test_schedules_and_forward_counts(model):
    prompt = [5, 17, 42, 9]
    one = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4)
    two = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4, tokens_per_step=2)
    dyn = dspec.generate(
        model, prompt, method="diffusion", max_new_tokens=8, block_size=4, threshold=1e-9
    )  # everything passes: one step per block
    # prefill + per block its steps (4, 2, 1), two blocks: a finished block is committed by
    # the next block's first step, the last one needs no commit
    assert one.stats["nfe"]["target"] == 1 + 2 * 4
    assert two.stats["nfe"]["target"] == 1 + 2 * 2
    assert dyn.stats["nfe"]["target"] == 1 + 2 * 1
    assert len(one.tokens) == len(two.tokens) == len(dyn.tokens) == 8


def test_sampling_reproducible(model):
    kw = dict(method="diffusion", max_new_tokens=6, block_size=2, temperature=0.8, seed=3)
    assert dspec.generate(model, [5, 6], **kw).tokens == dspec.generate(model, [5, 6], **kw).tokens


def test_bad_options(model, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        dspec.generate(model, [1, 2], method="diffusion", max_new_tokens=2, tokens_per_step=1, threshold=0.5)
    with pytest.raises(ValueError, match="threshold"):
        dspec.generate(model, [1, 2], method="diffusion", max_new_tokens=2, threshold=1.5)
    with pytest.raises(ValueError, match="does not take"):
        dspec.generate(model, [1, 2], method="diffusion", max_new_tokens=2, draft_len=3)
    causal = dspec.load(write_checkpoint(tmp_path, "llama", seed=1))
    with pytest.raises(ValueError, match="masked-diffusion model"):
        dspec.generate(causal, [1, 2], method="diffusion", max_new_tokens=2)


# ------------------------------------------------------------------ bidirectional models
@pytest.fixture(scope="module", params=["llada", "dream"])
def bidir(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return dspec.load(path)


def naive_semi_ar(model, prompt, max_new_tokens, block_size, eos_ids=None):
    """LLaDA's semi-autoregressive sampler, one token per step, spelled out: the whole
    region (max_new_tokens rounded up to blocks, counted from the prompt end) is decoded
    block after block, every step forwards the whole sequence, and the output is cut after
    the first EOS at the very end (no early stop)."""
    eos_ids = model.eos_token_ids if eos_ids is None else eos_ids
    mask = model.mask_token_id
    region = -(-max_new_tokens // block_size) * block_size
    seq = list(prompt) + [mask] * region
    p = len(prompt)
    for k in range(region // block_size):
        lo = p + k * block_size
        for _ in range(block_size):
            logits = model(model.plan([seq]), logits="all").logits[0].float()
            if model.shifted:  # Dream: position i predicts i + 1
                logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, mask] = float("-inf")
            conf, tok = torch.softmax(logits, -1).max(-1)
            todo = [j for j in range(lo, lo + block_size) if seq[j] == mask]
            j = max(todo, key=lambda j: (float(conf[j]), -j))
            seq[j] = int(tok[j])
        assert mask not in seq[lo : lo + block_size]
    out = seq[p : p + max_new_tokens]
    for i, t in enumerate(out):
        if t in eos_ids:
            return out[: i + 1]
    return out


@pytest.mark.parametrize(
    "prompt,max_new,block", [([5, 17, 42], 8, 4), ([5, 17, 42, 9, 11, 3, 8], 10, 4), ([7, 8], 6, 3)]
)
def test_bidirectional_one_token_per_step_equals_naive(bidir, prompt, max_new, block):
    got = dspec.generate(bidir, prompt, method="diffusion", max_new_tokens=max_new, block_size=block)
    assert got.tokens == naive_semi_ar(bidir, prompt, max_new, block)
    assert got.stats["attention"] == "bidirectional"
    assert got.stats["gen_length"] == -(-max_new // block) * block
    assert bidir.mask_token_id not in got.tokens
    # one forward per unmasked slot; the last block's slots past max_new_tokens only while
    # they come before the last slot the output needs
    assert max_new <= got.stats["nfe"]["target"] <= got.stats["gen_length"]


def test_bidirectional_eos_stops_early_with_the_same_output(bidir):
    from dspec.decode.diffusion import decode_diffusion

    prompt = [5, 17, 42, 9]
    free = dspec.generate(bidir, prompt, method="diffusion", max_new_tokens=12, block_size=4)
    eos = free.tokens[5]  # make the sixth token an EOS
    tokens, stats = decode_diffusion(bidir, [prompt], max_new_tokens=12, eos_ids=(eos,), block_size=4)
    expect = naive_semi_ar(bidir, prompt, 12, 4, eos_ids=(eos,))
    assert tokens[0] == expect and tokens[0][-1] == eos and len(expect) <= 6
    # the output is decided once its slots are: the third block is never decoded
    assert stats["nfe"]["target"] < free.stats["nfe"]["target"]


def test_bidirectional_batch_equals_single_runs(bidir):
    prompts = [[5, 17, 42, 9, 11], [7], [100, 2, 33, 4]]
    for opts in (dict(), dict(tokens_per_step=2), dict(threshold=0.2)):
        kw = dict(method="diffusion", max_new_tokens=9, block_size=4, **opts)
        batch = dspec.generate(bidir, prompts, **kw)
        singles = [dspec.generate(bidir, p, **kw) for p in prompts]
        assert [g.tokens for g in batch] == [g.tokens for g in singles], opts
        # a request leaves the batch when done: its forwards are its single run's
        assert batch[0].stats["request_forwards"] == [g.stats["nfe"]["target"] for g in singles]


def test_bidirectional_schedules(bidir):
    prompt = [5, 17, 42, 9]
    one = dspec.generate(bidir, prompt, method="diffusion", max_new_tokens=8, block_size=4)
    two = dspec.generate(bidir, prompt, method="diffusion", max_new_tokens=8, block_size=4, tokens_per_step=2)
    everything = dspec.generate(
        bidir, prompt, method="diffusion", max_new_tokens=8, block_size=4, threshold=1e-9
    )  # every slot passes: one step per block
    nothing = dspec.generate(
        bidir, prompt, method="diffusion", max_new_tokens=8, block_size=4, threshold=1.0
    )  # none passes: the most confident one per step
    assert (one.stats["nfe"]["target"], two.stats["nfe"]["target"]) == (8, 4)
    assert everything.stats["nfe"]["target"] == 2 and everything.stats["schedule"] == "threshold"
    assert nothing.tokens == one.tokens and nothing.stats["nfe"]["target"] == 8
    assert len(one.tokens) == len(two.tokens) == len(everything.tokens) == 8
    # threshold 1e-9 takes every slot from the first step's predictions of the block
    first = bidir(bidir.plan([prompt + [bidir.mask_token_id] * 8]), logits="all").logits[0].float()
    if bidir.shifted:
        first = torch.cat([first[:1], first[:-1]])
    first[:, bidir.mask_token_id] = float("-inf")
    assert everything.tokens[:4] == first[4:8].argmax(-1).tolist()


def test_bidirectional_default_block_and_sampling(bidir):
    g = dspec.generate(bidir, [5, 6], method="diffusion", max_new_tokens=5)
    assert g.stats["block_size"] == 32 and g.stats["gen_length"] == 32 and len(g.tokens) == 5
    kw = dict(method="diffusion", max_new_tokens=6, block_size=3, temperature=0.8, seed=3)
    a, b = dspec.generate(bidir, [5, 6], **kw), dspec.generate(bidir, [5, 6], **kw)
    assert a.tokens == b.tokens and bidir.mask_token_id not in a.tokens


def test_bidirectional_bad_options(bidir):
    for kw, match in (
        (dict(block_size=0), "block_size"),
        (dict(tokens_per_step=0), "tokens_per_step"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=True), "threshold"),
        (dict(tokens_per_step=2, threshold=0.5), "not both"),
        (dict(block_size=2.0), "block_size"),
    ):
        with pytest.raises(ValueError, match=match):
            dspec.generate(bidir, [1, 2], method="diffusion", max_new_tokens=2, **kw)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_confidence_and_log_probs_are_softmax(dtype, atol, temperature):
    from dspec.decode.unmask import confidence, log_probs

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 1000, generator=g) * 4).to(dtype)
    logits[0, 0, 7] = float("-inf")
    tokens = torch.randint(0, 1000, (3, 5, 4), generator=g)
    tokens[0, 0, 0] = 7
    t = temperature if temperature > 0 else 1.0
    want = torch.log_softmax(logits.float() / t, -1).gather(-1, tokens)
    got = log_probs(logits, tokens, temperature)
    assert got.dtype == torch.float32 and got.shape == tokens.shape
    assert got[0, 0, 0] == float("-inf")
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)
    conf = confidence(logits, tokens[..., 1], temperature)
    torch.testing.assert_close(conf, want[..., 1].exp(), atol=atol, rtol=1e-5)


def test_block_ends_follows_extend_blocks_rule():
    """OutputBuffer.block_ends: a request ends inside its block exactly when outputting the
    block as it stands (uncommitted slots still [MASK]) would finish it."""
    import numpy as np

    from dspec.decode.outputs import OutputBuffer

    rng = np.random.default_rng(0)
    mask, eos, bs = 99, 7, 6
    for _ in range(500):
        buf = OutputBuffer(3, int(rng.integers(1, 12)), [eos])
        buf.lengths[:] = rng.integers(0, buf.max_new_tokens, 3)
        block = rng.integers(0, 10, (3, bs))
        known = rng.random((3, bs)) < 0.6
        block = np.where(known, block, mask)
        start = rng.integers(0, 12, 3)
        plen = start + rng.integers(-2, bs, 3)
        ends = buf.block_ends(np.arange(3), block, known, start, plen)
        # the reference: output the committed run only, and see whether it finishes the request
        skip = np.clip(plen - start, 0, bs)
        for r in range(3):
            run = 0
            while skip[r] + run < bs and known[r, skip[r] + run]:
                run += 1
            seg = block[r, skip[r] : skip[r] + run].tolist()
            want = eos in seg or run >= buf.max_new_tokens - buf.lengths[r]
            assert bool(ends[r]) == want
