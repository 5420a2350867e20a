"""Study: how close XLA settings alone (`prophet_jax.xla_options`) come to each policy's plan.

The user keeps their plain step (the gradient tree's `pmean` under `shard_map`, each leaf its own
all-reduce until XLA's combiner merges them) and sets only the options `xla_options(schedule, network,
target=T)` returns (combine threshold = the plan's largest unit, the latency-hiding scheduler, the
in-flight limit, early start). The step is compiled for 8 compile-only GPUs of T (`gpu_topology`;
nothing runs) and its gradient all-reduces are compared with the plan's units:

- `count error`: compiled gradient all-reduces minus the plan's (`Schedule.num_allreduces`);
- `exact bytes`: the share of gradient bytes in plan units that XLA formed exactly, i.e. a compiled
  all-reduce of exactly that unit's bytes (the loss's one float that the user's `pmean` adds to one of
  them allowed): a lower bound on the share of bytes placed in the same bucket as the plan, without
  reading which leaf went where (after `all-reduce-contiguous` a combined all-reduce is one flat buffer).

Rules compared: `max-unit` (the largest unit's bytes: what `xla_options` sets for most plans) and, for
the threshold-fill policies, `policy cap` (the cap the policy fills to: `bucket`'s `bucket_bytes`, `xla`'s
30 MiB: what `xla_options` sets for them, chosen from this study); `default` is XLA left alone (its own
combiner heuristic) for reference.

Models: the small trainable models (`prophet_jax.models`: their real backward, profile from their
parameter sizes) and the bundled traces' shapes (`--traces`; a synthetic step whose leaf gradients
come one after another in the trace's ready order, each leaf its own all-reduce, as a backward's do).
Plans for `--network` (default 10gbe) x 8 workers; lossless all-reduce policies (dear and fsdp plans
are reduce-scatters and all-gathers: a plain step has none to combine).

    JAX_PLATFORMS=cpu .venv/bin/python bench/xla_options.py                 # jax 0.10.2 (make test's venv)
    .ci/latest shell, then /opt/venv/bin/python bench/xla_options.py       # the newest jax (make test-latest's root)

Prints a table; merges this jax's rows into bench/results/xla_options.json (one entry per jaxlib
version; a run replaces the rows of the targets and models it measured); never asserts.

Why it imports private code: it counts the compiled program's all-reduces and their bytes with the
library's HLO reader (`_compiled._hlo`, `_hlo_collectives`) and compiles bundled steps with `_steps`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import prophet_jax as pj  # noqa: E402
from prophet_jax import models  # noqa: E402
from prophet_jax._compiled._gpu import quiet_cuda_stub  # noqa: E402

OUT = Path(__file__).parent / "results" / "xla_options.json"
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
SMALL = ("mlp", "cnn", "gpt-tiny", "resnet-small")
TRACES = ("resnet50-h100", "bert-base-h100")
XLA_GPU_DEFAULT_BYTES = 30 * 2**20


def gradient_allreduces(compiled) -> list[int]:
  """Bytes of every all-reduce of the compiled step (all f32 here; the lone loss scalar dropped)."""
  from prophet_jax._compiled._hlo import hlo_text, parse_hlo, shape_bytes
  from prophet_jax._compiled._hlo_collectives import allreduces

  sizes = [shape_bytes(op.shape) for op in allreduces(parse_hlo(hlo_text(compiled)))]
  return [b for b in sizes if b > 4]


def compare(planned: tuple[int, ...], compiled: list[int]) -> dict:
  """Count error and the share of bytes in units formed exactly (a compiled all-reduce of the unit's
  bytes, or of one more float: the loss)."""
  pool = Counter(compiled)
  exact = 0
  for b in sorted(planned, reverse=True):
    for c in (b, b + 4):
      if pool[c]:
        pool[c] -= 1
        exact += b
        break
  total = sum(planned)
  return {"planned": len(planned), "compiled": len(compiled), "count_error": len(compiled) - len(planned),
          "exact_bytes": exact / total if total else 1.0}


def synthetic_step(profile, topo):
  """The trace's leaves as parameters; each leaf's 'gradient' is computed after the one ready before it
  (a backward's chain), then one psum per leaf (the plain step's all-reduces). Lowered, not run."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  rows = profile.rows
  order = list(profile.ready_order())
  mesh = topo.mesh("data")

  def step(params, s):
    grads = [None] * len(rows)
    carry = s[0]
    for r in order:
      g = params[r] * carry
      grads[r] = g
      carry = carry + g.reshape(-1)[0]
    return [jax.lax.pmean(g, "data") for g in grads]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  params = [jax.ShapeDtypeStruct(tuple(r.shape), jnp.dtype(r.dtype)) for r in rows]
  return f.lower(topo.abstract(params, P(), mesh=mesh),
                 topo.abstract(jax.ShapeDtypeStruct((8,), jnp.float32), P("data"), mesh=mesh))


