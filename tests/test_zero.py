"""Sharded schedules in the rewrite (issue 28): reduce-scatters in backward, the ZeRO-1 update of each
device's shard, all-gathers for the next forward.

The matrix: `scheduled`, `hooked` (+ `scheduled` consuming its GradShards) and `pipelined` under
`jax.pmap`, `jax.shard_map` and the plain-jit mesh path, on the setups of tests/_user_setups.py
(SGD+momentum, AdamW, clip_by_global_norm + AdamW, bfloat16 params), every API with every mapping,
on multi-bucket sharded schedules whose chunks are not divisible by the 8 devices (one holds 3
elements: 5 of its 8 shard slots are padding). Each case runs 3 steps and compares the params with
the single-device full batch (or the plain pmean step, for bfloat16: tests/_user_setups.py says why)
within docs/design.md's tolerance; the same compiled step, run with the reduce-scatters' divisor n
replaced by n - 1 (a 14% gradient scale, through the engine's seam and a runtime scalar), fails
every case. The optimizer state per device is measured: 1/n of the replicated one plus the padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _user_setups as U
import prophet_jax as pj
from _assert import assert_trees_close
from prophet_jax._rewrite import _collectives, _zero
from prophet_jax._values._schedule import shard_size
from test_jit import _reduced, mesh, put, unreduced_loss
from test_user_steps import _replicate, _split, reference

AXIS = "data"
N = U.N_DEV
WRONG = N / (N - 1)   # the negative control: the reduce-scatters divide by n - 1


# --------------------------------------------------------------------------------------------------
# sharded schedules with uneven chunks


def _cuts(total: int, fractions=(0.3, 0.6)) -> list[int]:
  """Cut points of a row of `total` elements: a 3-element first piece, then pieces at `fractions`,
  every piece's size not a multiple of N (so every reduce-scatter pads)."""
  cuts = [0, min(3, total)]
  for f in fractions:
    c = max(cuts[-1] + 1, int(total * f))
    while (c - cuts[-1]) % N == 0 or (total - c) % N == 0:
      c += 1
    if c < total:
      cuts.append(c)
  return sorted(set(cuts + [total]))


@functools.cache
def sharded_for(name: str) -> pj.Schedule:
  """A sharded schedule for the setup's params: per dtype, the rows in backward order (last first)
  cut into uneven chunks; all-gathers front first, of one chunk and of two alternately."""
  params = U.setups()[name].params
  rows = pj.GradientProfile.from_params(params).tree_rows()
  chunks = []
  for dt in dict.fromkeys(d for _, _, d in rows):
    order = [r for r in reversed(range(len(rows))) if rows[r][2] == dt]
    spans, off = [], 0
    for r in order:
      n = math.prod(rows[r][1])
      spans.append((r, off, off + n))
      off += n
    cuts = _cuts(off)
    for a, b in zip(cuts[:-1], cuts[1:]):
      sl = tuple((r, max(a, lo) - lo, min(b, hi) - lo) for r, lo, hi in spans if max(a, lo) < min(b, hi))
      chunks.append(pj.Chunk(slices=sl, dtype=dt))
  gathers, k, pair = [], len(chunks) - 1, False
  while k >= 0:  # alternately one chunk and two (of one dtype), front first
    if pair and k >= 1 and chunks[k - 1].dtype == chunks[k].dtype:
      gathers.append((k, k - 1))
      k -= 2
    else:
      gathers.append((k,))
      k -= 1
    pair = not pair
  half = (len(chunks) + 1) // 2
  return pj.Schedule(buckets=(pj.Bucket(chunks=tuple(chunks[:half])), pj.Bucket(chunks=tuple(chunks[half:]))),
                     rows=rows, gathers=tuple(gathers), policy="custom")


def test_the_schedules_are_uneven_multi_bucket_and_sharded():
  for name in ("int-labels", "mixed-bf16"):
    s = sharded_for(name)
    assert s.sharded and len(s.buckets) == 2 and len(s.chunks) >= 4 and len(s.gathers) >= 3
    assert all(c.size % N for c in s.chunks), [c.size for c in s.chunks]
    assert min(c.size for c in s.chunks) < N  # a chunk smaller than the axis: mostly padding
    assert any(len(g) > 1 for g in s.gathers)


