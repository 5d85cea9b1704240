"""The projections of a forward: ``x @ weight.T + bias`` for every model dspec runs.

A decode or verification step multiplies a handful of rows by each weight matrix; there a
library GEMM spends more time setting up than computing, and its result for a row depends
on how many rows it was given.  ``dense`` sends such calls (CPU, float32 / bfloat16, no
autograd, at most ``SMALL_ROWS`` rows) to ``dspec._C.linear``: the weight streamed once per
block of rows, float32 accumulation, and a reduction order that does not depend on the
number of rows or threads, so a token's projections are bit-identical in a one-token step
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
#: it the library GEMM is faster (bench/bench_linear.py: on an AVX512_BF16 EPYC oneDNN's
#: bf16 GEMM wins from ~16 rows, its fp32 GEMM from ~128).  A verification forward of up to
#: this many tokens rounds each token exactly as a one-token step does.
SMALL_ROWS = {torch.float32: 64, torch.bfloat16: 16}
_CODES = {torch.float32: 0, torch.bfloat16: 2}


def small_rows_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dense(x, weight)`` runs dspec._C.linear."""
    ext = _backend.extension()
    if ext is None or not hasattr(ext, "linear"):
        return False
    if x.dtype not in _CODES or weight.dtype is not x.dtype or not x.is_cpu or not weight.is_cpu:
        return False
    if x.dim() == 0 or x.shape[-1] != weight.shape[-1] or weight.dim() != 2 or weight.stride(1) != 1:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or rows > SMALL_ROWS[x.dtype] or not x.is_contiguous():
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return _library.call_directly(x, weight)       # plain tensors (or Parameters), nothing tracing


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] -> [..., O]."""
    if not small_rows_path(x, weight) or (bias is not None and (bias.dtype is not x.dtype or not bias.is_cpu
                                                               or bias.stride(0) != 1 or bias.requires_grad
                                                               and torch.is_grad_enabled())):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.numel() // k
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
    _backend.extension().linear(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                out.data_ptr(), _CODES[x.dtype], rows, k, n, k, weight.stride(0), n,
                                torch.get_num_threads())
    return out
