"""How long planning takes: every policy on a 1,000-leaf profile (the target: < 50 ms each, auto < 1 s).

`fsdp` plans the same profile with its kernels sharded over the data axis (`sharded_profile`), without a
budget and under one that binds (`BUDGET`, 128 MiB: about a fifth of what keeping every gathered
parameter takes; rows marked '+budget').

The targets are for calm networks; the same networks under `PRESSURE` (issue 29's: every candidate
scored on the mean over 64 seeded samples, the joint optimiser run at the typical costs and on the calm
network) are timed too, rows marked 'pressure'.

Prints a table and writes bench/results/plan_speed.json. Never asserts (timings vary by machine).

    .venv/bin/python bench/plan_speed.py [--leaves 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from prophet_jax import POLICIES, GradientProfile, NetworkModel, Pressure, plan

PRESSURE = Pressure(background_flows=0.3, tail_prob=0.002, tail_scale_s=0.005)
BUDGET = 128 * 2**20


def thousand_leaf_profile(leaves: int, seed: int = 0) -> GradientProfile:
  """`leaves` rows, 2 per layer (a kernel and a bias, a tenth of them bfloat16), ready back to front."""
  rng = np.random.default_rng(seed)
  sizes = np.exp(rng.uniform(np.log(16), np.log(4e6), size=leaves)).astype(np.int64)
  sizes[1::2] = rng.integers(16, 4096, size=len(sizes[1::2]))      # biases
  dtypes = np.where(rng.uniform(size=leaves) < 0.1, "bfloat16", "float32")
  backward_s, forward_s = 0.2, 0.1
  total = float(sizes.sum())
  ready = np.cumsum(sizes[::-1])[::-1] / total * backward_s        # later layers ready first
  rows = []
  for i in range(leaves):
    layer = f"block{i // 2:04d}"
    isz = 2 if dtypes[i] == "bfloat16" else 4
    rows.append(dict(path=f"params/{layer}/{'kernel' if i % 2 == 0 else 'bias'}", layer=layer,
                     shape=(int(sizes[i]),), dtype=str(dtypes[i]), nbytes=int(sizes[i]) * isz,
                     ready_s=float(min(ready[i], backward_s)),
                     fwd_s=forward_s / (leaves // 2) if i % 2 == 0 else 0.0))
  fwd = sum(r["fwd_s"] for r in rows)
  return GradientProfile.from_rows(rows, forward_s=fwd, backward_s=backward_s, model=f"random{leaves}")


def sharded_profile(leaves: int, workers: int, seed: int = 0) -> GradientProfile:
  """The same profile with its kernels sharded over a 'data' axis of `workers` devices (sizes rounded up
  to a multiple of it) and its biases replicated: what the `fsdp` policy plans."""
  base = thousand_leaf_profile(leaves, seed)
  rows = []
  for r in base.rows:
    d = {f: getattr(r, f) for f in ("path", "layer", "dtype", "ready_s", "fwd_s", "update_s")}
    if r.path.endswith("kernel"):
      n = -(-r.size // workers) * workers
      d.update(shape=(n,), nbytes=r.nbytes // r.size * n, shard_dim=0)
    else:
      d.update(shape=r.shape, nbytes=r.nbytes)
    rows.append(d)
  return GradientProfile.from_rows(rows, forward_s=base.forward_s, backward_s=base.backward_s,
                                   model=base.model, mesh={"data": workers}, shard_axes=["data"])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--leaves", type=int, default=1000)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "plan_speed.json"))
  a = ap.parse_args()
  profile = thousand_leaf_profile(a.leaves)
  results = []
  print(f"{a.leaves} leaves, {profile.total_nbytes / 2**20:.1f} MiB; best of {a.repeats} runs")
  print(f"{'policy':10s} {'network':14s} {'pressure':8s} {'mode':16s} {'plan ms':>8s} {'cpu ms':>7s} "
        f"{'policy ms':>9s} {'chunks':>7s}")
  for (net_name, workers), pressed in [(n, p) for p in (False, True)
                                       for n in (("10gbe", 16), ("100gb-ib", 256))]:
    net = NetworkModel.preset(net_name, workers=workers).replace(pressure=PRESSURE if pressed else None)
    for name in POLICIES:
      if name == "dlcp":
        continue
      prof = sharded_profile(a.leaves, workers) if name == "fsdp" else profile
      for cross_step, budget in [(c, b) for b in ((None, BUDGET) if name == "fsdp" else (None,))
                                 for c in (False, True)]:
        best, cpu, raw, s = float("inf"), float("inf"), float("inf"), None
        kw = {} if budget is None else {"memory_budget_bytes": budget}
        try:
          for _ in range(a.repeats if name != "auto" else 1):
            t0, c0 = time.perf_counter(), time.process_time()
            s = plan(prof, net, name, cross_step=cross_step, **kw)
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
            if name != "auto":  # the policy alone: no validation, no prediction
              t0 = time.perf_counter()
              POLICIES[name](**kw)(prof, net, cross_step=cross_step)
              raw = min(raw, time.perf_counter() - t0)
        except ImportError as e:  # auto may not be present yet
          print(f"{name:10s} unavailable: {e}")
          break
        mode = ("pipelined" if cross_step else "plain") + ("" if budget is None else "+budget")
        print(f"{name:10s} {net_name + '/P' + str(workers):14s} {'yes' if pressed else '-':8s} {mode:16s} "
              f"{best * 1e3:8.2f} {cpu * 1e3:7.2f} "
              f"{(f'{raw * 1e3:9.2f}' if raw < float('inf') else '        -')} {s.num_allreduces:7d}")
        results.append({"policy": name, "network": net_name, "workers": workers, "pressure": pressed,
                        "cross_step": cross_step, "memory_budget_bytes": budget,
                        "plan_ms": best * 1e3, "plan_cpu_ms": cpu * 1e3,
                        "policy_ms": None if name == "auto" else raw * 1e3,
                        "allreduces": s.num_allreduces, "predicted_s": s.predicted_s})
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"leaves": a.leaves, "repeats": a.repeats, "pressure": PRESSURE.to_dict(),
                             "note": "plan_ms: plan() wall time (validate_schedule and simulate included), best of "
                                     "repeats; plan_cpu_ms: its process CPU time; policy_ms: the scheduler "
                                     "callable alone",
                             "results": results}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