# --------------------------------------------------------------------------------------------------
# the steps a user writes, instrumented: scale is a runtime scalar (1: the library; WRONG: n - 1)


def _hooks(scale):
  return _collectives.engine_hooks(divisor=lambda n: n / scale, sum_divisor=1 / scale)


def _grads(s: U.Setup, p, b):
  if s.has_aux:
    return jax.grad(s.loss_fn, has_aux=True)(p, b)[0]
  return jax.grad(s.loss_fn)(p, b)


def _flags(s: U.Setup) -> dict:
  return {"has_aux": True} if s.has_aux else {}


def _run_plain(s: U.Setup, sched: pj.Schedule, api: str, mapping: str):
  """(compiled step(p, o, b, scale) -> (p, o), initial (p, o), place(batch), fetch(params))."""
  if mapping == "mesh":
    m = mesh()
    tx = pj.scheduled(s.make_tx(), sched, axis_name=AXIS, mesh=m)
    grad_fn = pj.hooked(s.loss_fn, sched, axis_name=AXIS, mesh=m, **_flags(s))

    def step(p, o, b, scale):
      with _hooks(scale):
        if api == "hooked":
          g = grad_fn(p, b)[1]
        else:  # gradients obtained unreduced (each device's partial sum), reduce-scattered on the mesh
          g = jax.grad(unreduced_loss)(_reduced(p), b)
        u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o

    jitted = jax.jit(step, static_argnums=3)  # a scalar closed over by the mesh's shard_map must be static

    def in_mesh(*args):  # the unreduced gradients' reshard names the mesh's axis
      with jax.set_mesh(m):
        return jitted(*args)

    p = put(s.params, P())
    return in_mesh, (p, tx.init(p)), (lambda b: put(b, P(AXIS))), jax.device_get
  tx = pj.scheduled(s.make_tx(), sched, axis_name=AXIS)
  grad_fn = pj.hooked(s.loss_fn, sched, axis_name=AXIS, **_flags(s))

  def step(p, o, b, scale):
    with _hooks(scale):
      if api == "hooked":
        g = grad_fn(p, b)[1]
        assert isinstance(g, pj.GradShards)
      else:
        g = _grads(s, jax.lax.pcast(p, AXIS, to="varying") if mapping == "shard_map" else p, b)
      u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  if mapping == "pmap":
    p = _replicate(s.params)
    o = jax.pmap(tx.init, axis_name=AXIS)(p)
    return (jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, 0, None)), (p, o), _split,
            lambda t: jax.tree.map(lambda x: np.asarray(x[0]), t))
  sm = functools.partial(jax.shard_map, mesh=mesh())
  o = jax.jit(sm(tx.init, in_specs=P(), out_specs=P(AXIS)))(put(s.params, P()))
  f = jax.jit(sm(step, in_specs=(P(), P(AXIS), P(AXIS), P()), out_specs=(P(), P(AXIS))))
  return f, (put(s.params, P()), o), (lambda b: put(b, P(AXIS))), jax.device_get


def _run_pipelined(s: U.Setup, sched: pj.Schedule, mapping: str):
  """(compiled step(state, b, scale) -> state, initial (state,), place, fetch, flush(state, scale))."""
  pipe = pj.pipelined(s.loss_fn, s.make_tx(), sched, axis_name=AXIS,
                      mesh=mesh() if mapping == "mesh" else None, **_flags(s))

  def step(st, b, scale):
    with _hooks(scale):
      return pipe.step(st, b)[0]

  def flush(st, scale):
    with _hooks(scale):
      return pipe.flush(st)

  if mapping == "mesh":
    return (jax.jit(step, static_argnums=2), (pipe.init(put(s.params, P())),), (lambda b: put(b, P(AXIS))),
            jax.device_get, jax.jit(flush, static_argnums=1))
  if mapping == "pmap":
    st = jax.pmap(pipe.init, axis_name=AXIS)(_replicate(s.params))
    return (jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, None)), (st,), _split,
            lambda t: jax.tree.map(lambda x: np.asarray(x[0]), t),
            jax.pmap(flush, axis_name=AXIS, in_axes=(0, None)))
  specs = pipe.state_specs()
  sm = functools.partial(jax.shard_map, mesh=mesh())
  st = jax.jit(sm(pipe.init, in_specs=P(), out_specs=specs))(put(s.params, P()))
  return (jax.jit(sm(step, in_specs=(specs, P(AXIS), P()), out_specs=specs)), (st,),
          (lambda b: put(b, P(AXIS))), jax.device_get,
          jax.jit(sm(flush, in_specs=(specs, P()), out_specs=specs)))


