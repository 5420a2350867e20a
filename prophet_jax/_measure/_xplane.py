"""Reading a jax.profiler trace of one compiled step: its executions, and when each op made each leaf."""

from __future__ import annotations

import bisect
import dataclasses
import glob
import gzip
import math
import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

import jax

from ._step_hlo import StepHlo, layer_index, is_backward
from .._values._errors import ProfileError

# --------------------------------------------------------------------------------------------------
# Profiler trace


_TRACE_SUFFIXES = (".xplane.pb", ".xplane.pb.gz")


def trace_files(trace: str | os.PathLike[str]) -> list[str]:
  """The `.xplane.pb` (or `.xplane.pb.gz`) files of a trace file or directory; FileNotFoundError if none."""
  path = os.fspath(trace)
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    raise FileNotFoundError(f"trace {path!r}: no such file or directory; pass the .xplane.pb file that "
                            f"jax.profiler.trace wrote, or the directory it wrote into.")
  files = sorted(f for suffix in _TRACE_SUFFIXES
                 for f in glob.glob(os.path.join(path, "**", "*" + suffix), recursive=True))
  if not files:
    raise FileNotFoundError(f"trace directory {path!r} holds no .xplane.pb file; pass the directory given "
                            f"to jax.profiler.trace (it writes plugins/profile/<run>/<host>.xplane.pb).")
  return files


def _load(path: str) -> Any:
  try:
    if path.endswith(".gz"):
      with gzip.open(path, "rb") as f:
        return jax.profiler.ProfileData.from_serialized_xspace(f.read())
    return jax.profiler.ProfileData.from_file(path)
  except (RuntimeError, ValueError, OSError, EOFError) as e:   # jax's "Failed to parse XSpace", gzip's
    raise ProfileError(
        f"trace {path!r} is not a profiler trace ({type(e).__name__}: {str(e)[:120]}): a trace is the "
        f".xplane.pb file that jax.profiler.trace(dir) writes under dir/plugins/profile/<run>/ (serialized "
        f"XSpace protobuf, optionally gzipped); pass that file or the directory given to jax.profiler.trace."
    ) from None


@dataclasses.dataclass
class Trace:
  """The op events of some modules in a trace, each tied to its execution where the trace says how.

  Attributes:
    events: module -> op events, dicts of `op`, `start_ns`, `end_ns`, `run` (a run_id, a (file, run_id) of
      a host launch, or a segment), `device`, `program`, `module`.
    launches: module -> the host's launches of it; linked: module -> 'run_id', 'host launch' or 'segments'.
  """

  events: dict[str, list[dict[str, Any]]]
  launches: dict[str, int]
  linked: dict[str, str]
  platform: str
  files: list[str]
  modules: dict[str, int] = dataclasses.field(default_factory=dict)
  device_name: str = ""


_EXEC_NAME = re.compile(r"Execute\s*\(([^)]*)\)")


