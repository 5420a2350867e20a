"""The joint optimiser of `auto`: exact and greedy programs over merges, issue order and partitions
(pure numpy; docs/design.md, "The policies", "auto").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._planning._core import Problem, equal_parts, link_end, objective_s, split_by_dtype
from .._values._network import NetworkModel
from ._base import Slice
from ._common import dtype_runs, groups_from_choice
from ._prophet import Planner as ProphetPlanner

# The joint optimiser's grid, in units of the network's start-up/byte ratio a/b (the bytes whose transfer
# time equals one start-up): partition size (None: whole rows), block size (None: no limit), and how the
# link waits while backward runs: for that many bytes to be ready, or (fit) chunks cut to end by the
# next ready time but holding at least that many. EXACT_TAILS heads get the exact tail grouping.
PARTITIONS = (None, 2, 8)
BLOCKS = (2, 8, 32, None)
MODES = (("wait", 0), ("wait", 2), ("fit", 1))
# Points where one chunk fills the link until backward ends (after waiting for that many a/b bytes): the
# link-bound sandwich (low-priority bytes while backward runs, then the high-priority ones, then the rest).
END_POINTS = tuple((None, None, "end", m) for m in (0.5, 2, 8, 32))
EXACT_TAILS = 4
MAX_PIECES = 2048
_INF = math.inf


# --------------------------------------------------------------------------------------------------
# Candidate chunks and their score


class SearchChunk:
  """One all-reduce of a candidate: its slices, dtype, bytes, readiness and tail (what follows its end)."""

  __slots__ = ("slices", "dtype", "nbytes", "ready_s", "tail_s")

  def __init__(self, slices: Sequence[Slice], dtype: str, nbytes: float, ready_s: float, tail_s: float):
    self.slices = tuple(slices)
    self.dtype = dtype
    self.nbytes = float(nbytes)
    self.ready_s = float(ready_s)
    self.tail_s = float(tail_s)


def merge_slices(slices: Sequence[Slice]) -> list[Slice]:
  """Joins consecutive slices of the same row that touch ((r, a, b), (r, b, c) -> (r, a, c))."""
  out: list[Slice] = []
  for r, a, b in slices:
    if out and out[-1][0] == r and out[-1][2] == a:
      out[-1] = (r, out[-1][1], b)
    else:
      out.append((r, a, b))
  return out


def make_chunk(prob: Problem, slices: Sequence[Slice]) -> SearchChunk:
  """The SearchChunk of `slices` (touching slices of a row joined)."""
  slices = merge_slices(slices)
  nbytes = sum((b - a) * prob.itemsize[r] for r, a, b in slices)
  return SearchChunk(slices, prob.dtype[slices[0][0]], nbytes, max(prob.ready[r] for r, _, _ in slices),
                     max(prob.tail[r] for r, _, _ in slices))


def merged(prob: Problem, x: SearchChunk, y: SearchChunk) -> SearchChunk:
  """One chunk holding x's slices, then y's."""
  return make_chunk(prob, x.slices + y.slices)


def chunk_stats(chunks: Sequence[SearchChunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(ready, nbytes, tail) of `chunks`, in issue order: the core's per-chunk arrays."""
  n = len(chunks)
  return (np.fromiter((c.ready_s for c in chunks), dtype=np.float64, count=n),
          np.fromiter((c.nbytes for c in chunks), dtype=np.float64, count=n),
          np.fromiter((c.tail_s for c in chunks), dtype=np.float64, count=n))


def evaluate_chunks(prob: Problem, chunks: Sequence[SearchChunk]) -> float:
  """The iteration time of `chunks` in issue order (`_core.objective_s`)."""
  return objective_s(prob, *chunk_stats(chunks))


# --------------------------------------------------------------------------------------------------
# cross_step=False: the exact dynamic program over contiguous merges of the ready order