def _scalar(scale, mapping):
  """The control's scale as the step takes it: a runtime scalar (one compiled step runs both), or, on
  the mesh path (where the engine runs inside the library's own shard_map, which cannot close over a
  value typed on Explicit axes), a static Python float (two compiles)."""
  if mapping == "mesh":
    return float(scale)
  x = jnp.float32(scale)
  return put(x, P()) if mapping == "shard_map" else x


@functools.cache
def run(name: str, api: str, mapping: str):
  """(params after 3 steps, the same with the n-1 divisor, the initial optimizer state, the optimizer
  state after the 3 steps (as the step leaves it: global arrays, or pmap's stacked values))."""
  s, sched = U.setups()[name], sharded_for(name)
  out = []
  if api == "pipelined":
    step, init, place, fetch, flush = _run_pipelined(s, sched, mapping)
    for scale in (1.0, WRONG):
      (st,) = init
      for b in s.batches:
        st = step(st, place(b), _scalar(scale, mapping))
      st = flush(st, _scalar(scale, mapping))
      out.append(fetch(st.params))
      if scale == 1.0:
        final = st.opt_state
    opt_state = init[0].opt_state
  else:
    step, init, place, fetch = _run_plain(s, sched, api, mapping)
    for scale in (1.0, WRONG):
      p, o = init
      for b in s.batches:
        p, o = step(p, o, place(b), _scalar(scale, mapping))
      out.append(fetch(p))
      if scale == 1.0:
        final = o
    opt_state = init[1]
  return out[0], out[1], opt_state, final


# every API with every mapping (9), and every setup with every API and mapping at least once (checked)
CASES = [
    ("int-labels", "scheduled", "pmap"), ("adamw", "scheduled", "shard_map"),
    ("int-labels", "scheduled", "mesh"),
    ("clip-adamw", "hooked", "pmap"), ("mixed-bf16", "hooked", "shard_map"), ("adamw", "hooked", "mesh"),
    ("mixed-bf16", "pipelined", "pmap"), ("clip-adamw", "pipelined", "shard_map"),
    ("int-labels", "pipelined", "mesh"),
    ("mixed-bf16", "scheduled", "shard_map"),
]


def test_the_cases_cover_every_api_with_every_mapping():
  assert {(a, m) for _, a, m in CASES} == {(a, m) for a in ("scheduled", "hooked", "pipelined")
                                          for m in ("pmap", "shard_map", "mesh")}
  for name in ("int-labels", "adamw", "clip-adamw", "mixed-bf16"):
    assert {a for n, a, _ in CASES if n == name} and {m for n, _, m in CASES if n == name}


def _reference(name: str, mapping: str):
  return reference(name, "pmap" if mapping == "pmap" else "shard_map")[0]


@pytest.mark.parametrize("name,api,mapping", CASES)
def test_sharded_step_equals_the_reference_and_the_n_minus_1_control_fails(name, api, mapping):
  s = U.setups()[name]
  got, wrong = run(name, api, mapping)[:2]
  ref = _reference(name, mapping)
  assert_trees_close(got, ref, s.params)
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
    assert_trees_close(wrong, ref, s.params)


# --------------------------------------------------------------------------------------------------
# the optimizer state per device: 1/n (+ padding) of the replicated one


