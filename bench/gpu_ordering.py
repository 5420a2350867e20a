"""Study: the tie (`_collectives.tie`) against JAX's own public means of ordering or grouping collectives.

Measured on the compiled schedule (8 compile-only H100s, `prophet_jax.gpu_topology`; no GPU runs) of the
scheduled step of `cnn` (wfbp: 6 chunks; priority: 19 split-leaf chunks) and `gpt-tiny` (wfbp: 19
chunks). Each mechanism issues the same chunks (gather the slices, one `psum` per chunk under its
`prophet/chunk<k>` scope, divide, scatter back) from a step written out here, so that every row is the
same program but for the mechanism:

- `tie`: chunk k+1's buffer adds an exact zero computed from chunk k's result (`_collectives.tie`, what
  the library does): chunk k+1 starts after chunk k is done; `tie (library)` is the library's own
  `scheduled` step (`prophet_jax.lower_step(..., "scheduled", ...)`), for reference;
- `none`: independent psums (what XLA does left alone);
- `metadata group`: each psum under `set_xla_metadata(_scheduling_group_id=k)` (XLA's scheduling-group
  annotation as an attribute);
- `scheduling_group`: each chunk's psum wrapped in `jax.experimental.scheduling_groups.scheduling_group(
  'prophet_chunk<k>')` (a call tagged `scheduling_group`; public in 0.10 and 0.12);
- `program_order`: the chunks' psums inside `jax.experimental.overlap.program_order(enforce=True)` (jax
  >= 0.11: consecutive equations chained by optimization barriers);
- `control_deps`: independent psums and `jax.experimental.control_deps.schedule` over their results
  (jax 0.10 only; an XLA custom call);
- `barrier`: chunk k+1's buffer passed through `lax.optimization_barrier` with chunk k's result.
Each with XLA's default flags and, where the jaxlib has XLA:GPU collective kernels (jaxlib 0.12: an
all-reduce of up to a few MiB runs as a one-shot Triton kernel, `fusion-start`), also on the NCCL path
(`xla_gpu_experimental_use_collective_kernels` empty).

Columns: found/planned chunk all-reduces, the audit's verdict, in order, how many all-reduce instructions
carry the chunks (1 = merged by the combiner), the form XLA wrote them in, most in flight, exposed chunks,
MFLOP of matmul/convolution work inside the windows, backward matmuls outside every window after the first
start, and the compile time (median of --reps compiles for cnn wfbp, one compile elsewhere; seconds on a
busy 2-core machine: compare within one run).

Why it imports private code: it studies the library's ordering mechanism itself (`_collectives.tie` and
`chunk_scope`, in a step written out here beside the alternatives) and asks `_gpu.xla_option_accepted`
which XLA:GPU options this jaxlib takes; neither is a public name.

    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_ordering.py                # jax 0.10.2 (make test's venv)
    .ci/latest shell, then /opt/venv/bin/python bench/gpu_ordering.py      # the newest jax (make test-latest's root)

Prints a table; merges this jax's rows into bench/results/gpu_ordering.json (one entry per jax version);
never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax._compiled import _gpu
from prophet_jax._rewrite._collectives import chunk_scope, tie  # noqa: E402
from prophet_jax._values._tree import path_str  # noqa: E402
from prophet_jax.models import get_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "gpu_ordering.json"
NET = pj.NetworkModel.preset("10gbe", workers=8)
AX = "data"
BATCH = 16
CASES = (("cnn", "wfbp", {}), ("cnn", "priority", {"partition_bytes": 8192, "credit_bytes": 8192}),
         ("gpt-tiny", "wfbp", {}))
MECHANISMS = ("tie (library)", "tie", "none", "metadata group", "scheduling_group", "program_order",
              "control_deps", "barrier")


def _optional(module: str, name: str):
  try:
    return getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError):
    return None


set_xla_metadata = _optional("jax.experimental.xla_metadata", "set_xla_metadata")
scheduling_group = _optional("jax.experimental.scheduling_groups", "scheduling_group")
program_order = _optional("jax.experimental.overlap", "program_order")
control_schedule = _optional("jax.experimental.control_deps", "schedule")


def issue(bufs: list, how: str, n: int) -> list:
  """The chunks' mean all-reduces, issued by mechanism `how`."""
  def reduce(k, b):
    with jax.named_scope(chunk_scope(k)):
      return jax.lax.psum(b, AX) / n

  if how == "tie":
    out, prev = [], None
    for k, b in enumerate(bufs):
      prev = reduce(k, tie(b, prev))
      out.append(prev)
    return out
  if how == "barrier":
    out, prev = [], None
    for k, b in enumerate(bufs):
      if prev is not None:
        b, _ = jax.lax.optimization_barrier((b, prev))
      prev = reduce(k, b)
      out.append(prev)
    return out
  if how == "metadata group":
    out = []
    for k, b in enumerate(bufs):
      with set_xla_metadata(_scheduling_group_id=str(k)):
        out.append(reduce(k, b))
    return out
  if how == "scheduling_group":
    return [scheduling_group(f"prophet_chunk{k}")(lambda x, k=k: reduce(k, x))(b) for k, b in enumerate(bufs)]
  if how == "program_order":
    return list(program_order(lambda *bs: [reduce(k, b) for k, b in enumerate(bs)], enforce=True)(*bufs))
  out = [reduce(k, b) for k, b in enumerate(bufs)]
  if how == "control_deps":
    control_schedule(out)
  return out


