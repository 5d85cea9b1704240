"""Shared cases of the self-speculative tests (ssd, spiffy, their compiled steps): tiny
block-diffusion models, the exact law of a first block, a chi-square p-value."""

from __future__ import annotations

import torch

import dspec
from dspec.models import AttentionPlan
from tiny_checkpoints import write_checkpoint


def weak_context(weights):
    """Scale the residual branches down: predictions depend less on the other slots, so
    drafts are often right and acceptance paths longer than 1 are exercised."""
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.3


def tiny(tmp_path_factory, family, **kw):
    path = tmp_path_factory.mktemp(f"{family}_ssd")
    return dspec.load(write_checkpoint(path, family, seed=5, vocab=64, **kw))


def exact_first_block(model, prompt, temperature):
    """P[a, b]: the exact law of the first generated block (block_size 2, both slots
    masked: len(prompt) even) under one-token-per-step sampling diffusion.

    The first step draws a token per slot and unmasks the more confident one (ties: slot 0):
    P(slot 0 first with a) = p0(a) P(p1(X1) <= p0(a)), P(slot 1 first with b) =
    p1(b) P(p0(X0) < p1(b)); the second step draws the other slot given the first.
    """
    vocab, mask = model.config.vocab_size, model.mask_token_id

    def probs(states):  # [R, 2] block states -> [R, 2, V]
        rows = states.shape[0]
        cache = model.new_cache(rows)
        out = model(model.plan([prompt] * rows, cache), logits="last")
        cache.append(out.suffix_kv)
        pos = cache.lengths[:, None] + torch.arange(2)
        logits = model(AttentionPlan(states, pos, None, cache), return_kv=False).logits.float()
        if model.shifted:
            logits = torch.cat([out.logits[:, -1:].float(), logits[:, :-1]], 1)
        return torch.softmax(logits / temperature, -1).double()

    p0, p1 = probs(torch.tensor([[mask, mask]]))[0]
    first0 = p0 * ((p1[None, :] <= p0[:, None]).double() * p1[None, :]).sum(1)
    first1 = p1 * ((p0[None, :] < p1[:, None]).double() * p0[None, :]).sum(1)
    ids = torch.arange(vocab)
    after0 = probs(torch.stack([ids, torch.full_like(ids, mask)], 1))[:, 1]  # [a, b]
    after1 = probs(torch.stack([torch.full_like(ids, mask), ids], 1))[:, 0]  # [b, a]
    law = first0[:, None] * after0 + (first1[:, None] * after1).T
    for eos in model.eos_token_ids:  # the output stops at an EOS in slot 0: pool its row
        row = law[eos].sum()
        law[eos] = 0.0
        law[eos, 0] = row
    return law


def sample_first_block(model, prompt, n, temperature, **kw):
    counts = torch.zeros(model.config.vocab_size, model.config.vocab_size, dtype=torch.float64)
    gens = dspec.generate(model, [prompt] * n, max_new_tokens=2, block_size=2, temperature=temperature, seed=11, **kw)
    for g in gens:
        counts[g.tokens[0], g.tokens[1] if len(g.tokens) > 1 else 0] += 1
    accepted = gens[0].stats.get("accepted_drafts", 0)
    return counts, accepted


def capture_caches(model, monkeypatch):
    made = []
    original = model.new_cache

    def new_cache(*args, **kw):
        cache = original(*args, **kw)
        made.append(cache)
        return cache

    monkeypatch.setattr(model, "new_cache", new_cache, raising=False)
    return made
