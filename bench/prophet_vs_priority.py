"""Prophet against ByteScheduler-style `priority` in the pipelined step, on the bundled traces.

The issue's target: with cross_step=True, prophet at least 1.2x faster than priority at ByteScheduler's
defaults (1M-parameter partitions, 4M-parameter credit), median over the *balanced* cells
(allreduce_s(total bytes) / (forward_s + backward_s) in [0.7, 1.5]); also reported against priority
tuned over its partition size, and, in the plain step, mgwfbp against wfbp (never slower). Times are
the simulator's predictions. Prints a table; writes bench/results/prophet_vs_priority.json; never
asserts.

    .venv/bin/python bench/prophet_vs_priority.py
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

from prophet_jax import NetworkModel, simulate
from prophet_jax.models import load_trace
from prophet_jax.schedulers import mgwfbp, priority, prophet, wfbp

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
DEVICES = ("v100", "h100")
NETWORKS = ("10gbe", "25gbe", "100gb-ib")
WORKERS = (4, 16, 64, 256, 2048)
PARTITIONS = (2**18, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)


def _t(scheduler, p, n, cross_step):
  return simulate(scheduler(p, n, cross_step=cross_step), p, n, cross_step=cross_step,
                  events=False).iteration_s


def main() -> None:
  cells = []
  print(f"{'model':9s} {'dev':4s} {'network':8s} {'P':>5s} {'ratio':>6s}   {'prophet':>8s} {'cpu ms':>6s} "
        f"{'priority':>9s} {'tuned':>8s} {'x prio':>7s} {'x tuned':>7s}  {'mg/wfbp':>7s}")
  for model in MODELS:
    for dev in DEVICES:
      p = load_trace(f"{model}-{dev}")
      for net in NETWORKS:
        for workers in WORKERS:
          n = NetworkModel.preset(net, workers=workers)
          ratio = n.allreduce_s(p.total_nbytes) / (p.forward_s + p.backward_s)
          c0 = time.process_time()
          sched = prophet()(p, n, cross_step=True)
          cpu = time.process_time() - c0
          t_pro = simulate(sched, p, n, cross_step=True, events=False).iteration_s
          t_pri = _t(priority(), p, n, True)
          t_tuned = min(_t(priority(partition_bytes=b), p, n, True) for b in PARTITIONS)
          mg = _t(mgwfbp(), p, n, False) / _t(wfbp(), p, n, False)
          balanced = 0.7 <= ratio <= 1.5
          cells.append({"model": model, "device": dev, "network": net, "workers": workers,
                        "ratio": ratio, "balanced": balanced, "prophet_s": t_pro,
                        "prophet_allreduces": sched.num_allreduces, "prophet_plan_cpu_ms": cpu * 1e3,
                        "priority_s": t_pri, "priority_tuned_s": t_tuned, "mgwfbp_over_wfbp": mg})
          print(f"{model:9s} {dev:4s} {net:8s} {workers:5d} {ratio:6.2f}{' B' if balanced else '  '} "
                f"{t_pro:8.4f} {cpu * 1e3:6.1f} {t_pri:9.4f} {t_tuned:8.4f} {t_pri / t_pro:7.2f} "
                f"{t_tuned / t_pro:7.2f}  {mg:7.3f}")
  bal = [c for c in cells if c["balanced"]]
  summary = {
      "balanced_cells": len(bal),
      "median_speedup_vs_priority": statistics.median(c["priority_s"] / c["prophet_s"] for c in bal),
      "median_speedup_vs_priority_tuned": statistics.median(c["priority_tuned_s"] / c["prophet_s"]
                                                            for c in bal),
      "min_speedup_vs_priority": min(c["priority_s"] / c["prophet_s"] for c in bal),
      "max_mgwfbp_over_wfbp": max(c["mgwfbp_over_wfbp"] for c in cells),
      "max_prophet_plan_cpu_ms": max(c["prophet_plan_cpu_ms"] for c in cells),
  }
  print("; ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
  out = pathlib.Path(__file__).parent / "results" / "prophet_vs_priority.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"summary": summary, "cells": cells}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
