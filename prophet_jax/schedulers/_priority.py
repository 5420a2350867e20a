"""ByteScheduler / P3: partitioned tensors, highest priority first, with a credit window (pure numpy)."""

from __future__ import annotations

import heapq
from collections import deque

from .._values._checks import check_bytes
from .._values._network import NetworkModel
from .._values._types import GradientProfile, itemsize
from ._base import Scheduler
from ._common import Groups, grouped_scheduler, partition_count, partition_row

POLICY = "priority"
# ByteScheduler's defaults, in parameters (elements), per its `arch` (bytedance/byteps, bytescheduler/):
# - "ps": the defaults in the code, bytescheduler/bytescheduler/common/bytecore.py:62 and :65
#   (ByteCore.__init__: BYTESCHEDULER_PARTITION 1000000, BYTESCHEDULER_CREDIT 4000000), which are the
#   same for either arch there;
# - "allreduce": what bytescheduler/docs/scheduling.md:36-40 prescribes for the all-reduce architecture
#   ("should be much larger, e.g., 8000000" and "larger, e.g., 16000000").
MODE_DEFAULTS = {"ps": (1_000_000, 4_000_000), "allreduce": (8_000_000, 16_000_000)}
DEFAULT_PARTITION_PARAMS, DEFAULT_CREDIT_PARAMS = MODE_DEFAULTS["ps"]
MAX_PARTITIONS = 2**20


def issue_order(profile: GradientProfile, network: NetworkModel, partition_bytes: int | None,
                credit_bytes: int | None, *, mode: str = "ps") -> list[tuple[int, int, int]]:
  """The partitions as (row, start, stop) slices in the order ByteScheduler's loop issues them.

  The loop: docs/design.md, "The policies", "priority".
  """
  partition_params, credit_params = MODE_DEFAULTS[mode]

  def limit(row):
    return partition_bytes if partition_bytes is not None else partition_params * itemsize(row.dtype)

  count = sum(partition_count(profile, r, limit(row)) for r, row in enumerate(profile.rows))
  if count > MAX_PARTITIONS:
    raise ValueError(f"priority(partition_bytes={partition_bytes!r}) cuts this profile into {count} "
                     f"partitions, more than {MAX_PARTITIONS}; use a larger partition_bytes (default: "
                     f"{partition_params:,} parameters times the dtype size).")
  parts = []  # (ready_s, row, start, stop, units, cost)
  startup_s, per_byte_s = network.startup_s, network.per_byte_s
  for r, row in enumerate(profile.rows):          # a zero-size row has no partition
    size = itemsize(row.dtype)
    for _, a, b in partition_row(profile, r, limit(row)):
      units = (b - a) * size if credit_bytes is not None else (b - a)
      parts.append((row.ready_s, r, a, b, units, startup_s + per_byte_s * (b - a) * size))
  parts.sort(key=lambda p: (p[0], p[1], p[2]))
  credit = credit_bytes if credit_bytes is not None else credit_params
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
    while pending and used < credit:
      r, a, b, units, cost = heapq.heappop(pending)
      link_free = max(t, link_free) + cost
      inflight.append((link_free, units))
      used += units
      order.append((r, a, b))
    nxt = ([parts[i][0]] if i < len(parts) else []) + ([inflight[0][0]] if inflight else [])
    if not nxt:
      break
    t = max(t, min(nxt))
  return order


def priority(*, partition_bytes: int | None = None, credit_bytes: int | None = None,
             mode: str = "ps") -> Scheduler:
  """ByteScheduler / P3: tensors cut into partitions, each its own all-reduce, sent highest priority first
  within a credit of bytes in flight (docs/design.md, "The policies").

  Args:
    partition_bytes: largest partition in bytes; None: `mode`'s default parameters times the dtype size.
    credit_bytes: bytes in flight; None: `mode`'s default, counted in parameters.
    mode: "ps" (1M-parameter partitions, 4M credit) or "allreduce" (8M, 16M): ByteScheduler's defaults.

  Returns:
    A Scheduler.

  Raises:
    TypeError, ValueError: a size that is not a positive integer number of bytes, or an unknown mode.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel
    >>> p = GradientProfile.from_rows([
    ...     dict(path="a/w", layer="a", shape=(2_500_000,), dtype="float32", nbytes=10_000_000,
    ...          ready_s=0.1)], forward_s=0.1, backward_s=0.1)
    >>> net = NetworkModel.preset("10gbe", workers=4)
    >>> [c.size for c in priority()(p, net, cross_step=True).chunks]        # 1M-parameter parts
    [833334, 833333, 833333]
    >>> [c.size for c in priority(mode="allreduce")(p, net, cross_step=True).chunks]
    [2500000]

  References:
    Y. Peng et al., "A Generic Communication Scheduler for Distributed DNN Training Acceleration"
    (ByteScheduler), SOSP 2019. A. Jayarajan et al., "Priority-based Parameter Propagation for
    Distributed DNN Training" (P3), SysML 2019.
  """
  if mode not in MODE_DEFAULTS:
    raise ValueError(f"priority(mode={mode!r}): expected one of {sorted(MODE_DEFAULTS)} (ByteScheduler's "
                     f"defaults for parameter servers or for all-reduce).")
  default_partition, default_credit = MODE_DEFAULTS[mode]
  partition_bytes = check_bytes(POLICY, "partition_bytes", partition_bytes,
                                hint=f"Try {4 * default_partition} or None ({default_partition:,} "
                                     f"parameters).")
  credit_bytes = check_bytes(POLICY, "credit_bytes", credit_bytes,
                             hint=f"Try {4 * default_credit} or None ({default_credit:,} parameters).")
  options = {"partition_bytes": partition_bytes, "credit_bytes": credit_bytes, "mode": mode}

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    return [[s] for s in issue_order(profile, network, partition_bytes, credit_bytes, mode=mode)]

  return grouped_scheduler(POLICY, options, plan_groups)
