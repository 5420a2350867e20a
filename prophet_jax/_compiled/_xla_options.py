"""A plan as XLA settings, for users who keep their plain step: `xla_options(schedule, network, target=)`.

A user who keeps `jax.jit` (or a `pmean` under `shard_map`) cannot give XLA a plan's buckets, only
settings: combine thresholds, the latency-hiding scheduler, how many collectives may be in flight,
early start, and the network XLA's scheduler assumes. This module picks those settings from a plan and
keeps only what the *installed* jaxlib accepts:

- Each candidate is checked once per process by compiling a tiny program with it on a GPU target (a
  compile-only one, `gpu_topology`, on a machine without a GPU): an unknown compile option raises
  there ('No such compile option'), whereas an unknown `XLA_FLAGS` entry aborts the whole process. The
  names move between versions (jax 0.10.2 takes the boolean `xla_gpu_enable_pipelined_*`; jaxlib 0.12
  refuses them and takes `xla_gpu_pipeline_*` modes), so nothing is assumed from a version number.
- The analytical (speed-of-light) latency model, `xla_gpu_analytical_latency_estimator_options`, is a
  map that neither jaxlib 0.10.2 nor 0.12 accepts as a compile option ("is not a valid message value",
  whatever the spelling); it goes in the `XLA_FLAGS` line (`xla_flags`), which is checked in a child
  process so that a refused entry cannot abort this one.

What thresholds can and cannot do (measured: bench/xla_options.py, docs/xla_options.md): the combiner
merges consecutive all-reduces in its own program order while the sum stays within the threshold, so a
threshold sets the *number* of buckets of a threshold-fill plan (`bucket`, `xla`), never which leaves go
together; a per-layer plan, a priority plan with sliced leaves, or the exact membership of any plan needs
combiner keys (`enforce_order=False`) or the library's own steps.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from .._values._errors import GpuCompileError
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from ._gpu import GpuTopology, cuda_plugin_installed, gpu_target

__all__ = ["xla_options", "xla_settings", "XlaSettings", "plan_options", "network_flags"]

# per-compile options the plan sets, each a list of spellings across jaxlib versions (first accepted wins)
_AR_THRESHOLD = ("xla_gpu_all_reduce_combine_threshold_bytes",)
_RS_THRESHOLD = ("xla_gpu_reduce_scatter_combine_threshold_bytes",)
_AG_THRESHOLD = ("xla_gpu_all_gather_combine_threshold_bytes",)
_SCHEDULER = ("xla_gpu_enable_latency_hiding_scheduler",)
_IN_FLIGHT = ("xla_gpu_experimental_parallel_collective_overlap_limit",)
_EARLY_START = ("xla_gpu_experimental_collective_start_as_early_as_possible",)
# the analytical latency model (XLA's SolGPUCostModel): switched on by a bool, filled from a map that
# only XLA_FLAGS can carry (see the module docstring)
_SOL_ON = "xla_gpu_enable_analytical_sol_latency_estimator"
_SOL_MAP = "xla_gpu_analytical_latency_estimator_options"
_REFUSED = re.compile(r"No such compile option: '([^']+)'|While setting option (\w+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaSettings:
  """The settings `xla_settings` found for a plan on the installed jaxlib.

  Attributes:
    compiler_options: per-compile options (`jax.jit(f).lower(...).compile(compiler_options=...)`),
      each accepted by this jaxlib.
    xla_flags: the same as an `XLA_FLAGS` line, plus what only flags carry (the latency model's map),
      each entry checked in a child process ('' when there is nothing to set).
    jaxlib: the jaxlib version they were checked against ('' when nothing was checked).
    target: the target they were checked on ('h100', 'gpu' for a real GPU, '' for none).
    notes: why something was left out, one sentence each.
  """

  compiler_options: dict[str, Any]
  xla_flags: str
  jaxlib: str
  target: str
  notes: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    return {"xla_flags": self.xla_flags, "compiler_options": dict(self.compiler_options),
            "jaxlib": self.jaxlib, "target": self.target, "notes": list(self.notes)}


# --------------------------------------------------------------------------------------------------
# from the plan (pure)


def _unit_bytes(schedule: Schedule, workers: int) -> dict[str, tuple[int, ...]]:
  """Bytes of every unit the plan issues, per collective kind ('all-reduce', 'reduce-scatter',
  'all-gather'), in issue order."""
  if not schedule.sharded:
    return {"all-reduce": schedule.allreduce_nbytes()}
  from .._values._types import itemsize  # pure; only sharded plans need the element width

  chunks = schedule.chunks
  rs = tuple(n * itemsize(c.dtype) for n, c in zip(schedule.padded_sizes(workers), chunks))
  ag = tuple(n * itemsize(chunks[g[0]].dtype) for n, g in zip(schedule.gather_sizes(workers), schedule.gathers))
  return {"reduce-scatter": rs, "all-gather": ag}


def _fill_cap(schedule: Schedule) -> int | None:
  """The byte cap a threshold-fill plan filled its buckets to: `bucket`'s `bucket_bytes`, `xla`'s 30 MiB
  (XLA:GPU's own default, which the policy models); None for other plans."""
  if schedule.policy == "bucket":
    cap = dict(schedule.options).get("bucket_bytes")
    return int(cap) if cap else None
  if schedule.policy == "xla" and schedule.num_allreduces > 1:
    from ..schedulers._xla import GPU_COMBINE_THRESHOLD_BYTES  # pure; the cap the policy models

    return GPU_COMBINE_THRESHOLD_BYTES
  return None


def plan_options(schedule: Schedule, network: NetworkModel | None = None) -> dict[str, tuple[tuple[str, ...], Any]]:
  """The settings a plan asks for, before any jaxlib is asked: setting -> (spellings, value).

  - Combine thresholds, per collective kind the plan issues: for a threshold-fill plan (`bucket`, `xla`)
    the cap it filled to (on ResNet-50 `bucket`'s 25 MiB gave its 5 buckets where its largest bucket's
    bytes gave 4); for any other plan the largest unit's bytes, so the combiner can form every unit (a
    smaller threshold would split the largest) and merges no more than that. XLA merges in its own
    program order, not the plan's ready order: the count can follow a plan, which leaves go together
    does not (bench/xla_options.py, docs/xla_options.md).
  - The latency-hiding scheduler on (it is what overlaps a collective with compute on GPUs).
  - In flight: the plan's links (one tie chain per link: that many collectives at once).
  - Early start where the plan overlaps communication with backward (more than one unit: each starts as
    soon as its gradients exist); a plan of one unit sends it after backward, so it is not set.
  A sharded plan's unit sizes depend on the workers: `network.workers`, or 8 without a network.
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f"xla_options: `schedule` must be a prophet_jax.Schedule (from prophet_jax.plan), got "
                    f"{type(schedule).__name__}.")
  if network is not None and not isinstance(network, NetworkModel):
    raise TypeError(f"xla_options: `network` must be a prophet_jax.NetworkModel or None, got "
                    f"{type(network).__name__}.")
  workers = network.workers if network is not None else 8
  units = _unit_bytes(schedule, workers)
  out: dict[str, tuple[tuple[str, ...], Any]] = {}
  for kind, names in (("all-reduce", _AR_THRESHOLD), ("reduce-scatter", _RS_THRESHOLD),
                      ("all-gather", _AG_THRESHOLD)):
    sizes = [n for n in units.get(kind, ()) if n > 0]
    if sizes:
      cap = _fill_cap(schedule) if kind == "all-reduce" else None
      out[f"{kind} threshold"] = (names, int(cap or max(sizes)))
  out["latency-hiding scheduler"] = (_SCHEDULER, True)
  links = max(schedule.links, default=0) + 1
  out["in flight"] = (_IN_FLIGHT, int(links))
  if sum(len(v) for v in units.values()) > 1:
    out["early start"] = (_EARLY_START, True)
  return out


def network_flags(network: NetworkModel) -> dict[str, str]:
  """XLA's analytical latency model filled from a NetworkModel, as XLA_FLAGS entries.

  XLA's speed-of-light model (`SolGPUCostModel::RingLatency`) charges an all-reduce of b bytes over N
  GPUs, g per node, 2 (N - 1)/g (b/N / nic + chunk_prep + rtt) + launch. With g = 1 (every worker its
  own link, as `NetworkModel`'s ring) that is the ring's 2 (P - 1) alpha + 2 (P - 1)/P b beta with
  rtt = alpha (per ring step) and nic = 1/beta: `rtt_us` = alpha in microseconds (XLA reads an integer,
  at least 1), `nic_speed_gbps` = 1/beta in GB/s (10^9 bytes/s, as XLA's comment says), `gpus_per_node`
  1. XLA's launch and chunk-preparation terms keep their defaults (the NetworkModel has no such term;
  XLA ignores values <= 0).
  """
  rtt_us = max(1, round(network.alpha_s * 1e6))
  nic_gbps = 1.0 / (network.beta_s_per_byte * 1e9) if network.beta_s_per_byte > 0 else 1e6
  value = f"nic_speed_gbps={nic_gbps:.6g},rtt_us={rtt_us},gpus_per_node=1"
  return {_SOL_ON: "true", _SOL_MAP: value}


# --------------------------------------------------------------------------------------------------
# what the installed jaxlib accepts (jax)


@functools.lru_cache(maxsize=None)
def _probe_program(target: str) -> Any:
  """A tiny psum program lowered for `target` ('gpu': the real GPU), to compile candidate options on."""
  import jax  # jax starts here, after gpu_target/_resolve_target looked at the environment (JAX_PLATFORMS)
  import jax.numpy as jnp  # (the same reason)
  from jax.sharding import PartitionSpec as P  # (the same reason)

  if target == "gpu":
    devices = jax.devices()[:1]
    mesh = jax.sharding.Mesh(devices, ("data",))
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
  else:
    from ._gpu import gpu_topology  # (the same reason: it sets up the compile-only platform first)

    topo = gpu_topology(target, devices=2)
    mesh = topo.mesh("data")
    x = topo.abstract(jax.ShapeDtypeStruct((64,), jnp.float32), P("data"), mesh=mesh)
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v * 2, "data"), mesh=mesh, in_specs=P("data"),
                            out_specs=P()))
  return f.lower(x)


_ACCEPTED: dict[tuple[str, str, str], bool] = {}   # (target, option, value type) -> accepted


def _accepts(target: str, options: dict[str, Any]) -> dict[str, bool]:
  """For each option, whether the installed jaxlib compiles the probe program with it (memoised per
  target, name and value type: one compile for all unknown ones, one more per refusal)."""
  key = lambda k, v: (target, k, type(v).__name__)  # noqa: E731
  todo = {k: v for k, v in options.items() if key(k, v) not in _ACCEPTED}
  while todo:
    lowered = _probe_program(target)
    try:
      lowered.compile(compiler_options=dict(todo))
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
      m = _REFUSED.search(str(e))
      name = (m.group(1) or m.group(2)) if m else None
      if name not in todo:
        raise
      _ACCEPTED[key(name, todo.pop(name))] = False
      continue
    for k, v in todo.items():
      _ACCEPTED[key(k, v)] = True
    todo = {}
  return {k: _ACCEPTED[key(k, v)] for k, v in options.items()}


_FLAGS_OK: dict[str, bool] = {}   # flag name -> the child process started with it


def _flags_accepted(flags: dict[str, str]) -> dict[str, bool]:
  """Whether a process starts with each `--name=value` in XLA_FLAGS (an unknown one aborts the
  process, so each new name is tried in a child process; memoised per name)."""
  todo = [k for k in flags if k not in _FLAGS_OK]
  if todo:
    line = " ".join(f"--{k}={flags[k]}" for k in todo)
    env = {**os.environ, "XLA_FLAGS": line, "JAX_PLATFORMS": "cpu"}
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.zeros(2)).block_until_ready()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
      _FLAGS_OK.update(dict.fromkeys(todo, True))
    else:  # one at a time, to say which
      for k in todo:
        env["XLA_FLAGS"] = f"--{k}={flags[k]}"
        one = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
        _FLAGS_OK[k] = one.returncode == 0
  return {k: _FLAGS_OK[k] for k in flags}


def _resolve_target(target: Any) -> tuple[str | None, str | None]:
  """(the target to check on, or None; the note saying why there is none)."""
  if isinstance(target, GpuTopology):
    return target.target.name, None
  if target is not None:
    return gpu_target(target).name, None
  if not cuda_plugin_installed():
    return None, ("no GPU target is known: jax's CUDA plugin (XLA:GPU's compiler) is not installed and no "
                  "`target` was given, so no XLA:GPU option can be checked and none is returned. Install "
                  "'prophet-jax[gpu-compile]' and pass target='h100' (or 'a100', 'v100'), or call it on a "
                  "machine with a GPU.")
  import jax  # only once a plugin is known to be there: jax then starts with it

  try:
    if jax.devices()[0].platform == "gpu":
      return "gpu", None
  except RuntimeError:
    pass
  return "h100", None


def _flag_value(v: Any) -> str:
  return ("true" if v else "false") if isinstance(v, bool) else str(v)


def xla_settings(schedule: Schedule, network: NetworkModel | None = None, *, target: Any = None) -> XlaSettings:
  """The compiler options, the XLA_FLAGS line and the notes for `schedule` on the installed jaxlib.

  See `xla_options`; this also returns the flags line, the jaxlib version and why anything was left out.
  """
  wanted = plan_options(schedule, network)
  name, why = _resolve_target(target)
  if name is None:
    return XlaSettings(compiler_options={}, xla_flags="", jaxlib="", target="", notes=(why,))
  import jaxlib  # only where a target exists (the CLI's xla-flags imports this module without jax)

  notes: list[str] = []
  candidates = {names[i]: value for names, value in wanted.values() for i in range(len(names))}
  try:
    ok = _accepts(name, candidates)
  except GpuCompileError as e:
    if target is not None:
      raise
    # no target named: one was guessed from the installed plugin, and this environment cannot build it
    return XlaSettings(compiler_options={}, xla_flags="", jaxlib=jaxlib.__version__, target="",
                       notes=(f"no GPU target could be used to check the options: {e}",))
  options: dict[str, Any] = {}
  for setting, (names, value) in wanted.items():
    first = next((n for n in names if ok[n]), None)
    if first is None:
      notes.append(f"{setting}: jaxlib {jaxlib.__version__} refuses {' and '.join(names)}; not set.")
    else:
      options[first] = value
  flags = {k: _flag_value(v) for k, v in options.items()}
  if network is not None:
    net = network_flags(network)
    # the map is refused as a compile option by every jaxlib measured; try the bool there all the same
    if _accepts(name, {_SOL_ON: True})[_SOL_ON] and _accepts(name, {_SOL_MAP: net[_SOL_MAP]})[_SOL_MAP]:
      options[_SOL_ON] = True
      options[_SOL_MAP] = net[_SOL_MAP]
    fine = _flags_accepted(net)
    for k, v in net.items():
      if fine[k]:
        flags[k] = v
      else:
        notes.append(f"network: jaxlib {jaxlib.__version__} does not start with --{k} in XLA_FLAGS; not set.")
    if all(fine.values()) and _SOL_MAP not in options:
      notes.append(f"network: XLA's analytical latency model ({_SOL_MAP}) is a map no compile option "
                   f"carries on jaxlib {jaxlib.__version__}: it is in the XLA_FLAGS line only.")
  else:
    notes.append("network=None: no network-derived options.")
  line = " ".join(f"--{k}={v}" for k, v in flags.items())
  return XlaSettings(compiler_options=options, xla_flags=line, jaxlib=jaxlib.__version__, target=name,
                     notes=tuple(notes))


def xla_options(schedule: Schedule, network: NetworkModel | None = None, *, target: Any = None) -> dict[str, Any]:
  """XLA `compiler_options` for the installed jaxlib that realise `schedule` as far as settings can.

  For a plain `jax.jit` step (or a `pmean` under `shard_map`) that keeps XLA's own gradient
  collectives: combine thresholds from the plan's units (the largest unit's bytes, per collective kind
  the plan issues), the latency-hiding scheduler on, the number of collectives in flight (the plan's
  links), early start where the plan overlaps communication with backward. Each option is checked once
  per process by compiling a tiny program with it for `target` (a refused one is left out, never
  returned). XLA's analytical latency model filled from `network` cannot be a compile option on the
  jaxlibs measured (0.10.2, 0.12): `prophet-jax xla-flags` prints it as an XLA_FLAGS line.

  Thresholds give the plan's *count* of buckets for threshold-fill plans (`bucket`, `xla`) but not
  their membership (XLA merges in its own order; docs/xla_options.md has the measured table); for other
  plans, and for exact buckets, use combiner keys (`scheduled(..., enforce_order=False)`) or the
  library's own steps.

  Args:
    schedule: the plan (`prophet_jax.plan`).
    network: the NetworkModel it was planned for, or None for no network-derived options.
    target: the GPU to check the options on: 'h100', 'a100', 'v100' (compile-only, `gpu_topology`) or a
      GpuTopology; None: the machine's GPU if jax has one, else a compile-only H100 if jax's CUDA plugin
      is installed, else none.

  Returns:
    A dict for `jax.jit(step).lower(...).compile(compiler_options=...)`; `{}` (with a warning saying
    why) where no GPU target is known.

  Raises:
    TypeError: `schedule` or `network` of the wrong type.
    ValueError: an unknown target name.
    GpuCompileError: a named target that this environment cannot compile for (the message says what to
      install or set).

  Example:
    >>> opts = prophet_jax.xla_options(schedule, network, target="h100")
    >>> compiled = jax.jit(step).lower(params, batch).compile(compiler_options=opts)
  """
  s = xla_settings(schedule, network, target=target)
  if not s.target:
    warnings.warn(f"xla_options: {s.notes[0]}", UserWarning, stacklevel=2)
  return dict(s.compiler_options)


