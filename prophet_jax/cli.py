"""The `prophet-jax` command line: simulate, plan, profile, probe, demo, launch, audit, xla-flags.

Only JSON passes between steps. Bad input prints one line to stderr and exits 2 (`--debug` shows the
traceback). The planning commands (simulate, plan) never import jax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._values._errors import ProphetError
from ._multiprocess._launcher import add_arguments as add_launch_arguments, run as run_launch
from ._values._network import NetworkModel, PRESETS, PRESETS_TWO_LEVEL, Pressure
from ._values._types import GradientProfile

DEFAULT_DEVICE = "v100"


# -- argument resolution ---------------------------------------------------------------------------

# what each kind of input file is, and how to make one: for the messages
_MAKERS = {
    "profile": ("a GradientProfile", "`prophet-jax profile --out P.json` or GradientProfile.to_json()"),
    "network": ("a NetworkModel", "`prophet-jax probe --out N.json` or NetworkModel.to_json()"),
    "schedule": ("a Schedule", "`prophet-jax plan --out S.json` or Schedule.to_json()"),
}


def _read_json(path: str, what: str, flag: str | None = None) -> dict[str, Any]:
  """The JSON object in `path`, the file `flag` names; one clear ValueError (naming the flag, the file
  and how to make a good one) for a missing, unreadable or malformed file, or one that holds anything
  but an object (a list, a string, a number)."""
  flag = flag or f"--{what}"
  kind, maker = _MAKERS.get(what, (f"a {what}", "the library's to_json()"))
  try:
    text = Path(path).read_text()
  except FileNotFoundError as e:
    raise ValueError(f"{what} file {path!r} does not exist.") from e
  except IsADirectoryError as e:
    raise ValueError(f"{flag} {path!r} is a directory; give the {what} JSON file.") from e
  except (PermissionError, UnicodeDecodeError) as e:
    raise ValueError(f"{flag} {path!r}: cannot read the {what} file ({type(e).__name__}).") from e
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what} file {path!r} is malformed JSON ({e.msg} at line {e.lineno}); {flag} takes "
                     f"{kind} as written by {maker}.") from e
  if not isinstance(obj, dict):
    held = {list: "a JSON list", str: "a JSON string", bool: "a JSON boolean", type(None): "null"}.get(
        type(obj), "a JSON number")
    raise ValueError(f"{flag} {path!r} holds {held} ({json.dumps(obj)[:40]}), not a JSON object: {flag} "
                     f"takes {kind} object as written by {maker}.")
  return obj


def _load(cls: Any, path: str, what: str, flag: str | None = None) -> Any:
  """`cls.from_json` of the object in `path`; its errors name the flag and the file."""
  obj = _read_json(path, what, flag)
  try:
    return cls.from_json(obj)
  except (ProphetError, ValueError, TypeError) as e:
    kind = type(e) if isinstance(e, ProphetError) else ValueError
    raise kind(f"{flag or '--' + what} {path!r}: {e}") from e


def _same_file(a: str, b: str) -> bool:
  """Whether paths `a` and `b` name one file (the same existing file, or else the same resolved path)."""
  try:
    return os.path.samefile(a, b)
  except OSError:  # one of them does not exist (yet)
    return Path(a).resolve() == Path(b).resolve()


def _check_out(out: str, flag: str, **inputs: str | None) -> None:
  """ValueError when the output file `out` (of `flag`) is one of the command's input files: writing
  it would destroy the input (a measured profile overwritten by a schedule)."""
  for name, path in inputs.items():
    if path and _same_file(out, path):
      raise ValueError(f"{flag} {out!r} is also the input of --{name.replace('_', '-')}: writing it would "
                       f"overwrite that {name.replace('_', ' ')} file. Give {flag} another path.")


def load_model(model: str, device: str | None = None) -> tuple[GradientProfile, str]:
  """A profile from a bundled trace name, a model name completed by `device`, or a JSON file."""
  from . import models  # lazy: the CLI starts without jax

  if model.endswith(".json") or os.path.sep in model:
    return _load(GradientProfile, model, "profile", "--model"), model
  names = tuple(models.TRACES)
  if model in names:
    return models.load_trace(model), model
  name = f"{model}-{device or DEFAULT_DEVICE}"
  if name in names:
    return models.load_trace(name), name
  listed = ", ".join(n + (" (development checkout only)" if n == "googlenet-k80" else "") for n in names)
  raise ValueError(f"--model {model!r} is neither a bundled trace ({listed}), a model name "
                   f"that --device completes, nor a GradientProfile JSON file.")


def parse_pressure(text: str) -> Pressure | None:
  """`--pressure`: 'none', or comma-separated Pressure fields, e.g.
  'background_flows=0.3,tail_prob=0.01,tail_scale_s=0.002' (the others keep their defaults)."""
  if text.strip().lower() in ("", "none", "calm"):
    return None
  names = {"background_flows": float, "tail_prob": float, "tail_scale_s": float, "tail_shape": float,
           "samples": int, "seed": int}
  fields: dict[str, Any] = {}
  for item in text.split(","):
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in names:
      raise ValueError(f"--pressure {text!r}: {item.strip()!r} is not NAME=VALUE with NAME one of "
                       f"{sorted(names)} (e.g. background_flows=0.3,tail_prob=0.01,tail_scale_s=0.002).")
    try:
      fields[key] = names[key](value)
    except ValueError:
      raise ValueError(f"--pressure {text!r}: {key}={value!r} is not a number.") from None
  return Pressure(**fields)


def load_network(network: str, workers: int | None, *, pressure: str | None = None) -> NetworkModel:
  """A preset name or a NetworkModel JSON file (its `pressure` field included); `workers` overrides
  the file's, and `pressure` (`--pressure`, see `parse_pressure`) its pressure."""
  if network in PRESETS or network in PRESETS_TWO_LEVEL:
    if workers is None:
      raise ValueError(f"--network {network}: a preset needs --workers.")
    net = NetworkModel.preset(network, workers=workers)
  elif network.endswith(".json") or Path(network).exists():
    net = _load(NetworkModel, network, "network")
    if workers is not None:
      net = net.with_workers(workers)
  else:
    raise ValueError(f"--network {network!r} is neither a preset ({', '.join([*PRESETS, *PRESETS_TWO_LEVEL])}) "
                     f"nor a NetworkModel JSON file.")
  return net if pressure is None else net.replace(pressure=parse_pressure(pressure))