def contiguous_dp(prob: Problem, networks: Sequence[NetworkModel] = ()) -> list[SearchChunk]:
  """Optimal contiguous merges of the ready order (one link, one dtype per chunk), by the exact O(L^2)
  program; with `networks`, the hedged heuristic for the robust choice.
  """
  costs = networks or (prob,)   # the networks' start-up and per-byte costs, or the problem's own
  a = np.array([n.startup_s for n in costs])
  b = np.array([n.per_byte_s for n in costs])
  order = [i for i in prob.profile.ready_order() if prob.row_nbytes[i] > 0]
  n = len(order)
  if n == 0:
    return []
  ready = np.asarray(prob.ready)[order]
  prefix = np.concatenate([[0.0], np.cumsum(prob.row_nbytes[order])])
  run_start = dtype_runs([prob.dtype[r] for r in order])
  best = np.zeros((n + 1, len(a)))
  choice = np.zeros(n, dtype=np.int64)
  for j in range(n):
    i0 = run_start[j]
    cand = np.maximum(best[i0:j + 1], ready[j]) + (a + b * (prefix[j + 1] - prefix[i0:j + 1])[:, None])
    k = int(np.argmin(cand.sum(axis=1)))  # the first minimum: the largest group
    best[j + 1] = cand[k]
    choice[j] = i0 + k
  return [make_chunk(prob, [(r, 0, prob.size[r]) for r in g]) for g in groups_from_choice(order, choice)]


# --------------------------------------------------------------------------------------------------
# cross_step=True: priority list schedule during backward, exact grouping of the tail


