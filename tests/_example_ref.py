"""The single-device full-batch loop that the examples' multi-process runs must equal."""

from __future__ import annotations

import os

import numpy as np


def full_batch_mlp(steps: int, lr: float = 0.05) -> tuple[dict, dict]:
  """examples/train_flax.py's and train_jit.py's defaults (mlp, sgd lr momentum 0.9, seed 0, the
  model's default global batch, batch k from key 10_000 + k) on one device for `steps` steps:
  (initial params, final params), each as {leaf path: array}."""
  import jax
  import optax

  from _reference import full_batch
  from prophet_jax._values._tree import flatten_with_paths
  from prophet_jax.models import get_model

  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  batches = [m.make_batch(jax.random.key(10_000 + k), m.default_batch_size) for k in range(steps)]
  p, _ = full_batch(m.loss_fn, params, optax.sgd(lr, momentum=0.9), batches)
  as_dict = lambda t: {k: np.asarray(v) for k, v in flatten_with_paths(t)}  # noqa: E731
  return as_dict(params), as_dict(p)


def example_env() -> dict[str, str]:
  """The environment of a child process that runs an example or a launch: 8 host CPU devices at the
  suite's backend optimisation level, a 60 s initialization timeout."""
  env = dict(os.environ)
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu", PROPHET_INIT_TIMEOUT_S="60")
  return env


def load_npz(path) -> dict[str, np.ndarray]:
  """Every array of an .npz file, by name."""
  with np.load(path) as z:
    return {k: z[k] for k in z.files}
