"""Testing helpers for engines: find the host synchronisations in a piece of code.

A CUDA graph cannot contain a device-to-host synchronisation, and every one of them stalls
the CPU until the GPU has drained its queue.  :func:`count_host_syncs` records, below the
Python layer (a ``TorchDispatchMode``), every operator call that needs tensor *values* on
the host:

- ``aten._local_scalar_dense``: what ``.item()``, ``int(t)``, ``float(t)`` and ``bool(t)``
  (so ``if t.any():``) call;
- ``aten.is_nonzero`` and ``aten.equal`` (``torch.equal`` returns a Python bool);
- operators whose output shape depends on values: ``nonzero``, ``masked_select``,
  ``unique``/``unique_consecutive``, ``repeat_interleave`` without ``output_size``,
  ``bincount``, and indexing with a boolean mask (``t[mask]``, ``t[mask] = x``);
- copies from an accelerator to the CPU (``aten._to_copy`` / ``aten.copy_``): ``.cpu()``,
  ``.to("cpu")``, ``.tolist()`` and ``.numpy()`` of an accelerator tensor.

Works on any device.  On CPU tensors the value reads and value-dependent shapes are
recorded exactly as they would be on a GPU (so a CPU test finds the syncs a GPU run would
have), but ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a *CPU* tensor never reach the
dispatcher and are invisible, as are ``torch.cuda.synchronize()``, ``Stream.synchronize()``,
``Event.synchronize()`` and raw ``data_ptr()`` reads by extensions.  Host-side bookkeeping
kept in CPU tensors (rather than Python ints) is recorded on a CPU run too: there is no
way to tell it apart from model tensors there.

dspec's custom ops (``torch.ops.dspec.*``) are entered: the operators their
implementations run are recorded as well (other libraries' custom ops are seen as one
call, which is what a CUDA graph sees too).

Example
-------
>>> import torch, dspec
>>> from dspec.testing import count_host_syncs
>>> x = torch.tensor([1.0, 2.0])
>>> with count_host_syncs() as syncs:
...     _ = dspec.token_stats(x[None]).token      # sync-free
...     _ = bool(x.sum() > 0)                     # a host read
>>> len(syncs), syncs.events[0].op
(1, 'aten._local_scalar_dense.default')
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncEvent", "SyncLog", "count_host_syncs", "assert_no_host_syncs"]

_aten = torch.ops.aten

# Value read to the host: the op itself returns a Python scalar.
# (inside a dspec custom op the mode sees operators before their decomposition, so
# ``aten.item`` and ``aten.to`` appear there instead of ``_local_scalar_dense`` / ``_to_copy``)
_SCALAR_READS = {
    _aten._local_scalar_dense.default,
    _aten.item.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.allclose.default,
}
_TO_OPS = {getattr(_aten.to, ov) for ov in ("device", "dtype_layout", "other") if hasattr(_aten.to, ov)}

# Output shape depends on the values (the host must learn the size before allocating).
_DYNAMIC_SHAPE = set()
for _name, _overloads in (
    ("nonzero", ("default",)),
    ("masked_select", ("default",)),
    ("_unique", ("default",)),
    ("_unique2", ("default",)),
    ("unique_dim", ("default",)),
    ("unique_consecutive", ("default",)),
    ("unique_dim_consecutive", ("default",)),
    ("bincount", ("default",)),
    ("repeat_interleave", ("Tensor", "self_Tensor")),
    ("argwhere", ("default",)),
    ("nonzero_numpy", ("default",)),
):
    _packet = getattr(_aten, _name, None)
    for _ov in _overloads:
        if _packet is not None and hasattr(_packet, _ov):
            _DYNAMIC_SHAPE.add(getattr(_packet, _ov))

_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class SyncEvent:
    """One host synchronisation: the operator, why it syncs, the device, and the innermost
    frame outside torch that caused it (``file:line in function``)."""

    op: str
    kind: str  # "scalar_read" | "dynamic_shape" | "bool_index" | "to_host"
    device: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind:13s} {self.op} on {self.device} at {self.where}"


@dataclass
class SyncLog:
    """The events recorded by :func:`count_host_syncs` (``len(log)`` counts them)."""

    events: list[SyncEvent] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def summary(self) -> str:
        return "\n".join(str(e) for e in self.events) or "no host synchronisation"


def _first_device(args) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            d = _first_device(a)
            if d is not None:
                return d
    return None


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _caller() -> str:
    """Innermost stack frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path == os.path.abspath(__file__):
            continue
        if "contextlib" in path or "/_pytest/" in path or "/pluggy/" in path:
            continue
        short = os.path.relpath(path, os.path.dirname(_HERE)) if path.startswith(os.path.dirname(_HERE)) else path
        return f"{short}:{frame.lineno} in {frame.name}"
    return "?"


class _SyncRecorder(TorchDispatchMode):
    def __init__(self, log: SyncLog, where: bool):
        super().__init__()
        self.log = log
        self.where = where

    def _record(self, func, kind, device):
        self.log.events.append(SyncEvent(str(func), kind, str(device), _caller() if self.where else "?"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "dspec":
            # look inside dspec's own custom ops: run their Python bodies under this mode
            # (the dispatcher excludes the Python keys inside __torch_dispatch__: include
            # them again so that the body's operators reach this mode)
            from . import _library

            body = _library.IMPLS[func._opname]
            with (
                torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Python),
                torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.PythonTLSSnapshot),
                self,
            ):
                return body(*args, **kwargs)
        device = _first_device(args)
        if func in _SCALAR_READS:
            self._record(func, "scalar_read", device)
        elif func in _DYNAMIC_SHAPE:
            self._record(func, "dynamic_shape", device)
        elif func in _INDEX_OPS and _has_bool_index(args):
            self._record(func, "bool_index", device)
        elif func is _aten._to_copy.default or func in _TO_OPS:
            target = kwargs.get("device")
            if target is None:
                target = next(
                    (
                        a.device if isinstance(a, torch.Tensor) else a
                        for a in args[1:2]
                        if isinstance(a, (torch.device, str, torch.Tensor))
                    ),
                    None,
                )
            if (
                device is not None
                and device.type != "cpu"
                and target is not None
                and torch.device(target).type == "cpu"
            ):
                self._record(func, "to_host", device)
        elif func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu":
                self._record(func, "to_host", src.device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs(*, where: bool = True):
    """Record the host synchronisations of the code in the ``with`` block.

    Parameters
    ----------
    where : record the caller's ``file:line`` of each event (a stack walk per event).

    Yields
    ------
    SyncLog: ``len(log)`` events, ``log.events`` (SyncEvent), ``log.summary()``.
    """
    log = SyncLog()
    with _SyncRecorder(log, where):
        yield log


@contextlib.contextmanager
def assert_no_host_syncs(what: str = "the block"):
    """Raise ``AssertionError`` listing every host synchronisation the block performed."""
    with count_host_syncs() as log:
        yield log
    if len(log):
        raise AssertionError(f"{what} synchronised with the host {len(log)} time(s):\n{log.summary()}")
