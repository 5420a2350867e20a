"""XLA:GPU's compiled schedule of every rewrite, per model x GPU target x policy (compile-only: no GPU runs).

Each step is compiled for 8 compile-only GPUs of the target (`prophet_jax.gpu_topology`: XLA:GPU's whole
pipeline, latency hiding scheduler and ptxas included) and read by `prophet_jax.audit`. This is the
program a GPU would execute, not a run on a GPU: there are no times here, only what the schedule puts
where. Per row:

- `planned` / `found`: chunk all-reduces in the plan / in the compiled program; `ok`: one per chunk,
  planned sizes, schedule order (`audit`'s verdict);
- `async`: chunks issued as async start/done pairs; `exposed`: chunks with no compute scheduled between
  their start and done; `in flight`: the most all-reduces in flight at once;
- `overlap GFLOP` / `overlap us`: the matmul/convolution FLOPs scheduled inside the chunks' windows, and a
  roofline estimate of the time of every compute op inside them on the target (max(FLOPs / FP32 peak,
  bytes / memory bandwidth) per op, from the target description: an estimate, not a measurement);
- `sim ovl`: chunks the simulator overlaps with backward compute (its all-reduce starts before backward
  ends) under the same plan, for comparison with `planned - exposed`;
- `compile s`: seconds in `compile()` on this machine.

Models: `cnn` and `gpt-tiny` (the small trainable models, profiles from their parameter sizes), and
ResNet-50 and BERT-base (`prophet_jax.models.architecture`, at the bundled traces' layer shapes, planned
from the `{model}-h100` trace), two examples per GPU (a global batch of 16). Network: the `nvlink`
preset for 8 workers (the 8 GPUs of one host the topology describes). Targets: `h100` and `a100` (and `a100+lhs`: the A100 with
`xla_gpu_enable_latency_hiding_scheduler=true`, which jaxlib 0.10.2 enables by default only on Hopper).
Policies with identical chunks compile to the same program and are compiled once.

    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_hlo.py          # everything (~30 min on 2 busy cores)
    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_hlo.py --models cnn gpt-tiny --targets h100 --modes pipelined

Prints a table; writes bench/results/gpu_hlo.json; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import architecture, get_model, load_trace  # noqa: E402

POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
MODELS = ("cnn", "gpt-tiny", "resnet50", "bert-base")
TARGETS = {"h100": ("h100", None), "a100": ("a100", None),
           "a100+lhs": ("a100", {"xla_gpu_enable_latency_hiding_scheduler": True})}
NDEV = 8
BATCH = 16  # two examples per GPU (with one, a Dense weight gradient is an outer product, not a matmul)
# per chunk, in compiled order (one array per chunk in the JSON)
CHUNK_FIELDS = ("chunk", "elements", "asynchronous", "window_flops", "window_bytes", "window_us",
                "backward_ops", "forward_ops", "other_ops")
OUT = Path(__file__).resolve().parent / "results" / "gpu_hlo.json"


class ZooModel:
  """A published architecture as a trainable-model stand-in: abstract params, a cross-entropy loss over
  its logits, batches of its input shape (BatchNorm statistics are constants: inference-mode BN, as the
  zoo defines it)."""

  default_batch_size = 16

  def __init__(self, name: str):
    self.arch = architecture(name)
    variables = self.arch.abstract_variables()
    self._params = {"params": variables["params"]}
    self._state = {k: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), v)
                   for k, v in variables.items() if k != "params"}

  def abstract_params(self):
    return self._params

  def loss_fn(self, params, batch):
    logits = self.arch.apply(params, batch["x"], state=self._state).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))

  def make_batch(self, rng, n):
    shape = (n, *self.arch.input_shape)
    x = (jax.random.randint(rng, shape, 0, 1000) if self.arch.input_dtype == "int32"
         else jax.random.normal(rng, shape))
    return {"x": x, "y": jax.random.randint(rng, (n,), 0, 10)}


def model_and_profile(name: str):
  if name in ("resnet50", "bert-base"):
    return ZooModel(name), load_trace(f"{name}-h100")
  m = get_model(name)
  return m, pj.GradientProfile.from_params(m.abstract_params(), forward_s=1e-3, backward_s=2e-3,
                                            model=name)


def sim_overlapped(schedule, profile, net) -> int:
  sim = pj.simulate(schedule, profile, net, cross_step=schedule.cross_step)
  bwd = [e for e in sim.events if e.kind == "backward"]
  end = max((e.end_s for e in bwd), default=0.0)
  return sum(1 for e in sim.events if e.kind == "allreduce" and e.start_s < end)


COMPUTE = ("backward", "forward", "other")  # the window ops that are the step's compute (AuditEntry.window_ops)


def compute_ops(entry):
  return [o for kind in COMPUTE for o in entry.window_ops(kind)]


def row_of(report, schedule, target, compile_s, sim_ovl):
  ops = {o.name: o for e in report.chunks for o in compute_ops(e)}
  overlap_s = sum(target.roofline_s(o.flops, o.nbytes) for o in ops.values())
  chunks = [[e.chunk, e.elements, int(e.asynchronous), e.window_flops, e.window_bytes,
             round(1e6 * sum(target.roofline_s(o.flops, o.nbytes) for o in compute_ops(e)), 3),
             len(e.window_ops("backward")), len(e.window_ops("forward")), len(e.window_ops("other"))]
            for e in report.chunks]
  return {"planned": schedule.num_allreduces, "found": report.chunk_allreduces, "ok": report.ok,
          "asynchronous": sum(e.asynchronous for e in report.chunks), "exposed": list(report.exposed),
          "max_in_flight": report.max_in_flight, "overlap_gflop": report.overlapped_flops / 1e9,
          "overlap_us": overlap_s * 1e6, "next_forward_inside": list(report.forward_overlap),
          "backward_outside_windows": report.backward_outside_windows, "sim_overlapped": sim_ovl,
          "compile_s": compile_s, "warnings": list(report.warnings), "chunks": chunks}


def summary(rows, policies) -> str:
  """The README's table: per model, target and mode, each policy's 'chunks / exposed' (+ 'next forward
  inside' windows for the pipelined step), '!' where the audit is not OK or not every chunk was found."""
  lines = ["| model | target | step | " + " | ".join(policies) + " |",
           "| --- | --- | --- | " + " | ".join("---:" for _ in policies) + " |"]
  groups: dict[tuple, dict] = {}
  for r in rows:
    groups.setdefault((r["model"], r["target"], r["mode"]), {})[r["policy"]] = r
  for (model, target, mode), by in groups.items():
    cells = []
    for pol in policies:
      r = by.get(pol)
      if r is None:
        cells.append("")
        continue
      cell = f"{r['planned']} / {len(r['exposed'])}"
      if mode == "pipelined":
        cell += f" / {len(r['next_forward_inside'])}"
      cells.append(cell + ("" if r["ok"] and r["found"] == r["planned"] else " !"))
    lines.append(f"| {model} | {target} | {mode} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
  p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
  p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
  p.add_argument("--modes", nargs="+", default=["scheduled", "pipelined"],
                 choices=["scheduled", "hooked", "pipelined"])
  p.add_argument("--out", default=str(OUT))
  a = p.parse_args(argv)
  net = pj.NetworkModel.preset("nvlink", workers=NDEV)
  rows = []
  t0 = time.time()
  for model_name in a.models:
    model, profile = model_and_profile(model_name)
    for mode in a.modes:
      plans = {pol: pj.plan(profile, net, pol, cross_step=mode == "pipelined") for pol in a.policies}
      for tname in a.targets:
        base, options = TARGETS[tname]
        topo = pj.gpu_topology(base, devices=NDEV)
        done: dict[tuple, tuple] = {}
        for pol, s in plans.items():
          key = tuple(tuple(sorted(c.slices)) for c in s.chunks)
          if key not in done:
            compiled, compile_s = pj.compile_step(model, s, mode, topo, batch_size=BATCH,
                                                  compiler_options=options)
            done[key] = (pj.audit(compiled, s), compile_s)
            del compiled
          report, compile_s = done[key]
          row = {"model": model_name, "target": tname, "device": topo.target.description,
                 "mode": mode, "policy": pol,
                 **row_of(report, s, topo.target, compile_s, sim_overlapped(s, profile, net))}
          rows.append(row)
          print(f"  {model_name} {tname} {mode} {pol}: {row['found']}/{row['planned']} ok={row['ok']} "
                f"exposed={len(row['exposed'])} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
  head = (f"{'model':9s} {'target':8s} {'mode':9s} {'policy':8s} {'planned':>7s} {'found':>5s} {'ok':>3s} "
          f"{'async':>5s} {'exposed':>7s} {'inflt':>5s} {'ovl GFLOP':>9s} {'ovl us':>7s} {'sim ovl':>7s} "
          f"{'compile s':>9s}")
  print(head)
  for r in rows:
    print(f"{r['model']:9s} {r['target']:8s} {r['mode']:9s} {r['policy']:8s} {r['planned']:7d} "
          f"{r['found']:5d} {'yes' if r['ok'] else 'NO':>3s} {r['asynchronous']:5d} {len(r['exposed']):7d} "
          f"{r['max_in_flight']:5d} {r['overlap_gflop']:9.3f} {r['overlap_us']:7.1f} "
          f"{r['sim_overlapped']:7d} {r['compile_s']:9.1f}")
  print()
  print(summary(rows, a.policies))
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({
      "what": "XLA:GPU's compiled schedule for compile-only GPUs (no GPU ran); audit per chunk",
      "jax": jax.__version__, "network": net.to_dict(), "devices": NDEV, "batch": BATCH,
      "chunk_fields": CHUNK_FIELDS, "rows": rows}, separators=(",", ":")))
  print(f"written to {out} ({time.time() - t0:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
