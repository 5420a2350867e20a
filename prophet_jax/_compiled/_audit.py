"""audit(compiled, schedule): did the compiled step keep the schedule's all-reduces, and what overlaps them?

Reads the optimized HLO of a *compiled* step (`jax.pmap(step).lower(*args).compile()`, the same with
`jax.jit`, or a step compiled for a compile-only GPU target, see `prophet_jax.gpu_topology`), finds
every all-reduce, and sorts them by their op_name metadata:
- `prophet/chunk<k>`: the k-th all-reduce the schedule issues per step (from `allreduce`, `scheduled`,
  `hooked` or `pipelined`): chunk k of a lossless schedule; a deferral group (`Bucket.defer > 0`)
  issues `slots` all-reduces of its padded slot size, so a deferring schedule is expected to have
  `schedule.num_allreduces` of them, of `schedule.allreduce_sizes()` elements;
- `prophet/loop/<name>`: a per-layer all-reduce in a scanned body (`loop_hook`), counted once per trip;
- anything else: foreign (a user's `pmean` of the loss, BatchNorm statistics, ...), listed apart.
The verdict is True when every chunk appears exactly once (per step), with its planned element count, in
schedule order, and no all-reduce carries two chunks.

A sharded schedule (`dear`, `Schedule.gathers`) is audited by its own collectives (`_audit_sharded`):
every `reduce-scatter` labelled `prophet/rs<k>` is chunk k's (`chunks`, `elements` its whole buffer,
padded to a multiple of the axis size: `schedule.padded_sizes(n)`, n read from the first one), every
`all-gather` labelled `prophet/ag<g>` is gather g's (`gathers`, `elements` its whole result:
`schedule.gather_sizes(n)`), in any form XLA writes them (synchronous, `-start`/`-done`, or wrapped in
a `fusion-start`/`async-start`); every all-reduce is foreign there (the loss `pmean`, a global norm's
`prophet/norm` psum). The verdict: each chunk's reduce-scatter once, each gather's all-gather once,
planned sizes, plan order, and every reduce-scatter before every all-gather (one tie chain). Their
windows are read as an all-reduce's are: backward compute in the reduce-scatters', and, in a
pipelined step, the next forward in the all-gathers' (`gathers_forward_overlap`).

XLA may combine a chunk's all-reduce with a *foreign* one (the loss `pmean`: independent of every chunk,
so the combiner is free to join it to any of them). On the CPU the combined all-reduce is a tuple; on
XLA:GPU `all-reduce-contiguous` flattens it into one buffer: a concatenation of the operands, one
all-reduce without op_name, and slices of its result that keep each original all-reduce's op_name. The
audit reads through both forms: each operand (or slice) is an entry of its own, marked `shared`. A chunk
sharing its all-reduce with a foreign scalar keeps its count, size and order (the rewrite cannot stop
that: the loss pmean is the user's, and a compile option is not available in the user's own jit); two
chunks sharing one all-reduce is a failure.

An all-reduce is read in any of the forms XLA writes (`AuditEntry.form`, `AuditReport.forms`): a
synchronous `all-reduce`; an async `all-reduce-start` / `all-reduce-done` pair (XLA:GPU); jaxlib 0.12's
asynchronous collective fusion, a `fusion-start` / `fusion-done` pair whose called computation's ROOT is
the all-reduce; XLA's generic `async-start` wrapper. jaxlib 0.12 names a combined instruction by the
op_names it merged ('.../(prophet/chunk5/psum:psum)', `_hlo.merged_op_names`): read through like an
unnamed one.

The schedule of an async collective (XLA:GPU's start / done pairs) is read as well:
each entry's `window` holds the ops the compiled program runs between the start and the done, with their
kind (backward, forward, other compute, the rewrite's own gather/tie ops, collectives) and their FLOPs and
bytes from the HLO shapes (`_hlo.OpCosts`). A chunk with no backward, forward or other compute in its
window is *exposed*: nothing hides its latency.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sys

from .._values._checks import check_values
from ._keyed_audit import KeyedUnit, keyed_audit
from ._hlo import (AsyncWindow, ExecutedOp, HloInstruction, OpCosts, allreduces, async_windows,
                   contiguous_parts, execution_order, hlo_text, is_collective, merged_op_names, parse_hlo,
                   sharded_collectives, users)
from .._values._schedule import Schedule
from .._values._types import _fields, _loads

__all__ = ["audit", "AuditReport", "AuditEntry", "WindowOp", "AUDIT_SCHEMA", "COMPUTE_KINDS",
           "NEXT_FORWARD"]

AUDIT_SCHEMA = 1
_CHUNK = re.compile(r"prophet/chunk(\d+)(?![0-9])")
_LOOP = re.compile(r"prophet/loop/([\w.\-]+)")
_RS = re.compile(r"prophet/rs(\d+)(?![0-9])")  # a sharded schedule's reduce-scatter of chunk k
_AG = re.compile(r"prophet/ag(\d+)(?![0-9])")  # its all-gather g
# window op kinds that are work of the step (what hides a collective's latency)
COMPUTE_KINDS = ("backward", "forward", "other")
NEXT_FORWARD = "pipelined_forward"  # the named scope of the pipelined step's next forward
_FORM_WORDS = {"all-reduce": "all-reduce (synchronous)", "all-reduce-start": "all-reduce-start/done (async)",
               "fusion-start": "fusion-start/done (async collective fusion)",
               "async-start": "async-start/done (async wrapper)"}
_GPU_MARKERS = ('"collective_backend_config"', "__cudnn$", "__cublas", "gemm_fusion", "triton")


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowOp:
  """An op the compiled program runs while an async all-reduce is in flight.

  Attributes:
    name: the HLO instruction's name.
    opcode: 'fusion', 'custom-call', ...
    kind: 'backward' (op_name under `transpose(` or `pipelined_backward`), 'forward' (`jvp(` without
      `transpose(`, or `pipelined_forward`: the next step's forward in a pipelined step), 'rewrite'
      (the schedule's own gather, tie and scatter ops, under `prophet/`), 'collective', or 'other'
      (the optimizer update and anything else).
    flops: matrix-product and convolution FLOPs (`_hlo.OpCosts`; elementwise ops count 0).
    nbytes: operand and result bytes.
    op_name: the op_name metadata (jax's name stack).
  """

  name: str
  opcode: str
  kind: str
  flops: int
  nbytes: int
  op_name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry:
  """One all-reduce of the compiled program (or one operand of a combined one).

  Attributes:
    name: the HLO instruction's name (the `all-reduce-start` of an async one).
    kind: 'chunk', 'loop' or 'foreign'.
    chunk: the schedule chunk index (kind 'chunk'), else None.
    label: the loop hook's name (kind 'loop'), else ''.
    elements: elements reduced (bf16 chunks are reduced as f32 on the CPU: same count).
    expected_elements: the chunk's planned element count (kind 'chunk'), else None.
    trips: times it runs per step (1 outside loops; a loop body's trip count; None if unknown).
    position: index among the program's executed ops (called computations inlined).
    backward_ops_after: backward ops (op_name under 'transpose(') executed after it: > 0 means the
      all-reduce is issued inside the backward pass, 0 after it.
    op_name: the op_name metadata (of the operand or slice, for a combined all-reduce).
    shared: the all-reduce also carries other operands (XLA's combiner merged it with others). A
      foreign one riding along (a user's pmean of the loss) is harmless; two chunks sharing one is not.
    asynchronous: issued as an async start/done pair (XLA:GPU); False for a synchronous all-reduce.
    window: the ops scheduled between its start and its done (empty when synchronous).
    form: how the compiled program writes the all-reduce (`_hlo.ALL_REDUCE_FORMS`): 'all-reduce'
      (synchronous), 'all-reduce-start' (an async start/done pair), 'fusion-start' (jaxlib 0.12's
      XLA:GPU: an asynchronous collective fusion whose called computation is the all-reduce) or
      'async-start'; '' in reports written before it was recorded.
    collective: 'all-reduce', or, for a sharded schedule, 'reduce-scatter' (kind 'chunk': chunk k's;
      `elements` is its whole buffer, padded to a multiple of the axis size) or 'all-gather' (kind
      'gather': `chunk` is the gather's index; `elements` is its whole result).
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
  asynchronous: bool = False
  window: tuple[WindowOp, ...] = ()
  form: str = ""
  collective: str = "all-reduce"

  @property
  def window_flops(self) -> int:
    """FLOPs of the compute ops inside the window."""
    return sum(o.flops for o in self.window if o.kind in COMPUTE_KINDS)

  @property
  def window_bytes(self) -> int:
    """Bytes read and written by the compute ops inside the window."""
    return sum(o.nbytes for o in self.window if o.kind in COMPUTE_KINDS)

  def window_ops(self, kind: str) -> tuple[WindowOp, ...]:
    """The window's ops of one kind ('backward', 'forward', 'other', 'rewrite', 'collective')."""
    return tuple(o for o in self.window if o.kind == kind)

  @property
  def overlapped(self) -> bool:
    """Some of the step's compute (backward, forward or other) is scheduled inside the window."""
    return any(o.kind in COMPUTE_KINDS for o in self.window)


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
  """What the compiled step does with the schedule's chunks.

  Attributes:
    planned: the all-reduces the schedule issues per step (`schedule.num_allreduces`: its chunks, a
      deferral group counting its `slots`); for a sharded schedule, its reduce-scatters.
    chunks: the chunk all-reduces, in compiled execution order.
    loops: per-layer all-reduces inside loop bodies (`loop_hook`), each with its trip count.
    foreign: all-reduces that are not the schedule's.
    order: chunk indices in compiled order (with repeats if a chunk runs more than once).
    ok: the verdict: every chunk exactly once, planned element count, schedule order, nothing merged.
    problems: what is wrong, one line each (empty when ok).
    total_ops: executed ops in the program (the scale of `position`).
    max_in_flight: the most async all-reduces in flight at once in the schedule (0 when synchronous).
    backward_outside_windows: backward ops with FLOPs (matmuls, convolutions) that run after the first
      chunk's all-reduce has started but inside no all-reduce window: backward compute the link could
      have hidden. 0 means that once the all-reduces begin, every remaining backward matmul overlaps one.
    warnings: what weakens the overlap without breaking the verdict (synchronous collectives on a GPU,
      no compute inside any window), one line each.
    gathers: a sharded schedule's all-gathers, in compiled order (`chunk` is the gather's index);
      empty otherwise. (`chunks` then holds its reduce-scatters.)
    gather_order: the gathers' indices in compiled order.
    planned_gathers: the all-gathers the schedule issues per step (`schedule.num_all_gathers`).
    order_by: 'schedule' (the tie: `order` is held to the plan's) or 'xla' (`audit(...,
      enforce_order=False)`, `_keyed_audit`: units matched by size and provenance, `order` is XLA's
      choice and no problem).
    schema: the JSON schema version.
  """

  planned: int
  chunks: tuple[AuditEntry, ...]
  loops: tuple[AuditEntry, ...]
  foreign: tuple[AuditEntry, ...]
  order: tuple[int, ...]
  ok: bool
  problems: tuple[str, ...]
  total_ops: int
  max_in_flight: int = 0
  backward_outside_windows: int = 0
  warnings: tuple[str, ...] = ()
  gathers: tuple[AuditEntry, ...] = ()
  gather_order: tuple[int, ...] = ()
  planned_gathers: int = 0
  order_by: str = "schedule"
  schema: int = AUDIT_SCHEMA

  @property
  def sharded(self) -> bool:
    """The audit of a sharded schedule: `chunks` are its reduce-scatters, `gathers` its all-gathers."""
    return self.planned_gathers > 0

  @property
  def gathers_forward_overlap(self) -> tuple[int, ...]:
    """All-gathers whose window holds the next step's forward (a `pipelined` step of a sharded
    schedule: each all-gather issued inside the forward that reads it)."""
    return tuple(e.chunk for e in self.gathers
                 if any(NEXT_FORWARD in o.op_name for o in e.window_ops("forward")))

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

  @property
  def asynchronous(self) -> bool:
    """Whether the chunks' all-reduces are async start/done pairs (XLA:GPU)."""
    return any(e.asynchronous for e in self.chunks)

  @property
  def forms(self) -> dict[str, int]:
    """How the compiled program writes its all-reduces (`AuditEntry.form`) -> how many of the chunks',
    loops' and foreign entries were read in that form."""
    out: dict[str, int] = {}
    for e in self.chunks + self.loops + self.foreign:
      out[e.form or "?"] = out.get(e.form or "?", 0) + 1
    return out

  @property
  def exposed(self) -> tuple[int, ...]:
    """Chunks with no compute scheduled inside their all-reduce window (every chunk when synchronous)."""
    return tuple(e.chunk for e in self.chunks if not e.overlapped)

  @property
  def forward_overlap(self) -> tuple[int, ...]:
    """Chunks whose window holds the *next* step's forward (ops under `pipelined_forward`, in a
    `pipelined` step): the overlap the pipelined step exists for."""
    return tuple(e.chunk for e in self.chunks
                 if any(NEXT_FORWARD in o.op_name for o in e.window_ops("forward")))

  @property
  def overlapped_flops(self) -> int:
    """FLOPs of the compute ops inside at least one chunk's window (each op counted once, even where
    windows overlap)."""
    ops = {o.name: o.flops for e in self.chunks for o in e.window if o.kind in COMPUTE_KINDS}
    return sum(ops.values())

  def describe(self) -> str:
    """A few lines for humans: the verdict, the order, the overlap (XLA:GPU), the problems and warnings."""
    head = (f"audit: {'OK' if self.ok else 'MISMATCH'}: {self.chunk_allreduces} chunk all-reduce(s) of "
            f"{self.planned} planned, order {list(self.order)}; {self.loop_allreduces} in loop bodies; "
            f"{len(self.foreign)} foreign; {self.inside_backward} issued inside backward")
    if self.sharded:
      head = (f"audit: {'OK' if self.ok else 'MISMATCH'}: sharded: {len(self.chunks)} reduce-scatter(s) of "
              f"{self.planned} planned, order {list(self.order)}; {len(self.gathers)} all-gather(s) of "
              f"{self.planned_gathers} planned, order {list(self.gather_order)}; {len(self.foreign)} "
              f"foreign; {self.inside_backward} reduce-scatter(s) issued inside backward")
    lines = [head]
    if self.order_by == "xla":
      lines.append("order: XLA's (keyed units, matched by size and provenance): " + str(list(self.order)))
    if self.forms:
      lines.append("read: " + ", ".join(f"{n} {_FORM_WORDS.get(f, f)}" for f, n in self.forms.items()))
    if self.asynchronous:
      n = len(self.chunks)
      what = "reduce-scatter" if self.sharded else "all-reduce"
      lines.append(f"overlap: {n - len(self.exposed)}/{n} chunk(s) have compute inside their {what} "
                   f"window ({self.overlapped_flops / 1e6:.3g} MFLOP); exposed {list(self.exposed)}; "
                   f"next forward inside {list(self.forward_overlap)}; at most {self.max_in_flight} "
                   f"in flight")
    if self.sharded and any(e.asynchronous for e in self.gathers):
      n = len(self.gathers)
      lines.append(f"all-gathers: {sum(e.overlapped for e in self.gathers)}/{n} have compute inside their "
                   f"window; next forward inside {list(self.gathers_forward_overlap)}")
    lines += [f"  problem: {p}" for p in self.problems]
    lines += [f"  warning: {w}" for w in self.warnings]
    return "\n".join(lines)

  def summary(self) -> str:
    """Deprecated: `describe()`, the name every value's human summary has."""
    import warnings

    warnings.warn("AuditReport.summary() is deprecated; use AuditReport.describe().", DeprecationWarning,
                  stacklevel=2)
    return self.describe()

  def window_table(self) -> str:
    """One line per chunk: elements, the ops its all-reduce window holds by kind, their FLOPs and bytes,
    and the largest of them (by FLOPs, then bytes)."""
    rows = [f"{'chunk':>5s} {'elements':>9s} {'bwd':>4s} {'fwd':>4s} {'other':>5s} {'MFLOP':>9s} "
            f"{'MB':>8s}  largest op inside"]
    for e in self.chunks:
      compute = [o for o in e.window if o.kind in COMPUTE_KINDS]
      top = max(compute, key=lambda o: (o.flops, o.nbytes), default=None)
      if top is not None:
        where = f"{top.name} ({'/'.join(top.op_name.split('/')[-2:])})"
      else:
        where = "(exposed)" if e.asynchronous else "(synchronous)"
      rows.append(f"{e.chunk:5d} {e.elements:9d} {len(e.window_ops('backward')):4d} "
                  f"{len(e.window_ops('forward')):4d} {len(e.window_ops('other')):5d} "
                  f"{e.window_flops / 1e6:9.3f} {e.window_bytes / 1e6:8.3f}  {where}")
    return "\n".join(rows)

  # -- JSON -------------------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict (every field; entries and window ops as objects)."""
    return dataclasses.asdict(self)

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> AuditReport:
    """Reads `to_json`'s output back (a JSON string or the dict).

    Raises:
      ValueError: malformed JSON, unknown or missing fields, or another schema version.
    """
    obj = _loads(text_or_obj, "AuditReport")
    if obj.get("schema", AUDIT_SCHEMA) != AUDIT_SCHEMA:
      raise ValueError(f"AuditReport.from_json: schema={obj.get('schema')!r}; this version reads "
                       f"{AUDIT_SCHEMA}.")
    obj = _fields(cls, obj, "AuditReport", required=True)
    for key in ("chunks", "loops", "foreign", "gathers"):
      obj[key] = tuple(_entry(e) for e in obj.get(key, ()))
    for key in ("order", "problems", "warnings", "gather_order"):
      obj[key] = tuple(obj.get(key, ()))
    return cls(**obj)


def _entry(obj: Mapping[str, Any]) -> AuditEntry:
  if not isinstance(obj, Mapping):
    raise ValueError(f"AuditReport.from_json: an entry must be an object, got {type(obj).__name__}.")
  obj = _fields(AuditEntry, dict(obj), "AuditEntry", required=True)
  obj["window"] = tuple(WindowOp(**_fields(WindowOp, dict(o), "WindowOp", required=True))
                        for o in obj.get("window", ()))
  return AuditEntry(**obj)


# --------------------------------------------------------------------------------------------------
# reading the compiled program


def _backward_after(ops: tuple[ExecutedOp, ...]) -> list[int]:
  """For each index, how many backward ops (op_name with 'transpose(') run after it."""
  after = [0] * (len(ops) + 1)
  for i in range(len(ops) - 1, -1, -1):
    after[i] = after[i + 1] + ("transpose(" in ops[i].instruction.op_name)
  return after


def _kind(ins: HloInstruction, collective_names: set[str] = frozenset()) -> str:
  name = ins.op_name
  if is_collective(ins.opcode) or ins.name in collective_names:
    return "collective"
  if "prophet/" in name:
    return "rewrite"
  if "pipelined_backward" in name or "transpose(" in name:
    return "backward"
  if NEXT_FORWARD in name or "jvp(" in name:
    return "forward"
  return "other"


def _label(op_name: str) -> tuple[re.Match | None, re.Match | None]:
  return _CHUNK.search(op_name), _LOOP.search(op_name)


def _is_gpu(text: str) -> bool:
  return any(m in text for m in _GPU_MARKERS)


def audit(compiled: Any, schedule: Schedule, *, enforce_order: bool = True) -> AuditReport:
  """Checks a compiled step's all-reduces against `schedule`, and reads what overlaps them.

  Args:
    compiled: the compiled step (`jax.jit(step).lower(*args).compile()`, `jax.pmap(...).lower(...)
      .compile()`, or a step compiled for a compile-only GPU target, `prophet_jax.gpu_topology`), or
      its HLO text. Not a Lowered: XLA's merging and scheduling happen at compile time.
    schedule: the schedule the step carries out.
    enforce_order: how the step was built (`scheduled(..., enforce_order=)` and the other front-ends).
      False: a keyed program: its units are matched by element count and operand provenance, not by
      name (combined collectives keep none), and the order is XLA's, reported, not checked
      (`_keyed_audit`).

  Returns:
    An AuditReport; `report.ok` is the verdict, `report.problems` says what differs; per chunk, the
    ops scheduled inside its all-reduce window (XLA:GPU), `report.exposed` the chunks nothing overlaps.

  Raises:
    TypeError: `compiled` is not compiled, or `schedule` is not a Schedule.
  """
  check_values("audit", schedule=schedule)
  if not enforce_order:
    return audit_keyed(compiled, schedule)
  text = hlo_text(compiled)
  module = parse_hlo(text)
  ops = execution_order(module)
  after = _backward_after(ops)
  windows = async_windows(module, ops)
  costs = OpCosts(module)
  if schedule.sharded:
    return _audit_sharded(text, module, ops, after, windows, costs, schedule)
  # what the step issues: one all-reduce per chunk, a deferral group's slots (padded to its largest
  # chunk; `prophet/chunk<k>` numbers the issued all-reduces, so a group's slots are consecutive k)
  sizes = list(schedule.allreduce_sizes())
  chunks, loops, foreign = [], [], []
  found = allreduces(module, ops)
  coll_names = {a.op.instruction.name for a in found}
  coll_names |= {w.done.instruction.name for w in windows.values() if w.start.instruction.name in coll_names}
  for ar in found:
    op, ins = ar.op, ar.op.instruction
    window: AsyncWindow | None = windows.get(ins.name) if ar.form != "all-reduce" else None
    parts = ar.part_elements or (ar.elements,)
    merged = merged_op_names(ar.op_name)
    own_chunk, own_loop = _label(ar.op_name) if len(merged) == 1 else (None, None)
    if len(parts) == 1:
      labels = [(own_chunk, own_loop)]
      names = [ar.op_name]
      if not (own_chunk or own_loop):  # XLA:GPU's contiguous form: concatenate, all-reduce, slices
        result = window.done.instruction.name if window else ins.name
        cparts = contiguous_parts(module, op.computation, ins, users(module, op.computation, result),
                                  named=lambda nm: any(_label(nm)), operands=ar.operands)
        if cparts:
          parts = tuple(n for n, _ in cparts)
          names = [nm for _, nm in cparts]
          labels = [_label(nm) for nm in names]
        elif len(merged) > 1:  # combined, but not read back by slices: label it by what it merged
          names = [next((nm for nm in merged if any(_label(nm))), ar.op_name)]
          labels = [_label(names[0])]
    else:  # a combined all-reduce (a tuple): label each operand by its producer's scope
      labels, names = [], []
      for opnd in ar.operands[:len(parts)]:
        prod = module.instruction(op.computation, opnd)
        pn = prod.op_name if prod is not None else ""
        labels.append(_label(pn))
        names.append(pn)
      labels += [(None, None)] * (len(parts) - len(labels))
      names += [""] * (len(parts) - len(names))
      for own in ([own_chunk] if own_chunk else [_CHUNK.search(nm) for nm in merged if len(merged) > 1]):
        if own is None or any(c and c.group(1) == own.group(1) for c, _ in labels):
          continue
        k = int(own.group(1))
        want = sizes[k] if k < len(sizes) else None
        for i, (c, lp) in enumerate(labels):
          if c is None and lp is None and parts[i] == want:
            labels[i] = (own, None)
            break
    # XLA:GPU issues a synchronous all-reduce as a start/done pair too, marked is_sync
    asynchronous = window is not None and not ar.is_sync()
    inside = ()
    if window is not None:
      inside = tuple(WindowOp(name=w.instruction.name, opcode=w.instruction.opcode,
                              kind=_kind(w.instruction, coll_names),
                              flops=(c := costs.cost(w.computation, w.instruction))[0], nbytes=c[1],
                              op_name=w.instruction.op_name)
                     for w in window.inside)
    for (m, lm), elements, nm in zip(labels, parts, names):
      k = int(m.group(1)) if m else None
      entry = AuditEntry(
          name=ins.name, kind="chunk" if m else "loop" if lm else "foreign", chunk=k,
          label=lm.group(1) if lm else "", elements=elements,
          expected_elements=sizes[k] if k is not None and k < len(sizes) else None,
          trips=op.trips, position=op.index, backward_ops_after=after[op.index + 1],
          op_name=nm or ar.op_name, shared=len(parts) > 1, asynchronous=asynchronous,
          window=inside, form=ar.form)
      (chunks if m else loops if lm else foreign).append(entry)
  problems = []
  order = []
  for e in chunks:
    order.extend([e.chunk] * (e.trips or 1))
    if e.chunk >= len(sizes):
      problems.append(f"all-reduce {e.name} is labelled chunk{e.chunk}, but the schedule has "
                      f"{len(sizes)} all-reduces per step: was the step built with another schedule?")
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
  problems += _sequence_problems(order, len(sizes), len(chunks), "chunk", "all-reduce")
  if not schedule.chunks:
    problems.append("the schedule has no chunks.")
  peak = _peak_in_flight(ops, {a.op.instruction.name for a in found if a.form != "all-reduce" and not a.is_sync()})
  outside = _backward_outside(ops, chunks, windows, coll_names, costs)
  warnings = []
  if chunks and _is_gpu(text):
    if not any(e.asynchronous for e in chunks):
      warnings.append("the chunks' all-reduces are synchronous in this compiled program: no compute can "
                      "overlap them (count and order still hold). XLA:GPU (jaxlib 0.10 to 0.12) runs its "
                      "latency hiding scheduler by default only on Hopper and later; for an A100 or V100 set "
                      "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true, and on any GPU do not set it "
                      "to false (jaxlib 0.12 then makes them synchronous on an H100 too) nor set "
                      "xla_gpu_disable_async_collectives.")
    elif len(chunks) > 1 and not any(e.overlapped for e in chunks):
      warnings.append("no compute is scheduled inside any chunk's all-reduce window: every all-reduce is "
                      "exposed (count and order still hold). Is XLA's latency hiding scheduler off "
                      "(xla_gpu_enable_latency_hiding_scheduler=false)?")
    kernels = [e.chunk for e in chunks[:-1] if e.form == "fusion-start" and e.asynchronous
               and not e.overlapped]
    if kernels:
      warnings.append(f"chunk(s) {kernels[:10]}{'...' if len(kernels) > 10 else ''} run as XLA:GPU collective "
                      f"kernels (one-shot Triton kernels in an asynchronous collective fusion, fusion-start: "
                      f"jaxlib >= 0.12's default for all-reduces of up to a few MiB on one host) with no "
                      f"compute inside their windows. XLA's NCCL path overlaps them: XLA_FLAGS=--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE (or the "
                      f"compile option xla_gpu_experimental_use_collective_kernels='').")
  return AuditReport(planned=len(sizes), chunks=tuple(chunks), loops=tuple(loops),
                     foreign=tuple(foreign), order=tuple(order), ok=not problems,
                     problems=tuple(problems), total_ops=len(ops), max_in_flight=peak,
                     backward_outside_windows=outside, warnings=tuple(warnings))


# --------------------------------------------------------------------------------------------------
# a sharded schedule: reduce-scatters and all-gathers


def _audit_sharded(text: str, module: Any, ops: tuple[ExecutedOp, ...], after: list[int],
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

  def window_of(name: str, form: str) -> tuple[tuple[WindowOp, ...], bool]:
    win = windows.get(name) if form.endswith("-start") else None
    if win is None:
      return (), False
    return tuple(WindowOp(name=w.instruction.name, opcode=w.instruction.opcode,
                          kind=_kind(w.instruction, coll_names),
                          flops=(c := costs.cost(w.computation, w.instruction))[0], nbytes=c[1],
                          op_name=w.instruction.op_name) for w in win.inside), True

  chunks, gathers, foreign = [], [], []
  for c in found:
    label = (_RS if c.collective == "reduce-scatter" else _AG).search(c.op_name)
    k = int(label.group(1)) if label else None
    inside, has_window = window_of(c.op.instruction.name, c.form)
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
    for e in entries:
      if e.chunk >= planned:
        problems.append(f"{what} {e.name} is labelled {unit} {e.chunk}, but the schedule has {planned}: "
                        f"was the step built with another schedule?")
      elif e.elements != e.expected_elements:
        problems.append(f"{unit} {e.chunk}: {what} {e.name} has {e.elements} elements, planned "
                        f"{e.expected_elements} (for {n} devices)")
      if e.trips != 1:
        problems.append(f"{unit} {e.chunk}: {what} {e.name} runs {e.trips} times per step, planned once.")
    problems += _sequence_problems(seq, planned, len(entries), unit, what)
  if chunks and gathers and max(e.position for e in chunks) > min(e.position for e in gathers):
    problems.append("an all-gather runs before the last reduce-scatter: the two halves are not one "
                    "chain (every reduce-scatter, then every all-gather).")
  peak = _peak_in_flight(ops, {e.name for e in chunks + gathers if e.asynchronous})
  outside = _backward_outside(ops, chunks, windows, coll_names, costs)
  warnings = []
  if chunks and _is_gpu(text) and not any(e.asynchronous for e in chunks + gathers):
    warnings.append("the reduce-scatters and all-gathers are synchronous in this compiled program: no "
                    "compute can overlap them (count and order still hold). Is XLA's latency hiding "
                    "scheduler off, or are async collectives disabled?")
  return AuditReport(planned=len(schedule.chunks), chunks=tuple(chunks), loops=(), foreign=tuple(foreign),
                     order=tuple(order), ok=not problems, problems=tuple(problems), total_ops=len(ops),
                     max_in_flight=peak, backward_outside_windows=outside, warnings=tuple(warnings),
                     gathers=tuple(gathers), gather_order=tuple(gorder),
                     planned_gathers=len(schedule.gathers))


def audit_keyed(compiled: Any, schedule: Schedule, units: Sequence[KeyedUnit] | None = None) -> AuditReport:
  """A keyed program's audit (`audit(..., enforce_order=False)`; `units`: what a tagged step should hold,
  `TaggedPlan.units()`): `_keyed_audit` matches its collectives, with this module's report types."""
  check_values("audit", schedule=schedule)
  return keyed_audit(compiled, schedule, kit=sys.modules[__name__], units=units)


def _sequence_problems(seq: list[int], planned: int, found: int, unit: str, what: str) -> list[str]:
  """What is wrong with the compiled sequence `seq` of planned indices (each `unit`'s `what`, once per
  trip): units with none of their own, units run more than once, an order other than the schedule's."""
  counts = collections.Counter(seq)
  missing = [k for k in range(planned) if not counts[k]]
  repeated = [k for k in range(planned) if counts[k] > 1]
  problems = []
  if missing:
    problems.append(f"{unit}(s) {missing[:10]}{'...' if len(missing) > 10 else ''} have no {what} of their "
                    f"own in the compiled program ({found} found, {planned} planned): XLA merged them, or "
                    f"the step does not use this schedule.")
  if repeated:
    problems.append(f"{unit}(s) {repeated[:10]} run more than one {what} per step.")
  if seq != sorted(seq):
    problems.append(f"{what}s run in compiled order {seq[:20]}, not in schedule order.")
  return problems


def _peak_in_flight(ops: Sequence[Any], starts: set[str]) -> int:
  """The most asynchronous collectives in flight at once: `starts` (their start ops' names) opened,
  each closed by the `-done` op that reads it."""
  in_flight = peak = 0
  open_starts: set[str] = set()
  for op in ops:
    ins = op.instruction
    if ins.name in starts:
      open_starts.add(ins.name)
      in_flight += 1
      peak = max(peak, in_flight)
    elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in open_starts:
      open_starts.discard(ins.operands[0])
      in_flight -= 1
  return peak


def _backward_outside(ops: Sequence[Any], chunks: Sequence[Any], windows: dict, coll_names: Any,
                      costs: Any) -> int:
  """Backward ops with FLOPs after the first asynchronous chunk started that sit in no window."""
  first = min((e.position for e in chunks if e.asynchronous), default=None)
  if first is None:
    return 0
  covered = {w.index for win in windows.values() for w in win.inside}
  return sum(1 for op in ops[first + 1:] if op.index not in covered
             and _kind(op.instruction, coll_names) == "backward" and costs.flops(op.computation, op.instruction) > 0)
