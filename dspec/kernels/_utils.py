"""Launch helpers shared by the Triton kernels."""

from __future__ import annotations

import triton

from .._backend import as_rows, parallel_units, vocab_splits  # noqa: F401  (re-exported for the kernels)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