def _out_path(path: str) -> Path:
  """`path` with its parent directories created (every file the CLI writes goes through this)."""
  out = Path(path)
  if out.parent != Path(""):
    try:
      out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
      raise ValueError(f"cannot write {path!r}: {out.parent} exists and is not a directory.") from e
  return out


def _parsed(text: str, kind: type, ok: Callable[[Any], bool], expected: str) -> Any:
  """`text` as `kind` where `ok` holds, else argparse's error saying what was `expected`."""
  try:
    v = kind(text)
  except ValueError:
    v = None
  if v is None or not ok(v):
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
  return v


def _non_negative(text: str) -> float:
  return _parsed(text, float, lambda v: 0 <= v < float("inf"), "a finite number of seconds >= 0")


def _positive(text: str) -> int:
  return _parsed(text, int, lambda v: v >= 1, "a positive integer")


# -- commands --------------------------------------------------------------------------------------

def cmd_simulate(a: argparse.Namespace) -> int:
  from . import lower_bound, plan, simulate  # lazy: the CLI starts without jax
  from .schedulers._registry import POLICIES

  if a.timeline:
    _check_out(a.timeline, "--timeline", model=a.model, network=a.network)
  profile, model = load_model(a.model, a.device)
  net = load_network(a.network, a.workers, pressure=a.pressure)
  # every policy, or those named; 'dear' (sharded schedules, one tie chain) where it applies: one link;
  # 'fsdp' for a profile whose parameters are sharded on a mesh of --workers devices
  fsdp_ok = profile.sharded and net.links == 1 and profile.shard_count * profile.replica_count == net.workers
  policies = a.policy or [p for p in POLICIES if (p != "dear" or net.links == 1) and (p != "fsdp" or fsdp_ok)]
  bound = lower_bound(profile, net, cross_step=a.cross_step)
  rows, sims = [], {}
  for name in policies:
    options = {"max_defer": a.max_defer} if name == "dlcp" else {}
    sched = plan(profile, net, name, cross_step=a.cross_step, **options)
    sims[name] = sim = simulate(sched, profile, net, cross_step=a.cross_step)
    d = sim.to_dict(events=False)
    r = {"policy": name, **{k: d[k] for k in ("iteration_s", "idle_s", "allreduces")},
         "vs_lower_bound": d["iteration_s"] / bound}
    if net.pressure is not None:     # the tail of the seeded samples
      r.update(iteration_p50_s=d["iteration_p50_s"], iteration_p99_s=d["iteration_p99_s"])
    if name == "dlcp":               # lossy per step: how much waits (vs_lower_bound may be < 1)
      r.update(max_defer=a.max_defer, deferred_fraction=sched.max_deferred_fraction)
    if sim.reduce_scatters:   # a sharded plan: reduce-scatters and all-gathers instead of all-reduces
      r.update(sharded=True, reduce_scatters=d["reduce_scatters"], all_gathers=d["all_gathers"],
               peak_memory_bytes=d["peak_memory_bytes"])
    rows.append(r)
  q = net.pressure
  if a.json:
    network = {"name": net.name or a.network, "alpha_s": net.alpha_s, "beta_s_per_byte": net.beta_s_per_byte,
               **({} if q is None else {"pressure": q.to_dict()})}
    print(json.dumps({"model": model, "device": profile.device or a.device, "workers": net.workers,
                      "cross_step": a.cross_step, "network": network, "lower_bound_s": bound, "results": rows},
                     indent=2))
  else:
    base = next((r["iteration_s"] for r in rows if r["policy"] == "wfbp"), None)
    print(f"{model}: {len(profile.rows)} gradients, {profile.total_nbytes / 2**20:.1f} MiB, "
          f"compute {profile.compute_s * 1e3:.2f} ms; {net.name or a.network} x {net.workers} workers; "
          f"{'pipelined' if a.cross_step else 'plain'} step; lower bound {bound * 1e3:.3f} ms"
          + (" (lossless schedules)" if "dlcp" in policies else ""))
    if q is not None:
      print(f"pressure: {q.background_flows:g} background flows, tail_prob {q.tail_prob:g} per ring step, tail >= "
            f"{q.tail_scale_s * 1e3:g} ms (shape {q.tail_shape:g}); mean of {q.samples} samples (seed {q.seed})")
    if "dlcp" in policies:
      print(f"dlcp: max_defer {a.max_defer:g} (elements that may wait each step, with error feedback)")
    if any(r.get("sharded") for r in rows if r["policy"] != "fsdp"):
      print("dear: sharded (ZeRO-1): its collectives are shown as reduce-scatters+all-gathers; each "
            "device updates 1/P of the parameters")
    for r in rows:
      if r["policy"] == "fsdp":
        print("fsdp: parameters sharded (ZeRO-3): reduce-scatters+all-gathers (re-gathers included); peak "
              f"{r['peak_memory_bytes'] / 2**30:.2f} GiB per device of gathered parameters and unsharded gradients")
    print(f"{'policy':10s} {'iter ms':>10s} {'/bound':>7s} {'idle ms':>9s} {'allreduces':>10s}"
          + (f" {'p50 ms':>9s} {'p99 ms':>9s}" if q is not None else "") + f" {'deferred':>8s}"
          + (f" {'vs wfbp':>8s}" if base else ""))
    for r in rows:
      count = (f"{r['reduce_scatters']}+{r['all_gathers']}" if r.get("sharded") else str(r["allreduces"]))
      print(f"{r['policy']:10s} {r['iteration_s'] * 1e3:10.3f} {r['vs_lower_bound']:7.3f} "
            f"{r['idle_s'] * 1e3:9.3f} {count:>10s}"
            + (f" {r['iteration_p50_s'] * 1e3:9.3f} {r['iteration_p99_s'] * 1e3:9.3f}" if q is not None else "")
            + f" {r.get('deferred_fraction', 0.0):8.1%}"
            + (f" {base / r['iteration_s']:7.2f}x" if base else ""))
  if a.timeline:
    from ._planning._timeline import plot_timelines  # lazy: the CLI starts without jax

    plot_timelines(sims, str(_out_path(a.timeline)), title=f"{model}, {net.name or a.network} x {net.workers}")
    print(f"timeline written to {a.timeline}", file=sys.stderr)
  return 0


