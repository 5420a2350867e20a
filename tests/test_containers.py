"""The state helpers on the containers users hold (issue 35): `unshard_state`, `shard_state`,
`state_specs`, `deferred_grads` x a flax `TrainState`, an `nnx.Optimizer`, `nnx.state(optimizer)`, a
dict, a `PipelinedState`, an optax chain's tuple x the plan families (lossless all-reduce, `dlcp`,
`dear`, `every_k`), as a pairwise cover (every pair of any two of the three dimensions appears in a row).

Each cell's right result is checked against the same helper on the bare library state (itself tested
against the full-batch step in tests/test_zero.py and tests/test_defer.py) and against the values put in:
the round trip `shard_state(unshard_state(x))` gives back the arrays exactly, `deferred_grads` gives the
residual's known values at their elements (nonzero: a helper that returns zeros fails), the specs give
`P(axis)` exactly where the per-device parts are. A cell where the helper has nothing to act on (no
sharded state to unshard) must be a clear error. No step is compiled: host values only.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax._rewrite._accumulate import AccumState
from prophet_jax._rewrite._defer import DeferState
from prophet_jax._rewrite._pipelined import PipelinedState
from prophet_jax._rewrite._transform import ScheduledState

AX = "dp"
N = 8
NET = pj.NetworkModel.preset("10gbe", workers=N)
TX = optax.sgd(0.1, momentum=0.9)
CONTAINERS = ("train_state", "nnx_optimizer", "nnx_state", "dict", "pipelined", "chain")
HELPERS = ("unshard_state", "shard_state", "state_specs", "deferred_grads")
FAMILIES = ("lossless", "dlcp", "dear", "every_k")


class Model(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 3, rngs=rngs)
    self.b = nnx.Linear(3, 2, rngs=rngs)


def _deferring(params) -> pj.Schedule:
  """One deferral group of two chunks (the first leaf cut in two, k=1), then the rest lossless."""
  prof = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  rows = prof.tree_rows()
  ch = lambda *s: pj.Chunk(slices=s, dtype="float32")  # noqa: E731
  size0 = int(np.prod(rows[0][1]))
  rest = tuple(ch((r, 0, int(np.prod(shape)))) for r, (_, shape, _) in enumerate(rows) if r)
  return pj.Schedule(buckets=(pj.Bucket(chunks=(ch((0, 0, size0 // 2)), ch((0, size0 // 2, size0))), defer=1),
                              pj.Bucket(chunks=rest)), rows=rows)


class World:
  """Params, schedules and one state of every family with known values (host arrays)."""

  def __init__(self, params):
    self.params = params
    prof = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
    self.sched = {"lossless": pj.plan(prof, NET, "wfbp"), "dlcp": _deferring(params),
                  "dear": pj.plan(prof, NET, "dear"), "every_k": pj.plan(prof, NET, "wfbp")}
    rng = np.random.default_rng(1)
    self.whole = jax.tree.map(lambda x: rng.standard_normal(np.shape(x)).astype(np.float32), TX.init(params))
    d = pj.defer_state(self.sched["dlcp"])
    self.defer = d._replace(residual=tuple(rng.standard_normal(np.shape(r)).astype(np.float32)
                                           for r in d.residual))
    rows = self.sched["every_k"].rows
    self.accum = AccumState(count=np.int32(1), grads=tuple(rng.standard_normal((1, *s)).astype(np.float32)
                                                           for _, s, _ in rows))
    self.sharded = pj.shard_state(self.whole, TX, params, self.sched["dear"], N)

  def state(self, family: str) -> ScheduledState:
    return {"lossless": ScheduledState(inner=self.whole),
            "dlcp": ScheduledState(inner=self.whole, defer_state=self.defer),
            "dear": ScheduledState(inner=self.sharded),
            "every_k": ScheduledState(inner=self.whole, accum=self.accum)}[family]


@pytest.fixture(scope="module")
def worlds():
  tree = {"a": {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}, "c": {"w": jnp.ones((3, 2))}}
  model = Model(nnx.Rngs(0))
  return {"tree": World(tree), "nnx": World(nnx.state(model, nnx.Param)), "model": model}


def _wrap(container: str, family: str, w: World, model) -> object:
  st = w.state(family)
  if container == "train_state":
    return TrainState(step=3, apply_fn=None, params=w.params, tx=TX, opt_state=st)
  if container == "dict":
    return {"opt": st, "step": 3}
  if container == "chain":
    return (st, optax.EmptyState())
  if container == "pipelined":
    return PipelinedState(params=w.params, opt_state=st.inner, pending=None, defer=st.defer_state)
  opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
  opt.opt_state = nnx.data(nnx.training.optimizer.to_opt_state(st))
  return opt if container == "nnx_optimizer" else nnx.state(opt)


def _leaves(x):
  return [np.asarray(v) for v in jax.tree.leaves(x)]


def _same_arrays(a, b) -> bool:
  la, lb = _leaves(a), _leaves(b)
  return len(la) == len(lb) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(la, lb))


def _pairwise_cover() -> list[tuple[str, str, str]]:
  """A small set of (container, helper, family) rows holding every pair of any two dimensions."""
  want = {(i, a, b) for i, (da, db) in enumerate([(CONTAINERS, HELPERS), (CONTAINERS, FAMILIES),
                                                  (HELPERS, FAMILIES)]) for a in da for b in db}
  rows: list[tuple[str, str, str]] = []
  cells = list(itertools.product(CONTAINERS, HELPERS, FAMILIES))
  while want:   # greedy: the cell covering the most pairs still wanted
    c, h, f = max(cells, key=lambda r: len({(0, r[0], r[1]), (1, r[0], r[2]), (2, r[1], r[2])} & want))
    rows.append((c, h, f))
    want -= {(0, c, h), (1, c, f), (2, h, f)}
  return rows


ROWS = _pairwise_cover()


def test_the_rows_are_a_pairwise_cover():
  for i, j in [(0, 1), (0, 2), (1, 2)]:
    dims = [CONTAINERS, HELPERS, FAMILIES]
    assert {(r[i], r[j]) for r in ROWS} == set(itertools.product(dims[i], dims[j]))
  assert len(ROWS) <= 30


def _expected_error(container: str, helper: str, family: str):
  """The clear error a cell must give where the helper has nothing to act on, else None."""
  if helper == "unshard_state" and family != "dear":
    return TypeError, "neither is nor holds"
  if helper == "shard_state" and family in ("dlcp", "every_k") and container != "pipelined":
    return ValueError, "would drop"
  if helper == "deferred_grads" and family == "dlcp" and container == "nnx_state":
    return ValueError, "schedule="
  return None


@pytest.mark.parametrize("container, helper, family", ROWS, ids=["-".join(r) for r in ROWS])
def test_helper_on_container(worlds, container, helper, family):
  w = worlds["nnx" if container.startswith("nnx") else "tree"]
  obj = _wrap(container, family, w, worlds["model"])
  before = jax.tree.map(np.copy, jax.tree.leaves(obj))
  sched = w.sched[family]
  err = _expected_error(container, helper, family)
  if helper == "shard_state" and family == "dear":
    sched = w.sched["dear"]
  call = {
      "unshard_state": lambda: pj.unshard_state(obj, TX, w.params, sched),
      "shard_state": lambda: pj.shard_state(obj, TX, w.params, w.sched["dear"], N),
      "state_specs": lambda: pj.state_specs(obj, AX),
      "deferred_grads": lambda: pj.deferred_grads(obj, w.params),
  }[helper]
  if err is not None:
    with pytest.raises(err[0], match=err[1]):
      call()
    return
  out = call()
  assert _same_arrays(jax.tree.leaves(obj), before), "the input was mutated"
  if container == "nnx_optimizer":
    assert isinstance(out, nnx.State) or helper == "deferred_grads"
  elif helper != "deferred_grads":
    assert type(out) is type(obj) or (container == "nnx_state" and isinstance(out, nnx.State)), type(out)
  check = {"unshard_state": _check_unshard, "shard_state": _check_shard, "state_specs": _check_specs,
           "deferred_grads": _check_deferred}[helper]
  check(out, w, family, container)


def _typed(out, container):
  """The library state out of a helper's result in any container (nnx: rebuilt by path)."""
  if isinstance(out, nnx.State):
    return out
  if container == "train_state":
    return out.opt_state
  if container == "dict":
    return out["opt"]
  if container == "chain":
    return out[0]
  return out


