"""Does the simulator, fed the measured profile and the probed network, predict real step times?

For each model (cnn, gpt-tiny) on 8 host CPU devices:
  1. profile_step of the real gradient step (method 'measured': the profiler's trace), with the
     optimizer's update time (optax.sgd, momentum 0.9);
  2. measure_network over 1 KiB .. 4 MiB (alpha and beta fitted on MEDIANS; overlap=False on the CPU,
     where a collective blocks the executor);
  3. for every policy: plan, simulate (plain step), then time the real scheduled step
     (`prophet_jax.scheduled(tx, schedule)` inside a plain user `jax.pmap` train step) and report the
     MEDIAN step time against the prediction.

Target: |predicted - measured| / measured <= 15% for every policy. Beside the prediction with the
probe's alpha: one with the network's `skew` (an interleaved probe); one with the start-up an
all-reduce pays *inside this step*, the slope between the xla (fewest all-reduces) and priority
(most) steps measured in the same rounds (those two are calibration there, the other five
predictions); one with the profile's compute set to the "local" step's median (the same train step
with no reduction at all) measured *in the same rounds*, which separates the communication model's
error from the machine's drift between the profile and the timing; and one with both. No GPU in
this run: the GPU part of the issue (ResNet-50 / BERT-base measured traces) is not done here.

The host's load is recorded (os.getloadavg before and after): on a shared machine, other processes
preempt the 8 device threads, and every all-reduce waits for the last one, so policies with many
chunks (many rendezvous) suffer most in the median; the 10th percentile is reported beside it.

Run:  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/profile_accuracy.py
Writes bench/results/profile_accuracy.json. Never asserts.
"""

from __future__ import annotations

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

AXIS = "dp"
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
# the in-step column's calibration: the fewest and the most all-reduces (their errors there are fits)
CAL_ONE, CAL_MANY = "xla", "priority"


def _train_step(loss_fn, tx):
  import jax
  import optax

  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.pmap(step, axis_name=AXIS)


def _pmean_tx(tx):
  import jax
  import optax

  def update(grads, state, params=None):
    return tx.update(jax.lax.pmean(grads, AXIS), state, params)

  return optax.GradientTransformation(tx.init, update)


def _walls(step, state, batch, repeats: int) -> list[float]:
  """Wall seconds of `repeats` calls of `state = step(*state, batch)`, each waited for."""
  import jax

  walls = [time.perf_counter()]
  for _ in range(repeats):
    state = jax.block_until_ready(step(*state, batch))
    walls.append(time.perf_counter())
  return np.diff(walls).tolist()


