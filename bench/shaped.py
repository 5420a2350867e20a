"""Real 2-process training over a shaped link: measured step time against the simulator, per policy.

Two processes, each in its own network namespace, joined by a veth pair capped with `tc ... tbf`
(1 Gbit/s, and a second rate, 100 Mbit/s by default, where communication weighs more). gloo is bound
to the veth (the private call of prophet_jax._multiprocess._distributed; the coordinator listens on the veth address of
rank 0's namespace). Model: `resnet-small` at 32 images per process (1 CPU device per process).

Per rate: probe the link (`measure_network` across the two processes), profile the step
(`profile_step`, scaled to the measured communication-free step), then per policy: plan on rank 0,
broadcast, predict with `simulate`, and measure the median step time of the real training step
(`scheduled(sgd)` under `shard_map`). Also the step with a plain `lax.pmean` (XLA left alone).

  sudo .venv/bin/python bench/shaped.py                     # writes bench/results/shaped.json
  sudo .venv/bin/python bench/shaped.py --pin               # rank i on core i only (taskset)
  sudo .venv/bin/python bench/shaped.py --rates 1gbit --steps 20 --out /tmp/s.json

Placement: by default both processes share every core (on a 2-core machine each steals the other's
cores while it computes); `--pin` gives each its own core, as on two machines, but then an
all-reduce inside a step waits one scheduler tick for gloo's thread to be woken (the README has both).

Without root (or without `ip`/`tc`) it prints why and exits 0 without measuring. Every namespace it
creates is deleted by name, even on failure. Bench scripts write JSON and never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

POLICIES = ("xla", "wfbp", "bucket", "mgwfbp", "priority", "prophet", "auto")
MODEL = "resnet-small"
PER_PROCESS_BATCH = 32
PORT = 29517
PROBE_SIZES = (2**10, 2**14, 2**16, 2**18, 2**20, 2**21)
INNER = 3
SYNTH_LEAVES, SYNTH_ELEMS = 16, 256  # a fresh namespace: any port is free


# --------------------------------------------------------------------------------------------------
# worker: runs in a namespace, under prophet_jax.launch


def _median_time(fn, repeats: int) -> tuple[float, float, list[float]]:
  import numpy as np

  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)), float(np.percentile(ts, 10)), ts


def _slowest(x: float) -> float:
  """The largest value over the processes (a step waits for the slower process)."""
  import jax
  import numpy as np

  if jax.process_count() == 1:
    return float(x)
  from jax.experimental import multihost_utils

  return float(np.max(multihost_utils.process_allgather(np.asarray(x, np.float64))))


def worker(args: argparse.Namespace) -> int:
  from prophet_jax.launch import broadcast_schedule, initialize

  initialize()
  import jax
  import numpy as np
  import optax
  from _netns import fit_absolute
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import prophet_jax
  from prophet_jax import NetworkModel, plan, simulate
  from prophet_jax.models import get_model

  rank, ndev = jax.process_index(), jax.device_count()
  model = get_model(MODEL)
  mesh = jax.make_mesh((ndev,), ("dp",))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

  def to_global(tree, sharding):
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]), tree)

  params = jax.device_get(model.init(jax.random.key(0)))
  gbatch = jax.device_get(model.make_batch(jax.random.key(1), PER_PROCESS_BATCH * ndev))
  local_batch = jax.tree_util.tree_map(lambda x: x[rank * PER_PROCESS_BATCH:(rank + 1) * PER_PROCESS_BATCH],
                                       gbatch)
  tx0 = optax.sgd(0.01, momentum=0.9)
  log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

  # 1. the link
  t0 = time.perf_counter()
  timings = prophet_jax.probe(sizes=tuple(2**k for k in range(10, 21, 2)) + (2**21,),
                             repeats=args.probe_repeats, max_seconds_per_size=8.0)
  net, net_low = timings.fit("median"), timings.fit("low")
  log(f"probe: alpha {net.alpha_s * 1e6:.1f} us/step, beta {net.beta_s_per_byte * 1e9:.2f} ns/B "
      f"({8 / net.beta_s_per_byte / 1e6 if net.beta_s_per_byte else float('inf'):.0f} Mbit/s), "
      f"residual {net.fit_residual_s * 1e6 if net.fit_residual_s else 0:.0f} us, {time.perf_counter() - t0:.1f} s")

  # 2. the step without communication (one local device): a first measure to plan with
  dev = jax.local_devices()[0]
  lp, lb = jax.device_put(params, dev), jax.device_put(local_batch, dev)
  lopt = jax.device_put(tx0.init(params), dev)

  @jax.jit
  def local_step(p, o, b):
    loss, g = jax.value_and_grad(model.loss_fn)(p, b)
    u, o = tx0.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  lstate = (lp, lopt)
  def run_local():
    nonlocal lstate
    p, o, _ = local_step(*lstate, lb)
    lstate = (p, o)
    jax.block_until_ready(p)
  for _ in range(3):
    run_local()
  first_compute_s = _slowest(_median_time(run_local, 10)[0])
  try:
    from prophet_jax import profile_step

    prof = profile_step(model.loss_fn, params, local_batch, num_devices=1, tx=tx0, model=MODEL)
    how = f"profile_step ({prof.method})"
  except Exception as e:  # noqa: BLE001 - fall back to an estimate from the sizes
    prof = prophet_jax.GradientProfile.from_params(params, forward_s=first_compute_s / 3,
                                                   backward_s=2 * first_compute_s / 3, model=MODEL)
    how = f"from_params (profile_step failed: {type(e).__name__})"
  profile = prof.scaled(first_compute_s / prof.compute_s) if prof.compute_s > 0 else prof

  # 3. per policy: plan (rank 0) and broadcast; compile every variant
  gparams, gbatch_arr = to_global(params, rep), to_global(gbatch, split)

  def make_runner(tx, reduce_in_step: bool):
    def step(p, o, b):
      pv = jax.lax.pcast(p, "dp", to="varying")
      loss, g = jax.value_and_grad(model.loss_fn)(pv, b)
      if reduce_in_step:
        g = jax.lax.pmean(g, "dp")
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P())))
    st = (gparams, to_global(jax.device_get(tx.init(params)), rep))
    def run():
      nonlocal st
      st = f(*st, gbatch_arr)
      jax.block_until_ready(st[0])
    run()
    return run

  def make_sync_runner():
    """The step with no gradient all-reduce, but one scalar psum: compute + dispatch + the lockstep
    of two processes (each step waits for the slower one), what every real step also pays."""
    def step(p, o, b):
      loss, g = jax.value_and_grad(model.loss_fn)(p, b)
      u, o = tx0.update(g, o, p)
      return optax.apply_updates(p, u), o, jax.lax.psum(loss, "dp")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P(), P()),
                              check_vma=False))
    st = (gparams, to_global(jax.device_get(tx0.init(params)), rep))
    def run():
      nonlocal st
      p_, o_, l_ = f(*st, gbatch_arr)
      st = (p_, o_)
      jax.block_until_ready(l_)
    run()
    return run

  scheds, runners = {}, {"compute-only": make_sync_runner()}
  for name in args.policies:
    sched = plan(profile, net, name) if rank == 0 else None
    scheds[name] = broadcast_schedule(sched, params)
    runners[name] = make_runner(prophet_jax.scheduled(tx0, scheds[name], axis_name="dp"), False)
  runners["pmean"] = make_runner(tx0, True)

  # the link probed again inside the rounds (paired 1 vs 1+INNER chained psums, as measure_network
  # does), so the network model sees the same machine load as the steps it predicts
  def chain(k: int):
    def body(x):
      return jax.lax.fori_loop(0, k, lambda _, y: jax.lax.psum(y, "dp") * 0.5, x)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
  short, long_ = chain(1), chain(1 + INNER)
  probe_x = {}
  for nbytes in PROBE_SIZES:
    probe_x[nbytes] = jax.make_array_from_process_local_data(
        split, np.ones(nbytes // 4, np.float32), (nbytes // 4 * ndev,))
    for f in (short, long_):
      jax.block_until_ready(f(probe_x[nbytes]))
  diffs: dict[int, list[float]] = {n: [] for n in PROBE_SIZES}

  # the start-up of one all-reduce as the rewrite issues it inside a step: a synthetic tree of
  # SYNTH_LEAVES small leaves reduced by `allreduce` as one chunk per leaf, against one chunk for all
  synth = {f"l{i:02d}": {"w": np.zeros(SYNTH_ELEMS, np.float32)} for i in range(SYNTH_LEAVES)}
  sprof = prophet_jax.GradientProfile.from_params(synth, backward_s=1e-3)
  s_many, s_one = plan(sprof, net, "wfbp"), plan(sprof, net, "xla")

  def synth_prog(sched):
    return jax.jit(jax.shard_map(lambda t: prophet_jax.allreduce(t, sched, "dp"), mesh=mesh,
                                 in_specs=P("dp"), out_specs=P()))
  synth_many, synth_one = synth_prog(s_many), synth_prog(s_one)
  synth_x = to_global({k: {"w": np.ones(SYNTH_ELEMS * ndev, np.float32)} for k in synth}, split)
  for f in (synth_many, synth_one):
    jax.block_until_ready(f(synth_x))
  extra_chunk: list[float] = []

  def probe_round():
    for nbytes, x in probe_x.items():
      for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(short(x))
        t1 = time.perf_counter()
        jax.block_until_ready(long_(x))
        diffs[nbytes].append(max(((time.perf_counter() - t1) - (t1 - t0)) / INNER, 0.0))
    for _ in range(args.steps):
      t0 = time.perf_counter()
      jax.block_until_ready(synth_one(synth_x))
      t1 = time.perf_counter()
      jax.block_until_ready(synth_many(synth_x))
      extra_chunk.append(max(((time.perf_counter() - t1) - (t1 - t0)) /
                             (s_many.num_allreduces - s_one.num_allreduces), 0.0))

  log(f"compiled {len(runners)} variants; timing {args.rounds} interleaved rounds of {args.steps} steps")

  # 4. interleaved rounds (the load of this shared machine drifts: every variant sees the same drift)
  times: dict[str, list[float]] = {k: [] for k in runners}
  for r in range(args.rounds):
    probe_round()
    order = list(runners)
    np.random.default_rng(r).shuffle(order)  # the same order on both processes; no position bias
    for k in order:
      runners[k]()  # untimed: the first step after a switch
      times[k] += _median_time(runners[k], args.steps)[2]
  upfront, upfront_low = net, net_low
  sizes_i = list(PROBE_SIZES)
  net = fit_absolute(sizes_i, [float(np.median(diffs[n])) for n in sizes_i], workers=ndev,
                     overlap=False, name="interleaved-probe:median")
  net_low = fit_absolute(sizes_i, [float(np.percentile(diffs[n], 10)) for n in sizes_i], workers=ndev,
                         overlap=False, name="interleaved-probe:p10")
  # the start-up the step pays per all-reduce (in-step probe), with beta from the interleaved probe
  per_chunk_s = float(np.median(extra_chunk))
  net_chunk = net.replace(alpha_s=per_chunk_s / (2 * (ndev - 1)), name="in-step start-up + interleaved beta")
  log(f"in-step start-up per all-reduce: {per_chunk_s * 1e3:.3f} ms (median of {len(extra_chunk)})")
  log(f"interleaved probe: alpha {net.alpha_s * 1e6:.1f} us/step, beta {net.beta_s_per_byte * 1e9:.2f} ns/B "
      f"(up-front probe: {upfront.alpha_s * 1e6:.1f} us/step, {upfront.beta_s_per_byte * 1e9:.2f} ns/B)")
  # the scalar psum's own cost is the network's start-up: take it out, the simulator adds it back per chunk
  compute_s = float(np.median(times["compute-only"])) - net.allreduce_s(4)
  compute_p10 = float(np.percentile(times["compute-only"], 10)) - net.allreduce_s(4)
  profile = prof.scaled(compute_s / prof.compute_s) if prof.compute_s > 0 else prof
  log(f"compute-only step (lockstep, no gradient all-reduce): median {compute_s * 1e3:.2f} ms (p10 "
      f"{compute_p10 * 1e3:.2f}); "
      f"profile by {how}, scaled x{compute_s / max(prof.compute_s, 1e-12):.2f} to it")
  rows = []
  for name in args.policies:
    sim = simulate(scheds[name], profile, net)
    med = float(np.median(times[name]))
    p10 = float(np.percentile(times[name], 10))
    err = (sim.iteration_s - med) / med
    upfront_pred = simulate(scheds[name], profile, upfront).iteration_s
    chunk_pred = simulate(scheds[name], profile, net_chunk).iteration_s
    floor = simulate(scheds[name], prof.scaled(compute_p10 / prof.compute_s), net_low).iteration_s
    rows.append(dict(policy=name, allreduces=scheds[name].num_allreduces, predicted_s=sim.iteration_s,
                     measured_median_s=med, measured_p10_s=p10, error=err, predicted_floor_s=floor,
                     predicted_upfront_probe_s=upfront_pred, upfront_error=(upfront_pred - med) / med,
                     predicted_in_step_startup_s=chunk_pred, in_step_error=(chunk_pred - med) / med,
                     floor_error=(floor - p10) / p10))
    log(f"{name:9s} {scheds[name].num_allreduces:3d} all-reduces  predicted {sim.iteration_s * 1e3:7.2f} ms  "
        f"measured {med * 1e3:7.2f} ms (p10 {p10 * 1e3:7.2f})  error {err * 100:+5.1f}%")
  med, p10 = float(np.median(times["pmean"])), float(np.percentile(times["pmean"], 10))
  pmean_row = dict(policy="pmean (XLA left alone)", allreduces=None, predicted_s=None,
                   measured_median_s=med, measured_p10_s=p10, error=None)
  log(f"plain pmean step (XLA left alone): measured {med * 1e3:7.2f} ms (p10 {p10 * 1e3:7.2f})")
  if rank == 0 and args.result:
    Path(args.result).write_text(json.dumps(dict(
        network=net.to_dict(), network_low=net_low.to_dict(), network_upfront=upfront.to_dict(),
        network_in_step=net_chunk.to_dict(), in_step_startup_s=per_chunk_s,
        upfront_probe=dict(sizes=timings.sizes, median_s=timings.median_s, low_s=timings.low_s),
        interleaved_probe=dict(sizes=sizes_i, median_s=[float(np.median(diffs[n])) for n in sizes_i],
                               p10_s=[float(np.percentile(diffs[n], 10)) for n in sizes_i]), first_compute_s=first_compute_s, compute_only_median_s=compute_s, compute_only_p10_s=compute_p10,
        profile_method=how, profile_compute_s=profile.compute_s, total_gradient_bytes=profile.total_nbytes,
        policies=rows, pmean=pmean_row), indent=1))
  return 0


# --------------------------------------------------------------------------------------------------
# parent: makes the namespaces, launches the two workers, collects the table


def _speedups(rows: list[dict], pmean: dict) -> dict:
  by = {r["policy"]: r for r in rows}
  out = {}
  if "auto" in by and "wfbp" in by:
    out["auto_over_wfbp_measured"] = by["wfbp"]["measured_median_s"] / by["auto"]["measured_median_s"]
    out["auto_over_wfbp_predicted"] = by["wfbp"]["predicted_s"] / by["auto"]["predicted_s"]
    out["ratio_error"] = out["auto_over_wfbp_measured"] / out["auto_over_wfbp_predicted"] - 1
    if "predicted_in_step_startup_s" in by["auto"]:
      out["auto_over_wfbp_predicted_in_step"] = (by["wfbp"]["predicted_in_step_startup_s"]
                                                 / by["auto"]["predicted_in_step_startup_s"])
      out["ratio_error_in_step"] = out["auto_over_wfbp_measured"] / out["auto_over_wfbp_predicted_in_step"] - 1
  if "auto" in by and "xla" in by:
    out["auto_over_xla_measured"] = by["xla"]["measured_median_s"] / by["auto"]["measured_median_s"]
    out["auto_over_xla_predicted"] = by["xla"]["predicted_s"] / by["auto"]["predicted_s"]
  if "auto" in by:
    out["auto_over_pmean_measured"] = pmean["measured_median_s"] / by["auto"]["measured_median_s"]
  return out


def parent(args: argparse.Namespace) -> int:
  from _netns import run_rates, skip_reason, write_results

  reason = skip_reason()
  if reason:
    print(f"bench/shaped.py: skipped: {reason}.")
    return 0
  results = dict(command="python " + " ".join(shlex.quote(a) for a in sys.argv), model=MODEL,
                 per_process_batch=PER_PROCESS_BATCH, processes=2, devices_per_process=1,
                 steps=args.steps, rounds=args.rounds, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 host_cpus=os.cpu_count(), pinned=args.pin)
  worker = [sys.executable, str(Path(__file__).resolve()), "--worker",
            "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--probe-repeats", str(args.probe_repeats), "--policies", *args.policies]
  results["rates"] = run_rates(args.rates, worker, port=PORT, pin=args.pin, bench="bench/shaped.py")
  for r in results["rates"].values():
    if "policies" in r:
      r["speedups"] = _speedups(r["policies"], r["pmean"])
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
    up = r["network_upfront"]
    lines.append(f"\n{rate}: link probed during the rounds: alpha {net['alpha_s'] * 1e6:.1f} us/step, beta "
                 f"{net['beta_s_per_byte'] * 1e9:.2f} ns/B (up front: {up['alpha_s'] * 1e6:.1f} us/step, "
                 f"{up['beta_s_per_byte'] * 1e9:.2f} ns/B); compute-only step "
                 f"{r['compute_only_median_s'] * 1e3:.2f} ms; gradients {r['total_gradient_bytes'] / 1e3:.0f} kB")
    if "in_step_startup_s" in r:
      lines.append(f"in-step start-up per all-reduce {r['in_step_startup_s'] * 1e3:.3f} ms")
    lines.append("| policy | all-reduces | measured ms (median) | predicted ms | error | predicted, in-step "
                 "start-up | error | floor predicted (p10) | floor measured (p10) | floor error |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p in r["policies"]:
      ins = (f"{p['predicted_in_step_startup_s'] * 1e3:.2f} | {p['in_step_error'] * 100:+.1f}%"
             if "in_step_error" in p else "- | -")
      lines.append(f"| {p['policy']} | {p['allreduces']} | {p['measured_median_s'] * 1e3:.2f} | "
                   f"{p['predicted_s'] * 1e3:.2f} | {p['error'] * 100:+.1f}% | {ins} | "
                   f"{p['predicted_floor_s'] * 1e3:.2f} | {p['measured_p10_s'] * 1e3:.2f} | "
                   f"{p['floor_error'] * 100:+.1f}% |")
    pm = r["pmean"]
    lines.append(f"| plain pmean (XLA alone) | - | {pm['measured_median_s'] * 1e3:.2f} | - | - | - | - | - | "
                 f"{pm['measured_p10_s'] * 1e3:.2f} | - |")
    s = r["speedups"]
    if "auto_over_wfbp_measured" in s:
      lines.append(f"auto over wfbp: measured {s['auto_over_wfbp_measured']:.3f}x, predicted "
                   f"{s['auto_over_wfbp_predicted']:.3f}x (ratio off by {s['ratio_error'] * 100:+.1f}%)")
    if "ratio_error_in_step" in s:
      lines.append(f"  with the in-step start-up: predicted {s['auto_over_wfbp_predicted_in_step']:.3f}x "
                   f"(ratio off by {s['ratio_error_in_step'] * 100:+.1f}%)")
    if "auto_over_xla_measured" in s:
      lines.append(f"auto over xla: measured {s['auto_over_xla_measured']:.3f}x, predicted "
                   f"{s['auto_over_xla_predicted']:.3f}x; over plain pmean: measured "
                   f"{s['auto_over_pmean_measured']:.3f}x")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
  p.add_argument("--policies", nargs="+", default=list(POLICIES))
  p.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
  p.add_argument("--rounds", type=int, default=6, help="interleaved rounds over the variants")
  p.add_argument("--probe-repeats", type=int, default=15)
  p.add_argument("--out", default=str(HERE / "results" / "shaped.json"))
  p.add_argument("--merge", action="store_true", help="keep other rates already in --out")
  p.add_argument("--pin", action="store_true",
                 help="run rank i on core i only (taskset), as on two machines: no core contention")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
  sys.exit(main())
