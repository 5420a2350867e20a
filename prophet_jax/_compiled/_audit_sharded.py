"""`audit` of a sharded schedule (`dear`, `Schedule.gathers`): its reduce-scatters and all-gathers,
labelled `prophet/rs<k>` and `prophet/ag<g>`, against the plan (the `_audit` docstring says what is
checked)."""

from __future__ import annotations

import re
from typing import Any

from ._audit_checks import (backward_outside, entry_problems, is_gpu, peak_in_flight, sequence_problems,
                            window_ops)
from ._audit_report import AuditEntry, AuditReport
from ._hlo import ExecutedOp
from ._hlo_collectives import AsyncWindow, allreduces, sharded_collectives
from ._hlo_costs import OpCosts
from .._values._schedule import Schedule

_RS = re.compile(r"prophet/rs(\d+)(?![0-9])")  # a sharded schedule's reduce-scatter of chunk k
_AG = re.compile(r"prophet/ag(\d+)(?![0-9])")  # its all-gather g


def audit_sharded(text: str, module: Any, ops: tuple[ExecutedOp, ...], after: list[int],
                   windows: dict[str, AsyncWindow], costs: OpCosts, schedule: Schedule) -> AuditReport:
  """`audit` for a sharded schedule: one reduce-scatter per chunk (`prophet/rs<k>`, its whole padded
  buffer), in chunk order, then one all-gather per gather (`prophet/ag<g>`, its whole result), in
  gather order; every all-reduce is foreign (the loss pmean, a global norm's psum `prophet/norm`)."""
  found = sharded_collectives(module, ops)
  reductions = allreduces(module, ops)
  coll_names = {c.op.instruction.name for c in found} | {a.op.instruction.name for a in reductions}
  coll_names |= {w.done.instruction.name for w in windows.values() if w.start.instruction.name in coll_names}
  # the axis size, from the first labelled reduce-scatter (its buffer over its shard)
  n = next((c.in_elements // c.out_elements for c in found if c.collective == "reduce-scatter"
            and _RS.search(c.op_name) and c.out_elements), None)
  if n is None:
    n = next((c.out_elements // c.in_elements for c in found if c.collective == "all-gather"
              and _AG.search(c.op_name) and c.in_elements), None)
  padded = list(schedule.padded_sizes(n)) if n else []
  gsizes = list(schedule.gather_sizes(n)) if n else []

  chunks, gathers, foreign = [], [], []
  for c in found:
    label = (_RS if c.collective == "reduce-scatter" else _AG).search(c.op_name)
    k = int(label.group(1)) if label else None
    window = windows.get(c.op.instruction.name) if c.form.endswith("-start") else None
    inside, has_window = window_ops(window, coll_names, costs), window is not None
    rs = c.collective == "reduce-scatter"
    sizes = padded if rs else gsizes
    entry = AuditEntry(
        name=c.op.instruction.name, kind=("chunk" if rs else "gather") if label else "foreign", chunk=k,
        label="", elements=c.in_elements if rs else c.out_elements,
        expected_elements=sizes[k] if k is not None and k < len(sizes) else None,
        trips=c.op.trips, position=c.op.index, backward_ops_after=after[c.op.index + 1],
        op_name=c.op_name, asynchronous=has_window and not c.synchronous, window=inside,
        form=c.form, collective=c.collective)
    (foreign if label is None else chunks if rs else gathers).append(entry)
  for ar in reductions:  # every all-reduce is foreign here (the loss pmean, prophet/norm), any form
    op = ar.op
    foreign.append(AuditEntry(name=op.instruction.name, kind="foreign", chunk=None, label="",
                              elements=ar.elements, expected_elements=None, trips=op.trips,
                              position=op.index, backward_ops_after=after[op.index + 1],
                              op_name=ar.op_name, shared=len(ar.part_elements) > 1, form=ar.form))
  problems: list[str] = []
  order = [e.chunk for e in chunks for _ in range(e.trips or 1)]
  gorder = [e.chunk for e in gathers for _ in range(e.trips or 1)]
  for what, entries, planned, seq, unit in (
      ("reduce-scatter", chunks, len(schedule.chunks), order, "chunk"),
      ("all-gather", gathers, len(schedule.gathers), gorder, "gather")):
    problems += entry_problems(entries, planned, what, unit, "has", f"for {n} devices")
    problems += sequence_problems(seq, planned, len(entries), unit, what)
  if chunks and gathers and max(e.position for e in chunks) > min(e.position for e in gathers):
    problems.append("an all-gather runs before the last reduce-scatter: the two halves are not one "
                    "chain (every reduce-scatter, then every all-gather).")
  peak = peak_in_flight(ops, {e.name for e in chunks + gathers if e.asynchronous})
  outside = backward_outside(ops, chunks, windows, coll_names, costs)
  synchronous = chunks and is_gpu(text) and not any(e.asynchronous for e in chunks + gathers)
  warnings = ["the reduce-scatters and all-gathers are synchronous in this compiled program: no compute can "
              "overlap them (count and order still hold). Is XLA's latency hiding scheduler off, or are async "
              "collectives disabled?"] if synchronous else []
  return AuditReport(planned=len(schedule.chunks), chunks=tuple(chunks), loops=(), foreign=tuple(foreign),
                     order=tuple(order), ok=not problems, problems=tuple(problems), total_ops=len(ops),
                     max_in_flight=peak, backward_outside_windows=outside, warnings=tuple(warnings),
                     gathers=tuple(gathers), gather_order=tuple(gorder),
                     planned_gathers=len(schedule.gathers))
