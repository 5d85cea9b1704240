"""``dspec.hf``: run a dspec decoding method inside transformers' ``model.generate``.

    >>> import dspec.hf                                                    # doctest: +SKIP
    >>> out = model.generate(**inputs, max_new_tokens=64,
    ...                      custom_generate=dspec.hf.custom_generate("dflash"))

transformers (>= 5) takes a callable as ``custom_generate``: ``generate`` prepares the
generation config, the inputs (attention mask, special tokens, ``max_length``), the logits
processors and the stopping criteria, puts the prompt on the streamer, and then calls
``custom_generate(model, input_ids, logits_processor=..., stopping_criteria=...,
generation_config=..., streamer=..., **model_kwargs)`` in place of its own decoding loop;
what it returns is what ``generate`` returns.

The callable decodes with a dspec model made from the HF model's own parameters
(:func:`dspec_model`: the tensors are shared, not copied; made once per HF model and kept
in a weak-keyed cache), honours ``max_new_tokens`` / ``max_length``, the generation
config's EOS ids, the other stopping criteria (applied to the decoded tokens: a row ends
where a criterion first fires), ``do_sample`` / ``temperature`` (the random stream is seeded
from torch's global generator, so ``torch.manual_seed`` reproduces a sampled call), the
streamer (generate puts the prompt; then the new tokens, one step per put, and ``end()``) and left-padded batches (each
row's padding stripped with the attention mask), and returns the ids ``generate`` returns:
the prompt rows as given followed by the new tokens, right-padded with ``pad_token_id``; or
``GenerateDecoderOnlyOutput(sequences=...)`` with ``return_dict_in_generate=True``.

What dspec's methods do not take is a ValueError before any decoding: ``top_k`` / ``top_p``
with ``do_sample`` (other than off: ``top_k`` None or 0, ``top_p`` None or 1.0), logits
processors other than the temperature (repetition penalty, min length, bad words, ...),
beam search, and per-step scores, logits, attentions or hidden states in the output.

Only causal Llama / Qwen2 / Qwen3-architecture models are made (the families
``dspec.models`` loads as causal LMs).  ``drafter=None`` in a method that drafts uses the
drafter dspec ships for the model when the HF model was loaded from a shipped checkpoint
(``dspec.load("smollm2-135m").name_or_path``, ``dspec/assets/tiny-ar``).
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from pathlib import Path

import torch

from .decode.generate import MAX_SEED, check_preset, generate as dspec_generate, method_module
from .models import Model, checkpoint_names, expected_shapes, parse_config
from .models.config import FAMILIES
from .models.shipped import ASSETS

__all__ = ["custom_generate", "dspec_model"]

# HF model -> (key of the parameters it was made from, dspec Model)
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# the logits processors whose effect dspec's methods reproduce themselves
_HANDLED_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
# the stopping criteria dspec's methods apply while decoding (the rest are applied to the
# decoded tokens)
_NATIVE_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria")
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _parameter_key(hf_model) -> tuple:
    """What the dspec model shares with ``hf_model``: every parameter's address, dtype and
    device (a ``.to(...)`` or a reloaded weight re-points them: the model is made again)."""
    return tuple((p.data_ptr(), p.dtype, p.device) for p in hf_model.parameters())


def _shipped_name(path) -> str | None:
    """The shipped dspec model whose checkpoint directory ``path`` is (None otherwise)."""
    if not path:
        return None
    try:
        here = Path(path).expanduser().resolve()
    except (OSError, TypeError, ValueError):
        return None
    from .models.embedded import SMOLLM2_NAME, default_cache_dir

    candidates = {
        "tiny-ar": ASSETS / "tiny-ar",
        "tiny-bd": ASSETS / "tiny-bd",
        "smollm2-135m": default_cache_dir() / SMOLLM2_NAME,
    }
    for name, where in candidates.items():
        try:
            if where.resolve() == here:
                return name
        except OSError:
            continue
    return None


def _build(hf_model) -> Model:
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(hf_model, "state_dict"):
        raise ValueError(f"model must be a transformers causal LM (PreTrainedModel), got {type(hf_model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("model: dspec decodes decoder-only causal LMs, not encoder-decoder models")
    raw = config.to_dict()
    gen = getattr(hf_model, "generation_config", None)
    cfg = parse_config(raw, gen.to_dict() if gen is not None else None)
    family = FAMILIES[cfg.family]
    if family.attention != "causal" or cfg.attention != "causal":
        raise ValueError(f"model: dspec.hf runs causal LMs; this is a {cfg.family!r} model ({cfg.attention} attention)")
    if family.mask_token_id is None:
        cfg = cfg.replace(mask_token_id=None)
    state = hf_model.state_dict()  # detached tensors that share the parameters' storage
    mapping, expected = checkpoint_names(cfg), expected_shapes(cfg)
    missing = [mapping[c] for c in expected if mapping[c] not in state]
    if missing:
        raise ValueError(
            f"model: a {cfg.family} model as its config describes it has weights {missing[:5]} "
            f"that this model lacks (a different architecture?)"
        )
    used = set(mapping.values())
    extra = sorted(
        n
        for n in state
        if n not in used
        and not n.endswith("rotary_emb.inv_freq")
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"model: weights {extra[:5]} are not part of a {cfg.family} model as dspec runs it "
            f"(a different architecture?)"
        )
    first = state[mapping["embed_tokens.weight"]]
    ours = {}
    for canon, shape in expected.items():
        t = state[mapping[canon]]
        if tuple(t.shape) != shape:
            raise ValueError(f"model: weight {mapping[canon]} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"model: every weight must share one dtype and device; {mapping[canon]} is "
                f"{t.dtype} on {t.device}, the embedding {first.dtype} on {first.device}"
            )
        ours[canon] = t
    if first.dtype not in (torch.float32, torch.bfloat16, torch.float16) or first.device.type == "meta":
        raise ValueError(
            f"model: weights must be float32 / bfloat16 / float16 with data, got {first.dtype} on {first.device}"
        )
    model = Model(cfg, tokenizer=None, device=first.device, dtype=first.dtype, _meta=True)
    model.load_state_dict(ours, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.name_or_path = getattr(hf_model, "name_or_path", None) or None
    model.shipped_name = _shipped_name(model.name_or_path)
    return model


def dspec_model(hf_model) -> Model:
    """The dspec :class:`~dspec.models.Model` over ``hf_model``'s own parameters (no copy:
    each dspec parameter is a view of the HF tensor).  Made on first use and kept while
    ``hf_model`` lives; made again when its parameters were re-pointed (``.to(...)``).

    On a CPU, dspec's matmul kernel reads each projection (and the output head) in a panel
    layout it packs on first use and keeps beside the weight: that packed copy is the one
    duplicate (about the size of the projections and the head in the model's dtype)."""
    key = _parameter_key(hf_model)
    with _LOCK:
        kept = _MODELS.get(hf_model)
        if kept is not None and kept[0] == key:
            return kept[1]
        model = _build(hf_model)
        _MODELS[hf_model] = (key, model)
        return model


def _check_generation(generation_config, logits_processor, model_kwargs) -> float:
    """The temperature to decode with (0: greedy); ValueError for what dspec does not take."""
    gc = generation_config
    if (getattr(gc, "num_beams", 1) or 1) > 1:
        raise ValueError(f"num_beams: dspec.hf decodes one beam, got num_beams={gc.num_beams}")
    if gc.return_dict_in_generate:
        asked = [k for k in _UNSUPPORTED_OUTPUTS if getattr(gc, k, False)]
        if asked:
            raise ValueError(
                f"{asked[0]}: dspec.hf returns the sequences only (return_dict_in_generate gives "
                f"GenerateDecoderOnlyOutput(sequences=...)), got {', '.join(asked)}=True"
            )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds: dspec.hf decodes from input_ids; pass input_ids")
    cache = model_kwargs.get("past_key_values")  # generate makes an empty one: that is fine
    filled = getattr(cache, "get_seq_length", None)
    if cache is not None and (filled is None or filled() > 0):
        raise ValueError(
            "past_key_values: dspec.hf decodes the whole prompt with its own cache; do not pass a filled cache"
        )
    temperature = 0.0
    if gc.do_sample:
        if gc.top_k not in (None, 0):
            raise ValueError(
                f"top_k: dspec's methods sample from the full distribution; with do_sample=True "
                f"leave top_k unset or 0, got {gc.top_k}"
            )
        if gc.top_p not in (None, 1.0):
            raise ValueError(
                f"top_p: dspec's methods sample from the full distribution; with do_sample=True "
                f"leave top_p unset or 1.0, got {gc.top_p}"
            )
        temperature = 1.0 if gc.temperature is None else float(gc.temperature)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 with do_sample=True, got {gc.temperature}")
    other = [type(p).__name__ for p in (logits_processor or ()) if type(p).__name__ not in _HANDLED_PROCESSORS]
    if other:
        raise ValueError(
            f"logits_processor: dspec's methods apply only the temperature to the target's "
            f"distribution; {other} would change it (unset the generation options that add them)"
        )
    return temperature


def _truncate(seq: torch.Tensor, start: int, lengths: list[int], criteria) -> list[int]:
    """Each row's new-token count after the stopping criteria dspec did not apply while
    decoding: row b ends at the first step where a criterion fires for it."""
    extra = [c for c in (criteria or ()) if type(c).__name__ not in _NATIVE_CRITERIA]
    if not extra or not max(lengths, default=0):
        return lengths
    out = list(lengths)
    done = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
    for step in range(1, max(lengths) + 1):
        fired = torch.zeros_like(done)
        for c in extra:
            fired |= torch.as_tensor(c(seq[:, : start + step], None), device=seq.device).bool()
        for b in torch.nonzero(fired & ~done).flatten().tolist():
            out[b] = min(out[b], step)
        done |= fired
        if bool(done.all()):
            break
    return out


def _generate_streamer(frame):
    """The ``streamer`` that ``GenerationMixin.generate`` (the calling frame) was given.
    transformers 5 passes a callable ``custom_generate`` only the keyword arguments its
    signature adds to ``_sample``'s, so the streamer it has put the prompt on is not among
    them; it is read from generate's own frame (None when the caller is anything else)."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return None
    code = inspect.unwrap(GenerationMixin.generate).__code__
    return frame.f_locals.get("streamer") if frame is not None and frame.f_code is code else None


def custom_generate(method: str = "ar", *, drafter=None, preset: str | None = None, **options):
    """A callable for ``model.generate(..., custom_generate=...)`` that decodes with dspec's
    ``method`` (``"ar"``, ``"dflash"``, ``"d2sd"``, ...; causal-target methods), ``drafter``,
    ``preset`` and ``options`` as :func:`dspec.generate` takes them.  The method, drafter,
    preset and options are checked here (ValueError naming them), the generation's settings
    when ``generate`` calls it."""
    module = method_module(method)
    check_preset(preset)
    takes = getattr(module, "DRAFTER", False)
    if drafter is not None and not takes:
        raise ValueError(f"drafter: method {method!r} takes no drafter")
    unknown = sorted(set(options) - set(module.OPTIONS))
    if unknown:
        raise ValueError(f"method {method!r} does not take {unknown}; it takes {list(module.OPTIONS)}")
    for banned in ("max_new_tokens", "temperature", "seed", "method"):
        if banned in options:
            raise ValueError(f"{banned}: pass it to model.generate, not to custom_generate")
    extra = {"drafter": drafter} if takes else {}

    def dspec_decode(
        model,
        input_ids,
        logits_processor=None,
        stopping_criteria=None,
        generation_config=None,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        if generation_config is None:
            generation_config = model.generation_config
        if streamer is None:
            streamer = _generate_streamer(sys._getframe(1))
        if synced_gpus:
            raise ValueError("synced_gpus: dspec.hf decodes on one device")
        temperature = _check_generation(generation_config, logits_processor, model_kwargs)
        target = dspec_model(model)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got {list(input_ids.shape)}")
        start = input_ids.shape[1]
        max_new = int(generation_config.max_length) - start
        if max_new < 1:
            raise ValueError(
                f"max_length: {generation_config.max_length} leaves no room after a prompt of {start} "
                f"tokens; set max_new_tokens"
            )
        mask = model_kwargs.get("attention_mask")
        rows = input_ids.tolist()
        if mask is not None:
            keep = mask.bool().tolist()
            rows = [[t for t, k in zip(row, ks) if k] for row, ks in zip(rows, keep)]
        eos = generation_config._eos_token_tensor
        eos_ids = tuple(int(i) for i in eos.flatten().tolist()) if eos is not None else ()
        seed = None
        if temperature > 0:  # torch.manual_seed reproduces a sampled call, as it does generate's
            seed = int(torch.randint(0, 2**62, (1,)).item()) % (MAX_SEED + 1)
        with _LOCK:
            saved = target.config
            target.config = saved.replace(eos_token_ids=eos_ids)
            try:
                results = dspec_generate(
                    target,
                    rows,
                    method=method,
                    max_new_tokens=max_new,
                    temperature=temperature,
                    seed=seed,
                    preset=preset,
                    **extra,
                    **options,
                )
            finally:
                target.config = saved
        new = [list(r.tokens) for r in results]
        pad = generation_config._pad_token_tensor
        pad_id = int(pad.flatten()[0]) if pad is not None else (eos_ids[0] if eos_ids else 0)
        width = max(len(t) for t in new)
        tail = torch.full((len(new), width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
        for b, t in enumerate(new):
            tail[b, : len(t)] = torch.tensor(t, dtype=input_ids.dtype)
        seq = torch.cat([input_ids, tail], dim=1)
        lengths = _truncate(seq, start, [len(t) for t in new], stopping_criteria)
        if lengths != [len(t) for t in new]:
            for b, n in enumerate(lengths):
                seq[b, start + n :] = pad_id
            seq = seq[:, : start + max(lengths)]
        if streamer is not None:
            for step in range(seq.shape[1] - start):
                streamer.put(seq[:, start + step].cpu())
            streamer.end()
        if generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=seq)
        return seq

    dspec_decode.__name__ = dspec_decode.__qualname__ = f"dspec_{method}"
    return dspec_decode
