"""plan(): a Schedule from a profile, a network model and a policy; validate_schedule().

Pure: numpy only, never jax.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import ScheduleError
from ._tree import match_rows
from ._types import GradientProfile, NetworkModel, Schedule


def _auto(**options: Any):
  from .schedulers._auto import auto

  return auto(**options)


def _dlcp(**options: Any):
  raise ValueError("policy 'dlcp' is reserved for a later policy (DLCP's chunk-level priority, bounded "
                   "dropping and striping) and is not implemented yet; use 'prophet', 'mgwfbp' or "
                   "'auto'.")


def _factories() -> dict[str, Callable[..., Any]]:
  from . import schedulers as s

  return {"wfbp": s.wfbp, "bucket": s.bucket, "xla": s.xla, "mgwfbp": s.mgwfbp, "priority": s.priority,
          "prophet": s.prophet, "auto": _auto, "dlcp": _dlcp}


# name -> factory (auto is imported from schedulers._auto on first use; 'dlcp' is reserved)
POLICIES: dict[str, Callable[..., Any]] = _factories()


def _option_names(name: str) -> list[str] | None:
  """The keyword options a named policy's factory accepts; None when it takes **options."""
  if name == "auto":
    try:
      from .schedulers._auto import auto
    except ImportError:
      return None
    fn = auto
  else:
    fn = POLICIES[name]
  params = inspect.signature(fn).parameters.values()
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return None
  return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def validate_schedule(schedule: Schedule, profile: GradientProfile) -> Schedule:
  """Check that `schedule` fits `profile`: same rows (fingerprint), dtypes, every element exactly once.

  Schedule checks coverage on construction; this re-checks it against the profile's own rows, so a
  schedule planned for another tree (or built by a buggy policy) fails here, in the planner.

  Args:
    schedule: the schedule.
    profile: the profile it must cover.

  Returns:
    `schedule`, unchanged.

  Raises:
    TypeError: the arguments are not a Schedule and a GradientProfile.
    ScheduleMismatchError: the schedule was planned for another tree (the first differing row named).
    ScheduleError: a chunk's dtype differs from its rows', or an element is missing or sent twice.
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f"validate_schedule: expected a Schedule, got {type(schedule).__name__}.")
  if not isinstance(profile, GradientProfile):
    raise TypeError(f"validate_schedule: expected a GradientProfile, got {type(profile).__name__}.")
  match_rows(schedule, profile.tree_rows(), where="validate_schedule")
  rows = profile.tree_rows()
  sizes = [math.prod(shape) for _, shape, _ in rows]
  covered = [0] * len(rows)
  for k, chunk in enumerate(schedule.chunks):
    for r, a, b in chunk.slices:
      if not 0 <= r < len(rows):
        raise ScheduleError(f"chunk{k} names row {r}, but the profile has {len(rows)} rows.")
      path, _, dtype = rows[r]
      if chunk.dtype != dtype:
        raise ScheduleError(f"chunk{k} has dtype {chunk.dtype} but holds leaf {path!r} of dtype "
                            f"{dtype}; one dtype per chunk, matching the rows.")
      if not 0 <= a < b <= sizes[r]:
        raise ScheduleError(f"chunk{k} slices leaf {path!r} at [{a}:{b}], outside its {sizes[r]} "
                            f"elements.")
      covered[r] += b - a
  for r, n in enumerate(sizes):
    if covered[r] != n:
      raise ScheduleError(f"the schedule sends {covered[r]} elements of leaf {rows[r][0]!r}, which has "
                          f"{n}; every element must be sent exactly once.")
  return schedule


def _resolve(policy: Any, options: Mapping[str, Any], cross_step: Any) -> tuple[str, Any]:
  """(policy name, scheduler) from a name + options, or a Scheduler callable."""
  if isinstance(policy, str):
    if policy not in POLICIES:
      raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(p for p in POLICIES)} or a "
                       f"Scheduler callable.")
    if cross_step == "auto" and policy != "auto":
      raise ValueError(f"plan(policy={policy!r}, cross_step='auto'): only the 'auto' policy chooses the "
                       f"step mode; pass cross_step=True or False, or use policy='auto'.")
    if policy == "dlcp":
      _dlcp()
    valid = _option_names(policy)
    if valid is not None:
      unknown = sorted(set(options) - set(valid))
      if unknown:
        raise TypeError(f"plan(policy={policy!r}): unknown option(s) {unknown}; {policy!r} accepts "
                        f"{valid or 'no options'}.")
    return policy, POLICIES[policy](**options)
  if callable(policy):
    if options:
      raise TypeError(f"plan(): options {sorted(options)} are for named policies; configure the "
                      f"Scheduler callable itself (e.g. prophet_jax.schedulers.bucket(bucket_bytes=...)).")
    return getattr(policy, "__name__", "custom"), policy
  raise TypeError(f"plan(policy={policy!r}): a policy is a name ({sorted(POLICIES)}) or a Scheduler "
                  f"callable.")


def plan(profile: GradientProfile, network: NetworkModel, policy: str | Callable[..., Schedule] = "auto", *,
         cross_step: bool | str = False, **options: Any) -> Schedule:
  """Plan the gradient all-reduces of one training step.

  Args:
    profile: per-leaf gradient sizes and ready times (rows in priority order).
    network: the all-reduce cost model.
    policy: a name in `POLICIES` ('wfbp', 'bucket', 'xla', 'mgwfbp', 'priority', 'prophet', 'auto')
      or a Scheduler callable `scheduler(profile, network, *, cross_step) -> Schedule`.
    cross_step: the step mode to plan for: False (a plain step: the next step starts when every
      all-reduce is done), True (the pipelined step: the next forward overlaps the all-reduces), or
      'auto' (policy 'auto' only: the planner chooses and records it).
    **options: the named policy's factory options (e.g. `bucket_bytes=` for 'bucket').

  Returns:
    The Schedule, validated against the profile, recording its policy, options and cross_step, with
    `predicted_s` from `prophet_jax.simulate` when the simulator is available.

  Raises:
    ValueError: an unknown policy, 'dlcp' (reserved), or cross_step='auto' with a policy other than
      'auto'; bad option values (raised by the factory).
    TypeError: an unknown option, or a profile/network of the wrong type.
    ScheduleError, ScheduleMismatchError: the policy returned a schedule that does not fit the profile.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel, plan
    >>> p = GradientProfile.from_rows([
    ...     dict(path="a/w", layer="a", shape=(4,), dtype="float32", nbytes=16, ready_s=0.2),
    ...     dict(path="b/w", layer="b", shape=(4,), dtype="float32", nbytes=16, ready_s=0.1)],
    ...     forward_s=0.1, backward_s=0.2)
    >>> s = plan(p, NetworkModel.preset("10gbe", workers=4), "bucket", bucket_bytes=1024)
    >>> s.policy, s.num_allreduces, dict(s.options)["bucket_bytes"]
    ('bucket', 1, 1024)
  """
  if not isinstance(profile, GradientProfile):
    raise TypeError(f"plan(): profile must be a GradientProfile, got {type(profile).__name__}.")
  if not isinstance(network, NetworkModel):
    raise TypeError(f"plan(): network must be a NetworkModel, got {type(network).__name__}.")
  if not (isinstance(cross_step, bool) or cross_step == "auto"):
    raise ValueError(f"plan(cross_step={cross_step!r}): expected True, False or 'auto' (policy 'auto' "
                     f"only).")
  name, scheduler = _resolve(policy, options, cross_step)
  schedule = scheduler(profile, network, cross_step=cross_step)
  if not isinstance(schedule, Schedule):
    raise TypeError(f"policy {name!r} returned {type(schedule).__name__}, not a Schedule.")
  validate_schedule(schedule, profile)
  changes: dict[str, Any] = {}
  if isinstance(policy, str):
    if schedule.policy != name and name != "auto":
      changes["policy"] = name
    if name != "auto":
      recorded = dict(schedule.options)
      merged = {**recorded, **options}
      if merged != recorded:
        changes["options"] = tuple(merged.items())
  if cross_step != "auto" and schedule.cross_step != cross_step:
    changes["cross_step"] = cross_step
  if schedule.predicted_s is None:
    try:
      from ._simulate import simulate
    except ImportError:
      simulate = None
    if simulate is not None:
      mode = changes.get("cross_step", schedule.cross_step)
      try:
        result = simulate(schedule, profile, network, cross_step=mode, events=False)
      except TypeError:  # a simulator without the `events` switch
        result = simulate(schedule, profile, network, cross_step=mode)
      changes["predicted_s"] = float(result.iteration_s)
  if not changes:
    return schedule
  if "options" in changes:
    return dataclasses.replace(schedule, **changes)
  return _copy_with(schedule, **changes)


def _copy_with(schedule: Schedule, **changes: Any) -> Schedule:
  """A copy of a validated schedule with new metadata (policy, cross_step, predicted_s).

  These fields do not take part in Schedule's invariants (coverage, fingerprint), so the copy skips
  re-running them: on a 1,000-leaf tree that halves plan()'s time.
  """
  new = object.__new__(Schedule)
  for f in dataclasses.fields(Schedule):
    object.__setattr__(new, f.name, changes.get(f.name, getattr(schedule, f.name)))
  object.__setattr__(new, "cross_step", bool(new.cross_step))
  if new.predicted_s is not None:
    object.__setattr__(new, "predicted_s", float(new.predicted_s))
  object.__setattr__(new, "policy", str(new.policy))
  return new
