"""The `fsdp` policy: FSDP (ZeRO-3) and HSDP as a plan of gathers, re-gathers, reduce-scatters and
all-reduces under a memory budget (pure numpy; docs/fsdp.md, "The plan").
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._planning._core import Problem, problem
from .._planning._fsdp_accum import accum_run
from .._planning._fsdp import (BackwardOrder, FsdpArrays, backward_order, fsdp_arrays, fsdp_run, gather_nbytes,
                               unit_costs)
from .._planning._fsdp_bound import backward_chain, forward_blocks
from .._planning._simulate import simulate_fsdp
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
_GRID = 128                  # `_split`'s blocks end at no more than this many places


def fsdp(*, memory_budget_bytes: int | None = None, bucket_bytes: int | None = None,
         prefetch: int | None = None, in_flight: int = 1, micro_batches: int = 1) -> Scheduler:
  """FSDP / HSDP: forward all-gathers with planned prefetch, keep or re-gather under a memory budget,
  reduce-scatters in backward, replicated leaves all-reduced (docs/fsdp.md, "The plan").

  The profile must carry its placement (a mesh with replica axes is HSDP) on `network.workers` devices.

  Args:
    memory_budget_bytes: per device, the most bytes of gathered parameters and unsharded gradients
      alive at once (as `SimResult.peak_memory_bytes` counts); None: no cap.
    bucket_bytes: None: planned units; an integer: runs of layers closed once they reach it.
    prefetch: None: planned; an integer from 1 to `in_flight`: that forward prefetch depth.
    in_flight: the collectives XLA:GPU keeps in flight (1, its default; more only where the step is
      compiled with `xla_gpu_experimental_parallel_collective_overlap_limit` set that high).
    micro_batches: k micro-batches per step, each as the profile measured (its forward and backward):
      per group and unit, hold across the k or not (docs/fsdp.md, "Accumulation"; calm networks only).

  Returns:
    A Scheduler; options record the arguments, `candidate` and `peak_memory_bytes`.

  Raises:
    TypeError, ValueError: bad arguments; the scheduler: no sharded rows, another mesh size, `links >
      1`, a budget below twice the largest leaf, or no plan within it.

  Examples:
    >>> import numpy as np, prophet_jax as pj
    >>> params = {f"l{i}": {"w": np.zeros((64, 64), np.float32)} for i in range(4)}
    >>> prof = pj.GradientProfile.from_params(params, forward_s=0.004, backward_s=0.008, mesh={"data": 8},
    ...     shardings={f"l{i}": {"w": ("data", None)} for i in range(4)})
    >>> net = pj.NetworkModel.preset("100gb-ib", workers=8)
    >>> s = pj.plan(prof, net, "fsdp", memory_budget_bytes=2**16)
    >>> s.fsdp is not None, pj.simulate(s, prof, net).peak_memory_bytes <= 2**16
    (True, True)

  References:
    S. Rajbhandari et al., "ZeRO", SC 2020 (stage 3). Y. Zhao et al., "PyTorch FSDP", VLDB 2023.
  """
  budget = check_bytes("fsdp", "memory_budget_bytes", memory_budget_bytes,
                       hint="e.g. 8 * 2**30 for 8 GiB of gathered parameters and gradient buffers.")
  bucket = check_bytes("fsdp", "bucket_bytes", bucket_bytes, hint="e.g. 64 * 2**20.")
  if not is_int(in_flight) or in_flight < 1:
    raise ValueError(f"fsdp(in_flight={in_flight!r}): the collectives XLA:GPU keeps in flight, an integer >= 1 "
                     f"(1: its default overlap limit).")
  if prefetch is not None and (not is_int(prefetch) or not 1 <= prefetch <= in_flight):
    raise ValueError(f"fsdp(prefetch={prefetch!r}): a prefetch depth is an integer from 1 to in_flight={in_flight} "
                     f"(or None: planned); XLA:GPU runs a deeper prefetch as depth in_flight. For depth 2, compile "
                     f"the step with xla_gpu_experimental_parallel_collective_overlap_limit=2 and pass in_flight=2.")
  if not is_int(micro_batches) or micro_batches < 1:
    raise ValueError(f"fsdp(micro_batches={micro_batches!r}): the micro-batches one step runs, an integer >= 1.")
  options = {"memory_budget_bytes": budget, "bucket_bytes": bucket, "prefetch": prefetch, "in_flight": in_flight}
  if micro_batches > 1:
    options["micro_batches"] = micro_batches

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(_POLICY, profile, network, cross_step)
    prob = problem(profile, network, cross_step=cross)
    best = plan_fsdp(prob, budget, bucket, prefetch, in_flight)
    if micro_batches > 1:
      plan_holds(prob, best, micro_batches, budget)
    return fsdp_schedule(profile, best, options=dict(options, candidate=best.label,
                                                     peak_memory_bytes=int(round(best.peak))),
                         cross_step=cross, budget=budget,
                         predicted_s=best.iteration if micro_batches > 1 else prediction(prob, best))

  scheduler.__name__ = _POLICY
  scheduler.__qualname__ = _POLICY
  return scheduler


class Plan:
  """One FSDP candidate: chunks, units, keeps and depths, with its simulated iteration and peak."""

  __slots__ = ("label", "chunks", "units", "keep", "prefetch", "backward_prefetch", "iteration", "peak", "gathers",
               "in_flight", "accum")

  def __init__(self, label, chunks, units, keep, prefetch, backward_prefetch, iteration, peak, gathers=None,
               in_flight=1):
    self.label, self.chunks, self.units, self.keep = label, chunks, units, keep
    self.prefetch, self.backward_prefetch, self.iteration, self.peak = prefetch, backward_prefetch, iteration, peak
    self.gathers = gathers          # the all-gather groups (rows), apart from the units; None: the units
    self.in_flight = in_flight
    self.accum = None               # (k, hold_params, hold_grads) of an accumulating step (`plan_holds`)


def check_fsdp_inputs(prob: Problem) -> tuple[int, int]:
  """(shards, replicas) of the profile's mesh; ValueError without sharded rows, for a mesh not of
  network.workers devices, or several links.
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


