"""Result types returned by the public ops."""
from __future__ import annotations

from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Per-row statistics of a logits tensor; every field has the logits' leading shape.

    token (int64; -1 for an invalid row), prob, margin, entropy (nats), lse (natural log):
    float32.
    """

    token: torch.Tensor
    prob: torch.Tensor
    margin: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
