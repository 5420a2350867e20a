"""`pipelined` with a deferring schedule (dlcp, max_defer > 0): the deferral state rides in the state.

The oracle is the plain loop with the same deferral: one jitted step per batch, `jax.grad`, then
`prophet_jax.allreduce(grads, schedule, axis, defer_state=...)` and `tx` (SGD with momentum), under
`pmap`. After N pipelined calls and a flush, the parameters equal N such steps (docs/design.md's
tolerance, tests/_assert.py) and the deferral state is the loop's (the same chunks deferred, the same
residuals). A tiny MLP, 8 CPU devices (conftest.py); compiled steps are cached.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from _assert import assert_trees_close
from _placement import AXIS, NDEV, mesh, put, replicate, shard, unrep
import prophet_jax as pj
from prophet_jax import DeferState, ScheduleMismatchError
from prophet_jax._rewrite import _collectives, _states
from prophet_jax._rewrite._pipelined import pipelined
from prophet_jax.models import get_model

STEPS = 5
LR, MOMENTUM = 0.05, 0.9
# a communication-bound network: dlcp splits layers into groups of 3 chunks, 1 deferred per step
NET = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-8, workers=NDEV)


def tx():
  return optax.sgd(LR, momentum=MOMENTUM)


@functools.cache
def setup():
  model = get_model("mlp")
  params = model.init(jax.random.key(0))
  bs = [model.make_batch(jax.random.key(100 + k), 32) for k in range(STEPS)]
  return model, params, bs


@functools.cache
def schedule(max_defer: float, spread: int = 3) -> pj.Schedule:
  _, params, _ = setup()
  prof = pj.GradientProfile.from_params(params, forward_s=1e-4, backward_s=2e-4)
  return pj.plan(prof, NET, "dlcp", cross_step=True, max_defer=max_defer, spread=spread)


def _scaled(fn):
  """fn(*args) -> fn(*args, scale), traced with every chunked reduction dividing by n / scale."""

  def scaled(*args):
    *args, scale = args
    with _collectives.engine_hooks(divisor=lambda n: n / scale):  # the one engine's test seam
      return fn(*args)

  return scaled


def _plain_step(model, s, p, o, st, b, owed=None):
  """One step of the plain loop the pipelined step must equal (inside pmap): grad, plus `owed(st)` (an
  old plan's residual) when given, `allreduce` with schedule `s` (and its deferral state), tx."""
  g = jax.grad(model.loss_fn)(p, b)
  if owed is not None:
    g = jax.tree.map(jnp.add, g, owed(st))
  if s.defers:
    g, st = pj.allreduce(g, s, AXIS, defer_state=st)
  else:
    g = pj.allreduce(g, s, AXIS)
  u, o = tx().update(g, o, p)
  return optax.apply_updates(p, u), o, st


@functools.cache
def loop_ref(max_defer: float):
  """STEPS plain steps (grad, allreduce with the deferral state, tx) under pmap: (params, DeferState
  of device 0 with its residuals per device, and the plain pmean loop's params)."""
  model, params, bs = setup()
  s = schedule(max_defer)

  step = functools.partial(_plain_step, model, s)

  def plain(p, o, b):
    g = jax.lax.pmean(jax.grad(model.loss_fn)(p, b), AXIS)
    u, o = tx().update(g, o, p)
    return optax.apply_updates(p, u), o

  f, fp = jax.pmap(step, axis_name=AXIS), jax.pmap(plain, axis_name=AXIS)
  p, o, st = replicate(params), replicate(tx().init(params)), replicate(pj.defer_state(s))
  q, oq = p, o
  for b in bs:
    p, o, st = f(p, o, st, shard(b))
    q, oq = fp(q, oq, shard(b))
  return unrep(p), st, unrep(q)


class Runner:
  """A Pipelined under pmap or shard_map, as a user runs it (jit caches the compiled programs). Its
  step and flush take a runtime `scale`: every chunked reduction divides by n / scale (the one engine's
  test seam), 1 by default (the library's own division, exactly); the negative control passes
  n / (n - 1) to the same compiled programs."""

  def __init__(self, pipe, mapping):
    self.pipe, self.mapping, self.compiled = pipe, mapping, None
    if mapping == "pmap":
      step = jax.pmap(_scaled(pipe.step), axis_name=AXIS, in_axes=(0, 0, None))
      flush = jax.pmap(_scaled(pipe.flush), axis_name=AXIS, in_axes=(0, None))
    else:
      specs = pipe.state_specs()

      def body(st, b):
        st, loss = pipe.step(st, b)
        return st, loss[None]

      step = jax.jit(jax.shard_map(_scaled(body), mesh=mesh(), in_specs=(specs, P(AXIS), P()),
                                   out_specs=(specs, P(AXIS))))
      flush = jax.jit(jax.shard_map(_scaled(pipe.flush), mesh=mesh(), in_specs=(specs, P()),
                                    out_specs=specs))
    self._step = step
    self.step = lambda st, b, scale=1.0: step(st, b, jnp.float32(scale))
    self.flush = lambda st, scale=1.0: flush(st, jnp.float32(scale))

  def init(self, params):
    if self.mapping == "pmap":
      return replicate(self.pipe.init(params))
    # the residuals are per device: one copy per device on their leading axis, as state_specs says
    st = self.pipe.init(params)
    if st.defer is not None:
      st = st._replace(defer=st.defer._replace(
          residual=tuple(np.repeat(np.asarray(r), NDEV, axis=0) for r in st.defer.residual)))
    return jax.tree.map(lambda x, s: put(x, s), st, self.pipe.state_specs(st))

  def batch(self, b):
    return shard(b) if self.mapping == "pmap" else put(b, P(AXIS))

  def run(self, params, bs, state=None, scale=1.0):
    """Steps and a flush; under shard_map the full step is compiled once and kept (`self.compiled`)."""
    state = self.init(params) if state is None else state
    for b in bs:
      b = self.batch(b)
      if state.pending is not None and self.mapping == "shard_map":
        self.compiled = self.compiled or self._step.lower(state, b, jnp.float32(1)).compile()
        state, _ = self.compiled(state, b, jnp.float32(scale))
      else:
        state, _ = self.step(state, b, scale)
    return self.flush(state, scale)

  def params(self, state):
    return unrep(state.params) if self.mapping == "pmap" else state.params

  def residuals(self, state):
    """Each DeferState residual as (NDEV, k, c) (device axis first, in both mappings)."""
    return [np.asarray(r).reshape(NDEV, *r.shape[-2:]) for r in state.defer.residual]

  def index(self, state):
    """The chunks each group deferred last step (its `deferred` mask)."""
    return [np.asarray(i)[0] if self.mapping == "pmap" else np.asarray(i) for i in state.defer.deferred]


@functools.cache
def runner(mapping: str, max_defer: float) -> Runner:
  model, _, _ = setup()
  return Runner(pipelined(model.loss_fn, tx(), schedule(max_defer), axis_name=AXIS), mapping)


# --------------------------------------------------------------------------------------------------
# equivalence


def test_the_schedule_has_several_groups_and_chunks():
  s = schedule(0.25)
  groups = [b for b in s.buckets if b.defer]
  assert s.defers and len(groups) >= 3 and all(len(b.chunks) >= 3 for b in groups)
  assert len(s.chunks) > s.num_allreduces >= 8 and any(not b.defer for b in s.buckets)
  s0 = schedule(0.0)
  assert not s0.defers and len(s0.chunks) >= 4


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_equals_the_plain_loop_with_the_same_deferral(mapping):
  """N pipelined calls + flush = N plain steps with `allreduce(..., defer_state=)`: the parameters,
  and the deferral state (the chunks deferred at the last step, each device's residual)."""
  _, params, bs = setup()
  ref, ref_st, plain = loop_ref(0.25)
  r = runner(mapping, 0.25)
  state = r.run(params, bs)
  assert state.pending is None and isinstance(state.defer, DeferState)
  assert_trees_close(r.params(state), ref, params)
  for got, want in zip(r.index(state), ref_st.deferred):
    np.testing.assert_array_equal(got, np.asarray(want)[0])
  for got, want in zip(r.residuals(state), ref_st.residual):
    want = np.asarray(want)[:, 0]
    assert np.abs(want).max() > 0  # the residuals are each device's own, and not empty
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
  if mapping == "shard_map":  # the compiled step: one all-reduce per slot, prophet/chunk<k> in order
    s = schedule(0.25)
    hlo = r.compiled.as_text()
    found = [int(m) for m in re.findall(r"all-reduce(?:-start)?\(.*?prophet/chunk(\d+)", hlo)]
    assert found == list(range(s.num_allreduces)), found
  # the deferral changes the result: the oracle is not the plain pmean loop
  with pytest.raises(AssertionError, match="max\\|got-ref\\|"):
    assert_trees_close(r.params(state), plain, params)


def test_deferred_grads_put_the_residual_back_and_conserve():
  """`deferred_grads` of the flushed state: this device's residual at its elements, zero elsewhere;
  every applied gradient plus its mean over the devices is the sum of the true mean gradients."""
  model, params, bs = setup()
  s = schedule(0.25)
  pipe = runner("pmap", 0.25).pipe

  def step(p, st, b):  # plain SGD at lr 1: the parameter change is minus the applied gradient
    g = jax.grad(model.loss_fn)(p, b)
    red, st = pj.allreduce(g, s, AXIS, defer_state=st)
    return p, st, red, jax.lax.pmean(g, AXIS)

  f = jax.pmap(step, axis_name=AXIS)
  st = replicate(pj.defer_state(s))
  p = replicate(params)
  applied = true = jax.tree.map(np.zeros_like, params)
  for b in bs:
    p, st, red, g = f(p, st, shard(b))
    applied = jax.tree.map(lambda a, x: a + np.asarray(x)[0], applied, red)
    true = jax.tree.map(lambda a, x: a + np.asarray(x)[0], true, g)
  state = pipe.init(params)._replace(defer=jax.tree.map(lambda x: np.asarray(x)[0], st))  # device 0's
  mine = pipe.deferred_grads(state)
  # its nonzero elements are exactly the deferred chunks' (device 0's residual, summed)
  n_res = sum(int(np.count_nonzero(np.asarray(r))) for r in state.defer.residual)
  assert sum(int(np.count_nonzero(x)) for x in jax.tree.leaves(mine)) == n_res > 0
  every = jax.pmap(lambda st: jax.lax.pmean(pipe.deferred_grads(
      pipe.init(params)._replace(defer=st)), AXIS), axis_name=AXIS)(st)
  total = jax.tree.map(lambda a, d: a + np.asarray(d)[0], applied, every)
  for x, y in zip(jax.tree.leaves(total), jax.tree.leaves(true)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max())


def test_max_defer_zero_is_the_plain_pmean_loop():
  """dlcp with max_defer=0 (a multi-chunk lossless plan): no deferral state, equal to plain pmean."""
  _, params, bs = setup()
  r = runner("shard_map", 0.0)
  state = r.run(params, bs)
  assert state.defer is None
  assert_trees_close(r.params(state), loop_ref(0.0)[2], params)


@pytest.mark.parametrize("max_defer", [0.25, 0.0])
def test_a_mean_over_n_minus_1_fails(max_defer):
  """The negative control: the same pipelined step with every chunk divided by n - 1 (a 14% scale)
  fails the comparison used above."""
  _, params, bs = setup()
  ref = loop_ref(max_defer)[0]  # traced without the hook
  r = runner("shard_map", max_defer)  # the compiled programs the equivalence tests ran
  assert_trees_close(r.params(r.run(params, bs)), ref, params)
  state = r.run(params, bs, scale=NDEV / (NDEV - 1))
  with pytest.raises(AssertionError, match="max\\|got-ref\\|"):
    assert_trees_close(r.params(state), ref, params)


# --------------------------------------------------------------------------------------------------
# the state and bad input (traced only)


def test_state_specs_give_the_residuals_the_axis():
  pipe = runner("shard_map", 0.25).pipe
  _, params, _ = setup()
  specs = pipe.state_specs()
  assert isinstance(specs.defer, DeferState) and specs.defer.residual == P(AXIS)
  assert specs.defer.norms == specs.defer.index == specs.defer.deferred == P()
  full = pipe.state_specs(pipe.init(params))
  assert full.defer.residual == tuple(P(AXIS) for _ in full.defer.residual)
  assert full.defer.norms == tuple(P() for _ in full.defer.norms)
  assert runner("shard_map", 0.0).pipe.state_specs().defer == P()


def test_a_state_of_another_schedule_is_named_with_convert_state():
  """A state of one dlcp plan stepped by another plan's pipelined step (its deferral state, or its
  pending forward): ScheduleMismatchError naming convert_state (the in-step carry is retired); a state
  that does not record its schedule: ScheduleMismatchError naming how to keep its residual."""
  model, params, bs = setup()
  s1, s2 = schedule(0.25), schedule(0.25, spread=2)
  assert _states.schedule_key(s1) != _states.schedule_key(s2)
  p1 = pipelined(model.loss_fn, tx(), s1, axis_name=AXIS)
  p2 = pipelined(model.loss_fn, tx(), s2, axis_name=AXIS)
  batch = shard(bs[0])
  step1, step2 = jax.pmap(p1.step, axis_name=AXIS), jax.pmap(p2.step, axis_name=AXIS)
  st = replicate(p1.init(params))
  key1 = _states.schedule_key(s1)
  with pytest.raises(ScheduleMismatchError, match="convert_state"):
    jax.eval_shape(step2, st, batch)
  pending, _ = jax.eval_shape(step1, st, batch)
  with pytest.raises(ScheduleMismatchError, match=r"pending forward ran under another plan.*Flush.*convert_state"):
    jax.eval_shape(step2, pending._replace(defer=replicate(p2.init(params)).defer), batch)
  with pytest.raises(ScheduleMismatchError, match="convert_state"):
    jax.eval_shape(step1, pending._replace(defer=replicate(p2.init(params)).defer), batch)
  bare = st.defer._replace(tag=_states.StateTag(st.defer.tag.key, st.defer.tag.fingerprint,
                                               st.defer.tag.layout))
  with pytest.raises(ScheduleMismatchError, match=f"pipelined.step: the deferral state belongs to "
                                                  f"another schedule .*{key1}.*deferred_grads"):
    jax.eval_shape(jax.pmap(lambda s, b: p2.step(s, b), axis_name=AXIS), st._replace(defer=bare), batch)
  with pytest.raises(TypeError, match="state.defer must be None or a prophet_jax.DeferState"):
    p1.flush(pending._replace(defer=(1, 2)))


def test_a_replan_to_a_lossless_plan_loses_nothing_through_convert_state():
  """Two calls under a dlcp plan, flush, convert_state to a lossless plan (other chunks, no deferral),
  two calls, flush. The new plan's first backward adds what the old one deferred to its gradients:
  equal to the plain loop doing the same; the control (the owed values dropped) is not."""
  model, params, bs = setup()
  s1, s2 = schedule(0.25), schedule(0.0)
  r1 = runner("pmap", 0.25)
  r2 = runner("pmap", 0.0)
  state = r1.init(params)
  for b in bs[:2]:
    state, _ = r1.step(state, r1.batch(b))
  state = pj.convert_state(r1.flush(state), params, s2)
  assert isinstance(state.defer, pj.OwedState)
  control = state._replace(defer=None)
  for b in bs[2:4]:
    state, _ = r2.step(state, r2.batch(b))
    control, _ = r2.step(control, r2.batch(b))
  state, control = r2.flush(state), r2.flush(control)
  assert state.defer is None

  def owed(st):  # the old plan's residual joins the new plan's first gradients
    return r1.pipe.deferred_grads(r1.pipe.init(params)._replace(defer=st))

  fs = [jax.pmap(functools.partial(_plain_step, model, s, owed=o), axis_name=AXIS)
        for s, o in ((s1, None), (s2, owed), (s2, None))]
  p, o, st = replicate(params), replicate(tx().init(params)), replicate(pj.defer_state(s1))
  for t, b in enumerate(bs[:4]):    # s1, s1 (the flush), then s2's first step adds what s1 owed
    p, o, st = fs[(0, 0, 1, 2)[t]](p, o, st, shard(b))
  assert_trees_close(r2.params(state), unrep(p), params)
  with pytest.raises(AssertionError):
    assert_trees_close(r2.params(control), unrep(p), params)
