"""Plain PyTorch implementations of every op: the oracle for tests, the CPU path, the bench baseline."""

from .boundary import boundary_posterior, expected_accept_length, rejection_boundaries
from .token_stats import token_stats
from .topk import mass_candidates, topk_tokens

__all__ = [
    "token_stats",
    "topk_tokens",
    "mass_candidates",
    "boundary_posterior",
    "rejection_boundaries",
    "expected_accept_length",
]
