"""Goodness-of-fit checks shared by the sampling tests: Pearson's chi-square with sparse cells
pooled, its p-value and the lenient 6-sigma bound the decoder tests use."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class ChiSquare(NamedTuple):
    statistic: float  # inf where a cell expected 0 was observed
    df: int  # the cells with a nonzero expectation, less one
    pvalue: float

    @property
    def bound(self) -> float:
        """df + 6 sqrt(2 df): six standard deviations above the statistic's mean under the
        law (a false alarm about once in 10^6 runs, for the degrees of freedom tested)."""
        return self.df + 6 * math.sqrt(2 * self.df)

    @property
    def fits(self) -> bool:
        """The counts fit the law within :attr:`bound`."""
        return self.statistic < self.bound


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> ChiSquare:
    """Pearson's chi-square of ``counts`` [C] against the law ``probs`` [C]: the cells expecting
    fewer than ``min_expected`` samples pooled into one, the cells expecting none dropped (an
    observation in one makes the statistic infinite)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return ChiSquare(math.inf, max(int(keep.sum()) - 1, 0), 0.0)
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return ChiSquare(stat, df, pvalue)
