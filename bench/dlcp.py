"""DLCP in software (issue 18): simulated speed under network pressure; convergence (the jax half).

Parts (`--part`, default `speed`):

* `speed`: the simulated iteration of `dlcp` at max_defer 0.05 / 0.1 / 0.25 against every lossless
  policy (`wfbp`, `bucket`, `xla`, `mgwfbp`, `priority`, `prophet`, `auto`), each planned for the
  same network (calm or pressured), on the bundled traces (resnet50, vgg16, bert-base, gpt2 on v100
  and h100), 8 workers on 10gbe and 100gb-ib, both step modes, on a calm network and under pressure
  (`PRESSURE`: competing flows, heavy-tailed delays; the mean over 64 seeded samples, with p50 and
  p99). Also: the calm cells where communication is hidden (dlcp must be auto's plan exactly: no
  loss when calm), dlcp against the lossless lower bound (below 1: what no lossless schedule can
  do), and what pressure costs the simulator and dlcp's planner. Times are the simulator's
  predictions.
* `convergence`: training with dlcp's deferral and error feedback (cnn, gpt-tiny; max_defer 0 /
  0.05 / 0.1 / 0.25, with and without error feedback, 3 seeds, 300 steps, global batch 4x the
  model's default, sgd-momentum through `scheduled` under pmap on 8 host devices): the eval loss
  after the same steps against the lossless plan's, steps to a target training loss, the curves in
  bench/results/dlcp_convergence.png (about 5 minutes on 2 shared cores).

Prints a table per part; writes bench/results/dlcp_<part>.json; never asserts.

    .venv/bin/python bench/dlcp.py                 # --part speed
    .venv/bin/python bench/dlcp.py --part speed --quick
    .venv/bin/python bench/dlcp.py --part convergence   # --quick: 60 steps, one seed, no files
"""

from __future__ import annotations

import os

# the convergence part trains on 8 host devices (the speed part never imports jax)
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import pathlib
import statistics
import sys
import time

from prophet_jax import NetworkModel, lower_bound, plan, simulate
from prophet_jax import Pressure
from prophet_jax.models import load_trace

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
DEVICES = ("v100", "h100")
NETWORKS = ("10gbe", "100gb-ib")
WORKERS = 8
# every lossless policy, each planned for the cell's network (under pressure: the pressured one);
# auto last (the ratios' reference and dlcp's starting plan). All-reduce plans only: `dear` (sharded,
# ZeRO-1: another optimizer-state layout) is compared with them in bench/dear.py.
BASELINES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
MAX_DEFER = (0.05, 0.1, 0.25)
# A shared network: on average 0.3 other flows on the bottleneck (a message's bytes take 1.3x as long
# on average), and 1 ring step in 500 delayed by a Pareto(1.5) delay of at least 5 ms (a retransmission
# timeout's order): with 8 workers about 2.8% of all-reduces are hit.
PRESSURE = Pressure(background_flows=0.3, tail_prob=0.002, tail_scale_s=0.005, tail_shape=1.5,
                    samples=64, seed=0)
RESULTS = pathlib.Path(__file__).parent / "results"


def _run(profile, net, name, cross_step, **options):
  t = time.perf_counter()
  s = plan(profile, net, name, cross_step=cross_step, **options)
  plan_s = time.perf_counter() - t
  r = simulate(s, profile, net, cross_step=cross_step, events=False)
  return s, r, plan_s


