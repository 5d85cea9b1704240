"""Loading the adapters dspec ships on top of a causal base (what ``dspec.load`` of an adapted
shipped name runs; training them lives in :mod:`dspec.train`).

- mask-selective adapters (``dspec-mask-lora-1``, :mod:`dspec.models.mask_adapter`): a LoRA
  that acts only at [MASK] rows plus a trained [MASK] input row; the base stays exact.
  Written by :func:`save_mask_adapter` (``python -m dspec.train.mask_adapter``), read by
  :func:`load_mask_adapter`.
- ``bd-adapt --lora-rank`` results (``dspec-lora-1``, :mod:`dspec.models.lora`): the base
  converted to its block-diffusion family (:func:`adapt_causal_model`) with the LoRA merged
  into the weights (:func:`load_adapted`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .._cli import dumps
from .config import parse_config
from .loader import load_checkpoint
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_fingerprint, load_adapter, read_adapter_config
from .mask_adapter import MaskAdapter
from .shipped import SHIPPED
from .transformer import Model

__all__ = [
    "MASK_ADAPTER_FORMAT",
    "adapt_causal_model",
    "init_mask_adapter",
    "is_mask_adapter",
    "load_adapted",
    "load_mask_adapter",
    "mask_diffusion_model",
    "resolve_source",
    "save_mask_adapter",
]


# ------------------------------------------------------------------ mask adapters


def mask_diffusion_model(
    base: Model,
    *,
    block_size: int,
    mask_token_id: int,
    rank: int = 16,
    alpha: float | None = None,
    targets=None,
    seed: int = 0,
) -> Model:
    """A copy of the causal ``base`` as a right-shifted, block-causal, clean-causal diffusion
    model with a fresh :class:`MaskAdapter` (``B = 0``: the model still computes exactly the
    base everywhere; at [MASK] rows it starts from the base with the [MASK] token's own
    embedding row)."""
    if base.attention != "causal" or base.mask_adapter is not None:
        raise ValueError(f"base: a causal LM without an adapter is needed, got {base.family!r} ({base.attention})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if (
        isinstance(mask_token_id, bool)
        or not isinstance(mask_token_id, int)
        or not 0 <= mask_token_id < base.config.vocab_size
    ):
        raise ValueError(f"mask_token_id must be an id in [0, {base.config.vocab_size}), got {mask_token_id!r}")
    cfg = base.config.replace(
        family="fast_dllm_v2",
        attention="block_causal",
        shifted=True,
        block_size=block_size,
        mask_token_id=mask_token_id,
        clean_causal=True,
    )
    # built on the meta device and given copies of the base's tensors: a randomly initialised
    # model overwritten at once cost ~0.4 s of every smollm2-135m-bd load
    model = Model(cfg, tokenizer=base.tokenizer, device=base.device, dtype=base.dtype, _meta=True)
    model.load_state_dict({k: v.detach().clone() for k, v in base.state_dict().items()}, strict=True, assign=True)
    model.name_or_path = base.name_or_path
    kw = {} if targets is None else {"targets": tuple(targets)}
    MaskAdapter.attach(model, rank=rank, alpha=alpha, seed=seed, **kw)
    return model


MASK_ADAPTER_FORMAT = "dspec-mask-lora-1"


def save_mask_adapter(
    model: Model,
    out_dir,
    *,
    base_name: str,
    base_fingerprint: str,
    meta: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter.safetensors`` (atomically) for the
    adapter of ``model``: its LoRA matrices and [MASK] row in ``dtype``."""
    from safetensors.torch import save_file

    adapter = model.mask_adapter
    if adapter is None:
        raise ValueError("model: has no mask adapter")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {
        n: p.detach().to("cpu", dtype).contiguous()
        for n, p in model.named_parameters()
        if n.endswith((".lora_A", ".lora_B"))
    }
    state["mask_embedding"] = adapter.mask_embedding.detach().to("cpu", dtype).contiguous()
    save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt", "dspec": MASK_ADAPTER_FORMAT})
    os.chmod(tmp / ADAPTER_WEIGHTS, 0o644)
    config = {
        "format": MASK_ADAPTER_FORMAT,
        "base_name": base_name,
        "base_fingerprint": base_fingerprint,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "targets": list(adapter.targets),
        "mask_token_id": adapter.mask_token_id,
        "block_size": model.block_size,
        "num_parameters": int(sum(t.numel() for t in state.values())),
        "meta": meta or {},
    }
    (tmp / ADAPTER_CONFIG).write_text(dumps(config, indent=2) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        os.replace(tmp / f, out_dir / f)
    shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_mask_adapter(adapter_dir) -> bool:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    return path.is_file() and json.loads(path.read_text()).get("format") == MASK_ADAPTER_FORMAT


def load_mask_adapter(base: Model, adapter_dir, *, check_fingerprint: bool = True) -> Model:
    """The block-diffusion model of ``adapter_dir`` on top of the causal ``base`` (which
    must be the base it was trained on: checked by weight fingerprint)."""
    path = Path(adapter_dir)
    if not is_mask_adapter(path) or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"adapter_dir: {path} holds no {MASK_ADAPTER_FORMAT} adapter")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if check_fingerprint:
        got = base_fingerprint(base)
        if got != config["base_fingerprint"]:
            raise ValueError(
                f"adapter {path} was trained on {config['base_name']!r} (weights fingerprint "
                f"{config['base_fingerprint']}), this base has {got}"
            )
    model = mask_diffusion_model(
        base,
        block_size=int(config["block_size"]),
        mask_token_id=int(config["mask_token_id"]),
        rank=int(config["rank"]),
        alpha=float(config["alpha"]),
        targets=config["targets"],
    )
    _copy_adapter_weights(model, path)
    model.name_or_path = str(path)
    return model