def _check_unshard(out, w, family, container):
  got = _typed(out, container)
  want = w.whole
  if container == "pipelined":
    assert _same_arrays(got.opt_state, want)
  elif isinstance(got, nnx.State):
    assert _same_arrays(got["opt_state"]["inner"], want)
  else:
    assert isinstance(got.inner, type(want)) and _same_arrays(got.inner, want)
  # control: an unshard that mixed the shards' order would not be the whole state
  assert not _same_arrays(w.sharded.per_device, want)


def _check_shard(out, w, family, container):
  got = _typed(out, container)
  if container == "pipelined":
    inner = got.opt_state
  elif isinstance(got, nnx.State):
    inner = got["opt_state"]["inner"]["per_device"]
    assert _same_arrays(inner, w.sharded.per_device)
    return
  else:
    inner = got.inner
  assert isinstance(inner, pj.ShardedState)
  assert _same_arrays(inner.per_device, w.sharded.per_device) and inner.tag == w.sharded.tag
  assert _same_arrays(pj.unshard_state(inner, TX, w.params, w.sched["dear"]), w.whole)


def _check_specs(out, w, family, container):
  specs = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, P))
  split = sum(s == P(AX) for s in specs)
  n_per = {"lossless": 0, "dear": len(jax.tree.leaves(w.sharded.per_device)),
           "dlcp": len(w.defer.residual), "every_k": len(w.accum.grads)}[family]
  if container == "pipelined" and family == "every_k":
    n_per = 0   # a PipelinedState holds the tx state and the deferral state only
  assert split == n_per, (split, n_per, out)


