"""`bucket(style="ddp")` against `bucket(style="horovod")` on the bundled traces: simulated step times.

Every bundled trace ({resnet50, vgg16, bert-base, gpt2} x {v100, h100}) x {10gbe, 25gbe, 100gb-ib} x
workers {4, 16, 64, 256, 2048} x both step modes, four bucketings:
  ddp          bucket() : DDP's steady state, 25 MiB, 1 MiB first bucket, close once the cap is reached
  horovod      bucket(style="horovod") : 64 MiB fusion per 5 ms cycle, close before overflow
  horovod_1ms  bucket(style="horovod", bucket_bytes=128 MiB, cycle_s=1 ms) : Horovod >= v0.21's defaults
  horovod_nocycle  Horovod's 64 MiB rule alone (close before overflow) over the whole ready order, no
               cycle: an idealised Horovod whose background thread always finds its buffer full
  legacy       the `bucket` before issue 19: 25 MiB, close before overflow, no first bucket, no cycle
               (what the README's tables were computed with)
Times are the simulator's. Prints the ratio of each to ddp (min, median, max over the cells) and the
worst cells; writes bench/results/bucket_styles.json. Never asserts.

    .venv/bin/python bench/bucket_styles.py
"""

from __future__ import annotations

import json
import pathlib
import statistics

from _schedules import schedule_of

from prophet_jax import GradientProfile, NetworkModel, plan, simulate
from prophet_jax.models import load_trace

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
DEVICES = ("v100", "h100")
NETWORKS = ("10gbe", "25gbe", "100gb-ib")
WORKERS = (4, 16, 64, 256, 2048)
STYLES = {"ddp": {}, "horovod": {"style": "horovod"},
          "horovod_1ms": {"style": "horovod", "bucket_bytes": 128 * 2**20, "cycle_s": 1e-3}}
OUT = pathlib.Path(__file__).resolve().parent / "results" / "bucket_styles.json"


def close_before_overflow(prof: GradientProfile, cap: int) -> list[list[tuple[int, int, int]]]:
  """`bucket` before issue 19 (and XLA's combiner rule): whole rows in ready order; a row that would
  overflow the open bucket closes it, and a bucket that reaches `cap` closes; no first bucket, no
  cycle. Zero-size rows are in no bucket."""
  groups, cur, size = [], [], 0
  for r in prof.ready_order():
    row = prof.rows[r]
    if not row.nbytes:
      continue
    if cur and size + row.nbytes > cap:
      groups.append(cur)
      cur, size = [], 0
    cur.append((r, 0, row.size))
    size += row.nbytes
    if size >= cap:
      groups.append(cur)
      cur, size = [], 0
  return groups + ([cur] if cur else [])


def main() -> None:
  cells = []
  for model in MODELS:
    for device in DEVICES:
      prof = load_trace(f"{model}-{device}")
      legacy = schedule_of(prof, close_before_overflow(prof, 25 * 2**20), policy="bucket")
      nocycle = schedule_of(prof, close_before_overflow(prof, 64 * 2**20), policy="bucket")
      for net_name in NETWORKS:
        for workers in WORKERS:
          net = NetworkModel.preset(net_name, workers=workers)
          for cross_step in (False, True):
            t = {k: simulate(plan(prof, net, "bucket", cross_step=cross_step, **o), prof, net,
                             cross_step=cross_step, events=False).iteration_s for k, o in STYLES.items()}
            t["legacy"] = simulate(legacy, prof, net, cross_step=cross_step, events=False).iteration_s
            t["horovod_nocycle"] = simulate(nocycle, prof, net, cross_step=cross_step,
                                            events=False).iteration_s
            cells.append({"trace": f"{model}-{device}", "network": net_name, "workers": workers,
                          "cross_step": cross_step, **{f"{k}_s": v for k, v in t.items()}})
  summary = {}
  print(f"{len(cells)} cells; step time relative to ddp (>1: slower than DDP's buckets)")
  print(f"{'vs ddp':16s} {'min':>7s} {'median':>7s} {'max':>7s}   worst cell")
  for k in ("horovod", "horovod_1ms", "horovod_nocycle", "legacy"):
    r = [c[f"{k}_s"] / c["ddp_s"] for c in cells]
    worst = max(cells, key=lambda c: abs(c[f"{k}_s"] / c["ddp_s"] - 1))
    summary[k] = {"min": min(r), "median": statistics.median(r), "max": max(r),
                  "worst": {kk: worst[kk] for kk in ("trace", "network", "workers", "cross_step")}}
    print(f"{k:16s} {min(r):7.3f} {statistics.median(r):7.3f} {max(r):7.3f}   "
          f"{worst['trace']} {worst['network']} P={worst['workers']} cross_step={worst['cross_step']}")
  for cs in (False, True):
    r = [c["horovod_s"] / c["ddp_s"] for c in cells if c["cross_step"] == cs]
    summary[f"horovod_cross_step_{cs}"] = {"min": min(r), "median": statistics.median(r), "max": max(r)}
    print(f"horovod/ddp, cross_step={cs}: {min(r):.3f} .. {max(r):.3f} (median {statistics.median(r):.3f})")
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_text(json.dumps({"summary": summary, "cells": cells}, indent=1))
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
