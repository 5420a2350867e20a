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

Why it imports private code: a compiled program's collectives become a Schedule with an `FsdpPlan`
(`_values._sharding`), which no public name builds from outside a planner.
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


def loss_fn(params, tokens, *, layers: int, remat: bool):
  def rms(x, s):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s

  def block(x, p):
    h = rms(x, p["attn_norm"])
    q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
    k = jnp.repeat(k, q.shape[-1] // k.shape[-1], axis=-1)
    v = jnp.repeat(v, q.shape[-1] // v.shape[-1], axis=-1)
    a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(q.shape[-1]), axis=-1)
    x = x + jnp.einsum("bts,bsd->btd", a, v) @ p["o"]
    h = rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

  if remat:
    block = jax.checkpoint(block)
  x = params["embed"][tokens]
  for i in range(layers):
    x = block(x, params[f"layer_{i}"])
  logits = rms(x, params["norm"]) @ params["embed"].T
  return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


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
  a = ap.parse_args()
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
