"""MG-WFBP: merged-gradient wait-free backpropagation (pure numpy)."""

from __future__ import annotations

from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler
from ._common import Groups, grouped_scheduler, layer_groups, whole_slice

POLICY = "mgwfbp"


def merge_groups(ready_s: list[float], bytes_by_dtype: list[dict[str, int]],
                 network: NetworkModel) -> list[list[int]]:
  """MG-WFBP's merge rule over units (layers) in ready order, in one O(L) sweep.

  The rule: docs/design.md, "The policies", "mgwfbp". `ready_s` per unit (seconds, non-decreasing),
  `bytes_by_dtype` per unit, a and b from `network`. Returns the merged runs of consecutive unit indices.
  """
  n = len(ready_s)
  a = network.startup_s
  merged = [dict(b) for b in bytes_by_dtype]
  groups: list[list[int]] = []
  group: list[int] = []
  comm_start = ready_s[0] if n else 0.0  # τ_c(u) of the current unit
  for u in range(n):
    group.append(u)
    cost = sum(network.allreduce_s(nb) for nb in merged[u].values() if nb > 0)   # one all-reduce per dtype
    if u + 1 < n:
      nxt = ready_s[u + 1]
      # merge when u's all-reduce is still running (or waiting) at r(u+1) and started late or within a of it
      if cost > 0 and nxt < comm_start + cost and (comm_start > nxt or nxt - comm_start < a):
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
  """MG-WFBP: merge a layer's all-reduce into the next one's when that saves a start-up.

  The rule: docs/design.md, "The policies", "mgwfbp". Returns a Scheduler, one bucket per merged group, the
  same plan for both step modes.

  References:
    S. Shi, X. Chu, B. Li, "MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD
    Algorithms", INFOCOM 2019; IEEE TPDS 2021.
  """

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    layers = layer_groups(profile)
    nbytes = []
    for _, rows, _ in layers:
      d: dict[str, int] = {}
      for r in rows:
        row = profile.rows[r]
        if row.nbytes:
          d[row.dtype] = d.get(row.dtype, 0) + row.nbytes
      nbytes.append(d)
    return [[s for u in run for r in layers[u][1] if (s := whole_slice(profile, r)) is not None]
            for run in merge_groups([t for _, _, t in layers], nbytes, network)]

  return grouped_scheduler(POLICY, {}, plan_groups)
