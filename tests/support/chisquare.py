"""Pearson's chi-square goodness-of-fit p-value, for the losslessness checks of speculative sampling
(tests/unit/pipeline/test_scheduler.py, tests/unit/training/test_spec_sampling.py)."""
import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value = Q((k - 1) / 2, stat / 2) (upper regularised gamma)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64), stat / 2))
