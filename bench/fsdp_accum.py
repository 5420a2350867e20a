"""FSDP with gradient accumulation (k micro-batches per step), shaped like marin#6304 (re-gathering every
parameter on every micro-batch: 9.37% -> 7.18% MFU): bytes all-gathered per step and the simulated step,
the `fsdp` plan of `micro_batches=k` (per group and unit: hold across the k or not, under a budget) against
the same plan re-gathering and reduce-scattering every micro-batch (torchtitan's per-micro-batch switches).
Bundled llama-1b / 8b H100 traces (per micro-batch), FSDP over one 'data' axis of P GPUs on
`NetworkModel.preset("nvlink+400gb-ib")`. Every number is SIMULATED (docs/fsdp.md, "Accumulation").

Budgets: none (everything held), and the re-gather-every-micro-batch plan's own peak plus a quarter of the
model's gathered bytes. Prints a table and writes bench/results/fsdp_accum.json. Never asserts.

    .venv/bin/python bench/fsdp_accum.py [--gpus 8 64 256] [--k 4 8]
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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
  ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fsdp_accum.json"))
  a = ap.parse_args()
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
