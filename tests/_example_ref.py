"""The single-device full-batch loop that the examples' multi-process runs must equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np


def full_batch_mlp(steps: int, lr: float = 0.05) -> tuple[dict, dict]:
  """examples/train_flax.py's and train_jit.py's defaults (mlp, sgd lr momentum 0.9, seed 0, the
  model's default global batch, batch k from key 10_000 + k) on one device for `steps` steps:
  (initial params, final params), each as {leaf path: array}."""
  import jax
  import optax

  from prophet_jax._values._tree import flatten_with_paths
  from prophet_jax.models import get_model

  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  tx = optax.sgd(lr, momentum=0.9)

  @jax.jit
  def step(p, o, batch):
    u, o = tx.update(jax.grad(m.loss_fn)(p, batch), o, p)
    return optax.apply_updates(p, u), o

  p, o = params, tx.init(params)
  for k in range(steps):
    p, o = step(p, o, m.make_batch(jax.random.key(10_000 + k), m.default_batch_size))
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


def two_process_results(script) -> list[dict]:
  """Runs `script` under `prophet_jax.launch --nproc 2` and returns each rank's `RESULT <json>` line,
  parsed, by rank; fails with both processes' output when the launch fails."""
  proc = subprocess.run([sys.executable, "-m", "prophet_jax.launch", "--nproc", "2", "--init-timeout",
                         "60", "--", sys.executable, str(script)], capture_output=True, text=True,
                        timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
             if "RESULT " in line]
  assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout[-3000:]
  return sorted(results, key=lambda r: r["rank"])
