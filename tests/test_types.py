"""The frozen values: validation on construction, JSON round trips, the alpha-beta model and its fit."""

import dataclasses
import json

import numpy as np
import pytest

from prophet_jax import (Bucket, Chunk, GradientProfile, NetworkModel, NetworkError, ProfileError,
                         ProfileRow, Schedule, ScheduleError)


def _profile():
  rows = [ProfileRow(path=f"l{i}/w", layer=f"l{i}", shape=(4, 3), dtype="float32", nbytes=48,
                     ready_s=0.3 - 0.1 * i, fwd_s=0.05) for i in range(3)]
  rows.append(ProfileRow(path="l2/b", layer="l2", shape=(0,), dtype="float32", nbytes=0, ready_s=0.1))
  return GradientProfile(rows=tuple(rows), forward_s=0.15, backward_s=0.3, model="toy")


def _schedule(p, slices=((0, 0, 12), (1, 0, 12), (2, 0, 12))):
  return Schedule(buckets=(Bucket(chunks=(Chunk(slices=slices, dtype="float32"),)),),
                  rows=p.tree_rows(), policy="test")


def test_profile_round_trip_and_derived():
  p = _profile()
  assert GradientProfile.from_json(p.to_json()) == p
  assert p.total_nbytes == 144 and p.layers == ("l0", "l1", "l2")
  assert p.ready_order()[0] == 2  # the last layer is ready first
  assert p.compute_s == pytest.approx(0.45)
  assert hash(p) == hash(GradientProfile.from_json(p.to_json()))


@pytest.mark.parametrize("change, match", [
    (dict(ready_s=-0.002), "ready_s=-0.002"),
    (dict(ready_s=float("nan")), "ready_s=nan"),
    (dict(nbytes=47), "nbytes=47"),
    (dict(shape=(-1, 3)), "dimensions must be >= 0"),
    (dict(ready_s=9.0), "ready times must be <= backward_s"),
])
def test_bad_profile_rows(change, match):
  p = _profile()
  row = dataclasses.replace if "shape" not in change else None
  with pytest.raises(ProfileError, match=match):
    rows = list(p.rows)
    rows[0] = (row or (lambda r, **kw: ProfileRow(**{**dataclasses.asdict(r), **kw})))(rows[0], **change)
    GradientProfile(rows=tuple(rows), forward_s=p.forward_s, backward_s=p.backward_s)


def test_bad_profiles():
  p = _profile()
  with pytest.raises(ProfileError, match="empty"):
    GradientProfile(rows=(), forward_s=0, backward_s=0)
  with pytest.raises(ProfileError, match="appears twice"):
    GradientProfile(rows=(p.rows[0], p.rows[0]), forward_s=0.05, backward_s=0.3)
  with pytest.raises(ProfileError, match="forward_s"):
    GradientProfile(rows=p.rows, forward_s=1.0, backward_s=0.3)
  with pytest.raises(ProfileError, match="method"):
    GradientProfile(rows=p.rows, forward_s=0.15, backward_s=0.3, method="guessed")
  with pytest.raises(ValueError, match="malformed JSON"):
    GradientProfile.from_json("{not json")
  with pytest.raises(ValueError, match="unknown field"):
    GradientProfile.from_json({**p.to_dict(), "colour": 1})
  bad = p.to_dict()
  bad["rows"][0].pop("ready_s")
  with pytest.raises(ProfileError, match="missing field"):
    GradientProfile.from_json(bad)


def test_from_params_sizes_exact_and_skips_integers():
  params = {"a": {"kernel": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
            "b": {"kernel": np.zeros((4, 2), np.float16)}, "step": np.zeros((), np.int32)}
  p = GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  assert [r.path for r in p.rows] == ["a/bias", "a/kernel", "b/kernel"]
  assert [r.nbytes for r in p.rows] == [16, 48, 16]
  assert p.rows[2].ready_s < p.rows[0].ready_s  # back layers ready first
  assert max(r.ready_s for r in p.rows) == pytest.approx(2e-3)


def test_network_model_cost_and_presets():
  n = NetworkModel(alpha_s=1e-5, beta_s_per_byte=1e-9, workers=4)
  assert n.allreduce_s(1000) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1000 * 1e-9)
  assert NetworkModel(alpha_s=1, beta_s_per_byte=1, workers=1).allreduce_s(10**6) == 0
  for name in ("1gbe", "10gbe", "25gbe", "100gb-ib", "nvlink"):
    m = NetworkModel.preset(name, workers=8)
    assert NetworkModel.from_json(m.to_json()) == m and m.name == name
  assert NetworkModel.preset("1gbe", workers=2).beta_s_per_byte == pytest.approx(8e-9)


