"""No deferred byte lost across a re-plan (issues 29, 36): the residual of a deferring plan's state is
converted outside the step (`convert_state`) and added by the next plan's first step (allreduce,
scheduled, hooked, pipelined, the mesh path), or taken out with `deferred_grads`; a step given another
plan's state, and what cannot be converted, raise saying how.

Integer-valued gradients make every sum exact, so conservation is checked bit for bit: the sum of the
applied (all-reduced) gradients times the axis size, plus the last state's residuals summed over the
devices, equals the sum of every device's true gradients, element for element, across the re-plan.
The control: starting the new plan from its own init (what dropped the residual before) fails it.
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

import prophet_jax as pj
from prophet_jax._rewrite import _defer, _states

AX = "data"
NDEV = 8
TREE = {"a": jnp.zeros((6, 10)), "b": jnp.zeros(37), "c": jnp.zeros(5), "d": jnp.zeros(9)}
ROWS = pj.GradientProfile.from_params(TREE).tree_rows()
KEY = {p.split("/")[-1].strip("[]'"): i for i, (p, _, _) in enumerate(ROWS)}


def _ch(*s):
  return pj.Chunk(slices=s, dtype="float32")


def _deferring(defer=(2, 1)):
  """c lossless, a+b as 6 chunks deferring defer[0], d as 3 chunks deferring defer[1]."""
  a, b, c, d = KEY["a"], KEY["b"], KEY["c"], KEY["d"]
  g1 = (_ch((a, 0, 16)), _ch((a, 16, 32)), _ch((a, 32, 48)), _ch((a, 48, 60), (b, 0, 4)), _ch((b, 4, 20)),
        _ch((b, 20, 37)))
  g2 = (_ch((d, 0, 3)), _ch((d, 3, 6)), _ch((d, 6, 9)))
  return pj.Schedule(buckets=(pj.Bucket(chunks=(_ch((c, 0, 5)),)), pj.Bucket(chunks=g1, defer=defer[0]),
                              pj.Bucket(chunks=g2, defer=defer[1])), rows=ROWS)


def _lossless():
  return pj.Schedule(buckets=tuple(pj.Bucket(chunks=(_ch((i, 0, int(np.prod(s)))),))
                                   for i, (_, s, _) in enumerate(ROWS)), rows=ROWS)


A, B_LOSSLESS, B_DEFER = _deferring(), _lossless(), _deferring((1, 1))


def _grads(seed, steps):
  rng = np.random.default_rng(seed)
  return [{k: rng.integers(-8, 8, (NDEV, *v.shape)).astype(np.float32) for k, v in TREE.items()}
          for _ in range(steps)]


def _residual_sum(state, schedule_of_state):
  """The last state's residuals summed over the devices, at their elements (host)."""
  if state is None:
    return {k: np.zeros(v.shape) for k, v in TREE.items()}
  per_device = jax.pmap(lambda s: pj.deferred_grads(s, TREE, schedule=schedule_of_state),
                        axis_name=AX)(state)
  return {k: np.asarray(v, np.float64).sum(0) for k, v in per_device.items()}


def _check_conserved(grads, applied, residual):
  for k in TREE:
    true = sum(np.asarray(g[k], np.float64).sum(0) for g in grads)
    sent = sum(NDEV * np.asarray(x[k], np.float64)[0] for x in applied)
    np.testing.assert_array_equal(sent + residual[k], true, err_msg=f"conservation of leaf {k}")


@functools.lru_cache(maxsize=None)
def _allreduce_step(schedule):
  return jax.pmap(lambda g, st: pj.allreduce(g, schedule, AX, defer_state=st), axis_name=AX)


def _init(schedule):
  return jax.pmap(lambda _: _defer.init(schedule), axis_name=AX)(np.arange(NDEV))


@pytest.mark.parametrize("new", ["lossless", "deferring"])
def test_allreduce_takes_the_converted_residual_into_the_new_plan(new):
  b = B_LOSSLESS if new == "lossless" else B_DEFER
  grads = _grads(0, 5)
  st, applied = _init(A), []
  for g in grads[:3]:
    out, st = _allreduce_step(A)(g, st)
    applied.append(out)
  held = _residual_sum(st, A)
  assert any(np.abs(v).sum() > 0 for v in held.values())       # something is deferred at the re-plan
  with pytest.raises(pj.ScheduleMismatchError, match="convert_state"):
    _allreduce_step(b)(grads[3], st)                         # the in-step carry is retired
  st = pj.convert_state(st, TREE, b)
  assert isinstance(st, pj.OwedState)
  for g in grads[3:]:
    r = _allreduce_step(b)(g, st)                            # the first call adds what A owed
    out, st = r if st is not None or b.defers else (r, None)
    applied.append(out)
  assert (st is None) == (new == "lossless")
  if st is not None:
    assert st.tag == _defer.init(b).tag
  _check_conserved(grads, applied, _residual_sum(st, b))
  # the control: the new plan from its own init (what a re-plan did before) loses A's residual
  st2, applied2 = (None if new == "lossless" else _init(b)), applied[:3]
  for g in grads[3:]:
    r = _allreduce_step(b)(g, st2) if st2 is not None else (_allreduce_step(b)(g, None), None)
    out, st2 = r
    applied2.append(out)
  with pytest.raises(AssertionError, match="conservation"):
    _check_conserved(grads, applied2, _residual_sum(st2, b))


