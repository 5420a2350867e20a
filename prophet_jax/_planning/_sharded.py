"""The numeric core of sharded (ZeRO-1, `dear`) schedules: reduce-scatters, the shard update and
all-gathers on one link (pure numpy; the model: docs/design.md, "Simulator semantics").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._core import Problem, ends_one_link, sync_waits

Slice = tuple[int, int, int]


class ShardedArrays(NamedTuple):
  """A sharded schedule as arrays: K reduce-scatters and G all-gathers, each in issue order.

  Attributes:
    rs_ready_s, rs_nbytes, rs_update_s: per reduce-scatter: readiness, padded bytes, shard update (/P).
    ag_nbytes, ag_update_s: per all-gather: padded result bytes, its chunks' shard update.
    members, member_start: every gather's chunk indices, concatenated, and where each gather begins.
    need: per layer, the last all-gather holding an element of it (-1: none).
    gathered_pairs: unique (gather, layer) pairs.
    layer_floor_s: per layer, the latest ready_s of its rows with nbytes=0 (-inf: none).
  """

  rs_ready_s: np.ndarray
  rs_nbytes: np.ndarray
  rs_update_s: np.ndarray
  ag_nbytes: np.ndarray
  ag_update_s: np.ndarray
  members: np.ndarray
  member_start: np.ndarray
  need: np.ndarray
  gathered_pairs: tuple[np.ndarray, np.ndarray]
  layer_floor_s: np.ndarray


class ShardedRun(NamedTuple):
  """The timeline of `sharded_run`, one row per sample: iteration, the collectives' starts and ends,
  backward's end, T0, each all-gather's release, each layer's forward start.
  """

  iteration_s: np.ndarray
  rs_start: np.ndarray
  rs_end: np.ndarray
  ag_start: np.ndarray
  ag_end: np.ndarray
  backward_end: np.ndarray
  t0: np.ndarray
  release: np.ndarray
  fwd_start: np.ndarray


ChunkArrays = tuple[np.ndarray, np.ndarray, np.ndarray, list[set[int]]]


def sharded_arrays(prob: Problem, chunks: Sequence[Sequence[Slice]], gathers: Sequence[Sequence[int]], *,
                   per_chunk: ChunkArrays | None = None) -> ShardedArrays:
  """The ShardedArrays of reduce-scatter chunks (slices) and gathers (chunk indices) for P =
  network.workers; `per_chunk` reuses the caller's `chunk_arrays`.
  """
  rs_ready, rs_nbytes, rs_update, layers_of = chunk_arrays(prob, chunks) if per_chunk is None else per_chunk
  g_n = len(gathers)
  members = np.fromiter((k for g in gathers for k in g), dtype=np.int64)
  counts = np.fromiter((len(g) for g in gathers), dtype=np.int64, count=g_n)
  member_start = np.zeros(g_n, dtype=np.int64)
  if g_n:
    np.cumsum(counts[:-1], out=member_start[1:])
  ag_nbytes = np.add.reduceat(rs_nbytes[members], member_start) if g_n else np.zeros(0)
  ag_update = np.add.reduceat(rs_update[members], member_start) if g_n else np.zeros(0)
  nl = len(prob.layers)
  need = np.full(nl, -1, dtype=np.int64)
  pg, pl = [], []
  for g, ks in enumerate(gathers):       # g ascending: the last gather holding a layer writes its `need`
    ls = set().union(*(layers_of[k] for k in ks))
    pg += [g] * len(ls)
    pl += ls
    need[list(ls)] = g
  floor = np.full(nl, -np.inf)
  zero = prob.row_nbytes == 0
  np.maximum.at(floor, prob.row_layer[zero], prob.row_ready_s[zero])
  return ShardedArrays(rs_ready_s=rs_ready, rs_nbytes=rs_nbytes, rs_update_s=rs_update,
                       ag_nbytes=ag_nbytes, ag_update_s=ag_update, members=members,
                       member_start=member_start, need=need,
                       gathered_pairs=(np.asarray(pg, dtype=np.int64), np.asarray(pl, dtype=np.int64)),
                       layer_floor_s=floor)


def chunk_arrays(prob: Problem, chunks: Sequence[Sequence[Slice]]) -> ChunkArrays:
  """Per reduce-scatter chunk: its ready time, padded bytes, update share (per worker) and layers."""
  workers = prob.network.workers
  k_n = len(chunks)
  rs_ready = np.empty(k_n)
  rs_nbytes = np.empty(k_n)
  rs_update = np.empty(k_n)
  layers_of: list[set[int]] = []
  ready, size, isz = prob.ready, prob.size, prob.itemsize      # Python values: no numpy scalars per slice
  upd, layer = prob.row_update_s.tolist(), prob.row_layer.tolist()
  for k, c in enumerate(chunks):
    rs_ready[k] = max(ready[r] for r, _, _ in c)
    rs_nbytes[k] = workers * -(-sum(b - a for _, a, b in c) // workers) * isz[c[0][0]]   # padded
    rs_update[k] = sum(upd[r] * (b - a) / size[r] for r, a, b in c) / workers
    layers_of.append({layer[r] for r, _, _ in c})
  return rs_ready, rs_nbytes, rs_update, layers_of


def sharded_durations(prob: Problem, arr: ShardedArrays) -> tuple[np.ndarray, np.ndarray]:
  """The calm durations (one sample): reduce-scatters [1, K] and all-gathers [1, G], a/2 + b/2·bytes."""
  a, b = 0.5 * prob.startup_s, 0.5 * prob.per_byte_s
  return (a + b * arr.rs_nbytes)[None, :], (a + b * arr.ag_nbytes)[None, :]


def sharded_run(prob: Problem, arr: ShardedArrays, rs_dur: np.ndarray, ag_dur: np.ndarray) -> ShardedRun:
  """The timeline of every sample at once.

  Args:
    prob: the problem.
    arr: the schedule's arrays.
    rs_dur: [S, K] reduce-scatter durations without the skew waits (added here).
    ag_dur: [S, G] all-gather durations.
  """
  rs_dur = np.asarray(rs_dur, dtype=np.float64)
  ag_dur = np.asarray(ag_dur, dtype=np.float64)
  samples = rs_dur.shape[0]
  g_n = ag_dur.shape[1]
  overlap = prob.overlap
  backward_s = prob.backward_s
  if prob.skew and not overlap and rs_dur.shape[1]:
    rs_dur = rs_dur + sync_waits(arr.rs_ready_s, prob.skew, prob.cycle_s, backward_s)[None, :]
  if rs_dur.shape[1]:
    rs_end, bw_end = ends_one_link(arr.rs_ready_s, rs_dur, backward_s, overlap)
    bw_end = np.broadcast_to(np.asarray(bw_end, dtype=np.float64), (samples,)).copy()
    t_rs = rs_end.max(axis=1)
  else:
    rs_end = np.zeros((samples, 0))
    bw_end = np.full(samples, float(backward_s))
    t_rs = np.full(samples, -np.inf)
  rs_start = rs_end - rs_dur
  ag_start = np.empty((samples, g_n))
  ag_end = np.empty((samples, g_n))
  release = np.empty((samples, g_n))
  nl = len(prob.layers)
  fwd = prob.layer_fwd_s
  if not prob.cross_step:
    t0 = np.maximum(bw_end, t_rs)
    cum = np.cumsum(arr.ag_update_s)
    release[:] = t0[:, None] + cum[None, :]
    u_total = float(cum[-1]) if g_n else 0.0
    if overlap:
      t = _gathers(t_rs, range(g_n), release, ag_dur, ag_start, ag_end)
      start_fwd = np.maximum(t0 + u_total, t if g_n else t0)   # the last all-gather's end
    else:
      t = t0.copy()
      for g in range(g_n):
        s = t + arr.ag_update_s[g]
        ag_start[:, g] = s
        t = s + ag_dur[:, g]
        ag_end[:, g] = t
      start_fwd = t if g_n else t0 + u_total
    offs = np.concatenate([[0.0], np.cumsum(fwd)[:-1]]) if nl else np.zeros(0)
    fwd_start = start_fwd[:, None] + offs[None, :]
    iteration = start_fwd + prob.forward_s
    return ShardedRun(iteration, rs_start, rs_end, ag_start, ag_end, bw_end, t0, release, fwd_start)
  # pipelined step: all-gather g released after its chunks' reduce-scatters and its shards' update
  if g_n:
    release[:] = np.maximum.reduceat(rs_end[:, arr.members], arr.member_start, axis=1) + arr.ag_update_s[None, :]
  fwd_start = np.empty((samples, nl))
  floor = arr.layer_floor_s
  if overlap:
    _gathers(t_rs, range(g_n), release, ag_dur, ag_start, ag_end)
    gathered = np.broadcast_to(floor[None, :], (samples, nl)).copy()
    pg, pl = arr.gathered_pairs
    if pg.size:
      np.maximum.at(gathered.T, pl, ag_end.T[pg])
    t0 = bw_end.copy()
    t = t0.copy()
    for l in range(nl):
      s = np.maximum(t, gathered[:, l])
      fwd_start[:, l] = s
      t = s + fwd[l]
    iteration = t
  else:
    t0 = np.maximum(bw_end, t_rs)
    t = t0.copy()
    j = 0
    for l in range(nl):
      t = _gathers(t, range(j, arr.need[l] + 1), release, ag_dur, ag_start, ag_end)
      j = max(j, arr.need[l] + 1)
      s = np.maximum(t, floor[l])
      fwd_start[:, l] = s
      t = s + fwd[l]
    iteration = _gathers(t, range(j, g_n), release, ag_dur, ag_start, ag_end)
  return ShardedRun(iteration, rs_start, rs_end, ag_start, ag_end, bw_end, t0, release, fwd_start)


def _gathers(t: np.ndarray, gs: range, release: np.ndarray, ag_dur: np.ndarray, ag_start: np.ndarray,
             ag_end: np.ndarray) -> np.ndarray:
  """All-gathers `gs` in turn on the link free at `t`, per sample (the one-link recurrence); returns when the
  link is free again.
  """
  for g in gs:
    s = np.maximum(t, release[:, g])
    ag_start[:, g] = s
    t = s + ag_dur[:, g]
    ag_end[:, g] = t
  return t


def sharded_iteration_s(prob: Problem, arr: ShardedArrays) -> float:
  """The calm iteration time of a sharded schedule (what `simulate` returns on a calm network)."""
  return float(sharded_run(prob, arr, *sharded_durations(prob, arr)).iteration_s[0])