def _per_device_nbytes(opt_state, mapping: str) -> int:
  """Bytes of one device's optimizer state."""
  leaves = jax.tree.leaves(opt_state)
  if mapping == "pmap":   # stacked per device
    return sum(x[0].nbytes for x in leaves)
  return sum(x.addressable_shards[0].data.nbytes for x in leaves)


@pytest.mark.parametrize("name,api,mapping", [("adamw", "scheduled", "shard_map"),
                                              ("int-labels", "scheduled", "pmap"),
                                              ("int-labels", "pipelined", "mesh")])
def test_the_optimizer_state_per_device_is_one_nth_plus_padding(name, api, mapping):
  s, sched = U.setups()[name], sharded_for(name)
  opt_state = run(name, api, mapping)[2]
  replicated = s.make_tx().init(s.params)
  rep = sum(np.asarray(x).nbytes for x in jax.tree.leaves(replicated))
  got = _per_device_nbytes(opt_state, mapping)
  # per-parameter state arrays (momentum: 1, adam: 2) of every chunk's shard, plus scalars
  per_param = sum(np.asarray(x).nbytes for x in jax.tree.leaves(replicated) if np.ndim(x)) // sum(
      c.nbytes for c in sched.chunks)
  scalars = rep - per_param * sum(c.nbytes for c in sched.chunks)
  assert got == per_param * sched.shard_nbytes(N) + scalars
  assert got <= rep / N + per_param * sum((N * shard_size(c.size, N) - c.size) * 4 // N + 4
                                          for c in sched.chunks) + scalars
  assert got < rep / 4, (got, rep)


# --------------------------------------------------------------------------------------------------
# allreduce with a sharded schedule: reduce-scatter + all-gather, replicated


def test_allreduce_with_a_sharded_schedule_is_the_mean():
  s, sched = U.setups()["int-labels"], sharded_for("int-labels")

  def body(p, b):
    g = _grads(s, p, b)
    return pj.allreduce(g, sched, AXIS), jax.lax.pmean(g, AXIS), pj.allreduce(g, sched, AXIS, mean=False)

  f = jax.pmap(body, axis_name=AXIS)
  got, ref, total = f(_replicate(s.params), _split(s.batches[0]))
  for x, y, z in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(total)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(z), N * np.asarray(y), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(x) == np.asarray(x)[:1])  # replicated


# --------------------------------------------------------------------------------------------------
# what tx may be, and the errors


def test_shard_modes_and_unshardable_optimizers():
  params = U.setups()["int-labels"].params
  assert _zero.shard_mode(optax.sgd(0.1, momentum=0.9), params) == "elementwise"
  assert _zero.shard_mode(optax.adamw(1e-3), params) == "elementwise"
  assert _zero.shard_mode(U.clip_adamw(), params) == "global-norm"
  for tx in (optax.lion(1e-3), optax.rmsprop(1e-3), optax.MultiSteps(optax.adam(1e-3), 2)):
    assert _zero.shard_mode(tx, params) == "elementwise"
  with pytest.raises(pj.ShardingError, match=r"differs from its update on the params' tree .* whole leaves"):
    _zero.shard_mode(optax.lamb(1e-3), params)
  with pytest.raises(pj.ShardingError, match=r"a mask that picks leaves .*\(masked\)"):
    _zero.shard_mode(optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), params)
  with pytest.raises(pj.ShardingError, match=r"Adafactor"):
    _zero.shard_mode(optax.adafactor(1e-3), params)


