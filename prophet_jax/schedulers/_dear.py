"""The `dear` policy: reduce-scatters in backward, each device updating its shard (ZeRO-1), all-gathers
before the next forward (pure numpy; docs/design.md, "The policies", "dear").
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._values._checks import check_bytes
from .._planning._core import Problem, ends_one_link, problem, split_by_dtype
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from .._planning._sharded import chunk_arrays, sharded_arrays, sharded_iteration_s
from .._planning._simulate import check_one_link, simulate_sharded
from .._values._types import GradientProfile
from ._base import Scheduler, Slice
from ._common import buckets_from_groups, check_inputs, dtype_runs, groups_from_choice, make_schedule

_POLICY = "dear"
# Caps on a reduce-scatter bucket, as fractions 1/k of the total bytes (None: no cap), and one row per
# bucket (0).
_CAPS: tuple[int | None, ...] = (None, 2, 4, 8, 16, 32, 64, 128, 0)
# DeAR's own default threshold (dear_pytorch, dopt_rsag.py: THRESHOLD = 25 MB).
DEAR_BUCKET_BYTES = 25 * 2**20
# The Pareto program's front, per prefix: at most this many (link free, cost) pairs.
_FRONT = 32


def dear(*, bucket_bytes: int | None = None) -> Scheduler:
  """DeAR: reduce-scatter buckets in backward, all-gather buckets in the next forward (ZeRO-1).

  A sharded schedule, its buckets the fastest of several plans under the alpha-beta model (docs/design.md,
  "The policies", "dear").

  Args:
    bucket_bytes: None: the planned buckets (DeAR's own 25 MB fusion among the candidates); an integer:
      DeAR's fixed fusion alone at that threshold.

  Returns:
    A Scheduler of sharded schedules; the options record `bucket_bytes` and `candidate`.

  Raises:
    TypeError, ValueError: a bad `bucket_bytes`; the scheduler: ValueError for `network.links > 1`.

  Examples:
    >>> import numpy as np, prophet_jax as pj
    >>> params = {f"l{i}": {"w": np.zeros(2**18, np.float32)} for i in range(4)}   # four 1 MiB layers
    >>> prof = pj.GradientProfile.from_params(params, forward_s=0.004, backward_s=0.004)
    >>> s = dear()(prof, pj.NetworkModel.preset("10gbe", workers=16), cross_step=True)
    >>> s.sharded, sorted(k for g in s.gathers for k in g) == list(range(len(s.chunks)))
    (True, True)

  References:
    L. Zhang et al., "DeAR: Accelerating Distributed Deep Learning with Fine-Grained All-Reduce
    Pipelining", ICDCS 2023. S. Rajbhandari et al., "ZeRO", SC 2020.
  """
  check_bytes("dear", "bucket_bytes", bucket_bytes, hint="DeAR's default is 25 * 2**20 (25 MiB).")
  options = {"bucket_bytes": bucket_bytes}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(_POLICY, profile, network, cross_step)
    check_one_link(_POLICY, network)
    prob = problem(profile, network, cross_step=cross)
    label, chunks, gathers, predicted = plan_sharded(prob, bucket_bytes)
    if network.pressure is not None and chunks:     # `simulate`'s number, under the pressure
      predicted = simulate_sharded(prob, sharded_arrays(prob, chunks, gathers), events=False).iteration_s
    return sharded_schedule(profile, chunks, gathers, options=dict(options, candidate=label),
                            cross_step=cross, predicted_s=predicted)

  scheduler.__name__ = scheduler.__qualname__ = _POLICY
  return scheduler


def sharded_schedule(profile: GradientProfile, chunks: Sequence[Sequence[Slice]],
                     gathers: Sequence[Sequence[int]], *, options: dict[str, Any], cross_step: bool,
                     predicted_s: float | None, policy: str = _POLICY) -> Schedule:
  """The sharded Schedule of reduce-scatter chunks (one dtype each) and gathers: one bucket per chunk."""
  # nothing to send (every row empty): an empty schedule, with no gathers (so not sharded)
  return make_schedule(buckets_from_groups(profile, chunks), profile, policy=policy, options=options,
                       cross_step=cross_step, predicted_s=predicted_s,
                       gathers=tuple(tuple(g) for g in gathers) if chunks else ())


# --------------------------------------------------------------------------------------------------
# The plan


def plan_sharded(prob: Problem, bucket_bytes: int | None = None
                 ) -> tuple[str, list[list[Slice]], list[list[int]], float]:
  """(label, reduce-scatter chunks, gathers, calm iteration) of the best sharded plan for `prob`; with
  `bucket_bytes`, DeAR's fixed fusion alone.
  """
  if not prob.live:
    return "empty", [], [], float(max(prob.backward_s + prob.after_s, prob.floor_s))
  if bucket_bytes is not None:
    chunks, gathers = fixed_fusion(prob, bucket_bytes)
    return (f"dear(bucket_bytes={bucket_bytes})", chunks, gathers,
            sharded_iteration_s(prob, sharded_arrays(prob, chunks, gathers)))
  best: tuple[float, int, str, list[list[Slice]], list[list[int]]] | None = None
  seen: set[tuple] = set()
  total = float(prob.row_nbytes.sum())
  order = [i for i in prob.profile.ready_order() if prob.row_nbytes[i] > 0]
  chunks, gathers = fixed_fusion(prob, DEAR_BUCKET_BYTES)
  cands: list[tuple[str, list[list[Slice]], list[list[int]] | None]] = [
      ("dear-25MiB", chunks, gathers), ("dear-25MiB+gather-dp", chunks, None)]
  inputs = _rs_inputs(prob, order)
  chunks, largest = [], math.inf
  for cap in _CAPS:      # limits decreasing: a plan whose buckets all fit the next limit is its plan too
    limit = None if cap is None else (0.0 if cap == 0 else total / cap)
    if limit is None or largest > limit:
      chunks = rs_partition(prob, order, limit, inputs=inputs)
      largest = max((sum(float(prob.row_nbytes[r]) for r, _, _ in c) for c in chunks if len(c) > 1),
                    default=0.0)
    key = tuple(map(tuple, chunks))
    if key in seen:
      continue
    seen.add(key)
    cands.append((f"rs-dp(cap={'none' if cap is None else ('row' if cap == 0 else f'1/{cap}')})", chunks, None))
  per_chunk = None
  for n, (label, chunks, gathers) in enumerate(cands):
    if gathers is None:     # the chunks of the candidate before (dear-25MiB's) or new ones
      per_chunk = per_chunk if n == 1 else chunk_arrays(prob, chunks)
      gathers = gather_partition(prob, chunks, per_chunk=per_chunk,
                                 beat=math.inf if best is None else best[0])
      if gathers is None:   # it cannot beat the best so far (its lower bound says so)
        continue
    else:
      per_chunk = chunk_arrays(prob, chunks)
    t = sharded_iteration_s(prob, sharded_arrays(prob, chunks, gathers, per_chunk=per_chunk))
    if best is None or t < best[0] * (1 - 1e-12):
      best = (t, n, label, chunks, gathers)
  t, _, label, chunks, gathers = best   # dear-25MiB is always scored: it has its gathers
  return label, chunks, gathers, t


def fixed_fusion(prob: Problem, bucket_bytes: float) -> tuple[list[list[Slice]], list[list[int]]]:
  """DeAR's own fusion: layers in forward order joined while the bucket stays under `bucket_bytes` (the
  first always joins); the same buckets reduce-scattered in ready order, gathered front first.
  """
  rows_of: dict[int, list[int]] = {}
  for i in prob.live:
    rows_of.setdefault(int(prob.row_layer[i]), []).append(i)
  groups: list[list[int]] = []
  cur: list[int] = []
  size = 0.0
  for l in sorted(rows_of):
    nb = float(sum(prob.row_nbytes[i] for i in rows_of[l]))
    if not cur or size + nb < bucket_bytes:
      cur += rows_of[l]
      size += nb
    else:
      groups.append(cur)
      cur, size = list(rows_of[l]), nb
  if cur:
    groups.append(cur)
  chunks = [(max(prob.ready[r] for r, _, _ in sl), gi, sl) for gi, rows in enumerate(groups)   # per dtype
            for sl in split_by_dtype(prob.dtype.__getitem__, [(r, 0, prob.size[r]) for r in rows])]
  order = sorted(range(len(chunks)), key=lambda k: (chunks[k][0], -chunks[k][1]))
  issued = [chunks[k][2] for k in order]
  where = {k: j for j, k in enumerate(order)}
  return issued, [[where[k]] for k in range(len(chunks))]   # one all-gather per bucket and dtype, front first


def _rs_inputs(prob: Problem, order: Sequence[int]) -> tuple[list[float], list[float], list[int]]:
  """`rs_partition`'s inputs for `order`: ready times, byte prefix sums, each item's dtype-run start."""
  prefix = np.concatenate([[0.0], np.cumsum(prob.row_nbytes[list(order)])]).tolist()
  return prob.row_ready_s[list(order)].tolist(), prefix, dtype_runs([prob.dtype[r] for r in order])


def rs_partition(prob: Problem, order: Sequence[int], cap: float | None, *,
                 inputs: tuple[list[float], list[float], list[int]] | None = None) -> list[list[Slice]]:
  """Reduce-scatter buckets: contiguous runs of `order` (one dtype, at most `cap` bytes unless one row is
  larger) minimising the last reduce-scatter's end, exactly; `inputs` reuses `_rs_inputs`.
  """
  a, b = 0.5 * prob.startup_s, 0.5 * prob.per_byte_s
  ready, prefix, run_start = _rs_inputs(prob, order) if inputs is None else inputs
  choice = contiguous_dp(ready, prefix, run_start, a, b, cap)[1]
  return [[(r, 0, prob.size[r]) for r in sorted(g)] for g in groups_from_choice(order, choice)]


def gather_partition(prob: Problem, chunks: Sequence[Sequence[Slice]], *, per_chunk: Any = None,
                     beat: float = math.inf) -> list[list[int]] | None:
  """All-gather buckets for `chunks`: contiguous runs in forward order, one dtype each, by the exact
  program; None when no grouping can end the step before `beat`.
  """
  k_n = len(chunks)
  front = [min(c)[0] for c in chunks]                  # the front-most row (slices are (row, a, b))
  seq = sorted(range(k_n), key=lambda k: (front[k], k))
  dtype = [prob.dtype[chunks[k][0][0]] for k in seq]
  if not prob.overlap:              # serial: the fewest all-gathers, one per dtype
    by_dtype: dict[str, list[int]] = {}
    for x, k in enumerate(seq):
      by_dtype.setdefault(dtype[x], []).append(k)
    return list(by_dtype.values())
  rs_ready, rs_nbytes, rs_update, _ = chunk_arrays(prob, chunks) if per_chunk is None else per_chunk
  a, b = 0.5 * prob.startup_s, 0.5 * prob.per_byte_s
  # the reduce-scatters on the link, as the simulator runs them with overlap (`_sharded.sharded_run`)
  rs_end, _ = ends_one_link(rs_ready, a + b * rs_nbytes, prob.backward_s, True)
  nbytes = rs_nbytes[seq]
  upd = rs_update[seq]
  end_rs = rs_end[seq]
  t_rs = float(rs_end.max())
  prefix = np.concatenate([[0.0], np.cumsum(nbytes)])
  cum_upd = np.concatenate([[0.0], np.cumsum(upd)])
  run_start = dtype_runs(dtype)
  runs = 1 + sum(1 for j in range(1, k_n) if run_start[j] == j)
  if t_rs + a * runs + b * float(prefix[-1]) >= beat:
    return None
  if not prob.cross_step:
    t0 = max(float(prob.backward_s), t_rs)       # with overlap, backward ends on time
    release = (t0 + cum_upd[1:]).tolist()
    choice = contiguous_dp(release, prefix.tolist(), run_start, a, b, None, start=t_rs)[1]
    return groups_from_choice(seq, choice)
  # pipelined: Pareto program over prefixes of (link free, max of end + forward tail), vectorised: every
  # prefix's front is a run of one flat array (entries of prefix i at starts[i]:starts[i + 1])
  tail = np.array([float(prob.layer_fwd_tail_s[int(prob.row_layer[front[k]])]) for k in seq])
  cap = 1 + k_n * _FRONT                                          # every prefix's front, flat
  ends = np.empty(cap)
  costs = np.empty(cap)
  parent = np.empty(cap, dtype=np.int64)
  owner = np.empty(cap, dtype=np.int64)
  ends[0], costs[0], parent[0], owner[0] = t_rs, -math.inf, -1, 0
  starts = [0, 1]
  for j in range(1, k_n + 1):
    lo = run_start[j - 1]
    rel = np.maximum.accumulate(end_rs[lo:j][::-1])[::-1]          # max RS end over chunks i..j-1
    head = np.maximum.accumulate(tail[lo:j][::-1])[::-1]           # the group's largest forward tail
    release = rel + (cum_upd[j] - cum_upd[lo:j])
    dur = a + b * (prefix[j] - prefix[lo:j])
    a0, a1 = starts[lo], starts[j]
    e_prev = ends[a0:a1]
    c_prev = costs[a0:a1]
    i = owner[a0:a1] - lo
    e2 = np.maximum(e_prev, release[i]) + dur[i]
    c2 = np.maximum(c_prev, e2 + head[i])
    order = np.lexsort((c2, e2))                                  # by end, then cost
    c_sorted = c2[order]
    keep = np.empty(c_sorted.size, dtype=bool)
    keep[0] = True
    keep[1:] = c_sorted[1:] < np.minimum.accumulate(c_sorted)[:-1]
    kept = order[keep]
    if kept.size > _FRONT:                                        # the lowest-cost ones
      kept = kept[np.argsort(c2[kept], kind="stable")[:_FRONT]]
    m = kept.size
    ends[a1:a1 + m] = e2[kept]
    costs[a1:a1 + m] = c2[kept]
    parent[a1:a1 + m] = a0 + kept
    owner[a1:a1 + m] = j
    starts.append(a1 + m)
  x = min(range(starts[k_n], starts[k_n + 1]), key=lambda x: (float(costs[x]), float(ends[x])))   # the last front
  groups: list[list[int]] = []
  j = k_n
  while j > 0:
    px = int(parent[x])
    i = int(owner[px])
    groups.append([seq[y] for y in range(i, j)])
    j, x = i, px
  groups.reverse()
  return groups


def contiguous_dp(release: Sequence[float], prefix: Sequence[float], run_start: Sequence[int], a: float,
                  b: float, cap: float | None, *, start: float = 0.0) -> tuple[list[float], list[int]]:
  """The exact one-link program over contiguous groups, O(n) with a monotone deque: f[0] = start, f[j] =
  min over allowed i of max(f[i], release[j-1]) + a + b·(prefix[j] - prefix[i]); returns (f, choice).
  """
  n = len(release)
  f = [0.0] * (n + 1)
  f[0] = start
  choice = [0] * n
  dq: collections.deque[int] = collections.deque()
  g = [0.0] * (n + 1)
  q = 0                    # first index with f[i] > release (among those pushed: 0..j-1)
  cap_lo = 0
  for j in range(1, n + 1):
    i_new = j - 1
    g[i_new] = f[i_new] - b * prefix[i_new]
    while dq and g[dq[-1]] > g[i_new]:
      dq.pop()
    dq.append(i_new)
    r = release[j - 1]
    while q < j and f[q] <= r:
      q += 1
    lo = run_start[j - 1]
    if cap is not None:
      while prefix[j] - prefix[cap_lo] > cap:
        cap_lo += 1
      lo = max(lo, min(cap_lo, j - 1))
    best_i, best_v = -1, math.inf
    if q - 1 >= lo:                                   # f[q-1] <= r: the largest such i
      best_i = q - 1
      best_v = r + a + b * (prefix[j] - prefix[best_i])
    left = max(lo, q)
    while dq and dq[0] < left:
      dq.popleft()
    if dq and left <= j - 1:
      i = dq[0]
      v = f[i] + a + b * (prefix[j] - prefix[i])
      if v < best_v:
        best_i, best_v = i, v
    f[j] = best_v
    choice[j - 1] = best_i
  return f, choice