def read_trace(trace: str | os.PathLike[str], modules: Sequence[str]) -> Trace:
  """The op events of `modules` in a trace file or directory, tied to their executions (one pass)."""
  files = trace_files(trace)
  wanted = set(modules)
  events: dict[str, list[dict[str, Any]]] = {m: [] for m in modules}
  runs_of: dict[str, set[Any]] = {m: set() for m in modules}
  platform, device_name = "cpu", ""
  counts: dict[str, int] = {}
  # per device: (start_ns, module) of every op event of any module (segment boundaries)
  timeline: dict[Any, list[tuple[float, str]]] = {}
  for fi, f in enumerate(files):
    pd = _load(f)
    prefix = f"{fi}:" if len(files) > 1 else ""
    launch_at: dict[Any, tuple[int, float]] = {}          # correlation_id -> (line key, start)
    scopes: dict[int, list[tuple[float, float, Any, str]]] = {}  # line -> (start, end, run_id, module)
    dev_events: list[tuple[dict[str, Any], Any]] = []   # (event, correlation_id): events without a run_id
    line_key = 0
    for plane in pd.planes:
      is_device = plane.name.startswith("/device:")
      if plane.name.startswith("/device:GPU"):
        platform = "gpu"
        device_name = device_name or str(dict(plane.stats).get("gpu_device_name", ""))
      for line in plane.lines:
        line_key += 1
        for ev in line.events:
          st = dict(ev.stats)
          mod = st.get("hlo_module")
          start = float(ev.start_ns)
          if mod is not None and "hlo_op" in st:
            dev = f"{prefix}{plane.name if is_device else st.get('device_ordinal', plane.name)}"
            timeline.setdefault(dev, []).append((start, mod))
            counts[mod] = counts.get(mod, 0) + 1
            if mod not in wanted:
              continue
            e = {"op": st["hlo_op"], "start_ns": start, "end_ns": start + float(ev.duration_ns),
                 "run": st.get("run_id"), "device": dev, "program": st.get("program_id"), "module": mod}
            events[mod].append(e)
            if e["run"] is None:
              dev_events.append((e, st.get("correlation_id")))
            continue
          if is_device:
            continue
          if "correlation_id" in st:
            launch_at[st["correlation_id"]] = (line_key, start)
          if "run_id" in st:
            name = st.get("name") or st.get("module_name")
            if not isinstance(name, str):
              em = _EXEC_NAME.search(ev.name)
              name = em.group(1) if em else ""
            if name in wanted:
              scopes.setdefault(line_key, []).append((start, start + float(ev.duration_ns), st["run_id"], name))
              runs_of[name].add((prefix, st["run_id"]))
    scopes[-1] = [x for k, v in scopes.items() for x in v]   # every line's, for _launched_in's second look
    for v in scopes.values():
      v.sort()
    starts = {k: [s[0] for s in v] for k, v in scopes.items()}
    for e, corr in dev_events:
      hit = launch_at.get(corr) if corr is not None else None
      rid = _launched_in(hit, e["module"], scopes, starts) if hit is not None else None
      if rid is not None:
        e["run"] = (prefix, rid)
  # an event still without a run was not tied to a launch
  linked = {m: "segments" if any(e["run"] is None for e in evs) else
            "host launch" if all(isinstance(e["run"], tuple) for e in evs) else "run_id"
            for m, evs in events.items() if evs}
  if "segments" in linked.values():
    _segment(events, timeline, linked)
  return Trace(events=events, launches={m: len(r) for m, r in runs_of.items() if r}, linked=linked,
               platform=platform, files=files, modules=counts, device_name=device_name)


def _launched_in(hit: tuple[int, float], module: str, scopes: dict[int, list[tuple[float, float, Any, str]]],
                 starts: dict[int, list[float]]) -> Any:
  """The run_id of the host's Execute event of `module` that holds a kernel's launch `hit`, or None."""
  line, t = hit
  for key, back in ((line, 3), (-1, 64)):
    j = bisect.bisect_right(starts.get(key, []), t) - 1
    for s, end, rid, name in reversed(scopes.get(key, [])[max(j - back, 0):j + 1]):
      if s <= t <= end and name == module:
        return rid
  return None


def _segment(events: dict[str, list[dict[str, Any]]], timeline: dict[Any, list[tuple[float, str]]],
             linked: dict[str, str]) -> None:
  """Runs for events tied to no launch: a device's execution ends where another program ran on it."""
  cut = [m for m, how in linked.items() if how == "segments"]
  bounds: dict[tuple[Any, str], list[float]] = {}
  for dev, tl in timeline.items():
    tl.sort()
    for m in cut:  # starts of the module's ops that follow another module's op: execution boundaries
      bounds[(dev, m)] = [t for (t, mm), (_, prev) in zip(tl[1:], tl) if mm == m and prev != m]
  for m in cut:
    for e in events[m]:
      e["run"] = ("segment", bisect.bisect_right(bounds.get((e["device"], m), []), e["start_ns"]))


