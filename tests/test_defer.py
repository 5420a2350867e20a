"""_defer: DLCP's deferral groups in the jitted step, against the host oracle (tests/_defer_ref.py).

Integer-valued gradients make every sum, mean and norm exact, so the step must equal the oracle bit
for bit: conservation (sent + residual = the true sum) element for element, the deferred fraction,
never twice in a row, the same choice on every device, one compile, the compiled all-reduces (count,
sizes, order), and k = 0 as the lossless path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _placement import NDEV, replicate
import prophet_jax as pj
from prophet_jax._rewrite import _defer, _states
from prophet_jax._compiled import _gpu
from prophet_jax._compiled._hlo import hlo_text, parse_hlo
from prophet_jax._compiled._hlo_collectives import collectives
from tests._defer_ref import RefDefer

AX = "data"
STEPS = 5
TREE = {"a": jnp.zeros((6, 10)), "b": jnp.zeros(37), "c": jnp.zeros(5), "d": jnp.zeros(9)}


def _schedule(defer=(2, 1), release=1.0):
  """c (lossless), then a+b as 6 chunks deferring defer[0], then d as 3 chunks deferring defer[1]
  (each group releasing `release` of a residual per send)."""
  rows = pj.GradientProfile.from_params(TREE).tree_rows()
  r = {p.split("/")[-1].strip("[]'"): i for i, (p, _, _) in enumerate(rows)}
  ch = lambda *s: pj.Chunk(slices=s, dtype="float32")  # noqa: E731
  a, b, c, d = r["a"], r["b"], r["c"], r["d"]
  g1 = (ch((a, 0, 16)), ch((a, 16, 32)), ch((a, 32, 48)), ch((a, 48, 60), (b, 0, 4)), ch((b, 4, 20)),
        ch((b, 20, 37)))
  g2 = (ch((d, 0, 3)), ch((d, 3, 6)), ch((d, 6, 9)))
  return pj.Schedule(buckets=(pj.Bucket(chunks=(ch((c, 0, 5)),)),
                              pj.Bucket(chunks=g1, defer=defer[0], release=release),
                              pj.Bucket(chunks=g2, defer=defer[1], release=release)), rows=rows)


def _grads(seed):
  """STEPS steps of per-device integer-valued gradients, some chunks much larger than others."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    g = {k: rng.integers(-8, 8, (NDEV, *v.shape)).astype(np.float32) for k, v in TREE.items()}
    g["a"][:, rng.integers(0, 6)] *= 3  # a row of a several times larger: it should rank first
    out.append(g)
  return out


def _rows(schedule, g):
  keys = [p.split("/")[-1].strip("[]'") for p, _, _ in schedule.rows]
  return keys, [g[k] for k in keys]


