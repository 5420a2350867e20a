"""The pipelined step's cost on the CPU, and the simulator's predicted gain of cross_step=True.

Part 1 (measured, 8 CPU devices, jit(shard_map), state donated): the cross-step pipelined step
(`prophet_jax.pipelined`) against the plain scheduled step (`jax.grad`, `prophet_jax.scheduled(tx)`)
with the *same* chunks, on `cnn` and `gpt-tiny` at per-device batches of 32 and 128. On the CPU a collective
blocks the executor (docs/facts.md, "CPU collectives are synchronous"), so nothing overlaps and the pipelined step can only cost: this part
says how much, and what the cost is made of. Arms, timed in interleaved rounds in the same run
(median of >= 20 steps each):

- `plain`: the plain scheduled step (one program: forward, backward, chunked all-reduces, update).
- `pipelined`: `pipelined(...).step` (the previous batch's backward from carried residuals, the
  all-reduces, the update, this batch's forward), carrying what `jax.vjp` keeps that depends on the
  batch (`residuals="all"`).
- `pipelined-min-cut`: `residuals="min-cut"`: the fewest bytes from which the backward recomputes
  the rest by elementwise and layout operations (prophet_jax/_rewrite/_residuals.py).
- `pipelined-matmuls`: `residuals="matmuls"`: the forward under `jax.checkpoint` keeping only
  matmul, convolution and reduction outputs (the elementwise rest is recomputed, fused, in the
  backward).

Step times are wall-clock medians and process CPU time per step (all 8 device threads together); on a
shared machine the CPU time is the steadier of the two. The overheads are medians over rounds of each
round's ratio of medians (every arm runs in every round, in alternating order), so a slow stretch of
the machine, which hits all arms of a round alike, cancels.

Also the runtime's fixed cost per program input/output buffer (a jitted, donated `x + 1` over 1 vs 101
small arrays on the 8 devices): the pipelined step carries one buffer per residual.

Also from XLA's cost analysis of the compiled programs: flops and bytes accessed.

Part 2 (predicted, pure): for each bundled trace (resnet50, vgg16, bert-base, gpt2 on v100 and h100),
network preset and worker count, the best plain step (min over every policy planned and simulated with
cross_step=False) against the best pipelined step (min over every policy with cross_step=True), with
both lower bounds.

The GPU part of issue 4 (the pipelined step compiled for a mock 8-GPU topology, where XLA places the
all-reduce-start/done pairs) is not run here: this session had no GPU.

Prints both tables; writes bench/results/pipelined.json; never asserts.

    .venv/bin/python bench/pipelined.py            # both parts (~2-4 min on 2 free cores)
    .venv/bin/python bench/pipelined.py --no-measure   # part 2 only (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import time

N_DEV = 8
if "jax" not in sys.modules:  # 8 CPU devices, before jax starts
  flag = f"--xla_force_host_platform_device_count={N_DEV}"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from prophet_jax import POLICIES, GradientProfile, NetworkModel, lower_bound, plan, simulate  # noqa: E402
from prophet_jax.models import load_trace  # noqa: E402

AXIS = "data"
OUT = pathlib.Path(__file__).resolve().parent / "results" / "pipelined.json"
TRACE_MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
TRACE_DEVICES = ("v100", "h100")
NETWORKS = ("1gbe", "10gbe", "25gbe", "100gb-ib", "nvlink")
WORKERS = (8, 64)
SIM_POLICIES = tuple(p for p in POLICIES if p not in ("dlcp", "dear"))  # all-reduce plans only
# the pipelined arms: arm -> pipelined(..., residuals=...)
PIPELINED = {"pipelined": "all", "pipelined-min-cut": "min-cut", "pipelined-matmuls": "matmuls"}


def _loss_row(out):
  state, loss = out
  return state, loss[None]


# --------------------------------------------------------------------------------------------------
# part 2: the simulator's predicted gain


def predicted_gain() -> list[dict]:
  rows = []
  for model in TRACE_MODELS:
    for dev in TRACE_DEVICES:
      prof = load_trace(f"{model}-{dev}")
      for net in NETWORKS:
        for workers in WORKERS:
          n = NetworkModel.preset(net, workers=workers)
          best = {}
          for cross in (False, True):
            times = {}
            for pol in SIM_POLICIES:
              s = plan(prof, n, pol, cross_step=cross)
              times[pol] = simulate(s, prof, n, cross_step=cross, events=False).iteration_s
            pol = min(times, key=times.get)
            best[cross] = (pol, times[pol])
          rows.append({
              "trace": f"{model}-{dev}", "network": net, "workers": workers,
              "compute_s": prof.compute_s,
              "comm_one_bucket_s": n.allreduce_s(prof.total_nbytes),
              "best_plain_policy": best[False][0], "best_plain_s": best[False][1],
              "best_pipelined_policy": best[True][0], "best_pipelined_s": best[True][1],
              "gain": best[False][1] / best[True][1],
              "lower_bound_plain_s": lower_bound(prof, n, cross_step=False),
              "lower_bound_pipelined_s": lower_bound(prof, n, cross_step=True),
          })
  return rows


def print_gain(rows: list[dict]) -> None:
  print("\nPredicted (simulator): best plain step vs best pipelined step (cross_step=True), per trace,"
        " network and workers")
  print(f"{'trace':15s} {'network':8s} {'P':>3s} {'comm/comp':>9s} {'plain ms':>9s} {'(policy)':10s} "
        f"{'pipe ms':>9s} {'(policy)':10s} {'gain':>6s} {'LB plain':>9s} {'LB pipe':>9s}")
  for r in rows:
    print(f"{r['trace']:15s} {r['network']:8s} {r['workers']:3d} "
          f"{r['comm_one_bucket_s'] / r['compute_s']:9.2f} {r['best_plain_s'] * 1e3:9.2f} "
          f"{r['best_plain_policy']:10s} {r['best_pipelined_s'] * 1e3:9.2f} "
          f"{r['best_pipelined_policy']:10s} {r['gain']:6.3f} {r['lower_bound_plain_s'] * 1e3:9.2f} "
          f"{r['lower_bound_pipelined_s'] * 1e3:9.2f}")
  gains = [r["gain"] for r in rows]
  print(f"gain: median {statistics.median(gains):.3f}, min {min(gains):.3f}, max {max(gains):.3f} over "
        f"{len(gains)} cells")


# --------------------------------------------------------------------------------------------------
# part 1: the measured cost on the CPU


def measure(models: tuple[str, ...], per_device_batches: tuple[int, ...], rounds: int,
            steps_per_round: int, policy: str) -> list[dict]:
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from prophet_jax import pipelined, scheduled
  from prophet_jax.models import get_model

  mesh = jax.make_mesh((N_DEV,), (AXIS,))

  def put(tree, spec):
    # from fresh host copies: device_put may share one buffer between two puts of the same array, and
    # donating one would delete the other
    return jax.device_put(jax.tree.map(np.array, tree), NamedSharding(mesh, spec))

  def varying(p):
    return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), p)

  results = []
  for name, per_device_batch in [(m, b) for m in models for b in per_device_batches]:
    model = get_model(name)
    params = model.init(jax.random.key(0))
    gb = per_device_batch * N_DEV
    batches = [put(model.make_batch(jax.random.key(10 + k), gb), P(AXIS)) for k in range(4)]
    # the schedule: planned for the pipelined step from the parameter sizes (times spread by bytes)
    prof = GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
    net = NetworkModel.preset("10gbe", workers=N_DEV)
    schedule = plan(prof, net, policy, cross_step=True)
    tx = optax.sgd(0.05, momentum=0.9)
    tx_s = scheduled(tx, schedule, axis_name=AXIS)

    def plain_body(p, o, b):
      loss, g = jax.value_and_grad(model.loss_fn)(varying(p), b)
      u, o = tx_s.update(g, o, p)
      return optax.apply_updates(p, u), o, loss[None]

    plain = jax.jit(jax.shard_map(plain_body, mesh=mesh, in_specs=(P(), P(), P(AXIS)),
                                  out_specs=(P(), P(), P(AXIS))), donate_argnums=(0, 1))
    pipes = {arm: pipelined(model.loss_fn, tx, schedule, axis_name=AXIS, residuals=how)
             for arm, how in PIPELINED.items()}

    # compile (and warm) every arm
    t0 = time.perf_counter()
    st_plain = (put(params, P()), put(tx_s.init(params), P()))
    compiled = {"plain": plain.lower(*st_plain, batches[0]).compile()}
    states = {}
    for arm, pipe in pipes.items():
      specs = pipe.state_specs()
      step = jax.jit(jax.shard_map(lambda s, b, pipe=pipe: _loss_row(pipe.step(s, b)), mesh=mesh,
                                   in_specs=(specs, P(AXIS)), out_specs=(specs, P(AXIS))),
                     donate_argnums=(0,))
      states[arm], _ = step(put(pipe.init(params), P()), batches[0])  # the forward-only program
      compiled[arm] = step.lower(states[arm], batches[0]).compile()
    compile_s = time.perf_counter() - t0

    def run_plain(k):
      nonlocal st_plain
      p, o, loss = compiled["plain"](*st_plain, batches[k % 4])
      st_plain = (p, o)
      return loss

    def runner(arm):
      def run(k):
        states[arm], loss = compiled[arm](states[arm], batches[k % 4])
        return loss
      return run

    arms = {"plain": run_plain, **{arm: runner(arm) for arm in pipes}}
    times = {a: [] for a in arms}
    cpu = {a: [] for a in arms}  # process CPU seconds per step: less sensitive to other processes
    faults = {a: [] for a in arms}  # minor page faults per step (fresh memory the kernel maps in)
    per_round = {a: [] for a in arms}  # (wall median, cpu median) of each round
    for k in range(3):  # warm-up
      for f in arms.values():
        jax.block_until_ready(f(k))
    for r in range(rounds):
      order = list(arms) if r % 2 == 0 else list(reversed(arms))  # alternate who goes first
      for a in order:
        wall_r, cpu_r = [], []
        for k in range(steps_per_round):
          f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
          c, t = time.process_time(), time.perf_counter()
          jax.block_until_ready(arms[a](k))
          wall_r.append(time.perf_counter() - t)
          cpu_r.append(time.process_time() - c)
          faults[a].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        times[a] += wall_r
        cpu[a] += cpu_r
        per_round[a].append((statistics.median(wall_r), statistics.median(cpu_r)))

    def paired(arm, i):  # median over rounds of (arm / plain) in that round, minus one
      return statistics.median(x[i] / y[i] for x, y in zip(per_round[arm], per_round["plain"])) - 1

    def cost(c):
      ca = c.cost_analysis()
      ca = ca[0] if isinstance(ca, (list, tuple)) else ca
      return {"flops": float(ca.get("flops", float("nan"))),
              "bytes_accessed": float(ca.get("bytes accessed", float("nan")))}

    med = {a: statistics.median(v) for a, v in times.items()}
    row = {
        "model": name, "per_device_batch": per_device_batch, "global_batch": gb,
        "policy": policy, "chunks": schedule.num_allreduces,
        "param_bytes": prof.total_nbytes,
        "residuals": {arm: {"option": PIPELINED[arm], "bytes_per_device": pipe.residual_bytes(states[arm]),
                            "arrays": len(states[arm].pending.residuals)} for arm, pipe in pipes.items()},
        "steps_per_arm": len(times["plain"]),
        "median_s": med,
        "p10_s": {a: float(np.percentile(v, 10)) for a, v in times.items()},
        "median_cpu_s": {a: statistics.median(v) for a, v in cpu.items()},
        "overhead_wall": {arm: paired(arm, 0) for arm in pipes},
        "overhead_cpu": {arm: paired(arm, 1) for arm in pipes},
        "median_minor_faults": {a: statistics.median(v) for a, v in faults.items()},
        "cost_analysis": {a: cost(c) for a, c in compiled.items()},
        "compile_s": compile_s,
    }
    results.append(row)
    print(f"{name:9s} B/dev={per_device_batch:3d} chunks={row['chunks']:3d} wall medians: "
          + ", ".join(f"{a} {t * 1e3:.2f} ms" for a, t in med.items()), flush=True)
    for arm in pipes:
      res, ca = row["residuals"][arm], row["cost_analysis"]
      print(f"{'':9s} {arm:18s} overhead wall / CPU {row['overhead_wall'][arm] * 100:+5.1f}% / "
            f"{row['overhead_cpu'][arm] * 100:+5.1f}%; residuals {res['bytes_per_device'] / 2**20:6.2f} "
            f"MiB/dev in {res['arrays']:3d} arrays; XLA bytes accessed "
            f"{ca[arm]['bytes_accessed'] / 2**20:.1f} MiB (plain {ca['plain']['bytes_accessed'] / 2**20:.1f})"
            f", flops {ca[arm]['flops'] / ca['plain']['flops']:.3f}x plain", flush=True)
    print(f"{'':9s} minor page faults per step (median): "
          + ", ".join(f"{a} {v:.0f}" for a, v in row["median_minor_faults"].items()), flush=True)
  return results


def buffer_cost(n: int = 101, repeats: int = 200) -> float:
  """Seconds the runtime spends per extra program input+output buffer (8 devices, tiny arrays).

  A jitted, donated `x + 1` over 1 array against `n` arrays of 64 floats per device, medians.
  """
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((N_DEV,), (AXIS,))

  def median_call(k):
    xs = [jax.device_put(np.ones((N_DEV, 64), np.float32), NamedSharding(mesh, P(AXIS)))
          for _ in range(k)]
    f = jax.jit(jax.shard_map(lambda xs: [x + 1 for x in xs], mesh=mesh, in_specs=(P(AXIS),),
                              out_specs=P(AXIS)), donate_argnums=0)
    ts = []
    for i in range(repeats + 10):
      t = time.perf_counter()
      xs = jax.block_until_ready(f(xs))
      if i >= 10:
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)

  return (median_call(n) - median_call(1)) / (n - 1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--no-measure", action="store_true", help="skip part 1 (the CPU measurement)")
  ap.add_argument("--models", default="cnn,gpt-tiny")
  ap.add_argument("--batch", default="32,128", help="per-device batch sizes, comma-separated")
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--per-round", type=int, default=5)
  ap.add_argument("--policy", default="priority")
  ap.add_argument("--out", type=pathlib.Path, default=OUT)
  args = ap.parse_args()

  out: dict = {"command": "python bench/pipelined.py " + " ".join(sys.argv[1:]),
               "gpu": "skipped: no GPU in this session (the mock 8-GPU placement study was not run)"}
  if not args.no_measure:
    import jax

    print(f"Measured on {N_DEV} CPU devices (jax {jax.__version__}, {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f} at start): pipelined vs plain scheduled step, same chunks")
    out["load_average_start"] = os.getloadavg()
    out["buffer_cost_s"] = buffer_cost()
    print(f"runtime cost per extra input+output buffer: {out['buffer_cost_s'] * 1e6:.1f} us per call "
          f"(8 devices)", flush=True)
    out["measured"] = measure(tuple(args.models.split(",")), tuple(int(b) for b in args.batch.split(",")),
                              args.rounds, args.per_round, args.policy)
    out["load_average_end"] = os.getloadavg()
    out["jax"] = jax.__version__
  elif args.out.exists():  # keep the last measurement
    prev = json.loads(args.out.read_text())
    out.update({k: prev[k] for k in ("measured", "buffer_cost_s", "load_average_start", "load_average_end",
                                     "jax")
                if k in prev})
  rows = predicted_gain()
  print_gain(rows)
  out["predicted"] = rows
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(out, indent=1))
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