def executions(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
  groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
  for e in events:
    groups.setdefault((e["run"], e["device"]), []).append(e)
  return sorted((sorted(g, key=lambda e: e["start_ns"]) for g in groups.values()),
                key=lambda g: (g[0]["start_ns"], str(g[0]["device"])))


def backward_start(ex: list[dict[str, Any]], hlo: StepHlo) -> float | None:
  """When backward starts in one execution: the first backward op after which <= 5% of forward remains."""
  names = [hlo.instrs[e["op"]].op_name if e["op"] in hlo.instrs else "" for e in ex]
  kinds = ["b" if is_backward(name) else ("f" if "jvp(" in name else "o") for name in names]
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
                      layers_in_order: Sequence[str], *, outputs: Sequence[str] | None = None
                      ) -> tuple[float, float, list[float], dict[str, float]] | None:
  """(forward_s, backward_s, ready_s per row, fwd_s per layer) of one execution, or None."""
  outputs = list(hlo.root_operands if outputs is None else outputs)
  b0 = backward_start(ex, hlo) if ex and len(outputs) == len(leaf_rows) else None
  if b0 is None:
    return None
  t0, t_end = ex[0]["start_ns"], max(e["end_ns"] for e in ex)
  ends: dict[str, float] = {}
  for e in ex:
    ends[e["op"]] = max(ends.get(e["op"], 0.0), e["end_ns"])

  def own_end(name: str, depth: int = 0) -> float | None:
    if name in ends:
      return ends[name]
    ins = hlo.instrs.get(name)
    if ins is None or depth > 4:
      return None
    vals = [v for c in ins.calls for i in hlo.comps.get(c, []) if (v := own_end(i, depth + 1)) is not None]
    return max(vals) if vals else None

  memo: dict[str, float] = {}

  def ready(name: str) -> float:
    if name in memo:
      return memo[name]
    memo[name] = t0  # cycle guard
    v = own_end(name)
    if v is None:
      ins = hlo.instrs.get(name)
      ops = ins.operands if ins else []
      if ins is not None and ins.opcode == "get-tuple-element" and ins.index is not None and ops:
        src = hlo.instrs.get(ops[0])
        if src is not None and src.opcode == "tuple" and own_end(src.name) is None \
           and ins.index < len(src.operands):
          ops = [src.operands[ins.index]]  # one element of a tuple, not all of it
      v = max((ready(o) for o in ops), default=t0)
    memo[name] = v
    return v

  bwd_s = max(t_end - b0, 0.0)
  rows = [0.0] * n_rows
  for out_name, r in zip(outputs, leaf_rows):
    if r >= 0:
      rows[r] = min(max(ready(out_name) - b0, 0.0), bwd_s)
  # forward time per layer: each op before backward starts, from the previous op's end to its end
  fwd = dict.fromkeys(layers_in_order, 0.0)
  index = layer_index(tuple(layers_in_order))
  current = layers_in_order[0]
  prev = t0
  for e in ex:
    if e["start_ns"] >= b0:
      break
    ins = hlo.instrs.get(e["op"])
    lay = index.match(ins.op_name) if ins is not None else None
    if lay is not None:
      current = lay
    end = min(e["end_ns"], b0)
    fwd[current] += max(end - prev, 0.0)
    prev = max(prev, end)
  fwd[current] += max(b0 - prev, 0.0)
  return (b0 - t0) * 1e-9, bwd_s * 1e-9, [x * 1e-9 for x in rows], {k: v * 1e-9 for k, v in fwd.items()}


def median_envelope(events: list[dict[str, Any]]) -> float:
  runs: dict[Any, list[float]] = {}
  for e in events:
    lo_hi = runs.setdefault(e["run"], [math.inf, -math.inf])
    lo_hi[0] = min(lo_hi[0], e["start_ns"])
    lo_hi[1] = max(lo_hi[1], e["end_ns"])
  spans = [(hi - lo) * 1e-9 for lo, hi in runs.values() if hi > lo]
  return statistics.median(spans) if spans else 0.0


# --------------------------------------------------------------------------------------------------
# Every execution of a step, their medians, and the checks that keep a wrong trace from passing


@dataclasses.dataclass
class Analysis:
  """The medians over a step's executions in a trace, what it held, and why they cannot be trusted."""

  forward_s: float
  backward_s: float
  ready_s: list[float]
  fwd_layer: dict[str, float]
  executions: int
  found: int
  devices: int
  events: int
  held: str
  problems: list[str]