def _check_against_oracle(schedule, grads, outs, states):
  """Each step equals the oracle bit for bit; conservation; fraction; never twice; same on all devices."""
  ref = RefDefer(schedule, NDEV)
  keys, _ = _rows(schedule, grads[0])
  total = {k: np.zeros(TREE[k].shape) for k in keys}
  sent = {k: np.zeros(TREE[k].shape) for k in keys}
  sizes = {k: int(np.prod(TREE[k].shape)) for k in keys}
  for t, (g, out, st) in enumerate(zip(grads, outs, states)):
    want = dict(zip(keys, ref.step(_rows(schedule, g)[1])))
    for k in keys:
      got = np.asarray(out[k])
      for dev in range(NDEV):  # every device holds the same reduced values
        np.testing.assert_array_equal(got[dev], want[k], err_msg=f"step {t} leaf {k} device {dev}")
      total[k] += g[k].sum(0)
      sent[k] += NDEV * want[k]
    for gi, (idx, mask) in enumerate(zip(st.index, st.deferred)):
      idx, mask = np.asarray(idx), np.asarray(mask)
      assert (idx == idx[:1]).all(), f"step {t} group {gi}: devices hold different indices {idx}"
      assert (mask == mask[:1]).all(), f"step {t} group {gi}: devices deferred different chunks {mask}"
      assert set(np.flatnonzero(mask[0])) == set(ref.history[-1][gi])
    deferred = sum(grp["bucket"].chunks[int(i)].size for grp, wait in zip(ref.groups, ref.history[-1])
                   for i in wait)
    assert deferred / sum(sizes.values()) <= schedule.max_deferred_fraction + 1e-12
  for a, b in zip(ref.history, ref.history[1:]):
    for ga, gb in zip(a, b):
      assert not set(ga) & set(gb), f"a chunk deferred twice in a row: {ga} then {gb}"
  # the device residual equals the oracle's, and sent + residual = the true sum, element for element
  res = dict(zip(keys, ref.residual_rows()))
  last = states[-1]
  for grp, idx, r in zip(ref.groups, last.index, last.residual):
    np.testing.assert_array_equal(np.asarray(r)[:, 0], grp["residual"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(idx)[0], grp["index"])
  for k in keys:
    np.testing.assert_array_equal(sent[k] + res[k], total[k], err_msg=f"conservation of leaf {k}")
  return ref


TRACES: dict = {}


@functools.lru_cache(maxsize=None)
def _pmap_step(schedule):
  def step(g, st):
    TRACES[schedule] = TRACES.get(schedule, 0) + 1
    return pj.allreduce(g, schedule, AX, defer_state=st)
  return jax.pmap(step, axis_name=AX)


def _run_pmap(schedule, grads):
  st = jax.pmap(lambda _: _defer.init(schedule), axis_name=AX)(np.arange(NDEV))  # sharded as steps return it
  step = _pmap_step(schedule)
  outs, states = [], []
  for g in grads:
    out, st = step(g, st)
    outs.append(out)
    states.append(st)
  return step, outs, states


@pytest.mark.parametrize("release", [1.0, 0.5])
def test_pmap_equals_oracle_conserves_and_agrees_across_devices(release):
  s = _schedule(release=release)
  grads = _grads(0)
  step, outs, states = _run_pmap(s, grads)
  ref = _check_against_oracle(s, grads, outs, states)
  assert any(h != ref.history[0] for h in ref.history[1:]), "the magnitude ranking never moved"
  assert TRACES[s] == 1  # static shapes: one trace (one compile) for every step


def test_shard_map_equals_oracle_state_specs_and_one_compile():
  s = _schedule()
  grads = _grads(1)
  mesh = jax.make_mesh((NDEV,), (AX,))
  st0 = _defer.init(s)
  specs = _states.state_specs(st0, AX)

  def body(g, st):
    g = jax.tree.map(lambda x: x[0], g)
    out, st = pj.allreduce(g, s, AX, defer_state=st)
    return jax.tree.map(lambda x: x[None], out), st

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(AX), specs)))
  init = jax.jit(jax.shard_map(lambda: _defer.init(s), mesh=mesh, in_specs=(), out_specs=specs))
  st = init()
  assert st.residual[0].shape == (NDEV, 2, 17)  # each device's own residual on the leading axis
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(AX)))  # noqa: E731
  outs, states = [], []
  for g in grads:
    out, st = step(jax.tree.map(put, g), st)
    outs.append(out)
    # replicated leaves as the devices hold them: one copy per device, so disagreement would show
    per_device = lambda xs: tuple(np.stack([np.asarray(sh.data) for sh in x.addressable_shards])  # noqa: E731
                                  for x in xs)
    states.append(st._replace(index=per_device(st.index), deferred=per_device(st.deferred),
                              residual=tuple(np.asarray(x)[:, None] for x in st.residual)))
  _check_against_oracle(s, grads, outs, states)
  assert step._cache_size() == 1


def test_compiled_allreduces_are_the_slots_in_order():
  s = _schedule()
  st = replicate(_defer.init(s))
  g = {k: jnp.zeros((NDEV, *v.shape)) for k, v in TREE.items()}
  text = hlo_text(_pmap_step(s).lower(g, st).compile())
  ops = collectives(parse_hlo(text))
  assert len(ops) == s.num_allreduces == 7
  assert tuple(op.instruction.elements for op in ops) == s.allreduce_sizes() == (5, 17, 17, 17, 17, 3, 3)
  scopes = [int(op.instruction.op_name.split("prophet/chunk")[1].split("/")[0]) for op in ops]
  assert scopes == list(range(7))


def _reduce_chunks_before_issue_18(flat, chunks, row_leaf, axis_name, divisor):
  """The lossless engine as it was before deferral groups and links (main at b3124b2), verbatim."""
  from prophet_jax._rewrite._collectives import chunk_scope, tie
  flat = list(flat)
  pieces, touched, prev = {}, [], None
  for k, chunk in enumerate(chunks):
    parts = [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in chunk.slices]
    with jax.named_scope(chunk_scope(k)):
      buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      buf = tie(buf, prev)
      red = jax.lax.psum(buf, axis_name)
      red = red / jnp.asarray(divisor, red.dtype)
    prev = red
    off = 0
    for r, a, b in chunk.slices:
      if r not in pieces:
        pieces[r] = []
        touched.append(r)
      pieces[r].append((a, red[off:off + (b - a)]))
      off += b - a
  for r in touched:
    i = row_leaf[r]
    segs = [x for _, x in sorted(pieces[r], key=lambda t: t[0])]
    full = segs[0] if len(segs) == 1 else jnp.concatenate(segs)
    flat[i] = full.reshape(np.shape(flat[i]))
  return flat