def _copy_adapter_weights(model: Model, path: Path, *, lora_b_scale: float = 1.0) -> None:
    """Copy the saved tensors in; a saved LoRA of lower rank goes into the leading rank
    slice (rows of ``lora_A``, columns of ``lora_B``, the rest of ``lora_B`` zeroed)."""
    from safetensors.torch import load_file

    state = load_file(str(path / ADAPTER_WEIGHTS))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in state.items():
            dest = model.mask_adapter.mask_embedding if name == "mask_embedding" else params.get(name)
            if (
                dest is not None
                and name.endswith(".lora_A")
                and t.dim() == 2
                and t.shape[1] == dest.shape[1]
                and t.shape[0] <= dest.shape[0]
            ):
                dest = dest[: t.shape[0]]
            elif (
                dest is not None
                and name.endswith(".lora_B")
                and t.dim() == 2
                and t.shape[0] == dest.shape[0]
                and t.shape[1] <= dest.shape[1]
            ):
                dest.zero_()
                dest = dest[:, : t.shape[1]]
                t = t.to(dest.dtype) * lora_b_scale
            if dest is None or dest.shape != t.shape:
                raise ValueError(f"adapter {path}: tensor {name!r} {list(t.shape)} does not fit this base")
            dest.copy_(t.to(dest.dtype))


def init_mask_adapter(model: Model, adapter_dir) -> None:
    """Warm start: copy a saved adapter's weights into ``model``'s adapter, e.g. the shipped
    one for a next round.  Same targets and [MASK] id (ValueError otherwise); the rank may
    grow: a rank-r adapter fills the first r rows of ``lora_A`` and the first r columns of
    ``lora_B`` (rescaled by the ratio of the two LoRA scales), the new columns of ``lora_B``
    stay zero, so the model starts as the saved one exactly (its new ``lora_A`` rows keep
    their random draw, which lets gradients reach the new columns)."""
    path = Path(adapter_dir)
    if not is_mask_adapter(path) or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"adapter_dir: {path} holds no {MASK_ADAPTER_FORMAT} adapter")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    adapter = model.mask_adapter
    if adapter is None:
        raise ValueError("model: has no mask adapter")
    for key, mine in (("targets", list(adapter.targets)), ("mask_token_id", adapter.mask_token_id)):
        if config[key] != mine:
            raise ValueError(f"adapter {path}: {key} = {config[key]!r}, this model's adapter has {mine!r}")
    if config["rank"] > adapter.rank:
        raise ValueError(f"adapter {path}: rank = {config['rank']!r}, above this model's adapter rank {adapter.rank!r}")
    rescale = (float(config["alpha"]) / config["rank"]) / (adapter.alpha / adapter.rank)
    _copy_adapter_weights(model, path, lora_b_scale=rescale)


