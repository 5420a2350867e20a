"""`audit` of an FSDP plan's step (`hooked(loss_fn, fsdp_schedule, ...)`): its collectives, labelled by the
step's named scopes, against the plan.

- `prophet/fsdp/ag<g>`: gather group g's all-gather in forward (`AuditReport.gathers`, `elements` its whole
  result), once per group;
- `prophet/fsdp/reag<g>`: the same group gathered again in backward (`AuditReport.regathers`), once for each
  group the plan does not keep, never for a kept one;
- `prophet/fsdp/rs<k>`: unit k's reduce-scatter (`AuditReport.chunks`, `collective='reduce-scatter'`,
  `elements` its whole buffer), once per unit, in the plan's chunk order;
- `prophet/fsdp/ar<k>`: HSDP: unit k's reduced shard all-reduced over the replica axes (`chunks`, kind
  'replica', `elements` the shard's), once per unit;
- `prophet/chunk<k>`: replicated leaves' chunk k all-reduced (`chunks`, `collective='all-reduce'`), read as
  an all-reduce plan's chunks are (combined with the loss's, or concatenated: `_audit`), in chunk order;
- anything else is foreign (`AuditReport.foreign`): the partitioner's own collectives, the loss's.

A scanned stack's collectives are inside loops, each named after the first layer it handles in the order it
runs (forward gathers ascending, re-gathers and reduce-scatters descending): an op run T times stands for T
layers of its stack, found from the rows' paths (`<prefix>/<k>/<rest>`), and each becomes one entry per layer
(`trips` says it came from a loop; its window is the loop body's). On an XLA:GPU program every window is read
(the compute scheduled between start and done), and the most all-gathers in flight at once
(`gathers_in_flight`) against the plan's prefetch depth: a deeper plan holds only where the user's own
compile option lets XLA keep more collectives in flight.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._audit_checks import backward_outside, is_gpu, peak_in_flight, window_ops
from ._audit_report import AuditEntry, AuditReport
from ._hlo_collectives import sharded_collectives
from .._values._schedule import Schedule

_LABEL = re.compile(r"prophet/fsdp/(ag|reag|rs)(\d+)(?![0-9])")
_REPLICA = re.compile(r"prophet/fsdp/ar(\d+)(?![0-9])")
_LAYER = re.compile(r"(?:^|/)(\d+)(?=/)")
_KINDS = {"ag": "all-gather", "reag": "all-gather", "rs": "reduce-scatter"}
DEPTH_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"


def _layer_of(paths: Sequence[str]) -> tuple[frozenset, int] | None:
  """(the stack, k) when every path is layer k of a scanned stack ('<prefix>/<k>/<rest>'), else None."""
  for m in _LAYER.finditer(paths[0]):
    k, wholes = int(m.group(1)), []
    for p in paths:
      hit = next((h for h in _LAYER.finditer(p) if int(h.group(1)) == k), None)
      if hit is None:
        break
      wholes.append(p[:hit.start()] + p[hit.end():])
    else:
      return frozenset(wholes), k
  return None


class _Layers:
  """The plan's groups and units, and which of them a loop's op runs for (a stack's layers in order)."""

  def __init__(self, schedule: Schedule):
    f, chunks, rows = schedule.fsdp, schedule.chunks, schedule.rows
    self.groups = [tuple(g) for g in f.gathers] or [tuple(r for r, _, _ in chunks[u].slices) for u in f.units]
    self.keys = [_layer_of([rows[r][0] for r in g]) for g in self.groups]
    self.at = {k: g for g, k in enumerate(self.keys) if k is not None}
    by_rows = {frozenset(g): i for i, g in enumerate(self.groups)}
    self.unit_group = {u: by_rows.get(frozenset(r for r, _, _ in chunks[u].slices)) for u in f.units}
    self.group_unit = {g: u for u, g in self.unit_group.items() if g is not None}

  def run(self, kind: str, first: int, count: int) -> list[int | None]:
    """The `count` groups (units for 'rs') an op labelled `kind<first>` runs for, in the order it runs."""
    if count == 1:
      return [first]
    g = self.unit_group.get(first) if kind == "rs" else first
    key = None if g is None or g >= len(self.keys) else self.keys[g]
    if key is None:
      return [first] + [None] * (count - 1)
    step = 1 if kind == "ag" else -1
    gs = [self.at.get((key[0], key[1] + step * t)) for t in range(count)]
    return [self.group_unit.get(x) if kind == "rs" and x is not None else x for x in gs]


def audit_fsdp(text: str, module: Any, ops: Any, after: list[int], windows: dict, costs: Any,
               schedule: Schedule, replicated: AuditReport, *, ordered: bool = True) -> AuditReport:
  """`audit` of an FSDP plan (the module docstring); `replicated` is the all-reduce audit of the same
  program (its `chunk<k>` entries and foreign all-reduces); `ordered=False`: the replicated chunks' order
  is XLA's (a keyed step), not checked."""
  f, chunks = schedule.fsdp, schedule.chunks
  layers = _Layers(schedule)
  rows = schedule.rows
  size = lambda rs: sum(_elements(rows[r][1]) for r in rs)  # noqa: E731
  expected = {"ag": [size(g) for g in layers.groups], "rs": {u: chunks[u].size for u in f.units}}
  expected["reag"] = expected["ag"]
  found = sharded_collectives(module, ops)
  coll_names = {c.op.instruction.name for c in found}
  coll_names |= {w.done.instruction.name for w in windows.values() if w.start.instruction.name in coll_names}
  out: dict[str, list[AuditEntry]] = {"ag": [], "reag": [], "rs": [], "foreign": []}
  problems: list[str] = []
  done_loops: set = set()
  for c in found:
    m = _LABEL.search(c.op_name)
    kind = m.group(1) if m and _KINDS[m.group(1)] == c.collective else None
    loop = (c.op.loops[-1:], kind, m and m.group(2))
    if kind is not None and (c.op.trips or 1) > 1:
      if loop in done_loops:
        continue
      done_loops.add(loop)
      copies = [x for x in found if x.op.loops[-1:] == loop[0] and x.op_name == c.op_name]
    else:
      copies = [c]
    trips = c.op.trips or 1
    indices = [None] if kind is None else layers.run(kind, int(m.group(2)), trips * len(copies))
    for t, index in enumerate(indices):
      x = copies[t % len(copies)]
      window = windows.get(x.op.instruction.name) if x.form.endswith("-start") else None
      sizes = expected.get(kind, [])
      want = (sizes.get(index) if isinstance(sizes, dict) else sizes[index] if index is not None
              and index < len(sizes) else None) if kind else None
      out[kind or "foreign"].append(AuditEntry(
          name=x.op.instruction.name, kind={"ag": "gather", "reag": "regather", "rs": "chunk"}.get(kind, "foreign"),
          chunk=index, label="", elements=x.out_elements if c.collective == "all-gather" else x.in_elements,
          expected_elements=want, trips=x.op.trips, position=x.op.index, backward_ops_after=after[x.op.index + 1],
          op_name=x.op_name, asynchronous=window is not None and not x.synchronous,
          window=window_ops(window, coll_names, costs), form=x.form, collective=c.collective))
      if kind and index is None:
        problems.append(f"{x.op_name.split('/')[-2]}: a loop's op run {trips} times, which the plan's layers "
                        f"do not account for (its stack has fewer layers after it, or another plan's).")
  rep = {k for k in range(len(chunks)) if k not in set(f.units)}
  ars = [e for e in replicated.chunks if e.chunk in rep]
  shards = 1
  for a, n in f.mesh:
    shards *= n if a in f.shard_axes else 1
  replica = [dataclasses.replace(e, kind="replica", chunk=u, expected_elements=None if u is None else
                                 chunks[u].size // shards)
             for e in replicated.foreign if _REPLICA.search(e.op_name)
             for u in layers.run("rs", int(_REPLICA.search(e.op_name).group(1)), e.trips or 1)]
  foreign = out["foreign"] + [e for e in replicated.chunks if e.chunk not in rep] + [
      e for e in replicated.foreign if not _REPLICA.search(e.op_name)]
  planned, k = len(layers.groups), f.micro_batches     # k micro-batches: a held group or unit once, the rest k times
  hold = {g for g, h in enumerate(f.hold_params) if h and k > 1}
  later = {f.units[u] for u, h in enumerate(f.hold_grads) if h and k > 1}
  rs_times = {u: 1 if u in later else k for u in f.units}
  if replica or len(f.mesh) > len(f.shard_axes):
    problems += _counts(replica, f.units, f.units, "unit", "all-reduce of its shard over the replica axes",
                        times=rs_times)
  problems += _counts(out["ag"], range(planned), range(planned), "group", "all-gather in forward",
                      times={g: 1 if g in hold else k for g in range(planned)})
  kept = [g for g in range(planned) if f.keep[g] or g in hold]
  again = [g for g in range(planned) if g not in kept]
  problems += _counts(out["reag"], again, range(planned), "group", "all-gather again in backward", optional=True,
                      times={g: k for g in again})
  stray = sorted({e.chunk for e in out["reag"] if e.chunk in kept})
  if stray:
    problems.append(f"group(s) {stray} are gathered again in backward, but the plan keeps them from forward: was "
                    f"the step built with another plan?")
  problems += _counts(out["rs"], f.units, f.units, "unit", "reduce-scatter", times=rs_times)
  problems += _counts(ars, sorted(rep), sorted(rep), "chunk", "all-reduce of replicated leaves",
                      times={c: k for c in rep})
  seq = [e.chunk for e in out["rs"]]
  if seq != sorted(set(f.units) - later) * k + sorted(later):
    problems.append(f"reduce-scatters run in compiled order {seq[:20]}, not in the plan's chunk order.")
  rseq = [e.chunk for e in ars]
  if ordered and rseq != sorted(rep) * k:
    problems.append(f"the replicated chunks' all-reduces run in compiled order {rseq[:20]}, not in chunk order.")
  missing = sorted(set(again) - {e.chunk for e in out["reag"]})
  warnings = []
  if missing:
    warnings.append(f"group(s) {missing[:10]} planned to be gathered again have no all-gather in backward: XLA "
                    f"removes one whose backward does not read the gathered weights (a first layer whose input "
                    f"needs no gradient).")
  gpu = is_gpu(text)
  gathers = out["ag"] + out["reag"]
  depth = peak_in_flight(ops, {e.name for e in gathers if e.asynchronous})
  if gpu and gathers:
    exposed = [e.chunk for e in out["ag"][1:] if not e.overlapped]
    if not any(e.asynchronous for e in gathers):
      warnings.append("the all-gathers are synchronous in this compiled program: no compute overlaps them. Is "
                      "XLA's latency hiding scheduler off, or are async collectives disabled?")
    elif exposed:
      warnings.append(f"forward all-gather(s) of group(s) {exposed[:10]} have no compute inside their window.")
    if f.prefetch > 1 and depth < f.prefetch:
      problems.append(f"the plan gathers {f.prefetch} groups ahead, but this program keeps at most {depth} of "
                      f"its all-gathers in flight: XLA:GPU keeps one collective in flight by default. Compile the "
                      f"step with compiler_options={{'{DEPTH_OPTION}': {f.prefetch}}} (jax.jit(...).lower(...)"
                      f".compile(compiler_options=...)), or plan with prefetch=1.")
  entries = sorted(out["rs"] + ars, key=lambda e: e.position)
  every = gathers + entries + replica
  return AuditReport(
      planned=len(chunks), chunks=tuple(sorted(entries + replica, key=lambda e: e.position)), loops=(),
      foreign=tuple(foreign), order=tuple(e.chunk for e in entries), ok=not problems, problems=tuple(problems), total_ops=len(ops),
      max_in_flight=peak_in_flight(ops, {e.name for e in every if e.asynchronous}),
      backward_outside_windows=backward_outside(ops, entries, windows, coll_names, costs),
      warnings=tuple(warnings), gathers=tuple(out["ag"]), gather_order=tuple(e.chunk for e in out["ag"]),
      planned_gathers=planned, regathers=tuple(out["reag"]), planned_regathers=len(again) * k,
      gathers_in_flight=depth, family="fsdp")


def _elements(shape: Sequence[int]) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


def _counts(entries: Sequence[AuditEntry], planned: Sequence[int], universe: Sequence[int], unit: str, what: str,
            *, optional: bool = False, times: dict | None = None) -> list[str]:
  """Each `planned` index's collective once (or `times[index]` times), of its planned size (`optional`: a
  missing one is no problem); none labelled outside `universe` (the plan's indices)."""
  counts: dict[int | None, int] = {}
  problems = []
  for e in entries:
    counts[e.chunk] = counts.get(e.chunk, 0) + 1
    if e.expected_elements is not None and e.elements != e.expected_elements:
      problems.append(f"{unit} {e.chunk}: its {what} ({e.name}) has {e.elements} elements, planned "
                      f"{e.expected_elements}.")
  missing = [] if optional else sorted(k for k in planned if counts.get(k, 0) < (times or {}).get(k, 1))
  twice = sorted(k for k in planned if counts.get(k, 0) > (times or {}).get(k, 1))
  beyond = sorted(k for k in counts if k is not None and k not in set(universe))
  if missing:
    few = "no" if all(not counts.get(k) for k in missing) else "fewer than the planned (k micro-batches')"
    problems.append(f"{unit}(s) {missing[:10]} have {few} {what} of their own in the compiled program: XLA merged "
                    f"them, or the step does not carry out this plan.")
  if twice:
    n = max((times or {}).get(k, 1) for k in twice)
    problems.append(f"{unit}(s) {twice[:10]} run more than {'one' if n == 1 else f'the planned {n} (or 1 held)'} "
                    f"{what} per step.")
  if beyond:
    problems.append(f"{what}(s) labelled {unit}(s) {beyond[:10]}, which the plan does not have: was the step "
                    f"built with another plan?")
  return problems
