"""FSDP steps of k micro-batches: the timeline and the collectives of one step (pure numpy; docs/fsdp.md,
"Accumulation").
"""

from __future__ import annotations

import numpy as np

from ._core import Problem
from ._fsdp import FsdpArrays, FsdpRun, fsdp_run, skew_wait

def accum_run(prob: Problem, arr: FsdpArrays, k: int, *, spans: bool = False) -> FsdpRun:
  """k micro-batches one after another and the update once (docs/fsdp.md, "Accumulation"): the held groups
  gathered by the first, the held units reduce-scattered by the last; what they hold counts for the whole step.
  """
  if k == 1:
    return fsdp_run(prob, arr, spans=spans)
  tail = arr.update_s + skew_wait(prob, arr)
  held = sum(b for b, h in zip(arr.unit_bytes, arr.held) if h) + sum(b for b, h in zip(arr.rs_bytes, arr.rs_held) if h)
  t = comm = peak = 0.0
  out: list[tuple[str, str, float, float, str]] = []
  runs: dict[tuple[bool, bool], FsdpRun] = {}
  for m in range(k):
    role = (m == 0, m == k - 1)
    if role not in runs:
      runs[role] = fsdp_run(prob, arr, spans=spans, micro=role)
    r = runs[role]
    out += [(kd, f"{name}@{m}", a + t, b + t, lane) for kd, name, a, b, lane in r.spans if kd != "update"]
    t, comm, peak = t + r.iteration_s - tail, comm + r.comm_s, max(peak, r.peak_memory_bytes)
  if spans and arr.update_s > 0:
    out.append(("update", "update", t, t + arr.update_s, "device"))
  return FsdpRun(t + tail, peak + held, comm, out)


def accum_counts(arr: FsdpArrays, k: int) -> tuple[int, int, float]:
  """(all-gathers, reduce-scatters, bytes all-gathered) per step of k micro-batches."""
  held = arr.held or (False,) * len(arr.unit_bytes)
  rs_held = arr.rs_held or (False,) * len(arr.rs_bytes)
  per = [1 if h else k * (1 + (r and not kp)) for h, r, kp in zip(held, arr.reads, arr.keep)]
  return (sum(per), sum(1 if h else k for h in rs_held), float(np.dot(per, arr.unit_bytes)) if per else 0.0)
