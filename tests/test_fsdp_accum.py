"""Accumulation in the FSDP step (issue 48): k micro-batches per step, each group's gathered parameters held
across them or gathered again, each unit's whole gradient held and reduce-scattered once or scattered each
micro-batch. Planned, simulated and bounded (pure), then carried out by `hooked` and compared with the
single-device full batch of the k micro-batches, its compiled collectives counted against the plan.
"""

import dataclasses
import itertools
import json

import numpy as np
import pytest

import prophet_jax as pj
from prophet_jax._planning._core import problem
from prophet_jax._planning._fsdp import fsdp_arrays, fsdp_arrays_of
from prophet_jax._planning._fsdp_accum import accum_counts, accum_run
from prophet_jax._values._errors import ScheduleError

from test_fsdp import _layered, _random_instance, _scanned_params

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
    assert pj.Schedule.from_json(s.to_json()) == s and f"; {k} micro-batches per step ({sum(f.hold_params)} groups" in s.describe()
    seen.append((f, moved, r))
  (every, moved, r), (_, _, r32), (least, moved_least, _) = seen
  # no budget: everything held, each gathered byte moved once per step, one reduce-scatter per unit
  assert all(every.hold_params) and all(every.hold_grads) and moved == sum(fsdp_arrays_of(prob, pj.plan(
      prof, NET, "fsdp")).unit_bytes)
  assert (r.all_gathers, r.reduce_scatters) == (len(every.keep), len(every.units))
  # the least budget holds nothing: every micro-batch gathers (and re-gathers) and scatters
  assert not any(least.hold_params) and not any(least.hold_grads) and moved_least > (k - 1) * moved
  assert any(seen[1][0].hold_params) and r32.peak_memory_bytes > r.peak_memory_bytes / 4


def test_a_scanned_stack_is_never_held():
  """The step gathers and reduce-scatters a stack's layers inside its loop each micro-batch: without a budget
  every other group and unit is held, no scanned layer's."""
  params, specs = _scanned_params(layers=4, width=64)
  prof = pj.GradientProfile.from_params(params, forward_s=0.01, backward_s=0.02, mesh={"data": 8}, shardings=specs,
                                        stacked=("stack",), order=("in", "stack", "head"))
  s = pj.plan(prof, NET, "fsdp", micro_batches=2)
  f = s.fsdp
  groups = [[r for r, _, _ in s.chunks[u].slices] for u in f.units]
  assert len(f.units) == 5 and not f.gathers
  for g, hp, hg in zip(groups, f.hold_params, f.hold_grads):
    assert hp == hg == (not prof.rows[g[0]].path.startswith("stack/")), g


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


# ---------------- the step

def _expected(sched):
  """The collectives a k-micro-batch step runs: a held group gathered once, another k times (and k times again
  in backward where not kept); a held unit reduce-scattered once, another k times; replicated chunks k times."""
  f = sched.fsdp
  k, n = f.micro_batches, len(f.keep)
  hp, hg = f.hold_params or (False,) * n, f.hold_grads or (False,) * len(f.units)
  out = {("all-gather", "fsdp/ag"): sum(1 if h else k for h in hp),
         ("all-gather", "fsdp/reag"): sum(k for h, kp in zip(hp, f.keep) if not (h or kp)),
         ("reduce-scatter", "fsdp/rs"): sum(1 if h else k for h in hg),
         ("all-reduce", "chunk"): k * (len(sched.chunks) - len(f.units))}
  return {key: v for key, v in out.items() if v}


