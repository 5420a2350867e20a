"""The numeric core under planning, the bound and simulation: a Problem's arrays, the link engine and the
closed-form iteration (pure numpy; docs/design.md, "The numeric core and what simulate reports").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._values._network import NetworkModel, typical_network
from .._values._tree import IdentityMemo
from .._values._types import GradientProfile, itemsize

Slice = tuple[int, int, int]  # (profile row, start element, stop element)


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
  """One (profile, network, step mode) as the arrays every estimator reads.

  Attributes:
    profile, network, cross_step: what it was built from; fingerprint: the profile's.
    row_ready_s, row_nbytes, row_tail_s, row_update_s: per row (float64): ready_s, bytes, what a chunk
      holding it adds after its end, update_s.
    row_layer, row_dtype_code: per row (int64): index into `layers`, index of its dtype.
    ready, tail, size, itemsize, dtype: per row, as Python tuples for the planners' loops.
    live: the rows with nbytes > 0.
    layers, layer_fwd_s, layer_update_s, layer_tail_s, layer_fwd_tail_s: per layer in priority order.
    backward_s, forward_s, update_s, cycle_s: backward, forward, update and their sum, seconds.
    after_s, floor_s: what follows backward's end; the floor from rows in no chunk, seconds.
    startup_s, per_byte_s, links, overlap, skew: the network's terms (skew 0 with overlap).
  """

  profile: GradientProfile
  network: NetworkModel
  cross_step: bool
  fingerprint: str
  row_ready_s: np.ndarray
  row_nbytes: np.ndarray
  row_tail_s: np.ndarray
  row_layer: np.ndarray
  row_dtype_code: np.ndarray
  ready: tuple[float, ...]
  tail: tuple[float, ...]
  size: tuple[int, ...]
  itemsize: tuple[int, ...]
  dtype: tuple[str, ...]
  live: tuple[int, ...]
  layers: tuple[str, ...]
  layer_fwd_s: np.ndarray
  layer_update_s: np.ndarray
  layer_tail_s: np.ndarray
  layer_fwd_tail_s: np.ndarray
  row_update_s: np.ndarray
  backward_s: float
  forward_s: float
  update_s: float
  cycle_s: float
  after_s: float
  floor_s: float
  startup_s: float
  per_byte_s: float
  links: int
  overlap: bool
  skew: float

  def durations(self, nbytes: np.ndarray | float) -> np.ndarray | float:
    """All-reduce seconds of chunks of `nbytes` bytes: a + b·nbytes."""
    return self.startup_s + self.per_byte_s * nbytes


def _build(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Problem:
  rows = profile.rows
  n = len(rows)
  layers = profile.layers
  lidx = {name: i for i, name in enumerate(layers)}
  row_layer = np.fromiter((lidx[r.layer] for r in rows), dtype=np.int64, count=n)
  row_ready = np.fromiter((r.ready_s for r in rows), dtype=np.float64, count=n)
  row_nbytes = np.fromiter((r.nbytes for r in rows), dtype=np.float64, count=n)
  dcode = {d: i for i, d in enumerate(dict.fromkeys(r.dtype for r in rows))}
  layer_fwd = np.array(list(profile.layer_fwd_s().values()), dtype=np.float64)   # in `layers`' order
  layer_upd = np.zeros(len(layers))
  row_upd = np.fromiter((r.update_s for r in rows), dtype=np.float64, count=n)
  np.add.at(layer_upd, row_layer, row_upd)
  forward_s = float(layer_fwd.sum())
  update_s = float(layer_upd.sum())
  layer_fwd_tail = np.cumsum(layer_fwd[::-1])[::-1]             # forward of layers l..L-1
  layer_tail = layer_upd + layer_fwd_tail                       # update(l) + forward of layers l..L-1
  if cross_step:
    row_tail = layer_tail[row_layer]
    zero = row_nbytes == 0
    floor = float(np.max(row_ready[zero] + row_tail[zero])) if zero.any() else 0.0
    after = forward_s
  else:
    row_tail = np.full(n, update_s + forward_s)
    floor = 0.0
    after = update_s + forward_s
  backward_s = float(profile.backward_s)
  return Problem(
      profile=profile, network=network, cross_step=bool(cross_step), fingerprint=profile.fingerprint(),
      row_ready_s=row_ready, row_nbytes=row_nbytes, row_tail_s=row_tail, row_layer=row_layer,
      row_dtype_code=np.fromiter((dcode[r.dtype] for r in rows), dtype=np.int64, count=n),
      ready=tuple(r.ready_s for r in rows), tail=tuple(row_tail.tolist()),
      size=tuple(math.prod(r.shape) for r in rows), itemsize=tuple(itemsize(r.dtype) for r in rows),
      dtype=tuple(r.dtype for r in rows), live=tuple(i for i, r in enumerate(rows) if r.nbytes > 0),
      layers=layers, layer_fwd_s=layer_fwd, layer_update_s=layer_upd, layer_tail_s=layer_tail,
      layer_fwd_tail_s=layer_fwd_tail, row_update_s=row_upd,
      backward_s=backward_s, forward_s=forward_s, update_s=update_s,
      cycle_s=forward_s + backward_s + update_s, after_s=after, floor_s=floor,
      startup_s=network.startup_s, per_byte_s=network.per_byte_s, links=network.links,
      overlap=network.overlap, skew=0.0 if network.overlap else network.skew)


# The repeated simulations and estimates of one profile skip the per-row Python work (the one memo
# policy, `_tree.IdentityMemo`: the values are frozen).
_build_memo = IdentityMemo(16)(_build)


def problem(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Problem:
  """The Problem of (profile, network, cross_step), from a small identity-keyed memo."""
  return _build_memo(profile, network, bool(cross_step))


# --------------------------------------------------------------------------------------------------
# Chunks as arrays


class ChunkArrays(NamedTuple):
  """Per chunk in issue order: readiness, bytes, tail; per slice, its chunk and row."""

  ready_s: np.ndarray
  nbytes: np.ndarray
  tail_s: np.ndarray
  pair_chunk: np.ndarray
  pair_row: np.ndarray


def chunk_arrays(prob: Problem, chunks: Iterable[Sequence[Slice]]) -> ChunkArrays:
  """The ChunkArrays of chunks given as (row, start, stop) slices, in issue order."""
  chunks = list(chunks)
  counts = [len(c) for c in chunks]
  rows = [r for c in chunks for r, _, _ in c]
  elems = [e - a for c in chunks for _, a, e in c]
  n = len(counts)
  if n == 0:
    z = np.zeros(0)
    return ChunkArrays(z, z, z, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
  cnt = np.asarray(counts, dtype=np.int64)
  starts = np.zeros(n, dtype=np.int64)
  np.cumsum(cnt[:-1], out=starts[1:])
  pair_row = np.asarray(rows, dtype=np.int64)
  isz = np.asarray(prob.itemsize, dtype=np.float64)[pair_row[starts]]
  return ChunkArrays(ready_s=np.maximum.reduceat(prob.row_ready_s[pair_row], starts),
                     nbytes=np.add.reduceat(np.asarray(elems, dtype=np.float64), starts) * isz,
                     tail_s=np.maximum.reduceat(prob.row_tail_s[pair_row], starts),
                     pair_chunk=np.repeat(np.arange(n, dtype=np.int64), cnt), pair_row=pair_row)


def schedule_arrays(prob: Problem, buckets: Iterable[Any]) -> ChunkArrays:
  """The ChunkArrays of the messages a schedule's buckets issue per step (a deferral group's slots: each
  holding every row of the group, `slot_size` elements); `chunk_arrays` when nothing defers.
  """
  buckets = tuple(buckets)
  if not any(b.defer for b in buckets):
    return chunk_arrays(prob, (c.slices for b in buckets for c in b.chunks))
  entries: list[Sequence[Slice]] = []
  slot_bytes: list[float] = []
  for b in buckets:
    if not b.defer:
      entries.extend(c.slices for c in b.chunks)
      slot_bytes.extend([math.nan] * len(b.chunks))
      continue
    group = tuple(x for c in b.chunks for x in c.slices)
    nbytes = float(b.slot_size * prob.itemsize[group[0][0]])
    entries.extend([group] * b.slots)
    slot_bytes.extend([nbytes] * b.slots)
  arrays = chunk_arrays(prob, entries)
  over = np.asarray(slot_bytes)
  return arrays._replace(nbytes=np.where(np.isnan(over), arrays.nbytes, over))


def part_count(size: int, itemsize: int, max_bytes: float | None) -> int:
  """How many parts `equal_parts(size, itemsize, max_bytes)` makes, without making them."""
  if size == 0:
    return 0
  if max_bytes is None:
    return 1
  return -(-size // max(1, int(max_bytes) // max(itemsize, 1)))   # parts of `per` elements, the last short


def equal_parts(size: int, itemsize: int, max_bytes: float | None) -> list[tuple[int, int]]:
  """`size` elements of `itemsize` bytes cut into consecutive [start, stop) ranges of at most `max_bytes`
  bytes (None: one part), sizes within one element of each other, at least one element each.
  """
  parts = part_count(size, itemsize, max_bytes)
  return equal_ranges(size, parts) if parts else []


def equal_ranges(size: int, parts: int) -> list[tuple[int, int]]:
  """`size` cut into `parts` consecutive [start, stop) ranges whose sizes differ by at most one, the
  larger first."""
  base, extra = divmod(size, parts)
  bounds = [k * base + min(k, extra) for k in range(parts + 1)]
  return list(zip(bounds[:-1], bounds[1:]))


def split_by_dtype(dtype_of: Callable[[int], str], slices: Iterable[Slice]) -> list[list[Slice]]:
  """A group's slices as one chunk per dtype, in order of each dtype's first slice, empty slices dropped."""
  by_dtype: dict[str, list[Slice]] = {}
  for r, a, b in slices:
    if b > a:
      by_dtype.setdefault(dtype_of(r), []).append((r, a, b))
  return list(by_dtype.values())


# --------------------------------------------------------------------------------------------------
# The link engine


def link_end(t: float, ready_s: float, nbytes: float, a: float, b: float) -> float:
  """The one-link recurrence for one chunk: max(t, ready_s) + a + b·nbytes, `t` the previous chunk's end."""
  return (t if t > ready_s else ready_s) + a + b * nbytes


