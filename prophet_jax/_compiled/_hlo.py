"""Reading compiled HLO text: computations, instructions, call graph, loop trip counts, collectives.

Pure text processing (no jax import): give it `compiled.as_text()` (`hlo_text(compiled)` does that and
rejects a Lowered, whose HLO has not been through XLA's passes). The compiled module of a CPU or GPU
executable is scheduled (`is_scheduled=true`), so the order of instructions in a computation is their
execution order; `execution_order` inlines called computations (while bodies, calls, conditionals) at
their call sites, so collectives in a loop body appear once, at the loop, with the loop's trip count.

Public helpers:
  parse_hlo(text) -> HloModule
  execution_order(module) -> tuple[ExecutedOp, ...]
  collectives(module, opcodes=ALL_REDUCE_OPCODES) -> tuple[ExecutedOp, ...]   (by opcode)
  allreduces(module) -> tuple[AllReduceOp, ...]   every all-reduce, in whichever form XLA wrote it
  async_windows(module) -> {start name: ops scheduled between an async collective's start and done}
  merged_op_names(op_name) -> the op_names XLA joined into one when it combined instructions
  contiguous_parts(module, ...) -> the parts of an all-reduce of one concatenated buffer (XLA:GPU)
  sharded_collectives(module) -> every reduce-scatter and all-gather, in whichever form XLA wrote it
  OpCosts(module).cost(computation, instruction) -> (flops, bytes), from the HLO shapes alone
  shape_elements(shape_text) -> int ; shape_bytes(shape_text) -> int ; shape_dtypes(shape_text)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

__all__ = ["HloInstruction", "HloModule", "ExecutedOp", "parse_hlo", "hlo_text", "execution_order",
           "collectives", "allreduces", "AllReduceOp", "ALL_REDUCE_FORMS", "merged_op_names", "async_windows", "OpCosts", "shape_elements", "shape_bytes", "shape_dtypes",
           "is_collective", "ALL_REDUCE_OPCODES", "producer", "users", "contiguous_parts",
           "SHARDED_COLLECTIVES", "ShardedCollectiveOp", "sharded_collectives"]

ALL_REDUCE_OPCODES = ("all-reduce", "all-reduce-start")
# how a compiled program writes an all-reduce (`AllReduceOp.form`): a synchronous `all-reduce` (the CPU's,
# or XLA:GPU's when nothing can overlap it); an async `all-reduce-start` / `all-reduce-done` pair (XLA:GPU;
# jaxlib 0.10 gives the start the result's shape, 0.12 a tuple (operands, result)); a `fusion-start` /
# `fusion-done` pair whose called computation's ROOT is the all-reduce (jaxlib 0.12's XLA:GPU wraps a
# collective in an asynchronous collective fusion, kind=kCustom, `__triton_collective`); an `async-start`
# / `async-done` pair around a called all-reduce (XLA's generic async wrapper)
ALL_REDUCE_FORMS = ("all-reduce", "all-reduce-start", "fusion-start", "async-start")
_WRAPPED_FORMS = ("fusion-start", "async-start")

_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPNAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def shape_elements(shape: str) -> int:
  """Elements in an HLO shape ('f32[4,5]{1,0}' -> 20; a tuple sums its arrays; 'f32[]' -> 1)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    total += math.prod(int(d) for d in dims.split(",") if d) if dims else 1
  return total


_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64,
         "c128": 128}


