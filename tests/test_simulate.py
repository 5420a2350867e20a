"""The simulator: hand-computed cases, properties, and agreement with a slow reference event loop."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prophet_jax import (Bucket, Chunk, Event, GradientProfile, NetworkModel, Schedule, ScheduleMismatchError,
                         SimResult)
from _brute import random_network, random_profile, random_schedule
from prophet_jax._planning._core import chunk_arrays, iteration_s, problem
from prophet_jax._planning._simulate import simulate

from _instances import NET, PROFILE
from _instances import row as _row, sched as _sched

SEEDS = st.integers(0, 2**32 - 1)


WFBP = _sched(PROFILE, [[1], [0]])      # B first (ready first), then A
PRIO = _sched(PROFILE, [[0], [1]])      # A first: waits for A's readiness (head-of-line blocking)
MERGED = _sched(PROFILE, [[0, 1]])


def _closed_form(s, p, net, cross_step):
  """The core's closed-form iteration time of schedule `s` (what auto ranks candidates by)."""
  prob = problem(p, net, cross_step=cross_step)
  ready, nbytes, tail, _, _ = chunk_arrays(prob, (c.slices for c in s.chunks))
  return iteration_s(prob, ready, prob.durations(nbytes), tail)


def test_hand_plain_overlap():
  # chunk B: start max(1.0, 0) = 1.0, end 3.5; chunk A: start max(3.0, 3.5) = 3.5, end 5.0.
  # iteration = max(backward 3.0, 5.0) + update 0.3 + forward 1.5 = 6.8; idle = 6.8 - 4.8 = 2.0.
  r = simulate(WFBP, PROFILE, NET)
  assert r.iteration_s == pytest.approx(6.8)
  assert r.compute_s == pytest.approx(4.8)
  assert r.comm_s == pytest.approx(4.0)
  assert r.idle_s == pytest.approx(2.0)
  assert r.network_busy == pytest.approx(4.0 / 6.8)
  assert r.allreduces == 2
  ar = [(e.name, e.start_s, e.end_s, e.lane) for e in r.events if e.kind == "allreduce"]
  assert ar == [("chunk0", 1.0, 3.5, "link0"), ("chunk1", 3.5, 5.0, "link0")]
  # after the last chunk (5.0): the update 5.0-5.3, then forward A 5.3-6.3 and B 6.3-6.8
  assert r.events[-3:] == (Event(kind="update", name="update", start_s=5.0, end_s=5.3),
                           Event(kind="forward", name="A", start_s=5.3, end_s=6.3),
                           Event(kind="forward", name="B", start_s=6.3, end_s=6.8))
  assert len({hash(e) for e in r.events}) == len(r.events)
  # merged: ready 3.0, end 6.5; iteration 6.5 + 1.8 = 8.3.
  assert simulate(MERGED, PROFILE, NET).iteration_s == pytest.approx(8.3)


def test_hand_cross_step():
  # WFBP: reduced(A) = 5.0, reduced(B) = 3.5. fwd A starts max(3.0, 5.0 + 0.1) = 5.1, ends 6.1;
  # fwd B starts max(6.1, 3.5 + 0.2) = 6.1, ends 6.6. idle = 6.6 - (1.5 + 3.0) = 2.1.
  r = simulate(WFBP, PROFILE, NET, cross_step=True)
  assert r.iteration_s == pytest.approx(6.6)
  assert r.idle_s == pytest.approx(2.1)
  fwd = {e.name: (e.start_s, e.end_s) for e in r.events if e.kind == "forward"}
  assert fwd["A"] == pytest.approx((5.1, 6.1)) and fwd["B"] == pytest.approx((6.1, 6.6))
  upd = {e.name: (e.start_s, e.end_s, e.lane) for e in r.events if e.kind == "update"}
  assert upd["A"][:2] == pytest.approx((5.0, 5.1)) and upd["A"][2] == "update"
  # A first: chunk A 3.0-4.5, chunk B 4.5-7.0; fwd A at max(3.0, 4.6) = 4.6 to 5.6;
  # fwd B at max(5.6, 7.0 + 0.2) = 7.2 to 7.7.
  assert simulate(PRIO, PROFILE, NET, cross_step=True).iteration_s == pytest.approx(7.7)
  # and in the plain step the order cannot help the next forward: max(3.0, 7.0) + 1.8 = 8.8
  assert simulate(PRIO, PROFILE, NET).iteration_s == pytest.approx(8.8)


