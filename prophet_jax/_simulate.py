"""The simulator: one steady-state training iteration of a profile under a schedule (pure numpy).

`simulate(schedule, profile, network, *, cross_step=False)` implements DESIGN.md's "Simulator
semantics" exactly; `SimResult` holds the numbers and the timeline.

The model, per chunk c_k in schedule (issue) order, with d_k = network.allreduce_s(bytes(c_k)):

- ready(c_k) = max(ready_s of its rows) (seconds from the start of backward).
- overlap=True, links=1: start_k = max(ready_k, end_{k-1}), end_k = start_k + d_k.
  links>1: chunks are issued in schedule order (a chunk never starts before the previous one
  started) and each goes to the link that frees first (ties: the lowest link index):
  start_k = max(ready_k, start_{k-1}, earliest link free time). With one link both rules agree.
- overlap=False: the device is one serial resource. Backward compute advances only while no chunk is
  on any link. Chunk k is issued once backward's compute progress has reached ready_k, the previous
  chunk has been issued and a link is free; while any chunk runs, compute stalls. With one link this
  is start_k = max(end_{k-1}, ready_k + sum_{j<k} d_j), so the iteration is exactly
  forward + backward + update + sum of all-reduce times (when every ready_s <= backward_s).
- skew (overlap=False only): a synchronous all-reduce also waits for the slowest worker, which falls
  behind by skew times the compute the device did since the previous issue. Chunk k's duration is
  d_k + skew·(q_k - q_{k-1}), q_k = max ready_s of chunks 0..k (backward progress at its issue); for
  the first chunk q_{-1} = q_last - (forward + update + backward), i.e. the compute since the previous
  step's last issue. With one link this adds exactly skew·(forward + backward + update) to any
  schedule with a chunk (when every ready_s <= backward_s).
- cross_step=False: iteration = max(backward end, last chunk end) + update + forward, where update is
  the sum of the rows' update_s and backward end includes the stalls of overlap=False.
- cross_step=True: layer l's forward of step k+1 starts at max(fwd_end(l-1), reduced(l) + update(l)),
  reduced(l) = when the last chunk holding an element of layer l ends (a row with nbytes=0 is in no
  chunk: it counts as reduced at its own ready_s), update(l) = sum of update_s of layer l's rows (a
  latency, as DESIGN's formula has it: updates of different layers may overlap each other and the
  forward), fwd_end(-1) = backward end with overlap=True; with overlap=False the device runs no
  forward while a chunk is on a link and chunks go first, so fwd_end(-1) = max(backward end, last
  chunk end). iteration = fwd_end(last layer), measured from the start of backward. Layers are
  `profile.layers` in priority order, with `profile.layer_fwd_s()` as their forward times.

SimResult.idle_s is counted as follows. cross_step=False: iteration - (forward + backward + update),
i.e. every moment the device neither computes nor runs the update (stalls under overlap=False, the
wait for the last chunk after backward). cross_step=True: iteration - (forward + backward): the
update is a latency there, so the time spent waiting for a layer's reduction *and* its update counts
as idle. Both are >= 0.

Fast path for inner loops (the `auto` planner): the iteration time depends on a schedule only
through three per-chunk arrays, so a candidate schedule can be scored without building a Schedule:

    prob = _problem(profile, network, cross_step=...)   # once per (profile, network, mode)
    # per candidate, chunks as lists of row indices (whole rows; use _chunk_arrays for slices):
    ready = np.maximum.reduceat(prob.row_ready_s[order], starts)    # max ready of each chunk's rows
    dur = prob.startup_s + prob.per_byte_s * np.add.reduceat(prob.row_nbytes[order], starts)
    tail = np.maximum.reduceat(prob.row_tail_s[order], starts)
    t = _iteration_s(ready, dur, tail, **prob.terms())

`_iteration_s` is exact (the same number `simulate` returns, up to float rounding): for one link it is
closed form over numpy arrays (about 20 us for 1,000 chunks); for several links it runs a heap loop.
The closed form rests on: iteration = max(backward_end + after_s, max_k(end_k + tail_k), floor_s
[, max_k end_k + after_s when overlap=False]), where tail_k = update + forward in the plain step and
max over the layers l the chunk touches of (update(l) + forward of layers l..L-1) in the pipelined step
(unrolling fwd_end(l) = max(fwd_end(l-1), reduced(l) + update(l)) + fwd(l)).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._tree import match_rows
from ._types import Event, GradientProfile, NetworkModel, Schedule, SimResult, itemsize

__all__ = ["simulate"]


class _Problem(NamedTuple):
  """Per-row constants of one (profile, network, mode), for `_iteration_s`.

  Attributes:
    row_ready_s: ready_s of each profile row.
    row_nbytes: nbytes of each row.
    row_tail_s: what a chunk holding the row adds after its end: update_s + forward_s in the plain
      step; update(l) + forward of layers l.. in the pipelined step (l the row's layer).
    row_layer: index of each row's layer in `profile.layers`.
    backward_s, after_s: backward time; what follows backward's end (update + forward in the plain
      step, forward in the pipelined step).
    floor_s: a constant lower limit from rows in no chunk (nbytes=0) in the pipelined step, else 0.
    startup_s, per_byte_s, links, overlap: the network's terms.
    skew: the network's skew when overlap is False, else 0; cycle_s: forward + backward + update.
  """

  row_ready_s: np.ndarray
  row_nbytes: np.ndarray
  row_tail_s: np.ndarray
  row_layer: np.ndarray
  backward_s: float
  after_s: float
  floor_s: float
  startup_s: float
  per_byte_s: float
  links: int
  overlap: bool
  cross_step: bool
  layer_fwd_s: np.ndarray
  layer_update_s: np.ndarray
  layers: tuple[str, ...] = ()
  skew: float = 0.0
  cycle_s: float = 0.0

  def terms(self) -> dict:
    """The keyword arguments of `_iteration_s` that come from the problem."""
    return dict(backward_s=self.backward_s, after_s=self.after_s, floor_s=self.floor_s, links=self.links,
                overlap=self.overlap, skew=self.skew, cycle_s=self.cycle_s)


def _problem(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> _Problem:
  """The per-row constants `_iteration_s` needs (see the module docstring)."""
  rows = profile.rows
  layers = profile.layers
  lidx = {name: i for i, name in enumerate(layers)}
  row_layer = np.fromiter((lidx[r.layer] for r in rows), dtype=np.int64, count=len(rows))
  row_ready = np.fromiter((r.ready_s for r in rows), dtype=np.float64, count=len(rows))
  row_nbytes = np.fromiter((r.nbytes for r in rows), dtype=np.float64, count=len(rows))
  fwd_map = profile.layer_fwd_s()
  layer_fwd = np.array([fwd_map[name] for name in layers], dtype=np.float64)
  layer_upd = np.zeros(len(layers))
  np.add.at(layer_upd, row_layer, np.fromiter((r.update_s for r in rows), dtype=np.float64,
                                              count=len(rows)))
  forward_s = float(layer_fwd.sum())
  update_s = float(layer_upd.sum())
  if cross_step:
    suffix_f = np.cumsum(layer_fwd[::-1])[::-1]          # forward of layers l..L-1
    layer_tail = layer_upd + suffix_f
    row_tail = layer_tail[row_layer]
    zero = row_nbytes == 0
    floor = float(np.max(row_ready[zero] + row_tail[zero])) if zero.any() else 0.0
    after = forward_s
  else:
    row_tail = np.full(len(rows), update_s + forward_s)
    floor = 0.0
    after = update_s + forward_s
  return _Problem(row_ready_s=row_ready, row_nbytes=row_nbytes, row_tail_s=row_tail,
                  row_layer=row_layer, backward_s=float(profile.backward_s), after_s=after,
                  floor_s=floor, startup_s=network.startup_s, per_byte_s=network.per_byte_s,
                  links=network.links, overlap=network.overlap, cross_step=bool(cross_step),
                  layer_fwd_s=layer_fwd, layer_update_s=layer_upd, layers=layers,
                  skew=0.0 if network.overlap else network.skew,
                  cycle_s=forward_s + float(profile.backward_s) + update_s)


def _sync_waits(ready: np.ndarray, skew: float, cycle_s: float, backward_s: float) -> np.ndarray:
  """Per chunk, in issue order, the wait for the slowest worker: skew x compute since the last issue."""
  q = np.maximum.accumulate(ready)
  prev = np.empty_like(q)
  prev[1:] = q[:-1]
  prev[0] = max(float(q[-1]), backward_s) - cycle_s
  return skew * (q - prev)


# --------------------------------------------------------------------------------------------------
# The link: start and end of every chunk.


def _link_loop(ready: Sequence[float], dur: Sequence[float], *, backward_s: float, links: int,
               overlap: bool) -> tuple[list[float], list[float], list[int], float,
                                        list[tuple[float, float]]]:
  """Event loop over the chunks in issue order.

  Returns:
    (start, end, link, backward_end, stalls): per-chunk start and end times and link index; when
    backward ends (wall clock); and the compute stalls of overlap=False as (progress_s, duration_s),
    in progress order (progress = backward compute done, in the profile's time).
  """
  n = len(ready)
  start = [0.0] * n
  end = [0.0] * n
  link = [0] * n
  free = [(0.0, j) for j in range(links)]  # a heap of (free time, link index)
  stalls: list[tuple[float, float]] = []
  if overlap:
    prev = 0.0
    for k in range(n):
      f, j = heapq.heappop(free)
      s = max(ready[k], prev, f)
      e = s + dur[k]
      start[k], end[k], link[k] = s, e, j
      heapq.heappush(free, (e, j))
      prev = s
    return start, end, link, float(backward_s), stalls
  # overlap=False: progress q advances only while no link is busy.
  q = 0.0            # backward progress at the last issue
  prev = 0.0         # wall time of the last issue
  reach = 0.0        # wall time at which progress reached q
  busy_until = 0.0   # the last end among chunks issued so far
  bw_end = None
  for k in range(n):
    r = ready[k]
    if r > q:
      resume = max(busy_until, prev)   # compute resumes once every link is idle
      if resume > reach:
        stalls.append((q, resume - reach))
      if bw_end is None and q < backward_s <= r:
        bw_end = resume + (backward_s - q)
      s = resume + (r - q)
      q, reach = r, s
      f, j = heapq.heappop(free)
    else:
      f, j = heapq.heappop(free)
      s = max(prev, f)
    e = s + dur[k]
    start[k], end[k], link[k] = s, e, j
    heapq.heappush(free, (e, j))
    prev = s
    busy_until = max(busy_until, e)
  if bw_end is None:
    if q < backward_s:
      resume = max(busy_until, prev)
      if resume > reach:
        stalls.append((q, resume - reach))
      bw_end = resume + (backward_s - q)
    else:  # backward_s <= 0 (or no progress needed)
      bw_end = float(backward_s)
  return start, end, link, float(bw_end), stalls


def _ends_one_link(ready: np.ndarray, dur: np.ndarray, backward_s: float,
                   overlap: bool) -> tuple[np.ndarray, float]:
  """Closed form of the one-link recurrences: (end of every chunk, backward end)."""
  c = np.cumsum(dur)
  if overlap:
    # end_k = max(ready_k, end_{k-1}) + d_k  <=>  end_k = C_k + max_{j<=k}(ready_j - C_{j-1})
    return c + np.maximum.accumulate(ready - (c - dur)), float(backward_s)
  # progress at issue q_k = max_{j<=k} ready_j; end_k = q_k + C_k; backward resumes after the chunks
  # issued before progress reached backward_s.
  q = np.maximum.accumulate(ready)
  m = int(np.searchsorted(q, backward_s, side="left"))  # chunks issued while q < backward_s
  return q + c, float(backward_s) + (float(c[m - 1]) if m > 0 else 0.0)


def _iteration_s(ready_s: np.ndarray, dur_s: np.ndarray, tail_s: np.ndarray | float, *,
                 backward_s: float, after_s: float, floor_s: float = 0.0, links: int = 1,
                 overlap: bool = True, skew: float = 0.0, cycle_s: float = 0.0) -> float:
  """The iteration time from per-chunk arrays in issue order (see the module docstring).

  Args:
    ready_s: ready time of each chunk (max ready_s of its rows), seconds.
    dur_s: all-reduce time of each chunk, seconds.
    tail_s: per chunk, what must follow its end (`_Problem.row_tail_s`, max over its rows); a scalar
      broadcasts.
    backward_s, after_s, floor_s, links, overlap, skew, cycle_s: from `_problem`.

  Returns:
    The iteration time in seconds, as `simulate` computes it.
  """
  ready = np.asarray(ready_s, dtype=np.float64)
  dur = np.asarray(dur_s, dtype=np.float64)
  if ready.size == 0:
    return max(float(backward_s) + float(after_s), float(floor_s))
  if skew and not overlap:
    dur = dur + _sync_waits(ready, skew, cycle_s, backward_s)
  if links == 1:
    end, bw_end = _ends_one_link(ready, dur, backward_s, overlap)
  else:
    _, e, _, bw_end, _ = _link_loop(ready.tolist(), dur.tolist(), backward_s=backward_s, links=links,
                                    overlap=overlap)
    end = np.asarray(e)
  t = max(bw_end + after_s, float(np.max(end + tail_s)), floor_s)
  if not overlap:
    t = max(t, float(end.max()) + after_s)
  return t


# --------------------------------------------------------------------------------------------------
# simulate


# A small memo of per-(profile, network, mode) constants and the profile's fingerprint, keyed by
# object identity (the values are frozen), so repeated simulations of one profile skip the per-row
# Python work. Entries hold the keyed objects themselves, so an id is never reused while cached.
_MEMO: dict[tuple[int, int, bool], tuple[GradientProfile, NetworkModel, _Problem, str]] = {}
_MEMO_SIZE = 16


def _memo_problem(profile: GradientProfile, network: NetworkModel,
                  cross_step: bool) -> tuple[_Problem, str]:
  key = (id(profile), id(network), cross_step)
  hit = _MEMO.get(key)
  if hit is not None and hit[0] is profile and hit[1] is network:
    return hit[2], hit[3]
  prob = _problem(profile, network, cross_step=cross_step)
  fp = profile.fingerprint()
  if len(_MEMO) >= _MEMO_SIZE:
    _MEMO.pop(next(iter(_MEMO)))
  _MEMO[key] = (profile, network, prob, fp)
  return prob, fp


def _check(schedule: Schedule, profile: GradientProfile, network: NetworkModel, cross_step: bool) -> None:
  if not isinstance(schedule, Schedule):
    raise TypeError(f"simulate(schedule=...) must be a Schedule, got {type(schedule).__name__}.")
  if not isinstance(profile, GradientProfile):
    raise TypeError(f"simulate(profile=...) must be a GradientProfile, got {type(profile).__name__}.")
  if not isinstance(network, NetworkModel):
    raise TypeError(f"simulate(network=...) must be a NetworkModel, got {type(network).__name__}.")
  if not isinstance(cross_step, (bool, np.bool_)):
    raise TypeError(f"simulate(cross_step={cross_step!r}) must be True or False (the step mode to "
                    f"simulate); 'auto' is only a planning option.")


def _chunk_arrays(schedule: Schedule, prob: _Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                 np.ndarray, np.ndarray]:
  """(ready, duration, tail, pair_chunk, pair_row) of the chunks of `schedule`, in issue order.

  pair_chunk[i], pair_row[i] name the chunk and row of the schedule's i-th slice.
  """
  sizes: dict[str, int] = {}
  rows: list[int] = []
  elems: list[int] = []
  counts: list[int] = []
  isz: list[int] = []
  for b in schedule.buckets:
    for c in b.chunks:
      s = sizes.get(c.dtype)
      if s is None:
        s = sizes[c.dtype] = itemsize(c.dtype)
      isz.append(s)
      counts.append(len(c.slices))
      for r, a, e in c.slices:
        rows.append(r)
        elems.append(e - a)
  n = len(counts)
  if n == 0:
    z = np.zeros(0)
    return z, z, z, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
  cnt = np.asarray(counts, dtype=np.int64)
  starts = np.zeros(n, dtype=np.int64)
  np.cumsum(cnt[:-1], out=starts[1:])
  pair_row = np.asarray(rows, dtype=np.int64)
  ready = np.maximum.reduceat(prob.row_ready_s[pair_row], starts)
  tail = np.maximum.reduceat(prob.row_tail_s[pair_row], starts)
  nbytes = np.add.reduceat(np.asarray(elems, dtype=np.float64), starts) * np.asarray(isz, dtype=np.float64)
  pair_chunk = np.repeat(np.arange(n, dtype=np.int64), cnt)
  return ready, prob.startup_s + prob.per_byte_s * nbytes, tail, pair_chunk, pair_row


def _union_length(start: np.ndarray, end: np.ndarray) -> float:
  """Total length of the union of intervals [start_k, end_k]."""
  if start.size == 0:
    return 0.0
  o = np.argsort(start, kind="stable")
  s, e = start[o], end[o]
  run_end = np.maximum.accumulate(e)
  # a new run begins where an interval starts after every earlier one has ended
  new = np.empty(s.size, dtype=bool)
  new[0] = True
  new[1:] = s[1:] > run_end[:-1]
  idx = np.flatnonzero(new)
  run_starts = s[idx]
  run_ends = run_end[np.r_[idx[1:] - 1, s.size - 1]]
  return float(np.sum(run_ends - run_starts))


def simulate(schedule: Schedule, profile: GradientProfile, network: NetworkModel, *,
             cross_step: bool = False, events: bool = True) -> SimResult:
  """Simulates one steady-state iteration of `profile` with the all-reduces of `schedule`.

  The semantics are DESIGN.md's "Simulator semantics"; the module docstring states them in full
  (chunk readiness, the link recurrence, `links > 1`, `overlap=False`, both step modes, and how
  `idle_s` is counted).

  Args:
    schedule: the plan; its rows must be the profile's rows (same paths, shapes, dtypes).
    profile: per-leaf readiness and the step's compute times, seconds.
    network: the all-reduce cost model (`allreduce_s`, `links`, `overlap`, `skew`).
    cross_step: False for the plain step (the next step starts after every chunk and the update);
      True for the pipelined step (each layer's forward of the next step waits only for its own
      reduction and update).
    events: build the timeline (`SimResult.events`); False skips it, for speed.

  Returns:
    A SimResult: iteration_s, compute_s (forward + backward + update), comm_s (sum of all-reduce
    durations), idle_s, network_busy (fraction of the iteration some link is busy), allreduces and
    events (per-layer 'backward' and 'forward' spans on lane 'device', 'allreduce' spans named
    'chunk<k>' on lane 'link<j>', 'update' spans: one on 'device' in the plain step, one per layer on
    lane 'update' in the pipelined step).

  Raises:
    TypeError: an argument of the wrong type (cross_step must be a bool here).
    ScheduleMismatchError: the schedule was planned for other rows than the profile's.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel, Schedule, Bucket, Chunk
    >>> p = GradientProfile.from_rows(
    ...     [dict(path="a/w", layer="a", shape=(250,), dtype="float32", nbytes=1000, ready_s=2.0,
    ...           fwd_s=1.0)], forward_s=1.0, backward_s=2.0)
    >>> net = NetworkModel(alpha_s=0.5, beta_s_per_byte=0.001, workers=2)  # a=1, b=0.001
    >>> s = Schedule(buckets=(Bucket(chunks=(Chunk(slices=((0, 0, 250),), dtype="float32"),)),),
    ...              rows=p.tree_rows())
    >>> simulate(s, p, net).iteration_s  # backward 2 + all-reduce (1 + 1) + forward 1
    5.0
  """
  _check(schedule, profile, network, cross_step)
  cross_step = bool(cross_step)
  prob, fingerprint = _memo_problem(profile, network, cross_step)
  if schedule.tree_fingerprint != fingerprint:
    match_rows(schedule, profile.tree_rows(), where="simulate()")
  ready, dur, tail, pair_chunk, pair_row = _chunk_arrays(schedule, prob)
  backward_s = prob.backward_s
  if prob.skew and ready.size:
    dur = dur + _sync_waits(ready, prob.skew, prob.cycle_s, backward_s)
  forward_s = float(prob.layer_fwd_s.sum())
  update_s = float(prob.layer_update_s.sum())
  n = ready.size
  if n:
    if network.links == 1 and not events:
      end, bw_end = _ends_one_link(ready, dur, backward_s, network.overlap)
      start = end - dur
      link = np.zeros(n, dtype=np.int64)
      stalls: list[tuple[float, float]] = []
    else:
      s_, e_, l_, bw_end, stalls = _link_loop(ready.tolist(), dur.tolist(), backward_s=backward_s,
                                              links=network.links, overlap=network.overlap)
      start, end, link = np.asarray(s_), np.asarray(e_), np.asarray(l_)
    last_end = float(end.max())
  else:
    start = end = np.zeros(0)
    link = np.zeros(0, dtype=np.int64)
    bw_end, last_end, stalls = backward_s, 0.0, []

  layers = prob.layers
  nl = len(layers)
  if cross_step:
    # reduced(l): the last end of a chunk touching layer l; rows in no chunk count at their ready_s.
    reduced = np.full(nl, -np.inf)
    zero = prob.row_nbytes == 0
    if zero.any():
      np.maximum.at(reduced, prob.row_layer[zero], prob.row_ready_s[zero])
    if n:
      np.maximum.at(reduced, prob.row_layer[pair_row], end[pair_chunk])
    t0 = bw_end if network.overlap else max(bw_end, last_end)
    fwd_start = np.empty(nl)
    t = t0
    for l in range(nl):
      s = t if reduced[l] == -np.inf else max(t, reduced[l] + prob.layer_update_s[l])
      fwd_start[l] = s
      t = s + prob.layer_fwd_s[l]
    iteration = t
    idle = iteration - forward_s - backward_s
  else:
    t0 = max(bw_end, last_end)
    fwd_start = t0 + update_s + np.concatenate([[0.0], np.cumsum(prob.layer_fwd_s)[:-1]])
    iteration = t0 + update_s + forward_s
    idle = iteration - forward_s - backward_s - update_s
  comm = float(dur.sum())
  busy = _union_length(start, end) if network.links > 1 else comm
  network_busy = busy / iteration if iteration > 0 else 0.0

  evs: tuple[Event, ...] = ()
  if events:
    evs = _events(profile, prob, layers, start, end, link, stalls, fwd_start, cross_step,
                  reduced if cross_step else None, t0, update_s)
  return SimResult(iteration_s=float(iteration), compute_s=forward_s + backward_s + update_s,
                   comm_s=comm, idle_s=max(float(idle), 0.0), network_busy=float(network_busy),
                   allreduces=int(n), events=evs, cross_step=cross_step)


def _event_factory():
  """A fast Event constructor: Event is a frozen slots dataclass whose __init__ only assigns its five
  fields, so setting the slots directly builds an equal object about 4x faster (the timeline of a
  1,000-chunk schedule has ~4,000 events). Falls back to the constructor if Event ever validates."""
  fields = ("kind", "name", "start_s", "end_s", "lane")
  if hasattr(Event, "__post_init__") or not all(hasattr(Event, f) for f in fields):
    return lambda kind, name, start_s, end_s, lane="device": Event(kind=kind, name=name, start_s=start_s,
                                                                  end_s=end_s, lane=lane)
  new = object.__new__
  setters = tuple(getattr(Event, f).__set__ for f in fields)
  sk, sn, ss, se, sl = setters

  def make(kind, name, start_s, end_s, lane="device"):
    e = new(Event)
    sk(e, kind)
    sn(e, name)
    ss(e, start_s)
    se(e, end_s)
    sl(e, lane)
    return e

  return make


_new_event = _event_factory()


def _events(profile: GradientProfile, prob: _Problem, layers: tuple[str, ...], start: np.ndarray,
            end: np.ndarray, link: np.ndarray, stalls: list[tuple[float, float]],
            fwd_start: np.ndarray, cross_step: bool, reduced: np.ndarray | None, t0: float,
            update_s: float) -> tuple[Event, ...]:
  ev = _new_event
  out: list[Event] = []
  # backward spans, in backward order: layer l runs from the previous layer's ready time to its own
  # (the last one runs to backward_s), in progress time, mapped to the wall clock around stalls.
  nl = len(layers)
  layer_ready = np.full(nl, 0.0)
  np.maximum.at(layer_ready, prob.row_layer, prob.row_ready_s)
  lr = layer_ready.tolist()
  order = sorted(range(nl), key=lambda l: (lr[l], -l))
  stall_q = [q for q, _ in stalls]
  stall_d = [d for _, d in stalls]
  stall_cum = [0.0]
  for d in stall_d:
    stall_cum.append(stall_cum[-1] + d)
  p0 = 0.0
  for i, l in enumerate(order):
    p1 = lr[l] if i < nl - 1 else max(lr[l], prob.backward_s)
    p1 = max(p1, p0)
    if not stalls:
      out.append(ev("backward", layers[l], p0, p1))
      p0 = p1
      continue
    # stalls at progress q with p0 <= q < p1 happen before (q == p0) or inside this span
    lo = bisect.bisect_left(stall_q, p0)
    hi = bisect.bisect_left(stall_q, p1)
    at_start = lo < hi and stall_q[lo] == p0
    seg_start = p0 + stall_cum[lo] + (stall_d[lo] if at_start else 0.0)
    cur_p = p0
    for j in range(lo + 1 if at_start else lo, hi):
      q = stall_q[j]
      out.append(ev("backward", layers[l], seg_start, seg_start + (q - cur_p)))
      seg_start += (q - cur_p) + stall_d[j]
      cur_p = q
    out.append(ev("backward", layers[l], seg_start, seg_start + (p1 - cur_p)))
    p0 = p1
  lanes = [f"link{j}" for j in range(int(link.max()) + 1)] if link.size else []
  for k, (a, b, j) in enumerate(zip(start.tolist(), end.tolist(), link.tolist())):
    out.append(ev("allreduce", f"chunk{k}", a, b, lanes[j]))
  if cross_step:
    upd = prob.layer_update_s.tolist()
    red = reduced.tolist() if reduced is not None else [-np.inf] * nl
    for l in range(nl):
      if upd[l] > 0 and red[l] != -np.inf:
        out.append(ev("update", layers[l], red[l], red[l] + upd[l], "update"))
  elif update_s > 0:
    out.append(ev("update", "update", t0, t0 + update_s))
  fs, ff = fwd_start.tolist(), prob.layer_fwd_s.tolist()
  for l in range(nl):
    out.append(ev("forward", layers[l], fs[l], fs[l] + ff[l]))
  return tuple(out)
