"""``dspec.generate``: one entry point for every decoding method."""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import math
import operator
import os
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from .. import _validate, cpu
from ..models.stack import frozen_weights
from .sampling import RequestStreams

# DESIGN.md's methods, each one module of dspec.decode with the same name.  A method module
# defines
#   OPTIONS: tuple[str, ...]   the keyword options it takes (DESIGN.md's common names first)
#   DRAFTER: False | "model" | "block"  whether it takes ``drafter=`` (None: the shipped
#                              default) and what: a model (dspec.load) or a block drafter
#                              (a BlockDrafter, its directory or a shipped drafter name)
#   decode(model, prompts, *, max_new_tokens, temperature, generator, eos_ids, progress,
#          [drafter,] **options) -> (tokens: list[list[int]], stats: dict)
# where ``prompts`` are lists of ids (a batch), ``generator`` is None when greedy, else a
# ``sampling.RequestStreams`` (one random stream per request; a torch.Generator is accepted too),
# ``progress`` a tqdm bar (or None) to advance by generated tokens per request, and stats
# hold at least ``nfe`` ({model role: forwards}) and ``mean_accepted``.
ALL_METHODS = ("ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd")
# the largest seed: torch.Generator.manual_seed takes an unsigned 64-bit integer
MAX_SEED = 2**64 - 1


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for one decode call (it was on before: back on
    after).  A decode loop makes thousands of short-lived tensors, freed by reference
    counting, and the collector's periodic passes over every live object (the model's
    modules, the tokenizer's tables) took 2-3 % of a step's samples (perf); same-process A/B,
    SmolLM2-135M, 4 prompts x 96 tokens x 3 reps: ``dflash`` +7 %, ``ssd`` +9 %."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def method_module(method: str) -> ModuleType:
    """The module implementing ``method``; ValueError when unknown."""
    if not isinstance(method, str) or method not in ALL_METHODS:
        raise ValueError(f"method: unknown method {method!r}; available: {list(ALL_METHODS)}")
    return importlib.import_module(f"{__package__}.{method}")


def available_methods() -> tuple[str, ...]:
    """Every decoding method, in DESIGN.md order."""
    return ALL_METHODS


class _Methods:
    """Read-only mapping name -> decode function over the implemented methods."""

    def __iter__(self):
        return iter(available_methods())

    def __contains__(self, name) -> bool:
        return name in available_methods()

    def __getitem__(self, name):
        return method_module(name).decode

    def __len__(self) -> int:
        return len(available_methods())

    def keys(self):
        return available_methods()


METHODS = _Methods()


class Generation(NamedTuple):
    """text (decoded, special tokens dropped), tokens (generated ids, prompt excluded, up to
    and including the first EOS), stats (nfe per model, mean_accepted, wall_s,
    tokens_per_s, ...)."""

    text: str
    tokens: list
    stats: dict


_PROMPT_FORMS = (
    "a str, a list of int token ids or a 1-D integer tensor / array (for a batch: a list of those, or a 2-D tensor)"
)


def _jsonable(value):
    """An option's value as strict JSON takes it: numbers, strings, bools, None and lists of
    them as they are (a non-finite float becomes None: "off" / "never"), anything else
    (a drafter graph object, a tensor) its type's name."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return type(value).__name__


PRESETS = ("paper",)


def check_preset(preset) -> None:
    """ValueError naming ``preset`` unless it is None or one of :data:`PRESETS`."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset must be None or one of {PRESETS}, got {preset!r}")


def preset_options(module, model, preset, given: dict) -> dict:
    """The options ``preset`` sets for the method of ``module`` (given the options the caller
    passed, which take precedence over them): {} for None; ``"paper"``: the module's
    ``paper_options(model, given)`` or its ``PAPER`` dict."""
    check_preset(preset)
    if preset is None:
        return {}
    if hasattr(module, "paper_options"):
        return dict(module.paper_options(model, given))
    return dict(getattr(module, "PAPER", {}))


def _resolved_options(module, given: dict, stats: dict) -> dict:
    """Every option of ``module.OPTIONS`` as this call used it: what the method reports
    (``stats["options"]`` first, then a top-level stat of the same name: the value its
    "auto" resolved to), else the value given, else the decode function's default."""
    params = inspect.signature(module.decode).parameters
    reported = stats.get("options") or {}
    out = {}
    for name in module.OPTIONS:
        if name in reported:
            value = reported[name]
        elif name in stats and not isinstance(stats[name], dict):
            value = stats[name]
        elif name in given:
            value = given[name]
        else:
            default = params[name].default if name in params else None
            value = None if default is inspect.Parameter.empty else default
        out[name] = _jsonable(value)
    return out


def _is_prompt(p) -> bool:
    """Whether ``p`` is one prompt's form (what a batch is a list of)."""
    return isinstance(p, (str, bytes, bytearray, memoryview, list, tuple)) or (
        (torch.is_tensor(p) or isinstance(p, np.ndarray)) and p.ndim == 1
    )