def speed(quick: bool = False) -> dict:
  """The speed part: a row per (trace, network, step mode, calm or pressure)."""
  rows = []
  models = MODELS[:2] if quick else MODELS
  names = list(BASELINES) + [f"dlcp@{f}" for f in MAX_DEFER]
  print(f"{'trace':15s} {'network':8s} {'step':5s} {'net':5s} {'auto ms':>9s} {'p99':>8s} "
        + " ".join(f"{n:>9s}" for n in names[:-4] + names[-3:]) + f" {'deferred':>8s} {'/lossless lb':>12s}")
  for model in models:
    for dev in DEVICES:
      profile = load_trace(f"{model}-{dev}")
      for net_name in NETWORKS:
        for cross_step in (False, True):
          for pressed in (False, True):
            net = NetworkModel.preset(net_name, workers=WORKERS)
            if pressed:
              net = net.replace(pressure=PRESSURE)
            cell = {"trace": f"{model}-{dev}", "network": net_name, "workers": WORKERS,
                    "cross_step": cross_step, "pressure": pressed,
                    "lossless_bound_s": lower_bound(profile, net, cross_step=cross_step),
                    "compute_s": profile.compute_s, "policies": {}}
            for name in names:
              pol, opts = (name.split("@")[0], {"max_defer": float(name.split("@")[1])}) if "@" in name \
                  else (name, {})
              s, r, plan_s = _run(profile, net, pol, cross_step, **opts)
              cell["policies"][name] = {
                  "iteration_s": r.iteration_s, "iteration_p50_s": r.iteration_p50_s,
                  "iteration_p99_s": r.iteration_p99_s, "allreduces": r.allreduces,
                  "deferred_fraction": s.max_deferred_fraction, "plan_s": plan_s,
                  "decision": dict(s.options).get("decision"),
                  "same_plan_as_auto": None}
              if pol == "dlcp":
                cell["policies"][name]["same_plan_as_auto"] = s.buckets == cell["_auto_buckets"]
              if name == "auto":
                cell["_auto_buckets"] = s.buckets
            del cell["_auto_buckets"]
            auto = cell["policies"]["auto"]
            cell["hidden"] = auto["iteration_s"] <= 1.01 * _compute_only(profile, net, cross_step)
            rows.append(cell)
            top = cell["policies"][names[-1]]
            print(f"{cell['trace']:15s} {net_name:8s} {'pipe' if cross_step else 'plain':5s} "
                  f"{'press' if pressed else 'calm':5s} {auto['iteration_s'] * 1e3:9.2f} "
                  f"{(auto['iteration_p99_s'] or auto['iteration_s']) * 1e3:8.2f} "
                  + " ".join(f"{cell['policies'][n]['iteration_s'] / auto['iteration_s']:9.3f}"
                             for n in names[:-4] + names[-3:])
                  + f" {top['deferred_fraction']:8.1%} "
                  f"{top['iteration_s'] / cell['lossless_bound_s']:12.3f}"
                  + ("  (hidden)" if cell["hidden"] else ""))
  summary = _summary(rows)
  print()
  for k, v in summary.items():
    print(f"{k}: {v}")
  cost = _cost()
  for k, v in cost.items():
    print(f"{k}: {v}")
  return {"workers": WORKERS, "networks": NETWORKS, "pressure": PRESSURE.to_dict(),
          "max_defer": MAX_DEFER, "summary": summary, "cost": cost, "cells": rows}


def _compute_only(profile, net, cross_step) -> float:
  """The iteration on a free network (every all-reduce instant)."""
  free = net.replace(alpha_s=0.0, beta_s_per_byte=0.0, pressure=None)
  return simulate(plan(profile, free, "wfbp", cross_step=cross_step), profile, free,
                  cross_step=cross_step, events=False).iteration_s


