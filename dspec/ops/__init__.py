"""Public wrappers: validate inputs, pick a backend, call it."""
from .token_stats import token_stats
from .topk import topk_tokens, mass_candidates
from .boundary import boundary_posterior, rejection_boundaries, expected_accept_length
from .verify import verify_chain, verify_tree
from .attention import CascadeAttentionPlan, cascade_attention, merge_states
from .masks import pack_mask, unpack_mask, tree_mask

__all__ = ["token_stats", "topk_tokens", "mass_candidates", "boundary_posterior",
           "rejection_boundaries", "expected_accept_length", "verify_chain", "verify_tree",
           "cascade_attention", "CascadeAttentionPlan", "merge_states"]
__all__ += ["pack_mask", "unpack_mask", "tree_mask"]
