"""Backend selection shared by every public op.

Order of precedence: the op's ``backend=`` argument (strict), then the ``DSPEC_BACKEND``
environment variable (read at call time; a preference that falls back to ``"auto"`` when
that backend cannot run the call), then ``"auto"``.

``auto`` picks, for CUDA tensors, the fastest backend built for the op (CUDA kernel in
``dspec._C``, else Triton, else torch); for CPU tensors, the C++ CPU code of ``dspec._C``
when the op has one, else torch.  ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``
(that is how CI runs the Triton kernels).  ``"cpp"`` names the C++ CPU code in ``dspec._C``
explicitly; it is an addition to the four names of DESIGN.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton", "cuda", "cpp")


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def extension():
    """The compiled ``dspec._C`` module, or None when it was not built."""
    return _load_extension()


#: the instruction-set levels of dspec's C++ CPU kernels, lowest first; ``$DSPEC_CPU_ISA``
#: caps them (like oneDNN's ``ONEDNN_MAX_CPU_ISA``), so a lower level's code can be tested
#: and measured on a CPU that has a higher one
CPU_ISA_LEVELS = ("generic", "avx2", "avx512", "amx")


def check_cpu_isa_env() -> str | None:
    """``$DSPEC_CPU_ISA`` as a level name (None when unset, empty or ``auto``); a ValueError
    names the variable for any other value, before the extension loads."""
    raw = os.environ.get("DSPEC_CPU_ISA")
    if raw is None or raw.lower() in ("", "auto"):
        return None
    if raw.lower() not in CPU_ISA_LEVELS:
        raise ValueError(f"DSPEC_CPU_ISA must be one of {', '.join(CPU_ISA_LEVELS)} or 'auto' (any case), got {raw!r}")
    return raw.lower()


@functools.lru_cache(maxsize=None)
def _load_extension():
    check_cpu_isa_env()
    try:
        from dspec import _C
    except ImportError:
        return None
    return _C


def cpp_available() -> bool:
    return extension() is not None


def cuda_available() -> bool:
    ext = extension()
    return ext is not None and bool(getattr(ext, "with_cuda", False))


def backend_ready(name: str) -> bool:
    """Whether backend ``name`` can run here (torch always; triton, cuda and cpp when their
    package, device or extension is present)."""
    return {
        "torch": True,
        "triton": triton_available(),
        "cuda": cuda_available(),
        "cpp": cpp_available(),
    }[name]


# dtype codes of dspec._C's launchers (csrc/dspec.h)
FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_CODE = {torch.int32: 0, torch.int64: 1}


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [rows, C] with a unit stride along C and rows that do not overlap (a copy
    only when needed: e.g. a broadcast ``expand`` gives rows with stride 0)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) == 1 and (x2.shape[0] == 0 or x2.stride(0) >= x2.shape[1]):
        return x2
    # a fresh row-major copy: contiguous() would keep the stride of a size-1 row dimension
    # (a [1, C] broadcast may report row stride 0), and the kernels take the row stride as given
    return x2.clone(memory_format=torch.contiguous_format)


def launch_context(device: torch.device, cuda: bool):
    """dspec._C launches on the current device: make it ``device`` for the call."""
    return torch.cuda.device(device) if cuda else contextlib.nullcontext()


def cuda_stream(device: torch.device, cuda: bool) -> int:
    """The current stream of ``device`` as the integer dspec._C takes (0 on the CPU)."""
    return torch.cuda.current_stream(device).cuda_stream if cuda else 0


def resolve(
    op: str,
    backend: str | None,
    device: torch.device,
    provided: tuple[str, ...],
    unsupported: dict[str, str] | None = None,
) -> str:
    """Return the backend that will run ``op`` on tensors living on ``device``.

    ``provided`` lists the backends the op implements; ``unsupported`` maps backends that
    cannot take this particular input (a size limit) to the reason.  An explicit
    ``backend=`` is strict: ``ValueError`` for an unknown name, a backend the op lacks or
    that cannot take the input, one not built here, or a device mismatch.  ``$DSPEC_BACKEND``
    is a preference: when it names a backend that cannot run this call, the call falls
    back to "auto" (only a misspelt name is an error).  "auto" takes the first usable
    backend of its order.
    """
    unsupported = unsupported or {}
    from_env = backend is None
    requested = backend if backend is not None else os.environ.get("DSPEC_BACKEND", "auto")
    if not isinstance(requested, str):
        raise ValueError(
            f"{op}: backend must be None or one of {BACKENDS}, got {type(requested).__name__} {requested!r}"
        )
    requested = (requested or "auto").lower()
    if requested not in BACKENDS:
        where = "$DSPEC_BACKEND" if from_env else "backend"
        raise ValueError(f"{op}: {where} must be one of {BACKENDS}, got {requested!r}")
    on_cuda = device.type == "cuda"
    if requested != "auto":
        why = _unusable(op, requested, device, provided, unsupported)
        if why is None:
            return requested
        if not from_env:
            raise ValueError(why)
    order = ("cuda", "triton", "torch") if on_cuda else ("cpp", "torch")
    for name in order:
        if name in provided and name not in unsupported and backend_ready(name):
            return name
    return "torch"


def _unusable(op: str, name: str, device: torch.device, provided, unsupported) -> str | None:
    """Why backend ``name`` cannot run this call of ``op`` (None: it can)."""
    on_cuda = device.type == "cuda"
    if name not in provided:
        return f"{op}: no {name!r} backend; available: {provided}"
    if name in unsupported:
        return f"{op}: {unsupported[name]}"
    if not backend_ready(name):
        return (
            f"{op}: backend {name!r} is not available in this install "
            "(dspec._C not built, built without CUDA, or triton missing)"
        )
    if name == "cuda" and not on_cuda:
        return f"{op}: backend 'cuda' needs CUDA tensors, got device {device}"
    if name == "cpp" and device.type != "cpu":
        return f"{op}: backend 'cpp' needs CPU tensors, got device {device}"
    if name == "triton" and not on_cuda and not triton_interpret():
        return (
            f"{op}: backend 'triton' on {device} tensors needs TRITON_INTERPRET=1 "
            "set before dspec's Triton kernels are imported"
        )
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def parallel_units(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 4 elsewhere (interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def vocab_splits(rows: int, vocab: int, block: int, device: torch.device, min_tiles_per_split: int = 4) -> int:
    """How many programs share one row's vocabulary so that small batches fill the GPU (the
    Triton kernels' launches, and the buffers the C++ extension's launchers size by them).

    Aim for two programs per SM, but never give a program fewer than
    ``min_tiles_per_split`` tiles (the merge pass would then cost more than it saves).
    """
    tiles = -(-vocab // block)
    want = -(-2 * parallel_units(device) // max(rows, 1))
    return max(1, min(want, tiles // min_tiles_per_split))