def priority_head(prob: Problem, units: Sequence[tuple[float, int, int, int]], block_bytes: float,
                  wait_bytes: float, fit_bytes: float | None = None, to_end: bool = False
                  ) -> tuple[list[SearchChunk], list[Slice]]:
  """A priority list schedule of `units` until every one is ready: (chunks sent, units left).

  Each time the link frees the ready units of highest priority go out together up to `block_bytes`;
  `wait_bytes` waits for that many bytes ready, `fit_bytes` cuts a chunk to end when the next gradient
  is ready, `to_end` when the last one is.
  """
  if not units:
    return [], []
  last_ready = units[-1][0]
  a_s, b_s = prob.startup_s, prob.per_byte_s
  size = prob.itemsize
  avail: list[Slice] = []  # heap by (row, start): priority order
  avail_bytes = 0.0
  chunks: list[SearchChunk] = []
  t, k, n = 0.0, 0, len(units)
  while True:
    while k < n and units[k][0] <= t:
      _, row, a, b = units[k]
      heapq.heappush(avail, (-row, a, b))
      avail_bytes += (b - a) * size[-row]
      k += 1
    if k == n and t >= last_ready:
      break
    if not avail or (wait_bytes > 0 and avail_bytes < wait_bytes):
      t = units[k][0]  # k < n here: something is still to become ready
      continue
    cap = block_bytes
    if to_end and last_ready - t <= a_s + b_s * fit_bytes:
      t = units[k][0]  # too late for a chunk to end by the last ready time: the rest waits for the tail
      continue
    if fit_bytes is not None and b_s > 0:
      cap = min(cap, max(fit_bytes, ((last_ready if to_end else units[k][0]) - t - a_s) / b_s))
    row, a, b = heapq.heappop(avail)
    dtype = prob.dtype[row]
    if fit_bytes is not None and (b - a) * size[row] > cap:
      cut = a + max(1, int(cap // size[row]))
      if cut < b:
        heapq.heappush(avail, (row, cut, b))
        b = cut
    picked = [(row, a, b)]
    nbytes = (b - a) * size[row]
    skipped = []
    while avail and nbytes < cap:
      r2, a2, b2 = avail[0]
      if prob.dtype[r2] != dtype:
        skipped.append(heapq.heappop(avail))
        continue
      more = (b2 - a2) * size[r2]
      if nbytes + more > cap:
        if fit_bytes is not None:
          take = int((cap - nbytes) // size[r2])
          if take >= 1:
            heapq.heapreplace(avail, (r2, a2 + take, b2))
            picked.append((r2, a2, a2 + take))
            nbytes += take * size[r2]
        break
      heapq.heappop(avail)
      picked.append((r2, a2, b2))
      nbytes += more
    for x in skipped:
      heapq.heappush(avail, x)
    avail_bytes -= nbytes
    chunk = make_chunk(prob, picked)
    chunks.append(chunk)
    t = link_end(t, chunk.ready_s, nbytes, a_s, b_s)
  return chunks, sorted(avail)


def block_tail(prob: Problem, units: Sequence[Slice], block_bytes: float) -> list[SearchChunk]:
  """Units in priority order, grouped greedily into chunks of at most `block_bytes` (one dtype)."""
  out, cur, cur_bytes = [], [], 0.0
  for r, a, b in merge_slices(units):
    nb = (b - a) * prob.itemsize[r]
    if cur and (prob.dtype[r] != prob.dtype[cur[0][0]] or cur_bytes + nb > block_bytes):
      out.append(make_chunk(prob, cur))
      cur, cur_bytes = [], 0.0
    cur.append((r, a, b))
    cur_bytes += nb
  if cur:
    out.append(make_chunk(prob, cur))
  return out


def tail_dp(prob: Problem, units: Sequence[Slice]) -> list[SearchChunk]:
  """Optimal grouping of ready gradients sent back to back in priority order (one link), by the reverse
  O(N^2) program.
  """
  merged = merge_slices(units)
  n = len(merged)
  if n == 0:
    return []
  rows = [r for r, _, _ in merged]
  prefix = np.concatenate([[0.0], np.cumsum([(b - a) * prob.itemsize[r] for r, a, b in merged])])
  completes = np.array([prob.tail[r] for r in rows])
  run_end = np.zeros(n, dtype=np.int64)
  run_end[-1] = n - 1
  for i in range(n - 2, -1, -1):
    run_end[i] = run_end[i + 1] if prob.dtype[rows[i]] == prob.dtype[rows[i + 1]] else i
  a, b = prob.startup_s, prob.per_byte_s
  h = np.full(n + 1, -_INF)
  nxt = np.zeros(n, dtype=np.int64)
  for i in range(n - 1, -1, -1):
    js = np.arange(i, run_end[i] + 1)
    worst = np.maximum.accumulate(completes[i:run_end[i] + 1])
    v = np.maximum(a + b * prefix[js + 1] + worst, a + h[js + 1])
    k = len(v) - 1 - int(np.argmin(v[::-1]))  # the last minimum: the largest group
    h[i] = v[k]
    nxt[i] = i + k + 1
  out, i = [], 0
  while i < n:
    out.append(make_chunk(prob, merged[i:nxt[i]]))
    i = int(nxt[i])
  return out


# --------------------------------------------------------------------------------------------------
# cross_step=True: Prophet's block rule with a floor in bytes


# Prophet's block rule: floors as fractions 1/k of the total bytes, growth of the blocks after backward
# (tried for the best few floors), and how many of its plans (ranked by prediction) become candidates.
BLOCK_FLOORS = (2, 4, 8, 16, 32, 64, 128, 256)
BLOCK_GROWTHS = (1.0, 1.5, 4.0)
BLOCK_KEEP = 12
BLOCK_FLOORS_TUNED = 4


def prophet_blocks(prob: Problem) -> list[tuple[str, list[SearchChunk], None]]:
  """Prophet's block rule with a floor in bytes, over `BLOCK_FLOORS` and tail settings, and the best heads
  with `tail_dp`'s tail.
  """
  total = float(prob.row_nbytes.sum())
  planner = ProphetPlanner(prob, 1.0)
  ranked = []
  for k in BLOCK_FLOORS:  # the floor with one tail setting, then every tail setting for the best floors
    groups, est = planner.plan(max(1.0, total / k), BLOCK_GROWTHS[0], True)
    ranked.append((est, k, BLOCK_GROWTHS[0], True, groups))
  ranked.sort(key=lambda x: x[0])
  for k in [x[1] for x in ranked[:BLOCK_FLOORS_TUNED]]:
    for g in BLOCK_GROWTHS:
      for small_first in (True, False):
        if (g, small_first) != (BLOCK_GROWTHS[0], True):
          groups, est = planner.plan(max(1.0, total / k), g, small_first)
          ranked.append((est, k, g, small_first, groups))
  ranked.sort(key=lambda x: x[0])
  ranked = [(est, f"blocks(floor=total/{k}, growth={g}, small_first={sf})", groups)
            for est, k, g, sf, groups in ranked]
  last_ready = max(prob.ready[r] for r in prob.live)
  a, b = prob.startup_s, prob.per_byte_s
  out, seen = [], set()
  for _, label, groups in ranked[:BLOCK_KEEP]:
    chunks = [make_chunk(prob, c) for g in groups for c in split_by_dtype(prob.dtype.__getitem__, g)]
    out.append((label, chunks, None))
    if len(seen) == EXACT_TAILS:
      continue
    t, head = 0.0, 0
    while head < len(chunks) and max(t, chunks[head].ready_s) < last_ready:
      t = link_end(t, chunks[head].ready_s, chunks[head].nbytes, a, b)
      head += 1
    key = tuple(c.slices for c in chunks[:head])
    if key not in seen:
      seen.add(key)
      rest = sorted(x for c in chunks[head:] for x in c.slices)
      out.append((label + "+tail-dp", chunks[:head] + tail_dp(prob, rest), None))
  return out


# --------------------------------------------------------------------------------------------------
# Every candidate of the joint optimiser


def own_candidates(prob: Problem, cross_step: bool, grid: Sequence[tuple] | None = None
                    ) -> list[tuple[str, list[SearchChunk], tuple | None]]:
  """The joint optimiser's candidates: (label, chunks, grid point or None); `grid` restricts the pipelined
  step's grid (then only the exact-tail variants).
  """
  out: list[tuple[str, list[SearchChunk], tuple | None]] = []
  if not prob.live:
    return [("empty", [], None)]
  if grid is None:
    rows = [(r, 0, prob.size[r]) for r in prob.profile.ready_order() if prob.row_nbytes[r] > 0]
    whole = [make_chunk(prob, c) for c in split_by_dtype(prob.dtype.__getitem__, rows)]
    out.append(("one-per-dtype", sorted(whole, key=lambda c: c.ready_s), None))
  if not prob.overlap:
    return out
  if grid is None or not cross_step:
    out.append(("contiguous-dp", contiguous_dp(prob), None))
  if not cross_step:
    return out
  a, b = prob.startup_s, prob.per_byte_s
  total = float(prob.row_nbytes.sum())
  scale = a / b if b > 0 else total
  # at most about MAX_PIECES pieces however cheap the start-up (alpha = 0 would cut every element)
  scale = min(max(scale, total / MAX_PIECES, 1.0), total)
  points = grid if grid is not None else [(pm, bm, mode, m) for pm in PARTITIONS for bm in BLOCKS
                                          for mode, m in MODES] + list(END_POINTS)
  # Stage 1: rank the grid with a cheap tail (blocks in priority order); stage 2: the exact tail
  # grouping for the best few heads.
  ranked = []
  units_of: dict[Any, list] = {}
  for point in points:
    pm, bm, mode, m = point
    if pm not in units_of:   # the rows in parts of at most pm·a/b bytes, as (ready, -row, start, stop) by readiness
      cap = None if pm is None else min(total, scale * pm)
      units_of[pm] = sorted((float(prob.ready[r]), -r, a, b) for r in prob.live
                            for a, b in equal_parts(prob.size[r], prob.itemsize[r], cap))
    block = _INF if bm is None else min(total, scale * bm)
    wait = min(total, scale * m) if mode in ("wait", "end") else 0.0
    fit = min(total, scale * m) if mode == "fit" else (1.0 if mode == "end" else None)
    head, rest = priority_head(prob, units_of[pm], block, wait, fit, to_end=mode == "end")
    chunks = head + block_tail(prob, rest, block)
    label = f"joint(partition={pm}, block={bm}, {mode}={m})"
    ranked.append((evaluate_chunks(prob, chunks), label, chunks, head, rest, point))
  ranked.sort(key=lambda x: x[0])
  if grid is None:
    out += prophet_blocks(prob)
  seen = set()
  for v, label, chunks, head, rest, point in ranked:
    if grid is None:
      out.append((label, chunks, point))
    key = tuple(c.slices for c in head)
    if (len(seen) < EXACT_TAILS or point in END_POINTS) and key not in seen:
      seen.add(key)
      out.append((label + "+tail-dp", head + tail_dp(prob, rest), point))
  return out


