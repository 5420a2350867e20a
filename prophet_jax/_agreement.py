"""The schedule agreement of a multi-process run: every process uses rank 0's schedule, checked.

Schedules planned separately per process could differ, and their collectives would then mismatch and
hang. So rank 0 plans, `broadcast_schedule` sends its schedule to every process, every process checks
it against its own parameter tree (by path, shape and dtype: `_tree.match_tree`), and the processes
agree on the outcome, so all fail together, naming the ranks, when one does not match. The Monitor
switches plans the same way.
"""

from __future__ import annotations

from typing import Any

from ._errors import LaunchError, ProphetError
from ._tree import flatten_with_paths, match_tree
from ._schedule import Schedule

__all__ = ["broadcast_schedule"]


def _check_tree(schedule: Schedule, params: Any) -> None:
  match_tree(flatten_with_paths(params), schedule, where="broadcast_schedule")


def broadcast_schedule(schedule: Schedule | None, params: Any = None) -> Schedule:
  """Sends rank 0's schedule to every process; each checks it against its own params.

  Rank 0 passes the schedule it planned (the others may pass None; their value is ignored). The
  schedule travels as JSON bytes through `jax.experimental.multihost_utils.broadcast_one_to_all`;
  every process rebuilds it (which checks the rows against the stored fingerprint), compares the
  fingerprint with rank 0's, and, given `params`, checks the schedule against its own tree. The
  processes then agree on the outcome, so all fail together when one does not match.

  Args:
    schedule: the planned schedule on rank 0 (anything on other ranks).
    params: this process's parameter tree (optional; checked by path, shape and dtype).

  Returns:
    The schedule, identical on every process.

  Raises:
    ValueError: rank 0 passed no Schedule.
    ScheduleMismatchError: this process's params do not match the schedule.
    LaunchError: another process reported a mismatch (names the ranks).
  """
  import jax
  import numpy as np

  if jax.process_count() == 1:
    if not isinstance(schedule, Schedule):
      raise ValueError(f"broadcast_schedule: expected a Schedule, got {type(schedule).__name__}.")
    if params is not None:
      _check_tree(schedule, params)
    return schedule
  from jax.experimental import multihost_utils

  rank0 = jax.process_index() == 0
  if rank0 and not isinstance(schedule, Schedule):
    raise ValueError(f"broadcast_schedule: rank 0 must pass the planned Schedule, got "
                     f"{type(schedule).__name__}.")
  payload = schedule.to_json().encode() if rank0 else b""
  n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(payload), np.int32)))
  buf = np.zeros(n, np.uint8)
  if rank0:
    buf[:] = np.frombuffer(payload, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  error: Exception | None = None
  try:
    got = Schedule.from_json(bytes(buf.astype(np.uint8)).decode())
    if params is not None:
      _check_tree(got, params)
  except ProphetError as e:
    error = e
  statuses = np.asarray(multihost_utils.process_allgather(np.asarray(0 if error is None else 1, np.int32)))
  if error is not None:
    raise error
  bad = [int(r) for r in np.flatnonzero(statuses.reshape(-1))]
  if bad:
    raise LaunchError(f"rank(s) {bad} found that rank 0's schedule (fingerprint "
                      f"{got.tree_fingerprint}) does not match their params; see their output.")
  return got


