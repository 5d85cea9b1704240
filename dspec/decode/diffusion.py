"""Block diffusion decoding for masked-diffusion LMs: block-causal models with an exact KV
cache, and fully bidirectional models (LLaDA, Dream) by semi-autoregressive sampling.

Both paths share the step rule.  Every step predicts every still-masked slot of the current
block and unmasks some of them:

- static schedule: the ``tokens_per_step`` most confident masked slots (1 = one token per
  step, the lossless reference of SSD and Spiffy; the last step of a block takes what is
  left);
- dynamic schedule (``threshold``, Fast-dLLM): every masked slot whose confidence reaches
  the threshold, and at least the single most confident one.

Confidence is the probability of the chosen token (the argmax when greedy; the sampled
token when ``temperature > 0``, drawn by the shared sampler).  Ties go to the lower slot.
Right-shifted models (Fast-dLLM v2, Dream) predict slot j from the logits of slot j - 1.

**Block-causal models** (SDAR, Fast-dLLM v2).  Blocks are aligned on absolute positions
(``position // block_size``, as the model's own block-causal attention).  The prompt's
complete blocks are committed to the cache in one prefill forward; its tail shares the first
generated block with [MASK] slots.  Every step forwards the current block (bidirectional
within it, the whole cached prefix before it).  A complete block's KV is that of its final
tokens: the first step of the next block forwards it again, as a committed block in front of
the new one (block-causal: it sees itself and the prefix, the new block sees it), appends
its keys and values and takes its last logits -- a right-shifted model's prediction for slot
0 -- from that forward, so a block costs its steps and no commit forward of its own.  (The
C++ attention gives those rows the bits of a separate commit forward: each row sees the
first keys of the suffix, at the key indices of its positions.)  A batch runs block by block
in lockstep; a request whose block is complete waits (its rows are recomputed but
unchanged), so a batch gives exactly what single runs give.

**Bidirectional models** (LLaDA, Dream).  Every position attends to every other one, so a
committed token's keys change whenever any [MASK] after it is filled: there is no exact KV
cache, and every step forwards the whole sequence, as in LLaDA's semi-autoregressive
sampler (Nie et al. 2025, "Large Language Diffusion Models", Sec. 2.4 / Appendix B):

- the sequence is the prompt followed by a *generation region* of
  ``ceil(max_new_tokens / block_size) * block_size`` [MASK] slots (LLaDA samples a fixed
  generation length that is a whole number of blocks; the region is ``max_new_tokens``
  rounded up to whole blocks);
- blocks are counted **from the end of the prompt** (block k holds region slots
  ``[k * block_size, (k + 1) * block_size)``), as LLaDA does, not on absolute positions;
- blocks are unmasked left to right; slots of later blocks stay [MASK] (and are seen as
  such by the model) until their block is current;
- the [MASK] id is never chosen (its logit is set to -inf before the choice), since an
  unmasked slot holding it would read as masked;
- EOS: LLaDA fills the rest of the region with EOS once it has decided to stop; the output
  is the region cut after its first EOS, and at ``max_new_tokens``.  A request stops as
  soon as that output is decided, i.e. every slot up to its first unmasked EOS (or up to
  ``max_new_tokens``) is unmasked: later steps cannot change those slots, so the result is
  exactly that of sampling the whole region, with fewer forwards.
- ``block_size`` defaults to the model's own, else 32 (LLaDA's semi-autoregressive
  evaluation setting).

A ragged batch is right-padded by ``model.plan`` (padding sees only itself and no token sees
it, positions are per request), so each request's logits are those of its own single run;
requests advance independently (each in its own block) and a finished request leaves the
batch, so a batch gives exactly what single runs give (greedy).

Host syncs: the block-causal path reads the block state once per step; the bidirectional
path reads one flag per step (whether a request finished), to shrink the batch and stop,
plus one count when a progress bar is given -- the step itself (choice, confidence, ranking,
unmasking, the finished test) stays on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from ..masks import block_diffusion
from ..models import AttentionPlan
from ..ops import pack_mask
from .bounds import check_rows
from .outputs import OutputBuffer
from .sampling import request_streams
from .unmask import choose, pick_slots, rank_masked

#: block size used for a bidirectional model when neither the call nor the model gives one
DEFAULT_BIDIRECTIONAL_BLOCK_SIZE = 32


def _schedule(block_size, tokens_per_step, threshold, default_block_size) -> tuple[int, int]:
    """Validate the options; returns (block size, tokens per static step)."""
    bs = block_size if block_size is not None else default_block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(
            f"block_size must be an int >= 1, got {bs!r}"
            + ("" if block_size is not None else " (the model gives no default: pass block_size)")
        )
    if threshold is not None and tokens_per_step is not None:
        raise ValueError("give tokens_per_step (static schedule) or threshold (dynamic), not both")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) <= 1.0
    ):
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}")
    per_step = tokens_per_step if tokens_per_step is not None else 1
    if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
        raise ValueError(f"tokens_per_step must be an int >= 1, got {per_step!r}")
    return bs, per_step


class PromptTails:
    """The prompts left-aligned on the device, so that a block reaching into a prompt (the
    first decoded one) is one gather for the whole batch: :meth:`block`."""

    def __init__(self, prompts: list[list[int]], mask_id: int, block_size: int, device):
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        width = int(self.lengths.max())
        buf = torch.full((len(prompts), width), mask_id, dtype=torch.int64)
        buf[torch.arange(width)[None] < self.lengths[:, None]] = torch.tensor(
            [t for p in prompts for t in p], dtype=torch.int64
        )
        self.tokens, self.lengths = buf.to(device), self.lengths.to(device)
        self.mask_id = mask_id
        self.slots = torch.arange(block_size, device=device)

    def block(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks starting at positions ``start`` [B]: (tokens [B, bs] -- the prompt's
        where it reaches into the block, [MASK] elsewhere --, in_prompt bool [B, bs])."""
        pos = start[:, None] + self.slots
        in_prompt = pos < self.lengths[:, None]
        tail = self.tokens.gather(1, pos.clamp(max=self.tokens.shape[1] - 1))
        return torch.where(in_prompt, tail, self.mask_id), in_prompt


