"""topk_tokens and mass_candidates: the k most likely tokens per row without sorting V."""

from __future__ import annotations

import math

import torch

from .. import _backend, _library, _validate, cpu
from ..reference import topk as _reference

TRITON_MAX_K = 32


def _pick(op: str, logits: torch.Tensor, k: int, backend: str | None) -> str:
    limits = None
    if k > TRITON_MAX_K:
        limits = {
            "triton": f"the Triton kernel handles k <= {TRITON_MAX_K}, got {k}; "
            "use backend='torch' (or 'cpp' on CPU tensors) for larger k"
        }
    return _library.resolve(op, backend, logits.device, ("torch", "triton", "cpp"), limits)


def _topk_ext(logits: torch.Tensor, k: int, temperature: float, tau: float):
    """dspec._C.topk on CPU logits: (tokens [..., k], values [..., k], count [...])."""
    rows = _backend.as_rows(logits)
    lead = logits.shape[:-1]
    n = rows.shape[0]
    tokens = torch.empty(n, k, dtype=torch.int64)
    values = torch.empty(n, k, dtype=torch.float32)
    count = torch.empty(n, dtype=torch.int64)
    _backend.extension().topk(
        rows.data_ptr(),
        _backend.FLOAT_CODE[rows.dtype],
        n,
        rows.shape[1],
        rows.stride(0) if n > 1 else rows.shape[1],
        k,
        temperature,
        tau,
        tokens.data_ptr(),
        values.data_ptr(),
        count.data_ptr(),
        cpu.kernel_threads(),
    )
    return tokens.view(*lead, k), values.view(*lead, k), count.view(lead)


def topk_tokens(logits: torch.Tensor, k: int, *, temperature: float = 1.0, backend: str | None = None):
    """The k most likely tokens of each row and their probabilities.

    Parameters
    ----------
    logits : Tensor [..., V], float32 / float16 / bfloat16
    k : int, 1 <= k <= V (the Triton kernel takes k <= 32; "auto" falls back to torch above)
    temperature : float, positive: probabilities are ``softmax(logits / temperature)``.

    Returns
    -------
    tokens : int64 [..., k], sorted by probability (by logit), ties to the lower id.
    probs : float32 [..., k].
    Rows with a NaN, a +inf or only -inf give tokens -1 and probs NaN.

    Example
    -------
    >>> import torch, dspec
    >>> t, p = dspec.topk_tokens(torch.tensor([[0.0, 3.0, 3.0, 1.0]]), 2)
    >>> t.tolist()
    [[1, 2]]
    """
    _validate.logits("logits", logits)
    k = _validate.positive_int("k", k, upper=logits.shape[-1], upper_name="V")
    temperature = _validate.temperature(temperature)
    name = _pick("topk_tokens", logits, k, backend)
    if _library.call_directly(logits):
        return _topk_tokens_impl(logits, k, temperature, name)
    return _library.topk_tokens(logits, k, temperature, name)


@_library.body('topk_tokens')
def _topk_tokens_impl(logits: torch.Tensor, k: int, temperature: float, name: str):
    """Body of the ``dspec::topk_tokens`` custom op: run backend ``name``."""
    if name == "torch":
        return tuple(_reference.topk_tokens(logits, k, temperature))
    if name == "cpp":
        return _topk_ext(logits, k, temperature, 0.0)[:2]
    from ..kernels.topk import topk_tokens_triton

    return tuple(topk_tokens_triton(logits, k, temperature))


def mass_candidates(
    logits: torch.Tensor, tau: float, max_m: int, *, temperature: float = 1.0, backend: str | None = None
):
    """Per row the fewest top tokens (at most ``max_m``) whose probability mass reaches ``tau``.

    DiffuSpec's lattice pruning.  Parameters as :func:`topk_tokens`, plus ``tau`` in (0, 1].

    Returns
    -------
    tokens : int64 [..., max_m], logprobs : float32 [..., max_m], count : int64 [...]
        Slots past ``count`` hold -1 / -inf.  ``count`` is the smallest m <= max_m with
        top-m mass >= tau (a float32 running sum in rank order), never counting tokens of
        probability 0, and max_m when the mass never reaches tau.  Backends agree exactly
        except where the running mass is within float rounding of tau.  Rows with a NaN, a
        +inf or only -inf have count 0.

    Example
    -------
    >>> import torch, dspec
    >>> t, lp, n = dspec.mass_candidates(torch.tensor([[4.0, 3.0, 0.0, -1.0]]), 0.9, 3)
    >>> n.tolist(), t.tolist()
    ([2], [[0, 1, -1]])
    """
    _validate.logits("logits", logits)
    max_m = _validate.positive_int("max_m", max_m, upper=logits.shape[-1], upper_name="V")
    tau = _validate.real("tau", tau, what="a number in (0, 1]")
    if not (0.0 < tau <= 1.0) or math.isnan(tau):
        raise ValueError(f"tau must be in (0, 1], got {tau!r}")
    temperature = _validate.temperature(temperature)
    name = _pick("mass_candidates", logits, max_m, backend)
    if _library.call_directly(logits):
        return _mass_candidates_impl(logits, tau, max_m, temperature, name)
    return _library.mass_candidates(logits, tau, max_m, temperature, name)


@_library.body('mass_candidates')
def _mass_candidates_impl(logits: torch.Tensor, tau: float, max_m: int, temperature: float, name: str):
    """Body of the ``dspec::mass_candidates`` custom op: run backend ``name``."""
    if name == "torch":
        return tuple(_reference.mass_candidates(logits, tau, max_m, temperature))
    if name == "cpp":
        return _topk_ext(logits, max_m, temperature, tau)
    from ..kernels.topk import mass_candidates_triton

    return tuple(mass_candidates_triton(logits, tau, max_m, temperature))
