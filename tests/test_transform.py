"""scheduled / hooked: N steps of sgd(momentum) equal the single-device full batch and the plain pmean step.

The engine sees a schedule's chunks, not the policy that planned them, so the compiled matrix runs the
chunk shapes every policy makes (`SHAPES`: a chunk per layer, buckets merging layers, leaves cut into
small partitions sent out of ready order, one bucket split by dtype), and a pure test shows each policy's
plan on every model and dtype (all-bfloat16 models included) has the engine-visible features of a
compiled case (each policy keeps its own conformance checks in test_schedulers). A pairwise cover of
shape x model x {float32, mixed bf16/f32} x {pmap, shard_map} x {scheduled, hooked}: every pair of values
of any two factors is run at least once (13 compiled steps instead of 96), except `per-dtype` with a
single dtype, which is one all-reduce by definition. Every case plans several chunks (asserted): a
network with a small start-up cost keeps the merging policies from merging everything, `bucket` gets
buckets of a quarter of the model, `priority` small partitions. Each compiled step is also audited: the
planned number of chunk all-reduces, in schedule order, with the user's pmean of the loss listed apart.

Negative control: the same compiled step, run with the all-reduce's divisor n replaced by n - 1 (a
14% gradient-scale bug, injected through the one engine's test seam, `_collectives.engine_hooks`, and
a runtime scalar), must fail the comparison in every case, bf16 included. The check is also shown to
fail for a wrong scale (psum) and a lost slice.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from _assert import assert_trees_close
from _placement import NDEV, replicate, shard, unrep
from _reference import full_batch
from prophet_jax._rewrite import _collectives
from prophet_jax.models import get_model

AX = "data"
N_STEPS = 2
BATCH = 16
LR = 0.05
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
# the chunk shapes the engine sees, each made by the policy that makes it most plainly
SHAPES = {"per-layer": "wfbp", "merged": "bucket", "cut": "priority", "per-dtype": "xla"}
MODELS = ("mlp", "cnn", "gpt-tiny")
# mixed: bfloat16 kernels, float32 biases and norm scales. A model all in bfloat16 shows the engine nothing
# that mixed does not (its chunks are bfloat16 chunks like mixed's; `engine_features` is per dtype): its
# plans are checked below, its steps not compiled.
DTYPES = ("float32", "mixed")
PLAN_DTYPES = ("float32", "bfloat16", "mixed")
MAPPINGS = ("pmap", "shard_map")
TRANSFORMS = ("scheduled", "hooked")
FACTORS = (tuple(SHAPES), MODELS, DTYPES, MAPPINGS, TRANSFORMS)
# A start-up cost small enough that mgwfbp, prophet and auto keep several chunks (at 10GbE's they merge
# the small models into one all-reduce).
NETWORK = pj.NetworkModel(alpha_s=1e-5, beta_s_per_byte=1e-9, workers=NDEV, overlap=True)
WRONG_SCALE = NDEV / (NDEV - 1)  # the negative control: the sum divided by n - 1


def feasible(row) -> bool:
  """`per-dtype` is one all-reduce per dtype: only mixed dtypes give it several chunks."""
  return row[0] != "per-dtype" or row[2] == "mixed"


def pairwise_cover() -> list[tuple[str, str, str, str, str]]:
  """Feasible rows covering every feasible pair of values of any two factors (greedy, deterministic)."""
  need = _all_pairs()
  rows = []
  for pol, model in itertools.product(SHAPES, MODELS):
    best = max((rest for rest in itertools.product(DTYPES, MAPPINGS, TRANSFORMS)
                if feasible((pol, model) + rest)),
               key=lambda rest: len(_pairs((pol, model) + rest) & need))
    row = (pol, model) + best
    need -= _pairs(row)
    rows.append(row)
  while need:  # top up with feasible rows
    i, a, j, b = sorted(need)[0]
    row = max((r for r in itertools.product(*FACTORS) if r[i] == a and r[j] == b and feasible(r)),
              key=lambda r: len(_pairs(r) & need))
    need -= _pairs(row)
    rows.append(row)
  return rows


def _pairs(row):
  return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(5), 2)}


def _all_pairs():
  """Every pair of factor values that some feasible row contains."""
  return set().union(*(_pairs(r) for r in itertools.product(*FACTORS) if feasible(r)))


CASES = pairwise_cover()


def test_pairwise_cover_is_complete_and_small():
  got = set().union(*(_pairs(r) for r in CASES))
  assert got == _all_pairs()
  assert all(feasible(r) for r in CASES)
  assert len(CASES) <= 13
  infeasible = {(i, a, j, b) for i, j in itertools.combinations(range(5), 2) for a in FACTORS[i]
                for b in FACTORS[j]} - got
  assert infeasible == {(0, "per-dtype", 2, "float32")}


def engine_features(s: pj.Schedule) -> frozenset:
  """What the engine's gather, all-reduce and scatter see of a plan, beyond its sizes: chunks of each dtype,
  holding several leaves, leaves cut over several chunks, chunks issued out of ready order (not back to
  front), buckets holding several chunks (one per dtype), more than one link."""
  firsts = [min(r for r, _, _ in c.slices) for c in s.chunks]
  owners: dict = {}
  for i, c in enumerate(s.chunks):
    for r, _, _ in c.slices:
      owners.setdefault(r, set()).add(i)
  cut = {r for r, v in owners.items() if len(v) > 1}
  dtypes = {c.dtype for c in s.chunks}
  return frozenset(name for name, present in (
      *((f"{dt} chunks", True) for dt in dtypes),
      *((f"{dt} chunks of several leaves", any(c.dtype == dt and len({r for r, _, _ in c.slices}) > 1
                                                for c in s.chunks)) for dt in dtypes),
      *((f"{dt} leaves cut", any(s.rows[r][2] == dt for r in cut)) for dt in dtypes),
      ("out of ready order", firsts != sorted(firsts, reverse=True)),
      ("several chunks per bucket", len(s.buckets) < len(s.chunks)),
      ("several links", len(set(s.links)) > 1)) if present)


def test_every_policys_plans_have_the_engine_features_of_a_compiled_case():
  """The compiled matrix runs shapes, not policies: every policy's plan of every model and dtype shows
  the engine features that one compiled case shows all together (so it runs the same code paths), and
  every shape in the matrix has the features it is named for."""
  compiled = {engine_features(schedule_for(model, dtype, shape)) for shape, model, dtype, *_ in CASES}
  for policy, model, dtype in itertools.product(POLICIES, MODELS, PLAN_DTYPES):
    got = engine_features(schedule_for(model, dtype, policy))
    assert any(got <= seen for seen in compiled), (policy, model, dtype, sorted(got), [sorted(f) for f in compiled])
  named = {"merged": "chunks of several leaves", "cut": "leaves cut", "per-dtype": "several chunks per bucket"}
  for shape, model, dtype, *_ in CASES:
    got = engine_features(schedule_for(model, dtype, shape))
    want = named.get(shape, "chunks of several leaves" if dtype != "mixed" else "several chunks per bucket")
    assert any(f.endswith(want) for f in got), (shape, model, dtype, sorted(got))
  assert "out of ready order" in engine_features(schedule_for("mlp", "float32", "cut"))


# --------------------------------------------------------------------------------------------------
# shared set-up and references (cached: each is compiled once per session)


@functools.lru_cache(maxsize=None)
def setup(model: str, dtype: str):
  m = get_model(model, param_dtype="bfloat16" if dtype == "mixed" else dtype)
  params = m.init(jax.random.key(0))
  if dtype == "mixed":  # the model computes in bf16; biases and norm scales are kept in f32
    params = jax.tree.map(lambda x: x.astype(jnp.float32) if x.ndim <= 1 else x, params)
  batches = [m.make_batch(jax.random.key(10 + i), BATCH) for i in range(N_STEPS)]
  return m, params, batches


@functools.lru_cache(maxsize=None)
def schedule_for(model: str, dtype: str, policy: str) -> pj.Schedule:
  """`policy`'s plan, or the plan of the policy that makes a shape in `SHAPES`."""
  policy = SHAPES.get(policy, policy)
  _, params, _ = setup(model, dtype)
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  # partitions smaller than the largest leaves: half of the mlp's kernels (4 KiB in float32)
  mlp_half = 2048 if dtype == "float32" else 1024
  options = {"priority": {"partition_bytes": mlp_half if model == "mlp" else 4096},
             "bucket": {"bucket_bytes": profile.total_nbytes // 4}}.get(policy, {})
  return pj.plan(profile, NETWORK, policy, **options)


def _tx():
  return optax.sgd(LR, momentum=0.9)


@functools.lru_cache(maxsize=None)
def single_device_reference(model: str, dtype: str):
  """N steps on one device with the full batch: the ground truth."""
  m, params, batches = setup(model, dtype)
  return full_batch(m.loss_fn, params, _tx(), batches)[0]


# on the host, placed as pmap places its own outputs (tests/_placement.py): an eager jnp op per leaf
# shape would compile a small program each
_replicate, _split = replicate, shard


@functools.lru_cache(maxsize=None)
def pmean_reference(model: str, dtype: str):
  """N steps of the plain user step: jax.pmap, grads pmean'd, then sgd."""
  m, params, batches = setup(model, dtype)
  tx = _tx()

  def step(p, o, batch):
    g = jax.lax.pmean(jax.grad(m.loss_fn)(p, batch), AX)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  f = jax.pmap(step, axis_name=AX)
  p, o = _replicate(params), _replicate(tx.init(params))
  for b in batches:
    p, o = f(p, o, _split(b))
  return unrep(p)


def assert_close(got, ref, before, *, rel=None):
  """docs/design.md's tolerance (tests/_assert.py), with two floors it cannot express per leaf.

  - A leaf whose true gradient is zero (e.g. an attention key bias: softmax ignores a shift) has an
    "update" made of float noise; its error is held to 1e-4 (bfloat16: 1e-3) of the largest update in
    the tree instead.
  - bfloat16 params are rounded after every update, so two computations of the same step can differ
    by one ulp of the param itself; that ulp (2**-8 |ref|) is allowed on top.
  The floors are far below a wrong scale (errors ~ 7x the update) or a lost slice (~ the update); a
  14% scale error fails it in every case of the matrix (the negative control).
  """
  leaves = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
  g, r, b = leaves(got), leaves(ref), leaves(before)
  assert len(g) == len(r) == len(b)
  as64 = lambda v: np.asarray(v, dtype=np.float64)
  global_update = max(float(np.max(np.abs(as64(y) - as64(z)), initial=0)) for (_, y), (_, z) in zip(r, b))
  sub = []
  for (path, x), (_, y), (_, z) in zip(g, r, b):
    name = pj_path(path)
    dtype = str(np.asarray(y).dtype)
    x64, y64, z64 = as64(x), as64(y), as64(z)
    if x64.size == 0:
      continue
    update = float(np.max(np.abs(y64 - z64)))
    tol = rel if rel is not None else (1e-2 if dtype == "bfloat16" else 1e-3)
    floor = 1e-4 * global_update
    if dtype == "bfloat16":
      floor = max(1e-3 * global_update, 2.0 ** -8 * float(np.max(np.abs(y64))))
    err = float(np.max(np.abs(x64 - y64)))
    assert err <= tol * update + floor, (f"{name}: max|got-ref|={err:.3e} > {tol:g} * update size "
                                         f"{update:.3e} + floor {floor:.3e}")
    sub.append(name)
  assert sub, "no leaf compared"


def _mesh():
  return jax.make_mesh((NDEV,), (AX,))


# Test-only instrumentation of the library's one engine, through its seam (`_collectives.engine_hooks`),
# active while a step is traced under `_instrument(scale, record)`:
# - the negative control: the engine divides by n / scale instead of n, `scale` a runtime scalar
#   argument of the compiled step: with scale = 1 that is the library's own division, exactly; with
#   scale = n / (n - 1) it divides by n - 1 (a 14% gradient-scale bug);
# - the same-rounding reference: it records each chunk's gathered buffer (the per-device values the
#   all-reduce receives, in the chunk's dtype), which the step returns, so the test can reduce exactly
#   those values itself and apply the optimizer to them (`teacher_forced_reference`).
def _instrument(scale, record):
  return _collectives.engine_hooks(divisor=lambda n: n / scale, gathered=record.__setitem__)


def build_step(model, dtype, policy, mapping, transform, compiler_options=None):
  """(compiled step(carry, batch, scale) -> (carry, loss, chunk buffers), initial carry, batches in
  the mapping's layout, carry -> params, schedule)."""
  m, params, batches = setup(model, dtype)
  s = schedule_for(model, dtype, policy)
  tx = _tx()
  if transform == "scheduled":
    carry = TrainState.create(apply_fn=m.apply, params=params, tx=pj.scheduled(tx, s, axis_name=AX))

    def user_step(state, batch):
      p = state.params
      if mapping == "shard_map":  # own the all-reduce: no implicit psum from check_vma
        p = jax.lax.pcast(p, AX, to="varying")
      loss, g = jax.value_and_grad(m.loss_fn)(p, batch)
      return state.apply_gradients(grads=g), jax.lax.pmean(loss, AX)

    get_params = lambda c: c.params
  else:
    grad_fn = pj.hooked(m.loss_fn, s, axis_name=AX)
    carry = (params, tx.init(params))

    def user_step(c, batch):
      p, o = c
      loss, g = grad_fn(p, batch)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), jax.lax.pmean(loss, AX)

    get_params = lambda c: c[0]

  def step(carry, batch, scale):
    record = {}
    with _instrument(scale, record):
      carry, loss = user_step(carry, batch)
    assert sorted(record) == list(range(s.num_allreduces)), sorted(record)
    bufs = [record[k] if mapping == "pmap" else record[k][None] for k in range(s.num_allreduces)]
    return carry, loss, bufs

  one = jnp.float32(1)
  if mapping == "pmap":
    f = jax.pmap(step, axis_name=AX, in_axes=(0, 0, None))
    carry, bs = _replicate(carry), [_split(b) for b in batches]
    unbox = lambda c: unrep(get_params(c))
  else:
    mesh = _mesh()
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AX), P()),
                              out_specs=(P(), P(), P(AX))))
    carry = jax.device_put(carry, NamedSharding(mesh, P()))
    bs = [jax.device_put(b, NamedSharding(mesh, P(AX))) for b in batches]
    one = jax.device_put(one, NamedSharding(mesh, P()))
    unbox = lambda c: jax.device_get(get_params(c))
  compiled = f.lower(carry, bs[0], one).compile(compiler_options=compiler_options)
  return compiled, carry, bs, unbox, s