def plan_fsdp(prob: Problem, budget: int | None, bucket: int | None = None, prefetch: int | None = None,
              in_flight: int = 1) -> Plan:
  """The best FSDP candidate for `prob` under `budget`, on the calm network, for `in_flight` collectives in flight."""
  s, r = check_fsdp_inputs(prob)
  rows = prob.profile.rows
  bo = backward_order(prob)
  rows_ = _Rows(prob, bo)
  sharded = [i for i in prob.live if rows[i].shard_dim is not None]
  if budget is not None:
    # a leaf's gradient is made while its gathered weights are held (not the first layer's: its backward reads none)
    need = {i: int(prob.row_nbytes[i] + (rows_.gbytes[i] if prob.row_layer[i] else 0)) for i in sharded}
    big = max(sharded, key=need.get)
    if budget < need[big]:
      raise ValueError(f"fsdp(memory_budget_bytes={budget}): leaf {rows[big].path!r} needs {need[big]} bytes "
                       f"per device during its backward (its unsharded gradient{'' if prob.row_layer[big] == 0 else ' and its parameters gathered'}); raise the budget to at least {need[big]}, or shard "
                       f"the leaf over more devices.")
  if bucket is not None:
    unit_sets = [(f"bucket_bytes={bucket}", rows_.stacked(_runs(rows_, sharded, float(bucket))), None)]
  else:
    unit_sets = [("per-layer", rows_.stacked(_runs(rows_, sharded, 0.0)), None)]
    seen = {_key(unit_sets[0][1])}
    per_leaf = rows_.stacked([[i] for i in sharded])
    if budget is not None and _key(per_leaf) not in seen:  # the least memory; never the fastest without
      unit_sets.append(("per-leaf", per_leaf, None))        # a cap (the most start-ups)
      seen.add(_key(per_leaf))
    for label, u in [(f"cap={mib}MiB", _runs(rows_, sharded, mib * 2.0**20)) for mib in _CAPS_MIB] + [
        (f"ramp={lo}-{mib}MiB", _runs(rows_, sharded, mib * 2.0**20, ramp=lo * 2.0**20)) for lo, mib in _RAMP_MIB] + [
        (f"taper={n},{g:g}", _taper(rows_, unit_sets[0][1], n, g)) for n, g in _TAPERS]:
      u = rows_.stacked(u)
      if _key(u) not in seen:
        seen.add(_key(u))
        unit_sets.append((label, u, None))
    u, g = _split(prob, rows_, sharded, s, r)
    unit_sets.append(("split", rows_.stacked(u), rows_.stacked(g)))
  depths = tuple(d for d in _PREFETCH if d <= in_flight) if prefetch is None else (prefetch,)
  dbs = tuple(d for d in (1, 2) if d <= in_flight)
  best: Plan | None = None
  smallest = None
  limit = budget if budget is not None else float("inf")
  # every unit set at the first depth; the deeper prefetches for the best few (deeper only pays while
  # the link is ahead of the compute, so each set stops at the first depth that does not help)
  # the replicated leaves' grouping (per unit window, or at once) is chosen on the first unit set and
  # kept for the others (it depends on the network's start-up far more than on the units)
  # each set's keep search is bounded below before it runs (`_Keeps.bound`): the sets are searched in
  # the order of their bounds, none whose bound is no better than the _DEEPER fastest plans that fit
  structs: list[_Set] = []
  keeps: list[_Keeps] = []
  # the replicated leaves at the end of backward with one collective in flight: each all-reduce in backward's
  # windows held the compute the units' collectives overlap (docs/design.md, "Windows, order and collectives")
  tails = ((True,) if in_flight == 1 else (False, True)) if rows_.rep else (False,)
  for n, (label, units, gathers) in enumerate(unit_sets):
    for tail in (tails if n == 0 else (tails[0],)):
      chunks, unit_idx = _chunks(rows_, units, tail=tail)
      base = fsdp_arrays(prob, chunks, unit_idx, [True] * len(gathers or units), depths[0], 1, s, r, gathers,
                         order_of=bo, in_flight=in_flight)
      structs.append(_Set(label + (",replicated-at-end" if tail else ""), chunks, unit_idx, base, gathers))
      keeps.append(_Keeps(prob, base, depths[0], budget, dbs))
    if n == 0 and len(tails) > 1:          # the replicated leaves' grouping: the lower bound's
      tails = (keeps[-1].bound() < keeps[-2].bound(),)
  first: dict[int, Plan] = {}
  fastest: list[float] = []              # the _DEEPER fastest first-depth plans that fit, so far
  for i in sorted(range(len(structs)), key=lambda i: keeps[i].bound()):
    if len(fastest) == _DEEPER and keeps[i].bound() >= fastest[-1]:
      break                              # neither the fastest nor among the _DEEPER tried deeper
    first[i] = keeps[i].plan(structs[i])
    if first[i].peak <= limit:
      fastest = sorted(fastest + [first[i].iteration])[:_DEEPER]
  ranked = sorted(first, key=lambda i: (first[i].peak > limit, first[i].iteration))
  for rank, i in enumerate(ranked):
    base = structs[i].base
    for d in depths:
      if d > 1 and (d > len(base.keep) or rank >= _DEEPER):
        break
      if d > depths[0]:
        deeper = _Keeps(prob, base, d, budget, dbs)
        if best is not None and deeper.bound() > best.iteration:
          break                            # deeper prefetch no longer pays for this unit set
      cand = first[i] if d == depths[0] else deeper.plan(structs[i])
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
  best.in_flight = in_flight
  return best


