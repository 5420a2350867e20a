"""FSDP with gradient accumulation (k micro-batches per step), shaped like marin#6304 (re-gathering every
parameter on every micro-batch: 9.37% -> 7.18% MFU): bytes all-gathered per step and the simulated step,
the `fsdp` plan of `micro_batches=k` (per group and unit: hold across the k or not, under a budget) against
the same plan re-gathering and reduce-scattering every micro-batch (torchtitan's per-micro-batch switches).
Bundled llama-1b / 8b H100 traces (per micro-batch), FSDP over one 'data' axis of P GPUs on
`NetworkModel.preset("nvlink+400gb-ib")`. Every number is SIMULATED (docs/fsdp.md, "Accumulation").

Budgets: none (everything held), and the re-gather-every-micro-batch plan's own peak plus a quarter of the
model's gathered bytes. Prints a table and writes bench/results/fsdp_accum.json. Never asserts.

`--compiled`: the library's own accumulating step (`hooked` with a `micro_batches=k` plan) on bench/fsdp_hlo.py's
unrolled decoder, compiled for compile-only H100s (XLA:GPU's whole pipeline; needs jax-cuda12-plugin and
ptxas, docs/facts.md), its all-gathers and reduce-scatters read back from the compiled program (count and
bytes per step) and audited, for the plan without a budget, the same re-gathering every micro-batch, and the
least-memory plan; the step simulated beside it. Writes bench/results/fsdp_accum_compiled.json. Read on
2026-12-07 (8 and 64 devices, k=4): counts and bytes as planned, audits OK, except the least-memory plan's
embedding, gathered again in each micro-batch's backward (a tied embedding: the logits read it), which the
simulator does not count (it takes the first layer's group as never read in backward): 4 all-gathers and
32 MiB per step more than planned.

    .venv/bin/python bench/fsdp_accum.py [--gpus 8 64 256] [--k 4 8]
    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_accum.py --compiled [--gpus 8] [--k 4] [--layers 2 --d 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from prophet_jax import NetworkModel, lower_bound, plan, simulate
from prophet_jax.models import load_trace

from fsdp import MODELS, NETWORK, placed


def regathering(s):
  """`s` with nothing held: every group gathered (and re-gathered) and every unit scattered each micro-batch."""
  f = s.fsdp
  return dataclasses.replace(s, fsdp=dataclasses.replace(f, hold_params=(False,) * len(f.keep),
                                                        hold_grads=(False,) * len(f.units)))


def gathered(s, prof) -> tuple[float, float, int]:
  """(bytes all-gathered per step, per micro-batch gathering everything once, all-gathers per step) of `s`: a
  held group once, another k times and k more where backward gathers it again (not kept; the profile's first
  layer's group is never gathered again: its backward reads no weight)."""
  f, rows = s.fsdp, prof.rows
  hold = f.hold_params or (False,) * len(f.keep)
  moved = once = count = 0.0
  for g, kp, h in zip(f.gathers or [[r for r, _, _ in s.chunks[u].slices] for u in f.units], f.keep, hold):
    nb = sum(rows[r].gather_nbytes for r in g)
    times = 1 if h else f.micro_batches * (1 + (not kp and any(rows[r].layer != rows[0].layer for r in g)))
    moved, once, count = moved + times * nb, once + nb, count + times
  return moved, once, int(count)


def compiled_main(a) -> None:
  """`--compiled` (module docstring)."""
  import re
  import time

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import prophet_jax as pj
  from fsdp_hlo import collectives, loss_fn, params_of

  results = []
  for devices in a.gpus:
    topo = pj.gpu_topology("h100", devices=devices)
    mesh = topo.mesh("data")
    params = params_of(a.layers, a.d, 4 * a.d, a.vocab)
    specs = jax.tree.map(lambda s: P("data", None) if len(s.shape) == 2 else P(), params)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    param_bytes = sum(4 * s.size for s in jax.tree.leaves(params))
    fwd_s = 2 * param_bytes / 4 * 512 / (989e12 * 0.5)          # one micro-batch: one sequence of 512 per GPU
    prof = pj.GradientProfile.from_params(params, forward_s=fwd_s, backward_s=2 * fwd_s, shardings=specs,
                                          mesh={"data": devices}, model="decoder-small", device="h100")
    net = pj.NetworkModel.preset(NETWORK, workers=devices)
    for k in a.k:
      tokens = topo.abstract(jax.ShapeDtypeStruct((devices * k, 512), jnp.int32), P("data"), mesh=mesh)
      every = plan(prof, net, "fsdp", micro_batches=k)
      least, budget = None, 1
      while least is None:                     # the budget each refusal names, until one fits
        try:
          least = plan(prof, net, "fsdp", micro_batches=k, memory_budget_bytes=budget)
        except ValueError as e:
          budget = int(re.search(r"(?:at least|least memory found is) (\d+)", str(e)).group(1))
      for label, s in (("re-gather every micro-batch", regathering(every)), ("plan (no budget)", every),
                       ("plan (least memory)", least)):
        grad_fn = pj.hooked(lambda p, t: loss_fn(p, t, layers=a.layers, remat=False), s, axis_name="data", mesh=mesh)
        step = jax.jit(lambda p, t, g=grad_fn: jax.tree.map(lambda x, y: x - 1e-3 * y, p, g(p, t)[1]),
                       in_shardings=(shard, NamedSharding(mesh, P("data"))), out_shardings=shard)
        t0 = time.perf_counter()
        c = step.lower(topo.abstract(params, specs, mesh=mesh), tokens).compile()
        secs = time.perf_counter() - t0
        cs, report, r = collectives(c.as_text()), pj.audit(c, s), simulate(s, prof, net, events=False)
        ag = [x for x in cs if x["kind"] == "all-gather"]
        rs = [x for x in cs if x["kind"] == "reduce-scatter"]
        row = {"devices": devices, "k": k, "schedule": label, "compile_s": secs, "all_gathers": len(ag),
               "gathered_bytes": sum(x["bytes"] for x in ag), "reduce_scatters": len(rs),
               "scattered_bytes": sum(x["bytes"] for x in rs), "planned_gathered_bytes": gathered(s, prof)[0],
               "planned_all_gathers": r.all_gathers, "planned_reduce_scatters": r.reduce_scatters,
               "audit_ok": report.ok, "audit": report.describe(), "step_ms": r.iteration_s * 1e3,
               "peak_bytes": r.peak_memory_bytes, "temp_bytes": c.memory_analysis().temp_size_in_bytes}
        results.append(row)
        print(f"{devices:4d} H100s k={k} {label:28s} compiled {secs:5.1f} s: {len(ag):3d} all-gathers "
              f"{row['gathered_bytes'] / 2**20:8.1f} MiB (planned {r.all_gathers}, "
              f"{row['planned_gathered_bytes'] / 2**20:.1f} MiB), {len(rs):3d} reduce-scatters "
              f"(planned {r.reduce_scatters}); audit {'OK' if report.ok else 'MISMATCH'}; simulated "
              f"{row['step_ms']:.2f} ms, peak {r.peak_memory_bytes / 2**20:.1f} MiB, temp "
              f"{row['temp_bytes'] / 2**20:.1f} MiB")
  out = pathlib.Path(a.out).with_name("fsdp_accum_compiled.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"network": NETWORK, "layers": a.layers, "d": a.d, "vocab": a.vocab,
                             "results": results}, indent=1))
  print(f"wrote {out}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gpus", type=int, nargs="+", default=None)
  ap.add_argument("--k", type=int, nargs="+", default=None)
  ap.add_argument("--compiled", action="store_true", help="the library's step compiled for compile-only H100s")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fsdp_accum.json"))
  a = ap.parse_args()
  a.gpus = a.gpus or ([8] if a.compiled else [8, 64, 256])
  a.k = a.k or ([4] if a.compiled else [4, 8])
  if a.compiled:
    compiled_main(a)
    return
  results = []
  print(f"{'model':14s} {'gpus':>5s} {'k':>2s} {'schedule':24s} {'AG GiB/step':>11s} {'AG+RS':>9s} {'step ms':>9s} "
        f"{'peak GiB':>8s} {'AG bytes':>8s} {'step':>6s} {'/bound':>6s}  (simulated; ratios vs re-gather)")
  for name in MODELS:
    base = load_trace(name)
    for gpus in a.gpus:
      net = NetworkModel.preset(NETWORK, workers=gpus)
      prof = placed(base, {"data": gpus}, ("data",))
      for k in a.k:
        bound = lower_bound(prof, net, sharded="fsdp", micro_batches=k)
        every = plan(prof, net, "fsdp", micro_batches=k)
        regather = regathering(plan(prof, net, "fsdp", micro_batches=k, memory_budget_bytes=1 << 62))
        r0 = simulate(regather, prof, net, events=False)
        total = gathered(every, prof)[1]
        budget = int(r0.peak_memory_bytes + total / 4)
        cands = [("re-gather every micro-batch", regather), ("plan (no budget)", every),
                 (f"plan ({budget / 2**30:.2f} GiB)", plan(prof, net, "fsdp", micro_batches=k,
                                                          memory_budget_bytes=budget))]
        ref = None
        for label, s in cands:
          r = simulate(s, prof, net, events=False)
          moved, _, count = gathered(s, prof)
          if count != r.all_gathers:
            print(f"(all-gathers counted {count}, simulated {r.all_gathers})")
          ref = ref or (moved, r.iteration_s)
          row = {"model": name, "gpus": gpus, "k": k, "schedule": label, "gathered_bytes_per_step": moved,
                 "all_gathers": r.all_gathers, "reduce_scatters": r.reduce_scatters, "step_ms": r.iteration_s * 1e3,
                 "peak_memory_gib": r.peak_memory_bytes / 2**30, "gathered_vs_regather": moved / ref[0],
                 "step_vs_regather": r.iteration_s / ref[1], "vs_bound": r.iteration_s / bound,
                 "held_groups": sum(s.fsdp.hold_params), "groups": len(s.fsdp.keep),
                 "held_units": sum(s.fsdp.hold_grads), "units": len(s.fsdp.units)}
          results.append(row)
          print(f"{name:14s} {gpus:5d} {k:2d} {label:24s} {moved / 2**30:11.2f} {r.all_gathers:4d}+{r.reduce_scatters:<4d} "
                f"{row['step_ms']:9.2f} {row['peak_memory_gib']:8.2f} {row['gathered_vs_regather']:8.3f} "
                f"{row['step_vs_regather']:6.3f} {row['vs_bound']:6.3f}")
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"network": NETWORK, "results": results}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
