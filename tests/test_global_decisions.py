"""Global decisions under a sharded (`dear`, ZeRO-1) plan (issue 35): a transformation that decides from
the whole update or counts something decides as the plain step does, on every device alike, or is
refused at init with a ShardingError naming it.

One compiled `shard_map` program (check_vma=False, as `scheduled(mesh=)` maps its update) runs every
exact case for 2 steps through `scheduled(tx, dear)`; one
jitted program runs the plain (single-device, whole tree) steps; the params and counters must agree.
The first step's gradient is the one that decides: one NaN in one device's gradient (apply_if_finite,
skip_not_finite: nobody may update), or a global norm above the threshold while every device's shard is
below it (skip_large_updates). The control: the plain step really skipped (params unchanged), which a
per-shard decision (7 of 8 devices applying) would not give. (`clip_by_global_norm`, the same mechanism,
is checked against the full-batch step in tests/test_zero.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj

AX = "dp"
N = 8
PARAMS = {"a": {"w": jnp.asarray(np.linspace(-1, 1, 12).reshape(4, 3), jnp.float32)},
          "b": {"w": jnp.asarray([0.5, -0.25, 1.0], jnp.float32)}}
DEAR = pj.plan(pj.GradientProfile.from_params(PARAMS, forward_s=1e-3, backward_s=2e-3),
               pj.NetworkModel.preset("10gbe", workers=N), "dear")
CLEAN = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, jnp.float32) + 0.01 * jnp.arange(x.size).reshape(x.shape),
                     PARAMS)
SQ = float(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(CLEAN)))
SGD = optax.sgd(0.1)
VALUES = (1.0, 2.0)   # the loss each step (reduce_on_plateau reads it: the second is worse)
STEPS = len(VALUES)

# (name, tx, the first step's gradient kind, takes value=)
EXACT = [
    ("apply_if_finite", optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 3), "nan", False),
    ("skip_not_finite", optax.MultiSteps(SGD, 1, should_skip_update_fn=optax.skip_not_finite), "nan", False),
    ("skip_large_updates", optax.MultiSteps(SGD, 1, should_skip_update_fn=lambda u, s, p: optax.skip_large_updates(
        u, s, p, max_squared_norm=0.5 * SQ)), "clean", False),
    ("reduce_on_plateau", optax.chain(SGD, optax.contrib.reduce_on_plateau(patience=0, cooldown=0, factor=0.5)),
     "clean", True),
    ("inject_hyperparams", optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9), "clean", False),
]


def _first(kind, device=None):
  if kind == "clean":
    return CLEAN
  g = jax.tree.map(np.array, CLEAN)
  if device is None or device == 3:
    g["a"]["w"][1, 2] = np.nan
  return g


def _per_device_grads(kind):
  """(N, ...) gradients of the first step: the same on every device, one NaN on device 3 only."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *[_first(kind, d) for d in range(N)])


@pytest.fixture(scope="module")
def runs():
  mesh = jax.make_mesh((N,), (AX,))
  txs = [pj.scheduled(tx, DEAR, axis_name=AX) for _, tx, _, _ in EXACT]

  def body(p, firsts):
    out = []
    for (name, _, _, value), tx, first in zip(EXACT, txs, firsts):
      q, st = p, tx.init(p)
      for t in range(STEPS):
        g = jax.tree.map(lambda x: x[0], first) if t == 0 else CLEAN
        u, st = tx.update(g, st, q, **({"value": jnp.float32(VALUES[t])} if value else {}))
        q = optax.apply_updates(q, u)
      out.append((q, st.inner.per_device))
    return out

  firsts = jax.device_put([_per_device_grads(kind) for _, _, kind, _ in EXACT], NamedSharding(mesh, P(AX)))
  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX)),
                                  out_specs=[(P(), P(AX))] * len(EXACT), check_vma=False))(
      jax.device_put(PARAMS, NamedSharding(mesh, P())), firsts)

  @jax.jit
  def plain(p):
    out = []
    for name, tx, kind, value in EXACT:
      q, st = p, tx.init(p)
      for t in range(STEPS):
        g = jax.tree.map(jnp.asarray, _first(kind)) if t == 0 else CLEAN
        u, st = tx.update(g, st, q, **({"value": jnp.float32(VALUES[t])} if value else {}))
        q = optax.apply_updates(q, u)
      out.append((q, st))
    return out

  return sharded, plain(PARAMS)


@pytest.mark.parametrize("i", range(len(EXACT)), ids=[e[0] for e in EXACT])
def test_a_global_decision_under_dear_is_the_plain_steps(runs, i):
  (got, per_device), (want, state) = runs[0][i], runs[1][i]
  name, _, kind, _ = EXACT[i]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=name)
  # every counter the sharded state keeps is the same on every device (replicated), as in the plain state
  for x in jax.tree.leaves(per_device):
    x = np.asarray(x)
    if x.ndim == 1 and x.dtype.kind in "iu":
      assert (x == x[0]).all(), (name, x)
  if name == "apply_if_finite":
    counts = [np.asarray(x) for x in jax.tree.leaves(per_device) if np.asarray(x).dtype.kind in "iu"]
    assert any((c == 1).all() for c in counts), counts   # notfinite_count 1 on all 8
    assert int(state.total_notfinite) == 1
  if name in ("skip_large_updates",):
    # the control: a per-shard decision (each shard's norm below the threshold) would have applied
    # both steps; the plain step skipped them (the global norm is above the threshold): nothing moved
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(PARAMS)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


@pytest.mark.parametrize("name, tx", [("adaptive_grad_clip", optax.chain(optax.adaptive_grad_clip(0.1), SGD))])
# (sm3, whose probe raised IndexError before: tests/test_bad_inputs.py, row J6)
def test_a_transformation_that_needs_whole_leaves_is_refused_at_init_by_name(name, tx):
  mesh = jax.make_mesh((N,), (AX,))
  s = pj.scheduled(tx, DEAR, axis_name=AX)
  with pytest.raises(pj.ShardingError, match=name):
    jax.eval_shape(jax.shard_map(s.init, mesh=mesh, in_specs=P(), out_specs=P(AX)), PARAMS)


def test_reduce_on_plateau_under_check_vma_says_how_to_map_it():
  """Its lax.cond mixes the per-device (varying) state with constants, which shard_map's check_vma
  refuses in jax's words; the library's say which mapping runs it (the exact runs above use them)."""
  mesh = jax.make_mesh((N,), (AX,))
  tx = pj.scheduled(EXACT[3][1], DEAR, axis_name=AX)
  state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(AX)), PARAMS)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((N,) + x.shape, x.dtype,
                                                      sharding=NamedSharding(mesh, P(AX))), CLEAN)

  def body(p, s, g):
    return tx.update(jax.tree.map(lambda x: x[0], g), s, p, value=jnp.float32(1.0))[0]

  with pytest.raises(TypeError, match="check_vma=False"):
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX), P(AX)), out_specs=P()),
                   jax.device_put(PARAMS, NamedSharding(mesh, P())), state, grads)