def test_hand_no_overlap():
  net = NET.replace(overlap=False)
  # chunk B issued at progress 1.0 (wall 1.0), runs 1.0-3.5 while backward stalls; backward resumes
  # at 3.5 and reaches A's ready time 3.0 after 2.0 more: wall 5.5 = backward end; chunk A 5.5-7.0.
  # plain: max(5.5, 7.0) + 1.8 = 8.8 = forward + backward + update + sum of all-reduces (4.8 + 4.0).
  r = simulate(WFBP, PROFILE, net)
  assert r.iteration_s == pytest.approx(8.8)
  assert r.iteration_s == pytest.approx(PROFILE.compute_s + r.comm_s)
  bwd = [(e.name, e.start_s, e.end_s) for e in r.events if e.kind == "backward"]
  assert bwd == [("B", 0.0, 1.0), ("A", 3.5, 5.5)]   # backward pauses during chunk B
  # pipelined: the device runs no forward while a chunk is on the link: T0 = max(5.5, 7.0) = 7.0;
  # fwd A at max(7.0, 7.0 + 0.1) = 7.1 to 8.1; fwd B at max(8.1, 3.5 + 0.2) = 8.1 to 8.6.
  assert simulate(WFBP, PROFILE, net, cross_step=True).iteration_s == pytest.approx(8.6)
  # A first: progress reaches 3.0 at wall 3.0 (= backward end); chunk A 3.0-4.5, chunk B 4.5-7.0.
  # No forward while the link is busy: fwd A at max(7.0, 4.5 + 0.1) = 7.0 to 8.0; fwd B at
  # max(8.0, 7.0 + 0.2) = 8.0 to 8.5.
  r = simulate(PRIO, PROFILE, net, cross_step=True)
  assert r.iteration_s == pytest.approx(8.5)
  assert r.idle_s == pytest.approx(8.5 - 4.5)


def test_hand_two_links():
  net = NET.replace(links=2)
  # chunk B on link0 1.0-3.5; chunk A: start max(3.0, previous start 1.0, link1 free at 0) = 3.0, on
  # link1, ends 4.5. plain: max(3.0, 4.5) + 1.8 = 6.3. Links busy over [1.0, 4.5]: 3.5 of 6.3.
  r = simulate(WFBP, PROFILE, net)
  assert r.iteration_s == pytest.approx(6.3)
  assert r.network_busy == pytest.approx(3.5 / 6.3)
  assert [e.lane for e in r.events if e.kind == "allreduce"] == ["link0", "link1"]


def test_hand_zero_size_row_cross_step():
  # Z: a zero-size leaf (in no chunk) in the first layer, ready 2.0, update 0.5, fwd 1.0.
  # R: 250 f32, ready 1.0, fwd 1.0: its chunk runs 1.0-2.5 (d = 0.5 + 1.0).
  # fwd Z at max(2.0, 2.0 + 0.5) = 2.5 to 3.5 (Z counts as reduced at its ready time);
  # fwd R at max(3.5, 2.5) = 3.5 to 4.5.
  p = GradientProfile.from_rows([_row("Z/w", "Z", 0, 2.0, fwd=1.0, update=0.5), _row("R/w", "R", 250, 1.0,
                                                                                      fwd=1.0)],
                                forward_s=2.0, backward_s=2.0)
  s = _sched(p, [[1]])
  assert simulate(s, p, NET, cross_step=True).iteration_s == pytest.approx(4.5)
  assert _closed_form(s, p, NET, True) == pytest.approx(4.5)


def test_sliced_chunk_readiness_and_bytes():
  # A's 250 elements split: [0:100] merged with B (chunk ready = max(3.0, 1.0) = 3.0, 400 + 2000 B),
  # [100:250] alone (600 B). Issue: chunk0 3.0-5.9 (0.5 + 2.4), chunk1 5.9-7.0 (0.5 + 0.6).
  # plain: 7.0 + 1.8 = 8.8.
  s = Schedule(buckets=(Bucket(chunks=(Chunk(slices=((0, 0, 100), (1, 0, 500)), dtype="float32"),
                                       Chunk(slices=((0, 100, 250),), dtype="float32"))),),
               rows=PROFILE.tree_rows())
  r = simulate(s, PROFILE, NET)
  assert r.iteration_s == pytest.approx(8.8)
  assert r.comm_s == pytest.approx(2.9 + 1.1)


# --------------------------------------------------------------------------------------------------
# a slow, independent reference: advance a clock from event to event