def sync_waits(ready: np.ndarray, skew: float, cycle_s: float, backward_s: float) -> np.ndarray:
  """Per chunk, in issue order, the wait for the slowest worker: skew x compute since the last issue."""
  q = np.maximum.accumulate(ready)
  prev = np.empty_like(q)
  prev[1:] = q[:-1]
  prev[0] = max(float(q[-1]), backward_s) - cycle_s
  return skew * (q - prev)


def link_loop(ready: Sequence[float], dur: Sequence[float], *, backward_s: float, links: int,
              overlap: bool) -> tuple[list[float], list[float], list[int], float,
                                       list[tuple[float, float]]]:
  """Event loop over the chunks in issue order.

  Returns:
    (start, end, link, backward_end, stalls): per chunk its times and link; backward's end; the compute
    stalls of overlap=False as (progress_s, duration_s).
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
    f, j = heapq.heappop(free)
    if r > q:
      resume = max(busy_until, prev)   # compute resumes once every link is idle
      if resume > reach:
        stalls.append((q, resume - reach))
      if bw_end is None and q < backward_s <= r:
        bw_end = resume + (backward_s - q)
      s = resume + (r - q)
      q, reach = r, s
    else:
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


def ends_one_link(ready: np.ndarray, dur: np.ndarray, backward_s: float,
                  overlap: bool) -> tuple[np.ndarray, Any]:
  """Closed form of the one-link recurrence: (every chunk's end, backward's end); `dur` [messages] or
  [samples, messages].
  """
  c = np.cumsum(dur, axis=-1)
  samples = () if dur.ndim == 1 else dur.shape[:1]
  if overlap:
    # end_k = max(ready_k, end_{k-1}) + d_k  <=>  end_k = C_k + max_{j<=k}(ready_j - C_{j-1})
    end = c + np.maximum.accumulate(ready - (c - dur), axis=-1)
    return end, float(backward_s) if not samples else np.full(samples, float(backward_s))
  # progress at issue q_k = max_{j<=k} ready_j; end_k = q_k + C_k; backward resumes after the chunks
  # issued before progress reached backward_s.
  q = np.maximum.accumulate(ready)
  m = int(np.searchsorted(q, backward_s, side="left"))  # chunks issued while q < backward_s
  if not samples:
    return q + c, float(backward_s) + (float(c[m - 1]) if m > 0 else 0.0)
  return q + c, float(backward_s) + (c[:, m - 1] if m > 0 else np.zeros(samples))


def iteration_s(prob: Problem, ready_s: np.ndarray, dur_s: np.ndarray,
                tail_s: np.ndarray | float) -> float:
  """The iteration time, seconds, from per-chunk arrays in issue order (the closed form): `iterations` of
  one sample. `tail_s` is per chunk what must follow its end, seconds (a scalar broadcasts).
  """
  return float(iterations(prob, ready_s, np.asarray(dur_s, dtype=np.float64)[None, :], tail_s)[0][0])


# --------------------------------------------------------------------------------------------------
# Network pressure: seeded samples of message durations, and the iteration of every sample


def background_flows(pressure: Any) -> np.ndarray:
  """The competing flows n_s of every sample of `pressure` (stream (seed, 0)), independent of the schedule."""
  if pressure.background_flows > 0:
    return np.random.default_rng([pressure.seed, 0]).poisson(pressure.background_flows, pressure.samples)
  return np.zeros(pressure.samples, dtype=np.int64)


def typical_costs(prob: Problem) -> tuple[float, float]:
  """(a', b'): a typical message's costs under the pressure (`typical_network`); calm: (a, b)."""
  net = typical_network(prob.network)
  return net.startup_s, net.per_byte_s


