"""The checks both audits make (all-reduces, and a sharded schedule's reduce-scatters and all-gathers):
what kind of work an op is, the ops inside a collective's async window, each labelled collective
against its planned size and trip count, the compiled sequence against the plan's order, and how
many collectives are in flight at once."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from typing import Any

from ._audit_report import NEXT_FORWARD, WindowOp
from ._hlo import ExecutedOp, HloInstruction, execution_order, hlo_text, parse_hlo
from ._hlo_collectives import AsyncWindow, async_windows, is_collective
from ._hlo_costs import OpCosts

_GPU_MARKERS = ('"collective_backend_config"', "__cudnn$", "__cublas", "gemm_fusion", "triton")


def backward_after(ops: tuple[ExecutedOp, ...]) -> list[int]:
  """For each index, how many backward ops (op_name with 'transpose(') run after it."""
  after = [0] * (len(ops) + 1)
  for i in range(len(ops) - 1, -1, -1):
    after[i] = after[i + 1] + ("transpose(" in ops[i].instruction.op_name)
  return after


def op_kind(ins: HloInstruction, collective_names: set[str] = frozenset()) -> str:
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




_MOVES = frozenset({"bitcast", "copy", "reshape", "slice", "dynamic-slice", "get-tuple-element", "tuple",
                    "concatenate", "transpose", "convert", "multiply", "divide", "broadcast", "parameter",
                    "constant"})


def reduced_again(module: Any, computation: str, operands: Sequence[str], results: set[str],
                  depth: int = 4) -> str | None:
  """The name of a collective in `results` (the plan's reduced results) whose value `operands` carry on
  through data movement and scaling alone (ops, or fusions of ops, in `_MOVES`: not the tie, not any
  compute): a second reduction of gradients the plan already reduced. None when there is none within
  `depth` ops."""
  frontier, seen = [(o, 0) for o in operands], set()
  while frontier:
    name, d = frontier.pop()
    if name in results:
      return name
    if name in seen or d >= depth:
      continue
    seen.add(name)
    ins = module.instruction(computation, name)
    if ins is None:
      continue
    body = dict(ins.callees).get("calls")
    moves = ins.opcode in _MOVES or (ins.opcode == "fusion" and body is not None and all(
        i.opcode in _MOVES for i in module.computations.get(body, ())))
    if moves:
      frontier.extend((o, d + 1) for o in ins.operands)
  return None


_KEYED = re.compile(r'combiner_key\s*=\s*"(prophet/[a-z]+\d+)"')


def keyed_problem(text: str) -> str | None:
  """The problem to report when an ordered audit reads a keyed program (a step built with
  `enforce_order=False`: its collectives carry the plan's combiner keys and no tie), naming the fix."""
  keys = sorted(set(_KEYED.findall(text)), key=lambda k: (len(k), k))
  return (f"this program is keyed: its collectives carry the plan's combiner keys ({', '.join(keys[:3])}"
          f"{', ...' if len(keys) > 3 else ''}) and no tie, as a step built with enforce_order=False is, so "
          f"XLA orders them (and XLA:CPU combines them). Audit it as it was built: "
          f"prophet_jax.audit(compiled, schedule, enforce_order=False); or build the step with "
          f"enforce_order=True (the default) for the plan's own order.") if keys else None


def is_gpu(text: str) -> bool:
  return any(m in text for m in _GPU_MARKERS)

def window_ops(window: AsyncWindow | None, coll_names: set[str], costs: OpCosts) -> tuple[WindowOp, ...]:
  """The ops scheduled inside an async collective's window, each with its kind, FLOPs and bytes."""
  return tuple(WindowOp(name=w.instruction.name, opcode=w.instruction.opcode,
                        kind=op_kind(w.instruction, coll_names),
                        flops=(c := costs.cost(w.computation, w.instruction))[0], nbytes=c[1],
                        op_name=w.instruction.op_name)
               for w in (window.inside if window is not None else ()))


def entry_problems(entries: Sequence[Any], planned: int, what: str, unit: str, verb: str, why: str
                   ) -> list[str]:
  """What is wrong with each labelled collective (`what`, e.g. 'all-reduce', of a `unit` k, e.g. chunk
  k): a label beyond the plan, another size than planned (`verb` it: 'reduces'; `why`: the likely
  cause), or more than one run per step."""
  problems = []
  for e in entries:
    if e.chunk >= planned:
      problems.append(f"{what} {e.name} is labelled {unit}{e.chunk}, but the schedule has "
                      f"{planned} {what}s per step: was the step built with another schedule?")
    elif e.elements != e.expected_elements:
      problems.append(f"{unit}{e.chunk}: {what} {e.name} {verb} {e.elements} elements, planned "
                      f"{e.expected_elements} ({why})")
    if e.trips != 1:
      problems.append(f"{unit}{e.chunk}: {what} {e.name} runs {e.trips} times per step (inside a "
                      f"loop), planned once.")
  return problems


def sequence_problems(seq: list[int], planned: int, found: int, unit: str, what: str) -> list[str]:
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


def peak_in_flight(ops: Sequence[Any], starts: set[str]) -> int:
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


def backward_outside(ops: Sequence[Any], chunks: Sequence[Any], windows: dict, coll_names: Any,
                      costs: Any) -> int:
  """Backward ops with FLOPs after the first asynchronous chunk started that sit in no window."""
  first = min((e.position for e in chunks if e.asynchronous), default=None)
  if first is None:
    return 0
  covered = {w.index for win in windows.values() for w in win.inside}
  return sum(1 for op in ops[first + 1:] if op.index not in covered
             and op_kind(op.instruction, coll_names) == "backward" and costs.flops(op.computation, op.instruction) > 0)


def read_program(compiled: Any) -> tuple[str, Any, tuple[ExecutedOp, ...], list[int], dict, OpCosts]:
  """What every audit reads of a compiled step (or its HLO text): (text, module, executed ops, backward
  ops after each, async windows by start name, op costs)."""
  text = hlo_text(compiled)
  module = parse_hlo(text)
  ops = execution_order(module)
  return text, module, ops, backward_after(ops), async_windows(module, ops), OpCosts(module)
