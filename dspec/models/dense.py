"""The projections of a forward: ``x @ weight.T + bias`` for every model dspec runs.

A decode or verification step multiplies a handful of rows by each weight matrix; there a
library GEMM spends more time setting up than computing, and its result for a row depends
on how many rows it was given.  ``dense`` sends every call it can (CPU, float32 /
bfloat16, no autograd, contiguous rows, a CPU with AVX2 or better, at most
``PACKED_MAX_ROWS_BY_ISA`` rows: no limit where there are SIMD tiles) to ``dspec._C.linear``:
the weight packed once into panels of 16 output columns (``packed_weight``, kept with the
weight; AMX tiles for bfloat16 on CPUs with AMX-BF16, AVX512_BF16 / AVX-512 dot products,
else AVX2 FMAs on weights widened in registers), float32 accumulation, and a reduction order
that does not depend on the number of rows or threads, so a token's projections are
bit-identical in a one-token step, in a verification and in a prompt's prefill of any
length.  Everything else (training, float64, strided rows) goes to
``torch.nn.functional.linear``.
Every projection of the lean transformer, the mask adapter's base and the DFlash drafter
goes through here, so a path taken by one is taken by all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _backend, _library, cpu

#: the largest row count (batch x suffix tokens) sent to dspec._C.linear per ISA level of
#: its tiles (``dspec._C.linear_isa``) and dtype: None is no limit, 0 never (torch's
#: F.linear runs).  Measured, SmolLM2-135M forwards against transformers on the same
#: weights, torch capped to the same ISA (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA):
#: - amx / avx512: prefills of 65-2048 tokens 1.2-1.4x (bf16) and 2.1-2.5x (fp32) faster on
#:   the packed path than with oneDNN above 64 / 128 rows (AVX512_BF16 EPYC, 2 threads);
#: - avx2: every N faster (fp32 N = 1 / 16 / 64 / 128 / 512: 2.6 / 1.7 / 1.2 / 1.17 / 1.15x;
#:   bf16, which oneDNN emulates there, 2.7 / 3.2 / 3.9 / 4.5 / 4.1x; EPYC Zen 4 under
#:   DSPEC_CPU_ISA=avx2, one thread; bench_forward, bench/results/cpu/avx2/);
#: - generic (no AVX2, or not x86): the portable loops are 10-30x slower than oneDNN, so
#:   torch runs every projection there (a row's bits then depend on the rows of its call,
#:   which the lossless methods' exact equality with their references assumes they do not).
#: A limit also lets a prompt's KV round differently when prefilled whole (``ar``) or in
#: blocks (the block-diffusion methods).
PACKED_MAX_ROWS_BY_ISA: dict = {
    "generic": {torch.float32: 0, torch.bfloat16: 0},
    "avx2": {torch.float32: None, torch.bfloat16: None},
    "avx512": {torch.float32: None, torch.bfloat16: None},
    "amx": {torch.float32: None, torch.bfloat16: None},
}
#: a further cap per dtype (None: none); tests lower it to exercise the library GEMM
PACKED_MAX_ROWS: dict = {torch.float32: None, torch.bfloat16: None}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}
_ISA_OF = {}


def linear_isa(dtype: torch.dtype) -> str:
    """The tiles ``dspec._C.linear`` runs for ``dtype`` under the current ISA cap
    ("generic" without the extension); cached per ``dspec.cpu.isa_epoch()``."""
    key = (cpu.isa_epoch(), dtype)
    got = _ISA_OF.get(key)
    if got is None:
        ext = _backend.extension()
        got = ext.linear_isa(DTYPE_CODES[dtype]) if ext is not None and hasattr(ext, "linear_isa") else "generic"
        if any(k[0] != key[0] for k in _ISA_OF):  # a new cap: the old answers go
            _ISA_OF.clear()
        _ISA_OF[key] = got
    return got


def _packed_rows(x: torch.Tensor) -> int:
    """x's row count when the packed path can take x (else 0)."""
    if x.dtype not in DTYPE_CODES:
        return 0
    cap = _max_rows(x.dtype)
    if cap == 0:
        return 0  # no SIMD tiles here: torch, decided first
    ext = _backend.extension()
    if ext is None or not hasattr(ext, "linear_pack") or not x.is_cpu or x.dim() == 0:
        return 0
    rows = x.numel() // max(x.shape[-1], 1)
    return rows if rows and x.is_contiguous() and (cap is None or rows <= cap) else 0


