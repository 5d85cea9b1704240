"""Input checks shared by the public ops: every failure is a ValueError naming the argument.

Types are checked here too, before any value is read: tensors (never meta tensors: they
have no data), real numbers (bool is not a number), ``torch.Generator`` and devices.
"""

from __future__ import annotations

import contextlib
import math
import numbers
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


def in_trusted_decode() -> bool:
    """Whether this thread runs inside :func:`decode_values_trusted` (a dspec decode loop over
    its own intermediate tensors)."""
    return bool(getattr(_trusted, "depth", 0))


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s values (a host synchronisation) may run now."""
    if not config.validate_values or getattr(_trusted, "depth", 0) or torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def not_meta(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` is not a meta tensor (shape only, no data: nothing could be computed from it)."""
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (shape only, no data); give a tensor on a real device")
    return t


def tensor(name: str, t, *, min_dim: int | None = None, dim: int | None = None, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    not_meta(name, t)
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
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like {like}")


def logits(name: str, t) -> torch.Tensor:
    tensor(name, t, min_dim=1, dtypes=FLOAT_DTYPES)
    if t.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary (last dimension is 0)")
    return t


_FLOAT32_MAX = 3.4028234663852886e38


def real(name: str, value, *, what: str = "a real number") -> float:
    """A real number as a float: int, float, a numpy scalar or a 0-d real tensor; never a
    bool, a string or anything else ``float()`` would happen to convert."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.device.type == "meta":
            raise ValueError(
                f"{name} must be {what}, got a {str(value.dtype).replace('torch.', '')} "
                f"{value.device.type} tensor of shape {list(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy bools are not Real
        raise ValueError(f"{name} must be {what}, got {_describe(value)}")
    return float(value)


def finite(name: str, value, *, what: str = "a finite number") -> float:
    """A real number finite as a float32 (what the kernels compute with)."""
    v = real(name, value, what=what)
    if not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
        raise ValueError(f"{name} must be {what} (within float32 range), got {value!r}")
    return v


def temperature(value) -> float:
    value = real("temperature", value, what="a positive finite number")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"temperature must be a positive finite number, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """A bool (or a numpy bool); an int or a string is not taken as one."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {_describe(value)}")


def generator(value, device: torch.device, like: str = "the logits"):
    """None or a ``torch.Generator`` on ``device``'s type (a CPU generator for CPU tensors)."""
    if value is None:
        return None
    if not isinstance(value, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {_describe(value)}")
    gdev = value.device
    if gdev.type != device.type or (
        device.type == "cuda" and gdev.index is not None and device.index is not None and gdev.index != device.index
    ):
        raise ValueError(f"generator is on {gdev}, expected a generator on {device} like {like}")
    return value


def device(name: str, value, *, default: str | None = None) -> torch.device:
    """A torch.device (a device, a device string such as "cpu" / "cuda:0", or a CUDA index);
    None gives ``default``.  The meta device is refused: it holds no data."""
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise ValueError(f"{name} must be a torch.device or a device string, got {_describe(value)}")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {value!r}"
        ) from None
    if dev.type == "meta":
        raise ValueError(f"{name} must be a real device, got {value!r} (meta tensors hold no data)")
    return dev


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
            raise ValueError(
                f"{name} must hold probabilities in [0, 1]; found "
                f"{int(bad.sum())} value(s) outside, e.g. {t[bad].flatten()[0].item()}"
            )


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
        raise ValueError(
            f"{name} is not a topologically ordered tree: {name}[{b}, {i + 1}] = "
            f"{int(par[b, i + 1])}, expected -1 or a value in [0, {i + 1})"
        )
    padding = par == -1
    padding[:, 0] = False
    parent_is_padding = padding.gather(1, par.clamp(min=0)) & (par >= 0)
    if bool(parent_is_padding.any()):
        b, i = parent_is_padding.nonzero()[0].tolist()
        raise ValueError(f"{name}[{b}, {i}] = {int(par[b, i])} points at a padding node (-1 parent)")
