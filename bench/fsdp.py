"""FSDP and HSDP plans for decoder-only transformers (the bundled llama-1b-h100 and llama-8b-h100 traces,
estimated per layer on H100), 8 to 1,024 GPUs, NVLink in 8-GPU nodes and 400 Gb/s InfiniBand across them
(`NetworkModel.preset("nvlink+400gb-ib")`): the `fsdp` plan, the same plan held to the partitioner's
memory, the partitioner's schedule (MODELLED, see below) and the bound B_fsdp. Every number is SIMULATED
(prophet_jax's model, docs/fsdp.md), nothing is measured.

The partitioner's schedule is modelled, not read from a compiled program: XLA's SPMD partitioner puts an
all-gather before each use of a sharded weight (forward, and again in backward under rematerialisation,
the large-model setup: scanned layers + remat) and a reduce-scatter after each gradient; its combiner
merges neighbouring collectives up to its threshold (30 MiB, the GPU default of
xla_gpu_all_gather_combine_threshold_bytes / ..._reduce_scatter_...); the latency-hiding scheduler keeps
one all-gather ahead of its use. So: units = leaves in forward order merged while under 30 MiB, prefetch
1, every unit gathered again in backward (backward prefetch 1), reduce-scatters in ready order, replicated
leaves all-reduced in 30 MiB chunks. 'partitioner-keep' is the same without the backward re-gathers
(no remat: the gathered weights kept as residuals, the memory jax#20763 reports).

Placement (`placed`): every 2-D weight sharded over the data axes on its first dimension (its second when
the first does not divide), norms replicated, as FSDP wraps a decoder. FSDP: one 'data' axis of all P
GPUs. HSDP: ('replica' P/8, 'data' 8): shards in a node, replicas across nodes.

Prints a table and writes bench/results/fsdp.json. Never asserts.

Why it imports private code: the modelled partitioner's schedule is built from the fsdp planner's own
units and simulated on its timeline arrays (`schedulers._fsdp`, `_planning._fsdp`), so both sides share
one model; no public name builds an arbitrary FSDP schedule.

    .venv/bin/python bench/fsdp.py [--gpus 8 64 256 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import numpy as np

from prophet_jax import GradientProfile, NetworkModel, lower_bound, plan, simulate
from prophet_jax._planning._core import problem
from prophet_jax.models import load_trace
from prophet_jax.schedulers._fsdp import Plan, _chunks, _Rows, fsdp_schedule
from prophet_jax._planning._fsdp import fsdp_arrays, fsdp_run

MODELS = ("llama-1b-h100", "llama-8b-h100")
NETWORK = "nvlink+400gb-ib"
COMBINE_BYTES = 30 * 2**20      # XLA:GPU's default combine threshold


def placed(profile: GradientProfile, mesh: dict[str, int], shard_axes: tuple[str, ...]) -> GradientProfile:
  """`profile` with every 2-D leaf sharded over `shard_axes` (dimension 0, else 1, when divisible),
  1-D leaves replicated."""
  s = int(np.prod([mesh[a] for a in shard_axes]))
  rows = []
  for r in profile.rows:
    dim = None
    if len(r.shape) == 2:
      dim = 0 if r.shape[0] % s == 0 else (1 if r.shape[1] % s == 0 else None)
    rows.append(dataclasses.replace(r, shard_dim=dim))
  return dataclasses.replace(profile, rows=tuple(rows), mesh=tuple(mesh.items()), shard_axes=shard_axes)


def partitioner(profile: GradientProfile, network: NetworkModel, *, regather: bool):
  """The modelled partitioner schedule (module docstring) as a Schedule."""
  prob = problem(profile, network)
  rows = _Rows(prob)
  units: list[list[int]] = []
  size = 0.0
  for i in prob.live:
    if profile.rows[i].shard_dim is None:
      continue
    if units and size + rows.nbytes[i] < COMBINE_BYTES and rows.dtype[units[-1][0]] == rows.dtype[i]:
      units[-1].append(i)
      size += rows.nbytes[i]
    else:
      units.append([i])
      size = rows.nbytes[i]
  chunks, idx = _chunks(rows, units)
  keep = [not regather] * len(units)
  arr = fsdp_arrays(prob, chunks, idx, keep, 1, 1, profile.shard_count, profile.replica_count)
  run = fsdp_run(prob, arr)
  best = Plan("partitioner (modelled)", chunks, idx, keep, 1, 1, run.iteration_s, run.peak_memory_bytes)
  return fsdp_schedule(profile, best, options={"modelled": "partitioner"}, cross_step=False, budget=None,
                       policy="partitioner")


def row(label: str, sched, profile, network, bound: float, plan_ms: float | None = None) -> dict:
  r = simulate(sched, profile, network, events=False)
  compute = r.compute_s
  return {"schedule": label, "iteration_ms": r.iteration_s * 1e3,
          "exposed_fraction": max(r.iteration_s - compute, 0.0) / r.iteration_s,
          "peak_memory_gib": r.peak_memory_bytes / 2**30, "vs_bound": r.iteration_s / bound,
          "all_gathers": r.all_gathers, "reduce_scatters": r.reduce_scatters,
          "candidate": dict(sched.options).get("candidate", ""), "plan_ms": plan_ms}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024])
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fsdp.json"))
  a = ap.parse_args()
  results = []
  print(f"{'model':14s} {'gpus':>5s} {'mode':5s} {'schedule':22s} {'iter ms':>9s} {'exposed':>8s} "
        f"{'peak GiB':>9s} {'/bound':>7s} {'AG+RS':>9s}  (all simulated)")
  for name in MODELS:
    base = load_trace(name)
    for gpus in a.gpus:
      net = NetworkModel.preset(NETWORK, workers=gpus)
      modes = [("fsdp", {"data": gpus}, ("data",))]
      if gpus > net.node_size:
        modes.append(("hsdp", {"replica": gpus // net.node_size, "data": net.node_size}, ("data",)))
      for mode, mesh, axes in modes:
        prof = placed(base, mesh, axes)
        bound = lower_bound(prof, net, sharded="fsdp")
        part = partitioner(prof, net, regather=True)
        keep = partitioner(prof, net, regather=False)
        part_peak = simulate(part, prof, net, events=False).peak_memory_bytes
        t0 = time.perf_counter()
        fast = plan(prof, net, "fsdp")
        fast_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        try:
          same = plan(prof, net, "fsdp", memory_budget_bytes=part_peak)
        except ValueError as e:                  # the partitioner's peak is below what a plan needs
          same, same_err = None, str(e)
        same_ms = (time.perf_counter() - t0) * 1e3
        rows = [row("plan", fast, prof, net, bound, fast_ms)]
        if same is not None:
          rows.append(row("plan@partitioner-mem", same, prof, net, bound, same_ms))
        rows += [row("partitioner (modelled)", part, prof, net, bound),
                 row("partitioner-keep (mod.)", keep, prof, net, bound)]
        for r in rows:
          r.update(model=name, gpus=gpus, mode=mode, mesh=mesh, bound_ms=bound * 1e3)
          results.append(r)
          print(f"{name:14s} {gpus:5d} {mode:5s} {r['schedule']:22s} {r['iteration_ms']:9.2f} "
                f"{r['exposed_fraction']:8.1%} {r['peak_memory_gib']:9.2f} {r['vs_bound']:7.3f} "
                f"{r['all_gathers']:4d}+{r['reduce_scatters']:<4d}")
        if same is not None:
          sp = rows[2]["iteration_ms"] / rows[1]["iteration_ms"]
          print(f"{'':14s} {'':5s} {'':5s} partitioner / plan at its memory: {sp:.3f}x (simulated); bound "
                f"{bound * 1e3:.2f} ms")
        else:
          print(f"{'':14s} no plan within the partitioner's peak: {same_err}")
  def stats(xs):
    return {"median": float(np.median(xs)), "worst": float(np.max(xs)), "n": len(xs)}
  plan_rows = [r for r in results if r["schedule"] == "plan"]
  def by(label):
    return {(r["model"], r["gpus"], r["mode"]): r for r in results if r["schedule"] == label}
  same_rows, part_rows = by("plan@partitioner-mem"), by("partitioner (modelled)")
  speedups = [part_rows[k]["iteration_ms"] / same_rows[k]["iteration_ms"] for k in same_rows if k[1] >= 64]
  summary = {"plan_vs_bound": stats([r["vs_bound"] for r in plan_rows]),
             "plan_at_partitioner_memory_vs_bound": stats([r["vs_bound"] for r in same_rows.values()]),
             "partitioner_over_plan_at_its_memory_64plus": (
                 {"median": float(np.median(speedups)), "least": float(np.min(speedups)), "n": len(speedups)}
                 if speedups else None)}
  print("summary (simulated):", json.dumps(summary))
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"network": NETWORK, "combine_bytes": COMBINE_BYTES,
                             "note": "every number simulated (prophet_jax's model); the partitioner's "
                                     "schedule is MODELLED (module docstring), not read from a compiled "
                                     "program", "summary": summary, "results": results}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
