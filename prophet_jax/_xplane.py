"""Reading a jax.profiler trace (.xplane.pb) of one compiled step: which op made which leaf, and when.

Used by `_profile` (`method='measured'`):
  step_hlo(text) -> StepHlo             the optimized module: instructions, operands, op_name metadata,
                                        the ENTRY ROOT's operands (the gradient leaves, in output order)
  op_events(trace_dir, module)          the module's XLA op events in a trace directory
  executions(events)                    grouped per (run, device), in time order
  analyse_execution(ex, hlo, ...)       forward/backward spans, per-leaf ready times, per-layer forward
  match_layer(op_name, layers)          the layer an op belongs to, from flax's name stack
  median_envelope(events)               the median span of a run over every device

An op's name stack marks backward ops with `transpose(...)` and forward ops with `jvp(...)`.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

from ._hlo import parse_hlo

# --------------------------------------------------------------------------------------------------
# HLO text (parsed by _hlo): instructions, operands, op_name metadata


@dataclasses.dataclass
class Instr:
  name: str
  comp: str
  operands: list[str]
  op_name: str
  calls: list[str]


@dataclasses.dataclass
class StepHlo:
  module: str
  instrs: dict[str, Instr]
  comps: dict[str, list[str]]
  entry: str
  root_operands: list[str]


def step_hlo(text: str) -> StepHlo:
  """The optimized module as the trace analysis reads it: instructions by name (HLO names are unique
  in a module), operands within their own computation, called computations, and the ENTRY ROOT's
  operands (the gradient leaves, in output order)."""
  m = parse_hlo(text)
  instrs: dict[str, Instr] = {}
  comps: dict[str, list[str]] = {}
  root_operands: list[str] = []
  for comp, body in m.computations.items():
    names = {i.name for i in body}
    comps[comp] = [i.name for i in body]
    for i in body:
      instrs[i.name] = Instr(name=i.name, comp=comp, operands=[o for o in i.operands if o in names],
                              op_name=i.op_name, calls=[c for _, c in i.callees])
      if i.root and comp == m.entry:
        root_operands = list(i.operands) if i.opcode == "tuple" else [i.name]
  return StepHlo(module=m.name, instrs=instrs, comps=comps, entry=m.entry, root_operands=root_operands)


def is_backward(op_name: str) -> bool:
  return "transpose(" in op_name


def segments(op_name: str) -> list[str]:
  out = []
  for seg in op_name.split("/"):
    seg = seg.strip()
    while True:
      m = re.match(r"^(?:transpose|jvp|jit|vmap|remat|checkpoint|pjit|custom_jvp|custom_vjp)\((.*)\)$", seg)
      if not m:
        break
      seg = m.group(1)
    if seg:
      out.append(seg)
  return out


def match_layer(op_name: str, layers: Sequence[str]) -> str | None:
  """The layer whose path (its longest suffix) appears as consecutive segments of the op's name."""
  segs = segments(op_name)
  best, best_len = None, 0
  for layer in layers:
    comps = layer.split("/")
    for start in range(len(comps)):
      suf = comps[start:]
      if len(suf) <= best_len:
        break
      k = len(suf)
      if any(segs[j:j + k] == suf for j in range(len(segs) - k + 1)):
        best, best_len = layer, k
        break
  return best


# --------------------------------------------------------------------------------------------------
# Profiler trace


def op_events(trace_dir: str, module: str) -> list[dict[str, Any]]:
  """XLA op events of `module` in the trace: dicts with op, start_ns, end_ns, run, device."""
  import jax

  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  out: list[dict[str, Any]] = []
  for f in files:
    pd = jax.profiler.ProfileData.from_file(f)
    for plane in pd.planes:
      for line in plane.lines:
        for ev in line.events:
          st = dict(ev.stats)
          if st.get("hlo_module") != module or "hlo_op" not in st:
            continue
          run = st.get("run_id", f"{plane.name}/{line.name}")
          out.append({"op": st["hlo_op"], "start_ns": float(ev.start_ns),
                      "end_ns": float(ev.start_ns + ev.duration_ns), "run": run,
                      "device": st.get("device_ordinal", plane.name)})
  return out


