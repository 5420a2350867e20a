"""Fixed-threshold bucketing (PyTorch DDP, Horovod tensor fusion), filled in ready order.

Pure: numpy only, never jax.
"""

from __future__ import annotations

from .._types import GradientProfile, NetworkModel, Schedule
from ._base import Scheduler
from ._common import check_bytes, check_inputs, schedule_from_groups, whole_slice

POLICY = "bucket"


def fill_buckets(profile: GradientProfile, order, bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> list[list[tuple[int, int, int]]]:
  """Greedy fill of whole rows, in `order`, into buckets of at most `bucket_bytes` bytes.

  A row that does not fit in the open bucket closes it; a row larger than the threshold goes alone into
  its own bucket. The first bucket uses `first_bucket_bytes` when given. Zero-size rows are skipped.

  Returns:
    The groups of slices, one per bucket, in issue order.
  """
  groups: list[list[tuple[int, int, int]]] = []
  cur: list[tuple[int, int, int]] = []
  cur_bytes = 0
  for r in order:
    s = whole_slice(profile, r)
    if s is None:
      continue
    cap = first_bucket_bytes if (first_bucket_bytes is not None and not groups) else bucket_bytes
    nb = profile.rows[r].nbytes
    if cur and cur_bytes + nb > cap:
      groups.append(cur)
      cur, cur_bytes = [], 0
      cap = bucket_bytes
    cur.append(s)
    cur_bytes += nb
    if cur_bytes >= cap:
      groups.append(cur)
      cur, cur_bytes = [], 0
  if cur:
    groups.append(cur)
  return groups


def bucket(*, bucket_bytes: int = 25 * 2**20, first_bucket_bytes: int | None = None) -> Scheduler:
  """Buckets of whole leaves up to a byte threshold, filled in ready order (DDP / Horovod fusion).

  Leaves are taken in ready order (`GradientProfile.ready_order`) and appended to the open bucket while
  it stays within `bucket_bytes`; a leaf larger than the threshold is a bucket by itself. A bucket with
  several dtypes holds one chunk (all-reduce) per dtype. The plan is the same for both step modes
  (`cross_step` is only recorded).

  Args:
    bucket_bytes: the threshold in bytes. PyTorch DDP uses 25 MiB (the default); Horovod's fusion
      buffer is 64 MiB (128 MiB since v0.21).
    first_bucket_bytes: the threshold of the first bucket, or None for `bucket_bytes`. DDP uses 1 MiB so
      that the first all-reduce starts early.

  Returns:
    A Scheduler: `scheduler(profile, network, *, cross_step) -> Schedule`.

  Raises:
    TypeError, ValueError: a threshold that is not a positive integer number of bytes.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel
    >>> p = GradientProfile.from_rows([
    ...     dict(path=f"l{i}/w", layer=f"l{i}", shape=(256,), dtype="float32", nbytes=1024,
    ...          ready_s=0.1 * (3 - i)) for i in range(3)], forward_s=0.1, backward_s=0.3)
    >>> s = bucket(bucket_bytes=2048)(p, NetworkModel.preset("10gbe", workers=4), cross_step=False)
    >>> [len(c.slices) for c in s.chunks]
    [2, 1]

  References:
    Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
    Sergeev and Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", 2018.
  """
  hint = "Try 25 * 2**20 (25 MiB, as DDP)."
  bucket_bytes = check_bytes(POLICY, "bucket_bytes", bucket_bytes, allow_none=False, hint=hint)
  first_bucket_bytes = check_bytes(POLICY, "first_bucket_bytes", first_bucket_bytes,
                                   hint="Try 2**20 (1 MiB, as DDP) or None.")
  options = {"bucket_bytes": bucket_bytes, "first_bucket_bytes": first_bucket_bytes}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross_step = check_inputs(POLICY, profile, network, cross_step)
    groups = fill_buckets(profile, profile.ready_order(), bucket_bytes, first_bucket_bytes)
    return schedule_from_groups(profile, groups, policy=POLICY, options=options, cross_step=cross_step)

  return scheduler
