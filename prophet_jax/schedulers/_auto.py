"""The `auto` policy: the best predicted schedule among every baseline's plans, a joint optimiser's and a
local search's (pure numpy; docs/design.md, "The policies", "auto").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._values._checks import check_bool, check_int, check_number
from .._planning._core import Problem, chunk_arrays, objective_s, problem, search_problem, split_by_dtype
from .._values._network import NetworkModel
from .._values._schedule import Schedule
from .._planning._sharded import sharded_arrays
from .._planning._simulate import chunk_links, simulate_arrays, simulate_sharded
from .._values._types import GradientProfile
from ._base import Scheduler
from ._bucket import bucket
from ._common import Groups, buckets_from_groups, check_inputs, make_schedule
from ._dear import plan_sharded, sharded_schedule
from ._fsdp import fsdp_schedule, plan_fsdp, prediction
from ._joint import SearchChunk, chunk_stats, contiguous_dp, make_chunk, own_candidates
from ._mgwfbp import mgwfbp
from ._priority import priority
from ._prophet import prophet
from ._search import iterated_local_search, local_search
from ._wfbp import wfbp
from ._xla import xla

_POLICY = "auto"
# Local search: schedules of at most _SMALL chunks and _SLICES slices get the rich neighbourhood (move a
# chunk or a slice anywhere, random kicks): a descent from each of the best _STARTS distinct ones, then
# kicks in the best _KICKED local optima.
_SMALL = 24
_SLICES = 400
_STARTS = 12
_KICKED = 3
# Robust choice: the exact-tail grid points of the best few candidates are replanned per network.
_ROBUST_POINTS = 3
_INF = math.inf
# With sharded=True, the sharded plan wins only when predicted faster than the best all-reduce plan by
# more than this fraction: a tie (within the model's rounding) keeps the optimizer state's layout.
_SHARDED_MARGIN = 1e-3


# --------------------------------------------------------------------------------------------------
# The factory


def auto(*, search_options: bool = True, local_search: bool = True, max_evals: int = 30000,
         robust: float = 0.0, robust_tol: float = 0.02, verify: bool = True,
         sharded: bool = False) -> Scheduler:
  """The best predicted schedule: every policy's option search plus a joint optimiser.

  The rules: docs/design.md, "The policies", "auto".

  Args:
    search_options: also plan the baselines over a grid of their options.
    local_search: refine the best candidates by merging, splitting, swapping and moving chunks.
    max_evals: evaluations the local search may spend (deterministic; a few microseconds each).
    robust: how far off (relative) alpha and beta may be; above 0, the minimax-regret candidate.
    robust_tol: the predicted time (relative) the robust choice may give up.
    verify: compute `predicted_s` with the simulator's own run.
    sharded: also weigh `dear`'s sharded plan (ZeRO-1), returned where faster by more than 0.1%.

  Returns:
    A Scheduler; ``cross_step`` may be False, True or ``"auto"`` (the faster mode, recorded).

  Raises:
    TypeError, ValueError: a bad option, named.

  Examples:
    >>> import prophet_jax as pj
    >>> prof = pj.GradientProfile.from_rows(
    ...     [dict(path=f"w{i}", layer=f"l{i}", shape=(1000,), dtype="float32", nbytes=4000,
    ...           ready_s=0.0001 * (4 - i)) for i in range(4)], forward_s=0.0, backward_s=0.0004)
    >>> auto()(prof, pj.NetworkModel.preset("10gbe", workers=8), cross_step=False).num_allreduces  # merged
    1

  References:
    S. Shi et al., MG-WFBP, INFOCOM 2019; Z. Zhang et al., Prophet, ICPP 2021; Y. Peng et al.,
    ByteScheduler, SOSP 2019.
  """
  for name, value in (("search_options", search_options), ("local_search", local_search),
                      ("verify", verify), ("sharded", sharded)):
    check_bool("auto", name, value)
  check_int("auto", "max_evals", max_evals, lo=1, fix="It is a number of evaluations, e.g. 3000.")
  for name, value, hi in (("robust", robust, 0.9), ("robust_tol", robust_tol, 1.0)):
    check_number("auto", name, value, lo=0, hi=hi, fix=f"e.g. {0.3 if name == 'robust' else 0.02}.")
  options = {"search_options": search_options, "local_search": local_search, "max_evals": max_evals,
             "robust": float(robust), "robust_tol": float(robust_tol), "verify": verify}
  if sharded:            # recorded only when set, so the options of every other auto plan are unchanged
    options["sharded"] = True

  def scheduler(profile: GradientProfile, network: NetworkModel, *, cross_step: bool | str = False
                ) -> Schedule:
    if cross_step == "auto" and isinstance(cross_step, str):
      check_inputs(_POLICY, profile, network, False)
      modes = (False, True)
    else:
      modes = (check_inputs(_POLICY, profile, network, cross_step),)
    if sharded and profile.sharded:
      return _fsdp_candidate(profile, network, modes, options)
    cands: list[tuple[float, Any]] = []     # (predicted iteration, a thunk building the Schedule)
    for cross in modes:
      contest = _contest(profile, network, cross, options)
      cands.append((contest[2], lambda c=contest: _schedule(profile, *c, options)))
      if sharded and network.links == 1:
        one = _sharded_candidate(profile, network, cross, options)
        if one is not None:
          cands.append((one[0] / (1 - _SHARDED_MARGIN), one[1]))
    return min(cands, key=lambda c: c[0])[1]()

  scheduler.__name__ = scheduler.__qualname__ = "auto"
  return scheduler


# --------------------------------------------------------------------------------------------------
# The contest


def _baselines(prob: Problem) -> list[tuple[str, Scheduler]]:
  """(label, scheduler) of every baseline at its defaults (labels without parentheses) and over a grid of
  its options.
  """
  mib = 2**20
  item = max(prob.itemsize) if prob.itemsize else 4
  out: list[tuple[str, Scheduler]] = [("wfbp", wfbp()), ("xla", xla()), ("mgwfbp", mgwfbp()),
                                      ("bucket", bucket()), ("priority", priority()),
                                      ("prophet", prophet())]
  out += [(f"bucket(bucket_bytes={mb}MiB)", bucket(bucket_bytes=mb * mib)) for mb in (1, 4, 16, 64, 128)]
  # priority's partitions of 2**22 and 2**24 parameters (the default is 2**20), credit 4x
  out += [(f"priority(partition_bytes={p * item}, credit_bytes={4 * p * item})",
           priority(partition_bytes=p * item, credit_bytes=4 * p * item)) for p in (2**22, 2**24)]
  out.append(("prophet(gap_factor=4.0)", prophet(gap_factor=4.0)))  # prophet tunes its other knobs
  return out


class _Candidate:
  """A candidate: a baseline's groups or the joint optimiser's chunks, with its arrays and predictions; only
  the chosen one becomes a Schedule.
  """

  __slots__ = ("label", "_chunks", "_groups", "_slices", "default_baseline", "arrays", "nominal", "point", "_prob")

  def __init__(self, prob: Problem, label: str, chunks: list[SearchChunk] | None = None,
               groups: Groups | None = None, default_baseline: bool = False,
               point: tuple | None = None):
    self.label = label
    self._prob = prob
    self._chunks = chunks
    self._groups = groups
    self.default_baseline = default_baseline
    self.point = point
    if chunks is None:
      # a group is one bucket with one chunk (one all-reduce) per dtype, as the baseline's Schedule has
      self._slices = [c for g in groups for c in split_by_dtype(prob.dtype.__getitem__, g)]
      self.arrays = chunk_arrays(prob, self._slices)[:3]
    else:
      self._slices = None
      self.arrays = chunk_stats(chunks)
    self.nominal = objective_s(prob, *self.arrays)

  @property
  def chunks(self) -> list[SearchChunk]:
    """The candidate as search chunks (built from a baseline's plan when first asked)."""
    if self._chunks is None:
      self._chunks = [make_chunk(self._prob, c) for c in self._slices]
    return self._chunks

  def slices(self) -> list[Sequence[tuple[int, int, int]]]:
    """Each chunk's slices, in issue order."""
    return self._slices if self._slices is not None else [c.slices for c in self._chunks]

  def groups(self) -> Groups:
    """The candidate's buckets as groups of slices: a baseline's own grouping, else one per chunk."""
    return self._groups if self._groups is not None else self.slices()


def _small(c: _Candidate) -> bool:
  """Small enough for the rich neighbourhood: at most _SMALL chunks and _SLICES slices."""
  return len(c.slices()) <= _SMALL and sum(len(x.slices) for x in c.chunks) <= _SLICES


def _refine(search: Problem, prob: Problem, cands: list[_Candidate], budget: int) -> list[_Candidate]:
  """The local search's improvements on the ranked candidates within `budget` evaluations, searched on
  `search` and scored on `prob`.
  """
  out: list[_Candidate] = []

  def start_value(c: _Candidate) -> float:
    return c.nominal if search is prob else objective_s(search, *c.arrays)

  if not _small(cands[0]):
    refined, v = iterated_local_search(search, cands[0].chunks, max(1, budget // 10), False)
    if v < start_value(cands[0]) * (1 - 1e-12):
      out.append(_Candidate(prob, cands[0].label + "+local", refined, point=cands[0].point))
  starts, seen = [], set()
  for c in cands:
    if len(starts) == _STARTS:
      break
    if c.nominal not in seen and _small(c):
      seen.add(c.nominal)
      starts.append(c)
  if not starts:
    return out
  share = max(1, budget // (2 * len(starts)))
  optima = []
  for c in starts:
    chunks, v, _ = local_search(search, c.chunks, share, True)
    optima.append((v, len(optima), c, chunks))
  optima.sort(key=lambda x: x[:2])
  kicked = optima[:_KICKED]
  share = max(1, (budget - budget // 2) // len(kicked))
  for v, _, c, chunks in kicked:
    refined, v2 = iterated_local_search(search, chunks, share, True)
    if v2 < start_value(c) * (1 - 1e-12):
      out.append(_Candidate(prob, c.label + "+local", refined, point=c.point))
  return out


def _contest(profile: GradientProfile, network: NetworkModel, cross: bool,
             options: dict[str, Any]) -> tuple[Problem, _Candidate, float]:
  """(the problem, the chosen candidate, its predicted iteration) for one step mode, every candidate scored
  on the network given.
  """
  prob = problem(profile, network, cross_step=cross)
  search = search_problem(prob)
  cands: list[_Candidate] = []
  baselines = _baselines(prob)
  if not options["search_options"]:
    baselines = [(label, s) for label, s in baselines if "(" not in label]
  for label, sched in baselines:
    cands.append(_Candidate(prob, label, groups=sched.plan_groups(profile, network, cross),
                            default_baseline="(" not in label))
  searches = [search]
  if search is not prob:   # under pressure: the baselines at the typical costs, and the calm network too
    for label, sched in baselines:
      cands.append(_Candidate(prob, label + "@typical", groups=sched.plan_groups(profile, search.network, cross)))
    searches.append(problem(profile, network.replace(pressure=None), cross_step=cross))
  for where in searches:
    suffix = "" if where is search else "@calm"
    for label, chunks, point in own_candidates(where, cross):
      cands.append(_Candidate(prob, label + suffix, chunks, point=point))
  cands.sort(key=lambda c: c.nominal)
  # With one link, no contiguous merge beats the plain step's DP and no other order or cut helps (on the
  # calm problem the search runs on).
  if options["local_search"] and prob.overlap and prob.live and (cross or prob.links > 1):
    cands += _refine(search, prob, cands, options["max_evals"])
    cands.sort(key=lambda c: c.nominal)
  chosen = cands[0]
  if options["robust"] > 0 and prob.live and len(cands) > 1:
    chosen = _robust_choice(prob, cands, options)
  predicted = (simulate_arrays(prob, chunk_arrays(prob, chosen.slices()), events=False).iteration_s
               if options["verify"] else chosen.nominal)
  return prob, chosen, predicted


def _schedule(profile: GradientProfile, prob: Problem, chosen: _Candidate, predicted: float,
              options: dict[str, Any]) -> Schedule:
  """The one Schedule of `auto`: the chosen candidate's buckets, prediction and links."""
  links = chunk_links(prob, chunk_arrays(prob, chosen.slices())) if prob.links > 1 else ()
  return make_schedule(buckets_from_groups(profile, chosen.groups()), profile, policy=_POLICY,
                       options=dict(options, candidate=chosen.label), cross_step=prob.cross_step,
                       predicted_s=predicted, links=links)


def _sharded_candidate(profile: GradientProfile, network: NetworkModel, cross: bool,
                       options: dict[str, Any]) -> tuple[float, Any] | None:
  """(predicted iteration, a thunk building the Schedule) of the `dear` plan for one step mode; None when
  nothing is sent.
  """
  prob = problem(profile, network, cross_step=cross)
  label, chunks, gathers, _ = plan_sharded(prob)
  if not chunks:
    return None
  predicted = simulate_sharded(prob, sharded_arrays(prob, chunks, gathers), events=False).iteration_s
  return predicted, lambda: sharded_schedule(profile, chunks, gathers, cross_step=cross, policy=_POLICY,
                                             options=dict(options, candidate=f"dear:{label}"),
                                             predicted_s=predicted)


def _fsdp_candidate(profile: GradientProfile, network: NetworkModel, modes: tuple[bool, ...],
                    options: dict[str, Any]) -> Schedule:
  """The fastest `fsdp` plan (no memory cap) over the step modes, as auto's Schedule."""
  plans = [(plan_fsdp(problem(profile, network, cross_step=cross), None), cross) for cross in modes]
  one, cross = min(plans, key=lambda p: p[0].iteration)
  return fsdp_schedule(profile, one, options=dict(options, candidate=f"fsdp:{one.label}"), cross_step=cross,
                       budget=None, policy=_POLICY,
                       predicted_s=prediction(problem(profile, network, cross_step=cross), one))


# --------------------------------------------------------------------------------------------------
# The robust choice


def _robust_choice(prob: Problem, cands: list[_Candidate], options: dict[str, Any]) -> _Candidate:
  """The minimax-regret candidate over the planning network and the four corners of the `robust` box."""
  network, cross = prob.network, prob.cross_step
  # (alpha factor, beta factor, network) of each corner: `network`'s alpha and beta each off by up to `robust`
  lo, hi = 1 / (1 + options["robust"]), 1 / (1 - options["robust"])
  scenarios = [(fa, fb, network.replace(alpha_s=network.alpha_s * fa, beta_s_per_byte=network.beta_s_per_byte * fb))
               for fa in (lo, hi) for fb in (lo, hi)]
  probs = [problem(prob.profile, n, cross_step=cross) for _, _, n in scenarios]
  top_points = list(dict.fromkeys(c.point for c in cands if c.point is not None))[:_ROBUST_POINTS]
  if prob.overlap:
    cands.append(_Candidate(prob, "contiguous-dp-hedged",
                            contiguous_dp(search_problem(prob), [search_problem(p).network for p in [prob] + probs])))
  for (fa, fb, _), si in zip(scenarios, probs):
    for label, chunks, _ in own_candidates(search_problem(si), cross, grid=top_points):
      if label != "one-per-dtype":
        cands.append(_Candidate(prob, f"{label}@alpha*{fa:.2f},beta*{fb:.2f}", chunks))
  times = np.array([[c.nominal] + [objective_s(si, *c.arrays) for si in probs] for c in cands])
  worst = (times / np.maximum(times.min(axis=0), 1e-300)).max(axis=1)   # each one's regret against the best
  limit = min((c.nominal for c in cands if c.default_baseline), default=_INF) * (1 + options["robust_tol"])
  ok = [i for i, c in enumerate(cands) if c.nominal <= limit * (1 + 1e-12)] or [0]
  return cands[min(ok, key=lambda i: (worst[i], cands[i].nominal))]
