"""Ordinary user train steps as small, fast, reusable fixtures, each with the reference it must equal.

A `Setup` is what a user brings: params, a loss, an optimizer, a few global batches, and maybe a model
state. Its loss has one of the shapes `jax.value_and_grad` takes:

- `loss_fn(params, batch) -> loss`, or `-> (loss, aux)` with `has_aux`;
- `loss_fn(params, model_state, batch) -> (loss, new_model_state)` when `model_state` is not None
  (BatchNorm statistics, a PRNG key): the plain loop feeds each step the state the previous step
  returned; `pipelined(..., has_state=True)` does the same from its `PipelinedState`.

The setups (`SETUPS`):

- `int-labels`: an MLP classifier with integer labels (`softmax_cross_entropy_with_integer_labels`,
  whose nested calls mix batch values and constant indices), returning `(loss, aux)` with the number of
  correct predictions on the device's batch; sgd-momentum.
- `batchnorm`: a flax MLP with `BatchNorm` (mutable `batch_stats`), `loss_fn(params, batch_stats,
  batch) -> (loss, new batch_stats)`, the statistics averaged over the devices in the loss; sgd-momentum.
- `dropout-batch-key`: dropout whose per-example typed keys (`jax.random.key`) are in the batch.
- `dropout-state-key`: dropout whose typed key is the model state, split every step; each example's
  mask comes from that step's key folded with the example's global index.
- `adamw` and `clip-adamw`: the classifier with `adamw`, and with `optax.chain(clip_by_global_norm,
  adamw)` (for `scheduled`: `scheduled(chain(...))`, the all-reduce first).
- `mixed-bf16`: a flax MLP whose first and last layers keep bfloat16 params (computing in float32,
  flax's promotion), the middle one float32; sgd-momentum.

References (`Setup.reference`): the single-device full-batch step, the ground truth, except where it is
not the same computation, and then the plain data-parallel step (`jax.grad`, `lax.pmean`, `tx`) under the
same mapping:

- `batchnorm`: per-device statistics are the design (flax's `BatchNorm` without `axis_name`, as in its
  pmap ImageNet example): each device normalises its 4 examples with their own mean and variance, so
  the gradient is not the full-batch gradient. The plain `pmean` step is the reference.
- `mixed-bf16`: bfloat16 gradients are rounded per device before the mean, while the single-device
  step rounds the full-batch gradient once: the two differ by bfloat16 rounding (measured 1.2e-2 to
  2.1e-2 of the update on the bfloat16 leaves, 5.7e-3 on the float32 leaf after 3 steps, beyond
  docs/design.md's 1e-2 and 1e-3). The plain `pmean` step rounds the same way, and is the reference.

Sgd with momentum shows a wrong gradient scale; Adam hides one (its update is nearly invariant to the
scale). So the adamw setups use `eps=1e-3`, of the size of the small gradients, where the update does
depend on the scale; and `clip-adamw`'s `max_norm` lies between the first step's gradient norm and the
later ones', so it clips once (where a scale would not show) and then not (where it does).

Every schedule plans several chunks (`schedule_for` rotates the policies, on a network with a small
alpha): one chunk proves nothing about order or slicing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import prophet_jax as pj

N_DEV = 8
BATCH = 32  # global: 4 examples per device
STEPS = 3
IN, HID, OUT = 8, 16, 4
DROP = 0.75  # keep probability


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
  """A user's train step: what the three APIs are given, and what they must equal.

  Attributes:
    name: the setup's name.
    params: the initial parameters.
    loss_fn: see the module docstring for its three shapes.
    has_aux: `loss_fn(params, batch)` returns `(loss, aux)` (aux: a per-device count, summed over
      devices it equals the full batch's).
    model_state: the initial model state, or None when `loss_fn` takes none.
    make_tx: the optimizer (a fresh one per call).
    batches: `STEPS` global batches (numpy arrays, typed key arrays).
    reference: "single-device" or "pmean" (why, in the module docstring).
    policy, options: how `schedule_for` plans it.
  """

  name: str
  params: Any
  loss_fn: Callable[..., Any]
  has_aux: bool
  model_state: Any
  make_tx: Callable[[], optax.GradientTransformation]
  batches: tuple
  reference: str
  policy: str
  options: tuple = ()

  @property
  def has_state(self) -> bool:
    return self.model_state is not None


# --------------------------------------------------------------------------------------------------
# models and data


def _mlp_params(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  dims = [(IN, HID), (HID, HID), (HID, OUT)]
  return {f"l{k}": {"w": jnp.asarray(rng.normal(size=d) / np.sqrt(d[0]), jnp.float32),
                    "b": jnp.asarray(rng.normal(size=d[1]) * 0.1, jnp.float32)}
          for k, d in enumerate(dims)}


def _hidden(p, x):
  h = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
  return jnp.tanh(h @ p["l1"]["w"] + p["l1"]["b"])


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def classifier_loss(p, batch):
  """(mean cross entropy with integer labels, number of correct predictions)."""
  logits = _hidden(p, batch["x"]) @ p["l2"]["w"] + p["l2"]["b"]
  correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"]).astype(jnp.int32)
  return _xent(logits, batch["y"]), correct


def _dropout(h, keys):
  """Per-example inverted dropout, each example's mask from its own key."""
  keep = jax.vmap(lambda k: jax.random.bernoulli(k, DROP, h.shape[1:]))(keys)
  return jnp.where(keep, h / DROP, 0.0)


def dropout_batch_key_loss(p, batch):
  h = _dropout(_hidden(p, batch["x"]), batch["key"])
  return _xent(h @ p["l2"]["w"] + p["l2"]["b"], batch["y"])


def dropout_state_key_loss(p, key, batch):
  """The key is the model state: split once per step, folded with each example's global index."""
  key, sub = jax.random.split(key)
  keys = jax.vmap(lambda i: jax.random.fold_in(sub, i))(batch["idx"])
  h = _dropout(_hidden(p, batch["x"]), keys)
  return _xent(h @ p["l2"]["w"] + p["l2"]["b"], batch["y"]), key


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(HID, use_bias=False)(x)  # a bias before BatchNorm has zero gradient: none, as usual
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
    x = jnp.tanh(x)
    return nn.Dense(OUT)(x)


class MixedNet(nn.Module):
  """bfloat16 params in the first and last layers (computing in float32), float32 in the middle."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(HID, param_dtype=jnp.bfloat16)(x))
    x = jnp.tanh(nn.Dense(HID)(x))
    return nn.Dense(OUT, param_dtype=jnp.bfloat16)(x)


def make_batchnorm_loss(axis_name: str) -> Callable[..., Any]:
  """`loss_fn(params, batch_stats, batch) -> (loss, new batch_stats)`, the statistics averaged over
  `axis_name` (the same on every device); without the axis bound (one device), as they are."""
  net = BNNet()

  def loss_fn(params, batch_stats, batch):
    logits, upd = net.apply({"params": params, "batch_stats": batch_stats}, batch["x"], train=True,
                            mutable=["batch_stats"])
    stats = upd["batch_stats"]
    try:
      stats = jax.lax.pmean(stats, axis_name)
    except NameError:  # the single-device reference: no axis bound
      pass
    return _xent(logits, batch["y"]), stats

  return loss_fn


def mixed_loss(p, batch):
  return _xent(MixedNet().apply(p, batch["x"]), batch["y"])


def _batches(seed: int, *, keys: bool = False, idx: bool = False) -> tuple:
  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(IN, OUT))
  out = []
  for k in range(STEPS):
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.5 * rng.normal(size=(BATCH, OUT)), -1).astype(np.int32)
    b = {"x": x, "y": y}
    if keys:
      b["key"] = jax.random.split(jax.random.key(1000 + k), BATCH)
    if idx:
      b["idx"] = np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int32)
    out.append(b)
  return tuple(out)


# --------------------------------------------------------------------------------------------------
# the setups


def sgd_momentum():
  return optax.sgd(0.2, momentum=0.9)


def adamw():
  return optax.adamw(1e-2, eps=1e-3, weight_decay=1e-2)


def clip_adamw():
  return optax.chain(optax.clip_by_global_norm(CLIP_NORM), adamw())


# between the first step's full-batch gradient norm and the later ones' (checked in test_user_steps)
CLIP_NORM = 0.95


@functools.cache
def setups(axis_name: str = "data") -> dict[str, Setup]:
  cls = _mlp_params(0)
  plain = _batches(1)
  x = np.zeros((1, IN), np.float32)
  bn_vars = jax.jit(BNNet().init)(jax.random.key(2), x)  # jitted: one compile, not one per op
  mixed = jax.jit(MixedNet().init)(jax.random.key(3), x)
  out = [
      Setup(name="int-labels", params=cls, loss_fn=classifier_loss, has_aux=True, model_state=None,
            make_tx=sgd_momentum, batches=plain, reference="single-device", policy="wfbp"),
      Setup(name="batchnorm", params=bn_vars["params"], loss_fn=make_batchnorm_loss(axis_name),
            has_aux=False, model_state=bn_vars["batch_stats"], make_tx=sgd_momentum,
            batches=_batches(4), reference="pmean", policy="mgwfbp"),
      Setup(name="dropout-batch-key", params=cls, loss_fn=dropout_batch_key_loss, has_aux=False,
            model_state=None, make_tx=sgd_momentum, batches=_batches(5, keys=True),
            reference="single-device", policy="priority", options=(("partition_bytes", 256),)),
      Setup(name="dropout-state-key", params=cls, loss_fn=dropout_state_key_loss, has_aux=False,
            model_state=jax.random.key(6), make_tx=sgd_momentum, batches=_batches(6, idx=True),
            reference="single-device", policy="bucket", options=(("bucket_bytes", 128),)),
      Setup(name="adamw", params=cls, loss_fn=classifier_loss, has_aux=True, model_state=None,
            make_tx=adamw, batches=plain, reference="single-device", policy="prophet"),
      Setup(name="clip-adamw", params=cls, loss_fn=classifier_loss, has_aux=True, model_state=None,
            make_tx=clip_adamw, batches=plain, reference="single-device", policy="auto"),
      Setup(name="mixed-bf16", params=mixed, loss_fn=mixed_loss, has_aux=False, model_state=None,
            make_tx=sgd_momentum, batches=_batches(7), reference="pmean", policy="wfbp"),
  ]
  return {s.name: s for s in out}


SETUP_NAMES = ("int-labels", "batchnorm", "dropout-batch-key", "dropout-state-key", "adamw", "clip-adamw",
               "mixed-bf16")

# a network with a small per-message cost: merging buys little, so every policy plans several chunks
NETWORK = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-9, workers=N_DEV)


@functools.cache
def schedule_for(name: str) -> pj.Schedule:
  s = setups()[name]
  profile = pj.GradientProfile.from_params(s.params, forward_s=1e-4, backward_s=2e-4)
  return pj.plan(profile, NETWORK, s.policy, **dict(s.options))


# --------------------------------------------------------------------------------------------------
# the single-device reference


def value_and_grad(s: Setup, params, model_state, batch):
  """((loss, aux or new model state or None), grads) of the setup's loss, as the plain loop takes it."""
  if s.has_state:
    return jax.value_and_grad(s.loss_fn, has_aux=True)(params, model_state, batch)
  if s.has_aux:
    return jax.value_and_grad(s.loss_fn, has_aux=True)(params, batch)
  loss, g = jax.value_and_grad(s.loss_fn)(params, batch)
  return (loss, None), g


@functools.cache
def _single_device_run(name: str):
  """STEPS plain steps on one device with the full batch: (params, model_state, [(loss, aux)], [the
  full-batch gradient's global norm])."""
  s = setups()[name]
  tx = s.make_tx()

  @jax.jit
  def step(p, o, ms, b):
    (loss, out), g = value_and_grad(s, p, ms, b)
    u, o = tx.update(g, o, p)
    ms, aux = (out, None) if s.has_state else (ms, out)
    return optax.apply_updates(p, u), o, ms, (loss, aux), optax.tree.norm(g)

  p, o, ms = s.params, tx.init(s.params), s.model_state
  history, norms = [], []
  for b in s.batches:
    p, o, ms, la, norm = step(p, o, ms, b)
    history.append(jax.device_get(la))
    norms.append(float(norm))
  return jax.device_get(p), ms, history, norms


def single_device_reference(name: str):
  """STEPS plain steps on one device with the full batch: (params, model_state, [(loss, aux)])."""
  return _single_device_run(name)[:3]


def gradient_norms(name: str) -> list[float]:
  """The full-batch gradient's global norm at each step of the single-device reference."""
  return _single_device_run(name)[3]
