"""The optimizer state a sharded (ZeRO-1) step keeps per device, measured from the rewrite itself.

For each model, a `dear` schedule (planned for 8 workers on 10GbE) and `scheduled(tx, schedule)`'s
`init` run inside `jax.shard_map` over 8 CPU devices: the state it returns is a global array split
over the data axis, and each device's part of it is what that device holds. Against it: `tx.init`
of the whole params, what every device of a replicated (all-reduce) step holds. For SGD with momentum
(one f32 copy of the parameters) and AdamW (two, and a step count).

- `mlp`, `cnn`, `gpt-tiny`, `resnet-small` (the bundled trainable models): the state is made on the
  devices and measured from each device's buffers (`addressable_shards`);
- ResNet-50 and BERT-base (the bundled traces' parameter shapes, as ShapeDtypeStructs): the same
  `init` under `jax.eval_shape` (nothing allocated), each device's part = the global shapes / 8.
Beside them, `Schedule.shard_nbytes` of the same plan for 16, 32 and 64 workers (the formula the 8-device
measurements check: per-parameter state arrays x `shard_nbytes(P)`, plus the scalars).

Writes bench/results/zero_state.json; prints the table; never asserts.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu .venv/bin/python bench/zero_state.py
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import get_model, load_trace  # noqa: E402

N = 8
AXIS = "dp"
TRAINABLE = ("mlp", "cnn", "gpt-tiny", "resnet-small")
TRACES = {"resnet50": "resnet50-h100", "bert-base": "bert-base-h100"}
OPTIMIZERS = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9), "adamw": lambda: optax.adamw(1e-3)}
OUT = pathlib.Path(__file__).resolve().parent / "results"


def _tree_from_rows(rows):
  """A params tree of ShapeDtypeStructs from a profile's (path, shape, dtype) rows ('a/b/c' -> nested)."""
  tree: dict = {}
  for path, shape, dtype in rows:
    node = tree
    *head, leaf = path.split("/")
    for k in head:
      node = node.setdefault(k, {})
    node[leaf] = jax.ShapeDtypeStruct(tuple(shape), dtype)
  return tree


def _nbytes(tree) -> int:
  return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def one(name: str, params, profile, mesh, materialize: bool) -> dict:
  schedule = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=N), "dear")
  out = {"model": name, "params_bytes": _nbytes(params), "chunks": len(schedule.chunks),
         "gathers": len(schedule.gathers), "padding_elements": int(sum(schedule.padded_sizes(N))
                                                                    - sum(c.size for c in schedule.chunks))}
  for label, make in OPTIMIZERS.items():
    replicated = _nbytes(jax.eval_shape(make().init, params))
    tx = pj.scheduled(make(), schedule, axis_name=AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))
    if materialize:
      state = init(jax.device_put(params, NamedSharding(mesh, P())))
      per_device = [sum(x.addressable_shards[d].data.nbytes for x in jax.tree.leaves(state)) for d in range(N)]
      assert len(set(per_device)) == 1  # every device holds the same number of bytes
      measured, how = per_device[0], "device buffers"
    else:
      shapes = jax.eval_shape(init, jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), params))
      measured, how = _nbytes(shapes) // N, "eval_shape / 8"
    arrays = sum(1 for x in jax.tree.leaves(jax.eval_shape(make().init, params)) if len(x.shape))
    arrays //= max(1, len(jax.tree.leaves(params)))
    scalars = replicated - arrays * out["params_bytes"]
    formula = {p: arrays * schedule.shard_nbytes(p) + scalars for p in (N, 16, 32, 64)}
    out[label] = {"replicated_bytes": replicated, "per_device_bytes": measured, "measured_by": how,
                  "ratio": measured / replicated, "ideal_ratio": 1 / N,
                  "padding_overhead": measured / (replicated / N) - 1,
                  "formula_bytes": formula, "formula_matches": formula[N] == measured,
                  "formula_ratio": {p: formula[p] / replicated for p in formula}}
  return out


def main() -> None:
  t0 = time.perf_counter()
  mesh = jax.make_mesh((N,), (AXIS,))
  rows = []
  for name in TRAINABLE:
    m = get_model(name)
    params = jax.device_get(m.init(jax.random.key(0)))
    profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3, model=name)
    rows.append(one(name, params, profile, mesh, materialize=True))
  for name, trace in TRACES.items():
    profile = load_trace(trace)
    params = _tree_from_rows(profile.tree_rows())
    rows.append(one(name, params, profile, mesh, materialize=False))
  result = {"devices": N, "network": "10gbe", "policy": "dear", "rows": rows,
            "machine": platform.platform(), "jax": jax.__version__, "seconds": time.perf_counter() - t0}
  OUT.mkdir(exist_ok=True)
  (OUT / "zero_state.json").write_text(json.dumps(result, indent=1))
  print(f"{'model':12s} {'params MB':>9s} {'rs/ag':>6s} | {'optimizer':12s} {'replicated MB':>13s} "
        f"{'per device MB':>13s} {'ratio':>6s} {'padding':>8s} | {'P=16':>6s} {'P=32':>6s} {'P=64':>6s}")
  for r in rows:
    for label in OPTIMIZERS:
      o = r[label]
      print(f"{r['model']:12s} {r['params_bytes'] / 1e6:9.3f} {r['chunks']:>3d}/{r['gathers']:<2d} | "
            f"{label:12s} {o['replicated_bytes'] / 1e6:13.3f} {o['per_device_bytes'] / 1e6:13.4f} "
            f"{o['ratio']:6.4f} {o['padding_overhead']:+8.2%} | "
            + " ".join(f"{o['formula_ratio'][p]:6.4f}" for p in (16, 32, 64))
            + ("" if o["formula_matches"] else "  (formula differs)"))
  print(f"ratio = per device / replicated (ideal 1/{N} = {1 / N:.4f}); padding = over 1/{N} of the "
        f"replicated state; P=16..64: Schedule.shard_nbytes' ratio for that many workers. "
        f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  main()