def cmd_plan(a: argparse.Namespace) -> int:
  from . import plan, simulate  # lazy: the CLI starts without jax

  _check_out(a.out, "--out", profile=a.profile, network=a.network)
  profile = _load(GradientProfile, a.profile, "profile")
  net = load_network(a.network, a.workers, pressure=a.pressure)
  if a.max_defer is not None and a.policy != "dlcp":
    raise ValueError(f"--max-defer is an option of policy 'dlcp', not {a.policy!r}.")
  options = {} if a.max_defer is None else {"max_defer": a.max_defer}
  sched = plan(profile, net, a.policy, cross_step=a.cross_step, **options)
  _out_path(a.out).write_text(sched.to_json(indent=1))
  sim = simulate(sched, profile, net, cross_step=sched.cross_step)
  print(sched.describe())
  print(f"predicted iteration {sim.iteration_s * 1e3:.3f} ms; written to {a.out}")
  return 0


def _set_cpu_devices(n: int) -> None:
  """Ask XLA for n host devices: only before jax starts, and only when the launcher did not."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def cmd_profile(a: argparse.Namespace) -> int:
  """profile_step on a bundled trainable model, with the update of optax.sgd(0.1, momentum=0.9)."""
  _set_cpu_devices(a.num_devices)
  import jax  # lazy: the CLI starts without jax
  import optax

  from . import models
  from ._measure._profile import profile_step

  m = models.get_model(a.model)
  params = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), m.default_batch_size)
  profile = profile_step(m.loss_fn, params, batch, num_devices=a.num_devices,
                         tx=optax.sgd(0.1, momentum=0.9), model=a.model, steps=a.steps)
  _out_path(a.out).write_text(profile.to_json(indent=1))
  print(profile.describe())
  print(f"written to {a.out}")
  return 0


def cmd_probe(a: argparse.Namespace) -> int:
  _set_cpu_devices(a.num_devices)
  from ._measure._probe import check_fit, probe  # lazy: the CLI starts without jax

  # under `prophet-jax launch` (jax.distributed initialized) the probe spans every process's devices
  kw = {} if a.sizes is None else {"sizes": tuple(a.sizes)}
  timings = probe(a.num_devices, repeats=a.repeats, max_seconds_per_size=20.0, progress=True,
                  time_budget_s=a.time_budget or None, **kw)
  net = timings.fit()
  warning = check_fit(net, timings)
  if warning is not None:
    print(f"warning: {warning}", file=sys.stderr)
  _out_path(a.out).write_text(net.to_json(indent=1))
  print(timings.describe(net))
  print(f"written to {a.out}")
  return 0


def cmd_demo(a: argparse.Namespace) -> int:
  _set_cpu_devices(8)
  from ._demo import run_demo  # lazy: the CLI starts without jax

  return run_demo(steps=a.steps, out_dir=a.out_dir, quick=a.quick)


# -- audit: a step compiled for a compile-only GPU target -------------------------------------------

def _xla_option(text: str) -> tuple[str, Any]:
  key, sep, value = text.partition("=")
  if not sep or not key.startswith("xla_"):
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE with an XLA option name (xla_...), got {text!r}")
  low = value.strip().lower()
  if low in ("true", "false"):
    return key, low == "true"
  try:
    return key, int(value)
  except ValueError:
    return key, value


def cmd_audit(a: argparse.Namespace) -> int:
  """Compiles a bundled model's step for a compile-only GPU target and prints its audit."""
  from . import models, plan  # lazy: the CLI starts without jax
  from ._compiled._gpu import gpu_target, gpu_topology, quiet_cuda_stub
  from ._values._schedule import Schedule

  if a.jit and a.mode == "scheduled":
    raise ValueError("audit --jit --mode scheduled: a plain jax.jit step's gradients come already reduced "
                     "by the partitioner; audit --jit --mode hooked (or pipelined, or pmean for the plain step).")
  target = gpu_target(a.target)  # an unknown target fails here, before jax starts
  model = models.get_model(a.model)
  if a.schedule:
    schedule = _load(Schedule, a.schedule, "schedule")
  else:
    profile = (_load(GradientProfile, a.profile, "profile") if a.profile else
               GradientProfile.from_params(model.abstract_params(), forward_s=1e-3, backward_s=2e-3, model=a.model))
    net = load_network(a.network, a.workers or a.devices)
    schedule = plan(profile, net, a.policy, cross_step=a.mode == "pipelined")
  with quiet_cuda_stub():
    topo = gpu_topology(target.name, devices=a.devices)
    from ._steps import compile_step  # imports jax: after the topology checked the environment

    options = dict(a.xla_option or ()) or None
    try:
      compiled, compile_s = compile_step(model, schedule, a.mode, topo, batch_size=a.batch,
                                         compiler_options=options, jit=a.jit)
    except Exception as e:  # noqa: BLE001 - XLA refusing an option: named, one line
      text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      if options and ("compile option" in text or "INVALID_ARGUMENT" in text):
        given = " ".join(f"{k}={v}" for k, v in options.items())
        raise ValueError(f"--xla-option {given}: XLA refused it ({text}). Give options this jaxlib's XLA knows, "
                         f"with values of their type (e.g. xla_gpu_enable_latency_hiding_scheduler=true).") from e
      raise
  from ._compiled._audit import audit  # lazy: the CLI starts without jax

  report = audit(compiled, schedule)
  if a.json:
    print(json.dumps({"target": target.name, "device": target.description, "devices": a.devices, "model": a.model,
                      "mode": a.mode, "policy": schedule.policy, "compile_s": compile_s,
                      "xla_options": options or {}, "report": report.to_dict()}, indent=1))
  else:
    count = (f"{schedule.num_reduce_scatters} reduce-scatter(s), {schedule.num_all_gathers} all-gather(s)"
             if schedule.num_reduce_scatters else f"{schedule.num_allreduces} chunk(s)")
    print(f"{a.model}, {a.mode} step, {schedule.policy} ({count}): XLA:GPU's compiled schedule for {a.devices} x "
          f"{target.description} (compile-only: nothing ran; compiled in {compile_s:.1f} s)")
    print(report.describe())
    if report.chunks:
      print(report.window_table())
  return 0 if report.ok else 1


