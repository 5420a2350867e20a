"""ByteScheduler / P3: partitioned tensors, highest priority first, with a credit window.

Pure: numpy only, never jax.
"""

from __future__ import annotations

import heapq
from collections import deque

from .._types import GradientProfile, NetworkModel, Schedule, itemsize
from ._base import Scheduler
from ._common import check_bytes, check_inputs, partition_count, partition_row, schedule_from_groups

POLICY = "priority"
DEFAULT_PARTITION_PARAMS = 2**20   # ByteScheduler's default partition: 1M parameters
DEFAULT_CREDIT_PARAMS = 4 * 2**20  # ByteScheduler's default credit: 4M parameters
MAX_PARTITIONS = 2**20


def issue_order(profile: GradientProfile, network: NetworkModel, partition_bytes: int | None,
                credit_bytes: int | None) -> list[tuple[int, int, int]]:
  """The partitions in the order ByteScheduler's loop would issue them, given the profile's timing.

  The loop: every tensor (row) is cut into partitions of at most `partition_bytes` (default 1M
  parameters times the row's dtype size); a partition is ready when its row is (`ready_s`); priority is
  the row index (row 0, needed first by the next forward, is highest), then the element offset. Whenever
  credit is free, the highest-priority ready partition is issued as its own all-reduce, and holds
  credit until it finishes; the credit is `credit_bytes` (default 4M parameters: counted in elements
  when defaulted, in bytes when given). A partition larger than the credit is issued when nothing else
  is in flight. Issued partitions share one link first come first served, each taking
  `network.allreduce_s(bytes)`.

  Returns:
    The partitions as (row, start, stop) slices in issue order.
  """
  def limit(row):
    return partition_bytes if partition_bytes is not None else DEFAULT_PARTITION_PARAMS * itemsize(row.dtype)

  count = sum(partition_count(profile, r, limit(row)) for r, row in enumerate(profile.rows))
  if count > MAX_PARTITIONS:
    raise ValueError(f"priority(partition_bytes={partition_bytes!r}) cuts this profile into {count} "
                     f"partitions, more than {MAX_PARTITIONS}; use a larger partition_bytes (default: 1M "
                     f"parameters times the dtype size).")
  parts = []  # (ready_s, row, start, stop, units, cost)
  startup_s, per_byte_s = network.startup_s, network.per_byte_s
  for r, row in enumerate(profile.rows):
    if row.nbytes == 0:
      continue
    size = itemsize(row.dtype)
    for _, a, b in partition_row(profile, r, limit(row)):
      units = (b - a) * size if credit_bytes is not None else (b - a)
      parts.append((row.ready_s, r, a, b, units, startup_s + per_byte_s * (b - a) * size))
  parts.sort(key=lambda p: (p[0], p[1], p[2]))
  credit = credit_bytes if credit_bytes is not None else DEFAULT_CREDIT_PARAMS
  pending: list[tuple[int, int, int, int, float]] = []  # heap by (row, start)
  inflight: deque[tuple[float, int]] = deque()            # (end time, units), FIFO on one link
  used = 0
  link_free = 0.0
  t = 0.0
  i = 0
  order = []
  while i < len(parts) or pending:
    while i < len(parts) and parts[i][0] <= t:
      _, r, a, b, units, cost = parts[i]
      heapq.heappush(pending, (r, a, b, units, cost))
      i += 1
    while inflight and inflight[0][0] <= t:
      used -= inflight.popleft()[1]
    while pending and (not inflight or used + pending[0][3] <= credit):
      r, a, b, units, cost = heapq.heappop(pending)
      start = max(t, link_free)
      link_free = start + cost
      inflight.append((link_free, units))
      used += units
      order.append((r, a, b))
    nxt = []
    if i < len(parts):
      nxt.append(parts[i][0])
    if inflight:
      nxt.append(inflight[0][0])
    if not nxt:
      break
    t = max(t, min(nxt))
  return order


def priority(*, partition_bytes: int | None = None, credit_bytes: int | None = None) -> Scheduler:
  """ByteScheduler / P3: tensors cut into partitions, sent highest priority first within a credit.

  A static model of ByteScheduler's run-time loop (see `issue_order`): the emitted schedule is the
  order in which its loop would issue the partitions, given the profile's ready times and the network
  model. As in ByteScheduler's all-reduce mode, every partition is its own all-reduce (one chunk in a
  bucket of its own); the credit bounds the bytes in flight, so a high-priority partition that becomes
  ready waits behind at most a credit's worth of lower-priority partitions. The same loop plans both
  step modes; priority order pays off with `cross_step=True` (the next forward needs row 0 first). With
  `network.overlap` False the loop still uses the profile's ready times (backward pauses are ignored),
  and it models one link (`network.links` > 1 gets the same order).

  Args:
    partition_bytes: largest partition in bytes; None for ByteScheduler's default, 1M parameters times
      the gradient dtype's size (4 MiB for float32).
    credit_bytes: bytes in flight; None for ByteScheduler's default, 4M parameters (counted in
      elements, so 16 MiB of float32).

  Returns:
    A Scheduler: `scheduler(profile, network, *, cross_step) -> Schedule`.

  Raises:
    TypeError, ValueError: an option that is not a positive integer number of bytes (or None).

  References:
    Peng et al., "A Generic Communication Scheduler for Distributed DNN Training Acceleration"
    (ByteScheduler), SOSP 2019. Jayarajan et al., "Priority-based Parameter Propagation for
    Distributed DNN Training" (P3), SysML 2019.
  """
  partition_bytes = check_bytes(POLICY, "partition_bytes", partition_bytes,
                                hint="Try 4 * 2**20 or None (1M parameters).")
  credit_bytes = check_bytes(POLICY, "credit_bytes", credit_bytes,
                             hint="Try 16 * 2**20 or None (4M parameters).")
  options = {"partition_bytes": partition_bytes, "credit_bytes": credit_bytes}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross_step = check_inputs(POLICY, profile, network, cross_step)
    groups = [[s] for s in issue_order(profile, network, partition_bytes, credit_bytes)]
    return schedule_from_groups(profile, groups, policy=POLICY, options=options, cross_step=cross_step)

  return scheduler