def _capture():
  """An optax member whose state is the update it was given (the reduced gradient)."""
  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda u, s, p=None: (u, u))


@functools.lru_cache(maxsize=None)
def _sched_step(schedule):
  tx = pj.scheduled(optax.chain(_capture(), optax.sgd(0.0)), schedule, axis_name=AX)
  return tx, jax.pmap(lambda g, opt: tx.update(g, opt, TREE)[1], axis_name=AX)


def _three_deferring_steps(grads):
  """The dlcp tx of plan A from its initial state over grads[:3]: (its state, the update each step
  applied, from the capture)."""
  tx_a, step_a = _sched_step(A)
  opt = jax.pmap(lambda _: tx_a.init(TREE), axis_name=AX)(np.arange(NDEV))
  applied = []
  for g in grads[:3]:
    opt = step_a(g, opt)
    applied.append(opt.inner[0])
  return opt, applied


def test_scheduled_takes_the_converted_state_across_a_replan():
  """The issue's case: a dlcp tx, then a re-plan to a lossless tx given the converted optimizer state:
  nothing is lost; the state's deferred_grads (taken out of a whole optax state) are what is held."""
  grads = _grads(1, 5)
  opt, applied = _three_deferring_steps(grads)
  held = _residual_sum(opt, A)     # deferred_grads finds the DeferState inside the ScheduledState
  assert sum(np.abs(v).sum() for v in held.values()) > 0
  _, step_b = _sched_step(B_LOSSLESS)
  opt = pj.convert_state(opt, TREE, B_LOSSLESS)
  for g in grads[3:]:
    opt = step_b(g, opt)
    applied.append(opt.inner[0])
  assert opt.defer_state is None
  _check_conserved(grads, applied, _residual_sum(opt, B_LOSSLESS))


def test_scheduled_first_step_under_shard_map_with_first_step_specs():
  """Under shard_map (check_vma) the first step after convert_state takes the converted state's specs
  in and the steady state's out (`first_step_specs`); the new residuals are the devices' own."""
  mesh = jax.make_mesh((NDEV,), (AX,))
  tx_a, _ = _sched_step(A)
  tx_b, _ = _sched_step(B_DEFER)
  spec_a = pj.state_specs(jax.eval_shape(tx_a.init, TREE), AX)
  spec_b = pj.state_specs(jax.eval_shape(tx_b.init, TREE), AX)
  grads = _grads(2, 4)

  def body(tx):
    def f(g, opt):
      return tx.update(jax.tree.map(lambda x: x[0], g), opt, TREE)[1]
    return f

  init = jax.jit(jax.shard_map(tx_a.init, mesh=mesh, in_specs=P(), out_specs=spec_a))
  step_a = jax.jit(jax.shard_map(body(tx_a), mesh=mesh, in_specs=(P(AX), spec_a), out_specs=spec_a))
  carry = None
  step_b = jax.jit(jax.shard_map(body(tx_b), mesh=mesh, in_specs=(P(AX), spec_b), out_specs=spec_b))
  put = lambda g: jax.device_put(g, NamedSharding(mesh, P(AX)))  # noqa: E731
  opt, applied = init(TREE), []
  for g in grads[:2]:
    opt = step_a(put(g), opt)
    applied.append(jax.tree.map(lambda x: np.asarray(x)[None], opt.inner[0]))
  opt = pj.convert_state(opt, TREE, B_DEFER, mesh=mesh, axis_name=AX)
  spec_in, spec_out = pj.first_step_specs(opt, AX)
  assert spec_out == spec_b
  carry = jax.jit(jax.shard_map(body(tx_b), mesh=mesh, in_specs=(P(AX), spec_in), out_specs=spec_out))
  for f, g in zip((carry, step_b), grads[2:]):
    opt = f(put(g), opt)
    applied.append(jax.tree.map(lambda x: np.asarray(x)[None], opt.inner[0]))
  assert opt.defer_state.tag == _defer.init(B_DEFER).tag
  res = {k: np.zeros(v.shape) for k, v in TREE.items()}
  # each device's residual is its own: gather them per device with the mesh's own deferred_grads
  per = jax.jit(jax.shard_map(lambda o: jax.tree.map(lambda x: x[None], pj.deferred_grads(o, TREE)),
                              mesh=mesh, in_specs=(spec_b,), out_specs=P(AX)))(opt)
  for k in TREE:
    res[k] = np.asarray(per[k], np.float64).sum(0)
  _check_conserved(grads, applied, res)