def test_sharded_state_errors():
  s, sched = U.setups()["int-labels"], sharded_for("int-labels")
  tx = pj.scheduled(optax.sgd(0.1, momentum=0.9), sched, axis_name=AXIS)
  with pytest.raises(pj.UnboundAxisError, match=r"sharded \(ZeRO-1\).*jax.pmap\(tx.init"):
    tx.init(s.params)
  pipe = pj.pipelined(s.loss_fn, optax.sgd(0.1), sched, axis_name=AXIS, has_aux=True)
  with pytest.raises(pj.UnboundAxisError, match=r"pipelined.init: .*jax.pmap\(p.init.*p.state_specs"):
    pipe.init(s.params)
  other = pj.Schedule(buckets=sched.buckets, rows=sched.rows, gathers=tuple(reversed(sched.gathers)))
  o = jax.pmap(pj.scheduled(optax.sgd(0.1, momentum=0.9), other, axis_name=AXIS).init,
               axis_name=AXIS)(_replicate(s.params))

  def step(p, o, b):
    return tx.update(_grads(s, p, b), o, p)

  with pytest.raises(pj.ScheduleMismatchError, match="does not belong to this schedule"):
    jax.pmap(step, axis_name=AXIS).lower(_replicate(s.params), o, _split(s.batches[0]))
  grad_fn = pj.hooked(s.loss_fn, sched, axis_name=AXIS, has_aux=True)
  o = jax.pmap(tx.init, axis_name=AXIS)(_replicate(s.params))

  def no_params(p, o, b):
    return tx.update(grad_fn(p, b)[1], o)

  with pytest.raises(TypeError, match="needs the params"):
    jax.pmap(no_params, axis_name=AXIS).lower(_replicate(s.params), o, _split(s.batches[0]))
  with pytest.raises(ValueError, match="in_loop"):
    pj.hooked(s.loss_fn, sched, axis_name=AXIS, in_loop=("params/x",))


def test_state_specs_of_a_sharded_state():
  s, sched = U.setups()["adamw"], sharded_for("adamw")
  opt_state = run("adamw", "scheduled", "shard_map")[2]
  specs = pj.state_specs(opt_state, AXIS)
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert flat and all(x == P(AXIS) for x in flat)
  assert isinstance(opt_state.inner, pj.ShardedState)
  mixed = {"params": s.params, "opt": opt_state}
  specs = pj.state_specs(mixed, AXIS)
  assert all(x == P() for x in jax.tree.leaves(specs["params"], is_leaf=lambda x: isinstance(x, P)))


# --------------------------------------------------------------------------------------------------
# between layouts: the whole optimizer state (a checkpoint any device count resumes) and back


@functools.cache
def _full_batch_states(name: str) -> list:
  """[(params, optimizer state)] after each of the setup's steps on one device with the full batch
  (as tests/_user_setups.single_device_reference steps, keeping the state)."""
  s = U.setups()[name]
  tx = s.make_tx()

  @jax.jit
  def step(p, o, b):
    g = U.value_and_grad(s, p, s.model_state, b)[1]
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  p, o, out = s.params, tx.init(s.params), []
  for b in s.batches:
    p, o = step(p, o, b)
    out.append(jax.device_get((p, o)))
  return out


def _full_batch_opt_state(name: str):
  """The optimizer state after the setup's steps on one device with the full batch."""
  return _full_batch_states(name)[-1][1]


def _leaves_close(got, ref, what):
  g, r = jax.tree.leaves(got), jax.tree.leaves(ref)
  assert len(g) == len(r), (what, len(g), len(r))
  for k, (x, y) in enumerate(zip(g, r)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape, (what, k, x.shape, y.shape)
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6 * (np.max(np.abs(y)) if y.size else 0),
                               err_msg=f"{what}: leaf {k}")


@pytest.mark.parametrize("name,api,mapping", [("adamw", "scheduled", "shard_map"),
                                              ("int-labels", "scheduled", "pmap"),
                                              ("clip-adamw", "pipelined", "shard_map")])