def run(models, *, n: int, repeats: int, rounds: int, profile_steps: int, probe_repeats: int) -> dict:
  import jax
  import optax

  import prophet_jax as pj
  from prophet_jax.models import get_model

  sizes = tuple(int(s) for s in np.geomspace(2**10, 2**22, 9))
  t0 = time.perf_counter()
  timings = pj.probe(n, sizes=sizes, repeats=probe_repeats, max_seconds_per_size=10.0)
  net = timings.fit("median")
  print(timings.describe(net), f"\n  ({time.perf_counter() - t0:.1f} s)\n", flush=True)
  # the skew of devices that share cores, measured apart (an interleaved probe): a second prediction
  skewed = pj.probe(n, sizes=sizes[:2], repeats=probe_repeats, interleave=True,
                                   max_seconds_per_size=10.0)
  net_skew = net.replace(skew=skewed.skew)
  print(f"skew {skewed.skew:.3f} (compute per round {[round(c * 1e6) for c in skewed.compute_s]} us)\n",
        flush=True)
  out = {"devices": n, "platform": jax.devices()[0].platform, "host": platform.node(),
         "jax": jax.__version__, "network": net.to_dict(), "skew": skewed.skew,
         "probe": {"sizes": list(timings.sizes), "median_s": list(timings.median_s),
                   "low_s": list(timings.low_s), "percentile": timings.percentile},
         "repeats": repeats, "rounds": rounds, "loadavg_before": os.getloadavg(),
         "cpu_count": os.cpu_count(), "models": {}}
  for name in models:
    m = get_model(name)
    params = m.init(jax.random.key(0))
    batch_g = m.make_batch(jax.random.key(1), m.default_batch_size)
    tx = optax.sgd(0.05, momentum=0.9)
    t0 = time.perf_counter()
    prof = pj.profile_step(m.loss_fn, params, batch_g, num_devices=n, steps=profile_steps, tx=tx,
                           model=name)
    print(prof.describe(), f"\n  ({time.perf_counter() - t0:.1f} s)\n", flush=True)
    schedules = {p: pj.plan(prof, net, p) for p in POLICIES}
    sims = {p: pj.simulate(s, prof, net) for p, s in schedules.items()}
    sims_skew = {p: pj.simulate(s, prof, net_skew) for p, s in schedules.items()}
    replicate = lambda t: jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)), t)  # noqa: E731
    batch = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch_g)
    batch = jax.pmap(lambda b: b)(batch)  # already on the devices, sharded as pmap wants: no transfer per step
    # "local": the same step with no reduction at all (each device applies its own gradients): its
    # time, measured in the same rounds as the policies, is the compute the steps had then
    txs = ({"pmean": _pmean_tx(tx), "local": tx}
           | {p: pj.scheduled(tx, s, axis_name=AXIS) for p, s in schedules.items()})
    steps, states = {}, {}
    for k, t in txs.items():
      steps[k] = _train_step(m.loss_fn, t)
      states[k] = steps[k](replicate(params), replicate(t.init(params)), batch)  # compile + warm up
      jax.block_until_ready(states[k])
    samples: dict[str, list[float]] = {k: [] for k in txs}
    for _ in range(rounds):  # interleave policies so load changes hit all of them alike
      for k in txs:
        samples[k] += _walls(steps[k], states[k], batch, repeats)
    # the start-up one all-reduce pays inside this step, from the slope between the two calibration
    # policies measured in the same rounds (one all-reduce for everything, one per layer): a prediction
    # with it in place of the probe's alpha (bench/shaped.py does the same across processes)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    n_lo, n_hi = sims[CAL_ONE].allreduces, sims[CAL_MANY].allreduces
    startup = max((med[CAL_MANY] - med[CAL_ONE]) / max(n_hi - n_lo, 1), 0.0)
    net_in = net.replace(alpha_s=startup / (2 * (n - 1)), name="in-step start-up")
    sims_in = {p: pj.simulate(s, prof, net_in) for p, s in schedules.items()}
    # the profile's shape with the compute of the same rounds (the local step's median): separates
    # the error of the communication model from the drift of the machine between profile and timing
    same = prof.scaled(med["local"] / prof.compute_s)
    sims_same = {p: pj.simulate(s, same, net) for p, s in schedules.items()}
    sims_same_in = {p: pj.simulate(s, same, net_in) for p, s in schedules.items()}
    print(f"local step (no reduction) {med['local'] * 1e3:.3f} ms in the rounds; profiled compute "
          f"{prof.compute_s * 1e3:.3f} ms")
    print(f"in-step start-up per all-reduce {startup * 1e6:.0f} us (probe: "
          f"{net.alpha_s * 2 * (n - 1) * 1e6:.0f} us), from {CAL_ONE} ({n_lo}) and {CAL_MANY} ({n_hi})")
    rows = []
    print(f"{name}: {'policy':9s} {'chunks':>6s} {'predicted ms':>13s} {'measured ms':>12s} "
          f"{'p10 ms':>8s} {'error':>7s} {'w/ skew':>8s} {'in-step':>8s} {'same-rd':>8s} {'both':>7s}")
    for p in POLICIES:
      pred, meas = sims[p].iteration_s, med[p]
      err = (pred - meas) / meas
      p10 = float(np.percentile(samples[p], 10))
      err_skew = (sims_skew[p].iteration_s - meas) / meas
      err_in = (sims_in[p].iteration_s - meas) / meas
      err_same = (sims_same[p].iteration_s - meas) / meas
      err_both = (sims_same_in[p].iteration_s - meas) / meas
      rows.append({"policy": p, "allreduces": sims[p].allreduces, "predicted_s": pred,
                   "measured_median_s": meas, "measured_p10_s": p10, "error": err,
                   "error_vs_p10": (pred - p10) / p10, "within_15pct": abs(err) <= 0.15,
                   "predicted_with_skew_s": sims_skew[p].iteration_s, "error_with_skew": err_skew,
                   "predicted_in_step_s": sims_in[p].iteration_s, "error_in_step": err_in,
                   "predicted_same_round_compute_s": sims_same[p].iteration_s,
                   "error_same_round_compute": err_same,
                   "predicted_same_round_compute_in_step_s": sims_same_in[p].iteration_s,
                   "error_same_round_compute_in_step": err_both,
                   "calibration": p in (CAL_ONE, CAL_MANY)})
      print(f"{'':{len(name) + 2}s}{p:9s} {sims[p].allreduces:6d} {pred * 1e3:13.3f} {meas * 1e3:12.3f} "
            f"{p10 * 1e3:8.3f} {err:+7.1%} {err_skew:+8.1%} {err_in:+8.1%}"
            f" {err_same:+8.1%} {err_both:+7.1%}"
            f"{' (calibration)' if p in (CAL_ONE, CAL_MANY) else ''}")
    pm = float(np.median(samples["pmean"]))
    print(f"{'':{len(name) + 2}s}{'pmean':9s} {'(xla)':>6s} {'':13s} {pm * 1e3:12.3f}\n", flush=True)
    out["models"][name] = {"profile": prof.to_dict(), "results": rows, "pmean_median_s": pm,
                           "in_step_startup_s": startup, "local_median_s": med["local"],
                           "loadavg_after": os.getloadavg(),
                           "max_abs_error": max(abs(r["error"]) for r in rows)}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["cnn", "gpt-tiny"])
  ap.add_argument("--repeats", type=int, default=4, help="timed steps per policy per round")
  ap.add_argument("--rounds", type=int, default=10, help="rounds over all policies (interleaved)")
  ap.add_argument("--profile-steps", type=int, default=60)
  ap.add_argument("--probe-repeats", type=int, default=15)
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_accuracy.json"))
  a = ap.parse_args()
  import jax

  n = jax.local_device_count()
  res = run(a.models, n=n, repeats=a.repeats, rounds=a.rounds, profile_steps=a.profile_steps,
            probe_repeats=a.probe_repeats)
  res["command"] = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python "
                    "bench/profile_accuracy.py " + " ".join(
                        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                        for k, v in vars(a).items() if k != "out"))
  res["gpu"] = "not run: no GPU in this session"
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps(res, indent=1))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