def plan_holds(prob: Problem, best: Plan, k: int, budget: int | None) -> None:
  """Sets `best.accum` for k micro-batches, and its iteration and peak: greedy by collective bytes saved per
  byte held, each group (held: k - 1 gathers fewer, and its k re-gathers) or unit (held: k - 1 reduce-scatters
  fewer) held while the simulated peak fits the budget; scanned stacks never held (docs/fsdp.md,
  "Accumulation")."""
  if prob.network.pressure is not None:
    raise ValueError(f"fsdp(micro_batches={k}): an accumulating plan is made on a calm network; pass the "
                     f"network without its pressure (network.replace(pressure=None)).")
  rows, stacks = prob.profile.rows, tuple(p + "/" for p in prob.profile.stacks)
  arr = fsdp_arrays(prob, best.chunks, best.units, best.keep, best.prefetch, best.backward_prefetch,
                    prob.profile.shard_count, prob.profile.replica_count, best.gathers)
  free = lambda rs: not any(rows[i].path.startswith(stacks) for i in rs) if stacks else True  # noqa: E731
  groups = best.gathers or [[i for i, _, _ in best.chunks[c]] for c in best.units]
  cands = [((k - 1) + k * (arr.reads[g] and not arr.keep[g]), arr.unit_bytes[g], 0, g)
           for g in range(len(groups)) if free(groups[g])]
  cands += [(k - 1, arr.rs_bytes[u], 1, u) for u, c in enumerate(best.units) if free([i for i, _, _ in best.chunks[c]])]
  held = [[False] * len(arr.unit_bytes), [False] * len(arr.rs_bytes)]
  for _, nb, kind, i in sorted(cands, key=lambda c: (-c[0], -c[1])):
    held[kind][i] = True
    if budget is not None:
      offset = sum(b for b, h in zip(arr.unit_bytes + arr.rs_bytes, held[0] + held[1]) if h)
      if offset > budget or accum_run(prob, arr._replace(held=tuple(held[0]), rs_held=tuple(held[1])),
                                      k).peak_memory_bytes > budget:
        held[kind][i] = False
  run = accum_run(prob, arr._replace(held=tuple(held[0]), rs_held=tuple(held[1])), k)
  best.accum = (k, tuple(held[0]), tuple(held[1]))
  best.iteration, best.peak = run.iteration_s, run.peak_memory_bytes