def test_unshard_state_is_the_full_batch_state_and_shard_state_inverts_it(name, api, mapping):
  s, sched = U.setups()[name], sharded_for(name)
  tx = s.make_tx()
  final = run(name, api, mapping)[3]
  whole = pj.unshard_state(final, tx, s.params, sched)   # ScheduledState(inner=tx's whole state)
  assert not [x for x in jax.tree.leaves(whole, is_leaf=lambda x: isinstance(x, pj.ShardedState))
              if isinstance(x, pj.ShardedState)]
  ref = _full_batch_opt_state(name)
  assert jax.tree.structure(jax.tree.leaves(whole)) == jax.tree.structure(jax.tree.leaves(ref))
  _leaves_close(whole, ref, "unsharded vs the full batch's state")
  # the momenta moved (a wrong slice would not pass silently), and the step counts are exact
  assert any(np.ndim(x) and np.max(np.abs(x)) > 0 for x in jax.tree.leaves(ref))
  for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(ref)):
    if np.issubdtype(np.asarray(y).dtype, np.integer):
      np.testing.assert_array_equal(x, y)
  inner = [x for x in jax.tree.leaves(final, is_leaf=lambda x: isinstance(x, pj.ShardedState))
           if isinstance(x, pj.ShardedState)]
  assert len(inner) == 1
  tx_whole = jax.tree.unflatten(jax.tree.structure(ref), jax.tree.leaves(whole))
  back = pj.shard_state(tx_whole, tx, s.params, sched, N, pmap=mapping == "pmap")
  assert back.tag == inner[0].tag
  again = pj.unshard_state(back, tx, s.params, sched)
  for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(tx_whole)):
    np.testing.assert_array_equal(x, y)
  if inner[0].tag.mode == "elementwise":  # every entry of the shard state back, padding (zeros) included
    for x, y in zip(jax.tree.leaves(back.per_device), jax.tree.leaves(inner[0].per_device)):
      np.testing.assert_array_equal(x, jax.device_get(y))