def run_steps(compiled, carry, bs, unbox, scale):
  """Final params, and per step the chunk buffers each device sent ([chunk] -> (NDEV, size))."""
  sent = []
  for b in bs:
    carry, loss, bufs = compiled(carry, b, jnp.float32(scale))
    assert np.all(np.isfinite(np.asarray(loss, np.float32)))
    sent.append([np.asarray(jax.device_get(x)) for x in bufs])
  return unbox(carry), sent


@functools.lru_cache(maxsize=None)
def _reference_update(model: str, dtype: str):
  tx = _tx()

  @jax.jit
  def update(p, o, g):
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  return tx, update


def teacher_forced_reference(model, dtype, schedule, sent):
  """The optimizer applied to the exact mean of the values each device sent, step by step.

  Each chunk's per-device buffers are summed in float64, rounded to the chunk's dtype and divided by
  n (what `psum` then the mean does), scattered into the leaves by the schedule's slices, and sgd
  (momentum) is applied on one device. This rounds the way the step does (the same gradient values,
  the same bf16 rounding of the reduced gradients and of the update), so it holds bf16 to docs/design.md's
  1e-2 of the update, and it is independent of the library's gather, all-reduce and scatter.
  """
  _, params, _ = setup(model, dtype)
  tx, update = _reference_update(model, dtype)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  index = {pj_path(kp): i for i, (kp, _) in enumerate(leaves_with_path)}
  p, o = params, tx.init(params)
  for bufs in sent:
    flat = [np.zeros(np.size(x), np.float64) for _, x in leaves_with_path]
    for chunk, buf in zip(schedule.chunks, bufs):
      assert buf.shape[0] == NDEV
      total = np.sum(np.asarray(buf, np.float64), axis=0)
      mean = np.asarray(jnp.asarray(total, jnp.float32).astype(chunk.dtype) / jnp.asarray(NDEV, chunk.dtype),
                        np.float64)
      off = 0
      for r, a, b in chunk.slices:
        flat[index[schedule.rows[r][0]]][a:b] = mean[off:off + b - a]
        off += b - a
    g = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(v.reshape(np.shape(x)), x.dtype)
                                               for v, (_, x) in zip(flat, leaves_with_path)])
    p, o = update(p, o, g)
  return jax.device_get(p)


