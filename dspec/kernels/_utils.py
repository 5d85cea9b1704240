"""Launch helpers shared by the Triton kernels."""
from __future__ import annotations

import functools

import torch
import triton

from .._backend import as_rows  # noqa: F401  (re-exported for the kernels)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def parallel_units(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 4 elsewhere (interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def vocab_splits(rows: int, vocab: int, block: int, device: torch.device,
                 min_tiles_per_split: int = 4) -> int:
    """How many programs share one row's vocabulary so that small batches fill the GPU.

    Aim for two programs per SM, but never give a program fewer than
    ``min_tiles_per_split`` tiles (the merge pass would then cost more than it saves).
    """
    tiles = -(-vocab // block)
    want = -(-2 * parallel_units(device) // max(rows, 1))
    return max(1, min(want, tiles // min_tiles_per_split))
