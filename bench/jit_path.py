"""The plain jax.jit path: a jit step on global arrays with hooked/pipelined(mesh=) vs the plain jit step
and vs the same rewrite under a user-written shard_map.

8 host devices (CPU), a one-axis mesh 'data' with Auto axes (on Explicit axes, jax.make_mesh's default,
the plain jit step of gpt-tiny does not trace: its embedding gather over the batch-split tokens asks for
an out_sharding; the mesh path runs per device and works on either), params replicated (P()), the
batch split over the axis (P('data')). For each model (cnn, gpt-tiny) and policy (planned for the
'10gbe' preset, 8 workers, so that there are several chunks), these train steps (grad, all-reduce,
sgd with momentum) are compiled and timed:
  plain_jit         jax.jit(step) with jax.value_and_grad: the partitioner's own gradient all-reduce;
  jit_hooked        jax.jit(step) with prophet_jax.hooked(loss_fn, schedule, axis_name, mesh=mesh);
  shard_map_hooked  jax.jit(jax.shard_map(step)) with prophet_jax.hooked(...) and a loss pmean: what a
                    shard_map user writes (the per-device program jit_hooked maps over the mesh);
  jit_pipelined     jax.jit(pipe.step), pipe = prophet_jax.pipelined(..., mesh=mesh) (cross-step plan);
  shard_map_pipelined  the same step under a user-written shard_map.
Steps are timed round-robin (one step of every variant per round, so load drifts hit them alike),
medians and 10th percentiles over the rounds; ratios against plain_jit and, for the mesh path, against
its shard_map twin. Writes bench/results/jit_path.json.

  .venv/bin/python bench/jit_path.py [--models cnn gpt-tiny] [--policies auto wfbp] [--rounds 30]

A benchmark: it prints and writes numbers, it asserts nothing.
"""

from __future__ import annotations

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import get_model  # noqa: E402

AX = "data"
NDEV = 8
VARIANTS = ("plain_jit", "jit_hooked", "shard_map_hooked", "jit_pipelined", "shard_map_pipelined")


