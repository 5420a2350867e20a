"""Monitor: re-plans on a degraded network, not on noise; caches compiled steps; processes agree."""


import numpy as np
import pytest


from prophet_jax import GradientProfile, Monitor, NetworkModel, ScheduleMismatchError
from prophet_jax._multiprocess._monitor import plan_key

SIZES = (2**10, 2**14, 2**18, 2**20)


def _profile(layers=32, nbytes=100_000, backward_s=0.01, prefix="l"):
  n = nbytes // 4
  rows = [dict(path=f"{prefix}{i}/w", layer=f"{prefix}{i}", shape=(n,), dtype="float32", nbytes=nbytes,
               ready_s=backward_s * (layers - i) / layers, fwd_s=2e-4) for i in range(layers)]
  return GradientProfile.from_rows(rows, forward_s=2e-4 * layers, backward_s=backward_s)


FAST = NetworkModel(alpha_s=2e-6, beta_s_per_byte=1e-10, workers=8, overlap=True)
# the degraded link: a fifth of the bandwidth and twenty times the per-message latency
SLOW = FAST.replace(alpha_s=40e-6, beta_s_per_byte=5e-10)


class FakeProbe:
  """A probe that times a given network, with optional relative noise."""

  def __init__(self, net, noise=0.0, seed=0):
    self.net, self.noise, self.rng, self.calls = net, noise, np.random.default_rng(seed), 0

  def __call__(self, sizes):
    self.calls += 1
    t = np.array([self.net.allreduce_s(s) for s in sizes])
    return t * (1 + self.noise * self.rng.uniform(-1, 1, t.size))


def test_bandwidth_drop_replans_and_switching_back_reuses_the_compiled_step():
  probe = FakeProbe(FAST)
  built = []
  mon = Monitor(_profile(), FAST, policy="mgwfbp", probe_every=5, window=1, probe_fn=probe, threshold=0.02,
                build_step=lambda s: built.append(s) or object())
  first = mon.schedule
  step_fast = mon.step_fn
  assert mon.step_fn is step_fast and mon.builds == 1
  for _ in range(5):
    assert mon.record_step(0.02) is None  # probe at step 5: same network, no switch
  assert probe.calls == 1 and not mon.decisions[-1].switched
  probe.net = SLOW
  switched = [mon.record_step(0.02) for _ in range(5)]  # same step times: the periodic probe finds it
  assert probe.calls == 2 and switched[-1] is not None and mon.schedule is switched[-1]
  d = mon.decisions[-1]
  assert d.switched and d.gain > mon.threshold and d.candidate_s < d.current_s
  assert mon.network.beta_s_per_byte == pytest.approx(SLOW.beta_s_per_byte, rel=1e-3)
  assert mon.schedule.num_allreduces < first.num_allreduces  # merged to amortise the start-up
  step_slow = mon.step_fn
  assert step_slow is not step_fast and mon.builds == 2
  probe.net = FAST  # the link recovers (a 3% gain): back to the first plan, its step cached
  for _ in range(5):
    mon.record_step(0.02)
  assert plan_key(mon.schedule) == plan_key(first)
  assert mon.step_fn is step_fast and mon.builds == 2 and len(built) == 2


def test_noise_does_not_replan():
  probe = FakeProbe(FAST, noise=0.05, seed=3)
  mon = Monitor(_profile(), FAST, policy="mgwfbp", probe_every=1, window=3, probe_fn=probe)
  first = plan_key(mon.schedule)
  for _ in range(12):
    assert mon.record_step(0.02 * (1 + 0.05 * np.sin(_))) is None
  assert probe.calls == 12 and len(mon.decisions) == 12
  assert not any(d.switched for d in mon.decisions)
  assert plan_key(mon.schedule) == first


def test_step_time_drift_triggers_an_early_probe():
  probe = FakeProbe(FAST)
  mon = Monitor(_profile(), FAST, policy="mgwfbp", probe_every=0, window=3, drift=0.25, probe_fn=probe)
  for _ in range(6):
    mon.record_step(0.020)
  assert probe.calls == 0
  probe.net = SLOW
  out = [mon.record_step(0.040) for _ in range(3)]
  assert probe.calls >= 1 and any(o is not None for o in out)


def test_bad_arguments_and_foreign_schedules():
  prof = _profile(layers=4)
  with pytest.raises(ValueError, match="threshold=2"):
    Monitor(prof, FAST, threshold=2)
  with pytest.raises(ValueError, match="probe_repeats=1"):
    Monitor(prof, FAST, probe_repeats=1)
  with pytest.raises(TypeError, match="GradientProfile"):
    Monitor("p.json", FAST)
  mon = Monitor(prof, FAST, policy="wfbp", probe_every=0)
  with pytest.raises(ValueError, match="no build_step"):
    mon.step_fn
  with pytest.raises(ValueError, match="pair up"):
    mon.observe((1024, 2048), (1e-4,))
  from prophet_jax import plan

  other = plan(_profile(layers=4, prefix="m"), FAST, "wfbp")
  with pytest.raises(ScheduleMismatchError, match="fingerprint"):
    Monitor(prof, FAST, schedule=other)


def test_real_probe_on_cpu_devices():
  mon = Monitor(_profile(layers=4), FAST.replace(overlap=False), policy="wfbp", probe_every=1,
                probe_sizes=(2**10, 2**16), probe_repeats=3, num_devices=8)
  mon.record_step(0.01)
  assert len(mon.decisions) == 1 and mon.network.workers == 8 and mon.network.overlap is False
  assert mon.network.name == "monitor"
