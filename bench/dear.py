"""DeAR in its own settings (simulated): reduce-scatters in backward, all-gathers in the next forward.

DeAR (Zhang et al., ICDCS 2023) reports up to 83% faster training than its baselines on a 64-GPU
cluster with 10Gb/s Ethernet and up to 15% with 100Gb/s InfiniBand (five models). Its repository
(lzhangbv/dear_pytorch) compares against WFBP and ByteScheduler (no tensor fusion) and Horovod,
PyTorch DDP and MG-WFBP (with fusion); DeAR itself fuses layers into 25 MB buffers by default.

This bench runs those settings on the simulator: ResNet-50 and BERT-base bundled traces (V100 by
default; `--devices v100 h100`), 10GbE and 100Gb IB, 16, 32 and 64 workers, both step modes. Per
cell it simulates every baseline as its system runs it (wfbp; DDP's and Horovod's buckets; mgwfbp;
ByteScheduler's `priority`), our all-reduce planners (`prophet`, `auto`: the best all-reduce plan),
`dear` (buckets planned under the alpha-beta model) and `dear(bucket_bytes=25 MiB)` (DeAR's own
fusion), and the lower bounds (all-reduce schedules, sharded schedules, every schedule).

Three comparisons:
  * DeAR's: dear in the pipelined step (its all-gathers overlap the next forward) against each
    baseline as the paper ran it (the fused and unfused all-reduce baselines in the plain step, a
    ByteScheduler-like `priority` in the pipelined step, since it overlaps the next forward);
  * same mode: dear against the best all-reduce plan (`auto`) in the same step mode;
  * the bound: dear against the bound over sharded schedules and over every schedule.
And the memory a sharded (ZeRO-1) step saves per device: the optimizer state of SGD with momentum
(one f32 copy of the parameters) and of Adam (two), replicated against 1/P of it plus the padding
of every reduce-scatter buffer to a multiple of P (`Schedule.shard_nbytes`), for the dear plan.

Writes bench/results/dear.json; prints the tables (medians and ratios); never asserts.

    .venv/bin/python bench/dear.py                  # V100 traces (about a minute on 2 cores)
    .venv/bin/python bench/dear.py --devices v100 h100
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

from prophet_jax import NetworkModel, lower_bound, plan, simulate
from prophet_jax.models import load_trace

MODELS = ("resnet50", "bert-base")
NETWORKS = ("10gbe", "100gb-ib")
WORKERS = (16, 32, 64)
MIB = 2**20
# (label, policy, options): the baselines as their systems run them, then our planners
BASELINES = (("wfbp", "wfbp", {}), ("ddp", "bucket", {}), ("horovod", "bucket", {"style": "horovod"}),
             ("mgwfbp", "mgwfbp", {}), ("bytescheduler", "priority", {}))
OURS = (("prophet", "prophet", {}), ("auto", "auto", {}), ("dear", "dear", {}),
        ("dear_25MiB", "dear", {"bucket_bytes": 25 * MIB}))
# the paper's headline numbers (arXiv:2302.12445, abstract): speedup over the best of its baselines
PAPER = {"10gbe": {"workers": 64, "speedup_up_to": 0.83}, "100gb-ib": {"workers": 64, "speedup_up_to": 0.15}}
OUT = pathlib.Path(__file__).resolve().parent / "results"


def _sim(schedule, profile, network, cross_step) -> float:
  return simulate(schedule, profile, network, cross_step=cross_step, events=False).iteration_s


def cell(profile, net_name: str, workers: int) -> dict:
  """Every policy in both step modes, the bounds, and the dear plans' shapes, for one cell."""
  net = NetworkModel.preset(net_name, workers=workers)
  out: dict = {"network": net_name, "workers": workers, "plain": {}, "pipelined": {}}
  for mode, cross in (("plain", False), ("pipelined", True)):
    times, shapes = {}, {}
    for label, policy, options in BASELINES + OURS:
      t0 = time.perf_counter()
      s = plan(profile, net, policy, cross_step=cross, **options)
      times[label] = _sim(s, profile, net, cross)
      shapes[label] = ({"reduce_scatters": s.num_reduce_scatters, "all_gathers": s.num_all_gathers,
                        "candidate": dict(s.options).get("candidate")} if s.sharded
                       else {"allreduces": s.num_allreduces})
      shapes[label]["plan_s"] = time.perf_counter() - t0
      if label == "dear":
        out.setdefault("shard_nbytes", s.shard_nbytes(workers))
    out[mode] = {"iteration_s": times, "plans": shapes,
                 "bound_allreduce_s": lower_bound(profile, net, cross_step=cross, sharded=False),
                 "bound_sharded_s": lower_bound(profile, net, cross_step=cross, sharded=True),
                 "bound_s": lower_bound(profile, net, cross_step=cross)}
  plain, piped = out["plain"]["iteration_s"], out["pipelined"]["iteration_s"]
  # DeAR's comparison: dear pipelined against each baseline as the paper ran it
  paper_base = {k: plain[k] for k in ("wfbp", "ddp", "horovod", "mgwfbp")} | {"bytescheduler": piped["bytescheduler"]}
  out["deear_setting"] = {"baselines_s": paper_base, "dear_s": piped["dear"],
                          "speedup_vs": {k: v / piped["dear"] - 1 for k, v in paper_base.items()},
                          "speedup_vs_best_baseline": min(paper_base.values()) / piped["dear"] - 1}
  out["same_mode"] = {m: {"dear_vs_auto": out[m]["iteration_s"]["dear"] / out[m]["iteration_s"]["auto"],
                          "dear_vs_dear_25MiB": out[m]["iteration_s"]["dear"] / out[m]["iteration_s"]["dear_25MiB"],
                          "dear_vs_bound_sharded": out[m]["iteration_s"]["dear"] / out[m]["bound_sharded_s"],
                          "best_vs_bound": min(out[m]["iteration_s"]["auto"], out[m]["iteration_s"]["dear"])
                          / out[m]["bound_s"]}
                      for m in ("plain", "pipelined")}
  return out


