"""Fixed-threshold bucketing as PyTorch DDP and Horovod's tensor fusion do it (pure numpy)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._values._checks import check_bytes, check_number
from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler, Slice
from ._common import Groups, grouped_scheduler, whole_slice

POLICY = "bucket"
STYLES = ("ddp", "horovod")
DDP_BUCKET_BYTES = 25 * 2**20       # DistributedDataParallel(bucket_cap_mb=None): 25 MiB
DDP_FIRST_BUCKET_BYTES = 2**20      # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: 1 MiB
HOROVOD_FUSION_BYTES = 64 * 2**20   # HOROVOD_FUSION_THRESHOLD before v0.21 (128 MiB since)
HOROVOD_CYCLE_S = 5e-3              # HOROVOD_CYCLE_TIME before v0.21 (1 ms since)


def fill_buckets(profile: GradientProfile, order, bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
  """Greedy fill of whole rows, in `order`, into buckets of at most `bucket_bytes`; a row that does not fit
  closes the bucket. Returns the groups of slices.
  """
  groups: list[list[tuple[int, int, int]]] = []
  cur: list[tuple[int, int, int]] = []
  cur_bytes = 0
  for r in order:
    s = whole_slice(profile, r)
    if s is None:
      continue
    nb = profile.rows[r].nbytes
    if cur and cur_bytes + nb > bucket_bytes:
      groups.append(cur)
      cur, cur_bytes = [], 0
    cur.append(s)
    cur_bytes += nb
    if cur_bytes >= bucket_bytes:
      groups.append(cur)
      cur, cur_bytes = [], 0
  return groups + [cur] if cur else groups


def ddp_buckets(profile: GradientProfile, order: Sequence[int], bucket_bytes: int,
                first_bucket_bytes: int) -> list[list[Slice]]:
  """PyTorch DDP's bucket assignment (`compute_bucket_assignment_by_size`) over rows in `order`.

  A bucket closes once it reaches its cap (docs/design.md, "The policies"). Returns the groups of slices, in
  issue order.
  """
  closed: list[list[Slice]] = []
  open_: dict[str, tuple[list[Slice], int]] = {}   # dtype -> (its open bucket's slices, bytes)
  n_closed: dict[str, int] = {}                     # dtype -> buckets of that dtype closed so far
  for r in order:
    s = whole_slice(profile, r)
    if s is None:
      continue
    row = profile.rows[r]
    slices, nbytes = open_.pop(row.dtype, ([], 0))
    slices.append(s)
    nbytes += row.nbytes
    cap = first_bucket_bytes if n_closed.get(row.dtype, 0) == 0 else bucket_bytes
    if nbytes >= cap:
      closed.append(slices)
      n_closed[row.dtype] = n_closed.get(row.dtype, 0) + 1
    else:
      open_[row.dtype] = (slices, nbytes)
  rest = sorted(open_.values(), key=lambda v: max(profile.rows[r].ready_s for r, _, _ in v[0]))
  return closed + [v[0] for v in rest]


def horovod_buckets(profile: GradientProfile, order: Sequence[int], fusion_bytes: int,
                    cycle_s: float) -> list[list[Slice]]:
  """Horovod's tensor fusion: every `cycle_s`, the ready tensors fused per dtype into buffers.

  Buffers of at most `fusion_bytes` (docs/design.md, "The policies"). Returns the groups of slices, in issue
  order.
  """
  def tick(r: int) -> float:
    t = profile.rows[r].ready_s
    return t if cycle_s == 0 else math.ceil(t / cycle_s - 1e-9) * cycle_s

  by_tick: dict[float, list[int]] = {}
  for r in order:
    if whole_slice(profile, r) is not None:
      by_tick.setdefault(tick(r), []).append(r)
  groups: list[list[Slice]] = []
  for t in sorted(by_tick):
    queue = by_tick[t]
    while queue:
      first, queue = queue[0], queue[1:]
      dtype = profile.rows[first].dtype
      fused = [first]
      size = profile.rows[first].nbytes
      skipped: list[int] = []
      skipped_size = 0
      while queue:
        r = queue[0]
        nb = profile.rows[r].nbytes
        if profile.rows[r].dtype == dtype and size + nb <= fusion_bytes:
          fused.append(r)
          size += nb
          queue = queue[1:]
        else:
          skipped_size += nb
          if size + skipped_size <= fusion_bytes:
            skipped.append(r)
            queue = queue[1:]
          else:
            break
      queue = skipped + queue
      groups.append([whole_slice(profile, r) for r in fused])
  return groups


def bucket(*, style: str = "ddp", bucket_bytes: int | None = None, first_bucket_bytes: int | None = None,
           cycle_s: float | None = None) -> Scheduler:
  """Whole leaves fused into buckets by a byte threshold, as PyTorch DDP or Horovod does it.

  The models of both: docs/design.md, "The policies", "bucket".

  Args:
    style: "ddp" (DDP's steady state: a bucket closes once it reaches its cap) or "horovod" (fusion
      every `cycle_s`: a buffer closes before a tensor would overflow it).
    bucket_bytes: the cap in bytes; None for the style's default (DDP 25 MiB, Horovod 64 MiB).
    first_bucket_bytes: DDP only: the first bucket's cap in bytes; None for DDP's rule (1 MiB with the
      default `bucket_bytes`, else `bucket_bytes`).
    cycle_s: Horovod only: the background cycle in seconds (>= 0); None for 5 ms.

  Returns:
    A Scheduler; the schedule's options record the resolved values. The same plan for both step modes.

  Raises:
    TypeError, ValueError: an unknown style, a bad threshold or cycle, or an option of the other style.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel
    >>> p = GradientProfile.from_rows([
    ...     dict(path=f"l{i}/w", layer=f"l{i}", shape=(256,), dtype="float32", nbytes=1024,
    ...          ready_s=0.1 * (3 - i)) for i in range(3)], forward_s=0.1, backward_s=0.3)
    >>> net = NetworkModel.preset("10gbe", workers=4)
    >>> [len(c.slices) for c in bucket(bucket_bytes=1500)(p, net, cross_step=False).chunks]  # DDP
    [2, 1]
    >>> h = bucket(style="horovod", bucket_bytes=2048, cycle_s=1.0)(p, net, cross_step=False)
    >>> [len(c.slices) for c in h.chunks]  # one cycle: 2 KiB, then the rest
    [2, 1]

  References:
    S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
    A. Sergeev, M. Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", 2018.
  """
  if style not in STYLES:
    raise ValueError(f"bucket(style={style!r}): expected one of {list(STYLES)} ('ddp': PyTorch DDP's "
                     f"buckets; 'horovod': Horovod's tensor fusion).")
  bucket_bytes = check_bytes(POLICY, "bucket_bytes", bucket_bytes,
                             hint="Try 25 * 2**20 (DDP) or 64 * 2**20 (Horovod), or None for the "
                                  "style's default.")
  first_bucket_bytes = check_bytes(POLICY, "first_bucket_bytes", first_bucket_bytes,
                                   hint="Try 2**20 (1 MiB, as DDP) or None.")
  # each style refuses the other's option, then fills in its own defaults
  other, name, value, why = (("horovod", "cycle_s", cycle_s, "`cycle_s` is Horovod's background cycle")
                             if style == "ddp" else
                             ("ddp", "first_bucket_bytes", first_bucket_bytes,
                              "Horovod has no first bucket; `first_bucket_bytes` is DDP's"))
  if value is not None:
    raise ValueError(f"bucket(style={style!r}, {name}={value!r}): {why}. Use style={other!r} or leave "
                     f"{name}=None.")
  if style == "ddp":
    if bucket_bytes is None:
      bucket_bytes, first_bucket_bytes = DDP_BUCKET_BYTES, first_bucket_bytes or DDP_FIRST_BUCKET_BYTES
    first_bucket_bytes = first_bucket_bytes or bucket_bytes
  else:
    bucket_bytes = bucket_bytes or HOROVOD_FUSION_BYTES
    cycle_s = float(check_number("bucket", "cycle_s", HOROVOD_CYCLE_S if cycle_s is None else cycle_s, lo=0,
                                 fix="It is seconds: try 5e-3 (Horovod before v0.21) or 1e-3 (v0.21 and later)."))
  options = {"style": style, "bucket_bytes": bucket_bytes, "first_bucket_bytes": first_bucket_bytes,
             "cycle_s": cycle_s}

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    order = profile.ready_order()
    if style == "ddp":
      return ddp_buckets(profile, order, bucket_bytes, first_bucket_bytes)
    return horovod_buckets(profile, order, bucket_bytes, cycle_s)

  return grouped_scheduler(POLICY, options, plan_groups)
