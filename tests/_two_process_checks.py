"""The library's cross-process checks, run in ONE launch: `python -m prophet_jax.launch --nproc 2
--gloo-interface lo -- python tests/_two_process_checks.py OUTDIR` (tests/test_two_processes.py does it once
and asserts each check in its own test).

Each check runs on both ranks in turn and prints one line, `CHECK <name> <json>` (the launcher prefixes
it with the rank). A check that raises prints `CHECK <name> {"error": ...}` and the process exits, so
the launch stops (the other rank may be waiting in a collective) and the checks after it report that
they were not reached.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests.*` and `examples.*` as packages of the checkout

from prophet_jax.launch import initialize  # noqa: E402  (before any other jax call)

assert initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402

OUT = Path(sys.argv[1])
RANK = jax.process_index()


def check_psum() -> dict:
  """A psum over both processes' devices (gloo bound to the loopback interface by the launch)."""
  mesh = jax.make_mesh((jax.device_count(),), ("dp",))
  x = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("dp")), np.full(jax.local_device_count(), RANK + 1.0, np.float32))
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P()))
  return {"psum": float(np.asarray(f(x).addressable_data(0))[0]), "processes": jax.process_count(),
          "local_devices": jax.local_device_count()}


def check_broadcast() -> dict:
  """broadcast_schedule when a rank's tree differs, rank 0 failed, rank 0 passed nothing, then a good
  schedule: each case's outcome on this rank."""
  from prophet_jax.launch import broadcast_schedule

  params = {"a": {"kernel": np.zeros((3, 4), np.float32)}, "b": {"bias": np.zeros(4, np.float32)}}
  other = {"a": {"kernel": np.zeros((3, 5), np.float32)}, "b": {"bias": np.zeros(4, np.float32)}}
  planned = pj.plan(pj.GradientProfile.from_params(params, backward_s=1e-3),
                    pj.NetworkModel.preset("1gbe", workers=2), "wfbp") if RANK == 0 else None
  cases = [("tree", planned, other if RANK == 1 else params),  # rank 1's tree differs
           ("raised", ValueError("no policy 'fastest'") if RANK == 0 else None, params),  # rank 0 failed
           ("none", None, params),  # rank 0 passed nothing
           ("ok", planned, params)]
  out = {}
  for name, sched, tree in cases:
    try:
      out[name] = f"OK {broadcast_schedule(sched, tree).num_allreduces}"
    except Exception as e:  # noqa: BLE001  (the message is the result)
      out[name] = f"ERR {type(e).__name__}: {e}"
  return out


def _example(name: str, argv: list[str]) -> dict:
  """examples/<name>.py's main(argv), its printed output captured."""
  module = __import__(f"examples.{name}", fromlist=["main"])
  text = io.StringIO()
  with contextlib.redirect_stdout(text):
    code = module.main(argv)
  return {"code": code, "stdout": text.getvalue()}


def check_flax_wfbp() -> dict:
  """examples/train_flax.py, a multi-chunk wfbp plan, 3 steps."""
  return _example("train_flax", ["--model", "mlp", "--steps", "3", "--policy", "wfbp",
                                 "--out", str(OUT / "flax-wfbp.npz")])


def check_jit_dear() -> dict:
  """examples/train_jit.py --policy dear: hooked(mesh=) gradient shards, scheduled(mesh=)'s ZeRO-1 update."""
  return _example("train_jit", ["--policy", "dear", "--steps", "3", "--out", str(OUT / "jit-dear.npz")])


def check_jit_mgwfbp() -> dict:
  """examples/train_jit.py --policy mgwfbp (hooked mode), 3 steps at lr 0.05."""
  return _example("train_jit", ["--model", "mlp", "--steps", "3", "--policy", "mgwfbp", "--lr", "0.05",
                                "--out", str(OUT / "jit-mgwfbp.npz")])


def check_fsdp() -> dict:
  """examples/train_fsdp.py: hooked(fsdp plan, mesh=) over both processes' devices (the weights sharded across
  them), SGD with momentum, 3 steps, the step's gradients against jax.value_and_grad's at the first."""
  return _example("train_fsdp", ["--steps", "3", "--opt", "sgd", "--compare", "1", "--out", str(OUT / "fsdp.npz")])


