"""DiffuSpec's causal-consistency path search (CPS): the lattice and the search launcher.

:func:`build_lattice` prunes a drafter's per-slot logits into candidates with
``dspec.mass_candidates`` (the fewest top tokens reaching mass ``tau``, at most
``max_candidates``) and always adds the EOS ids (with their own dLLM log-probs) when pruning
dropped them, so a draft can end the text.  :func:`path_search` runs the search: the C++
code of ``dspec._C.diffuspec_search`` (``csrc/diffuspec_search_cpu.cpp``) when the extension
is built, else the Python oracle ``dspec.reference.path_search`` (same output, bit for bit).
The search semantics are documented in ``dspec/reference/path_search.py``.

The search runs on the CPU (it is branchy, small and latency-bound: beams x candidates x
slots is a few thousand scores); lattices on a GPU are copied to the host, which is the one
host synchronisation of a DiffuSpec cycle besides the acceptance counts.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np
import torch

from ..ops import mass_candidates
from .ngram import NgramLM
from .unmask import log_probs

BACKENDS = ("auto", "cpp", "python")


class PathSearchOutput(NamedTuple):
    """tokens int64 [B, L] (-1 past each path), length int64 [B], score float64 [B] (the
    path's summed mixed log-prob), q float32 [B, L, M] (per slot, the proposal probability of
    each candidate given the path before it: sampled paths; one-hot on the chosen
    candidate for beam search)."""

    tokens: torch.Tensor
    length: torch.Tensor
    score: torch.Tensor
    q: torch.Tensor


def build_lattice(logits: torch.Tensor, *, tau: float, max_candidates: int, eos_ids=(), temperature: float = 1.0):
    """The pruned lattice of per-slot drafter logits.

    Parameters
    ----------
    logits : float [B, L, V], the drafter's logits for each drafted slot.
    tau : float in (0, 1], the cumulative-mass threshold of ``mass_candidates``.
    max_candidates : int >= 1, M_max.
    eos_ids : EOS token ids, each kept as a candidate of every slot.
    temperature : the drafter's temperature (log-probs of ``softmax(logits / T)``; 1 when greedy).

    Returns
    -------
    tokens int64 [B, L, M_max + E], logprobs float32 [B, L, M_max + E] (E = len(eos_ids)):
    the mass candidates first, then one column per EOS id (-1 / -inf where that EOS is
    already a mass candidate or has probability 0).
    """
    if not torch.is_tensor(logits) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float tensor [B, L, V], got "
            f"{getattr(logits, 'dtype', type(logits).__name__)} {list(getattr(logits, 'shape', []))}"
        )
    V = logits.shape[-1]
    eos = sorted({int(e) for e in eos_ids})
    if any(not 0 <= e < V for e in eos):
        raise ValueError(f"eos_ids must lie in [0, V = {V}), got {eos}")
    max_m = min(int(max_candidates), V)
    t = temperature if temperature > 0 else 1.0
    tokens, logprobs, _ = mass_candidates(logits, tau, max_m, temperature=t)
    if not eos:
        return tokens, logprobs
    B, L = logits.shape[:2]
    eos_t = torch.tensor(eos, device=logits.device)
    eos_lp = log_probs(logits, eos_t.expand(B, L, -1), t)  # [B, L, E]
    present = (tokens[..., None] == eos_t).any(-2)  # [B, L, E]
    drop = present | torch.isneginf(eos_lp)
    extra_tok = torch.where(drop, torch.full_like(eos_lp, -1, dtype=torch.int64), eos_t.expand(B, L, -1))
    extra_lp = torch.where(drop, torch.full_like(eos_lp, -math.inf), eos_lp)
    return torch.cat([tokens, extra_tok], -1), torch.cat([logprobs.float(), extra_lp], -1)


def cpp_available() -> bool:
    """Whether the built extension has the C++ search."""
    try:
        from .. import _C
    except ImportError:
        return False
    return hasattr(_C, "diffuspec_search")


def path_search(
    cand_tokens,
    cand_logprobs,
    lengths,
    history,
    eos_ids,
    ngram: NgramLM | None,
    *,
    beam: int = 3,
    lam: float = 0.5,
    uniforms=None,
    backend: str | None = None,
) -> PathSearchOutput:
    """Beam search (or, with ``uniforms``, one sampled path) over a lattice.

    Parameters
    ----------
    cand_tokens : int [B, L, M], candidate ids per slot (-1 = none), e.g. from :func:`build_lattice`.
    cand_logprobs : float [B, L, M], their dLLM log-probs.
    lengths : int [B], slots of the lattice each request uses (<= L).
    history : int [B, 2], the last two committed tokens before the path (oldest first; -1 when
        the text is shorter).
    eos_ids : EOS ids: a path stops after its first one.
    ngram : the causal proxy (:class:`dspec.decode.ngram.NgramLM`), or None with ``lam = 1``.
    beam : beam width >= 1.
    lam : weight of the dLLM log-prob in [0, 1]; the proxy gets ``1 - lam``.
    uniforms : float [B, L] in [0, 1), or None. Given: sample one path left to right.
    backend : "auto" (C++ when built), "cpp" or "python"; default ``DSPEC_PATH_SEARCH`` or "auto".

    Returns
    -------
    PathSearchOutput(tokens [B, L], length [B], score [B], q [B, L, M]) on the CPU.
    """
    backend = backend or os.environ.get("DSPEC_PATH_SEARCH", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    tok = _host("cand_tokens", cand_tokens, np.int64, 3)
    B, L, M = tok.shape
    if M < 1:
        raise ValueError("cand_tokens must have M >= 1 candidates per slot")
    lp = _host("cand_logprobs", cand_logprobs, np.float32, 3)
    if lp.shape != tok.shape:
        raise ValueError(f"cand_logprobs must have the shape of cand_tokens {list(tok.shape)}, got {list(lp.shape)}")
    if np.isnan(lp).any() or np.isposinf(lp).any():
        raise ValueError("cand_logprobs must not hold NaN or +inf")
    lengths = _host("lengths", lengths, np.int64, 1)
    if lengths.shape != (B,) or (lengths < 0).any() or (lengths > L).any():
        raise ValueError(f"lengths must be [B = {B}] ints in [0, L = {L}], got {lengths.tolist()}")
    history = _host("history", history, np.int64, 2)
    if history.shape != (B, 2):
        raise ValueError(f"history must have shape [B, 2] = [{B}, 2], got {list(history.shape)}")
    eos = np.ascontiguousarray(sorted({int(e) for e in eos_ids}) or [-1], np.int64)
    num_eos = 0 if eos[0] == -1 and len(eos) == 1 else len(eos)
    if isinstance(beam, bool) or not isinstance(beam, (int, np.integer)) or beam < 1:
        raise ValueError(f"beam must be an int >= 1, got {beam!r}")
    try:
        lam = float(lam)
    except (TypeError, ValueError):
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}") from None
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam!r}")
    if ngram is None:
        if lam != 1.0:
            raise ValueError("ngram is None: lam must be 1 (no causal proxy to mix in)")
    elif not isinstance(ngram, NgramLM):
        raise ValueError(f"ngram must be an NgramLM or None, got {type(ngram).__name__}")
    limit = ngram.vocab_size if ngram is not None else None
    if limit is not None:
        if tok.size and (tok.min() < -1 or tok.max() >= limit):
            raise ValueError(f"cand_tokens must hold -1 or ids in [0, ngram.vocab_size = {limit})")
        if (history < -1).any() or (history >= limit).any():
            raise ValueError(f"history must hold -1 or ids in [0, ngram.vocab_size = {limit})")
    elif tok.size and tok.min() < -1:
        raise ValueError("cand_tokens must hold -1 or ids >= 0")
    uni = None
    if uniforms is not None:
        uni = _host("uniforms", uniforms, np.float32, 2)
        if uni.shape != (B, L):
            raise ValueError(f"uniforms must have shape [B, L] = [{B}, {L}], got {list(uni.shape)}")
        if uni.size and not ((uni >= 0) & (uni < 1)).all():
            raise ValueError("uniforms must lie in [0, 1)")
    use_cpp = backend == "cpp" or (backend == "auto" and cpp_available())
    if backend == "cpp" and not cpp_available():
        raise ValueError("backend='cpp' but dspec._C was built without diffuspec_search: rebuild the extension")
    if not use_cpp:
        from ..reference.path_search import path_search as ref

        out = ref(tok, lp, lengths, history, eos[:num_eos].tolist(), ngram, beam=int(beam), lam=lam, uniforms=uni)
        return PathSearchOutput(*(torch.from_numpy(np.ascontiguousarray(a)) for a in out))
    from .. import _C

    out_tok = np.empty((B, L), np.int64)
    out_len = np.empty(B, np.int64)
    out_score = np.empty(B, np.float64)
    out_q = np.empty((B, L, M), np.float32)
    if ngram is not None:
        tables = ngram.arrays()
        nv = ngram.vocab_size
        ptr = {k: (a.ctypes.data if a.size else 0) for k, a in tables.items()}
        n2, n3 = len(ngram.bigram_keys), len(ngram.trigram_keys)
    else:
        nv, ptr, n2, n3 = (
            0,
            dict.fromkeys(
                (
                    "unigram_logp",
                    "unigram_bow",
                    "bigram_keys",
                    "bigram_logp",
                    "bigram_bow",
                    "trigram_keys",
                    "trigram_logp",
                ),
                0,
            ),
            0,
            0,
        )
    _C.diffuspec_search(
        tok.ctypes.data,
        lp.ctypes.data,
        lengths.ctypes.data,
        history.ctypes.data,
        eos.ctypes.data,
        num_eos,
        B,
        L,
        M,
        int(beam),
        lam,
        uni.ctypes.data if uni is not None else 0,
        nv,
        ptr["unigram_logp"],
        ptr["unigram_bow"],
        ptr["bigram_keys"],
        ptr["bigram_logp"],
        ptr["bigram_bow"],
        n2,
        ptr["trigram_keys"],
        ptr["trigram_logp"],
        n3,
        out_tok.ctypes.data,
        out_len.ctypes.data,
        out_score.ctypes.data,
        out_q.ctypes.data,
    )
    return PathSearchOutput(
        torch.from_numpy(out_tok), torch.from_numpy(out_len), torch.from_numpy(out_score), torch.from_numpy(out_q)
    )


def _host(name: str, x, dtype, dim: int) -> np.ndarray:
    if torch.is_tensor(x):
        if x.dtype == torch.bool or (np.issubdtype(dtype, np.integer) and x.is_floating_point()):
            raise ValueError(f"{name} must be {np.dtype(dtype).name}-compatible, got {x.dtype}")
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x)
    if a.dtype == np.bool_ or (np.issubdtype(dtype, np.integer) and not np.issubdtype(a.dtype, np.integer) and a.size):
        raise ValueError(
            f"{name} must hold {'integers' if np.issubdtype(dtype, np.integer) else 'numbers'}, got {a.dtype}"
        )
    if a.ndim != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {list(a.shape)}")
    return np.ascontiguousarray(a, dtype=dtype)
