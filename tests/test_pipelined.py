"""The cross-step pipelined step (`prophet_jax.pipelined`): equal to the plain loop, ordered chunks, errors.

Every equivalence test runs N pipelined steps and a flush and compares the parameters with N plain steps
(single-device full batch, and the plain `pmean` step under the same mapping) within DESIGN.md's
tolerance (tests/_assert.py). 8 CPU devices (conftest.py).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _assert import assert_trees_close
from prophet_jax import Bucket, Chunk, GradientProfile, Schedule, ScheduleMismatchError, audit
from prophet_jax._pipelined import Pending, PipelinedState, pipelined
from prophet_jax._tree import path_str
from prophet_jax.models import get_model

AXIS = "data"
N_DEV = 8
STEPS = 3


# --------------------------------------------------------------------------------------------------
# helpers


def make_schedule(params, *, split: int = 2, per_layer: bool = True) -> Schedule:
  """A hand-made schedule: chunks in ready order (last layer first), one per layer (or per leaf), and
  the largest leaf split into `split` chunks, so merged, split and ordered chunks are all exercised."""
  prof = GradientProfile.from_params(params)
  order = prof.ready_order()
  big = max(range(len(prof.rows)), key=lambda i: prof.rows[i].size)
  groups: dict[str, list[int]] = {}
  for i in order:
    key = prof.rows[i].layer if per_layer else prof.rows[i].path
    groups.setdefault(key, []).append(i)
  chunks = []
  for rows in groups.values():
    rest = [(i, 0, prof.rows[i].size) for i in rows if i != big and prof.rows[i].size > 0]
    if big in rows:
      n = prof.rows[big].size
      cuts = np.linspace(0, n, split + 1).astype(int)
      chunks += [Chunk(slices=((big, int(a), int(b)),), dtype=prof.rows[big].dtype)
                 for a, b in zip(cuts[:-1], cuts[1:])]
    if rest:
      chunks.append(Chunk(slices=tuple(rest), dtype=prof.rows[rest[0][0]].dtype))
  return Schedule(buckets=(Bucket(chunks=tuple(chunks)),), rows=prof.tree_rows(), policy="test")


def batches(model, n, batch_size):
  return [model.make_batch(jax.random.key(100 + k), batch_size) for k in range(n)]


@functools.cache
def mesh():
  return jax.make_mesh((N_DEV,), (AXIS,))


@functools.cache
def pmap_sharding():
  # pmap's own output sharding: inputs already laid out this way do not make pmap compile again
  return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:N_DEV]), (AXIS,)), P(AXIS))


def shard(x):
  """Global batch (B, ...) -> (N_DEV, B / N_DEV, ...), laid out for pmap."""
  x = jax.tree.map(lambda a: np.asarray(a).reshape(N_DEV, a.shape[0] // N_DEV, *a.shape[1:]), x)
  return jax.device_put(x, pmap_sharding())


def replicate(tree):
  # on the host (numpy): an eager jnp op per leaf shape would compile a small program each
  return jax.device_put(jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (N_DEV, *np.shape(a))), tree),
                        pmap_sharding())


def unrep(tree):
  return jax.tree.map(lambda a: np.asarray(a)[0], tree)


def put(tree, spec):
  return jax.device_put(tree, NamedSharding(mesh(), spec))


def single_device_ref(model, tx, params, bs):
  """N plain steps on one device with the full batch; returns (params, losses)."""

  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(model.loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  o = tx.init(params)
  losses = []
  for b in bs:
    params, o, loss = step(params, o, b)
    losses.append(float(loss))
  return params, losses


def pmean_ref(mapping, model, tx, params, bs):
  """N plain data-parallel steps (grad, pmean, tx) under `mapping`."""

  def step(p, o, b):
    if mapping == "shard_map":
      p_diff = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), p)
    else:
      p_diff = p
    g = jax.grad(model.loss_fn)(p_diff, b)
    g = jax.lax.pmean(g, AXIS)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  if mapping == "pmap":
    f = jax.pmap(step, axis_name=AXIS)
    p, o = replicate(params), replicate(tx.init(params))
    for b in bs:
      p, o = f(p, o, shard(b))
    return unrep(p)
  f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P())))
  p, o = put(params, P()), put(tx.init(params), P())
  for b in bs:
    p, o = f(p, o, put(b, P(AXIS)))
  return p


class Runner:
  """Runs a Pipelined under pmap or shard_map the way a user would; keeps the compiled full step."""

  def __init__(self, pipe, mapping, *, keep_compiled=True):
    self.pipe, self.mapping = pipe, mapping
    self.keep_compiled = keep_compiled and mapping == "shard_map"
    self.compiled = None
    if mapping == "pmap":
      self._step = jax.pmap(pipe.step, axis_name=AXIS)
      self._flush = jax.pmap(pipe.flush, axis_name=AXIS)
    else:
      specs = pipe.state_specs()

      def body(s, b):
        s, loss = pipe.step(s, b)
        return s, loss[None]

      self._step = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(specs, P(AXIS)),
                                         out_specs=(specs, P(AXIS))))
      self._flush = jax.jit(jax.shard_map(pipe.flush, mesh=mesh(), in_specs=(specs,), out_specs=specs))

  def init(self, params):
    state = self.pipe.init(params)
    return replicate(state) if self.mapping == "pmap" else put(state, P())

  def batch(self, b):
    return shard(b) if self.mapping == "pmap" else put(b, P(AXIS))

  def step(self, state, b):
    b = self.batch(b)
    if state.pending is not None and self.keep_compiled:
      if self.compiled is None:  # the full step, compiled once, kept for audit
        self.compiled = self._step.lower(state, b).compile()
      return self.compiled(state, b)
    return self._step(state, b)

  def flush(self, state):
    return self._flush(state)

  def params(self, state):
    p = self.pipe.params(state)
    return unrep(p) if self.mapping == "pmap" else p

  def run(self, params, bs, state=None):
    state = self.init(params) if state is None else state
    losses = []
    for b in bs:
      state, loss = self.step(state, b)
      losses.append(float(np.mean(np.asarray(loss))))
    return self.flush(state), losses


TXS = {
    "sgd-momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(3e-3, weight_decay=1e-2),
    "clip-sgd": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.05, momentum=0.9)),
}


@functools.cache
def case(modelname, txname, steps=STEPS):
  """Model, params, batches and the single-device full-batch reference, shared between mappings."""
  model = get_model(modelname)
  params = model.init(jax.random.key(0))
  bs = batches(model, steps, 32)
  ref, ref_losses = single_device_ref(model, TXS[txname](), params, bs)
  return model, params, bs, ref, ref_losses


def chunk_allreduces(hlo_text):
  """[(chunk index, element count)] of the all-reduces in a compiled module, in program order."""
  out = []
  for line in hlo_text.splitlines():
    if " all-reduce(" not in line and " all-reduce-start(" not in line:
      continue
    m = re.search(r"prophet/chunk(\d+)", line)
    shape = re.search(r"= \w+\[([\d,]*)\]", line)
    n = int(np.prod([int(d) for d in shape.group(1).split(",") if d])) if shape else -1
    out.append((int(m.group(1)) if m else None, n))
  return out


# --------------------------------------------------------------------------------------------------
# equivalence


@pytest.mark.parametrize("mapping,modelname,txname,residuals", [
    ("pmap", "mlp", "sgd-momentum", "all"),
    ("shard_map", "mlp", "sgd-momentum", "min-cut"),
    ("pmap", "cnn", "adamw", "all"),
    ("shard_map", "cnn", "adamw", "matmuls"),
    ("shard_map", "gpt-tiny", "sgd-momentum", "all"),
    ("shard_map", "gpt-tiny", "sgd-momentum", "matmuls"),
    ("pmap", "cnn", "adamw", "min-cut"),
    ("shard_map", "gpt-tiny", "sgd-momentum", "min-cut"),
])
def test_matches_plain_loop(mapping, modelname, txname, residuals):
  model, params, bs, ref, ref_losses = case(modelname, txname)
  tx = TXS[txname]()
  schedule = make_schedule(params)
  traces = []

  def loss_fn(p, b):  # counts traces: the state's structure must be stable, or every call retraces
    traces.append(1)
    return model.loss_fn(p, b)

  pipe = pipelined(loss_fn, tx, schedule, axis_name=AXIS, residuals=residuals)
  runner = Runner(pipe, mapping)
  state, losses = runner.run(params, bs)
  assert state.pending is None
  # forward-only program: 1 trace; full step: 2 (its abstract rebuild of the residuals' structure and
  # the new forward), whatever the number of steps; flush: 1 (the rebuild). (jax.checkpoint caches
  # its trace of loss_fn per shape: once with residuals="matmuls")
  assert len(traces) == (1 if residuals == "matmuls" else 4), len(traces)
  if residuals == "matmuls":  # fewer bytes carried than the jax.vjp closure's (less its constants)
    full = pipelined(model.loss_fn, tx, schedule, axis_name=AXIS, residuals="all")
    b = runner.batch(bs[0])
    n_all = full.residual_bytes(Runner(full, mapping)._step.eval_shape(runner.init(params), b)[0])
    n_mm = pipe.residual_bytes(runner._step.eval_shape(runner.init(params), b)[0])
    assert 0 < n_mm < (0.9 if modelname == "cnn" else 0.6) * n_all, (n_mm, n_all)
  got = runner.params(state)
  floor = 1e-4 if modelname == "gpt-tiny" else 0.0  # its attention key biases have zero gradient
  assert_trees_close(got, ref, params, tree_floor=floor)
  assert_trees_close(got, pmean_ref(mapping, model, tx, params, bs), params, tree_floor=floor)
  # each call returns the plain step's loss on its batch (the mean over devices is the full-batch loss)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  if mapping == "shard_map":
    # the compiled full step holds the planned chunks, each once, in schedule order
    found = chunk_allreduces(runner.compiled.as_text())
    assert found == [(k, c.size) for k, c in enumerate(schedule.chunks)], found
    report = audit(runner.compiled, schedule)
    assert report.ok, report.summary()
    assert report.order == tuple(range(len(schedule.chunks))) and not report.foreign
    if modelname == "cnn":  # evaluation after a flush equals the plain loop's
      ev = model.make_batch(jax.random.key(7), 64)
      loss = jax.jit(model.loss_fn)
      np.testing.assert_allclose(float(loss(got, ev)), float(loss(ref, ev)), rtol=1e-5)


def test_schedule_change_between_calls_flushes_first_and_stays_exact():
  """Two steps under a per-layer schedule, two under a per-leaf one, flush: equal to four plain steps.

  The first call under the new schedule reduces the pending gradients with the schedule they were made
  under (its chunks, in its order), then runs the new forward. clip_by_global_norm (needs every
  gradient) stays exact too."""
  model, params, bs, ref, _ = case("mlp", "clip-sgd", 4)
  tx = TXS["clip-sgd"]()
  s1, s2 = make_schedule(params), make_schedule(params, per_layer=False, split=3)
  assert len(s1.chunks) != len(s2.chunks)
  r1 = Runner(pipelined(model.loss_fn, tx, s1, axis_name=AXIS), "shard_map", keep_compiled=False)
  r2 = Runner(pipelined(model.loss_fn, tx, s2, axis_name=AXIS), "shard_map", keep_compiled=False)
  state = r1.init(params)
  for b in bs[:2]:
    state, _ = r1.step(state, b)
  assert state.pending.meta.schedule is s1
  # the transition program reduces with s1's chunks (one psum each), then forwards under s2
  jaxpr = str(r2._step.trace(state, r2.batch(bs[2])).jaxpr)
  assert jaxpr.count("psum") == len(s1.chunks)
  for b in bs[2:]:
    state, _ = r2.step(state, b)
  assert state.pending.meta.schedule is s2
  state = r2.flush(state)
  assert_trees_close(r2.params(state), ref, params)


@pytest.mark.parametrize("mutation", ["psum-not-pmean", "lost-slice"])
def test_tolerance_catches_wrong_scale_and_lost_slice(monkeypatch, mutation):
  """The equivalence check used above fails for a psum in place of a pmean, or a slice left out."""
  import prophet_jax._pipelined as mod

  model, params, bs, ref, _ = case("mlp", "sgd-momentum")
  schedule = make_schedule(params)
  real = mod.allreduce
  r, a, b = schedule.chunks[0].slices[0]
  lost_path = schedule.rows[r][0]

  def broken(grads, sched, axis_name, *, mean=True):
    if mutation == "psum-not-pmean":
      return real(grads, sched, axis_name, mean=False)
    out = real(grads, sched, axis_name, mean=mean)

    def drop(path, g):
      if path_str(path) != lost_path:
        return g
      return g.reshape(-1).at[a:b].set(0).reshape(g.shape)

    return jax.tree_util.tree_map_with_path(drop, out)

  monkeypatch.setattr(mod, "allreduce", broken)
  runner = Runner(pipelined(model.loss_fn, TXS["sgd-momentum"](), schedule, axis_name=AXIS), "shard_map",
                  keep_compiled=False)
  state, _ = runner.run(params, bs)
  with pytest.raises(AssertionError, match="max\\|got-ref\\|"):
    assert_trees_close(runner.params(state), ref, params)


# --------------------------------------------------------------------------------------------------
# state, residuals and bad input (traced only: nothing is compiled)


@functools.cache
def mlp_setup():
  model = get_model("mlp")
  params = model.init(jax.random.key(0))
  pipe = pipelined(model.loss_fn, optax.sgd(0.1), make_schedule(params), axis_name=AXIS)
  runner = Runner(pipe, "shard_map", keep_compiled=False)
  state0 = runner.init(params)
  batch = runner.batch(model.make_batch(jax.random.key(1), 32))
  state1, _ = runner._step.eval_shape(state0, batch)  # abstract: a state with a pending forward
  return model, params, pipe, runner, state0, batch, state1


def test_state_specs_residual_bytes_and_flush_noop():
  model, params, pipe, runner, state0, batch, state1 = mlp_setup()
  assert isinstance(state1, PipelinedState) and isinstance(state1.pending, Pending)
  # residuals are per device, with a leading axis of one per device
  res = state1.pending.residuals
  assert all(x.shape[0] == N_DEV for x in res)
  per_device = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in res) // N_DEV
  assert pipe.residual_bytes(state1) == per_device > 0
  assert pipe.residual_bytes(state0) == 0
  # they hold at least the activations of every hidden layer (4 examples x 32 wide x 11 layers)
  assert per_device >= 4 * 32 * 11 * 4
  full = pipe.state_specs(state1)
  assert jax.tree.structure(full, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(state1)
  assert set(jax.tree.leaves(full.pending, is_leaf=lambda x: isinstance(x, P))) == {P(AXIS)}
  assert set(jax.tree.leaves(full.params, is_leaf=lambda x: isinstance(x, P))) == {P()}
  # flush with nothing pending is a no-op (no axis needed, nothing traced)
  s = pipe.init(params)
  assert pipe.flush(s) is s
  # the flush program only reduces: one psum per chunk
  assert str(runner._flush.trace(state1).jaxpr).count("psum") == len(pipe.schedule.chunks)


@pytest.mark.parametrize("modelname", ["cnn", "gpt-tiny"])
def test_carries_fewer_bytes_than_the_vjp_closure(modelname):
  """Only values computed from the batch are carried: the backward recomputes the parameters' casts and
  the constants (relu's zero fill, iotas, masks) from the state's parameters. "min-cut" carries fewer
  still: the cheap elementwise values (a tanh-GELU's derivative terms) are recomputed from their inputs."""
  model = get_model(modelname)
  params = model.init(jax.random.key(0))
  bs = model.make_batch(jax.random.key(1), 32)
  one = jax.tree.map(lambda x: x[: 32 // N_DEV], bs)  # one device's batch
  closure = jax.eval_shape(lambda p, b: jax.tree.leaves(jax.vjp(lambda q: model.loss_fn(q, b), p)[1]),
                           params, one)
  closure_bytes = sum(x.size * x.dtype.itemsize for x in closure)
  carried = {}
  for how in ("all", "min-cut"):
    pipe = pipelined(model.loss_fn, optax.sgd(0.1), make_schedule(params), axis_name=AXIS, residuals=how)
    runner = Runner(pipe, "shard_map", keep_compiled=False)
    state1, _ = runner._step.eval_shape(runner.init(params), runner.batch(bs))
    assert len(state1.pending.meta.carry) == len(state1.pending.residuals)
    carried[how] = pipe.residual_bytes(state1)
  assert carried["all"] < (0.5 if modelname == "cnn" else 0.97) * closure_bytes, (carried, closure_bytes)
  # cnn carries relu masks and conv inputs already; gpt-tiny's GELU, layer norm and softmax terms go
  assert carried["min-cut"] <= (1.0 if modelname == "cnn" else 0.35) * carried["all"], carried


def test_batch_shape_change_is_an_error():
  model, params, pipe, runner, state0, batch, state1 = mlp_setup()
  other = runner.batch(model.make_batch(jax.random.key(2), 64))
  with pytest.raises(ValueError, match=r"batch leaf 'x' has shape \(8, 16\).*pending forward ran on "
                                       r"shape \(4, 16\).*flush\(state\)"):
    runner._step.trace(state1, other)
  # after a flush any shape is fine
  runner._step.trace(state0, other)


def test_schedule_for_another_tree_is_an_error():
  model, params, pipe, runner, state0, batch, state1 = mlp_setup()
  cnn_params = get_model("cnn").abstract_params()
  cnn_schedule = make_schedule(cnn_params)
  with pytest.raises(ScheduleMismatchError, match="pipelined.init: the schedule has a row for leaf "
                                                  "'params/Conv_0/bias'"):
    pipelined(model.loss_fn, optax.sgd(0.1), cnn_schedule, axis_name=AXIS).init(params)
  other = Runner(pipelined(model.loss_fn, optax.sgd(0.1), cnn_schedule, axis_name=AXIS), "shard_map",
                 keep_compiled=False)
  with pytest.raises(ScheduleMismatchError, match="pipelined.step"):
    other._step.trace(state1, batch)


def test_state_from_another_schedule_or_loss_is_an_error():
  import dataclasses

  model, params, pipe, runner, state0, batch, state1 = mlp_setup()
  cnn_schedule = make_schedule(get_model("cnn").abstract_params())
  meta = dataclasses.replace(state1.pending.meta, schedule=cnn_schedule)
  forged = state1._replace(pending=Pending(state1.pending.residuals, meta))
  with pytest.raises(ScheduleMismatchError, match="pending forward ran under a schedule for another tree"):
    runner._step.trace(forged, batch)
  with pytest.raises(ScheduleMismatchError, match="pipelined.flush"):
    runner._flush.trace(forged)

  def l2_loss(p, b):  # another loss_fn: its forward keeps other residuals
    return model.loss_fn(p, b) + 1e-3 * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))

  other = Runner(pipelined(l2_loss, optax.sgd(0.1), pipe.schedule, axis_name=AXIS), "shard_map",
                 keep_compiled=False)
  with pytest.raises(ValueError, match="state carries 26 residuals.*other values of the forward.*another loss_fn"):
    other._step.trace(state1, batch)


def test_bad_arguments():
  model, params, pipe, runner, state0, batch, state1 = mlp_setup()
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    pipelined(model.loss_fn, object(), pipe.schedule, axis_name=AXIS)
  with pytest.raises(TypeError, match="prophet_jax.Schedule"):
    pipelined(model.loss_fn, optax.sgd(0.1), "wfbp", axis_name=AXIS)
  with pytest.raises(TypeError, match="callable"):
    pipelined(None, optax.sgd(0.1), pipe.schedule, axis_name=AXIS)
  with pytest.raises(ValueError, match="residuals='dots'.*'all', 'min-cut', 'matmuls' or a jax.checkpoint policy"):
    pipelined(model.loss_fn, optax.sgd(0.1), pipe.schedule, axis_name=AXIS, residuals="dots")
  with pytest.raises(TypeError, match="expected the PipelinedState"):
    pipe.step({"params": params}, batch)
  from prophet_jax import UnboundAxisError

  with pytest.raises(UnboundAxisError, match="axis_name='data'"):
    pipe.step(pipe.init(params), model.make_batch(jax.random.key(1), 4))

  def per_example(p, b):
    return jnp.zeros(b["x"].shape[0])

  bad = Runner(pipelined(per_example, optax.sgd(0.1), pipe.schedule, axis_name=AXIS), "shard_map",
               keep_compiled=False)
  with pytest.raises(TypeError, match="must return a floating scalar, got shape \\(4,\\)"):
    bad._step.trace(state0, batch)