def _linear_loss(p, x):
  """sum(p * x): its gradient is the batch itself (integers: exact)."""
  return sum(jnp.sum(p[k] * x[k]) for k in p)


def test_hooked_takes_the_converted_state_and_keeps_the_loss():
  grads = _grads(3, 4)
  ga, gb = pj.hooked(_linear_loss, A, axis_name=AX), pj.hooked(_linear_loss, B_LOSSLESS, axis_name=AX)
  step_a = jax.pmap(lambda x, st: ga(TREE, x, st)[1:], axis_name=AX)
  carry = jax.pmap(lambda x, st: gb(TREE, x, defer_state=st), axis_name=AX)
  step_b = jax.pmap(lambda x: gb(TREE, x)[1], axis_name=AX)
  st, applied = _init(A), []
  for g in grads[:2]:
    out, st = step_a(g, st)
    applied.append(out)
  loss, out, new = carry(grads[2], pj.convert_state(st, TREE, B_LOSSLESS))
  assert new is None
  np.testing.assert_allclose(np.asarray(loss), 0.0)            # the value is loss_fn's (params are 0)
  applied.append(out)
  applied.append(step_b(grads[3]))
  _check_conserved(grads, applied, _residual_sum(None, B_LOSSLESS))


def test_pipelined_converts_a_flushed_state_into_another_plan():
  """A flushed dlcp pipelined state converted to a lossless plan: the old residual is applied with the
  next backward; after the final flush, the params are the plain loop's exactly. A pending forward is
  refused, saying to flush."""
  def loss(p, x):
    return _linear_loss(p, x)

  batches = _grads(4, 5)
  pa = pj.pipelined(loss, optax.sgd(1.0), A, axis_name=AX)
  pb = pj.pipelined(loss, optax.sgd(1.0), B_LOSSLESS, axis_name=AX)
  sa, fa = jax.pmap(pa.step, axis_name=AX), jax.pmap(pa.flush, axis_name=AX)
  sb, fb = jax.pmap(pb.step, axis_name=AX), jax.pmap(pb.flush, axis_name=AX)
  state = jax.pmap(lambda _: pa.init(TREE), axis_name=AX)(np.arange(NDEV))
  for x in batches[:3]:
    state, _ = sa(state, x)
  with pytest.raises(ValueError, match=r"pending forward.*flush"):
    pj.convert_state(state, TREE, B_LOSSLESS)
  state = fa(state)
  assert sum(np.abs(np.asarray(v)).sum() for v in jax.tree.leaves(
      jax.pmap(pa.deferred_grads, axis_name=AX)(state))) > 0
  state = pj.convert_state(state, TREE, B_LOSSLESS)
  for x in batches[3:]:
    state, _ = sb(state, x)
  state = fb(state)
  assert state.defer is None
  want = {k: -sum(np.asarray(x[k], np.float64).mean(0) for x in batches) for k in TREE}
  for k in TREE:
    np.testing.assert_array_equal(np.asarray(state.params[k])[0], want[k], err_msg=k)


def test_deferred_grads_from_any_state_and_the_mesh_path():
  """deferred_grads: zeros for a lossless state, the DeferState found inside a TrainState-like tuple,
  and on the jit path a hooked(mesh=) grad_fn given a converted deferring state in a lossless plan."""
  zero = pj.deferred_grads(None, TREE)
  assert all(not np.asarray(v).any() for v in jax.tree.leaves(zero))
  mesh = jax.make_mesh((NDEV,), (AX,))
  ga = pj.hooked(_linear_loss, A, axis_name=AX, mesh=mesh)
  gb = pj.hooked(_linear_loss, B_LOSSLESS, axis_name=AX, mesh=mesh)
  grads = _grads(5, 3)
  put = lambda g: jax.device_put(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), g),  # noqa: E731
                                 NamedSharding(mesh, P(AX)))
  params = jax.device_put(TREE, NamedSharding(mesh, P()))
  st, applied = ga.defer_state(), []
  for g in grads[:2]:
    _, out, st = jax.jit(ga)(params, put(g), st)
    applied.append(jax.tree.map(lambda x: np.asarray(x)[None], out))
  _, out, new = jax.jit(gb)(params, put(grads[2]), pj.convert_state(st, TREE, B_LOSSLESS, mesh=mesh,
                                                                     axis_name=AX))
  assert new is None
  applied.append(jax.tree.map(lambda x: np.asarray(x)[None], out))
  # device i's batch is grads[t][i]: the gradients returned are their mean over the devices
  _check_conserved(grads, applied, {k: np.zeros(v.shape) for k, v in TREE.items()})