def memory(profile, workers: int, shard_nbytes: int) -> dict:
  """Optimizer state per device, replicated against sharded (ZeRO-1), for SGD+momentum and Adam."""
  params = sum(r.nbytes for r in profile.rows)
  return {"workers": workers, "params_bytes": params,
          "sgd_momentum": {"replicated": params, "sharded": shard_nbytes},
          "adam": {"replicated": 2 * params, "sharded": 2 * shard_nbytes},
          "padding_bytes": shard_nbytes - params / workers,
          "saved_fraction": 1 - shard_nbytes / params}


def _fmt_ms(x: float) -> str:
  return f"{x * 1e3:9.1f}"


def report(result: dict) -> None:
  labels = [b[0] for b in BASELINES] + [o[0] for o in OURS]
  for key, cells in result["cells"].items():
    print(f"\n## {key}: iteration (ms), simulated")
    head = f"{'network':9s} {'P':>3s} {'step':9s}" + "".join(f"{l[:9]:>10s}" for l in labels) + \
        f"{'bound':>10s}{'dear/auto':>10s}{'dear/bnd':>9s}"
    print(head)
    for c in cells:
      for mode in ("plain", "pipelined"):
        m = c[mode]
        print(f"{c['network']:9s} {c['workers']:3d} {mode:9s}"
              + "".join(f"{_fmt_ms(m['iteration_s'][l]):>10s}" for l in labels)
              + f"{_fmt_ms(m['bound_s']):>10s}{c['same_mode'][mode]['dear_vs_auto']:10.3f}"
              + f"{c['same_mode'][mode]['dear_vs_bound_sharded']:9.3f}")
  print("\n## DeAR's comparison: dear (pipelined step) vs its baselines (speedup = baseline / dear - 1)")
  print(f"{'model':22s} {'network':9s} {'P':>3s}" + "".join(f"{b[0]:>14s}" for b in BASELINES)
        + f"{'best base':>10s}")
  for key, cells in result["cells"].items():
    for c in cells:
      d = c["deear_setting"]
      print(f"{key:22s} {c['network']:9s} {c['workers']:3d}"
            + "".join(f"{d['speedup_vs'][b[0]]:14.1%}" for b in BASELINES)
            + f"{d['speedup_vs_best_baseline']:10.1%}")
  s = result["summary"]
  print("\n## Summary (medians over the cells; 'up to' = max)")
  for net_name, v in s["by_network"].items():
    p = PAPER[net_name]
    print(f"{net_name:9s}: dear vs its best baseline (DeAR's setting): up to {v['up_to_vs_best_baseline']:.1%}, "
          f"median {v['median_vs_best_baseline']:.1%} (the paper: up to {p['speedup_up_to']:.0%} at "
          f"{p['workers']} GPUs); vs wfbp up to {v['up_to_vs_wfbp']:.1%}; "
          f"dear / auto, pipelined: median {v['median_dear_vs_auto_pipelined']:.3f}, "
          f"best {v['best_dear_vs_auto_pipelined']:.3f}; plain: median {v['median_dear_vs_auto_plain']:.3f}")
  print(f"dear vs DeAR's own 25 MiB fusion (same step): median {s['median_dear_vs_25MiB']:.3f}, "
        f"best {s['best_dear_vs_25MiB']:.3f}; dear vs the sharded bound: median "
        f"{s['median_dear_vs_bound_sharded']:.3f}, worst {s['worst_dear_vs_bound_sharded']:.3f}")
  print("\n## Optimizer state per device (MiB), replicated -> sharded (dear plan, padding included)")
  for key, rows in result["memory"].items():
    for m in rows:
      print(f"{key:22s} P={m['workers']:3d}  SGD+momentum {m['sgd_momentum']['replicated'] / MIB:7.1f} -> "
            f"{m['sgd_momentum']['sharded'] / MIB:6.2f}   Adam {m['adam']['replicated'] / MIB:7.1f} -> "
            f"{m['adam']['sharded'] / MIB:6.2f}   saved {m['saved_fraction']:.2%} "
            f"(padding {m['padding_bytes']:.0f} B)")


