"""Study: does the one-in-flight tie chain cost overlap on XLA:GPU, against XLA's own ordering means?

Measured on the compiled schedule (8 compile-only H100s, `prophet_jax.gpu_topology`; no GPU runs), for
the scheduled step of `cnn` (wfbp: 6 chunks; priority: 19 split-leaf chunks) and `gpt-tiny` (wfbp: 19
chunks), with the same chunks issued in different ways: `tie` is the library's own step (`prophet_jax.
lower_step(..., "scheduled", ...)`, i.e. `scheduled(tx)`, the program a user gets); every other variant
is the same step with this script's own chunk loop in place of `scheduled`'s all-reduce (the same
gather, psum, divide and scatter per chunk, under the same `prophet/chunk<k>` scopes, so `audit` reads it
the same way):

- `tie`: the library's rewrite: chunk k+1's buffer adds an exact zero computed from chunk k's result
  (`_collectives.tie`), so chunk k+1 starts after chunk k is done: one in flight, in order.
- `none`: independent psums, each under its chunk scope (what XLA would do left alone).
- `group`: independent psums, each in its own scheduling group (`jax.experimental.xla_metadata.
  set_xla_metadata(_scheduling_group_id=k)`, XLA's annotation for ops the scheduler keeps together).
- `barrier`: chunk k+1's buffer passed through `lax.optimization_barrier` together with chunk k's result
  (the tie as a barrier; docs/facts.md once guessed barriers may suffice on GPUs).
- `barrier-in`: the barrier on chunk k's *input* buffer (orders the issue without waiting for the done).
- `none, no combiner`: independent psums compiled with `xla_gpu_all_reduce_combine_threshold_bytes=0`
  (a compile option, not available in a user's own jit): XLA's own order and overlap.
- `... limit 2`: with `xla_gpu_experimental_parallel_collective_overlap_limit=2` (default 1): may XLA keep
  two all-reduces in flight, and does the tie then cost overlap?

Control dependencies cannot be expressed from JAX. Also the users' flags on the `tie` rewrite (each alone):
the combiner threshold at 1 GiB, the latency hiding scheduler off, pipelined all-reduce on, async
all-reduce off: whether the compiled schedule differs from the default's.

Columns: found/planned chunk all-reduces, the audit's verdict, in order, how many all-reduce
instructions carry the chunks (1 = merged by the combiner), most in flight, exposed chunks, FLOPs inside
the windows (each op once), backward matmuls outside every window after the first start.

    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_ordering.py       (~3 min on 2 busy cores)

Prints a table; writes bench/results/gpu_ordering.json; never asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.xla_metadata import set_xla_metadata  # noqa: E402

import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import get_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "gpu_ordering.json"
NET = pj.NetworkModel.preset("10gbe", workers=8)
CASES = (("cnn", "wfbp", {}), ("cnn", "priority", {"partition_bytes": 8192, "credit_bytes": 8192}),
         ("gpt-tiny", "wfbp", {}))
NO_COMBINE = {"xla_gpu_all_reduce_combine_threshold_bytes": 0}
LIMIT2 = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
VARIANTS = (("tie", "tie", None), ("none", "none", None), ("group", "group", None),
            ("barrier", "barrier", None), ("barrier-in", "barrier-in", None),
            ("none, no combiner", "none", NO_COMBINE), ("tie, limit 2", "tie", LIMIT2),
            ("none, no combiner, limit 2", "none", {**NO_COMBINE, **LIMIT2}))
FLAGS = (("combine 1 GiB", {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30}),
         ("LHS off", {"xla_gpu_enable_latency_hiding_scheduler": False}),
         ("pipelined all-reduce", {"xla_gpu_enable_pipelined_all_reduce": True}),
         ("async all-reduce off", {"xla_gpu_disable_async_collectives": "ALLREDUCE"}))
BATCH = 16
AXIS = "data"


def path_of(keypath) -> str:
  return jax.tree_util.keystr(keypath, simple=True, separator="/")


def variant_allreduce(grads, schedule, how):
  """The schedule's chunks, each gathered, psum'd and averaged, issued the way `how` says (no tie)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
  index = {path_of(kp): i for i, (kp, _) in enumerate(leaves)}
  flat = [x for _, x in leaves]
  row_leaf = [index[path] for path, _, _ in schedule.rows]
  n = jax.lax.axis_size(AXIS)
  pieces: dict[int, list] = {}
  prev = prev_buf = None
  for k, chunk in enumerate(schedule.chunks):
    parts = [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in chunk.slices]
    group = set_xla_metadata(_scheduling_group_id=str(k)) if how == "group" else contextlib.nullcontext()
    with jax.named_scope(f"prophet/chunk{k}"), group:  # the scope `audit` reads (docs/design.md)
      buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      if how == "barrier" and prev is not None:
        buf, _ = jax.lax.optimization_barrier((buf, prev))
      elif how == "barrier-in" and prev_buf is not None:
        buf, _ = jax.lax.optimization_barrier((buf, prev_buf))
      prev_buf = buf
      red = jax.lax.psum(buf, AXIS) / jnp.asarray(n, buf.dtype)
    prev = red
    off = 0
    for r, a, b in chunk.slices:
      pieces.setdefault(r, []).append((a, red[off:off + (b - a)]))
      off += b - a
  for r, segs in pieces.items():
    segs = [x for _, x in sorted(segs, key=lambda t: t[0])]
    full = segs[0] if len(segs) == 1 else jnp.concatenate(segs)
    flat[row_leaf[r]] = full.reshape(np.shape(flat[row_leaf[r]]))
  return jax.tree_util.tree_unflatten(treedef, flat)


