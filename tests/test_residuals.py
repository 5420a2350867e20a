"""The carry plan of the pipelined forward (`prophet_jax._rewrite._residuals`): minimal, complete and exact.

The min-cut plan is checked against brute force (every subset of the batch values, on small forwards,
with which values depend on the batch taken from JAX's own dead-code elimination); the flow graph
against brute-force minimum cuts on random graphs; the forward and recompute subprograms against
`jax.vjp`'s own closure, bit for bit. The forwards include nested calls whose outputs mix batch values
and constants (integer labels, a `jnp.where` mask): the backward must recompute the constants without
the batch, and carry nothing more.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prophet_jax._rewrite._residuals import (_CHEAP, _FlowGraph, _batch_vars, _is_var, _nbytes, carried_avals,
                                    carry_plan, forward, recompute, vjp_jaxpr)


def mlp_gelu(p, b):  # a tanh-GELU MLP: jax.vjp keeps its derivative terms, the cut keeps its input
  x = b["x"]
  h = x @ p["w1"] + p["b1"]
  g = 0.5 * h * (1.0 + jnp.tanh(0.79788456 * (h + 0.044715 * h ** 3)))
  y = g @ p["w2"]
  return jnp.sum(y * y) / x.shape[0]


def norm_softmax(p, b):  # reductions (never recomputed), exp, broadcasts
  x = b["x"]
  h = x @ p["w1"]
  mu = jnp.sum(h, axis=-1, keepdims=True) / h.shape[-1]
  c = h - mu
  e = jnp.exp(c * p["b1"])
  s = e / jnp.sum(e, axis=-1, keepdims=True)
  return jnp.sum(jnp.log(s + 1.0)) / x.shape[0]


def int_labels(p, b):  # a classifier with integer labels: its nested calls (take_along_axis, _take) have
  logits = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"]  # outputs that mix batch values and constants
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def take_labels(p, b):  # the same nested calls, small enough for the brute force
  logits = (b["x"] @ p["w1"]) * p["b1"]
  return jnp.sum(jnp.take_along_axis(logits, b["y"][:, None], axis=1) ** 2)


def causal_mask(p, b):  # jnp.where(mask, s, -inf): a nested call whose outputs are the batch-dependent
  h = b["x"] @ p["w1"]  # select, the constant mask and a zero fill (attention scores, as in gpt-tiny)
  s = h[:, :, None] * h[:, None, :]
  s = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), s, -jnp.inf)
  return jnp.sum(jnp.exp(s) * p["b1"]) / s.shape[0]


FUNCS = {"mlp_gelu": mlp_gelu, "norm_softmax": norm_softmax, "int_labels": int_labels,
         "take_labels": take_labels, "causal_mask": causal_mask}
BRUTE = sorted(set(FUNCS) - {"int_labels"})  # the functions with at most 20 batch values


def setup(fn_name):
  rng = np.random.default_rng(0)
  p = {"w1": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
       "b1": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
       "w2": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  b = {"x": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), "y": jnp.asarray([0, 2, 1, 2], jnp.int32)}
  closed, treedef, _ = vjp_jaxpr(FUNCS[fn_name], p, b)
  return p, b, closed, treedef


def depends_on_batch(jaxpr, n_params):
  """The values of `jaxpr` that depend on a batch input, by JAX's own dead-code elimination (which looks
  into nested calls): an oracle independent of `_residuals._live`."""
  from jax._src.interpreters import partial_eval as pe

  values = [v for e in jaxpr.eqns for v in e.outvars if _is_var(v)]
  out = {v for v in jaxpr.invars[n_params:]}
  for v in values:
    _, used = pe.dce_jaxpr(jaxpr.replace(outvars=[v]), [True])
    if any(used[n_params:]):
      out.add(v)
  return out


def brute_force_min_bytes(closed, n_params):
  """The fewest bytes of batch values from which every batch closure leaf is computable by cheap
  single-output equations: every subset of the batch values tried. Which values depend on the batch
  comes from JAX's dead-code elimination (`depends_on_batch`); the rest is computable from the params."""
  jaxpr = closed.jaxpr
  on_batch = depends_on_batch(jaxpr, n_params)
  candidates = [v for v in jaxpr.invars if v in on_batch]
  candidates += [v for e in jaxpr.eqns for v in e.outvars if v in on_batch]
  needed = {v for v in jaxpr.outvars[1:] if _is_var(v) and v in on_batch}
  assert len(candidates) <= 20, len(candidates)
  bit = {v: 1 << k for k, v in enumerate(candidates)}
  rules = [(bit[e.outvars[0]], sum(bit[u] for u in e.invars if _is_var(u) and u in on_batch))
           for e in jaxpr.eqns if e.primitive.name in _CHEAP and len(e.outvars) == 1
           and e.outvars[0] in on_batch]  # program order: one pass closes a subset
  want = sum(bit[v] for v in needed)
  cost = np.zeros(1 << len(candidates), np.int64)  # bytes of every subset, then cheapest first
  for k, v in enumerate(candidates):
    cost[1 << k:2 << k] = cost[:1 << k] + _nbytes(v)
  for subset in np.argsort(cost, kind="stable"):
    have = int(subset)
    for out, ins in rules:
      if ins & have == ins:
        have |= out
    if have & want == want:
      return int(cost[subset])
  raise AssertionError("no subset works: the batch itself always does")