class _Set(NamedTuple):
  """One unit set as scored: label, chunks, units, timeline arrays and all-gather groups."""

  label: str
  chunks: list[list[Slice]]
  unit_idx: list[int]
  base: FsdpArrays
  gathers: list[list[int]] | None


class _Keeps:
  """The keep patterns of one unit set at one prefetch: the last k groups kept, backward prefetch 1 or 2,
  each run once when asked (docs/fsdp.md, "The plan": the largest k that fits, and the bound).
  """

  def __init__(self, prob: Problem, base: FsdpArrays, d: int, budget: int | None, dbs: tuple[int, ...] = (1, 2)):
    self.prob, self.base, self.d, self.budget, self.dbs = prob, base, d, budget, dbs
    self.n = n = len(base.keep)
    self.kept = np.concatenate([[0.0], np.cumsum(base.unit_bytes[::-1])])   # bytes of the last k groups
    self.top = n if budget is None else int(np.searchsorted(self.kept, budget, side="right")) - 1
    self.runs: dict[tuple[int, int], tuple[float, float]] = {}
    self.forward = None                  # every pattern's forward is the same: run once

  def run(self, k: int, db: int) -> tuple[float, float]:
    """(iteration, peak) with the last k groups kept and backward prefetch db."""
    if (k, db) not in self.runs:
      n = self.n
      res = fsdp_run(self.prob, self.base._replace(keep=tuple(u >= n - k for u in range(n)), prefetch=self.d,
                                                   backward_prefetch=db), forward=self.forward)
      self.forward = res.forward
      self.runs[k, db] = res.iteration_s, res.peak_memory_bytes
    return self.runs[k, db]

  def bound(self) -> float:
    """No keep pattern that fits the budget runs faster than this."""
    if self.top >= self.n:
      return self.run(self.n, 1)[0]
    return min(self.run(self.top, db)[0] for db in self.dbs)

  def plan(self, st: _Set) -> Plan:
    """The largest k that fits, at the faster backward prefetch; when none fits, the pattern of least
    memory (its peak over the budget, for the error message)."""
    n, d, budget = self.n, self.d, self.budget
    label, chunks, unit_idx, _, gathers = st
    if self.top >= n:
      it, pk = self.run(n, 1)
      if budget is None or pk <= budget:
        return Plan(f"{label},prefetch={d},keep=all", chunks, unit_idx, [True] * n, d, 1, it, pk, gathers)
    best = None
    hi = min(self.top, n - 1)
    guess = None
    for db in self.dbs:
      if best is not None and self.run(hi, db)[0] > best.iteration:
        continue                         # no k that fits is faster at this backward prefetch
      def fits(k: int) -> bool:
        return self.run(k, db)[1] <= budget
      if guess is None and not fits(hi):   # about where the peak, less what hi keeps beyond k, fits
        guess = int(np.searchsorted(self.kept, budget - self.run(hi, db)[1] + self.kept[hi], side="right")) - 1
      g = hi if guess is None else min(guess, hi)
      if not fits(g) and not fits(0):
        continue                         # no k fits at this backward prefetch
      k = _largest(fits, hi + 1, g)
      guess = k
      it, pk = self.run(k, db)
      cand = Plan(f"{label},prefetch={d},keep=last{k},backward_prefetch={db}", chunks, unit_idx,
                  [u >= n - k for u in range(n)], d, db, it, pk, gathers)
      if best is None or (cand.iteration, cand.peak) < (best.iteration, best.peak):
        best = cand
    if best is None:
      return Plan(f"{label},prefetch={d},keep=none", chunks, unit_idx, [False] * n, d, 1, *self.run(0, 1),
                  gathers)
    return best


