"""The FSDP step's mechanism on compiled programs (docs/design.md, "FSDP in the user's step: the mechanism").

It imports private code: the per-device FSDP core (`_rewrite._fsdp_step`, not public until `hooked` carries
FSDP plans) and the HLO reader the audit uses, to print each compiled schedule.

Compiles small FSDP steps (L layers of D x D, f32 or a bf16 model over f32 shards; the weights sharded
`P("data", None)`, the biases replicated) for 8 compile-only H100s (and, with --cpu, for 8 host CPUs) and
prints each program's schedule as a short sequence, with its temp memory (`memory_analysis()`):

  [A3 ... A3]  forward all-gather of gather group 3 (async start ... done); A3 alone: synchronous
  [R3 ... R3]  its all-gather again in backward;   [S5 ... S5] the reduce-scatter of chunk 5 (a unit)
  C7           the all-reduce of replicated chunk 7;   g / g4: gemms (4 in a row);   { ... } a loop body
  ag / rs / ar the partitioner's own collectives (no prophet scope)

Run (prints, never asserts; both jax lines):
    JAX_PLATFORMS=cpu .venv/bin/python bench/fsdp_mechanism.py [case ...]        # jax 0.10.2
    .ci/latest shell, then /opt/venv/bin/python bench/fsdp_mechanism.py [case ...]  # jax 0.12.1
Cases: unrolled scan layout depth mixed remat frameworks (default: all).
"""
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax._compiled._hlo import execution_order, parse_hlo  # noqa: E402
from prophet_jax._rewrite._fsdp_step import fsdp_grad  # noqa: E402

L, D, B = int(os.environ.get("FSDP_L", 6)), int(os.environ.get("FSDP_D", 1024)), int(os.environ.get("FSDP_B", 4096))
N = 8
LAYER_MIB = D * D * 4 / 2**20

_LABEL = ((r"fsdp/ag(\d+)/", "A"), (r"fsdp/reag(\d+)/", "R"), (r"fsdp/rs(\d+)/", "S"), (r"chunk(\d+)/", "C"))
_KIND = {"all-gather": "ag", "reduce-scatter": "rs", "all-reduce": "ar"}


def _label(ins, module, comp):
  kind = next((k for k in _KIND if ins.opcode.startswith(k)), None)
  if kind is None and ins.opcode in ("fusion-start", "async-start", "fusion-done", "async-done"):
    body = dict(ins.callees).get("calls")
    if ins.opcode.endswith("-done"):
      start = module.instruction(comp, ins.operands[0]) if ins.operands else None
      body = dict(start.callees).get("calls") if start is not None else None
    root = next((i for i in module.computations.get(body or "", ()) if i.root), None)
    kind = next((k for k in _KIND if root is not None and root.opcode.startswith(k)), None)
    if kind is None:
      return None
    ins = root if not ins.op_name else ins
  if kind is None:
    return None
  for pat, tag in _LABEL:
    m = re.search(pat, ins.op_name + "/")
    if m:
      return tag + m.group(1)
  return _KIND[kind]


def sequence(compiled):
  """The compiled schedule as a short sequence (see the module docstring)."""
  module = parse_hlo(compiled.as_text())
  out, loops, open_ = [], (), {}
  for op in execution_order(module):
    ins = op.instruction
    while len(op.loops) < len(loops):
      out.append("}")
      loops = loops[:-1]
    if op.loops != loops:
      out.append("{")
      loops = op.loops
    lab = _label(ins, module, op.computation)
    if lab is not None:
      if ins.opcode.endswith("-start"):
        open_[ins.name] = lab
        out.append("[" + lab)
      elif ins.opcode.endswith("-done"):
        out.append(open_.pop(ins.operands[0], lab) + "]")
      else:
        out.append(lab)
      continue
    text = ins.text
    if ("gemm" in text and ins.opcode in ("custom-call", "fusion")) or ins.opcode in ("dot", "convolution") or (
        ins.opcode == "fusion" and ("dot(" in text or "ynn_fusion" in ins.name)):
      out.append("g")
  text = " ".join(out + ["}"] * len(loops))
  return re.sub(r"(?<!\S)g( g)+(?!\S)", lambda m: f"g{m.group(0).count('g')}", text)


def temp_mib(compiled):
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def show(name, compiled):
  print(f"  {name}: temp {temp_mib(compiled):.0f} MiB\n      {sequence(compiled)}")


