"""The `dlcp` policy: layer-prioritised chunks, a per-step send budget, bounded deferral (pure numpy;
docs/design.md, "The policies", "dlcp").
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._values._checks import check_bool, check_bytes, check_int, check_max_defer, check_number
from .._values._errors import DeferralWarning
from .._planning._core import (Problem, equal_ranges, iteration_s, link_loop, problem, schedule_arrays,
                               typical_costs)
from .._values._network import NetworkModel
from .._values._schedule import Bucket, Chunk, Schedule
from .._planning._simulate import simulate_arrays
from .._values._types import GradientProfile, itemsize
from ._auto import auto
from ._base import Scheduler, Slice
from ._common import check_inputs

_POLICY = "dlcp"
# How a decision that deferral was asked for, was possible to time, and found nothing starts.
_NOTHING_PAYS = "lossless: no deferral of at most"
# Communication counts as hidden when the lossless plan is within this fraction of compute only.
_HIDDEN_TOL = 0.01
# Budget rounds per level (each one simulation), and the ladder of budget levels below max_defer.
_MAX_ROUNDS = 16
_LADDER = (0.02, 0.05, 0.1, 0.25, 0.5)
# At most this many parts per deferral group.
_MAX_GROUP_CHUNKS = 1024
# The searches run at every budget level (docs/design.md, "The policies", dlcp step 4): spread-2
# groups that may take a whole message or pass their rest to a neighbour, sized a round's need or the
# budget at once; and issue 18's search (spread-4 groups, their rest its own message, a round's need
# at a time).
_STRATEGIES = ({"spreads": (2,), "legacy": False}, {"spreads": (4,), "legacy": True},
               {"spreads": (2,), "legacy": True})
# The fraction of a deferred chunk's residual each send carries (`Bucket.release`), by default.
RELEASE = 0.05
# Levels tried above max_defer to say from which one deferral would pay (only when none does).
_WHY_LEVELS = (0.25, 0.5, 0.75)


def dlcp(*, max_defer: float = 0.0, spread: int | None = None, chunk_bytes: int | None = None,
         all_layers: bool = False, release: float = RELEASE) -> Scheduler:
  """DLCP in software: layer-prioritised chunks, a per-step send budget, bounded deferral.

  auto's plan with up to `max_defer` of the elements per step in deferral groups where communication is
  exposed; deferred values are kept and sent later, damped (docs/design.md, "The policies", "dlcp").

  Args:
    max_defer: the largest fraction of the elements that may wait each step, in [0, 1); 0 (the
      default) is lossless: the plan is auto's.
    spread: parts per deferred part of a group (>= 2); None: the faster of 2 and 4.
    chunk_bytes: the largest part of a deferral group, bytes; None: one deferred part per group.
    all_layers: let the first and the last layer (in priority order) wait too.
    release: the fraction of a residual each later send carries, in (0, 1] (default 0.05).

  Returns:
    A Scheduler; the options record the arguments, `base` and `decision` (how much it defers, or why
    not), which `Schedule.describe()` prints.

  Raises:
    TypeError, ValueError: a bad option, named. Warns `DeferralWarning` when nothing within the budget
    pays although communication is exposed.

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

  References:
    H. Wang et al., DLCP, arXiv:2008.08445, 2020 (as MLT, NSDI 2024); COVAP, 2023; E. Warraich et al.,
    OptiReduce, NSDI 2025; Y. Peng et al., ByteScheduler, SOSP 2019 (issues #339, #370).
  """
  max_defer = check_max_defer("dlcp()", max_defer)
  spread = check_int("dlcp", "spread", spread, lo=2, none=True,
                     fix="A group defers k of its spread x k parts, at most half, so each deferred part "
                     "is sent the next step; e.g. 4, or None to let the planner choose.")
  check_bool("dlcp", "all_layers", all_layers)
  release = check_number("dlcp", "release", release, lo=0, hi=1, lo_open=True,
                         fix="It is the fraction of a deferred chunk's residual each send carries: 1 sends "
                         "all of it at the next step, 0.05 (the default) damps the late part.")
  chunk_bytes = check_bytes(_POLICY, "chunk_bytes", chunk_bytes,
                            hint="Try None (one deferred part per group) or 4 * 2**20.")
  base_planner = auto()
  options = {"max_defer": max_defer, "spread": spread, "chunk_bytes": chunk_bytes, "all_layers": all_layers,
             "release": release}

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False) -> Schedule:
    cross = check_inputs(_POLICY, profile, network, cross_step)
    base = base_planner(profile, network, cross_step=cross)
    s = _plan(problem(profile, network, cross_step=cross), base, options)
    decision = dict(s.options)["decision"]
    if max_defer > 0 and not s.defers and decision.startswith(_NOTHING_PAYS):
      frame, level = sys._getframe(), 1   # the warning names the first frame outside prophet_jax
      while frame is not None and frame.f_globals.get("__name__", "").startswith("prophet_jax"):
        frame, level = frame.f_back, level + 1
      warnings.warn(f"dlcp(max_defer={max_defer:g}) defers nothing although communication is exposed: "
                    f"{decision[len('lossless: '):]}. The plan is auto's (lossless); Schedule.describe() "
                    f"repeats this.", DeferralWarning, stacklevel=level)
    return s

  scheduler.__name__ = scheduler.__qualname__ = _POLICY
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
    return lossless(f"lossless: communication hidden (auto's plan predicts {_time(t0)}, compute alone "
                    f"{_time(compute)})")
  if typical_costs(prob)[1] <= 0:
    return lossless("lossless: no per-byte cost to save")
  may_wait = _may_wait(prob, options["all_layers"])
  if not any(may_wait[r] for r in prob.live):
    return lossless(f"{_NOTHING_PAYS} {max_defer:g} of the elements can wait: only the first and the last layer "
                    f"hold elements, and they never wait (dlcp(all_layers=True) lets them)")
  total = sum(prob.size)
  best_buckets, best_t = base.buckets, t0
  for level in [f for f in _LADDER if f < max_defer] + [max_defer]:
    for strategy in _strategies(options):
      buckets, t = _search(prob, base, math.floor(level * total), compute, options, strategy, may_wait)
      if t < best_t * (1 - 1e-9):
        best_buckets, best_t = buckets, t
  if best_buckets is base.buckets:
    return lossless(_why_not(prob, base, compute, options, may_wait))
  # the release changes when deferred values reach the optimizer, not what the link carries: set last
  best_buckets = tuple(dataclasses.replace(b, release=options["release"]) if b.defer else b
                       for b in best_buckets)
  s = Schedule(buckets=best_buckets, rows=base.rows, policy=_POLICY, cross_step=base.cross_step,
               predicted_s=best_t)
  f = s.max_deferred_fraction
  why = ""
  if f < max_defer * (1 - 0.01):
    why = "; no larger deferral found predicts a shorter iteration"
    if not options["all_layers"] and not all(may_wait[r] for r in prob.live):
      why += " (the first and the last layer never wait: dlcp(all_layers=True) lets them)"
  options["decision"] = (f"defer {f:.4f} of the elements per step (max_defer {max_defer:g}): predicted "
                         f"{_time(best_t)} against auto's {_time(t0)}{why}")
  return dataclasses.replace(s, options=tuple(options.items()))


def _why_not(prob: Problem, base: Schedule, compute: float, options: dict[str, Any],
             may_wait: np.ndarray) -> str:
  """Why no deferral within max_defer shortens the iteration, and from which max_defer one would."""
  a_eff, b_eff = typical_costs(prob)
  total = sum(prob.size)
  t0 = float(base.predicted_s)
  budget = math.floor(options["max_defer"] * total)
  saves = b_eff * budget * max(prob.itemsize)
  if saves <= a_eff:
    reason = (f"holding back {budget} elements would save at most {_time(saves)} on the link, less than "
              f"the {_time(a_eff)} start-up of the one more all-reduce a deferral group costs unless it "
              f"takes a whole message's place")
  else:
    reason = ("no deferral group tried (spread 2 or 4; the rest of its chunk alone or merged into a "
              "neighbour) made the simulated iteration shorter")
  if not options["all_layers"] and not all(may_wait[r] for r in prob.live):
    reason += "; the first and the last layer never wait (dlcp(all_layers=True) lets them)"
  text = (f"{_NOTHING_PAYS} {options['max_defer']:g} of the elements shortens the predicted iteration "
          f"(auto's {_time(t0)}): {reason}")
  for level in [x for x in _WHY_LEVELS if x > options["max_defer"]]:
    buckets, t = min((_search(prob, base, math.floor(level * total), compute, options, strategy, may_wait)
                      for strategy in _strategies(options)), key=lambda z: z[1])
    if t < t0 * (1 - 1e-9):
      got = Schedule(buckets=buckets, rows=base.rows).max_deferred_fraction
      return f"{text}; with max_defer={level:g} it would defer {got:.4f} of the elements for a predicted {_time(t)}"
  return f"{text}; nor would any max_defer up to {_WHY_LEVELS[-1]:g}"


def _time(seconds: float) -> str:
  """A duration for a message: 'us' below a millisecond, 'ms' below a second, else 's'."""
  if seconds < 1e-3:
    return f"{seconds * 1e6:.4g} us"
  return f"{seconds * 1e3:.4g} ms" if seconds < 1 else f"{seconds:.4g} s"


def _strategies(options: dict[str, Any]) -> list[dict[str, Any]]:
  """`_STRATEGIES`, each once with the spreads it would use (a `spread` option makes some the same)."""
  out = []
  for st in _STRATEGIES:
    st = {**st, "spreads": (options["spread"],) if options["spread"] is not None else st["spreads"]}
    if st not in out:
      out.append(st)
  return out


def _may_wait(prob: Problem, all_layers: bool) -> np.ndarray:
  """Per row: may it be deferred? All but the first and the last layer's rows (with more than two layers),
  or all with `all_layers`.
  """
  n = len(prob.layers)
  if all_layers or n <= 2:
    return np.ones(len(prob.size), dtype=bool)
  return (prob.row_layer > 0) & (prob.row_layer < n - 1)


@dataclasses.dataclass(frozen=True)
class _Mod:
  """What became of one of auto's chunks: the elements asked of it, its deferral group, its lossless rest
  (own message, merged into chunk `into`, or none).
  """

  x: int
  group: Bucket
  rest: tuple[Slice, ...]
  into: int | None


def _search(prob: Problem, base: Schedule, budget: int, compute: float, options: dict[str, Any],
            strategy: dict[str, Any], may_wait: np.ndarray) -> tuple[tuple[Bucket, ...], float]:
  """The budget rounds (steps 3-5) with at most `budget` elements deferred per step: the best buckets and
  their iteration (base's if nothing beat it).
  """
  a_eff, b_eff = typical_costs(prob)
  chunks = base.chunks
  priority = [min(int(prob.row_layer[r]) for r, _, _ in c.slices) for c in chunks]
  mods: dict[int, _Mod] = {}
  best_buckets, best_t = base.buckets, float(base.predicted_s)
  buckets, origin = base.buckets, list(range(len(chunks)))

  def simulated(trial: dict[int, _Mod]) -> tuple[tuple[Bucket, ...], list[int], float]:
    bk, org = _buckets(base.buckets, chunks, trial)
    return bk, org, simulate_arrays(prob, schedule_arrays(prob, bk), events=False).iteration_s

  for _ in range(_MAX_ROUNDS):
    period, exposed = _critical_period(prob, schedule_arrays(prob, buckets), a_eff, b_eff, compute)
    if exposed <= compute * _HIDDEN_TOL:
      break
    touched = sorted({origin[k] for k in period}, key=lambda i: (-priority[i], -i))
    need = min(exposed / b_eff, budget / 4 * max(prob.itemsize))   # bytes this round
    added, changed = 0.0, False
    for i in touched:
      if any(m.into == i for j, m in mods.items() if j != i):
        continue        # it holds another chunk's rest
      left = budget - sum(m.group.deferred_size for j, m in mods.items() if j != i)
      have = mods[i].x if i in mods else 0
      want = have + math.ceil((need - added) / itemsize(chunks[i].dtype))
      held = mods[i].group.deferred_size if i in mods else 0
      trials = [(*simulated({**mods, i: v}), v)
                for v in _variants(prob, chunks, i, want, left, mods, options, strategy, may_wait, a_eff, b_eff)
                if v.x > have and v.group.deferred_size > held]
      if not trials:
        continue
      buckets, origin, t, v = min(trials, key=lambda z: (z[2], z[3].group.deferred_size))
      added += (v.group.deferred_size - held) * itemsize(chunks[i].dtype)
      mods[i], changed = v, True
      if t < best_t * (1 - 1e-9):
        best_buckets, best_t = buckets, t
      if added >= need:
        break
    if not changed:
      break
  return best_buckets, best_t


def _variants(prob: Problem, chunks: Sequence[Chunk], i: int, want: int, left: int,
              mods: dict[int, _Mod], options: dict[str, Any], strategy: dict[str, Any],
              may_wait: np.ndarray, a_eff: float, b_eff: float) -> list[_Mod]:
  """The ways to defer about `want` elements (at most `left`) from auto's chunk i that could pay for their
  start-ups at the typical costs (step 4).
  """
  c = chunks[i]
  isz = itemsize(c.dtype)
  eligible = sum(b - a for r, a, b in c.slices if may_wait[r])
  if eligible < 2 or left < 1:
    return []
  neighbours = [j for j in (i + 1, i - 1)
                if 0 <= j < len(chunks) and j not in mods and chunks[j].dtype == c.dtype]
  tries: list[tuple[int, int, int, int]] = []   # (spread, elements carved, x asked, most it may defer)
  for spread in strategy["spreads"]:
    most = min(eligible // spread, left)
    if most < 1:
      continue
    if strategy["legacy"]:
      parts = 1 if options["chunk_bytes"] is None else max(1, math.ceil(most * isz / options["chunk_bytes"]))
      if b_eff * most * isz <= spread * parts * a_eff:
        continue      # issue 18's gate: it can never pay for its start-ups (slots and the rest)
    x = max(1, min(want, most))
    tries.append((spread, min(eligible, spread * x), x, most))
    if not strategy["legacy"]:
      tries.append((spread, min(eligible, spread * most), most, most))
  if not strategy["legacy"]:
    spread = options["spread"] or max(2, math.ceil(eligible / max(1, left)))
    tries.append((spread, eligible, eligible // spread, eligible // spread))
  out: list[_Mod] = []
  for spread, n, x, most in dict.fromkeys(tries):
    made = _group(prob, c, n, spread, options["chunk_bytes"], left, may_wait)
    if made is None:
      continue
    group, rest = made
    for into in ([None, *neighbours] if rest and not strategy["legacy"] else [None]):
      added = group.slots + (1 if rest and into is None else 0) - 1
      if strategy["legacy"] or b_eff * most * isz > a_eff * added:    # it can pay for its start-ups
        out.append(_Mod(x=x, group=group, rest=rest, into=into))
  return out


def _group(prob: Problem, chunk: Chunk, n: int, spread: int, chunk_bytes: int | None, left: int,
           may_wait: np.ndarray) -> tuple[Bucket, tuple[Slice, ...]] | None:
  """(a deferral group of n of `chunk`'s elements that may wait, the rest of its slices), or None when no
  group defers at most `left` elements per step.
  """
  per = None if chunk_bytes is None else max(1, chunk_bytes // itemsize(chunk.dtype))
  k = 1 if per is None else max(1, math.ceil(n / spread / per))
  slices = list(chunk.slices)
  order = sorted((j for j in range(len(slices)) if may_wait[slices[j][0]]),
                 key=lambda j: (-int(prob.row_layer[slices[j][0]]), -j))
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
  n -= need
  m = spread * k
  while m <= min(_MAX_GROUP_CHUNKS, n):
    size, extra = divmod(n, m)
    if k * size + min(k, extra) <= left:
      group = Bucket(chunks=tuple(Chunk(slices=tuple(p), dtype=chunk.dtype)
                                  for p in _equal_parts(carved, m)), defer=k)
      return group, tuple(rest[j] for j in sorted(rest))
    m += 1
  return None


def _equal_parts(slices: Sequence[Slice], m: int) -> list[list[Slice]]:
  """The slices' elements cut into m consecutive parts as equal as possible (the larger first), as slices."""
  sizes = [b - a for _, a, b in slices]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
  return [[(r, a + max(lo, o) - o, a + min(hi, o + n) - o)
           for (r, a, _), o, n in zip(slices, offsets, sizes) if o < hi and o + n > lo]
          for lo, hi in equal_ranges(offsets[-1], m)]


def _critical_period(prob: Problem, arr: Any, a_eff: float, b_eff: float,
                     compute: float) -> tuple[list[int], float]:
  """(the messages of the busy period ending with the critical message, its exposed time), at the typical
  costs.
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


def _buckets(base: Sequence[Bucket], chunks: Sequence[Chunk],
             mods: dict[int, _Mod]) -> tuple[tuple[Bucket, ...], list[int]]:
  """auto's buckets with each chunk in `mods` replaced by its rest and its deferral group; also the auto
  chunk each issued message comes from.
  """
  merged: dict[int, list[Slice]] = {}
  for m in mods.values():
    if m.into is not None and m.rest:
      merged.setdefault(m.into, []).extend(m.rest)
  out: list[Bucket] = []
  origin: list[int] = []
  i = 0
  for b in base:
    kept: list[Chunk] = []
    for _ in b.chunks:
      c = chunks[i]
      if i in mods:
        m = mods[i]
        if m.rest and m.into is None:
          kept.append(Chunk(slices=m.rest, dtype=c.dtype))
          origin.append(i)
        if kept:
          out.append(Bucket(chunks=tuple(kept)))
          kept = []
        out.append(m.group)
        origin.extend([i] * m.group.slots)
      else:
        kept.append(Chunk(slices=c.slices + tuple(merged.get(i, ())), dtype=c.dtype) if i in merged else c)
        origin.append(i)
      i += 1
    if kept:
      out.append(Bucket(chunks=tuple(kept)))
  return tuple(out), origin
