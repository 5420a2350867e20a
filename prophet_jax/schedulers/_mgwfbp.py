"""MG-WFBP: merged-gradient wait-free backpropagation (Shi, Chu, Li).

Pure: numpy only, never jax.
"""

from __future__ import annotations

from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler
from ._common import Groups, grouped_scheduler, layer_groups, whole_slice

POLICY = "mgwfbp"


def _cost_s(network: NetworkModel, bytes_by_dtype: dict[str, int]) -> float:
  """All-reduce time of a merged group: one all-reduce (a + b·M) per dtype it holds; 0 when empty."""
  return sum(network.allreduce_s(nb) for nb in bytes_by_dtype.values() if nb > 0)


def merge_groups(ready_s: list[float], bytes_by_dtype: list[dict[str, int]],
                 network: NetworkModel) -> list[list[int]]:
  """MG-WFBP's merge rule over units (layers) given in ready order; returns the merged runs of units.

  Notation of the paper, with units indexed in ready order (u = 0 is the paper's layer L, ready first):
  r(u) is the unit's ready time (τ_b + t_b in the paper), t_c(u) its all-reduce time (a + b·M per
  dtype, 0 once merged away) and τ_c(u) = max(τ_c(u−1) + t_c(u−1), r(u)) the start of its all-reduce.
  Going from the first-ready unit to the last, unit u is merged into the next one (u + 1, the paper's
  layer l − 1) when its all-reduce has not finished by r(u + 1), i.e. r(u + 1) < τ_c(u) + t_c(u), and
  either it has not started yet (τ_c(u) > r(u + 1)) or it started less than `a` before r(u + 1)
  (r(u + 1) − τ_c(u) < a): waiting that long costs less than a second start-up. After a merge t_c is
  recomputed and τ_c with it. Since τ_c(v) for v <= u does not depend on t_c(u), recomputing τ_c from u
  on, lazily during the same sweep, is the paper's full recomputation in O(L) instead of O(L²).

  Args:
    ready_s: r(u) per unit, non-decreasing.
    bytes_by_dtype: bytes of each unit per dtype.
    network: gives a = `startup_s` and b = `per_byte_s`.

  Returns:
    Runs of consecutive unit indices; each run is one merged group.
  """
  n = len(ready_s)
  a = network.startup_s
  merged = [dict(b) for b in bytes_by_dtype]
  groups: list[list[int]] = []
  group: list[int] = []
  comm_start = ready_s[0] if n else 0.0  # τ_c(u) of the current unit
  for u in range(n):
    group.append(u)
    cost = _cost_s(network, merged[u])
    if u + 1 < n:
      nxt = ready_s[u + 1]
      do_merge = False
      if cost > 0 and nxt < comm_start + cost:  # u's all-reduce still running (or waiting) at r(u+1)
        do_merge = comm_start > nxt or nxt - comm_start < a
      if do_merge:
        for d, nb in merged[u].items():
          merged[u + 1][d] = merged[u + 1].get(d, 0) + nb
        merged[u] = {}
        cost = 0.0
      else:
        groups.append(group)
        group = []
      comm_start = max(comm_start + cost, nxt)
  if group:
    groups.append(group)
  return groups


def mgwfbp() -> Scheduler:
  """MG-WFBP's merge rule: merge a layer's all-reduce into the next one when that saves a start-up.

  Layers (the profile rows' `layer`) are the units, taken in ready order (a layer is ready when its last
  row is), with a = `network.startup_s` (2(P−1)·alpha_s) and b = `network.per_byte_s`. See
  `merge_groups` for the rule and its recurrences; it is the paper's Algorithm (merge when the earlier
  all-reduce is still running at the later layer's ready time and r(l−1) − τ_c(l) < a), read
  literally. It is not optimal (brute force over contiguous merges beats it on some instances) but never
  slower than WFBP or a single bucket in the paper's model. Each merged group is one bucket, with one
  all-reduce per dtype. The rule assumes communication overlaps backward (the paper's setting); it is
  applied unchanged when `network.overlap` is False, and the plan is the same for both step modes
  (`cross_step` is only recorded).

  Returns:
    A Scheduler: `scheduler(profile, network, *, cross_step) -> Schedule`.

  References:
    Shi, Chu, Li, "MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD Algorithms",
    IEEE INFOCOM 2019; extended in IEEE TPDS 2021 ("MG-WFBP: Merging Gradients Wisely for Efficient
    Communication in Distributed Deep Learning").
  """

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    layers = layer_groups(profile)
    ready = [t for _, _, t in layers]
    nbytes = []
    for _, rows, _ in layers:
      d: dict[str, int] = {}
      for r in rows:
        row = profile.rows[r]
        if row.nbytes:
          d[row.dtype] = d.get(row.dtype, 0) + row.nbytes
      nbytes.append(d)
    groups = []
    for run in merge_groups(ready, nbytes, network):
      groups.append([s for u in run for r in layers[u][1] if (s := whole_slice(profile, r)) is not None])
    return groups

  return grouped_scheduler(POLICY, {}, plan_groups)
