"""choose: paired interleaved timing against a control; the statistics with an injected clock, the
decision's JSON, the errors, a real choice on 8 host devices, two processes, and Monitor's confirmation."""

import json

import numpy as np
import pytest


from prophet_jax import Choice, GradientProfile, Monitor, NetworkModel
from prophet_jax._planning._paired import (DEFAULT_ROUNDS, decide, interleave, median_interval, min_rounds,
                                           round_order)

SIGMA = 0.10  # multiplicative lognormal noise on every timing


def _clock(true_s: dict[str, float], seed: int, rounds: int = 1000):
  """An injected clock: `measure(name, round)` -> the step's true time times lognormal noise (drawn
  up front, one per step and round)."""
  noise = np.exp(SIGMA * np.random.default_rng(seed).standard_normal((rounds, len(true_s))))
  col = {n: i for i, n in enumerate(true_s)}
  return lambda name, r: true_s[name] * noise[r, col[name]]


def _trial(true_s: dict[str, float], seed: int, rounds: int = DEFAULT_ROUNDS) -> Choice:
  names = tuple(true_s)
  return decide(names, interleave(names, rounds, _clock(true_s, seed)), control="control")


SEEDS = range(20)


def test_five_percent_faster_is_chosen_in_19_of_20():
  wins = [_trial({"control": 0.010, "fast": 0.010 / 1.05}, s) for s in SEEDS]
  assert sum(c.best == "fast" for c in wins) >= 19
  assert all(c.verdicts["fast"] == "faster" for c in wins if c.best == "fast")
  assert all("faster than the control" in c.reason for c in wins if c.best == "fast")


def test_too_few_rounds_cannot_resolve_five_percent():
  """The control of the test above: the sizing matters (at 60 rounds 5% is mostly unresolved)."""
  wins = [_trial({"control": 0.010, "fast": 0.010 / 1.05}, s, rounds=60) for s in SEEDS]
  assert sum(c.best == "fast" for c in wins) < 10


def test_identical_candidates_give_no_difference_in_19_of_20():
  same = [_trial({"control": 0.010, "a": 0.010, "b": 0.010}, s) for s in SEEDS]
  ok = [c for c in same if c.best == "control" and set(c.verdicts.values()) == {"no difference"}]
  assert len(ok) >= 19
  assert all("the control 'control' stays" in c.reason for c in ok)
  assert all(1 / 1.02 < c.ratios[k] < 1.02 for c in ok for k in "ab")


def test_five_percent_slower_is_never_chosen():
  slow = [_trial({"control": 0.010, "slow": 0.0105}, s) for s in SEEDS]
  assert all(c.best == "control" for c in slow)
  assert sum(c.verdicts["slow"] == "slower" for c in slow) >= 19


def test_the_fastest_winner_wins_and_an_outlier_round_does_not_decide():
  c = _trial({"control": 0.010, "a": 0.008, "b": 0.006}, 0, rounds=100)
  assert c.best == "b" and c.verdicts == {"a": "faster", "b": "faster"} and "Also faster" in c.reason
  assert c.ratios["b"] == pytest.approx(0.6, rel=0.05)
  names = ("control", "cand")
  t = interleave(names, 100, _clock({"control": 0.010, "cand": 0.010}, 1))
  t[7, 0] = 10.0  # one round where the control hit a 10 s hiccup
  d = decide(names, t, control="control")
  assert d.best == "control" and d.verdicts["cand"] == "no difference"


