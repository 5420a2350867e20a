"""Overlap replay: a GPU's compute emulated by per-layer sleeps, real all-reduces over a shaped link.

The simulator's overlap logic (`NetworkModel.overlap=True`: the device keeps computing while chunks
are on the link) meets a real network here. Two processes, each in its own network namespace, joined
by a veth pair capped with `tc ... tbf` (bench/_netns.py; gloo bound to the veth). Each process replays
one iteration of a bundled trace (default `resnet50-v100`, a V100's per-layer times from the bundled
traces): the main thread sleeps through backward, and at each chunk's ready time (the latest
`ready_s` of its rows) hands the chunk to a second thread, which issues the chunk's real all-reduce
(a jitted `psum` of the chunk's bytes across the two processes) in schedule order, one at a time, as
soon as it is ready and the previous one has ended. After backward and the last all-reduce: the update
and the forward, also as sleeps. The measured iteration is compared with `simulate(..., overlap=True)`
for several policies, with alpha and beta probed the same way the replay issues its all-reduces (one
jitted call per all-reduce, from the host).

  sudo .venv/bin/python bench/replay.py                    # writes bench/results/replay.json
  sudo .venv/bin/python bench/replay.py --trace googlenet-k80 --rates 1gbit --iterations 3

Without root (or without `ip`/`tc`) it prints why and exits 0. Every namespace it creates is deleted by
name, even on failure. Bench scripts write JSON and never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

POLICIES = ("xla", "wfbp", "bucket", "mgwfbp", "priority", "prophet", "auto")
PORT = 29518


def worker(args: argparse.Namespace) -> int:
  from prophet_jax.launch import broadcast_schedule, initialize

  initialize()
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from prophet_jax import NetworkModel, plan, simulate
  from prophet_jax.models import load_trace

  rank, ndev = jax.process_index(), jax.device_count()
  log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
  profile = load_trace(args.trace)
  if args.compute_scale != 1.0:
    profile = profile.scaled(args.compute_scale)
  mesh = jax.make_mesh((ndev,), ("dp",))
  sharding = NamedSharding(mesh, P("dp"))
  fns: dict[tuple[int, str], object] = {}

  def buffer(n: int, dtype: str):
    key = (n, dtype)
    if key not in fns:
      fns[key] = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "dp"), mesh=mesh, in_specs=P("dp"),
                                       out_specs=P("dp")))
    local = np.ones(n, dtype=np.dtype(dtype) if dtype != "bfloat16" else jax.numpy.bfloat16)
    return fns[key], jax.make_array_from_process_local_data(sharding, local, (n * ndev,))

  def barrier():
    f, x = buffer(1, "float32")
    jax.block_until_ready(f(x))

  # 1. probe the link the way the replay uses it: one jitted all-reduce call per message, from the host
  sizes = [2**k for k in range(12, 25, 2)]
  probe_x = {n: buffer(n // 4, "float32") for n in sizes}
  samples: dict[int, list[float]] = {n: [] for n in sizes}

  def probe_round(repeats: int):
    for nbytes, (f, x) in probe_x.items():
      jax.block_until_ready(f(x))
      for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        samples[nbytes].append(time.perf_counter() - t0)

  def fit(name: str) -> NetworkModel:
    """alpha, beta by least squares in absolute seconds over the per-size medians: an iteration is a
    sum of seconds that the large messages dominate (a relative-error fit lets a 4 ms scheduler tick
    on a 4 KiB message pull beta down)."""
    med = np.asarray([np.median(samples[n]) for n in sizes])
    x = np.asarray(sizes, np.float64)
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), med, rcond=None)
    a, b = max(float(a), 0.0), max(float(b), 0.0)
    p = ndev
    resid = float(np.sqrt(np.mean((a + b * x - med) ** 2)))
    return NetworkModel(alpha_s=a / (2 * (p - 1)), beta_s_per_byte=b * p / (2 * (p - 1)), workers=p,
                        overlap=True, name=name, fit_residual_s=resid)

  t_probe = time.perf_counter()
  probe_round(args.probe_repeats)
  net = fit("replay-probe:median (up front)")
  log(f"probe: alpha {net.alpha_s * 1e6:.1f} us/step, beta {net.beta_s_per_byte * 1e9:.2f} ns/B, residual "
      f"{(net.fit_residual_s or 0) * 1e6:.0f} us ({time.perf_counter() - t_probe:.1f} s); trace {args.trace}: "
      f"{len(profile.rows)} rows, {profile.total_nbytes / 1e6:.1f} MB, backward {profile.backward_s * 1e3:.1f} ms")

  # 2. plan every policy (rank 0), broadcast, build and warm each chunk's all-reduce
  scheds, work = {}, {}
  for name in args.policies:
    sched = plan(profile, net, name) if rank == 0 else None
    scheds[name] = broadcast_schedule(sched)
    items = []
    for c in scheds[name].chunks:
      f, x = buffer(c.size, c.dtype)
      ready = max(profile.rows[r].ready_s for r in c.rows)
      items.append((ready, f, x))
    work[name] = items
  for name in args.policies:
    for _, f, x in work[name]:
      jax.block_until_ready(f(x))
  log(f"compiled {len(fns)} all-reduce sizes for {len(args.policies)} policies")

  tail_s = profile.update_s + profile.forward_s

  def iteration(items) -> float:
    events = [threading.Event() for _ in items]
    ends: list[float] = []

    def comm():
      for ev, (_, f, x) in zip(events, items):
        ev.wait()
        jax.block_until_ready(f(x))
        ends.append(time.perf_counter())

    th = threading.Thread(target=comm, daemon=True)
    barrier()
    th.start()
    t0 = time.perf_counter()
    for t_ready, k in sorted((it[0], k) for k, it in enumerate(items)):
      delay = t0 + t_ready - time.perf_counter()
      if delay > 0:
        time.sleep(delay)
      events[k].set()
    delay = t0 + profile.backward_s - time.perf_counter()
    if delay > 0:
      time.sleep(delay)
    th.join()
    time.sleep(tail_s)  # the update and the next forward, after the last all-reduce
    return time.perf_counter() - t0

  times = {k: [] for k in args.policies}
  for r in range(args.iterations):
    probe_round(2)  # the link re-probed between rounds: the fit sees the same machine load
    order = list(args.policies)
    np.random.default_rng(r).shuffle(order)  # the same order on both processes
    for name in order:
      times[name].append(iteration(work[name]))
  upfront = net
  net = fit("replay-probe:median (all rounds)")
  log(f"probe over all rounds: alpha {net.alpha_s * 1e6:.1f} us/step, beta {net.beta_s_per_byte * 1e9:.2f} ns/B")

  rows = []
  for name in args.policies:
    sim = simulate(scheds[name], profile, net)
    m = float(np.median(times[name]))
    up = simulate(scheds[name], profile, upfront).iteration_s
    rows.append(dict(policy=name, allreduces=scheds[name].num_allreduces, predicted_s=sim.iteration_s,
                     predicted_upfront_probe_s=up, upfront_error=(up - float(np.median(times[name]))) /
                     float(np.median(times[name])),
                     measured_median_s=m, measured_min_s=float(np.min(times[name])),
                     error=(sim.iteration_s - m) / m, compute_s=profile.compute_s,
                     comm_s=sim.comm_s))
    log(f"{name:9s} {scheds[name].num_allreduces:3d} all-reduces  predicted {sim.iteration_s * 1e3:8.1f} ms  "
        f"measured {m * 1e3:8.1f} ms  error {(sim.iteration_s - m) / m * 100:+5.1f}%")
  if rank == 0 and args.result:
    Path(args.result).write_text(json.dumps(dict(
        network=net.to_dict(), network_upfront=upfront.to_dict(),
        probe=dict(sizes=sizes, median_s=[float(np.median(samples[n])) for n in sizes],
                   samples=[len(samples[n]) for n in sizes]), trace=args.trace,
        compute_scale=args.compute_scale, compute_s=profile.compute_s, backward_s=profile.backward_s,
        total_gradient_bytes=profile.total_nbytes, policies=rows), indent=1))
  return 0


def parent(args: argparse.Namespace) -> int:
  from _netns import run_rates, skip_reason, write_results

  reason = skip_reason()
  if reason:
    print(f"bench/replay.py: skipped: {reason}.")
    return 0
  results = dict(command="python " + " ".join(shlex.quote(a) for a in sys.argv), trace=args.trace,
                 compute_scale=args.compute_scale, iterations=args.iterations,
                 started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), host_cpus=os.cpu_count())
  worker = [sys.executable, str(Path(__file__).resolve()), "--worker",
            "--trace", args.trace, "--compute-scale", str(args.compute_scale),
            "--iterations", str(args.iterations), "--probe-repeats", str(args.probe_repeats),
            "--policies", *args.policies]
  results["rates"] = run_rates(args.rates, worker, port=PORT, bench="bench/replay.py")
  write_results(results, args.out, merge=args.merge)
  print(format_table(results))
  print(f"written to {args.out}")
  return 0


def format_table(results: dict) -> str:
  lines = []
  for rate, r in results["rates"].items():
    if "policies" not in r:
      lines.append(f"{rate}: failed")
      continue
    net = r["network"]
    lines.append(f"\n{rate}, trace {r['trace']} (compute x{r['compute_scale']:g}: backward "
                 f"{r['backward_s'] * 1e3:.0f} ms, {r['total_gradient_bytes'] / 1e6:.1f} MB): probed alpha "
                 f"{net['alpha_s'] * 1e6:.0f} us/step, beta {net['beta_s_per_byte'] * 1e9:.2f} ns/B over all "
                 f"rounds (up front: {r['network_upfront']['alpha_s'] * 1e6:.0f} us/step, "
                 f"{r['network_upfront']['beta_s_per_byte'] * 1e9:.2f} ns/B)")
    lines.append("| policy | all-reduces | predicted ms (overlap) | measured ms (median) | error | "
                 "predicted with the up-front probe | error |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p in r["policies"]:
      lines.append(f"| {p['policy']} | {p['allreduces']} | {p['predicted_s'] * 1e3:.1f} | "
                   f"{p['measured_median_s'] * 1e3:.1f} | {p['error'] * 100:+.1f}% | "
                   f"{p['predicted_upfront_probe_s'] * 1e3:.1f} | {p['upfront_error'] * 100:+.1f}% |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rates", nargs="+", default=["1gbit"])
  p.add_argument("--trace", default="resnet50-v100", help="a bundled trace (resnet50-v100, vgg16-v100, ...)")
  p.add_argument("--compute-scale", type=float, default=1.0,
                 help="multiply the trace's times (a slower or faster device)")
  p.add_argument("--policies", nargs="+", default=list(POLICIES))
  p.add_argument("--iterations", type=int, default=5, help="replayed iterations per policy (median)")
  p.add_argument("--probe-repeats", type=int, default=15)
  p.add_argument("--out", default=str(HERE / "results" / "replay.json"))
  p.add_argument("--merge", action="store_true", help="keep other rates already in --out")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
  sys.exit(main())