def prefill_prompt_blocks(model, prompts: list[list[int]], cache, bs: int) -> tuple[torch.Tensor, int]:
    """Commit every prompt's complete blocks (block size ``bs``) to ``cache`` in one forward.

    Returns ``(carry, forwards)``: the float32 logits [B, V] of each request's last committed
    slot (what a right-shifted model reads for its next block's first slot; zeros when no
    prompt fills a block) and the forwards spent (0 or 1).  Block-causal attention uses the
    decoding block size, so the committed blocks match the decoded ones.
    """
    carry = torch.zeros(len(prompts), model.config.vocab_size, device=model.device)
    full = [p[: (len(p) // bs) * bs] for p in prompts]
    if not any(full):
        return carry, 0
    # a prompt shorter than one block commits nothing (a stand-in token, count 0)
    out = model(model.plan([f or p[:1] for f, p in zip(full, prompts)], cache, block_size=bs), logits="last")
    cache.append(out.suffix_kv, counts=[len(f) for f in full])
    return out.logits[:, -1].float(), 1


@torch.no_grad()
def decode_diffusion(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_ids=(),
    progress=None,
    block_size: int | None = None,
    tokens_per_step: int | None = None,
    threshold: float | None = None,
):
    """Block diffusion decoding of a ragged batch; returns (tokens per request, stats).

    Parameters
    ----------
    model : a masked-diffusion ``Model`` (``model.mask_token_id`` set) whose attention is
        ``"block_causal"`` (SDAR, Fast-dLLM v2) or ``"bidirectional"`` (LLaDA, Dream).
    prompts : B lists of prompt token ids (ragged).
    max_new_tokens : generated tokens per request at most (EOS included).
    temperature, generator : <= 0 greedy; else sampling with the shared sampler.
    eos_ids : ids that end a request (kept in its output).
    progress : a tqdm bar advanced by generated tokens per request, or None.
    block_size : denoising block length (default: the model's; 32 for bidirectional
        models without one).  Bounded by the context (:mod:`dspec.decode.bounds`): a
        block-causal step forwards up to two blocks (the finished one and the next), so
        the longest prompt + 2 * block_size must fit ``max_position_embeddings``; a
        bidirectional step forwards the prompt and the generation region
        (``max_new_tokens`` rounded up to whole blocks), which must fit it too.
    tokens_per_step : static schedule, slots unmasked per step (default 1).
    threshold : dynamic schedule in (0, 1] (exclusive with ``tokens_per_step``).

    Returns
    -------
    tokens : B lists of generated ids (prompt excluded, up to and including the first EOS).
    stats : ``nfe`` ({"target": batched model forwards}), ``mean_accepted`` (generated
        tokens per request per model forward of that request; prefill and block commits
        included), ``block_size``, ``schedule`` ("static" | "threshold"), ``attention``;
        for bidirectional models also ``gen_length`` (the region length) and
        ``request_forwards`` (forwards each request took part in).
    """
    if model.mask_token_id is None:
        raise ValueError(f"method 'diffusion' needs a masked-diffusion model; {model.family!r} has no mask token")
    if model.attention == "bidirectional":
        bs, per_step = _schedule(
            block_size, tokens_per_step, threshold, model.block_size or DEFAULT_BIDIRECTIONAL_BLOCK_SIZE
        )
        check_rows(
            model,
            prompts,
            "block_size",
            bs,
            -(-max_new_tokens // bs) * bs,
            "the generation region (max_new_tokens rounded up to whole blocks)",
        )
        return _decode_bidirectional(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
            eos_ids=eos_ids,
            progress=progress,
            bs=bs,
            per_step=per_step,
            threshold=threshold,
        )
    if model.attention != "block_causal":
        raise ValueError(
            f"method 'diffusion' runs block-causal (SDAR, Fast-dLLM v2) or bidirectional "
            f"(LLaDA, Dream) models; {model.family!r} attends {model.attention!r}"
        )
    bs, per_step = _schedule(block_size, tokens_per_step, threshold, model.block_size)
    check_rows(model, prompts, "block_size", bs, 2 * bs, "2 * block_size")
    return _decode_block_causal(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        eos_ids=eos_ids,
        progress=progress,
        bs=bs,
        per_step=per_step,
        threshold=threshold,
    )


def _decode_block_causal(
    model, prompts, *, max_new_tokens, temperature, generator, eos_ids, progress, bs, per_step, threshold
):
    """Block-causal models with an exact KV cache (see the module docstring).  A request stops
    decoding its block once the block's committed run from its first generated slot holds an
    EOS or reaches ``max_new_tokens`` (the later slots would never be output)."""
    dev = model.device
    batch = len(prompts)
    mask_id = model.mask_token_id
    streams = request_streams(generator, batch, dev)  # one random stream per request
    cache = model.new_cache(batch)
    carry, forwards = prefill_prompt_blocks(model, prompts, cache, bs)

    outputs = OutputBuffer(batch, max_new_tokens, eos_ids)
    tails = PromptTails(prompts, mask_id, bs, dev)
    requests = np.arange(batch)
    prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
    finished = torch.zeros(batch, dtype=torch.bool, device=dev)
    slots = torch.arange(bs, device=dev)
    block_mask = block_diffusion(bs, device=dev)
    # the finished block and the next one: each block sees itself, the second also the first
    two = torch.arange(2 * bs, device=dev) // bs
    pair_mask = pack_mask(two[:, None] >= two[None, :])
    new_rows = (bs + slots - (1 if model.shifted else 0))[None].expand(batch, -1)
    pending = None  # the finished block not yet in the cache
    while not bool(finished.all()):
        # the block's slots: prompt tail where it reaches into the block, [MASK] elsewhere
        block_start = cache.lengths.to(dev) + (0 if pending is None else bs)
        pos = block_start[:, None] + slots
        tokens, in_prompt = tails.block(block_start)
        masked = ~in_prompt & ~finished[:, None]
        while bool(masked.any()):
            if pending is None:
                out = model(AttentionPlan(tokens, pos, block_mask.words, cache), return_kv=False)
                logits = out.logits.float()
                if model.shifted:
                    logits = torch.cat([carry[:, None], logits[:, :-1]], 1)
            else:  # commit the finished block in this step
                prev_tokens, prev_pos = pending
                out = model(
                    AttentionPlan(torch.cat([prev_tokens, tokens], 1), torch.cat([prev_pos, pos], 1), pair_mask, cache),
                    logits=new_rows,
                    return_kv=True,
                )
                cache.append(out.suffix_kv, counts=[bs] * batch)
                logits = out.logits.float()  # the new block's slots (shifted: rows bs-1 ..)
                carry = logits[:, 0] if model.shifted else carry
                pending = None
            forwards += 1
            # a draw per slot, advancing only the rows still unmasking (a row whose block is
            # done waits for the others without drawing, as it would not step alone)
            u = None if streams is None else streams.uniforms(requests, bs, advance=masked.any(1).cpu())
            choice, conf = choose(logits, temperature, uniforms=u)
            conf_m, _, rank = rank_masked(conf, masked)
            pick = pick_slots(masked, conf_m, rank, threshold=threshold, per_step=per_step)
            tokens = torch.where(pick, choice, tokens)
            masked &= ~pick
            if progress is not None:
                progress.update(int(pick.sum()) / batch)
            # a request whose committed run reaches an EOS or max_new_tokens stops decoding
            # its block: the later slots are never output
            host = torch.cat([tokens, masked.long(), block_start[:, None]], 1).cpu().numpy()  # one read
            ended = outputs.block_ends(requests, host[:, :bs], host[:, bs : 2 * bs] == 0, host[:, 2 * bs], prompt_len)
            if ended.any():
                masked &= ~torch.from_numpy(ended).to(dev)[:, None]
        pending = (tokens, pos)  # committed by the next block's first step
        live = np.flatnonzero(~finished.cpu().numpy())
        done = outputs.extend_block(
            requests[live], tokens.cpu().numpy()[live], block_start.cpu().numpy()[live], prompt_len[live]
        )
        finished[torch.from_numpy(live[done]).to(dev)] = True
    generated = outputs.generated
    steps = max(forwards, 1)
    # mean_accepted: new tokens per model forward (prefill and block commits included)
    return generated, {
        "nfe": {"target": forwards},
        "mean_accepted": sum(len(g) for g in generated) / batch / steps,
        "block_size": bs,
        "schedule": "threshold" if threshold is not None else "static",
        "attention": "block_causal",
    }


def _decode_bidirectional(
    model, prompts, *, max_new_tokens, temperature, generator, eos_ids, progress, bs, per_step, threshold
):
    """Bidirectional models, LLaDA's semi-autoregressive sampler (see the module docstring)."""
    dev = model.device
    batch = len(prompts)
    mask_id = model.mask_token_id
    streams = request_streams(generator, batch, dev)  # one random stream per request
    num_blocks = -(-max_new_tokens // bs)
    region = num_blocks * bs  # generation region length
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
    # right-padded plan of prompt + region; its mask hides the padding, positions per request
    plan = model.plan([list(p) + [mask_id] * region for p in prompts])
    canvas = plan.tokens.clone()  # [B, N] the sequences being denoised
    undecided = torch.ones(batch, region, dtype=torch.bool, device=dev)  # region slot still [MASK]
    block = torch.zeros(batch, dtype=torch.int64, device=dev)  # current block per request
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=dev)
    slots = torch.arange(bs, device=dev)
    region_slots = torch.arange(region, device=dev)
    shift = 1 if model.shifted else 0
    forwards = 0
    request_forwards = torch.zeros(batch, dtype=torch.int64, device=dev)
    decided_out = torch.zeros(batch, dtype=torch.int64, device=dev)  # for the progress bar

    rows = torch.arange(batch, device=dev)  # requests still running
    while rows.numel():
        tokens = canvas[rows, : plan.tokens.shape[1]]
        first = plen[rows] + block[rows] * bs  # current block's first position
        pos = first[:, None] + slots  # [A, bs] canvas columns
        # only the current block's logits (a right-shifted model reads each slot's left neighbour)
        out = model(
            AttentionPlan(tokens, plan.positions, plan.mask, None, plan.lengths), logits=pos - shift, return_kv=False
        )
        forwards += 1
        request_forwards[rows] += 1
        logits = out.logits.float()
        logits[..., mask_id] = float("-inf")  # never "unmask" to [MASK]
        # every running row steps: a draw per slot of its current block
        choice, conf = choose(
            logits, temperature, uniforms=None if streams is None else streams.uniforms(rows.cpu(), bs)
        )
        region_pos = block[rows, None] * bs + slots  # [A, bs] region slots
        masked = undecided[rows].gather(1, region_pos)
        conf_m, _, rank = rank_masked(conf, masked)
        pick = pick_slots(masked, conf_m, rank, threshold=threshold, per_step=per_step)
        current = tokens.gather(1, pos)
        canvas[rows[:, None], pos] = torch.where(pick, choice, current)
        still = masked & ~pick
        undecided[rows[:, None], region_pos] = still
        block[rows] += (~still.any(1)).to(torch.int64)  # a complete block hands over

        # a request is done once its output is decided: every slot up to its first unmasked
        # EOS (or up to max_new_tokens) unmasked
        und = undecided[rows]
        gen = canvas[rows[:, None], plen[rows, None] + region_slots]
        leading = torch.cumprod((~und).to(torch.int64), 1).sum(1)  # unmasked prefix length
        is_eos = torch.isin(gen, eos) & ~und
        first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1), region)
        end = torch.clamp(first_eos + 1, max=max_new_tokens)
        done = leading >= end
        if progress is not None:
            now = torch.minimum(leading, end)
            progress.update(float((now - decided_out[rows]).sum()) / batch)
            decided_out[rows] = now
        if bool(done.any()):  # the one host sync per step
            rows = rows[~done]
            if rows.numel():
                lens = (plen[rows] + region).cpu()
                plan = model.plan(canvas[rows, : int(lens.max())], lengths=lens)
    generated = []
    for b in range(batch):
        gen = canvas[b, int(plen[b]) : int(plen[b]) + max_new_tokens].tolist()
        for i, t in enumerate(gen):
            if t in eos_ids:
                gen = gen[: i + 1]
                break
        generated.append(gen)
    total_request_forwards = max(int(request_forwards.sum()), 1)
    # mean_accepted: new tokens per request forward (every forward is a full-sequence step)
    return generated, {
        "nfe": {"target": forwards},
        "mean_accepted": sum(len(g) for g in generated) / total_request_forwards,
        "block_size": bs,
        "schedule": "threshold" if threshold is not None else "static",
        "attention": "bidirectional",
        "gen_length": region,
        "request_forwards": request_forwards.tolist(),
    }


OPTIONS = ("block_size", "tokens_per_step", "threshold")
DRAFTER = False
PAPER = {}  # preset="paper": the defaults are the block-diffusion decoding the dLLMs publish
decode = decode_diffusion