def _largest(fits, n: int, guess: int) -> int:
  """The largest k in [0, n) with fits(k) for a monotone `fits`, or -1: galloping from `guess`, then
  bisection.
  """
  lo, hi = -1, n
  k, step = min(max(guess, 0), n - 1), 1
  if fits(k):
    lo = k
    while lo + step < hi:
      if not fits(lo + step):
        hi = lo + step
        break
      lo, step = lo + step, step * 2
  else:
    hi = k
    while hi - step > lo:
      if fits(hi - step):
        lo = hi - step
        break
      hi, step = hi - step, step * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo


def _key(units: Sequence[Sequence[int]]) -> tuple:
  return tuple(map(tuple, units))


class _Rows:
  """Per-row layer, backward position, bytes (as reduce-scattered and as gathered), dtype (with the gather
  dtype: what one collective moves) and scanned layer, computed once per plan."""

  def __init__(self, prob: Problem, bo: BackwardOrder | None = None):
    bo = bo if bo is not None else backward_order(prob)
    self.layer = prob.row_layer.tolist()
    self.nl, self.pos_l, self.ready_l, self.pos = len(prob.layers), bo.layer_pos, bo.ready, bo.row_pos
    self.nbytes = prob.row_nbytes.tolist()
    self.gbytes = gather_nbytes(prob.profile)
    rows = prob.profile.rows
    self.dtype = [d if r.gather_dtype is None else f"{d}>{r.gather_dtype}" for d, r in zip(prob.dtype, rows)]
    self.size = prob.size
    self.rep = [i for i in prob.live if rows[i].shard_dim is None]
    self.tail_items = None              # `_chunks`' replicated chunks at the end, once computed
    stacks = tuple(p + "/" for p in prob.profile.stacks)
    self.scanned: dict[int, list[int]] = {}    # a scanned layer's sharded rows (forward order)
    for i in prob.live:
      if rows[i].shard_dim is not None and rows[i].path.startswith(stacks):
        self.scanned.setdefault(self.layer[i], []).append(i)
    for l, rs in self.scanned.items():
      if len({self.dtype[i] for i in rs}) > 1:
        raise ValueError(f"fsdp: scanned layer {prob.layers[l]!r} holds sharded leaves of dtypes "
                         f"{sorted({self.dtype[i] for i in rs})}; the step gathers a scanned layer in one "
                         f"all-gather of one dtype. Give its leaves one dtype (and gather dtype).")

  def stacked(self, units: Sequence[Sequence[int]]) -> list[list[int]]:
    """`units` (or gather groups) with every scanned layer alone in one, whole: the step runs a stack's
    layers in a loop, one all-gather and one reduce-scatter each (docs/fsdp.md, "Scanned stacks")."""
    if not self.scanned:
      return [list(u) for u in units]
    out: list[list[int]] = []
    seen: set[int] = set()
    for u in units:
      rest: list[int] = []
      for i in u:
        l = self.layer[i]
        if l not in self.scanned:
          rest.append(i)
          continue
        if rest:
          out.append(rest)
          rest = []
        if l not in seen:
          seen.add(l)
          out.append(self.scanned[l])
      if rest:
        out.append(rest)
    return sorted(out, key=lambda u: self.layer[u[0]])


