"""The `auto` policy: the best predicted schedule, from every policy's option search and a joint optimiser.

Pure: numpy only, never jax.

`auto` plans every baseline policy at its defaults and over a small grid of its options, runs its own
joint optimiser of merge points, issue order and partition sizes, predicts every candidate's iteration
time with the simulator's own fast path (`_simulate._iteration_s`, the number `simulate` returns), and
returns the fastest. The baselines at their defaults are among the candidates, so `auto` is never
predicted slower than the best of them under the model it planned with.

The joint optimiser, per step mode:

* ``cross_step=False`` with overlap: an exact O(L^2) dynamic program over contiguous merges of the
  ready order (one dtype per chunk). The end of a prefix's last all-reduce is monotone in the end of
  the prefix before it, so keeping the earliest end per prefix is optimal over contiguous merges; with
  one link, sending a row in pieces or out of ready order never ends earlier, so no search follows.
* ``cross_step=True`` with overlap: a priority list schedule while backward runs (on a grid of partition
  size, block size, and how the link waits: for some bytes to be ready, or chunks cut at element
  boundaries to end when the next gradient is ready, as Prophet sizes blocks to gaps; the grid is in
  units of the bytes whose transfer costs one start-up). Once every gradient is ready, the rest goes
  in priority order, grouped by an exact O(N^2) dynamic program that minimises the next forward's end
  (`_tail_dp`). Then a first-improvement local search (merge, swap, split chunks; on small schedules
  also move a chunk or one slice anywhere, with random kicks) refines the best candidates within a
  fixed evaluation budget.
* without overlap (XLA on the CPU): every all-reduce stalls the device, so few all-reduces win: one per
  dtype (the baselines are candidates too).
* ``cross_step="auto"``: both modes are planned and the faster prediction wins; the schedule records it.

With ``robust > 0`` (alpha and beta uncertain by that fraction), auto returns instead the candidate
whose worst slowdown over that box of networks is least (minimax regret), replanning its own candidates
for the box's corners, among those predicted within ``robust_tol`` of the best default baseline.

References:
  S. Shi, X. Chu, B. Li. MG-WFBP: Efficient data communication for distributed synchronous SGD
  algorithms. INFOCOM 2019.
  Z. Zhang et al. Prophet: Speeding up distributed DNN training with predictable communication
  scheduling. ICPP 2021.
  Y. Peng et al. A generic communication scheduler for distributed DNN training acceleration
  (ByteScheduler). SOSP 2019.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._types import GradientProfile, NetworkModel, Schedule, itemsize
from . import _common

Slice = tuple[int, int, int]

_POLICY = "auto"
# The joint optimiser's grid, in units of the network's start-up/byte ratio a/b (the bytes whose transfer
# time equals one start-up): partition size (None: whole rows), block size (None: no limit), and how the
# link waits while backward runs: for that many bytes to be ready, or (fit) chunks cut to end by the
# next ready time but holding at least that many. _EXACT_TAILS heads get the exact tail grouping.
_PARTITIONS = (None, 2, 8)
_BLOCKS = (2, 8, 32, None)
_MODES = (("wait", 0), ("wait", 2), ("fit", 1))
_EXACT_TAILS = 4
_MAX_PIECES = 2048
# Local search: schedules of at most _SMALL chunks (3 * _SMALL slices) get the rich neighbourhood
# (move a chunk or a slice anywhere, random kicks) and up to _STARTS starting points.
_SMALL = 24
_STARTS = 3
_PATIENCE = 40
# Robust choice: the exact-tail grid points of the best few candidates are replanned per network.
_ROBUST_POINTS = 3
_INF = math.inf


# --------------------------------------------------------------------------------------------------
# The instance and its fast evaluator


class _Chunk:
  """One all-reduce during the search: its slices, dtype, bytes, readiness and tail.

  `tail_s` is what must follow the chunk's end (the simulator's per-row tail, max over its rows):
  update + forward in the plain step, update(l) + forward of layers l.. in the pipelined step.
  """

  __slots__ = ("slices", "dtype", "nbytes", "ready_s", "tail_s")

  def __init__(self, slices: Sequence[Slice], dtype: str, nbytes: float, ready_s: float, tail_s: float):
    self.slices = tuple(slices)
    self.dtype = dtype
    self.nbytes = float(nbytes)
    self.ready_s = float(ready_s)
    self.tail_s = float(tail_s)


def _merge_slices(slices: Sequence[Slice]) -> list[Slice]:
  """Joins consecutive slices of the same row that touch ((r, a, b), (r, b, c) -> (r, a, c))."""
  out: list[Slice] = []
  for r, a, b in slices:
    if out and out[-1][0] == r and out[-1][2] == a:
      out[-1] = (r, out[-1][1], b)
    else:
      out.append((r, a, b))
  return out


class _Instance:
  """The arrays of one (profile, network, step mode) that the evaluator and the searches read.

  The evaluator is the simulator's own fast path (`_simulate._problem` and `_simulate._iteration_s`),
  so a prediction here is the number `simulate` returns.
  """

  def __init__(self, profile: GradientProfile, network: NetworkModel, cross_step: bool):
    from .._simulate import _problem

    self.profile = profile
    self.network = network
    self.cross_step = cross_step
    self.prob = _problem(profile, network, cross_step=cross_step)
    rows = profile.rows
    self.n = len(rows)
    self.ready = [r.ready_s for r in rows]
    self.tail = self.prob.row_tail_s.tolist()
    self.nbytes = np.array([r.nbytes for r in rows], dtype=np.float64)
    self.dtype = [r.dtype for r in rows]
    self.itemsize = [itemsize(r.dtype) for r in rows]
    self.size = [r.size for r in rows]
    self.startup_s = network.startup_s
    self.per_byte_s = network.per_byte_s
    self.overlap = network.overlap
    self.live = [i for i in range(self.n) if self.nbytes[i] > 0]

  def chunk(self, slices: Sequence[Slice]) -> _Chunk:
    slices = _merge_slices(slices)
    nbytes = sum((b - a) * self.itemsize[r] for r, a, b in slices)
    return _Chunk(slices, self.dtype[slices[0][0]], nbytes, max(self.ready[r] for r, _, _ in slices),
                  max(self.tail[r] for r, _, _ in slices))

  def chunks_of(self, schedule: Schedule) -> list[_Chunk]:
    return [self.chunk(c.slices) for c in schedule.chunks]

  def merged(self, x: _Chunk, y: _Chunk) -> _Chunk:
    return self.chunk(x.slices + y.slices)

  def arrays(self, chunks: Sequence[_Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ready, nbytes, tail) of `chunks`, in issue order."""
    n = len(chunks)
    return (np.fromiter((c.ready_s for c in chunks), dtype=np.float64, count=n),
            np.fromiter((c.nbytes for c in chunks), dtype=np.float64, count=n),
            np.fromiter((c.tail_s for c in chunks), dtype=np.float64, count=n))

  def iteration_of(self, ready: np.ndarray, nbytes: np.ndarray, tail: np.ndarray) -> float:
    """The simulator's iteration time from per-chunk arrays in issue order."""
    from .._simulate import _iteration_s

    p = self.prob
    return float(_iteration_s(ready, p.startup_s + p.per_byte_s * nbytes, tail, **p.terms()))

  def iteration_s(self, chunks: Sequence[_Chunk]) -> float:
    """The simulator's steady-state iteration time of `chunks` in issue order."""
    return self.iteration_of(*self.arrays(chunks))


