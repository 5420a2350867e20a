"""Gradient accumulation: `scheduled(tx, schedule, axis_name=..., every_k=k)` (issue 27).

Under `pmap`, `shard_map` and the plain `jax.jit` path (`mesh=`, gradients obtained unreduced), k
micro-steps of `scheduled(sgd(momentum), ..., every_k=k)` on a multi-chunk plan equal the
single-device step on the concatenation of the k micro-batches (docs/design.md's tolerance), and the
n - 1 divisor (through the engine's seam) fails every mapping; the compiled program's all-reduces are
the schedule's chunks, each once, all inside the true branch of one `conditional` (taken once per k
micro-steps), none outside it; a deferring schedule accumulates as the per-device mean it reduces;
bad input is refused naming the fix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _placement import replicate
import prophet_jax as pj
from prophet_jax._rewrite._collectives import engine_hooks
from prophet_jax._compiled._hlo import parse_hlo
from tests import _user_setups as U
from tests._assert import assert_trees_close

K = 3
UPDATES = 2
AX = "data"
MAPPINGS = ("pmap", "shard_map", "jit")


def _setup():
  return U.setups()["int-labels"]


@functools.cache
def _schedule():
  s = _setup()
  prof = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  sched = pj.plan(prof, U.NETWORK, "priority", partition_bytes=256)
  assert len(sched.chunks) >= 6
  return sched


def _micro():
  s = _setup()
  return [s.batches[i % len(s.batches)] for i in range(UPDATES * K)]


def _loss(p, b):
  return _setup().loss_fn(p, b)[0]


def _bias(b, h):
  return h + jax.lax.broadcast_in_dim(b, h.shape, (h.ndim - 1,), out_sharding=jax.typeof(h).sharding)


def _unreduced_loss(p, batch):
  """The setup's MLP with the bias adds broadcast first (jax refuses `h + b` for a `reduced` b)."""
  h = jnp.tanh(_bias(p["l0"]["b"], batch["x"] @ p["l0"]["w"]))
  h = jnp.tanh(_bias(p["l1"]["b"], h @ p["l1"]["w"]))
  return U._xent(_bias(p["l2"]["b"], h @ p["l2"]["w"]), batch["y"])


@functools.cache
def _reference(jit_loss: bool = False):
  """The single-device step on each concatenation of K micro-batches (sgd with momentum)."""
  s, loss = _setup(), (_unreduced_loss if jit_loss else _loss)
  tx = optax.sgd(0.2, momentum=0.9)
  p, o = s.params, tx.init(s.params)
  mb = _micro()
  for t in range(UPDATES):
    big = jax.tree.map(lambda *xs: jnp.concatenate(xs), *mb[t * K:(t + 1) * K])
    u, o = tx.update(jax.grad(loss)(p, big), o, p)
    p = optax.apply_updates(p, u)
  return p


@functools.cache
def _mesh():
  return jax.make_mesh((U.N_DEV,), (AX,))


def _put(tree, spec):
  return jax.device_put(tree, NamedSharding(_mesh(), spec))


@functools.cache
def _step(mapping, schedule=None, jit_scale=None):
  """(compiled step(params, opt_state, batch, scale), params, opt_state, put, to_host): k = K, sgd with
  momentum; `scale` a runtime scalar the engine's seam folds into every divisor (1: the library's own
  mean; n / (n - 1): the 14% gradient-scale bug). On the jit path (sums) the scale multiplies every
  sum and is compiled in (`jit_scale`; a traced one cannot be closed over by the mesh's shard_map)."""
  s = _setup()
  schedule = schedule or _schedule()
  n = U.N_DEV
  if mapping == "jit":
    with jax.set_mesh(_mesh()):
      tx = pj.scheduled(optax.sgd(0.2, momentum=0.9), schedule, axis_name=AX, mesh=_mesh(), every_k=K)
      reduced = lambda p: jax.tree.map(  # noqa: E731
          lambda w: jax.sharding.reshard(w, P(*[None] * w.ndim, reduced={AX})), p)

      def step(p, o, b, scale):
        with engine_hooks(sum_divisor=None if jit_scale is None else 1 / jit_scale):
          u, o = tx.update(jax.grad(_unreduced_loss)(reduced(p), b), o, p)
        return optax.apply_updates(p, u), o

      p0 = _put(s.params, P())
      o0 = tx.init(p0)
      one = _put(jnp.float32(1), P())
      compiled = jax.jit(step).lower(p0, o0, _put(_micro()[0], P(AX)), one).compile()
    return compiled, p0, o0, lambda b: _put(b, P(AX)), jax.device_get
  tx = pj.scheduled(optax.sgd(0.2, momentum=0.9), schedule, axis_name=AX, every_k=K)

  def step(p, o, b, scale):
    with engine_hooks(divisor=lambda d: d / scale):
      pv = jax.lax.pcast(p, AX, to="varying") if mapping == "shard_map" else p
      u, o = tx.update(jax.grad(_loss)(pv, b), o, p)
    return optax.apply_updates(p, u), o

  one = jnp.float32(1)
  if mapping == "pmap":
    rep = replicate
    p0, o0 = rep(s.params), rep(tx.init(s.params))
    put = lambda b: jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), b)  # noqa: E731
    f = jax.pmap(step, axis_name=AX, in_axes=(0, 0, 0, None))
    compiled = f.lower(p0, o0, put(_micro()[0]), one).compile()
    return compiled, p0, o0, put, lambda t: jax.tree.map(lambda x: np.asarray(x)[0], t)
  specs = pj.state_specs(jax.eval_shape(tx.init, s.params), AX)
  o0 = jax.jit(jax.shard_map(tx.init, mesh=_mesh(), in_specs=P(), out_specs=specs))(s.params)
  f = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=(P(), specs, P(AX), P()), out_specs=(P(), specs)))
  p0, one = _put(s.params, P()), _put(one, P())
  compiled = f.lower(p0, o0, _put(_micro()[0], P(AX)), one).compile()
  return compiled, p0, o0, lambda b: _put(b, P(AX)), jax.device_get


