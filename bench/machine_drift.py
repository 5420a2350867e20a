"""How steady is this machine? The same compiled step, timed in blocks for a while.

The accuracy bench (bench/profile_accuracy.py) predicts step times from a profile taken before the
timed rounds; that can only be as good as the machine is steady between the two. This times one
program, the profile's local step (gradients and optax.sgd's update on 8 host devices, no
reduction), in consecutive blocks of `--block` steps for `--seconds`, and reports the spread of the
block medians and their lag-1 autocorrelation (near 0: independent noise that a longer median
averages away; near 1: slow drift that no median taken earlier can follow).

  .venv/bin/python bench/machine_drift.py [--model gpt-tiny] [--seconds 25] [--block 50]
                                          [--out bench/results/machine_drift.json]

A benchmark: it prints and writes numbers, it asserts nothing.
"""

from __future__ import annotations

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def block_medians(step, seconds: float, block: int) -> np.ndarray:
  """Median wall seconds of each block of `block` consecutive calls of `step`, for `seconds`."""
  import jax

  meds, t_end = [], time.perf_counter() + seconds
  while time.perf_counter() < t_end:
    walls = []
    for _ in range(block):
      t0 = time.perf_counter()
      jax.block_until_ready(step())
      walls.append(time.perf_counter() - t0)
    meds.append(float(np.median(walls)))
  return np.asarray(meds)


def local_step(m, tx):
  """(step, devices): the profiler's local step, gradients then `tx`'s update on every device with no
  reduction (`shard_map` with check_vma off), as a closure over fixed inputs."""
  import jax
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.asarray(jax.devices()), ("d",))
  params = jax.device_put(m.init(jax.random.key(0)), NamedSharding(mesh, P()))
  batch = jax.device_put(m.make_batch(jax.random.key(1), m.default_batch_size), NamedSharding(mesh, P("d")))
  state = tx.init(params)

  def step(p, s, b):
    u, s = tx.update(jax.grad(m.loss_fn)(p, b), s, p)
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()),
                            check_vma=False))
  return (lambda: f(params, state, batch)), mesh.devices.size


def lag1(x: np.ndarray) -> float:
  d = x - x.mean()
  den = float((d * d).sum())
  return float((d[1:] * d[:-1]).sum() / den) if den > 0 else 0.0


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="gpt-tiny")
  ap.add_argument("--seconds", type=float, default=25.0)
  ap.add_argument("--block", type=int, default=50, help="steps per block (one median each)")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "machine_drift.json"))
  a = ap.parse_args()
  import jax
  import optax

  from prophet_jax.models import get_model

  step, devices = local_step(get_model(a.model), optax.sgd(0.05, momentum=0.9))
  for _ in range(3):
    jax.block_until_ready(step())
  load = os.getloadavg()
  meds = block_medians(step, a.seconds, a.block)
  p10, p50, p90 = (float(np.percentile(meds, q)) for q in (10, 50, 90))
  r1 = lag1(meds)
  print(f"{a.model}, local step on {devices} devices: {len(meds)} blocks of {a.block} steps in "
        f"{a.seconds:g} s (load {load[0]:.2f} at start)")
  print("  block medians ms: " + " ".join(f"{x * 1e3:.2f}" for x in meds))
  print(f"  median {p50 * 1e3:.3f} ms, p10 {p10 * 1e3:.3f}, p90 {p90 * 1e3:.3f}, min {meds.min() * 1e3:.3f}, "
        f"max {meds.max() * 1e3:.3f} (max/min {meds.max() / meds.min():.2f}x); lag-1 autocorrelation "
        f"{r1:.2f}")
  out = {"model": a.model, "devices": devices, "block": a.block, "seconds": a.seconds,
         "host": platform.node(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
         "loadavg_before": load, "block_median_s": meds.tolist(), "median_s": p50, "p10_s": p10,
         "p90_s": p90, "lag1_autocorrelation": r1,
         "command": f".venv/bin/python bench/machine_drift.py --model {a.model} --seconds {a.seconds:g} "
                    f"--block {a.block}"}
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps(out, indent=1))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
