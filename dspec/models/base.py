"""The base class of dspec's transformer ``Model``, apart from the transformer itself.

:mod:`dspec.models.stack` (which the transformer's forward calls) must tell a dspec
transformer from any other object for :func:`~dspec.models.stack.frozen_weights`; naming
this class instead of :class:`dspec.models.transformer.Model` keeps the import one way
(transformer -> stack -> base).
"""

from __future__ import annotations

from torch import nn

__all__ = ["DecoderModel"]


class DecoderModel(nn.Module):
    """What :class:`dspec.models.transformer.Model` is: decoder layers whose weights
    :func:`dspec.models.stack.frozen_weights` may hold for a scope.  No state, no methods."""
