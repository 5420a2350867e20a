"""The measure step and the rewrite's cost on one GPU: every number issue 23 asks of a GPU, in one run.

Sections (each writes the results file when it ends; one that would pass `DEADLINE_S` is skipped and
said so):
  env          the card, the driver's view of it, jax / jaxlib / flax / optax / Python / prophet_jax versions
  profile-M    for M in cnn, ResNet-50, BERT-base: the plain jitted train step (value_and_grad + sgd with
               momentum, donated; median of 30 timed steps, and 20 back to back) against `profile_step`
               (10 traced steps, its trace kept): its time, method and notes, forward / backward / update,
               its predicted step (forward + backward + update) over the measured one, backward / forward,
               the Spearman rank correlation of each layer's forward index with its ready time, the layers
               with distinct ready times; and `profile_from_trace` of the kept trace (its time, and its
               ready times against profile_step's)
  overhead-M   on a one-device mesh, round-robin medians against the plain `pmean` step: `scheduled` wfbp
               (one chunk per layer), auto, dlcp (max_defer 0.1), and `pipelined` (wfbp, min-cut
               residuals, and with residuals="all"); the compile time of each arm (its first call; the
               pipelined step's first two)
A one-device mesh has no all-reduce to hide: what it shows is the rewrite's own compute cost and its
compile time on the GPU (issue 23's targets: pipelined <= 1.05x, compile <= 2x the plain step's).

  python bench/gpu_step.py                                    # on the GPU machine
  QUICK=1 JAX_PLATFORMS=cpu python bench/gpu_step.py          # dry run on the CPU: the mlp, few repeats

Environment: OUT (folder of the results, default bench/results), QUICK=1, DEADLINE_S (default 480),
MODELS (space-separated, default "cnn resnet50 bert-base"; QUICK=1 runs the mlp alone). Writes OUT/gpu_step-<card>.json and prints a
table last. Never asserts.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

T0 = time.time()
QUICK = os.environ.get("QUICK") == "1"
DEADLINE_S = float(os.environ.get("DEADLINE_S", "480"))
OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = os.environ.get("MODELS", "cnn resnet50 bert-base").split()
AX = "dp"
R: dict = {"what": __doc__.splitlines()[0], "quick": QUICK, "sections": {}}
PATH = [None]


def _save():
  os.makedirs(OUT, exist_ok=True)
  if PATH[0] is None:
    card = R["sections"].get("env", {}).get("result", {}).get("device_kind", "unknown")
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") + ("-quick" if QUICK else "")
    PATH[0] = os.path.join(OUT, f"gpu_step-{slug}.json")
  with open(PATH[0], "w") as f:
    json.dump(R, f, indent=1, default=str)


def _left():
  return DEADLINE_S - (time.time() - T0)


def section(name, need_s, fn, *args):
  if _left() < need_s:
    R["sections"][name] = {"skipped": f"{_left():.0f} s left of DEADLINE_S={DEADLINE_S:.0f}, {need_s} needed"}
    print(f"[{time.time() - T0:6.1f}s] {name}: skipped", flush=True)
    _save()
    return None
  t = time.time()
  print(f"[{t - T0:6.1f}s] {name} ...", flush=True)
  try:
    out = fn(*args)
    R["sections"][name] = {"ok": True, "s": round(time.time() - t, 1), "result": out}
  except Exception as e:  # noqa: BLE001 - recorded, and the next section runs
    out = None
    R["sections"][name] = {"ok": False, "s": round(time.time() - t, 1), "error": f"{type(e).__name__}: {e}"[:2000],
                           "traceback": traceback.format_exc()[-4000:]}
    print(f"  FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  _save()
  return out


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import prophet_jax as pj  # noqa: E402
from prophet_jax.models import architecture, get_model  # noqa: E402


def env():
  import flax
  import jaxlib

  d = jax.devices()[0]
  return {"device_kind": d.device_kind, "platform": d.platform, "devices": len(jax.devices()),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "optax": optax.__version__, "python": sys.version.split()[0], "prophet_jax": pj.__version__,
          "prophet_jax_file": pj.__file__, "quick": QUICK}


class Zoo:
  """A published architecture with initialised variables (ResNet-50's BatchNorm statistics are constants:
  inference-mode BN, as the zoo defines it) and a cross-entropy loss over its outputs."""

  def __init__(self, name, batch):
    self.arch = architecture(name)
    variables = jax.jit(self.arch.module.init)(jax.random.key(0), self._x(jax.random.key(1), 2))
    self.params = {"params": variables["params"]}
    self.state = {k: v for k, v in variables.items() if k != "params"}
    self.batch = {"x": self._x(jax.random.key(2), batch),
                  "y": jax.random.randint(jax.random.key(3), (batch,), 0, 10)}
    self.forward_paths = list(self.arch.forward_paths())

  def _x(self, rng, n):
    shape = (n, *self.arch.input_shape)
    if self.arch.input_dtype == "int32":
      return jax.random.randint(rng, shape, 0, 1000)
    return jax.random.normal(rng, shape)

  def loss_fn(self, params, batch):
    out = self.arch.apply(params, batch["x"], state=self.state).astype(jnp.float32)
    logp = jax.nn.log_softmax(out.reshape(out.shape[0], -1))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


class Small:
  def __init__(self, name, batch):
    m = get_model(name)
    self.params = m.init(jax.random.key(0))
    self.batch = m.make_batch(jax.random.key(1), batch)
    self.loss_fn = m.loss_fn
    self.forward_paths = list(m.forward_paths(self.params))


def make(name):
  if name == "mlp":  # the CPU dry run (QUICK=1): the smallest model at a small batch
    return Small("mlp", 16)
  return {"cnn": lambda: Small("cnn", 512), "resnet50": lambda: Zoo("resnet50", 64),
          "bert-base": lambda: Zoo("bert-base", 32)}[name]()


def timed(f, n):
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f())
    ts.append(time.perf_counter() - t)
  return ts


def summary(ts):
  ts = sorted(ts)
  return {"median_ms": 1e3 * statistics.median(ts), "p10_ms": 1e3 * ts[len(ts) // 10],
          "p90_ms": 1e3 * ts[(9 * len(ts)) // 10], "n": len(ts)}


def spearman(a, b):
  def ranks(x):
    x = np.asarray(x, float)
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    for v in np.unique(x):
      r[x == v] = r[x == v].mean()
    return r
  return float(np.corrcoef(ranks(a), ranks(b))[0, 1]) if len(a) > 2 else float("nan")


def shape_of(prof, forward_paths):
  """backward / forward, Spearman(layer forward index, layer ready time), distinct layer ready times: a
  layer is ready when its last gradient is; its forward index is the model's own (jaxpr) order."""
  from prophet_jax.models import layer_of

  layer_ready = {}
  for r in prof.rows:
    layer_ready[r.layer] = max(layer_ready.get(r.layer, 0.0), r.ready_s)
  layers = [l for l in dict.fromkeys(layer_of(p) for p in forward_paths) if l in layer_ready]
  times = [layer_ready[l] for l in layers]
  return {"backward_over_forward": prof.backward_s / max(prof.forward_s, 1e-12),
          "spearman_layer_ready": spearman(range(len(layers)), times),
          "distinct_layer_ready": len(set(times)), "layers": len(layers)}


