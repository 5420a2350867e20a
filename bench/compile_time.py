"""Where the rewrite's compile time goes on XLA:GPU (compile-only H100s: nothing runs on a GPU).

For a published model (ResNet-50, BERT-base at the bundled `{model}-h100` traces' layer shapes, 8 H100s, a
global batch of 16, the `nvlink` preset, as `bench/gpu_hlo.py`), each step is built in a fresh process
(`prophet_jax.lower_step`) and timed in three parts:

- `lower s`: tracing the step and lowering it to StableHLO (our Python: the chunks' gathers, psums,
  scatters and the tie chain);
- `compile s`: XLA:GPU's `compile()` (HLO passes, scheduling, LLVM, ptxas);
- each also in CPU seconds of the process (`time.process_time`, every thread): on a shared machine the
  wall clock varies with the other load, the CPU time much less; `--repeats` fresh processes, medians;
- with `--passes`, a second run logs every HLO pass's time (`TF_CPP_VMODULE=hlo_pass_pipeline=1`, XLA's
  own per-pass timer); the table lists the passes whose time grows most over the plain step's.

Against the plain step (`pmean`: `jax.lax.pmean` of the gradient tree, what XLA merges into one
all-reduce): `scheduled` and `pipelined` with many chunks (wfbp, priority).

    JAX_PLATFORMS=cpu .venv/bin/python bench/compile_time.py [--models resnet50 bert-base] [--passes]

Writes bench/results/compile_time.json and prints a table. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "compile_time.json"
CASES = {  # (mode, policy); policy None: the plain step
    "resnet50": [("pmean", None), ("scheduled", "xla"), ("scheduled", "wfbp"), ("scheduled", "priority"),
                 ("pipelined", "wfbp"), ("pipelined", "priority")],
    "bert-base": [("pmean", None), ("scheduled", "wfbp"), ("scheduled", "priority"), ("pipelined", "priority")],
}
_PASS = re.compile(r"HLO pass: (\S+) time: [^(]*\((\d+) us\)")
_PIPE = re.compile(r"Running HLO pass pipeline on module \S+: (\S+)")


def one(model_name: str, mode: str, policy: str | None) -> dict:
  """In this process: lower and compile one step; its times and sizes."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  import prophet_jax as pj

  sys.path.insert(0, str(ROOT / "bench"))
  from gpu_hlo import BATCH, NDEV, model_and_profile

  model, profile = model_and_profile(model_name)
  net = pj.NetworkModel.preset("nvlink", workers=NDEV)
  sched = pj.plan(profile, net, policy or "xla", cross_step=mode == "pipelined")
  topo = pj.gpu_topology("h100", devices=NDEV)
  jax.clear_caches()
  t, c = time.perf_counter(), time.process_time()
  lowered = pj.lower_step(model, sched, mode, topo, batch_size=BATCH)
  lower_s, lower_cpu_s = time.perf_counter() - t, time.process_time() - c
  stablehlo = lowered.as_text()
  c = time.process_time()
  t = time.perf_counter()
  compiled = lowered.compile()
  compile_s, compile_cpu_s = time.perf_counter() - t, time.process_time() - c
  text = compiled.as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  return {"model": model_name, "mode": mode, "policy": policy or "-",
          "chunks": sched.num_allreduces if policy else 1, "lower_s": lower_s, "compile_s": compile_s,
          "lower_cpu_s": lower_cpu_s, "compile_cpu_s": compile_cpu_s, "load": os.getloadavg()[0],
          "stablehlo_lines": stablehlo.count("\n"), "hlo_lines": text.count("\n"),
          "entry_instructions": entry.count("\n"), "jax": jax.__version__}