def _reference(schedule, profile, network, cross_step):
  rows = profile.rows
  chunks = schedule.chunks
  ready = [max(rows[r].ready_s for r, _, _ in c.slices) for c in chunks]
  dur = [network.allreduce_s(c.nbytes) for c in chunks]
  n, links, bwd = len(chunks), network.links, profile.backward_s
  free = [0.0] * links
  start, end = [0.0] * n, [0.0] * n
  t = p = 0.0          # wall clock; backward progress (overlap=False only)
  k = 0
  bw_end = bwd if network.overlap or bwd <= 0 else None
  while True:
    while k < n and ready[k] <= (t if network.overlap else p):
      idle = [j for j in range(links) if free[j] <= t]
      if not idle:
        break
      j = min(idle, key=lambda j: (free[j], j))
      start[k], end[k] = t, t + dur[k]
      free[j] = end[k]
      k += 1
    busy = [f for f in free if f > t]
    cands = []
    if busy:
      cands.append(min(busy))
    target = None
    if network.overlap:
      if k < n and ready[k] > t:
        cands.append(ready[k])
    elif not busy:
      goals = ([ready[k]] if k < n and ready[k] > p else []) + ([bwd] if p < bwd else [])
      if goals:
        target = min(goals)
        cands.append(t + (target - p))
    if not cands:
      break
    t_next = min(cands)
    if target is not None:   # compute ran (nothing was on a link)
      p = target
      if bw_end is None and p >= bwd:
        bw_end = t_next
    t = t_next
  assert k == n
  last = max(end, default=0.0)
  layers = profile.layers
  fwd = profile.layer_fwd_s()
  upd = {l: 0.0 for l in layers}
  for r in rows:
    upd[r.layer] += r.update_s
  if not cross_step:
    return max(bw_end, last) + sum(upd.values()) + sum(fwd.values())
  reduced = {l: None for l in layers}
  for r in rows:
    if r.nbytes == 0:
      reduced[r.layer] = max(reduced[r.layer] or -1e300, r.ready_s)
  for c, e in zip(chunks, end):
    for r, _, _ in c.slices:
      l = rows[r].layer
      reduced[l] = max(reduced[l] if reduced[l] is not None else -1e300, e)
  t = bw_end if network.overlap else max(bw_end, last)
  for l in layers:
    if reduced[l] is not None:
      t = max(t, reduced[l] + upd[l])
    t += fwd[l]
  return t


def _instance(seed, n_max=6, **net_kw):
  rng = np.random.default_rng(seed)
  p = random_profile(rng, int(rng.integers(1, n_max + 1)), dtypes=("float32", "bfloat16"),
                     zero_prob=0.1)
  net = random_network(rng, p, **net_kw)
  return rng, p, net


@settings(deadline=None, max_examples=60)
@given(SEEDS, st.booleans())
def test_agrees_with_reference_loop(seed, cross_step):
  rng, p, net = _instance(seed)
  s = random_schedule(p, rng, in_ready_order=bool(rng.random() < 0.3))
  ref = _reference(s, p, net, cross_step)
  r = simulate(s, p, net, cross_step=cross_step)
  assert r.iteration_s == pytest.approx(ref, rel=1e-9, abs=1e-12)
  # the fast paths agree: no events, and the core's closed form over the chunk arrays
  assert simulate(s, p, net, cross_step=cross_step, events=False).iteration_s == pytest.approx(ref, rel=1e-9)
  assert _closed_form(s, p, net, cross_step) == pytest.approx(ref, rel=1e-9, abs=1e-12)
  # bookkeeping
  assert r.allreduces == s.num_allreduces
  assert r.comm_s == pytest.approx(sum(net.allreduce_s(c.nbytes) for c in s.chunks))
  assert 0.0 <= r.network_busy <= 1.0 + 1e-9
  assert r.idle_s >= 0.0
  _check_events(r, p, net)


def _check_events(r, p, net):
  dev = sorted((e.start_s, e.end_s) for e in r.events if e.lane == "device")
  for (s0, e0), (s1, _) in zip(dev, dev[1:]):
    assert s1 >= e0 - 1e-9, "device spans overlap"
  bwd = sum(e.end_s - e.start_s for e in r.events if e.kind == "backward")
  assert bwd == pytest.approx(p.backward_s)
  fwd = sum(e.end_s - e.start_s for e in r.events if e.kind == "forward")
  assert fwd == pytest.approx(p.forward_s)
  for lane in {e.lane for e in r.events if e.kind == "allreduce"}:
    spans = sorted((e.start_s, e.end_s) for e in r.events if e.lane == lane)
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
      assert s1 >= e0 - 1e-9, f"{lane} spans overlap"
  assert max((e.end_s for e in r.events), default=0.0) <= r.iteration_s + 1e-9
  if not net.overlap:  # the device computes only while no link is busy
    ar = [(e.start_s, e.end_s) for e in r.events if e.kind == "allreduce"]
    for e in r.events:
      if e.kind in ("backward", "forward"):
        for a, b in ar:
          assert e.end_s <= a + 1e-9 or e.start_s >= b - 1e-9