def check_defer() -> dict:
  """A deferring schedule over both processes' devices, float gradients of random scale, 6 steps: per
  step, group and device, the chunks deferred and the norms ranked (as hex bytes)."""
  from prophet_jax._rewrite import _defer, _states
  from tests.test_defer import TREE, _schedule

  s = _schedule()
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  specs = _states.state_specs(_defer.init(s), "d")

  def body(g, st):
    out, st = pj.allreduce(jax.tree.map(lambda x: x[0], g), s, "d", defer_state=st)
    return jax.tree.map(lambda x: x[None], out), st

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), specs), out_specs=(P("d"), specs)))
  st = jax.jit(jax.shard_map(lambda: _defer.init(s), mesh=mesh, in_specs=(), out_specs=specs))()
  n, local = jax.device_count(), jax.local_device_count()
  rows = []
  for t in range(6):
    rng = np.random.default_rng(t)  # every process draws all devices' gradients, keeps its own rows
    full = {k: (rng.standard_normal((n, *v.shape)) * rng.uniform(0.1, 10, v.shape)).astype(np.float32)
            for k, v in TREE.items()}
    g = {k: jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                                   v[RANK * local:(RANK + 1) * local])
         for k, v in full.items()}
    _, st = step(g, st)
    for gi, (x, y) in enumerate(zip(st.index, st.norms)):
      for a, b in zip(x.addressable_shards, y.addressable_shards):
        rows.append([t, gi, a.device.id, np.asarray(a.data).tolist(), np.asarray(b.data).tobytes().hex()])
  return {"rows": rows}


def check_monitor() -> dict:
  """A Monitor whose ranks probe different networks: rank 0 decides for both; a real probe spans both
  processes' devices."""
  from prophet_jax._multiprocess._monitor import plan_key
  from tests.test_monitor import FAST as fast
  from tests.test_monitor import SLOW as slow
  from tests.test_monitor import _profile

  prof = _profile()  # 32 layers of 100 kB
  seen = slow if RANK == 0 else fast  # each rank sees another network: alone they would disagree
  mon = pj.Monitor(prof, fast, policy="mgwfbp", probe_every=2, window=1,
                   probe_fn=lambda sizes: [seen.allreduce_s(s) * (1 + 0.01 * RANK) for s in sizes])
  own = pj.plan(prof, seen, "mgwfbp")  # what this rank alone would plan
  for _ in range(4):
    mon.record_step(0.02)
  net = pj.measure_network(sizes=(1024, 16384), repeats=3, inner=1)
  return {"schedule": plan_key(mon.schedule), "own": plan_key(own), "probe": net.to_json(),
          "workers": net.workers}


def check_choose() -> dict:
  """pj.choose with local work only (no collective makes one process wait for the other): the candidate
  is faster than the control on rank 0 and 7 ms slower on rank 1; the decision, as each rank sees it."""
  import time

  import jax.numpy as jnp

  state = {"params": jnp.ones(64, jnp.float32)}
  step = jax.jit(lambda s, b: ({"params": s["params"] * 0.999 + b}, jnp.sum(s["params"])))

  def looks_fast(s, b):
    if RANK == 1:
      time.sleep(0.008)
    return step(s, b)

  def control(s, b):
    time.sleep(0.001)
    return step(s, b)

  c = pj.choose({"cand": looks_fast}, state, [1.0], control=control, rounds=20)
  return {"choice": c.to_json(), "fp": c.fingerprint}


CHECKS = {name[len("check_"):]: f for name, f in list(globals().items()) if name.startswith("check_")}


def main() -> int:
  for name, check in CHECKS.items():
    try:
      result = check()
    except Exception:  # noqa: BLE001  (reported, then the launch stops)
      print(f"CHECK {name} " + json.dumps({"error": traceback.format_exc()}), flush=True)
      return 1
    print(f"CHECK {name} " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
