"""Other libraries' signatures over dspec's ops.

``dspec.compat.flashinfer`` offers flashinfer's ``chain_speculative_sampling``,
``merge_state``, ``merge_state_in_place`` and ``merge_states`` (same argument names,
defaults, dtypes and return values) on CPU and CUDA tensors, so that an engine written
against flashinfer runs where flashinfer does not (a CPU).
"""

from . import flashinfer

__all__ = ["flashinfer"]
