"""The carry plan of the pipelined forward (`prophet_jax._residuals`): minimal, complete and exact.

The min-cut plan is checked against brute force (every subset of the batch values, on small forwards);
the flow graph against brute-force minimum cuts on random graphs; the forward and recompute
subprograms against `jax.vjp`'s own closure, bit for bit.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prophet_jax._residuals import (_CHEAP, _FlowGraph, _batch_vars, _is_var, _nbytes, carried_avals,
                                    carry_plan, forward, recompute, vjp_jaxpr)


def mlp_gelu(p, x):  # a tanh-GELU MLP: jax.vjp keeps its derivative terms, the cut keeps its input
  h = x @ p["w1"] + p["b1"]
  g = 0.5 * h * (1.0 + jnp.tanh(0.79788456 * (h + 0.044715 * h ** 3)))
  y = g @ p["w2"]
  return jnp.sum(y * y) / x.shape[0]


def norm_softmax(p, x):  # reductions (never recomputed), exp, broadcasts
  h = x @ p["w1"]
  mu = jnp.sum(h, axis=-1, keepdims=True) / h.shape[-1]
  c = h - mu
  e = jnp.exp(c * p["b1"])
  s = e / jnp.sum(e, axis=-1, keepdims=True)
  return jnp.sum(jnp.log(s + 1.0)) / x.shape[0]


FUNCS = {"mlp_gelu": mlp_gelu, "norm_softmax": norm_softmax}


def setup(fn_name):
  rng = np.random.default_rng(0)
  p = {"w1": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
       "b1": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
       "w2": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  closed, treedef = vjp_jaxpr(FUNCS[fn_name], p, x)
  return p, x, closed, treedef


def brute_force_min_bytes(closed, n_params):
  """The fewest bytes of batch values from which every batch closure leaf is computable by cheap
  single-output equations: every subset of the batch values tried."""
  jaxpr = closed.jaxpr
  on_batch = _batch_vars(jaxpr, n_params)
  candidates = [v for v in jaxpr.invars if v in on_batch]
  candidates += [v for e in jaxpr.eqns for v in e.outvars if v in on_batch]
  needed = {v for v in jaxpr.outvars[1:] if _is_var(v) and v in on_batch}
  assert len(candidates) <= 20, len(candidates)
  best = None
  for r in range(len(candidates) + 1):
    for subset in itertools.combinations(candidates, r):
      have = set(subset)
      for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CHEAP and len(eqn.outvars) == 1 and all(
            not _is_var(u) or u not in on_batch or u in have for u in eqn.invars):
          have.add(eqn.outvars[0])
      if needed <= have:
        cost = sum(_nbytes(v) for v in subset)
        best = cost if best is None else min(best, cost)
  return best


@pytest.mark.parametrize("fn_name", sorted(FUNCS))
def test_min_cut_carries_the_brute_force_minimum(fn_name):
  p, x, closed, _ = setup(fn_name)
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
  p, x, closed, treedef = setup(fn_name)
  n = len(jax.tree.leaves(p))
  plan = carry_plan(closed, n, how)
  loss, *carried = jax.jit(forward(closed, plan))(*jax.tree.leaves(p), x)
  assert [(c.shape, c.dtype) for c in carried] == [(a.shape, a.dtype) for a in carried_avals(closed, plan)]
  leaves = jax.jit(recompute(closed, plan, n))(*jax.tree.leaves(p), *carried)
  ref_loss, ref_vjp = jax.jit(lambda q, b: jax.vjp(lambda r: FUNCS[fn_name](r, b), q))(p, x)
  np.testing.assert_array_equal(loss, ref_loss)
  for got, want in zip(leaves, jax.tree.leaves(ref_vjp)):
    np.testing.assert_array_equal(got, want)
  (g,) = jax.tree.unflatten(treedef, leaves)(jnp.ones((), loss.dtype))
  ref_g = jax.grad(FUNCS[fn_name])(p, x)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


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
  p, x, closed, _ = setup("mlp_gelu")
  with pytest.raises(ValueError, match="how='fast'"):
    carry_plan(closed, 3, "fast")