def plain_step(loss_fn, tx):
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss
  return jax.jit(step, donate_argnums=(0, 1))


DONE = {}


def profile(name):
  m = make(name)
  tx = optax.sgd(0.01, momentum=0.9)
  step = plain_step(m.loss_fn, tx)
  state = [jax.tree.map(jnp.copy, m.params), None]
  state[1] = tx.init(state[0])
  t = time.perf_counter()
  jax.block_until_ready(step(*state, m.batch)[2])  # donated: state is consumed, rebuild it
  compile_s = time.perf_counter() - t
  state = [jax.tree.map(jnp.copy, m.params), tx.init(m.params)]

  def one():
    state[0], state[1], loss = step(state[0], state[1], m.batch)
    return loss
  for _ in range(3):
    jax.block_until_ready(one())
  plain = summary(timed(one, 5 if QUICK else 30))
  t = time.perf_counter()
  for _ in range(5 if QUICK else 20):
    loss = one()
  jax.block_until_ready(loss)
  back_to_back_ms = 1e3 * (time.perf_counter() - t) / (5 if QUICK else 20)
  with tempfile.TemporaryDirectory(prefix="gpu_step_trace_") as d:
    t = time.perf_counter()
    prof = pj.profile_step(m.loss_fn, m.params, m.batch, num_devices=1, steps=2 if QUICK else 10, warmup=1 if QUICK else 2,
                           tx=tx, model=name, trace_dir=d)
    profile_s = time.perf_counter() - t
    upd = prof.update_s
    predicted = prof.forward_s + prof.backward_s + upd
    res = {"compile_plain_s": compile_s, "plain_step": plain, "back_to_back_ms": back_to_back_ms,
           "profile_s": profile_s, "method": prof.method, "notes": prof.notes[:1500], "rows": len(prof.rows),
           "forward_ms": 1e3 * prof.forward_s, "backward_ms": 1e3 * prof.backward_s, "update_ms": 1e3 * upd,
           "predicted_step_ms": 1e3 * predicted,
           "predicted_over_measured": predicted / (plain["median_ms"] / 1e3),
           **shape_of(prof, m.forward_paths)}
    hlo_file = os.path.join(d, "prophet_profile_step.hlo.txt")  # profile_step(trace_dir=d) writes it there
    if prof.method == "measured" and os.path.exists(hlo_file):
      with open(hlo_file) as f:
        text = f.read()
      t = time.perf_counter()
      back = pj.profile_from_trace(d, text, m.params)
      res["profile_from_trace"] = {
          "s": time.perf_counter() - t, "backward_ms": 1e3 * back.backward_s, "forward_ms": 1e3 * back.forward_s,
          "ready_spearman_vs_profile_step": spearman([r.ready_s for r in sorted(back.rows, key=lambda r: r.path)],
                                                     [r.ready_s for r in sorted(prof.rows, key=lambda r: r.path)]),
          **shape_of(back, m.forward_paths)}
  DONE[name] = (m, prof)
  return res