def test_k0_is_the_lossless_path_same_hlo():
  """A schedule whose groups defer 0 is lossless: no state, and the very program of the engine
  before deferral existed."""
  from prophet_jax._values._checks import match_tree
  s0 = _schedule(defer=(0, 0))
  assert not s0.defers and s0.num_allreduces == 10 and _defer.init(s0) is None
  g = {k: jnp.zeros((NDEV, *v.shape)) for k, v in TREE.items()}

  def step(g):  # one name for both, so the modules' names match
    return fn(g)

  def before(g):
    lw, td = jax.tree_util.tree_flatten_with_path(g)
    lmap = match_tree(lw, s0)
    flat = _reduce_chunks_before_issue_18([x for _, x in lw], s0.chunks, lmap.row_leaf, AX, NDEV)
    return jax.tree_util.tree_unflatten(td, flat)

  fn = lambda g: pj.allreduce(g, s0, AX)  # noqa: E731
  a = jax.pmap(step, axis_name=AX).lower(g).compile().as_text()
  fn = before
  b = jax.pmap(step, axis_name=AX).lower(g).compile().as_text()
  assert a == b


def test_state_from_another_schedule_or_shape_raises():
  s, other = _schedule(), _schedule(defer=(1, 1))
  g = {k: jnp.zeros((NDEV, *v.shape)) for k, v in TREE.items()}
  bcast = replicate
  # a state of another schedule of this tree is a re-plan's: the step names convert_state (after
  # which the first step continues from s's own state, tests/test_replan.py), and one that does not
  # record its schedule cannot be converted: the error names both and says how to keep it
  with pytest.raises(pj.ScheduleMismatchError, match="convert_state"):
    _pmap_step(s)(g, bcast(_defer.init(other)))
  _, new = _pmap_step(s)(g, pj.convert_state(bcast(_defer.init(other)), TREE, s))
  assert new.tag == _defer.init(s).tag
  o = _defer.init(other)
  bare = o._replace(tag=_states.StateTag(o.tag.key, o.tag.fingerprint, o.tag.layout))
  fresh = jax.pmap(lambda g, st: pj.allreduce(g, s, AX, defer_state=st), axis_name=AX)
  with pytest.raises(pj.ScheduleMismatchError, match=r"another schedule.*same tree but with other deferral"
                                                      r".*deferred_grads"):
    fresh(g, bcast(bare))
  bad = _defer.init(s)
  bad = bad._replace(residual=(jnp.zeros((1, 2, 16)),) + bad.residual[1:])
  with pytest.raises(pj.ScheduleMismatchError, match=r"residual of group 1 .* shape \(1, 2, 16\)"):
    _pmap_step(s)(g, bcast(bad))
  with pytest.raises(TypeError, match=r"defers \(2 deferral groups.*prophet_jax.defer_state\(schedule\)"):
    _pmap_step(s)(g, None)


def test_nan_norms_never_defer_a_chunk_twice_in_a_row():
  """Chunks whose reduced values overflowed rank after the chunks deferred last step (not with them,
  as a literal "NaN counts as +inf" with ties by index would): staleness stays one step."""
  s = _schedule()
  g = _grads(2)[:2]
  g[0]["a"][:, :] = np.nan  # chunks 0-3 of the first group get NaN norms at step 1 (4 and 5 wait)
  _, _, states = _run_pmap(s, g)
  assert tuple(np.asarray(states[0].index[0])[0]) == (4, 5)
  assert tuple(np.asarray(states[1].index[0])[0]) == (2, 3)  # 4, 5 sent first; then 0, 1 by index


def test_links_over_one_on_the_cpu_raise_naming_the_value():
  s = dataclasses.replace(_schedule(defer=(0, 0)), links=(0, 1) * 5)
  g = {k: jnp.zeros((NDEV, *v.shape)) for k, v in TREE.items()}
  with pytest.raises(ValueError, match=r"links=2 tie chains, more links than the platform can run at once "
                                       r"\(cpu: 1"):
    jax.pmap(lambda g: pj.allreduce(g, s, AX), axis_name=AX)(g)


# XLA:GPU (compile-only H100s): two tie chains put two all-reduces in flight at once, given the flags
STRIPE_FLAGS = {"xla_gpu_all_reduce_combine_threshold_bytes": 0,
                "xla_gpu_experimental_parallel_collective_overlap_limit": 2}
# jaxlib 0.12 runs these small all-reduces as one-shot collective kernels, one at a time; the claim is
# about NCCL's all-reduces (docs/facts.md, "XLA:GPU 0.12's collective kernels")
NCCL_PATH = {"xla_gpu_experimental_use_collective_kernels": ""}


def _gpu_step(schedule, topo, model):
  import optax
  params = model.abstract_params()
  batch = jax.eval_shape(lambda k: model.make_batch(k, 16), jax.random.key(0))
  tx = optax.sgd(0.1, momentum=0.9)
  mesh = topo.mesh(AX)

  def body(p, o, b):
    loss, g = jax.value_and_grad(model.loss_fn)(jax.lax.pcast(p, AX, to="varying"), b)
    g = pj.allreduce(g, schedule, AX)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss[None]

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=(P(), P(), P(AX))))
  return step.lower(topo.abstract(params, P(), mesh=mesh),
                    topo.abstract(jax.eval_shape(tx.init, params), P(), mesh=mesh),
                    topo.abstract(batch, P(AX), mesh=mesh))


