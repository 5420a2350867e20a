"""examples/train_jit.py: the plain `jax.jit` loop on global arrays with `hooked(..., mesh=)` gradients, on one
process (the pipelined mode) and on two under `prophet-jax launch` (the hooked mode), ends where the plain
jit step (the partitioner's own gradient all-reduce) ends, within docs/design.md's tolerance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _example_ref import example_env, load_npz

from tests._assert import assert_trees_close

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_jit.py")
PY = sys.executable
STEPS = 3
LR = 0.05

pytestmark = pytest.mark.multiprocess


_env, _load = example_env, load_npz


def _plain_jit_reference():
  """The example's loop with jax.value_and_grad in place of hooked: (initial, final) params by path."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from prophet_jax._values._tree import flatten_with_paths
  from prophet_jax.models import get_model

  model = get_model("mlp")
  mesh = jax.make_mesh((8,), ("dp",))
  params = jax.device_put(model.init(jax.random.key(0)), NamedSharding(mesh, P()))
  tx = optax.sgd(LR, momentum=0.9)
  opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

  @jax.jit
  def step(p, o, b):
    g = jax.grad(model.loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  before = {k: np.asarray(x) for k, x in flatten_with_paths(params)}
  for k in range(STEPS):
    b = model.make_batch(jax.random.key(10_000 + k), model.default_batch_size)
    params, opt = step(params, opt, jax.device_put(b, NamedSharding(mesh, P("dp"))))
  return before, {k: np.asarray(x) for k, x in flatten_with_paths(params)}


def test_one_and_two_processes_match_the_plain_jit_step(tmp_path):
  one, two = tmp_path / "one.npz", tmp_path / "two.npz"
  args = ["--model", "mlp", "--steps", str(STEPS), "--policy", "mgwfbp", "--lr", str(LR)]
  r1 = subprocess.run([PY, EXAMPLE, *args, "--mode", "pipelined", "--out", str(one)], env=_env(),
                      capture_output=True, text=True, timeout=240)
  assert r1.returncode == 0, r1.stdout + r1.stderr
  assert "1 process(es) x 8 device(s), pipelined" in r1.stdout
  r2 = subprocess.run([PY, "-m", "prophet_jax.launch", "--nproc", "2", "--", PY, EXAMPLE, *args,
                       "--out", str(two)], env=_env(), capture_output=True, text=True, timeout=240)
  assert r2.returncode == 0, r2.stdout + r2.stderr
  assert "[rank 0] rank 0 of 2" in r2.stdout and "[rank 1] rank 1 of 2" in r2.stdout
  assert "2 process(es) x 4 device(s), hooked" in r2.stdout

  before, ref = _plain_jit_reference()
  for got in (_load(one), _load(two)):
    assert sorted(got) == sorted(ref) == sorted(before)
    assert all(np.max(np.abs(ref[k] - before[k])) > 0 for k in ref), "training did not move every leaf"
    assert_trees_close(got, ref, before)
  # the check discriminates: a 1% larger update fails it
  got = _load(two)
  with pytest.raises(AssertionError):
    assert_trees_close({k: before[k] + 1.01 * (got[k] - before[k]) for k in got}, ref, before)