# --------------------------------------------------------- bd-adapt LoRA results


def _adapted_config(src_raw: dict, src_family: str, *, mask_token_id: int, block_size: int) -> tuple[dict, str]:
    """config.json of the block-diffusion model adapted from a causal one, and its family."""
    raw = {k: v for k, v in src_raw.items() if k not in ("architectures", "model_type", "auto_map")}
    if src_family == "qwen3":
        raw.update(
            architectures=["SDARForCausalLM"], model_type="sdar", block_size=block_size, mask_token_id=mask_token_id
        )
        return raw, "sdar"
    if src_family in ("llama", "qwen2"):
        if src_raw.get("mlp_bias"):
            raise ValueError("bd-adapt: a Llama source with mlp_bias has no Fast-dLLM v2 counterpart")
        if src_family == "llama" and src_raw.get("attention_bias"):
            raise ValueError("bd-adapt: a Llama source with attention_bias (o_proj bias) is not supported")
        raw.update(
            architectures=["Fast_dLLM_QwenForCausalLM"],
            model_type="Fast_dLLM_Qwen",
            bd_size=block_size,
            mask_token_id=mask_token_id,
            use_sliding_window=False,
        )
        return raw, "fast_dllm_v2"
    raise ValueError(f"bd-adapt needs a causal source (qwen3, llama or qwen2), got family {src_family!r}")


def adapt_causal_model(src_model: Model, *, mask_token_id: int, block_size: int) -> tuple[Model, dict, str]:
    """The block-diffusion model bd-adapt starts from: ``src_model``'s weights (float32)
    under the adapted config (:func:`_adapted_config`; a Llama's absent q/k/v biases become
    zeros).  Returns (model, its config.json dict, family).  Shared by the recipe and by
    :func:`load_adapted`, so an adapter is always applied to the same base."""
    raw, family = _adapted_config(
        src_model.config.raw, src_model.family, mask_token_id=mask_token_id, block_size=block_size
    )
    raw.setdefault("eos_token_id", list(src_model.eos_token_ids) or None)
    cfg = parse_config(raw).replace(mask_token_id=mask_token_id)
    model = Model(cfg, tokenizer=src_model.tokenizer, device=src_model.device)
    state = src_model.state_dict()
    own = model.state_dict()
    for k in own:  # zero q/k/v biases of a Llama source
        own[k] = state[k].float() if k in state else torch.zeros_like(own[k], dtype=torch.float32)
    model.load_state_dict(own)
    model.name_or_path = src_model.name_or_path
    return model, raw, family


def load_adapted(source, adapter_dir, *, device="cpu", dtype=None) -> Model:
    """A bd-adapt LoRA result: load ``source`` (checkpoint directory or shipped name, the
    base the adapter was trained on), convert it to the block-diffusion family as bd-adapt
    does, load the adapter (base fingerprint checked) and merge it into the weights.

    dtype : of the returned weights (None: the source checkpoint's dtype); the merge itself
        runs in float32.
    """
    config = read_adapter_config(adapter_dir)
    bd = config.get("meta", {}).get("block_diffusion")
    if not bd:
        raise ValueError(f"adapter_dir: {adapter_dir} is not a bd-adapt adapter (no meta.block_diffusion)")
    src_dir = resolve_source(source)
    src = load_checkpoint(src_dir, device=device, dtype=torch.float32)
    out_dtype = dtype if dtype is not None else src.config.raw.get("torch_dtype") or "float32"
    model, raw, family = adapt_causal_model(
        src, mask_token_id=int(bd["mask_token_id"]), block_size=int(bd["block_size"])
    )
    del src
    load_adapter(model, adapter_dir, merge=True)
    if isinstance(out_dtype, str):
        out_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
            out_dtype, torch.float32
        )
    model.name_or_path = str(adapter_dir)
    return model.to(dtype=out_dtype)


def resolve_source(init) -> Path:
    """The checkpoint directory ``init`` names: a directory, or a shipped name's checkpoint."""
    p = Path(os.fspath(init)).expanduser()
    if p.is_dir():
        return p
    name = os.fspath(init)
    if name in SHIPPED:
        return Path(SHIPPED[name]())
    raise ValueError(f"init must be a checkpoint directory or a shipped name {sorted(SHIPPED)}, got {init!r}")
