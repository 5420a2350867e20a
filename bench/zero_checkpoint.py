"""What converting a ZeRO-1 optimizer state between layouts costs on the host (`unshard_state`,
`shard_state`): the checkpoint path of a sharded (`dear`) schedule.

For ResNet-50 and BERT-base (the bundled traces' parameter shapes), AdamW: a whole state (`tx.init` of
the params, its moments filled with random values) is cut for 8 devices with `shard_state` (global
layout), then gathered back with `unshard_state`; both are timed (median of 3, wall clock, one
process on the host's CPU) and the round trip is checked exact. Beside them, the bytes of the whole
state: the conversion is a copy of it, so its time is that of moving those bytes a few times.

Writes bench/results/zero_checkpoint.json; prints the table; never asserts.

    JAX_PLATFORMS=cpu .venv/bin/python bench/zero_checkpoint.py
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import load_trace  # noqa: E402

N = 8
REPEATS = 3
TRACES = {"resnet50": "resnet50-h100", "bert-base": "bert-base-h100"}
OUT = pathlib.Path(__file__).resolve().parent / "results"


def _tree_from_rows(rows, rng):
  """A params tree of numpy arrays from a profile's (path, shape, dtype) rows ('a/b/c' -> nested)."""
  tree: dict = {}
  for path, shape, dtype in rows:
    node = tree
    *head, leaf = path.split("/")
    for k in head:
      node = node.setdefault(k, {})
    node[leaf] = rng.standard_normal(tuple(shape), np.float32).astype(dtype)
  return tree


def _median_s(f, repeats=REPEATS):
  times, out = [], None
  for _ in range(repeats):
    t = time.perf_counter()
    out = f()
    times.append(time.perf_counter() - t)
  return statistics.median(times), out


def one(name: str, trace: str) -> dict:
  profile = load_trace(trace)
  rng = np.random.default_rng(0)
  params = _tree_from_rows(profile.tree_rows(), rng)
  schedule = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=N), "dear")
  tx = optax.adamw(1e-3)
  whole = jax.tree.map(lambda x: rng.standard_normal(np.shape(x), np.float32).astype(np.asarray(x).dtype)
                       if np.ndim(x) else np.asarray(x), jax.device_get(tx.init(params)))
  nbytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(whole)))
  pj.shard_state(whole, tx, params, schedule, N)  # warm: shard_mode's probe (memoized) and jnp's ops
  cut_s, cut = _median_s(lambda: pj.shard_state(whole, tx, params, schedule, N))
  back_s, back = _median_s(lambda: pj.unshard_state(cut, tx, params, schedule))
  exact = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(whole)))
  return {"model": name, "chunks": len(schedule.chunks), "state_bytes": nbytes, "shard_state_s": cut_s,
          "unshard_state_s": back_s, "round_trip_exact": exact,
          "shard_state_GBps": nbytes / cut_s / 1e9, "unshard_state_GBps": nbytes / back_s / 1e9}


def main() -> None:
  t0 = time.perf_counter()
  rows = [one(name, trace) for name, trace in TRACES.items()]
  result = {"devices": N, "optimizer": "adamw", "network": "10gbe", "policy": "dear", "repeats": REPEATS,
            "rows": rows, "machine": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "seconds": time.perf_counter() - t0}
  OUT.mkdir(exist_ok=True)
  (OUT / "zero_checkpoint.json").write_text(json.dumps(result, indent=1))
  print(f"{'model':10s} {'rs':>3s} {'state MB':>9s} | {'shard_state s':>13s} {'GB/s':>6s} | "
        f"{'unshard_state s':>15s} {'GB/s':>6s} | exact")
  for r in rows:
    print(f"{r['model']:10s} {r['chunks']:3d} {r['state_bytes'] / 1e6:9.1f} | {r['shard_state_s']:13.3f} "
          f"{r['shard_state_GBps']:6.2f} | {r['unshard_state_s']:15.3f} {r['unshard_state_GBps']:6.2f} | "
          f"{r['round_trip_exact']}")
  print(f"AdamW, {N} devices, median of {REPEATS} (wall clock, host CPU); GB/s = the whole state's bytes / "
        f"time. {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  main()
