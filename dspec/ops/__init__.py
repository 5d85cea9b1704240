"""Public wrappers: validate inputs, pick a backend, call it."""

from .attention import CascadeAttentionPlan, cascade_attention, merge_states
from .boundary import boundary_posterior, expected_accept_length, rejection_boundaries
from .masks import pack_mask, tree_mask, unpack_mask
from .token_stats import token_stats
from .topk import mass_candidates, topk_tokens
from .tree import best_first_tree
from .verify import verify_chain, verify_tree

__all__ = [
    "token_stats",
    "topk_tokens",
    "mass_candidates",
    "boundary_posterior",
    "rejection_boundaries",
    "expected_accept_length",
    "verify_chain",
    "verify_tree",
    "cascade_attention",
    "CascadeAttentionPlan",
    "merge_states",
]
__all__ += ["pack_mask", "unpack_mask", "tree_mask"]
__all__ += ["best_first_tree"]
