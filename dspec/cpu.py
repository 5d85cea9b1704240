"""The CPU as a platform: what this machine is, which dtype decodes fastest on it, how
many threads to use.

- ``machine()``: CPU model, the instruction-set flags that matter for decoding (AVX2,
  AVX-512, AVX512_BF16, AMX), cores, load average, torch's CPU capability; every benchmark
  records it.
- ``native_bf16()``: whether bf16 matmul runs in hardware (AMX-BF16 or AVX512_BF16, read
  from ``/proc/cpuinfo``).  Without it oneDNN emulates bf16: on an AVX-512 Xeon without
  those flags a bf16 576x1536 linear at M = 16 took 3x the fp32 time (measured November
  2026).
- ``isa()``: the instruction-set level dspec's C++ kernels run at (``$DSPEC_CPU_ISA`` caps it).
- ``default_dtype(device)``: what ``dspec.load`` uses when ``dtype=None`` -- bf16 on a CPU
  with native bf16 matmul or with dspec's SIMD tiles (on AVX2 they widen bf16 weights in
  registers and stream half the bytes), fp32 where neither runs (torch's bf16 is emulated
  there); on CUDA, None (the checkpoint's dtype).  AVX2, SmolLM2-135M, 2 threads, 8 grid
  prompts: ``ar`` 71.4 tok/s in bf16 against 44.2 in fp32, the fastest lossless decode of
  either dtype (fp32 ``dflash`` 55.7; bench/results/cpu/avx2/e2e_smollm2_avx2_*.json); a
  forward's rows cost more in bf16 there (N = 16 is 6.7x N = 1, fp32 3.3x).  bf16 rounds
  the weights and every activation: lossless methods then equal ``ar`` in bf16, not fp32.
- ``kernel_threads()`` / ``torch_ops_one_thread()``: the threads dspec's C++ CPU kernels
  use (torch's intra-op count), and the scope every ``dspec.generate`` call decodes in:
  torch's own CPU ops run on one thread inside it while dspec's kernels keep the count.
  Why: torch opens an OpenMP team for any op over ~32k elements (a logits row is 49k), and
  after the op libgomp's worker spins for milliseconds on the core dspec's thread pool
  needs next; a DFlash cycle opened one team, an SSD forward ~20 (gdb on GOMP_parallel,
  SmolLM2-135M, November 2026).  Every op that matters in a decode step is dspec's.
- ``default_threads()`` / ``apply_threads(n)``: the torch intra-op thread count.
  ``$DSPEC_NUM_THREADS`` (an int, or "auto") wins; "auto" (the default) takes the cores that
  are idle now: it samples ``/proc/stat`` for 50 ms and leaves out the cores other
  processes keep busy.  Why: on a 2-core machine a 2-thread torch process beside one busy
  process stalls in ~8 ms scheduler quanta at every parallel region (20-50x slower), while
  a 1-thread process keeps its speed; alone, 2 threads are faster.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
import time
from pathlib import Path

import torch

REPORTED_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_SAMPLE_S = 0.05


@functools.lru_cache(maxsize=None)
def cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its flags, read once from /proc/cpuinfo (``platform.processor()``
    and no flags where that file is missing)."""
    model, flags = platform.processor() or "cpu", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return cpuinfo()[0]


def cpu_flags() -> list[str]:
    """The decoding-relevant instruction-set flags this CPU reports."""
    flags = cpuinfo()[1]
    return [f for f in REPORTED_FLAGS if f in flags]


def native_bf16() -> bool:
    """bf16 matmul runs in hardware here (AMX-BF16 or AVX512_BF16)."""
    flags = cpuinfo()[1]
    return "amx_bf16" in flags or "avx512_bf16" in flags