def _check_deferred(out, w, family, container):
  assert jax.tree.structure(out) == jax.tree.structure(w.params)
  total = sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(out))
  if family != "dlcp" or (container == "pipelined" and family != "dlcp"):
    assert total == 0
    return
  want = pj.deferred_grads(w.defer, w.params)
  assert total > 0 and _same_arrays(out, want)


# -- rows beside the matrix ----------------------------------------------------------------------------


def test_deferred_grads_of_an_nnx_state_with_the_schedule(worlds):
  w = worlds["nnx"]
  st = _wrap("nnx_state", "dlcp", w, worlds["model"])
  got = pj.deferred_grads(st, w.params, schedule=w.sched["dlcp"])
  assert _same_arrays(got, pj.deferred_grads(w.defer, w.params))
  assert sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(got)) > 0


def test_deferred_grads_of_a_non_state_is_a_type_error(worlds):
  w = worlds["tree"]
  for garbage in ("garbage", {"a": 1}, w.whole, TrainState(step=0, apply_fn=None, params=w.params, tx=TX,
                                                             opt_state=w.whole)):
    with pytest.raises(TypeError, match="neither is nor holds"):
      pj.deferred_grads(garbage, w.params)


def test_deferred_grads_outside_a_mapping_gives_the_per_device_stack(worlds):
  w = worlds["tree"]
  rng = np.random.default_rng(2)
  glob = w.defer._replace(residual=tuple(rng.standard_normal((N, *np.shape(r)[1:])).astype(np.float32)
                                         for r in w.defer.residual))
  stack = pj.deferred_grads(ScheduledState(inner=w.whole, defer_state=glob), w.params)
  mean = pj.deferred_grads(ScheduledState(inner=w.whole, defer_state=glob), w.params, average=True)
  for i in (0, N - 1):
    one = w.defer._replace(residual=tuple(r[i:i + 1] for r in glob.residual))
    assert _same_arrays(jax.tree.map(lambda x: x[i], stack), pj.deferred_grads(one, w.params))
  assert all(np.allclose(np.asarray(m), np.asarray(s).mean(0)) for m, s in
             zip(jax.tree.leaves(mean), jax.tree.leaves(stack)))
  assert all(np.shape(s)[0] == N for s in jax.tree.leaves(stack))


