"""Block-diffusion decoding (SDAR / Fast-dLLM v2 style) with an exact KV cache.

Blocks are aligned on absolute positions (``position // block_size``, as the model's own
block-causal attention).  The prompt's complete blocks are committed to the cache in one
prefill forward; its tail shares the first generated block with [MASK] slots.  Every step
forwards the current block (bidirectional within it, the whole cached prefix before it),
predicts every masked slot and unmasks some of them:

- static schedule: the ``tokens_per_step`` most confident masked slots (1 = one token per
  step, the lossless reference of SSD and Spiffy);
- dynamic schedule (``threshold``, Fast-dLLM): every masked slot whose confidence reaches
  the threshold, and at least the single most confident one.

Confidence is the probability of the chosen token (the argmax when greedy; the sampled
token when ``temperature > 0``, drawn by the shared sampler).  Ties go to the lower slot.
A complete block is forwarded once more with its final tokens so the committed KV is
exactly that of the finished text.  Right-shifted models (Fast-dLLM v2, Dream) predict slot j
from the logits of slot j - 1 (slot 0 from the last committed position).

A batch runs block by block in lockstep; a request whose block is complete waits (its rows
are recomputed but unchanged), so a batch gives exactly what single runs give.
"""
from __future__ import annotations

import torch

from ..masks import block_diffusion
from ..models import AttentionPlan
from .sampling import next_tokens


def _confidence(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(-1, tokens[..., None])[..., 0].exp()


@torch.no_grad()
def decode_diffusion(model, prompts: list[list[int]], *, max_new_tokens: int,
                     temperature: float = 0.0, generator: torch.Generator | None = None,
                     eos_ids=(), progress=None, block_size: int | None = None,
                     tokens_per_step: int | None = None, threshold: float | None = None):
    if model.mask_token_id is None:
        raise ValueError(f"method 'diffusion' needs a masked-diffusion model; {model.family!r} has no mask token")
    if model.attention != "block_causal":
        raise ValueError(f"method 'diffusion' runs block-causal models (SDAR, Fast-dLLM v2) with an exact "
                         f"KV cache; {model.family!r} attends {model.attention!r}, which is not supported yet")
    bs = block_size or model.block_size
    if not isinstance(bs, int) or bs < 1:
        raise ValueError(f"block_size must be an int >= 1, got {bs!r}")
    if threshold is not None and tokens_per_step is not None:
        raise ValueError("give tokens_per_step (static schedule) or threshold (dynamic), not both")
    if threshold is not None and not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    per_step = tokens_per_step if tokens_per_step is not None else 1
    if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
        raise ValueError(f"tokens_per_step must be an int >= 1, got {per_step!r}")

    dev = model.device
    batch = len(prompts)
    mask_id = model.mask_token_id
    cache = model.new_cache(batch)
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    start = (plen // bs) * bs                      # first position of each request's first block
    carry = torch.zeros(batch, model.config.vocab_size, device=dev)  # logits of the last committed slot
    forwards = 0
    full = [p[: int(s)] for p, s in zip(prompts, start.tolist())]
    if any(full):
        # a prompt shorter than one block commits nothing (a stand-in token, count 0)
        out = model(model.plan([f or p[:1] for f, p in zip(full, prompts)], cache), logits="last")
        cache.append(out.suffix_kv, counts=[len(f) for f in full])
        carry = out.logits[:, -1].float()
        forwards += 1

    generated = [[] for _ in range(batch)]
    finished = torch.zeros(batch, dtype=torch.bool, device=dev)
    slots = torch.arange(bs, device=dev)
    block_mask = block_diffusion(bs, device=dev)
    while not bool(finished.all()):
        # the block's slots: prompt tail where it reaches into the block, [MASK] elsewhere
        block_start = cache.lengths.to(dev)
        pos = block_start[:, None] + slots
        tokens = torch.full((batch, bs), mask_id, dtype=torch.int64, device=dev)
        for b, p in enumerate(prompts):
            tail = [t for i, t in enumerate(p) if int(block_start[b]) <= i < int(block_start[b]) + bs]
            if tail:
                tokens[b, : len(tail)] = torch.tensor(tail, device=dev)
        masked = (pos >= plen[:, None]) & ~finished[:, None]
        while bool(masked.any()):
            out = model(AttentionPlan(tokens, pos, block_mask.words, cache), return_kv=False)
            forwards += 1
            logits = out.logits.float()
            if model.shifted:
                logits = torch.cat([carry[:, None], logits[:, :-1]], 1)
            flat = logits.reshape(batch * bs, -1)
            choice = next_tokens(flat, temperature, generator).view(batch, bs)
            conf = _confidence(logits, choice, temperature)
            conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
            order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, slots.expand(batch, -1))
            if threshold is not None:
                pick = masked & ((conf >= threshold) | (rank == 0))
            else:
                pick = masked & (rank < per_step)
            tokens = torch.where(pick, choice, tokens)
            masked &= ~pick
            if progress is not None:
                progress.update(int(pick.sum()) / batch)
        # commit the finished block with its final tokens (exact KV), carry its last logits
        out = model(AttentionPlan(tokens, pos, block_mask.words, cache), logits="last")
        forwards += 1
        cache.append(out.suffix_kv, counts=[bs] * batch)
        carry = out.logits[:, -1].float()
        for b in range(batch):
            if finished[b]:
                continue
            new = [int(t) for t, q in zip(tokens[b].tolist(), pos[b].tolist()) if q >= int(plen[b])]
            for t in new:
                if len(generated[b]) == max_new_tokens:
                    break
                generated[b].append(t)
                if t in eos_ids:
                    break
            done_eos = bool(generated[b]) and generated[b][-1] in eos_ids
            finished[b] = done_eos or len(generated[b]) >= max_new_tokens
    steps = max(forwards, 1)
    # mean_accepted: new tokens per model forward (prefill and block commits included)
    return generated, {"nfe": {"target": forwards},
                       "mean_accepted": sum(len(g) for g in generated) / batch / steps,
                       "block_size": bs, "schedule": "threshold" if threshold is not None else "static"}


OPTIONS = ("block_size", "tokens_per_step", "threshold")
DRAFTER = False
decode = decode_diffusion
