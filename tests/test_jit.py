"""The plain `jax.jit` path: `hooked(..., mesh=)`, `pipelined(..., mesh=)`, `scheduled(..., mesh=)` on
gradients obtained unreduced, and an `nnx.jit` step, on global arrays (params `P()`, batch `P("data")`).

Each case is written as a user writes a data-parallel step now (no shard_map, no pmap: the library maps
over the mesh itself) and compared with its reference by docs/design.md's tolerance, on multi-chunk
schedules: the setups of tests/_user_setups.py (the single-device full-batch step, or the plain pmean
step where that is the right one) with SGD+momentum or AdamW, on a one-axis mesh with Explicit axes
(`jax.make_mesh`'s default) and on a ("data", "model") mesh with Auto axes; the n-1 divisor control
(the case's own compiled step, the divisor a runtime scalar) fails every case, bfloat16 included. The
compiled programs: the plain jit step's own gradient all-reduce is gone (not doubled), the chunks are
there in order inside backward (CPU, and compile-only H100s), no collective runs over the other mesh
axis. Bad placement gets an error naming the leaf.
"""

from __future__ import annotations

import functools
import re
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import _user_setups as U
import prophet_jax as pj
from _assert import assert_trees_close
from prophet_jax._rewrite import _collectives
from test_user_steps import WRONG_SCALE, _scaled, check, reference

AXIS = "data"
APIS = ("hooked", "pipelined")


@functools.cache
def mesh(kind: str = "1d"):
  """'1d': 8 devices on 'data', Explicit (jax.make_mesh's default); '1d-auto': the same, Auto; '2d':
  ('data', 'model') = (4, 2), Auto; '2d-explicit': the same, Explicit."""
  if kind == "1d":
    return jax.make_mesh((U.N_DEV,), (AXIS,))
  if kind == "1d-auto":
    return jax.make_mesh((U.N_DEV,), (AXIS,), axis_types=(AxisType.Auto,))
  types = (AxisType.Explicit,) * 2 if kind == "2d-explicit" else (AxisType.Auto,) * 2
  return jax.make_mesh((4, 2), (AXIS, "model"), axis_types=types)


def _host(x):
  return x if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else np.asarray(x)


def put(tree, spec, kind="1d"):
  return jax.device_put(jax.tree.map(_host, tree), NamedSharding(mesh(kind), spec))


def _flags(s: U.Setup) -> dict:
  return {k: v for k, v in (("has_aux", s.has_aux), ("has_state", s.has_state)) if v}


# --------------------------------------------------------------------------------------------------
# the steps a jit user writes


