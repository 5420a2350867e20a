"""`prophet-jax demo` (= `make demo`): profile, probe, plan every policy, measure, train with `auto`.

On 8 host devices (the CLI sets XLA_FLAGS before it imports this module, so before jax starts): profile a
real step of a small model, probe the all-reduce's alpha and beta, plan every policy, measure each
policy's scheduled step beside the simulator's prediction, then train with the `auto` plan, showing the
loss fall. Writes a timeline PNG (predicted Gantt per policy, measured beside it) and a Chrome trace
(Perfetto) to `out_dir`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
import optax
from tqdm import tqdm

import prophet_jax as pj
from prophet_jax import POLICIES
from prophet_jax._planning._timeline import plot_timelines
from prophet_jax.models import get_model

DEMO_MODEL = "cnn"
AXIS = "dp"


def _median_step_s(step, state, batch, repeats: int) -> float:
  """The median wall-clock seconds of `repeats` calls of `state = step(*state, batch)`, each waited for."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(*state, batch))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _train_step(loss_fn, tx):
  """A plain user train step under jax.pmap: grads per device, the transformation reduces them."""
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

  return jax.pmap(step, axis_name=AXIS)


def _pmean_tx(tx):
  """The baseline: XLA's own reduction (a per-leaf pmean, which XLA combines), then tx."""
  def update(grads, state, params=None):
    return tx.update(jax.lax.pmean(grads, AXIS), state, params)

  return optax.GradientTransformation(tx.init, update)