def test_unshard_and_shard_name_both_transformations(worlds):
  w = worlds["tree"]
  adam = optax.adam(0.1)
  with pytest.raises(pj.ShardingError, match="TraceState") as e:
    pj.unshard_state(w.state("dear"), adam, w.params, w.sched["dear"])
  assert "ScaleByAdamState" in str(e.value) and "Array(" not in str(e.value) and len(str(e.value)) < 800
  with pytest.raises(pj.ShardingError, match="ScaleByAdamState") as e:
    pj.shard_state(w.whole, adam, w.params, w.sched["dear"], N)
  assert "TraceState" in str(e.value) and "Array(" not in str(e.value)


@pytest.mark.parametrize("n, exc", [(2.7, TypeError), (True, TypeError), ("8", TypeError), (0, ValueError)])
def test_shard_state_lax_n(worlds, n, exc):
  w = worlds["tree"]
  with pytest.raises(exc, match=f"n={n!r}"):
    pj.shard_state(w.whole, TX, w.params, w.sched["dear"], n)


@pytest.mark.parametrize("axis", [None, 3, "", ("dp", 3)])
def test_state_specs_lax_axis_name(worlds, axis):
  with pytest.raises(TypeError, match="axis_name="):
    pj.state_specs(worlds["tree"].state("dear"), axis)


def test_deferred_grads_of_an_nnx_optimizer_and_its_opt_state(worlds):
  """The issue's two nnx cases: the optimizer (or its opt_state, OptArray variables inside) gives the
  deferred values, not zeros and not jax's `__jax_array__` error."""
  w = worlds["nnx"]
  opt = _wrap("nnx_optimizer", "dlcp", w, worlds["model"])
  want = pj.deferred_grads(w.defer, w.params)
  assert sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(want)) > 0
  for given in (opt, opt.opt_state):
    assert _same_arrays(pj.deferred_grads(given, w.params), want)


def test_the_mesh_grad_fn_gives_the_deferred_values_averaged(worlds):
  """`hooked(..., mesh=)`'s grad_fn.deferred_grads, as MeshPipelined's: the devices' deferred values
  averaged (replicated), which equal the mean of the per-device stack deferred_grads gives outside."""
  from jax.sharding import NamedSharding

  w = worlds["tree"]
  mesh = jax.make_mesh((N,), (AX,))
  rng = np.random.default_rng(3)
  glob = w.defer._replace(residual=tuple(rng.standard_normal((N, *np.shape(r)[1:])).astype(np.float32)
                                         for r in w.defer.residual))
  glob = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), glob, pj.state_specs(glob, AX))
  g = pj.hooked(lambda p, x: jnp.mean(x @ p["a"]["w"]), w.sched["dlcp"], axis_name=AX, mesh=mesh)
  got = g.deferred_grads(glob, jax.device_put(w.params, NamedSharding(mesh, P())))
  want = pj.deferred_grads(glob, w.params, average=True)
  assert all(np.allclose(np.asarray(a), np.asarray(b), atol=1e-6) for a, b in zip(jax.tree.leaves(got),
                                                                                  jax.tree.leaves(want)))
  assert sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(got)) > 0


@pytest.mark.parametrize("container", ["train_state", "pipelined", "dict"])
def test_the_issues_crash_unshard_of_a_dear_state_in_its_container(worlds, container):
  """unshard_state of a TrainState, a PipelinedState, {"opt": opt_state, "step": 3} holding a dear
  state: `'int' object has no attribute 'tag'` before; the whole state in the same container now."""
  w = worlds["tree"]
  obj = _wrap(container, "dear", w, worlds["model"])
  out = pj.unshard_state(obj, TX, w.params, w.sched["dear"])
  assert type(out) is type(obj)
  _check_unshard(out, w, "dear", container)
  if container == "train_state":
    assert out.step == 3 and _same_arrays(out.params, obj.params)


def test_deferred_grads_of_an_nnx_optimizer_of_a_plain_tx_is_a_type_error(worlds):
  opt = nnx.Optimizer(worlds["model"], TX, wrt=nnx.Param)
  with pytest.raises(TypeError, match="in the given Optimizer: it neither is nor holds"):
    pj.deferred_grads(opt, worlds["nnx"].params)