@pytest.mark.gpu
def test_gpu_two_links_two_allreduces_in_flight():
  from prophet_jax.models import get_model
  topo = pj.gpu_topology("h100", devices=NDEV)
  stripe = {**STRIPE_FLAGS, **(NCCL_PATH if _gpu.xla_option_accepted(*next(iter(NCCL_PATH.items()))) else {})}
  m = get_model("cnn")
  prof = pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3)
  net = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-10, workers=NDEV, links=2)
  s2 = pj.plan(prof, net, "wfbp")
  assert len(set(s2.links)) == 2
  s1 = dataclasses.replace(s2, links=())
  two = pj.audit(_gpu_step(s2, topo, m).compile(compiler_options=stripe), s2)
  assert two.ok and two.max_in_flight == 2, two.describe()
  one = pj.audit(_gpu_step(s1, topo, m).compile(compiler_options=stripe), s1)
  assert one.ok and one.max_in_flight == 1, one.describe()  # one chain: the tie keeps one in flight
  # default flags (as measured with each flag alone too): XLA keeps one in flight and interleaves the
  # two chains, so the planned order is lost, and audit says so
  default = pj.audit(_gpu_step(s2, topo, m).compile(), s2)
  assert not default.ok and default.max_in_flight == 1, default.describe()


# --------------------------------------------------------------------------------------------------
# through `scheduled`: a planned dlcp schedule on a small model, sgd(momentum), 8 devices

LR = 0.05
SCHED_STEPS = 4
WRONG_SCALE = NDEV / (NDEV - 1)  # the negative control: the sum divided by n - 1
# a bandwidth-bound link on which deferral pays for a 46 kB model (a preset's start-ups cost more)
SLOW = pj.NetworkModel(workers=NDEV, alpha_s=1e-6, beta_s_per_byte=1e-7)
MAX_DEFER = 0.25


@functools.lru_cache(maxsize=None)
def _mlp():
  from prophet_jax.models import get_model
  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  batches = [m.make_batch(jax.random.key(100 + t), 32) for t in range(SCHED_STEPS)]
  return m, params, batches


@functools.lru_cache(maxsize=None)
def _mlp_plan(max_defer):
  _, params, _ = _mlp()
  prof = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  # spread 4 and every layer: issue 18's plan (three groups of four chunks, 13 chunks), which these
  # tests of the rewrite were written for (the default plan has fewer, larger groups)
  return pj.plan(prof, SLOW, "dlcp", max_defer=max_defer, spread=4, all_layers=True)


def _zero_defer(s):
  """The same chunks with every group's `defer` set to 0: the lossless path."""
  return dataclasses.replace(s, buckets=tuple(dataclasses.replace(b, defer=0) for b in s.buckets))


def _capture():
  """An optax member whose state is the update it was given: the reduced gradient `scheduled` applied."""
  import optax
  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda u, s, p=None: (u, u))


def _tx(schedule):
  import optax
  return pj.scheduled(optax.chain(_capture(), optax.sgd(LR, momentum=0.9)), schedule, axis_name=AX)


def _scaled(scale):
  """The one engine's test seam: every sum divided by n / scale instead of n."""
  from prophet_jax._rewrite._collectives import engine_hooks
  return engine_hooks(divisor=lambda n: n / scale)


@functools.lru_cache(maxsize=None)
def _sched_step(schedule, mapping):
  """(compiled step(params, opt_state, batch, scale) -> (params, opt_state), initial opt_state, put).

  `scale` is a runtime scalar: the engine divides each sum by n / scale (1: the library's own mean,
  exactly; n / (n - 1): a 14% gradient-scale bug), injected through the engine's test seam while
  this step is traced."""
  import optax
  m, params, _ = _mlp()
  tx = _tx(schedule)

  def step(p, opt, batch, scale):
    with _scaled(scale):
      pv = jax.lax.pcast(p, AX, to="varying") if mapping == "shard_map" else p
      g = jax.grad(m.loss_fn)(pv, batch)
      u, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  one = jnp.float32(1)
  if mapping == "pmap":
    f = jax.pmap(step, axis_name=AX, in_axes=(0, 0, 0, None))
    rep = replicate
    opt0 = rep(tx.init(params))  # made once outside the map, replicated: zero residuals serve every device
    put = lambda b: jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), b)  # noqa: E731
    p0 = rep(params)
    compiled = f.lower(p0, opt0, put(_mlp()[2][0]), one).compile()
  else:
    mesh = jax.make_mesh((NDEV,), (AX,))
    specs = pj.state_specs(jax.eval_shape(tx.init, params), AX)
    opt0 = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AX), P()), out_specs=(P(), specs)))
    put = lambda b: jax.device_put(b, NamedSharding(mesh, P(AX)))  # noqa: E731
    p0 = jax.device_put(params, NamedSharding(mesh, P()))
    one = jax.device_put(one, NamedSharding(mesh, P()))
    compiled = f.lower(p0, opt0, put(_mlp()[2][0]), one).compile()
  return compiled, p0, opt0, put