def lower_variant(model, schedule, topo, how):
  """The `scheduled` step of `pj.lower_step`, with `variant_allreduce` in place of `scheduled(tx)`."""
  if how == "tie":
    return pj.lower_step(model, schedule, "scheduled", topo, batch_size=BATCH, axis_name=AXIS)
  tx = optax.sgd(0.1, momentum=0.9)
  mesh = topo.mesh(AXIS)
  params = model.abstract_params()
  batch = jax.eval_shape(lambda k: model.make_batch(k, BATCH), jax.random.key(0))

  def body(p, o, b):
    loss, g = jax.value_and_grad(model.loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), b)
    updates, o = tx.update(variant_allreduce(g, schedule, how), o, p)
    return optax.apply_updates(p, updates), o, jax.lax.pmean(loss, AXIS)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P(), P())))
  return step.lower(topo.abstract(params, P(), mesh=mesh),
                    topo.abstract(jax.eval_shape(tx.init, params), P(), mesh=mesh),
                    topo.abstract(batch, P(AXIS), mesh=mesh))


def measure(model, schedule, topo, how, options):
  lowered = lower_variant(model, schedule, topo, how)
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
  compile_s = time.perf_counter() - t0
  r = pj.audit(compiled, schedule)
  order = list(r.order)
  return {"found": r.chunk_allreduces, "planned": schedule.num_allreduces, "ok": r.ok,
          "in_order": order == sorted(order) and len(order) == schedule.num_allreduces,
          "instructions": len({e.name for e in r.chunks}), "max_in_flight": r.max_in_flight,
          "exposed": len(r.exposed), "overlap_mflop": r.overlapped_flops / 1e6,
          "backward_outside": r.backward_outside_windows, "compile_s": compile_s,
          "problems": list(r.problems[:2]), "warnings": list(r.warnings),
          "schedule_text": re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())}


def main() -> int:
  topo = pj.gpu_topology("h100", devices=8)
  rows, t0 = [], time.time()
  for model_name, policy, options in CASES:
    m = get_model(model_name)
    profile = pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3)
    s = pj.plan(profile, NET, policy, **options)
    default_text = None
    for label, how, copts in VARIANTS + tuple((f"tie + {n}", "tie", o) for n, o in FLAGS):
      row = {"model": model_name, "policy": policy, "variant": label, **measure(m, s, topo, how, copts)}
      text = row.pop("schedule_text")
      if label == "tie":
        default_text = text
      row["same_schedule_as_tie"] = text == default_text
      rows.append(row)
      print(f"  {model_name} {policy} {label} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
  print(f"{'model':8s} {'policy':8s} {'variant':28s} {'found':>9s} {'ok':>3s} {'order':>5s} {'instr':>5s} "
        f"{'inflt':>5s} {'exposed':>7s} {'MFLOP ovl':>9s} {'bwd out':>7s} {'=tie':>4s}")
  for r in rows:
    print(f"{r['model']:8s} {r['policy']:8s} {r['variant']:28s} {r['found']:4d}/{r['planned']:<4d} "
          f"{'yes' if r['ok'] else 'NO':>3s} {'yes' if r['in_order'] else 'NO':>5s} {r['instructions']:5d} "
          f"{r['max_in_flight']:5d} {r['exposed']:7d} {r['overlap_mflop']:9.2f} {r['backward_outside']:7d} "
          f"{'yes' if r['same_schedule_as_tie'] else 'no':>4s}")
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_text(json.dumps({"what": "compiled XLA:GPU schedules (8 compile-only H100s), no GPU ran",
                             "jax": jax.__version__, "network": NET.to_dict(), "rows": rows}, indent=1))
  print(f"written to {OUT} ({time.time() - t0:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
