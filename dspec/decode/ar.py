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
    ``mean_accepted`` is 1.0 by definition (one committed token per target forward).

    Host synchronisation: the step (forward, next-token choice, cache append) reads nothing
    on the host; the tokens stay on the device until the end.  The loop reads one bool per
    step (have all requests hit EOS?) to stop early.
    """
    if model.attention != "causal":
        raise ValueError(f"method: 'ar' needs a causal LM; {model.family!r} attends {model.attention!r}: "
                         f"decode it with 'diffusion', 'ssd', 'spiffy' or 's2d2'")
    batch = len(prompts)
    device = model.device
    cache = model.new_cache(batch)
    plan = model.plan(prompts, cache)
    out = model(plan, logits="last")
    cache.append(out.suffix_kv, counts=plan.lengths)
    forwards = 1
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    produced = torch.zeros(batch, max_new_tokens, dtype=torch.int64, device=device)
    kept = torch.zeros(batch, max_new_tokens, dtype=torch.bool, device=device)   # before EOS
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    ones = [1] * batch
    token = next_tokens(out.logits[:, -1], temperature, generator)
    steps = 0
    for step in range(max_new_tokens):
        produced[:, step] = token
        kept[:, step] = ~done
        steps = step + 1
        done |= torch.isin(token, eos)
        if progress is not None:
            progress.update(1)
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        out = model(model.plan(token[:, None], cache), logits="last")
        cache.append(out.suffix_kv, counts=ones)
        forwards += 1
        token = next_tokens(out.logits[:, -1], temperature, generator)
    generated = [[t for t, k in zip(row, keep) if k]
                 for row, keep in zip(produced[:, :steps].tolist(), kept[:, :steps].tolist())]
    return generated, {"nfe": {"target": forwards}, "mean_accepted": 1.0}


OPTIONS = ()
DRAFTER = False
decode = decode_ar