def select_program(events: list[dict[str, Any]], hlo: StepHlo) -> tuple[list[dict[str, Any]], str]:
  """The events of the one compiled program `hlo` is (a module name may name several)."""
  by_prog: dict[Any, list[dict[str, Any]]] = {}
  for e in events:
    by_prog.setdefault(e.get("program"), []).append(e)
  if len(by_prog) <= 1:
    return events, ""
  fits = {p: v for p, v in by_prog.items() if all(e["op"] in hlo.instrs for e in v)}
  pick = max(fits or by_prog, key=lambda p: len((fits or by_prog)[p]))
  return by_prog[pick], (f"{len(by_prog)} programs named {hlo.module!r} in the trace; used program_id "
                         f"{pick} ({len(by_prog[pick])} events{'' if fits else ', some ops not in the HLO'})")


def analyse(events: list[dict[str, Any]], hlo: StepHlo, leaf_rows: list[int], n_rows: int,
            layers_in_order: Sequence[str], *, outputs: Sequence[str] | None = None,
            expected: int | None = None, expected_why: str = "", row_layers: Sequence[str] | None = None
            ) -> Analysis:
  """Every execution of the step in `events`, the medians over them, and what makes them implausible."""
  events, prog_note = select_program(events, hlo)
  groups = executions(events)
  devices = len({e["device"] for e in events})
  problems: list[str] = []
  notes = [prog_note] if prog_note else []
  # an execution the profiler caught in part (it started or stopped inside it) runs fewer ops
  sizes = [len(g) for g in groups]
  if len(groups) > 1:
    typical = statistics.median(sizes)
    whole = [g for g in groups if len(g) >= 0.9 * typical]
    if len(whole) < len(groups):
      notes.append(f"{len(groups) - len(whole)} execution(s) with under 90% of the typical "
                   f"{typical:.0f} ops dropped (caught in part by the profiler)")
    groups = whole
  results = [r for g in groups
             if (r := analyse_execution(g, hlo, leaf_rows, n_rows, layers_in_order, outputs=outputs))
             is not None]
  held = (f"the trace held {len(events)} op events of {hlo.module!r} in {len(sizes)} execution(s) on "
          f"{devices} device(s)" + (f" ({'; '.join(notes)})" if notes else ""))
  if expected is not None and len(sizes) != expected:
    problems.append(f"{len(sizes)} execution(s) found where {expected} were traced{expected_why}")
  if not results:
    problems.append("no execution had backward ops (op names under transpose(...)) to map")
    return Analysis(0.0, 0.0, [0.0] * n_rows, dict.fromkeys(layers_in_order, 0.0), 0, len(sizes), devices,
                    len(events), held, problems)
  forward_s = statistics.median(r[0] for r in results)
  backward_s = statistics.median(r[1] for r in results)
  ready = [statistics.median(r[2][k] for r in results) for k in range(n_rows)]
  fwd_layer = {l: statistics.median(r[3][l] for r in results) for l in layers_in_order}
  if backward_s < 0.1 * forward_s:
    problems.append(f"backward {backward_s * 1e3:.3f} ms is under a tenth of forward {forward_s * 1e3:.3f} ms "
                    f"(a backward pass costs about twice its forward)")
  n_layers = len(set(row_layers or ()))
  if n_layers >= 3 and backward_s > 0:
    tol = 1e-3 * backward_s
    order = sorted(range(n_rows), key=lambda k: ready[k])
    best_layers: set[str] = set()
    best_rows = lo = 0
    for hi in range(n_rows):  # the most layers whose rows fall in one window of width tol
      while ready[order[hi]] - ready[order[lo]] > tol:
        lo += 1
      window = {row_layers[order[k]] for k in range(lo, hi + 1)}
      if len(window) > len(best_layers):
        best_layers, best_rows = window, hi - lo + 1
    if len(best_layers) > n_layers / 2:
      problems.append(f"{best_rows} of {n_rows} gradients ({len(best_layers)} of {n_layers} layers) are "
                      f"ready within {tol * 1e6:.2f} us of each other (backward {backward_s * 1e3:.3f} ms)")
  return Analysis(forward_s, backward_s, ready, fwd_layer, len(results), len(sizes), devices, len(events),
                  held, problems)
