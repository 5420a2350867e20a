"""The `fsdp` policy: FSDP (ZeRO-3) and HSDP as a plan. Parameters stay sharded over the data axis;
forward all-gathers them bucket by bucket, a planned number of buckets ahead; backward keeps or gathers
them again under a memory budget and reduce-scatters the gradients in ready order; replicated leaves
are all-reduced.

Pure: numpy only, never jax.

What is planned (the model is `_planning/_fsdp.py`'s; docs/fsdp.md says it for users):

1. Units (FSDP buckets): contiguous runs of layers in forward order, each the sharded leaves of those
   layers of one dtype, whole (each device's slice of a bucket is its shard of every leaf in turn, so
   a reduce-scatter's output is exactly each leaf's shard). Candidates: one unit per leaf (the least
   memory), one per layer (FSDP2's per-module default), runs of layers closed once they reach a cap
   (2^k MiB, 1 to 2,048), ramps (small at both ends), and tapers (`_taper`: 4 to 32 units filled from
   the back, equal or growing towards the front; over many devices, where each start-up is costly,
   they come closest to the bound B_fsdp).
2. Forward prefetch depth d in {1, 2, 3, 4} (unit u's all-gather issued when unit u-d's forward
   starts) and, where backward gathers again, backward prefetch depth in {1, 2}.
3. Keep or gather again, per unit, under the budget: the last k units in forward order (the first
   backward needs) keep their parameters from forward; the others are freed after their forward and
   gathered again in backward. k is the largest whose peak fits the budget (the peak grows with k;
   found by bisection); without a budget every unit keeps (no re-gather: the least communication).
4. Replicated leaves: all-reduced over the whole mesh in chunks of one dtype, one per unit window of
   backward (the replicated rows that become ready during a unit's backward, issued after its
   reduce-scatter), or all in one chunk per dtype at the end of backward (both are candidates: over
   many devices one all-reduce's start-up, 2(P-1)·alpha, can outweigh a norm's bytes); on one link they
   share it with the units' collectives first-in first-out in issue order; on an HSDP mesh they go on
   the outer link (link 1) beside the shards' replica all-reduces.

Every candidate is scored by the simulator's engine (`_fsdp.fsdp_run`): the fastest whose peak fits
the budget wins (ties: the smaller peak).

References:
  S. Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion parameter models", SC
  2020 (stage 3). Y. Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
  VLDB 2023 (prefetch, reshard-after-forward, HSDP).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._planning._core import Problem, problem
from .._planning._fsdp import FsdpArrays, backward_order, fsdp_arrays, fsdp_run
from .._values._checks import check_bytes
from .._values._network import NetworkModel
from .._values._schedule import Bucket, Chunk, Schedule
from .._values._sharding import FsdpPlan
from .._values._types import GradientProfile, is_int
from ._base import Scheduler, Slice
from ._common import check_inputs

_POLICY = "fsdp"
_CAPS_MIB = (1, 4, 16, 64, 256, 1024, 2048)
_RAMP_MIB = ((8, 256), (8, 1024), (32, 1024))   # ramps (first, last): unit k closes at first·2^k, capped
# tapers (units, growth): about `units` units filled from the back, unit k from the back closing at
# lo·(1 + growth·k), lo such that they hold the dtype's bytes
_TAPERS = tuple((n, g) for n in (4, 8, 16, 32) for g in (0.0, 1.0))
_PREFETCH = (1, 2, 3, 4)
_DEEPER = 3                  # unit sets (the fastest at depth 1) tried at deeper prefetch


def fsdp(*, memory_budget_bytes: int | None = None, bucket_bytes: int | None = None,
         prefetch: int | None = None) -> Scheduler:
  """FSDP / HSDP: forward all-gathers with planned prefetch, re-gather or keep under a memory budget,
  reduce-scatters in backward, replicated leaves all-reduced.

  The profile must carry its placement (`GradientProfile.from_params(..., shardings=, mesh=)`): the
  sharded rows become FSDP buckets, the rest all-reduces; a mesh with replica axes (axes the leaves
  are not split over) is HSDP: the shards are then all-reduced over the replica axes on the network's
  outer link (`NetworkModel` two levels). `network.workers` must be the mesh's device count.

  Args:
    memory_budget_bytes: per device, the most bytes of gathered (whole) parameters and unsharded
      gradient buffers alive at once (docs/fsdp.md; `SimResult.peak_memory_bytes` is the same count).
      None: the fastest plan without a cap.
    bucket_bytes: None: units planned (module docstring); an integer: runs of layers closed once they
      reach it (FSDP's fixed wrapping), only prefetch and keep planned.
    prefetch: None: planned; an integer >= 1: that forward prefetch depth only.

  Returns:
    A Scheduler; its Schedules have `fsdp` set and options recording the arguments, `candidate` and
    `peak_memory_bytes`.

  Raises:
    TypeError, ValueError: bad arguments (named). The scheduler: ValueError for a profile without
      sharded rows, a mesh whose size is not `network.workers`, `network.links > 1`, or a budget below
      what the largest leaf needs (its parameters gathered and its gradient, both whole during its
      backward: twice its bytes; the leaf is named), or no plan within the budget.

  Examples:
    >>> import numpy as np, prophet_jax as pj
    >>> params = {f"l{i}": {"w": np.zeros((64, 64), np.float32)} for i in range(4)}
    >>> prof = pj.GradientProfile.from_params(params, forward_s=0.004, backward_s=0.008, mesh={"data": 8},
    ...     shardings={f"l{i}": {"w": ("data", None)} for i in range(4)})
    >>> s = pj.plan(prof, pj.NetworkModel.preset("100gb-ib", workers=8), "fsdp", memory_budget_bytes=2**16)
    >>> s.fsdp is not None, pj.simulate(s, prof, pj.NetworkModel.preset("100gb-ib", workers=8)).peak_memory_bytes <= 2**16
    (True, True)
  """
  budget = check_bytes("fsdp", "memory_budget_bytes", memory_budget_bytes,
                       hint="e.g. 8 * 2**30 for 8 GiB of gathered parameters and gradient buffers.")
  bucket = check_bytes("fsdp", "bucket_bytes", bucket_bytes, hint="e.g. 64 * 2**20.")
  if prefetch is not None and (not is_int(prefetch) or prefetch < 1):
    raise ValueError(f"fsdp(prefetch={prefetch!r}): a prefetch depth is an integer >= 1 (or None: planned).")
  options = {"memory_budget_bytes": budget, "bucket_bytes": bucket, "prefetch": prefetch}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(_POLICY, profile, network, cross_step)
    prob = problem(profile, network, cross_step=cross)
    best = plan_fsdp(prob, budget, bucket, prefetch)
    return fsdp_schedule(profile, best, options=dict(options, candidate=best.label,
                                                     peak_memory_bytes=int(round(best.peak))),
                         cross_step=cross, budget=budget)

  scheduler.__name__ = _POLICY
  scheduler.__qualname__ = _POLICY
  return scheduler


class Plan:
  """One FSDP candidate: chunks (issue order), units (chunk indices, forward order), keep, depths, and
  its simulated iteration and peak."""

  __slots__ = ("label", "chunks", "units", "keep", "prefetch", "backward_prefetch", "iteration", "peak")

  def __init__(self, label, chunks, units, keep, prefetch, backward_prefetch, iteration, peak):
    self.label, self.chunks, self.units, self.keep = label, chunks, units, keep
    self.prefetch, self.backward_prefetch, self.iteration, self.peak = prefetch, backward_prefetch, iteration, peak


def check_fsdp_inputs(prob: Problem) -> tuple[int, int]:
  """(shards, replicas) of the profile's mesh, checked against the network.

  Raises:
    ValueError: no sharded rows; a mesh of another size than network.workers; several links.
  """
  profile, network = prob.profile, prob.network
  if not profile.sharded:
    raise ValueError("fsdp: the profile has no sharded rows; FSDP plans parameters sharded over the data "
                     "axis. Build the profile with GradientProfile.from_params(params, shardings=..., "
                     "mesh=...) (or profile_step(mesh=...)), or use an all-reduce policy.")
  s, r = profile.shard_count, profile.replica_count
  if s * r != network.workers:
    raise ValueError(f"fsdp: the profile's mesh {dict(profile.mesh)} has {s * r} devices, but network.workers"
                     f"={network.workers}; use network.with_workers({s * r}).")
  if network.links != 1:
    raise ValueError(f"fsdp: an FSDP schedule runs its collectives in one issue order per link level, but "
                     f"network.links={network.links}; use network.replace(links=1).")
  return s, r


def plan_fsdp(prob: Problem, budget: int | None, bucket: int | None = None, prefetch: int | None = None) -> Plan:
  """The best FSDP candidate for `prob` under `budget` (module docstring)."""
  s, r = check_fsdp_inputs(prob)
  rows = prob.profile.rows
  rows_ = _Rows(prob)
  sharded = [i for i in prob.live if rows[i].shard_dim is not None]
  if budget is not None:
    big = max(sharded, key=lambda i: prob.row_nbytes[i])
    need = 2 * int(prob.row_nbytes[big])
    if budget < need:
      raise ValueError(f"fsdp(memory_budget_bytes={budget}): leaf {rows[big].path!r} needs {need} bytes "
                       f"per device during its backward (its {int(prob.row_nbytes[big])} bytes of parameters "
                       f"gathered and its unsharded gradient); raise the budget to at least {need}, or shard "
                       f"the leaf over more devices.")
  if bucket is not None:
    unit_sets = [(f"bucket_bytes={bucket}", _runs(rows_, sharded, float(bucket)))]
  else:
    unit_sets = [("per-layer", _runs(rows_, sharded, 0.0))]
    seen = {_key(unit_sets[0][1])}
    per_leaf = [[i] for i in sharded]
    if budget is not None and _key(per_leaf) not in seen:  # the least memory; never the fastest without
      unit_sets.append(("per-leaf", per_leaf))              # a cap (the most start-ups)
      seen.add(_key(per_leaf))
    for label, u in [(f"cap={mib}MiB", _runs(rows_, sharded, mib * 2.0**20)) for mib in _CAPS_MIB] + [
        (f"ramp={lo}-{mib}MiB", _runs(rows_, sharded, mib * 2.0**20, ramp=lo * 2.0**20)) for lo, mib in _RAMP_MIB] + [
        (f"taper={n},{g:g}", _taper(rows_, unit_sets[0][1], n, g)) for n, g in _TAPERS]:
      if _key(u) not in seen:
        seen.add(_key(u))
        unit_sets.append((label, u))
  depths = _PREFETCH if prefetch is None else (prefetch,)
  best: Plan | None = None
  smallest = None
  limit = budget if budget is not None else float("inf")
  # every unit set at the first depth; the deeper prefetches for the best few (deeper only pays while
  # the link is ahead of the compute, so each set stops at the first depth that does not help)
  # the replicated leaves' grouping (per unit window, or at once) is chosen on the first unit set and
  # kept for the others (it depends on the network's start-up far more than on the units)
  structs, first = [], []
  bo = backward_order(prob)
  tails = (False, True) if rows_.rep else (False,)
  for n, (label, units) in enumerate(unit_sets):
    for tail in (tails if n == 0 else (tails[0],)):
      chunks, unit_idx = _chunks(rows_, units, tail=tail)
      base = fsdp_arrays(prob, chunks, unit_idx, [True] * len(units), depths[0], 1, s, r, order_of=bo)
      structs.append((label + (",replicated-at-end" if tail else ""), chunks, unit_idx, base))
      first.append(_best_keep(prob, base, chunks, unit_idx, depths[0], budget, structs[-1][0]))
    if n == 0 and len(tails) > 1:
      tails = (first[-1].iteration < first[-2].iteration,)
  ranked = sorted(range(len(structs)), key=lambda i: (first[i].peak > limit, first[i].iteration))
  for rank, i in enumerate(ranked):
    label, chunks, unit_idx, base = structs[i]
    for d in depths:
      if d > 1 and (d > len(unit_idx) or rank >= _DEEPER):
        break
      cand = first[i] if d == depths[0] else _best_keep(prob, base, chunks, unit_idx, d, budget, label)
      if smallest is None or cand.peak < smallest:
        smallest = cand.peak
      if cand.peak <= limit and (
          best is None or (cand.iteration, cand.peak) < (best.iteration * (1 - 1e-12), best.peak)):
        best = cand
      elif d > depths[0] and best is not None and cand.iteration >= best.iteration:
        break                              # deeper prefetch no longer pays for this unit set
  if best is None:
    raise ValueError(f"fsdp(memory_budget_bytes={budget}): no plan fits; the least memory found is "
                     f"{int(smallest or 0)} bytes per device. Raise the budget, or shard over more devices.")
  return best


def _best_keep(prob: Problem, base: FsdpArrays, chunks, unit_idx, d: int, budget: int | None,
               label: str) -> Plan:
  """The keep pattern (the last k units keep) that fits the budget with the most k, and its run;
  without re-gathers the backward prefetch does not matter, with them 1 and 2 are tried."""
  n = len(unit_idx)

  def run(k: int, db: int) -> tuple[float, float, FsdpArrays]:
    keep = tuple(u >= n - k for u in range(n))
    arr = base._replace(keep=keep, prefetch=d, backward_prefetch=db)
    res = fsdp_run(prob, arr)
    return res.iteration_s, res.peak_memory_bytes, arr

  it, pk, _ = run(n, 1)
  if budget is None or pk <= budget:
    return Plan(f"{label},prefetch={d},keep=all", chunks, unit_idx, [True] * n, d, 1, it, pk)
  best = None
  for db in (1, 2):
    it0, pk0, _ = run(0, db)
    if pk0 > budget:
      continue
    lo, hi, res = 0, n, (it0, pk0)     # the largest k in [0, n) that fits: bisection on the monotone peak
    while hi - lo > 1:
      mid = (lo + hi) // 2
      it_m, pk_m, _ = run(mid, db)
      if pk_m <= budget:
        lo, res = mid, (it_m, pk_m)
      else:
        hi = mid
    cand = Plan(f"{label},prefetch={d},keep=last{lo},backward_prefetch={db}", chunks, unit_idx,
                [u >= n - lo for u in range(n)], d, db, res[0], res[1])
    if best is None or (cand.iteration, cand.peak) < (best.iteration, best.peak):
      best = cand
  if best is None:                      # nothing fits: the least-memory pattern, for the error message
    return Plan(f"{label},prefetch={d},keep=none", chunks, unit_idx, [False] * n, d, 1, *run(0, 1)[:2])
  return best


def _key(units: Sequence[Sequence[int]]) -> tuple:
  return tuple(map(tuple, units))


class _Rows:
  """Per-row lists the unit and chunk builders read, computed once per plan: layer, backward position
  of the layer (its rank in ready order), bytes, dtype."""

  def __init__(self, prob: Problem):
    self.layer = prob.row_layer.tolist()
    nl = len(prob.layers)
    ready_l = np.zeros(nl)
    np.maximum.at(ready_l, prob.row_layer, prob.row_ready_s)
    order = sorted(range(nl), key=lambda l: (ready_l[l], -l))
    pos_l = [0] * nl
    for k, l in enumerate(order):
      pos_l[l] = k
    self.nl = nl
    self.pos = [pos_l[l] for l in self.layer]
    self.nbytes = prob.row_nbytes.tolist()
    self.dtype = prob.dtype
    self.size = prob.size
    rows = prob.profile.rows
    self.rep = [i for i in prob.live if rows[i].shard_dim is None]


def _runs(rows: _Rows, sharded: Sequence[int], cap: float, *, ramp: float = 0.0) -> list[list[int]]:
  """Sharded rows grouped into units: runs of whole layers in forward order, one dtype each, closed
  once a unit reaches `cap` bytes (0: one unit per layer and dtype). With `ramp` > 0, unit k of a dtype
  closes once it reaches min(cap, ramp·2^k, max(ramp, the sharded bytes of the layers after it)): small
  units at both ends (forward starts waiting on the front's gathers; backward's first reduce-scatters
  can start only once a whole back unit is done, and it ends waiting on the front's), doubling towards
  the middle, where fewer start-ups pay."""
  by_layer: dict[int, list[int]] = {}
  for i in sharded:
    by_layer.setdefault(rows.layer[i], []).append(i)
  units: list[tuple[int, list[int]]] = []
  open_: dict[str, tuple[int, list[int]]] = {}
  size: dict[str, float] = {}
  count: dict[str, int] = {}
  layers = sorted(by_layer)
  after = {}
  rest = 0.0
  for l in reversed(layers):
    after[l] = rest
    rest += sum(rows.nbytes[i] for i in by_layer[l])
  for l in layers:
    for i in by_layer[l]:
      dt = rows.dtype[i]
      if dt not in open_:
        open_[dt] = (l, [])
        size[dt] = 0.0
      open_[dt][1].append(i)
      size[dt] += rows.nbytes[i]
    for dt in list(open_):
      limit = min(cap, ramp * 2.0 ** count.get(dt, 0), max(ramp, after[l])) if ramp else cap
      if size[dt] >= limit:
        units.append(open_.pop(dt))
        count[dt] = count.get(dt, 0) + 1
  units.extend(open_.values())
  units.sort(key=lambda u: u[0])
  return [u for _, u in units]


def _taper(rows: _Rows, per_layer: Sequence[Sequence[int]], n_units: int, growth: float) -> list[list[int]]:
  """Sharded rows grouped into about `n_units` units per dtype, filled from the back of the model: runs
  of whole layers, unit k from the back closing once it reaches lo·(1 + growth·k) bytes (lo: the
  dtype's bytes over the sum of those factors), the front unit taking what is left. Small units at the
  back let backward's first reduce-scatters start early; with growth > 0 they grow towards the front,
  where forward's and backward's ends make fewer start-ups pay."""
  by_dtype: dict[str, list[tuple[Sequence[int], float]]] = {}
  for u in per_layer:                                  # one unit per layer and dtype, forward order
    by_dtype.setdefault(rows.dtype[u[0]], []).append((u, float(sum(rows.nbytes[i] for i in u))))
  units: list[list[int]] = []
  for layers in by_dtype.values():
    total = sum(b for _, b in layers)
    lo = total / sum(1.0 + growth * k for k in range(n_units))
    parts: list[Sequence[int]] = []
    size, k = 0.0, 0
    for u, nb in reversed(layers):
      parts.append(u)
      size += nb
      if size >= lo * (1.0 + growth * k) * (1 - 1e-12):
        units.append([i for p in reversed(parts) for i in p])
        parts, size, k = [], 0.0, k + 1
    if parts:
      units.append([i for p in reversed(parts) for i in p])
  units.sort(key=lambda u: rows.layer[u[0]])
  return units


def _chunks(rows: _Rows, units: Sequence[Sequence[int]], *, tail: bool = False
            ) -> tuple[list[list[Slice]], list[int]]:
  """The schedule's chunks in issue order (each unit's reduce-scatter once its backward has ended; the
  replicated rows in one chunk per dtype and unit window, after the unit's, or with `tail` in one chunk
  per dtype, issued once its last row is ready: one start-up, which over many devices may cost more
  than its bytes) and the
  chunk index of every unit (forward order)."""
  pos, size = rows.pos, rows.size
  items: list[tuple[int, int, int, list[Slice]]] = []     # (ready position, 0 unit / 1 replicated, id, slices)
  unit_ready = []
  for u, rs in enumerate(units):
    p = max(pos[i] for i in rs)
    unit_ready.append(p)
    items.append((p, 0, u, [(i, 0, size[i]) for i in rs]))          # rs ascending (forward order)
  marks = sorted(unit_ready)
  groups: dict[tuple[int, str], list[int]] = {}
  for i in rows.rep:
    w = bisect.bisect_left(marks, pos[i])            # the first unit window ending at or after it
    win = -1 if tail else (marks[w] if w < len(marks) else rows.nl)
    groups.setdefault((win, rows.dtype[i]), []).append(i)
  for n, ((win, _), rs) in enumerate(sorted(groups.items())):
    items.append((max(win, max(pos[i] for i in rs)), 1, n, [(i, 0, size[i]) for i in rs]))
  items.sort(key=lambda x: (x[0], x[1], x[2]))
  chunks = [it[3] for it in items]
  unit_idx = [0] * len(units)
  for k, it in enumerate(items):
    if it[1] == 0:
      unit_idx[it[2]] = k
  return chunks, unit_idx


def fsdp_schedule(profile: GradientProfile, best: Plan, *, options: dict[str, Any], cross_step: bool,
                  budget: int | None, policy: str = _POLICY) -> Schedule:
  """The Schedule of an FSDP candidate: one bucket per chunk (issue order), `fsdp` set."""
  rows = profile.rows
  buckets = tuple(Bucket(chunks=(Chunk(slices=tuple(c), dtype=rows[c[0][0]].dtype),)) for c in best.chunks)
  plan = FsdpPlan(units=tuple(best.units), keep=tuple(best.keep), prefetch=best.prefetch,
                  backward_prefetch=best.backward_prefetch, shard_dims=tuple(r.shard_dim for r in rows),
                  mesh=profile.mesh, shard_axes=profile.shard_axes, memory_budget_bytes=budget)
  return Schedule(buckets=buckets, rows=profile.tree_rows(), policy=policy, options=tuple(options.items()),
                  cross_step=bool(cross_step), predicted_s=best.iteration, fsdp=plan)