def _copies(x):
  """Every device's copy of a replicated (or per-device) array: (NDEV, ...)."""
  if hasattr(x, "addressable_shards") and len(x.addressable_shards) == NDEV and x.ndim and \
      all(sh.data.shape == x.shape for sh in x.addressable_shards):
    return np.stack([np.asarray(sh.data) for sh in x.addressable_shards])
  return np.asarray(x)


@functools.lru_cache(maxsize=None)
def _sched_run(schedule, mapping, scale=1.0):
  """Runs SCHED_STEPS steps; per step: params before it, the applied reduced gradient (host),
  each device's DeferState (indices, norms, residuals), as host arrays."""
  compiled, p, opt, put = _sched_step(schedule, mapping)
  one = lambda t: jax.tree.map(lambda x: np.asarray(x)[0], t) if mapping == "pmap" else jax.device_get(t)  # noqa: E731
  out = []
  for b in _mlp()[2]:
    before = one(p)
    p, opt = compiled(p, opt, put(b), jnp.float32(scale))
    d = opt.defer_state
    out.append({"params": before, "applied": one(opt.inner[0]),
                "index": [_copies(x) for x in d.index] if d is not None else [],
                "deferred": [_copies(x) for x in d.deferred] if d is not None else [],
                "norms": [_copies(x) for x in d.norms] if d is not None else [],
                "residual": [np.asarray(x).reshape(NDEV, *x.shape[-2:]) for x in d.residual] if d is not None else []})
  return out, one(p)


@functools.lru_cache(maxsize=None)
def _true_grads():
  """The single-device full-batch gradient (the loss is a mean: the mean of the devices' gradients)."""
  return jax.jit(jax.grad(_mlp()[0].loss_fn))


def _leaf_paths(tree):
  from prophet_jax._values._tree import path_str
  return {path_str(p): np.asarray(x, np.float64).reshape(-1) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _residual_leaves(schedule, groups_residual, groups_index, like):
  """The mean over devices of each group's residual rows, scattered to the leaves' elements."""
  flat = {k: np.zeros_like(v) for k, v in like.items()}
  for g, res, idx in zip(_defer.defer_groups(schedule), groups_residual, groups_index):
    mean = np.asarray(res, np.float64).mean(0)  # (k, c)
    for row, j in zip(mean, idx[0]):
      off = 0
      for r, a, b in g.chunks[int(j)].slices:
        flat[schedule.rows[r][0]][a:b] += row[off:off + b - a]
        off += b - a
  return flat


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_scheduled_defers_within_budget_never_twice_same_everywhere_and_conserves(mapping):
  """sgd(momentum) through `scheduled` on a multi-chunk dlcp plan: per step at most max_defer of the
  elements wait, never a chunk twice in a row, the same chunks (and bitwise the same norms) on all 8
  devices; and the reduced gradients applied over the steps plus the final residual's mean equal the
  sum of the true full-batch gradients element for element (nothing lost). The n - 1 divisor fails."""
  s = _mlp_plan(MAX_DEFER)
  groups = _defer.defer_groups(s)
  assert len(groups) >= 2 and s.num_allreduces > len(groups), s.describe()
  total = sum(int(np.prod(sh)) for _, sh, _ in s.rows)
  steps, _ = _sched_run(s, mapping)
  grad = _true_grads()
  m, _, batches = _mlp()
  for t, st in enumerate(steps):
    deferred = 0
    for g, mask, norms in zip(groups, st["deferred"], st["norms"]):
      assert (mask == mask[:1]).all(), f"step {t}: devices deferred different chunks {mask}"
      assert (norms.view(np.uint32) == norms[:1].view(np.uint32)).all(), f"step {t}: norms differ"
      assert mask[0].sum() == g.defer
      deferred += sum(g.chunks[int(j)].size for j in np.flatnonzero(mask[0]))
      if t:
        prev = steps[t - 1]["deferred"][groups.index(g)][0]
        assert not (prev & mask[0]).any(), f"step {t}: deferred twice in a row"
    assert 0 < deferred / total <= MAX_DEFER
  assert any((a["deferred"][0][0] != b["deferred"][0][0]).any() for a, b in zip(steps, steps[1:])), \
      "the magnitude ranking never moved"

  def conservation(run):
    applied = {k: np.zeros_like(v) for k, v in _leaf_paths(run[0]["params"]).items()}
    true = {k: np.zeros_like(v) for k, v in applied.items()}
    for st, b in zip(run, batches):
      for k, v in _leaf_paths(st["applied"]).items():
        applied[k] += v
      for k, v in _leaf_paths(grad(st["params"], b)).items():
        true[k] += v
    res = _residual_leaves(s, run[-1]["residual"], run[-1]["index"], applied)
    scale = max(float(np.max(np.abs(v))) for v in true.values())
    for k in true:
      np.testing.assert_allclose(applied[k] + res[k], true[k], rtol=0, atol=1e-5 * scale, err_msg=k)

  conservation(steps)
  wrong, _ = _sched_run(s, mapping, WRONG_SCALE)
  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    conservation(wrong)


def test_audit_expects_the_slots_of_a_deferring_scheduled_step():
  """The compiled `scheduled` pmap step of the dlcp plan: `num_allreduces` all-reduces (a group's
  m - k slots, not its m chunks) of `allreduce_sizes()` elements, in issue order."""
  s = _mlp_plan(MAX_DEFER)
  compiled = _sched_step(s, "pmap")[0]
  report = pj.audit(compiled, s)
  assert report.ok, report.describe()
  assert report.planned == report.chunk_allreduces == s.num_allreduces < len(s.chunks)
  assert tuple(e.elements for e in report.chunks) == s.allreduce_sizes()
  assert report.order == tuple(range(s.num_allreduces))
  # the same step read against the lossless schedule of the same chunks: the slots are missing
  lossless = pj.audit(compiled, _zero_defer(s))
  assert not lossless.ok and any("have no all-reduce" in p for p in lossless.problems)


def _pmean_step():
  """The plain step: jax.lax.pmean of the gradients, then the same optimizer (no schedule)."""
  import optax
  m, params, _ = _mlp()
  tx = optax.chain(_capture(), optax.sgd(LR, momentum=0.9))

  def step(p, opt, batch):
    g = jax.lax.pmean(jax.grad(m.loss_fn)(p, batch), AX)
    u, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  rep = replicate
  p, opt = rep(params), rep(tx.init(params))
  f = jax.pmap(step, axis_name=AX)
  for b in _mlp()[2]:
    p, opt = f(p, opt, jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), b))
  return jax.tree.map(lambda x: np.asarray(x)[0], p)


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_k0_through_scheduled_equals_plain_pmean(mapping):
  """The dlcp plan's chunks with nothing deferred (13 chunks): no state, and SCHED_STEPS steps of
  sgd(momentum) equal the plain pmean step (docs/design.md's tolerance); n - 1 fails."""
  from tests._assert import assert_trees_close
  s0 = _zero_defer(_mlp_plan(MAX_DEFER))
  assert not s0.defers and s0.num_allreduces == len(s0.chunks) > 8
  _, _, opt0, _ = _sched_step(s0, mapping)
  assert opt0.defer_state is None
  ref, before = _pmean_step(), _mlp()[1]
  _, got = _sched_run(s0, mapping)
  assert_trees_close(got, ref, before)
  _, wrong = _sched_run(s0, mapping, WRONG_SCALE)
  with pytest.raises(AssertionError, match="max"):
    assert_trees_close(wrong, ref, before)