_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device="cpu") -> torch.dtype | None:
    """The weight dtype ``dspec.load`` picks when ``dtype=None`` (see the module docstring)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    env = os.environ.get("DSPEC_DTYPE", "").strip().lower()
    if env and env != "auto":
        if env not in _DTYPE_NAMES:
            raise ValueError(f"DSPEC_DTYPE must be one of {sorted(_DTYPE_NAMES)} or 'auto', got {env!r}")
        return _DTYPE_NAMES[env]
    if kind != "cpu":
        return None
    return torch.bfloat16 if native_bf16() or isa() in ("avx2", "avx512", "amx") else torch.float32


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[:8]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks), idle


def busy_cores(sample_s: float = _SAMPLE_S) -> float | None:
    """How many cores other processes keep busy now (a /proc/stat sample over
    ``sample_s`` seconds while this process sleeps); None where /proc/stat is missing."""
    a = _cpu_times()
    if a is None:
        return None
    time.sleep(sample_s)
    b = _cpu_times()
    total, idle = b[0] - a[0], b[1] - a[1]
    if total <= 0:
        return 0.0
    return (os.cpu_count() or 1) * (total - idle) / total


def default_threads() -> int:
    """The thread count dspec uses unless told otherwise: ``$DSPEC_NUM_THREADS`` when it is
    an int >= 1, else the idle cores (at least 1; see the module docstring)."""
    env = os.environ.get("DSPEC_NUM_THREADS", "auto").strip().lower()
    if env not in ("", "auto"):
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"DSPEC_NUM_THREADS must be an int >= 1 or 'auto', got {env!r}") from None
        if n < 1:
            raise ValueError(f"DSPEC_NUM_THREADS must be an int >= 1 or 'auto', got {env!r}")
        return n
    n = cores()
    busy = busy_cores()
    if busy is not None:
        n -= int(busy + 0.5)
    return max(1, min(n, cores()))


def apply_threads(threads: int | str | None = None) -> int:
    """Set torch's intra-op threads (what dspec's C++ CPU kernels use too): ``threads`` an
    int >= 1, or None / "auto" for ``default_threads()``.  Returns the count set."""
    if threads is None or (isinstance(threads, str) and threads.strip().lower() == "auto"):
        n = default_threads()
    else:
        try:
            n = int(threads)
        except (TypeError, ValueError):
            raise ValueError(f"threads must be an int >= 1 or 'auto', got {threads!r}") from None
        if isinstance(threads, bool) or n < 1:
            raise ValueError(f"threads must be an int >= 1 or 'auto', got {threads!r}")
    torch.set_num_threads(n)
    return n


_scope_lock = threading.Lock()
_scope_depth = 0
_scope_threads: int | None = None


def kernel_threads() -> int:
    """The thread count dspec's C++ CPU kernels run with: torch's intra-op count, or inside
    :func:`torch_ops_one_thread` the count torch had when the scope opened."""
    n = _scope_threads
    return n if n is not None else torch.get_num_threads()


_GENERIC_AT = [None, False]  # (isa epoch, whether the kernels run at the generic level then)


def layer_threads() -> int:
    """The threads of dspec's per-layer C++ kernels inside a forward (norms, RoPE, attention,
    KV-cache writes): ``kernel_threads()``, or 1 at the generic level.  There torch's
    multi-threaded GEMMs run every projection between those small kernels, and a pool worker
    spinning after one (cpu_parallel.h) takes a core from them (SmolLM2-135M fp32 forwards
    after 256 tokens, 2 threads, AMD EPYC Zen 3 at DSPEC_CPU_ISA=generic, in-process A/B
    against the pool's threads: N = 4 / 16 / 64 1.03 / 0.92 / 0.98x the time)."""
    return 1 if generic_level() else kernel_threads()


def generic_level() -> bool:
    """Whether the C++ kernels run at the generic level (cached per ``isa_epoch()``)."""
    if _GENERIC_AT[0] != _ISA_EPOCH[0]:
        _GENERIC_AT[0], _GENERIC_AT[1] = _ISA_EPOCH[0], isa() == "generic"
    return _GENERIC_AT[1]


# A constant to torch.compile (what ``torch.compiler.assume_constant_result`` marks, without
# importing torch._dynamo): a traced forward reads the level once, as an eager one does.
generic_level._dynamo_marked_constant = True


@contextlib.contextmanager
def torch_ops_one_thread():
    """Run torch's own CPU ops on one thread inside the scope; dspec's kernels keep
    ``kernel_threads()`` (see the module docstring).  At the generic level, where torch's
    GEMMs and attention run the forward (no SIMD tiles), torch keeps its threads.  Nests,
    and concurrent scopes from several Python threads share one saved count; the count is
    restored when the last scope closes (results never depend on it: only speed)."""
    global _scope_depth, _scope_threads
    with _scope_lock:
        if _scope_depth == 0:
            _scope_threads = torch.get_num_threads()
            if _scope_threads > 1 and not generic_level():
                torch.set_num_threads(1)
        _scope_depth += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                if torch.get_num_threads() != _scope_threads:
                    torch.set_num_threads(_scope_threads)
                _scope_threads = None


_ISA_EPOCH = [0]


def isa_epoch() -> int:
    """A counter that ``set_isa_cap`` bumps: decisions cached per ISA level key on it."""
    return _ISA_EPOCH[0]


def set_isa_cap(level: str) -> str:
    """Caps the instruction-set level of dspec's C++ CPU kernels for this process (what
    ``$DSPEC_CPU_ISA`` sets at start; ``"amx"`` is no cap) and returns the previous cap:
    ``"generic"``, ``"avx2"``, ``"avx512"`` or ``"amx"``.  The tests run every level of
    the CPU in one process with it.  Packed weights stay valid; bits may change between
    levels, so a decode keeps one level from start to end."""
    from . import _backend

    if level not in _backend.CPU_ISA_LEVELS:
        raise ValueError(f"level must be one of {', '.join(_backend.CPU_ISA_LEVELS)}, got {level!r}")
    ext = _backend.extension()
    if ext is None:
        raise ValueError("set_isa_cap needs the compiled extension dspec._C")
    old = ext.set_cpu_isa_cap(level)
    _ISA_EPOCH[0] += 1
    return old


def isa() -> str | None:
    """The instruction-set level dspec's C++ CPU kernels run at here: ``"generic"``,
    ``"avx2"``, ``"avx512"`` or ``"amx"`` -- the CPU's highest that dspec has code for,
    capped by ``$DSPEC_CPU_ISA`` -- or None without the compiled extension."""
    from . import _backend

    ext = _backend.extension()
    return ext.cpu_isa() if ext is not None and hasattr(ext, "cpu_isa") else None


def machine() -> dict:
    """What a benchmark records about the CPU it ran on."""
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "native_bf16": native_bf16(),
        "cores": cores(),
        "torch_threads": kernel_threads(),
        "dspec_cpu_isa": isa(),
        "dspec_cpu_isa_cap": os.environ.get("DSPEC_CPU_ISA") or None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg": loadavg(),
    }
