"""Reference boundary_posterior, rejection_boundaries and expected_accept_length.

With ``c = log(conf)`` and ``C_i = sum_{j<i} c_j`` (float32, in order):
``log r_i = C_i + log1p(-conf_i)`` for i < L and ``log r_L = C_L``; ``r = exp(log r)``.
Ranking for rejection_boundaries uses ``log r`` (no underflow: two boundaries whose r both
underflow to 0 are still ordered correctly), ties to the smaller i.
``expected_accept_length = sum_{i=1..L} exp(C_i)`` (``exp(C_{i})`` with ``C`` inclusive).
"""

from __future__ import annotations

import torch


def _log_boundary(conf: torch.Tensor) -> torch.Tensor:
    c = conf.float()
    log_c = torch.log(c)
    inclusive = torch.cumsum(log_c, -1)
    zero = c.new_zeros(*c.shape[:-1], 1)
    exclusive = torch.cat([zero, inclusive], -1)  # [B, L+1]
    tail = torch.cat([torch.log1p(-c), zero], -1)
    return exclusive + tail


def boundary_posterior(conf: torch.Tensor) -> torch.Tensor:
    return torch.exp(_log_boundary(conf))


def rejection_boundaries(conf: torch.Tensor, k: int):
    log_r = _log_boundary(conf)[..., :-1]
    _, order = torch.sort(log_r, dim=-1, descending=True, stable=True)
    lengths = order[..., :k]
    return lengths, torch.exp(torch.gather(log_r, -1, lengths))


def expected_accept_length(conf: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.cumsum(torch.log(conf.float()), -1)).sum(-1)
