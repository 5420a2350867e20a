"""A plain `jax.jit` training loop on global arrays with a scheduled gradient all-reduce: one process,
or several under `launch`.

The loop is data parallelism as most JAX code writes it now: a mesh with a data axis 'dp', the params
(a flax `TrainState`) placed replicated, `NamedSharding(mesh, P())`, each global batch split over the
axis, `NamedSharding(mesh, P('dp'))`, and one `jax.jit` step. No `shard_map`, no `pmap`: the one change
from the plain step is where the gradients come from,

    grad_fn = prophet_jax.hooked(model.loss_fn, schedule, axis_name="dp", mesh=mesh)
    loss, grads = grad_fn(state.params, batch)      # in place of jax.value_and_grad(model.loss_fn)

whose all-reduces are the schedule's chunks, issued inside backward (the partitioner's own gradient
all-reduce is gone from the compiled program). `--mode pipelined` runs `prophet_jax.pipelined(...,
mesh=mesh)` instead (this step's backward, its all-reduces and the next forward in one program).
`--policy dear` plans a sharded schedule (ZeRO-1): reduce-scatters in backward, each device updates its
shard with 1/n of the optimizer state, all-gathers for the next forward.

Run it:

  # one process, 8 CPU devices
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_jit.py --steps 20

  # two processes of 4 CPU devices each (launch splits the 8), the same global batch
  XLA_FLAGS=--xla_force_host_platform_device_count=8 prophet-jax launch --nproc 2 -- \\
      python examples/train_jit.py --steps 20

The schedule is planned on rank 0 and broadcast to the others, which check it against their own params.
Every process computes the same global batch from the step number and hands jax only the rows its
devices hold, so the result does not depend on how the devices are split into processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="mlp", help="mlp, cnn, gpt-tiny or resnet-small (default mlp)")
  p.add_argument("--mode", default="hooked", choices=("hooked", "pipelined"))
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--global-batch", type=int, default=None,
                 help="examples per step over all devices (default: the model's, 32)")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--policy", default="auto",
                 help="scheduling policy (wfbp, mgwfbp, prophet, auto, dear (ZeRO-1), ...)")
  p.add_argument("--network", default="1gbe", help="network preset or NetworkModel JSON used to plan")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="write the final params here (.npz, keys = leaf paths)")
  p.add_argument("--log-every", type=int, default=5)
  a = p.parse_args(argv)
  if a.steps < 1:
    p.error(f"--steps={a.steps}: give at least 1 step.")
  return a


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)

  # 1. Join the run (does nothing for a single process): before any other jax call.
  from prophet_jax.launch import broadcast_schedule, initialize

  initialize()

  import jax
  import numpy as np
  import optax
  from flax.training.train_state import TrainState
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import prophet_jax
  from prophet_jax import GradientProfile, NetworkModel
  from prophet_jax.models import get_model

  rank, nproc = jax.process_index(), jax.process_count()
  ndev = jax.device_count()
  print(f"rank {rank} of {nproc}: pid {os.getpid()}, {jax.local_device_count()} of {ndev} devices",
        flush=True)
  model = get_model(args.model)
  global_batch = args.global_batch or model.default_batch_size
  if global_batch % ndev:
    raise SystemExit(f"--global-batch={global_batch} does not split over {ndev} devices; give a "
                     f"multiple of {ndev}.")
  mesh = jax.make_mesh((ndev,), ("dp",))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

  def to_global(tree, sharding):
    """Host values (the same on every process) -> global arrays; each process supplies its shards."""
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]),
        tree)

  params = jax.device_get(model.init(jax.random.key(args.seed)))  # identical on every process

  # 2. Plan on rank 0, broadcast, check on every process.
  schedule = None
  if rank == 0:
    try:
      network = (NetworkModel.preset(args.network, workers=ndev) if not args.network.endswith(".json")
                 else NetworkModel.from_json(open(args.network).read()).with_workers(ndev))
      profile = GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3, model=args.model)
      schedule = prophet_jax.plan(profile, network, args.policy, cross_step=args.mode == "pipelined")
      print(schedule.describe(max_chunks=6), flush=True)
    except (ValueError, OSError) as e:  # bad --policy / --network: ProphetError is a ValueError
      schedule = e
  schedule = broadcast_schedule(schedule, params)
  tx = optax.sgd(args.lr, momentum=0.9)

  # 3. The plain jit step; the gradients from hooked(..., mesh=mesh).
  if args.mode == "hooked":
    grad_fn = prophet_jax.hooked(model.loss_fn, schedule, axis_name="dp", mesh=mesh)
    if schedule.sharded:
      # 'dear' (ZeRO-1): grad_fn returns each device's reduce-scattered gradient shards; the optimizer,
      # wrapped in scheduled(..., mesh=mesh), updates them with 1/n of the optimizer state per device
      # (a global array split over 'dp', made on the mesh) and all-gathers the update
      state = TrainState.create(apply_fn=model.module.apply, params=to_global(params, replicated),
                                tx=prophet_jax.scheduled(tx, schedule, axis_name="dp", mesh=mesh))
    else:
      state = to_global(jax.device_get(TrainState.create(apply_fn=model.module.apply, params=params,
                                                         tx=tx)), replicated)

    def train_step(state, batch):
      loss, grads = grad_fn(state.params, batch)  # the mean loss over the global batch; grads replicated
      return state.apply_gradients(grads=grads), loss

    step = jax.jit(train_step, donate_argnums=0)
  else:
    pipe = prophet_jax.pipelined(model.loss_fn, tx, schedule, axis_name="dp", mesh=mesh)
    state = pipe.init(to_global(params, replicated))
    step = jax.jit(pipe.step, donate_argnums=0)

  t0 = time.perf_counter()
  for k in range(args.steps):
    batch = jax.device_get(model.make_batch(jax.random.key(10_000 + k), global_batch))
    state, loss = step(state, to_global(batch, split))
    if rank == 0 and (k % args.log_every == 0 or k == args.steps - 1):
      print(f"step {k:4d}  loss {float(loss.addressable_data(0)):.4f}", flush=True)
  if args.mode == "pipelined":
    state = jax.jit(pipe.flush)(state)  # the last backward and update: params = the plain loop's
  jax.block_until_ready(state)
  dt = time.perf_counter() - t0
  if rank == 0:
    print(f"{args.steps} steps in {dt:.2f} s on {nproc} process(es) x {jax.local_device_count()} "
          f"device(s), {args.mode}, policy {schedule.policy}", flush=True)
    if args.out:
      leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
      final = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x.addressable_data(0))
               for p, x in leaves}
      np.savez(args.out, **final)
      print(f"final params written to {args.out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