def overhead(name):
  m, prof = DONE[name]
  mesh = jax.make_mesh((1,), (AX,))

  def put(tree, spec):
    tree = jax.tree.map(jnp.copy, tree)
    if isinstance(spec, P):
      return jax.device_put(tree, NamedSharding(mesh, spec))
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), spec,
                                             is_leaf=lambda x: isinstance(x, P)))
  batch = put(m.batch, P(AX))
  tx = optax.sgd(0.01, momentum=0.9)
  slow = pj.NetworkModel.preset("10gbe", workers=8)
  plans = {"wfbp": pj.plan(prof, slow, "wfbp"), "auto": pj.plan(prof, pj.NetworkModel.preset("100gb-ib", workers=8),
                                                                  "auto"),
           "dlcp": pj.plan(prof, slow, "dlcp", max_defer=0.1)}
  pipe_plan = pj.plan(prof, slow, "wfbp", cross_step=True)

  def varying(p):
    return jax.tree.map(lambda x: jax.lax.pcast(x, AX, to="varying"), p)

  def body_plain(p, o, b):
    loss, g = jax.value_and_grad(m.loss_fn)(varying(p), b)
    u, o = tx.update(jax.lax.pmean(g, AX), o, p)
    return optax.apply_updates(p, u), o, jax.lax.pmean(loss, AX)

  arms = {"plain": (jax.jit(jax.shard_map(body_plain, mesh=mesh, in_specs=(P(), P(), P(AX)),
                                          out_specs=(P(), P(), P())), donate_argnums=(0, 1)),
                    [put(m.params, P()), put(tx.init(m.params), P())])}
  for k, s in plans.items():
    txs = pj.scheduled(tx, s, axis_name=AX)

    def body(p, o, b, txs=txs):
      loss, g = jax.value_and_grad(m.loss_fn)(varying(p), b)
      u, o = txs.update(g, o, p)
      return optax.apply_updates(p, u), o, jax.lax.pmean(loss, AX)
    st0 = txs.init(m.params)
    ospec = pj.state_specs(st0, AX) if s.max_deferred_fraction > 0 else P()
    arms[k] = (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), ospec, P(AX)), out_specs=(P(), ospec, P())),
                       donate_argnums=(0, 1)), [put(m.params, P()), put(st0, ospec)])
  # min-cut residuals (the default) recompute elementwise ops in the backward; "all" carries what
  # jax.vjp keeps (on ResNet-50 XLA:GPU's program reads and writes ~3 GB less per step: docs/facts.md)
  for arm, residuals in (("pipelined", "min-cut"), ("pipelined-all", "all")):
    pipe = pj.pipelined(m.loss_fn, tx, pipe_plan, axis_name=AX, residuals=residuals)
    specs = pipe.state_specs()

    def pbody(s, b, pipe=pipe):
      s, loss = pipe.step(s, b)
      return s, loss[None]
    arms[arm] = (jax.jit(jax.shard_map(pbody, mesh=mesh, in_specs=(specs, P(AX)), out_specs=(specs, P(AX))),
                         donate_argnums=(0,)), [put(pipe.init(m.params), specs)])
  chunks = {k: s.num_allreduces for k, s in plans.items()}
  chunks["pipelined"] = chunks["pipelined-all"] = pipe_plan.num_allreduces
  compile_s, calls = {}, {}
  for k, (f, st) in arms.items():
    # the first call compiles; the pipelined step's first call runs a forward alone, and its state then
    # changes structure (a forward is pending), so its second call compiles the real step: both count
    ts = []
    for _ in range(2):
      t = time.perf_counter()
      out = f(*st, batch)
      jax.block_until_ready(out)
      ts.append(time.perf_counter() - t)
      st[:] = list(out[:-1])
    calls[k] = ts
    compile_s[k] = ts[0] + (ts[1] if k.startswith("pipelined") else 0.0)

  def runner(k):
    f, st = arms[k]

    def run():
      out = f(*st, batch)
      st[:] = list(out[:-1])
      return out[-1]
    return run
  runs = {k: runner(k) for k in arms}
  for r in runs.values():
    for _ in range(1 if QUICK else 3):
      jax.block_until_ready(r())
  per = {k: [] for k in runs}
  for i in range(2 if QUICK else 10):  # round robin, the order reversed every other round
    for k in (list(runs) if i % 2 == 0 else list(reversed(runs))):
      per[k].append(statistics.median(timed(runs[k], 3 if QUICK else 5)))
  ratio = {k: statistics.median(a / b for a, b in zip(per[k], per["plain"])) for k in runs}
  return {"chunks": chunks, "compile_s": compile_s, "first_two_calls_s": calls,
          "compile_over_plain": {k: v / compile_s["plain"] for k, v in compile_s.items()},
          "median_ms": {k: 1e3 * statistics.median(v) for k, v in per.items()}, "ratio_vs_plain": ratio}