def test_accumulating_step_equals_the_full_batch_and_runs_the_planned_collectives():
  """k = 2 with every group and unit held (no budget; on the mesh) or none (the least budget: groups also
  gathered again in backward), k = 4 with some groups held and others gathered again (a budget between),
  each equal to the single-device step on the whole batch (SGD with momentum, 2 steps); the same compiled
  step dividing by k - 1 fails; its compiled collectives counted against the plan, by hand and by `audit`."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import PartitionSpec as P

  import test_fsdp_step as T
  params, specs, loss, stacked = T.unrolled()
  mesh, tx = T._mesh(), optax.sgd(0.1, momentum=0.9)
  rng = np.random.default_rng(3)
  batches = [{x: jnp.asarray(rng.normal(size=(4 * T.NDEV, T.D)), jnp.float32) for x in ("x", "y")} for _ in range(2)]
  one = jax.devices()[0]
  single = T._run(T.reference_step(loss, tx), jax.device_put(params, one), jax.device_put(tx.init(params), one),
                  jax.device_put(batches, one))
  sspecs = T._state_specs(tx, params, specs)
  placed = [T._place(b, {"x": P("data"), "y": P("data")}, mesh) for b in batches]
  least = T._least(params, specs, stacked, micro_batches=2)
  between = T._plan(params, specs, stacked, least.fsdp.memory_budget_bytes + 1024, micro_batches=4)
  for i, (k, sched) in enumerate([(2, T._plan(params, specs, stacked, None, micro_batches=2)), (2, least),
                                  (4, between)]):
    f = sched.fsdp
    assert f.micro_batches == k and [all(f.hold_params + f.hold_grads), not any(f.hold_params + f.hold_grads),
                                     any(f.hold_params) and not all(f.hold_params)][i] and (i == 0) != (False in f.keep)
    step, _ = T.library_step(loss, sched, specs, tx, params, mesh, on_mesh=i == 0)
    p0, s0 = T._place(params, specs, mesh), T._place(tx.init(params), sspecs, mesh)
    step = step.lower(p0, s0, placed[0], jnp.float32(1.0)).compile()
    got = T._run(step, p0, s0, placed, jnp.float32(1.0))
    T.assert_trees_close(got[0], single[0], params)
    with pytest.raises(AssertionError):        # each micro-batch's mean divided by k - 1 instead of k
      T.assert_trees_close(T._run(step, p0, s0, placed, jnp.float32(k / (k - 1)))[0], single[0], params)
    assert T.collectives(step) == _expected(sched), (k, f)
    assert pj.audit(step, sched).ok, pj.audit(step, sched).describe()
    one = dataclasses.replace(sched, fsdp=dataclasses.replace(f, micro_batches=1))
    assert not pj.audit(step, one).ok                # the same program against one micro-batch's plan


def test_accumulating_step_refusals_name_the_fault():
  import jax.numpy as jnp
  import optax

  import test_fsdp_step as T
  params, specs, loss, stacked = T.unrolled()
  sched = T._plan(params, specs, stacked, None, micro_batches=3)
  grad_fn = pj.hooked(loss, sched, axis_name="data", mesh=T._mesh())
  batch = {x: jnp.zeros((2 * T.NDEV, T.D), jnp.float32) for x in ("x", "y")}
  with pytest.raises(ValueError, match=r"micro_batches=3.*batch leaf .*'x'.*\(2, 16\)"):
    grad_fn(T._place(params, specs, T._mesh()), T._place(batch, {"x": T.P("data"), "y": T.P("data")}, T._mesh()))
  with pytest.raises(ValueError, match=r"every_k=2 with an FSDP plan.*micro_batches=2"):
    pj.scheduled(optax.sgd(0.1), sched, axis_name="data", every_k=2)


def test_hsdp_accumulates_too():
  """An HSDP plan (4 replicas x 2 shards) of k = 2, everything held: the gradient equals the single-device full
  batch's, the audit counts each held group's gather, unit's reduce-scatter and its shard's replica all-reduce once."""
  import jax
  import jax.numpy as jnp

  import test_fsdp_step as T
  import test_hsdp_step as H
  params, specs, loss, _ = T.unrolled()
  mesh = H._mesh()
  prof = pj.GradientProfile.from_params(params, forward_s=0.004, backward_s=0.008, mesh=dict(zip(H.AXES, (H.R, H.S))),
                                        shardings=specs)
  s = pj.plan(prof, pj.NetworkModel.preset("nvlink+400gb-ib", workers=8), "fsdp", micro_batches=2)
  assert all(s.fsdp.hold_params + s.fsdp.hold_grads)
  rng = np.random.default_rng(2)
  batch = {x: jnp.asarray(rng.normal(size=(32, T.D)), jnp.float32) for x in ("x", "y")}
  step = jax.jit(pj.hooked(loss, s, axis_name=H.AXES, mesh=mesh))
  p, b = T._place(params, specs, mesh), T._place(batch, {"x": H.BATCH, "y": H.BATCH}, mesh)
  T.assert_trees_close(step(p, b)[1], jax.grad(loss)(params, batch), params)
  report = pj.audit(step.lower(p, b).compile(), s)
  assert report.ok and len(report.gathers) == len(s.fsdp.keep), report.describe()
