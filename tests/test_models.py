"""Tests of prophet_jax.models: the trainable registry, the reference architectures and the traces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prophet_jax.models import MODELS, forward_paths, get_model, layer_of, num_params

# -------------------------------------------------------------------------------------------------
# registry


@pytest.mark.parametrize("name", MODELS)
def test_registry_shapes_sizes_and_dtypes(name):
  for dtype in ("float32", "bfloat16"):
    m = get_model(name, param_dtype=dtype)
    params = m.abstract_params()
    assert list(params) == ["params"]
    leaves = jax.tree_util.tree_leaves(params)
    assert all(str(x.dtype) == dtype for x in leaves), (name, dtype)
    assert 10_000 <= num_params(params) <= 200_000, (name, num_params(params))
    batch = jax.eval_shape(lambda k: m.make_batch(k, 8), jax.random.key(0))
    assert set(batch) == {"x", "y"} and all(v.shape[0] == 8 for v in batch.values())
    loss = jax.eval_shape(m.loss_fn, params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
  assert m.default_batch_size % 8 == 0


def test_make_batch_is_deterministic_and_checks_size():
  m = get_model("gpt-tiny")
  a, b = m.make_batch(jax.random.key(3), 8), m.make_batch(jax.random.key(3), 8)
  c = m.make_batch(jax.random.key(4), 8)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a["x"], c["x"])
  # the targets are the inputs shifted by one token
  assert np.array_equal(a["x"][:, 1:], a["y"][:, :-1])
  with pytest.raises(ValueError, match="batch_size=0"):
    m.make_batch(jax.random.key(0), 0)


def test_unknown_model_and_dtype():
  with pytest.raises(ValueError, match="unknown model.*'mlp'"):
    get_model("mlpp")
  with pytest.raises(ValueError, match="param_dtype='float16'.*bfloat16"):
    get_model("mlp", param_dtype="float16")


@pytest.mark.parametrize("name", ["mlp", "gpt-tiny"])
def test_loss_falls_and_is_a_batch_mean(name):
  m = get_model(name)
  params = m.init(jax.random.key(0))
  tx = optax.sgd(0.05 if name == "mlp" else 0.3, momentum=0.9)

  @jax.jit
  def step(p, s, b):
    loss, g = jax.value_and_grad(m.loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  batch = m.make_batch(jax.random.key(1))

  @jax.jit
  def three_losses(p, b):  # one program: the full batch and its two halves
    return [m.loss_fn(p, {k: v[s] for k, v in b.items()})
            for s in (slice(None), slice(None, 16), slice(16, None))]

  full, a, b = (float(x) for x in three_losses(params, batch))
  assert abs(full - (a + b) / 2) < 1e-5 * abs(full)  # a mean over the batch, not a sum
  state, losses = tx.init(params), []
  for i in range(20):
    params, state, loss = step(params, state, m.make_batch(jax.random.key(i)))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3]), losses


def test_forward_paths_follow_the_forward_pass_not_sorted_keys():
  m = get_model("mlp")
  order = m.forward_paths()
  flat = [jax.tree_util.keystr(p, simple=True, separator="/")
          for p, _ in jax.tree_util.tree_flatten_with_path(m.abstract_params())[0]]
  assert sorted(order) == sorted(flat)
  layers = list(dict.fromkeys(layer_of(p) for p in order))
  assert layers == [f"params/Dense_{i}" for i in range(12)]
  assert flat.index("params/Dense_10/kernel") < flat.index("params/Dense_2/kernel")  # the trap
  # the tied embedding of gpt-tiny is read first in the forward pass (the lookup)
  assert get_model("gpt-tiny").forward_paths()[0] == "params/wte/embedding"
  # a hand-made function: b is read before a
  order = forward_paths(lambda p, x: jnp.sum(p["b"] * x) + jnp.sum(p["a"]),
                        {"a": jnp.ones(2), "b": jnp.ones(2)}, jnp.ones(2))
  assert order == ("b", "a")


def test_layer_of():
  assert layer_of("params/Conv_0/kernel") == "params/Conv_0"
  assert layer_of("wpe") == "wpe"
  with pytest.raises(ValueError, match="path=''"):
    layer_of("")
