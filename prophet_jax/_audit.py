"""audit(compiled, schedule): did the compiled step keep the schedule's all-reduces, count and order?

Reads the optimized HLO of a *compiled* step (`jax.pmap(step).lower(*args).compile()` or the same with
`jax.jit`), finds every all-reduce, and sorts them by their op_name metadata:
- `prophet/chunk<k>`: chunk k of the schedule (from `allreduce`, `scheduled` or `hooked`);
- `prophet/loop/<name>`: a per-layer all-reduce in a scanned body (`loop_hook`), counted once per trip;
- anything else: foreign (a user's `pmean` of the loss, BatchNorm statistics, ...), listed apart.
The verdict is True when every chunk appears exactly once (per step), with its planned element count, in
schedule order, and no all-reduce mixes chunks (XLA's combiner merges independent all-reduces into one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ._hlo import ExecutedOp, collectives, execution_order, hlo_text, parse_hlo
from ._types import Schedule

__all__ = ["audit", "AuditReport", "AuditEntry"]

_CHUNK = re.compile(r"prophet/chunk(\d+)(?![0-9])")
_LOOP = re.compile(r"prophet/loop/([\w.\-]+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry:
  """One all-reduce of the compiled program.

  Attributes:
    name: the HLO instruction's name.
    kind: 'chunk', 'loop' or 'foreign'.
    chunk: the schedule chunk index (kind 'chunk'), else None.
    label: the loop hook's name (kind 'loop'), else ''.
    elements: elements reduced (bf16 chunks are reduced as f32 on the CPU: same count).
    expected_elements: the chunk's planned element count (kind 'chunk'), else None.
    trips: times it runs per step (1 outside loops; a loop body's trip count; None if unknown).
    position: index among the program's executed ops (called computations inlined).
    backward_ops_after: backward ops (op_name under 'transpose(') executed after it: > 0 means the
      all-reduce is issued inside the backward pass, 0 after it.
    op_name: the op_name metadata.
    shared: the all-reduce also carries other operands (XLA's combiner merged it with others). A
      foreign one riding along (a user's pmean of the loss) is harmless; two chunks sharing one is not.
  """

  name: str
  kind: str
  chunk: int | None
  label: str
  elements: int
  expected_elements: int | None
  trips: int | None
  position: int
  backward_ops_after: int
  op_name: str
  shared: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
  """What the compiled step does with the schedule's chunks.

  Attributes:
    planned: the schedule's number of chunks (all-reduces per step).
    chunks: the chunk all-reduces, in compiled execution order.
    loops: per-layer all-reduces inside loop bodies (`loop_hook`), each with its trip count.
    foreign: all-reduces that are not the schedule's.
    order: chunk indices in compiled order (with repeats if a chunk runs more than once).
    ok: the verdict: every chunk exactly once, planned element count, schedule order, nothing merged.
    problems: what is wrong, one line each (empty when ok).
    total_ops: executed ops in the program (the scale of `position`).
  """

  planned: int
  chunks: tuple[AuditEntry, ...]
  loops: tuple[AuditEntry, ...]
  foreign: tuple[AuditEntry, ...]
  order: tuple[int, ...]
  ok: bool
  problems: tuple[str, ...]
  total_ops: int

  @property
  def chunk_allreduces(self) -> int:
    """Chunk all-reduces executed per step (trips counted)."""
    return sum(e.trips or 1 for e in self.chunks)

  @property
  def loop_allreduces(self) -> int:
    """Loop-body all-reduces executed per step, once per trip (None trips count as 1)."""
    return sum(e.trips or 1 for e in self.loops)

  @property
  def inside_backward(self) -> int:
    """Chunk and loop all-reduces issued while backward ops still follow."""
    return sum(1 for e in self.chunks + self.loops if e.backward_ops_after > 0)

  def summary(self) -> str:
    """A few lines for humans."""
    head = (f"audit: {'OK' if self.ok else 'MISMATCH'}: {self.chunk_allreduces} chunk all-reduce(s) of "
            f"{self.planned} planned, order {list(self.order)}; {self.loop_allreduces} in loop bodies; "
            f"{len(self.foreign)} foreign; {self.inside_backward} issued inside backward")
    return "\n".join([head] + [f"  problem: {p}" for p in self.problems])


def _backward_after(ops: tuple[ExecutedOp, ...]) -> list[int]:
  """For each index, how many backward ops (op_name with 'transpose(') run after it."""
  after = [0] * (len(ops) + 1)
  for i in range(len(ops) - 1, -1, -1):
    after[i] = after[i + 1] + ("transpose(" in ops[i].instruction.op_name)
  return after


def audit(compiled: Any, schedule: Schedule) -> AuditReport:
  """Checks a compiled step's all-reduces against `schedule`.

  Args:
    compiled: the compiled step (`jax.jit(step).lower(*args).compile()`, `jax.pmap(...).lower(...)
      .compile()`), or its HLO text. Not a Lowered: XLA's merging happens at compile time.
    schedule: the schedule the step carries out.

  Returns:
    An AuditReport; `report.ok` is the verdict, `report.problems` says what differs.

  Raises:
    TypeError: `compiled` is not compiled, or `schedule` is not a Schedule.
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f"audit: `schedule` must be a prophet_jax.Schedule, got {type(schedule).__name__}.")
  module = parse_hlo(hlo_text(compiled))
  ops = execution_order(module)
  after = _backward_after(ops)
  sizes = [c.size for c in schedule.chunks]
  chunks, loops, foreign = [], [], []
  for op in collectives(module):
    ins = op.instruction
    parts = ins.part_elements or (ins.elements,)
    own_chunk = _CHUNK.search(ins.op_name)
    own_loop = _LOOP.search(ins.op_name)
    if len(parts) == 1:
      labels = [(own_chunk, own_loop)]
    else:  # a combined all-reduce: label each operand by its producer's scope
      labels = []
      for opnd in ins.operands[:len(parts)]:
        prod = module.instruction(op.computation, opnd)
        pn = prod.op_name if prod is not None else ""
        labels.append((_CHUNK.search(pn), _LOOP.search(pn)))
      labels += [(None, None)] * (len(parts) - len(labels))
      if own_chunk and not any(c and c.group(1) == own_chunk.group(1) for c, _ in labels):
        k = int(own_chunk.group(1))
        want = sizes[k] if k < len(sizes) else None
        for i, (c, lp) in enumerate(labels):
          if c is None and lp is None and parts[i] == want:
            labels[i] = (own_chunk, None)
            break
    for (m, lm), elements in zip(labels, parts):
      k = int(m.group(1)) if m else None
      entry = AuditEntry(
          name=ins.name, kind="chunk" if m else "loop" if lm else "foreign", chunk=k,
          label=lm.group(1) if lm else "", elements=elements,
          expected_elements=sizes[k] if k is not None and k < len(sizes) else None,
          trips=op.trips, position=op.index, backward_ops_after=after[op.index + 1],
          op_name=ins.op_name, shared=len(parts) > 1)
      (chunks if m else loops if lm else foreign).append(entry)
  problems = []
  order = []
  for e in chunks:
    order.extend([e.chunk] * (e.trips or 1))
    if e.chunk >= len(sizes):
      problems.append(f"all-reduce {e.name} is labelled chunk{e.chunk}, but the schedule has "
                      f"{len(sizes)} chunks: was the step built with another schedule?")
    elif e.elements != e.expected_elements:
      problems.append(f"chunk{e.chunk}: all-reduce {e.name} reduces {e.elements} elements, planned "
                      f"{e.expected_elements} (merged with other all-reduces by XLA's combiner?)")
    if e.trips != 1:
      problems.append(f"chunk{e.chunk}: all-reduce {e.name} runs {e.trips} times per step (inside a "
                      f"loop), planned once.")
  by_ins: dict[str, list[int]] = {}
  for e in chunks:
    by_ins.setdefault(e.name, []).append(e.chunk)
  for name, ks in by_ins.items():
    if len(ks) > 1:
      problems.append(f"chunks {ks} share one all-reduce ({name}): XLA's combiner merged them.")
  counts = {k: order.count(k) for k in range(len(sizes))}
  missing = [k for k, c in counts.items() if c == 0]
  repeated = [k for k, c in counts.items() if c > 1]
  if missing:
    problems.append(f"chunk(s) {missing[:10]}{'...' if len(missing) > 10 else ''} have no all-reduce of "
                    f"their own in the compiled program ({len(chunks)} found, {len(sizes)} planned): XLA "
                    f"merged them, or the step does not use this schedule.")
  if repeated:
    problems.append(f"chunk(s) {repeated[:10]} run more than once per step.")
  if order != sorted(order):
    problems.append(f"chunks run in compiled order {order[:20]}, not in schedule order.")
  if not schedule.chunks:
    problems.append("the schedule has no chunks.")
  return AuditReport(planned=len(sizes), chunks=tuple(chunks), loops=tuple(loops),
                     foreign=tuple(foreign), order=tuple(order), ok=not problems,
                     problems=tuple(problems), total_ops=len(ops))
