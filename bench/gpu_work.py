"""The work in XLA:GPU's compiled program of each step: what the pipelined step does beyond the plain one.

Compile-only (nothing runs): each step of ResNet-50 (batch 64, as the H200 run of issue 23) is compiled
for ONE H100 (`gpu_topology("h100", devices=1)`, a one-device mesh: no all-reduce to hide, as on the
H200), and its ENTRY computation read with `_hlo_costs.OpCosts`: kernels (fusions and library calls), matmul
and convolution FLOPs, and bytes (every op's operands and result, read and written once: an estimate of
memory traffic, not a measurement). Steps: the plain `pmean` step, `scheduled` wfbp, and `pipelined`
wfbp with min-cut residuals (the default) and with `residuals="all"`. Per op kind the bytes say where
the difference goes (min-cut recomputes elementwise ops in the backward: more `maximum`, `select`,
`compare` traffic).

Why it imports private code: it reads the compiled HLO with the library's own HLO parser and op-cost
model (`_hlo`, `_hlo_costs`, what `audit` counts window FLOPs with); no public name returns per-op costs.

    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_work.py [--model resnet50] [--batch 64]

Writes bench/results/gpu_work.json and prints a table. Never asserts.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

_SKIP = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")


def work(compiled_text: str) -> dict:
  from prophet_jax._compiled._hlo import parse_hlo, shape_bytes
  from prophet_jax._compiled._hlo_costs import OpCosts

  m = parse_hlo(compiled_text)
  costs = OpCosts(m)
  entry = m.computations[m.entry]
  flops = nbytes = 0
  kinds: collections.Counter = collections.Counter()
  kind_bytes: collections.Counter = collections.Counter()
  for ins in entry:
    if ins.opcode in _SKIP:
      continue
    f, b = costs.cost(m.entry, ins)
    flops += f
    nbytes += b
    kind = ins.opcode if ins.opcode != "fusion" or not ins.callees else re.sub(r"[._]?\d+$", "", ins.callees[0][1])
    if kind.startswith(("all-reduce", "fusion-start", "fusion-done")):
      kind = "all-reduce"
    kinds[kind] += 1
    kind_bytes[kind] += b
  return {"kernels": sum(n for k, n in kinds.items() if k != "all-reduce"), "flops": flops, "bytes": nbytes,
          "input_bytes": sum(shape_bytes(i.shape) for i in entry if i.opcode == "parameter"),
          "kinds": dict(kinds.most_common()), "kind_bytes": dict(kind_bytes.most_common())}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="resnet50", choices=("resnet50", "bert-base"))
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_work.json"))
  a = ap.parse_args()
  import jax

  import prophet_jax as pj
  from prophet_jax import _steps
  from gpu_hlo import model_and_profile

  model, profile = model_and_profile(a.model)
  net = pj.NetworkModel.preset("10gbe", workers=8)
  topo = pj.gpu_topology("h100", devices=1)
  real = _steps.pipelined  # the name lower_step calls
  rows = {}
  for name, mode, policy, residuals in (("plain", "pmean", "xla", None), ("scheduled wfbp", "scheduled", "wfbp", None),
                                        ("pipelined wfbp min-cut", "pipelined", "wfbp", "min-cut"),
                                        ("pipelined wfbp all", "pipelined", "wfbp", "all")):
    sched = pj.plan(profile, net, policy, cross_step=mode == "pipelined")
    _steps.pipelined = functools.partial(real, residuals=residuals) if residuals else real
    try:
      t = time.process_time()
      compiled, _ = pj.compile_step(model, sched, mode, topo, batch_size=a.batch)
      cpu_s = time.process_time() - t
    finally:
      _steps.pipelined = real
    rows[name] = {"chunks": sched.num_allreduces if mode != "pmean" else 1, "lower_compile_cpu_s": cpu_s,
                  **work(compiled.as_text())}
    print(f"  {name}: {rows[name]['kernels']} kernels, {rows[name]['bytes'] / 1e9:.2f} GB", file=sys.stderr, flush=True)
  base = rows["plain"]
  print(f"{a.model}, batch {a.batch}, one compile-only H100 (jax {jax.__version__})")
  print(f"{'step':24s} {'chunks':>6s} {'kernels':>7s} {'TFLOP':>6s} {'GB':>6s} {'x plain':>7s} {'inputs GB':>9s}")
  for name, r in rows.items():
    r["bytes_over_plain"] = r["bytes"] / base["bytes"]
    print(f"{name:24s} {r['chunks']:6d} {r['kernels']:7d} {r['flops'] / 1e12:6.2f} {r['bytes'] / 1e9:6.2f} "
          f"{r['bytes_over_plain']:7.3f} {r['input_bytes'] / 1e9:9.2f}")
  print("\nbytes over the plain step's, by op kind (GB):")
  for name, r in rows.items():
    if name == "plain":
      continue
    diff = {k: (r["kind_bytes"].get(k, 0) - base["kind_bytes"].get(k, 0)) / 1e9
            for k in set(r["kind_bytes"]) | set(base["kind_bytes"])}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:6]
    print(f"  {name}: " + ", ".join(f"{k} {v:+.2f}" for k, v in top))
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"what": __doc__.splitlines()[0], "model": a.model, "batch": a.batch, "jax": jax.__version__,
                             "target": "h100 x1 (compile-only)", "rows": rows}, indent=1) + "\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
