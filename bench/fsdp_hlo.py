"""What XLA's partitioner makes of an FSDP step, read from its compiled program on compile-only H100s: the
all-gathers and reduce-scatters (count, sizes, order) of a Llama-style decoder whose 2-D weights are
sharded over the data axis (`P("data", None)`), under default flags and under the flag set large-model
users set (`LARGE_MODEL`), with and without per-layer remat, and the compiled `memory_analysis()`. It
checks the assumptions of the partitioner schedule that bench/fsdp.py MODELS (one all-gather per weight,
neighbours combined, gathered again in backward or not), and reads each program into a Schedule
(`read_schedule`) that the simulator runs beside the `fsdp` plan held to its peak, on one profile and
network model (all simulated; programs compiled for `--devices`; for the small model's programs the
rows for 64 and 256 GPUs also reuse a program's grouping).

Compile-only (FACTS.md, "XLA:GPU without a GPU"): run with JAX_PLATFORMS=cpu. Prints a table and writes
bench/results/fsdp_hlo.json. Never asserts. By default a small model (4 layers, d=1024); the Llama 3.2 1B
and Llama 3 8B shapes compile too (each program in seconds to a minute on 2 cores; --out elsewhere):

    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py --layers 16 --d 2048 --ff 8192 --vocab 128256 \
        --name llama-1b --out bench/results/fsdp_hlo_1b.json
    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py --layers 32 --d 4096 --ff 14336 --vocab 128256 \
        --name llama-8b --out bench/results/fsdp_hlo_8b.json

On 1,024 GPUs (`--devices 1024 --remat no`) the vocabulary must divide by 1,024: `--vocab 131072`
(bench/results/fsdp_hlo_1b_1024.json, fsdp_hlo_8b_1024.json).

    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py [--layers 4] [--devices 8 64] [--flags both]

`--scanned`: the blocks stacked and scanned on both sides, and the library's own FSDP step (`hooked` with an
FSDP plan, keep-everything and least-memory plans) compiled beside the partitioner's programs; each library
program audited (`prophet_jax.audit`: its gathers, re-gathers, reduce-scatters and windows) and read back
from the audit (`read_library`), each partitioner program read by `read_scanned`; all simulated on one
per-layer profile and network (docs/fsdp.md, "The library's step beside the partitioner's"):

    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py --scanned --layers 16 --d 2048 --ff 8192 \
        --vocab 128256 --name llama-1b --devices 8 64 --out bench/results/fsdp_hlo_scanned_1b.json \
        --timeline bench/results/fsdp_hlo_scanned_1b

`--hsdp`: the same scanned shapes on a ("replica", "data") mesh of devices/8 replicas x 8 shards (a node's
8 GPUs share a shard group): the partitioner's step (params over "data" only) beside the library's
(`hooked(..., axis_name=("replica", "data"), mesh=)`, keep-all and least-memory plans), default flags; each
program's collectives per step read by link from their device groups (`census`: in-node or across nodes),
the bytes across nodes against the plan's, temp memory, and each simulated on `nvlink+400gb-ib` beside the
plan's prediction (docs/fsdp.md, "HSDP: the library's step beside the partitioner's"; about 2 minutes):

    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py --hsdp --layers 32 --d 4096 --ff 14336 \
        --vocab 128256 --name llama-8b --devices 64 256 --out bench/results/fsdp_hlo_hsdp_8b.json \
        --timeline bench/results/fsdp_hlo_hsdp_8b

Why it imports private code: a compiled program's collectives become a Schedule with an `FsdpPlan`
(`_values._sharding`), which no public name builds from outside a planner; the HLO reader counts a loop's
collectives per trip; a scanned profile is planned per layer (`from_params(stacked=)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402

# The flag set of NVIDIA's JAX-Toolbox GPU performance guide and the MaxText/Paxml GPU scripts for large
# models (FSDP): the latency-hiding scheduler on the highest-priority stream, pipelined all-gather,
# reduce-scatter and all-reduce, while-loop double buffering, and combine thresholds of 1 GiB
# (all-reduce), 1 GiB / 8 GPUs (all-gather) and 1 GiB / 16 (reduce-scatter). Options this jaxlib refuses
# are left out and named.
_GIB = 2**30
LARGE_MODEL = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_highest_priority_async_stream": True,
               "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
               "xla_gpu_enable_pipelined_all_reduce": True, "xla_gpu_enable_while_loop_double_buffering": True,
               "xla_gpu_all_reduce_combine_threshold_bytes": _GIB,
               "xla_gpu_all_gather_combine_threshold_bytes": _GIB // 8,
               "xla_gpu_reduce_scatter_combine_threshold_bytes": _GIB // 16}
_DT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8)\[([0-9,]*)\]")
_START = re.compile(r"%([\w.-]+) = (.*?) (all-gather|reduce-scatter|all-reduce)-start\(")
_DONE = re.compile(r"-done\(%([\w.-]+)\)")


def params_of(layers: int, d: int, ff: int, vocab: int, dtype=jnp.float32) -> dict:
  kv = d // 4
  p = {"embed": jax.ShapeDtypeStruct((vocab, d), dtype), "norm": jax.ShapeDtypeStruct((d,), dtype)}
  for i in range(layers):
    p[f"layer_{i}"] = {
        "attn_norm": jax.ShapeDtypeStruct((d,), dtype), "q": jax.ShapeDtypeStruct((d, d), dtype),
        "k": jax.ShapeDtypeStruct((d, kv), dtype), "v": jax.ShapeDtypeStruct((d, kv), dtype),
        "o": jax.ShapeDtypeStruct((d, d), dtype), "mlp_norm": jax.ShapeDtypeStruct((d,), dtype),
        "gate": jax.ShapeDtypeStruct((d, ff), dtype), "up": jax.ShapeDtypeStruct((d, ff), dtype),
        "down": jax.ShapeDtypeStruct((ff, d), dtype)}
  return p


def _rms(x, s):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s


def _block(x, p):
  """One decoder block (attention with grouped K/V, SwiGLU MLP), pre-norm."""
  h = _rms(x, p["attn_norm"])
  q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
  k = jnp.repeat(k, q.shape[-1] // k.shape[-1], axis=-1)
  v = jnp.repeat(v, q.shape[-1] // v.shape[-1], axis=-1)
  a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(q.shape[-1]), axis=-1)
  x = x + jnp.einsum("bts,bsd->btd", a, v) @ p["o"]
  h = _rms(x, p["mlp_norm"])
  return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def _head_loss(x, params):
  """The tied output projection's loss on the last hidden state."""
  logits = _rms(x, params["norm"]) @ params["embed"].T
  return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def loss_fn(params, tokens, *, layers: int, remat: bool):
  block = jax.checkpoint(_block) if remat else _block
  x = params["embed"][tokens]
  for i in range(layers):
    x = block(x, params[f"layer_{i}"])
  return _head_loss(x, params)


