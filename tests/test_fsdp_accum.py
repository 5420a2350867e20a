"""Accumulation in the FSDP step (issue 48): k micro-batches per step, each group's gathered parameters held
across them or gathered again, each unit's whole gradient held and reduce-scattered once or scattered each
micro-batch. Planned, simulated and bounded (pure), then carried out by `hooked` and compared with the
single-device full batch of the k micro-batches, its compiled collectives counted against the plan.
"""

import itertools
import json

import numpy as np
import pytest

import prophet_jax as pj
from prophet_jax._planning._core import problem
from prophet_jax._planning._fsdp import accum_counts, accum_run, fsdp_arrays, fsdp_arrays_of
from prophet_jax._values._errors import ScheduleError

from test_fsdp import _layered, _random_instance

NET = pj.NetworkModel.preset("100gb-ib", workers=8)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulating_plan_holds_what_fits_and_stays_above_its_bound(k):
  prof = _layered()
  bound = pj.lower_bound(prof, NET, sharded="fsdp", micro_batches=k)
  prob = problem(prof, NET)
  seen = []
  for budget in (None, 32 * 2**20, 17 * 2**20):
    s = pj.plan(prof, NET, "fsdp", memory_budget_bytes=budget, micro_batches=k)
    f, r = s.fsdp, pj.simulate(s, prof, NET)
    arr = fsdp_arrays_of(prob, s)
    ag, rs, moved = accum_counts(arr, k)
    assert f.micro_batches == k and dict(s.options)["micro_batches"] == k
    assert r.iteration_s == pytest.approx(s.predicted_s) and r.peak_memory_bytes <= (budget or np.inf)
    assert bound <= r.iteration_s * (1 + 1e-9) and (r.all_gathers, r.reduce_scatters) == (ag, rs)
    assert pj.Schedule.from_json(s.to_json()) == s
    seen.append((f, moved, r))
  (every, moved, r), (_, _, r32), (least, moved_least, _) = seen
  # no budget: everything held, each gathered byte moved once per step, one reduce-scatter per unit
  assert all(every.hold_params) and all(every.hold_grads) and moved == sum(fsdp_arrays_of(prob, pj.plan(
      prof, NET, "fsdp")).unit_bytes)
  assert (r.all_gathers, r.reduce_scatters) == (len(every.keep), len(every.units))
  # the least budget holds nothing: every micro-batch gathers (and re-gathers) and scatters
  assert not any(least.hold_params) and not any(least.hold_grads) and moved_least > (k - 1) * moved
  assert any(seen[1][0].hold_params) and r32.peak_memory_bytes > r.peak_memory_bytes / 4


def test_plans_without_micro_batches_are_unchanged_and_old_json_loads():
  prof = _layered(n_layers=4)
  s = pj.plan(prof, NET, "fsdp", memory_budget_bytes=14 * 2**20)
  obj = json.loads(s.to_json())
  assert not {"micro_batches", "hold_params", "hold_grads"} & set(obj["fsdp"]) and "micro_batches" not in str(
      obj["options"])
  assert pj.Schedule.from_json(json.dumps(obj)).fsdp.micro_batches == 1
  one = pj.plan(prof, NET, "fsdp", memory_budget_bytes=14 * 2**20, micro_batches=2)
  assert one.buckets == s.buckets and one.fsdp.keep == s.fsdp.keep      # the same plan, holds on top
  with pytest.raises(ScheduleError, match=r"hold_params=\[True\]; expected \[\] or 4"):
    pj.Schedule.from_json(json.dumps({**obj, "fsdp": {**obj["fsdp"], "hold_params": [True]}}))
  with pytest.raises(ValueError, match=r"micro_batches=0"):
    pj.plan(prof, NET, "fsdp", micro_batches=0)
  with pytest.raises(ValueError, match=r"micro_batches=2.*sharded='fsdp'"):
    pj.lower_bound(prof, NET, micro_batches=2)
  with pytest.raises(ValueError, match=r"micro_batches=2.*calm"):
    pj.plan(prof, NET.replace(pressure=pj.Pressure(background_flows=1)), "fsdp", micro_batches=2)


def test_the_bound_holds_for_every_hold_pattern():
  """B_fsdp for k micro-batches is at most the simulated step of every hold pattern of every keep pattern on
  random instances (HSDP and no-overlap networks among them)."""
  rng = np.random.default_rng(48)
  for _ in range(6):
    prof, net = _random_instance(rng)
    s = pj.plan(prof, net, "fsdp")
    prob = problem(prof, net)
    f = s.fsdp
    for k in (2, 3):
      bound = pj.lower_bound(prof, net, sharded="fsdp", micro_batches=k)
      n_g, n_u = len(f.keep), len(f.units)
      for keep in itertools.product([True, False], repeat=n_g):
        arr = fsdp_arrays(prob, [c.slices for c in s.chunks], f.units, keep, 1, 1, f.shard_count,
                          f.replica_count, f.gathers or None)
        for hp in itertools.product([True, False], repeat=n_g):
          for hg in itertools.product([True, False], repeat=n_u):
            run = accum_run(prob, arr._replace(held=hp, rs_held=hg), k)
            assert bound <= run.iteration_s * (1 + 1e-9), (k, keep, hp, hg)