def search_problem(prob: Problem) -> Problem:
  """The calm Problem a planner searches on: `prob` itself when calm, else the same on `typical_network`."""
  return problem(prob.profile, typical_network(prob.network), cross_step=prob.cross_step) if pressured(prob) else prob


def pressured(prob: Problem) -> bool:
  """True when `prob`'s network carries a pressure that changes any message's time."""
  q = prob.network.pressure
  return q is not None and not q.calm


def objective_s(prob: Problem, ready_s: np.ndarray, nbytes: np.ndarray, tail_s: np.ndarray | float) -> float:
  """The iteration every planner minimises: `iteration_s` when calm, else the mean over the seeded
  samples (what `simulate` returns).
  """
  nb = np.asarray(nbytes, dtype=np.float64)
  dur = pressure_durations(prob, nb) if pressured(prob) else prob.durations(nb)[None, :]
  return float(iterations(prob, ready_s, dur, tail_s)[0].mean())


def pressure_durations(prob: Problem, nbytes: np.ndarray, *, half: bool = False) -> np.ndarray:
  """Every sample's message durations under the pressure, [samples, messages], without skew; `half`: the
  messages are a sharded schedule's reduce-scatters and all-gathers.
  """
  scale = 0.5 if half else 1.0
  return sampled_durations(prob.network.pressure, scale * prob.startup_s, scale * prob.per_byte_s, nbytes,
                           (1 if half else 2) * (prob.network.workers - 1))


