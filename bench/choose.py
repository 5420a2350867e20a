"""`prophet_jax.choose` on real steps: a 40-leaf model's per-leaf plan against one bucket against the
plain `pmean` step (the control), timed in paired interleaved rounds; the decision and its intervals.

Model: a 20-layer tanh MLP (width 128; a kernel and a bias per layer: 40 gradient leaves), SGD with
momentum, `jax.jit(jax.shard_map(step))` over the data axis, `state, loss = step(state, batch)`.
Steps compared:
  control      the plain step: `lax.pmean` of the gradient tree (XLA combines it into one all-reduce)
  wfbp         `scheduled(sgd, plan(profile, net, "wfbp"))`, one all-reduce per leaf (40)
  bucket       `scheduled(sgd, plan(profile, net, "bucket", bucket_bytes=1 GiB))`: one all-reduce
  control-copy the control's function jitted again: an identical step (must come out "no difference")

  .venv/bin/python bench/choose.py                          # 8 host devices, one process
  .venv/bin/python bench/choose.py --rounds 300             # fewer rounds (default: choose's, 750)
  sudo .venv/bin/python bench/choose.py --shaped 1gbit      # two processes over a shaped veth link
  .venv/bin/python bench/choose.py --power --no-local       # the statistics alone (injected clock)

`--shaped RATE` runs two processes (one CPU device each) in their own network namespaces joined by a
veth pair capped with `tc ... tbf` (bench/_netns.py; needs root, else it says why and measures only the
local part). Both parts go to bench/results/choose.json (`--out`); a part not run keeps the file's
earlier entry. A benchmark: it prints and writes numbers, it asserts nothing.

Why it imports private code: `--power` runs choose's decision rule (`_planning._paired.decide`) on an
injected clock, thousands of trials without a step or jax, to size the default `rounds`.
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
sys.path.insert(0, str(HERE))

LAYERS, WIDTH = 20, 128
PER_DEVICE_BATCH = 32
AX = "dp"
PORT = 29541


def _setup_env(devices: int | None) -> None:
  if devices:
    flag = f"--xla_force_host_platform_device_count={devices}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build(rounds: int | None, rank_local_batch: bool = False) -> dict:
  """Builds the three steps on every device (of every process), runs `choose`, returns the record."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import prophet_jax as pj

  ndev = jax.device_count()
  mesh = jax.make_mesh((ndev,), (AX,))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AX))
  rng = np.random.default_rng(0)
  params = {f"l{i:02d}": {"b": np.zeros(WIDTH, np.float32),
                          "w": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)}
            for i in range(LAYERS)}
  gb = PER_DEVICE_BATCH * ndev
  batch = {"x": rng.standard_normal((gb, WIDTH)).astype(np.float32),
           "y": rng.standard_normal((gb, WIDTH)).astype(np.float32)}

  def loss_fn(p, b):
    h = b["x"]
    for i in range(LAYERS):
      h = jnp.tanh(h @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
    return jnp.mean((h - b["y"]) ** 2)

  def to_global(tree, sharding):
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                               lambda idx: np.asarray(x)[idx]), tree)

  net = pj.NetworkModel.preset("10gbe", workers=ndev)
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3, layer_depth=2)
  scheds = {"wfbp": pj.plan(profile, net, "wfbp"),
            "bucket": pj.plan(profile, net, "bucket", bucket_bytes=2**30, first_bucket_bytes=2**30)}
  if jax.process_count() > 1:
    from prophet_jax.launch import broadcast_schedule  # rank 0 plans, every process checks

    scheds = {k: broadcast_schedule(s if jax.process_index() == 0 else None, params)
              for k, s in scheds.items()}
  sgd = optax.sgd(0.01, momentum=0.9)

  def make(tx, reduce_in_step: bool):
    def body(state, b):
      p, o = state
      pv = jax.lax.pcast(p, AX, to="varying")
      loss, g = jax.value_and_grad(loss_fn)(pv, b)
      if reduce_in_step:
        g = jax.lax.pmean(g, AX)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), jax.lax.pmean(loss, AX)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=((P(), P()), P(AX)), out_specs=((P(), P()), P())))

  txs = {"control": sgd, "control-copy": sgd,
         **{k: pj.scheduled(sgd, sc, axis_name=AX) for k, sc in scheds.items()}}
  steps = {k: make(tx, k.startswith("control")) for k, tx in txs.items() if k != "control"}
  control = make(sgd, True)
  # each plan's own state layout (a scheduled tx wraps sgd's state): the mapping form of `state`,
  # as prophet_jax.convert_state gives it when a run changes plans
  pglobal = to_global(params, rep)
  state = {k: (pglobal, to_global(jax.device_get(tx.init(params)), rep)) for k, tx in txs.items()}
  gbatch = to_global(batch, split)
  t0 = time.perf_counter()
  choice = pj.choose(steps, state, [gbatch], control=control, rounds=rounds)
  wall = time.perf_counter() - t0
  return dict(choice=json.loads(choice.to_json()), describe=choice.describe(), wall_s=wall,
              devices=ndev, processes=jax.process_count(), leaves=2 * LAYERS, width=WIDTH,
              per_device_batch=PER_DEVICE_BATCH,
              allreduces={"control": 1, "control-copy": 1,
                          **{k: s.num_allreduces for k, s in scheds.items()}},
              timed_steps=choice.rounds * (len(steps) + 1), jax=jax.__version__)


