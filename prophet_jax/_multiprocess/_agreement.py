"""The schedule agreement of a multi-process run: every process uses rank 0's schedule, checked.

Schedules planned separately per process could differ, and their collectives would then mismatch and
hang. So rank 0 plans, `broadcast_schedule` sends its schedule to every process, every process checks
it against its own parameter tree (by path, shape and dtype: `_tree.match_tree`), and the processes
agree on the outcome, so all fail together, naming the ranks, when one does not match. The Monitor
switches plans the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._values._checks import match_tree
from .._values._errors import LaunchError, ProphetError
from .._values._schedule import Schedule
from .._values._tree import flatten_with_paths

__all__ = ["broadcast_schedule"]

MESSAGE_BYTES = 600  # each rank's error message, as gathered for the others (truncated)


def _check_tree(schedule: Schedule, params: Any) -> None:
  match_tree(flatten_with_paths(params), schedule, where="broadcast_schedule")


def gather_messages(text: str) -> list[str]:
  """Every process's `text` (at most MESSAGE_BYTES bytes of it), in rank order."""
  from jax.experimental import multihost_utils  # lazy: `launch` (pure) imports this module

  raw = text.encode()[:MESSAGE_BYTES]
  buf = np.zeros(MESSAGE_BYTES + 1, np.uint8)
  buf[0] = len(raw) > 0
  buf[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(-1, MESSAGE_BYTES + 1)
  return [bytes(r[1:]).rstrip(b"\0").decode(errors="replace") if r[0] else "" for r in rows]


def failed_ranks(message: str) -> tuple[list[int], str]:
  """Every process's `message` gathered: the ranks whose message is not empty, and the first of those."""
  messages = gather_messages(message)
  bad = [r for r, m in enumerate(messages) if m]
  return bad, messages[bad[0]] if bad else ""


def broadcast_text(text: str) -> str:
  """Rank 0's `text` on every process (the others' `text` is ignored)."""
  import jax  # lazy: `launch` (pure) imports this module
  from jax.experimental import multihost_utils

  rank0 = jax.process_index() == 0
  data = np.frombuffer(text.encode() if rank0 else b"", np.uint8)
  n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([data.size], np.int32)))[0])
  buf = data.copy() if rank0 else np.zeros(n, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)).decode()


def broadcast_schedule(schedule: Schedule | BaseException | None, params: Any = None) -> Schedule:
  """Sends rank 0's schedule to every process; each checks it against its own params.

  Rank 0 passes the schedule it planned (the others may pass None; their value is ignored), or the
  exception that stopped it planning: every process takes part in the broadcast either way, so when
  rank 0 has no schedule the others fail at once with its message (a LaunchError) instead of waiting
  in a collective until a timeout. The schedule travels as JSON bytes through
  `jax.experimental.multihost_utils.broadcast_one_to_all`; every process rebuilds it (which checks the
  rows against the stored fingerprint) and, given `params`, checks it against its own tree. The
  processes then agree on the outcome, so all fail together when one does not match: the mismatching
  rank with the mismatch (naming its rank), every other rank with a LaunchError that names the ranks
  and quotes the first one's message.

  Args:
    schedule: the planned schedule on rank 0, or the exception planning raised there (anything on
      other ranks).
    params: this process's parameter tree (optional; checked by path, shape and dtype).

  Returns:
    The schedule, identical on every process.

  Raises:
    ValueError: rank 0 passed no Schedule (or the exception rank 0 passed, re-raised there).
    ScheduleMismatchError: this process's params do not match the schedule.
    LaunchError: another process reported a mismatch, or rank 0 had no schedule to send.

  Example:
    >>> schedule = plan(profile, network, "auto") if jax.process_index() == 0 else None  # doctest: +SKIP
    >>> schedule = broadcast_schedule(schedule, params)                                   # doctest: +SKIP
  """
  import jax  # lazy: `launch` (pure) imports this module

  rank0_error: BaseException | None = None
  if not isinstance(schedule, Schedule):
    rank0_error = (schedule if isinstance(schedule, BaseException) else
                   ValueError(f"broadcast_schedule: expected a Schedule on rank 0 (the planned one, or "
                              f"the exception that stopped it planning), got {type(schedule).__name__}."))
  if jax.process_count() == 1:
    if rank0_error is not None:
      raise rank0_error
    if params is not None:
      _check_tree(schedule, params)
    return schedule
  rank = jax.process_index()
  # a schedule's JSON starts with "{"; "!" marks rank 0's failure, the rest its message
  text = broadcast_text(schedule.to_json() if rank0_error is None
                        else f"!{type(rank0_error).__name__}: {rank0_error}")
  if text.startswith("!"):
    if rank == 0:
      raise rank0_error  # type: ignore[misc]
    raise LaunchError(f"rank {rank}: rank 0 sent no schedule; it failed before broadcasting it with "
                      f"{text[1:]}. Fix that on rank 0 (see its output); this rank stops with it.")
  error: Exception | None = None
  try:
    got = Schedule.from_json(text)
    if params is not None:
      _check_tree(got, params)
  except ProphetError as e:
    error = type(e)(f"rank {rank}: {e}")
    error.__cause__ = e
  bad, first = failed_ranks("" if error is None else str(error))
  if error is not None:
    raise error
  if bad:
    raise LaunchError(f"rank {rank}: rank(s) {bad} found that rank 0's schedule (fingerprint "
                      f"{got.tree_fingerprint}) does not match their params. {first}")
  return got
