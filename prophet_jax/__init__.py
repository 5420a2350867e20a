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

# public name -> private module that defines it
_EXPORTS: dict[str, str] = {
    # values (pure)
    "GradientProfile": "_values._types", "ProfileRow": "_values._types", "NetworkModel": "_values._network", "Pressure": "_values._network",
    "Chunk": "_values._schedule",
    "Bucket": "_values._schedule", "Schedule": "_values._schedule", "SimResult": "_planning._simulate", "Event": "_planning._simulate",
    # errors (pure)
    "ProphetError": "_values._errors", "ProfileError": "_values._errors", "NetworkError": "_values._errors",
    "ScheduleError": "_values._errors", "ScheduleMismatchError": "_values._errors", "UnboundAxisError": "_values._errors",
    "AlreadyReducedError": "_values._errors", "TraceUnavailableError": "_values._errors", "LaunchError": "_values._errors",
    "GlooBindError": "_values._errors", "CompositionError": "_values._errors", "GpuCompileError": "_values._errors",
    "DeferralWarning": "_values._errors", "ShardingError": "_values._errors", "JaxVersionError": "_values._errors",
    # planning and simulation (pure)
    "plan": "schedulers._plan", "validate_schedule": "schedulers._plan", "POLICIES": "schedulers._plan",
    "simulate": "_planning._simulate", "lower_bound": "_planning._bound",
    # plots (pure; matplotlib is imported when one is drawn)
    "plot_timelines": "_planning._timeline",
    # the rewrite and measurement (jax)
    "allreduce": "_rewrite._reduction", "scheduled": "_rewrite._transform", "hooked": "_rewrite._hooked",
    "defer_state": "_rewrite._defer", "DeferState": "_rewrite._states", "state_specs": "_rewrite._containers", "deferred_grads": "_rewrite._containers",
    "ShardedState": "_rewrite._states", "GradShards": "_rewrite._states", "unshard_state": "_rewrite._containers", "shard_state": "_rewrite._containers",
    "convert_state": "_rewrite._convert_state", "first_step_specs": "_rewrite._convert_state", "OwedState": "_rewrite._states",
    "loop_hook": "_rewrite._hooked", "check_composition": "_rewrite._compose",
    "pipelined": "_rewrite._pipelined", "audit": "_compiled._audit", "AuditReport": "_compiled._audit",
    "tag_layers": "_rewrite._tagging", "tag_plan": "_rewrite._tagging", "TaggedPlan": "_rewrite._tagging",
    "profile_step": "_measure._profile", "profile_from_trace": "_measure._profile", "measure_network": "_measure._probe",
    "probe": "_measure._probe", "AllreduceTimings": "_measure._probe", "Monitor": "_multiprocess._monitor",
    # measured choice between steps (the statistics are pure; choose runs the steps)
    "choose": "_multiprocess._choose", "Choice": "_planning._paired",
    # compile-only GPU targets (jax, imported when a topology is made)
    "gpu_topology": "_compiled._gpu", "GpuTopology": "_compiled._gpu", "GpuTarget": "_compiled._gpu", "gpu_target": "_compiled._gpu",
    "GPU_TARGETS": "_compiled._gpu", "lower_step": "_steps", "compile_step": "_steps",
    # the plan as XLA settings, for a plain step (jax, imported when the options are checked)
    "xla_options": "_compiled._xla_options",
}

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
  from .schedulers._plan import POLICIES, plan, validate_schedule
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
