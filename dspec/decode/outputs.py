"""Generated tokens of a batch as one host array: a decode cycle extends every live request
with array ops, never a Python loop over requests or tokens."""

from __future__ import annotations

import numpy as np


class OutputBuffer:
    """Each request's generated tokens (``tokens`` [B, max_new_tokens] int64, ``lengths`` [B])
    with the stopping rules of ``dspec.generate``: a request ends after its first EOS or at
    ``max_new_tokens``.  numpy, not torch: ~1 us an op on these few-element host arrays, where
    a torch op costs ~8."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids, progress=None):
        self.tokens = np.full((batch, max_new_tokens), -1, dtype=np.int64)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.eos = np.array(sorted({int(e) for e in eos_ids}) or [-1], dtype=np.int64)
        self.max_new_tokens = max_new_tokens
        self.progress = progress

    def extend(
        self, requests: np.ndarray, tokens: np.ndarray, counts: np.ndarray, *, only_done: bool = False
    ) -> np.ndarray:
        """Append ``tokens[a, :counts[a]]`` to request ``requests[a]`` (host arrays [A], [A, W],
        [A]), cut after an EOS and at ``max_new_tokens``; returns which of the A requests are
        done (bool [A]).  ``only_done``: append only to the requests this would finish."""
        width = tokens.shape[1]
        col = np.arange(width)
        is_eos = (tokens[:, :, None] == self.eos).any(2) & (col < counts[:, None])  # np.isin: ~0.2 ms
        eos_end = np.where(is_eos.any(1), is_eos.argmax(1) + 1, width + 1)
        length = self.lengths[requests]
        take = np.minimum(np.minimum(counts, eos_end), self.max_new_tokens - length)
        done = (eos_end <= take) | (length + take >= self.max_new_tokens)
        if only_done:
            take = np.where(done, take, 0)
        r, c = np.nonzero(col < take[:, None])
        self.tokens[requests[r], length[r] + c] = tokens[r, c]
        self.lengths[requests] = length + take
        if self.progress is not None:
            self.progress.update(int(take.sum()) / self.tokens.shape[0])
        return done

    def extend_block(
        self,
        requests: np.ndarray,
        block: np.ndarray,
        block_start: np.ndarray,
        prompt_len: np.ndarray,
        *,
        only_done: bool = False,
    ) -> np.ndarray:
        """:meth:`extend` by complete blocks of a block-diffusion decode: ``block`` [A, bs]
        holds text positions ``block_start[a] .. + bs``, of which those before
        ``prompt_len[a]`` (the prompt's tail) are not output."""
        bs = block.shape[1]
        skip = np.clip(prompt_len - block_start, 0, bs)
        at = np.minimum(skip[:, None] + np.arange(bs), bs - 1)
        return self.extend(requests, np.take_along_axis(block, at, 1), bs - skip, only_done=only_done)

    def block_ends(
        self,
        requests: np.ndarray,
        block: np.ndarray,
        known: np.ndarray,
        block_start: np.ndarray,
        prompt_len: np.ndarray,
    ) -> np.ndarray:
        """Which of ``requests`` (host [A]) end inside their unfinished block: ``block`` [A, bs]
        at text positions ``block_start`` [A] .., ``known`` [A, bs] bool its committed slots
        (the prompt's tail and the generated slots decoded so far).  A request ends there when
        the committed run of its generated slots from the block's first one holds an EOS or
        reaches ``max_new_tokens``: :meth:`extend_block` of the block as it stands then
        outputs exactly what the finished block would, and marks the request done, so its
        decoding may stop before the block's later slots are decoded (bool [A])."""
        bs = block.shape[1]
        skip = np.clip(prompt_len - block_start, 0, bs)
        col = np.arange(bs)
        gen = col >= skip[:, None]
        run = np.cumprod(np.where(gen, known, True), axis=1).astype(bool) & gen  # the committed run
        count = run.sum(1)
        eos = (run & (block[:, :, None] == self.eos).any(2)).any(1)
        return eos | (count >= self.max_new_tokens - self.lengths[requests])

    def remaining(self, requests: np.ndarray) -> np.ndarray:
        """Tokens each of ``requests`` may still generate."""
        return self.max_new_tokens - self.lengths[requests]

    @property
    def generated(self) -> list[list[int]]:
        """Each request's generated tokens (up to and including EOS)."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]
