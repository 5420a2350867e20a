"""How long `scheduled(..., mesh=).init` takes when called outside `jax.jit` (as `TrainState.create`
and `nnx.Optimizer` call it), per plan family, against the same init under `jax.jit`.

A sharded (`dear`, ZeRO-1) state is made on every device of the mesh (`jax.shard_map`). Un-jitted, a
`shard_map` runs its body op by op on every device: seconds per call on a 2-core host (issue 35: 4-6 s);
the library now jits it itself. Columns: the first call (the shardability probe and the compile), the
median of the next `--repeats` calls, the median under the user's own `jax.jit`; and, for `dear`, one
call of the old un-jitted path (`before s`). An MLP of `--layers` 256x256 layers on 8 host devices.

    .venv/bin/python bench/init_time.py [--layers 6] [--repeats 5]

Writes bench/results/init_time.json and prints a table. Never asserts. Noisy machine: medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "init_time.json"
AX = "dp"


def _timed(fn) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=6)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((256, 256)) * 0.05, jnp.float32),
                      "b": jnp.zeros((256,), jnp.float32)} for i in range(args.layers)}
  mesh = jax.make_mesh((8,), (AX,))
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  net = pj.NetworkModel.preset("10gbe", workers=8)
  rows = []
  for name, policy, kw in [("dear", "dear", {}), ("wfbp", "wfbp", {}), ("dlcp", "dlcp", {"max_defer": 0.5}),
                           ("every_k=4", "wfbp", {})]:
    schedule = pj.plan(profile, net, policy, **kw)
    tx = pj.scheduled(optax.adamw(1e-3), schedule, axis_name=AX, mesh=mesh,
                      **({"every_k": 4} if name.startswith("every_k") else {}))
    first = _timed(lambda: tx.init(placed))
    eager = statistics.median(_timed(lambda: tx.init(placed)) for _ in range(args.repeats))
    with jax.set_mesh(mesh):
      jitted_init = jax.jit(tx.init)
      _timed(lambda: jitted_init(placed))
      jitted = statistics.median(_timed(lambda: jitted_init(placed)) for _ in range(args.repeats))
    before = None
    if policy == "dear":   # the old path: the same per-device init in a shard_map, not jitted
      per_device = pj.scheduled(optax.adamw(1e-3), schedule, axis_name=AX)
      before = _timed(lambda: jax.shard_map(per_device.init, mesh=mesh, in_specs=P(), out_specs=P(AX))(placed))
    rows.append({"plan": name, "first_s": first, "eager_s": eager, "jit_s": jitted, "before_s": before})
  print(f"{'plan':<10} {'first s':>8} {'eager s':>8} {'jit s':>8} {'before s':>9}")
  for r in rows:
    before = f"{r['before_s']:9.3f}" if r["before_s"] is not None else f"{'-':>9}"
    print(f"{r['plan']:<10} {r['first_s']:8.3f} {r['eager_s']:8.3f} {r['jit_s']:8.3f} {before}")
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_text(json.dumps({"what": "scheduled(mesh=).init outside jit vs under jit, 8 host devices, "
                                     f"MLP {args.layers}x256x256, adamw; medians of {args.repeats}",
                             "cpus": os.cpu_count(), "load": os.getloadavg()[0], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