def table():
  lines = ["", "=== gpu_step: " + R["sections"].get("env", {}).get("result", {}).get("device_kind", "?") + " ==="]
  for k, v in R["sections"].items():
    if not v.get("ok"):
      lines.append(f"{k}: {'skipped' if 'skipped' in v else 'FAILED ' + v.get('error', '')[:200]}")
      continue
    r = v["result"]
    if k.startswith("profile-"):
      back = r.get("profile_from_trace", {})
      lines.append(f"{k}: {r['method']} in {r['profile_s']:.1f} s; plain step {r['plain_step']['median_ms']:.2f} ms "
                   f"(b2b {r['back_to_back_ms']:.2f}); fwd {r['forward_ms']:.2f} bwd {r['backward_ms']:.2f} "
                   f"upd {r['update_ms']:.2f} ms; predicted/measured {r['predicted_over_measured']:.3f}; "
                   f"bwd/fwd {r['backward_over_forward']:.2f}; spearman {r['spearman_layer_ready']:.3f}; distinct "
                   f"{r['distinct_layer_ready']}/{r['layers']}"
                   + (f"; profile_from_trace {back['s']:.2f} s, bwd {back['backward_ms']:.2f} ms" if back else ""))
    elif k.startswith("overhead-"):
      lines.append(f"{k}: chunks {r['chunks']}; step / plain "
                   + ", ".join(f"{a} {x:.3f}" for a, x in r["ratio_vs_plain"].items())
                   + "; compile / plain " + ", ".join(f"{a} {x:.2f}" for a, x in r["compile_over_plain"].items()))
    else:
      lines.append(f"{k}: {r}")
  lines.append(f"total {time.time() - T0:.0f} s; written to {PATH[0]}")
  return "\n".join(lines)


def main():
  section("env", 0, env)
  # the most informative first; each is skipped when too little time is left
  order = [("profile", "cnn", 30), ("profile", "resnet50", 60), ("overhead", "resnet50", 120),
           ("profile", "bert-base", 90), ("overhead", "bert-base", 150), ("overhead", "cnn", 30)]
  if QUICK:
    order = [("profile", "mlp", 0), ("overhead", "mlp", 0)]
  for kind, name, need in order:
    if name not in MODELS and not QUICK:
      continue
    if kind == "profile":
      section(f"profile-{name}", need, profile, name)
    elif name in DONE:
      section(f"overhead-{name}", need, overhead, name)
  print(table())


if __name__ == "__main__":
  main()
