"""generate / load reject bad input with a ValueError naming it, before any forward."""

import numpy as np
import pytest
import torch

import dspec


def test_context_length_checked_before_any_forward(ar, monkeypatch):
    ctx = ar.config.max_position_embeddings
    calls = []
    monkeypatch.setattr(type(ar), "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=rf"{ctx}.*|.*{ctx}"):
        dspec.generate(ar, [1] * 10, method="ar", max_new_tokens=ctx)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dspec.generate(ar, [1] * (ctx + 1), method="ar", max_new_tokens=1)
    assert not calls


def test_ar_rejects_a_non_causal_model(bd):
    with pytest.raises(ValueError, match="causal.*diffusion"):
        dspec.generate(bd, "Compute: 1 + 1 =", method="ar", max_new_tokens=4)


@pytest.mark.parametrize("temperature", ["hot", None, float("nan"), True])
def test_temperature_must_be_a_number(ar, temperature):
    with pytest.raises(ValueError, match="temperature"):
        dspec.generate(ar, "x", method="ar", max_new_tokens=2, temperature=temperature)


def test_prompt_forms(ar):
    ids = ar.tokenizer.encode("Compute: 2 + 2 =")
    one = dspec.generate(ar, ids, method="ar", max_new_tokens=4).tokens
    assert dspec.generate(ar, torch.tensor(ids), method="ar", max_new_tokens=4).tokens == one
    assert dspec.generate(ar, [np.int64(t) for t in ids], method="ar", max_new_tokens=4).tokens == one
    batch = dspec.generate(ar, torch.tensor([ids, ids]), method="ar", max_new_tokens=4)
    assert [g.tokens for g in batch] == [one, one]
    for bad in ([1.5, 2.0], torch.tensor([1.0, 2.0]), ["a", 3], torch.zeros(2, 2, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match="prompt"):
            dspec.generate(ar, bad, method="ar", max_new_tokens=2)


def test_unknown_method(ar):
    with pytest.raises(ValueError, match="method"):
        dspec.generate(ar, "x", method="beam", max_new_tokens=2)


def test_sampling_without_seed_leaves_the_global_rng_alone(ar):
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    dspec.generate(ar, "x", method="ar", max_new_tokens=3, temperature=1.0)
    assert torch.equal(torch.rand(4), want)


def test_load_device_checks():
    with pytest.raises(ValueError, match="device"):
        dspec.load("tiny-ar", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            dspec.load("tiny-ar", device="cuda")
