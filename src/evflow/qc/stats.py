"""Two-sample tests on binned contents, with numpy only (scipy is not a dependency).

``chi2_test`` and ``ks_test`` follow ROOT's ``TH1::Chi2Test`` and
``TH1::KolmogorovTest``: both compare shapes (each histogram normalised to its own
total), so a reference filled with more events than the object is fine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_EPS = 3.0e-14
_MAX_ITER = 500


def gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series below a+1, continued fraction above)."""
    if a <= 0.0:
        raise ValueError(f"gamma_q needs a > 0, got {a}")
    if x <= 0.0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        # P(a, x) by its series; Q = 1 - P
        term = total = 1.0 / a
        ap = a
        for _ in range(_MAX_ITER):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * _EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # Lentz's continued fraction for Q(a, x)
    tiny = 1.0e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return min(1.0, math.exp(log_prefactor) * h)


def chi2_sf(chi2: float, ndf: int) -> float:
    """P(X >= chi2) for a chi-square variable with ``ndf`` degrees of freedom."""
    if ndf <= 0:
        raise ValueError(f"chi-square needs ndf > 0, got {ndf}")
    return gamma_q(ndf / 2.0, chi2 / 2.0)


def kolmogorov_prob(z: float) -> float:
    """P(K >= z) of the Kolmogorov distribution (ROOT's ``TMath::KolmogorovProb``)."""
    if z < 0.2:
        return 1.0
    if z < 1.18:
        # small z: the theta-function form converges in a few terms
        y = math.exp(-(math.pi**2) / (8.0 * z * z))
        s = sum(y ** ((2 * j - 1) ** 2) for j in range(1, 6))
        return max(0.0, min(1.0, 1.0 - math.sqrt(2.0 * math.pi) / z * s))
    s = sum((-1) ** (j - 1) * math.exp(-2.0 * j * j * z * z) for j in range(1, 101))
    return max(0.0, min(1.0, 2.0 * s))


@dataclass(frozen=True)
class TestResult:
    """A test statistic, its p-value and (chi2) the degrees of freedom."""

    statistic: float
    pvalue: float
    ndf: int = 0


def chi2_test(
    values1: np.ndarray,
    values2: np.ndarray,
    variances1: np.ndarray | None = None,
    variances2: np.ndarray | None = None,
) -> TestResult:
    """Chi-square test that two binned contents come from one distribution.

    Unweighted (no variances, or variances equal to the values): ROOT's "UU" form;
    otherwise its "WW" form using the per-bin variances. Bins empty in both are skipped.
    """
    v1 = np.asarray(values1, dtype=float).ravel()
    v2 = np.asarray(values2, dtype=float).ravel()
    if v1.shape != v2.shape:
        raise ValueError(f"chi2 test of {v1.size} bins against {v2.size} bins")
    s1, s2 = v1.sum(), v2.sum()
    if s1 <= 0 or s2 <= 0:
        raise ValueError("chi2 test of an empty histogram")
    e1 = v1 if variances1 is None else np.asarray(variances1, dtype=float).ravel()
    e2 = v2 if variances2 is None else np.asarray(variances2, dtype=float).ravel()
    weighted = not (np.allclose(e1, v1) and np.allclose(e2, v2))
    if weighted:
        denom = s1 * s1 * e2 + s2 * s2 * e1
        used = denom > 0
        chi2 = float(np.sum((s1 * v2[used] - s2 * v1[used]) ** 2 / denom[used]))
    else:
        n = v1 + v2
        used = n > 0
        chi2 = float(np.sum((s2 * v1[used] - s1 * v2[used]) ** 2 / n[used]) / (s1 * s2))
    ndf = int(np.count_nonzero(used)) - 1
    if ndf <= 0:
        raise ValueError("chi2 test needs at least two filled bins")
    return TestResult(chi2, chi2_sf(chi2, ndf), ndf)


def ks_test(
    values1: np.ndarray,
    values2: np.ndarray,
    variances1: np.ndarray | None = None,
    variances2: np.ndarray | None = None,
) -> TestResult:
    """Kolmogorov-Smirnov test between two 1D binned contents.

    D is the largest distance between the normalised cumulative sums; the effective
    entries ``sum(w)**2 / sum(w**2)`` of each side scale it like ROOT does.
    """
    v1 = np.asarray(values1, dtype=float)
    v2 = np.asarray(values2, dtype=float)
    if v1.ndim != 1 or v2.ndim != 1:
        raise ValueError(f"KS test needs 1D contents, got {v1.ndim}D and {v2.ndim}D")
    if v1.shape != v2.shape:
        raise ValueError(f"KS test of {v1.size} bins against {v2.size} bins")
    s1, s2 = v1.sum(), v2.sum()
    if s1 <= 0 or s2 <= 0:
        raise ValueError("KS test of an empty histogram")
    d = float(np.max(np.abs(np.cumsum(v1) / s1 - np.cumsum(v2) / s2)))
    n1 = _effective_entries(v1, variances1)
    n2 = _effective_entries(v2, variances2)
    z = d * math.sqrt(n1 * n2 / (n1 + n2))
    return TestResult(d, kolmogorov_prob(z))


def _effective_entries(values: np.ndarray, variances: np.ndarray | None) -> float:
    if variances is None:
        return float(values.sum())
    var_sum = float(np.sum(variances))
    return float(values.sum()) ** 2 / var_sum if var_sum > 0 else float(values.sum())
