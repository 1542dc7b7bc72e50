import math

import numpy as np
import pytest

from loadgen.arrivals import Arrivals


def rng():
    return np.random.default_rng(1)


def test_constant_is_evenly_spaced():
    t = Arrivals("constant", rate=4).times(5, rng())
    assert t == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_infinite_rate_sends_everything_at_once():
    assert Arrivals("poisson", rate=math.inf).times(3, rng()).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "kind,burstiness,cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)]
)
def test_mean_rate_and_burstiness(kind, burstiness, cv):
    t = Arrivals(kind, rate=20, burstiness=burstiness).times(40_000, rng())
    gaps = np.diff(t)
    assert 1 / gaps.mean() == pytest.approx(20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)  # gamma shape k: CV = 1/sqrt(k)
    assert np.all(gaps >= 0) and t[0] == 0


def test_two_level_alternates_low_and_burst_phases():
    a = Arrivals("two-level", low_rate=(2, 5), burst_rate=(10, 30), low_s=20, burst_s=10)
    t = a.times(3000, rng())
    period = 30.0
    phase = (t + 0.0) % period  # the first arrival is shifted to 0 but lies in the first low phase
    low = np.sum(phase < 20) / (20 * (t[-1] / period))
    burst = np.sum(phase >= 20) / (10 * (t[-1] / period))
    assert 2 <= low <= 5.5 and 9 <= burst <= 30
    assert burst > 2.5 * low


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind="uniform"),
        dict(rate=0),
        dict(rate=-1),
        dict(burstiness=0),
        dict(low_rate=(5, 2)),
        dict(burst_s=0),
    ],
)
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        Arrivals(**kw)