@settings(deadline=None, max_examples=40)
@given(SEEDS, st.booleans())
def test_free_network_iteration_is_compute(seed, cross_step):
  rng, p, net = _instance(seed)
  free = net.replace(alpha_s=0.0, beta_s_per_byte=0.0)
  s = random_schedule(p, rng)
  r = simulate(s, p, free, cross_step=cross_step)
  if not cross_step:
    assert r.iteration_s == pytest.approx(p.compute_s)
    assert r.idle_s == pytest.approx(0.0, abs=1e-12)
  else:
    # the update is a latency in the pipelined step: with no update, iteration = forward + backward;
    # with one, never less than that and never more than forward + backward + update.
    assert p.forward_s + p.backward_s - 1e-9 <= r.iteration_s <= p.compute_s + 1e-9
    no_upd = dataclasses.replace(p, rows=tuple(dataclasses.replace(row, update_s=0.0) for row in p.rows))
    assert simulate(s, no_upd, free, cross_step=True).iteration_s == pytest.approx(
        p.forward_s + p.backward_s)


@settings(deadline=None, max_examples=40)
@given(SEEDS, st.booleans(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_more_bandwidth_never_slower(seed, cross_step, f_beta, f_alpha):
  rng, p, net = _instance(seed)
  s = random_schedule(p, rng)
  faster = net.replace(beta_s_per_byte=net.beta_s_per_byte * f_beta, alpha_s=net.alpha_s * f_alpha)
  slow = simulate(s, p, net, cross_step=cross_step, events=False).iteration_s
  fast = simulate(s, p, faster, cross_step=cross_step, events=False).iteration_s
  assert fast <= slow * (1 + 1e-12) + 1e-15
  # more links never hurt either
  more = simulate(s, p, net.replace(links=net.links + 1), cross_step=cross_step, events=False).iteration_s
  assert more <= slow * (1 + 1e-12) + 1e-15


@settings(deadline=None, max_examples=30)
@given(SEEDS)
def test_no_overlap_one_link_is_compute_plus_comm(seed):
  rng, p, net = _instance(seed, links=1, overlap=False)
  s = random_schedule(p, rng)
  r = simulate(s, p, net)
  assert r.iteration_s == pytest.approx(p.compute_s + r.comm_s)
  assert r.idle_s == pytest.approx(r.comm_s)


def test_hand_skew():
  # skew 0.5: chunk B waits 0.5 x (compute since the last issue of the previous step: the rest of
  # backward 0, update 0.3, forward 1.5, backward up to 1.0) = 1.4; chunk A waits 0.5 x 2.0 = 1.0.
  net = NET.replace(overlap=False, skew=0.5)
  r = simulate(WFBP, PROFILE, net)
  assert r.iteration_s == pytest.approx(8.8 + 2.4)
  assert [(e.start_s, e.end_s) for e in r.events if e.kind == "allreduce"] == [
      pytest.approx((1.0, 4.9)), pytest.approx((6.9, 9.4))]
  assert simulate(WFBP, PROFILE, NET.replace(skew=0.5)).iteration_s == pytest.approx(
      simulate(WFBP, PROFILE, NET).iteration_s)  # ignored where the device overlaps


@settings(deadline=None, max_examples=30)
@given(SEEDS, st.booleans(), st.floats(0.0, 2.0))
def test_skew_adds_its_share_of_compute(seed, cross_step, skew):
  rng, p, net = _instance(seed, overlap=False)
  s = random_schedule(p, rng)
  slow = net.replace(skew=skew)
  r0 = simulate(s, p, net, cross_step=cross_step).iteration_s
  r = simulate(s, p, slow, cross_step=cross_step)
  if net.links == 1 and not cross_step and s.num_allreduces:
    assert r.iteration_s == pytest.approx(r0 + skew * p.compute_s)
  assert r.iteration_s >= r0 - 1e-12
  assert _closed_form(s, p, slow, cross_step) == pytest.approx(r.iteration_s, rel=1e-9, abs=1e-12)
  assert simulate(s, p, slow, cross_step=cross_step, events=False).iteration_s == pytest.approx(r.iteration_s)
  _check_events(r, p, slow)


# --------------------------------------------------------------------------------------------------
# errors, purity, speed


def test_errors():
  other = GradientProfile.from_rows([_row("A/w", "A", 250, 3.0, fwd=1.0), _row("B/v", "B", 500, 1.0,
                                                                               fwd=0.5)],
                                    forward_s=1.5, backward_s=3.0)
  with pytest.raises(ScheduleMismatchError, match=r"row 1 .*B/w.*B/v"):
    simulate(WFBP, other, NET)
  with pytest.raises(TypeError, match="cross_step='auto'"):
    simulate(WFBP, PROFILE, NET, cross_step="auto")
  with pytest.raises(TypeError, match="must be a prophet_jax.Schedule"):
    simulate(PROFILE, PROFILE, NET)
  with pytest.raises(TypeError, match="must be a prophet_jax.NetworkModel"):
    simulate(WFBP, PROFILE, "10gbe")


def test_pure_without_jax():
  code = ("import sys; sys.modules['jax'] = None\n"
          f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
          "from prophet_jax._planning._simulate import simulate; from prophet_jax._planning._bound import lower_bound\n"
          "from _brute import best_contiguous, best_ordered\n"
          "assert 'jax' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n")
  subprocess.run([sys.executable, "-c", code], check=True)


def _big(n=1000):
  rng = np.random.default_rng(0)
  rows = [_row(f"l{i}/w", f"l{i}", int(rng.integers(1, 100_000)), (n - i) * 1e-4, fwd=1e-4, update=1e-5)
          for i in range(n)]
  p = GradientProfile.from_rows(rows, forward_s=n * 1e-4, backward_s=n * 1e-4)
  return p, _sched(p, [[i] for i in p.ready_order()])


def test_1000_chunks():
  # its speed (P8: < 5 ms) is measured by bench/scaling.py (`e_timings`), not asserted here
  p, s = _big()
  for cross_step in (False, True):
    net = NetworkModel.preset("10gbe", workers=8)
    bare = simulate(s, p, net, cross_step=cross_step, events=False)
    r = simulate(s, p, net, cross_step=cross_step)
    assert len([e for e in r.events if e.kind == "allreduce"]) == 1000
    assert r.iteration_s == bare.iteration_s and bare.events == ()


def test_docstring_examples_and_chrome_trace():
  import doctest

  import prophet_jax._planning._bound
  import prophet_jax._planning._simulate

  for mod in (prophet_jax._planning._simulate, prophet_jax._planning._bound):
    res = doctest.testmod(mod)
    assert res.attempted > 0 and res.failed == 0, mod.__name__
  r = simulate(WFBP, PROFILE, NET.replace(links=2, overlap=False), cross_step=True)
  trace = r.to_chrome_trace()
  spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(spans) == len(r.events)
  assert {e["cat"] for e in spans} == {"backward", "forward", "allreduce", "update"}


def test_simresult_json_round_trip():
  r = simulate(WFBP, PROFILE, NET.replace(links=2, overlap=False), cross_step=True)
  assert r.events and SimResult.from_json(r.to_json()) == r          # every field, the timeline too
  assert SimResult.from_json(json.loads(r.to_json(indent=1))) == r    # from a parsed object as well
  bare = SimResult.from_json(r.to_json(events=False))
  assert bare.events == () and dataclasses.replace(bare, events=r.events) == r
  with pytest.raises(ValueError, match=r"missing field\(s\) \['iteration_s'\]"):
    SimResult.from_json({k: v for k, v in r.to_dict().items() if k != "iteration_s"})
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['nope'\]"):
    SimResult.from_json({**r.to_dict(), "nope": 1})


def test_fast_event_maker_builds_equal_events():
  """The timeline's events are built by filling Event's slots; that is only right while Event's
  constructor checks nothing."""
  from prophet_jax._planning._simulate import _new_event

  assert not hasattr(Event, "__post_init__")
  assert _new_event("allreduce", "chunk0", 0.5, 1.0, "link1") == Event(kind="allreduce", name="chunk0",
                                                                         start_s=0.5, end_s=1.0, lane="link1")
  assert _new_event("forward", "l0", 0.0, 1.0) == Event(kind="forward", name="l0", start_s=0.0, end_s=1.0)