@pytest.mark.parametrize("fn_name", BRUTE)
def test_min_cut_carries_the_brute_force_minimum(fn_name):
  p, b, closed, _ = setup(fn_name)
  n = len(jax.tree.leaves(p))
  plan = carry_plan(closed, n, "min-cut")
  carried = sum(a.size * a.dtype.itemsize for a in carried_avals(closed, plan))
  assert carried == brute_force_min_bytes(closed, n)
  closure = sum(a.size * a.dtype.itemsize for a in carried_avals(closed, carry_plan(closed, n, "closure")))
  assert carried <= closure
  if fn_name == "mlp_gelu":  # the GELU's terms are not carried: its input is (and the batch)
    assert carried < 0.6 * closure, (carried, closure)


@pytest.mark.parametrize("fn_name", sorted(FUNCS))
@pytest.mark.parametrize("how", ["closure", "min-cut"])
def test_forward_and_recompute_give_the_vjp_closure_bit_for_bit(fn_name, how):
  p, b, closed, treedef = setup(fn_name)
  n = len(jax.tree.leaves(p))
  plan = carry_plan(closed, n, how)
  loss, *carried = jax.jit(forward(closed, plan))(*jax.tree.leaves(p), *jax.tree.leaves(b))
  assert [(c.shape, c.dtype) for c in carried] == [(a.shape, a.dtype) for a in carried_avals(closed, plan)]
  leaves = jax.jit(recompute(closed, plan, n))(*jax.tree.leaves(p), *carried)
  ref_loss, ref_vjp = jax.jit(lambda q, c: jax.vjp(lambda r: FUNCS[fn_name](r, c), q))(p, b)
  np.testing.assert_array_equal(loss, ref_loss)
  for got, want in zip(leaves, jax.tree.leaves(ref_vjp)):
    np.testing.assert_array_equal(got, want)
  (g,) = jax.tree.unflatten(treedef, leaves)(jnp.ones((), loss.dtype))
  (ref_same,) = ref_vjp(jnp.ones((), loss.dtype))  # jax's own closure, applied the same way: bit for bit
  for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(ref_same)):
    np.testing.assert_array_equal(got, want)
  # jax.grad is another program (one jit, fused otherwise): float32 rounding apart (jaxlib 0.12's XLA:CPU
  # differs from the closure applied op by op by up to 3.3e-6 relative on mlp_gelu, ~28 ulp)
  ref_g = jax.grad(FUNCS[fn_name])(p, b)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("fn_name", sorted(FUNCS))
def test_batch_dependence_agrees_with_jax_dead_code_elimination(fn_name):
  """What the plan takes as computed from the batch (`_batch_vars`, per output of a nested call) is
  exactly what JAX's own dead-code elimination says depends on a batch input."""
  p, b, closed, _ = setup(fn_name)
  n = len(jax.tree.leaves(p))
  values = set(closed.jaxpr.invars) | {v for e in closed.jaxpr.eqns for v in e.outvars if _is_var(v)}
  assert _batch_vars(closed.jaxpr, n) & values == depends_on_batch(closed.jaxpr, n)


@pytest.mark.parametrize("how", ["closure", "min-cut"])
def test_aux_outputs_come_between_the_loss_and_the_closure(how):
  """With has_aux, the forward returns the aux (batch-dependent or not) after the loss; the backward
  recomputes the closure without it, bit for bit."""
  def with_aux(q, c):
    loss = int_labels(q, c)
    return loss, {"logits_sum": jnp.sum(c["x"] @ q["w1"]), "w_norm": jnp.sum(q["w2"] ** 2), "y": c["y"]}

  p, b, _, _ = setup("int_labels")
  trace = vjp_jaxpr(with_aux, p, b, has_aux=True)
  n = len(jax.tree.leaves(p))
  assert trace.n_head == 4
  plan = carry_plan(trace.closed, n, how, n_head=trace.n_head)
  loss, *rest = jax.jit(forward(trace.closed, plan, n_head=trace.n_head))(*jax.tree.leaves(p),
                                                                          *jax.tree.leaves(b))
  aux, carried = jax.tree.unflatten(trace.aux_tree, rest[:3]), rest[3:]
  ref_loss, ref_vjp, ref_aux = jax.vjp(lambda r: with_aux(r, b), p, has_aux=True)
  np.testing.assert_array_equal(loss, ref_loss)
  for got, want in zip(jax.tree.leaves(aux), jax.tree.leaves(ref_aux)):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  leaves = jax.jit(recompute(trace.closed, plan, n, n_head=trace.n_head))(*jax.tree.leaves(p), *carried)
  (g,) = jax.tree.unflatten(trace.treedef, leaves)(jnp.ones((), loss.dtype))
  for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(ref_vjp(jnp.ones((), loss.dtype))[0])):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_flow_graph_min_cut_equals_brute_force():
  rng = np.random.default_rng(1)
  for _ in range(40):
    n = int(rng.integers(3, 9))
    edges = [(int(u), int(v), int(rng.integers(1, 10))) for u in range(n) for v in range(n)
             if u != v and rng.random() < 0.35]
    g = _FlowGraph(n)
    for u, v, c in edges:
      g.add(u, v, c)
    flow = g.max_flow(0, n - 1)
    best = min(sum(c for u, v, c in edges if u in side and v not in side)
               for r in range(n - 1) for rest in itertools.combinations(range(1, n - 1), r)
               for side in [{0, *rest}])
    assert flow == best
    # the nodes that still reach the sink are the sink side of a cut of exactly that capacity
    t_side = g.reaching(n - 1)
    assert 0 not in t_side
    assert sum(c for u, v, c in edges if u not in t_side and v in t_side) == flow


def test_unknown_plan_kind_is_an_error():
  p, b, closed, _ = setup("mlp_gelu")
  with pytest.raises(ValueError, match="how='fast'"):
    carry_plan(closed, 3, "fast")