def test_max_defer_0_is_the_lossless_plan_and_the_same_hlo():
  """plan(..., 'dlcp', max_defer=0) is auto's plan, and its `scheduled` step compiles to the same
  program as the lossless plan's (no deferral state, no extra op)."""
  import optax
  s0, auto = _mlp_plan(0.0), pj.plan(pj.GradientProfile.from_params(_mlp()[1], forward_s=1e-3,
                                                                     backward_s=2e-3), SLOW, "auto")
  assert s0.buckets == auto.buckets and not s0.defers and s0.policy == "dlcp"
  m, params, batches = _mlp()
  rep = replicate
  b = jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), batches[0])

  def text(s):
    tx = pj.scheduled(optax.sgd(LR, momentum=0.9), s, axis_name=AX)

    def step(p, opt, batch):
      u, opt = tx.update(jax.grad(m.loss_fn)(p, batch), opt, p)
      return optax.apply_updates(p, u), opt

    return jax.pmap(step, axis_name=AX).lower(rep(params), rep(tx.init(params)), b).compile().as_text()

  a, b = [text(s) for s in (s0, auto)]  # one call site: the source locations in the metadata match
  assert a == b


def test_scheduled_bad_input_links_state_of_another_schedule_and_replicated_residual():
  """At trace time, through `scheduled`: links > 1 on the CPU names the value; the state of another
  deferring schedule (other groups, same tree) is a ScheduleMismatchError naming both; under
  shard_map a residual passed with P() (not state_specs) names state_specs."""
  import optax
  m, params, batches = _mlp()
  s, other = _mlp_plan(MAX_DEFER), _mlp_plan(0.1)
  assert other.defers and _defer.defer_groups(other) != _defer.defer_groups(s)
  rep = replicate
  b = jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), batches[0])

  def lower(s, opt_from):
    tx = pj.scheduled(optax.sgd(LR), s, axis_name=AX)

    def step(p, opt, batch):
      return tx.update(jax.grad(m.loss_fn)(p, batch), opt, p)

    return jax.pmap(step, axis_name=AX).lower(rep(params), rep(pj.scheduled(optax.sgd(LR), opt_from, axis_name=AX)
                                                                 .init(params)), b)

  striped = dataclasses.replace(s, links=(0, 1) * (s.num_allreduces // 2) + (0,) * (s.num_allreduces % 2))
  with pytest.raises(ValueError, match=r"scheduled: the schedule stripes .* links=2 .*\(cpu: 1"):
    lower(striped, striped)
  with pytest.raises(pj.ScheduleMismatchError, match="convert_state"):
    lower(s, other)   # another plan's state of this tree: convert it outside the step
  with pytest.raises(TypeError, match=r"scheduled: the schedule defers .* got NoneType"):
    lower(s, _zero_defer(s))  # a lossless state (no deferral state) for a deferring schedule
  # shard_map, the whole optimizer state replicated: each device's residual would be lost
  mesh = jax.make_mesh((NDEV,), (AX,))
  tx = pj.scheduled(optax.sgd(LR), s, axis_name=AX)

  def body(p, opt, batch):
    return tx.update(jax.grad(m.loss_fn)(jax.lax.pcast(p, AX, to="varying"), batch), opt, p)

  bad = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P()))
  with pytest.raises(ValueError, match=r"residual of group 0 .* is replicated over axis 'data' .* "
                                       r"prophet_jax.state_specs\(state, 'data'\)"):
    bad.lower(jax.device_put(params, NamedSharding(mesh, P())),
              jax.device_put(tx.init(params), NamedSharding(mesh, P())),
              jax.device_put(batches[0], NamedSharding(mesh, P(AX))))