def allreduce(grads, s: pj.Schedule, how: str):
  """The schedule's chunks, gathered, issued by `how`, scattered back (mean over the axis)."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  index = {path_str(p): i for i, (p, _) in enumerate(leaves_with_path)}
  flat = [x for _, x in leaves_with_path]
  row_leaf = [index[path] for path, _, _ in s.rows]
  bufs = []
  for c in s.chunks:
    parts = [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in c.slices]
    bufs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
  reds = issue(bufs, how, jax.lax.axis_size(AX))
  pieces: dict[int, list] = {}
  for c, red in zip(s.chunks, reds):
    off = 0
    for r, a, b in c.slices:
      pieces.setdefault(r, []).append((a, red[off:off + b - a]))
      off += b - a
  for r, segs in pieces.items():
    segs = [x for _, x in sorted(segs, key=lambda t: t[0])]
    full = segs[0] if len(segs) == 1 else jnp.concatenate(segs)
    flat[row_leaf[r]] = full.reshape(np.shape(flat[row_leaf[r]]))
  return jax.tree_util.tree_unflatten(treedef, flat)


def lower(model, s: pj.Schedule, topo, how: str):
  if how == "tie (library)":
    return pj.lower_step(model, s, "scheduled", topo, batch_size=BATCH)
  tx = optax.sgd(0.1, momentum=0.9)
  mesh = topo.mesh(AX)

  def body(p, o, b):
    loss, g = jax.value_and_grad(model.loss_fn)(jax.lax.pcast(p, AX, to="varying"), b)
    updates, o = tx.update(allreduce(g, s, how), o, p)
    return optax.apply_updates(p, updates), o, jax.lax.pmean(loss, AX)

  params = model.abstract_params()
  batch = jax.eval_shape(lambda k: model.make_batch(k, BATCH), jax.random.key(0))
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=(P(), P(), P())))
  return step.lower(topo.abstract(params, P(), mesh=mesh),
                    topo.abstract(jax.eval_shape(tx.init, params), P(), mesh=mesh),
                    topo.abstract(batch, P(AX), mesh=mesh))


def available(how: str) -> bool:
  need = {"metadata group": set_xla_metadata, "scheduling_group": scheduling_group,
          "program_order": program_order, "control_deps": control_schedule}
  return how not in need or need[how] is not None


def measure(model, s, topo, how, options, reps):
  try:
    times = []
    for _ in range(reps):  # lowered anew each time: jax caches the executable of one Lowered
      lowered = lower(model, s, topo, how)
      t = time.perf_counter()
      compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
      times.append(time.perf_counter() - t)
  except Exception as e:  # noqa: BLE001 - record what XLA or jax said
    return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
  r = pj.audit(compiled, s)
  order = list(r.order)
  return {"found": r.chunk_allreduces, "planned": s.num_allreduces, "ok": r.ok,
          "in_order": order == sorted(order) and len(order) == s.num_allreduces,
          "instructions": len({e.name for e in r.chunks}), "forms": r.forms,
          "max_in_flight": r.max_in_flight, "exposed": len(r.exposed),
          "overlap_mflop": r.overlapped_flops / 1e6, "backward_outside": r.backward_outside_windows,
          "compile_s": statistics.median(times), "compile_s_all": times, "problems": list(r.problems[:2]),
          "warnings": list(r.warnings)}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=3, help="compiles per row of cnn wfbp (median compile time)")
  ap.add_argument("--cases", nargs="*", default=None, help="e.g. cnn/wfbp gpt-tiny/wfbp")
  a = ap.parse_args()
  topo = pj.gpu_topology("h100", devices=8)
  nccl = {"xla_gpu_experimental_use_collective_kernels": ""}
  flag_sets = [("default", None)]
  if _gpu.xla_option_accepted(*next(iter(nccl.items()))):
    flag_sets.append(("NCCL path", nccl))
  rows, t0 = [], time.time()
  for model_name, policy, options in CASES:
    if a.cases and f"{model_name}/{policy}" not in a.cases:
      continue
    m = get_model(model_name)
    profile = pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3)
    s = pj.plan(profile, NET, policy, **options)
    reps = a.reps if (model_name, policy) == ("cnn", "wfbp") else 1
    for how in MECHANISMS:
      if not available(how):
        rows.append({"model": model_name, "policy": policy, "mechanism": how, "flags": "default",
                     "error": f"not in jax {jax.__version__}"})
        continue
      for flags, copts in flag_sets:
        row = {"model": model_name, "policy": policy, "mechanism": how, "flags": flags,
               **measure(m, s, topo, how, copts, reps)}
        rows.append(row)
        print(f"  {model_name} {policy} {how} [{flags}] ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
  print(f"jax {jax.__version__}, 8 compile-only H100s")
  print(f"{'model':8s} {'policy':8s} {'mechanism':16s} {'flags':9s} {'found':>7s} {'ok':>3s} {'order':>5s} "
        f"{'instr':>5s} {'form':12s} {'inflt':>5s} {'exp':>4s} {'MFLOP':>6s} {'bwd':>4s} {'compile s':>9s}")
  for r in rows:
    head = f"{r['model']:8s} {r['policy']:8s} {r['mechanism']:16s} {r['flags']:9s}"
    if "error" in r:
      print(f"{head} {r['error'][:90]}")
      continue
    form = "+".join(sorted(f.replace("all-reduce-start", "ar-start").replace("all-reduce", "ar")
                           for f in r["forms"])) or "-"
    print(f"{head} {r['found']:3d}/{r['planned']:<3d} {'yes' if r['ok'] else 'NO':>3s} "
          f"{'yes' if r['in_order'] else 'NO':>5s} {r['instructions']:5d} {form:12s} {r['max_in_flight']:5d} "
          f"{r['exposed']:4d} {r['overlap_mflop']:6.2f} {r['backward_outside']:4d} {r['compile_s']:9.2f}")
  ties = {(r["model"], r["policy"], r["flags"]): r["compile_s"] for r in rows
          if r["mechanism"] == "tie" and "compile_s" in r}
  print("compile time against the tie (same case and flags):")
  for r in rows:
    key = (r["model"], r["policy"], r["flags"])
    if "compile_s" in r and key in ties and r["mechanism"] != "tie":
      print(f"  {r['model']} {r['policy']} [{r['flags']}] {r['mechanism']}: {r['compile_s'] / ties[key]:.2f}x")
  results = json.loads(OUT.read_text()) if OUT.exists() else {}
  if "runs" not in results:  # the file of the older study (one jax, other variants): start anew
    results = {"what": "compiled XLA:GPU schedules (8 compile-only H100s), no GPU ran", "runs": {}}
  if a.cases and jax.__version__ in results["runs"]:  # a partial run replaces only its cases' rows
    done = {(r["model"], r["policy"]) for r in rows}
    rows = [r for r in results["runs"][jax.__version__]["rows"] if (r["model"], r["policy"]) not in done] + rows
  results["runs"][jax.__version__] = {"network": NET.to_dict(), "reps": a.reps, "rows": rows,
                                      "seconds": time.time() - t0}
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_text(json.dumps(results, indent=1))
  print(f"written to {OUT} ({time.time() - t0:.0f} s)")
  return 0


if __name__ == "__main__":
  with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