@pytest.mark.parametrize("shape,model,dtype,mapping,transform", CASES)
def test_numerics_and_audit(shape, model, dtype, mapping, transform):
  _, params, _ = setup(model, dtype)
  compiled, carry, bs, unbox, s = build_step(model, dtype, shape, mapping, transform)
  assert s.num_allreduces > 1, f"{s.policy} planned one chunk: the case proves nothing about order"
  got, sent = run_steps(compiled, carry, bs, unbox, 1.0)
  # docs/design.md's tolerance (1e-3 float32, 1e-2 bfloat16) against the same values reduced by the test
  assert_close(got, teacher_forced_reference(model, dtype, s, sent), params)
  # and the whole computation against the single-device full batch and the plain pmean step: exact to
  # docs/design.md's tolerance in float32; with bf16 compute, the same batch's gradients computed by another
  # program (one device; pmap instead of shard_map; another fusion) round differently, by up to 0.15
  # of the update measured (float32 biases of a bf16 model included), so there the whole-step check
  # is a coarse one (a psum instead of a pmean is 8x, a lost slice 1x the update)
  for ref in (single_device_reference(model, dtype), pmean_reference(model, dtype)):
    assert_close(got, ref, params, rel=None if dtype == "float32" else 0.25)
  # the negative control: the same compiled step dividing by n - 1 fails, in every case
  wrong, sent_wrong = run_steps(compiled, carry, bs, unbox, WRONG_SCALE)
  with pytest.raises(AssertionError, match="max"):
    assert_close(wrong, teacher_forced_reference(model, dtype, s, sent_wrong), params)
  # the compiled plain-user step keeps the plan: count, order, sizes; the loss pmean is foreign
  report = pj.audit(compiled, s)
  assert report.ok, report.describe()
  assert report.chunk_allreduces == s.num_allreduces
  assert report.order == tuple(range(s.num_allreduces))
  assert [e.elements for e in report.chunks] == [c.size for c in s.chunks]
  assert sum(e.elements for e in report.foreign) >= 1  # the user's pmean of the loss
  if transform == "hooked":
    assert report.inside_backward >= 1, "hooked all-reduces should run while backward still runs"


