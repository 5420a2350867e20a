"""Prophet: stage-aware gradient blocks, highest priority first (pure numpy)."""

from __future__ import annotations

import heapq
import math

import numpy as np

from .._values._checks import check_number
from .._planning._core import Problem, chunk_arrays, objective_s, problem, search_problem, split_by_dtype
from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler
from ._common import Groups, grouped_scheduler

POLICY = "prophet"
# Candidate start-up fractions (a / block time) searched when `alpha_fraction` is None.
ALPHA_FRACTIONS = (0.02, 0.1, 0.5)
# Candidate growth of the blocks sent after backward, when `tail_growth` is None.
TAIL_GROWTHS = (1.0, 4.0)
MAX_BLOCKS = 512


def find_stages(ready_s: list[float], gap_factor: float) -> list[float]:
  """Start times of Prophet's stages: where the gap between consecutive distinct ready times exceeds
  `gap_factor` times the mean gap (the first at the first ready time).
  """
  times = sorted(set(ready_s))
  if len(times) < 2:
    return times[:1]
  mean_gap = (times[-1] - times[0]) / (len(times) - 1)
  starts = [times[0]]
  for prev, cur in zip(times, times[1:]):
    if cur - prev > gap_factor * mean_gap:
      starts.append(cur)
  return starts