def test_interleaving_and_the_interval_of_the_median():
  assert sorted(round_order("ab", r) for r in range(2)) == [("a", "b"), ("b", "a")]
  seen = []
  interleave(("x", "y"), 4, lambda n, r: seen.append((r, n)) or 1.0)
  assert [r for r, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3] and seen[0][1] != seen[2][1]
  for names in ("abc", "abcd", "abcde"):  # every position and every predecessor equally often
    period = len(names) * (1 + len(names) % 2)
    rows = [round_order(names, r) for r in range(period, 2 * period)]
    assert len({(x, i) for row in rows for i, x in enumerate(row)}) == len(names) ** 2
    follows = [(row[i], row[i + 1]) for row in rows for i in range(len(row) - 1)]
    assert {follows.count(p) for p in set(follows)} == {follows.count(follows[0])}
    assert len(set(follows)) == len(names) * (len(names) - 1)
  assert min_rounds(0.95) == 6 and min_rounds(0.99) == 8
  m, lo, hi = median_interval(np.arange(1.0, 7.0), 0.95)  # n = 6: [x(1), x(6)], coverage 1 - 2/64
  assert (m, lo, hi) == (3.5, 1.0, 6.0)
  # coverage: the interval holds the true median in at least 95% of 2,000 skewed samples
  rng = np.random.default_rng(0)
  hits = sum(lo <= np.log(2) <= hi for lo, hi in
             (median_interval(rng.exponential(1.0, 31), 0.95)[1:] for _ in range(2000)))
  assert 0.95 <= hits / 2000 <= 0.99


def test_what_a_step_inherits_from_its_predecessor_is_no_ones_bias():
  """A step run right after 'heavy' takes 30% longer (leftover work): an identical copy of the
  control still comes out "no difference" (with a plain rotation, 'copy' always followed 'heavy'
  and looked 23% slower)."""
  true = {"control": 0.010, "heavy": 0.020, "copy": 0.010}
  clock, last = _clock(true, 0), [None]

  def measure(name, r):
    t = clock(name, r) * (1.3 if last[0] == "heavy" else 1.0)
    last[0] = name
    return t

  names = tuple(true)
  c = decide(names, interleave(names, 200, measure), control="control")
  assert c.verdicts["copy"] == "no difference" and abs(np.log(c.ratios["copy"])) < 0.03, c.describe()
  rotated = [tuple(names[(i + r) % 3] for i in range(3)) for r in range(200)]  # the control of it
  last[0] = None
  t = np.array([[0.0] * 3 for _ in range(200)])
  for r, order in enumerate(rotated):
    for n in order:
      t[r, names.index(n)] = measure(n, r)
  assert decide(names, t, control="control").verdicts["copy"] == "slower"


def test_choice_json_round_trip_and_fingerprint():
  c = _trial({"control": 0.010, "a": 0.008, "b": 0.0101}, 3, rounds=50)
  back = Choice.from_json(c.to_json())
  assert back == c and back.fingerprint == c.fingerprint
  assert json.loads(c.to_json())["best"] == c.best == "a" and c.switched
  assert "control" in c.describe() and "[" in c.describe()
  other = Choice.from_json(c.to_json().replace('"best": "a"', '"best": "control"'))
  assert other.fingerprint != c.fingerprint and not other.switched
  with pytest.raises(ValueError, match="neither the control"):
    Choice.from_json(c.to_json().replace('"best": "a"', '"best": "zz"'))


def test_statistics_errors():
  t = np.full((20, 2), 0.01)
  with pytest.raises(ValueError, match="min_gain"):
    decide(("control", "a"), t, control="control", min_gain=-0.1)
  with pytest.raises(TypeError, match="min_gain"):
    decide(("control", "a"), t, control="control", min_gain="2%")
  with pytest.raises(ValueError, match="at least 6 rounds"):
    decide(("control", "a"), t[:4], control="control")
  with pytest.raises(ValueError, match="shape"):
    decide(("control", "a", "b"), t, control="control")
  t[3, 1] = 0.0
  with pytest.raises(ValueError, match=r"step 'a' took 0.0 s in round 3"):
    decide(("control", "a"), t, control="control")


# --------------------------------------------------------------------------------------------------
# choose on real devices


