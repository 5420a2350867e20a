"""Reading compiled HLO text: instructions, call graph, execution order (pure; docs/design.md)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPNAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64,
         "c128": 128}


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape) if t != "token"]


def shape_dims(shape: str) -> tuple[tuple[int, ...], ...]:
  return tuple(dims for _, dims in _arrays(shape))


def shape_dtypes(shape: str) -> tuple[str, ...]:
  return tuple(t for t, _ in _arrays(shape))


def shape_parts(shape: str) -> tuple[int, ...]:
  return tuple(math.prod(dims) for dims in shape_dims(shape))


def shape_elements(shape: str) -> int:
  return sum(shape_parts(shape))


def shape_bytes(shape: str) -> int:
  bits = sum(math.prod(dims) * _BITS.get(t, 8 if t.startswith("f8") else 4 if t.startswith("f4") else 0)
             for t, dims in _arrays(shape))
  return (bits + 7) // 8


class Shaped:
  """What a value with an HLO `shape` says of it: its elements, and each array's (one per operand of a tuple)."""

  __slots__ = ()

  @property
  def elements(self) -> int:
    return shape_elements(self.shape)  # type: ignore[attr-defined]

  @property
  def part_elements(self) -> tuple[int, ...]:
    return shape_parts(self.shape)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class HloInstruction(Shaped):
  """One HLO instruction: its name, opcode, result shape, op_name metadata, operands and callees."""

  name: str
  opcode: str
  shape: str
  op_name: str
  operands: tuple[str, ...]
  callees: tuple[tuple[str, str], ...]
  trip_count: int | None
  text: str = field(repr=False)
  root: bool = False


@dataclass(frozen=True, slots=True)
class HloModule:

  name: str
  entry: str
  computations: dict[str, tuple[HloInstruction, ...]]
  scheduled: bool

  def instruction(self, computation: str, name: str) -> HloInstruction | None:
    return next((ins for ins in self.computations.get(computation, ()) if ins.name == name), None)

  def called(self, ins: HloInstruction | None) -> tuple[str | None, HloInstruction | None]:
    """(the computation `ins` calls, that computation's ROOT); None for what is not there."""
    body = dict(ins.callees).get("calls") if ins is not None else None
    return body, next((i for i in self.computations.get(body or "", ()) if i.root), None)


def hlo_text(compiled: Any) -> str:
  """The optimized HLO text of a compiled executable; TypeError for a Lowered (XLA's passes have not run)."""
  if isinstance(compiled, str):
    return compiled
  if hasattr(compiled, "compile") or type(compiled).__name__ == "Lowered":
    raise TypeError("expected a *compiled* step (`jax.jit(step).lower(*args).compile()`), got a "
                    f"{type(compiled).__name__}; XLA's passes (which merge and reorder all-reduces) run at "
                    "compile time, so the lowered program says nothing about them. Call .compile().")
  as_text = getattr(compiled, "as_text", None)
  if as_text is None:
    raise TypeError(f"expected a compiled jax executable or HLO text, got {type(compiled).__name__}.")
  text = as_text()
  if not isinstance(text, str) or "HloModule" not in text:
    raise TypeError(f"{type(compiled).__name__}.as_text() did not return HLO module text.")
  return text


def _closing(text: str, depth: int = 0) -> int:
  for i, ch in enumerate(text):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      return i
  return len(text)


def _split_shape(rest: str) -> tuple[str, str]:
  rest = rest.lstrip()
  end = _closing(rest) + 1 if rest.startswith("(") else rest.find(" ") if " " in rest else len(rest)
  return rest[:end], rest[end:].lstrip()