def test_reshard_to_another_device_count_and_resume_from_the_whole_state():
  """A state cut for 4 devices and gathered back is the whole state; the initial shard state
  (weight decay's zeros aside) is what shard_state cuts from tx.init; bad input is named."""
  s, sched = U.setups()["adamw"], sharded_for("adamw")
  tx = s.make_tx()
  ref = _full_batch_opt_state("adamw")
  four = pj.shard_state(ref, tx, s.params, sched, 4)
  assert four.tag.n == 4 and four.tag.sizes == tuple(shard_size(c.size, 4) for c in sched.chunks)
  lead = {np.shape(x)[0] for x in jax.tree.leaves(four.per_device)}
  assert lead == {4}
  for x, y in zip(jax.tree.leaves(pj.unshard_state(four, tx, s.params, sched)), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(x, y)
  init = run("adamw", "scheduled", "shard_map")[2].inner
  cut = pj.shard_state(tx.init(s.params), tx, s.params, sched, N)
  for x, y in zip(jax.tree.leaves(cut.per_device), jax.tree.leaves(init.per_device)):
    np.testing.assert_array_equal(x, jax.device_get(y))
  with pytest.raises(pj.ScheduleMismatchError, match="another schedule"):
    pj.unshard_state(init, tx, s.params, dataclasses.replace(
        sched, gathers=tuple((k,) for k in reversed(range(len(sched.chunks))))))
  with pytest.raises(ValueError, match="not sharded"):
    pj.shard_state(ref, tx, s.params, U.schedule_for("adamw"), N)
  with pytest.raises(TypeError, match="no ShardedState"):  # never silently the state unchanged
    pj.unshard_state({"opt": ref}, tx, s.params, sched)


def test_a_whole_state_cut_for_4_devices_resumes_there_and_equals_the_full_batch():
  """The full batch's first step (params, AdamW state) cut by shard_state for a 4-device mesh; the
  remaining steps there (scheduled, shard_map) end where the full batch does; the same cut with the
  first moments taken from step 0 (a stale state) does not."""
  s, sched = U.setups()["adamw"], sharded_for("adamw")
  tx0 = s.make_tx()
  (p1, o1), *_ = _full_batch_states("adamw")
  m4 = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
  tx = pj.scheduled(tx0, sched, axis_name=AXIS)

  def step(p, o, b):
    g = _grads(s, jax.lax.pcast(p, AXIS, to="varying"), b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  def resume(whole):
    inner = pj.shard_state(whole, tx0, s.params, sched, 4)
    init = jax.eval_shape(jax.shard_map(tx.init, mesh=m4, in_specs=P(), out_specs=P(AXIS)), s.params)
    o = init._replace(inner=inner)
    specs = pj.state_specs(o, AXIS)
    o = jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(m4, sp)), o, specs)
    f = jax.jit(jax.shard_map(step, mesh=m4, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
    p = jax.device_put(p1, NamedSharding(m4, P()))
    for b in s.batches[1:]:
      p, o = f(p, o, jax.device_put(b, NamedSharding(m4, P(AXIS))))
    return jax.device_get(p)

  ref = U.single_device_reference("adamw")[0]
  assert_trees_close(resume(o1), ref, s.params)
  stale = jax.tree.map(lambda a, b: b if np.ndim(a) else a, o1, tx0.init(s.params))  # moments reset
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
    assert_trees_close(resume(stale), ref, s.params)


# --------------------------------------------------------------------------------------------------
# the compiled programs (CPU): one reduce-scatter per chunk, then one all-gather per gather, in order


def _compiled(name: str, api: str, mapping: str):
  s, sched = U.setups()[name], sharded_for(name)
  one = _scalar(1.0, mapping)
  if api == "pipelined":
    step, (st,), place, _, _ = _run_pipelined(s, sched, mapping)
    st = step(st, place(s.batches[0]), one)  # a forward pending: the program with the whole step
    return step.lower(st, place(s.batches[1]), one).compile()
  step, (p, o), place, _ = _run_plain(s, sched, api, mapping)
  return step.lower(p, o, place(s.batches[0]), one).compile()


@pytest.mark.parametrize("name,api,mapping", [("int-labels", "scheduled", "pmap"),
                                              ("mixed-bf16", "hooked", "shard_map"),
                                              ("clip-adamw", "pipelined", "shard_map")])
def test_audit_finds_the_reduce_scatters_then_the_all_gathers_in_plan_order(name, api, mapping):
  sched = sharded_for(name)
  r = pj.audit(_compiled(name, api, mapping), sched)
  assert r.ok and r.sharded, r.describe()
  assert r.order == tuple(range(len(sched.chunks))) and r.gather_order == tuple(range(len(sched.gathers)))
  assert [e.elements for e in r.chunks] == list(sched.padded_sizes(N))
  assert [e.elements for e in r.gathers] == list(sched.gather_sizes(N))
  assert {e.collective for e in r.chunks} == {"reduce-scatter"}
  assert {e.collective for e in r.gathers} == {"all-gather"}
  if api == "hooked":  # issued from the backward rules: backward compute still follows them
    assert r.inside_backward >= 1, r.describe()
  if name == "clip-adamw":  # the global norm's one extra psum, foreign to the schedule
    assert any("prophet/norm" in e.op_name for e in r.foreign), [e.op_name for e in r.foreign]
  assert "sharded" in r.describe()
  assert pj.AuditReport.from_json(r.to_json()) == r


# --------------------------------------------------------------------------------------------------
# compile-only H100s: XLA:GPU's schedule of the reduce-scatters and all-gathers


@pytest.mark.gpu
def test_h100_audit_of_the_sharded_steps(topo):
  """The cnn with a per-layer sharded schedule (one reduce-scatter per layer in backward order, one
  all-gather per layer, front first), `scheduled`, `hooked` and `pipelined` compiled by XLA:GPU for 8
  H100s: one async reduce-scatter per chunk and one async all-gather per gather, padded sizes, plan
  order, the two halves one chain (one in flight); every reduce-scatter but the last holds backward
  compute in its window and none of backward's matmuls/convolutions runs outside the windows once
  they begin; `hooked` issues them inside backward; in the pipelined step the next forward runs inside
  an all-gather's window (jaxlib 0.10.2 and 0.12.0.1 compile the same schedule). The same for the plain
  jax.jit steps on global arrays (`hooked`/`pipelined` with mesh=, `lower_step(jit=True)`)."""
  from concurrent.futures import ThreadPoolExecutor

  from prophet_jax.models import get_model

  m = get_model("cnn")
  prof = pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3)
  w = pj.plan(prof, pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-10, workers=N), "wfbp")
  s = pj.Schedule(buckets=w.buckets, rows=w.rows, gathers=tuple((k,) for k in reversed(range(len(w.chunks)))))
  assert len(s.chunks) >= 5 and any(c.size % N for c in s.chunks)
  # the shard_map steps, and the plain jax.jit steps on global arrays (mesh=; lower_step(jit=True))
  modes = ("scheduled", "hooked", "pipelined", "hooked-jit", "pipelined-jit")
  lowered = {mode: pj.lower_step(m, s, mode.removesuffix("-jit"), topo, batch_size=16,
                                 jit=mode.endswith("-jit")) for mode in modes}
  with ThreadPoolExecutor(2) as pool:  # compilation releases the GIL
    compiled = dict(zip(modes, pool.map(lambda k: lowered[k].compile(), modes)))
  for key in modes:
    mode = key.removesuffix("-jit")
    r = pj.audit(compiled[key], s)
    where = f"{key}\n{r.describe()}"
    assert r.ok and r.sharded and r.asynchronous and r.max_in_flight == 1, where
    assert r.order == tuple(range(len(s.chunks))) and r.gather_order == tuple(range(len(s.gathers))), where
    assert [e.elements for e in r.chunks] == list(s.padded_sizes(N)), where
    assert [e.elements for e in r.gathers] == list(s.gather_sizes(N)), where
    assert all(e.asynchronous for e in r.gathers), where
    assert set(range(len(s.chunks) - 1)) <= {e.chunk for e in r.chunks if e.window_ops("backward")}, where
    assert r.backward_outside_windows == 0, where
    if mode == "hooked":  # every reduce-scatter but the front layer's (the last) inside backward
      assert r.inside_backward >= len(s.chunks) - 1, where
    if mode == "pipelined":
      assert r.gathers_forward_overlap, where