def _summary(rows: list[dict]) -> dict:
  out = {}
  for pressed in (False, True):
    tag = "pressure" if pressed else "calm"
    cells = [c for c in rows if c["pressure"] is pressed]
    bound_cells = [c for c in cells if not c["hidden"]]
    for f in MAX_DEFER:
      key = f"dlcp@{f}"
      ratios = [c["policies"][key]["iteration_s"] / c["policies"]["auto"]["iteration_s"] for c in bound_cells]
      if ratios:
        out[f"{tag}: {key}/auto, median over the {len(ratios)} cells with exposed communication"] = \
            round(statistics.median(ratios), 4)
        out[f"{tag}: {key}/auto, worst"] = round(max(ratios), 4)
      p99 = [c["policies"][key]["iteration_p99_s"] / c["policies"]["auto"]["iteration_p99_s"]
             for c in bound_cells if pressed]
      if p99:
        out[f"{tag}: {key}/auto p99, median"] = round(statistics.median(p99), 4)
      below = sum(c["policies"][key]["iteration_s"] < c["lossless_bound_s"] * (1 - 1e-9) for c in cells)
      out[f"{tag}: {key} below the lossless bound (cells)"] = f"{below} of {len(cells)}"
    for b in BASELINES[:-1]:
      ratios = [c["policies"][b]["iteration_s"] / c["policies"]["auto"]["iteration_s"] for c in cells]
      out[f"{tag}: {b}/auto, median"] = round(statistics.median(ratios), 4)
    # auto against every lossless policy planned for the same network (it must never lose)
    best = [min(c["policies"][b]["iteration_s"] for b in BASELINES) for c in cells]
    out[f"{tag}: auto / the best lossless policy, worst"] = round(
        max(c["policies"]["auto"]["iteration_s"] / b for c, b in zip(cells, best)), 6)
    for f in MAX_DEFER:
      ratios = [c["policies"][f"dlcp@{f}"]["iteration_s"] / b for c, b in zip(cells, best) if not c["hidden"]]
      if ratios:
        out[f"{tag}: dlcp@{f} / the best lossless policy, median over exposed cells"] = \
            round(statistics.median(ratios), 4)
    hidden = [c for c in cells if c["hidden"]]
    same = sum(all(c["policies"][f"dlcp@{f}"]["same_plan_as_auto"] for f in MAX_DEFER) for c in hidden)
    out[f"{tag}: communication hidden, dlcp's plan is auto's (cells)"] = f"{same} of {len(hidden)}"
    worst = max(c["policies"][f"dlcp@{f}"]["iteration_s"] / c["policies"]["auto"]["iteration_s"]
                for c in cells for f in MAX_DEFER)
    out[f"{tag}: dlcp never slower than auto (worst ratio)"] = round(worst, 6)
  return out


def _cost() -> dict:
  """What pressure costs: simulate on 1,000 one-leaf layers (calm vs 64 samples; 1 and 2 links), and
  dlcp's planning time on the largest trace."""
  sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests"))
  from test_simulate import _big

  p, s = _big()
  out = {}
  for links in (1, 2):
    for pressed in (False, True):
      net = NetworkModel.preset("10gbe", workers=8, links=links)
      if pressed:
        net = net.replace(pressure=PRESSURE)
      simulate(s, p, net, events=False)
      best = min(_timed(lambda: simulate(s, p, net, events=False)) for _ in range(7))
      out[f"simulate 1,000 chunks, links={links}, {'64 samples' if pressed else 'calm'} (ms, best of 7)"] = \
          round(best * 1e3, 2)
  prof = load_trace("bert-base-v100")
  for pressed in (False, True):
    net = NetworkModel.preset("10gbe", workers=WORKERS)
    if pressed:
      net = net.replace(pressure=PRESSURE)
    for name, opts in (("auto", {}), ("dlcp", {"max_defer": 0.25})):
      best = min(_timed(lambda: plan(prof, net, name, cross_step=True, **opts)) for _ in range(3))
      out[f"plan {name} bert-base-v100 pipelined, {'pressure' if pressed else 'calm'} (ms, best of 3)"] = \
          round(best * 1e3, 1)
  return out


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


# the convergence part: a bandwidth-bound link (10 MB/s, 1 us per ring step) on which deferral pays for
# these small models, so dlcp defers up to max_defer (its start-ups would cost more than it saves on
# a preset's link: the models are 78-112 kB); the plain step; estimated times.
CONV_MODELS = ("cnn", "gpt-tiny")
CONV_DEFER = (0.0, 0.05, 0.1, 0.25)
CONV_SEEDS = (0, 1, 2)
CONV_LR = {"cnn": 0.02, "gpt-tiny": 0.1}
CONV_NETWORK = dict(alpha_s=1e-6, beta_s_per_byte=1e-7)
# time to target: the first step at which the 10-step moving average of the training loss is at or
# below this (cnn: past its plateau; gpt-tiny: near the bigram task's floor of about 0.77)
CONV_TARGET = {"cnn": 0.1, "gpt-tiny": 0.85}