# --------------------------------------------------------------------------------------------------
# cross_step=False: the exact dynamic program over contiguous merges of the ready order


def _contiguous_dp(inst: _Instance, networks: Sequence[NetworkModel] = ()) -> list[_Chunk]:
  """Optimal contiguous merges of the ready order (one link, one dtype per chunk).

  f[j] = min over i of max(f[i], ready(j-1)) + a + b * bytes(i..j-1): the earliest end of the last
  all-reduce of the first j rows. The end of a group is monotone in f[i], so the earliest prefix end is
  all a later group needs; the inner minimum is one numpy expression.

  With `networks`, a hedged variant (a heuristic, for the robust choice): each prefix keeps its end
  under every one of those networks, and the choice minimises their sum.
  """
  if networks:
    a = np.array([n.startup_s for n in networks])
    b = np.array([n.per_byte_s for n in networks])
  else:
    a = np.array([inst.startup_s])
    b = np.array([inst.per_byte_s])
  order = [i for i in inst.profile.ready_order() if inst.nbytes[i] > 0]
  n = len(order)
  if n == 0:
    return []
  ready = np.asarray(inst.ready)[order]
  prefix = np.concatenate([[0.0], np.cumsum(inst.nbytes[order])])
  run_start = np.zeros(n, dtype=np.int64)
  for j in range(1, n):
    same = inst.dtype[order[j]] == inst.dtype[order[j - 1]]
    run_start[j] = run_start[j - 1] if same else j
  best = np.zeros((n + 1, len(a)))
  choice = np.zeros(n, dtype=np.int64)
  for j in range(n):
    i0 = run_start[j]
    cand = np.maximum(best[i0:j + 1], ready[j]) + (a + b * (prefix[j + 1] - prefix[i0:j + 1])[:, None])
    k = int(np.argmin(cand.sum(axis=1)))  # the first minimum: the largest group
    best[j + 1] = cand[k]
    choice[j] = i0 + k
  groups = []
  j = n - 1
  while j >= 0:
    i = int(choice[j])
    groups.append([(r, 0, inst.size[r]) for r in order[i:j + 1]])
    j = i - 1
  return [inst.chunk(g) for g in reversed(groups)]