def run_child(model_name: str, mode: str, policy: str | None, passes: bool) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if passes:
    env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
  cmd = [sys.executable, __file__, "--one", model_name, mode, policy or "-"]
  p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  if p.returncode:
    raise RuntimeError(f"{cmd}: {p.stderr[-2000:]}")
  row = json.loads(p.stdout.strip().splitlines()[-1])
  if passes:
    per_pass: dict[str, float] = {}
    per_pipe: dict[str, float] = {}
    pipe = "?"
    for line in p.stderr.splitlines():
      m = _PIPE.search(line)
      if m:
        pipe = m.group(1)
        continue
      m = _PASS.search(line)
      if m:
        per_pass[m.group(1)] = per_pass.get(m.group(1), 0.0) + int(m.group(2)) * 1e-6
        per_pipe[pipe] = per_pipe.get(pipe, 0.0) + int(m.group(2)) * 1e-6
    row["passes_s"] = dict(sorted(per_pass.items(), key=lambda kv: -kv[1])[:30])
    row["pipelines_s"] = dict(sorted(per_pipe.items(), key=lambda kv: -kv[1])[:15])
    row["passes_total_s"] = sum(per_pass.values())
  return row


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--one", nargs=3, metavar=("MODEL", "MODE", "POLICY"), help=argparse.SUPPRESS)
  ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
  ap.add_argument("--passes", action="store_true", help="also log XLA's per-pass times (a second compile)")
  ap.add_argument("--top", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=1, help="fresh processes per case; medians")
  ap.add_argument("--out", default=str(OUT))
  a = ap.parse_args()
  if a.one:
    model_name, mode, policy = a.one
    print(json.dumps(one(model_name, mode, None if policy == "-" else policy)))
    return 0
  rows = []
  for model_name in a.models:
    for mode, policy in CASES[model_name]:
      runs = [run_child(model_name, mode, policy, False) for _ in range(a.repeats)]
      row = dict(runs[0])
      for k in ("lower_s", "compile_s", "lower_cpu_s", "compile_cpu_s", "load"):
        row[k] = statistics.median(r[k] for r in runs)
        row[k + "_runs"] = [r[k] for r in runs]
      if a.passes:
        logged = run_child(model_name, mode, policy, True)
        row.update({k: logged[k] for k in ("passes_s", "pipelines_s", "passes_total_s")})
        row["compile_s_logged"] = logged["compile_s"]
      rows.append(row)
      print(f"  {model_name} {mode} {policy}: lower {row['lower_s']:.1f} s, compile {row['compile_s']:.1f} s",
            file=sys.stderr, flush=True)
  print(f"{'model':10s} {'mode':10s} {'policy':9s} {'chunks':>6s} {'lower s':>8s} {'compile s':>9s} "
        f"{'x plain':>7s} {'lower cpu':>9s} {'comp cpu':>8s} {'x plain':>7s} {'entry ops':>9s}")
  plain = {r["model"]: r for r in rows if r["mode"] == "pmean"}
  for r in rows:
    base = plain.get(r["model"])
    ratio = (r["lower_s"] + r["compile_s"]) / (base["lower_s"] + base["compile_s"]) if base else float("nan")
    cpu = (r["lower_cpu_s"] + r["compile_cpu_s"]) / (base["lower_cpu_s"] + base["compile_cpu_s"]) \
        if base else float("nan")
    r["ratio_vs_plain"], r["cpu_ratio_vs_plain"] = ratio, cpu
    print(f"{r['model']:10s} {r['mode']:10s} {r['policy']:9s} {r['chunks']:6d} {r['lower_s']:8.1f} "
          f"{r['compile_s']:9.1f} {ratio:7.2f} {r['lower_cpu_s']:9.1f} {r['compile_cpu_s']:8.1f} {cpu:7.2f} "
          f"{r['entry_instructions']:9d}")
  if a.passes:
    print("\nXLA passes that grow most over the plain step (seconds, summed over a pass's runs):")
    for r in rows:
      base = plain.get(r["model"])
      if base is None or r is base:
        continue
      grow = sorted(((t - base["passes_s"].get(p, 0.0), p, t) for p, t in r["passes_s"].items()), reverse=True)
      cells = ", ".join(f"{p} {t:.2f} (+{d:.2f})" for d, p, t in grow[:a.top])
      print(f"{r['model']} {r['mode']} {r['policy']}: passes {r['passes_total_s']:.1f} s of "
            f"{r['compile_s_logged']:.1f} s (plain {base['passes_total_s']:.1f} of {base['compile_s_logged']:.1f}); "
            f"{cells}")
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"what": "lower and compile times of the rewrite for 8 compile-only H100s (no GPU "
                                     "ran); XLA's per-pass times with --passes; passes_s: the 30 slowest passes, "
                                     "pipelines_s: the 15 slowest pipelines", "rows": rows}, indent=1) + "\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