class Planner:
  """One greedy pass of Prophet's block rule for fixed knobs, on the problem's per-row arrays."""

  def __init__(self, prob: Problem, gap_factor: float, score: Problem | None = None):
    self.prob = prob
    self.score = prob if score is None else score   # the problem its plans are scored on
    self.a = prob.startup_s
    self.b = prob.per_byte_s
    self.nbytes = [n * k for n, k in zip(prob.size, prob.itemsize)]
    self.arrivals = sorted(prob.live, key=lambda i: (prob.ready[i], -i))
    self.stage_starts = find_stages([prob.ready[i] for i in prob.live], gap_factor)
    first = np.flatnonzero(prob.row_layer == 0) if prob.layers else []
    self.first_layer_bytes = sum(self.nbytes[i] for i in first)

  def _bytes_within(self, seconds: float) -> float:
    """Bytes one all-reduce can carry in `seconds` (0 when even the start-up does not fit)."""
    return 0.0 if seconds <= self.a else math.inf if self.b == 0 else (seconds - self.a) / self.b

  def plan(self, min_block: float, tail_growth: float,
           small_first: bool = True) -> tuple[list[list[tuple[int, int, int]]], float]:
    """Blocks in issue order and their predicted iteration for one setting: `min_block` the floor on a
    block's bytes, `tail_growth` the growth after backward, `small_first` a small first block after it.
    """
    prob = self.prob
    arrivals, item, sizes, dtype_of, ready, nbytes = (self.arrivals, prob.itemsize, prob.size,
                                                      prob.dtype, prob.ready, self.nbytes)
    a, b = self.a, self.b
    n_arr = len(arrivals)
    stage_starts = self.stage_starts
    pending: list[int] = []          # heap of row indices (priority: lowest row first)
    offset: dict[int, int] = {}      # row -> first element not yet sent
    pend_bytes = 0
    blocks: list[list[tuple[int, int, int]]] = []
    t = 0.0
    k = 0                            # next arrival
    s = 0                            # next stage start index
    tail_size = None
    mixed: list[int] = []            # blocks holding several dtypes (one chunk per dtype)

    def take(budget: float) -> tuple[list[tuple[int, int, int]], float]:
      """The highest-priority pending slices up to `budget` bytes (at least one element), and their
      all-reduce time (one all-reduce per dtype)."""
      nonlocal pend_bytes
      out = []
      total = 0
      dtypes = set()
      while pending and budget > 0:
        r = pending[0]
        a0, size = offset[r], sizes[r]
        left = (size - a0) * item[r]
        if left <= budget:
          heapq.heappop(pending)
          out.append((r, a0, size))
          budget -= left
          nb = left
        else:
          cut = max(1, int(budget // item[r]))
          out.append((r, a0, a0 + cut))
          offset[r] = a0 + cut
          nb = cut * item[r]
          budget = 0
        pend_bytes -= nb
        total += nb
        dtypes.add(dtype_of[r])
      if len(dtypes) > 1:
        mixed.append(len(blocks))
      return out, len(dtypes) * a + b * total

    while k < n_arr or pending:
      while k < n_arr and ready[arrivals[k]] <= t:
        r = arrivals[k]
        heapq.heappush(pending, r)
        offset[r] = 0
        pend_bytes += nbytes[r]
        k += 1
      if not pending:
        t = ready[arrivals[k]]
        continue
      if k < n_arr:
        t_next = ready[arrivals[k]]
        while s < len(stage_starts) and stage_starts[s] <= t:
          s += 1
        new_stage = s < len(stage_starts) and stage_starts[s] <= t_next
        fit = self._bytes_within(t_next - t)   # B·Δ: what finishes before the next gradient is ready
        if pend_bytes >= min_block:
          block, cost = take(max(min_block, fit))
        elif fit >= pend_bytes:
          block, cost = take(math.inf)  # all of it ends before the next arrival: the link would idle
        elif new_stage and fit > 0:
          block, cost = take(fit)       # the stage's block: the highest priority that fits the gap
        else:
          t = t_next  # wait for the rest of the stage (saves a start-up)
          continue
      elif tail_size is None:   # every gradient has arrived: the first block after backward
        if small_first and self.first_layer_bytes:
          block, cost = take(max(1.0, min(min_block, self.first_layer_bytes)))
          tail_size = min_block
        else:
          block, cost = take(min_block)
          tail_size = min_block * tail_growth
      else:
        block, cost = take(tail_size)
        tail_size *= tail_growth
      t += cost
      blocks.append(block)
    return blocks, self._estimate(blocks, mixed)

  def _estimate(self, blocks: list[list[tuple[int, int, int]]], mixed: list[int]) -> float:
    """The iteration time of the chunks the blocks become (`mixed`: the blocks of several dtypes)."""
    prob = self.score
    if mixed:   # such a block holds one chunk (all-reduce) per dtype
      split, dtype_of = set(mixed), prob.dtype.__getitem__
      blocks = [c for k, blk in enumerate(blocks)
                for c in (split_by_dtype(dtype_of, blk) if k in split else (blk,))]
    ready, nbytes, tail, _, _ = chunk_arrays(prob, blocks)
    return objective_s(prob, ready, nbytes, tail)


def prophet(*, gap_factor: float = 2.0, alpha_fraction: float | None = None,
            tail_growth: float | None = None) -> Scheduler:
  """Prophet: blocks sized to the gaps of backward, highest-priority gradients first; knobs left None are
  chosen by predicting each candidate (docs/design.md, "The policies").

  Args:
    gap_factor: a gap larger than this multiple of the mean gap between ready times starts a stage.
    alpha_fraction: the largest share of a block's time spent on the start-up (None: chosen).
    tail_growth: growth factor (>= 1) of the blocks sent after backward (None: chosen).

  Returns:
    A Scheduler. TypeError or ValueError for an option that is not a positive number.

  References:
    Z. Zhang et al., "Prophet: Speeding up Distributed DNN Training with Predictable Communication
    Scheduling", ICPP 2021.
  """
  gap_factor = check_number(POLICY, "gap_factor", gap_factor, lo=0, lo_open=True, fix="Try 2.0.")
  alpha_fraction = check_number(POLICY, "alpha_fraction", alpha_fraction, lo=0, lo_open=True, none=True,
                                fix="Try 0.1 or None.")
  tail_growth = check_number(POLICY, "tail_growth", tail_growth, lo=1, none=True,
                             fix="Blocks after backward never shrink. Try 2.0 or None.")
  options = {"gap_factor": gap_factor, "alpha_fraction": alpha_fraction, "tail_growth": tail_growth}

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    prob = problem(profile, network, cross_step=cross_step)
    if not network.overlap:
      return [[(r, 0, prob.size[r]) for r in prob.live]]
    fracs = ALPHA_FRACTIONS if alpha_fraction is None else (alpha_fraction,)
    growths = TAIL_GROWTHS if tail_growth is None else (tail_growth,)
    best = None
    # never more than about MAX_BLOCKS blocks of the floor (a free start-up would allow any number)
    least = max(1.0, profile.total_nbytes / MAX_BLOCKS)
    # under pressure the block rule also runs at a typical message's costs (as Prophet sizes blocks
    # from measured timings); every plan is scored on the network given (`_core.objective_s`)
    search = search_problem(prob)
    planners = [Planner(prob, gap_factor)] + ([Planner(search, gap_factor, score=prob)] if search is not prob else [])
    for planner in planners:
      a, b = planner.a, planner.b
      for frac in fracs:
        floor = max(least, a / (frac * b) if b > 0 else math.inf)
        for g in growths:
          for small_first in (True, False):
            blocks, est = planner.plan(floor, g, small_first)
            if best is None or est < best[0] - 1e-15:
              best = (est, blocks)
    return best[1]

  return grouped_scheduler(POLICY, options, plan_groups)