def _dtype_bits(dtype: str) -> int:
  if dtype in _BITS:
    return _BITS[dtype]
  if dtype.startswith("f8"):
    return 8
  if dtype.startswith("f4"):
    return 4
  return 0  # token, opaque types


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape ('f32[4,5]{1,0}' -> 80; a tuple sums its arrays; tokens count 0)."""
  bits = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    bits += n * _dtype_bits(dtype)
  return (bits + 7) // 8


def shape_dims(shape: str) -> tuple[tuple[int, ...], ...]:
  """Dimensions of each array in an HLO shape ('(f32[2,3], u8[0])' -> ((2, 3), (0,)))."""
  return tuple(tuple(int(d) for d in dims.split(",") if d) for dt, dims in _ARRAY.findall(shape)
               if dt != "token")


def shape_dtypes(shape: str) -> tuple[str, ...]:
  """Element types in an HLO shape, in order ('(f32[2], bf16[3])' -> ('f32', 'bf16'))."""
  return tuple(d for d, _ in _ARRAY.findall(shape) if d != "token")


@dataclass(frozen=True, slots=True)
class HloInstruction:
  """One HLO instruction.

  Attributes:
    name: its name without '%'.
    opcode: 'all-reduce', 'fusion', 'while', ...
    shape: the result shape text.
    op_name: the op_name metadata ('' if none): jax's name stack, e.g. '.../prophet/chunk3/psum'.
    operands: names of its operands (without '%'), in order.
    callees: (kind, computation) pairs: ('body', ...), ('condition', ...), ('calls', ...), ...
    trip_count: a while loop's known trip count (None when unknown or not a loop).
    text: the instruction's line.
    root: whether it is its computation's ROOT.
  """

  name: str
  opcode: str
  shape: str
  op_name: str
  operands: tuple[str, ...]
  callees: tuple[tuple[str, str], ...]
  trip_count: int | None
  text: str = field(repr=False)
  root: bool = False

  @property
  def elements(self) -> int:
    return shape_elements(self.shape)

  @property
  def part_elements(self) -> tuple[int, ...]:
    """Elements of each array of the result shape (one per operand for a combined collective)."""
    return tuple(shape_elements(f"{d}[{dims}]") for d, dims in _ARRAY.findall(self.shape) if d != "token")


@dataclass(frozen=True, slots=True)
class HloModule:
  """A parsed HLO module: computations (name -> instructions in order) and the entry's name."""

  name: str
  entry: str
  computations: dict[str, tuple[HloInstruction, ...]]
  scheduled: bool

  def instruction(self, computation: str, name: str) -> HloInstruction | None:
    """The instruction `name` of `computation` (None if absent)."""
    for ins in self.computations.get(computation, ()):
      if ins.name == name:
        return ins
    return None


def hlo_text(compiled: Any) -> str:
  """The optimized HLO text of a compiled executable (`jax.jit(f).lower(...).compile()`).

  Raises:
    TypeError: `compiled` is a Lowered (not yet compiled) or has no HLO text.
  """
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


def _split_shape(rest: str) -> tuple[str, str]:
  """Splits 'SHAPE opcode(...)...' into (SHAPE, 'opcode(...)...'); SHAPE may be a parenthesized tuple."""
  rest = rest.lstrip()
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
    return rest, ""
  sp = rest.find(" ")
  return (rest, "") if sp < 0 else (rest[:sp], rest[sp + 1:].lstrip())


def _parse_instruction(line: str) -> HloInstruction | None:
  m = _INSTR_HEAD.match(line)
  if not m:
    return None
  shape, tail = _split_shape(line[m.end():])
  om = re.match(r"([a-z][a-z0-9\-]*)\(", tail)
  if not om:
    return None
  callees = [(k, v) for k, v in _CALLEE.findall(tail)]
  for group in _BRANCHES.findall(tail):
    callees += [("branch", b.strip().lstrip("%")) for b in group.split(",") if b.strip()]
  trip = None
  if om.group(1) == "while":
    tm = _TRIP.search(tail)
    trip = int(tm.group(1)) if tm else None
  opm = _OPNAME.search(tail)
  args, depth = tail[om.end():], 1
  for i, ch in enumerate(args):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      args = args[:i]
      break
  operands = tuple(re.findall(r"%([\w.\-]+)", args))
  return HloInstruction(name=m.group(2), opcode=om.group(1), shape=shape,
                        op_name=opm.group(1) if opm else "", operands=operands,
                        callees=tuple(callees), trip_count=trip,
                        text=line.strip(), root=bool(m.group(1)))