# --------------------------------------------------------------------------------------------------
# models: L layers x = tanh(x @ w + b); plain JAX, unrolled or scanned; f32 or bf16 compute

def unrolled_params(dtype=jnp.float32):
  return {f"l{i}": {"b": jax.ShapeDtypeStruct((D,), dtype), "w": jax.ShapeDtypeStruct((D, D), dtype)} for i in range(L)}


def unrolled_specs():
  return {f"l{i}": {"b": P(), "w": P("data", None)} for i in range(L)}


def unrolled_loss(compute=jnp.float32, remat=False):
  def layer(p, x):
    return jnp.tanh(x @ p["w"].astype(compute) + p["b"].astype(compute))
  layer_fn = jax.checkpoint(layer) if remat else layer

  def loss(params, batch):
    x = batch["x"].astype(compute)
    for i in range(L):
      x = layer_fn(params[f"l{i}"], x)
    return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)
  return loss


def scanned_params(dtype=jnp.float32):
  return {"stack": {"b": jax.ShapeDtypeStruct((L, D), dtype), "w": jax.ShapeDtypeStruct((L, D, D), dtype)}}


def scanned_specs():
  return {"stack": {"b": P(), "w": P(None, "data", None)}}


def scanned_loss(compute=jnp.float32, remat=False):
  def body(x, p):
    return jnp.tanh(x @ p["w"].astype(compute) + p["b"].astype(compute)), None
  body_fn = jax.checkpoint(body) if remat else body

  def loss(params, batch):
    x, _ = jax.lax.scan(body_fn, batch["x"].astype(compute), params["stack"])
    return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)
  return loss


BATCH = {"x": jax.ShapeDtypeStruct((B, D), jnp.float32), "y": jax.ShapeDtypeStruct((B, D), jnp.float32)}


def profile(params, specs, stacked=(), gather_dtype=None):
  """The model's estimated profile, scanned stacks planned per layer."""
  return pj.GradientProfile.from_params(params, forward_s=0.01, backward_s=0.02, mesh={"data": N}, shardings=specs,
                                        stacked=stacked, gather_dtype=gather_dtype)


NET = pj.NetworkModel.preset("nvlink", workers=N)


def plan(params, specs, budget, stacked=(), gather_dtype=None, **options):
  """The fsdp plan of the model's profile."""
  return pj.plan(profile(params, specs, stacked, gather_dtype), NET, "fsdp", memory_budget_bytes=budget, **options)


def peak_mib(sched, params, specs, stacked=()):
  """The simulator's peak (gathered parameters and unsharded gradients) of a plan, MiB."""
  return pj.simulate(sched, profile(params, specs, stacked), NET).peak_memory_bytes / 2**20


_TOPO = {}


def topology(cpu=False):
  if "t" not in _TOPO:
    _TOPO["t"] = pj.gpu_topology("h100", devices=N)
  if cpu:
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices("cpu")[:N]), ("data",))
  return _TOPO["t"].mesh("data")


def abstract(tree, spec, mesh):
  from jax.sharding import NamedSharding
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, spec)


def compile_library(loss, params, specs, sched, cpu=False, opts=None, **kw):
  mesh = topology(cpu)
  grad_fn = fsdp_grad(loss, sched, axis_name="data", **kw)

  def step(p, b):
    value, g = grad_fn(p, b)
    return jax.lax.pmean(value, "data"), g
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs)))
  return f.lower(abstract(params, specs, mesh), abstract(BATCH, {"x": P("data"), "y": P("data")}, mesh)).compile(
      compiler_options=opts or {})


def compile_partitioner(loss, params, specs, cpu=False, opts=None):
  from jax.sharding import NamedSharding
  mesh = topology(cpu)
  f = jax.jit(jax.value_and_grad(loss), out_shardings=(NamedSharding(mesh, P()), jax.tree.map(
      lambda s: NamedSharding(mesh, s), specs)))
  return f.lower(abstract(params, specs, mesh), abstract(BATCH, {"x": P("data"), "y": P("data")}, mesh)).compile(
      compiler_options=opts or {})


def least_budget(params, specs, stacked=(), **options):
  """The smallest budget fsdp accepts for the model (its errors name it)."""
  budget = 1
  for _ in range(3):
    try:
      plan(params, specs, budget, stacked, **options)
      return budget
    except ValueError as e:
      budget = int(re.search(r"(?:at least|least memory found is) (\d+)", str(e)).group(1))
  return budget