def _run(mapping, scale=1.0, schedule=None):
  compiled, p, o, put, host = _step(mapping, schedule, scale if mapping == "jit" and scale != 1.0 else None)
  states = []
  for b in _micro():
    p, o = compiled(p, o, put(b), jnp.float32(scale))
    states.append(o)
  return host(p), states


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_k_micro_steps_equal_the_full_batch_step_and_n_minus_1_fails(mapping):
  s = _setup()
  ref = _reference(jit_loss=mapping == "jit")
  got, states = _run(mapping)
  assert_trees_close(got, ref, s.params)
  # the count runs 1, 2, 0, 1, 2, 0: the update on every K-th micro-step only
  counts = [int(np.asarray(st.accum.count).reshape(-1)[0]) for st in states]
  assert counts == [1, 2, 0] * UPDATES
  wrong, _ = _run(mapping, scale=U.N_DEV / (U.N_DEV - 1))
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
    assert_trees_close(wrong, ref, s.params)


def _allreduce_places(text):
  """{computation: (all-reduces in it, [(caller, caller's opcode, branch index)])} for every
  computation of the compiled module holding an all-reduce."""
  m = parse_hlo(text)
  callers = {}
  for comp, inss in m.computations.items():
    for ins in inss:
      branches = [c for k, c in ins.callees if k == "branch"]
      for k, c in ins.callees:
        callers.setdefault(c, []).append((comp, ins.opcode, branches.index(c) if c in branches else None))
  out = {}
  for comp, inss in m.computations.items():
    ars = [i for i in inss if i.opcode in ("all-reduce", "all-reduce-start")]
    if ars:
      out[comp] = (ars, callers.get(comp, []))
  return m, out


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_the_compiled_allreduces_are_the_chunks_under_one_cond(mapping):
  compiled = _step(mapping)[0]
  text = compiled.as_text()
  m, places = _allreduce_places(text)
  assert len(places) == 1, places
  (comp, (ars, callers)), = places.items()
  # one computation holds every all-reduce: the branch taken when the count reaches K (index 1 of the
  # conditional of the boolean predicate), called from the entry computation only
  assert comp != m.entry and callers == [(m.entry, "conditional", 1)], callers
  chunk_ars = [a for a in ars if "prophet/chunk" in a.op_name]
  assert len(chunk_ars) == len(ars) == len(_schedule().chunks)
  report = pj.audit(compiled, _schedule())
  assert report.ok and report.order == tuple(range(len(_schedule().chunks))), report.describe()


@functools.cache
def _deferring():
  s = _setup()
  prof = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  slow = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-6, workers=U.N_DEV)
  sched = pj.plan(prof, slow, "dlcp", max_defer=0.25, all_layers=True)
  assert sched.defers, sched.describe()
  return sched


