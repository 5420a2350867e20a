"""MG-WFBP's merge rule against brute force over contiguous merges of the ready order (plain step).

The rule is not optimal (docs/facts.md, "The field"): this reports how far from the best contiguous merge it lands on
random instances of up to 7 layers (one row per layer), and checks it is never slower than wfbp or
one bucket. Times are the simulator's. Prints a summary; writes bench/results/mgwfbp_gap.json; never
asserts.

    .venv/bin/python bench/mgwfbp_gap.py [--instances 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib

import numpy as np

from prophet_jax import Bucket, Chunk, GradientProfile, NetworkModel, Schedule, simulate
from prophet_jax.schedulers import bucket, mgwfbp, wfbp


def instance(rng: np.random.Generator) -> tuple[GradientProfile, NetworkModel]:
  layers = int(rng.integers(2, 8))
  sizes = rng.integers(1, 20_000, size=layers)
  ready = np.sort(rng.uniform(0, 0.01, size=layers))[::-1]        # forward order, ready back to front
  rows = [dict(path=f"l{i}/w", layer=f"l{i}", shape=(int(n),), dtype="float32", nbytes=4 * int(n),
               ready_s=float(r)) for i, (n, r) in enumerate(zip(sizes, ready))]
  p = GradientProfile.from_rows(rows, forward_s=0.002, backward_s=float(ready.max()))
  net = NetworkModel(alpha_s=float(10 ** rng.uniform(-6, -3.5)), beta_s_per_byte=float(10 ** rng.uniform(-10, -8)),
                     workers=int(rng.choice([2, 4, 8, 16])))
  return p, net


def brute_force(p: GradientProfile, net: NetworkModel) -> float:
  order = list(p.ready_order())
  best = float("inf")
  for cuts in itertools.product((False, True), repeat=len(order) - 1):
    groups, cur = [], [order[0]]
    for r, cut in zip(order[1:], cuts):
      if cut:
        groups.append(cur)
        cur = []
      cur.append(r)
    groups.append(cur)
    s = Schedule(buckets=tuple(Bucket(chunks=(Chunk(slices=tuple((r, 0, p.rows[r].size) for r in g),
                                                    dtype="float32"),)) for g in groups),
                 rows=p.tree_rows(), policy="brute")
    best = min(best, simulate(s, p, net, events=False).iteration_s)
  return best


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--instances", type=int, default=3000)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()
  rng = np.random.default_rng(a.seed)
  gaps, worse_than_baseline = [], 0
  for _ in range(a.instances):
    p, net = instance(rng)
    t = {name: simulate(f(p, net, cross_step=False), p, net, events=False).iteration_s
         for name, f in (("mgwfbp", mgwfbp()), ("wfbp", wfbp()), ("one", bucket(bucket_bytes=2**40)))}
    opt = brute_force(p, net)
    gaps.append(t["mgwfbp"] / opt)
    worse_than_baseline += t["mgwfbp"] > min(t["wfbp"], t["one"]) * (1 + 1e-9)
  g = np.asarray(gaps)
  summary = {"instances": a.instances, "seed": a.seed, "optimal_fraction": float(np.mean(g <= 1 + 1e-9)),
             "median_gap": float(np.median(g)), "p99_gap": float(np.quantile(g, 0.99)),
             "max_gap": float(g.max()), "slower_than_wfbp_or_one_bucket": int(worse_than_baseline)}
  print("; ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
  out = pathlib.Path(__file__).parent / "results" / "mgwfbp_gap.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(summary, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