def test_the_suites_backend_optimisation_level_leaves_the_hlo_and_its_audit_unchanged():
  """tests/conftest.py compiles the suite at XLA's backend (LLVM) optimisation level 0: the optimized HLO
  that every audit and HLO test reads is byte for byte the one of level 3 (XLA's default), here for a
  cnn step with backward hooks (test_gpu.py shows the same for XLA:GPU)."""
  policy, model, dtype, mapping, transform = next(c for c in CASES if c[1] == "cnn" and c[4] == "hooked")
  texts, audits = [], []
  for level in (0, 3):
    compiled, *_, s = build_step(model, dtype, policy, mapping, transform,
                                 compiler_options={"xla_backend_optimization_level": level})
    texts.append(compiled.as_text())
    audits.append(pj.audit(compiled, s).describe())
  assert texts[0] == texts[1], (policy, model, dtype, mapping, transform)
  assert audits[0] == audits[1] and audits[0].startswith("audit: OK"), audits[0]


def test_check_fails_for_wrong_scale_and_lost_slice():
  """The equivalence check is sharp: psum instead of pmean, or one slice left unreduced, fails it."""
  model, dtype = "mlp", "float32"
  m, params, batches = setup(model, dtype)
  s = schedule_for(model, dtype, "priority")
  tx = _tx()
  victim = s.chunks[len(s.chunks) // 2]
  r, a, b = victim.slices[0]
  path = s.rows[r][0]

  def lose_slice(g_local, g_red):
    flat_l = dict((pj_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(g_local)[0])

    def fix(kp, x):
      if pj_path(kp) != path:
        return x
      # (not `.at[a:b].set`: docs/facts.md, "jax 0.11.2: zero-size operands of a mapped program")
      return jax.lax.dynamic_update_slice(x.reshape(-1), flat_l[path].reshape(-1)[a:b], (a,)).reshape(x.shape)

    return jax.tree_util.tree_map_with_path(fix, g_red)

  def step(states, batch):
    out = []
    for kind, (p, o) in zip(("ok", "scale", "slice"), states):
      g = jax.grad(m.loss_fn)(p, batch)
      red = pj.allreduce(g, s, AX, mean=kind != "scale")
      if kind == "slice":
        red = lose_slice(g, red)
      u, o = tx.update(red, o, p)
      out.append((optax.apply_updates(p, u), o))
    return tuple(out)

  f = jax.pmap(step, axis_name=AX)
  states = _replicate(tuple((params, tx.init(params)) for _ in range(3)))
  for bt in batches:
    states = f(states, _split(bt))
  ok, scale, sliced = (unrep(st[0]) for st in states)
  ref = single_device_reference(model, dtype)
  assert_close(ok, ref, params)
  assert_trees_close(ok, ref, params)  # docs/design.md's tolerance as tests/_assert.py states it
  for check in (assert_close, assert_trees_close):
    with pytest.raises(AssertionError, match="max"):
      check(scale, ref, params)
    with pytest.raises(AssertionError, match="max"):
      check(sliced, ref, params)


def pj_path(kp) -> str:
  return jax.tree_util.keystr(tuple(kp), simple=True, separator="/")


# --------------------------------------------------------------------------------------------------
# hooked inside a scanned body (loop_hook) and its audit


def test_hooked_scan_model_reduces_inside_the_backward_loop():
  from prophet_jax.models.scan import SCAN_IN_LOOP, outer_params, scan_model

  m = scan_model(depth=3)
  params = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), BATCH)
  s = pj.plan(pj.GradientProfile.from_params(outer_params(params), forward_s=1e-3, backward_s=2e-3),
              pj.NetworkModel.preset("10gbe", workers=NDEV), "wfbp")
  grad_fn = pj.hooked(m.loss_fn, s, axis_name=AX, in_loop=SCAN_IN_LOOP)

  def step(p, b):
    loss, g = grad_fn(p, b)
    return g, jax.lax.pmean(loss, AX)

  compiled = jax.pmap(step, axis_name=AX).lower(_replicate(params), _split(batch)).compile()
  g, _ = compiled(_replicate(params), _split(batch))
  ref = jax.grad(m.loss_fn)(params, batch)
  got = jax.tree.map(lambda x: np.asarray(x[0]), g)
  for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                               jax.tree_util.tree_flatten_with_path(ref)[0]):
    np.testing.assert_allclose(x, y, atol=1e-6, err_msg=pj_path(path))
  report = pj.audit(compiled, s)
  assert report.ok, report.describe()
  (loop,) = report.loops
  assert loop.trips == 3 and report.loop_allreduces == 3  # once per trip of the backward loop
  assert loop.elements == 32 * 32 + 32  # one layer's kernel and bias
  assert loop.backward_ops_after > 0  # inside the backward pass, not after it
  # the same model under `scheduled` reduces the stacked gradients after the loop, in no loop body
  full = pj.plan(pj.GradientProfile.from_params(params), pj.NetworkModel.preset("10gbe", workers=NDEV),
                 "wfbp")

  def step2(p, b):  # what `scheduled` does: the all-reduce of the finished gradients
    return pj.allreduce(jax.grad(m.loss_fn)(jax.lax.pcast(p, AX, to="varying"), b), full, AX)

  c2 = jax.pmap(step2, axis_name=AX).lower(_replicate(params), _split(batch)).compile()
  r2 = pj.audit(c2, full)
  assert r2.ok and not r2.loops and all(e.trips == 1 for e in r2.chunks)


