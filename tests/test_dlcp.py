"""Deferral groups (Bucket.defer) and the `dlcp` policy: invariants, JSON, simulation, the planner.

Pure: these tests never import jax.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _brute import random_deferral, random_network, random_profile, random_schedule, split_group
from _instances import NET, PROFILE, row, sched
from prophet_jax import Bucket, Chunk, GradientProfile, NetworkModel, Schedule, ScheduleError, plan
from prophet_jax._planning._simulate import simulate
from prophet_jax._values._network import Pressure
from prophet_jax.schedulers import auto, dlcp

SEEDS = st.integers(0, 2**32 - 1)
F32 = "float32"


def _chunk(r, a, b, dtype=F32):
  return Chunk(slices=((r, a, b),), dtype=dtype)


# -- the representation -------------------------------------------------------------------------------

def test_bucket_defer_invariants_name_the_values():
  parts = (_chunk(0, 0, 3), _chunk(0, 3, 6), _chunk(0, 6, 10))
  with pytest.raises(ScheduleError, match=r"bucket of 3 chunks has defer=2; .* 0 <= defer <= 1"):
    Bucket(chunks=parts, defer=2)
  with pytest.raises(ScheduleError, match=r"defer=-1"):
    Bucket(chunks=parts, defer=-1)
  with pytest.raises(ScheduleError, match=r"defer=1.5; `defer` must be an integer"):
    Bucket(chunks=parts, defer=1.5)
  with pytest.raises(ScheduleError, match=r"defer=True"):
    Bucket(chunks=parts, defer=True)
  with pytest.raises(ScheduleError, match=r"mixes dtypes \['bfloat16', 'float32'\]"):
    Bucket(chunks=(_chunk(0, 0, 3), _chunk(1, 0, 3, "bfloat16")), defer=1)
  b = Bucket(chunks=parts, defer=1)
  assert (b.slots, b.slot_size, b.deferred_size, b.allreduce_sizes()) == (2, 4, 4, (4, 4))
  lossless = Bucket(chunks=parts)
  assert (lossless.slots, lossless.deferred_size, lossless.allreduce_sizes()) == (3, 0, (3, 3, 4))
  # at most half: a chunk deferred at one step must be sendable at the next
  assert Bucket(chunks=parts + (_chunk(0, 10, 12),), defer=2).slots == 2


def _deferring():
  # A (250 f32) lossless; B (500 f32) as a group of 4 parts of 125, 1 deferred
  group = split_group(_chunk(1, 0, 500), 4, 1)
  return Schedule(buckets=(Bucket(chunks=(_chunk(0, 0, 250),)), group), rows=PROFILE.tree_rows())


def test_schedule_numbers_json_and_old_files():
  s = _deferring()
  assert s.defers and s.num_allreduces == 1 + 3
  assert s.allreduce_sizes() == (250, 125, 125, 125)
  assert s.allreduce_nbytes() == (1000, 500, 500, 500)
  assert s.max_deferred_fraction == pytest.approx(125 / 750)
  assert "1 deferral groups defer 1 of 4 chunks per step" in s.describe()
  assert Schedule.from_json(s.to_json()) == s
  assert Schedule.from_json(json.loads(s.to_json(indent=1))) == s
  # a lossless schedule's file is unchanged (buckets as lists of chunks) and old files load
  plain = sched(PROFILE, [[1], [0]])
  assert isinstance(plain.to_dict()["buckets"][0], list) and not plain.defers
  assert plain.max_deferred_fraction == 0.0 and plain.allreduce_sizes() == (500, 250)
  d = s.to_dict()
  d["buckets"][1]["extra"] = 1
  with pytest.raises(ScheduleError, match=r"unknown field\(s\) \['extra'\]"):
    Schedule.from_json(d)
  d["buckets"][1] = {"defer": 3, "chunks": d["buckets"][1]["chunks"]}
  with pytest.raises(ScheduleError, match="defer=3"):
    Schedule.from_json(d)


def test_coverage_is_unchanged_by_deferral():
  group = split_group(_chunk(1, 0, 500), 4, 1)
  with pytest.raises(ScheduleError, match="drops elements of leaf 'A/w'"):
    Schedule(buckets=(group,), rows=PROFILE.tree_rows())
  dup = Bucket(chunks=group.chunks + (_chunk(1, 0, 10),), defer=1)
  with pytest.raises(ScheduleError, match="repeats elements of leaf 'B/w'"):
    Schedule(buckets=(Bucket(chunks=(_chunk(0, 0, 250),)), dup), rows=PROFILE.tree_rows())


def test_simulated_slots_by_hand():
  # A: 1.5 s from 3.0. B's group: 3 slots of 125 f32 = 500 B: 0.5 + 0.5 = 1.0 s each, from 1.0.
  # plain: B's slots 1.0-4.0, A 4.0-5.5; + update 0.3 + forward 1.5 = 7.3 (wfbp: 6.8 + ...)
  s = _deferring()
  s = Schedule(buckets=(s.buckets[1], s.buckets[0]), rows=s.rows)
  r = simulate(s, PROFILE, NET)
  assert r.allreduces == 4 and r.comm_s == pytest.approx(3 * 1.0 + 1.5)
  assert r.iteration_s == pytest.approx(5.5 + 1.8)
  assert [x for e in r.events if e.kind == "allreduce" for x in (e.start_s, e.end_s)] == pytest.approx(
      [1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.5])
  # padding: parts of 167, 167, 166 with one deferred: 2 slots of 167 f32 (668 B: 1.168 s each)
  pad = Schedule(buckets=(split_group(_chunk(1, 0, 500), 3, 1), Bucket(chunks=(_chunk(0, 0, 250),))),
                 rows=PROFILE.tree_rows())
  assert pad.allreduce_sizes() == (167, 167, 250)
  assert simulate(pad, PROFILE, NET).comm_s == pytest.approx(2 * (0.5 + 0.668) + 1.5)


def test_a_slot_waits_for_its_whole_group_and_holds_every_row():
  # one group over A and B (one dtype): every slot is ready when A is (3.0) and holds both layers:
  # pipelined, B's forward waits for the last slot too.
  both = Chunk(slices=((0, 0, 250), (1, 0, 500)), dtype=F32)
  g = split_group(both, 2, 1)              # 2 parts of 375 f32, one sent: 0.5 + 1.5 = 2.0 s
  s = Schedule(buckets=(g,), rows=PROFILE.tree_rows())
  r = simulate(s, PROFILE, NET, cross_step=True)
  ar = [x for e in r.events if e.kind == "allreduce" for x in (e.start_s, e.end_s)]
  assert ar == pytest.approx([3.0, 5.0])
  # A: 5.0 + update 0.1, forward 1.0 -> 6.1; B: max(6.1, 5.0 + 0.2) + 0.5 = 6.6
  assert r.iteration_s == pytest.approx(6.6)


@settings(deadline=None, max_examples=40)
@given(SEEDS, st.booleans())
def test_deferral_agrees_with_a_reference_built_by_hand(seed, cross_step):
  # a schedule with deferral simulates exactly as the lossless schedule whose chunks are the slots:
  # m - k chunks, each holding the whole group, with the padded slot's bytes (checked through a
  # profile whose rows make those bytes)
  rng = np.random.default_rng(seed)
  p = random_profile(rng, int(rng.integers(1, 7)), dtypes=("float32", "bfloat16"), zero_prob=0.1)
  net = random_network(rng, p)
  s = random_deferral(random_schedule(p, rng), rng)
  r = simulate(s, p, net, cross_step=cross_step, events=False)
  assert r.allreduces == s.num_allreduces == len(s.allreduce_nbytes())
  d = [net.allreduce_s(n) for n in s.allreduce_nbytes()]
  if not net.skew:
    assert r.comm_s == pytest.approx(sum(d))
  zero = Schedule(buckets=tuple(Bucket(chunks=b.chunks) for b in s.buckets), rows=s.rows)
  # deferral never sends more: never slower than the same chunks all sent (one link, overlap), unless
  # a group pads its slots past its chunks' bytes, or holds chunks ready at different times (a slot's
  # content is chosen at run time, so every slot waits for the group's last chunk)
  def ready(c):
    return max(p.rows[r].ready_s for r, _, _ in c.slices)

  if net.links == 1 and net.overlap:
    groups_lossless = simulate(zero, p, net, cross_step=cross_step, events=False).iteration_s
    assert r.iteration_s <= groups_lossless * (1 + 1e-12) or any(
        b.defer and (b.slot_size * b.slots > sum(c.size for c in b.chunks)
                     or len({ready(c) for c in b.chunks}) > 1) for b in s.buckets)


# -- the policy ---------------------------------------------------------------------------------------

def _comm_bound(n=6, elems=2**20):
  rows = [row(f"l{i}/w", f"l{i}", elems, 0.001 * (n - i), fwd=0.001) for i in range(n)]
  return GradientProfile.from_rows(rows, forward_s=0.001 * n, backward_s=0.001 * n)


NET10 = NetworkModel.preset("10gbe", workers=8)


@pytest.mark.parametrize("kw, err, match", [
    (dict(max_defer=1.0), ValueError, r"dlcp\(\): max_defer=1.0 must be a fraction .* \[0, 1\)"),
    (dict(max_defer=-0.1), ValueError, r"max_defer=-0.1"),
    (dict(max_defer=float("nan")), ValueError, r"max_defer=nan"),
    (dict(max_defer="0.1"), ValueError, r"max_defer='0.1'"),
    (dict(max_defer=True), ValueError, r"max_defer=True"),
    (dict(spread=1), ValueError, r"dlcp\(spread=1\): `spread` must be an integer >= 2"),
    (dict(spread=2.0), TypeError, r"dlcp\(spread=2.0\)"),
    (dict(chunk_bytes=0), ValueError, r"dlcp\(chunk_bytes=0\)"),
])
def test_bad_options(kw, err, match):
  with pytest.raises(err, match=match):
    dlcp(**kw)
  with pytest.raises(err, match=match.replace(r"dlcp\(\): ", "")):
    plan(PROFILE, NET, "dlcp", **kw)


def test_unknown_option_names_the_valid_ones():
  with pytest.raises(TypeError, match=r"unknown option\(s\) \['drop_fraction'\]; 'dlcp' accepts "
                                      r"\['max_defer', 'spread', 'chunk_bytes', 'all_layers', 'release'\]"):
    plan(PROFILE, NET, "dlcp", drop_fraction=0.1)


@pytest.mark.parametrize("cross_step", [False, True])
def test_lossless_when_max_defer_is_zero_or_communication_hidden(cross_step):
  p = _comm_bound()
  a = auto()(p, NET10, cross_step=cross_step)
  s = dlcp()(p, NET10, cross_step=cross_step)
  assert s.buckets == a.buckets and s.predicted_s == a.predicted_s and not s.defers
  assert s.policy == "dlcp" and dict(s.options)["decision"] == "lossless: max_defer=0"
  # a calm, fast network: communication hidden, so nothing is split or deferred
  fast = NetworkModel.preset("nvlink", workers=8)
  a = auto()(p, fast, cross_step=cross_step)
  s = dlcp(max_defer=0.25)(p, fast, cross_step=cross_step)
  assert s.buckets == a.buckets and s.predicted_s == a.predicted_s
  assert dict(s.options)["decision"].startswith("lossless: communication hidden")


@pytest.mark.parametrize("cross_step", [False, True])
def test_defers_within_budget_and_gains_when_communication_bound(cross_step):
  p = _comm_bound()
  a = auto()(p, NET10, cross_step=cross_step)
  times = []
  for f in (0.05, 0.1, 0.25):
    s = plan(p, NET10, "dlcp", cross_step=cross_step, max_defer=f)
    assert s.defers and 0 < s.max_deferred_fraction <= f
    assert s.predicted_s == pytest.approx(simulate(s, p, NET10, cross_step=cross_step).iteration_s)
    times.append(s.predicted_s)
    assert dict(s.options)["max_defer"] == f and dict(s.options)["decision"].startswith("defer")
  # a quarter of the bytes deferred: most of a quarter of the (communication-bound) step saved
  assert times[0] < a.predicted_s and times[2] < (0.9 if cross_step else 0.85) * a.predicted_s
  assert times[0] >= times[1] >= times[2]               # a larger budget is never predicted slower


@pytest.mark.filterwarnings("ignore::prophet_jax._values._errors.DeferralWarning")
@settings(deadline=None, max_examples=25)
@given(SEEDS, st.booleans(), st.sampled_from([0.05, 0.1, 0.25, 0.5]))
def test_never_over_budget_never_slower_than_auto(seed, cross_step, max_defer):
  rng = np.random.default_rng(seed)
  p = random_profile(rng, int(rng.integers(1, 10)), dtypes=("float32", "bfloat16"), zero_prob=0.1)
  net = random_network(rng, p, comm_ratio=float(rng.choice([0.3, 2.0, 8.0])))
  if rng.random() < 0.3:
    net = net.replace(pressure=Pressure(background_flows=0.3, tail_prob=0.05,
                                        tail_scale_s=0.05 * p.backward_s, samples=8))
  a = auto()(p, net, cross_step=cross_step)
  s = dlcp(max_defer=max_defer, spread=int(rng.integers(2, 5)))(p, net, cross_step=cross_step)
  assert s.max_deferred_fraction <= max_defer
  assert s.predicted_s <= a.predicted_s * (1 + 1e-12)
  for b in s.buckets:
    assert 2 * b.defer <= len(b.chunks)
  assert Schedule.from_json(s.to_json()) == s


def test_plans_against_pressure():
  p = _comm_bound()
  net = NET10.replace(pressure=Pressure(background_flows=0.5, tail_prob=0.01, tail_scale_s=1e-3, samples=16))
  s = plan(p, net, "dlcp", max_defer=0.1)
  r = simulate(s, p, net)
  assert r.samples == 16 and s.predicted_s == pytest.approx(r.iteration_s)
  assert s.predicted_s < plan(p, net, "auto").predicted_s


@pytest.mark.filterwarnings("ignore::prophet_jax._values._errors.DeferralWarning")
def test_fine_parts_with_chunk_bytes():
  p = _comm_bound()
  s = plan(p, NET10, "dlcp", max_defer=0.25, chunk_bytes=2**20, spread=3)
  groups = [b for b in s.buckets if b.defer]
  assert groups and all(len(b.chunks) == 3 * b.defer for b in groups)
  assert any(b.defer > 1 for b in groups)
  assert all(b.slot_size * 4 <= 2**20 + 4 for b in groups)     # parts of at most chunk_bytes
  # parts too small ever to pay for their start-ups are not made: lossless
  tiny = plan(p, NET10, "dlcp", max_defer=0.25, chunk_bytes=2**16)
  assert not tiny.defers and "no deferral of at most 0.25" in dict(tiny.options)["decision"]


# -- issue 27: deferral at any model size, and saying why not ------------------------------------------

def _issue27():
  """The issue's case: a 4-layer model of 18k float32 params (7 leaves), 8 workers, a link of 50 us per
  ring step + 20 MB/s, the plain step, estimated times."""
  f32 = np.float32
  params = {"embed": {"embedding": np.zeros((64, 48), f32)},
            "dense0": {"kernel": np.zeros((48, 96), f32), "bias": np.zeros(96, f32)},
            "dense1": {"kernel": np.zeros((96, 96), f32), "bias": np.zeros(96, f32)},
            "head": {"kernel": np.zeros((96, 10), f32), "bias": np.zeros(10, f32)}}
  profile = GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  return profile, NetworkModel(alpha_s=50e-6, beta_s_per_byte=1 / 20e6, workers=8)


@pytest.mark.parametrize("max_defer", [0.1, 0.25])
def test_the_issue_case_defers_at_any_model_size(max_defer):
  p, net = _issue27()
  assert sum(r.nbytes for r in p.rows) // 4 == 18058 and len(p.rows) == 7
  a = plan(p, net, "auto")
  s = plan(p, net, "dlcp", max_defer=max_defer)
  assert 0.5 * max_defer < s.max_deferred_fraction <= max_defer
  assert s.predicted_s < (0.98 if max_defer == 0.1 else 0.92) * a.predicted_s   # 8.945 / 8.288 ms vs 9.168
  assert s.predicted_s == pytest.approx(simulate(s, p, net).iteration_s)
  assert "decision: defer" in s.describe()
  if max_defer == 0.1:
    # the group takes a whole message's place and its rest goes to the neighbour: no start-up added
    assert s.num_allreduces == a.num_allreduces


def test_deferring_nothing_under_exposed_communication_warns_and_says_why(recwarn):
  p, net = _issue27()
  with pytest.warns(pj_deferral_warning(), match=r"dlcp\(max_defer=0.05\) defers nothing .* save at most "
                                                 r"315.7 us .* less than the 700 us start-up .* with "
                                                 r"max_defer=0.25 it would defer"):
    s = plan(p, net, "dlcp", max_defer=0.05)
  assert not s.defers and s.buckets == plan(p, net, "auto").buckets
  assert "decision: lossless: no deferral of at most 0.05" in s.describe()
  # asked for nothing, or nothing to gain: no warning
  recwarn.clear()
  plan(p, net, "dlcp", max_defer=0.0)
  plan(p, NetworkModel.preset("nvlink", workers=8), "dlcp", max_defer=0.25)
  assert not [w for w in recwarn if w.category is pj_deferral_warning()]


def pj_deferral_warning():
  from prophet_jax import DeferralWarning
  return DeferralWarning


def test_first_and_last_layers_never_wait_unless_all_layers():
  p = _comm_bound(n=4)
  layer_of = {i: r.layer for i, r in enumerate(p.rows)}
  for f in (0.1, 0.25):
    s = plan(p, NET10, "dlcp", max_defer=f)
    waiting = {layer_of[r] for b in s.buckets if b.defer for c in b.chunks for r in c.rows}
    assert s.defers and waiting <= {"l1", "l2"}
  both = plan(p, NET10, "dlcp", max_defer=0.25, all_layers=True)
  assert both.predicted_s <= plan(p, NET10, "dlcp", max_defer=0.25).predicted_s
  assert dict(both.options)["all_layers"] is True
  with pytest.raises(TypeError, match=r"dlcp\(all_layers=1\)"):
    dlcp(all_layers=1)