@pytest.fixture(scope="module")
def steps():
  """Cheap jitted steps on a dict state `{"params": array}` sharded over 8 host devices, `state, loss =
  step(state, batch)`: a lean one, the control computing the same four times over, a donating copy of
  the lean one, and a step that does not train (returns the state unchanged)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  def lean(s, b):
    p = s["params"]
    g = p * b - jnp.mean(p * b)  # the mean over every device: an all-reduce
    return {"params": p - 0.1 * g}, jnp.sum(g * g)

  lean_jit = jax.jit(lean)

  def heavy(s, b):  # the lean step's work four times, the same result: nothing more to compile
    for _ in range(4):
      out = lean_jit(s, b)
    return out

  sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
  x = jnp.arange(8 * 96 * 96, dtype=jnp.float32).reshape(8, 96, 96) / (8 * 96 * 96)
  state = {"params": jax.device_put(x, sharding)}
  batch = jax.device_put(jnp.ones((8, 96, 96), jnp.float32) * 0.5, sharding)
  idle = jax.jit(lambda s, b: (s, jnp.sum(s["params"] * 0)))
  return (dict(lean=lean_jit, heavy=heavy, donating=jax.jit(lean, donate_argnums=0), idle=idle), state,
          batch)


def test_real_choose_on_8_devices_keeps_the_callers_state(steps):
  import prophet_jax as pj

  fns, state, batch = steps
  c = pj.choose({"lean": fns["lean"], "donating": fns["donating"]}, state, [batch], control=fns["heavy"],
                rounds=25)
  assert c.best in ("lean", "donating") and c.control == "control" and c.rounds == 25
  assert c.ratios["lean"] < 0.8 and c.verdicts["lean"] == "faster", c.describe()
  assert set(c.median_s) == {"control", "lean", "donating"} and c.processes == 1
  assert float(state["params"].sum()) == pytest.approx((8 * 96 * 96 - 1) / 2)  # not consumed by the donor
  assert c.compared["lean"].startswith("equal") and "after the second call" in c.reason
  # the control given by name, states per step (as convert_state gives them); the heavy step loses
  c2 = pj.choose({"lean": fns["lean"], "heavy": fns["heavy"]},
                 {"lean": state, "heavy": {"params": state["params"] * 1}}, [batch], control="lean", rounds=20)
  assert c2.best == "lean" and c2.verdicts["heavy"] == "slower", c2.describe()


def test_choose_errors(steps):
  import prophet_jax as pj

  fns, state, batch = steps
  f = fns["lean"]
  with pytest.raises(ValueError, match="no candidates"):
    pj.choose({}, state, [batch], control=f)
  with pytest.raises(ValueError, match="a candidate is named 'control'"):
    pj.choose({"control": f}, state, [batch], control=f)
  with pytest.raises(ValueError, match="min_gain"):
    pj.choose({"a": f}, state, [batch], control=f, min_gain=1.5)
  with pytest.raises(ValueError, match="choose\\(control='b'\\): no step of that name"):
    pj.choose({"a": f}, state, [batch], control="b")
  with pytest.raises(ValueError, match=r"missing \['control'\]"):
    pj.choose({"a": f}, {"a": state}, [batch], control=f)
  with pytest.raises(TypeError, match="sequence of batches"):
    pj.choose({"a": f}, state, batch, control=f)
  with pytest.raises(TypeError, match="step 'a' returned"):
    pj.choose({"a": lambda s, b: {"x": s}}, state, [batch], control=f, rounds=6)
  with pytest.raises(ValueError, match="warmup.*second is compared"):
    pj.choose({"a": f}, state, [batch], control=f, warmup=1)
  with pytest.raises(ValueError, match=r"lossy=\['b'\]\): \['b'\] are not candidates"):
    pj.choose({"a": f}, state, [batch], control=f, lossy={"b"})


def test_choose_compares_what_the_steps_compute(steps):
  """issue 46: a step that does not train came out "faster"; a step with the wrong gradient scale or a
  NaN loss was timed without a word. Now what each candidate computes is compared with the control
  after the second call (docs/design.md's tolerance), lossy candidates reported, NaN refused."""
  import jax
  import jax.numpy as jnp

  import prophet_jax as pj

  fns, state, batch = steps
  with pytest.raises(ValueError, match=r"step 'idle' computes something else than the control 'control'.*"
                                       r"the loss differs.*lossy=\{'idle'\}"):
    pj.choose({"idle": fns["idle"]}, state, [batch], control=fns["lean"], rounds=6)

  def eight(s, b):  # the lean step with a psum for a pmean: 8 times the update
    new, loss = fns["lean"](s, b)
    return {"params": s["params"] + 8 * (new["params"] - s["params"])}, loss

  with pytest.raises(ValueError, match="step 'eight' computes something else"):
    pj.choose({"eight": eight}, state, [batch], control=fns["lean"], rounds=6)
  c = pj.choose({"eight": eight}, state, [batch], control=fns["lean"], rounds=6, lossy={"eight"})
  assert c.compared["eight"].startswith("differs (lossy, reported)") and "'eight' differs" in c.reason
  nan = batch * jnp.nan
  with pytest.raises(ValueError, match=r"step 'control' returned a non-finite loss \(nan\) on its call 1"):
    pj.choose({"lean": fns["lean"]}, state, [nan], control=fns["heavy"], rounds=6)
  with pytest.raises(ValueError, match=r"step '(lean|heavy)' returned a non-finite loss \(nan\) in timed "
                                       r"round 2 \(batches\[2\]\)"):
    pj.choose({"lean": fns["lean"], "heavy": fns["heavy"]}, state, [batch, batch, nan], control="heavy",
              rounds=6)
  # a state whose parameters choose cannot find: 'not compared', unless compare= says where they are
  raw = state["params"]
  plain = jax.jit(lambda s, b: s - 0.1 * (s * b - jnp.mean(s * b)))
  c = pj.choose({"a": plain}, raw, [batch], control=plain, rounds=6)
  assert c.compared["a"].startswith("not compared") and "pass compare=" in c.reason
  c = pj.choose({"a": plain}, raw, [batch], control=plain, rounds=6, compare=lambda s: {"w": s})
  assert c.compared["a"].startswith("equal")


def test_choose_names_the_candidate_that_raises(steps):
  """issue 46: a candidate that needed its own state raised jax's error, naming no candidate."""
  import prophet_jax as pj

  fns, state, batch = steps

  def own_state(s, b):  # written for a (params, opt_state) state
    params, opt_state = s
    return fns["lean"]({"params": params}, b)

  with pytest.raises(ValueError) as e:
    pj.choose({"dear": own_state}, state, [batch], control=fns["lean"], rounds=6)
  notes = getattr(e.value, "__notes__", [])
  assert any("choose: raised by step 'dear', on its call 1" in n and "convert_state" in n for n in notes), notes


# --------------------------------------------------------------------------------------------------
# Monitor: a predicted switch confirmed (or not) by a measured Choice


def _profile(layers=32, nbytes=100_000, backward_s=0.01):
  rows = [dict(path=f"l{i}/w", layer=f"l{i}", shape=(nbytes // 4,), dtype="float32", nbytes=nbytes,
               ready_s=backward_s * (layers - i) / layers, fwd_s=2e-4) for i in range(layers)]
  return GradientProfile.from_rows(rows, forward_s=2e-4 * layers, backward_s=backward_s)


FAST = NetworkModel(alpha_s=2e-6, beta_s_per_byte=1e-10, workers=8, overlap=True)
SLOW = FAST.replace(alpha_s=40e-6, beta_s_per_byte=5e-10)


@pytest.mark.parametrize("measured_ratio, switches", [(1.0, False), (0.8, True)])
def test_monitor_switches_only_when_the_measurement_confirms(measured_ratio, switches):
  asked = []

  def confirm(current, new):
    asked.append((current, new))
    return _trial({"control": 0.010, "new": 0.010 * measured_ratio}, 0, rounds=40)

  seen = [FAST]
  mon = Monitor(_profile(), FAST, policy="mgwfbp", probe_every=2, window=1, threshold=0.02,
                probe_fn=lambda sizes: [seen[0].allreduce_s(s) for s in sizes], confirm=confirm)
  first = mon.schedule
  mon.record_step(0.02), mon.record_step(0.02)  # same network: no predicted switch, nothing asked
  assert not asked
  seen[0] = SLOW
  mon.record_step(0.02)
  out = mon.record_step(0.02)  # the prediction wants a switch; the measurement decides
  assert mon.decisions[-1].switched and len(asked) == 1 and asked[0][0] is first
  assert len(mon.confirmations) == 1 and mon.confirmations[0].switched == switches
  assert (out is not None) == switches and (mon.schedule is first) != switches
  with pytest.raises(TypeError, match="confirm"):
    Monitor(_profile(), FAST, confirm=3)