def test_a_deferring_schedule_accumulates_the_mean_it_reduces():
  """dlcp with every_k=K under shard_map: the same params and deferral choices as the k=1 scheduled
  step given, on each device, the mean gradient of its K micro-batches (one step per K micro-steps)."""
  s = _setup()
  sched = _deferring()
  got, states = _run("shard_map", schedule=sched)
  tx = pj.scheduled(optax.sgd(0.2, momentum=0.9), sched, axis_name=AX)
  specs = pj.state_specs(jax.eval_shape(tx.init, s.params), AX)

  def step(p, o, *bs):
    pv = jax.lax.pcast(p, AX, to="varying")
    g = jax.tree.map(lambda *x: sum(x) / K, *[jax.grad(_loss)(pv, b) for b in bs])
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  f = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=(P(), specs) + (P(AX),) * K, out_specs=(P(), specs)))
  o = jax.jit(jax.shard_map(tx.init, mesh=_mesh(), in_specs=P(), out_specs=specs))(s.params)
  p = _put(s.params, P())
  mb = _micro()
  for t in range(UPDATES):
    p, o = f(p, o, *[_put(b, P(AX)) for b in mb[t * K:(t + 1) * K]])
  assert_trees_close(got, jax.device_get(p), s.params)
  for a, b in zip(states[-1].defer_state.deferred, o.defer_state.deferred):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # on the micro-steps between, the deferral state stays as it was
  for a, b in zip(states[0].defer_state.norms, states[1].defer_state.norms):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_every_k_a_replicated_accumulator_and_another_schedules_state():
  s = _setup()
  with pytest.raises(ValueError, match=r"scheduled\(every_k=0\): `every_k` must be an integer >= 1"):
    pj.scheduled(optax.sgd(0.1), _schedule(), axis_name=AX, every_k=0)
  with pytest.raises(TypeError, match=r"scheduled\(every_k=2.0\)"):
    pj.scheduled(optax.sgd(0.1), _schedule(), axis_name=AX, every_k=2.0)
  # a sharded schedule (dear: reduce-scatters and all-gathers) has no accumulation of its own
  prof = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  dear = pj.plan(prof, U.NETWORK, "dear")
  assert dear.sharded
  with pytest.raises(ValueError, match=r"every_k=3 with a sharded schedule .*optax\.MultiSteps\(tx, 3\)"):
    pj.scheduled(optax.sgd(0.1), dear, axis_name=AX, every_k=K)
  tx = pj.scheduled(optax.sgd(0.1), _schedule(), axis_name=AX, every_k=K)

  def step(p, o, b):
    return tx.update(jax.grad(_loss)(jax.lax.pcast(p, AX, to="varying"), b), o, p)

  # the accumulator passed replicated (P()) under shard_map: each device's sums would be lost
  f = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=(P(), P(), P(AX)), out_specs=(P(), P())))
  with pytest.raises(ValueError, match=r"accumulator's sum for 'l0/b' .* replicated over axis 'data'.*"
                                       r"state_specs"):
    f.trace(_put(s.params, P()), _put(tx.init(s.params), P()), _put(_micro()[0], P(AX)))
  # a state of another schedule (other rows), or none
  other = pj.scheduled(optax.sgd(0.1), _deferring(), axis_name=AX, every_k=K)
  assert pj.scheduled(optax.sgd(0.1), _schedule(), axis_name=AX).init(s.params).accum is None
  bad = tx.init(s.params)._replace(accum=other.init(s.params).accum._replace(grads=()))
  g = jax.pmap(lambda p, o, b: tx.update(jax.grad(_loss)(p, b), o, p), axis_name=AX)
  rep = replicate
  batch = jax.tree.map(lambda x: x.reshape(U.N_DEV, -1, *x.shape[1:]), _micro()[0])
  with pytest.raises(pj.ScheduleMismatchError, match=r"accumulator holds 0 sums, but the schedule has 6 rows"):
    g(rep(s.params), rep(bad), batch)


def test_the_readme_snippet_runs_and_equals_the_full_batch_step():
  import re
  from pathlib import Path

  text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
  start = text.index("## Gradient accumulation: `every_k`")
  code = re.compile(r"```python\n(.*?)```", re.S).search(text, start).group(1)
  s = _setup()
  mesh = jax.make_mesh((U.N_DEV,), ("dp",))
  ns = {"jax": jax, "optax": optax, "pj": pj, "P": P, "schedule": _schedule(), "params": s.params,
        "loss_fn": _loss, "mesh": mesh}
  exec(compile(code, "docs/usage.md", "exec"), ns)  # noqa: S102
  k = 4
  mb = [s.batches[i % len(s.batches)] for i in range(k)]
  p, o = jax.device_put(s.params, NamedSharding(mesh, P())), ns["opt_state"]
  for b in mb:
    p, o = ns["step"](p, o, jax.device_put(b, NamedSharding(mesh, P("dp"))))
  tx = optax.sgd(0.05, momentum=0.9)
  big = jax.tree.map(lambda *xs: jnp.concatenate(xs), *mb)
  ref = optax.apply_updates(s.params, tx.update(jax.grad(_loss)(s.params, big), tx.init(s.params), s.params)[0])
  assert_trees_close(jax.device_get(p), ref, s.params)