def summarize(result: dict) -> dict:
  by_net: dict = {}
  allc = [c for cells in result["cells"].values() for c in cells]
  for net_name in NETWORKS:
    cs = [c for c in allc if c["network"] == net_name]
    if not cs:
      continue
    best = [c["deear_setting"]["speedup_vs_best_baseline"] for c in cs]
    by_net[net_name] = {
        "up_to_vs_best_baseline": max(best), "median_vs_best_baseline": statistics.median(best),
        "up_to_vs_wfbp": max(c["deear_setting"]["speedup_vs"]["wfbp"] for c in cs),
        "median_dear_vs_auto_pipelined": statistics.median(c["same_mode"]["pipelined"]["dear_vs_auto"] for c in cs),
        "best_dear_vs_auto_pipelined": min(c["same_mode"]["pipelined"]["dear_vs_auto"] for c in cs),
        "median_dear_vs_auto_plain": statistics.median(c["same_mode"]["plain"]["dear_vs_auto"] for c in cs)}
  ratios = [c["same_mode"][m]["dear_vs_dear_25MiB"] for c in allc for m in ("plain", "pipelined")]
  vb = [c["same_mode"][m]["dear_vs_bound_sharded"] for c in allc for m in ("plain", "pipelined")]
  return {"by_network": by_net, "median_dear_vs_25MiB": statistics.median(ratios),
          "best_dear_vs_25MiB": min(ratios), "median_dear_vs_bound_sharded": statistics.median(vb),
          "worst_dear_vs_bound_sharded": max(vb)}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", nargs="+", default=["v100"], choices=["v100", "h100"])
  ap.add_argument("--workers", nargs="+", type=int, default=list(WORKERS))
  ap.add_argument("--out", default=str(OUT / "dear.json"))
  ap.add_argument("--table", action="store_true", help="print the tables of an existing results file")
  a = ap.parse_args(argv)
  if a.table:
    report(json.loads(pathlib.Path(a.out).read_text()))
    return
  t0 = time.perf_counter()
  result: dict = {"versions": {"python": platform.python_version()}, "paper": PAPER, "cells": {},
                  "memory": {}}
  for model in MODELS:
    for device in a.devices:
      key = f"{model}-{device}"
      profile = load_trace(key)
      cells = [cell(profile, n, w) for n in NETWORKS for w in a.workers]
      result["cells"][key] = cells
      result["memory"][key] = [memory(profile, c["workers"], c["shard_nbytes"])
                               for c in cells if c["network"] == NETWORKS[0]]
      print(f"{key}: {len(cells)} cells", file=sys.stderr)
  result["summary"] = summarize(result)
  result["seconds"] = time.perf_counter() - t0
  report(result)
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"\nwritten {out} ({result['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
  main()
