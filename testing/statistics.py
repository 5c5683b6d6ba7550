"""Statistical checks the exactness tests share: sampled counts against a distribution."""

from __future__ import annotations

import torch

CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
"""Chi-square critical values at p = 0.001 by degrees of freedom (no scipy here)."""


def chi2_passes(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts consistent with `probs` at p = 0.001; a zero-probability token must never appear."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * counts.sum()
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic < CHI2_CRITICAL_P001[int(support.sum()) - 1]