def _runs(rows: _Rows, sharded: Sequence[int], cap: float, *, ramp: float = 0.0) -> list[list[int]]:
  """Sharded rows in units: runs of whole layers in forward order, one dtype each, closed at `cap` bytes
  (0: per layer); with `ramp`, a ramp's caps.
  """
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
  for l in reversed(layers if ramp else ()):
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
  """Sharded rows in about `n_units` units per dtype, filled from the back, growing by `growth`."""
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


def _split(prob: Problem, rows: _Rows, sharded: Sequence[int], s: int, r: int
           ) -> tuple[list[list[int]], list[list[int]]]:
  """Reduce-scatter units and all-gather groups apart, from the partitions of F'' and E'' (`_fsdp_bound`)."""
  a_g, b_g, a_r, b_r, _, _ = unit_costs(prob, s, r)
  by_layer: dict[int, list[int]] = {}
  for i in sharded:
    by_layer.setdefault(rows.layer[i], []).append(i)
  s_l = np.zeros(rows.nl)
  g_l = np.zeros(rows.nl)
  for l, rs in by_layer.items():
    s_l[l] = sum(rows.nbytes[i] for i in rs)
    g_l[l] = sum(rows.gbytes[i] for i in rs)
  layers = sorted(by_layer)
  _, f_ends = forward_blocks(g_l, np.asarray(prob.layer_fwd_s, dtype=float), a_g, b_g, _grid(g_l[layers]))
  in_ready = sorted(layers, key=lambda l: rows.pos_l[l])
  _, b_ends = backward_chain(np.array([rows.ready_l[l] for l in in_ready]), s_l[in_ready], a_g, b_g,
                             _grid(s_l[in_ready]), (a_r, b_r) if r > 1 else None)
  gathers, lo = [], 0
  for end in f_ends:
    gathers += _by_dtype(rows, [i for l in range(lo, end + 1) for i in by_layer.get(l, ())])
    lo = end + 1
  units, lo = [], 0
  for end in b_ends:
    units += _by_dtype(rows, sorted(i for l in in_ready[lo:end + 1] for i in by_layer[l]))
    lo = end + 1
  first_layer = lambda u: rows.layer[u[0]]
  return sorted(units, key=first_layer), sorted(gathers, key=first_layer)


def _grid(nbytes: np.ndarray) -> np.ndarray | None:
  """Where `_split`'s blocks may end among `nbytes`' places: anywhere up to _GRID places (None), else
  where the bytes cross a 1/_GRID step, and at the last."""
  if len(nbytes) <= _GRID:
    return None
  cum = np.cumsum(nbytes)
  return np.unique(np.append(np.searchsorted(cum, cum[-1] * np.arange(1, _GRID) / _GRID), len(nbytes) - 1))


