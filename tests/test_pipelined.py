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
from prophet_jax import Bucket, Chunk, GradientProfile, Schedule, ScheduleMismatchError
from prophet_jax._pipelined import Pending, PipelinedState, pipelined
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
  x = jax.tree.map(lambda a: a.reshape(N_DEV, a.shape[0] // N_DEV, *a.shape[1:]), x)
  return jax.device_put(x, pmap_sharding())


def replicate(tree):
  return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV, *jnp.shape(a))), tree),
                        pmap_sharding())


def unrep(tree):
  return jax.tree.map(lambda a: a[0], tree)


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

  def __init__(self, pipe, mapping):
    self.pipe, self.mapping = pipe, mapping
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
    if state.pending is not None and self.mapping == "shard_map":
      if self.compiled is None:  # the full step, compiled once, kept for audit
        self.compiled = self._step.lower(state, b).compile()
      return self.compiled(state, b)
    return self._step(state, b)

  def flush(self, state):
    return self._flush(state)

  def params(self, state):
    p = self.pipe.params(state)
    return unrep(p) if self.mapping == "pmap" else p

  def run(self, params, bs):
    state = self.init(params)
    losses = []
    for b in bs:
      state, loss = self.step(state, b)
      losses.append(float(jnp.mean(loss)))
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


@pytest.mark.parametrize("mapping,modelname,txname", [
    ("pmap", "mlp", "sgd-momentum"),
    ("shard_map", "mlp", "sgd-momentum"),
    ("pmap", "cnn", "adamw"),
    ("shard_map", "cnn", "adamw"),
])
def test_matches_plain_loop(mapping, modelname, txname):
  model, params, bs, ref, ref_losses = case(modelname, txname)
  tx = TXS[txname]()
  schedule = make_schedule(params)
  pipe = pipelined(model.loss_fn, tx, schedule, axis_name=AXIS)
  runner = Runner(pipe, mapping)
  state, losses = runner.run(params, bs)
  assert state.pending is None
  got = runner.params(state)
  assert_trees_close(got, ref, params)
  assert_trees_close(got, pmean_ref(mapping, model, tx, params, bs), params)
  # each call returns the plain step's loss on its batch (the mean over devices is the full-batch loss)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  if mapping == "shard_map":
    # the compiled full step holds the planned chunks, each once, in schedule order
    found = chunk_allreduces(runner.compiled.as_text())
    assert found == [(k, c.size) for k, c in enumerate(schedule.chunks)], found
    try:
      from prophet_jax import audit
    except (ImportError, AttributeError):
      audit = None
    if audit is not None:
      report = audit(runner.compiled, schedule)
      assert report.ok, report
    if modelname == "cnn":  # evaluation after a flush equals the plain loop's
      ev = model.make_batch(jax.random.key(7), 64)
      np.testing.assert_allclose(float(model.loss_fn(got, ev)), float(model.loss_fn(ref, ev)), rtol=1e-5)