def _steps_to(curve, target, k=10):
  import numpy as np

  smooth = np.convolve(np.asarray(curve), np.ones(k) / k, mode="valid")
  hit = np.nonzero(smooth <= target)[0]
  return int(hit[0] + k) if hit.size else None


def _conv_schedule(m, params, max_defer):
  import prophet_jax as pj

  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3, model=m.name)
  net = NetworkModel(workers=8, **CONV_NETWORK)
  return pj.plan(profile, net, "dlcp", max_defer=max_defer)


_CONV_STEPS: dict = {}


def _conv_step(m, schedule):
  """(pmapped step(params, opt_state, batch, keep), init), one per (model, schedule): every seed and
  both feedback settings run the same compiled step."""
  key = (m.name, schedule)
  if key in _CONV_STEPS:
    return _CONV_STEPS[key]
  import jax
  import optax

  import prophet_jax as pj

  tx = pj.scheduled(optax.sgd(CONV_LR[m.name], momentum=0.9), schedule, axis_name="d")

  def step(params, opt_state, batch, keep):
    loss, g = jax.value_and_grad(m.loss_fn)(params, batch)
    opt_state = _drop_residual(opt_state, keep)
    upd, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, jax.lax.pmean(loss, "d")

  _CONV_STEPS[key] = (jax.pmap(step, axis_name="d"), jax.pmap(lambda p: (p, tx.init(p)), axis_name="d"))
  return _CONV_STEPS[key]