def _parse_instruction(line: str) -> HloInstruction | None:
  m = _INSTR_HEAD.match(line)
  if not m:
    return None
  shape, tail = _split_shape(line[m.end():])
  om = re.match(r"([a-z][a-z0-9\-]*)\(", tail)
  if not om:
    return None
  callees = _CALLEE.findall(tail)
  for group in _BRANCHES.findall(tail):
    callees += [("branch", b.strip().lstrip("%")) for b in group.split(",") if b.strip()]
  tm = _TRIP.search(tail) if om.group(1) == "while" else None
  opm = _OPNAME.search(tail)
  args = tail[om.end():]
  return HloInstruction(name=m.group(2), opcode=om.group(1), shape=shape, op_name=opm.group(1) if opm else "",
                        operands=tuple(re.findall(r"%([\w.\-]+)", args[:_closing(args, 1)])),
                        callees=tuple(callees), trip_count=int(tm.group(1)) if tm else None, text=line.strip(),
                        root=bool(m.group(1)))


def parse_hlo(text: str) -> HloModule:
  """Parses HLO module text (`compiled.as_text()`); ValueError without a module or an ENTRY computation."""
  if not isinstance(text, str) or "HloModule" not in text:
    raise ValueError("parse_hlo: the text is not an HLO module (no 'HloModule' header).")
  first = text[text.index("HloModule"):].splitlines()[0]
  name = first.split()[1].rstrip(",") if len(first.split()) > 1 else ""
  comps: dict[str, list[HloInstruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      if m := _COMP_HEAD.match(line):
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
      continue
    if line.strip() == "}":
      current = None
      continue
    ins = _parse_instruction(line)
    if ins is not None:
      comps[current].append(ins)
  if not entry:
    raise ValueError("parse_hlo: no ENTRY computation found in the HLO text.")
  return HloModule(name=name, entry=entry, computations={k: tuple(v) for k, v in comps.items()},
                   scheduled="is_scheduled=true" in first)


@dataclass(frozen=True, slots=True)
class ExecutedOp:
  """An instruction at its place in `execution_order`, with its trips per run (None: unknown) and loops."""

  instruction: HloInstruction
  computation: str
  index: int
  trips: int | None
  loops: tuple[str, ...]


_STRUCTURAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "call",
               "while", "conditional", "after-all", "opt-barrier"}
# the calls execution_order inlines: opcode -> the callee kinds it runs
_INLINED = {"call": ("to_apply",), "conditional": ("branch", "true_computation", "false_computation")}


def execution_order(module: HloModule) -> tuple[ExecutedOp, ...]:
  """Every non-structural instruction, called computations inlined at their call sites (loop bodies once)."""
  out: list[ExecutedOp] = []

  def walk(comp: str, trips: int | None, loops: tuple[str, ...], depth: int) -> None:
    if depth > 64:
      raise ValueError("execution_order: the HLO call graph is deeper than 64 levels.")
    for ins in module.computations.get(comp, ()):
      if ins.opcode == "while":  # the condition runs once more than the body
        called = dict(ins.callees)
        t = None if trips is None or ins.trip_count is None else trips * ins.trip_count
        for kind, runs in (("condition", None if t is None else t + (trips or 0)), ("body", t)):
          if called.get(kind):
            walk(called[kind], runs, loops + (ins.name,), depth + 1)
        continue
      if ins.opcode in _INLINED:
        for kind, callee in ins.callees:
          if kind in _INLINED[ins.opcode]:
            walk(callee, trips, loops, depth + 1)
        continue
      if ins.opcode in _STRUCTURAL:
        continue
      out.append(ExecutedOp(instruction=ins, computation=comp, index=len(out), trips=trips,
                            loops=loops))

  walk(module.entry, 1, (), 0)
  return tuple(out)


_PASS_THROUGH = ("bitcast", "copy", "reshape")


def producer(module: HloModule, comp: str, name: str) -> HloInstruction | None:
  ins = module.instruction(comp, name)
  for _ in range(8):
    if ins is None or ins.opcode not in _PASS_THROUGH or not ins.operands:
      return ins
    ins = module.instruction(comp, ins.operands[0])
  return ins


def users(module: HloModule, comp: str, name: str) -> list[HloInstruction]:
  return [i for i in module.computations.get(comp, ()) if name in i.operands]
