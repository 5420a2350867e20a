"""A plan as XLA settings, for users who keep their plain step: `xla_options` (docs/xla_options.md)."""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._values._checks import check_values
from .._values._errors import GpuCompileError
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from ._gpu import GpuTopology, cuda_plugin_installed, gpu_target

# per-compile options the plan sets, each a list of spellings across jaxlib versions (first accepted wins)
_KINDS = (("all-reduce", ("xla_gpu_all_reduce_combine_threshold_bytes",)),   # collective kind -> its threshold
          ("reduce-scatter", ("xla_gpu_reduce_scatter_combine_threshold_bytes",)),
          ("all-gather", ("xla_gpu_all_gather_combine_threshold_bytes",)))
_SCHEDULER = ("xla_gpu_enable_latency_hiding_scheduler",)
_IN_FLIGHT = ("xla_gpu_experimental_parallel_collective_overlap_limit",)
_EARLY_START = ("xla_gpu_experimental_collective_start_as_early_as_possible",)
# the analytical latency model (XLA's SolGPUCostModel): switched on by a bool, filled from a map that
# only XLA_FLAGS can carry (docs/xla_options.md)
_SOL_ON = "xla_gpu_enable_analytical_sol_latency_estimator"
_SOL_MAP = "xla_gpu_analytical_latency_estimator_options"
Units = dict[str, tuple[tuple[int, ...], ...]]   # collective kind -> its units, each the bytes of its leaves
_REFUSED = re.compile(r"No such compile option: '([^']+)'|While setting option (\w+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaSettings:
  """The settings `xla_settings` found for a plan on the installed jaxlib, the notes and the warning."""

  notes: tuple[str, ...]
  compiler_options: dict[str, Any] = field(default_factory=dict)
  xla_flags: str = ""
  jaxlib: str = ""       # '' when nothing was checked
  target: str = ""       # '' when no target could be used
  warning: str = ""

  def to_dict(self) -> dict[str, Any]:
    return {"xla_flags": self.xla_flags, "compiler_options": dict(self.compiler_options),
            "jaxlib": self.jaxlib, "target": self.target, "notes": list(self.notes),
            "warning": self.warning}


# --------------------------------------------------------------------------------------------------
# from the plan (pure)


def _sizes(schedule: Schedule) -> list[int]:
  return [math.prod(shape) for _, shape, _ in schedule.rows]


def plan_units(schedule: Schedule, workers: int) -> Units:
  """The units the plan issues per collective kind, in order, each as the bytes XLA's combiner counts per leaf."""
  from .._values._types import itemsize  # pure

  sizes = _sizes(schedule)
  row_bytes = [n * itemsize(dtype) for n, (_, _, dtype) in zip(sizes, schedule.rows)]
  chunks = schedule.chunks

  def leaves(c: Any, shard: int = 1) -> tuple[int, ...]:
    whole = all((a, b) == (0, sizes[r]) for r, a, b in c.slices)   # XLA counts a whole leaf's bytes
    return tuple(row_bytes[r] // shard for r in c.rows) if whole else (c.nbytes // shard,)

  if schedule.family == "zero1":
    rs = tuple((n * itemsize(c.dtype) // workers,) for n, c in zip(schedule.padded_sizes(workers), chunks))
    ag = tuple((n * itemsize(chunks[g[0]].dtype),) for n, g in zip(schedule.gather_sizes(workers),
                                                                  schedule.gathers))
    return {"reduce-scatter": rs, "all-gather": ag}
  if schedule.family == "fsdp":
    f = schedule.fsdp
    groups = f.gathers or tuple(chunks[u].rows for u in f.units)
    return {"all-reduce": tuple(leaves(c) for k, c in enumerate(chunks) if k not in set(f.units)),
            "reduce-scatter": tuple(leaves(chunks[u], f.shard_count) for u in f.units),
            "all-gather": tuple(tuple(row_bytes[r] for r in g) for g in groups)}
  if schedule.defers:
    return {"all-reduce": tuple((n,) for n in schedule.allreduce_nbytes())}
  return {"all-reduce": tuple(leaves(c) for c in chunks)}


def threshold_fill(units: tuple[tuple[int, ...], ...], threshold: int) -> tuple[int, bool]:
  count, acc, bounds = 0, None, []
  for b in (b for u in units for b in u):
    if acc is None or acc + b > threshold:
      count, acc = count + 1, b
    else:
      acc += b
    bounds.append(count)
  starts = [0] + list(itertools.accumulate(len(u) for u in units))[:-1]
  return count, count == len(units) and all(bounds[i] == k + 1 for k, i in enumerate(starts))   # exact?


def _fill_cap(schedule: Schedule) -> int | None:
  if schedule.policy == "bucket":
    cap = dict(schedule.options).get("bucket_bytes")
    return int(cap) if cap else None
  if schedule.policy == "xla" and schedule.num_allreduces > 1:
    from ..schedulers._xla import GPU_COMBINE_THRESHOLD_BYTES  # pure; the cap the policy models

    return GPU_COMBINE_THRESHOLD_BYTES
  return None


def _thresholds(schedule: Schedule, units: Units) -> dict[str, int]:
  out = {}
  for kind, _ in _KINDS:
    sizes = [sum(u) for u in units.get(kind, ()) if sum(u) > 0]
    if sizes:
      out[kind] = int((_fill_cap(schedule) if kind == "all-reduce" else None) or max(sizes))
  return out


def plan_options(schedule: Schedule, units: Units, limits: dict[str, int]) -> dict[str, tuple[tuple[str, ...], Any]]:
  out = {f"{kind} threshold": (names, limits[kind]) for kind, names in _KINDS if kind in limits}
  out["latency-hiding scheduler"] = (_SCHEDULER, True)
  fsdp = schedule.family == "fsdp"
  f = schedule.fsdp
  depth = max(f.prefetch, f.backward_prefetch) if fsdp else max(schedule.links, default=0) + 1
  out["in flight"] = (_IN_FLIGHT, int(depth))
  if not fsdp and sum(len(v) for v in units.values()) > 1:
    out["early start"] = (_EARLY_START, True)
  return out


def unformed(schedule: Schedule, units: Units, limits: dict[str, int]) -> str | None:
  """Where the settings cannot give this plan: what differs and what does give it; None where they do."""
  parts = []
  sizes = _sizes(schedule)   # the leaves sent in parts (a ZeRO-1 plan's shards are its own)
  cut = [] if schedule.family == "zero1" else [schedule.rows[r][0] for r in sorted(
      {r for c in schedule.chunks for r, a, b in c.slices if (a, b) != (0, sizes[r])})]
  if cut:
    parts.append(f"it sends {len(cut)} leaves in parts ({', '.join(map(repr, cut[:3]))}"
                 f"{', ...' if len(cut) > 3 else ''}), and no threshold cuts a leaf's gradient")
  for kind, limit in limits.items():   # in _KINDS' order
    count, exact = threshold_fill(units[kind], limit)
    if not exact:
      parts.append(f"its {len(units[kind])} {kind} unit(s) become about {count} {kind}(s) under a "
                   f"{limit:,}-byte threshold (XLA joins neighbouring collectives up to the threshold, in its "
                   f"own order)")
  if schedule.defers:
    parts.append("it defers gradient elements (dlcp), which no setting does: a plain step sends every "
                 "gradient every step")
  if not parts:
    return None
  fix = ("To run the plan itself: the library's FSDP step, prophet_jax.hooked(loss_fn, schedule, "
         "axis_name=..., mesh=mesh) (docs/fsdp.md)." if schedule.family == "fsdp" else
         "To run the plan itself: the library's step (prophet_jax.scheduled / hooked / pipelined), or one "
         "XLA combiner key per unit (scheduled(..., enforce_order=False); prophet_jax.tag_layers for a "
         "plain jax.jit step; docs/keys.md).")
  return (f"these settings do not give this {schedule.policy!r} plan: {'; '.join(parts)}. {fix}")


def fsdp_notes(schedule: Schedule) -> list[str]:
  if schedule.family != "fsdp":
    return []
  f = schedule.fsdp
  return [f"fsdp: which gathered parameters backward gathers again ({sum(not k for k in f.keep)} of "
          f"{len(f.keep)} groups in this plan) is XLA's rematerialisation, not a setting; the forward prefetch depth "
          f"({f.prefetch}) is set only as the in-flight limit; early start is left off (it would start "
          f"every all-gather at the top of the step, every parameter gathered at once)."]


def network_flags(network: NetworkModel) -> dict[str, str]:
  rtt_us = max(1, round(network.alpha_s * 1e6))
  nic_gbps = 1.0 / (network.beta_s_per_byte * 1e9) if network.beta_s_per_byte > 0 else 1e6
  return {_SOL_ON: "true", _SOL_MAP: f"nic_speed_gbps={nic_gbps:.6g},rtt_us={rtt_us},gpus_per_node=1"}


# --------------------------------------------------------------------------------------------------
# what the installed jaxlib accepts (jax)


@functools.lru_cache(maxsize=None)
def _probe_program(target: str) -> Any:
  import jax  # jax starts here, after gpu_target/_resolve_target looked at the environment (JAX_PLATFORMS)
  import jax.numpy as jnp  # (the same reason)
  from jax.sharding import PartitionSpec as P  # (the same reason)

  if target == "gpu":
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
  else:
    from ._gpu import gpu_topology  # (the same reason: it sets up the compile-only platform first)

    topo = gpu_topology(target, devices=2)
    mesh = topo.mesh("data")
    x = topo.abstract(jax.ShapeDtypeStruct((64,), jnp.float32), P("data"), mesh=mesh)
  def prophet_option_probe(v):   # the name tells tests/_golden.py this program is no step
    return jax.lax.psum(v * 2, "data")

  f = jax.jit(jax.shard_map(prophet_option_probe, mesh=mesh, in_specs=P("data"), out_specs=P()))
  return f.lower(x)


_ACCEPTED: dict[tuple[str, str, str], bool] = {}   # (target, option, value type) -> accepted


def _accepts(target: str, options: dict[str, Any]) -> dict[str, bool]:
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
      _ACCEPTED[key(name, todo.pop(name))] = False   # refused: try the others again without it
    else:
      _ACCEPTED.update({key(k, v): True for k, v in todo.items()})
      todo = {}
  return {k: _ACCEPTED[key(k, v)] for k, v in options.items()}


_FLAGS_OK: dict[str, bool] = {}   # flag name -> the child process started with it


def _flags_accepted(flags: dict[str, str]) -> dict[str, bool]:
  todo = [k for k in flags if k not in _FLAGS_OK]
  if todo and _starts(" ".join(f"--{k}={flags[k]}" for k in todo)):
    _FLAGS_OK.update(dict.fromkeys(todo, True))
  else:  # one at a time, to say which
    _FLAGS_OK.update({k: _starts(f"--{k}={flags[k]}") for k in todo})
  return {k: _FLAGS_OK[k] for k in flags}


def _starts(xla_flags: str) -> bool:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  code = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.zeros(2)).block_until_ready()"
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120).returncode == 0


def _resolve_target(target: Any) -> tuple[str | None, str | None]:
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


def xla_settings(schedule: Schedule, network: NetworkModel | None = None, *, target: Any = None) -> XlaSettings:
  """The compiler options, the XLA_FLAGS line and the notes for `schedule` (see `xla_options`)."""
  check_values("xla_options", schedule=schedule, **({} if network is None else {"network": network}))
  units = plan_units(schedule, 8 if network is None else network.workers)   # a sharded plan's workers
  limits = _thresholds(schedule, units)
  wanted = plan_options(schedule, units, limits)
  warning = unformed(schedule, units, limits) or ""
  name, why = _resolve_target(target)
  if name is None:
    return XlaSettings(notes=(why,), warning=warning)
  import jaxlib  # only where a target exists (the CLI's xla-flags imports this module without jax)

  notes: list[str] = fsdp_notes(schedule)
  candidates = {n: value for names, value in wanted.values() for n in names}
  try:
    ok = _accepts(name, candidates)
  except GpuCompileError as e:
    if target is not None:
      raise
    # no target named: one was guessed from the installed plugin, and this environment cannot build it
    return XlaSettings(jaxlib=jaxlib.__version__, notes=(f"no GPU target could be used to check the options: {e}",),
                       warning=warning)
  options: dict[str, Any] = {}
  for setting, (names, value) in wanted.items():
    first = next((n for n in names if ok[n]), None)
    if first is None:
      notes.append(f"{setting}: jaxlib {jaxlib.__version__} refuses {' and '.join(names)}; not set.")
    else:
      options[first] = value
  flags = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()}
  if network is not None:
    net = network_flags(network)
    # the map is refused as a compile option by every jaxlib measured; try the bool there all the same
    if _accepts(name, {_SOL_ON: True})[_SOL_ON] and _accepts(name, {_SOL_MAP: net[_SOL_MAP]})[_SOL_MAP]:
      options.update({_SOL_ON: True, _SOL_MAP: net[_SOL_MAP]})
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
  return XlaSettings(compiler_options=options, xla_flags=" ".join(f"--{k}={v}" for k, v in flags.items()),
                     jaxlib=jaxlib.__version__, target=name, notes=tuple(notes), warning=warning)


def xla_options(schedule: Schedule, network: NetworkModel | None = None, *, target: Any = None) -> dict[str, Any]:
  """XLA `compiler_options` that realise `schedule` as far as settings can (docs/xla_options.md).

  Args:
    schedule: the plan; network: its NetworkModel, or None for no network-derived options.
    target: the GPU the options are checked on by compiling a tiny program: 'h100', 'a100', 'v100'
      (compile-only) or a GpuTopology; None: the machine's GPU, else a compile-only H100 where jax's
      CUDA plugin is installed, else none (`{}` and a warning).

  Returns:
    A dict for `.compile(compiler_options=...)`, with a UserWarning where it does not give the plan's units.

  Raises:
    TypeError: `schedule` or `network` of the wrong type; ValueError: an unknown target name.
    GpuCompileError: a named target this environment cannot compile for (what to install or set).

  Example:
    >>> opts = prophet_jax.xla_options(schedule, network, target="h100")
    >>> compiled = jax.jit(step).lower(params, batch).compile(compiler_options=opts)
  """
  s = xla_settings(schedule, network, target=target)
  if not s.target:
    warnings.warn(f"xla_options: {s.notes[0]}", UserWarning, stacklevel=2)
  elif s.warning:
    warnings.warn(f"xla_options: {s.warning}", UserWarning, stacklevel=2)
  return dict(s.compiler_options)