def sampled_durations(q: Any, a: Any, b: Any, nbytes: np.ndarray, steps: Any) -> np.ndarray:
  """`pressure_durations` of messages with their own costs: `a`, `b` and ring `steps` scalars or one per
  message.
  """
  nb = np.asarray(nbytes, dtype=np.float64)
  n = nb.size
  flows = background_flows(q)
  dur = np.asarray(a, dtype=np.float64) + np.asarray(b, dtype=np.float64) * nb[None, :] * (
      1.0 + flows.astype(np.float64))[:, None]
  dur = np.broadcast_to(dur, (q.samples, n)).copy()
  steps = np.asarray(steps, dtype=np.int64)
  if q.tail_prob > 0 and q.tail_scale_s > 0 and steps.max(initial=0) > 0 and n:
    rng = np.random.default_rng([q.seed, 1])
    hits = rng.binomial(np.broadcast_to(steps, (q.samples, n)), q.tail_prob)
    total = int(hits.sum())
    if total:
      delays = q.tail_scale_s * (rng.pareto(q.tail_shape, total) + 1.0)
      where = np.repeat(np.arange(q.samples * n), hits.ravel())
      dur = dur + np.bincount(where, weights=delays, minlength=q.samples * n).reshape(q.samples, n)
  return dur


def iterations(prob: Problem, ready_s: np.ndarray, dur_s: np.ndarray,
               tail_s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`iteration_s` for every row of `dur_s` [samples, messages] at once: (iterations, durations with the
  skew waits, starts).
  """
  ready = np.asarray(ready_s, dtype=np.float64)
  dur = np.asarray(dur_s, dtype=np.float64)
  backward_s, after_s, floor_s = prob.backward_s, prob.after_s, prob.floor_s
  samples = dur.shape[0]
  if ready.size == 0:
    return np.full(samples, max(float(backward_s) + float(after_s), float(floor_s))), dur, dur
  if prob.skew and not prob.overlap:
    dur = dur + sync_waits(ready, prob.skew, prob.cycle_s, backward_s)[None, :]
  if prob.links == 1:
    end, bw_end = ends_one_link(ready, dur, backward_s, prob.overlap)
  else:
    start, end = np.empty_like(dur), np.empty_like(dur)
    bw_end = np.empty(samples)
    rl = ready.tolist()
    for i in range(samples):
      st, e, _, bw, _ = link_loop(rl, dur[i].tolist(), backward_s=backward_s, links=prob.links,
                                  overlap=prob.overlap)
      start[i], end[i], bw_end[i] = st, e, bw
  tail = np.broadcast_to(np.asarray(tail_s, dtype=np.float64), ready.shape)
  t = np.maximum(np.maximum(bw_end + after_s, np.max(end + tail[None, :], axis=1)), floor_s)
  if not prob.overlap:
    t = np.maximum(t, end.max(axis=1) + after_s)
  return t, dur, (end - dur if prob.links == 1 else start)