def hooked_step(s: U.Setup, schedule: pj.Schedule, kind: str):
  """step(params, opt_state, model_state, batch) -> (params, opt_state, model_state, loss, aux), to jit,
  with hooked(..., mesh=) gradients and the user's own tx, and tx."""
  tx = s.make_tx()
  grad_fn = pj.hooked(s.loss_fn, schedule, axis_name=AXIS, mesh=mesh(kind), **_flags(s))

  def step(p, o, ms, b):
    aux = None
    if s.has_state:
      (loss, ms), g = grad_fn(p, ms, b)
    elif s.has_aux:
      (loss, aux), g = grad_fn(p, b)
    else:
      loss, g = grad_fn(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, ms, loss, aux

  return step, tx


def hooked_runner(s: U.Setup, schedule: pj.Schedule, kind: str):
  body, tx = hooked_step(s, schedule, kind)
  step = jax.jit(_scaled(body))
  p0, o0 = put(s.params, P(), kind), put(tx.init(s.params), P(), kind)
  ms0 = put(s.model_state, P(), kind)

  def go(scale: float):
    p, o, ms, history = p0, o0, ms0, []
    for b in s.batches:
      p, o, ms, loss, aux = step(p, o, ms, put(b, P(AXIS), kind), _scale(scale))
      history.append((np.asarray(loss), None if aux is None else np.asarray(aux)))
    return jax.device_get(p), ms, history

  return go


def pipelined_runner(s: U.Setup, schedule: pj.Schedule, kind: str):
  pipe = pj.pipelined(s.loss_fn, s.make_tx(), schedule, axis_name=AXIS, mesh=mesh(kind), **_flags(s))
  params = put(s.params, P(), kind)
  state0 = pipe.init(params, put(s.model_state, P(), kind)) if s.has_state else pipe.init(params)
  step, flush = jax.jit(_scaled(pipe.step)), jax.jit(_scaled(pipe.flush))

  def go(scale: float):
    state, history = state0, []
    for b in s.batches:
      state, out = step(state, put(b, P(AXIS), kind), _scale(scale))
      loss, aux = out if s.has_aux else (out, None)
      history.append((np.asarray(loss), None if aux is None else np.asarray(aux)))
    state = flush(state, _scale(scale))
    assert state.pending is None
    return jax.device_get(state.params), state.model_state, history

  return go


def _scale(scale: float):
  """The runtime scalar as an uncommitted host value: the mesh path's shard_map closes over it (jax
  refuses to close over a value committed to Explicit axes)."""
  return np.float32(scale)


@functools.cache
def runner(name: str, api: str, kind: str):
  """scale -> the case's result: one compiled step (and flush) per case, cached; the chunked reductions
  divide by n / scale (`_scaled`)."""
  s, schedule = U.setups()[name], U.schedule_for(name)
  return (hooked_runner if api == "hooked" else pipelined_runner)(s, schedule, kind)


def run(name: str, api: str, kind: str):
  return runner(name, api, kind)(1.0)


@functools.cache
def cached_run(name: str, api: str, kind: str):
  return run(name, api, kind)


def cases() -> list[tuple[str, str, str]]:
  """Every setup with both APIs; the ('data', 'model') mesh (Auto axes, 4 examples... 8 per device)
  alternates with the one-axis Explicit mesh where the reference is the single-device step (a plain
  pmean reference is per device, so it needs the same 8-way split)."""
  out = []
  for k, name in enumerate(U.SETUP_NAMES):
    single = U.setups()[name].reference == "single-device"
    out += [(name, api, "2d" if single and (k + j) % 2 else "1d") for j, api in enumerate(APIS)]
  return out


CASES = cases()


def test_cases_cover_both_meshes_with_both_apis():
  assert {(api, kind) for _, api, kind in CASES} == {(a, k) for a in APIS for k in ("1d", "2d")}
  assert {name for name, _, _ in CASES} == set(U.SETUP_NAMES)


@pytest.mark.parametrize("name,api,kind", CASES)
def test_jit_step_matches_reference(name, api, kind):
  check(name, "shard_map", cached_run(name, api, kind))


@pytest.mark.parametrize("name,api,kind", CASES)
def test_a_14_percent_gradient_scale_fails_every_case(name, api, kind):
  """The case's own compiled step, run with every chunked reduction dividing by n - 1 (the one engine's
  seam and a runtime scalar: hooked and pipelined reach it on the mesh path as elsewhere), fails."""
  got = runner(name, api, kind)(WRONG_SCALE)
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
    check(name, "shard_map", got, params_only=True)


def test_a_tuple_of_data_axes():
  """axis_name=('data', 'model') on the (4, 2) mesh: the batch split over both (4 examples per device),
  the chunks reduced over all 8 devices; equal to the single-device step."""
  s, schedule = U.setups()["int-labels"], U.schedule_for("int-labels")
  kind, axes = "2d-explicit", (AXIS, "model")
  tx = s.make_tx()
  grad_fn = pj.hooked(s.loss_fn, schedule, axis_name=axes, mesh=mesh(kind), has_aux=True)

  @jax.jit
  def step(p, o, b):
    (loss, aux), g = grad_fn(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss, aux

  p, o = put(s.params, P(), kind), put(tx.init(s.params), P(), kind)
  history = []
  for b in s.batches:
    p, o, loss, aux = step(p, o, put(b, P(axes), kind))
    assert aux.shape == (U.N_DEV,)
    history.append((np.asarray(loss), np.asarray(aux)))
  check("int-labels", "shard_map", (jax.device_get(p), None, history))
  with pytest.raises(ValueError, match=r"batch leaf 'batch/x' .* placed as P\('data'.*\('data', 'model'\)"):
    grad_fn(p, put(s.batches[0], P(AXIS), kind))


# --------------------------------------------------------------------------------------------------
# the compiled program: the plain jit step's all-reduce is gone, the chunks are there


def _plain_jit_step(s: U.Setup):
  tx = s.make_tx()

  @jax.jit
  def step(p, o, b):
    (loss, _), g = jax.value_and_grad(s.loss_fn, has_aux=True)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  return step, tx


def test_the_plain_jit_steps_allreduce_is_replaced_by_the_chunks():
  """int-labels on the one-axis mesh: the plain jit step (the partitioner's gradient all-reduce) and
  the same step with hooked(mesh=) gradients end at the same params and losses; the plain step's
  compiled program reduces every gradient element in its own all-reduce(s), ours only the chunks (in
  schedule order, inside backward) and the one scalar of the loss. (The plain step runs on Auto axes:
  on Explicit ones, jax 0.12 refuses optax's integer-label cross entropy over the global batch, whose
  take_along_axis asks for an out_sharding; the mesh path runs it per device.)"""
  name = "int-labels"
  s, schedule = U.setups()[name], U.schedule_for(name)
  plain, tx = _plain_jit_step(s)
  p, o = put(s.params, P(), "1d-auto"), put(tx.init(s.params), P(), "1d-auto")
  losses = []
  for b in s.batches:
    p, o, loss = plain(p, o, put(b, P(AXIS), "1d-auto"))
    losses.append(float(loss))
  got_p, _, history = cached_run(name, "hooked", "1d")
  assert_trees_close(got_p, jax.device_get(p), s.params)
  np.testing.assert_allclose([float(h[0]) for h in history], losses, rtol=2e-5)

  args = (put(s.params, P()), put(tx.init(s.params), P()), put(s.batches[0], P(AXIS)))
  n_grad = sum(np.size(x) for x in jax.tree.leaves(s.params))
  auto = (put(s.params, P(), "1d-auto"), put(tx.init(s.params), P(), "1d-auto"),
          put(s.batches[0], P(AXIS), "1d-auto"))
  before = pj.audit(plain.lower(*auto).compile(), schedule)
  assert before.chunk_allreduces == 0 and sum(e.elements for e in before.foreign) >= n_grad
  step = jax.jit(hooked_step(s, schedule, "1d")[0])
  after = pj.audit(step.lower(args[0], args[1], None, args[2]).compile(), schedule)
  assert after.ok and after.order == tuple(range(len(schedule.chunks))), after.describe()
  assert [e.elements for e in after.chunks] == [c.size for c in schedule.chunks]
  assert after.inside_backward >= len(schedule.chunks) - 1, after.describe()
  assert [e.elements for e in after.foreign] == [1], after.describe()  # the loss, nothing else
  assert sum(e.elements for e in after.chunks) == n_grad  # every gradient element once, not twice


def _groups(line: str, shape: tuple[int, ...]) -> list[list[int]]:
  """The device groups of a collective's replica_groups (an explicit list or the iota form)."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(d) for d in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:  # names the axes the collective spans
    sizes = [int(v) for v in re.findall(r"=(\d+)", m.group(1))]
    names = re.findall(r"'(\w+)'=", m.group(1))
    over = set(re.findall(r"'(\w+)'", m.group(2)))
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    keep = [i for i, n in enumerate(names) if n in over]
    rest = [i for i, n in enumerate(names) if n not in over]
    return ids.transpose(rest + keep).reshape(-1, int(np.prod([sizes[i] for i in keep]))).tolist()
  raise AssertionError(f"unreadable replica_groups: {line[:200]}")


@pytest.mark.parametrize("api", APIS)
def test_other_mesh_axes_are_untouched(api):
  """On a ("data", "model") = (4, 2) mesh with Explicit axes: every collective of the compiled step is
  an all-reduce over 'data' alone (groups of 4 devices that share their 'model' index); none runs over
  'model', and there is no all-gather, reduce-scatter, all-to-all or permute."""
  s, schedule = U.setups()["int-labels"], U.schedule_for("int-labels")
  kind = "2d-explicit"
  b = put(s.batches[0], P(AXIS), kind)
  if api == "hooked":
    step, tx = hooked_step(s, schedule, kind)
    text = jax.jit(step).lower(put(s.params, P(), kind), put(tx.init(s.params), P(), kind), None, b).compile().as_text()
  else:
    pipe = pj.pipelined(s.loss_fn, s.make_tx(), schedule, axis_name=AXIS, mesh=mesh(kind), has_aux=True)
    state, _ = jax.jit(pipe.step)(pipe.init(put(s.params, P(), kind)), b)
    text = jax.jit(pipe.step).lower(state, b).compile().as_text()
  coords = np.asarray([[d.id for d in row] for row in mesh(kind).devices])  # (data, model) -> device
  flat = coords.reshape(-1).tolist()
  lines = [ln for ln in text.splitlines() if re.search(r"\b(all-gather|reduce-scatter|all-to-all|"
                                                        r"collective-permute)(-start)?\(", ln)]
  assert not lines, lines[:3]
  reduces = [ln for ln in text.splitlines() if re.search(r"\ball-reduce(-start)?\(", ln)]
  assert len(reduces) >= len(schedule.chunks)
  for ln in reduces:
    for g in _groups(ln, coords.shape):
      where = [np.argwhere(coords == flat[d])[0] for d in g]
      assert len(g) == 4 and len({int(w[1]) for w in where}) == 1, ln[:200]  # one 'model' index
      assert sorted(int(w[0]) for w in where) == [0, 1, 2, 3], ln[:200]  # every 'data' index


# --------------------------------------------------------------------------------------------------
# bad input: clear errors, before anything compiles


def _grad_fn(kind="1d", **kw):
  s, schedule = U.setups()["int-labels"], U.schedule_for("int-labels")
  return s, pj.hooked(s.loss_fn, schedule, axis_name=AXIS, mesh=mesh(kind), has_aux=True, **kw)


def test_an_axis_the_mesh_lacks_is_named():
  s, schedule = U.setups()["int-labels"], U.schedule_for("int-labels")
  with pytest.raises(ValueError, match=r"no axis 'dp'; its axes are \{'data': 8\}"):
    pj.hooked(s.loss_fn, schedule, axis_name="dp", mesh=mesh())
  with pytest.raises(ValueError, match="no axis 'dp'"):
    pj.pipelined(s.loss_fn, s.make_tx(), schedule, axis_name="dp", mesh=mesh())
  with pytest.raises(ValueError, match="no axis 'dp'"):
    pj.scheduled(s.make_tx(), schedule, axis_name="dp", mesh=mesh())
  with pytest.raises(TypeError, match="expected a jax.sharding.Mesh"):
    pj.hooked(s.loss_fn, schedule, axis_name=AXIS, mesh="data")


def test_a_batch_not_split_over_the_axis_is_named():
  s, grad_fn = _grad_fn()
  p = put(s.params, P())
  with pytest.raises(ValueError, match=r"batch leaf 'batch/x' .* is replicated .* P\('data'\)"):
    jax.jit(grad_fn).trace(p, put(s.batches[0], P()))
  bad = {"x": np.zeros((12, U.IN), np.float32), "y": np.zeros((12,), np.int32)}
  with pytest.raises(ValueError, match=r"batch leaf 'batch/x' has shape \(12, 8\).*8 devices"):
    grad_fn(p, bad)
  pipe = pj.pipelined(s.loss_fn, s.make_tx(), U.schedule_for("int-labels"), axis_name=AXIS, mesh=mesh(),
                      has_aux=True)
  with pytest.raises(ValueError, match=r"batch leaf 'batch/y' .* is replicated"):
    pipe.step(pipe.init(p), {"x": put(s.batches[0]["x"], P(AXIS)), "y": put(s.batches[0]["y"], P())})


def test_params_not_replicated_are_named():
  s, grad_fn = _grad_fn()
  params = dict(s.params, l1={"w": put(s.params["l1"]["w"], P(AXIS)), "b": s.params["l1"]["b"]})
  with pytest.raises(ValueError, match=r"params leaf 'params/l1/w' .* split over mesh axis 'data' on its "
                                       r"axis 0 .* replicated, P\(\)"):
    jax.jit(grad_fn).trace(params, put(s.batches[0], P(AXIS)))
  s, grad_fn = _grad_fn("2d-explicit")
  params = dict(s.params, l0={"w": put(s.params["l0"]["w"], P(None, "model"), "2d-explicit"),
                              "b": s.params["l0"]["b"]})
  with pytest.raises(ValueError, match=r"params leaf 'params/l0/w' .* split over mesh axis 'model'"):
    grad_fn(params, put(s.batches[0], P(AXIS), "2d-explicit"))


def test_inside_a_shard_map_it_says_to_drop_mesh():
  s, grad_fn = _grad_fn()
  f = jax.shard_map(lambda p, b: grad_fn(p, b)[1], mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P())
  with pytest.raises(ValueError, match="inside a jax.shard_map .* make it without mesh="):
    jax.jit(f).trace(put(s.params, P()), put(s.batches[0], P(AXIS)))


def test_a_model_state_computed_per_device_is_named():
  """BatchNorm statistics not averaged over the axis vary per device: on the mesh the model state is
  one replicated value, as in a plain jit step, so the grad_fn says where to average them."""
  s = U.setups()["batchnorm"]
  net = U.BNNet()

  def loss_fn(params, stats, batch):
    logits, upd = net.apply({"params": params, "batch_stats": stats}, batch["x"], train=True,
                            mutable=["batch_stats"])
    return U._xent(logits, batch["y"]), upd["batch_stats"]

  grad_fn = pj.hooked(loss_fn, U.schedule_for("batchnorm"), axis_name=AXIS, mesh=mesh(), has_state=True)
  with pytest.raises(ValueError, match=r"model state's leaf 'model_state/BatchNorm_0/mean' varies over "
                                       r"mesh axis 'data'.*BatchNorm\(axis_name='data'\)"):
    jax.jit(grad_fn).trace(put(s.params, P()), put(s.model_state, P()), put(s.batches[0], P(AXIS)))


# --------------------------------------------------------------------------------------------------
# deferral (dlcp) on the mesh


def _defer_setup():
  import test_pipelined_defer as TP
  return TP


@pytest.mark.parametrize("api", APIS)
def test_a_deferring_schedule_on_the_mesh_equals_the_loop_with_the_same_deferral(api):
  """dlcp (max_defer 0.25: several deferral groups) through hooked(mesh=) with grad_fn.defer_state()
  and through pipelined(mesh=): STEPS steps equal the pmap loop with `allreduce(..., defer_state=)`
  (the params, the chunks deferred at the last step, each device's residual); a state in the
  per-device layout is refused naming the fix."""
  TP = _defer_setup()
  model, params, bs = TP.setup()
  s = TP.schedule(0.25)
  ref, ref_st, _ = TP.loop_ref(0.25)
  if api == "hooked":
    grad_fn = pj.hooked(model.loss_fn, s, axis_name=AXIS, mesh=mesh())
    tx = TP.tx()

    @jax.jit
    def step(p, o, d, b):
      _, g, d = grad_fn(p, b, d)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o, d

    p, o, d = put(params, P()), put(tx.init(params), P()), grad_fn.defer_state()
    assert [np.shape(r)[0] for r in d.residual] == [U.N_DEV] * len(d.residual)
    for b in bs:
      p, o, d = step(p, o, d, put(b, P(AXIS)))
    with pytest.raises(ValueError, match=r"residual of group 0 has shape \(1, .*grad_fn.defer_state\(\)"):
      grad_fn(put(params, P()), put(bs[0], P(AXIS)), pj.defer_state(s))
  else:
    pipe = pj.pipelined(model.loss_fn, TP.tx(), s, axis_name=AXIS, mesh=mesh())
    state = pipe.init(put(params, P()))
    step = jax.jit(pipe.step)
    for b in bs:
      state, _ = step(state, put(b, P(AXIS)))
    state = jax.jit(pipe.flush)(state)
    p, d = state.params, state.defer
  assert_trees_close(jax.device_get(p), ref, params)
  for got, want in zip(d.deferred, ref_st.deferred):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[0])
  for got, want in zip(d.residual, ref_st.residual):
    want = np.asarray(want)[:, 0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


# --------------------------------------------------------------------------------------------------
# gradients obtained unreduced ({U:data}): scheduled(tx, ..., mesh=) reduces them on the schedule


def _bias(b, h):
  """h + b, with b broadcast to h's layout first: jax refuses `h + b` for a `reduced` b and a
  batch-split h (jax 0.10.2 and 0.12.0.1), so a model fed reduced params broadcasts explicitly."""
  return h + jax.lax.broadcast_in_dim(b, h.shape, (h.ndim - 1,), out_sharding=jax.typeof(h).sharding)


def unreduced_loss(p, batch):
  h = jnp.tanh(_bias(p["l0"]["b"], batch["x"] @ p["l0"]["w"]))
  h = jnp.tanh(_bias(p["l1"]["b"], h @ p["l1"]["w"]))
  return U._xent(_bias(p["l2"]["b"], h @ p["l2"]["w"]), batch["y"])


def _reduced(p):
  """params resharded to P(reduced={'data'}): a free cast whose transpose leaves the gradient
  unreduced (each device's partial sum)."""
  return jax.tree.map(lambda w: jax.sharding.reshard(w, P(*[None] * w.ndim, reduced={AXIS})), p)


def _unreduced_steps(schedule, scale=None):
  """(the scheduled(mesh=) jit step on unreduced gradients, its tx; the plain jit step, its tx).
  `scale`: the sums are multiplied by it (the negative control), injected into the one engine."""
  txs = pj.scheduled(optax.sgd(0.2, momentum=0.9), schedule, axis_name=AXIS, mesh=mesh())
  tx = optax.sgd(0.2, momentum=0.9)

  @jax.jit
  def step(p, o, b):
    with _collectives.engine_hooks(sum_divisor=None if scale is None else 1 / scale):
      g = jax.grad(unreduced_loss)(_reduced(p), b)
      u, o = txs.update(g, o, p)
    return optax.apply_updates(p, u), o

  @jax.jit
  def plain(p, o, b):
    g = jax.grad(unreduced_loss)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  return step, txs, plain, tx


def test_unreduced_gradients_are_reduced_on_the_schedule():
  """On an Explicit mesh, gradients obtained unreduced through `scheduled(tx, ..., mesh=)`: 3 steps equal
  the plain jit step (SGD+momentum); the compiled program's all-reduces are the chunks alone, in order,
  one per chunk, with their planned sizes (the plain step's one gradient all-reduce is not there); a
  sum scaled by n/(n-1) fails; replicated gradients and an Auto mesh are refused naming the fix."""
  s = U.setups()["int-labels"]
  prof = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  schedule = pj.plan(prof, U.NETWORK, "priority", partition_bytes=256)
  assert len(schedule.chunks) >= 6
  with jax.set_mesh(mesh()):
    step, txs, plain, tx = _unreduced_steps(schedule)
    p, o = put(s.params, P()), txs.init(put(s.params, P()))
    q, oq = put(s.params, P()), put(tx.init(s.params), P())
    for b in s.batches:
      b = put(b, P(AXIS))
      p, o = step(p, o, b)
      q, oq = plain(q, oq, b)
    assert_trees_close(jax.device_get(p), jax.device_get(q), s.params)
    r = pj.audit(step.lower(p, o, put(s.batches[0], P(AXIS))).compile(), schedule)
    assert r.ok and r.order == tuple(range(len(schedule.chunks))) and not r.foreign, r.describe()
    assert [e.elements for e in r.chunks] == [c.size for c in schedule.chunks]

    wrong, txw, _, _ = _unreduced_steps(schedule, scale=U.N_DEV / (U.N_DEV - 1))
    p, o = put(s.params, P()), txw.init(put(s.params, P()))
    for b in s.batches:
      p, o = wrong(p, o, put(b, P(AXIS)))
    with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
      assert_trees_close(jax.device_get(p), jax.device_get(q), s.params)

    def replicated(p, o, b):
      return txs.update(jax.grad(unreduced_loss)(p, b), o, p)

    with pytest.raises(pj.AlreadyReducedError, match=r"gradient 'grads/l0/b' is replicated .*"
                                                     r"P\(reduced=\{'data'\}\)"):
      jax.jit(replicated).trace(q, txs.init(q), put(s.batches[0], P(AXIS)))
  auto = pj.scheduled(optax.sgd(0.1), schedule, axis_name=AXIS, mesh=mesh("2d"))
  g = put(s.params, P(), "2d")
  with pytest.raises(ValueError, match="need mesh axes of type Explicit.*hooked"):
    auto.update(g, auto.init(g), g)


def test_unreduced_gradients_with_a_deferring_schedule():
  """dlcp (max_defer 0.25, three deferral groups) through `scheduled(mesh=)` on unreduced gradients:
  `init` lays the residuals out on the mesh (8, k, c); 3 steps equal `scheduled` under a user-written
  shard_map (per-device gradients, the deferral tested against its oracle in test_defer.py): the same
  chunks deferred, the same params."""
  s = U.setups()["int-labels"]
  prof = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  slow = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-7, workers=U.N_DEV)
  schedule = pj.plan(prof, slow, "dlcp", max_defer=0.25, spread=3, cross_step=True)
  assert sum(1 for b in schedule.buckets if b.defer) >= 2, schedule.describe()
  tx = pj.scheduled(optax.sgd(0.2, momentum=0.9), schedule, axis_name=AXIS)
  specs = pj.state_specs(jax.eval_shape(tx.init, s.params), AXIS)

  def body(p, o, b):
    g = jax.grad(unreduced_loss)(jax.lax.pcast(p, AXIS, to="varying"), b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  ref = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
  o = jax.jit(jax.shard_map(tx.init, mesh=mesh(), in_specs=P(), out_specs=specs))(s.params)
  p = put(s.params, P())
  with jax.set_mesh(mesh()):
    txs = pj.scheduled(optax.sgd(0.2, momentum=0.9), schedule, axis_name=AXIS, mesh=mesh())

    @jax.jit
    def step(q, oq, b):
      u, oq = txs.update(jax.grad(unreduced_loss)(_reduced(q), b), oq, q)
      return optax.apply_updates(q, u), oq

    q, oq = put(s.params, P()), txs.init(put(s.params, P()))
    assert all(np.shape(r)[0] == U.N_DEV for r in oq.defer_state.residual)
    for b in s.batches:
      b = put(b, P(AXIS))
      p, o = ref(p, o, b)
      q, oq = step(q, oq, b)
  assert_trees_close(jax.device_get(q), jax.device_get(p), s.params)
  for got, want in zip(oq.defer_state.deferred, o.defer_state.deferred):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --------------------------------------------------------------------------------------------------
# flax.nnx: an nnx.jit step with nnx.Optimizer and the scheduled gradient


def test_nnx_jit_step_with_nnx_optimizer():
  """The README's nnx example: `nnx.jit` train step, `nnx.Optimizer(model, sgd(momentum), wrt=nnx.Param)`,
  gradients from `hooked(..., mesh=)` on `nnx.state(model, nnx.Param)`; 3 steps equal the plain
  `nnx.jit` step (`nnx.value_and_grad`, the partitioner's all-reduce) in params and losses; the n-1
  divisor fails."""
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l0 = nnx.Linear(U.IN, U.HID, rngs=rngs)
      self.l1 = nnx.Linear(U.HID, U.OUT, rngs=rngs)

    def __call__(self, x):
      return self.l1(jnp.tanh(self.l0(x)))

  def loss_of(model, batch):
    return U._xent(model(batch["x"]), batch["y"])

  batches = U.setups()["int-labels"].batches
  # the reference on Auto axes: optax's integer-label cross entropy does not trace on Explicit axes
  # in jax 0.12 (its take_along_axis asks for an out_sharding); the mesh path runs it per device
  auto = mesh("2d")

  def make(m):
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.2, momentum=0.9), wrt=nnx.Param)
    nnx.update((model, opt), jax.device_put(nnx.state((model, opt)), NamedSharding(m, P())))
    return model, opt

  model, opt = make(auto)
  before = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  @nnx.jit
  def plain_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_of)(model, batch)
    opt.update(model, grads)
    return loss

  ref_losses = [float(plain_step(model, opt, jax.device_put(b, NamedSharding(auto, P(AXIS))))) for b in batches]
  ref = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  def train(wrong: bool):
    model, opt = make(mesh())
    params = nnx.state(model, nnx.Param)
    schedule = pj.plan(pj.GradientProfile.from_params(params, forward_s=1e-4, backward_s=2e-4), U.NETWORK,
                       "wfbp")
    assert len(schedule.chunks) >= 2
    graphdef = nnx.graphdef(model)

    def loss_fn(params, batch):
      return loss_of(nnx.merge(graphdef, params), batch)

    grad_fn = pj.hooked(loss_fn, schedule, axis_name=AXIS, mesh=mesh())

    @nnx.jit
    def train_step(model, opt, batch):
      loss, grads = grad_fn(nnx.state(model, nnx.Param), batch)
      opt.update(model, grads)
      return loss

    with _collectives.engine_hooks(divisor=(lambda n: n - 1) if wrong else None):
      losses = [float(train_step(model, opt, put(b, P(AXIS)))) for b in batches]
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))), losses

  got, losses = train(False)
  assert_trees_close(got, ref, before)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  wrong, _ = train(True)
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):
    assert_trees_close(wrong, ref, before)


