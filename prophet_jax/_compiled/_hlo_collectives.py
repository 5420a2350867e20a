"""The collectives of a compiled HLO module: all-reduces, reduce-scatters and all-gathers in every form
XLA writes them, what the schedule puts between an async start and its done, and the parts of a
combined (contiguous) all-reduce.

Public helpers:
  collectives(module, opcodes=ALL_REDUCE_OPCODES) -> tuple[ExecutedOp, ...]   (by opcode)
  allreduces(module) -> tuple[AllReduceOp, ...]   every all-reduce, in whichever form XLA wrote it
  async_windows(module) -> {start name: ops scheduled between an async collective's start and done}
  merged_op_names(op_name) -> the op_names XLA joined into one when it combined instructions
  contiguous_parts(module, ...) -> the parts of an all-reduce of one concatenated buffer (XLA:GPU)
  sharded_collectives(module) -> every reduce-scatter and all-gather, in whichever form XLA wrote it
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._hlo import ExecutedOp, HloInstruction, HloModule, Shaped, execution_order, producer, shape_elements

ALL_REDUCE_OPCODES = ("all-reduce", "all-reduce-start")
# how a compiled program writes an all-reduce (`AllReduceOp.form`): a synchronous `all-reduce` (the CPU's,
# or XLA:GPU's when nothing can overlap it); an async `all-reduce-start` / `all-reduce-done` pair (XLA:GPU;
# jaxlib 0.10 gives the start the result's shape, 0.12 a tuple (operands, result)); a `fusion-start` /
# `fusion-done` pair whose called computation's ROOT is the all-reduce (jaxlib 0.12's XLA:GPU wraps a
# collective in an asynchronous collective fusion, kind=kCustom, `__triton_collective`); an `async-start`
# / `async-done` pair around a called all-reduce (XLA's generic async wrapper)
ALL_REDUCE_FORMS = ("all-reduce", "all-reduce-start", "fusion-start", "async-start")
_WRAPPED_FORMS = ("fusion-start", "async-start")


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
class AllReduceOp(Shaped):
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

  def is_sync(self) -> bool:
    """XLA:GPU marked it synchronous (`"is_sync":true` in its backend config): nothing overlaps it."""
    return any('"is_sync":true' in t.replace(" ", "") for t in (self.op.instruction.text,
                                                                  self.reduction.text))


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
    elif ins.opcode in _WRAPPED_FORMS:   # the all-reduce is the ROOT of the computation it calls
      body, red = module.called(ins)
      if red is None or red.opcode not in ALL_REDUCE_OPCODES:
        continue
      operands = [_outer(module.instruction(body, o), ins.operands) for o in red.operands]
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
    body, root = module.called(cat)
    if root is None or root.opcode != "concatenate":
      return None
    part_shapes = []
    for o in root.operands:
      shape = module.instruction(body, o).shape if module.instruction(body, o) else ""
      part_shapes.append((shape, _outer(producer(module, body, o), cat.operands)))
  else:
    return None
  if len(part_shapes) < 2:
    return None
  slices: dict[tuple[int, int], str] = {}
  for u in readers:
    text = u.text
    if u.opcode == "fusion":
      root = module.called(u)[1]
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
      # a start's shape (jaxlib 0.10): ((operands...), result) or (operand, result), or the result alone
      items = _top_level(ins.shape) if ins.opcode.endswith("-start") else [ins.shape]
      n_in = shape_elements(items[0]) if len(items) > 1 else _elements(module, op.computation, ins.operands)
      n_out = shape_elements(items[-1])
      sync = ins.opcode == kind or '"is_sync":true' in ins.text.replace(" ", "")
      out.append(ShardedCollectiveOp(op=op, collective=kind, form=ins.opcode, in_elements=n_in,
                                     out_elements=n_out, op_name=ins.op_name, synchronous=sync))
    elif ins.opcode in _SHARDED_WRAPPERS:
      body, root = module.called(ins)
      kind = next((c for c in SHARDED_COLLECTIVES if root is not None and root.opcode == c), None)
      if kind is None:
        continue
      n_in = _elements(module, body, root.operands)
      sync = '"is_sync":true' in (ins.text + root.text).replace(" ", "")
      out.append(ShardedCollectiveOp(op=op, collective=kind, form=ins.opcode, in_elements=n_in,
                                     out_elements=root.elements, op_name=ins.op_name or root.op_name,
                                     synchronous=sync))
  return tuple(out)


def _elements(module: HloModule, comp: str, names: Sequence[str]) -> int:
  """Elements of the values `names` of computation `comp` (those it holds)."""
  return sum(shape_elements(ins.shape) for o in names if (ins := module.instruction(comp, o)) is not None)


def _outer(inner: HloInstruction | None, operands: Sequence[str]) -> str:
  """The operand of a calling instruction that `inner`, a parameter of the called computation, stands for; ''
  for anything else."""
  pm = _PARAM.search(inner.text) if inner is not None and inner.opcode == "parameter" else None
  k = int(pm.group(1)) if pm else -1
  return operands[k] if 0 <= k < len(operands) else ""
