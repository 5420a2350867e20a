"""flax's ImageNet example as users run it: a `jax.pmap` step over the axis 'batch', cross-device BatchNorm
(`nn.BatchNorm(axis_name="batch")`), a `TrainState` subclass holding `batch_stats`, the gradients
`lax.pmean`ed. What issue 46 found on it, on the public API only:

- `profile_step` maps the loss over an axis of its own, so the model's `pmean` over 'batch' raised "unbound
  axis name: batch" and the error blamed the batch's shapes: now `axis_name="batch"` profiles it, and
  without it the error names the axis and that argument;
- the step with `hooked` (two changed lines) equals the original to docs/design.md's tolerance, and
  `choose` compares the two `TrainState`s' parameters after the second call;
- a step that keeps its own `lax.pmean(grads)` after switching to `hooked` computes the same numbers, and
  its audit says that a second all-reduce of the gradients remains and should go (it blamed XLA's combiner).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training import train_state

import prophet_jax as pj
from _assert import assert_trees_close

AXIS = "batch"
NDEV = 8


class CNN(nn.Module):
  """A small ResNet-like stem: conv, cross-device BatchNorm, relu, pooling, a classifier."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=AXIS)(x)
    x = nn.relu(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


def loss_of(params, batch_stats, batch):
  """The example's loss, as `hooked(..., has_state=True)` takes it: (loss, new batch_stats)."""
  logits, new = CNN().apply({"params": params, "batch_stats": batch_stats}, batch["image"],
                            mutable=["batch_stats"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, new["batch_stats"]


def original_step(state, batch):
  """flax's imagenet `train_step`: value_and_grad, pmean of the gradients, apply_gradients."""
  grad_fn = jax.value_and_grad(lambda p: loss_of(p, state.batch_stats, batch), has_aux=True)
  (loss, stats), grads = grad_fn(state.params)
  grads = jax.lax.pmean(grads, axis_name=AXIS)
  return state.apply_gradients(grads=grads, batch_stats=stats), jax.lax.pmean(loss, AXIS)


def hooked_step(grad_fn, leftover=False):
  """The same step with prophet_jax: `grad_fn` in place of value_and_grad, the pmean gone (or kept)."""
  def step(state, batch):
    (loss, stats), grads = grad_fn(state.params, state.batch_stats, batch)
    if leftover:
      grads = jax.lax.pmean(grads, axis_name=AXIS)
    return state.apply_gradients(grads=grads, batch_stats=stats), jax.lax.pmean(loss, AXIS)
  return step


@functools.lru_cache(maxsize=None)
def setup():
  variables = CNN().init(jax.random.key(0), jnp.ones((2, 8, 8, 3)))
  params, stats = variables["params"], variables["batch_stats"]
  rng = np.random.default_rng(0)
  batches = [{"image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
              "label": rng.integers(0, 10, size=(16,)).astype(np.int32)} for _ in range(3)]
  state = TrainState.create(apply_fn=CNN().apply, params=params, tx=optax.sgd(0.1, momentum=0.9),
                            batch_stats=stats)
  return state, batches


def _per_device(batch):
  return jax.tree.map(lambda x: x.reshape(NDEV, -1, *x.shape[1:]), batch)


@functools.lru_cache(maxsize=None)
def schedule():
  state, _ = setup()
  profile = pj.GradientProfile.from_params(state.params, forward_s=1e-3, backward_s=2e-3)
  return pj.plan(profile, pj.NetworkModel(alpha_s=1e-5, beta_s_per_byte=1e-9, workers=NDEV), "wfbp")


def test_profile_step_runs_a_model_that_names_the_data_axis():
  state, batches = setup()
  profile = pj.profile_step(loss_of, state.params, batches[0], has_state=True, model_state=state.batch_stats,
                            axis_name=AXIS, steps=1, warmup=1)
  assert sorted(r.path for r in profile.rows) == sorted(r[0] for r in schedule().rows)
  assert profile.backward_s > 0 and profile.method in ("measured", "timed")
  with pytest.raises(ValueError, match=r"loss_fn reduces over the axis 'batch' \(e\.g\. flax's "
                                       r"BatchNorm\(axis_name='batch'\).*Pass axis_name='batch'"):
    pj.profile_step(loss_of, state.params, batches[0], has_state=True, model_state=state.batch_stats, steps=1)


def test_hooked_under_pmap_equals_the_original_step_and_choose_compares_the_train_states():
  state, batches = setup()
  grad_fn = pj.hooked(loss_of, schedule(), axis_name=AXIS, has_state=True)
  original = jax.pmap(original_step, axis_name=AXIS)
  hooked = jax.pmap(hooked_step(grad_fn), axis_name=AXIS)
  got, ref = jax_utils.replicate(state), jax_utils.replicate(state)
  for b in batches:
    got, _ = hooked(got, _per_device(b))
    ref, _ = original(ref, _per_device(b))
  before = state.params
  assert_trees_close(jax_utils.unreplicate(got).params, jax_utils.unreplicate(ref).params, before)
  assert_trees_close(jax_utils.unreplicate(got).batch_stats, jax_utils.unreplicate(ref).batch_stats,
                     state.batch_stats)
  c = pj.choose({"hooked": hooked}, jax_utils.replicate(state), [_per_device(b) for b in batches],
                control=original, rounds=6)
  assert c.compared["hooked"].startswith("equal"), c.compared


def test_a_leftover_pmean_of_the_gradients_is_diagnosed_by_the_audit():
  state, batches = setup()
  grad_fn = pj.hooked(loss_of, schedule(), axis_name=AXIS, has_state=True)
  args = (jax_utils.replicate(state), _per_device(batches[0]))
  compiled = jax.pmap(hooked_step(grad_fn, leftover=True), axis_name=AXIS).lower(*args).compile()
  report = pj.audit(compiled, schedule())
  assert not report.ok
  assert report.problems[0].startswith("a second all-reduce of the gradients remains"), report.describe()
  assert "jax.lax.pmean(grads, axis)" in report.problems[0] and "Remove it" in report.problems[0]


def test_dynamic_scale_pairs_with_scheduled_as_docs_usage_writes_it():
  """docs/usage.md's dynamic loss scaling with `scheduled` (no axis_name; the devices agree on the
  overflow and the scale) equals flax's example step (DynamicScale averaging the gradients itself), on a
  batch that overflows on one device only: every device skips that step and backs the scale off."""
  import re
  from pathlib import Path

  from flax.training import dynamic_scale as dynamic_scale_lib

  text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
  code = re.search(r"```python\n(dyn, is_fin.*?)```", text, re.S).group(1)

  class State(train_state.TrainState):
    dynamic_scale: dynamic_scale_lib.DynamicScale

  def loss_fn(p, x):
    return jnp.mean((x @ p["w"]) ** 2), None

  def finish(state, new_state, dyn, is_fin):
    keep = functools.partial(jnp.where, is_fin)
    return new_state.replace(params=jax.tree.map(keep, new_state.params, state.params),
                             opt_state=jax.tree.map(keep, new_state.opt_state, state.opt_state), dynamic_scale=dyn)

  def example(state, x):   # flax's imagenet example: DynamicScale averages the gradients
    dyn, is_fin, _, grads = state.dynamic_scale.value_and_grad(lambda p: loss_fn(p, x), has_aux=True,
                                                               axis_name=AXIS)(state.params)
    return finish(state, state.apply_gradients(grads=grads), dyn, is_fin)

  def documented(state, x):
    ns = {"jax": jax, "jnp": jnp, "state": state, "loss_fn": lambda p: loss_fn(p, x)}
    exec(code.replace('"batch"', repr(AXIS)), ns)  # noqa: S102
    return finish(state, ns["new_state"], ns["dyn"], ns["is_fin"])

  params = {"w": jnp.full((4, 2), 0.1, jnp.float32)}
  schedule = pj.plan(pj.GradientProfile.from_params(params), pj.NetworkModel.preset("10gbe", workers=NDEV), "wfbp")
  tx = optax.sgd(0.1, momentum=0.9)
  x = np.ones((NDEV, 2, 4), np.float32)
  bad = x.copy()
  bad[0, 0, 0] = np.inf                    # device 0's gradients overflow, the others' do not
  states = []
  for f, t in ((example, tx), (documented, pj.scheduled(tx, schedule, axis_name=AXIS))):
    s = jax_utils.replicate(State.create(apply_fn=None, params=params, tx=t, dynamic_scale=dynamic_scale_lib.DynamicScale()))
    s = s.replace(opt_state=jax.pmap(t.init, axis_name=AXIS)(s.params))
    step = jax.pmap(f, axis_name=AXIS)
    for batch in (bad, x, x):
      s = step(s, batch)
    states.append(s)
  ref, got = states
  assert np.all(np.asarray(ref.dynamic_scale.scale) == 2.0 ** 15)       # 2**16 backed off once, everywhere
  assert not np.allclose(np.asarray(ref.params["w"]), 0.1)              # and the two good steps trained
  for a, b in zip(jax.tree.leaves((got.params, got.dynamic_scale)), jax.tree.leaves((ref.params, ref.dynamic_scale))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
