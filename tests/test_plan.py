"""plan(): names and callables, options, cross_step, validation, prediction; validate_schedule().

Pure: these tests never import jax.
"""

from __future__ import annotations

import dataclasses

import pytest

from prophet_jax import (Bucket, Chunk, GradientProfile, NetworkModel, Schedule, ScheduleError,
                         ScheduleMismatchError, plan, validate_schedule)
from prophet_jax.schedulers._registry import POLICIES
from prophet_jax._planning._simulate import simulate
from prophet_jax.schedulers import _auto, bucket, wfbp

NET = NetworkModel.preset("10gbe", workers=8)


def _profile(dtype_b="float32", n_b=8):
  return GradientProfile.from_rows([
      dict(path="a/w", layer="a", shape=(4, 4), dtype="float32", nbytes=64, ready_s=0.02, fwd_s=0.01),
      dict(path="a/b", layer="a", shape=(4,), dtype="float32", nbytes=16, ready_s=0.02),
      dict(path="b/w", layer="b", shape=(n_b,), dtype=dtype_b, nbytes=n_b * (2 if dtype_b == "bfloat16" else 4),
           ready_s=0.01, fwd_s=0.01),
  ], forward_s=0.02, backward_s=0.02)


P = _profile()
BASELINES = ["wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet"]


def test_policies_table_names_every_policy():
  assert list(POLICIES) == BASELINES[:3] + ["mgwfbp", "priority", "prophet", "auto", "dlcp", "dear", "fsdp"]
  s = plan(P, NET, "dlcp")                     # lossless by default: auto's plan, named dlcp
  assert s.policy == "dlcp" and s.buckets == plan(P, NET, "auto").buckets
  with pytest.raises(TypeError, match=r"unknown option\(s\) \['drop_fraction'\]"):
    plan(P, NET, "dlcp", drop_fraction=0.1)
  with pytest.raises(ValueError, match=r"max_defer=1.0"):
    plan(P, NET, "dlcp", max_defer=1.0)


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("cross_step", [False, True])
def test_plan_by_name_records_policy_mode_and_prediction(name, cross_step):
  s = plan(P, NET, name, cross_step=cross_step)
  assert s.policy == name and s.cross_step is cross_step
  assert validate_schedule(s, P) is s
  assert s.predicted_s == pytest.approx(simulate(s, P, NET, cross_step=cross_step).iteration_s)
  assert s.predicted_s >= P.compute_s - 1e-12


def test_plan_passes_options_and_records_them():
  s = plan(P, NET, "bucket", bucket_bytes=64, first_bucket_bytes=32)
  assert dict(s.options) == {"style": "ddp", "bucket_bytes": 64, "first_bucket_bytes": 32, "cycle_s": None}
  assert s == Schedule.from_json(s.to_json())
  s = plan(P, NET, "priority", partition_bytes=16)
  assert dict(s.options)["partition_bytes"] == 16 and max(s.chunk_nbytes()) <= 16


def test_plan_accepts_a_scheduler_callable():
  s = plan(P, NET, bucket(bucket_bytes=10**6), cross_step=True)
  assert s.policy == "bucket" and s.cross_step is True and s.num_allreduces == 1

  def mine(profile, network, *, cross_step):
    return dataclasses.replace(wfbp()(profile, network, cross_step=cross_step), policy="mine")

  assert plan(P, NET, mine).policy == "mine"


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(policy="fifo"), ValueError, r"unknown policy 'fifo'; expected one of .*'prophet'"),
    (dict(policy="bucket", bucket_size=5), TypeError,
     r"plan\(policy='bucket'\): unknown option\(s\) \['bucket_size'\]; 'bucket' accepts \['style', 'bucket_bytes', 'first_bucket_bytes', 'cycle_s'\]"),
    (dict(policy="wfbp", partition_bytes=5), TypeError, r"'wfbp' accepts no options"),
    (dict(policy="bucket", bucket_bytes=0), ValueError, r"bucket_bytes=0"),
    (dict(policy="prophet", cross_step="auto"), ValueError, r"only the 'auto' policy chooses the step mode"),
    (dict(policy="wfbp", cross_step="yes"), ValueError, r"cross_step='yes'"),
    (dict(policy=42), TypeError, r"a policy is a name"),
    (dict(policy=wfbp(), bucket_bytes=3), TypeError, r"configure the Scheduler callable itself"),
])
def test_plan_rejects_bad_arguments_clearly(kwargs, exc, match):
  kwargs = dict(kwargs)
  policy = kwargs.pop("policy")
  with pytest.raises(exc, match=match):
    plan(P, NET, policy, **kwargs)


def test_plan_rejects_wrong_value_types():
  with pytest.raises(TypeError, match="GradientProfile"):
    plan(P.to_dict(), NET, "wfbp")
  with pytest.raises(TypeError, match="NetworkModel"):
    plan(P, "10gbe", "wfbp")

  def not_a_schedule(profile, network, *, cross_step):
    return "schedule"

  with pytest.raises(TypeError, match="returned str, not a Schedule"):
    plan(P, NET, not_a_schedule)


def test_plan_catches_a_policy_that_plans_for_another_tree():
  other = _profile(dtype_b="bfloat16")

  def wrong_tree(profile, network, *, cross_step):
    return wfbp()(other, network, cross_step=cross_step)

  with pytest.raises(ScheduleMismatchError, match=r"row 2 of the Schedule is 'b/w' \(8,\) bfloat16"):
    plan(P, NET, wrong_tree)


def test_validate_schedule_names_what_differs():
  s = plan(P, NET, "wfbp")
  with pytest.raises(ScheduleMismatchError, match="planned for a tree with 3 leaves, but the profile has 2"):
    validate_schedule(s, GradientProfile(rows=P.rows[:2], forward_s=0.01, backward_s=0.02))
  with pytest.raises(ScheduleMismatchError, match=r"'b/w' \(16,\) float32"):
    validate_schedule(plan(_profile(n_b=16), NET, "wfbp"), P)
  with pytest.raises(TypeError, match="`schedule` must be a prophet_jax.Schedule"):
    validate_schedule(s.to_dict(), P)
  with pytest.raises(TypeError, match="`profile` must be a prophet_jax.GradientProfile"):
    validate_schedule(s, NET)


def test_schedule_that_drops_or_repeats_elements_is_refused():
  rows = P.tree_rows()
  whole = [Chunk(slices=((0, 0, 16), (1, 0, 4)), dtype="float32")]
  with pytest.raises(ScheduleError, match="drops elements of leaf 'b/w'"):
    Schedule(buckets=(Bucket(chunks=tuple(whole)),), rows=rows)
  with pytest.raises(ScheduleError, match="repeats elements of leaf 'b/w'"):
    Schedule(buckets=(Bucket(chunks=tuple(whole + [Chunk(slices=((2, 0, 8),), dtype="float32"),
                                                   Chunk(slices=((2, 4, 6),), dtype="float32")])),),
             rows=rows)


def test_plan_auto():
  assert callable(_auto.auto)
  s = plan(P, NET, "auto", cross_step="auto")
  assert isinstance(s.cross_step, bool)
  validate_schedule(s, P)
