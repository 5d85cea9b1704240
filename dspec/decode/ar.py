"""Autoregressive decoding with the KV cache: the baseline every method is compared with."""

from __future__ import annotations

import torch

from .sampling import next_tokens, non_finite_error, request_streams


@torch.no_grad()
def decode_ar(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_ids=(),
    progress=None,
):
    """Greedy or sampled decoding of a ragged batch; returns (tokens per request, stats).

    One prefill forward for the whole batch, then one forward per generated token.
    A request stops after its first EOS (kept in its output) or at ``max_new_tokens``.
    ``mean_accepted`` is 1.0 by definition (one committed token per target forward).

    Requests that hit EOS leave the batch once they are a quarter of it (their cache rows
    are dropped), so a ragged batch does not compute finished rows until its longest
    request ends.

    Host synchronisation: the step (forward, next-token choice, cache append) reads nothing
    on the host; the tokens stay on the device until the end.  The loop reads two counts per
    step in one read (how many requests have hit EOS, to stop early and to drop finished
    requests; how many tokens are -1, the ops' mark of a non-finite logits row: ValueError,
    :func:`dspec.decode.sampling.require_finite`).
    """
    if model.attention != "causal":
        raise ValueError(
            f"method: 'ar' needs a causal LM; {model.family!r} attends {model.attention!r}: "
            f"decode it with 'diffusion', 'ssd', 'spiffy' or 's2d2'"
        )
    batch = len(prompts)
    device = model.device
    streams = request_streams(generator, batch, device)  # one random stream per request
    cache = model.new_cache(batch)
    plan = model.plan(prompts, cache)
    out = model(plan, logits="last")
    cache.append(out.suffix_kv, counts=plan.lengths)
    forwards = 1
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    produced = torch.zeros(batch, max_new_tokens, dtype=torch.int64, device=device)
    kept = torch.zeros(batch, max_new_tokens, dtype=torch.bool, device=device)  # before EOS
    active = torch.arange(batch, device=device)  # the requests still in the batch
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # per active row: EOS seen
    ones = [1] * batch
    requests = list(range(batch))  # active, on the host (the streams' rows)

    def uniforms():
        return None if streams is None else streams.uniforms(requests, 1)[:, 0]

    token = next_tokens(out.logits[:, -1], temperature, uniforms=uniforms(), check=False)
    steps = 0
    for step in range(max_new_tokens):
        produced[active, step] = token
        kept[active, step] = ~done
        steps = step + 1
        done |= torch.isin(token, eos)
        if progress is not None:
            progress.update(1)
        n_done, n_bad = torch.stack([done.sum(), (token < 0).sum()]).tolist()
        if n_bad:
            raise non_finite_error()
        if step + 1 == max_new_tokens or n_done == len(active):
            break
        if n_done * 4 >= len(active):
            # finished requests leave the batch once they are a quarter of it (one cache
            # copy), instead of being computed until the longest request ends
            keep = (~done).nonzero()[:, 0]
            cache = cache.select(keep.tolist())
            active, token, done = active[keep], token[keep], done[keep]
            requests = [requests[i] for i in keep.tolist()]
            ones = [1] * len(active)
        out = model(model.plan(token[:, None], cache), logits="last")
        cache.append(out.suffix_kv, counts=ones)
        forwards += 1
        token = next_tokens(out.logits[:, -1], temperature, uniforms=uniforms(), check=False)
    generated = [
        [t for t, k in zip(row, keep) if k] for row, keep in zip(produced[:, :steps].tolist(), kept[:, :steps].tolist())
    ]
    return generated, {"nfe": {"target": forwards}, "mean_accepted": 1.0}


OPTIONS = ()
DRAFTER = False
PAPER = {}  # preset="paper": ar has no options
decode = decode_ar