def power_table(trials: int = 1000) -> list[dict]:
  """How often `choose`'s rule decides right, with an injected clock (no jax): per noise level and
  rounds, the share of seeded trials in which a candidate 5% faster (time x 1/1.05) is chosen, an
  identical one gives "no difference" and one 5% slower is chosen."""
  import numpy as np

  from prophet_jax._planning._paired import decide, interleave

  rows = []
  for sigma in (0.02, 0.05, 0.10):
    for rounds in (50, 100, 200, 400, 750):
      row = dict(sigma=sigma, rounds=rounds, trials=trials)
      for label, ratio in (("faster_chosen", 1 / 1.05), ("identical_no_difference", 1.0),
                           ("slower_chosen", 1.05)):
        rng = np.random.default_rng(0)
        true = {"control": 0.01, "cand": 0.01 * ratio}
        hits = 0
        for _ in range(trials):
          noise = np.exp(sigma * rng.standard_normal((rounds, 2)))
          c = decide(("control", "cand"), interleave(("control", "cand"), rounds,
                                                     lambda n, r: true[n] * noise[r, int(n == "cand")]),
                     control="control")
          hits += (c.verdicts["cand"] == "no difference") if ratio == 1.0 else (c.best == "cand")
        row[label] = hits / trials
      rows.append(row)
      print(f"sigma {sigma:.2f}  rounds {rounds:4d}  5% faster chosen {row['faster_chosen']:6.1%}  "
            f"identical: no difference {row['identical_no_difference']:6.1%}  "
            f"5% slower chosen {row['slower_chosen']:6.1%}", flush=True)
  return rows


def worker(args: argparse.Namespace) -> int:
  from prophet_jax.launch import initialize

  initialize()
  import jax

  rec = build(args.rounds)
  if jax.process_index() == 0:
    print(rec["describe"], flush=True)
    if args.result:
      Path(args.result).write_text(json.dumps(rec, indent=1))
  return 0


def _print_table(title: str, rec: dict) -> None:
  print(f"\n== {title}: {rec['devices']} devices, {rec['processes']} process(es), "
        f"{rec['choice']['rounds']} rounds, {rec['timed_steps']} timed steps, {rec['wall_s']:.1f} s")
  print(rec["describe"])
  print("all-reduces per step:", rec["allreduces"])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default: choose's)")
  ap.add_argument("--shaped", nargs="*", default=None, metavar="RATE",
                  help="also two processes over a shaped link at each RATE (e.g. 1gbit); needs root")
  ap.add_argument("--no-local", action="store_true", help="skip the 8-device run")
  ap.add_argument("--pin", action="store_true", help="shaped: rank i on core i only")
  ap.add_argument("--power", action="store_true", help="the rule's power table (injected clock)")
  ap.add_argument("--out", default=str(HERE / "results" / "choose.json"))
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    _setup_env(None)
    return worker(args)
  out = Path(args.out)
  results = json.loads(out.read_text()) if out.exists() else {}
  command = "python " + " ".join(shlex.quote(a) for a in ([sys.argv[0]] + list(argv or sys.argv[1:])))
  if args.power:
    results["power"] = dict(command=command, rows=power_table())
  if not args.no_local:
    _setup_env(8)
    rec = build(args.rounds)
    rec["command"] = command
    _print_table("local", rec)
    results["local"] = rec
  if args.shaped is not None:
    from _netns import run_rates, skip_reason

    reason = skip_reason()
    if reason:
      print(f"bench/choose.py --shaped: skipped: {reason}.")
    else:
      argv_w = [sys.executable, str(Path(__file__).resolve()), "--worker"]
      if args.rounds:
        argv_w += ["--rounds", str(args.rounds)]
      for rate, r in run_rates(args.shaped or ["1gbit"], argv_w, port=PORT, pin=args.pin,
                               bench="bench/choose.py").items():
        if "failed" not in r:
          r["command"] = command
          _print_table(f"two processes over a {rate} link", r)
        results.setdefault("shaped", {})[rate] = r
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=1))
  print(f"\nwrote {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