# --------------------------------------------------------------------------------------------------
# cross_step=True: priority list schedule during backward, exact grouping of the tail


def _units(inst: _Instance, partition_bytes: float | None) -> list[tuple[float, int, int, int]]:
  """Rows cut into parts of at most `partition_bytes` (as equal as possible, as
  `_common.partition_row` cuts them), as (ready, -row, start, stop) sorted by readiness."""
  units: list[tuple[float, int, int, int]] = []
  for r in inst.live:
    ready, n = float(inst.ready[r]), inst.size[r]
    per = n if partition_bytes is None else max(1, int(partition_bytes) // inst.itemsize[r])
    parts = -(-n // per)
    base, extra = divmod(n, parts)
    pos = 0
    for k in range(parts):
      step = base + (1 if k < extra else 0)
      units.append((ready, -r, pos, pos + step))
      pos += step
  units.sort()
  return units


def _priority_head(inst: _Instance, units: Sequence[tuple[float, int, int, int]], block_bytes: float,
                   wait_bytes: float, fit_bytes: float | None = None) -> tuple[list[_Chunk], list[Slice]]:
  """A priority list schedule of `units` until every one is ready: (chunks sent, units left).

  Each time the link frees, the ready units of the highest priority (lowest row) go out together, up
  to `block_bytes` (at least one unit, one dtype); with `wait_bytes`, the link first waits until that
  many bytes are ready. With `fit_bytes` (Prophet's gap sizing, on elements), a chunk is cut to end
  when the next gradient becomes ready, so a low-priority chunk never holds the link then, but holds
  at least `fit_bytes` (to amortise the start-up); the last unit is cut at an element boundary and
  its rest stays queued. The units left are those not yet sent when the last one is ready.
  """
  if not units:
    return [], []
  last_ready = units[-1][0]
  a_s, b_s = inst.startup_s, inst.per_byte_s
  size = inst.itemsize
  avail: list[Slice] = []  # heap by (row, start): priority order
  avail_bytes = 0.0
  chunks: list[_Chunk] = []
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
    if fit_bytes is not None and b_s > 0:
      cap = min(cap, max(fit_bytes, (units[k][0] - t - a_s) / b_s))
    row, a, b = heapq.heappop(avail)
    dtype = inst.dtype[row]
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
      if inst.dtype[r2] != dtype:
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
    chunk = inst.chunk(picked)
    chunks.append(chunk)
    t = max(t, chunk.ready_s) + a_s + b_s * nbytes
  return chunks, sorted(avail)


def _block_tail(inst: _Instance, units: Sequence[Slice], block_bytes: float) -> list[_Chunk]:
  """Units in priority order, grouped greedily into chunks of at most `block_bytes` (one dtype)."""
  out, cur, cur_bytes = [], [], 0.0
  for r, a, b in _merge_slices(units):
    nb = (b - a) * inst.itemsize[r]
    if cur and (inst.dtype[r] != inst.dtype[cur[0][0]] or cur_bytes + nb > block_bytes):
      out.append(inst.chunk(cur))
      cur, cur_bytes = [], 0.0
    cur.append((r, a, b))
    cur_bytes += nb
  if cur:
    out.append(inst.chunk(cur))
  return out


def _tail_dp(inst: _Instance, units: Sequence[Slice]) -> list[_Chunk]:
  """Optimal grouping of ready gradients sent back to back in priority order (one link).

  With start-up a and per-byte b, the group ending at unit j ends at T0 + (its rank)·a + b·P(j), and the
  iteration is the max over groups of that end plus the group's tail (the largest `_Chunk.tail_s` of its
  rows: update and forward that must follow). h[i], the best such max for units i.. with ranks counted from i, obeys
  h[i] = min_j max(a + b·P(j+1) + C(i..j), a + h[j+1]): a reverse O(N^2) program, exact for the order.
  """
  merged = _merge_slices(units)
  n = len(merged)
  if n == 0:
    return []
  rows = [r for r, _, _ in merged]
  nbytes = np.array([(b - a) * inst.itemsize[r] for r, a, b in merged])
  prefix = np.concatenate([[0.0], np.cumsum(nbytes)])
  completes = np.array([inst.tail[r] for r in rows])
  run_end = np.zeros(n, dtype=np.int64)
  run_end[-1] = n - 1
  for i in range(n - 2, -1, -1):
    run_end[i] = run_end[i + 1] if inst.dtype[rows[i]] == inst.dtype[rows[i + 1]] else i
  a, b = inst.startup_s, inst.per_byte_s
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
    out.append(inst.chunk(merged[i:nxt[i]]))
    i = int(nxt[i])
  return out


def _moves(inst: _Instance, cur: list[_Chunk], k: int, rich: bool):
  """The neighbourhood of chunk k, as edits (i, j, new): replace cur[i:j] with `new`."""
  c = cur[k]
  if k + 1 < len(cur):
    if c.dtype == cur[k + 1].dtype:
      yield k, k + 2, [inst.merged(c, cur[k + 1])]
    yield k, k + 2, [cur[k + 1], c]
  s = c.slices
  if len(s) > 1:
    half = len(s) // 2
    yield k, k + 1, [inst.chunk(s[:half]), inst.chunk(s[half:])]
  if not rich:
    return
  n = len(cur)
  rest = cur[:k] + cur[k + 1:]
  for j in range(n):  # move the chunk anywhere
    if j not in (k, k + 1):
      yield 0, n, rest[:j] + [c] + rest[j:]
  for j in range(n - 1):  # merge it into any other chunk of its dtype
    if rest[j].dtype == c.dtype:
      yield 0, n, rest[:j] + [inst.merged(rest[j], c)] + rest[j + 1:]
  if len(s) > 1:  # move one slice out: alone anywhere, or into another chunk of its dtype
    for i in range(len(s)):
      alone = inst.chunk([s[i]])
      base = cur[:k] + [inst.chunk(s[:i] + s[i + 1:])] + cur[k + 1:]
      for j in range(n + 1):
        yield 0, n, base[:j] + [alone] + base[j:]
      for j in range(n):
        if j != k and base[j].dtype == c.dtype:
          yield 0, n, base[:j] + [inst.merged(base[j], alone)] + base[j + 1:]


def _local_search(inst: _Instance, chunks: list[_Chunk], budget: int,
                  rich: bool) -> tuple[list[_Chunk], float, int]:
  """First-improvement local search over `_moves` (merge, swap, split; rich: move chunks and slices).

  A trial replaces a range of chunks, so it is scored by splicing the per-chunk arrays (no rebuild).
  Stops at a local optimum or after `budget` evaluations. Returns (chunks, predicted, evaluations).
  """
  cur = list(chunks)
  arrays = inst.arrays(cur)
  best = inst.iteration_of(*arrays)
  evals = 1
  improved = True
  while improved and evals < budget:
    improved = False
    k = 0
    while k < len(cur) and evals < budget:
      for i, j, new in _moves(inst, cur, k, rich):
        evals += 1
        mid = inst.arrays(new)
        trial = tuple(np.concatenate((x[:i], m, x[j:])) for x, m in zip(arrays, mid))
        v = inst.iteration_of(*trial)
        if v < best * (1 - 1e-12):
          best, arrays, improved = v, trial, True
          cur = cur[:i] + new + cur[j:]
          break
        if evals >= budget:
          break
      else:
        k += 1
  return cur, best, evals


def _kick(inst: _Instance, cur: list[_Chunk], rng: np.random.Generator) -> list[_Chunk]:
  """A random move (a chunk or one slice moved elsewhere, merged into another chunk, or split off)."""
  out = list(cur)
  k = int(rng.integers(len(out)))
  c = out.pop(k)
  kind = int(rng.integers(3))
  if kind == 1 and len(c.slices) > 1:  # one slice alone, anywhere
    i = int(rng.integers(len(c.slices)))
    out.insert(k, inst.chunk(c.slices[:i] + c.slices[i + 1:]))
    out.insert(int(rng.integers(len(out) + 1)), inst.chunk([c.slices[i]]))
    return out
  same = [j for j in range(len(out)) if out[j].dtype == c.dtype]
  if kind == 2 and same:  # merge into another chunk of its dtype
    j = same[int(rng.integers(len(same)))]
    out[j] = inst.merged(out[j], c)
    return out
  out.insert(int(rng.integers(len(out) + 1)), c)
  return out


def _iterated_local_search(inst: _Instance, chunks: list[_Chunk], budget: int, rich: bool
                           ) -> tuple[list[_Chunk], float]:
  """Local search, then (small schedules) kicks of two random moves followed by local search again,
  keeping improvements, until `budget` evaluations are spent or `_PATIENCE` kicks in a row fail.
  Deterministic (fixed seed)."""
  cur, best, used = _local_search(inst, chunks, budget, rich)
  if not rich:
    return cur, best
  rng = np.random.default_rng(0)
  idle = 0
  while used < budget and len(cur) > 1 and idle < _PATIENCE:
    trial = _kick(inst, _kick(inst, cur, rng), rng)
    cand, v, n = _local_search(inst, trial, max(1, budget - used), rich)
    used += n
    idle += 1
    if v < best * (1 - 1e-12):
      cur, best, idle = cand, v, 0
  return cur, best


# --------------------------------------------------------------------------------------------------
# The candidates


def _baselines(inst: _Instance) -> list[tuple[str, Any]]:
  """(label, scheduler) for every baseline policy at its defaults and over a grid of its options.

  Labels without parentheses are the defaults (the ones auto must never lose to).
  """
  from ._bucket import bucket
  from ._mgwfbp import mgwfbp
  from ._priority import priority
  from ._prophet import prophet
  from ._wfbp import wfbp
  from ._xla import xla

  mib = 2**20
  item = max(inst.itemsize) if inst.itemsize else 4
  out: list[tuple[str, Any]] = [("wfbp", wfbp()), ("xla", xla()), ("mgwfbp", mgwfbp()),
                                ("bucket", bucket()), ("priority", priority()), ("prophet", prophet())]
  out += [(f"bucket(bucket_bytes={mb}MiB)", bucket(bucket_bytes=mb * mib)) for mb in (1, 4, 16, 64, 128)]
  for params in (2**22, 2**24):  # the default is 2**20 parameters, credit 4x
    p, c = params * item, 4 * params * item
    out.append((f"priority(partition_bytes={p}, credit_bytes={c})",
                priority(partition_bytes=p, credit_bytes=c)))
  out.append(("prophet(gap_factor=4.0)", prophet(gap_factor=4.0)))  # prophet tunes its other knobs
  return out


def _own_candidates(inst: _Instance, cross_step: bool, grid: Sequence[tuple] | None = None
                    ) -> list[tuple[str, list[_Chunk], tuple | None]]:
  """The joint optimiser's candidates: (label, chunks, grid point or None).

  `grid` restricts the pipelined step's grid of (partition, block, mode, amount) points (all of
  `_PARTITIONS` x `_BLOCKS` x `_MODES` by default); with it, only the exact-tail variants are returned.
  """
  out: list[tuple[str, list[_Chunk], tuple | None]] = []
  if not inst.live:
    return [("empty", [], None)]
  if grid is None:
    by_dtype: dict[str, list[int]] = {}
    for r in inst.profile.ready_order():
      if inst.nbytes[r] > 0:
        by_dtype.setdefault(inst.dtype[r], []).append(r)
    whole = [inst.chunk([(r, 0, inst.size[r]) for r in rows]) for rows in by_dtype.values()]
    out.append(("one-per-dtype", sorted(whole, key=lambda c: c.ready_s), None))
  if not inst.overlap:
    return out
  if grid is None or not cross_step:
    out.append(("contiguous-dp", _contiguous_dp(inst), None))
  if not cross_step:
    return out
  a, b = inst.startup_s, inst.per_byte_s
  total = float(inst.nbytes.sum())
  scale = a / b if b > 0 else total
  # at most about _MAX_PIECES pieces however cheap the start-up (alpha = 0 would cut every element)
  scale = min(max(scale, total / _MAX_PIECES, 1.0), total)
  points = grid if grid is not None else [(pm, bm, mode, m) for pm in _PARTITIONS for bm in _BLOCKS
                                          for mode, m in _MODES]
  # Stage 1: rank the grid with a cheap tail (blocks in priority order); stage 2: the exact tail
  # grouping for the best few heads.
  ranked = []
  units_of: dict[Any, list] = {}
  for point in points:
    pm, bm, mode, m = point
    if pm not in units_of:
      units_of[pm] = _units(inst, None if pm is None else min(total, scale * pm))
    block = _INF if bm is None else min(total, scale * bm)
    wait = min(total, scale * m) if mode == "wait" else 0.0
    fit = min(total, scale * m) if mode == "fit" else None
    head, rest = _priority_head(inst, units_of[pm], block, wait, fit)
    chunks = head + _block_tail(inst, rest, block)
    label = f"joint(partition={pm}, block={bm}, {mode}={m})"
    ranked.append((inst.iteration_s(chunks), label, chunks, head, rest, point))
  ranked.sort(key=lambda x: x[0])
  seen = set()
  for v, label, chunks, head, rest, point in ranked:
    if grid is None:
      out.append((label, chunks, point))
    key = tuple(c.slices for c in head)
    if len(seen) < _EXACT_TAILS and key not in seen:
      seen.add(key)
      out.append((label + "+tail-dp", head + _tail_dp(inst, rest), point))
  return out


# --------------------------------------------------------------------------------------------------
# The factory


def auto(*, search_options: bool = True, local_search: bool = True, max_evals: int = 3000,
         robust: float = 0.0, robust_tol: float = 0.02, verify: bool = True
         ) -> Callable[..., Schedule]:
  """The best predicted schedule: every policy's option search plus a joint optimiser.

  Args:
    search_options: also plan the baselines over a grid of their options (bucket sizes, priority
      partition and credit), not only at their defaults.
    local_search: refine the best candidate by merging, splitting, swapping and moving chunks.
    max_evals: evaluations the local search may spend (bounds planning time; deterministic).
    robust: how far off (relative) alpha and beta may be, e.g. 0.3 for a rough fit. 0 (the default)
      returns the fastest predicted schedule. Above 0, auto returns the candidate whose worst slowdown
      against the best candidate, over the networks with alpha and beta each off by up to `robust`,
      is least (minimax regret), among those predicted at most `robust_tol` slower than the best
      default baseline under the given network.
    robust_tol: the predicted time (relative) the robust choice may give up, e.g. 0.02.
    verify: compute `Schedule.predicted_s` with `prophet_jax.simulate` (the search uses the
      simulator's own fast path, which agrees with it).

  Returns:
    A Scheduler: ``scheduler(profile, network, *, cross_step) -> Schedule``; ``cross_step`` may be
    False, True or ``"auto"`` (plan both modes, keep the faster, record it in ``Schedule.cross_step``).

  Raises:
    TypeError, ValueError: a bad option (named in the message).

  Examples:
    >>> import prophet_jax as pj
    >>> from prophet_jax.schedulers._auto import auto
    >>> prof = pj.GradientProfile.from_rows(
    ...     [dict(path=f"w{i}", layer=f"l{i}", shape=(1000,), dtype="float32", nbytes=4000,
    ...           ready_s=0.001 * (4 - i)) for i in range(4)], forward_s=0.0, backward_s=0.004)
    >>> net = pj.NetworkModel.preset("10gbe", workers=8)
    >>> auto()(prof, net, cross_step=False).num_allreduces
    1

  References:
    Shi, Chu, Li: MG-WFBP (INFOCOM 2019); Zhang et al.: Prophet (ICPP 2021); Peng et al.:
    ByteScheduler (SOSP 2019).
  """
  for name, value in (("search_options", search_options), ("local_search", local_search),
                      ("verify", verify)):
    if not isinstance(value, bool):
      raise TypeError(f"auto({name}={value!r}): `{name}` must be True or False.")
  if isinstance(max_evals, bool) or not isinstance(max_evals, int) or max_evals < 1:
    raise ValueError(f"auto(max_evals={max_evals!r}): `max_evals` must be a positive integer number "
                     f"of evaluations, e.g. 3000.")
  for name, value, hi in (("robust", robust, 0.9), ("robust_tol", robust_tol, 1.0)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= hi:
      raise ValueError(f"auto({name}={value!r}): `{name}` must be a number in [0, {hi}], e.g. "
                       f"{0.3 if name == 'robust' else 0.02}.")
  options = {"search_options": search_options, "local_search": local_search, "max_evals": max_evals,
             "robust": float(robust), "robust_tol": float(robust_tol), "verify": verify}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool | str = False
                ) -> Schedule:
    if cross_step == "auto" and isinstance(cross_step, str):
      plain = scheduler(profile, network, cross_step=False)
      piped = scheduler(profile, network, cross_step=True)
      return piped if piped.predicted_s < plain.predicted_s else plain
    cross = _common.check_inputs(_POLICY, profile, network, cross_step)
    return _plan_auto(profile, network, cross, options)

  scheduler.__name__ = "auto"
  scheduler.__qualname__ = "auto"
  return scheduler


def _small(x: Schedule | list[_Chunk]) -> bool:
  """Small enough for the rich neighbourhood: at most _SMALL chunks and 3 * _SMALL slices."""
  chunks = x if isinstance(x, list) else x.chunks
  return len(chunks) <= _SMALL and sum(len(c.slices) for c in chunks) <= 3 * _SMALL


class _Candidate:
  """A candidate schedule: its chunks, per-chunk arrays, and predicted times."""

  __slots__ = ("label", "chunks", "schedule", "default_baseline", "arrays", "nominal", "point", "worst")

  def __init__(self, inst: _Instance, label: str, chunks: list[_Chunk], schedule: Schedule | None = None,
               default_baseline: bool = False, point: tuple | None = None):
    self.label = label
    self.chunks = chunks
    self.schedule = schedule
    self.default_baseline = default_baseline
    self.point = point
    self.arrays = inst.arrays(chunks)
    self.nominal = inst.iteration_of(*self.arrays)
    self.worst = 1.0


def _scenarios(network: NetworkModel, robust: float) -> list[NetworkModel]:
  """The networks the true one may be if `network`'s alpha and beta are each off by up to `robust`."""
  lo, hi = 1 / (1 + robust), 1 / (1 - robust)
  return [network.replace(alpha_s=network.alpha_s * fa, beta_s_per_byte=network.beta_s_per_byte * fb)
          for fa in (lo, hi) for fb in (lo, hi)]


def _plan_auto(profile: GradientProfile, network: NetworkModel, cross: bool,
               options: dict[str, Any]) -> Schedule:
  inst = _Instance(profile, network, cross)
  cands: list[_Candidate] = []
  baselines = _baselines(inst)
  if not options["search_options"]:
    baselines = [(label, s) for label, s in baselines if "(" not in label]
  for label, sched in baselines:
    s = sched(profile, network, cross_step=cross)
    cands.append(_Candidate(inst, label, inst.chunks_of(s), s, default_baseline="(" not in label))
  for label, chunks, point in _own_candidates(inst, cross):
    cands.append(_Candidate(inst, label, chunks, point=point))
  cands.sort(key=lambda c: c.nominal)
  # With one link, no contiguous merge beats the plain step's DP and no other order or cut helps.
  exact = not cross and inst.prob.links == 1
  if options["local_search"] and inst.overlap and inst.live and not exact:
    # Refine the best few distinct candidates (one when large), sharing the evaluation budget.
    starts = [c for c in cands if _small(c.chunks)]
    starts = starts[:_STARTS] if starts and starts[0] is cands[0] else cands[:1]
    budget = options["max_evals"]
    for c in list(starts):
      refined, v = _iterated_local_search(inst, c.chunks, max(1, budget // len(starts)), _small(c.chunks))
      if v < c.nominal * (1 - 1e-12):
        cands.append(_Candidate(inst, c.label + "+local", refined, point=c.point))
    cands.sort(key=lambda c: c.nominal)
  chosen = cands[0]
  robust = options["robust"]
  if robust > 0 and inst.live and len(cands) > 1:
    chosen = _robust_choice(inst, profile, network, cross, cands, options)
  schedule = chosen.schedule
  if schedule is None:
    schedule = _common.schedule_from_groups(profile, [c.slices for c in chosen.chunks], policy=_POLICY,
                                            cross_step=cross)
  predicted = chosen.nominal
  if options["verify"]:
    from .._simulate import simulate

    predicted = float(simulate(schedule, profile, network, cross_step=cross, events=False).iteration_s)
  opts = dict(options, candidate=chosen.label)
  return Schedule(buckets=schedule.buckets, rows=schedule.rows, tree_fingerprint=schedule.tree_fingerprint,
                  policy=_POLICY, options=tuple(opts.items()), cross_step=cross, predicted_s=predicted)


def _robust_choice(inst: _Instance, profile: GradientProfile, network: NetworkModel, cross: bool,
                   cands: list[_Candidate], options: dict[str, Any]) -> _Candidate:
  """The minimax-regret candidate over the networks whose alpha and beta are off by up to `robust`.

  Scenarios: the planning network and the four corners of the box (alpha and beta each divided by
  1 - robust or 1 + robust). The joint optimiser also plans for each corner, so the best candidate
  there is close to the optimum there. A candidate's regret in a scenario is its time over the best
  candidate's; the choice minimises the worst regret among the candidates predicted no more than
  `robust_tol` slower than the best default baseline under the planning network.
  """
  nets = _scenarios(network, options["robust"])
  insts = [_Instance(profile, n, cross) for n in nets]
  top_points = list(dict.fromkeys(c.point for c in cands if c.point is not None))[:_ROBUST_POINTS]
  if inst.overlap:
    cands.append(_Candidate(inst, "contiguous-dp-hedged", _contiguous_dp(inst, [network] + nets)))
  lo, hi = 1 / (1 + options["robust"]), 1 / (1 - options["robust"])
  factors = [(fa, fb) for fa in (lo, hi) for fb in (lo, hi)]  # the order of _scenarios
  for (fa, fb), si in zip(factors, insts):
    for label, chunks, _ in _own_candidates(si, cross, grid=top_points):
      if label != "one-per-dtype":
        cands.append(_Candidate(inst, f"{label}@alpha*{fa:.2f},beta*{fb:.2f}", chunks))
  times = np.array([[c.nominal] + [si.iteration_of(*c.arrays) for si in insts] for c in cands])
  best = np.maximum(times.min(axis=0), 1e-300)
  worst = (times / best).max(axis=1)
  base = min((c.nominal for c in cands if c.default_baseline), default=_INF)
  limit = base * (1 + options["robust_tol"])
  ok = [i for i, c in enumerate(cands) if c.nominal <= limit * (1 + 1e-12)] or [0]
  i = min(ok, key=lambda i: (worst[i], cands[i].nominal))
  cands[i].worst = float(worst[i])
  return cands[i]