def collectives(hlo: str) -> list[dict]:
  """The ENTRY computation's collectives in schedule order: kind, the full (unsharded) bytes they move
  (an all-gather's outputs, a reduce-scatter's inputs, an all-reduce's buffer), the arrays combined into
  it, whether XLA made it synchronous, and how many instructions run between its start and done."""
  entry = hlo[hlo.index("\nENTRY"):]
  lines = entry.splitlines()
  out, open_ = [], {}
  for n, line in enumerate(lines):
    m = _START.search(line)
    if m:
      name, result, kind = m.group(1), m.group(2), m.group(3)
      arrays = [_DT_BYTES[t] * math.prod(int(x) for x in dims.split(",") if x)
                for t, dims in _SHAPE.findall(result)]
      if kind == "all-gather":
        moved, count = sum(arrays[len(arrays) // 2:]), len(arrays) // 2
      elif kind == "reduce-scatter":
        moved, count = sum(arrays[:(len(arrays) + 1) // 2]), (len(arrays) + 1) // 2
      else:
        moved, count = sum(arrays), len(arrays)
      out.append({"kind": kind, "bytes": moved, "arrays": count, "sync": '"is_sync":true' in line,
                  "between": 0})
      open_[name] = (n, len(out) - 1)
      continue
    d = _DONE.search(line)
    if d and d.group(1) in open_:
      n0, k = open_.pop(d.group(1))
      out[k]["between"] = n - n0 - 1
  return out


_PARAM = re.compile(r"%([\w.-]+) = \S+ parameter\(\d+\).*?op_name=\"p((?:\[\\?'[^\]]+\\?'\])+)\"")
_KEY = re.compile(r"\[\\?'([^\]\\']+)\\?'\]")
_OPERANDS = re.compile(r"(all-gather|reduce-scatter|all-reduce)-start\(([^)]*)\)")


def read_schedule(hlo: str, profile: pj.GradientProfile) -> tuple[pj.Schedule, list[str]]:
  """The compiled program's FSDP collectives as a Schedule the simulator runs, and notes on what was
  assumed. All-gathers: the ENTRY parameters each gathers (named by their op_name metadata), grouped as
  compiled, in order of first gather (a weight gathered again is not kept: re-gathered in backward);
  reduce-scatters: the 2-D gradients of each, assigned to the weights of their shapes in backward order
  (the program does not name them); activation collectives are left out (they are not the plan's);
  the all-reduce of the concatenated norms is one replicated chunk at its place."""
  from prophet_jax._values._schedule import Bucket, Chunk
  from prophet_jax._values._sharding import FsdpPlan

  entry = hlo[hlo.index("\nENTRY"):]
  names = {}
  for m in _PARAM.finditer(entry):
    names[m.group(1)] = "/".join(_KEY.findall(m.group(2)))
  index = {r.path: i for i, r in enumerate(profile.rows)}
  sharded = {i for i, r in enumerate(profile.rows) if r.shard_dim is not None}
  rep_rows = [i for i, r in enumerate(profile.rows) if r.shard_dim is None and r.nbytes]
  gathers, seen, again = [], set(), set()
  rs_groups, events = [], []
  notes = []
  backward_pool = sorted(sharded, reverse=True)                     # back layers are ready first
  for line in entry.splitlines():
    m = _OPERANDS.search(line)
    if not m or "-start(" not in line:
      continue
    kind, ops = m.group(1), [o.strip().lstrip("%").split(" ")[0] for o in m.group(2).split(",")]
    ops = [o.split("*/")[-1].lstrip("%") for o in ops]
    if kind == "all-gather":
      rows = [index[names[o]] for o in ops if o in names and names[o] in index and index[names[o]] in sharded]
      fresh = [r for r in rows if r not in seen]
      again.update(r for r in rows if r in seen)
      seen.update(fresh)
      if fresh:
        gathers.append(fresh)
      elif not rows and seen:              # remat: a weight gathered again from a rematerialised copy,
        result = line.split(" = ", 1)[1].split(" all-gather-start(")[0]     # known by its gathered shape
        arrays = _SHAPE.findall(result)
        for _, d in arrays[len(arrays) // 2:]:
          shp = tuple(int(x) for x in d.split(",") if x)
          r = next((r for r in sorted(seen - again, reverse=True) if profile.rows[r].shape == shp), None)
          if r is not None:
            again.add(r)
    elif kind == "reduce-scatter":
      result = line.split(" = ", 1)[1].split(" reduce-scatter-start(")[0]
      arrays = _SHAPE.findall(result)
      shapes = [tuple(int(x) for x in d.split(",") if x) for _, d in arrays[:(len(arrays) + 1) // 2]]
      rows = []
      for shp in shapes:
        r = next((r for r in backward_pool if profile.rows[r].shape == shp), None)
        if r is not None:
          backward_pool.remove(r)
          rows.append(r)
      if rows:
        rs_groups.append(sorted(rows))
        events.append(("u", len(rs_groups) - 1))
    elif kind == "all-reduce" and rep_rows and "wrapped_concatenate" in line:
      events.append(("r", 0))
  if backward_pool:
    notes.append(f"{len(backward_pool)} gradient(s) found in no reduce-scatter "
                 f"({[profile.rows[r].path for r in backward_pool][:3]}): one unit at the end")
    rs_groups.append(sorted(backward_pool))
    events.append(("u", len(rs_groups) - 1))
  if rep_rows and ("r", 0) not in events:
    events.append(("r", 0))
    notes.append("the replicated leaves' all-reduce was not found: one chunk at the end")
  never = sorted(sharded - seen)
  if never:
    notes.append(f"{[profile.rows[r].path for r in never]} never all-gathered (the partitioner moves "
                 f"activations instead): modelled as one gather group at its first use")
    gathers.append(never)
  layer = {i: profile.layers.index(r.layer) for i, r in enumerate(profile.rows)}
  gathers.sort(key=lambda g: min(layer[r] for r in g))
  chunks, units = [], []
  for kind, x in events:
    rows = rs_groups[x] if kind == "u" else rep_rows
    if kind == "u":
      units.append(len(chunks))
    chunks.append(Chunk(slices=tuple((r, 0, profile.rows[r].size) for r in rows), dtype="float32"))
  plan = FsdpPlan(units=tuple(units), keep=tuple(not (set(g) & again) for g in gathers), prefetch=1,
                  backward_prefetch=1, shard_dims=tuple(r.shard_dim for r in profile.rows), mesh=profile.mesh,
                  shard_axes=profile.shard_axes, gathers=tuple(tuple(g) for g in gathers))
  sched = pj.Schedule(buckets=tuple(Bucket(chunks=(c,)) for c in chunks), rows=profile.tree_rows(),
                      policy="partitioner-compiled", fsdp=plan)
  return sched, notes


# --------------------------------------------------------------------------------------------------
# Scanned on both sides: the library's FSDP step (hooked) beside the partitioner's, one profile and network

STACK = "layers"
STACK_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")   # one layer's sharded weights, in forward order


def scanned_params_of(layers: int, d: int, ff: int, vocab: int, dtype=jnp.float32) -> tuple[dict, dict]:
  """The Llama shapes with the blocks stacked (a leading layer axis, scanned): the params and their specs
  (the embedding `P("data", None)`, a stack's weights `P(None, "data", None)`, the norms `P()`)."""
  kv = d // 4
  S = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  params = {"embed": S(vocab, d), "norm": S(d), STACK: {
      "attn_norm": S(layers, d), "q": S(layers, d, d), "k": S(layers, d, kv), "v": S(layers, d, kv),
      "o": S(layers, d, d), "mlp_norm": S(layers, d), "gate": S(layers, d, ff), "up": S(layers, d, ff),
      "down": S(layers, ff, d)}}
  specs = jax.tree.map(lambda x: P("data", None) if x.ndim == 2 and x.shape[0] == vocab else
                       P(None, "data", None) if x.ndim == 3 else P(), params)
  return params, specs


def scanned_loss_fn(params, tokens, *, remat: bool = False):
  """`loss_fn`'s model with its blocks under `jax.lax.scan` (per-layer remat: the body under jax.checkpoint)."""
  body = lambda x, p: (_block(x, p), None)  # noqa: E731
  x, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, params["embed"][tokens], params[STACK])
  return _head_loss(x, params)


def _arrays(ins, kind: str) -> list[tuple[int, ...]]:
  """The arrays a collective moves whole: an all-gather's results, a reduce-scatter's operands."""
  found = [tuple(int(x) for x in dims.split(",") if x) for _, dims in _SHAPE.findall(ins.shape)]
  if ins.opcode.endswith("-start") and len(found) > 1:
    return found[len(found) // 2:] if kind == "all-gather" else found[:(len(found) + 1) // 2]
  return found


def executed(hlo: str) -> dict:
  """Collectives per step by kind, each loop body's once per trip (weights' and activations' alike)."""
  from prophet_jax._compiled._hlo import execution_order, parse_hlo
  from prophet_jax._compiled._hlo_collectives import allreduces, sharded_collectives

  module = parse_hlo(hlo)
  ops = execution_order(module)
  out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
  for c in sharded_collectives(module, ops):
    out[c.collective] += c.op.trips or 1
  out["all-reduce"] = sum(a.op.trips or 1 for a in allreduces(module, ops))
  return out


def read_scanned(hlo: str, profile: pj.GradientProfile, layers: int) -> tuple[pj.Schedule, list[str]]:
  """The partitioner's compiled scanned program as a Schedule: per layer, its weights grouped into all-gathers
  as the forward loop's body gathers them (weights known by their shapes, in STACK_WEIGHTS order), a weight
  gathered again in the backward loop not kept, reduce-scatter units as the backward loop's body groups
  them (layers in backward order); outside the loops, the embedding's all-gathers and reduce-scatters at
  their places; the norms' all-reduces one replicated chunk at the first one's place. Activation
  collectives (shapes of no weight) are left out."""
  from prophet_jax._compiled._hlo import execution_order, parse_hlo
  from prophet_jax._values._schedule import Bucket, Chunk
  from prophet_jax._values._sharding import FsdpPlan

  rows = profile.rows
  index = {r.path: i for i, r in enumerate(rows)}
  shape_of = {n: rows[index[f"{STACK}/0/{n}"]].shape for n in STACK_WEIGHTS}
  outer = {rows[i].shape: i for i, r in enumerate(rows) if r.shard_dim is not None and not r.path.startswith(STACK)}
  replicated = [i for i, r in enumerate(rows) if r.shard_dim is None and r.nbytes]

  free: dict = {}   # per (loop, kind): the layer's weights not yet seen in this trip (same shapes: in order)

  def names(shapes, where):
    out, left = [], free.setdefault(where, list(STACK_WEIGHTS))
    for shp in shapes:
      n = next((n for n in left if shape_of[n] == shp), None)
      if n is None and any(shape_of[m] == shp for m in STACK_WEIGHTS):   # the next trip's (or copy's)
        left[:] = list(STACK_WEIGHTS)
        n = next(n for n in left if shape_of[n] == shp)
      if n is not None:
        left.remove(n)
        out.append(n)
    return out

  stack_rep = [[i for i in replicated if rows[i].path.startswith(f"{STACK}/{k}/")] for k in range(layers)]
  top_rep = [i for i in replicated if not rows[i].path.startswith(f"{STACK}/")]
  size = lambda rs: sum(rows[i].size for i in rs)  # noqa: E731
  fwd_loop, fwd_groups, again, events, seen_outer, outer_again = None, [], set(), [], set(), set()
  body, body_done = [], False    # one trip of the backward loop: ("u", weights) and ("r", None), in order
  notes = []
  for op in execution_order(parse_hlo(hlo)):
    ins = op.instruction
    kind = next((k for k in ("all-gather", "reduce-scatter", "all-reduce") if ins.opcode in (k, f"{k}-start")), None)
    if kind is None:
      continue
    shapes = _arrays(ins, kind)
    loop = op.loops[0] if op.loops else None
    backward = loop is not None and fwd_loop is not None and loop != fwd_loop
    ws = names(shapes, (loop, kind)) if loop is not None else []
    if kind == "all-gather":
      if loop is not None and ws and fwd_loop is None:
        fwd_loop = loop
      if loop is not None and loop == fwd_loop:
        if ws and set(ws) - {n for g in fwd_groups for n in g}:
          fwd_groups.append([n for n in ws if n not in {m for g in fwd_groups for m in g}])
      elif loop is not None:
        again.update(ws)
      for shp in shapes:
        if shp in outer:
          (outer_again if fwd_loop is not None else seen_outer).add(outer[shp])
      continue
    if backward and ("loop", None) not in events:
      events.append(("loop", None))
    elements = sum(math.prod(x) for x in shapes) if all(len(x) == 1 for x in shapes) else -1   # norms: 1-D
    if kind == "reduce-scatter" and backward and ws and not body_done:
      if set(ws) & {n for e, g in body if e == "u" for n in g}:
        body_done = True         # the next trip's (a double-buffered body holds two)
      else:
        body.append(("u", ws))
    elif kind == "reduce-scatter" and loop is None:
      events += [("u", outer[x]) for x in shapes if x in outer and ("u", outer[x]) not in events]
    elif kind == "all-reduce" and backward and elements == size(stack_rep[0]) and ("r", None) not in body:
      body.append(("r", None))
    elif kind == "all-reduce" and loop is None and elements in (size(top_rep), size(replicated)):
      events.append(("r", "top" if elements == size(top_rep) else "all"))
  missing = [n for n in STACK_WEIGHTS if n not in {m for g in fwd_groups for m in g}]
  if missing:
    notes.append(f"{missing} never all-gathered in the forward loop: one group of their own")
    fwd_groups.append(missing)
  unscattered = [n for n in STACK_WEIGHTS if n not in {m for e, g in body if e == "u" for m in g}]
  if unscattered:
    notes.append(f"{unscattered} in no reduce-scatter of the backward loop (the partitioner gathers activations "
                 f"for its gradient instead): one unit of its own")
    body.append(("u", unscattered))
  gathers, keep = [], []
  for i in sorted(outer.values()):
    if i not in seen_outer:
      notes.append(f"{rows[i].path} never all-gathered before the loop (the partitioner moves activations "
                   f"instead): modelled as gathered at its first use")
    gathers.append([i])
    keep.append(i not in outer_again)
  for k in range(layers):
    for g in fwd_groups:
      gathers.append([index[f"{STACK}/{k}/{n}"] for n in g])
      keep.append(not set(g) & again)
  layer_of = {i: profile.layers.index(r.layer) for i, r in enumerate(rows)}
  order = sorted(range(len(gathers)), key=lambda j: min(layer_of[r] for r in gathers[j]))
  gathers, keep = [gathers[j] for j in order], [keep[j] for j in order]
  for i in outer.values():
    if ("u", i) not in events:
      notes.append(f"{rows[i].path}'s gradient found in no reduce-scatter: one unit at the end")
      events.append(("u", i))
  chunks, units = [], {}
  for kind, x in events:
    if kind == "loop":
      for k in range(layers - 1, -1, -1):
        for e, g in body:
          if e == "r":
            chunks += [stack_rep[k]] if stack_rep[k] else []
            continue
          units[len(chunks)] = True
          chunks.append(sorted(index[f"{STACK}/{k}/{n}"] for n in g))
    elif kind == "u":
      units[len(chunks)] = True
      chunks.append([x])
    elif top_rep or x == "all":
      chunks.append(top_rep if x == "top" else replicated)
  left = [i for i in replicated if i not in {r for c in chunks for r in c}]
  if left:
    notes.append(f"{len(left)} replicated leaves in no all-reduce found: one chunk at the end")
    chunks.append(left)
  # the reduce-scatter units in forward use order (FsdpPlan.units), as the gathers
  forward_units = sorted(units, key=lambda c: min(layer_of[r] for r in chunks[c]))
  plan = FsdpPlan(units=tuple(forward_units), keep=tuple(keep), prefetch=1, backward_prefetch=1,
                  shard_dims=tuple(r.shard_dim for r in rows), mesh=profile.mesh, shard_axes=profile.shard_axes,
                  gathers=tuple(tuple(g) for g in gathers))
  sched = pj.Schedule(buckets=tuple(Bucket(chunks=(Chunk(slices=tuple((r, 0, rows[r].size) for r in c),
                                                         dtype="float32"),)) for c in chunks),
                      rows=profile.tree_rows(), policy="partitioner-compiled", fsdp=plan)
  return sched, notes


def planned_under(prof: pj.GradientProfile, net: pj.NetworkModel, budget: int | None) -> tuple[pj.Schedule, int | None]:
  """The `fsdp` plan under `budget` (each layer one unit, one gather ahead), the budget raised to the least the
  planner names where it does not fit (a leaf's need, then the least memory found), and the budget used."""
  for _ in range(3):
    try:
      return pj.plan(prof, net, "fsdp", memory_budget_bytes=budget, bucket_bytes=1, prefetch=1), budget
    except ValueError as e:
      budget = int(re.search(r"(?:at least|least memory found is) (\d+)", str(e)).group(1))
  raise ValueError(f"no fsdp plan under {budget} bytes")


def read_library(report, sched: pj.Schedule) -> pj.Schedule:
  """The library's compiled step as a Schedule, from its audit: the plan's groups and units, a group kept
  where the program has no all-gather of it in backward, the chunks in compiled order, the gathers' depth
  as compiled (at most the plan's prefetch)."""
  from prophet_jax._values._schedule import Bucket

  f = sched.fsdp
  groups = len(f.gathers) or len(f.units)
  again = {e.chunk for e in report.regathers}
  order = list(dict.fromkeys(report.order)) + [k for k in range(len(sched.chunks)) if k not in report.order]
  new = {k: i for i, k in enumerate(order)}
  plan = dataclasses.replace(f, units=tuple(new[u] for u in f.units), keep=tuple(g not in again for g in range(groups)),
                             prefetch=max(1, min(f.prefetch, report.gathers_in_flight or 1)))
  return pj.Schedule(buckets=tuple(Bucket(chunks=(sched.chunks[k],)) for k in order), rows=sched.rows,
                     policy="library-compiled", fsdp=plan)


def scanned_main(a) -> None:
  """`--scanned`: per device count, the partitioner's scanned programs (flags x remat) and the library's step
  planned at the least of their simulated peaks, each compiled, read into a Schedule and simulated."""
  from prophet_jax._compiled._gpu import xla_option_accepted
  large = {k: v for k, v in LARGE_MODEL.items() if xla_option_accepted(k, v)}
  flag_sets = {"both": ("default", "large-model"), "default": ("default",), "large-model": ("large-model",)}[a.flags]
  remats = {"both": (False, True), "no": (False,), "yes": (True,)}[a.remat]
  ff, seq, tokens_per_gpu = a.ff or 4 * a.d, 512, 16384
  results = []
  for devices in a.devices:
    topo = pj.gpu_topology("h100", devices=devices)
    mesh = topo.mesh("data")
    params, specs = scanned_params_of(a.layers, a.d, ff, a.vocab)
    param_bytes = sum(4 * math.prod(x.shape) for x in jax.tree.leaves(params))
    fwd_s = 2 * param_bytes / 4 * tokens_per_gpu / (989e12 * 0.5)
    prof = pj.GradientProfile.from_params(params, forward_s=fwd_s, backward_s=2 * fwd_s,
                                          update_s_per_byte=30 / 4 / (3.35e12 * 0.8), shardings=specs, stacked=(STACK,),
                                          mesh={"data": devices}, model=a.name, device="h100")
    net = pj.NetworkModel.preset("nvlink+400gb-ib", workers=devices)
    bound = pj.lower_bound(prof, net, sharded="fsdp")
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    args = (topo.abstract(params, specs, mesh=mesh),
            topo.abstract(jax.ShapeDtypeStruct((devices, seq), jnp.int32), P("data"), mesh=mesh))
    print(f"{a.layers} scanned layers, d={a.d}, {param_bytes / 2**30:.2f} GiB of f32 parameters, {devices} "
          f"compile-only H100s; {net.name}; bound {bound * 1e3:.1f} ms (simulated)")

    def compiled_of(step, options=None):
      f = jax.jit(step, in_shardings=(shard, NamedSharding(mesh, P("data"))), out_shardings=shard)
      t0 = time.perf_counter()
      c = f.lower(*args).compile(compiler_options=options)
      return c, time.perf_counter() - t0

    rows, peaks = [], []
    for flags in flag_sets:
      for remat in remats:
        def step(p, t, remat=remat):
          g = jax.grad(scanned_loss_fn)(p, t, remat=remat)
          return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
        c, secs = compiled_of(step, large if flags == "large-model" else None)
        text = c.as_text()
        if a.dump:
          pathlib.Path(a.dump).mkdir(parents=True, exist_ok=True)
          (pathlib.Path(a.dump) / f"scanned_{devices}_{flags}_remat{int(remat)}.hlo.txt").write_text(text)
        read, notes = read_scanned(text, prof, a.layers)
        sim = pj.simulate(read, prof, net, events=True)
        peaks.append(sim.peak_memory_bytes)
        per_step = executed(text)
        rows.append({"program": "partitioner", "devices": devices, "flags": flags, "remat": remat,
                     "compile_s": secs, "temp_bytes": c.memory_analysis().temp_size_in_bytes,
                     "all_gathers": per_step["all-gather"], "reduce_scatters": per_step["reduce-scatter"],
                     "all_reduces": per_step["all-reduce"],
                     "iteration_ms": sim.iteration_s * 1e3, "peak_bytes": sim.peak_memory_bytes,
                     "idle_ms": sim.idle_s * 1e3, "read_notes": notes,
                     "read_schedule": json.loads(read.to_json()), "_sim": sim})
        print(f"  partitioner {flags} flags, remat={remat}: compiled in {secs:.0f} s, temp "
              f"{rows[-1]['temp_bytes'] / 2**30:.2f} GiB; read: {len(read.fsdp.gathers)} gather groups "
              f"({sum(not k for k in read.fsdp.keep)} again in backward), {len(read.fsdp.units)} units; "
              f"simulated {sim.iteration_s * 1e3:.1f} ms, peak {sim.peak_memory_bytes / 2**30:.2f} GiB"
              + (f"; {'; '.join(notes)}" if notes else ""))
    libs = []
    # the library's step under two budgets: keep every gathered layer, and the least memory (all gathered
    # again); each layer one unit (bucket_bytes=1: units closed at every layer); one gather ahead, what XLA:GPU
    # keeps in flight by default (F2)
    for label, budget in (("keep all", None), ("least memory", 1)):
      sched, budget = planned_under(prof, net, budget)
      planned = pj.simulate(sched, prof, net, events=True)
      grad_fn = pj.hooked(scanned_loss_fn, sched, axis_name="data", mesh=mesh)

      def lib_step(p, t, grad_fn=grad_fn):
        g = grad_fn(p, t)[1]
        return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
      c, secs = compiled_of(lib_step)
      report, per_step = pj.audit(c, sched), executed(c.as_text())
      read = read_library(report, sched)
      sim = pj.simulate(read, prof, net, events=True)
      windows = [{"group": e.chunk, "kind": e.kind, "trips": e.trips, "asynchronous": e.asynchronous,
                  "window_ops": len(e.window), "window_gflop": e.window_flops / 1e9}
                 for e in report.gathers + report.regathers]
      lib = {"program": f"library, {label}", "devices": devices, "flags": "default", "remat": False,
             "compile_s": secs, "temp_bytes": c.memory_analysis().temp_size_in_bytes, "budget_bytes": budget,
             "all_gathers": per_step["all-gather"], "reduce_scatters": per_step["reduce-scatter"],
             "all_reduces": per_step["all-reduce"],
             "audit_ok": report.ok, "audit": report.describe(), "gathers_in_flight": report.gathers_in_flight,
             "windows": windows, "planned_ms": planned.iteration_s * 1e3,
             "planned_peak_bytes": planned.peak_memory_bytes, "iteration_ms": sim.iteration_s * 1e3,
             "peak_bytes": sim.peak_memory_bytes, "idle_ms": sim.idle_s * 1e3,
             "vs_plan": sim.iteration_s / planned.iteration_s, "bound_ms": bound * 1e3,
             "vs_partitioner": {f"{r['flags']}, remat={r['remat']}": r["iteration_ms"] / (sim.iteration_s * 1e3)
                                for r in rows},
             "plan": json.loads(sched.to_json()), "_sim": sim, "_planned": planned}
      libs.append(lib)
      over = [e for e in report.gathers if e.overlapped]
      print(f"  library, {label} ({sum(not k for k in sched.fsdp.keep)} of {len(sched.fsdp.keep)} groups again in "
            f"backward): compiled in {secs:.0f} s, temp {lib['temp_bytes'] / 2**30:.2f} GiB; "
            f"{report.describe().splitlines()[0]}")
      for line in report.problems:
        print(f"    problem: {line}")
      print(f"    compiled order simulated {sim.iteration_s * 1e3:.1f} ms = {lib['vs_plan']:.4f} x the plan's "
            f"prediction ({planned.iteration_s * 1e3:.1f} ms); forward all-gathers with compute in their window "
            f"{len(over)}/{len(report.gathers)} ({sum(e.window_flops for e in over) / 1e9:.0f} GFLOP); at most "
            f"{report.gathers_in_flight} in flight")
      print("    vs the partitioner (simulated): " + "; ".join(
          f"{k}: {v:.3f}x" for k, v in lib["vs_partitioner"].items()))
    if a.timeline:
      pj.plot_timelines({f"partitioner {r['flags']} remat={r['remat']}": r["_sim"] for r in rows} |
                        {f"{x['program']} (compiled)": x["_sim"] for x in libs} |
                        {f"{x['program']} (plan)": x["_planned"] for x in libs},
                        str(pathlib.Path(a.timeline).with_suffix("")) + f"_{devices}.png",
                        title=f"{a.name}, {devices} H100s, {net.name} (simulated)")
    results += rows + libs
  for r in results:
    r.pop("_sim")
    r.pop("_planned", None)
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"layers": a.layers, "d": a.d, "ff": ff, "vocab": a.vocab, "model": a.name,
                             "scanned": True, "devices": a.devices, "target": "h100", "jax": jax.__version__,
                             "tokens_per_gpu": tokens_per_gpu, "large_model_flags": large,
                             "results": results}, indent=1))
  print(f"wrote {out}")

# --------------------------------------------------------------------------------------------------
# HSDP: shards within a node, replicas across nodes; the library's step beside the partitioner's

NODE = 8                                     # GPUs per node: the shard axis
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def device_groups(text: str, devices: int) -> np.ndarray:
  """An HLO collective's device groups, one a row, from its `replica_groups` in any of the three spellings
  (explicit lists, iota `[g,n]<=[dims]T(perm)`, and `mesh['axis_0'=a,...], device_ids=(...) {'axis_k'}`:
  the groups vary along the named axes of the mesh of device ids); none or empty: one group of all."""
  ints = lambda x: [int(v) for v in x.split(",") if v]  # noqa: E731
  m = _MESH_GROUPS.search(text)
  if m:
    axes = [(x.split("=")[0].strip("'\" "), int(x.split("=")[1])) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(n for _, n in axes))
    if m.group(2):
      ids = ids.reshape(ints(m.group(2))).transpose(ints(m.group(3)) if m.group(3) else None)
    ids = ids.reshape([n for _, n in axes])
    over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(4)]
    ids = np.moveaxis(ids, over, list(range(len(axes) - len(over), len(axes))))
    return ids.reshape(-1, math.prod(axes[i][1] for i in over))
  m = _IOTA_GROUPS.search(text)
  if m:
    ids = np.arange(math.prod(ints(m.group(3)))).reshape(ints(m.group(3)))
    return ids.transpose(ints(m.group(4)) if m.group(4) else None).reshape(int(m.group(1)), int(m.group(2)))
  m = _LIST_GROUPS.search(text)
  if m and m.group(1):
    return np.array([ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))])
  return np.arange(devices)[None]


def census(hlo: str, devices: int) -> dict:
  """A compiled program's collectives per step (each loop's per trip) by kind and link: 'in-node' where every
  group lies within one node (device ids // NODE), else 'across nodes'; count and bytes (an all-gather's
  outputs, a reduce-scatter's inputs, an all-reduce's buffers)."""
  from prophet_jax._compiled._hlo import execution_order, parse_hlo

  out: dict = {}
  for op in execution_order(parse_hlo(hlo)):
    ins = op.instruction
    kind = next((k for k in ("all-gather", "reduce-scatter", "all-reduce") if ins.opcode in (k, f"{k}-start")), None)
    if kind is None:
      continue
    found = [(_DT_BYTES[t], math.prod(int(x) for x in d.split(",") if x)) for t, d in _SHAPE.findall(ins.shape)]
    if ins.opcode.endswith("-start") and len(found) > 1 and kind != "all-reduce":
      found = found[len(found) // 2:] if kind == "all-gather" else found[:(len(found) + 1) // 2]
    groups = device_groups(ins.text, devices)
    link = "in-node" if all(len(set(g // NODE)) == 1 for g in groups) else "across nodes"
    e = out.setdefault(f"{kind}, {link} (groups of {groups.shape[1]})", {"count": 0, "bytes": 0})
    e["count"] += op.trips or 1
    e["bytes"] += (op.trips or 1) * sum(b * n for b, n in found)
  return out


def outer_bytes(c: dict) -> int:
  """The bytes a program's collectives move over groups spanning nodes, per step."""
  return sum(v["bytes"] for k, v in c.items() if "across" in k)


def hsdp_main(a) -> None:
  """`--hsdp`: per device count, a ("replica", "data") mesh of devices/8 x 8; the partitioner's scanned HSDP step
  (params over "data" only) and the library's (`hooked(..., axis_name=("replica", "data"), mesh=)`, keep-all and
  least-memory plans), each compiled for H100s, its collectives read by link, read into a Schedule and
  simulated on the two-level network beside the plan's prediction."""
  ff, seq, tokens_per_gpu, axes = a.ff or 4 * a.d, 512, 16384, ("replica", "data")
  results = []
  for devices in a.devices:
    R = devices // NODE
    topo = pj.gpu_topology("h100", devices=devices)
    mesh = jax.sharding.Mesh(np.asarray(topo.devices).reshape(R, NODE), axes)
    params, specs = scanned_params_of(a.layers, a.d, ff, a.vocab)
    param_bytes = sum(4 * math.prod(x.shape) for x in jax.tree.leaves(params))
    fwd_s = 2 * param_bytes / 4 * tokens_per_gpu / (989e12 * 0.5)
    prof = pj.GradientProfile.from_params(params, forward_s=fwd_s, backward_s=2 * fwd_s,
                                          update_s_per_byte=30 / 4 / (3.35e12 * 0.8), shardings=specs, stacked=(STACK,),
                                          mesh={"replica": R, "data": NODE}, model=a.name, device="h100")
    net = pj.NetworkModel.preset("nvlink+400gb-ib", workers=devices)
    bound = pj.lower_bound(prof, net, sharded="fsdp")
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    batch = NamedSharding(mesh, P(axes))
    args = (topo.abstract(params, specs, mesh=mesh),
            topo.abstract(jax.ShapeDtypeStruct((devices, seq), jnp.int32), P(axes), mesh=mesh))
    sharded_bytes = sum(r.nbytes for r in prof.rows if r.shard_dim is not None)
    plan_outer = sharded_bytes // NODE + sum(r.nbytes for r in prof.rows if r.shard_dim is None)
    print(f"{a.layers} scanned layers, d={a.d}, {param_bytes / 2**30:.2f} GiB of f32 parameters, {R} replicas x "
          f"{NODE} shards of compile-only H100s; {net.name}; bound {bound * 1e3:.1f} ms (simulated); the plan "
          f"all-reduces {plan_outer / 2**20:.0f} MiB across nodes per step (the shards and the norms)")

    def compiled_of(step):
      f = jax.jit(step, in_shardings=(shard, batch), out_shardings=shard)
      t0 = time.perf_counter()
      c = f.lower(*args).compile()
      return c, time.perf_counter() - t0

    def row(program, c, secs, read, **more):
      text = c.as_text()
      if a.dump:
        pathlib.Path(a.dump).mkdir(parents=True, exist_ok=True)
        name = program.replace(", ", "_").replace(" ", "-")
        (pathlib.Path(a.dump) / f"hsdp_{devices}_{name}.hlo.txt").write_text(text)
      col = census(text, devices)
      sim = pj.simulate(read, prof, net, events=True)
      # the outer link's time for the bytes beyond the plan's (one ring all-reduce over the replicas), which a
      # Schedule read from the program cannot hold: the simulated time leaves it out
      excess = outer_bytes(col) - plan_outer
      excess_s = 2 * (R - 1) * (net.outer_alpha_s + excess / R * net.outer_beta_s_per_byte) if excess > 0 else 0.0
      r = {"program": program, "devices": devices, "replicas": R, "shards": NODE, "flags": "default",
           "compile_s": secs, "temp_bytes": c.memory_analysis().temp_size_in_bytes, "collectives": col,
           "outer_bytes": outer_bytes(col), "outer_vs_plan": outer_bytes(col) / plan_outer,
           "excess_outer_ms": 1e3 * excess_s,
           "iteration_ms": sim.iteration_s * 1e3, "peak_bytes": sim.peak_memory_bytes,
           "idle_ms": sim.idle_s * 1e3, "bound_ms": bound * 1e3, **more, "_sim": sim}
      print(f"  {program}: compiled in {secs:.0f} s, temp {r['temp_bytes'] / 2**30:.2f} GiB; across nodes "
            f"{r['outer_bytes'] / 2**20:.0f} MiB per step ({r['outer_vs_plan']:.2f} x the plan's: "
            f"{r['excess_outer_ms']:.1f} ms more on the outer link); simulated "
            f"{sim.iteration_s * 1e3:.1f} ms (idle {sim.idle_s * 1e3:.1f}), peak "
            f"{sim.peak_memory_bytes / 2**30:.2f} GiB")
      for k, v in col.items():
        print(f"    {k}: {v['count']} per step, {v['bytes'] / 2**20:.0f} MiB")
      return r

    def step(p, t):
      g = jax.grad(scanned_loss_fn)(p, t)
      return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
    c, secs = compiled_of(step)
    read, notes = read_scanned(c.as_text(), prof, a.layers)
    read = dataclasses.replace(read, fsdp=dataclasses.replace(read.fsdp, in_flight=1))   # XLA:GPU's default
    rows = [row("partitioner", c, secs, read, read_notes=notes, read_schedule=json.loads(read.to_json()))]
    for n in notes:
      print(f"    read: {n}")
    for label, budget in (("keep all", None), ("least memory", 1)):
      sched, budget = planned_under(prof, net, budget)
      planned = pj.simulate(sched, prof, net, events=True)
      grad_fn = pj.hooked(scanned_loss_fn, sched, axis_name=axes, mesh=mesh)

      def lib_step(p, t, grad_fn=grad_fn):
        g = grad_fn(p, t)[1]
        return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
      c, secs = compiled_of(lib_step)
      report = pj.audit(c, sched)
      shards = [(e.elements, e.expected_elements) for e in report.chunks if e.kind == "replica"]
      r = row(f"library, {label}", c, secs, read_library(report, sched), budget_bytes=budget,
              groups_again=sum(not k for k in sched.fsdp.keep), groups=len(sched.fsdp.keep),
              audit_ok=report.ok, audit=report.describe(), replica_allreduces=len(shards),
              replica_at_shard_size=all(e == x for e, x in shards), planned_ms=planned.iteration_s * 1e3,
              planned_peak_bytes=planned.peak_memory_bytes, plan=json.loads(sched.to_json()), _planned=planned)
      r["vs_plan"] = r["iteration_ms"] / r["planned_ms"]
      r["vs_partitioner"] = rows[0]["iteration_ms"] / r["iteration_ms"]
      print(f"    {r['groups_again']} of {r['groups']} groups again in backward; audit "
            f"{'OK' if report.ok else 'NOT OK'}; {len(shards)} replica all-reduces, all at the shard's size: "
            f"{r['replica_at_shard_size']}; compiled order {r['vs_plan']:.4f} x the plan's prediction "
            f"({r['planned_ms']:.1f} ms); the partitioner's {r['vs_partitioner']:.3f} x this (simulated)")
      for line in report.problems:
        print(f"    problem: {line}")
      rows.append(r)
    if a.timeline:
      pj.plot_timelines({f"{r['program']} (compiled)": r["_sim"] for r in rows} |
                        {f"{r['program']} (plan)": r["_planned"] for r in rows[1:]},
                        str(pathlib.Path(a.timeline).with_suffix("")) + f"_{devices}.png",
                        title=f"{a.name} HSDP, {R} x {NODE} H100s, {net.name} (simulated)")
    for r in rows:
      r.pop("_sim")
      r.pop("_planned", None)
    results += rows
    out = pathlib.Path(a.out)       # written after every device count: a later one may not finish
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": a.layers, "d": a.d, "ff": ff, "vocab": a.vocab, "model": a.name,
                               "scanned": True, "hsdp": True, "node": NODE, "devices": a.devices, "target": "h100",
                               "jax": jax.__version__, "tokens_per_gpu": tokens_per_gpu,
                               "network": net.name, "results": results}, indent=1))
    print(f"wrote {out}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--remat", choices=["both", "no", "yes"], default="both")
  ap.add_argument("--devices", type=int, nargs="+", default=[8, 64])
  ap.add_argument("--d", type=int, default=1024)
  ap.add_argument("--ff", type=int, default=None, help="the MLP's width (default 4 d)")
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--name", default="decoder-small", help="the profile's model name")
  ap.add_argument("--flags", choices=["both", "default", "large-model"], default="both",
                  help="XLA's default flags, the large-model flag set (LARGE_MODEL), or both")
  ap.add_argument("--dump", default=None, help="a folder for the compiled HLO texts")
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fsdp_hlo.json"))
  ap.add_argument("--scanned", action="store_true",
                  help="scanned on both sides: the library's FSDP step (hooked) beside the partitioner's programs")
  ap.add_argument("--timeline", default=None, help="with --scanned: a PNG path stem for the simulated timelines")
  ap.add_argument("--hsdp", action="store_true",
                  help="HSDP, scanned: a (devices/8 x 8) mesh, the library's step beside the partitioner's")
  a = ap.parse_args()
  if a.hsdp:
    hsdp_main(a)
    return
  if a.scanned:
    scanned_main(a)
    return
  from prophet_jax._compiled._gpu import xla_option_accepted  # which of LARGE_MODEL this jaxlib takes

  large = {k: v for k, v in LARGE_MODEL.items() if xla_option_accepted(k, v)}
  refused = sorted(set(LARGE_MODEL) - set(large))
  flag_sets = {"both": ("default", "large-model"), "default": ("default",), "large-model": ("large-model",)}[a.flags]
  if "large-model" in flag_sets:
    print(f"large-model flag set: {len(large)} options" + (f"; refused by this jaxlib: {', '.join(refused)}"
                                                           if refused else ""))
  results = []
  for devices in a.devices:
    topo = pj.gpu_topology("h100", devices=devices)
    mesh = topo.mesh("data")
    ff, vocab, seq = a.ff or 4 * a.d, a.vocab, 512
    params = params_of(a.layers, a.d, ff, vocab)
    specs = jax.tree.map(lambda s: P("data", None) if len(s.shape) == 2 else P(), params)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    tokens = jax.ShapeDtypeStruct((devices, seq), jnp.int32)
    param_bytes = sum(4 * math.prod(s.shape) for s in jax.tree.leaves(params))
    weights = [s for s in jax.tree.leaves(params) if len(s.shape) == 2]
    print(f"{a.layers} layers, d={a.d}, {len(weights)} sharded weights, {param_bytes / 2**20:.1f} MiB of f32 "
          f"parameters, {devices} compile-only H100s")
    tokens_per_gpu = 16384
    flops = 2 * param_bytes / 4 * tokens_per_gpu
    fwd_s = flops / (989e12 * 0.5)
    prof = pj.GradientProfile.from_params(params, forward_s=fwd_s, backward_s=2 * fwd_s,
                                          update_s_per_byte=30 / 4 / (3.35e12 * 0.8), shardings=specs,
                                          mesh={"data": devices}, model=a.name, device="h100")
    net = pj.NetworkModel.preset("nvlink+400gb-ib", workers=devices)
    bound = pj.lower_bound(prof, net, sharded="fsdp")
    for flags, remat in [(f, r) for f in flag_sets
                         for r in {"both": (False, True), "no": (False,), "yes": (True,)}[a.remat]]:
      def step(p, t, remat=remat):
        g = jax.grad(loss_fn)(p, t, layers=a.layers, remat=remat)
        return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
      f = jax.jit(step, in_shardings=(shard, NamedSharding(mesh, P("data"))), out_shardings=shard)
      t0 = time.perf_counter()
      compiled = f.lower(topo.abstract(params, specs, mesh=mesh),
                         topo.abstract(tokens, P("data"), mesh=mesh)).compile(
                             compiler_options=large if flags == "large-model" else None)
      secs = time.perf_counter() - t0
      text = compiled.as_text()
      if a.dump:
        pathlib.Path(a.dump).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(a.dump) / f"fsdp_{devices}_{flags}_remat{int(remat)}.hlo.txt").write_text(text)
      cs = collectives(text)
      ag = [c for c in cs if c["kind"] == "all-gather"]
      rs = [c for c in cs if c["kind"] == "reduce-scatter"]
      ar = [c for c in cs if c["kind"] == "all-reduce"]
      mem = compiled.memory_analysis()
      temp = getattr(mem, "temp_size_in_bytes", None)
      row = {"devices": devices, "flags": flags, "remat": remat, "compile_s": secs, "all_gathers": len(ag), "reduce_scatters": len(rs),
             "all_reduces": len(ar), "gathered_bytes": sum(c["bytes"] for c in ag),
             "scattered_bytes": sum(c["bytes"] for c in rs), "param_bytes": param_bytes,
             "sharded_weights": len(weights), "temp_bytes": temp,
             "sequence": cs}
      read, notes = read_schedule(text, prof)
      sim = pj.simulate(read, prof, net, events=False)
      same = pj.plan(prof, net, "fsdp", memory_budget_bytes=sim.peak_memory_bytes)
      mine = pj.simulate(same, prof, net, events=False)
      row.update(read_iteration_ms=sim.iteration_s * 1e3, read_peak_bytes=sim.peak_memory_bytes,
                 plan_at_its_memory_ms=mine.iteration_s * 1e3, plan_peak_bytes=mine.peak_memory_bytes,
                 bound_ms=bound * 1e3, read_notes=notes, read_schedule=json.loads(read.to_json()))
      results.append(row)
      print(f"{flags} flags, remat={remat}: {len(ag)} all-gathers ({row['gathered_bytes'] / 2**20:.1f} MiB gathered = "
            f"{row['gathered_bytes'] / param_bytes:.2f} x the parameters), {len(rs)} reduce-scatters "
            f"({row['scattered_bytes'] / 2**20:.1f} MiB), {len(ar)} all-reduces; temp "
            f"{(temp or 0) / 2**20:.1f} MiB; compiled in {secs:.1f} s")
      tag = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR"}
      print(f"  read into a Schedule and simulated ({tokens_per_gpu} tokens per GPU, {net.name} x {devices}, "
            f"simulated): "
            f"{sim.iteration_s * 1e3:.3f} ms, peak {sim.peak_memory_bytes / 2**20:.0f} MiB; fsdp plan at that "
            f"memory {mine.iteration_s * 1e3:.3f} ms ({sim.iteration_s / mine.iteration_s:.2f}x); bound "
            f"{bound * 1e3:.3f} ms; {'; '.join(notes) or 'every collective mapped'}")
      print("  schedule order (MiB, x arrays combined, s = synchronous):",
            " ".join(f"{tag[c['kind']]}{c['bytes'] / 2**20:.1f}x{c['arrays']}{'s' if c['sync'] else ''}" for c in cs))
      row["extrapolated"] = []
      for gpus in (g for g in (64, 256) if g > devices):   # this program's grouping on more GPUs
        big = dataclasses.replace(prof, mesh=(("data", gpus),))
        bnet = pj.NetworkModel.preset("nvlink+400gb-ib", workers=gpus)
        bread = dataclasses.replace(read, fsdp=dataclasses.replace(read.fsdp, mesh=(("data", gpus),)),
                                    tree_fingerprint="")
        bsim = pj.simulate(bread, big, bnet, events=False)
        bmine = pj.simulate(pj.plan(big, bnet, "fsdp", memory_budget_bytes=bsim.peak_memory_bytes), big, bnet,
                            events=False)
        bb = pj.lower_bound(big, bnet, sharded="fsdp")
        row["extrapolated"].append({"gpus": gpus, "read_iteration_ms": bsim.iteration_s * 1e3,
                                    "plan_at_its_memory_ms": bmine.iteration_s * 1e3, "bound_ms": bb * 1e3})
        print(f"  the same grouping on {gpus} GPUs (nvlink+400gb-ib, simulated): {bsim.iteration_s * 1e3:.3f} "
              f"ms; "
              f"fsdp plan at its memory {bmine.iteration_s * 1e3:.3f} ms "
              f"({bsim.iteration_s / bmine.iteration_s:.2f}x); bound {bb * 1e3:.3f} ms")
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"layers": a.layers, "d": a.d, "ff": a.ff or 4 * a.d, "vocab": a.vocab,
                             "model": a.name, "devices": a.devices, "target": "h100",
                             "jax": jax.__version__, "large_model_flags": large,
                             "large_model_refused": refused, "results": results}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