def _by_dtype(rows: _Rows, rs: Sequence[int]) -> list[list[int]]:
  """Rows (forward order) in one group per dtype."""
  out: dict[str, list[int]] = {}
  for i in rs:
    out.setdefault(rows.dtype[i], []).append(i)
  return list(out.values())


def _chunks(rows: _Rows, units: Sequence[Sequence[int]], *, tail: bool = False
            ) -> tuple[list[list[Slice]], list[int]]:
  """The schedule's chunks in issue order (each unit's reduce-scatter, the replicated rows per unit window,
  or with `tail` once at the end) and each unit's chunk index.
  """
  pos, size = rows.pos, rows.size
  items: list[tuple[int, int, int, list[Slice]]] = []     # (ready position, 0 unit / 1 replicated, id, slices)
  unit_ready = []
  for u, rs in enumerate(units):
    p = max(pos[i] for i in rs)
    unit_ready.append(p)
    items.append((p, 0, u, [(i, 0, size[i]) for i in rs]))          # rs ascending (forward order)
  if tail and rows.tail_items is not None:        # the same for every unit set
    items.extend(rows.tail_items)
  else:
    marks = sorted(unit_ready)
    groups: dict[tuple[int, str], list[int]] = {}
    for i in rows.rep:
      w = bisect.bisect_left(marks, pos[i])            # the first unit window ending at or after it
      win = -1 if tail else (marks[w] if w < len(marks) else rows.nl)
      groups.setdefault((win, rows.dtype[i]), []).append(i)
    rep = [(max(win, max(pos[i] for i in rs)), 1, n, [(i, 0, size[i]) for i in rs])
           for n, ((win, _), rs) in enumerate(sorted(groups.items()))]
    if tail:
      rows.tail_items = rep
    items.extend(rep)
  items.sort(key=lambda x: (x[0], x[1], x[2]))
  chunks = [it[3] for it in items]
  unit_idx = [0] * len(units)
  for k, it in enumerate(items):
    if it[1] == 0:
      unit_idx[it[2]] = k
  return chunks, unit_idx


def prediction(prob: Problem, p: Plan) -> float:
  """`simulate`'s iteration of a candidate (under pressure the mean; the calm peak)."""
  if prob.network.pressure is None:
    return p.iteration
  s, r = prob.profile.shard_count, prob.profile.replica_count
  return simulate_fsdp(prob, fsdp_arrays(prob, p.chunks, p.units, p.keep, p.prefetch, p.backward_prefetch, s, r,
                                         p.gathers, in_flight=p.in_flight), events=False).iteration_s


def fsdp_schedule(profile: GradientProfile, best: Plan, *, options: dict[str, Any], cross_step: bool,
                  budget: int | None, policy: str = _POLICY, predicted_s: float | None = None) -> Schedule:
  """The Schedule of an FSDP candidate: one bucket per chunk (issue order), `fsdp` set."""
  rows = profile.rows
  buckets = tuple(Bucket(chunks=(Chunk(slices=tuple(c), dtype=rows[c[0][0]].dtype),)) for c in best.chunks)
  plan = FsdpPlan(units=tuple(best.units), keep=tuple(best.keep), prefetch=best.prefetch,
                  backward_prefetch=best.backward_prefetch, shard_dims=tuple(r.shard_dim for r in rows),
                  mesh=profile.mesh, shard_axes=profile.shard_axes, memory_budget_bytes=budget,
                  gathers=tuple(map(tuple, best.gathers or ())), in_flight=best.in_flight,
                  gather_dtypes=tuple(r.gather_dtype for r in rows) if any(r.gather_dtype for r in rows) else (),
                  **({} if best.accum is None else dict(zip(("micro_batches", "hold_params", "hold_grads"), best.accum))))
  return Schedule(buckets=buckets, rows=profile.tree_rows(), policy=policy, options=tuple(options.items()),
                  cross_step=bool(cross_step), predicted_s=best.iteration if predicted_s is None else predicted_s,
                  fsdp=plan)
