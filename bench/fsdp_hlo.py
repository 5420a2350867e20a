"""What XLA's partitioner makes of an FSDP step, read from its compiled program on compile-only H100s: the
all-gathers and reduce-scatters (count, sizes, order) of a small Llama-style decoder whose 2-D weights are
sharded over the data axis (`P("data", None)`), under default flags, with and without per-layer remat,
and the compiled `memory_analysis()`. It checks the assumptions of the partitioner schedule that
bench/fsdp.py MODELS (one all-gather per weight, neighbours combined, gathered again in backward or not).

Compile-only (FACTS.md, "XLA:GPU without a GPU"): run with JAX_PLATFORMS=cpu. Prints a table and writes
bench/results/fsdp_hlo.json. Never asserts. A small model (4 layers, d=1024) because XLA:GPU's pipeline on
a large unscanned model is too slow to compile on 2 cores; the per-weight structure is what carries over.

    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_hlo.py [--layers 4] [--devices 8]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--remat", choices=["both", "no", "yes"], default="both")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--d", type=int, default=1024)
  ap.add_argument("--dump", default=None, help="a folder for the compiled HLO texts")
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fsdp_hlo.json"))
  a = ap.parse_args()
  topo = pj.gpu_topology("h100", devices=a.devices)
  mesh = topo.mesh("data")
  ff, vocab, seq = 4 * a.d, 8192, 512
  params = params_of(a.layers, a.d, ff, vocab)
  specs = jax.tree.map(lambda s: P("data", None) if len(s.shape) == 2 else P(), params)
  shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  tokens = jax.ShapeDtypeStruct((a.devices, seq), jnp.int32)
  param_bytes = sum(4 * math.prod(s.shape) for s in jax.tree.leaves(params))
  weights = [s for s in jax.tree.leaves(params) if len(s.shape) == 2]
  results = []
  print(f"{a.layers} layers, d={a.d}, {len(weights)} sharded weights, {param_bytes / 2**20:.1f} MiB of f32 "
        f"parameters, {a.devices} compile-only H100s, default flags")
  for remat in {"both": (False, True), "no": (False,), "yes": (True,)}[a.remat]:
    def step(p, t, remat=remat):
      g = jax.grad(loss_fn)(p, t, layers=a.layers, remat=remat)
      return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)
    f = jax.jit(step, in_shardings=(shard, NamedSharding(mesh, P("data"))), out_shardings=shard)
    t0 = time.perf_counter()
    compiled = f.lower(topo.abstract(params, specs, mesh=mesh),
                       topo.abstract(tokens, P("data"), mesh=mesh)).compile()
    secs = time.perf_counter() - t0
    text = compiled.as_text()
    if a.dump:
      pathlib.Path(a.dump).mkdir(parents=True, exist_ok=True)
      (pathlib.Path(a.dump) / f"fsdp_remat{int(remat)}.hlo.txt").write_text(text)
    cs = collectives(text)
    ag = [c for c in cs if c["kind"] == "all-gather"]
    rs = [c for c in cs if c["kind"] == "reduce-scatter"]
    ar = [c for c in cs if c["kind"] == "all-reduce"]
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None)
    row = {"remat": remat, "compile_s": secs, "all_gathers": len(ag), "reduce_scatters": len(rs),
           "all_reduces": len(ar), "gathered_bytes": sum(c["bytes"] for c in ag),
           "scattered_bytes": sum(c["bytes"] for c in rs), "param_bytes": param_bytes,
           "sharded_weights": len(weights), "temp_bytes": temp,
           "sequence": cs}
    results.append(row)
    print(f"remat={remat}: {len(ag)} all-gathers ({row['gathered_bytes'] / 2**20:.1f} MiB gathered = "
          f"{row['gathered_bytes'] / param_bytes:.2f} x the parameters), {len(rs)} reduce-scatters "
          f"({row['scattered_bytes'] / 2**20:.1f} MiB), {len(ar)} all-reduces; temp "
          f"{(temp or 0) / 2**20:.1f} MiB; compiled in {secs:.1f} s")
    tag = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR"}
    print("  schedule order (MiB, x arrays combined, s = synchronous):",
          " ".join(f"{tag[c['kind']]}{c['bytes'] / 2**20:.1f}x{c['arrays']}{'s' if c['sync'] else ''}" for c in cs))
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"layers": a.layers, "d": a.d, "devices": a.devices, "target": "h100",
                             "jax": jax.__version__, "results": results}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
