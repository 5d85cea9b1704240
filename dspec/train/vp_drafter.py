"""Training recipe of D2SD's variable-prefix drafter (VP-drafter).

The VP-drafter has the DFlash drafter's architecture (:class:`dspec.models.dflash.BlockDrafter`,
kind "vp") and is trained by the same recipe (:mod:`dspec.train.dflash`: target-generated
responses, target hidden-state conditioning, one no-grad target forward per step) with one
difference: each training block ``[x_p, x_{p+1} .. x_{p+i}, MASK ...]`` gives the drafter a
prefix of i true tokens and asks it to re-draft the rest, as D2SD does at a rejection
boundary after i accepted drafts.

- Prefix prior: i is drawn from a **truncated geometric** distribution on [0, G-2]
  (L = G - 1 drafts, boundaries 0 .. L-1 as ``dspec.rejection_boundaries`` returns them):
  ``P(i) = a^i (1 - a) / (1 - a^L)``, the law of "exactly i drafts accepted" when each is
  accepted with probability a (``prefix_accept``, default 0.7).
- Loss: cross-entropy of slots j > i, weighted ``exp(-(j - i - 1) / decay)``: decaying with
  the distance from the re-draft's anchor (the last given token), since a later slot only
  matters when the ones before it are accepted (:func:`dspec.models.dflash.block_loss_weights`).

CLI: ``python -m dspec.train.vp_drafter --target tiny-ar --out DIR [--minutes M]
[--dflash-drafter DIR]`` (the DFlash drafter, default the shipped one, is used only to
measure D2SD's acceptance for the model card).
"""

from __future__ import annotations

import torch

from .._cli import run_command
from .dflash import DrafterTrainConfig, main as _main


def prefix_prior(num_drafts: int, accept: float) -> torch.Tensor:
    """Truncated geometric prior over prefix lengths i in [0, num_drafts - 1]:
    ``P(i) = a^i (1 - a) / (1 - a^L)`` (float64 [L], sums to 1)."""
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"num_drafts must be an int >= 1, got {num_drafts!r}")
    if not 0 < accept < 1:
        raise ValueError(f"accept must lie in (0, 1), got {accept!r}")
    i = torch.arange(num_drafts, dtype=torch.float64)
    p = accept**i * (1 - accept)
    return p / p.sum()


def sample_prefix_lengths(generator: torch.Generator, shape, num_drafts: int, accept: float) -> torch.Tensor:
    """Prefix lengths int64 ``shape`` drawn i.i.d. from :func:`prefix_prior`."""
    probs = prefix_prior(num_drafts, accept)
    flat = torch.multinomial(probs, int(torch.Size(shape).numel()), replacement=True, generator=generator)
    return flat.view(shape)


def prefix_sampler(cfg: DrafterTrainConfig):
    """The recipe's sampler: callable(generator, shape) -> prefix lengths for block size G."""
    num_drafts = cfg.block_size - 1

    def sample(generator, shape):
        return sample_prefix_lengths(generator, shape, num_drafts, cfg.prefix_accept)

    return sample


def main(argv=None) -> dict:
    return _main(argv, kind="vp", prefix_sampler_factory=prefix_sampler)


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))
