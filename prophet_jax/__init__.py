"""prophet_jax: scheduled gradient all-reduces for data-parallel JAX training.

profile -> measure -> plan -> rewrite -> simulate. Planning and simulation are pure numpy and work
without jax; the jax-backed names (allreduce, scheduled, hooked, pipelined, audit, profile_step,
measure_network, Monitor, gpu_topology, lower_step, compile_step, profile_from_trace) are imported lazily on
first use, as is matplotlib (plot_timelines).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> private module that defines it
_EXPORTS: dict[str, str] = {
    # values (pure)
    "GradientProfile": "_types", "ProfileRow": "_types", "NetworkModel": "_network", "Pressure": "_network",
    "Chunk": "_schedule",
    "Bucket": "_schedule", "Schedule": "_schedule", "SimResult": "_simulate", "Event": "_simulate",
    # errors (pure)
    "ProphetError": "_errors", "ProfileError": "_errors", "NetworkError": "_errors",
    "ScheduleError": "_errors", "ScheduleMismatchError": "_errors", "UnboundAxisError": "_errors",
    "AlreadyReducedError": "_errors", "TraceUnavailableError": "_errors", "LaunchError": "_errors",
    "GlooBindError": "_errors", "CompositionError": "_errors", "GpuCompileError": "_errors",
    "DeferralWarning": "_errors", "ShardingError": "_errors", "JaxVersionError": "_errors",
    # planning and simulation (pure)
    "plan": "_plan", "validate_schedule": "_plan", "POLICIES": "_plan",
    "simulate": "_simulate", "lower_bound": "_bound",
    # plots (pure; matplotlib is imported when one is drawn)
    "plot_timelines": "_timeline",
    # the rewrite and measurement (jax)
    "allreduce": "_collectives", "scheduled": "_transform", "hooked": "_transform",
    "defer_state": "_defer", "DeferState": "_defer", "state_specs": "_zero", "deferred_grads": "_defer",
    "ShardedState": "_zero", "GradShards": "_zero", "unshard_state": "_zero", "shard_state": "_zero",
    "loop_hook": "_transform", "check_composition": "_transform",
    "pipelined": "_pipelined", "audit": "_audit", "AuditReport": "_audit",
    "profile_step": "_profile", "profile_from_trace": "_profile", "measure_network": "_probe",
    "probe": "_probe", "AllreduceTimings": "_probe", "Monitor": "_monitor",
    # compile-only GPU targets (jax, imported when a topology is made)
    "gpu_topology": "_gpu", "GpuTopology": "_gpu", "GpuTarget": "_gpu", "gpu_target": "_gpu",
    "GPU_TARGETS": "_gpu", "lower_step": "_steps", "compile_step": "_steps",
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
  from ._audit import AuditReport, audit
  from ._bound import lower_bound
  from ._collectives import allreduce
  from ._defer import DeferState, defer_state, deferred_grads
  from ._errors import (AlreadyReducedError, CompositionError, DeferralWarning, GlooBindError, GpuCompileError,
                        JaxVersionError, LaunchError, NetworkError, ProfileError, ProphetError,
                        ScheduleError, ScheduleMismatchError, ShardingError, TraceUnavailableError,
                        UnboundAxisError)
  from ._gpu import GPU_TARGETS, GpuTarget, GpuTopology, gpu_target, gpu_topology
  from ._monitor import Monitor
  from ._probe import AllreduceTimings, measure_network, probe
  from ._pipelined import pipelined
  from ._plan import POLICIES, plan, validate_schedule
  from ._profile import profile_from_trace, profile_step
  from ._simulate import simulate
  from ._steps import compile_step, lower_step
  from ._timeline import plot_timelines
  from ._transform import check_composition, hooked, loop_hook, scheduled
  from ._schedule import Bucket, Chunk, Schedule
  from ._simulate import Event, SimResult
  from ._types import GradientProfile, ProfileRow
  from ._zero import GradShards, ShardedState, shard_state, state_specs, unshard_state
  from ._network import NetworkModel, Pressure
