"""measure_network: the fit reproduces synthetic data; the probe runs across 8 CPU devices; bad input."""

import dataclasses
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prophet_jax import NetworkError, NetworkModel, measure_network
from prophet_jax._measure import _probe


@settings(deadline=None, max_examples=25)
@given(alpha=st.floats(1e-7, 1e-3), beta=st.floats(1e-12, 1e-8), workers=st.integers(2, 64),
       seed=st.integers(0, 2**16))
def test_fit_reproduces_synthetic_timings(alpha, beta, workers, seed):
  truth = NetworkModel(alpha_s=alpha, beta_s_per_byte=beta, workers=workers)
  sizes = np.asarray(_probe.DEFAULT_SIZES, dtype=float)
  exact = np.array([truth.allreduce_s(s) for s in sizes])
  rng = np.random.default_rng(seed)
  noisy = exact * (1 + 0.01 * rng.standard_normal(exact.size))  # 1% noise
  t = _probe.AllreduceTimings(sizes=tuple(int(s) for s in sizes), median_s=tuple(noisy),
                                low_s=tuple(exact * 0.9), percentile=10, repeats=5, workers=workers,
                                processes=1, platform="cpu")
  net = t.fit()
  assert net.workers == workers and net.overlap is False and net.name == f"probe:cpux{workers}:median"
  pred = np.array([net.allreduce_s(s) for s in sizes])
  assert np.all(np.abs(pred - exact) <= 0.05 * exact + 1e-12)  # every size within 5%
  # beta is identifiable only as far as its share of the largest message's time rises above the noise
  share = (truth.allreduce_s(sizes[-1]) - truth.allreduce_s(0)) / exact[-1]
  assert net.beta_s_per_byte == pytest.approx(beta, rel=0.05 / share)
  low = t.fit("low")
  assert low.name.endswith(":p10")
  assert low.allreduce_s(2**26) == pytest.approx(0.9 * truth.allreduce_s(2**26), rel=1e-6)


def test_fit_rejects_bad_stat():
  t = _probe.AllreduceTimings(sizes=(1024, 2048), median_s=(1e-4, 2e-4), low_s=(1e-4, 2e-4),
                                percentile=10, repeats=3, workers=2, processes=1, platform="gpu")
  assert t.fit().overlap is True  # overlap from the platform
  with pytest.raises(ValueError, match="stat='mean'"):
    t.fit("mean")


def test_probe_across_eight_cpu_devices():
  t = _probe.probe(8, sizes=(2**10, 2**14, 2**18), repeats=4, inner=2, time_budget_s=None)
  assert t.workers == 8 and t.processes == 1 and t.platform == "cpu"
  assert all(m > 0 for m in t.median_s)
  assert all(lo <= m for lo, m in zip(t.low_s, t.median_s))
  assert t.sizes == (2**10, 2**14, 2**18)
  # no timing order is asserted (a loaded machine can time 1 KiB above 256 KiB): speed is bench's
  net = t.fit()
  assert net.workers == 8 and net.overlap is False and net.fit_residual_s is not None
  assert net.alpha_s >= 0 and net.beta_s_per_byte >= 0
  text = t.describe(net)
  assert "probe:cpux8:median" in text and "p10 us" in text and "262144" in text
  assert "predicted all-reduce" in net.describe()


def test_a_time_budget_cuts_the_sizes_that_do_not_fit_and_says_so():
  # the two smallest sizes always run (a fit needs two); a budget already spent cuts the rest
  t = _probe.probe(2, sizes=(2**10, 2**12, 2**18, 2**20), repeats=3, inner=1, time_budget_s=1e-3)
  assert t.sizes == (2**10, 2**12) and t.cut_sizes == (2**18, 2**20) and t.time_budget_s == 1e-3
  assert "not measured (the 0.001 s time budget): 256 KiB, 1 MiB" in t.describe()
  bad = dataclasses.replace(t, median_s=(1e-3, 1e-6), platform="gpu")  # times falling with size: it warns
  text = _probe.check_fit(bad.fit(), bad)
  assert "time budget measured sizes up to 4 KiB and cut 256 KiB..1 MiB" in text and "time_budget_s" in text
  for budget in (0, -1.0, float("nan"), "10"):
    with pytest.raises((ValueError, TypeError), match="time_budget_s"):
      _probe.probe(2, sizes=(2**10, 2**12), time_budget_s=budget)


def test_interleaved_probe_measures_skew_and_carries_it():
  # 21 rounds: the small matmul's compute is a difference of two ~0.1 ms timings, and with 3 rounds
  # its median came out negative in 10 of 48 probes here (0 of 48 with 21)
  t = _probe.probe(8, sizes=(2**10, 2**14), repeats=21, inner=1, interleave=True)
  assert t.skew >= 0 and len(t.compute_s) == 2 and all(c > 0 for c in t.compute_s)
  assert all(m >= 0 for m in t.median_s)
  net = t.fit()
  assert net.skew == t.skew and net.overlap is False
  given = _probe.probe(2, sizes=(2**10, 2**14), repeats=3, inner=1, interleave=True, skew=0.25)
  assert given.skew == 0.25 and len(given.compute_s) == 1
  assert "skew 0.250" in given.describe()
  with pytest.raises(ValueError, match="skew=-1"):
    _probe.probe(2, sizes=(1024, 4096), repeats=3, interleave=True, skew=-1)


