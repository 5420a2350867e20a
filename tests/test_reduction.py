"""`reduction="sum"` on `hooked` and `pipelined` (issue 35): a loss summed over its examples gives the
plain `jax.jit` step's loss and gradients over the global batch, per device (`shard_map`) and with
`mesh=`, for an all-reduce and a sharded (`dear`) plan; the default `"mean"` on the same sum loss is the
control (1/8 of them: what a sum loss gave silently before). One tiny model, a handful of small compiles.
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
PARAMS = {"a": {"w": jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)},
          "b": {"w": jnp.asarray(np.linspace(-1, 1, 3), jnp.float32)}}
BATCH = jnp.asarray(np.random.default_rng(1).standard_normal((2 * N, 4)), jnp.float32)
PROF = pj.GradientProfile.from_params(PARAMS, forward_s=1e-3, backward_s=2e-3)
NET = pj.NetworkModel.preset("10gbe", workers=N)
WFBP = pj.plan(PROF, NET, "wfbp")
DEAR = pj.plan(PROF, NET, "dear")
LR = 0.1


def sum_loss(p, x):
  return jnp.sum((x @ p["a"]["w"] + p["b"]["w"]) ** 2)


def _mesh():
  return jax.make_mesh((N,), (AX,))


def _plain():
  return jax.jit(jax.value_and_grad(sum_loss))(PARAMS, BATCH)


def _close(a, b, rtol=1e-5):
  return all(np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-5)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _put(mesh):
  return (jax.device_put(PARAMS, NamedSharding(mesh, P())), jax.device_put(BATCH, NamedSharding(mesh, P(AX))))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_hooked_on_the_mesh_sums_a_sum_loss(reduction):
  mesh = _mesh()
  grad_fn = pj.hooked(sum_loss, WFBP, axis_name=AX, mesh=mesh, reduction=reduction)
  loss, grads = jax.jit(grad_fn)(*_put(mesh))
  ref_loss, ref_grads = _plain()
  if reduction == "sum":
    assert np.allclose(loss, ref_loss, rtol=1e-5) and _close(grads, ref_grads)
  else:   # the control: a sum loss under the default is 1/n of the plain step
    assert np.allclose(loss * N, ref_loss, rtol=1e-5) and not _close(grads, ref_grads)


def test_pipelined_on_the_mesh_sums_a_sum_loss():
  mesh = _mesh()
  pipe = pj.pipelined(sum_loss, optax.sgd(LR), WFBP, axis_name=AX, mesh=mesh, reduction="sum")
  params, batch = _put(mesh)
  state, loss = jax.jit(pipe.step)(pipe.init(params), batch)
  state = jax.jit(pipe.flush)(state)
  ref_loss, ref_grads = _plain()
  want = jax.tree.map(lambda p, g: p - LR * g, PARAMS, ref_grads)
  assert np.allclose(loss, ref_loss, rtol=1e-5)
  assert _close(state.params, want) and not _close(state.params, PARAMS)


def test_hooked_per_device_with_a_sharded_plan_sums_a_sum_loss():
  mesh = _mesh()
  grad_fn = pj.hooked(sum_loss, DEAR, axis_name=AX, reduction="sum")
  tx = pj.scheduled(optax.sgd(LR), DEAR, axis_name=AX)

  def body(p, x):
    st = tx.init(p)
    _, shards = grad_fn(p, x)
    u, _ = tx.update(shards, st, p)
    return optax.apply_updates(p, u)

  new = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P()))(*_put(mesh))
  _, ref_grads = _plain()
  assert _close(new, jax.tree.map(lambda p, g: p - LR * g, PARAMS, ref_grads))


@pytest.mark.parametrize("make", [lambda: pj.hooked(sum_loss, WFBP, axis_name=AX, reduction="total"),
                                  lambda: pj.pipelined(sum_loss, optax.sgd(LR), WFBP, axis_name=AX,
                                                       reduction=None)])
def test_an_unknown_reduction_is_named(make):
  with pytest.raises(ValueError, match="reduction="):
    make()
