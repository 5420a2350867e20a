"""plan(): a Schedule from a profile, a network model and a policy; validate_schedule() (pure numpy)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._values._checks import check_values, match_rows
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from .._planning._core import problem, schedule_arrays
from .._planning._simulate import chunk_links, simulate
from .._values._types import GradientProfile, is_bool
from ._registry import resolve


def validate_schedule(schedule: Schedule, profile: GradientProfile) -> Schedule:
  """Checks that `schedule` was planned for `profile`'s rows, so a policy that planned for another tree
  fails in the planner; returns it. TypeError or ScheduleMismatchError (the first differing row).
  """
  check_values("validate_schedule", schedule=schedule, profile=profile)
  match_rows(schedule, profile.tree_rows(), where="validate_schedule")
  return schedule


def plan(profile: GradientProfile, network: NetworkModel, policy: str | Callable[..., Schedule] = "auto", *,
         cross_step: bool | str = False, **options: Any) -> Schedule:
  """Plan the gradient collectives of one training step.

  Args:
    profile: per-leaf gradient sizes and ready times (rows in priority order).
    network: the cost model.
    policy: a name in `POLICIES` or a Scheduler `scheduler(profile, network, *, cross_step) -> Schedule`.
    cross_step: False (plain step), True (pipelined step) or 'auto' (policy 'auto' only: it chooses).
    **options: the named policy's factory options (e.g. `bucket_bytes=` for 'bucket').

  Returns:
    The Schedule, validated against the profile, with `predicted_s` (`simulate`'s) and, with
    `network.links > 1`, the calm simulation's `links`.

  Raises:
    ValueError, TypeError: an unknown policy or option, a bad option value or argument.
    ScheduleError, ScheduleMismatchError: the policy's schedule does not fit the profile.

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
  mode = bool(changes.get("cross_step", schedule.cross_step))
  if network.links > 1 and not schedule.links and not schedule.gathers:
    prob = problem(profile, network, cross_step=mode)
    changes["links"] = chunk_links(prob, schedule_arrays(prob, schedule.buckets))
  if schedule.predicted_s is None:
    changes["predicted_s"] = simulate(schedule, profile, network, cross_step=mode, events=False).iteration_s
  return dataclasses.replace(schedule, **changes) if changes else schedule
