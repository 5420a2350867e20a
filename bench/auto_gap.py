"""Is `auto` beaten by a heavier search? An oracle over the scaling sweep's pipelined cells.

Per cell (bench/scaling.py's grid: 4 bundled traces x {v100, h100} x {10gbe, 25gbe, 100gb-ib} x
workers {4, 16, 64, 256, 2048}, cross_step=True), `auto` at its defaults against the best of a
heavier search, every schedule scored by `prophet_jax.simulate` (the model auto plans with):

* `blocks`: Prophet's block rule (`_prophet.Planner`, the same greedy pass as `prophet`) with a minimum
  block size in absolute bytes, 1-128 MiB (the `prophet` policy's floor is relative to the network's
  start-up, auto's block family's to the total bytes), x tail growth x a small first block x Prophet's
  stage gap factor: the external search of issue 19;
* `prophet`: the `prophet` policy over a finer grid of its knobs (alpha_fraction, tail_growth,
  gap_factor);
* `auto10`: `auto` with a 10x larger local-search budget (and `auto100` with --heavy);
* `blocks+ls`: the best `blocks` schedule refined by auto's iterated local search (rich neighbourhood
  up to 24 chunks, whatever the number of slices) with 10x auto's whole budget, from that one start.

The last two reuse auto's own search engine, so they get stronger whenever it does: what they find is
the depth a 10x budget buys, not a family auto lacks. That is also why this bench alone imports private
code (auto's block planner `Planner`, its problem, chunks and local search): the oracle measures how
much deeper auto's own engine could go, so it must run that engine, not a copy. Schedules are built
with the public values (`_schedules.schedule_of`). Prints per cell auto's predicted iteration time,
the best found and by whom, and the gap (how much faster the oracle's schedule is than auto's, in %);
with --before, whether auto got slower anywhere; writes bench/results/auto_gap.json. Never asserts.

    .venv/bin/python bench/auto_gap.py            # the 120 pipelined cells (several minutes on 2 cores)
    .venv/bin/python bench/auto_gap.py --plain    # also the plain step (cross_step=False)
    .venv/bin/python bench/auto_gap.py --quick    # resnet50 and gpt2 on v100 only
    .venv/bin/python bench/auto_gap.py --plain --no-oracle --out before.json   # auto alone, both modes
    .venv/bin/python bench/auto_gap.py --plain --before before.json   # and whether auto got slower anywhere
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import platform
import sys
import time

from _schedules import schedule_of

from prophet_jax import NetworkModel, plan, simulate
from prophet_jax._planning._core import problem
from prophet_jax.models import load_trace
from prophet_jax.schedulers import auto
from prophet_jax.schedulers._joint import make_chunk
from prophet_jax.schedulers._prophet import Planner
from prophet_jax.schedulers._search import iterated_local_search

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
DEVICES = ("v100", "h100")
NETWORKS = ("10gbe", "25gbe", "100gb-ib")
WORKERS = (4, 16, 64, 256, 2048)
MIB = 2**20
MIN_BLOCKS_MIB = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TAIL_GROWTHS = (1.0, 1.5, 2.0, 4.0)
GAP_FACTORS = (1.0, 2.0, 4.0, 8.0)
ALPHA_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
PROPHET_TAIL_GROWTHS = (1.0, 2.0, 4.0)
DEFAULT_EVALS = inspect.signature(auto).parameters["max_evals"].default   # auto's search budget
OUT = pathlib.Path(__file__).resolve().parent / "results"


def _sim(schedule, profile, network, cross_step) -> float:
  return simulate(schedule, profile, network, cross_step=cross_step, events=False).iteration_s


def heavier_search(profile, network, cross_step: bool, heavy: bool) -> dict[str, tuple[float, str]]:
  """{family: (best simulated iteration_s, the setting that found it)} of the heavier search."""
  prob = problem(profile, network, cross_step=cross_step)
  found: dict[str, tuple[float, str]] = {}

  def keep(family: str, t: float, how: str) -> None:
    if family not in found or t < found[family][0]:
      found[family] = (t, how)

  best_groups = None
  if network.overlap:
    for gf in GAP_FACTORS:
      planner = Planner(prob, gf)
      for mb in MIN_BLOCKS_MIB:
        for g in TAIL_GROWTHS:
          for small_first in (True, False):
            groups, _ = planner.plan(mb * MIB, g, small_first)
            s = schedule_of(profile, groups, policy="blocks", cross_step=cross_step)
            t = _sim(s, profile, network, cross_step)
            how = f"min_block={mb}MiB, tail_growth={g}, small_first={small_first}, gap_factor={gf}"
            keep("blocks", t, how)
            if found["blocks"][1] == how:
              best_groups = groups
    for af in ALPHA_FRACTIONS:
      for g in PROPHET_TAIL_GROWTHS:
        for gf in GAP_FACTORS:
          s = plan(profile, network, "prophet", cross_step=cross_step, alpha_fraction=af,
                   tail_growth=g, gap_factor=gf)
          keep("prophet", _sim(s, profile, network, cross_step),
               f"alpha_fraction={af}, tail_growth={g}, gap_factor={gf}")
  for name, evals in (("auto10", 10 * DEFAULT_EVALS),) + ((("auto100", 100 * DEFAULT_EVALS),) if heavy else ()):
    s = plan(profile, network, "auto", cross_step=cross_step, max_evals=evals)
    keep(name, _sim(s, profile, network, cross_step), dict(s.options).get("candidate", ""))
  if best_groups is not None:
    s = schedule_of(profile, best_groups, policy="blocks", cross_step=cross_step)
    chunks = [make_chunk(prob, c.slices) for c in s.chunks]
    small = len(chunks) <= 24
    refined, _ = iterated_local_search(prob, chunks, 10 * DEFAULT_EVALS, small)
    s = schedule_of(profile, [c.slices for c in refined], policy="blocks+ls", cross_step=cross_step)
    keep("blocks+ls", _sim(s, profile, network, cross_step), found["blocks"][1])
  return found


def _key(c: dict) -> str:
  return f"{c['model']}-{c['device']} {c['network']} P={c['workers']} cross_step={c['cross_step']}"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="resnet50 and gpt2 on v100 only")
  ap.add_argument("--plain", action="store_true", help="also the plain step (cross_step=False)")
  ap.add_argument("--heavy", action="store_true", help="also auto with a 100x budget")
  ap.add_argument("--no-oracle", action="store_true", help="auto alone (e.g. to record a --before file)")
  ap.add_argument("--before", help="an earlier output: report every cell where auto is now slower")
  ap.add_argument("--out", default=str(OUT / "auto_gap.json"))
  args = ap.parse_args(argv)
  before = {}
  if args.before:
    before = {_key(c): c["auto_s"] for c in json.loads(pathlib.Path(args.before).read_text())["cells"]}
  models = ("resnet50", "gpt2") if args.quick else MODELS
  devices = DEVICES[:1] if args.quick else DEVICES
  modes = (True, False) if args.plain else (True,)
  w0 = time.perf_counter()
  cells = []
  print("iteration times in ms; gap: how much faster the oracle's best is than auto (%)")
  print(f"{'model':9s} {'dev':4s} {'network':8s} {'P':>5s} {'x':1s} {'auto':>9s} {'oracle':>9s} {'gap %':>7s} "
        f"{'auto ms':>7s}  best by")
  for cross_step in modes:
    for model in models:
      for dev in devices:
        prof = load_trace(f"{model}-{dev}")
        for net_name in NETWORKS:
          for workers in WORKERS:
            net = NetworkModel.preset(net_name, workers=workers)
            c0 = time.process_time()
            s = plan(prof, net, "auto", cross_step=cross_step)
            auto_ms = (time.process_time() - c0) * 1e3
            t_auto = _sim(s, prof, net, cross_step)
            found = {} if args.no_oracle else heavier_search(prof, net, cross_step, args.heavy)
            fam, (t_best, how) = min(found.items(), key=lambda kv: kv[1][0], default=("none", (t_auto, "")))
            gap = (t_auto - t_best) / t_auto * 100
            cells.append({"model": model, "device": dev, "network": net_name, "workers": workers,
                          "cross_step": cross_step, "auto_s": t_auto,
                          "auto_candidate": dict(s.options).get("candidate", ""), "auto_plan_cpu_ms": auto_ms,
                          "oracle_s": t_best, "oracle_family": fam, "oracle_setting": how, "gap_pct": gap,
                          "families": {k: {"iteration_s": v[0], "setting": v[1]} for k, v in found.items()}})
            old = before.get(_key(cells[-1]))
            if old is not None:
              cells[-1]["auto_before_s"] = old
            mark = " <" if gap > 1e-9 else ""
            print(f"{model:9s} {dev:4s} {net_name:8s} {workers:5d} {'T' if cross_step else 'F'} "
                  f"{t_auto * 1e3:9.3f} {t_best * 1e3:9.3f} {gap:7.3f} {auto_ms:7.0f}  {fam}: {how}{mark}",
                  flush=True)
  beaten = [c for c in cells if c["gap_pct"] > 1e-9]
  compared = [c for c in cells if "auto_before_s" in c]
  slower = [c for c in compared if c["auto_s"] > c["auto_before_s"] * (1 + 1e-9)]
  faster = [c for c in compared if c["auto_s"] < c["auto_before_s"] * (1 - 1e-9)]
  summary = {"cells": len(cells), "cells_auto_beaten": len(beaten),
             "max_gap_pct": max((c["gap_pct"] for c in cells), default=0.0),
             "beaten": [f"{c['model']}-{c['device']} {c['network']} P={c['workers']} "
                        f"cross_step={c['cross_step']}: {c['gap_pct']:.3f}% by {c['oracle_family']} "
                        f"({c['oracle_setting']})" for c in beaten],
             "families_beating_auto": {f: sum(1 for c in cells if f in c["families"] and
                                                  c["families"][f]["iteration_s"] < c["auto_s"] * (1 - 1e-9))
                                       for f in ("blocks", "prophet", "auto10", "auto100", "blocks+ls")},
             "wall_s": time.perf_counter() - w0}
  if compared:
    beaten_before = [c for c in compared if c["auto_before_s"] > c["oracle_s"] * (1 + 1e-9)]
    summary["vs_before"] = {"cells": len(compared), "slower": len(slower), "faster": len(faster),
                            "before_beaten_by_oracle": len(beaten_before),
                            "before_max_gap_pct": max((100 * (1 - c["oracle_s"] / c["auto_before_s"])
                                                       for c in beaten_before), default=0.0),
                            "max_gain_pct": max((100 * (1 - c["auto_s"] / c["auto_before_s"]) for c in compared),
                                                default=0.0),
                            "slower_cells": [_key(c) for c in slower]}
  print(f"\nauto beaten on {summary['cells_auto_beaten']} of {summary['cells']} cells; largest gap "
        f"{summary['max_gap_pct']:.3f}%")
  for line in summary["beaten"]:
    print("  " + line)
  print("families beating auto (cells): " + ", ".join(f"{k} {v}" for k, v in summary["families_beating_auto"].items()))
  if compared:
    v = summary["vs_before"]
    print(f"against --before: {v['cells']} cells, auto slower on {v['slower']}, faster on {v['faster']} "
          f"(largest gain {v['max_gain_pct']:.3f}%); the earlier auto was beaten by the best found here on "
          f"{v['before_beaten_by_oracle']} cells, by up to {v['before_max_gap_pct']:.3f}%")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"command": "python bench/auto_gap.py " + " ".join(argv or sys.argv[1:]),
                             "python": sys.version.split()[0], "machine": platform.machine(),
                             "summary": summary, "cells": cells}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
