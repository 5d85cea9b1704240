"""The projections of a forward: ``x @ weight.T + bias`` for every model dspec runs.

A decode or verification step multiplies a handful of rows by each weight matrix; there a
library GEMM spends more time setting up than computing, and its result for a row depends
on how many rows it was given.  ``dense`` sends such calls (CPU, float32 / bfloat16, no
autograd, at most ``SMALL_ROWS`` rows) to ``dspec._C.linear``: the weight packed once into
panels of 16 output columns (``packed_weight``, kept with the weight), float32
accumulation, and a reduction order that does not depend on the number of rows or
threads, so a token's projections are bit-identical in a one-token step
and in a verification of up to ``SMALL_ROWS`` tokens.  Everything else goes to
``torch.nn.functional.linear``.
Every projection of the lean transformer, the mask adapter's base and the DFlash drafter
goes through here, so a path taken by one is taken by all.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _backend, _library

#: the largest row count (batch x suffix tokens) sent to dspec._C.linear per dtype; above
#: it the library GEMM is faster (bench/bench_linear.py, AVX512_BF16 EPYC, 2 threads: the
#: packed kernel is 1.0-1.3x oneDNN's bf16 GEMM at 64 rows and 0.7-1.0x at 128; in fp32
#: it is 1.3-2.5x faster up to 128 rows).  A verification forward of up to this many
#: tokens rounds each token exactly as a one-token step does.
SMALL_ROWS = {torch.float32: 128, torch.bfloat16: 64}
_CODES = {torch.float32: 0, torch.bfloat16: 2}


def _rows_if_small(x: torch.Tensor) -> int:
    """x's row count when the small-row path can take x (else 0)."""
    ext = _backend.extension()
    if ext is None or not hasattr(ext, "linear_pack") or x.dtype not in _CODES or not x.is_cpu or x.dim() == 0:
        return 0
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or rows > SMALL_ROWS[x.dtype] or not x.is_contiguous():
        return 0
    return rows


def _weight_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if (weight.dtype is not x.dtype or not weight.is_cpu or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]
            or weight.stride(1) != 1):
        return False
    if bias is not None and (bias.dtype is not x.dtype or not bias.is_cpu or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    return True


def untracked(*tensors) -> bool:
    """Nothing for autograd to record and no tracer to see (plain tensors or Parameters)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return _library.call_directly(*tensors)


def small_rows_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dense(x, weight)`` runs dspec._C.linear."""
    return bool(_rows_if_small(x)) and _weight_fits(x, weight, None) and untracked(x, weight)


_PACKED = "_dspec_linear_packed"


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [O, K] in dspec._C.linear's panel layout.  Packed on first use and kept as
    an attribute of the weight tensor (a plan made once per model, not per call); repacked
    when the weight is modified in place (its version counter) or re-pointed."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(0))
    kept = getattr(weight, _PACKED, None)
    if kept is not None and kept[0] == key:
        return kept[1]
    ext = _backend.extension()
    n, k = weight.shape
    code = _CODES[weight.dtype]
    packed = torch.empty(ext.linear_packed_size(n, k, code), dtype=weight.dtype)
    ext.linear_pack(weight.data_ptr(), packed.data_ptr(), code, n, k, weight.stride(0), torch.get_num_threads())
    setattr(weight, _PACKED, (key, packed))
    return packed


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] -> [..., O]."""
    rows = _rows_if_small(x)
    if not rows or not _weight_fits(x, weight, bias) or not untracked(x, weight, bias):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    n = weight.shape[0]
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
    _backend.extension().linear(x.data_ptr(), packed_weight(weight).data_ptr(),
                                0 if bias is None else bias.data_ptr(), out.data_ptr(), _CODES[x.dtype], rows, k, n,
                                k, n, torch.get_num_threads())
    return out


def dense_many(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """``[dense(x, w, b) for w, b in zip(weights, biases)]`` (q / k / v, gate / up), in one
    dspec._C call when the small-row path takes every weight: one dispatch instead of
    several, and the projections' columns split over the threads together.  Each result is
    bit-identical to its own ``dense`` call."""
    rows = _rows_if_small(x)
    ext = _backend.extension()
    if (not rows or not hasattr(ext, "linear_group")
            or not all(_weight_fits(x, w, b) for w, b in zip(weights, biases))
            or not untracked(x, *weights, *biases)):
        return [dense(x, w, b) for w, b in zip(weights, biases)]
    lead = x.shape[:-1]
    outs = [torch.empty(lead + (w.shape[0],), dtype=x.dtype) for w in weights]
    ext.linear_group(x.data_ptr(), _CODES[x.dtype], rows, x.shape[-1], [packed_weight(w).data_ptr() for w in weights],
                     [0 if b is None else b.data_ptr() for b in biases], [o.data_ptr() for o in outs],
                     [w.shape[0] for w in weights], torch.get_num_threads())
    return outs