def _prompt_ids(model, prompt, where: str = "prompt") -> list[int]:
    """One prompt as token ids; ValueError naming ``where`` for anything else (bytes
    included: iterating them would read each byte as a token id)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"{where}: bytes are not a prompt (each byte would be read as a token id); pass "
            f"a str (prompt.decode()) or a list of int token ids"
        )
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError(f"{where}: this model has no tokenizer; pass the prompt as token ids")
        ids = model.tokenizer.encode(prompt)
    else:
        if torch.is_tensor(prompt) or isinstance(prompt, np.ndarray):
            integer = (
                not (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool)
                if torch.is_tensor(prompt)
                else np.issubdtype(prompt.dtype, np.integer)
            )
            if prompt.ndim != 1 or not integer:
                raise ValueError(
                    f"{where}: a tensor / array prompt must be 1-D integer token ids (a 2-D "
                    f"tensor is a batch, one row per prompt), got {prompt.dtype} {list(prompt.shape)}"
                )
            prompt = prompt.tolist()
        elif not isinstance(prompt, (list, tuple)):
            raise ValueError(f"{where} must be {_PROMPT_FORMS}, got {type(prompt).__name__}")
        try:
            if any(isinstance(t, (bool, np.bool_)) for t in prompt):
                raise TypeError
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError(f"{where} must be {_PROMPT_FORMS}, got {prompt!r:.80}") from None
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    vocab = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"{where}: prompt ids must lie in [0, {vocab})")
    return ids


def _check_model(model, name: str = "model") -> None:
    """``model`` is a loaded dspec model with data (ValueError naming ``name`` otherwise)."""
    from ..models.transformer import Model

    if isinstance(model, (str, os.PathLike)):
        raise ValueError(
            f"{name} must be a loaded model: generate takes dspec.load({os.fspath(model)!r}), not a name or path"
        )
    if not isinstance(model, Model):
        raise ValueError(f"{name} must be a dspec model (dspec.load(...)), got {type(model).__name__}")
    if any(t.is_meta for t in model.parameters()):
        raise ValueError(
            f"{name}: its weights are on the meta device (no data to decode with); load it with "
            f"dspec.load(..., device='cpu') or 'cuda'"
        )


def _check_model_drafter(method: str, drafter) -> None:
    """The ``drafter=`` of a method that drafts with a model (``DRAFTER == "model"``): None,
    a dspec model, or a checkpoint directory / shipped model name that ``dspec.load`` takes.
    ValueError naming ``drafter`` and what it takes otherwise; whether the model fits the
    target (block diffusion, same tokenizer) is the method's check."""
    from ..models.dflash import ASSETS as DRAFTER_ASSETS, BlockDrafter
    from ..models.transformer import Model

    takes = (
        f"method {method!r} drafts with a block-diffusion model (a dLLM sharing the target's tokenizer): "
        f"a dspec model, its checkpoint directory or a shipped model name such as 'tiny-bd'"
    )
    block = " (a block drafter: those draft in methods 'dflash' and 'd2sd')"
    if drafter is None:
        return
    if isinstance(drafter, Model):
        _check_model(drafter, "drafter")
        return
    if isinstance(drafter, (str, os.PathLike)) and isinstance(os.fspath(drafter), str) and os.fspath(drafter):
        from ..hub import ADAPTED, SHIPPED, available_models

        name = os.fspath(drafter)
        if name in SHIPPED or name in ADAPTED or Path(name).expanduser().is_dir():
            return
        hint = block if "/" not in name and (DRAFTER_ASSETS / name).is_dir() else ""
        raise ValueError(
            f"drafter: {takes}; {name!r} is neither a checkpoint directory nor a shipped model "
            f"({available_models()}){hint}"
        )
    hint = block if isinstance(drafter, BlockDrafter) else ""
    raise ValueError(f"drafter: {takes}; got {type(drafter).__name__}{hint}")


