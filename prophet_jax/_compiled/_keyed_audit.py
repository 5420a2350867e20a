"""Reading a keyed program: the plan's units found by size and provenance, in the order XLA chose.

With `enforce_order=False` (`_rewrite._keys`) every unit of a plan carries its own XLA `combiner_key`
and no tie, and with the partitioner's own collectives (`prophet_jax.tag_layers`) each bucket's leaves
are reduced by several all-reduces that XLA:GPU's combiner joins into one. A combined collective keeps
no `op_name` on jax 0.10.2 (docs/facts.md, "Buckets in XLA's own terms"), so this audit does not read
names at all. It matches every collective of the compiled program to a unit:

- by **element count**: an all-reduce (a tuple or XLA:GPU's concatenated buffer counts all its
  parts) to a unit of that many elements (`Schedule.allreduce_sizes()`); a sharded plan's
  reduce-scatter by its whole (padded) buffer (`padded_sizes(n)`), an all-gather by its result
  (`gather_sizes(n)`);
- by **provenance**, where sizes are equal: the op_names of the first ops that produce its operands
  (looking through the rewrite's gathers, concatenations, slices, bitcasts and tuples) name the model's
  layers (`Dense_1/dot_general`); the unit whose rows' layers they name most is its unit.
- **Equal sizes, same provenance** (two units the program cannot tell apart, e.g. two identical
  layers' buckets): matched in plan order among themselves, and the report says which
  (`ambiguous` in its warnings). Counts and sizes are then still proven; which of the two ran first is
  not.

The verdict holds count and size only: every unit exactly once, with its planned size, nothing merged.
The order is XLA's (`AuditReport.order` is what it chose; `order_by == "xla"`), and the windows are read
as `audit` reads them: the compute XLA scheduled inside each unit's start/done.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._audit_checks import backward_outside, is_gpu, peak_in_flight, read_program, window_ops
from ._audit_report import AuditEntry, AuditReport
from ._hlo import HloModule
from ._hlo_collectives import allreduces, sharded_collectives
from .._values._schedule import Bucket, Schedule

# ops the provenance walk looks through: the rewrite's own buffer handling and pure data movement
_THROUGH = {"bitcast", "copy", "reshape", "concatenate", "slice", "tuple", "get-tuple-element", "pad",
            "transpose", "convert", "dynamic-slice", "broadcast"}
_WORD = re.compile(r"[A-Za-z_][\w.\-]*")


@dataclass(frozen=True, slots=True)
class KeyedUnit:
  """One unit a keyed program is expected to hold: its index in the plan's issue order, its element
  count, the layers (path components) of its rows, which its operands' producers name, and, for a
  unit that is one slice of one leaf, where the slice starts in the leaf (None otherwise)."""

  index: int
  elements: int
  layers: frozenset[str]
  start: int | None = None


def _layers(paths: Sequence[str]) -> frozenset[str]:
  """The layer words of parameter paths: every component but the first ('params') and the leaf's
  own name ('kernel'): 'params/Block_0/Dense_1/kernel' -> {'Block_0', 'Dense_1'}."""
  out = set()
  for p in paths:
    parts = [q for q in p.split("/") if q]
    out.update(parts[1:-1] if len(parts) > 2 else parts[:-1] or parts)
  return frozenset(out)


def units_of(schedule: Schedule, *, workers: int | None = None) -> tuple[tuple[str, tuple[KeyedUnit, ...]], ...]:
  """The units a schedule issues, per collective kind: (('all-reduce', units),) for an all-reduce
  plan (a deferral group's slots each a unit, of its slot size); (('reduce-scatter', ...),
  ('all-gather', ...)) for a sharded one (`workers` the axis size, needed for the padded sizes)."""
  paths = [r[0] for r in schedule.rows]
  if schedule.sharded:
    if workers is None:
      raise ValueError("units_of: a sharded schedule's padded sizes need workers= (the axis size).")
    chunks = schedule.chunks
    rs = tuple(KeyedUnit(k, e, _layers([paths[r] for r, _, _ in c.slices]), _start(c.slices))
               for k, (c, e) in enumerate(zip(chunks, schedule.padded_sizes(workers))))
    ag = tuple(KeyedUnit(g, e, _layers([paths[r] for k in ks for r, _, _ in chunks[k].slices]))
               for g, (ks, e) in enumerate(zip(schedule.gathers, schedule.gather_sizes(workers))))
    return (("reduce-scatter", rs), ("all-gather", ag))
  units, k = [], 0
  for b in schedule.buckets:
    for u in ((b,) if b.defer else b.chunks):
      rows = [r for c in (u.chunks if isinstance(u, Bucket) else (u,)) for r, _, _ in c.slices]
      sizes = (u.slot_size,) * u.slots if isinstance(u, Bucket) else (u.size,)
      start = None if isinstance(u, Bucket) else _start(u.slices)
      for e in sizes:
        units.append(KeyedUnit(k, e, _layers([paths[r] for r in rows]), start))
        k += 1
  return (("all-reduce", tuple(units)),)


def _start(slices: Sequence[tuple[int, int, int]]) -> int | None:
  """Where a unit of one partial slice of one leaf starts in it; None for anything else."""
  return slices[0][1] if len(slices) == 1 else None


_SLICE = re.compile(r"slice=\{((?:\[\d+:\d+(?::\d+)?\],?\s*)+)\}")
_GTE = re.compile(r"\bindex=(\d+)")
_MOVES = ("bitcast", "copy", "reshape", "transpose")


def slice_start(module: HloModule, computation: str, name: str) -> int | None:
  """The flat start (row-major in the sliced operand) of the slice that produces `name`, looking through
  bitcasts and transposes, into a fusion (its ROOT, or the ROOT tuple's element a get-tuple-element
  reads); None when no slice makes it. A unit that is a part of a leaf reads its gradient so."""
  comp, ins = computation, module.instruction(computation, name)
  for _ in range(8):
    if ins is None:
      return None
    if ins.opcode == "get-tuple-element" and ins.operands:
      src = module.instruction(comp, ins.operands[0])
      m = _GTE.search(ins.text)
      body, root = module.called(src if src is not None and src.opcode == "fusion" else None)
      if root is None or m is None or root.opcode != "tuple" or int(m.group(1)) >= len(root.operands):
        return None
      comp, ins = body, module.instruction(body, root.operands[int(m.group(1))])
    elif ins.opcode == "fusion":
      comp, ins = module.called(ins)
    elif ins.opcode in _MOVES and ins.operands:
      ins = module.instruction(comp, ins.operands[0])
    elif ins.opcode == "slice" and ins.operands:
      m = _SLICE.search(ins.text)
      src = module.instruction(comp, ins.operands[0])
      if m is None or src is None:
        return None
      starts = [int(b.split(":")[0].strip("[")) for b in re.findall(r"\[\d+:\d+", m.group(1))]
      dims = [int(d) for d in re.findall(r"\d+", src.shape.split("]")[0].split("[")[-1])]
      if len(dims) != len(starts):
        return None
      return sum(st * math.prod(dims[i + 1:]) for i, st in enumerate(starts))   # row-major
    else:
      return None
  return None


def provenance(module: HloModule, computation: str, operands: Sequence[str], *, depth: int = 12) -> tuple[str, ...]:
  """The op_names of the first ops that produce `operands`, looking through data movement and the
  rewrite's own ops (`prophet/` scopes): for a gradient bucket, its layers' backward ops."""
  seen, out, frontier = set(), [], [(o, 0) for o in operands]
  while frontier:
    name, d = frontier.pop()
    if name in seen or d > depth:
      continue
    seen.add(name)
    ins = module.instruction(computation, name)
    if ins is None:
      continue
    through = ins.opcode in _THROUGH or "prophet/" in ins.op_name or (
        ins.opcode == "fusion" and ("concatenate" in ins.name or "prophet/" in ins.op_name))
    if through and ins.operands:
      frontier.extend((o, d + 1) for o in ins.operands)
    elif ins.op_name:
      out.append(ins.op_name)
  return tuple(out)


def _score(found: _Found, unit: KeyedUnit) -> tuple[int, int]:
  """(layers its operands' producers name, whether its operand is the slice where the unit starts)."""
  words = {w for n in found.names for w in _WORD.findall(n.replace("/", " "))}
  return len(unit.layers & words), int(unit.start is not None and found.start == unit.start)


@dataclass(frozen=True, slots=True)
class _Found:
  name: str
  elements: int
  names: tuple[str, ...]
  start: int | None = None


def match_units(found: Sequence[_Found], units: Sequence[KeyedUnit]) -> tuple[dict[int, int], list[tuple[int, ...]]]:
  """Each found collective's unit ({found index: unit index}), and the groups of units matched by the
  equal-size rule alone (equal sizes, provenance that does not tell them apart)."""
  by_size: dict[int, list[KeyedUnit]] = {}
  for u in units:
    by_size.setdefault(u.elements, []).append(u)
  out: dict[int, int] = {}
  ambiguous: list[tuple[int, ...]] = []
  for size, cands in by_size.items():
    idx = [i for i, f in enumerate(found) if f.elements == size]
    pairs = sorted(((tuple(-x for x in _score(found[i], u)), u.index, i) for i in idx for u in cands))
    used_f, used_u = set(), set()
    tied: set[int] = set()
    for neg, k, i in pairs:
      if i in used_f or k in used_u:
        continue
      rivals = [u.index for u in cands if u.index not in used_u and u.index != k
                and _score(found[i], u) == tuple(-x for x in neg)]
      if rivals:
        tied.update([k, *rivals])
      out[i] = k
      used_f.add(i)
      used_u.add(k)
    if len(tied) > 1:
      ambiguous.append(tuple(sorted(tied)))
  return out, ambiguous


def keyed_audit(compiled: Any, schedule: Schedule, *, units: Sequence[KeyedUnit] | None = None) -> AuditReport:
  """`audit(compiled, schedule, enforce_order=False)`: the plan's units matched by size and provenance
  (module docstring), the order XLA chose, the compute inside each window.

  Args:
    compiled: the compiled step or its HLO text.
    schedule: the plan the step carries out.
    units: the all-reduce units to find instead of the schedule's (`tag_layers`' buckets of whole
      leaves, `TaggedPlan.units()`); None: the schedule's own.

  Returns:
    An `AuditReport` with `order_by='xla'`.
  """
  text, module, ops, after, windows, costs = read_program(compiled)
  ars = allreduces(module, ops)
  shc = sharded_collectives(module, ops) if schedule.sharded else ()
  coll_names = {a.op.instruction.name for a in ars} | {c.op.instruction.name for c in shc}
  coll_names |= {w.done.instruction.name for w in windows.values() if w.start.instruction.name in coll_names}
  if schedule.sharded:
    n = next((c.in_elements // c.out_elements for c in shc if c.collective == "reduce-scatter"
              and c.out_elements), None)
    kinds = units_of(schedule, workers=n) if n else (("reduce-scatter", ()), ("all-gather", ()))
    sources = {kind: [(c.op, c.form, c.in_elements if kind == "reduce-scatter" else c.out_elements,
                       c.op.instruction.operands, c.synchronous, c.op_name)
                      for c in shc if c.collective == kind] for kind, _ in kinds}
  else:
    kinds = (("all-reduce", tuple(units) if units is not None else units_of(schedule)[0][1]),)
    sources = {"all-reduce": [(a.op, a.form, a.elements, a.operands, a.form == "all-reduce" or a.is_sync(),
                               a.op_name) for a in ars]}
  sections: dict[str, tuple[list[Any], list[int]]] = {}
  foreign: list[Any] = [
      AuditEntry(name=a.op.instruction.name, kind="foreign", chunk=None, label="", elements=a.elements,
                 expected_elements=None, trips=a.op.trips, position=a.op.index,
                 backward_ops_after=after[a.op.index + 1], op_name=a.op_name, form=a.form)
      for a in (ars if schedule.sharded else ())]   # a sharded plan's all-reduces are never its units
  problems: list[str] = []
  warnings: list[str] = []
  for kind, kunits in kinds:
    src = sources[kind]
    found = [_Found(op.instruction.name, e, provenance(module, op.computation, opnds),
                    slice_start(module, op.computation, opnds[0]) if len(opnds) == 1 else None)
             for op, _, e, opnds, _, _ in src]
    match, ambiguous = match_units(found, kunits)
    entries, order = [], []
    sizes = {u.index: u.elements for u in kunits}
    for i, (op, form, e, _, sync, op_name) in enumerate(src):
      k = match.get(i)
      inside = window_ops(windows.get(op.instruction.name), coll_names, costs) if form.endswith("-start") else ()
      entry = AuditEntry(
          name=op.instruction.name, kind=("gather" if kind == "all-gather" else "chunk") if k is not None
          else "foreign", chunk=k, label="", elements=e, expected_elements=sizes.get(k),
          trips=op.trips, position=op.index, backward_ops_after=after[op.index + 1], op_name=op_name,
          shared=False, asynchronous=bool(inside) or (form.endswith("-start") and not sync), window=inside,
          form=form, collective=kind)
      if k is None:
        foreign.append(entry)
        continue
      entries.append(entry)
      order.extend([k] * (entry.trips or 1))
      if entry.trips != 1:
        problems.append(f"unit {k}: {kind} {entry.name} runs {entry.trips} times per step, planned once.")
    missing = sorted(set(sizes) - set(match.values()))
    if missing:
      twins = [k for k in missing if any(sizes[j] == sizes[k] for j in match.values())]
      problems.append(f"{kind} unit(s) {missing[:10]}{'...' if len(missing) > 10 else ''} (of "
                      f"{[sizes[k] for k in missing[:10]]} elements) have no {kind} of their own in the "
                      f"compiled program ({len(entries)} of {len(sizes)} found): XLA merged them (are the "
                      f"keys on? enforce_order=False), or the step does not use this plan."
                      + (f" Units {twins[:10]} have the size of a unit that was found: where two units "
                         f"reduce equal values (two batch-norm biases that meet at a residual add have "
                         f"equal gradients), XLA's CSE keeps one {kind} for both, which the tie prevents."
                         if twins else ""))
    for group in ambiguous:
      warnings.append(f"ambiguous: {kind} units {list(group)} have {sizes[group[0]]} elements each and "
                      f"operands this audit cannot tell apart; matched in plan order (their count and "
                      f"sizes hold, which of them ran first is not proven).")
    sections[kind] = (entries, order)
  warnings.append("order: XLA's (enforce_order=False: each unit carries a combiner key and no tie; "
                  "the order shown is the one XLA chose).")
  if not is_gpu(text):
    warnings.append("XLA:CPU ignores combiner keys and merges independent all-reduces: on the CPU a "
                    "keyed program proves numbers only; audit a compile-only GPU target "
                    "(prophet_jax.gpu_topology) for counts and sizes.")
  chunks, order = sections["reduce-scatter" if schedule.sharded else "all-reduce"]
  gathers, gorder = sections.get("all-gather", ([], []))
  peak = peak_in_flight(ops, {e.name for e in chunks + gathers if e.asynchronous})
  outside = backward_outside(ops, chunks, windows, coll_names, costs)
  return AuditReport(planned=len(kinds[0][1]), chunks=tuple(chunks), loops=(), foreign=tuple(foreign),
                     order=tuple(order), ok=not problems, problems=tuple(problems), total_ops=len(ops),
                     max_in_flight=peak, backward_outside_windows=outside, warnings=tuple(warnings),
                     gathers=tuple(gathers), gather_order=tuple(gorder),
                     planned_gathers=len(kinds[1][1]) if schedule.sharded else 0, order_by="xla")