def _max_rows(dtype: torch.dtype) -> int | None:
    """The most rows of ``dtype`` the packed path takes (None: any): the smaller of
    ``PACKED_MAX_ROWS_BY_ISA`` for the tiles of this CPU and ``PACKED_MAX_ROWS``."""
    caps = [c for c in (PACKED_MAX_ROWS_BY_ISA[linear_isa(dtype)][dtype], PACKED_MAX_ROWS[dtype]) if c is not None]
    return min(caps) if caps else None


def within_packed_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether ``rows`` rows of ``dtype`` may take the packed path (``PACKED_MAX_ROWS_BY_ISA``
    for the tiles of this CPU, then ``PACKED_MAX_ROWS``)."""
    cap = _max_rows(dtype)
    return cap is None or rows <= cap


def _weight_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if (
        weight.dtype is not x.dtype
        or not weight.is_cpu
        or weight.dim() != 2
        or x.shape[-1] != weight.shape[-1]
        or weight.stride(1) != 1
    ):
        return False
    if bias is not None and (bias.dtype is not x.dtype or not bias.is_cpu or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    return True


def untracked(*tensors) -> bool:
    """Nothing for autograd to record and no tracer to see (plain tensors or Parameters)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return _library.call_directly(*tensors)


def packed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dense(x, weight)`` runs dspec._C.linear."""
    return bool(_packed_rows(x)) and _weight_fits(x, weight, None) and untracked(x, weight)


_PACKED = "_dspec_linear_packed"


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [O, K] in dspec._C.linear's panel layout.  Packed on first use and kept as
    an attribute of the weight tensor (a plan made once per model, not per call); repacked
    when the weight is modified in place (its version counter) or re-pointed."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(0))
    kept = getattr(weight, _PACKED, None)
    if kept is not None and kept[0] == key:
        return kept[1]
    if not weight.is_cpu or weight.dim() != 2 or weight.stride(1) != 1 or weight.dtype not in DTYPE_CODES:
        raise ValueError(
            f"weight: packing takes a 2-D CPU float32 / bfloat16 tensor with unit column "
            f"stride, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    ext = _backend.extension()
    n, k = weight.shape
    code = DTYPE_CODES[weight.dtype]
    packed = torch.empty(ext.linear_packed_size(n, k, code), dtype=weight.dtype)
    ext.linear_pack(weight.data_ptr(), packed.data_ptr(), code, n, k, weight.stride(0), cpu.kernel_threads())
    setattr(weight, _PACKED, (key, packed))
    return packed


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] -> [..., O]."""
    rows = _packed_rows(x)
    if not rows or not _weight_fits(x, weight, bias) or not untracked(x, weight, bias):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    n = weight.shape[0]
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
    _backend.extension().linear(
        x.data_ptr(),
        packed_weight(weight).data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        DTYPE_CODES[x.dtype],
        rows,
        k,
        n,
        k,
        n,
        cpu.kernel_threads(),
    )
    return out


def dense_many(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """``[dense(x, w, b) for w, b in zip(weights, biases)]`` (q / k / v, gate / up), in one
    dspec._C call when the small-row path takes every weight: one dispatch instead of
    several, and the projections' columns split over the threads together.  Each result is
    bit-identical to its own ``dense`` call."""
    rows = _packed_rows(x)
    ext = _backend.extension()
    if (
        not rows
        or not hasattr(ext, "linear_group")
        or not all(_weight_fits(x, w, b) for w, b in zip(weights, biases))
        or not untracked(x, *weights, *biases)
    ):
        return [dense(x, w, b) for w, b in zip(weights, biases)]
    lead = x.shape[:-1]
    outs = [torch.empty(lead + (w.shape[0],), dtype=x.dtype) for w in weights]
    ext.linear_group(
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        rows,
        x.shape[-1],
        [packed_weight(w).data_ptr() for w in weights],
        [0 if b is None else b.data_ptr() for b in biases],
        [o.data_ptr() for o in outs],
        [w.shape[0] for w in weights],
        cpu.kernel_threads(),
    )
    return outs