@pytest.mark.parametrize("kw, match", [
    (dict(alpha_s=-1.0), "alpha_s=-1.0"), (dict(beta_s_per_byte=float("inf")), "beta_s_per_byte=inf"),
    (dict(workers=0), "workers=0"), (dict(links=0), "links=0"), (dict(algorithm="tree"), "algorithm"),
])
def test_bad_network(kw, match):
  with pytest.raises(NetworkError, match=match):
    NetworkModel(**{"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "workers": 2, **kw})


def test_unknown_preset():
  with pytest.raises(NetworkError, match="unknown network preset '5gbe'"):
    NetworkModel.preset("5gbe", workers=2)


def test_fit_reproduces_synthetic_data_and_keeps_residual():
  true = NetworkModel(alpha_s=2e-5, beta_s_per_byte=3e-9, workers=4)
  sizes = np.geomspace(1024, 64 * 2**20, 17)
  rng = np.random.default_rng(0)
  secs = np.array([true.allreduce_s(s) for s in sizes]) * (1 + 0.01 * rng.standard_normal(17))
  fit = NetworkModel.fit(sizes, secs, workers=4)
  assert fit.alpha_s == pytest.approx(2e-5, rel=0.2)
  assert fit.beta_s_per_byte == pytest.approx(3e-9, rel=0.02)
  assert fit.fit_residual_s is not None and fit.fit_residual_s > 0
  exact = NetworkModel.fit(sizes, [true.allreduce_s(s) for s in sizes], workers=4)
  assert exact.alpha_s == pytest.approx(2e-5) and exact.fit_residual_s == pytest.approx(0, abs=1e-12)
  with pytest.raises(NetworkError, match="at least 2 distinct message sizes"):
    NetworkModel.fit([4194304, 4194304], [1e-3, 1e-3], workers=2)


def test_schedule_round_trip_and_invariants():
  p = _profile()
  s = _schedule(p)
  assert Schedule.from_json(s.to_json()) == s and hash(s) == hash(Schedule.from_json(s.to_json()))
  assert s.tree_fingerprint == p.fingerprint() and s.num_allreduces == 1
  with pytest.raises(ScheduleError, match=r"drops elements of leaf 'l1/w' at \[6:12\]"):
    _schedule(p, ((0, 0, 12), (1, 0, 6), (2, 0, 12)))
  with pytest.raises(ScheduleError, match="repeats elements of leaf 'l0/w'"):
    _schedule(p, ((0, 0, 12), (0, 4, 8), (1, 0, 12), (2, 0, 12)))
  with pytest.raises(ScheduleError, match="past its 12 elements"):
    _schedule(p, ((0, 0, 13), (1, 0, 12), (2, 0, 12)))
  with pytest.raises(ScheduleError, match="one dtype per chunk"):
    Schedule(buckets=(Bucket(chunks=(Chunk(slices=((0, 0, 12), (1, 0, 12), (2, 0, 12)), dtype="bfloat16"),)),),
             rows=p.tree_rows())
  edited = json.loads(s.to_json())
  edited["rows"][0][1] = [4, 4]
  with pytest.raises(ScheduleError, match="does not match its rows"):
    Schedule.from_json(edited)
  with pytest.raises(ScheduleError, match=r"float32 chunk with slices \(\(0, 0, 3\), \(0, 5, 5\)\) has slice 1 "
                                          r"\(row=0, start=5, stop=5\), which is empty.*Drop an empty slice"):
    Chunk(slices=((0, 0, 3), (0, 5, 5)), dtype="float32")
  bad = json.loads(s.to_json())
  bad["buckets"][0][0]["slices"][1] = [1, -2, 3]
  with pytest.raises(ScheduleError, match=r"from_json: bucket 0, chunk 0: .* has slice 1 \(row=1, start=-2, "
                                          r"stop=3\), which is negative"):
    Schedule.from_json(bad)
  with pytest.raises(ScheduleError, match=r"chunk0 names row 4, but the schedule has 4 rows \(0 to 3.*Plan "
                                          r"again for this profile"):
    _schedule(p, ((0, 0, 12), (1, 0, 12), (2, 0, 12), (4, 0, 1)))


def test_schedule_family_is_one_field_in_json_derived_for_old_files_and_checked():
  import prophet_jax as pj
  from prophet_jax.models import load_trace

  p, net = load_trace("resnet50-v100"), NetworkModel.preset("25gbe", workers=8)
  for policy, family in (("wfbp", "allreduce"), ("dear", "zero1")):
    s = pj.plan(p, net, policy)
    d = json.loads(s.to_json())
    assert s.family == d["family"] == family and s.sharded == (family == "zero1")
    del d["family"]   # a file written before the field existed
    assert Schedule.from_json(d) == s
    with pytest.raises(ScheduleError, match=r"family='fsdp'.*'%s'" % family):
      Schedule.from_json({**d, "family": "fsdp"})
  assert isinstance(Schedule.sharded, property) and Schedule.sharded.fset is None   # derived, read-only