def test_what_cannot_be_converted_raises_saying_how():
  # a state of a schedule for another tree: its residual's elements are not these gradients'
  other_tree = {"a": jnp.zeros((6, 10)), "b": jnp.zeros(37), "c": jnp.zeros(5), "d": jnp.zeros(9),
                "e": jnp.zeros(3)}
  prof = pj.GradientProfile.from_params(other_tree)
  rows = prof.tree_rows()
  idx = {p.split("/")[-1].strip("[]'"): i for i, (p, _, _) in enumerate(rows)}
  other = pj.Schedule(buckets=(pj.Bucket(chunks=(_ch((idx["c"], 0, 5)), _ch((idx["d"], 0, 9))), defer=1),
                               pj.Bucket(chunks=(_ch((idx["a"], 0, 60)), _ch((idx["b"], 0, 37)),
                                                 _ch((idx["e"], 0, 3))))), rows=rows)
  g = {k: jnp.zeros((NDEV, *v.shape)) for k, v in TREE.items()}
  with pytest.raises(pj.ScheduleMismatchError, match=r"convert_state"):
    _allreduce_step(B_LOSSLESS)(g, _init(other))
  with pytest.raises(pj.ScheduleMismatchError):
    pj.convert_state(_init(other), TREE, B_LOSSLESS)
  # a state that does not record its schedule: the how-to
  st = _defer.init(A)
  bare = st._replace(tag=_states.StateTag(st.tag.key, st.tag.fingerprint, st.tag.layout))
  rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (NDEV, *x.shape)), bare)
  fresh = jax.pmap(lambda g, st: pj.allreduce(g, B_LOSSLESS, AX, defer_state=st), axis_name=AX)
  with pytest.raises(TypeError, match=r"cannot be carried over.*convert_state.*deferred_grads\(state, params\)"):
    fresh(g, rep)
  with pytest.raises(ValueError, match=r"pass it: deferred_grads\(state, params, schedule="):
    pj.deferred_grads(bare, TREE)
  assert all(not np.asarray(v).any() for v in jax.tree.leaves(pj.deferred_grads(bare, TREE, schedule=A)))


def test_scheduled_converts_a_deferring_state_into_a_sharded_plan():
  """A re-plan from dlcp to a sharded (dear, ZeRO-1) schedule: the whole state (here sgd's, with the
  old deferral state) converted; the first sharded update adds the owed values before its
  reduce-scatter. The control (the deferral state dropped) fails conservation."""
  sharded = pj.plan(pj.GradientProfile.from_params(TREE), pj.NetworkModel.preset("10gbe", workers=NDEV),
                    "dear")
  assert sharded.sharded
  tx_s = pj.scheduled(optax.sgd(1.0), sharded, axis_name=AX)
  step_s = jax.pmap(lambda g, opt: tx_s.update(g, opt, TREE), axis_name=AX)
  init_s = jax.pmap(lambda _: tx_s.init(TREE), axis_name=AX)
  grads = _grads(5, 5)
  opt, applied = _three_deferring_steps(grads)
  assert sum(np.abs(v).sum() for v in _residual_sum(opt, A).values()) > 0

  def run(first):
    out, st = list(applied), first
    for g in grads[3:]:
      upd, st = step_s(g, st)
      out.append(jax.tree.map(lambda u: -u, upd))      # sgd(1.0): the update is minus the mean gradient
    assert st.defer_state is None
    return out

  fresh = init_s(np.arange(NDEV))
  whole = _states.ScheduledState(inner=jax.pmap(lambda _: optax.sgd(1.0).init(TREE))(np.arange(NDEV)),
                                 defer_state=opt.defer_state)
  conv = pj.convert_state(whole, TREE, sharded, tx=optax.sgd(1.0), num_devices=NDEV)
  assert isinstance(conv.defer_state, pj.OwedState) and isinstance(conv.inner, pj.ShardedState)
  _check_conserved(grads, run(conv), _residual_sum(None, sharded))
  with pytest.raises(AssertionError, match="conservation"):
    _check_conserved(grads, run(fresh), _residual_sum(None, sharded))
