"""``dspec.generate``: one entry point for every decoding method."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from .ar import decode_ar
from .diffusion import decode_diffusion

METHODS = {"ar": decode_ar, "diffusion": decode_diffusion}
# DESIGN.md's methods that later work adds
PLANNED = ("ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd")
# the options each method takes (DESIGN.md's common names)
OPTIONS = {"ar": (), "diffusion": ("block_size", "tokens_per_step", "threshold")}


class Generation(NamedTuple):
    """text (decoded, special tokens dropped), tokens (generated ids, prompt excluded, up to
    and including the first EOS), stats (nfe per model, mean_accepted, wall_s,
    tokens_per_s, ...)."""

    text: str
    tokens: list
    stats: dict


def _prompt_ids(model, prompt) -> list[int]:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        ids = model.tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in (prompt.tolist() if torch.is_tensor(prompt) else prompt)]
    if not ids:
        raise ValueError("the prompt is empty")
    vocab = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab})")
    return ids


def generate(model, prompt, *, method: str, max_new_tokens: int, drafter=None,
             temperature: float = 0.0, seed: int | None = None, progress: bool = False,
             **options):
    """Decode ``prompt`` (a string, token ids, or a list of either for one batch) with ``method``.

    Returns a :class:`Generation` (a list of them for a list of prompts).  ``stats['nfe']``
    counts model forwards per model; ``tokens_per_s`` counts generated tokens over the whole
    call's wall time (prefill included).

    Example
    -------
    >>> import dspec
    >>> model = dspec.load("smollm2-135m")                                   # doctest: +SKIP
    >>> dspec.generate(model, "def add(a, b):", method="ar", max_new_tokens=16).text  # doctest: +SKIP
    """
    if method not in METHODS:
        if method in PLANNED:
            raise ValueError(f"method {method!r} is not implemented yet; available: {sorted(METHODS)}")
        raise ValueError(f"unknown method {method!r}; available: {sorted(METHODS)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if drafter is not None:
        raise ValueError(f"method {method!r} takes no drafter")
    unknown = sorted(set(options) - set(OPTIONS[method]))
    if unknown:
        raise ValueError(f"method {method!r} does not take {unknown}; it takes {list(OPTIONS[method])}")
    batched = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)
    prompts = [_prompt_ids(model, p) for p in (prompt if batched else [prompt])]
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=model.device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens, desc=f"{method} decode", unit="tok")
    start = time.perf_counter()
    tokens, stats = METHODS[method](model, prompts, max_new_tokens=max_new_tokens,
                                    temperature=temperature, generator=generator,
                                    eos_ids=model.eos_token_ids, progress=bar, **options)
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    results = []
    total = sum(len(t) for t in tokens)
    for ids in tokens:
        text = model.tokenizer.decode(ids) if model.tokenizer is not None else ""
        s = dict(stats, wall_s=wall, new_tokens=len(ids), batch_size=len(prompts),
                 tokens_per_s=total / wall if wall > 0 else float("inf"))
        results.append(Generation(text, ids, s))
    return results if batched else results[0]