def test_hooked_without_loop_hook_call_is_an_error():
  _, params, batches = setup("mlp", "float32")
  m = get_model("mlp")
  s = schedule_for("mlp", "float32", "wfbp")
  g = pj.hooked(m.loss_fn, s, axis_name=AX, in_loop=("params/Dense_0",))
  with pytest.raises(ValueError, match="never called prophet_jax's loop_hook"):
    jax.eval_shape(jax.pmap(g, axis_name=AX), _replicate(params), _split(batches[0]))


# --------------------------------------------------------------------------------------------------
# the optax wrapper: state, construction errors, the check_vma trap


def test_scheduled_state_and_construction_errors():
  s = schedule_for("mlp", "float32", "wfbp")
  _, params, _ = setup("mlp", "float32")
  tx = pj.scheduled(optax.adam(1e-3), s, axis_name=AX)
  state = tx.init(params)
  assert isinstance(state, tuple) and hasattr(state, "inner") and type(state).__name__ == "ScheduledState"
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    pj.scheduled(lambda g: g, s, axis_name=AX)
  with pytest.raises(TypeError, match="must be a prophet_jax.Schedule"):
    pj.scheduled(optax.sgd(0.1), s.to_json(), axis_name=AX)
  with pytest.raises(TypeError, match="axis_name"):
    pj.scheduled(optax.sgd(0.1), s, axis_name=3)
  with pytest.raises(TypeError, match="loss_fn"):
    pj.hooked(None, s, axis_name=AX)


