"""The local search of `auto`: first-improvement moves over candidate chunks, with random kicks,
incremental scoring and a fixed evaluation budget (pure numpy; docs/design.md, "The policies", "auto").
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Callable, Iterator

import numpy as np

from .._planning._core import Problem, iteration_s, link_end
from ._joint import SearchChunk, make_chunk, merged

PATIENCE = 40   # kicks in a row without improvement before the iterated search stops
_EPS = 1e-12    # a trial must beat the best by this fraction to count as an improvement
SIGNIFICANT = 32  # single-slice moves: slices of at least 1/SIGNIFICANT of their chunk's bytes

Stats = tuple[float, float, float]   # (ready_s, nbytes, tail_s) of one chunk
Move = tuple[int, int, list[Stats], Callable[[], list[SearchChunk]]]


def stats(c: SearchChunk) -> Stats:
  return (c.ready_s, c.nbytes, c.tail_s)


def _join(x: Stats, y: Stats) -> Stats:
  return (max(x[0], y[0]), x[1] + y[1], max(x[2], y[2]))


class Scorer:
  """The iteration time of a candidate and of edits of it (chunks i..j-1 replaced): with overlap the
  recurrence from the edit on, else the core on the whole schedule.
  """

  def __init__(self, prob: Problem, chunks: list[SearchChunk]):
    self.prob = prob
    self.fast = prob.overlap
    self.links = prob.links
    self.a, self.b = prob.startup_s, prob.per_byte_s
    self.base = max(prob.backward_s + prob.after_s, prob.floor_s)
    self.reset([stats(c) for c in chunks])

  def reset(self, st: list[Stats]) -> None:
    """Sets the candidate to the chunks of stats `st` (in issue order)."""
    self.st = st
    if not self.fast:
      self.value = self._core(st)
      return
    a, b = self.a, self.b
    n = len(st)
    ends, best, after = [0.0] * n, [0.0] * n, [0.0] * n
    m = self.base
    if self.links == 1:
      t = -math.inf
      for k, (r, nb, q) in enumerate(st):
        t = link_end(t, r, nb, a, b)
        ends[k] = t
        m = max(m, t + q)
        best[k] = m
    else:
      free, prev = [0.0] * self.links, -math.inf
      self.states = [None] * n
      for k, (r, nb, q) in enumerate(st):
        prev = max(r, prev, free[0])
        e = prev + a + b * nb
        del free[0]
        insort(free, e)
        self.states[k] = (tuple(free), prev)
        ends[k] = e
        m = max(m, e + q)
        best[k] = m
    s = -math.inf
    for k in range(n - 1, -1, -1):
      s = max(s, ends[k] + st[k][2])
      after[k] = s
    self.ends, self.best, self.after = ends, best, after
    self.value = m

  def _core(self, st: list[Stats]) -> float:
    arr = np.array(st, dtype=np.float64).reshape(-1, 3)
    return iteration_s(self.prob, arr[:, 0], self.prob.durations(arr[:, 1]), arr[:, 2])

  def trial(self, i: int, j: int, new: list[Stats], limit: float) -> float:
    """The iteration with chunks i..j-1 replaced by `new`; any value >= `limit` means "no better"."""
    if not self.fast:
      return self._core(self.st[:i] + new + self.st[j:])
    if self.links > 1:
      return self._trial_links(i, j, new, limit)
    a, b = self.a, self.b
    t, m = (self.ends[i - 1], self.best[i - 1]) if i > 0 else (-math.inf, self.base)
    for r, nb, q in new:
      t = link_end(t, r, nb, a, b)
      if t + q > m:
        m = t + q
        if m >= limit:
          return m
    st, ends, after = self.st, self.ends, self.after
    for u in range(j, len(st)):
      r, nb, q = st[u]
      t = link_end(t, r, nb, a, b)
      if t == ends[u]:   # back on the old timeline: the rest is unchanged
        return m if m > after[u] else after[u]
      if t + q > m:
        m = t + q
        if m >= limit:
          return m
    return m

  def _trial_links(self, i: int, j: int, new: list[Stats], limit: float) -> float:
    a, b = self.a, self.b
    if i > 0:
      free, prev = list(self.states[i - 1][0]), self.states[i - 1][1]
      m = self.best[i - 1]
    else:
      free, prev, m = [0.0] * self.links, -math.inf, self.base
    st, states, after = self.st, self.states, self.after
    for u, (r, nb, q) in enumerate(new + st[j:]):
      prev = max(r, prev, free[0])
      e = prev + a + b * nb
      del free[0]
      insort(free, e)
      if e + q > m:
        m = e + q
        if m >= limit:
          return m
      old = u - len(new) + j
      if old >= j and states[old] == (tuple(free), prev):  # back on the old timeline
        return m if m > after[old] else after[old]
    return m


def moves(prob: Problem, cur: list[SearchChunk], st: list[Stats], k: int, rich: bool) -> Iterator[Move]:
  """The neighbourhood of chunk k, as edits (i, j, stats, build): replace cur[i:j] with build()."""
  c, sc = cur[k], st[k]
  n = len(cur)
  if k + 1 < n:
    d = cur[k + 1]
    if c.dtype == d.dtype:
      yield k, k + 2, [_join(sc, st[k + 1])], lambda: [merged(prob, c, d)]
    yield k, k + 2, [st[k + 1], sc], lambda: [d, c]
  s = c.slices
  if len(s) > 1:
    half = len(s) // 2
    x, y = make_chunk(prob, s[:half]), make_chunk(prob, s[half:])
    yield k, k + 1, [stats(x), stats(y)], lambda: [x, y]
  if not rich:
    return
  for p in range(n + 1):  # move the chunk to just before chunk p (p = n: to the end)
    if p < k:
      yield p, k + 1, [sc] + st[p:k], lambda p=p: [c] + cur[p:k]
    elif p > k + 1:
      yield k, p, st[k + 1:p] + [sc], lambda p=p: cur[k + 1:p] + [c]
  for m in range(n):  # merge it into chunk m of its dtype
    if m != k and cur[m].dtype == c.dtype:
      if m < k:
        yield m, k + 1, [_join(st[m], sc)] + st[m + 1:k], lambda m=m: [merged(prob, cur[m], c)] + cur[m + 1:k]
      else:
        yield k, m + 1, st[k + 1:m] + [_join(st[m], sc)], lambda m=m: cur[k + 1:m] + [merged(prob, cur[m], c)]
  if len(s) < 2:
    return
  ready, tail, size = prob.ready, prob.tail, prob.itemsize
  one = [(ready[r], (b - a) * size[r], tail[r]) for r, a, b in s]
  # move in bulk every slice that chunk m can take without becoming ready later or needing more tail
  # after it (one trial for what would be many single moves of small gains each)
  for m in range(n):
    if m != k and cur[m].dtype == c.dtype:
      rm, nm, qm = st[m]
      fits = [x[0] <= rm and x[2] <= qm for x in one]
      count = sum(fits)
      if 0 < count < len(s):
        moved = sum(x[1] for x, f in zip(one, fits) if f)
        base_st = (max(x[0] for x, f in zip(one, fits) if not f), sc[1] - moved,
                   max(x[2] for x, f in zip(one, fits) if not f))
        into_st = (rm, nm + moved, qm)

        def parts(fits=fits):
          return (make_chunk(prob, [x for x, f in zip(s, fits) if not f]),
                  make_chunk(prob, [x for x, f in zip(s, fits) if f]))

        yield _into(prob, cur, st, k, m, base_st, into_st, parts)
  # move one slice out: alone anywhere, or into another chunk of its dtype; only the slices that set the
  # chunk's readiness or tail or hold at least 1/SIGNIFICANT of its bytes (a smaller one changes little
  # but its own bytes' time, which the bulk move above shifts in one go)
  pre_r, pre_q, suf_r, suf_q = _running_max(one)
  for i in range(len(s)):
    alone_st = one[i]
    if alone_st[1] * SIGNIFICANT < sc[1] and alone_st[0] < sc[0] and alone_st[2] < sc[2]:
      continue
    base_st = (max(pre_r[i], suf_r[i + 1]), sc[1] - alone_st[1], max(pre_q[i], suf_q[i + 1]))

    def parts(i=i):
      return make_chunk(prob, s[:i] + s[i + 1:]), make_chunk(prob, [s[i]])

    for p in range(n + 1):  # alone at position p of the list with the rest of chunk k at k
      if p <= k:
        yield p, k + 1, [alone_st] + st[p:k] + [base_st], lambda p=p, f=parts: _alone_before(cur, k, p, f)
      else:
        yield k, p, [base_st] + st[k + 1:p] + [alone_st], lambda p=p, f=parts: _alone_after(cur, k, p, f)
    for m in range(n):
      if m != k and cur[m].dtype == c.dtype:
        yield _into(prob, cur, st, k, m, base_st, _join(st[m], alone_st), parts)


def _running_max(one: list[Stats]) -> tuple[list[float], list[float], list[float], list[float]]:
  """Prefix and suffix maxima of ready and tail over a chunk's slices (prefix[i]: slices before i;
  suffix[i]: slices from i on)."""
  n = len(one)
  pre_r, pre_q = [-math.inf] * (n + 1), [-math.inf] * (n + 1)
  suf_r, suf_q = [-math.inf] * (n + 1), [-math.inf] * (n + 1)
  for i, (r, _, q) in enumerate(one):
    pre_r[i + 1], pre_q[i + 1] = max(pre_r[i], r), max(pre_q[i], q)
  for i in range(n - 1, -1, -1):
    suf_r[i], suf_q[i] = max(suf_r[i + 1], one[i][0]), max(suf_q[i + 1], one[i][2])
  return pre_r, pre_q, suf_r, suf_q


def _alone_before(cur, k, p, parts):
  base, alone = parts()
  return [alone] + cur[p:k] + [base]


def _alone_after(cur, k, p, parts):
  base, alone = parts()
  return [base] + cur[k + 1:p] + [alone]


def _into(prob: Problem, cur: list[SearchChunk], st: list[Stats], k: int, m: int, base_st: Stats, into_st: Stats,
          parts: Callable[[], tuple[SearchChunk, SearchChunk]]) -> Move:
  """The edit that splits chunk k into `parts()` (the rest, the part moved) and merges the moved part into
  chunk m: `base_st` and `into_st` are the stats of the rest and of chunk m after."""
  def build() -> list[SearchChunk]:
    base, moved = parts()
    if m < k:
      return [merged(prob, cur[m], moved)] + cur[m + 1:k] + [base]
    return [base] + cur[k + 1:m] + [merged(prob, cur[m], moved)]

  if m < k:
    return m, k + 1, [into_st] + st[m + 1:k] + [base_st], build
  return k, m + 1, [base_st] + st[k + 1:m] + [into_st], build


def local_search(prob: Problem, chunks: list[SearchChunk], budget: int, rich: bool,
                 active: set[SearchChunk] | None = None) -> tuple[list[SearchChunk], float, int]:
  """First-improvement local search over `moves` until a local optimum (near the `active` chunks, by
  don't-look bits) or `budget` evaluations: (chunks, predicted, evaluations).
  """
  cur = list(chunks)
  look = None if active is None else set(active)
  score = Scorer(prob, cur)
  best = score.value
  evals = 1
  improved = True
  while improved and evals < budget:
    improved = False
    k = 0
    while k < len(cur) and evals < budget:
      if look is not None and cur[k] not in look:
        k += 1
        continue
      limit = best * (1 - _EPS)
      for i, j, new, build in moves(prob, cur, score.st, k, rich):
        evals += 1
        v = score.trial(i, j, new, limit)
        if v < limit:
          built = build()
          cur = cur[:i] + built + cur[j:]
          score.reset(score.st[:i] + new + score.st[j:])
          best, improved = score.value, True
          if look is not None:
            look.update(cur[max(0, i - 1):i + len(built) + 1])
          break
        if evals >= budget:
          break
      else:
        if look is not None:
          look.discard(cur[k])
        k += 1
  return cur, best, evals


def kick(prob: Problem, cur: list[SearchChunk], rng: np.random.Generator) -> list[SearchChunk]:
  """A random move (a chunk or one slice moved elsewhere, merged into another chunk, or split off)."""
  out = list(cur)
  k = int(rng.integers(len(out)))
  c = out.pop(k)
  kind = int(rng.integers(3))
  if kind == 1 and len(c.slices) > 1:  # one slice alone, anywhere
    i = int(rng.integers(len(c.slices)))
    out.insert(k, make_chunk(prob, c.slices[:i] + c.slices[i + 1:]))
    out.insert(int(rng.integers(len(out) + 1)), make_chunk(prob, [c.slices[i]]))
    return out
  same = [j for j in range(len(out)) if out[j].dtype == c.dtype]
  if kind == 2 and same:  # merge into another chunk of its dtype
    j = same[int(rng.integers(len(same)))]
    out[j] = merged(prob, out[j], c)
    return out
  out.insert(int(rng.integers(len(out) + 1)), c)
  return out


def iterated_local_search(prob: Problem, chunks: list[SearchChunk], budget: int, rich: bool
                          ) -> tuple[list[SearchChunk], float]:
  """Local search, then (small schedules) kicks of two random moves and local search again, keeping
  improvements, until `budget` or `PATIENCE` failed kicks. Deterministic.
  """
  cur, best, used = local_search(prob, chunks, budget, rich)
  if not rich:
    return cur, best
  rng = np.random.default_rng(0)
  idle = 0
  while used < budget and len(cur) > 1 and idle < PATIENCE:
    trial = kick(prob, kick(prob, cur, rng), rng)
    kept = set(cur)
    near = [trial[q] for p, c in enumerate(trial) if c not in kept
            for q in range(max(0, p - 1), min(len(trial), p + 2))]
    cand, v, n = local_search(prob, trial, max(1, budget - used), rich, active=set(near))
    used += n
    idle += 1
    if v < best * (1 - _EPS):
      cur, best, idle = cand, v, 0
  return cur, best
