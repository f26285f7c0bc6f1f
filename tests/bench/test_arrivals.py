"""Arrival processes over 10,000 samples match their definitions."""

import numpy as np
import pytest
from scipy import stats

from quantpipe.runtime.workload import ArrivalSpec

N = 10_000


def _sample(d, n=N, duration=None, seed=0):
    return ArrivalSpec.from_dict(d).sample(np.random.default_rng(seed), n, duration)


def test_poisson_gaps_are_exponential():
    t = _sample({"process": "poisson", "rate": 50})
    gaps = np.diff(t)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 50)).pvalue > 0.01
    assert abs(len(t) / t[-1] - 50) / 50 < 0.03
    # and a wrong rate is rejected: the test can fail
    assert stats.kstest(gaps, "expon", args=(0, 1 / 40)).pvalue < 0.01


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_hits_requested_cv(cv):
    gaps = np.diff(_sample({"process": "gamma", "rate": 10, "cv": cv}, n=N + 1))
    assert abs(gaps.std() / gaps.mean() - cv) / cv < 0.05
    assert abs(1 / gaps.mean() - 10) / 10 < 0.1


def test_constant_is_evenly_spaced():
    t = _sample({"process": "constant", "rate": 4}, n=9)
    assert np.allclose(t, np.arange(9) * 0.25)


def test_diurnal_follows_its_rate_curve():
    spec = ArrivalSpec.from_dict({"process": "diurnal", "valley": 10, "peak": 90, "period_s": 200})
    t = spec.sample(np.random.default_rng(1), None, 200.0)
    assert abs(len(t) - 50 * 200) < 4 * np.sqrt(50 * 200)  # mean rate (10+90)/2 over one period
    edges = np.linspace(0, 200, 21)
    counts, _ = np.histogram(t, edges)
    grid = np.linspace(0, 200, 20001)
    cum = np.concatenate([[0], np.cumsum(spec.rate_at(grid)[1:] * np.diff(grid))])
    expected = np.diff(np.interp(edges, grid, cum))
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert stats.chi2.sf(chi2, len(counts) - 1) > 0.001
    assert counts[0] < counts[10] / 4  # valley at t=0, peak at half period


def test_burst_multiplies_rate_inside_window():
    d = {"process": "poisson", "rate": 40, "bursts": [{"at_s": 100, "duration_s": 20, "factor": 5}]}
    t = _sample(d, n=None, duration=250.0, seed=2)
    inside = ((t >= 100) & (t < 120)).sum()
    outside = len(t) - inside
    assert abs(inside - 40 * 5 * 20) < 4 * np.sqrt(4000)
    assert abs(outside - 40 * 230) < 4 * np.sqrt(9200)
    spec = ArrivalSpec.from_dict(d)
    assert spec.peak_rate() == 200 and spec.rate_at(np.array([110.0]))[0] == 200


def test_with_rate_keeps_shape():
    d = ArrivalSpec.from_dict({"process": "diurnal", "valley": 10, "peak": 30, "period_s": 60}).with_rate(40)
    assert (d.valley, d.peak) == (20, 60)
