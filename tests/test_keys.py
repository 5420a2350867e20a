"""enforce_order=False: combiner keys in place of the tie, and layers tagged for users who keep their step.

One small model (mlp) x two policies (priority: an all-reduce plan whose chunks cut leaves, several of
equal size; dear: a sharded plan of reduce-scatters and all-gathers) x one compile-only target (8 H100s):
- on the CPU, 2 steps of the keyed step equal the single-device full-batch step (SGD momentum, DESIGN.md's
  tolerance), and the same compiled step with the divisor n - 1 (the engine's test seam) fails it; the
  keyed program carries one combiner key per unit and no tie (its lowered text);
- on the H100s, the keyed audit is OK: exactly the plan's units (count and sizes), matched by size and
  provenance, the order XLA's; the CPU's compiled keyed program, where XLA ignores the keys and merges,
  fails the same audit (its control);
- `tag_layers` (flax linen and nnx): the partitioner's gradient all-reduces of a plain `jax.jit` step
  come out as the plan's buckets on the H100s (and the audit tells them from a finer tagging);
  `tag_plan` says where it cannot follow a plan. (On the CPU the keys are ignored: a tagged step is the
  plain step; bench/keys.py checks its numbers.)
bench/keys.py runs the full matrix (docs/keys.md).
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

import prophet_jax as pj
from _assert import assert_trees_close
from _reference import full_batch
from prophet_jax._rewrite import _collectives
from prophet_jax.models import get_model

AX = "data"
NDEV = 8
BATCH = 16
N_STEPS = 2
LR = 0.05
NETWORK = pj.NetworkModel(alpha_s=1e-5, beta_s_per_byte=1e-9, workers=NDEV, overlap=True)
# priority with partitions smaller than a kernel: leaves cut into chunks of equal size; dear: sharded
POLICIES = {"priority": {"partition_bytes": 4096}, "dear": {}}
MODES = {"priority": "scheduled", "dear": "hooked"}


@functools.lru_cache(maxsize=None)
def setup():
  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  batches = [m.make_batch(jax.random.key(10 + i), BATCH) for i in range(N_STEPS)]
  return m, params, batches


@functools.lru_cache(maxsize=None)
def schedule_for(policy: str) -> pj.Schedule:
  _, params, _ = setup()
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  return pj.plan(profile, NETWORK, policy, **POLICIES[policy])


@functools.lru_cache(maxsize=None)
def reference():
  m, params, batches = setup()
  p, _ = full_batch(m.loss_fn, params, optax.sgd(LR, momentum=0.9), batches)
  return jax.device_get(p)


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:NDEV]), (AX,))


@functools.lru_cache(maxsize=None)
def keyed_cpu_step(policy: str):
  """(jitted shard_map step(p, o, b, scale), initial state, the lowered text, the compiled step)."""
  m, params, batches = setup()
  s = schedule_for(policy)
  mesh = _mesh()
  tx = optax.sgd(LR, momentum=0.9)
  sharded = s.sharded
  opt = pj.scheduled(tx, s, axis_name=AX, enforce_order=False)
  grad_fn = pj.hooked(m.loss_fn, s, axis_name=AX, enforce_order=False) if MODES[policy] == "hooked" else None

  def body(p, o, b, scale):
    with _collectives.engine_hooks(divisor=lambda n: n / scale):
      if grad_fn is not None:
        _, g = grad_fn(p, b)
      else:
        g = jax.grad(m.loss_fn)(jax.lax.pcast(p, AX, to="varying"), b)
      u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o

  ospec = P(AX) if sharded else P()
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), ospec, P(AX), P()), out_specs=(P(), ospec)))
  init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=ospec))
  o0 = init(params)
  lowered = step.lower(params, o0, batches[0], jnp.float32(1.0))
  return step, o0, lowered.as_text(), lowered.compile()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_keyed_step_equals_the_full_batch_step_on_the_cpu_and_carries_keys_not_ties(policy):
  m, params, batches = setup()
  s = schedule_for(policy)
  step, o0, text, _ = keyed_cpu_step(policy)
  units = s.num_allreduces + (len(s.gathers) if s.sharded else 0)
  assert units >= 4
  keys = set(re.findall(r'combiner_key = "(prophet/[a-z]+\d+)"', text))
  want = ({f"prophet/rs{k}" for k in range(len(s.chunks))} | {f"prophet/ag{g}" for g in range(len(s.gathers))}
          if s.sharded else {f"prophet/chunk{k}" for k in range(s.num_allreduces)})
  assert keys == want
  assert "is_finite" not in text   # the tie's NaN-proof zero is gone

  def run(scale):
    p, o = params, o0
    for b in batches:
      p, o = step(p, o, b, jnp.float32(scale))
    return jax.device_get(p)

  assert_trees_close(run(1.0), reference(), params)
  with pytest.raises(AssertionError):   # the control: a 14% scale (n - 1 divisor) fails the same check
    assert_trees_close(run(NDEV / (NDEV - 1)), reference(), params)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_keyed_units_compile_to_exactly_the_plan_on_h100s(topo, policy):
  m, _, _ = setup()
  s = schedule_for(policy)
  compiled, _ = pj.compile_step(m, s, MODES[policy], topo, batch_size=BATCH, enforce_order=False)
  report = pj.audit(compiled, s, enforce_order=False)
  assert report.ok, report.describe()
  assert report.order_by == "xla" and "order: XLA's" in report.describe()
  assert sorted(report.order) == list(range(len(s.chunks) if s.sharded else s.num_allreduces))
  want = s.padded_sizes(NDEV) if s.sharded else s.allreduce_sizes()
  assert [e.elements for e in sorted(report.chunks, key=lambda e: e.chunk)] == list(want)
  if s.sharded:
    assert sorted(report.gather_order) == list(range(len(s.gathers)))
  else:   # priority: eleven kernels of 1024 elements, eleven biases of 32: equal sizes
    assert len(set(want)) < len(want)
  # where this jaxlib prints a collective's key (one not combined), the match read without names agrees,
  # except among units the audit itself reports as matched by plan order alone (the equal-size rule)
  guessed = {int(k) for w in report.warnings if w.startswith("ambiguous")
             for k in re.findall(r"\d+", w.split("[")[1].split("]")[0])}
  text = compiled.as_text()
  printed = {n: int(k) for n, k in re.findall(r'%([\w.\-]+-start[.\d]*) = .*?combiner_key="prophet/(?:chunk|rs)(\d+)"',
                                              text)}
  checked = [e for e in report.chunks if e.name in printed and e.chunk not in guessed]
  assert checked and all(printed[e.name] == e.chunk for e in checked), report.describe()
  # the control: XLA:CPU ignores the keys and merges the all-reduces (numbers only there)
  if not s.sharded:
    cpu = pj.audit(keyed_cpu_step(policy)[3], s, enforce_order=False)
    assert not cpu.ok and any("have no all-reduce of their own" in p for p in cpu.problems)


def test_an_ordered_audit_of_a_keyed_program_says_it_is_keyed_and_how_to_audit_it():
  """issue 46: audit(compiled, schedule) of a step built with enforce_order=False reported an order
  problem and did not say that the program is keyed (its combiner keys are in the text) or what to pass."""
  s = schedule_for("priority")
  report = pj.audit(keyed_cpu_step("priority")[3], s)
  assert not report.ok
  assert report.problems[0].startswith("this program is keyed: its collectives carry the plan's combiner "
                                       "keys (prophet/chunk0, prophet/chunk1, prophet/chunk2, ...)")
  assert "audit(compiled, schedule, enforce_order=False)" in report.problems[0]


def test_tag_plan_says_where_it_cannot_follow_the_plan():
  _, params, _ = setup()
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  s = pj.plan(profile, NETWORK, "priority", partition_bytes=2048)   # cuts the 32x32 kernels in two
  tp = pj.tag_plan(s)
  assert not tp.exact and len(tp.buckets) < len(s.chunks)
  assert any("is cut by units" in n for n in tp.notes) and tp.notes[-1].startswith("order: XLA's")
  # each layer whole in one bucket, every element of the model in exactly one bucket
  layers = [l for b in tp.buckets for l in b.layers]
  assert len(layers) == len(set(layers))
  assert sum(b.elements for b in tp.buckets) == sum(int(np.prod(r[1])) for r in s.rows)
  with pytest.raises(ValueError, match="reduce-scatters"):
    pj.tag_plan(schedule_for("dear"))


def test_tagged_linen_and_nnx_steps_give_the_plans_buckets_on_h100s(topo):
  from flax import nnx

  m, params, batches = setup()
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  s = pj.plan(profile, NETWORK, "bucket", bucket_bytes=profile.total_nbytes // 4)
  mesh = topo.mesh(AX)

  tx = optax.sgd(LR, momentum=0.9)

  def step(p, o, b):   # the user's own step: only the trace of its gradient is tagged
    with pj.tag_layers(s):
      g = jax.grad(m.loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  a_batch = topo.abstract(jax.eval_shape(lambda: batches[0]), P(AX), mesh=mesh)
  a_opt = topo.abstract(jax.eval_shape(tx.init, params), P(), mesh=mesh)
  compiled = jax.jit(step).lower(topo.abstract(params, P(), mesh=mesh), a_opt, a_batch).compile()
  tp = pj.tag_plan(s)
  report = tp.audit(compiled)
  assert report.ok and len(report.chunks) == len(tp.buckets) >= 3, report.describe()
  # the control: the same program read against a finer tagging (one bucket per layer) fails
  assert not pj.tag_plan(pj.plan(profile, NETWORK, "wfbp")).audit(compiled).ok

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(16, 64, rngs=rngs)
      self.l2 = nnx.Linear(64, 64, rngs=rngs)
      self.l3 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
      return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

  model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
  gdef, state = nnx.split(model)
  ns = pj.plan(pj.GradientProfile.from_params(nnx.state(model, nnx.Param), forward_s=1e-3, backward_s=2e-3),
               NETWORK, "wfbp")

  def nnx_step(state, x):
    mod = nnx.merge(gdef, state)
    with pj.tag_layers(ns, model=mod):
      return nnx.value_and_grad(lambda mm, xx: jnp.mean(mm(xx) ** 2))(mod, x)

  x = topo.abstract(jax.ShapeDtypeStruct((BATCH, 16), jnp.float32), P(AX), mesh=mesh)
  report = pj.tag_plan(ns).audit(jax.jit(nnx_step).lower(topo.abstract(state, P(), mesh=mesh), x).compile())
  assert report.ok and len(report.chunks) == 3, report.describe()
  assert "__call__" not in vars(nnx.Linear) or nnx.Linear.__call__.__name__ == "__call__"  # restored