def parse_hlo(text: str) -> HloModule:
  """Parses HLO module text (as `compiled.as_text()` prints it).

  Raises:
    ValueError: the text holds no HLO module or no ENTRY computation.
  """
  if not isinstance(text, str) or "HloModule" not in text:
    raise ValueError("parse_hlo: the text is not an HLO module (no 'HloModule' header).")
  first = text[text.index("HloModule"):].splitlines()[0]
  name = first.split()[1].rstrip(",") if len(first.split()) > 1 else ""
  comps: dict[str, list[HloInstruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      m = _COMP_HEAD.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
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
  """An instruction at its place in the inlined execution order.

  Attributes:
    instruction: the instruction.
    computation: the computation it belongs to.
    index: its position in `execution_order` (0-based).
    trips: how many times it runs per execution of the module (product of enclosing loops' trip
      counts); None when a loop's trip count is unknown.
    loops: names of the enclosing while instructions, outermost first.
  """

  instruction: HloInstruction
  computation: str
  index: int
  trips: int | None
  loops: tuple[str, ...]


_STRUCTURAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "call",
               "while", "conditional", "after-all", "opt-barrier"}


def execution_order(module: HloModule) -> tuple[ExecutedOp, ...]:
  """Every non-structural instruction, called computations inlined at their call sites (loop bodies once).

  Fusion bodies are not expanded (a fusion is one executed op); reducers (`to_apply` of reductions and
  collectives) are skipped. Structural ops (parameters, constants, tuples, bitcasts, copies, calls,
  whiles) are left out, so indices count real work.
  """
  out: list[ExecutedOp] = []

  def walk(comp: str, trips: int | None, loops: tuple[str, ...], depth: int) -> None:
    if depth > 64:
      raise ValueError("execution_order: the HLO call graph is deeper than 64 levels.")
    for ins in module.computations.get(comp, ()):
      if ins.opcode == "while":
        body = dict(ins.callees).get("body")
        cond = dict(ins.callees).get("condition")
        t = None if trips is None or ins.trip_count is None else trips * ins.trip_count
        if cond:
          walk(cond, None if t is None else t + (trips or 0), loops + (ins.name,), depth + 1)
        if body:
          walk(body, t, loops + (ins.name,), depth + 1)
        continue
      if ins.opcode == "call":
        for kind, callee in ins.callees:
          if kind == "to_apply":
            walk(callee, trips, loops, depth + 1)
        continue
      if ins.opcode == "conditional":
        for kind, callee in ins.callees:
          if kind in ("branch", "true_computation", "false_computation"):
            walk(callee, trips, loops, depth + 1)
        continue
      if ins.opcode in _STRUCTURAL:
        continue
      out.append(ExecutedOp(instruction=ins, computation=comp, index=len(out), trips=trips,
                            loops=loops))

  walk(module.entry, 1, (), 0)
  return tuple(out)


def collectives(module: HloModule, opcodes: tuple[str, ...] = ALL_REDUCE_OPCODES
                ) -> tuple[ExecutedOp, ...]:
  """The collectives of `opcodes` in execution order, with their trip counts (by opcode: an all-reduce
  wrapped in an async collective fusion is a `fusion-start`; `allreduces` finds every form)."""
  return tuple(op for op in execution_order(module) if op.instruction.opcode in opcodes)


def _top_level(shape: str) -> list[str]:
  """The elements of a tuple shape at its top level ('(f32[2]{0}, (s32[], f32[3]))' -> ['f32[2]{0}',
  '(s32[], f32[3])']); [shape] for an array shape."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  out, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
      if depth == 0:
        out.append(shape[start:i])
        break
    elif ch == "," and depth == 1:
      out.append(shape[start:i])
      start = i + 1
  return [re.sub(r"/\*[^*]*\*/", "", e).strip() for e in out if e.strip()]


def merged_op_names(op_name: str) -> tuple[str, ...]:
  """The op_names XLA joined when it combined instructions into one, else `(op_name,)`.

  jaxlib 0.12's XLA writes a combined instruction's op_name as the common prefix and the differing
  rests in parentheses, separated by ':' ('jit(f)/(prophet/chunk5/psum:psum)' -> ('jit(f)/prophet/chunk5/
  psum', 'jit(f)/psum')); jaxlib 0.10's left such an instruction without op_name.
  """
  if not op_name.endswith(")"):
    return (op_name,)
  depth = 0
  for i in range(len(op_name) - 1, -1, -1):
    depth += (op_name[i] == ")") - (op_name[i] == "(")
    if depth == 0:
      break
  else:
    return (op_name,)
  inner, prefix = op_name[i + 1:-1], op_name[:i]
  parts, depth, start = [], 0, 0
  for j, ch in enumerate(inner):
    depth += (ch == "(") - (ch == ")")
    if ch == ":" and depth == 0:
      parts.append(inner[start:j])
      start = j + 1
  parts.append(inner[start:])
  if len(parts) < 2 or (i > 0 and op_name[i - 1] not in "/"):  # 'jvp(x)' is a name, not a merge
    return (op_name,)
  return tuple(prefix + p for p in parts)


@dataclass(frozen=True, slots=True)
class AllReduceOp:
  """An all-reduce of the compiled program, in whichever form XLA wrote it (`ALL_REDUCE_FORMS`).

  Attributes:
    op: where it is issued in the execution order: the `all-reduce`, or the `-start` of an async form.
    form: 'all-reduce', 'all-reduce-start', 'fusion-start' or 'async-start'.
    reduction: the all-reduce instruction itself (for a wrapped form, the ROOT of the called computation).
    shape: the shape of the reduced values (an async start's tuple (operands, result) unwrapped; a
      combined all-reduce's is a tuple, one array per operand).
    operands: the names of the values reduced, in the issuing computation (a wrapped form's called
      computation's parameters mapped to the start's operands).
    op_name: the op_name metadata (the start's, else the reduction's).
  """

  op: ExecutedOp
  form: str
  reduction: HloInstruction
  shape: str
  operands: tuple[str, ...]
  op_name: str

  @property
  def part_elements(self) -> tuple[int, ...]:
    """Elements of each reduced array (one per operand of a combined all-reduce)."""
    return tuple(shape_elements(f"{d}[{dims}]") for d, dims in _ARRAY.findall(self.shape) if d != "token")

  @property
  def elements(self) -> int:
    return shape_elements(self.shape)

  def is_sync(self) -> bool:
    """XLA:GPU marked it synchronous (`"is_sync":true` in its backend config): nothing overlaps it."""
    return any('"is_sync":true' in t.replace(" ", "") for t in (self.op.instruction.text,
                                                                  self.reduction.text))


def _wrapped_allreduce(module: HloModule, ins: HloInstruction) -> tuple[HloInstruction, str] | None:
  """The all-reduce a `fusion-start` / `async-start` calls (its called computation's ROOT), and that
  computation's name; None when it wraps something else."""
  body = dict(ins.callees).get("calls")
  root = next((i for i in module.computations.get(body or "", ()) if i.root), None)
  if root is None or root.opcode not in ALL_REDUCE_OPCODES:
    return None
  return root, body


def allreduces(module: HloModule, ops: tuple[ExecutedOp, ...] | None = None) -> tuple[AllReduceOp, ...]:
  """Every all-reduce in execution order, whichever form (`ALL_REDUCE_FORMS`) XLA wrote it in.

  Args:
    module: a parsed module.
    ops: `execution_order(module)`, if already computed.
  """
  ops = execution_order(module) if ops is None else ops
  out = []
  for op in ops:
    ins = op.instruction
    if ins.opcode == "all-reduce":
      out.append(AllReduceOp(op=op, form="all-reduce", reduction=ins, shape=ins.shape,
                             operands=ins.operands, op_name=ins.op_name))
    elif ins.opcode == "all-reduce-start":
      top = _top_level(ins.shape)  # jaxlib 0.12: ((operands...), result); 0.10: the result
      shape = top[-1] if ins.shape.lstrip().startswith("((") and len(top) == 2 else ins.shape
      out.append(AllReduceOp(op=op, form="all-reduce-start", reduction=ins, shape=shape,
                             operands=ins.operands, op_name=ins.op_name))
    elif ins.opcode in _WRAPPED_FORMS:
      found = _wrapped_allreduce(module, ins)
      if found is None:
        continue
      red, body = found
      operands = []
      for o in red.operands:
        inner = module.instruction(body, o)
        pm = _PARAM.search(inner.text) if inner is not None and inner.opcode == "parameter" else None
        k = int(pm.group(1)) if pm else -1
        operands.append(ins.operands[k] if 0 <= k < len(ins.operands) else "")
      out.append(AllReduceOp(op=op, form=ins.opcode, reduction=red, shape=red.shape,
                             operands=tuple(operands), op_name=ins.op_name or red.op_name))
  return tuple(out)


# --------------------------------------------------------------------------------------------------
# async collectives: what the schedule puts between a start and its done

_COLLECTIVE_PREFIXES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-",
                        "send", "recv", "ragged-all-to-all")


def is_collective(opcode: str) -> bool:
  """True for collective opcodes (sync, or the -start / -done halves of an async one)."""
  return opcode.startswith(_COLLECTIVE_PREFIXES)


@dataclass(frozen=True, slots=True)
class AsyncWindow:
  """An async collective and the ops the schedule runs while it is in flight.

  Attributes:
    start: the `*-start` op.
    done: its `*-done` op.
    inside: the ops executed between them (execution order, called computations inlined): the work a
      device can do while the collective runs. Empty when the done directly follows the start.
  """

  start: ExecutedOp
  done: ExecutedOp
  inside: tuple[ExecutedOp, ...]


def async_windows(module: HloModule, ops: tuple[ExecutedOp, ...] | None = None
                  ) -> dict[str, AsyncWindow]:
  """Every async collective's window, keyed by the name of its `-start` instruction.

  In a scheduled module (XLA:GPU's compiled HLO) a collective issued as `X-start` runs on its own
  stream until `X-done`; the instructions between them in the schedule are what overlaps it. A
  synchronous collective (the CPU's, or a GPU one with async collectives disabled) has no window.

  Args:
    module: a parsed, scheduled module.
    ops: `execution_order(module)`, if already computed.
  """
  ops = execution_order(module) if ops is None else ops
  starts: dict[tuple[str, str], int] = {}
  out: dict[str, AsyncWindow] = {}
  for op in ops:
    ins = op.instruction
    if ins.opcode.endswith("-start"):
      starts[(op.computation, ins.name)] = op.index
    elif ins.opcode.endswith("-done") and ins.operands:
      i = starts.get((op.computation, ins.operands[0]))
      if i is not None:
        out[ins.operands[0]] = AsyncWindow(start=ops[i], done=op, inside=ops[i + 1:op.index])
  return out


# --------------------------------------------------------------------------------------------------
# Combined collectives: XLA:GPU's all-reduce-contiguous (concatenate, one all-reduce, slices)

_SLICE = re.compile(r"slice=\{\[(\d+):(\d+)\]\}")
_PARAM = re.compile(r"\bparameter\((\d+)\)")
_PASS_THROUGH = ("bitcast", "copy", "reshape")


def producer(module: HloModule, comp: str, name: str) -> HloInstruction | None:
  """The producer of `name`, looking through bitcasts, copies and reshapes."""
  ins = module.instruction(comp, name)
  for _ in range(8):
    if ins is None or ins.opcode not in _PASS_THROUGH or not ins.operands:
      return ins
    ins = module.instruction(comp, ins.operands[0])
  return ins


def users(module: HloModule, comp: str, name: str) -> list[HloInstruction]:
  """The instructions of computation `comp` that read `name`."""
  return [i for i in module.computations.get(comp, ()) if name in i.operands]


def contiguous_parts(module: HloModule, comp: str, ins: HloInstruction, readers: list[HloInstruction], *,
                     named: Callable[[str], bool], operands: tuple[str, ...] | None = None
                     ) -> list[tuple[int, str]] | None:
  """For an all-reduce of one concatenated buffer (XLA:GPU's all-reduce-contiguous): each part's element
  count and the op_name that names it (from the slice of the result that reads it back, else from its
  producer). None when the operand is not a concatenation of several parts.

  Args:
    module, comp, ins: the all-reduce and its computation.
    readers: the instructions that read its result (`users(module, comp, result)`).
    named: whether an op_name names a part (else the part's producer's op_name is used).
    operands: the values it reduces, when they are not `ins.operands` (`AllReduceOp.operands`).
  """
  operands = ins.operands if operands is None else operands
  if len(operands) != 1 or not operands[0]:
    return None
  cat = producer(module, comp, operands[0])
  if cat is None:
    return None
  if cat.opcode == "concatenate":
    part_shapes = [(module.instruction(comp, o).shape if module.instruction(comp, o) else "", o)
                   for o in cat.operands]
  elif cat.opcode == "fusion":
    body = dict(cat.callees).get("calls")
    root = next((i for i in module.computations.get(body or "", ()) if i.root), None)
    if root is None or root.opcode != "concatenate":
      return None
    part_shapes = []
    for o in root.operands:
      inner = producer(module, body, o)
      pm = _PARAM.search(inner.text) if inner is not None and inner.opcode == "parameter" else None
      outer = cat.operands[int(pm.group(1))] if pm and int(pm.group(1)) < len(cat.operands) else ""
      shape = module.instruction(body, o).shape if module.instruction(body, o) else ""
      part_shapes.append((shape, outer))
  else:
    return None
  if len(part_shapes) < 2:
    return None
  slices: dict[tuple[int, int], str] = {}
  for u in readers:
    text = u.text
    if u.opcode == "fusion":
      body = dict(u.callees).get("calls")
      root = next((i for i in module.computations.get(body or "", ()) if i.root), None)
      if root is None or root.opcode != "slice":
        continue
      text = root.text
    elif u.opcode != "slice":
      continue
    m = _SLICE.search(text)
    if m:
      slices[(int(m.group(1)), int(m.group(2)))] = u.op_name or slices.get(
          (int(m.group(1)), int(m.group(2))), "")
  parts, off = [], 0
  for shape, outer in part_shapes:
    n = shape_elements(shape)
    name = slices.get((off, off + n), "")
    if not named(name) and outer:
      prod = producer(module, comp, outer)
      name = prod.op_name if prod is not None else ""
    parts.append((n, name))
    off += n
  return parts


# --------------------------------------------------------------------------------------------------
# FLOPs and bytes from the shapes

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


class OpCosts:
  """FLOPs and bytes of HLO instructions, from their shapes alone (no device, no cost model).

  FLOPs count the multiply-adds of matrix products and convolutions (2 per multiply-add), wherever
  they are: a `dot` or `convolution`, one inside a fusion (Triton gemm fusions), or a cuBLAS / cuDNN
  custom call. Elementwise work counts 0 FLOPs (it is memory-bound: its bytes say what it costs).
  A convolution counts 2 * |forward output| * |kernel| / output features, for its forward, backward-input
  and backward-filter forms alike (padding not discounted). Bytes are the instruction's operands plus
  its result, as read and written once.
  XLA's own cost analysis is not available for a deviceless compile (`compiled.cost_analysis()` is
  None there), hence this estimate.
  """

  def __init__(self, module: HloModule):
    self._module = module
    self._shapes: dict[str, dict[str, str]] = {}
    self._body_flops: dict[str, int] = {}

  def _shape_map(self, comp: str) -> dict[str, str]:
    if comp not in self._shapes:
      self._shapes[comp] = {i.name: i.shape for i in self._module.computations.get(comp, ())}
    return self._shapes[comp]

  def cost(self, comp: str, ins: HloInstruction) -> tuple[int, int]:
    """(FLOPs, bytes) of instruction `ins` of computation `comp`."""
    shapes = self._shape_map(comp)
    nbytes = shape_bytes(ins.shape) + sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    return self.flops(comp, ins), nbytes

  def flops(self, comp: str, ins: HloInstruction, depth: int = 0) -> int:
    """Matrix-product and convolution FLOPs of `ins` (fusion bodies included)."""
    op = ins.opcode
    if op == "dot":
      return self._dot(comp, ins, _CONTRACT.search(ins.text))
    if op == "convolution":
      return self._conv(comp, ins)
    if op == "custom-call":
      target = _TARGET.search(ins.text)
      name = target.group(1).lower() if target else ""
      if "conv" in name:
        return self._conv(comp, ins, name)
      if "gemm" in name or "matmul" in name:
        return self._dot(comp, ins, _GEMM_CONTRACT.search(ins.text))
      return 0
    if op in ("fusion", "call", "async-start") and depth < 16:
      total = 0
      for kind, callee in ins.callees:
        if kind == "calls" or (op == "call" and kind == "to_apply"):
          total += self._body(callee, depth + 1)
      return total
    return 0

  def _body(self, comp: str, depth: int) -> int:
    if comp not in self._body_flops:
      self._body_flops[comp] = sum(self.flops(comp, i, depth)
                                   for i in self._module.computations.get(comp, ()))
    return self._body_flops[comp]

  def _dot(self, comp: str, ins: HloInstruction, contract: re.Match | None) -> int:
    dims = shape_dims(ins.shape)
    if not dims or not ins.operands:
      return 0
    lhs = shape_dims(self._shape_map(comp).get(ins.operands[0], ""))
    if not lhs or contract is None:
      return 0
    k = 1
    for d in re.findall(r"\d+", contract.group(1)):
      if int(d) < len(lhs[0]):
        k *= lhs[0][int(d)]
    return 2 * math.prod(dims[0]) * k

  def _conv(self, comp: str, ins: HloInstruction, target: str = "") -> int:
    """2 * |forward output| * |filter| / filter's output features. cuDNN's custom calls keep the forward
    convolution's dim_labels: a backward-input call reads (output gradient, filter), a backward-filter
    call reads (input, output gradient) and returns the filter."""
    labels = _DIM_LABELS.search(ins.text)
    if labels is None or len(ins.operands) < 2:
      return 0
    shapes = self._shape_map(comp)
    result = shape_dims(ins.shape)
    op0 = shape_dims(shapes.get(ins.operands[0], ""))
    op1 = shape_dims(shapes.get(ins.operands[1], ""))
    if "backwardfilter" in target:
      out, rhs = op1, result
    elif "backwardinput" in target:
      out, rhs = op0, op1
    else:
      out, rhs = result, op1
    rhs_labels = labels.group(2)
    if not out or not rhs or "o" not in rhs_labels or len(rhs[0]) != len(rhs_labels):
      return 0
    out_features = rhs[0][rhs_labels.index("o")] or 1
    return 2 * math.prod(out[0]) * math.prod(rhs[0]) // out_features


# --------------------------------------------------------------------------------------------------
# reduce-scatters and all-gathers (a sharded schedule's collectives), in whichever form XLA wrote them

SHARDED_COLLECTIVES = ("reduce-scatter", "all-gather")
_SHARDED_WRAPPERS = ("fusion-start", "async-start")


@dataclass(frozen=True, slots=True)
class ShardedCollectiveOp:
  """A reduce-scatter or an all-gather of the compiled program, in whichever form XLA wrote it: the
  synchronous op, an async `-start` / `-done` pair (XLA:GPU), or a `fusion-start` / `async-start`
  whose called computation's ROOT is the collective (jaxlib 0.12's asynchronous collective fusions,
  XLA's generic async wrapper).

  Attributes:
    op: where it is issued in the execution order (the op, or its `-start`).
    collective: 'reduce-scatter' or 'all-gather'.
    form: the opcode it was found under ('reduce-scatter', 'all-gather-start', 'fusion-start', ...).
    in_elements: elements of its operand (a reduce-scatter's whole buffer, an all-gather's shard).
    out_elements: elements of its result (a reduce-scatter's shard, an all-gather's whole buffer).
    op_name: the op_name metadata (the start's, else the collective's).
    synchronous: XLA:GPU marked it `"is_sync":true` (nothing overlaps it), or it has no start/done.
  """

  op: ExecutedOp
  collective: str
  form: str
  in_elements: int
  out_elements: int
  op_name: str
  synchronous: bool


def sharded_collectives(module: HloModule, ops: tuple[ExecutedOp, ...] | None = None
                        ) -> tuple[ShardedCollectiveOp, ...]:
  """Every reduce-scatter and all-gather in execution order, whichever form XLA wrote it in."""
  ops = execution_order(module) if ops is None else ops
  out = []
  for op in ops:
    ins = op.instruction
    kind = next((c for c in SHARDED_COLLECTIVES if ins.opcode in (c, f"{c}-start")), None)
    if kind is not None:
      if ins.opcode.endswith("-start"):  # jaxlib 0.10: ((operands...), result) or (operand, result)
        items = _top_level(ins.shape)
        n_in, n_out = shape_elements(items[0]), shape_elements(items[-1])
        if len(items) == 1:  # a start of the result's shape alone
          n_in = sum(shape_elements(module.instruction(op.computation, o).shape)
                     for o in ins.operands if module.instruction(op.computation, o) is not None)
      else:
        n_in = sum(shape_elements(module.instruction(op.computation, o).shape)
                   for o in ins.operands if module.instruction(op.computation, o) is not None)
        n_out = ins.elements
      sync = ins.opcode == kind or '"is_sync":true' in ins.text.replace(" ", "")
      out.append(ShardedCollectiveOp(op=op, collective=kind, form=ins.opcode, in_elements=n_in,
                                     out_elements=n_out, op_name=ins.op_name, synchronous=sync))
    elif ins.opcode in _SHARDED_WRAPPERS:
      body = dict(ins.callees).get("calls")
      root = next((i for i in module.computations.get(body or "", ()) if i.root), None)
      kind = next((c for c in SHARDED_COLLECTIVES if root is not None and root.opcode == c), None)
      if kind is None:
        continue
      n_in = sum(shape_elements(module.instruction(body, o).shape)
                 for o in root.operands if module.instruction(body, o) is not None)
      sync = '"is_sync":true' in (ins.text + root.text).replace(" ", "")
      out.append(ShardedCollectiveOp(op=op, collective=kind, form=ins.opcode, in_elements=n_in,
                                     out_elements=root.elements, op_name=ins.op_name or root.op_name,
                                     synchronous=sync))
  return tuple(out)