def test_scheduled_under_shard_map_without_pcast_raises_already_reduced():
  m, params, batches = setup("mlp", "float32")
  s = schedule_for("mlp", "float32", "wfbp")
  tx = pj.scheduled(optax.sgd(0.1), s, axis_name=AX)

  def step(p, o, batch):  # the 8x trap: replicated params, default check_vma, no pcast
    g = jax.grad(m.loss_fn)(p, batch)
    return tx.update(g, o, p)

  mesh = _mesh()
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=(P(), P())))
  repl = NamedSharding(mesh, P())
  args = (jax.device_put(params, repl), jax.device_put(tx.init(params), repl),
          jax.device_put(batches[0], NamedSharding(mesh, P(AX))))
  with pytest.raises(pj.AlreadyReducedError, match=r"pcast\(params, 'data', to='varying'\)"):
    f.trace(*args)


def test_hooked_has_aux_and_int_leaves_trace():
  s = pj.Schedule(buckets=(pj.Bucket(chunks=(pj.Chunk(slices=((0, 0, 3),), dtype="float32"),)),),
                  rows=(("w", (3,), "float32"),))
  loss_fn = lambda p, x: (jnp.sum(p["w"] * x), {"n": p["n"]})
  params = {"w": jnp.ones(3), "n": jnp.array(2, jnp.int32)}
  g = pj.hooked(loss_fn, s, axis_name=AX, has_aux=True)
  (loss, aux), grads = jax.eval_shape(jax.pmap(g, axis_name=AX), _replicate(params),
                                      jnp.ones((NDEV, 3)))
  assert aux["n"].dtype == jnp.int32 and grads["n"].dtype == jax.dtypes.float0
  assert grads["w"].shape == (NDEV, 3) and loss.shape == (NDEV,)