def build(model, schedule, cross, variant, mesh, params, batch):
  """(compiled step, its arguments, compile seconds, all-reduces in the compiled program)."""
  tx = optax.sgd(0.01, momentum=0.9)
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AX))
  p, b = jax.device_put(params, rep), jax.device_put(batch, split)
  if variant in ("plain_jit", "jit_hooked", "shard_map_hooked"):
    if variant == "plain_jit":
      grad_fn = jax.value_and_grad(model.loss_fn)
    elif variant == "jit_hooked":
      grad_fn = pj.hooked(model.loss_fn, schedule, axis_name=AX, mesh=mesh)
    else:
      per_device = pj.hooked(model.loss_fn, schedule, axis_name=AX)

      def grad_fn(p, b):
        def body(p, b):
          loss, g = per_device(p, b)
          return jax.lax.pmean(loss, AX), g
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX)), out_specs=(P(), P()))(p, b)

    def step(p, o, b):
      loss, g = grad_fn(p, b)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o, loss

    args = (p, jax.device_put(tx.init(params), rep), b)
    f = jax.jit(step)
  else:
    if variant == "jit_pipelined":
      pipe = pj.pipelined(model.loss_fn, tx, cross, axis_name=AX, mesh=mesh)
      f = jax.jit(pipe.step)
      state = pipe.init(p)
    else:
      pipe = pj.pipelined(model.loss_fn, tx, cross, axis_name=AX)
      specs = pipe.state_specs()

      def body(st, b):
        st, loss = pipe.step(st, b)
        return st, jax.lax.pmean(loss, AX)

      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AX)), out_specs=(specs, P())))
      st = pipe.init(params)
      state = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), st, pipe.state_specs(st))
    state, _ = f(state, b)  # a forward pending: the full step is what runs from here on
    args = (state, b)
  t0 = time.perf_counter()
  compiled = f.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  report = pj.audit(compiled, cross if "pipelined" in variant else schedule)
  ars = len({e.name for e in report.chunks + report.loops + report.foreign})
  return compiled, args, compile_s, ars, (report.ok if variant != "plain_jit" else None)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["cnn", "gpt-tiny"])
  ap.add_argument("--policies", nargs="+", default=["auto", "wfbp"])
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "jit_path.json"))
  a = ap.parse_args(argv)
  if a.rounds < 20:
    ap.error(f"--rounds={a.rounds}: need at least 20 for a median.")
  net = pj.NetworkModel.preset("10gbe", workers=NDEV)
  mesh = jax.make_mesh((NDEV,), (AX,), axis_types=(jax.sharding.AxisType.Auto,))
  rows = []
  for name in a.models:
    model = get_model(name)
    params = jax.device_get(model.init(jax.random.key(0)))
    batch = jax.device_get(model.make_batch(jax.random.key(1), a.batch))
    profile = pj.GradientProfile.from_params(params, forward_s=2e-3, backward_s=4e-3)
    built = {}
    for pol in a.policies:
      s, cross = pj.plan(profile, net, pol), pj.plan(profile, net, pol, cross_step=True)
      for v in VARIANTS:
        if v == "plain_jit" and pol != a.policies[0]:
          continue
        c, args, cs, ars, ok = build(model, s, cross, v, mesh, params, batch)
        for _ in range(2):  # warm up
          jax.block_until_ready(c(*args))
        chunks = (cross if "pipelined" in v else s).num_allreduces if v != "plain_jit" else 0
        built[(pol if v != "plain_jit" else "-", v)] = (c, args, cs, ars, ok, chunks)
        print(f"  compiled {name} {pol:6s} {v:20s} {cs:6.2f} s", file=sys.stderr, flush=True)
    times = {k: [] for k in built}
    for _ in range(a.rounds):
      for k, (c, args, *_rest) in built.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for (pol, v), (c, args, cs, ars, ok, chunks) in built.items():
      twin = (pol, v.replace("jit_", "shard_map_")) if v.startswith("jit_") else None
      rows.append({
          "model": name, "policy": pol, "variant": v, "chunks": chunks, "allreduces": ars,
          "median_ms": med[(pol, v)] * 1e3, "p10_ms": float(np.percentile(times[(pol, v)], 10)) * 1e3,
          "compile_s": cs, "vs_plain_jit": med[(pol, v)] / med[("-", "plain_jit")],
          "vs_shard_map_twin": med[(pol, v)] / med[twin] if twin else None,
          "audit_ok": ok,
      })
  print(f"{'model':9s} {'policy':7s} {'variant':20s} {'chunks':>6s} {'ARs':>4s} {'median ms':>10s} "
        f"{'p10 ms':>8s} {'vs plain jit':>12s} {'vs shard_map':>12s} {'compile s':>9s} audit")
  for r in rows:
    tw = f"{r['vs_shard_map_twin']:.3f}" if r["vs_shard_map_twin"] is not None else "-"
    print(f"{r['model']:9s} {r['policy']:7s} {r['variant']:20s} {r['chunks']:6d} {r['allreduces']:4d} "
          f"{r['median_ms']:10.2f} {r['p10_ms']:8.2f} {r['vs_plain_jit']:12.3f} {tw:>12s} "
          f"{r['compile_s']:9.2f} {'-' if r['audit_ok'] is None else 'ok' if r['audit_ok'] else 'MISMATCH'}")
  out = {"command": "python bench/jit_path.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "devices": NDEV, "platform": jax.devices()[0].platform, "jax": jax.__version__,
         "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
         "network": "10gbe", "workers": NDEV, "rounds": a.rounds, "batch": a.batch, "mesh_axes": "Auto",
         "profile": "GradientProfile.from_params(params, forward_s=2e-3, backward_s=4e-3)",
         "results": rows}
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