# --------------------------------------------------------------------------------------------------
# profile_step and Monitor on the same loss and mesh


@pytest.mark.golden_measured  # it plans from profile_step's timings: its step's chunks follow them
def test_profile_step_and_monitor_take_the_mesh():
  """The jit user profiles, plans and re-plans without a shard_map: `profile_step(loss_fn, params, batch,
  mesh=, axis_name=, has_aux=)` on the ('data', 'model') mesh profiles the 4 devices along 'data' (the
  per-device batch of training: 32 / 4), one row per parameter leaf; `Monitor(..., mesh=, axis_name=)`
  probes over those devices and re-plans a schedule the mesh step takes."""
  s = U.setups()["int-labels"]
  m = mesh("2d")
  prof = pj.profile_step(s.loss_fn, s.params, s.batches[0], mesh=m, axis_name=AXIS, has_aux=True, steps=2)
  assert [r.path for r in prof.rows] and {r.path for r in prof.rows} == {
      r.path for r in pj.GradientProfile.from_params(s.params).rows}
  assert "4 devices" in prof.notes and prof.method in ("measured", "timed", "estimated")
  with pytest.raises(ValueError, match="no axis 'dp'"):
    pj.profile_step(s.loss_fn, s.params, s.batches[0], mesh=m, axis_name="dp", has_aux=True)
  net = pj.NetworkModel(alpha_s=1e-6, beta_s_per_byte=1e-9, workers=4)
  built = []
  mon = pj.Monitor(prof, net, mesh=m, axis_name=AXIS, probe_every=1, probe_repeats=3,
                   build_step=lambda sch: built.append(sch) or pj.hooked(
                       s.loss_fn, sch, axis_name=AXIS, mesh=m, has_aux=True))
  grad_fn = mon.step_fn
  (loss, _), g = jax.jit(grad_fn)(put(s.params, P(), "2d"), put(s.batches[0], P(AXIS), "2d"))
  assert np.isfinite(float(loss)) and built == [mon.schedule]
  mon.record_step(1e-3)  # probes over the 4 devices along 'data', refits, maybe re-plans
  assert len(mon.decisions) == 1 and mon.network.workers == 4
  with pytest.raises(ValueError, match=r"workers=8, but the mesh has 4 devices along 'data'"):
    pj.Monitor(prof, net.replace(workers=8), mesh=m, axis_name=AXIS)


