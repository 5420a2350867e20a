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

An FSDP plan's step (`hooked` with an FSDP plan) is audited by its all-gathers, re-gathers, reduce-scatters and
replicated chunks (`_audit_fsdp`), a scanned stack's loops counted per layer.

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
op_names it merged ('.../(prophet/chunk5/psum:psum)', `_hlo_collectives.merged_op_names`): read through like an
unnamed one.

The schedule of an async collective (XLA:GPU's start / done pairs) is read as well:
each entry's `window` holds the ops the compiled program runs between the start and the done, with their
kind (backward, forward, other compute, the rewrite's own gather/tie ops, collectives) and their FLOPs and
bytes from the HLO shapes (`_hlo_costs.OpCosts`). A chunk with no backward, forward or other compute in its
window is *exposed*: nothing hides its latency.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._audit_checks import (backward_outside, entry_problems, is_gpu, keyed_problem, peak_in_flight,
                            read_program, reduced_again, sequence_problems, window_ops)
from ._audit_report import AuditEntry, AuditReport
from ._audit_fsdp import audit_fsdp
from ._audit_sharded import audit_sharded
from ._hlo import users
from ._keyed_audit import KeyedUnit, keyed_audit
from ._hlo_collectives import AsyncWindow, allreduces, contiguous_parts, merged_op_names
from .._values._checks import check_bool, check_values
from .._values._schedule import Schedule

_CHUNK = re.compile(r"prophet/chunk(\d+)(?![0-9])")
_LOOP = re.compile(r"prophet/loop/([\w.\-]+)")


def _label(op_name: str) -> tuple[re.Match | None, re.Match | None]:
  return _CHUNK.search(op_name), _LOOP.search(op_name)



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
  ordered = check_bool("audit", "enforce_order", enforce_order, fix="False audits a step built with "
                       "enforce_order=False (a keyed program).")
  if not ordered and schedule.family != "fsdp":
    return keyed_audit(compiled, schedule)
  text, module, ops, after, windows, costs = read_program(compiled)
  if schedule.family == "fsdp":   # its gathers, re-gathers and reduce-scatters; the replicated chunks as below
    return audit_fsdp(text, module, ops, after, windows, costs, schedule,
                      _audit_allreduces(text, module, ops, after, windows, costs, schedule), ordered=ordered)
  if schedule.family == "zero1":
    report = audit_sharded(text, module, ops, after, windows, costs, schedule)
  else:
    report = _audit_allreduces(text, module, ops, after, windows, costs, schedule)
  keyed = None if report.ok else keyed_problem(text)
  return report if keyed is None else dataclasses.replace(report, problems=(keyed,) + report.problems)


def _audit_allreduces(text: str, module: Any, ops: Any, after: list[int], windows: dict, costs: Any,
                      schedule: Schedule) -> AuditReport:
  """`audit` of an all-reduce schedule's ordered program (the module docstring)."""
  # what the step issues: one all-reduce per chunk, a deferral group's slots (padded to its largest
  # chunk; `prophet/chunk<k>` numbers the issued all-reduces, so a group's slots are consecutive k)
  sizes = list(schedule.allreduce_sizes())
  chunks, loops, foreign, again = [], [], [], []
  found = allreduces(module, ops)
  coll_names = {a.op.instruction.name for a in found}
  coll_names |= {w.done.instruction.name for w in windows.values() if w.start.instruction.name in coll_names}
  # the plan's own reduced results: an operand that carries one on is gradients reduced a second time
  planned = {a.op.instruction.name for a in found if any(_label(a.op_name))}
  planned |= {w.done.instruction.name for n, w in windows.items() if n in planned}
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
      names = [prod.op_name if (prod := module.instruction(op.computation, opnd)) is not None else ""
               for opnd in ar.operands[:len(parts)]]
      names += [""] * (len(parts) - len(names))
      labels = [_label(nm) for nm in names]
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
    inside = window_ops(window, coll_names, costs)
    sources = [[o] for o in ar.operands[:len(parts)]] if len(parts) > 1 else [list(ar.operands)]
    for i, ((m, lm), elements, nm) in enumerate(zip(labels, parts, names)):
      source = None if (own_chunk or own_loop) and len(parts) == 1 or i >= len(sources) else reduced_again(
          module, op.computation, sources[i], planned - {ins.name})
      if source is not None:   # not a chunk's all-reduce: the plan's result reduced once more
        m = lm = None
        again.append((elements, ar.op_name, source))
      k = int(m.group(1)) if m else None
      entry = AuditEntry(
          name=ins.name, kind="chunk" if m else "loop" if lm else "foreign", chunk=k,
          label=lm.group(1) if lm else "", elements=elements,
          expected_elements=sizes[k] if k is not None and k < len(sizes) else None,
          trips=op.trips, position=op.index, backward_ops_after=after[op.index + 1],
          op_name=nm or ar.op_name, shared=len(parts) > 1, asynchronous=asynchronous,
          window=inside, form=ar.form)
      (chunks if m else loops if lm else foreign).append(entry)
  problems = [] if not again else [_again_problem(again)]
  order = [e.chunk for e in chunks for _ in range(e.trips or 1)]
  problems += entry_problems(chunks, len(sizes), "all-reduce", "chunk", "reduces",
                             "merged with other all-reduces by XLA's combiner?")
  by_ins: dict[str, list[int]] = {}
  for e in chunks:
    by_ins.setdefault(e.name, []).append(e.chunk)
  for name, ks in by_ins.items():
    if len(ks) > 1:
      problems.append(f"chunks {ks} share one all-reduce ({name}): XLA's combiner merged them.")
  problems += sequence_problems(order, len(sizes), len(chunks), "chunk", "all-reduce")
  if not chunks and sizes and not any(after):   # no backward and no chunk: a forward-only program
    problems.append("this program has no backward pass and none of the schedule's all-reduces: it runs a "
                    "forward alone, as a pipelined step does from a state with nothing pending (after "
                    "init or flush). Lower the step from a state with a forward pending (after one step) "
                    "to audit the program that reduces.")
  if not schedule.chunks:
    problems.append("the schedule has no chunks.")
  peak = peak_in_flight(ops, {a.op.instruction.name for a in found if a.form != "all-reduce" and not a.is_sync()})
  outside = backward_outside(ops, chunks, windows, coll_names, costs)
  warnings = []
  if chunks and is_gpu(text):
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


def _again_problem(again: list[tuple[int, str, str]]) -> str:
  """The problem of gradients the plan reduced being all-reduced once more in the step."""
  elements = sum(e for e, _, _ in again)
  _, name, source = again[0]
  return (f"a second all-reduce of the gradients remains: {len(again)} all-reduce operand(s), {elements:,} "
          f"elements (e.g. op_name {name!r}), reduce again what the plan's all-reduce {source} already "
          f"reduced. The step still averages the gradients itself: a jax.lax.pmean(grads, axis) left from "
          f"the plain step, or a tx that reduces them. Remove it: the gradients of hooked and scheduled are "
          f"already averaged over the axis (the numbers do not change; each gradient crosses the network "
          f"twice).")


def audit_keyed(compiled: Any, schedule: Schedule, units: Sequence[KeyedUnit] | None = None) -> AuditReport:
  """A keyed program's audit (`audit(..., enforce_order=False)`; `units`: what a tagged step should hold,
  `TaggedPlan.units()`): `_keyed_audit` matches its collectives by size and provenance."""
  check_values("audit", schedule=schedule)
  return keyed_audit(compiled, schedule, units=units)
