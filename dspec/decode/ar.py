"""Autoregressive decoding with the KV cache: the baseline every method is compared with."""
from __future__ import annotations

import torch

from .sampling import next_tokens


@torch.no_grad()
def decode_ar(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, eos_ids=(), progress=None):
    """Greedy or sampled decoding of a ragged batch; returns (tokens per request, stats).

    One prefill forward for the whole batch, then one forward per generated token.
    A request stops after its first EOS (kept in its output) or at ``max_new_tokens``.
    """
    batch = len(prompts)
    cache = model.new_cache(batch)
    plan = model.plan(prompts, cache)
    out = model(plan, logits="last")
    cache.append(out.suffix_kv, counts=plan.lengths)
    forwards = 1
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=model.device)
    generated = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=model.device)
    token = next_tokens(out.logits[:, -1], temperature, generator)
    for step in range(max_new_tokens):
        for b in range(batch):
            if not done[b]:
                generated[b].append(int(token[b]))
        done |= torch.isin(token, eos)
        if progress is not None:
            progress.update(1)
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        out = model(model.plan(token[:, None], cache), logits="last")
        cache.append(out.suffix_kv, counts=[1] * batch)
        forwards += 1
        token = next_tokens(out.logits[:, -1], temperature, generator)
    return generated, {"nfe": {"target": forwards}, "mean_accepted": 1.0}


OPTIONS = ()
DRAFTER = False
decode = decode_ar
