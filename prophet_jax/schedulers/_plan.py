"""plan(): a Schedule from a profile, a network model and a policy; validate_schedule().

Pure: numpy only, never jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._values._checks import check_values, match_rows
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from .._planning._simulate import link_assignment, simulate
from .._values._types import GradientProfile, is_bool
from ._registry import POLICIES, resolve

__all__ = ["plan", "validate_schedule", "POLICIES"]


def validate_schedule(schedule: Schedule, profile: GradientProfile) -> Schedule:
  """Check that `schedule` fits `profile`: the same rows (paths, shapes, dtypes, in order).

  Coverage (every element of every non-empty row in exactly one chunk, once, one dtype per chunk) is
  Schedule's own invariant, checked when it is built; this adds what the Schedule cannot know, that
  its rows are this profile's, so a policy that planned for another tree fails here, in the planner.

  Args:
    schedule: the schedule.
    profile: the profile it must cover.

  Returns:
    `schedule`, unchanged.

  Raises:
    TypeError: the arguments are not a Schedule and a GradientProfile.
    ScheduleMismatchError: the schedule was planned for another tree (the first differing row named).
  """
  check_values("validate_schedule", schedule=schedule, profile=profile)
  match_rows(schedule, profile.tree_rows(), where="validate_schedule")
  return schedule


def plan(profile: GradientProfile, network: NetworkModel, policy: str | Callable[..., Schedule] = "auto", *,
         cross_step: bool | str = False, **options: Any) -> Schedule:
  """Plan the gradient all-reduces of one training step.

  Args:
    profile: per-leaf gradient sizes and ready times (rows in priority order).
    network: the all-reduce cost model.
    policy: a name in `POLICIES` ('wfbp', 'bucket', 'xla', 'mgwfbp', 'priority', 'prophet', 'auto',
      'dlcp', 'dear') or a Scheduler callable `scheduler(profile, network, *, cross_step) -> Schedule`.
    cross_step: the step mode to plan for: False (a plain step: the next step starts when every
      all-reduce is done), True (the pipelined step: the next forward overlaps the all-reduces), or
      'auto' (policy 'auto' only: the planner chooses and records it).
    **options: the named policy's factory options (e.g. `bucket_bytes=` for 'bucket').

  Returns:
    The Schedule, validated against the profile, recording its policy, options and cross_step, with
    `predicted_s` from `prophet_jax.simulate` (unless the policy predicted it), and with
    `network.links > 1` the link of every all-reduce (`Schedule.links`, as the calm simulation
    assigns them).

  Raises:
    ValueError: an unknown policy, or cross_step='auto' with a policy other than 'auto'; bad option
      values (raised by the factory).
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
  check_values("plan()", profile=profile, network=network)
  if not (is_bool(cross_step) or (isinstance(cross_step, str) and cross_step == "auto")):
    raise ValueError(f"plan(cross_step={cross_step!r}): expected True, False or 'auto' (policy 'auto' "
                     f"only).")
  if not isinstance(cross_step, str):
    cross_step = bool(cross_step)
  name, scheduler = resolve(policy, options, cross_step)
  schedule = scheduler(profile, network, cross_step=cross_step)
  if not isinstance(schedule, Schedule):
    raise TypeError(f"policy {name!r} returned {type(schedule).__name__}, not a Schedule.")
  # validate_schedule's check, the types being known (the rows of every built-in policy's Schedule are
  # the profile's own tuple: an identity compare); coverage is Schedule's own, checked when it was built
  match_rows(schedule, profile.tree_rows(), where="validate_schedule")
  changes: dict[str, Any] = {}
  if isinstance(policy, str) and name != "auto":
    if schedule.policy != name:
      changes["policy"] = name
    recorded = dict(schedule.options)
    merged = {**recorded, **options}
    if merged != recorded:
      changes["options"] = tuple(merged.items())
  if cross_step != "auto" and schedule.cross_step != cross_step:
    changes["cross_step"] = cross_step
  if network.links > 1 and not schedule.links and not schedule.gathers:
    changes["links"] = link_assignment(schedule, profile, network,
                                       cross_step=bool(changes.get("cross_step", schedule.cross_step)))
  if schedule.predicted_s is None:
    mode = changes.get("cross_step", schedule.cross_step)
    changes["predicted_s"] = simulate(schedule, profile, network, cross_step=mode, events=False).iteration_s
  return dataclasses.replace(schedule, **changes) if changes else schedule
