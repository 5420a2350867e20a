"""allreduce: exactness against pmean, pass-through leaves, the NaN-proof tie, and bad input."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax._rewrite._collectives import tie

AX = "data"
NDEV = 8


def _schedule(tree, cuts_per_row=None, *, reverse=True, merge=False):
  """A hand-built schedule: each row cut into pieces; one chunk per piece, or merged per dtype."""
  profile = pj.GradientProfile.from_params(tree)
  rows = profile.tree_rows()
  pieces = []
  for r, (_, shape, dtype) in enumerate(rows):
    n = int(np.prod(shape))
    if n == 0:
      continue
    cuts = sorted(set([0, n] + list((cuts_per_row or {}).get(r, ()))))
    pieces += [(r, a, b, dtype) for a, b in zip(cuts, cuts[1:])]
  if reverse:
    pieces.reverse()
  if merge:
    by = {}
    for r, a, b, d in pieces:
      by.setdefault(d, []).append((r, a, b))
    chunks = [pj.Chunk(slices=tuple(v), dtype=d) for d, v in by.items()]
  else:
    chunks = [pj.Chunk(slices=((r, a, b),), dtype=d) for r, a, b, d in pieces]
  return pj.Schedule(buckets=(pj.Bucket(chunks=tuple(chunks)),), rows=rows)


def _per_device(tree, seed=0):
  """Per-device integer-valued floats (sums exact in any order), ints left as they are."""
  rng = np.random.default_rng(seed)

  def f(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.asarray(rng.integers(-8, 8, (NDEV, *x.shape)), x.dtype)
    return jnp.broadcast_to(x, (NDEV, *x.shape))

  return jax.tree.map(f, tree)


def test_mixed_tree_equals_pmean_and_passes_through_ints_float0_and_empty():
  tree = {"a": jnp.zeros((4, 5)), "b": jnp.zeros(7), "h": jnp.zeros((3, 3), jnp.bfloat16),
          "i": jnp.arange(3, dtype=jnp.int32), "z": jnp.zeros((0, 3))}
  s = _schedule(tree, {0: (10,)})
  # the empty leaf is made inside the step, as a gradient is: jax 0.11.2's XLA:CPU crashes compiling a
  # pmap that has a zero-size operand, whatever the step does (docs/facts.md, "jax 0.11.2: zero-size
  # operands of a mapped program")
  x = _per_device({k: v for k, v in tree.items() if k != "z"})
  seen = []

  def step(g):
    g = {**g, "z": jnp.zeros((0, 3)) * g["b"][0]}
    f0 = jax.grad(lambda p: jnp.sum(p["a"]), allow_int=True)(g)["i"]  # a float0 gradient
    out = pj.allreduce({**g, "i": f0}, s, AX)
    seen.append(out["i"].dtype)
    return pj.allreduce(g, s, AX)

  got = jax.pmap(step, axis_name=AX)(x)
  assert seen and seen[0] == jax.dtypes.float0  # float0 gradient: passed through
  assert got["z"].shape == (NDEV, 0, 3) and got["z"].dtype == jnp.float32  # empty leaf: passed through
  x["z"] = jnp.zeros((NDEV, 0, 3))
  ref = jax.pmap(lambda g: jax.lax.pmean(g, AX), axis_name=AX)(
      {k: v for k, v in x.items() if k not in ("i", "z")})
  ref["z"] = x["z"]
  for k in ("a", "b", "h", "z"):
    np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(ref[k], np.float32), k)
    assert got[k].dtype == x[k].dtype
  np.testing.assert_array_equal(got["i"], x["i"])  # integer leaf: unreduced


def test_sum_without_mean():
  tree = {"w": jnp.zeros(6)}
  s = _schedule(tree, {0: (2,)})
  x = _per_device(tree, seed=3)
  got = jax.pmap(lambda g: pj.allreduce(g, s, AX, mean=False), axis_name=AX)(x)
  np.testing.assert_array_equal(got["w"][0], np.asarray(x["w"]).sum(0))


def test_nan_in_one_chunk_stays_in_that_chunk():
  tree = {"a": jnp.zeros(4), "b": jnp.zeros(4)}
  s = _schedule(tree)  # chunk0 = b, chunk1 = a (tied to b's result)
  x = {"a": jnp.ones((NDEV, 4)), "b": jnp.ones((NDEV, 4)).at[:, 0].set(jnp.nan)}
  got = jax.pmap(lambda g: pj.allreduce(g, s, AX), axis_name=AX)(x)
  assert np.isnan(got["b"][0, 0]) and np.all(np.isfinite(got["a"]))
  inf = tie(jnp.ones(3), jnp.array([jnp.inf, 1.0]))
  np.testing.assert_array_equal(inf, np.ones(3))


def test_a_lossless_schedule_never_calls_deferral_code(monkeypatch):
  """allreduce, scheduled (init and update) and hooked trace a schedule that defers nothing without
  calling into `_defer` (its state, its checks): the lossless walk to the psum has no deferral stop."""
  import optax

  from prophet_jax._rewrite import _collectives, _hooked, _reduction, _transform

  def boom(*args, **kwargs):
    raise AssertionError("a lossless schedule called deferral code")

  for mod in (_collectives, _reduction, _transform, _hooked):
    for name in ("check_state", "group_states", "with_groups", "defer_init"):
      if hasattr(mod, name):
        monkeypatch.setattr(mod, name, boom)
  tree = {"a": jnp.zeros((4, 5)), "b": jnp.zeros(7)}
  s = _schedule(tree, {0: (10,)})
  grads = {k: jnp.zeros((NDEV, *v.shape)) for k, v in tree.items()}
  jax.eval_shape(jax.vmap(lambda g: pj.allreduce(g, s, AX), axis_name=AX), grads)
  tx = pj.scheduled(optax.sgd(0.1), s, axis_name=AX)
  opt = tx.init(tree)
  jax.eval_shape(jax.vmap(lambda g: tx.update(g, opt, tree)[0], axis_name=AX), grads)
  grad_fn = pj.hooked(lambda p, x: sum(jnp.sum(v) * x for v in p.values()), s, axis_name=AX)
  jax.eval_shape(jax.vmap(lambda x: grad_fn(tree, x)[1], axis_name=AX), jnp.ones(NDEV))


@st.composite
def trees_and_schedules(draw):
  n = draw(st.integers(1, 4))
  tree = {}
  for i in range(n):
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int32"]))
    tree[f"l{i}"] = jnp.zeros(shape, dtype)
  if not any(jnp.issubdtype(v.dtype, jnp.inexact) and v.size for v in tree.values()):
    tree["w"] = jnp.zeros(3)
  rows = pj.GradientProfile.from_params(tree).tree_rows()
  cuts = {r: draw(st.lists(st.integers(1, max(int(np.prod(s)) - 1, 1)), max_size=3))
          for r, (_, s, _) in enumerate(rows)}
  cuts = {r: [c for c in cs if c < int(np.prod(rows[r][1]))] for r, cs in cuts.items()}
  return tree, _schedule(tree, cuts, reverse=draw(st.booleans()), merge=draw(st.booleans()))


@settings(deadline=None, max_examples=6)
@given(trees_and_schedules(), st.integers(0, 2**16))
def test_property_random_tree_and_schedule_equals_pmean_exactly(ts, seed):
  tree, s = ts
  for c in s.chunks:  # one dtype per chunk
    assert {s.rows[r][2] for r, _, _ in c.slices} == {c.dtype}
  x = _per_device(tree, seed)
  # zero-size leaves are made inside the step, as a gradient is (jax 0.11.2's XLA:CPU crashes on a
  # zero-size pmap operand: docs/facts.md, "jax 0.11.2: zero-size operands of a mapped program")
  empty = {k: (v.shape[1:], v.dtype) for k, v in x.items() if v.size == 0}

  def step(g):
    return pj.allreduce({**g, **{k: jnp.zeros(sh, dt) for k, (sh, dt) in empty.items()}}, s, AX)

  got = jax.pmap(step, axis_name=AX)({k: v for k, v in x.items() if k not in empty})
  for k, v in x.items():
    assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
    if jnp.issubdtype(v.dtype, jnp.inexact):
      want = np.asarray(v, np.float64).mean(0).astype(np.asarray(v).dtype)
      np.testing.assert_array_equal(np.asarray(got[k][0], np.float64), np.asarray(want, np.float64), k)
    else:
      np.testing.assert_array_equal(got[k], v)


def test_compiled_pmap_keeps_one_allreduce_per_chunk_in_order():
  tree = {"a": jnp.zeros((4, 5)), "b": jnp.zeros(7), "h": jnp.zeros((3, 3), jnp.bfloat16)}
  s = _schedule(tree, {0: (10,)})
  c = jax.pmap(lambda g: pj.allreduce(g, s, AX), axis_name=AX).lower(_per_device(tree)).compile()
  report = pj.audit(c, s)
  assert report.ok, report.describe()
  assert report.order == tuple(range(s.num_allreduces)) and s.num_allreduces == 4


# --------------------------------------------------------------------------------------------------
# bad input: clear errors at trace time, never a silent wrong result


def _trace(fn, tree):
  return jax.eval_shape(jax.pmap(fn, axis_name=AX), _per_device(tree))


TREE = {"a": jnp.zeros((4, 5)), "b": jnp.zeros(7)}


def test_schedule_for_another_tree_names_path_shape_dtype():
  s = _schedule(TREE)
  with pytest.raises(pj.ScheduleMismatchError, match=r"leaf 'a' has shape \(5, 4\).*\(4, 5\)"):
    _trace(lambda g: pj.allreduce(g, s, AX), {"a": jnp.zeros((5, 4)), "b": jnp.zeros(7)})
  with pytest.raises(pj.ScheduleMismatchError, match=r"leaf 'b' has dtype bfloat16.*float32"):
    _trace(lambda g: pj.allreduce(g, s, AX), {"a": jnp.zeros((4, 5)), "b": jnp.zeros(7, jnp.bfloat16)})
  with pytest.raises(pj.ScheduleMismatchError, match=r"row for leaf 'b'.*no leaf at that path"):
    _trace(lambda g: pj.allreduce(g, s, AX), {"a": jnp.zeros((4, 5)), "c": jnp.zeros(7)})
  with pytest.raises(pj.ScheduleMismatchError, match=r"floating leaf 'extra'.*does not cover"):
    _trace(lambda g: pj.allreduce(g, s, AX), {**TREE, "extra": jnp.zeros(2)})


def test_unbound_axis_and_empty_tree_and_wrong_types():
  s = _schedule(TREE)
  with pytest.raises(pj.UnboundAxisError, match=r"axis_name='nope'.*inside jax.pmap"):
    jax.eval_shape(lambda g: pj.allreduce(g, s, "nope"), TREE)
  with pytest.raises(pj.UnboundAxisError, match="outside a mapped context"):
    _trace(lambda g: pj.allreduce(g, s, "other"), TREE)
  with pytest.raises(ValueError, match="the gradient tree is empty"):
    jax.eval_shape(jax.pmap(lambda x: pj.allreduce({}, s, AX), axis_name=AX), jnp.zeros(NDEV))
  with pytest.raises(TypeError, match="must be a prophet_jax.Schedule"):
    _trace(lambda g: pj.allreduce(g, "schedule.json", AX), TREE)
  with pytest.raises(TypeError, match="`mean` must be True or False"):
    _trace(lambda g: pj.allreduce(g, s, AX, mean="yes"), TREE)


def test_edited_schedule_json_fails_on_load():
  s = _schedule(TREE, {0: (10,)})
  d = json.loads(s.to_json())
  d["buckets"][0][0]["slices"][0][2] -= 1  # drop an element
  with pytest.raises(pj.ScheduleError, match="drops elements of leaf"):
    pj.Schedule.from_json(json.dumps(d))
  d = json.loads(s.to_json())
  d["rows"][0][1] = [5, 4]  # another tree, fingerprint kept
  with pytest.raises(pj.ScheduleError, match="tree_fingerprint"):
    pj.Schedule.from_json(json.dumps(d))


def test_already_reduced_gradients_under_shard_map():
  s = _schedule(TREE)
  mesh = jax.make_mesh((NDEV,), (AX,))

  def step(p, x):
    g = jax.grad(lambda p: jnp.sum(p["a"]) * jnp.sum(x) + jnp.sum(p["b"] * jnp.sum(x)))(p)
    return pj.allreduce(g, s, AX)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P()))
  p = jax.device_put(TREE, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones(NDEV), NamedSharding(mesh, P(AX)))
  with pytest.raises(pj.AlreadyReducedError, match=r"gradient 'a' is already summed over axis 'data'"):
    f.trace(p, x)
  ok = jax.jit(jax.shard_map(lambda p, x: step(jax.lax.pcast(p, AX, to="varying"), x), mesh=mesh,
                             in_specs=(P(), P(AX)), out_specs=P()))
  out = ok(p, x)
  np.testing.assert_allclose(out["a"], np.full((4, 5), 1.0))  # mean over devices of sum(x_local) = 1