def executions(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
  groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
  for e in events:
    groups.setdefault((e["run"], e["device"]), []).append(e)
  return [sorted(g, key=lambda e: e["start_ns"])
          for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]


def backward_start(ex: list[dict[str, Any]], hlo: StepHlo) -> float | None:
  """When backward starts in one execution (ns), or None when no op is a backward op.

  XLA may schedule small backward ops (e.g. the loss's scatter-add set-up) before the forward ends,
  and rematerialised forward ops run inside backward. So backward starts at the first backward op
  after which at most 5% of the forward ops' time remains.
  """
  kinds = []
  for e in ex:
    name = hlo.instrs[e["op"]].op_name if e["op"] in hlo.instrs else ""
    kinds.append("b" if is_backward(name) else ("f" if "jvp(" in name else "o"))
  if "b" not in kinds:
    return None
  dur = [e["end_ns"] - e["start_ns"] for e in ex]
  remaining = sum(d for d, k in zip(dur, kinds) if k == "f")
  budget = 0.05 * remaining
  for e, k, d in zip(ex, kinds, dur):
    if k == "b" and remaining <= budget:
      return e["start_ns"]
    if k == "f":
      remaining -= d
  return None


def analyse_execution(ex: list[dict[str, Any]], hlo: StepHlo, leaf_rows: list[int], n_rows: int,
                      layers_in_order: Sequence[str]
                      ) -> tuple[float, float, list[float], dict[str, float]] | None:
  """(forward_s, backward_s, ready_s per row, fwd_s per layer) of one execution, or None."""
  if not ex:
    return None
  t0 = ex[0]["start_ns"]
  t_end = max(e["end_ns"] for e in ex)
  b0 = backward_start(ex, hlo)
  if b0 is None:
    return None
  ends: dict[str, float] = {}
  for e in ex:
    ends[e["op"]] = max(ends.get(e["op"], 0.0), e["end_ns"])

  memo: dict[str, float] = {}

  def own_end(name: str, depth: int = 0) -> float | None:
    if name in ends:
      return ends[name]
    ins = hlo.instrs.get(name)
    if ins is None or depth > 4:
      return None
    vals = [v for c in ins.calls for i in hlo.comps.get(c, []) if (v := own_end(i, depth + 1)) is not None]
    return max(vals) if vals else None

  def ready(name: str) -> float:
    if name in memo:
      return memo[name]
    memo[name] = t0  # cycle guard
    v = own_end(name)
    if v is None:
      ins = hlo.instrs.get(name)
      ops = ins.operands if ins else []
      v = max((ready(o) for o in ops), default=t0)
    memo[name] = v
    return v

  if len(hlo.root_operands) != len(leaf_rows):
    return None
  bwd_s = max(t_end - b0, 0.0)
  rows = [0.0] * n_rows
  for out_name, r in zip(hlo.root_operands, leaf_rows):
    if r >= 0:
      rows[r] = min(max(ready(out_name) - b0, 0.0), bwd_s)
  # forward time per layer: each op before backward starts, from the previous op's end to its end
  fwd = dict.fromkeys(layers_in_order, 0.0)
  current = layers_in_order[0]
  prev = t0
  for e in ex:
    if e["start_ns"] >= b0:
      break
    ins = hlo.instrs.get(e["op"])
    lay = match_layer(ins.op_name, layers_in_order) if ins else None
    if lay is not None:
      current = lay
    end = min(e["end_ns"], b0)
    fwd[current] += max(end - prev, 0.0)
    prev = max(prev, end)
  fwd[current] += max(b0 - prev, 0.0)
  return (b0 - t0) * 1e-9, bwd_s * 1e-9, [x * 1e-9 for x in rows], {k: v * 1e-9 for k, v in fwd.items()}


def median_envelope(events: list[dict[str, Any]]) -> float:
  """Median over runs of (last op end - first op start) across every device of the run, seconds."""
  runs: dict[Any, list[float]] = {}
  for e in events:
    lo_hi = runs.setdefault(e["run"], [math.inf, -math.inf])
    lo_hi[0] = min(lo_hi[0], e["start_ns"])
    lo_hi[1] = max(lo_hi[1], e["end_ns"])
  spans = [(hi - lo) * 1e-9 for lo, hi in runs.values() if hi > lo]
  return statistics.median(spans) if spans else 0.0
