"""How long the measure step takes: reading a kept trace, and `profile_step` on BERT-base, phase by phase.

Part `trace` (no device needed): `profile_from_trace` on the kept H200 traces (tests/fixtures: cnn, and
ResNet-50's 2,190 kernel events in 3 steps), split into reading the trace (`_xplane.read_trace`), parsing
the HLO (`_step_hlo.step_hlo`) and the analysis (`_xplane.analyse`); and the analysis of a long trace made
by repeating ResNet-50's executions (30 steps, 21,900 events). Medians of `--repeats` runs.

Part `bert`: `profile_step` of `architecture("bert-base")` (batch `--batch` x 128 tokens, one device,
`--steps` traced steps, sgd with momentum) on this machine, with the time of each phase: checking and
tracing the loss (`_setup`: eval_shape of the loss and of its gradient, the jaxpr's forward order),
compiling (the gradient step, the local train step and the update, at once), running the steps (warm-up,
untraced wall clock, traced), reading and analysing the trace, and the rest (lowering, the profiler's
start and stop); then the same with `method="timed"` (at most `_profile_methods.TIMED_LAYERS` per-layer
programs: BERT-base has 100 layers).

Why it imports private code: it times the measure step's own phases (the trace reader `_xplane`, the
HLO reader `_step_hlo`, and `_profile`'s setup, compile and analysis, wrapped for the run): no public
name exposes them one by one.

  JAX_PLATFORMS=cpu .venv/bin/python bench/profile_time.py [--part trace|bert|all] [--batch 2] [--steps 3]

Writes bench/results/profile_time.json and prints a table. Never asserts.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
STEP = "jit_prophet_profile_step"


def _median_time(fn, repeats):
  ts = []
  out = None
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    ts.append(time.perf_counter() - t)
  return statistics.median(ts), out


def _params(name):
  import jax

  if name == "cnn":
    from prophet_jax.models import get_model

    m = get_model("cnn")
    params = jax.eval_shape(m.init, jax.random.key(0))
    return params, list(m.forward_paths(params))
  from prophet_jax.models import architecture

  a = architecture(name)
  return a.abstract_params(), list(a.forward_paths())


def part_trace(repeats):
  import jax

  from prophet_jax._measure import _step_hlo, _xplane

  from prophet_jax import profile_from_trace
  from prophet_jax._values._tree import layer_of, path_str

  out = {}
  for name in ("cnn", "resnet50"):
    trace = FIXTURES / f"h200-{name}.xplane.pb.gz"
    with gzip.open(FIXTURES / f"h200-{name}.hlo.txt.gz", "rt") as f:
      text = f.read()
    params, fwd = _params(name)
    total, prof = _median_time(lambda: profile_from_trace(trace, text, params), repeats)
    read, tr = _median_time(lambda: _xplane.read_trace(trace, [STEP]), repeats)
    parse, hlo = _median_time(lambda: _step_hlo.step_hlo(text), repeats)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    n = len(paths)
    layers = list(dict.fromkeys(layer_of(p) for p in fwd))
    row_layers = [layer_of(p) for p in paths]
    events = tr.events[STEP]
    analyse, an = _median_time(lambda: _xplane.analyse(events, hlo, list(range(n)), n, layers,
                                                       row_layers=row_layers), repeats)
    row = {"events": len(events), "executions": an.executions, "rows": n, "layers": len(layers),
           "profile_from_trace_s": total, "read_trace_s": read, "step_hlo_s": parse, "analyse_s": analyse,
           "backward_over_forward": prof.backward_s / prof.forward_s}
    if name == "resnet50":  # a long trace: the 3 executions repeated to 30 steps
      span = max(e["end_ns"] for e in events) - min(e["start_ns"] for e in events) + 1e6
      long = [dict(e, run=(k, e["run"]), start_ns=e["start_ns"] + k * span, end_ns=e["end_ns"] + k * span)
              for k in range(10) for e in events]
      t_long, an_long = _median_time(lambda: _xplane.analyse(long, hlo, list(range(n)), n, layers,
                                                             row_layers=row_layers), repeats)
      row["long_trace"] = {"events": len(long), "executions": an_long.executions, "analyse_s": t_long}
    out[name] = row
  return out


def _bert(batch_n):
  import jax
  import jax.numpy as jnp

  from prophet_jax.models import architecture

  arch = architecture("bert-base")
  x = jnp.zeros((2, *arch.input_shape), arch.input_dtype)
  variables = jax.jit(arch.module.init)(jax.random.key(0), x)
  params = {"params": variables["params"]}
  batch = {"x": jax.random.randint(jax.random.key(2), (batch_n, *arch.input_shape), 0, 1000),
           "y": jax.random.randint(jax.random.key(3), (batch_n,), 0, 10)}

  def loss_fn(p, b):
    out = arch.apply(p, b["x"]).astype(jnp.float32)
    out = out.reshape(out.shape[0], -1)
    logp = jax.nn.log_softmax(out)
    return -jnp.mean(jnp.take_along_axis(logp, b["y"][:, None], axis=1))

  return loss_fn, params, batch


class _Phases:
  """Wall time spent inside some functions during a run (patched for the run): `_profile`'s own,
  `jax.block_until_ready` (running the programs) and the `.lower` of the gradient programs."""

  def __init__(self, mod, methods):
    self.mod = mod            # _profile: profile_step and what it calls first
    self.methods = methods    # _profile_methods: the measured method's compile, run and analysis
    self.t = {"setup": 0.0, "lower": 0.0, "compile": 0.0, "run": 0.0, "analysis": 0.0}
    self.saved = []

  def _wrap(self, owner, attr, phase):
    real = getattr(owner, attr)

    @functools.wraps(real)
    def timed(*a, **k):
      t = time.perf_counter()
      try:
        return real(*a, **k)
      finally:
        self.t[phase] += time.perf_counter() - t
    self.saved.append((owner, attr, real))
    setattr(owner, attr, timed)
    return real

  def __enter__(self):
    import jax

    self._wrap(self.mod, "setup", "setup")
    self._wrap(self.mod, "update_program", "lower")
    self._wrap(self.mod, "local_step_program", "lower")
    self._wrap(self.methods, "compile_all", "compile")
    self._wrap(self.methods, "from_trace", "analysis")
    self._wrap(jax, "block_until_ready", "run")
    phases = self
    real_grad = self.methods.grad_program

    def grad_program(*a, **k):
      f = real_grad(*a, **k)

      class Timed:  # times .lower, passes calls through
        def lower(self, *la, **lk):
          t = time.perf_counter()
          try:
            return f.lower(*la, **lk)
          finally:
            phases.t["lower"] += time.perf_counter() - t

        def __call__(self, *ca, **ck):
          return f(*ca, **ck)
      return Timed()
    self.saved.append((self.methods, "grad_program", real_grad))
    self.methods.grad_program = grad_program
    return self

  def __exit__(self, *exc):
    for owner, attr, real in reversed(self.saved):
      setattr(owner, attr, real)


def part_bert(batch_n, steps):
  import optax

  import prophet_jax as pj
  from prophet_jax._measure import _profile, _profile_methods

  t = time.perf_counter()
  loss_fn, params, batch = _bert(batch_n)
  init_s = time.perf_counter() - t
  out = {"batch": [batch_n, 128], "steps": steps, "init_s": init_s}
  for method in ("auto", "timed"):
    with _Phases(_profile, _profile_methods) as ph:
      t = time.perf_counter()
      prof = pj.profile_step(loss_fn, params, batch, num_devices=1, steps=steps, warmup=1,
                             tx=optax.sgd(0.01, momentum=0.9), method=method, model="bert-base")
      total = time.perf_counter() - t
    row = {"method": prof.method, "total_s": total, "setup_s": ph.t["setup"], "lower_s": ph.t["lower"],
           "compile_s": ph.t["compile"], "run_s": ph.t["run"], "trace_analysis_s": ph.t["analysis"],
           "rows": len(prof.rows), "layers": len({r.layer for r in prof.rows}),
           "forward_ms": prof.forward_s * 1e3, "backward_ms": prof.backward_s * 1e3, "notes": prof.notes[:400]}
    row["other_s"] = total - sum(row[k] for k in ("setup_s", "lower_s", "compile_s", "run_s", "trace_analysis_s"))
    if method == "timed":  # compiles happen at each program's first call, inside "run"
      row["gradient_programs"] = min(_profile_methods.TIMED_LAYERS, row["layers"]) + 1  # the layers' and the full
    out[method] = row
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--part", choices=("trace", "bert", "all"), default="all")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile_time.json"))
  args = ap.parse_args()
  import jax

  res = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                     "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                     "load_at_start": os.getloadavg()[0]}}
  if args.part in ("trace", "all"):
    res["trace"] = part_trace(args.repeats)
  if args.part in ("bert", "all"):
    res["bert"] = part_bert(args.batch, args.steps)
  res["machine"]["load_at_end"] = os.getloadavg()[0]
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
  old.update(res)
  Path(args.out).write_text(json.dumps(old, indent=1) + "\n")

  if "trace" in res:
    print(f"{'trace':<10} {'events':>7} {'execs':>5} {'total ms':>9} {'read':>7} {'hlo':>7} {'analyse':>8}")
    for name, r in res["trace"].items():
      print(f"{name:<10} {r['events']:>7} {r['executions']:>5} {r['profile_from_trace_s'] * 1e3:>9.1f} "
            f"{r['read_trace_s'] * 1e3:>7.1f} {r['step_hlo_s'] * 1e3:>7.1f} {r['analyse_s'] * 1e3:>8.1f}")
      if "long_trace" in r:
        lt = r["long_trace"]
        print(f"{name + ' x10':<10} {lt['events']:>7} {lt['executions']:>5} {'':>9} {'':>7} {'':>7} "
              f"{lt['analyse_s'] * 1e3:>8.1f}")
  if "bert" in res:
    b = res["bert"]
    print(f"\nbert-base profile_step, batch {b['batch']}, {b['steps']} steps, {res['machine']['device']}")
    print(f"{'method':<8} {'total s':>8} {'setup':>7} {'lower':>7} {'compile':>8} {'run':>7} {'analysis':>9} "
          f"{'other':>7}")
    for m in ("auto", "timed"):
      r = b[m]
      print(f"{r['method']:<8} {r['total_s']:>8.1f} {r['setup_s']:>7.1f} {r['lower_s']:>7.1f} {r['compile_s']:>8.1f} "
            f"{r['run_s']:>7.1f} {r['trace_analysis_s']:>9.2f} {r['other_s']:>7.1f}")
    print("(timed: every program compiles at its first run, inside 'run')")
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