# --------------------------------------------------------------------------------------------------
# the README's snippet


def test_the_readme_snippet_runs_and_matches_the_single_device_step():
  """README, "DeAR and ZeRO-1": the snippet as written (a dear plan for the mlp; hooked(mesh=) shards,
  scheduled(mesh=)'s ZeRO-1 update in a flax TrainState, host batches; docs/usage.md) equals the single-device loop,
  and its optimizer state is split over the devices."""
  import re
  from pathlib import Path

  from prophet_jax.models import get_model

  text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
  start = text.index("## DeAR and ZeRO-1: a sharded schedule in the rewrite")
  code = re.compile(r"```python\n(.*?)```", re.S).search(text, start).group(1)
  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  batches = [jax.device_get(m.make_batch(jax.random.key(10 + i), 16)) for i in range(2)]
  ns = {"loss_fn": m.loss_fn, "params": params, "batches": batches, "model": m}
  exec(compile(code, "README.md", "exec"), ns)  # noqa: S102
  assert ns["schedule"].sharded and len(ns["schedule"].chunks) > 1
  state = ns["state"]
  assert isinstance(state.opt_state.inner, pj.ShardedState)
  leaf = jax.tree.leaves(state.opt_state)[0]
  assert leaf.shape[0] == N and leaf.sharding.spec[0] == "dp"
  tx = optax.sgd(0.05, momentum=0.9)
  p, o = params, tx.init(params)
  for b in batches:
    u, o = tx.update(jax.grad(m.loss_fn)(p, b), o, p)
    p = optax.apply_updates(p, u)
  assert_trees_close(jax.device_get(state.params), jax.device_get(p), params)


def test_check_composition_takes_a_sharded_scheduled():
  """check_composition runs `init` where its simulated axis is bound, so a sharded (ZeRO-1) scheduled
  passes it; a transformation before it in a chain is still refused at init."""
  s, sched = U.setups()["int-labels"], sharded_for("int-labels")
  pj.check_composition(pj.scheduled(U.clip_adamw(), sched, axis_name=AXIS), s.params, axis_name=AXIS)
  bad = optax.chain(optax.clip_by_global_norm(1.0), pj.scheduled(optax.sgd(0.1), sched, axis_name=AXIS))
  with pytest.raises(pj.CompositionError, match="runs after the chain's member #0"):
    pj.check_composition(bad, s.params, axis_name=AXIS)
