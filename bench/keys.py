"""Combiner keys against the tie, and tagged layers, compiled for GPU targets (compile-only: nothing runs).

Three parts, each written to bench/results/keys.json:

- `matrix`: every lossless policy (wfbp, bucket, xla, mgwfbp, priority, prophet, auto, dear) x the bundled
  small models (mlp, cnn, gpt-tiny, resnet-small) x targets (h100, a100) x {tie (`enforce_order=True`),
  keys (`enforce_order=False`)}; the `scheduled` step (a sharded `dear` plan: its reduce-scatters and
  all-gathers). Per cell: planned units, units found (`audit`, keyed: by size and provenance), ok, the
  order (the tie's is the plan's; the keys' is XLA's), exposed units, FLOPs inside the windows, compile
  seconds. Policies with the same units compile the same program: compiled once per model, target, way.
- `deferral`: cnn, a `dlcp` plan with a deferral group (its slot is a unit of its own), tie and keys.
- `tagged`: the same models x policies on h100, each a plain `jax.jit` step whose layers are tagged
  (`prophet_jax.tag_layers`): the partitioner's all-reduces found against `tag_plan`'s buckets, and
  whether that tagging is the plan's exactly.
- `compile_time` (`--compile-time`): ResNet-50 and BERT-base, `scheduled` priority (176 and 270
  chunks, bench/results/compile_time.json's rows), tie and keys, each in a fresh process, CPU seconds of
  lower and compile (medians of `--repeats`), and the keyed audit of the big programs.

    JAX_PLATFORMS=cpu .venv/bin/python bench/keys.py [--models cnn] [--targets h100] [--compile-time]

Prints tables; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "keys.json"
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto", "dear")
MODELS = ("mlp", "cnn", "gpt-tiny", "resnet-small")
TARGETS = ("h100", "a100")
NDEV = 8
BATCH = 16


def _plans(model_name: str):
  import prophet_jax as pj
  from prophet_jax.models import get_model

  m = get_model(model_name)
  profile = pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3, model=model_name)
  net = pj.NetworkModel.preset("nvlink", workers=NDEV)
  # priority with partitions smaller than the large leaves, so that it cuts them (equal sizes)
  options = {"priority": {"partition_bytes": max(4096, profile.total_nbytes // 24)}}
  return m, {p: pj.plan(profile, net, p, **options.get(p, {})) for p in POLICIES}


def _key(s) -> tuple:
  return (s.sharded, tuple(tuple(sorted(c.slices)) for c in s.chunks), tuple(map(tuple, s.gathers or ())))


def _cell(report, s, seconds: float) -> dict:
  return {"ok": report.ok, "found": len(report.chunks), "gathers_found": len(report.gathers),
          "order": list(report.order), "order_by": report.order_by, "exposed": list(report.exposed),
          "overlap_mflop": report.overlapped_flops / 1e6, "max_in_flight": report.max_in_flight,
          "ambiguous": [w for w in report.warnings if w.startswith("ambiguous")],
          "problems": list(report.problems)[:3], "compile_s": seconds}


def matrix(models, targets) -> list[dict]:
  import prophet_jax as pj

  rows = []
  for target in targets:
    topo = pj.gpu_topology(target, devices=NDEV)
    for model_name in models:
      m, plans = _plans(model_name)
      done: dict[tuple, dict] = {}
      for policy, s in plans.items():
        key = _key(s)
        if key not in done:
          cell = {}
          for way, eo in (("tie", True), ("keys", False)):
            try:
              compiled, sec = pj.compile_step(m, s, "scheduled", topo, batch_size=BATCH, enforce_order=eo)
              cell[way] = _cell(pj.audit(compiled, s, enforce_order=eo), s, sec)
            except Exception as e:  # a bench never stops on one cell: the row says what failed
              cell[way] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
          done[key] = cell
        planned = len(s.chunks) if s.sharded else s.num_allreduces
        row = {"target": target, "model": model_name, "policy": policy, "planned": planned,
               "planned_gathers": len(s.gathers) if s.sharded else 0, **done[key]}
        rows.append(row)
        t, k = row["tie"], row["keys"]
        print(f"  {target} {model_name:12s} {policy:8s} units {planned:3d}  tie {_show(t)}  keys {_show(k)}",
              file=sys.stderr, flush=True)
  return rows


def _show(c: dict) -> str:
  if "error" in c:
    return "ERROR " + c["error"][:60]
  return (f"{'ok' if c['ok'] else 'MISMATCH'} {c['found']:3d} exp {len(c['exposed']):2d} "
          f"{c['overlap_mflop']:7.2f} MFLOP {c['compile_s']:5.1f}s")


def tagged(models) -> list[dict]:
  import jax
  from jax.sharding import PartitionSpec as P

  import prophet_jax as pj

  topo = pj.gpu_topology("h100", devices=NDEV)
  mesh = topo.mesh("data")
  rows = []
  for model_name in models:
    m, plans = _plans(model_name)
    params = m.abstract_params()
    batch = jax.eval_shape(lambda k: m.make_batch(k, BATCH), jax.random.key(0))
    done: dict[tuple, dict] = {}
    for policy, s in plans.items():
      if s.sharded:
        rows.append({"model": model_name, "policy": policy, "note": "sharded: not taggable (tag_plan raises)"})
        continue
      tp = pj.tag_plan(s)
      key = tuple((b.elements, b.layers) for b in tp.buckets)
      if key not in done:
        def step(p, b, s=s):
          with pj.tag_layers(s):
            loss, g = jax.value_and_grad(m.loss_fn)(p, b)
          return jax.tree.map(lambda x, y: x - 0.1 * y, p, g), loss

        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(topo.abstract(params, P(), mesh=mesh),
                                       topo.abstract(batch, P("data"), mesh=mesh)).compile()
        sec = time.perf_counter() - t0
        done[key] = _cell(tp.audit(compiled), s, sec)
      rows.append({"model": model_name, "policy": policy, "plan_units": s.num_allreduces,
                   "buckets": len(tp.buckets), "exact": tp.exact, "notes": list(tp.notes), **done[key]})
      r = rows[-1]
      print(f"  tagged {model_name:12s} {policy:8s} plan {s.num_allreduces:3d} buckets {len(tp.buckets):3d} "
            f"exact {tp.exact!s:5s} {_show(r)}", file=sys.stderr, flush=True)
  return rows


def deferral() -> list[dict]:
  """cnn, `dlcp` on 1 GbE (max_defer 0.2: a deferral group of 2 chunks, 1 slot), the `scheduled` step
  with its state made inside the map (`state_specs`): tie and keys on h100."""
  import jax
  import optax
  from jax.sharding import PartitionSpec as P

  import prophet_jax as pj
  from prophet_jax.models import get_model

  topo = pj.gpu_topology("h100", devices=NDEV)
  mesh = topo.mesh("data")
  m = get_model("cnn")
  params = m.abstract_params()
  prof = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  s = pj.plan(prof, pj.NetworkModel.preset("1gbe", workers=NDEV), "dlcp", max_defer=0.2)
  batch = jax.eval_shape(lambda k: m.make_batch(k, BATCH), jax.random.key(0))
  row = {"model": "cnn", "policy": "dlcp@1gbe", "max_defer": 0.2, "defers": s.defers,
         "planned": s.num_allreduces, "sizes": list(s.allreduce_sizes())}
  for way, eo in (("tie", True), ("keys", False)):
    opt = pj.scheduled(optax.sgd(0.1, momentum=0.9), s, axis_name="data", enforce_order=eo)
    specs = pj.state_specs(jax.eval_shape(opt.init, params), "data")
    o0 = jax.eval_shape(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs),
                        topo.abstract(params, P(), mesh=mesh))

    def body(p, o, b, opt=opt):
      g = jax.grad(m.loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
      u, o = opt.update(g, o, p)
      return optax.apply_updates(p, u), o

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    t0 = time.perf_counter()
    compiled = step.lower(topo.abstract(params, P(), mesh=mesh), topo.abstract(o0, specs, mesh=mesh),
                          topo.abstract(batch, P("data"), mesh=mesh)).compile()
    row[way] = _cell(pj.audit(compiled, s, enforce_order=eo), s, time.perf_counter() - t0)
  print(f"  deferral cnn dlcp@1gbe units {s.num_allreduces} tie {_show(row['tie'])} keys {_show(row['keys'])}",
        file=sys.stderr, flush=True)
  return [row]


def one_compile(model_name: str, enforce_order: bool) -> dict:
  """In this process: lower and compile the `scheduled` priority step of a published model; audit it."""
  import jax

  import prophet_jax as pj

  sys.path.insert(0, str(ROOT / "bench"))
  from gpu_hlo import model_and_profile

  model, profile = model_and_profile(model_name)
  sched = pj.plan(profile, pj.NetworkModel.preset("nvlink", workers=NDEV), "priority")
  topo = pj.gpu_topology("h100", devices=NDEV)
  jax.clear_caches()
  c = time.process_time()
  lowered = pj.lower_step(model, sched, "scheduled", topo, batch_size=BATCH, enforce_order=enforce_order)
  lower_cpu = time.process_time() - c
  c = time.process_time()
  compiled = lowered.compile()
  compile_cpu = time.process_time() - c
  report = pj.audit(compiled, sched, enforce_order=enforce_order)
  return {"model": model_name, "way": "tie" if enforce_order else "keys", "chunks": sched.num_allreduces,
          "lower_cpu_s": lower_cpu, "compile_cpu_s": compile_cpu, "load": os.getloadavg()[0],
          "ok": report.ok, "found": len(report.chunks), "exposed": len(report.exposed),
          "overlap_mflop": report.overlapped_flops / 1e6, "problems": list(report.problems)[:3],
          "jax": jax.__version__}


def compile_time(repeats: int) -> list[dict]:
  rows = []
  for model_name in ("resnet50", "bert-base"):
    for way in ("tie", "keys"):
      runs = []
      for _ in range(repeats):
        cmd = [sys.executable, __file__, "--one", model_name, way]
        p = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                           timeout=1800)
        if p.returncode:
          runs.append({"error": p.stderr[-500:]})
          continue
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
      good = [r for r in runs if "error" not in r]
      row = dict(good[0]) if good else {"model": model_name, "way": way, "error": runs[0].get("error")}
      for k in ("lower_cpu_s", "compile_cpu_s", "load"):
        if good:
          row[k] = statistics.median(r[k] for r in good)
          row[k + "_runs"] = [r[k] for r in good]
      rows.append(row)
      print(f"  {model_name} {way}: {row.get('chunks')} chunks, lower {row.get('lower_cpu_s', float('nan')):.1f} "
            f"cpu-s, compile {row.get('compile_cpu_s', float('nan')):.1f} cpu-s, ok {row.get('ok')}",
            file=sys.stderr, flush=True)
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--one", nargs=2, metavar=("MODEL", "WAY"), help=argparse.SUPPRESS)
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
  ap.add_argument("--compile-time", action="store_true", help="also ResNet-50 and BERT-base priority")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip-matrix", action="store_true")
  ap.add_argument("--out", default=str(OUT))
  a = ap.parse_args()
  if a.one:
    print(json.dumps(one_compile(a.one[0], a.one[1] == "tie")))
    return 0
  import jax

  old = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
  res = {"what": __doc__.split("\n\n")[0], "jax": jax.__version__, "devices": NDEV, "batch": BATCH}
  res["matrix"] = old.get("matrix", []) if a.skip_matrix else matrix(a.models, a.targets)
  res["tagged"] = old.get("tagged", []) if a.skip_matrix else tagged(a.models)
  res["deferral"] = old.get("deferral", []) if a.skip_matrix else deferral()
  res["compile_time"] = compile_time(a.repeats) if a.compile_time else old.get("compile_time", [])
  Path(a.out).write_text(json.dumps(res, indent=1))
  print(table(res))
  return 0


def table(res: dict) -> str:
  lines = [f"{'target':6s} {'model':12s} {'policy':8s} {'units':>5s} | {'tie':^28s} | {'keys':^28s}",
           f"{'':34s} | {'ok':>4s} {'exp':>3s} {'MFLOP':>8s} {'comp s':>6s}   | {'ok':>4s} {'exp':>3s} "
           f"{'MFLOP':>8s} {'comp s':>6s}"]
  for r in res["matrix"]:
    cells = []
    for way in ("tie", "keys"):
      c = r[way]
      cells.append("error" if "error" in c else f"{'yes' if c['ok'] else 'NO':>4s} {len(c['exposed']):3d} "
                   f"{c['overlap_mflop']:8.2f} {c['compile_s']:6.1f}  ")
    lines.append(f"{r['target']:6s} {r['model']:12s} {r['policy']:8s} {r['planned']:5d} | {cells[0]} | {cells[1]}")
  lines.append("")
  lines.append(f"{'tagged':6s} {'model':12s} {'policy':8s} {'plan':>5s} {'bkts':>5s} {'exact':>5s} {'ok':>4s} "
               f"{'found':>5s}")
  for r in res["tagged"]:
    if "note" in r:
      lines.append(f"{'':6s} {r['model']:12s} {r['policy']:8s} {r['note']}")
      continue
    lines.append(f"{'':6s} {r['model']:12s} {r['policy']:8s} {r['plan_units']:5d} {r['buckets']:5d} "
                 f"{r['exact']!s:>5s} {'yes' if r['ok'] else 'NO':>4s} {r['found']:5d}")
  if res.get("compile_time"):
    lines.append("")
    lines.append(f"{'model':10s} {'way':5s} {'chunks':>6s} {'lower cpu s':>11s} {'compile cpu s':>13s} "
                 f"{'ok':>4s}")
    for r in res["compile_time"]:
      lines.append(f"{r['model']:10s} {r['way']:5s} {r.get('chunks', 0):6d} {r.get('lower_cpu_s', float('nan')):11.1f} "
                   f"{r.get('compile_cpu_s', float('nan')):13.1f} {'yes' if r.get('ok') else 'NO':>4s}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
