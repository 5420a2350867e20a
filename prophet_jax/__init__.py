"""prophet_jax: scheduled gradient all-reduces for data-parallel JAX training.

profile -> measure -> plan -> rewrite -> simulate. Planning and simulation are pure numpy and work
without jax; the jax-backed names (allreduce, scheduled, hooked, pipelined, audit, profile_step,
measure_network, Monitor, choose, gpu_topology, lower_step, compile_step, profile_from_trace,
xla_options) are imported lazily on
first use, as is matplotlib (plot_timelines).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# private module -> the public names it defines, imported on first use
_MODULES = {
    # values and errors (pure)
    "_values._types": "GradientProfile ProfileRow", "_values._network": "NetworkModel Pressure",
    "_values._schedule": "Chunk Bucket Schedule",
    "_values._errors": "ProphetError ProfileError NetworkError ScheduleError ScheduleMismatchError UnboundAxisError "
                       "AlreadyReducedError TraceUnavailableError LaunchError GlooBindError CompositionError "
                       "GpuCompileError DeferralWarning ShardingError JaxVersionError",
    # planning, simulation, plots (pure; matplotlib is imported when one is drawn), the measured choice's statistics
    "schedulers._plan": "plan validate_schedule", "schedulers._registry": "POLICIES", "_planning._simulate": "SimResult Event simulate",
    "_planning._bound": "lower_bound", "_planning._timeline": "plot_timelines", "_planning._paired": "Choice",
    # the rewrite (jax)
    "_rewrite._reduction": "allreduce", "_rewrite._transform": "scheduled", "_rewrite._hooked": "hooked loop_hook",
    "_rewrite._pipelined": "pipelined", "_rewrite._defer": "defer_state", "_rewrite._compose": "check_composition",
    "_rewrite._states": "DeferState ShardedState GradShards OwedState",
    "_rewrite._containers": "state_specs deferred_grads unshard_state shard_state",
    "_rewrite._convert_state": "convert_state first_step_specs", "_rewrite._tagging": "tag_layers tag_plan TaggedPlan",
    # measurement, several processes, compiled programs (jax; a GPU target's when a topology is made)
    "_measure._profile": "profile_step profile_from_trace", "_measure._probe": "measure_network probe AllreduceTimings",
    "_multiprocess._monitor": "Monitor", "_multiprocess._choose": "choose", "_compiled._audit": "audit AuditReport",
    "_compiled._gpu": "gpu_topology GpuTopology GpuTarget gpu_target GPU_TARGETS", "_steps": "lower_step compile_step",
    "_compiled._xla_options": "xla_options",   # the plan as XLA settings, for a plain step
}
# public name -> private module that defines it
_EXPORTS: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = sorted(_EXPORTS) + ["schedulers"]


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
  if name == "schedulers":
    return importlib.import_module(".schedulers", __name__)
  raise AttributeError(f"module 'prophet_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs only
  from ._compiled._audit import AuditReport, audit
  from ._planning._bound import lower_bound
  from ._rewrite._reduction import allreduce
  from ._rewrite._containers import deferred_grads, shard_state, state_specs, unshard_state
  from ._rewrite._defer import defer_state
  from ._values._errors import (AlreadyReducedError, CompositionError, DeferralWarning, GlooBindError, GpuCompileError,
                        JaxVersionError, LaunchError, NetworkError, ProfileError, ProphetError,
                        ScheduleError, ScheduleMismatchError, ShardingError, TraceUnavailableError,
                        UnboundAxisError)
  from ._compiled._gpu import GPU_TARGETS, GpuTarget, GpuTopology, gpu_target, gpu_topology
  from ._multiprocess._choose import choose
  from ._compiled._xla_options import xla_options
  from ._multiprocess._monitor import Monitor
  from ._planning._paired import Choice
  from ._measure._probe import AllreduceTimings, measure_network, probe
  from ._rewrite._pipelined import pipelined
  from .schedulers._plan import plan, validate_schedule
  from .schedulers._registry import POLICIES
  from ._measure._profile import profile_from_trace, profile_step
  from ._planning._simulate import simulate
  from ._steps import compile_step, lower_step
  from ._planning._timeline import plot_timelines
  from ._rewrite._compose import check_composition
  from ._rewrite._hooked import hooked, loop_hook
  from ._rewrite._transform import scheduled
  from ._rewrite._tagging import TaggedPlan, tag_layers, tag_plan
  from ._values._schedule import Bucket, Chunk, Schedule
  from ._planning._simulate import Event, SimResult
  from ._values._types import GradientProfile, ProfileRow
  from ._rewrite._convert_state import convert_state, first_step_specs
  from ._rewrite._states import DeferState, GradShards, OwedState, ShardedState
  from ._values._network import NetworkModel, Pressure
