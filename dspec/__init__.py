"""dspec: fused kernels for speculative decoding with diffusion language models.

Importing dspec needs neither a GPU, nvcc nor Triton; kernels load lazily.
"""

import os as _os

from . import masks  # suffix-mask builders: dspec.masks
from ._validate import config
from .decode import Generation, generate
from .hub import load
from .ops import (
    CascadeAttentionPlan,
    best_first_tree,
    boundary_posterior,
    cascade_attention,
    expected_accept_length,
    mass_candidates,
    merge_states,
    pack_mask,
    rejection_boundaries,
    token_stats,
    topk_tokens,
    tree_mask,
    unpack_mask,
    verify_chain,
    verify_tree,
)
from .types import BestFirstTree, TokenStats, TreeMask, TreeVerifyOutput, VerifyOutput

if _os.environ.get("DSPEC_NUM_THREADS"):  # an explicit choice holds for the Python API too
    from .cpu import apply_threads as _apply_threads

    _apply_threads()

__version__ = "0.1.0"

__all__ = [
    "BestFirstTree",
    "CascadeAttentionPlan",
    "Generation",
    "TokenStats",
    "TreeMask",
    "TreeVerifyOutput",
    "VerifyOutput",
    "best_first_tree",
    "boundary_posterior",
    "cascade_attention",
    "config",
    "expected_accept_length",
    "generate",
    "load",
    "masks",
    "mass_candidates",
    "merge_states",
    "pack_mask",
    "rejection_boundaries",
    "token_stats",
    "topk_tokens",
    "tree_mask",
    "unpack_mask",
    "verify_chain",
    "verify_tree",
]


def __getattr__(name: str):
    """``dspec.hf`` (transformers' ``custom_generate``) and ``dspec.compat`` (other libraries'
    signatures) load on first use, so ``import dspec`` stays light."""
    if name in ("hf", "compat"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dspec' has no attribute {name!r}")
