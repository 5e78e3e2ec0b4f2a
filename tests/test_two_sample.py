"""The on-policy check's two-sample tests (`bench/two_sample.py`) against reference
values and their behaviour on samples that do and do not share a distribution."""

from __future__ import annotations

import random

import pytest

from bench.two_sample import chi2_sf, chi2_test, kolmogorov_sf, ks_test, normal_sf, proportions_test


@pytest.mark.parametrize("x, dof, p", [
    (3.841459, 1, 0.05), (6.634897, 1, 0.01), (10.0, 5, 0.075235), (0.5, 3, 0.918891),
    (30.0, 10, 0.00085664), (100.0, 80, 0.0645704),
])
def test_chi2_sf_matches_tabulated_values(x: float, dof: int, p: float) -> None:
    assert chi2_sf(x, dof) == pytest.approx(p, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("x, p", [(1.358099, 0.05), (1.627624, 0.01), (0.5, 0.963945), (0.2, 1.0)])
def test_kolmogorov_sf_matches_tabulated_values(x: float, p: float) -> None:
    assert kolmogorov_sf(x) == pytest.approx(p, rel=1e-4, abs=1e-6)


def test_normal_sf() -> None:
    assert normal_sf(1.959964) == pytest.approx(0.025, rel=1e-5)


def test_same_distributions_pass_and_different_ones_fail() -> None:
    rng = random.Random(0)
    a = [rng.gauss(0, 1) for _ in range(2000)]
    b = [rng.gauss(0, 1) for _ in range(2000)]
    c = [rng.gauss(0.2, 1) for _ in range(2000)]
    assert ks_test(a, b).p_value > 0.01
    assert ks_test(a, c).p_value < 1e-4
    r1 = [float(rng.random() < 0.5) for _ in range(2000)]
    r2 = [float(rng.random() < 0.5) for _ in range(2000)]
    r3 = [float(rng.random() < 0.6) for _ in range(2000)]
    assert proportions_test(r1, r2).p_value > 0.01
    assert proportions_test(r1, r3).p_value < 1e-4
    cats = "abcdefg"
    t1 = [rng.choice(cats) for _ in range(2000)]
    t2 = [rng.choice(cats) for _ in range(2000)]
    t3 = [rng.choice("aabcdefg") for _ in range(2000)]
    res = chi2_test(t1, t2)
    assert res.p_value > 0.01 and res.dof == 6
    assert chi2_test(t1, t3).p_value < 1e-4


def test_ks_statistic_is_the_largest_gap_of_the_empirical_cdfs() -> None:
    assert ks_test([1, 2, 3], [1, 2, 3]).statistic == 0.0
    assert ks_test([1, 2], [3, 4]).statistic == 1.0


def test_rare_categories_are_pooled() -> None:
    a = ["x"] * 50 + ["y"] * 50 + ["r1", "r2", "r3"]
    b = ["x"] * 50 + ["y"] * 50 + ["r4", "r5"]
    res = chi2_test(a, b)
    assert res.dof == 1  # x, y kept; the five rare ones pooled have too few to stand alone
