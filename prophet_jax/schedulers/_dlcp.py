"""The `dlcp` policy: layer-prioritised chunks, a per-step send budget, bounded deferral.

Pure: numpy only, never jax.

DLCP (switch level) drops the least important packets of late flows and relies on SGD's tolerance
of bounded loss. A synchronous all-reduce cannot drop a late packet and a compiled step has no
clock, so the software form decides at plan time *how many* chunks of a group wait one step
(`Bucket.defer`) and at run time *which* (by magnitude, from values every worker holds identically),
and nothing is lost: a deferred chunk's values are added to the next step's gradient (error
feedback) and sent then (`Bucket` states the exact run-time semantics). What a step saves is the
deferred bytes on the link.

The plan:

1. The best lossless plan: `auto`'s for the same network (its chunks and order: front layers first in
   the pipelined step, readiness in the plain step; under pressure auto scores its candidates on the
   pressured mean, so the start is the best lossless plan for the pressured network), its predicted
   iteration T0 (simulated under the network's pressure, the mean over the seeded samples), and C, the
   same plan's iteration on a free network.
2. Switched off: with `max_defer=0`, or when communication is already hidden (T0 <= 1.01·C), the
   plan *is* auto's (same buckets and chunks; policy 'dlcp'). ByteScheduler's issues #339/#370:
   splitting tensors loses when communication is hidden, so the policy must not split then.
3. The send budget. The deadline is C: the step's end in the plain step; in the pipelined step each
   layer's forward (a message's end plus the update and forward that must follow it). The critical
   message is the one whose end plus what must follow it is last, at the typical costs under
   pressure (`_core.typical_costs`); before it the link carries a busy period with no idle gap. What
   fits before the deadline is sent; the excess, (T - C)/b' bytes (b' the typical per-byte cost), is
   deferred from the chunks of that busy period, least important first (back layers: the last the
   next forward needs, DLCP's layer priority), at most a quarter of the budget per round and never
   more than `max_defer` of all elements in total.
4. Deferring x elements from one of auto's chunks carves its spread·x least important elements
   (back layers first) into a deferral group issued right after the rest of the chunk: m =
   spread·k equal parts of which k wait each step (k = 1, or parts of at most `chunk_bytes`). The
   group's m - k slots and the rest replace one message, so a deferral costs spread - 1 start-ups
   (k = 1) and saves b'·x: a chunk too small ever to pay for them is left alone. With spread > 2 the run-time magnitude ranking chooses which parts wait (with
   spread = 2 the two halves simply alternate).
5. Steps 3-4 repeat (the critical message moves as the link empties), up to 16 rounds, each
   candidate simulated; the fastest is kept, and if none beats T0 the plan is auto's (lossless). The
   whole search runs once per budget level of a fixed ladder below `max_defer` (0.01, 0.02, 0.05,
   0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, ...) and at `max_defer` itself, so a larger `max_defer`
   never predicts a slower plan at the ladder's levels.

So dlcp is never predicted slower than auto, and equal to it when deferral cannot help.

References:
  H. Wang et al. Domain-specific communication optimization for distributed DNN training (DLCP).
  arXiv:2008.08445, 2020; as MLT: Towards domain-specific network transport for distributed DNN
  training, NSDI 2024.
  COVAP: a drop budget sized from the compute/communication overlap window, with error feedback
  (2023).
  E. Warraich et al. OptiReduce: Resilient and tail-optimal AllReduce for distributed deep learning
  in the cloud. NSDI 2025.
  Y. Peng et al. A generic communication scheduler for distributed DNN training acceleration
  (ByteScheduler). SOSP 2019; issues #339 and #370 (partitioning loses when communication is hidden).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import check_bytes, check_int, check_max_defer
from .._core import Problem, iteration_s, link_loop, problem, schedule_arrays, typical_costs
from .._network import NetworkModel
from .._schedule import Bucket, Chunk, Schedule
from .._simulate import simulate_arrays
from .._types import GradientProfile, itemsize
from ._auto import auto
from ._base import Scheduler, Slice
from ._common import check_inputs

_POLICY = "dlcp"
# Communication counts as hidden when the lossless plan is within this fraction of compute only.
_HIDDEN_TOL = 0.01
# Budget rounds per level (each one simulation), and the ladder of budget levels below max_defer.
_MAX_ROUNDS = 16
_LADDER = (0.02, 0.05, 0.1, 0.25, 0.5)
# At most this many parts per deferral group.
_MAX_GROUP_CHUNKS = 1024


def dlcp(*, max_defer: float = 0.0, spread: int = 4, chunk_bytes: int | None = None) -> Scheduler:
  """DLCP in software: layer-prioritised chunks, a per-step send budget, bounded deferral.

  Args:
    max_defer: the largest fraction of the gradient elements that may wait one step, in [0, 1)
      (`Schedule.max_deferred_fraction` never exceeds it). 0, the default, is lossless: the plan is
      auto's.
    spread: a deferral group has spread x k parts of which k wait each step (an integer >= 2). With
      2 the two halves alternate; larger spreads let the run-time magnitude ranking choose the k
      smallest of (spread - 1) x k eligible parts, for a few more start-ups.
    chunk_bytes: the largest part of a deferral group, bytes (finer parts: a finer magnitude choice,
      more start-ups); None (the default): k = 1, the fewest start-ups.

  Returns:
    A Scheduler: `scheduler(profile, network, *, cross_step) -> Schedule`. The schedule's options
    record `max_defer`, `spread`, `chunk_bytes`, `base` (auto's candidate) and `decision` (how much
    it defers, or why it does not: 'max_defer=0', 'communication hidden', 'no gain', ...).

  Raises:
    ValueError: `max_defer` outside [0, 1), `spread` below 2, `chunk_bytes` not positive (each
      named in the message).
    TypeError: `spread` or `chunk_bytes` not an integer.

  Examples:
    >>> import prophet_jax as pj
    >>> prof = pj.GradientProfile.from_rows(
    ...     [dict(path=f"l{i}/w", layer=f"l{i}", shape=(2**20,), dtype="float32", nbytes=2**22,
    ...           ready_s=0.001 * (4 - i), fwd_s=0.001) for i in range(4)],
    ...     forward_s=0.004, backward_s=0.004)
    >>> net = pj.NetworkModel.preset("10gbe", workers=8)
    >>> s = dlcp(max_defer=0.25)(prof, net, cross_step=False)
    >>> 0 < s.max_deferred_fraction <= 0.25, s.predicted_s < pj.plan(prof, net, "auto").predicted_s
    (True, True)
    >>> dlcp()(prof, net, cross_step=False).buckets == pj.plan(prof, net, "auto").buckets  # lossless
    True

  References:
    Wang et al.: DLCP (arXiv:2008.08445, 2020), MLT (NSDI 2024); COVAP (2023); Warraich et al.:
    OptiReduce (NSDI 2025); Peng et al.: ByteScheduler (SOSP 2019), issues #339/#370.
  """
  max_defer = check_max_defer("dlcp()", max_defer)
  check_int("dlcp", "spread", spread, lo=2, fix="A group defers k of its spread x k parts, at most half, so "
            "each deferred part is sent the next step; e.g. 4.")
  chunk_bytes = check_bytes(_POLICY, "chunk_bytes", chunk_bytes,
                            hint="Try None (one deferred part per group) or 4 * 2**20.")
  base_planner = auto()
  options = {"max_defer": max_defer, "spread": spread, "chunk_bytes": chunk_bytes}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(_POLICY, profile, network, cross_step)
    base = base_planner(profile, network, cross_step=cross)
    return _plan(problem(profile, network, cross_step=cross), base, options)

  scheduler.__name__ = _POLICY
  scheduler.__qualname__ = _POLICY
  return scheduler


# --------------------------------------------------------------------------------------------------
# The plan


def _plan(prob: Problem, base: Schedule, options: dict[str, Any]) -> Schedule:
  options = {**options, "base": dict(base.options).get("candidate", base.policy)}
  max_defer = options["max_defer"]

  def lossless(decision: str) -> Schedule:
    return dataclasses.replace(base, policy=_POLICY, options=tuple({**options, "decision": decision}.items()))

  if max_defer == 0:
    return lossless("lossless: max_defer=0")
  if not prob.live:
    return lossless("lossless: nothing to send")
  arrays = schedule_arrays(prob, base.buckets)
  compute = iteration_s(prob, arrays.ready_s, np.zeros(arrays.ready_s.size), arrays.tail_s)
  t0 = float(base.predicted_s)
  if t0 <= compute * (1 + _HIDDEN_TOL):
    return lossless("lossless: communication hidden")
  if typical_costs(prob)[1] <= 0:
    return lossless("lossless: no per-byte cost to save")
  best_buckets, best_t = base.buckets, t0
  total = sum(prob.size)
  for level in [f for f in _LADDER if f < max_defer] + [max_defer]:
    buckets, t = _search(prob, base, math.floor(level * total), compute, options)
    if t < best_t * (1 - 1e-9):
      best_buckets, best_t = buckets, t
  if best_buckets is base.buckets:
    return lossless("lossless: deferral did not shorten the predicted iteration")
  s = Schedule(buckets=best_buckets, rows=base.rows, policy=_POLICY, cross_step=base.cross_step,
               predicted_s=best_t)
  options["decision"] = f"defer {s.max_deferred_fraction:.4f} of the elements per step"
  return dataclasses.replace(s, options=tuple(options.items()))


def _search(prob: Problem, base: Schedule, budget: int, compute: float,
            options: dict[str, Any]) -> tuple[tuple[Bucket, ...], float]:
  """The budget rounds (module docstring, steps 3-5) with at most `budget` elements deferred per
  step: the best buckets found and their simulated iteration (base's if nothing beat it)."""
  a_eff, b_eff = typical_costs(prob)
  chunks = base.chunks
  layer = prob.row_layer
  priority = [min(int(layer[r]) for r, _, _ in c.slices) for c in chunks]
  spread, chunk_bytes = options["spread"], options["chunk_bytes"]
  groups: dict[int, tuple[Chunk | None, Bucket]] = {}   # auto's chunk i -> (its rest, its group)
  want: dict[int, int] = {}                             # elements deferred from chunk i
  best_buckets, best_t = base.buckets, float(base.predicted_s)
  buckets = base.buckets
  for _ in range(_MAX_ROUNDS):
    arr = schedule_arrays(prob, buckets)
    period, exposed = _critical_period(prob, arr, a_eff, b_eff, compute)
    if exposed <= compute * _HIDDEN_TOL:
      break
    sizes = [(1 if groups[i][0] is not None else 0) + groups[i][1].slots if i in groups else 1
             for i in range(len(chunks))]
    origin = np.repeat(np.arange(len(chunks)), sizes)
    touched = sorted({int(origin[k]) for k in period}, key=lambda i: (-priority[i], -i))
    need = min(exposed / b_eff, budget / 4 * max(prob.itemsize))   # bytes this round
    added, changed = 0.0, False
    for i in touched:
      c = chunks[i]
      isz = itemsize(c.dtype)
      left = budget - sum(g.deferred_size for j, (_, g) in groups.items() if j != i)
      most = min(c.size // spread, left)
      parts = 1 if chunk_bytes is None else max(1, math.ceil(most * isz / chunk_bytes))
      if b_eff * most * isz <= spread * parts * a_eff:
        continue        # it can never pay for its start-ups: (spread - 1)·k slots and the rest
      have = want.get(i, 0)
      x = min(c.size // spread, have + math.ceil((need - added) / isz), left)
      if x <= have:
        continue
      made = _group(prob, c, x, spread, chunk_bytes, left)
      if made is None:
        continue
      gain = made[1].deferred_size - (groups[i][1].deferred_size if i in groups else 0)
      if gain <= 0:
        continue
      groups[i], want[i], changed = made, x, True
      added += gain * isz
      if added >= need:
        break
    if not changed:
      break
    buckets = _buckets(base.buckets, groups)
    t = simulate_arrays(prob, schedule_arrays(prob, buckets), events=False).iteration_s
    if t < best_t * (1 - 1e-9):
      best_buckets, best_t = buckets, t
  return best_buckets, best_t


def _group(prob: Problem, chunk: Chunk, x: int, spread: int, chunk_bytes: int | None,
           left: int) -> tuple[Chunk | None, Bucket] | None:
  """(the rest of `chunk`, a deferral group of its spread·x least important elements), deferring
  about x elements per step and at most `left`; None if no such group fits.

  The carved elements are taken from the chunk's slices of the highest layer index first (back
  layers: the last the next forward needs), the latest slice first, from its end; the rest keeps
  the chunk's order. The group: m = spread·k equal parts, k = 1 or ceil(x / parts of at most
  `chunk_bytes`); more parts (smaller) while its k largest parts exceed `left`.
  """
  per = None if chunk_bytes is None else max(1, chunk_bytes // itemsize(chunk.dtype))
  k = 1 if per is None else max(1, math.ceil(x / per))
  n = min(chunk.size, spread * x)
  slices = list(chunk.slices)
  order = sorted(range(len(slices)), key=lambda j: (-int(prob.row_layer[slices[j][0]]), -j))
  carved: list[Slice] = []
  rest = dict(enumerate(slices))
  need = n
  for j in order:
    if need == 0:
      break
    r, a, b = slices[j]
    take = min(need, b - a)
    carved.append((r, b - take, b))
    if take == b - a:
      del rest[j]
    else:
      rest[j] = (r, a, b - take)
    need -= take
  m = spread * k
  while m <= min(_MAX_GROUP_CHUNKS, n):
    base, extra = divmod(n, m)
    if k * base + min(k, extra) <= left:
      group = Bucket(chunks=tuple(Chunk(slices=tuple(p), dtype=chunk.dtype)
                                  for p in _equal_parts(carved, m)), defer=k)
      remainder = [rest[j] for j in sorted(rest)]
      return (Chunk(slices=tuple(remainder), dtype=chunk.dtype) if remainder else None), group
    m += 1
  return None


def _equal_parts(slices: Sequence[Slice], m: int) -> list[list[Slice]]:
  """The slices' elements, concatenated in order, cut into m consecutive parts as equal as possible
  (sizes differ by at most one element, the larger first), each part as (row, start, stop) slices."""
  sizes = [b - a for _, a, b in slices]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
  base, extra = divmod(offsets[-1], m)
  parts, lo = [], 0
  for p in range(m):
    hi = lo + base + (1 if p < extra else 0)
    parts.append([(r, a + max(lo, o) - o, a + min(hi, o + n) - o)
                  for (r, a, _), o, n in zip(slices, offsets, sizes) if o < hi and o + n > lo])
    lo = hi
  return parts


def _critical_period(prob: Problem, arr: Any, a_eff: float, b_eff: float,
                     compute: float) -> tuple[list[int], float]:
  """(the messages of the busy period that ends with the critical message, its exposed time).

  The critical message maximises end + tail (what must follow its end) at the typical costs; its
  exposed time is that value over `compute`. The busy period: the messages on its link before it
  with no idle gap (with overlap=False every earlier message, since each one stalls the device).
  """
  n = arr.ready_s.size
  if n == 0:
    return [], 0.0
  dur = a_eff + b_eff * arr.nbytes
  start, end, link, _, _ = link_loop(arr.ready_s.tolist(), dur.tolist(), backward_s=prob.backward_s,
                                     links=prob.links, overlap=prob.overlap)
  value = np.asarray(end) + arr.tail_s
  crit = int(np.argmax(value))
  exposed = float(value[crit]) - compute
  if not prob.overlap:
    return list(range(crit + 1)), exposed
  period = [crit]
  first = start[crit]
  for k in range(crit - 1, -1, -1):
    if link[k] != link[crit]:
      continue
    if end[k] < first - 1e-12 * max(1.0, abs(first)):
      break
    period.append(k)
    first = start[k]
  return period, exposed


def _buckets(base: Sequence[Bucket], groups: dict[int, tuple[Chunk | None, Bucket]]) -> tuple[Bucket, ...]:
  """auto's buckets, each of its chunks i in `groups` replaced, in place, by its rest (a lossless
  chunk, if any) and then its deferral group (the bucket around them split there)."""
  out: list[Bucket] = []
  i = 0
  for b in base:
    kept: list[Chunk] = []
    for c in b.chunks:
      if i in groups:
        rest, group = groups[i]
        if rest is not None:
          kept.append(rest)
        if kept:
          out.append(Bucket(chunks=tuple(kept)))
          kept = []
        out.append(group)
      else:
        kept.append(c)
      i += 1
    if kept:
      out.append(Bucket(chunks=tuple(kept)))
  return tuple(out)