# -- xla-flags: the plan as XLA settings for a plain step ------------------------------------------

def cmd_xla_flags(a: argparse.Namespace) -> int:
  """Plans, then prints the XLA_FLAGS line and the compiler_options that realise the plan as far as
  settings can, checked against the installed jaxlib (`prophet_jax.xla_options`)."""
  from . import plan  # lazy: the CLI starts without jax
  from ._compiled._gpu import gpu_target, quiet_cuda_stub

  target = gpu_target(a.target).name if a.target else None  # an unknown target fails before jax starts
  profile, model = load_model(a.model, a.device)
  net = load_network(a.network, a.workers)
  schedule = plan(profile, net, a.policy)
  with quiet_cuda_stub():
    from ._compiled._xla_options import xla_settings  # inside the stub's quiet: the plugin may print

    s = xla_settings(schedule, net, target=target)
  if a.json:
    print(json.dumps({"model": model, "policy": schedule.policy, "workers": net.workers,
                      "units": schedule.num_allreduces, **s.to_dict()}, indent=1))
    return 0
  print(f'XLA_FLAGS="{s.xla_flags}"')
  print(f"compiler_options={json.dumps(s.compiler_options)}")
  if s.target:
    where = "this machine's GPU" if s.target == "gpu" else f"a compile-only {s.target}"
    print(f"checked against jaxlib {s.jaxlib} on {where}; plan: {model}, {schedule.policy}, "
          f"{schedule.num_allreduces} unit(s), {net.workers} workers")
  for note in s.notes:
    print(f"note: {note}")
  if s.warning:
    print(f"warning: {s.warning}", file=sys.stderr)
  return 0