def rules(schedule, options: dict) -> list[tuple[str, dict]]:
  """The thresholds compared: the largest unit's bytes ('max-unit') and, for a threshold-fill plan, the
  cap it filled to ('policy cap'; what `xla_options` sets for those plans), the rest of the options
  as `xla_options` returned them."""
  key = "xla_gpu_all_reduce_combine_threshold_bytes"
  if key not in options:
    return [("xla_options", options)]
  out = [("max-unit", {**options, key: max(schedule.allreduce_nbytes())})]
  cap = None
  if schedule.policy == "bucket":
    cap = dict(schedule.options).get("bucket_bytes")
  elif schedule.policy == "xla" and schedule.num_allreduces > 1:
    cap = XLA_GPU_DEFAULT_BYTES
  if cap and cap != out[0][1][key]:
    out.append(("policy cap", {**options, key: int(cap)}))
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--targets", nargs="+", default=["h100", "a100"])
  p.add_argument("--models", nargs="+", default=list(SMALL))
  p.add_argument("--traces", nargs="*", default=list(TRACES))
  p.add_argument("--policies", nargs="+", default=list(POLICIES))
  p.add_argument("--network", default="10gbe")
  a = p.parse_args()
  t0 = time.time()
  import jax
  import jaxlib

  from prophet_jax._steps import compile_step

  net = pj.NetworkModel.preset(a.network, workers=8)
  rows = []
  for target in a.targets:
    with quiet_cuda_stub():
      topo = pj.gpu_topology(target, devices=8)
    for name in [*a.models, *a.traces]:
      trace = name in models.TRACES
      if trace:
        profile = models.load_trace(name)
        lowered = synthetic_step(profile, topo)
        compile_fn = lambda opts, lowered=lowered: lowered.compile(compiler_options=opts) if opts \
            else lowered.compile()  # noqa: E731
      else:
        model = models.get_model(name)
        profile = pj.GradientProfile.from_params(model.abstract_params(), forward_s=1e-3, backward_s=2e-3,
                                                 model=name)
        compile_fn = lambda opts, model=model: compile_step(model, None, "pmean", topo,  # noqa: E731
                                                             compiler_options=opts or None)[0]
      t = time.perf_counter()
      base = gradient_allreduces(compile_fn({}))
      rows.append({"target": target, "model": name, "policy": "-", "rule": "default", "threshold_bytes": None,
                   "planned": None, "compiled": len(base), "count_error": None, "exact_bytes": None,
                   "compile_s": time.perf_counter() - t, "total_bytes": profile.total_nbytes})
      for policy in a.policies:
        schedule = pj.plan(profile, net, policy)
        options = pj.xla_options(schedule, net, target=topo)
        planned = schedule.allreduce_nbytes()
        for rule, opts in rules(schedule, options):
          t = time.perf_counter()
          got = gradient_allreduces(compile_fn(opts))
          r = {"target": target, "model": name, "policy": policy, "rule": rule,
               "threshold_bytes": opts.get("xla_gpu_all_reduce_combine_threshold_bytes"),
               **compare(planned, got), "compile_s": time.perf_counter() - t,
               "total_bytes": profile.total_nbytes, "options": opts}
          rows.append(r)
          print(f"{target:5s} {name:15s} {policy:9s} {rule:10s} units {r['planned']:4d} -> {r['compiled']:4d} "
                f"exact bytes {r['exact_bytes']:6.1%}  ({r['compile_s']:.1f} s)", flush=True)
  print(f"\n{'target':6s} {'model':15s} {'policy':9s} {'rule':10s} {'threshold':>10s} {'plan':>5s} "
        f"{'xla':>5s} {'err':>5s} {'exact bytes':>11s}")
  for r in rows:
    thr = "-" if r["threshold_bytes"] is None else f"{r['threshold_bytes']:,}"
    plan_n = "-" if r["planned"] is None else str(r["planned"])
    err = "-" if r["count_error"] is None else f"{r['count_error']:+d}"
    ex = "-" if r["exact_bytes"] is None else f"{r['exact_bytes']:.1%}"
    print(f"{r['target']:6s} {r['model']:15s} {r['policy']:9s} {r['rule']:10s} {thr:>10s} {plan_n:>5s} "
          f"{r['compiled']:5d} {err:>5s} {ex:>11s}")
  results = json.loads(OUT.read_text()) if OUT.exists() else {}
  results.setdefault("what", "plain pmean step compiled for 8 compile-only GPUs with xla_options(plan); "
                     "no GPU ran")
  results.setdefault("runs", {})
  old = results["runs"].get(jaxlib.__version__, {}).get("rows", [])
  done = {(r["target"], r["model"]) for r in rows}    # a partial run replaces only its (target, model) rows
  rows = [r for r in old if (r["target"], r["model"]) not in done] + rows
  results["runs"][jaxlib.__version__] = {"jax": jax.__version__, "network": net.to_dict(), "rows": rows,
                                         "seconds": time.time() - t0}
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_text(json.dumps(results, indent=1))
  print(f"written to {OUT} ({time.time() - t0:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
