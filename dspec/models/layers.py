"""The layer helpers dspec's decoder layers share: the transformer's blocks
(:mod:`dspec.models.transformer`) and the DFlash drafter's (:mod:`dspec.models.dflash`).

- :func:`linear` / :func:`project`: a projection, or several of one input, through
  ``dense`` (no module-call overhead on plain ``nn.Linear``; mask adapters add their update);
- :func:`fused_cpu`: whether dspec._C's fused RMSNorm / RoPE ops can run on some tensors;
- :func:`rotate`: rotate-half RoPE in float32 from ``rope_tables``' tables;
- :func:`head_norm`: an optional per-head norm (Qwen3's q / k RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _backend, _library
from .dense import dense, dense_many
from .mask_adapter import MaskLoraLinear

__all__ = ["fused_cpu", "head_norm", "linear", "project", "rotate"]


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection: ``dense`` on a plain ``nn.Linear`` (no module-call overhead, ~30 per
    layer matter at one token per step), else the module itself (a LoRA wrapper)."""
    if type(module) is nn.Linear:
        return dense(x, module.weight, module.bias)
    return module(x)


def project(modules, x: torch.Tensor) -> list[torch.Tensor]:
    """``[linear(m, x) for m in modules]``: plain projections (and mask adapters' bases) of
    one input in one ``dense_many`` call; any other wrapper runs as its own module."""
    kinds = [type(m) for m in modules]
    if all(t is nn.Linear or t is MaskLoraLinear for t in kinds):
        ys = dense_many(x, [m.weight for m in modules], [m.bias for m in modules])
        return [y if t is nn.Linear else m.update(x, y) for m, t, y in zip(modules, kinds, ys)]
    return [linear(m, x) for m in modules]


def fused_cpu(*tensors: torch.Tensor) -> bool:
    """Whether dspec._C's fused layer ops (RMSNorm, RoPE) can run on these tensors: the
    extension is built, every tensor is a plain CPU tensor of one float dtype it takes, and
    autograd need not record the call (training keeps the torch ops)."""
    first = tensors[0]
    if first.dtype not in _backend.FLOAT_CODE or not first.is_cpu or _backend.extension() is None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _library.call_directly(*tensors) and all(t.is_cpu for t in tensors)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, ``x * cos + (x2, x1) * signed_sin``, in float32 (tables from
    ``rope_tables``): the half swap is one flip of a [2, D/2] view."""
    xf = x.float()
    swapped = xf.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (xf * cos + swapped * signed_sin).to(x.dtype)


def head_norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` over the last (head) dimension of x [..., heads, D], or x when ``norm``
    is None (a layer without per-head q / k norm)."""
    return x if norm is None else norm(x)