# -- parser ----------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
  """argparse, but a usage error is one line (naming the flag, and where to read the usage), exit 2."""

  def error(self, message: str) -> Any:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_NETWORK = f"a preset ({', '.join(PRESETS)}) or a NetworkModel JSON"
_MODELS = "mlp, cnn, gpt-tiny, resnet-small"

# the options several commands take, declared once; a command's own keywords (below) override these
_SHARED: dict[str, dict[str, Any]] = {
    "--model": {"required": True}, "--workers": {"type": _positive}, "--policy": {"default": "auto"},
    "--device": {"help": f"device of the bundled trace (default {DEFAULT_DEVICE})"},
    "--network": {"required": True}, "--out": {"required": True},
    "--pressure": {"metavar": "SPEC", "help": "network pressure (see simulate)"},
    "--num-devices": {"type": _positive, "default": 8},
    "--cross-step": {"action": "store_true"}, "--json": {"action": "store_true"},
}

# command -> (its function, its help, its options: a flag of _SHARED as it is, or (flag, keywords))
_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str, tuple[Any, ...]]] = {
    "simulate": (cmd_simulate, "every policy (or those named) on a model", (
        ("--model", dict(help="trace name (resnet50-h100, ...; googlenet-k80 in a development checkout only: "
                              "it reads the public GoogLeNet logs beside the repository), model name completed "
                              "by --device, or a GradientProfile JSON")),
        "--device", "--workers", ("--network", dict(help=_NETWORK)),
        ("--policy", dict(nargs="+", default=None, help="policies to compare (default: all)")),
        ("--pressure", dict(help="network pressure: 'none' or NAME=VALUE,... of Pressure's fields, e.g. "
                                 "background_flows=0.3,tail_prob=0.01,tail_scale_s=0.002 (overrides the network "
                                 "file's); results are then the mean over seeded samples, with p50 and p99")),
        ("--max-defer", dict(type=float, default=0.1, help="dlcp's max_defer in this comparison (default 0.1; "
                                                           "the library's default is 0, lossless)")),
        ("--cross-step", dict(help="simulate the pipelined step")),
        ("--json", dict(help="print the result object as JSON")),
        ("--timeline", dict(metavar="PNG", help="write a Gantt chart per policy")))),
    "plan": (cmd_plan, "write a schedule", (
        ("--profile", dict(required=True)), "--network", "--workers", "--policy", "--pressure",
        ("--max-defer", dict(type=float, help="dlcp's max_defer (default 0: lossless)")), "--cross-step", "--out")),
    "profile": (cmd_profile, "measure a real step of a bundled model", (
        ("--model", dict(help=_MODELS)), "--num-devices",
        ("--steps", dict(type=_positive, default=20, help="steps measured (default 20)")), "--out")),
    "probe": (cmd_probe, "fit alpha and beta of the all-reduce", (
        "--num-devices",
        ("--sizes", dict(type=_positive, nargs="+", metavar="BYTES",
                         help="message sizes in bytes per device (default 1 KiB .. 64 MiB, powers of 4)")),
        ("--repeats", dict(type=_positive, default=15, help="paired timings per size (default 15)")),
        ("--time-budget", dict(type=_non_negative, default=6.0, metavar="SECONDS",
                               help="seconds the probe may take, compiles included (default 6; 0: no budget): "
                                    "sizes run smallest first until the next would not fit, and the output "
                                    "names those cut")), "--out")),
    "demo": (cmd_demo, "the main job: profile, probe, plan, train, compare", (
        ("--steps", dict(type=_positive, default=200)), ("--out-dir", dict(default="out")),
        ("--quick", dict(action="store_true", help="a reduced run (tests)")))),
    "launch": (run_launch, "start N processes wired with jax.distributed", ()),  # add_launch_arguments
    "audit": (cmd_audit, "compile a model's step for a GPU target (no GPU needed) and audit its all-reduces: "
              "count, order, what overlaps them; exit 1 on a mismatch", (
        ("--target", dict(default="h100", help="h100, a100 or v100 (compile-only; needs the gpu-compile extra, "
                                               "or gpu-compile-cuda13, which cannot build for the v100)")),
        ("--devices", dict(type=_positive, default=8)), ("--model", dict(required=False, default="cnn", help=_MODELS)),
        ("--mode", dict(default="scheduled", choices=("scheduled", "hooked", "pipelined", "pmean"))), "--policy",
        ("--network", dict(required=False, default="10gbe", help=_NETWORK)),
        ("--workers", dict(help="default: --devices")),
        ("--profile", dict(help="a GradientProfile JSON of the model (default: its parameter sizes with estimated "
                                "times)")),
        ("--schedule", dict(help="a Schedule JSON to audit instead of planning one")),
        ("--batch", dict(type=_positive, help="global batch (default: the model's)")),
        ("--xla-option", dict(type=_xla_option, action="append", metavar="KEY=VALUE",
                              help="a per-compile XLA option, e.g. xla_gpu_enable_latency_hiding_scheduler=true")),
        ("--jit", dict(action="store_true", help="the plain jax.jit step over sharded arrays (hooked or pipelined "
                                                 "with mesh=; pmean: the partitioner's all-reduce) instead of a "
                                                 "shard_map step")),
        ("--json", dict(help="print the report as JSON")))),
    "xla-flags": (cmd_xla_flags, "the XLA_FLAGS line and compiler_options that realise a plan as far as XLA "
                  "settings can (for a plain jax.jit step), checked against the installed jaxlib", (
        ("--model", dict(help="trace name, model name completed by --device, or a GradientProfile JSON")),
        "--device", "--workers", ("--network", dict(help=_NETWORK)), "--policy",
        ("--target", dict(help="h100, a100 or v100: check on that compile-only GPU (default: this machine's GPU, "
                               "else a compile-only h100 where jax's CUDA plugin is installed)")),
        ("--json", dict(help="print the settings, the jaxlib and the notes as JSON")))),
}


