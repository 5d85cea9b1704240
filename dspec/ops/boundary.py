"""Acceptance-boundary scores from per-draft confidences (D2SD re-anchoring, S2D2 routing)."""

from __future__ import annotations

import torch

from .. import _library, _validate
from ..reference import boundary as _reference

PROVIDED = ("torch", "triton")


def _conf(conf) -> torch.Tensor:
    _validate.tensor("conf", conf, dim=2, dtypes=_validate.FLOAT_DTYPES)
    _validate.probabilities("conf", conf)
    return conf


def boundary_posterior(conf: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Probability that exactly i drafts are accepted, for i = 0..L.

    Parameters
    ----------
    conf : Tensor [B, L], float, values in [0, 1]: the chance each draft is accepted given
        the earlier ones were (e.g. ``token_stats(...).prob`` of the drafter).

    Returns
    -------
    r : float32 [B, L + 1] with ``r[:, i] = prod(conf[:, :i]) * (1 - conf[:, i])`` for i < L
        and ``r[:, L] = prod(conf)``; computed in log space.

    Example
    -------
    >>> import torch, dspec
    >>> dspec.boundary_posterior(torch.tensor([[0.5, 0.5]])).tolist()
    [[0.5, 0.25, 0.25]]
    """
    _conf(conf)
    name = _library.resolve("boundary_posterior", backend, conf.device, PROVIDED)
    if _library.call_directly(conf):
        return _boundary_posterior_impl(conf, name)
    return _library.boundary_posterior(conf, name)


@_library.body('boundary_posterior')
def _boundary_posterior_impl(conf: torch.Tensor, name: str) -> torch.Tensor:
    """Body of the ``dspec::boundary_posterior`` custom op: run backend ``name``."""
    if name == "torch":
        return _reference.boundary_posterior(conf)
    from ..kernels.boundary import boundary_triton

    return boundary_triton(conf, want_r=True)[0]


def rejection_boundaries(conf: torch.Tensor, k: int, *, backend: str | None = None):
    """The k most likely rejection points: prefix lengths i in [0, L-1] with the largest r_i.

    Returns
    -------
    lengths : int64 [B, k], largest r first, ties to the smaller i (ranked in log space, so
        boundaries whose r underflows to 0 are still ordered).
    r : float32 [B, k], their posterior probabilities.

    Example
    -------
    >>> import torch, dspec
    >>> dspec.rejection_boundaries(torch.tensor([[0.9, 0.5, 0.9]]), 2)[0].tolist()
    [[1, 0]]
    """
    _conf(conf)
    k = _validate.positive_int("k", k, upper=conf.shape[1], upper_name="L")
    name = _library.resolve("rejection_boundaries", backend, conf.device, PROVIDED)
    if _library.call_directly(conf):
        return _rejection_boundaries_impl(conf, k, name)
    return _library.rejection_boundaries(conf, k, name)


@_library.body('rejection_boundaries')
def _rejection_boundaries_impl(conf: torch.Tensor, k: int, name: str):
    """Body of the ``dspec::rejection_boundaries`` custom op: run backend ``name``."""
    if name == "torch":
        return tuple(_reference.rejection_boundaries(conf, k))
    from ..kernels.boundary import boundary_triton

    _, lengths, r, _ = boundary_triton(conf, k)
    return lengths, r


def expected_accept_length(conf: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Expected number of accepted drafts, ``sum_{i=1..L} prod_{j<=i} conf_j``: float32 [B].

    Example
    -------
    >>> import torch, dspec
    >>> dspec.expected_accept_length(torch.tensor([[0.5, 0.5]])).tolist()
    [0.75]
    """
    _conf(conf)
    name = _library.resolve("expected_accept_length", backend, conf.device, PROVIDED)
    if _library.call_directly(conf):
        return _expected_accept_length_impl(conf, name)
    return _library.expected_accept_length(conf, name)


@_library.body('expected_accept_length')
def _expected_accept_length_impl(conf: torch.Tensor, name: str) -> torch.Tensor:
    """Body of the ``dspec::expected_accept_length`` custom op: run backend ``name``."""
    if name == "torch":
        return _reference.expected_accept_length(conf)
    from ..kernels.boundary import boundary_triton

    return boundary_triton(conf, want_expected=True)[3]
