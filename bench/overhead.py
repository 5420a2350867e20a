"""Overhead of the rewrite: scheduled / hooked per policy vs plain pmean and vs a hand-written chain.

8 host devices (CPU). For each model (cnn, gpt-tiny) and policy, a schedule is planned for the '10gbe'
preset with 8 workers (so it has several chunks), and four jax.pmap train steps (grad, all-reduce,
sgd with momentum) are compiled and timed:
  pmean      the plain step: jax.lax.pmean of the gradient tree (XLA merges it into one all-reduce);
  hand       hand-written chained psums of the same chunks (concatenate, tie, psum, split), no library;
  scheduled  prophet_jax.scheduled(optax.sgd(...), schedule, axis_name=...);
  hooked     prophet_jax.hooked(loss_fn, schedule, axis_name=...) + optax.sgd.
Steps are timed round-robin (one step of every variant per round, so machine load drifts hit them
alike), median over >= 20 rounds; compile time is lower + compile. Writes bench/results/overhead.json.

  .venv/bin/python bench/overhead.py [--models cnn gpt-tiny] [--rounds 30] [--out bench/results/overhead.json]

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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import get_model  # noqa: E402

AX = "data"
NDEV = 8
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")


def hand_chain(grads, schedule, n):
  """The same chunks, written by hand: no path matching, no checks, no named scopes."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
  paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
  flat = [x for _, x in leaves]
  where = [paths.index(p) for p, _, _ in schedule.rows]
  pieces = {}
  prev = None
  for chunk in schedule.chunks:
    buf = jnp.concatenate([flat[where[r]].reshape(-1)[a:b] for r, a, b in chunk.slices])
    if prev is not None:
      p0 = prev[0]
      buf = buf.at[0].add(jnp.where(jnp.isfinite(p0), p0 * 0, 0).astype(buf.dtype))
    red = jax.lax.psum(buf, AX) / n
    prev = red
    off = 0
    for r, a, b in chunk.slices:
      pieces.setdefault(r, []).append((a, red[off:off + b - a]))
      off += b - a
  for r, segs in pieces.items():
    i = where[r]
    flat[i] = jnp.concatenate([s for _, s in sorted(segs, key=lambda t: t[0])]).reshape(flat[i].shape)
  return jax.tree_util.tree_unflatten(treedef, flat)


def build(model, schedule, variant, params, batch):
  tx = optax.sgd(0.01, momentum=0.9)
  if variant == "scheduled":
    tx = pj.scheduled(tx, schedule, axis_name=AX)
  if variant == "hooked":
    grad_fn = pj.hooked(model.loss_fn, schedule, axis_name=AX)
  else:
    grad_fn = jax.value_and_grad(model.loss_fn)

  def step(p, o, b):
    loss, g = grad_fn(p, b)
    if variant == "pmean":
      g = jax.lax.pmean(g, AX)
    elif variant == "hand":
      g = hand_chain(g, schedule, NDEV)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (NDEV, *jnp.shape(a))), t)
  args = (rep(params), rep(tx.init(params)),
          jax.tree.map(lambda a: a.reshape(NDEV, -1, *a.shape[1:]), batch))
  t0 = time.perf_counter()
  compiled = jax.pmap(step, axis_name=AX, donate_argnums=()).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  report = pj.audit(compiled, schedule)
  return compiled, args, compile_s, report


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["cnn", "gpt-tiny"])
  ap.add_argument("--policies", nargs="+", default=list(POLICIES))
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "overhead.json"))
  a = ap.parse_args(argv)
  if a.rounds < 20:
    ap.error(f"--rounds={a.rounds}: need at least 20 for a median.")
  net = pj.NetworkModel.preset("10gbe", workers=NDEV)
  rows = []
  for name in a.models:
    model = get_model(name)
    params = model.init(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1), a.batch)
    profile = pj.GradientProfile.from_params(params, forward_s=2e-3, backward_s=4e-3)
    variants = [("pmean", None, "pmean")]
    schedules = {}
    for pol in a.policies:
      schedules[pol] = pj.plan(profile, net, pol)
      variants += [(pol, schedules[pol], v) for v in ("hand", "scheduled", "hooked")]
    built = {}
    for pol, s, v in variants:
      c, args, cs, rep = build(model, s or schedules[a.policies[0]], v, params, batch)
      for _ in range(2):  # warm up
        jax.block_until_ready(c(*args))
      built[(pol, v)] = (c, args, cs, rep)
      print(f"  compiled {name} {pol:9s} {v:9s} {cs:6.2f} s", file=sys.stderr, flush=True)
    times = {k: [] for k in built}
    for _ in range(a.rounds):
      for k, (c, args, _, _) in built.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for (pol, v), (c, args, cs, rep) in built.items():
      s = schedules.get(pol)
      rows.append({
          "model": name, "policy": pol, "variant": v, "chunks": s.num_allreduces if s else 1,
          "median_ms": med[(pol, v)] * 1e3, "p10_ms": float(np.percentile(times[(pol, v)], 10)) * 1e3,
          "compile_s": cs,
          "vs_hand": med[(pol, v)] / med[(pol, "hand")] if (pol, "hand") in med else None,
          "vs_pmean": med[(pol, v)] / med[("pmean", "pmean")],
          "vs_hand_p10": (float(np.percentile(times[(pol, v)], 10))
                          / float(np.percentile(times[(pol, "hand")], 10))) if (pol, "hand") in med else None,
          # all-reduces in the compiled program (the loss is not reduced here): pmean is merged into 1
          "allreduces": len({e.name for e in rep.chunks + rep.loops + rep.foreign}),
          "audit_ok": rep.ok if v in ("scheduled", "hooked") else None,
      })
  print(f"{'model':9s} {'policy':9s} {'variant':9s} {'chunks':>6s} {'ARs':>4s} {'median ms':>10s} "
        f"{'p10 ms':>8s} {'vs hand':>8s} {'(p10)':>6s} {'vs pmean':>9s} {'compile s':>9s} audit")
  for r in rows:
    vh = f"{r['vs_hand']:.3f}" if r["vs_hand"] is not None else "-"
    vp = f"{r['vs_hand_p10']:.3f}" if r["vs_hand_p10"] is not None else "-"
    print(f"{r['model']:9s} {r['policy']:9s} {r['variant']:9s} {r['chunks']:6d} {r['allreduces']:4d} "
          f"{r['median_ms']:10.2f} {r['p10_ms']:8.2f} {vh:>8s} {vp:>6s} {r['vs_pmean']:9.3f} "
          f"{r['compile_s']:9.2f} "
          f"{'-' if r['audit_ok'] is None else 'ok' if r['audit_ok'] else 'MISMATCH'}")
  out = {"command": "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "devices": NDEV, "platform": jax.devices()[0].platform, "jax": jax.__version__,
         "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
         "network": "10gbe", "workers": NDEV, "rounds": a.rounds, "batch": a.batch,
         "profile": "GradientProfile.from_params(params, forward_s=2e-3, backward_s=4e-3)",
         "results": rows}
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