def build_parser() -> argparse.ArgumentParser:
  common = _Parser(add_help=False)
  common.add_argument("--debug", action="store_true", help="show the traceback on errors")
  p = _Parser(prog="prophet-jax", parents=[common],
              description="Plan, simulate and run scheduled gradient all-reduces.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
  for name, (fn, text, options) in _COMMANDS.items():
    s = sub.add_parser(name, parents=[common], help=text)
    for option in options:
      flag, kw = (option, {}) if isinstance(option, str) else option
      s.add_argument(flag, **{**_SHARED.get(flag, {}), **kw})
    s.set_defaults(fn=fn)
  add_launch_arguments(sub.choices["launch"])
  return p


def _quiet_jax_start(command: str) -> None:
  """Where jax's CUDA plugin is installed but no NVIDIA driver is (a CPU machine with the gpu-compile
  extra, as `make test` builds it): pin jax to the CPU (`_config.default_jax_platforms` says why) and
  import jax with the plugin's driver-search lines dropped, so commands print only their own output."""
  from ._values._config import default_jax_platforms, nvidia_driver_present  # lazy: the CLI starts without jax
  from ._compiled._gpu import cuda_plugin_installed, import_jax_quietly

  plugin = cuda_plugin_installed()
  driver = nvidia_driver_present()
  value = default_jax_platforms(os.environ, cuda_plugin=plugin, nvidia_driver=driver)
  if value:
    os.environ["JAX_PLATFORMS"] = value
  if plugin and not driver and command not in ("simulate", "plan", "launch"):
    import_jax_quietly()


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  try:
    _quiet_jax_start(args.command)
    return int(args.fn(args) or 0)
  except (ProphetError, ValueError, TypeError, OSError) as e:
    if args.debug:
      raise
    # one line, whatever the message held
    print(f"prophet-jax {args.command}: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
