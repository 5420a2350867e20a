"""Helpers shared by the policies: slices, partitions, groups to Buckets and Schedules, and
`grouped_scheduler` (pure numpy; docs/design.md, "The policies").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._values._checks import check_values
from .._planning._core import equal_parts, part_count, split_by_dtype
from .._values._network import NetworkModel
from .._values._schedule import Bucket, Chunk, Schedule
from .._values._types import GradientProfile, itemsize
from ._base import Scheduler, Slice

Groups = Sequence[Sequence[Slice]]   # a plan: ordered groups (each one Bucket) of ordered slices
PlanGroups = Callable[[GradientProfile, NetworkModel, bool], Groups]


# --------------------------------------------------------------------------------------------------
# Rows and slices


def row_size(profile: GradientProfile, row: int) -> int:
  """Number of elements of profile row `row` (math.prod: ~100x faster than the row's numpy `size`)."""
  return math.prod(profile.rows[row].shape)


def row_itemsize(profile: GradientProfile, row: int) -> int:
  """Bytes per element of profile row `row`."""
  return itemsize(profile.rows[row].dtype)


def whole_slice(profile: GradientProfile, row: int) -> Slice | None:
  """The slice covering all of row `row`, or None for a zero-size row (which belongs in no chunk)."""
  n = row_size(profile, row)
  return (row, 0, n) if n > 0 else None


def partition_row(profile: GradientProfile, row: int, max_bytes: int | None) -> list[Slice]:
  """Row `row` cut into consecutive element ranges of at most `max_bytes` bytes each (None: one part),
  as equal as possible: the one partition rule, `_core.equal_parts` (empty for a zero-size row)."""
  return [(row, a, b) for a, b in equal_parts(row_size(profile, row), row_itemsize(profile, row), max_bytes)]


def partition_count(profile: GradientProfile, row: int, max_bytes: int | None) -> int:
  """How many parts `partition_row(profile, row, max_bytes)` makes, without making them."""
  return part_count(row_size(profile, row), row_itemsize(profile, row), max_bytes)


def dtype_runs(dtypes: Sequence[str]) -> list[int]:
  """Per position, where its run of one dtype starts (a chunk holds one dtype, so a group stays in its run)."""
  out = [0] * len(dtypes)
  for j in range(1, len(dtypes)):
    out[j] = out[j - 1] if dtypes[j] == dtypes[j - 1] else j
  return out


def groups_from_choice(seq: Sequence[Any], choice: Sequence[int]) -> list[list[Any]]:
  """The runs of `seq` a program over contiguous groups chose: `choice[j]`, where the group ending at j starts."""
  groups = []
  j = len(seq)
  while j > 0:
    i = int(choice[j - 1])
    groups.append(list(seq[i:j]))
    j = i
  groups.reverse()
  return groups


def layer_groups(profile: GradientProfile) -> list[tuple[str, list[int], float]]:
  """The profile's layers in ready order, as (layer, its rows, its ready time); ties: the later layer
  first.
  """
  rows_of: dict[str, list[int]] = {}
  for i, r in enumerate(profile.rows):
    rows_of.setdefault(r.layer, []).append(i)
  layers = sorted(((max(profile.rows[i].ready_s for i in rows), -pos, name, rows)
                   for pos, (name, rows) in enumerate(rows_of.items())), key=lambda t: t[:2])
  return [(name, rows, ready) for ready, _, name, rows in layers]


# --------------------------------------------------------------------------------------------------
# Chunks, buckets, schedules


def chunks_of_group(profile: GradientProfile, slices: Iterable[Slice]) -> list[Chunk]:
  """One Chunk per dtype of a group's slices, in order; empty slices dropped."""
  rows = profile.rows
  return [Chunk(slices=tuple(s), dtype=rows[s[0][0]].dtype)
          for s in split_by_dtype(lambda r: rows[r].dtype, slices)]


def buckets_from_groups(profile: GradientProfile,
                        groups: Iterable[Iterable[Slice]]) -> tuple[Bucket, ...]:
  """One Bucket per non-empty group, each with one Chunk per dtype (see `chunks_of_group`)."""
  return tuple(Bucket(chunks=tuple(chunks)) for chunks in (chunks_of_group(profile, g) for g in groups) if chunks)


def make_schedule(buckets: Iterable[Bucket], profile: GradientProfile, *, policy: str,
                  options: Mapping[str, Any] | None = None, cross_step: bool = False,
                  predicted_s: float | None = None, links: tuple[int, ...] = (),
                  gathers: tuple[tuple[int, ...], ...] = ()) -> Schedule:
  """A Schedule for `profile` (rows and fingerprint from it); Schedule checks coverage itself."""
  return Schedule(buckets=tuple(buckets), rows=profile.tree_rows(), policy=policy,
                  options=tuple(dict(options or {}).items()), cross_step=bool(cross_step),
                  predicted_s=predicted_s, links=links, gathers=gathers)


def schedule_from_groups(profile: GradientProfile, groups: Iterable[Iterable[Slice]], *, policy: str,
                         options: Mapping[str, Any] | None = None,
                         cross_step: bool = False) -> Schedule:
  """`make_schedule(buckets_from_groups(profile, groups), ...)` in one call."""
  return make_schedule(buckets_from_groups(profile, groups), profile, policy=policy, options=options,
                       cross_step=cross_step)


# --------------------------------------------------------------------------------------------------
# The inputs every scheduler checks first


def check_inputs(policy: str, profile: Any, network: Any, cross_step: Any) -> bool:
  """Type checks every scheduler runs first; returns cross_step as bool."""
  check_values(f"{policy} scheduler", profile=profile, network=network, cross_step=cross_step)
  return bool(cross_step)


def grouped_scheduler(policy: str, options: Mapping[str, Any], plan_groups: PlanGroups) -> Scheduler:
  """The Scheduler of a policy that plans groups: `plan_groups(profile, network, cross_step) -> groups` on
  checked inputs, one Schedule built (recording `policy` and `options`); `.plan_groups` is the plan
  alone.
  """

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(policy, profile, network, cross_step)
    return schedule_from_groups(profile, plan_groups(profile, network, cross), policy=policy,
                                options=options, cross_step=cross)

  scheduler.plan_groups = plan_groups  # type: ignore[attr-defined]
  return scheduler
