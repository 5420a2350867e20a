"""Scaling sweep: every policy on the bundled traces, both step modes, 4 to 2,048 workers.

4 models (resnet50, vgg16, bert-base, gpt2) x {v100, h100} x {10gbe, 25gbe, 100gb-ib} x workers
{4, 16, 64, 256, 2048} x cross_step {False, True} x every policy (wfbp, bucket, xla, mgwfbp, priority,
prophet, auto), plus `priority` tuned over its partition sizes. Times are the simulator's predictions
(`prophet_jax.simulate`); the ratio to `lower_bound` says how much room any schedule could have left.

A cell is *balanced* when allreduce_s(total bytes) / (forward_s + backward_s) is in [0.7, 1.5].
Summary targets (issue 2):
  (a) cross_step=True: prophet vs priority at ByteScheduler's defaults, median over balanced cells
      (>= 1.2x), and vs priority tuned over its partition sizes;
  (b) cross_step=False: mgwfbp no slower than wfbp in any cell;
  (c) auto against the lower bound in every cell;
  (d) robustness on balanced cells: auto (default, and robust=0.3) planned with alpha and beta each off
      by +-30% (4 corners), judged with the true model, against the best baseline policy planned with
      the true model (strict) and with the same wrong model (fair); target within 2%;
  (e) timings: planning a 1,000-leaf model per policy and with auto, one simulation; the whole sweep.

Writes bench/results/scaling.json and bench/results/scaling.png (scaling efficiency = compute time /
iteration time against workers, per policy); prints a table and the summary. Never asserts.

    .venv/bin/python bench/scaling.py            # the full sweep (a few minutes on 2 cores)
    .venv/bin/python bench/scaling.py --quick    # one device and network, for a smoke run
    .venv/bin/python bench/scaling.py --table    # the Markdown summary of bench/results/scaling.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

from prophet_jax import GradientProfile, NetworkModel, lower_bound, plan, simulate
from prophet_jax.models import load_trace

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
DEVICES = ("v100", "h100")
NETWORKS = ("10gbe", "25gbe", "100gb-ib")
WORKERS = (4, 16, 64, 256, 2048)
BASELINES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet")
POLICIES = BASELINES + ("auto",)
PARTITION_PARAMS = (2**16, 2**18, 2**20, 2**22, 2**24, 2**26)  # priority tuning, in parameters
PERTURB = ((0.7, 0.7), (0.7, 1.3), (1.3, 0.7), (1.3, 1.3))     # (alpha, beta) factors
# auto as shipped (fastest predicted), robust (minimax regret within 2% of the best default baseline),
# and robust but never predicted slower than the best default baseline
VARIANTS = {"auto": {}, "auto_robust": {"robust": 0.3},
            "auto_robust_tol0": {"robust": 0.3, "robust_tol": 0.0}}
OUT = pathlib.Path(__file__).resolve().parent / "results"


def _sim(schedule, profile, network, cross_step) -> float:
  return simulate(schedule, profile, network, cross_step=cross_step, events=False).iteration_s


def _grad_itemsize(profile: GradientProfile) -> int:
  return max(r.nbytes // max(r.size, 1) for r in profile.rows)


def _tuned_priority(profile, network, cross_step) -> tuple[float, dict]:
  item = _grad_itemsize(profile)
  best = (np.inf, {})
  for params in PARTITION_PARAMS:
    for credit in (None, 4 * params * item):
      opts = {"partition_bytes": params * item, "credit_bytes": credit}
      t = _sim(plan(profile, network, "priority", cross_step=cross_step, **opts), profile, network,
               cross_step)
      if t < best[0]:
        best = (t, opts)
  return best


def run_cell(profile, network, cross_step, balanced) -> dict:
  out: dict = {"lower_bound_s": lower_bound(profile, network, cross_step=cross_step), "policies": {},
               "plan_cpu_ms": {}, "allreduces": {}}
  schedules = {}
  for name in POLICIES:
    c0 = time.process_time()
    s = plan(profile, network, name, cross_step=cross_step)
    out["plan_cpu_ms"][name] = (time.process_time() - c0) * 1e3
    out["policies"][name] = _sim(s, profile, network, cross_step)
    out["allreduces"][name] = s.num_allreduces
    schedules[name] = s
  out["auto_candidate"] = dict(schedules["auto"].options).get("candidate", "")
  t, opts = _tuned_priority(profile, network, cross_step)
  out["priority_tuned_s"], out["priority_tuned_options"] = t, opts
  best_base = min(out["policies"][n] for n in BASELINES)
  out["best_baseline_s"] = best_base
  if balanced:
    worst = dict.fromkeys(VARIANTS, 0.0)
    worst_fair = dict.fromkeys(VARIANTS, 0.0)
    for fa, fb in PERTURB:
      wrong = network.replace(alpha_s=network.alpha_s * fa, beta_s_per_byte=network.beta_s_per_byte * fb)
      # the fair comparison: baselines planned with the same wrong model
      fair = min(_sim(plan(profile, wrong, n, cross_step=cross_step), profile, network, cross_step)
                 for n in BASELINES)
      for key, opts in VARIANTS.items():
        s = plan(profile, wrong, "auto", cross_step=cross_step, **opts)
        t_true = _sim(s, profile, network, cross_step)
        worst[key] = max(worst[key], t_true / best_base)
        worst_fair[key] = max(worst_fair[key], t_true / fair)
    out["robust_vs_best_baseline"] = worst
    out["robust_vs_best_baseline_same_model"] = worst_fair
    s = plan(profile, network, "auto", cross_step=cross_step, robust=0.3)
    out["auto_robust_nominal_s"] = _sim(s, profile, network, cross_step)
  return out


def thousand_leaf_profile() -> GradientProfile:
  """A GPT-like model with 1,000 leaves (83 blocks of 12 leaves + 4), times estimated from bytes."""
  d, f = 1024, 4096
  params = {"embed": {"wte": np.broadcast_to(np.float32(0), (50304, d)),
                      "wpe": np.broadcast_to(np.float32(0), (2048, d))}}
  for i in range(83):
    blk = {}
    for name, shape in (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("fc1", (d, f)),
                        ("fc2", (f, d))):
      blk[f"{name}_kernel"] = np.broadcast_to(np.float32(0), shape)
    for name, n in (("ln1_scale", d), ("ln1_bias", d), ("ln2_scale", d), ("ln2_bias", d),
                    ("fc1_bias", f), ("fc2_bias", d)):
      blk[name] = np.broadcast_to(np.float32(0), (n,))
    params[f"block_{i:03d}"] = blk
  params["final"] = {"ln_scale": np.broadcast_to(np.float32(0), (d,)),
                     "ln_bias": np.broadcast_to(np.float32(0), (d,))}
  return GradientProfile.from_params(params, forward_s=0.3, backward_s=0.6, model="gpt-1000-leaves")


def timings() -> dict:
  prof = thousand_leaf_profile()
  net = NetworkModel.preset("25gbe", workers=64)
  out = {"leaves": len(prof.rows), "plan_cpu_ms": {}}
  for cross_step in (False, True):
    for name in POLICIES:
      reps = 1 if name == "auto" else 3
      c0 = time.process_time()
      for _ in range(reps):
        s = plan(prof, net, name, cross_step=cross_step)
      out["plan_cpu_ms"][f"{name}/cross_step={cross_step}"] = (time.process_time() - c0) / reps * 1e3
  s = plan(prof, net, "bucket", cross_step=True)
  c0 = time.process_time()
  for _ in range(20):
    simulate(s, prof, net, cross_step=True)
  out["simulate_cpu_ms"] = (time.process_time() - c0) / 20 * 1e3
  return out


def summarize(cells: list[dict]) -> dict:
  bal_true = [c for c in cells if c["balanced"] and c["cross_step"]]
  prio = [c["policies"]["priority"] / c["policies"]["prophet"] for c in bal_true]
  tuned = [c["priority_tuned_s"] / c["policies"]["prophet"] for c in bal_true]
  auto_prio = [c["priority_tuned_s"] / c["policies"]["auto"] for c in bal_true]
  plain = [c for c in cells if not c["cross_step"]]
  mg = [c["policies"]["mgwfbp"] / c["policies"]["wfbp"] for c in plain]
  lb = [c["policies"]["auto"] / c["lower_bound_s"] for c in cells]
  auto_vs_base = [c["policies"]["auto"] / c["best_baseline_s"] for c in cells]
  rob = {k: [c["robust_vs_best_baseline"][k] for c in cells if "robust_vs_best_baseline" in c]
         for k in VARIANTS}
  rob_fair = {k: [c["robust_vs_best_baseline_same_model"][k] for c in cells
                  if "robust_vs_best_baseline" in c] for k in VARIANTS}
  rob_nom = [c["auto_robust_nominal_s"] / c["best_baseline_s"] for c in cells if "auto_robust_nominal_s" in c]
  med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
  return {
      "balanced_cells_cross_step_true": len(bal_true),
      "a_prophet_over_priority_defaults_median": med(prio),
      "a_prophet_over_priority_tuned_median": med(tuned),
      "a_auto_over_priority_tuned_median": med(auto_prio),
      "b_mgwfbp_slower_than_wfbp_cells": sum(x > 1 + 1e-9 for x in mg),
      "b_mgwfbp_over_wfbp_max": max(mg) if mg else float("nan"),
      "c_auto_over_lower_bound_median": med(lb),
      "c_auto_over_lower_bound_max": max(lb),
      "c_auto_over_best_baseline_max": max(auto_vs_base),
      "c_auto_over_best_baseline_median": med(auto_vs_base),
      "d_robust_cells": len(rob["auto"]),
      **{f"d_{k}_worst_vs_best_baseline": max(v) if v else float("nan") for k, v in rob.items()},
      **{f"d_{k}_cells_over_2pct": sum(x > 1.02 for x in v) for k, v in rob.items()},
      **{f"d_{k}_median_worst_vs_best_baseline": med(v) for k, v in rob.items()},
      **{f"d_{k}_worst_vs_same_wrong_model": max(v) if v else float("nan") for k, v in rob_fair.items()},
      **{f"d_{k}_same_wrong_model_cells_over_2pct": sum(x > 1.02 for x in v) for k, v in rob_fair.items()},
      "d_auto_robust_nominal_over_best_baseline_max": max(rob_nom) if rob_nom else float("nan"),
  }


def readme_table(cells: list[dict]) -> str:
  """A compact Markdown table: per model and step mode, medians over devices, networks and workers."""
  lines = ["| model | step | cells | auto / lower bound (median, max) | auto vs best baseline (median, best) "
           "| auto vs wfbp (median) | auto vs tuned priority (median) | prophet vs priority defaults (median) |",
           "| --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
  for model in MODELS:
    for cross_step in (False, True):
      sel = [c for c in cells if c["model"] == model and c["cross_step"] == cross_step]
      if not sel:
        continue
      lb = [c["policies"]["auto"] / c["lower_bound_s"] for c in sel]
      vb = [c["best_baseline_s"] / c["policies"]["auto"] for c in sel]
      vw = [c["policies"]["wfbp"] / c["policies"]["auto"] for c in sel]
      vt = [c["priority_tuned_s"] / c["policies"]["auto"] for c in sel]
      pp = [c["policies"]["priority"] / c["policies"]["prophet"] for c in sel]
      lines.append(f"| {model} | {'pipelined' if cross_step else 'plain'} | {len(sel)} | "
                   f"{statistics.median(lb):.3f}, {max(lb):.3f} | {statistics.median(vb):.3f}x, "
                   f"{max(vb):.3f}x | {statistics.median(vw):.2f}x | {statistics.median(vt):.2f}x | "
                   f"{statistics.median(pp):.2f}x |")
  return "\n".join(lines)


def plot(cells: list[dict], path: pathlib.Path, device: str, network: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, len(MODELS), figsize=(4 * len(MODELS), 7), sharey=True)
  for row, cross_step in enumerate((False, True)):
    for col, model in enumerate(MODELS):
      ax = axes[row][col]
      sel = sorted((c for c in cells if c["model"] == model and c["device"] == device
                    and c["network"] == network and c["cross_step"] == cross_step),
                   key=lambda c: c["workers"])
      if not sel:
        continue
      xs = [c["workers"] for c in sel]
      for name in POLICIES:
        ys = [c["compute_s"] / c["policies"][name] for c in sel]
        ax.plot(xs, ys, marker="o", lw=2.2 if name == "auto" else 1.2, label=name,
                color="black" if name == "auto" else None)
      ax.plot(xs, [c["compute_s"] / c["lower_bound_s"] for c in sel], ls=":", color="gray",
              label="lower bound")
      ax.set_xscale("log", base=2)
      ax.set_ylim(0, 1.05)
      ax.set_title(f"{model} ({'pipelined' if cross_step else 'plain'} step)", fontsize=10)
      ax.set_xlabel("workers")
      if col == 0:
        ax.set_ylabel("scaling efficiency (compute / iteration)")
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"prophet_jax simulated scaling efficiency, {device}, {network}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="one device and one network only")
  ap.add_argument("--out", default=str(OUT), help="output folder (default bench/results)")
  ap.add_argument("--table", action="store_true",
                  help="print the Markdown summary table of an existing scaling.json and exit")
  args = ap.parse_args(argv)
  if args.table:
    print(readme_table(json.loads((pathlib.Path(args.out) / "scaling.json").read_text())["cells"]))
    return
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  devices = DEVICES[:1] if args.quick else DEVICES
  networks = NETWORKS[1:2] if args.quick else NETWORKS
  w0, c0 = time.perf_counter(), time.process_time()
  cells = []
  hdr = (f"{'model':9s} {'dev':4s} {'network':8s} {'P':>5s} {'x':1s} {'ratio':>6s} "
         + " ".join(f"{n[:8]:>8s}" for n in POLICIES) + f" {'tunedpri':>8s} {'auto/lb':>7s} "
         f"{'vs wfbp':>7s} {'vs tuned':>8s} {'robust':>6s}")
  # robust: auto(robust=0.3) planned with alpha, beta off by +-30%, judged with the true model, over the
  # best baseline planned with the true model (worst of 4 corners; balanced cells only)
  print("iteration times in ms; x: cross_step; ratio: allreduce(total)/(fwd+bwd), B = balanced")
  print(hdr)
  for model in MODELS:
    for dev in devices:
      prof = load_trace(f"{model}-{dev}")
      for net_name in networks:
        for workers in WORKERS:
          net = NetworkModel.preset(net_name, workers=workers)
          ratio = net.allreduce_s(prof.total_nbytes) / (prof.forward_s + prof.backward_s)
          balanced = 0.7 <= ratio <= 1.5
          for cross_step in (False, True):
            cell = {"model": model, "device": dev, "network": net_name, "workers": workers,
                    "cross_step": cross_step, "ratio": ratio, "balanced": balanced,
                    "compute_s": prof.compute_s if not cross_step else prof.forward_s + prof.backward_s}
            cell.update(run_cell(prof, net, cross_step, balanced))
            p = cell["policies"]
            cell["auto_over_lower_bound"] = p["auto"] / cell["lower_bound_s"]
            cell["speedup_over_wfbp"] = {n: p["wfbp"] / p[n] for n in POLICIES}
            cell["speedup_over_priority_tuned"] = {n: cell["priority_tuned_s"] / p[n] for n in POLICIES}
            cells.append(cell)
            rob = cell.get("robust_vs_best_baseline", {}).get("auto_robust")
            print(f"{model:9s} {dev:4s} {net_name:8s} {workers:5d} {'T' if cross_step else 'F'} "
                  f"{ratio:5.2f}{'B' if balanced else ' '} "
                  + " ".join(f"{p[n] * 1e3:8.2f}" for n in POLICIES)
                  + f" {cell['priority_tuned_s'] * 1e3:8.2f} {cell['auto_over_lower_bound']:7.3f} "
                  f"{cell['speedup_over_wfbp']['auto']:7.2f} {cell['speedup_over_priority_tuned']['auto']:8.2f} "
                  f"{'' if rob is None else f'{rob:6.3f}'}", flush=True)
  sweep_wall, sweep_cpu = time.perf_counter() - w0, time.process_time() - c0
  summary = summarize(cells)
  t = timings()
  summary["e_sweep_wall_s"], summary["e_sweep_cpu_s"] = sweep_wall, sweep_cpu
  summary["e_timings"] = t
  result = {"command": "python bench/scaling.py" + (" --quick" if args.quick else ""),
            "python": sys.version.split()[0], "machine": platform.machine(),
            "models": MODELS, "devices": devices, "networks": networks, "workers": WORKERS,
            "policies": POLICIES, "summary": summary, "cells": cells}
  (out_dir / "scaling.json").write_text(json.dumps(result, indent=1))
  plot(cells, out_dir / "scaling.png", devices[0], "25gbe" if "25gbe" in networks else networks[0])
  print("\nsummary")
  print(f" (a) pipelined step, balanced cells: {summary['balanced_cells_cross_step_true']}; prophet vs "
        f"priority(defaults) median {summary['a_prophet_over_priority_defaults_median']:.3f}x (target "
        f">= 1.2x); vs priority tuned {summary['a_prophet_over_priority_tuned_median']:.3f}x; auto vs "
        f"priority tuned {summary['a_auto_over_priority_tuned_median']:.3f}x")
  print(f" (b) plain step: mgwfbp slower than wfbp in {summary['b_mgwfbp_slower_than_wfbp_cells']} "
        f"cells (max mgwfbp/wfbp {summary['b_mgwfbp_over_wfbp_max']:.4f})")
  print(f" (c) auto / lower bound: median {summary['c_auto_over_lower_bound_median']:.3f}, max "
        f"{summary['c_auto_over_lower_bound_max']:.3f}; auto / best baseline: median "
        f"{summary['c_auto_over_best_baseline_median']:.4f}, max {summary['c_auto_over_best_baseline_max']:.4f}")
  print(f" (d) +-30% alpha/beta (4 corners) on {summary['d_robust_cells']} balanced cells, judged with the "
        f"true model, worst over the corners, per cell:")
  for k in VARIANTS:
    print(f"     {k:16s}: vs best baseline planned with the true model: worst "
          f"{summary[f'd_{k}_worst_vs_best_baseline']:.4f}, median {summary[f'd_{k}_median_worst_vs_best_baseline']:.4f}, "
          f"{summary[f'd_{k}_cells_over_2pct']} cells over 2%; vs baselines planned with the same wrong "
          f"model: worst {summary[f'd_{k}_worst_vs_same_wrong_model']:.4f}, "
          f"{summary[f'd_{k}_same_wrong_model_cells_over_2pct']} cells over 2%")
  print(f"     auto(robust=0.3) with the true model / best baseline: max "
        f"{summary['d_auto_robust_nominal_over_best_baseline_max']:.4f}")
  pc = t["plan_cpu_ms"]
  print(f" (e) {t['leaves']}-leaf model, plan CPU ms: "
        + ", ".join(f"{k} {v:.1f}" for k, v in pc.items())
        + f"; one simulation {t['simulate_cpu_ms']:.2f} ms; sweep {sweep_wall:.1f} s wall, "
        f"{sweep_cpu:.1f} s CPU")
  print()
  print(readme_table(cells))
  print(f"wrote {out_dir / 'scaling.json'} and {out_dir / 'scaling.png'}")


if __name__ == "__main__":
  main()
