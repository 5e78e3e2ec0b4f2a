"""Two-sample tests with their p-values, in plain Python (no scipy here): whether two
samples could come from one distribution.

- `ks_test`: Kolmogorov-Smirnov on numbers (response lengths), the asymptotic p-value
  with the Stephens small-sample correction;
- `proportions_test`: two proportions (rewards of 0 and 1, or their means), a z-test;
- `chi2_test`: categorical counts (first tokens), a chi-square test of homogeneity over
  the categories with enough expected counts, the rest pooled into one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TestResult:
    statistic: float
    p_value: float
    n: tuple[int, int]
    dof: int = 0

    def to_json(self) -> dict[str, float | int | list[int]]:
        return {"statistic": self.statistic, "p_value": self.p_value, "n": list(self.n), "dof": self.dof}


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for Kolmogorov's distribution: 2 sum (-1)^(k-1) exp(-2 k^2 x^2)."""
    if x <= 0:
        return 1.0
    if x < 0.3:
        # The alternating series converges slowly here; the complement's theta-function
        # form converges fast: P(K <= x) = sqrt(2 pi)/x sum exp(-(2k-1)^2 pi^2 / (8 x^2)).
        s = sum(math.exp(-((2 * k - 1) ** 2) * math.pi**2 / (8 * x * x)) for k in range(1, 20))
        return max(0.0, 1.0 - math.sqrt(2 * math.pi) / x * s)
    total = 0.0
    for k in range(1, 101):
        term = 2 * (-1) ** (k - 1) * math.exp(-2 * k * k * x * x)
        total += term
        if abs(term) < 1e-16:
            break
    return min(1.0, max(0.0, total))


def ks_test(a: Sequence[float], b: Sequence[float]) -> TestResult:
    """Two-sample Kolmogorov-Smirnov: D = sup |F_a - F_b|."""
    if not a or not b:
        raise ValueError("ks_test needs two non-empty samples")
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        v = min(xs[i], ys[j])
        while i < n and xs[i] == v:
            i += 1
        while j < m and ys[j] == v:
            j += 1
        d = max(d, abs(i / n - j / m))
    en = math.sqrt(n * m / (n + m))
    return TestResult(d, kolmogorov_sf((en + 0.12 + 0.11 / en) * d), (n, m))


def normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def proportions_test(a: Sequence[float], b: Sequence[float]) -> TestResult:
    """Two-sided z-test of equal means for values in [0, 1] (rewards): the pooled
    variance of the mean difference under the null."""
    n, m = len(a), len(b)
    if not n or not m:
        raise ValueError("proportions_test needs two non-empty samples")
    pa, pb = sum(a) / n, sum(b) / m
    pooled = (sum(a) + sum(b)) / (n + m)
    var = pooled * (1 - pooled) * (1 / n + 1 / m)
    if var <= 0:
        return TestResult(0.0, 1.0, (n, m))
    z = (pa - pb) / math.sqrt(var)
    return TestResult(z, 2 * normal_sf(abs(z)), (n, m))


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for a chi-square of `dof` degrees of freedom: the regularised upper
    incomplete gamma Q(dof/2, x/2)."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if x <= 0:
        return 1.0
    return _gamma_q(dof / 2, x / 2)


def _gamma_q(s: float, x: float) -> float:
    if x < s + 1:
        # series for P, then Q = 1 - P
        term = total = 1.0 / s
        k = s
        for _ in range(1000):
            k += 1
            term *= x / k
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-x + s * math.log(x) - math.lgamma(s)))
    # continued fraction for Q (Lentz)
    tiny = 1e-300
    b = x + 1 - s
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - s)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return min(1.0, h * math.exp(-x + s * math.log(x) - math.lgamma(s)))


def chi2_test(a: Sequence[Hashable], b: Sequence[Hashable], min_expected: float = 5.0) -> TestResult:
    """Chi-square test that two samples of categories share their frequencies.
    Categories whose expected count in either sample falls under `min_expected` are
    pooled into one (kept if the pool itself has enough)."""
    ca, cb = Counter(a), Counter(b)
    n, m = len(a), len(b)
    if not n or not m:
        raise ValueError("chi2_test needs two non-empty samples")
    total = n + m
    cells: list[tuple[int, int]] = []
    rest = [0, 0]
    for cat in set(ca) | set(cb):
        ka, kb = ca[cat], cb[cat]
        k = ka + kb
        if min(k * n / total, k * m / total) >= min_expected:
            cells.append((ka, kb))
        else:
            rest[0] += ka
            rest[1] += kb
    k = rest[0] + rest[1]
    if k and min(k * n / total, k * m / total) >= min_expected:
        cells.append((rest[0], rest[1]))
    if len(cells) < 2:
        return TestResult(0.0, 1.0, (n, m), 0)
    stat = 0.0
    for ka, kb in cells:
        k = ka + kb
        ea, eb = k * n / total, k * m / total
        stat += (ka - ea) ** 2 / ea + (kb - eb) ** 2 / eb
    dof = len(cells) - 1
    return TestResult(stat, chi2_sf(stat, dof), (n, m), dof)