@functools.lru_cache(maxsize=None)
def _hooked_run(schedule, mapping, scale=1.0):
  """`hooked` with the deferral state: grad_fn(params, batch, defer_state) -> (loss, grads, state),
  then chain(capture, sgd(momentum)); the final params and each step's chosen chunks."""
  import optax
  m, params, batches = _mlp()
  grad_fn = pj.hooked(m.loss_fn, schedule, axis_name=AX)
  tx = optax.chain(_capture(), optax.sgd(LR, momentum=0.9))

  def step(p, opt, dstate, batch, scale):
    with _scaled(scale):
      _, g, dstate = grad_fn(p, batch, dstate)
      u, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, u), opt, dstate

  d0 = pj.defer_state(schedule)
  if mapping == "pmap":
    rep = replicate
    f = jax.pmap(step, axis_name=AX, in_axes=(0, 0, 0, 0, None))
    p, opt, d = rep(params), rep(tx.init(params)), rep(d0)
    put = lambda b: jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), b)  # noqa: E731
    one = lambda t: jax.tree.map(lambda x: np.asarray(x)[0], t)  # noqa: E731
  else:
    mesh = jax.make_mesh((NDEV,), (AX,))
    specs = pj.state_specs(d0, AX)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), specs, P(AX), P()),
                              out_specs=(P(), P(), specs)))
    d = jax.jit(jax.shard_map(lambda: pj.defer_state(schedule), mesh=mesh, in_specs=(), out_specs=specs))()
    p, opt = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    put = lambda b: jax.device_put(b, NamedSharding(mesh, P(AX)))  # noqa: E731
    one = jax.device_get
  f = f.lower(p, opt, d, put(batches[0]), jnp.float32(scale)).compile()
  chosen = []
  for b in batches:
    p, opt, d = f(p, opt, d, put(b), jnp.float32(scale))
    chosen.append([_copies(x) for x in d.deferred])
  return one(p), chosen, f


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_hooked_with_the_deferral_state_equals_scheduled(mapping):
  """hooked's grad_fn(params, batch, defer_state) -> (loss, grads, new_state) on the dlcp plan: the
  all-reduces inside the backward pass defer the same chunks at every step (on all 8 devices) as
  `scheduled`, and SCHED_STEPS steps of sgd(momentum) end at the same params (docs/design.md's
  tolerance); the n - 1 divisor fails; the compiled step keeps the slots (audit)."""
  from tests._assert import assert_trees_close
  s = _mlp_plan(MAX_DEFER)
  steps, ref = _sched_run(s, mapping)
  got, chosen, f = _hooked_run(s, mapping)
  for t, (st, ch) in enumerate(zip(steps, chosen)):
    for a, b in zip(st["deferred"], ch):
      assert (b == b[:1]).all(), f"step {t}: devices deferred different chunks {b}"
      np.testing.assert_array_equal(a[0], b[0], err_msg=f"step {t}")
  assert_trees_close(got, ref, _mlp()[1])
  wrong, _, _ = _hooked_run(s, mapping, WRONG_SCALE)
  with pytest.raises(AssertionError, match="max"):
    assert_trees_close(wrong, ref, _mlp()[1])
  report = pj.audit(f, s)
  assert report.ok and report.chunk_allreduces == s.num_allreduces, report.describe()
  assert tuple(e.elements for e in report.chunks) == s.allreduce_sizes()
  assert report.inside_backward >= 1, "hooked all-reduces should run while backward still runs"


