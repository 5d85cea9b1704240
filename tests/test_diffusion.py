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
            logits = model(model.plan([base + block]), logits="all").logits[0, start:].float()
            if model.shifted:
                prev = model(model.plan([base + block]), logits="all").logits[0, start - 1].float() \
                    if start > 0 else torch.zeros_like(logits[0])
                logits = torch.cat([prev[None], logits[:-1]])
            probs = torch.softmax(logits, -1)
            conf, tok = probs.max(-1)
            masked = torch.tensor([t == mask for t in block])
            conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
            j = int(torch.sort(conf, descending=True, stable=True).indices[0])
            block[j] = int(tok[j])
        new = block[len(seq) - start:]
        for t in new:
            if len(out) == max_new_tokens:
                break
            out.append(t)
            if t in model.eos_token_ids:
                return out
        seq = base + block
    return out


@pytest.mark.parametrize("prompt", [[5, 17, 42], [5, 17, 42, 9, 11, 3, 8, 2]])
def test_one_token_per_step_equals_naive(model, prompt):
    got = dspec.generate(model, prompt, method="diffusion", max_new_tokens=10, block_size=4)
    assert got.tokens == naive_diffusion(model, prompt, 10, 4)


def test_batch_equals_single_runs(model):
    prompts = [[5, 17, 42, 9, 11], [7], [100, 2, 33, 4]]
    kw = dict(method="diffusion", max_new_tokens=9, block_size=4, threshold=0.05)
    batch = dspec.generate(model, prompts, **kw)
    singles = [dspec.generate(model, p, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles]


def test_schedules_and_forward_counts(model):
    prompt = [5, 17, 42, 9]
    one = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4)
    two = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4,
                         tokens_per_step=2)
    dyn = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4,
                         threshold=1e-9)  # everything passes: one step per block
    # prefill + per block (steps + commit): 4 + 1 and 2 + 1 and 1 + 1, two blocks
    assert one.stats["nfe"]["target"] == 1 + 2 * 5
    assert two.stats["nfe"]["target"] == 1 + 2 * 3
    assert dyn.stats["nfe"]["target"] == 1 + 2 * 2
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
