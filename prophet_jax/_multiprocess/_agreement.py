"""Rank 0's schedule on every process, checked against each one's tree (docs/design.md, "Several processes")."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._values._checks import match_tree
from .._values._errors import LaunchError, ProphetError
from .._values._schedule import Schedule
from .._values._tree import flatten_with_paths

MESSAGE_BYTES = 600  # each rank's error message, as gathered for the others (truncated)


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

  Args:
    schedule: on rank 0 the planned schedule, or the exception planning raised; ignored elsewhere.
    params: this process's parameter tree, checked by path, shape and dtype (optional).

  Returns:
    The schedule, identical on every process.

  Raises:
    ValueError: rank 0 passed no Schedule (or the exception rank 0 passed, re-raised there).
    ScheduleMismatchError: this process's params do not match the schedule.
    LaunchError: another process reported a mismatch, or rank 0 had no schedule to send.

  Example:
    >>> schedule = broadcast_schedule(planned_on_rank_0, params)  # doctest: +SKIP
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
      match_tree(flatten_with_paths(params), schedule, where="broadcast_schedule")
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
      match_tree(flatten_with_paths(params), got, where="broadcast_schedule")
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