def test_profile_step_takes_a_model_state():
  """The loss hooked(..., has_state=True) takes: `profile_step(..., has_state=True, model_state=)`
  profiles it at that state (BatchNorm statistics averaged over the mesh's data axis inside the loss),
  one row per parameter leaf; a state without the flag, or the flag without a state, is a TypeError."""
  s = U.setups()["batchnorm"]
  m = mesh("2d")
  prof = pj.profile_step(s.loss_fn, s.params, s.batches[0], mesh=m, axis_name=AXIS, has_state=True,
                         model_state=s.model_state, steps=2, method="timed")
  assert {r.path for r in prof.rows} == {r.path for r in pj.GradientProfile.from_params(s.params).rows}
  assert prof.method == "timed" and sum(r.fwd_s for r in prof.rows) > 0, prof.notes
  with pytest.raises(TypeError, match="pass model_state="):
    pj.profile_step(s.loss_fn, s.params, s.batches[0], mesh=m, axis_name=AXIS, has_state=True)
  with pytest.raises(TypeError, match="without has_state=True"):
    pj.profile_step(s.loss_fn, s.params, s.batches[0], mesh=m, axis_name=AXIS, model_state=s.model_state)


# --------------------------------------------------------------------------------------------------
# compile-only H100s


@pytest.mark.gpu
def test_h100_audit_of_the_jit_steps(topo):
  """The cnn's plain jit step with hooked(mesh=) gradients and its pipelined(mesh=) step, compiled by
  XLA:GPU for 8 H100s: one async all-reduce per chunk, planned sizes, schedule order, one in flight,
  every remaining backward matmul/convolution inside an all-reduce window and every chunk but the last
  with backward compute in its own (the loss pmean, concatenated into the last chunk's all-reduce, is
  read through); the plain jit step is one all-reduce with nothing overlapped."""
  from prophet_jax.models import get_model

  m = get_model("cnn")
  gmesh = topo.mesh(AXIS)
  params = m.abstract_params()
  batch = jax.eval_shape(lambda k: m.make_batch(k, 16), jax.random.key(0))
  prof = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  net = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-10, workers=U.N_DEV)
  schedule = pj.plan(prof, net, "wfbp")
  tx = optax.sgd(0.1, momentum=0.9)
  grad_fn = pj.hooked(m.loss_fn, schedule, axis_name=AXIS, mesh=gmesh)

  def step(p, o, b, plain=False):
    loss, g = jax.value_and_grad(m.loss_fn)(p, b) if plain else grad_fn(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  args = (topo.abstract(params, P(), mesh=gmesh),
          topo.abstract(jax.eval_shape(tx.init, params), P(), mesh=gmesh),
          topo.abstract(batch, P(AXIS), mesh=gmesh))
  pipe = pj.pipelined(m.loss_fn, tx, pj.plan(prof, net, "wfbp", cross_step=True), axis_name=AXIS,
                      mesh=gmesh)
  state0 = jax.eval_shape(pipe.init, args[0])
  pending, _ = jax.eval_shape(pipe.step, topo.abstract(state0, pipe.state_specs(state0), mesh=gmesh), args[2])
  lowered = {"hooked": jax.jit(step).lower(*args),
             "pipelined": jax.jit(pipe.step).lower(topo.abstract(pending, pipe.state_specs(pending),
                                                                 mesh=gmesh), args[2]),
             "plain": jax.jit(functools.partial(step, plain=True)).lower(*args)}
  # jaxlib 0.12 runs these small all-reduces as one-shot collective kernels, with less inside their
  # windows; the overlap claims are about NCCL's all-reduces, jaxlib 0.10's only path (docs/facts.md,
  # "XLA:GPU 0.12's collective kernels"; test_gpu.py audits the default)
  from prophet_jax._compiled import _gpu

  nccl = ({"xla_gpu_experimental_use_collective_kernels": ""}
          if _gpu.xla_option_accepted("xla_gpu_experimental_use_collective_kernels", "") else None)
  with ThreadPoolExecutor(2) as pool:  # compilation releases the GIL
    compiled = dict(zip(lowered, pool.map(lambda k: lowered[k].compile(compiler_options=nccl),
                                          list(lowered))))
  for mode in ("hooked", "pipelined"):
    s = schedule if mode == "hooked" else pipe.schedule
    r = pj.audit(compiled[mode], s)
    where = f"{mode}\n{r.describe()}"
    assert r.ok and r.asynchronous and r.max_in_flight == 1, where
    assert r.order == tuple(range(len(s.chunks))), where
    assert [e.elements for e in r.chunks] == [c.size for c in s.chunks], where
    assert r.backward_outside_windows == 0, where
    assert set(range(len(s.chunks) - 1)) <= {e.chunk for e in r.chunks if e.window_ops("backward")}, where
    assert [e.elements for e in r.foreign] == [1], where  # the loss: read through the concatenation
  r = pj.audit(compiled["plain"], schedule)
  assert r.chunk_allreduces == 0 and len({e.name for e in r.foreign}) == 1, r.describe()
  assert len(r.foreign) == len(jax.tree.leaves(params)) + 1 and not any(e.overlapped for e in r.foreign)


def test_cli_audits_the_plain_jit_step():
  """`prophet-jax audit --jit --mode hooked`: the plain jax.jit step with hooked(mesh=) gradients, compiled
  for 8 H100s, audits OK (the wfbp plan's chunks, in order); `--jit --mode scheduled` (gradients the
  partitioner already reduced) is one line naming the modes that work, exit 2."""
  import json
  import subprocess
  import sys

  cmd = [sys.executable, "-m", "prophet_jax", "audit", "--target", "h100", "--model", "mlp", "--policy",
         "wfbp", "--batch", "16", "--jit", "--json"]
  out = subprocess.run([*cmd, "--mode", "hooked"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  report = pj.AuditReport.from_json(json.loads(out.stdout)["report"])
  assert report.ok and len(report.order) >= 2 and report.order == tuple(range(len(report.order)))
  bad = subprocess.run([*cmd, "--mode", "scheduled"], capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and "audit --jit --mode hooked" in bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
