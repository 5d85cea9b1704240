"""Next-token choice shared by every method, so that all of them use one sampler.

Greedy is the argmax with ties to the lowest id (``token_stats``); sampling at temperature
T is a draw from ``softmax(logits / T)`` by inverse CDF with one uniform per row, exactly
``verify_chain``'s bonus-token draw.  With the same uniforms the AR baseline and the
speculative methods therefore pick the same token from the same distribution.

A forward whose logits hold NaN or inf stops every method with one ValueError
(:func:`require_finite`, called wherever a method picks tokens) instead of feeding the ops'
-1 mark back to a model.

Seeded sampling draws its uniforms from :class:`RequestStreams`: one counter-based stream
per request, so that a request's tokens never depend on the other requests of its batch.
"""

from __future__ import annotations

import operator
import os

import numpy as np
import torch

from .._validate import config
from ..ops import token_stats, verify_chain
from ..reference.verify import draw

_M64 = (1 << 64) - 1
_DRAW = 0x9E3779B97F4A7C15  # odd: keeps the draw counter's mix apart from the request's


def non_finite_error(who: str = "model") -> ValueError:
    """The error every method raises when ``who``'s forward gave a logits row holding NaN or
    +inf (or only -inf): there is no distribution to pick a token from."""
    return ValueError(
        f"the {who}'s logits hold NaN or inf (a non-finite forward: check its weights, dtype "
        f"and inputs); decoding stopped"
    )


def require_finite(tokens: torch.Tensor, who: str = "model") -> torch.Tensor:
    """``tokens`` (picked token ids, any shape) unchanged, or ValueError when one of them is
    -1: the mark ``token_stats``, ``topk_tokens``, ``verify_chain`` / ``verify_tree`` and the
    shared draw give a logits row holding NaN or +inf (or only -inf).  Every method checks
    the tokens it picks here, so a non-finite forward stops the call with one clear error
    before a -1 could be fed back to a model as a token.  One host read of one flag."""
    if tokens.numel() and bool((tokens < 0).any()):
        raise non_finite_error(who)
    return tokens


def _mix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser: a bijection on 64-bit ints with ``_mix64(0) == 0``."""
    x &= _M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a seeded batch: ``dspec.generate(m, prompts, seed=s)[i]``
    decodes exactly as ``dspec.generate(m, prompts[i], seed=request_seed(s, i))``; request 0
    keeps ``s`` (``request_seed(s, 0) == s``), so a batch's first request is its single call."""
    return (int(seed) ^ _mix64(int(index))) & _M64


class RequestStreams:
    """Seeded sampling's random numbers: one counter-based stream per request of a batch.

    Draw ``c`` of request ``r`` (its ``c``-th :meth:`uniforms` call that advances it) comes
    from the CPU Mersenne Twister seeded with a key of (the request's seed, ``c``) alone, its
    values in increasing position order.  So a request's draws depend neither on which other
    rows share the step nor on when they finish, and a draw padded wider than the row needs
    holds the row's own draw as its prefix.  Draw 0 of a request seeded ``s`` is
    ``torch.Generator().manual_seed(s)``'s first values (for ``s < 2**32``).  The uniforms are
    drawn on the host and copied to the device: the same uniforms on every device.  ``torch``'s global RNG is never
    read or advanced.
    """

    def __init__(self, seeds, device="cpu"):
        self.seeds = [int(s) & _M64 for s in seeds]
        self.draws = [0] * len(self.seeds)
        self.device = torch.device(device)
        self._gen = torch.Generator()

    @classmethod
    def seeded(cls, seed: int | None, batch: int, device="cpu") -> "RequestStreams":
        """Streams for ``batch`` requests: request i seeded ``request_seed(seed, i)``; without a
        seed, fresh OS entropy (never ``torch.seed()``, which reseeds the global RNG)."""
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        return cls([request_seed(seed, i) for i in range(batch)], device)

    def uniforms(self, requests, width: int, advance=None) -> torch.Tensor:
        """float32 [len(requests), width] in [0, 1) on the device: row j is the next draw of
        request ``requests[j]`` (host ints: a list, numpy or CPU tensor).  ``advance`` (bool per
        row, default all): rows that use this draw; the others get zeros and keep their
        counter, so a row idle in a step draws what it would draw alone."""
        requests = _host_list(requests)
        go = [True] * len(requests) if advance is None else [bool(a) for a in _host_list(advance)]
        out = torch.zeros(len(requests), width)
        gen, seeds, draws = self._gen, self.seeds, self.draws
        for row, req in enumerate(requests):
            if not go[row]:
                continue
            count = draws[req]
            draws[req] = count + 1
            key = seeds[req] ^ _mix64(count * _DRAW)
            gen.manual_seed((key ^ (key >> 32)) & 0xFFFFFFFF)  # the engine's seed is 32-bit
            out[row].uniform_(generator=gen)
        return out if self.device.type == "cpu" else out.to(self.device)

    def chain(self, requests, length: int, advance=None) -> dict:
        """``verify_chain``'s randomness for rows ``requests`` with ``length`` drafts (the
        padded width): one draw, the sample uniform first, then the coins."""
        u = self.uniforms(requests, length + 1, advance)
        return {"sample_uniforms": u[:, 0], "coins": u[:, 1:]}

    def tree(self, requests, nodes: int, advance=None) -> dict:
        """``verify_tree``'s randomness for rows ``requests`` of a tree of ``nodes`` nodes."""
        return self.chain(requests, nodes, advance)


def _host_list(x) -> list:
    if torch.is_tensor(x):
        return x.tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return [operator.index(v) if not isinstance(v, (bool, np.bool_)) else bool(v) for v in x]


def request_streams(generator, batch: int, device) -> RequestStreams | None:
    """A method's ``generator`` argument as request streams: None (greedy) stays None, streams
    stay as given, and a ``torch.Generator`` seeds a batch of streams with one draw from it."""
    if generator is None or isinstance(generator, RequestStreams):
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return RequestStreams.seeded(seed, batch, device)


def next_tokens(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    *,
    who: str = "model",
    check: bool | None = None,
):
    """logits [B, V] -> token ids [B] (int64).  At T > 0 the draw uses ``uniforms`` [B] when
    given (the rows' :class:`RequestStreams` draws), else ``generator``.  ValueError where a
    row is not finite (:func:`require_finite`, one host read; ``check=False`` leaves the -1 to
    the caller; default: ``dspec.config.validate_values``, so a sync-free engine loop that
    switched value checks off reads nothing back)."""
    if check is None:
        check = config.validate_values
    if temperature <= 0:
        tokens = token_stats(logits).token
    else:
        batch = logits.shape[0]
        empty = torch.zeros(batch, 0, dtype=torch.int64, device=logits.device)
        if uniforms is not None:
            tokens = verify_chain(
                empty,
                logits[:, None],
                temperature=temperature,
                coins=torch.zeros(batch, 0, device=logits.device),
                sample_uniforms=uniforms.reshape(batch),
            ).tokens[:, 0]
        else:
            tokens = verify_chain(empty, logits[:, None], temperature=temperature, generator=generator).tokens[:, 0]
    return require_finite(tokens, who) if check else tokens


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from unnormalised weights probs [..., V] with uniforms [...] in
    [0, 1): ``verify_chain``'s draw rule itself (``dspec.reference.verify.draw``: the smallest
    id v with ``cumsum(probs)[v] > u * sum(probs)``), int64 [...]."""
    vocab = probs.shape[-1]
    return draw(probs.reshape(-1, vocab).float(), uniforms.reshape(-1)).view(uniforms.shape)
