"""token_stats: one read of the logits gives argmax, its probability, margin, entropy, lse."""

from __future__ import annotations

import torch

from .. import _backend, _library, _validate, cpu
from ..reference.token_stats import token_stats as _token_stats_reference
from ..types import TokenStats
from . import _sampling_params


def token_stats(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k=0, top_p=1.0, backend: str | None = None
) -> TokenStats:
    """Per-row statistics of ``softmax(logits / temperature)`` from a single pass.

    Parameters
    ----------
    logits : Tensor [..., V], float32 / float16 / bfloat16
        Any leading shape; the last dimension is the vocabulary.
    temperature : float
        Positive and finite.  The maximum is subtracted before the division, so tiny
        temperatures do not overflow.
    top_k : int or int tensor [B], top_p : float or float tensor [B], optional
        Per request b = ``logits``' first index (``logits`` then [B, ..., V]); a float tensor
        [B] ``temperature`` too, its rows <= 0 greedy.  With any of them the statistics are
        those of the filtered distribution, softmax of ``logits / T_b`` over the top-k set
        then the smallest top set reaching top_p (``dspec.reference.sampling_params``):
        prob, margin and entropy renormalised over the kept tokens, lse the logsumexp of the
        kept scaled logits; token (the argmax) is unchanged.  Greedy rows report the one-hot
        distribution on the argmax: prob = margin = 1, entropy = 0, lse = the row maximum.
    backend : "auto" | "torch" | "triton" | "cuda" | "cpp", optional
        Defaults to ``$DSPEC_BACKEND`` or "auto".

    Returns
    -------
    TokenStats(token, prob, margin, entropy, lse), each of shape ``logits.shape[:-1]``:
    token int64 (argmax, lowest id on ties); prob, margin (top-1 minus top-2 probability),
    entropy (nats) and lse (natural log) float32.  A row with a NaN, a +inf, or only -inf
    has token -1 and NaN prob/margin/entropy; its lse is NaN, +inf or -inf respectively.

    Example
    -------
    >>> import torch, dspec
    >>> s = dspec.token_stats(torch.tensor([[2.0, 1.0, 0.0]]))
    >>> s.token.tolist(), round(s.prob.item(), 4)
    ([0], 0.6652)
    >>> s = dspec.token_stats(torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]),
    ...                       temperature=torch.tensor([0.0, 1.0]), top_k=2)
    >>> [round(v, 4) for v in s.prob.tolist()]
    [1.0, 0.7311]
    """
    _validate.logits("logits", logits)
    if _sampling_params.engaged(temperature, top_k, top_p, None):
        return _sampling_params.token_stats(token_stats, logits, temperature, top_k, top_p, backend)
    temperature = _validate.temperature(temperature)
    name = _library.resolve("token_stats", backend, logits.device, ("torch", "triton", "cuda", "cpp"))
    if _library.call_directly(logits):
        return TokenStats(*_token_stats_impl(logits, temperature, name))
    return TokenStats(*_library.token_stats(logits, temperature, name))


@_library.body('token_stats')
def _token_stats_impl(logits: torch.Tensor, temperature: float, name: str):
    """Run the resolved backend ``name`` (the body of the ``dspec::token_stats`` custom op)."""
    if name == "torch":
        return tuple(_token_stats_reference(logits, temperature))
    if name == "triton":
        from ..kernels.token_stats import token_stats_triton

        return tuple(token_stats_triton(logits, temperature))
    return _token_stats_ext(logits, temperature, cuda=name == "cuda")


def _token_stats_ext(logits: torch.Tensor, temperature: float, *, cuda: bool):
    ext = _backend.extension()
    lead = logits.shape[:-1]
    x = _backend.as_rows(logits)
    rows, vocab = x.shape
    dev = x.device
    token = torch.empty(rows, dtype=torch.int64, device=dev)
    prob, margin, entropy, lse = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(4))
    if rows:
        splits, workspace, stream = 1, 0, 0
        if cuda:
            splits = _backend.vocab_splits(rows, vocab, ext.token_stats_tile, dev, min_tiles_per_split=2)
            if splits > 1:
                ws = torch.empty(ext.token_stats_workspace_bytes(rows, splits), dtype=torch.uint8, device=dev)
                workspace = ws.data_ptr()
            stream = _backend.cuda_stream(dev, True)
        with _backend.launch_context(dev, cuda):  # launch on x's GPU
            ext.token_stats(
                x.data_ptr(),
                _backend.FLOAT_CODE[x.dtype],
                rows,
                vocab,
                x.stride(0),
                1.0 / temperature,
                token.data_ptr(),
                prob.data_ptr(),
                margin.data_ptr(),
                entropy.data_ptr(),
                lse.data_ptr(),
                "cuda" if cuda else "cpu",
                stream,
                splits,
                workspace,
                cpu.kernel_threads(),
            )
    return tuple(t.reshape(lead) for t in (token, prob, margin, entropy, lse))