def _conv_run(m, schedule, steps, seed, batch_size):
  """Trains `m` with scheduled(sgd-momentum) under `schedule` on 8 host devices, from seed `seed`,
  with and without error feedback (the same compiled step: the residual is multiplied by 0 or 1
  before the step, a bench-only switch); returns {feedback: (train losses, eval loss)}."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  n = jax.local_device_count()
  pstep, init = _conv_step(m, schedule)
  params0 = m.init(jax.random.key(seed))
  shard = lambda b: jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), b)  # noqa: E731
  batches = [shard(m.make_batch(jax.random.key(10_000 * seed + t + 1), batch_size)) for t in range(steps)]
  held_out = m.make_batch(jax.random.key(999_999), 4 * batch_size)
  evaluate = jax.jit(m.loss_fn)
  out = {}
  for feedback in ((True, False) if schedule.defers else (True,)):
    keep = np.full((n,), 1.0 if feedback else 0.0, np.float32)
    params, opt_state = init(jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params0))
    losses = []
    for b in batches:
      params, opt_state, loss = pstep(params, opt_state, b, keep)
      losses.append(loss)
    losses = [float(x[0]) for x in losses]
    out[feedback] = (losses, float(evaluate(jax.tree.map(lambda x: x[0], params), held_out)))
  return out


def _drop_residual(opt_state, keep):
  """The bench-only switch: the deferral residual times `keep` (0: the deferred values are dropped)."""
  defer = getattr(opt_state, "defer_state", None)
  if defer is None:
    return opt_state
  return opt_state._replace(defer_state=defer._replace(
      residual=tuple(r * keep.astype(r.dtype) for r in defer.residual)))


def convergence(quick: bool = False) -> dict:
  """The convergence part: cnn and gpt-tiny trained with dlcp's deferral, with and without error
  feedback, against the lossless baseline (max_defer 0) after the same number of steps."""
  import jax

  from prophet_jax.models import get_model

  steps = 60 if quick else 300
  seeds = CONV_SEEDS[:1] if quick else CONV_SEEDS
  result = {"steps": steps, "seeds": list(seeds), "network": {**CONV_NETWORK, "workers": 8},
            "lr": CONV_LR, "models": {}}
  t_all = time.perf_counter()
  print(f"{'model':9s} {'max_defer':>9s} {'deferred':>8s} {'feedback':>8s} "
        + " ".join(f"{'seed ' + str(s):>9s}" for s in seeds) + f" {'mean':>8s} {'vs lossless':>11s} "
        f"{'verdict':>8s}  steps to target (per seed)")
  for name in CONV_MODELS:
    m = get_model(name)
    params = m.init(jax.random.key(0))
    batch = m.default_batch_size * 4
    runs = {}
    for f in CONV_DEFER:
      sched = _conv_schedule(m, params, f)
      per_seed = [_conv_run(m, sched, steps, seed, batch) for seed in seeds]
      for fb in per_seed[0]:
        runs[(f, fb)] = {"max_defer": f, "feedback": fb, "deferred_fraction": sched.max_deferred_fraction,
                         "allreduces": sched.num_allreduces,
                         "groups": [[len(b.chunks), b.defer] for b in sched.buckets if b.defer],
                         "eval_loss": [r[fb][1] for r in per_seed],
                         "train_loss": [r[fb][0] for r in per_seed]}
    base = runs[(0.0, True)]["eval_loss"]
    base_mean = statistics.mean(base)
    spread = max(base) - min(base)
    for key, r in runs.items():
      mean = statistics.mean(r["eval_loss"])
      r["eval_loss_mean"] = mean
      r["vs_lossless"] = mean / base_mean
      r["within"] = bool(abs(mean - base_mean) <= max(0.02 * base_mean, spread))
      r["steps_to_target"] = [_steps_to(c, CONV_TARGET[name]) for c in r["train_loss"]]
      print(f"{name:9s} {r['max_defer']:9.2f} {r['deferred_fraction']:8.1%} {str(r['feedback']):>8s} "
            + " ".join(f"{x:9.4f}" for x in r["eval_loss"]) + f" {mean:8.4f} {r['vs_lossless']:11.4f} "
            f"{'ok' if r['within'] else 'OFF':>8s}  {r['steps_to_target']}")
    result["models"][name] = {"lossless_eval_loss": base, "lossless_spread": spread,
                              "target_train_loss": CONV_TARGET[name], "runs": [runs[k] for k in runs]}
  result["seconds"] = round(time.perf_counter() - t_all, 1)
  print(f"({result['seconds']} s; eval loss on a held-out batch after {steps} steps; ok = within 2% of "
        f"the lossless mean or within the lossless seeds' spread)")
  if not quick:
    _plot_convergence(result)
  return result


def _plot_convergence(result: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  models = list(result["models"])
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2))
  colors = {0.0: "black", 0.05: "tab:blue", 0.1: "tab:green", 0.25: "tab:red"}
  for ax, name in zip(np.atleast_1d(axes), models):
    for r in result["models"][name]["runs"]:
      curve = np.mean(np.asarray(r["train_loss"]), axis=0)
      k = max(1, len(curve) // 30)
      smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
      label = (f"lossless" if r["max_defer"] == 0 else
               f"defer {r['deferred_fraction']:.0%}{'' if r['feedback'] else ', no feedback'}")
      ax.plot(np.arange(len(smooth)) + k, smooth, color=colors[r["max_defer"]],
              ls="-" if r["feedback"] else ":", lw=1.4 if r["max_defer"] == 0 else 1.0, label=label)
    ax.set_yscale("log")
    ax.set_title(f"{name}: dlcp deferral, sgd-momentum, 8 devices (mean of {len(result['seeds'])} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving average)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  out = RESULTS / "dlcp_convergence.png"
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")


PARTS = {"speed": speed, "convergence": convergence}


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--part", choices=sorted(PARTS) + ["all"], default="speed")
  ap.add_argument("--quick", action="store_true", help="fewer traces (a smoke run)")
  a = ap.parse_args(argv)
  for part in (sorted(PARTS) if a.part == "all" else [a.part]):
    result = PARTS[part](quick=a.quick)
    if result.get("status") == "pending" or a.quick:
      continue
    out = RESULTS / f"dlcp_{part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
  main()
