"""FSDP in a plain `jax.jit` step: a small decoder-only transformer whose blocks are scanned (flax linen's
`nn.scan`), its weights sharded over the data axis, trained on 8 host devices (or several processes).

What changes from the partitioner's own FSDP step (`jax.jit` of `jax.value_and_grad(loss_fn)` over params
placed `NamedSharding(mesh, P("data", ...))`) is one line, plus the plan:

    schedule = prophet_jax.plan(profile, network, "fsdp", bucket_bytes=1)   # each layer one unit
    grad_fn = prophet_jax.hooked(loss_fn, schedule, axis_name="data", mesh=mesh)
    loss, grads = grad_fn(params, batch)       # in place of jax.value_and_grad(loss_fn)(params, batch)

The model is unchanged; the params are placed as the plan says (a stacked kernel `P(None, "data", None)`,
the embedding `P("data", None)`, the rest `P()`); the optimizer state is made by a jitted `tx.init` whose
`out_shardings` are `prophet_jax.state_specs(...)`. Each layer's weights are all-gathered inside the scan
with the next layer's gather in flight, gathered again in backward or kept as the plan's memory budget
says, and reduce-scattered per layer; the gradients come back sharded as the params.

Run it:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_fsdp.py
  XLA_FLAGS=--xla_force_host_platform_device_count=8 prophet-jax launch --nproc 2 -- \\
      python examples/train_fsdp.py --steps 10

It prints the loss as it falls, the audit of the compiled step (the plan's collectives, counted), and, for
the first `--compare` steps, the largest difference of the loss and the gradients from the partitioner's own
FSDP step (`jax.value_and_grad` on the same placed params and batch), as a fraction of the largest
gradient: float32 summation order alone (about 1e-6; the update itself is the same optax code).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

AXIS = "data"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d", type=int, default=64, help="the model width (a multiple of the device count)")
  p.add_argument("--vocab", type=int, default=64)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--global-batch", type=int, default=32)
  p.add_argument("--opt", default="adamw", choices=("adamw", "sgd"), help="adamw, or sgd with momentum 0.9")
  p.add_argument("--lr", type=float, default=None, help="default: 3e-3 for adamw, 0.1 for sgd")
  p.add_argument("--budget-mib", type=float, default=None,
                 help="the plan's per-device memory budget for gathered weights (default: keep everything)")
  p.add_argument("--compare", type=int, default=3, help="steps checked against the partitioner's gradients (0: none)")
  p.add_argument("--log-every", type=int, default=5)
  p.add_argument("--out", default=None, help="write the final params here (.npz, keys = leaf paths)")
  return p.parse_args(argv)


def make_model(layers: int, d: int, vocab: int):
  """(module, loss_fn): token embedding, `layers` pre-norm blocks (causal self-attention and an MLP) under
  one `nn.scan`, a final norm and the output projection tied to the embedding (as Llama 3.2 1B's);
  `loss_fn(params, batch)` the next-token cross entropy, a mean over the batch's tokens."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.RMSNorm()(x)
      q, k, v = (nn.Dense(d, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
      mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      a = jax.nn.softmax(jnp.where(mask, q @ k.swapaxes(1, 2) / jnp.sqrt(d), -1e9), axis=-1)
      x = x + nn.Dense(d, use_bias=False, name="o")(a @ v)
      h = nn.RMSNorm()(x)
      return x + nn.Dense(d, name="down")(jax.nn.gelu(nn.Dense(4 * d, name="up")(h))), None

  class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(vocab, d)
      x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)()(
          embed(tokens), None)
      return embed.attend(nn.RMSNorm()(x))       # the output projection tied to the embedding

  module = Decoder()

  def loss_fn(params, batch):
    logits = module.apply(params, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return module, loss_fn


def specs_of(params):
  """The placement: each scanned (stacked) kernel split over the data axis on the dimension after its
  layer axis, the embedding on its rows, norms and biases replicated."""
  import jax
  from jax.sharding import PartitionSpec as P

  def one(path, x):
    names = [getattr(k, "key", "") for k in path]
    if "ScanBlock_0" in names:
      return P(None, AXIS, None) if x.ndim == 3 else P()
    return P(AXIS, None) if names[-1] == "embedding" else P()
  return jax.tree_util.tree_map_with_path(one, params)


def per_layer(params, specs, stack: str = "ScanBlock_0"):
  """The per-layer view a profile plans, as dicts {path: leaf} and {path: spec} in forward order: layer k of
  a stacked leaf at `<stack path>/<k>/<rest>` (its spec without the layer axis), a layer's leaves together,
  so each layer of the stack is one gather group and one reduce-scatter unit."""
  import jax
  from jax.sharding import PartitionSpec as P

  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  pspecs = jax.tree_util.tree_structure(params).flatten_up_to(specs)
  paths = ["/".join(str(getattr(k, "key", k)) for k in p) for p, _ in leaves]
  out, out_specs = {}, {}
  for path, (_, x), spec in zip(paths, leaves, pspecs):
    head, sep, _ = path.partition(f"/{stack}/")
    if not sep:
      out[path], out_specs[path] = x, P(*spec)
    elif f"{head}/{stack}/0" not in {k.rpartition("/")[0] for k in out}:
      members = [(q.partition(f"/{stack}/")[2], y, t) for q, (_, y), t in zip(paths, leaves, pspecs)
                 if q.startswith(f"{head}/{stack}/")]
      for k in range(x.shape[0]):
        for rest, y, t in members:
          out[f"{head}/{stack}/{k}/{rest}"], out_specs[f"{head}/{stack}/{k}/{rest}"] = y[k], P(*tuple(t)[1:])
  return out, out_specs


def batch_at(step: int, args) -> dict:
  """Step `step`'s global batch, the same on every process: sequences x_{i+1} = (3 x_i + 1) mod vocab from
  random starts (a rule the model learns), the targets the next tokens."""
  import numpy as np

  rng = np.random.default_rng(10_000 + step)
  x = rng.integers(0, args.vocab, size=(args.global_batch, 1))
  seq = [x]
  for _ in range(args.seq):
    seq.append((3 * seq[-1] + 1) % args.vocab)
  toks = np.concatenate(seq, axis=1).astype(np.int32)
  return {"tokens": toks[:, :-1], "targets": toks[:, 1:]}


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  from prophet_jax.launch import initialize

  initialize()   # one process: nothing; under launch: jax.distributed, before any other jax call

  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import prophet_jax as pj

  rank, ndev = jax.process_index(), jax.device_count()
  mesh = jax.make_mesh((ndev,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  module, loss_fn = make_model(args.layers, args.d, args.vocab)
  b0 = batch_at(0, args)
  params = jax.device_get(jax.jit(module.init)(jax.random.key(0), b0["tokens"][:1]))   # the same everywhere
  specs = specs_of(params)
  place = lambda tree, sp: jax.tree.map(  # noqa: E731  (host values, the same everywhere -> global arrays)
      lambda x, s: jax.make_array_from_callback(np.shape(x), NamedSharding(mesh, s), lambda i: np.asarray(x)[i]),
      tree, sp, is_leaf=lambda x: isinstance(x, P))

  # 1. The plan, per layer of the stack, from the params and their placement (estimated times): a block is
  #    one layer (its first 3 path components, params/ScanBlock_0/<k>), units closed at each layer
  #    (bucket_bytes=1), so each block is one gather group and one reduce-scatter unit
  flat, flat_specs = per_layer(params, specs)
  profile = pj.GradientProfile.from_params(flat, shardings=flat_specs, mesh={AXIS: ndev}, forward_s=4e-3,
                                           backward_s=8e-3, layer_depth=3)
  network = pj.NetworkModel.preset("100gb-ib", workers=ndev)
  budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
  schedule = pj.plan(profile, network, "fsdp", memory_budget_bytes=budget, bucket_bytes=1)

  # 2. The step: hooked(..., mesh=) in place of jax.value_and_grad; the state placed as the plan says
  tx = (optax.adamw(args.lr or 3e-3, weight_decay=0.01) if args.opt == "adamw"
        else optax.sgd(args.lr or 0.1, momentum=0.9))
  state_specs = pj.state_specs(jax.eval_shape(tx.init, params), AXIS, params=params, schedule=schedule)
  grad_fn = pj.hooked(loss_fn, schedule, axis_name=AXIS, mesh=mesh)

  def step(p, opt, batch):
    loss, grads = grad_fn(p, batch)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, loss, grads

  p0 = place(params, specs)
  opt0 = jax.jit(tx.init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs,
                                                     is_leaf=lambda x: isinstance(x, P)))(p0)
  batch = lambda k: place(batch_at(k, args), {"tokens": P(AXIS), "targets": P(AXIS)})  # noqa: E731
  step = jax.jit(step).lower(p0, opt0, batch(0)).compile()   # compiled once: audited, then run
  report = pj.audit(step, schedule)
  if rank == 0:
    print(schedule.describe(max_chunks=4))
    print(report.describe().splitlines()[0], flush=True)

  # 3. Train; on the first --compare steps, the partitioner's own FSDP gradients (jax.value_and_grad on the
  #    same placed params and batch) beside the step's: the same, to float32 summation order
  reference = jax.jit(jax.value_and_grad(loss_fn))
  whole = lambda t: pj.unshard_state(t, tx, params, schedule)  # noqa: E731  (every array on the host)
  p, opt, first, worst = p0, opt0, None, 0.0
  for k in range(args.steps):
    b = batch(k)
    if k < args.compare:
      ref_loss, ref_grads = reference(p, b)
    p_next, opt, loss, grads = step(p, opt, b)
    if k < args.compare:
      for x, y in zip(jax.tree.leaves(whole(grads)), jax.tree.leaves(whole(ref_grads))):
        worst = max(worst, float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-30))
      worst = max(worst, abs(float(whole(loss)) - float(whole(ref_loss))) / abs(float(whole(ref_loss))))
    p, loss = p_next, float(whole(loss))
    first = loss if first is None else first
    if rank == 0 and (k % args.log_every == 0 or k == args.steps - 1):
      print(f"step {k:4d}  loss {loss:.4f}", flush=True)
  if rank == 0 and args.compare:
    print(f"against the partitioner's step (jax.value_and_grad) at steps 0-{min(args.compare, args.steps) - 1}: "
          f"loss and gradients differ by at most {worst:.1e} of the largest ({'equal' if worst <= 1e-4 else 'DIFFERENT'})",
          flush=True)
  if args.out:    # every process takes part in gathering the params whole
    host = pj.unshard_state(p, tx, params, schedule)
    if rank == 0:
      leaves = jax.tree_util.tree_flatten_with_path(host)[0]
      np.savez(args.out, **{jax.tree_util.keystr(q, simple=True, separator="/"): x for q, x in leaves})
  if rank == 0:
    print(f"{args.steps} steps on {jax.process_count()} process(es) x {jax.local_device_count()} device(s): "
          f"loss {first:.3f} -> {loss:.3f}; audit {'OK' if report.ok else 'MISMATCH'}", flush=True)
  return 0 if report.ok and worst <= 1e-4 and loss < first else 1


if __name__ == "__main__":
  sys.exit(main())