def run_demo(*, steps: int = 200, out_dir: str = "out", quick: bool = False, model: str = DEMO_MODEL,
             lr: float = 0.05) -> int:
  """Runs the demo and prints the comparison. Returns 0 (the CLI's exit code).

  Args:
    steps: training steps with the `auto` plan.
    out_dir: where timeline.png, trace.json and demo.json go.
    quick: fewer repeats everywhere (the test of the demo).
    model: a trainable model of `prophet_jax.models`.
    lr: SGD learning rate (momentum 0.9).
  """
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  n = jax.local_device_count()
  if n < 2:
    raise pj.ProphetError(f"the demo needs several devices, found {n}; run it through `prophet-jax demo`, "
                          f"which sets XLA_FLAGS=--xla_force_host_platform_device_count=8.")
  print(f"prophet-jax demo: {n} {jax.devices()[0].platform.upper()} devices, model {model!r}\n")
  m = get_model(model)
  params = m.init(jax.random.key(0))
  make = lambda k: m.make_batch(jax.random.key(k), m.default_batch_size * (1 if quick else 2))  # noqa: E731
  tx = optax.sgd(lr, momentum=0.9)

  # 1. profile and probe
  t0 = time.perf_counter()
  profile = pj.profile_step(m.loss_fn, params, make(1), num_devices=n, steps=2 if quick else 4, tx=tx,
                            model=model)
  print(profile.describe(), f"\n  ({time.perf_counter() - t0:.1f} s)\n")
  t0 = time.perf_counter()
  sizes = tuple(int(s) for s in np.geomspace(2**10, 2**20 if quick else 2**22, 5 if quick else 7))
  # the demo predicts the host devices' own steps: it probes them as before, not as a 1 s stand-in
  net = pj.measure_network(n, sizes=sizes, repeats=5 if quick else 12, max_seconds_per_size=5.0,
                           time_budget_s=6.0)
  print(net.describe(), f"\n  ({time.perf_counter() - t0:.1f} s)\n")

  # 2. plan every policy and predict
  # dlcp is lossy (the demo compares lossless steps); fsdp plans parameters sharded over the data axis,
  # which the demo's replicated model is not (and the rewrite does not carry fsdp plans out yet)
  policies = [p for p in POLICIES if p not in ("dlcp", "fsdp")]
  schedules = {p: pj.plan(profile, net, p) for p in policies}
  sims = {p: pj.simulate(s, profile, net) for p, s in schedules.items()}
  print(schedules["auto"].describe(), "\n")

  # 3. measure each policy's real scheduled step (and XLA's own pmean) beside the prediction
  replicate = lambda t: jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)), t)  # noqa: E731
  shard = lambda b: jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), b)  # noqa: E731
  batch = shard(make(2))
  repeats = 4 if quick else 15
  measured: dict[str, float] = {}
  timed = policies if not quick else ["wfbp", "mgwfbp", "dear", "auto"]  # quick: fewer compiles
  txs = {"pmean": _pmean_tx(tx)} | {p: pj.scheduled(tx, schedules[p], axis_name=AXIS) for p in timed}
  steps_of = {name: _train_step(m.loss_fn, t) for name, t in txs.items()}  # compiled once, trained below
  # made where the axis is bound: a sharded plan (dear, ZeRO-1) keeps each device's shard of the state
  start = lambda t: (replicate(params), jax.pmap(t.init, axis_name=AXIS)(replicate(params)))  # noqa: E731
  for name, t in tqdm(txs.items(), desc="measuring policies", leave=False):
    step = steps_of[name]
    state = step(*start(t), batch)[:2]  # compile
    measured[name] = _median_step_s(lambda p, o, b: step(p, o, b)[:2], state, batch, repeats)
  print(f"{'policy':10s} {'chunks':>6s} {'predicted ms':>13s} {'measured ms':>12s} {'error':>7s}")
  rows = []
  for p in timed:
    pred, meas = sims[p].iteration_s, measured[p]
    s = schedules[p]
    rows.append({"policy": p, "allreduces": sims[p].allreduces, "predicted_s": pred, "measured_s": meas,
                 **({"reduce_scatters": s.num_reduce_scatters, "all_gathers": s.num_all_gathers}
                    if s.num_reduce_scatters else {})})
    chunks = f"{s.num_reduce_scatters}+{s.num_all_gathers}" if s.num_reduce_scatters else str(sims[p].allreduces)
    print(f"{p:10s} {chunks:>6s} {pred * 1e3:13.2f} {meas * 1e3:12.2f} {(pred - meas) / meas:+7.1%}")
  print(f"{'pmean':10s} {'(xla)':>6s} {'':13s} {measured['pmean'] * 1e3:12.2f}\n")

  # 4. train with the auto plan
  step, (p_, o_) = steps_of["auto"], start(txs["auto"])
  losses = []
  bar = tqdm(range(steps), desc="training (auto plan)", unit="step")
  for k in bar:
    p_, o_, loss = step(p_, o_, shard(make(100 + k)))
    losses.append(float(loss[0]))
    if k % 10 == 0:
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
  bar.close()
  marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
  print("loss: " + "  ".join(f"step {k}: {losses[k]:.4f}" for k in marks))
  print(f"the loss fell from {losses[0]:.4f} to {np.mean(losses[-5:]):.4f} (mean of the last 5 steps)\n")

  # 5. pictures and data
  plot_timelines({p: sims[p] for p in timed}, str(out / "timeline.png"), measured_s=measured,
                 title=f"{model} on {n} CPU devices: predicted timelines, measured step beside them")
  trace = sims["auto"].to_chrome_trace(pid=0, name="auto: simulated")
  t = 0.0
  for p in timed:  # the measured steps, one after another, on a second process row
    trace["traceEvents"].append({"ph": "X", "name": f"{p} step (measured median)", "cat": "measured",
                                 "pid": 1, "tid": 0, "ts": t * 1e6, "dur": measured[p] * 1e6})
    t += measured[p]
  trace["traceEvents"].append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "measured"}})
  (out / "trace.json").write_text(json.dumps(trace))
  (out / "demo.json").write_text(json.dumps({
      "model": model, "devices": n, "network": net.to_dict(), "profile_method": profile.method,
      "policies": rows, "pmean_measured_s": measured["pmean"], "losses": losses}, indent=1))
  print(f"wrote {out / 'timeline.png'}, {out / 'trace.json'} (open in https://ui.perfetto.dev), {out / 'demo.json'}")
  return 0
