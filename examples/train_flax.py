"""A flax training loop with a scheduled gradient all-reduce: one process, or several under `launch`.

The loop is the usual data-parallel one (a `TrainState`, a jitted step under `jax.shard_map` over a
mesh axis 'dp', the batch split over the devices). The one change: `scheduled(tx, schedule,
axis_name='dp')` replaces the step's `jax.lax.pmean(grads, 'dp')`, and the params are marked varying
(`jax.lax.pcast(..., to='varying')`) before `jax.grad`, so that `jax.grad` does not sum the gradients
itself (docs/facts.md, "The 8x gradient trap").

Run it:

  # one process, 8 CPU devices
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_flax.py --steps 20

  # two processes of 4 CPU devices each (launch splits the 8), the same global batch
  XLA_FLAGS=--xla_force_host_platform_device_count=8 prophet-jax launch --nproc 2 -- \\
      python examples/train_flax.py --steps 20

  # a real cluster: start one process per host with your scheduler; jax.distributed finds the rest
  srun python examples/train_flax.py --steps 20

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
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--global-batch", type=int, default=None,
                 help="examples per step over all devices (default: the model's, 32)")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--policy", default="auto", help="scheduling policy (wfbp, mgwfbp, prophet, auto, ...)")
  p.add_argument("--network", default="1gbe", help="network preset or NetworkModel JSON used to plan")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="write the final params here (.npz, keys = leaf paths)")
  p.add_argument("--log-every", type=int, default=5)
  p.add_argument("--step-delay", type=float, default=0.0,
                 help="seconds to sleep after each step (tests use it to kill a worker mid-run)")
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
  #    If planning fails on rank 0, hand the error to broadcast_schedule: every rank then stops with
  #    its message at once, instead of waiting in the broadcast for a schedule that never comes.
  schedule = None
  if rank == 0:
    try:
      network = (NetworkModel.preset(args.network, workers=ndev) if not args.network.endswith(".json")
                 else NetworkModel.from_json(open(args.network).read()).with_workers(ndev))
      profile = GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3, model=args.model)
      schedule = prophet_jax.plan(profile, network, args.policy)
      print(schedule.describe(max_chunks=6), flush=True)
    except (ValueError, OSError) as e:  # bad --policy / --network: ProphetError is a ValueError
      schedule = e
  schedule = broadcast_schedule(schedule, params)

  # 3. The usual TrainState; `scheduled(...)` in place of the gradient pmean.
  tx = prophet_jax.scheduled(optax.sgd(args.lr, momentum=0.9), schedule, axis_name="dp")
  state = TrainState.create(apply_fn=model.module.apply, params=params, tx=tx)
  state = to_global(jax.device_get(state), replicated)

  def train_step(state, batch):
    params = jax.lax.pcast(state.params, "dp", to="varying")  # own the all-reduce (docs/facts.md)
    loss, grads = jax.value_and_grad(model.loss_fn)(params, batch)
    state = state.apply_gradients(grads=grads)  # scheduled(...) all-reduces the grads, then sgd
    return state, jax.lax.pmean(loss, "dp")

  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P())),
                 donate_argnums=0)

  t0 = time.perf_counter()
  for k in range(args.steps):
    batch = jax.device_get(model.make_batch(jax.random.key(10_000 + k), global_batch))
    state, loss = step(state, to_global(batch, split))
    if rank == 0 and (k % args.log_every == 0 or k == args.steps - 1):
      print(f"step {k:4d}  loss {float(loss.addressable_data(0)):.4f}", flush=True)
    if args.step_delay:
      time.sleep(args.step_delay)
  jax.block_until_ready(state)
  dt = time.perf_counter() - t0
  if rank == 0:
    print(f"{args.steps} steps in {dt:.2f} s on {nproc} process(es) x {jax.local_device_count()} "
          f"device(s), policy {schedule.policy}", flush=True)
    if args.out:
      leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
      final = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x.addressable_data(0))
               for p, x in leaves}
      np.savez(args.out, **final)
      print(f"final params written to {args.out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