def generate(
    model,
    prompt,
    *,
    method: str,
    max_new_tokens: int,
    drafter=None,
    temperature: float = 0.0,
    seed: int | None = None,
    progress: bool = False,
    preset: str | None = None,
    **options,
):
    """Decode ``prompt`` (a string, token ids, or a list of either for one batch) with ``method``.

    Returns a :class:`Generation` (a list of them for a list of prompts).  ``stats['nfe']``
    counts model forwards per model; ``tokens_per_s`` counts generated tokens over the whole
    call's wall time (prefill included).

    Every argument is checked before any forward, with a ValueError naming it: ``model``
    must be a loaded dspec model with data (a name or path is not loaded here: call
    ``dspec.load`` first; meta tensors are refused), ``prompt`` one of the forms above
    (bytes are refused: they would read as token ids), ``seed`` None or an int in
    [0, 2**64 - 1], ``drafter`` what the method drafts with.

    Sampling (``temperature > 0``) gives each request its own random stream, so a batch
    decodes as its requests one by one: with ``seed=s``, request i of a batch gives exactly
    the single call ``generate(model, prompt_i, seed=dspec.decode.sampling.request_seed(s, i))``
    (``request_seed(s, 0) == s``: a batch's first request is the single call with ``seed=s``),
    whatever the other requests are and when they finish.  (The batch's forwards must give
    each row's logits as a single call does: fp32, or the CPU's row-invariant kernels.)
    Limits, where a method decides per batch, not per request: ``s2d2`` with
    ``redraft="auto"`` (off above 2 requests on a CPU; pass True or False) or
    ``policy="ucb"`` (its bandit learns from every row), ``dflash`` / ``d2sd`` with a
    ``row_cost`` (one verify length or tree size for the batch; pass ``row_cost=None``) and
    ``d2sd`` with ``redraft_min > 0`` (a cycle where no row re-drafts is DFlash's own).  ``seed=None`` draws
    fresh OS entropy; the global RNG is never read or reseeded.

    ``preset="paper"`` runs the method as its paper publishes it: the method module's
    ``PAPER`` settings (or its ``paper_options``) in place of dspec's device-dependent
    defaults -- no draft trees, prompt-lookup branches or redraft blocks where the paper has
    none, every draft verified -- with the options given explicitly still taking precedence;
    ``stats["preset"]`` names it and ``stats["options"]`` lists what ran.  None (default):
    dspec's defaults.

    Example
    -------
    >>> import dspec
    >>> model = dspec.load("smollm2-135m")                                   # doctest: +SKIP
    >>> dspec.generate(model, "def add(a, b):", method="ar", max_new_tokens=16).text  # doctest: +SKIP
    """
    _check_model(model)
    module = method_module(method)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    takes_drafter = getattr(module, "DRAFTER", False)
    if drafter is not None and not takes_drafter:
        raise ValueError(f"method {method!r} takes no drafter")
    if takes_drafter == "model":
        _check_model_drafter(method, drafter)  # block drafters: load_drafter checks what it is given
    unknown = sorted(set(options) - set(module.OPTIONS))
    if unknown:
        raise ValueError(f"method {method!r} does not take {unknown}; it takes {list(module.OPTIONS)}")
    options = {**preset_options(module, model, preset, options), **options}
    if takes_drafter:
        options["drafter"] = drafter
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature != temperature:
        raise ValueError(f"temperature must be a number (<= 0: greedy), got {temperature!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(
            f"seed must be None or an int in [0, 2**64 - 1] (what torch.Generator.manual_seed takes), got {seed!r:.80}"
        )
    if (torch.is_tensor(prompt) or isinstance(prompt, np.ndarray)) and prompt.ndim == 2:
        prompt = list(prompt)  # a batch, one row per prompt
    batched = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and _is_prompt(prompt[0])
    prompts = [
        _prompt_ids(model, p, f"prompt[{i}]" if batched else "prompt")
        for i, p in enumerate(prompt if batched else [prompt])
    ]
    context = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if context and longest + max_new_tokens > context:
        raise ValueError(
            f"max_new_tokens: a prompt of {longest} tokens plus max_new_tokens = {max_new_tokens} "
            f"is {longest + max_new_tokens} tokens, past the model's context of {context}"
        )
    generator = None
    if temperature > 0:
        # one stream per request (request i seeded request_seed(seed, i)): a request's draws
        # never depend on the rest of its batch; without a seed, fresh OS entropy (the user's
        # global RNG is neither read nor reseeded)
        generator = RequestStreams.seeded(seed, len(prompts), model.device)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc=f"{method} decode", unit="tok")
    start = time.perf_counter()
    # no grad mode whatever the method module does: under grad mode a CPU forward takes the
    # torch attention and the per-op layers (the C++ kernels have no backward)
    # the prompts and options are checked: the loop's ops need not re-read their own tensors
    with (
        torch.no_grad(),
        frozen_weights(model),
        cpu.torch_ops_one_thread(),
        _gc_paused(),
        _validate.decode_values_trusted(),
    ):
        tokens, stats = module.decode(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
            eos_ids=model.eos_token_ids,
            progress=bar,
            **options,
        )
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    stats = dict(stats, options=_resolved_options(module, options, stats), preset=preset)
    results = []
    total = sum(len(t) for t in tokens)
    for ids in tokens:
        text = model.tokenizer.decode(ids) if model.tokenizer is not None else ""
        s = dict(
            stats,
            wall_s=wall,
            new_tokens=len(ids),
            batch_size=len(prompts),
            tokens_per_s=total / wall if wall > 0 else None,
        )  # stats are strict JSON: no inf
        results.append(Generation(text, ids, s))
    return results if batched else results[0]
