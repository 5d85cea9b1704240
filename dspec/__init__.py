"""dspec: fused kernels for speculative decoding with diffusion language models.

Importing dspec needs neither a GPU, nvcc nor Triton; kernels load lazily.
"""
from ._validate import config
from .ops import (boundary_posterior, cascade_attention, expected_accept_length,
                  mass_candidates, merge_states, rejection_boundaries, token_stats, topk_tokens,
                  verify_chain, verify_tree)
from .ops import pack_mask, tree_mask, unpack_mask
from .decode import Generation, generate
from .hub import load
from .types import TreeMask, TokenStats, TreeVerifyOutput, VerifyOutput

from . import masks  # noqa: E402  (suffix-mask builders: dspec.masks)

__version__ = "0.1.0"

__all__ = ["Generation", "generate", "load", "TokenStats", "TreeVerifyOutput", "VerifyOutput", "boundary_posterior",
           "cascade_attention", "config", "expected_accept_length", "mass_candidates",
           "merge_states", "rejection_boundaries", "token_stats", "topk_tokens", "verify_chain",
           "verify_tree"]
__all__ += ["TreeMask", "masks", "pack_mask", "tree_mask", "unpack_mask"]