def test_release_checked_saved_and_shaping_the_state():
  """`Bucket.release`: a number in (0, 1], meaningless (stored as 1) without deferral; JSON keeps it (and files
  without it load as 1); a damped group's state has a residual row per chunk, and a state of the
  undamped schedule is refused by the damped one (another schedule key)."""
  ch = pj.Chunk(slices=((0, 0, 4),), dtype="float32")
  two = (ch, pj.Chunk(slices=((0, 4, 8),), dtype="float32"))
  for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.1"):
    with pytest.raises(pj.ScheduleError, match=r"release="):
      pj.Bucket(chunks=two, defer=1, release=bad)
  assert pj.Bucket(chunks=two, release=0.5) == pj.Bucket(chunks=two)   # no residual: stored as 1
  damped, undamped = _schedule(release=0.25), _schedule()
  assert pj.Schedule.from_json(damped.to_json()) == damped
  assert '"release"' in damped.to_json() and '"release"' not in undamped.to_json()
  st = _defer.init(damped)
  assert [r.shape for r in st.residual] == [(1, 6, 17), (1, 3, 3)]
  assert [tuple(np.asarray(i)) for i in st.index] == [tuple(range(6)), tuple(range(3))]
  with pytest.raises(pj.ScheduleMismatchError, match="another schedule"):
    _defer.check_state(_defer.init(undamped), damped, "test")


def test_undamped_state_converted_into_a_damped_schedule_loses_nothing():
  """A re-plan from release 1 to release 0.5 (same groups), through convert_state: the old residual
  goes into the first damped step; sent + the new residual = every gradient, element for element."""
  old, new = _schedule(), _schedule(release=0.5)
  grads = _grads(2)
  st = jax.pmap(lambda _: _defer.init(old), axis_name=AX)(np.arange(NDEV))
  keys = [p.split("/")[-1].strip("[]'") for p, _, _ in old.rows]
  sent = {k: np.zeros(TREE[k].shape) for k in keys}
  for t, g in enumerate(grads):
    if t == 2:
      st = pj.convert_state(st, TREE, new)
    out, st = _pmap_step(old if t < 2 else new)(g, st)
    for k in keys:
      sent[k] += NDEV * np.asarray(out[k])[0]
  assert st.residual[0].shape == (NDEV, 1, 6, 17)
  left = jax.pmap(lambda s: pj.deferred_grads(s, TREE), axis_name=AX)(st)
  for k in keys:
    np.testing.assert_allclose(sent[k] + np.asarray(left[k]).sum(0), sum(g[k].sum(0) for g in grads),
                               rtol=0, atol=1e-4, err_msg=f"leaf {k}")


def test_damped_bfloat16_group_keeps_a_float32_residual_and_loses_nothing():
  """A damped bfloat16 group keeps its residual in float32 and puts back what the bfloat16 cast of a
  send rounded away: the values sent + the residual = every gradient, to float32 rounding, although
  the exact sends (the float64 oracle's, r = 0.3) hold fractions bfloat16 cannot. Only device 0's
  gradients are nonzero, so the all-reduce itself adds nothing but zeros (no rounding of its own)."""
  tree = {"a": jnp.zeros(60, jnp.bfloat16)}
  rows = pj.GradientProfile.from_params(tree).tree_rows()
  parts = tuple(pj.Chunk(slices=((0, 15 * i, 15 * (i + 1)),), dtype="bfloat16") for i in range(4))
  s = pj.Schedule(buckets=(pj.Bucket(chunks=parts, defer=1, release=0.3),), rows=rows)
  assert _defer.init(s).residual[0].dtype == jnp.float32
  rng = np.random.default_rng(3)
  grads = []
  for _ in range(6):
    g = np.zeros((NDEV, 60), np.float32)
    g[0] = rng.integers(-100, 100, 60)
    grads.append({"a": g.astype(jnp.bfloat16)})
  step = jax.pmap(lambda g, st: pj.allreduce(g, s, AX, defer_state=st), axis_name=AX)
  st = jax.pmap(lambda _: _defer.init(s), axis_name=AX)(np.arange(NDEV))
  ref = RefDefer(s, NDEV)
  sent, exact_sends = np.zeros(60), []
  for g in grads:
    out, st = step(g, st)
    sent += NDEV * np.asarray(out["a"][0], np.float64)
    exact_sends.append(NDEV * ref.step([np.asarray(g["a"], np.float64)], dtype=np.float64)[0])
  exact = np.concatenate(exact_sends)
  assert np.any(exact != exact.astype(jnp.bfloat16).astype(np.float64)), "no send needed rounding"
  left = np.asarray(st.residual[0], np.float64)[:, 0].sum(0).reshape(-1)
  total = sum(np.asarray(g["a"], np.float64).sum(0) for g in grads)
  np.testing.assert_allclose(sent + left, total, rtol=0, atol=1e-4)