def case_unrolled():
  p, s = unrolled_params(), unrolled_specs()
  print(f"== unrolled: {L} layers of {D}x{D} f32 ({LAYER_MIB:.0f} MiB gathered each), batch {B} over {N}")
  show("partitioner, no remat", compile_partitioner(unrolled_loss(), p, s))
  show("partitioner, per-layer remat", compile_partitioner(unrolled_loss(remat=True), p, s))
  memory_table(unrolled_loss(), p, s, ())


def case_scan():
  p, s = scanned_params(), scanned_specs()
  print(f"== scanned: lax.scan over {L} stacked layers of {D}x{D} f32 (w P(None, 'data', None), b P())")
  show("partitioner, no remat", compile_partitioner(scanned_loss(), p, s))
  show("partitioner, body remat", compile_partitioner(scanned_loss(remat=True), p, s))
  memory_table(scanned_loss(), p, s, ("stack",))


def memory_table(loss, p, s, stacked):
  """The library's step under four budgets, each compiled: temp(b) - temp(least) against the simulator's
  peak(b) - peak(least) (docs/design.md, "Memory against the plan")."""
  least = least_budget(p, s, stacked)
  most = int(peak_mib(plan(p, s, None, stacked), p, s, stacked) * 2**20)
  rows = []
  for name, budget in (("keep all", None), ("3/4", least + 3 * (most - least) // 4), ("1/2", (least + most) // 2),
                       ("least", least)):
    sched = plan(p, s, budget, stacked)
    c = compile_library(loss, p, s, sched)
    rows.append((name, "".join("K" if k else "." for k in sched.fsdp.keep), temp_mib(c), peak_mib(sched, p, s, stacked)))
    if name in ("keep all", "least"):
      show(f"library, {name}", c)
  print("  | budget | keep (K: kept) | temp MiB | simulated peak MiB | temp - temp(least) | peak - peak(least) | ratio |")
  for name, keep, t, pk in rows:
    dt, dp = t - rows[-1][2], pk - rows[-1][3]
    print(f"  | {name} | {keep} | {t:.1f} | {pk:.1f} | {dt:.1f} | {dp:.1f} | {dt / dp if dp else float('nan'):.3f} |")


def mlp_params():
  """Per layer w1 (D, 2D) split on dimension 0 and w2 (2D, D) split on dimension 1 (a leaf cut on another
  dimension than 0: what packing costs)."""
  return {f"l{i}": {"w1": jax.ShapeDtypeStruct((D, 2 * D), jnp.float32),
                    "w2": jax.ShapeDtypeStruct((2 * D, D), jnp.float32)} for i in range(L)}


def mlp_specs():
  return {f"l{i}": {"w1": P("data", None), "w2": P(None, "data")} for i in range(L)}


def mlp_loss(params, batch):
  x = batch["x"]
  for i in range(L):
    x = x + jnp.tanh(x @ params[f"l{i}"]["w1"]) @ params[f"l{i}"]["w2"]
  return jnp.mean((x - batch["y"]) ** 2)


def counts(compiled):
  text = compiled.as_text()
  n = lambda k: len(re.findall(rf"= [^=]*? {k}(-start)?\(", text))
  return (f"all-gathers {n('all-gather')}, reduce-scatters {n('reduce-scatter')}, transposes "
          f"{len(re.findall(r' transpose[(]', text))}, copies {len(re.findall(r' copy[(]', text))}")


def case_layout():
  p, s = mlp_params(), mlp_specs()
  print(f"== layout: {L} layers of w1 {D}x{2 * D} (split on dim 0) and w2 {2 * D}x{D} (split on dim 1); units of 2 layers")
  for budget in (None, least_budget(p, s, bucket_bytes=2 * 16 * D * D)):
    sched = plan(p, s, budget, bucket_bytes=2 * 16 * D * D)
    print(f"  plan: {len(sched.fsdp.units)} units, {len(sched.fsdp.gathers) or len(sched.fsdp.units)} gather groups, keep {sched.fsdp.keep}")
    for layout in ("packed", "leaf"):
      for cpu in (False, True):
        c = compile_library(mlp_loss, p, s, sched, cpu=cpu, layout=layout)
        where = "CPU" if cpu else "H100"
        print(f"    {layout:6s} {where:4s}: temp {temp_mib(c):.0f} MiB; {counts(c)}")
        if not cpu:
          print(f"      {sequence(c)}")


def case_depth():
  p, s = unrolled_params(), unrolled_specs()
  print("== depth: the unrolled model planned at forward prefetch 2")
  sched = plan(p, s, None, prefetch=2, in_flight=2)   # a deeper plan: the user compiles with the limit raised
  print(f"  plan: prefetch {sched.fsdp.prefetch}")
  show("library, prefetch 2, default flags", compile_library(unrolled_loss(), p, s, sched))
  show("library, prefetch 2, parallel_collective_overlap_limit=2", compile_library(
      unrolled_loss(), p, s, sched, opts={"xla_gpu_experimental_parallel_collective_overlap_limit": 2}))


def case_mixed():
  print("== mixed precision: bf16 compute over f32 shards (x @ w.astype(bf16))")
  for name, loss, p, s, stacked in (("unrolled", unrolled_loss(jnp.bfloat16), unrolled_params(), unrolled_specs(), ()),
                                    ("scanned", scanned_loss(jnp.bfloat16), scanned_params(), scanned_specs(), ("stack",))):
    for planned in (None, "bfloat16"):
      sched = plan(p, s, least_budget(p, s, stacked, gather_dtype=planned), stacked, gather_dtype=planned)
      for gd in ("auto", None):
        try:
          c = compile_library(loss, p, s, sched, gather_dtype=gd)
        except ValueError as e:
          print(f"  {name}, planned in {planned or 'float32'}, gather_dtype={gd!r}: refused: {str(e)[:120]}...")
          continue
        dts = sorted({m.group(1) for ln in c.as_text().splitlines() if " all-gather(" in ln or "all-gather-start(" in ln
                      for m in [re.search(r"= [(]*(\w+)\[", ln)] if m})
        print(f"  {name}, planned in {planned or 'float32'} (simulated peak {peak_mib(sched, p, s, stacked):.0f} MiB), "
              f"gather_dtype={gd!r}: all-gathers in {dts}, temp {temp_mib(c):.0f} MiB")
    show(f"{name}, partitioner (no remat)", compile_partitioner(loss, p, s))


def case_remat():
  print("== the user's remat: per-layer jax.checkpoint (unrolled) and a checkpointed scan body")
  for name, loss, p, s, stacked in (("unrolled", unrolled_loss(remat=True), unrolled_params(), unrolled_specs(), ()),
                                    ("scanned", scanned_loss(remat=True), scanned_params(), scanned_specs(), ("stack",))):
    for label, budget in (("keep all", None), ("least memory", least_budget(p, s, stacked))):
      sched = plan(p, s, budget, stacked)
      show(f"{name} + remat, library {label}", compile_library(loss, p, s, sched))


def linen_scanned():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jnp.tanh(nn.Dense(D)(x)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)()(x, None)[0]

  model = Model()
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, D)))
  specs = {"params": {"ScanBlock_0": {"Dense_0": {"bias": P(), "kernel": P(None, "data", None)}}}}
  return params, specs, lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2), ("params/ScanBlock_0",)


def nnx_scanned():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  class Model(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=L)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def blocks(rngs):
        return Block(rngs)
      self.blocks = blocks(rngs)

    def __call__(self, x):
      return nnx.scan(lambda x, blk: blk(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)

  graphdef, params = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
  specs = jax.tree.map(lambda a: P(None, "data", None) if a.ndim == 3 else P(), params)
  return params, specs, lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2), ("blocks",)


def case_frameworks():
  print("== the same scanned model written in flax linen (nn.scan) and flax nnx (nnx.scan), loss as usual")
  for name, model in (("linen", linen_scanned), ("nnx", nnx_scanned)):
    p, s, loss, stacked = model()
    sched = plan(p, s, least_budget(p, s, stacked), stacked)
    show(f"{name}, library least memory", compile_library(loss, p, s, sched))


CASES = {"unrolled": case_unrolled, "scan": case_scan, "layout": case_layout, "depth": case_depth,
         "mixed": case_mixed, "remat": case_remat, "frameworks": case_frameworks}
if __name__ == "__main__":
  print("jax", jax.__version__)
  for name in sys.argv[1:] or CASES:
    CASES[name]()
