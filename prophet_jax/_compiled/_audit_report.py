"""What `audit` reports: the compiled step's collectives sorted by the schedule's labels (`AuditReport`,
`AuditEntry` per collective, `WindowOp` per op inside an async collective's window), its human summary
and its JSON form (`AUDIT_SCHEMA`)."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._values._types import JsonValue, json_fields, json_object

AUDIT_SCHEMA = 1
# window op kinds that are work of the step (what hides a collective's latency)
COMPUTE_KINDS = ("backward", "forward", "other")
NEXT_FORWARD = "pipelined_forward"  # the named scope of the pipelined step's next forward
_FORM_WORDS = {"all-reduce": "all-reduce (synchronous)", "all-reduce-start": "all-reduce-start/done (async)",
               "fusion-start": "fusion-start/done (async collective fusion)",
               "async-start": "async-start/done (async wrapper)"}


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
    flops: matrix-product and convolution FLOPs (`_hlo_costs.OpCosts`; elementwise ops count 0).
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
    kind: 'chunk', 'loop', 'gather', 'regather' (an FSDP group gathered again in backward), 'replica' (an
      HSDP unit's shard all-reduced over the replica axes) or 'foreign'.
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
    form: how the compiled program writes the all-reduce (`_hlo_collectives.ALL_REDUCE_FORMS`): 'all-reduce'
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
class AuditReport(JsonValue):
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
    planned_gathers: the all-gathers the schedule issues per step (`schedule.num_all_gathers`); an FSDP
      plan's gather groups.
    regathers: an FSDP plan's all-gathers again in backward (`chunk` the group), in compiled order.
    planned_regathers: the groups an FSDP plan gathers again (those it does not keep).
    gathers_in_flight: the most of an FSDP plan's all-gathers in flight at once (XLA:GPU).
    family: "fsdp" for an FSDP plan's audit (`chunks` then holds its units' reduce-scatters and its
      replicated chunks' all-reduces, `collective` says which), else "".
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
  regathers: tuple[AuditEntry, ...] = ()
  planned_regathers: int = 0
  gathers_in_flight: int = 0
  family: str = ""
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
    return dict(collections.Counter(e.form or "?" for e in self.chunks + self.loops + self.foreign))

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
    return sum({o.name: o.flops for e in self.chunks for o in e.window if o.kind in COMPUTE_KINDS}.values())

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
    if self.family == "fsdp":
      units = sum(e.collective == "reduce-scatter" for e in self.chunks)
      shards = sum(e.kind == "replica" for e in self.chunks)
      head = (f"audit: {'OK' if self.ok else 'MISMATCH'}: fsdp: {len(self.gathers)} all-gather(s) of "
              f"{self.planned_gathers} groups, {len(self.regathers)} again in backward of {self.planned_regathers} "
              f"planned; {units} reduce-scatter(s)" + (f", {shards} shard all-reduce(s) over the replicas" if shards
                                                      else "") + f" and {len(self.chunks) - units - shards} "
              f"replicated all-reduce(s) of {self.planned} chunks, order {list(self.order)}; {len(self.foreign)} foreign")
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
                   f"window; next forward inside {list(self.gathers_forward_overlap)}" + (
                       f"; at most {self.gathers_in_flight} in flight" if self.family else ""))
    lines += [f"  problem: {p}" for p in self.problems]
    lines += [f"  warning: {w}" for w in self.warnings]
    return "\n".join(lines)

  def summary(self) -> str:
    """Deprecated: `describe()`, the name every value's human summary has."""
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

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> AuditReport:
    """Reads `to_json`'s output back (a JSON string or the dict).

    Raises:
      ValueError: malformed JSON, unknown or missing fields, or another schema version.
    """
    obj = json_object(text_or_obj, "AuditReport")
    if obj.get("schema", AUDIT_SCHEMA) != AUDIT_SCHEMA:
      raise ValueError(f"AuditReport.from_json: schema={obj.get('schema')!r}; this version reads "
                       f"{AUDIT_SCHEMA}.")
    obj = json_fields(cls, obj, "AuditReport", required=True)
    for key in ("chunks", "loops", "foreign", "gathers", "regathers"):
      obj[key] = tuple(_entry(e) for e in obj.get(key, ()))
    for key in ("order", "problems", "warnings", "gather_order"):
      obj[key] = tuple(obj.get(key, ()))
    return cls(**obj)


def _entry(obj: Mapping[str, Any]) -> AuditEntry:
  if not isinstance(obj, Mapping):
    raise ValueError(f"AuditReport.from_json: an entry must be an object, got {type(obj).__name__}.")
  obj = json_fields(AuditEntry, dict(obj), "AuditEntry", required=True)
  obj["window"] = tuple(WindowOp(**json_fields(WindowOp, dict(o), "WindowOp", required=True))
                        for o in obj.get("window", ()))
  return AuditEntry(**obj)