def test_measure_network_returns_model_on_subset_of_devices():
  net = measure_network(2, sizes=(2**10, 2**16), repeats=3, inner=1, stat="low")
  assert isinstance(net, NetworkModel) and net.workers == 2 and net.name == "probe:cpux2:p10"


def test_single_device_and_bad_arguments_are_clear():
  with pytest.raises(NetworkError, match=r"num_devices=1\).*at least 2 devices"):
    measure_network(1, sizes=(1024, 4096), repeats=3)
  with pytest.raises(NetworkError, match="num_devices=64.*only 8 cpu"):
    measure_network(64, sizes=(1024, 4096), repeats=3)
  with pytest.raises(ValueError, match="at least 2 distinct sizes"):
    measure_network(2, sizes=(1024, 1024))
  with pytest.raises(ValueError, match="size 2 is too small"):
    measure_network(2, sizes=(2, 1024))
  with pytest.raises(ValueError, match="repeats=1"):
    measure_network(2, sizes=(1024, 4096), repeats=1)
  with pytest.raises(ValueError, match="stat='mean'"):
    measure_network(2, stat="mean")


def _timings(ys, workers=8, platform="gpu"):
  sizes = (2**10, 2**14, 2**18, 2**20, 2**22)
  return _probe.AllreduceTimings(sizes=sizes, median_s=tuple(ys), low_s=tuple(ys), percentile=10,
                                   repeats=5, workers=workers, processes=1, platform=platform)


def test_a_bad_fit_warns_naming_the_residual(monkeypatch):
  line = NetworkModel(alpha_s=5e-6, beta_s_per_byte=1e-9, workers=8)
  sizes = (2**10, 2**14, 2**18, 2**20, 2**22)
  exact = [line.allreduce_s(s) for s in sizes]
  good = _timings([t * f for t, f in zip(exact, (1.02, 0.97, 1.01, 0.99, 1.0))])
  assert _probe.check_fit(good.fit(), good) is None
  ticked = list(exact)
  # a 4 ms scheduler tick at the small sizes (docs/facts.md, "Several processes")
  ticked[0] = ticked[1] = 4e-3
  bad = _timings(ticked)
  text = _probe.check_fit(bad.fit(), bad)
  assert text is not None and "RMS residual of" in text and "not a straight line" in text
  assert "worst at" in text and "stat='low'" in text
  zero = _timings([0.0] * 5)
  assert "every measured all-reduce time is 0" in _probe.check_fit(zero.fit(), zero)
  # measure_network itself warns (the probe replaced by those timings: no minute-long run here)
  monkeypatch.setattr(_probe, "probe", lambda *a, **k: bad)
  with pytest.warns(UserWarning, match="measure_network: the alpha-beta fit leaves an RMS residual"):
    measure_network(8)
  # on host CPU devices of one process (no network between them): one line, what it means and what to do
  host = _timings(ticked, platform="cpu")
  with pytest.warns(UserWarning) as seen:
    monkeypatch.setattr(_probe, "probe", lambda *a, **k: host)
    measure_network(8)
  text = str(seen[0].message)
  assert text.startswith("measure_network: on host CPU devices the probe times copies between threads, a "
                         "stand-in for a network (fit residual ") and "NetworkModel.preset" in text
  assert "\n" not in text and len(text) < 300
  monkeypatch.setattr(_probe, "probe", lambda *a, **k: good)
  import warnings

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    measure_network(8)


def test_progress_is_quiet_by_default_and_reports_each_size(capsys):
  measure_network(2, sizes=(2**10, 2**12), repeats=3, inner=1)
  assert capsys.readouterr().err == ""
  lines = []
  measure_network(2, sizes=(2**10, 2**12), repeats=3, inner=1, progress=lines.append)
  assert len(lines) == 3 and "over 2 cpu device(s) at up to 2 message sizes" in lines[0]
  assert "as fit in 1 s" in lines[0]   # the host budget (a stand-in for a network): 6 s on accelerators
  assert lines[1].startswith("measure_network: size 1/2 (1 KiB): median") and "size 2/2 (4 KiB)" in lines[2]
  measure_network(2, sizes=(2**10, 2**12), repeats=3, inner=1, progress=True)
  assert "size 2/2" in capsys.readouterr().err


def test_a_probe_on_host_devices_warns_in_one_line_what_it_is_and_what_to_do():
  """issue 46: on host devices the probe's fit warning was a paragraph that read as a failure (56% RMS
  residual); the probe there is a stand-in for a network. Any warning it gives is now one line saying so
  (the deterministic case: test_a_bad_fit_warns_naming_the_residual's host timings)."""
  import warnings

  import prophet_jax as pj

  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pj.measure_network(8, sizes=(2**10, 2**14, 2**20), repeats=3, inner=1)
  texts = [str(w.message) for w in seen if str(w.message).startswith("measure_network")]
  assert all(t.startswith("measure_network: on host CPU devices the probe times copies between threads")
             and "\n" not in t for t in texts), texts
