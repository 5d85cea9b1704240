"""Input checks shared by the public ops: every failure is a ValueError naming the argument."""
from __future__ import annotations

import contextlib
import math
import threading

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)


class _Config:
    """Library-wide switches.

    ``validate_values``: checks that read tensor contents (id ranges, probabilities in
    [0, 1]) need a device-to-host copy.  They run by default, are skipped automatically while
    a CUDA graph is being captured or ``torch.compile`` is tracing (FakeTensors have no
    values), and can be turned off for sync-free engine loops.

    ``trust_decode``: ``dspec.generate`` checks the prompts and options it is given, then
    runs the method's loop inside :func:`decode_values_trusted`, where the ops' value checks
    are off: every tensor they would read there (drafted ids, tree parents, accepted
    counts, commit indices) was made by dspec's own ops in that loop.  On a CPU those checks
    were ~0.5 ms of a ~20 ms speculative cycle (SmolLM2-135M, dflash).  False keeps them on
    inside decode loops too (the test suite runs every method both ways).
    """

    validate_values: bool = True
    trust_decode: bool = True


config = _Config()
_trusted = threading.local()


@contextlib.contextmanager
def decode_values_trusted():
    """Within: value checks are off on this thread while ``config.trust_decode`` holds (a
    decode loop over its own intermediate tensors, after its inputs were checked)."""
    if not config.trust_decode:
        yield
        return
    depth = getattr(_trusted, "depth", 0)
    _trusted.depth = depth + 1
    try:
        yield
    finally:
        _trusted.depth = depth


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s values (a host synchronisation) may run now."""
    if not config.validate_values or getattr(_trusted, "depth", 0) or torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def tensor(name: str, t, *, min_dim: int | None = None, dim: int | None = None,
           dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if min_dim is not None and t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    return t


def same_device(device: torch.device, like: str, **tensors) -> None:
    """Every given tensor (None skipped) lives on ``device``, the device of ``like``."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like {like}")


def logits(name: str, t) -> torch.Tensor:
    tensor(name, t, min_dim=1, dtypes=FLOAT_DTYPES)
    if t.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary (last dimension is 0)")
    return t


def temperature(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a positive finite number, got {value!r}") from None
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"temperature must be a positive finite number, got {value!r}")
    return value


def positive_int(name: str, value, *, upper: int | None = None, upper_name: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be <= {upper_name} ({upper}), got {value}")
    return value


def probabilities(name: str, t: torch.Tensor) -> None:
    """Values in [0, 1] (NaN rejected too); skipped when value checks are off."""
    if t.numel() and value_checks_enabled(t):
        bad = ~((t >= 0) & (t <= 1))
        if bool(bad.any()):
            raise ValueError(f"{name} must hold probabilities in [0, 1]; found "
                             f"{int(bad.sum())} value(s) outside, e.g. {t[bad].flatten()[0].item()}")


def tree_parents(parents: torch.Tensor, name: str = "parents") -> None:
    """Rows of ``parents`` [B, N] are topologically ordered trees (as verify_tree takes them).

    Node 0 is the root (-1); node i >= 1 has a parent in [0, i) that is not itself padding,
    or is padding (-1).  Reads values: skipped when value checks are off.
    """
    if not parents.numel() or not value_checks_enabled(parents):
        return
    par = parents.long()
    if bool((par[:, 0] != -1).any()):
        b = int((par[:, 0] != -1).nonzero()[0])
        raise ValueError(f"{name}[{b}, 0] must be -1 (node 0 is the root), got {int(par[b, 0])}")
    idx = torch.arange(par.shape[1], device=par.device)
    bad = (par[:, 1:] < -1) | (par[:, 1:] >= idx[None, 1:])
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise ValueError(f"{name} is not a topologically ordered tree: {name}[{b}, {i + 1}] = "
                         f"{int(par[b, i + 1])}, expected -1 or a value in [0, {i + 1})")
    padding = par == -1
    padding[:, 0] = False
    parent_is_padding = padding.gather(1, par.clamp(min=0)) & (par >= 0)
    if bool(parent_is_padding.any()):
        b, i = parent_is_padding.nonzero()[0].tolist()
        raise ValueError(f"{name}[{b}, {i}] = {int(par[b, i])} points at a padding node (-1 parent)")
