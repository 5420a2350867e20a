"""The compiled step as the trace analysis reads it: instructions, outputs (which are the gradient leaves),
parameters, backward ops, layers."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

from .._compiled._hlo import parse_hlo, shape_dims, shape_dtypes

_GTE_INDEX = re.compile(r"\bindex=(\d+)")
_TRANSFORM = re.compile(r"^(?:transpose|jvp|jit|vmap|remat|checkpoint|pjit|custom_jvp|custom_vjp)\((.*)\)$")


@dataclasses.dataclass
class Instr:
  name: str
  operands: list[str]
  op_name: str
  calls: list[str]
  opcode: str = ""
  shape: str = ""
  index: int | None = None      # a get-tuple-element's tuple index


@dataclasses.dataclass
class StepHlo:
  module: str
  instrs: dict[str, Instr]
  comps: dict[str, list[str]]
  entry: str
  root_operands: list[str]
  params: dict[int, str] = dataclasses.field(default_factory=dict)   # ENTRY parameter number -> name
  position: dict[str, int] = dataclasses.field(default_factory=dict)  # ENTRY instruction -> its index


def step_hlo(text: str) -> StepHlo:
  """The optimized module by instruction name (operands within their computation), its outputs and parameters."""
  m = parse_hlo(text)
  instrs: dict[str, Instr] = {}
  comps: dict[str, list[str]] = {}
  root_operands: list[str] = []
  params: dict[int, str] = {}
  for comp, body in m.computations.items():
    names = {i.name for i in body}
    comps[comp] = [i.name for i in body]
    for i in body:
      gte = _GTE_INDEX.search(i.text) if i.opcode == "get-tuple-element" else None
      pm = re.search(r"\bparameter\((\d+)\)", i.text) if i.opcode == "parameter" and comp == m.entry else None
      if pm:
        params[int(pm.group(1))] = i.name
      instrs[i.name] = Instr(name=i.name, operands=[o for o in i.operands if o in names], op_name=i.op_name,
                             calls=[c for _, c in i.callees], opcode=i.opcode, shape=i.shape,
                             index=int(gte.group(1)) if gte else None)
      if i.root and comp == m.entry:
        root_operands = list(i.operands) if i.opcode == "tuple" else [i.name]
  position = {n: k for k, n in enumerate(comps.get(m.entry, []))}
  return StepHlo(module=m.name, instrs=instrs, comps=comps, entry=m.entry, root_operands=root_operands,
                 params=params, position=position)


def is_backward(op_name: str) -> bool:
  return "transpose(" in op_name


def segments(op_name: str) -> list[str]:
  out = []
  for seg in op_name.split("/"):
    seg = seg.strip()
    while m := _TRANSFORM.match(seg):   # 'transpose(jvp(Dense_0))' -> 'Dense_0'
      seg = m.group(1)
    if seg:
      out.append(seg)
  return out


class LayerIndex:
  """Every suffix of every layer path -> the first layer that ends with it; each op name matched once."""

  def __init__(self, layers: tuple[str, ...]):
    self.by_suffix: dict[tuple[str, ...], int] = {}
    self.layers = layers
    self.match = functools.lru_cache(maxsize=None)(self._match)
    self.longest = 0
    for k, layer in enumerate(self.layers):
      comps = tuple(layer.split("/"))
      self.longest = max(self.longest, len(comps))
      for start in range(len(comps)):
        self.by_suffix.setdefault(comps[start:], k)

  def _match(self, op_name: str) -> str | None:
    segs = segments(op_name)
    for k in range(min(self.longest, len(segs)), 0, -1):
      hits = [self.by_suffix[t] for j in range(len(segs) - k + 1) if (t := tuple(segs[j:j + k])) in
              self.by_suffix]
      if hits:
        return self.layers[min(hits)]
    return None


@functools.lru_cache(maxsize=16)
def layer_index(layers: tuple[str, ...]) -> LayerIndex:
  return LayerIndex(layers)


def match_layer(op_name: str, layers: Sequence[str]) -> str | None:
  """The layer whose path (its longest suffix) is consecutive segments of the op's name; ties: the first."""
  return layer_index(tuple(layers)).match(op_name)


def forward_positions(hlo: StepHlo, n: int) -> list[int | None]:
  """Per gradient leaf's ENTRY parameter, the schedule position of the first op reading it and the batch."""
  entry = hlo.comps.get(hlo.entry, [])
  users: dict[str, list[str]] = {}
  for name in entry:
    for o in hlo.instrs[name].operands:
      users.setdefault(o, []).append(name)
  data = {name for k, name in hlo.params.items() if k >= n}
  for name in entry:  # schedule order is a topological order
    if name not in data and any(o in data for o in hlo.instrs[name].operands):
      data.add(name)
  out: list[int | None] = []
  for k in range(n):
    start = hlo.params.get(k)
    hits, stack, seen = [], ([start] if start else []), set()
    while stack:
      for u in users.get(stack.pop(), ()):
        if u in seen:
          continue
        seen.add(u)
        if u in data:
          hits.append(hlo.position[u])
        else:
          stack.append(u)
    out.append(min(hits, default=None))
  return out


_HLO_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "complex64": "c64",
               "complex128": "c128"}


def _hlo_dtype(name: str) -> str:
  return "f8" + name[len("float8_"):] if name.startswith("float8_") else _HLO_DTYPES.get(name, name)


def hlo_matches(shape_text: str, shape: tuple[int, ...], dtype: str) -> bool:
  return shape_dims(shape_text) == (tuple(shape),) and shape_dtypes(shape_text) == (_hlo_dtype(dtype),)


def gradient_outputs(hlo: StepHlo, paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
                      dtypes: Sequence[str]) -> list[str]:
  """The one run of consecutive ENTRY ROOT operands with the leaves' shapes and dtypes; else ValueError."""
  outs = hlo.root_operands
  n = len(paths)

  def matched(off: int) -> int:  # how many leaves, from the first, the outputs from `off` on match
    k = 0
    while k < n and off + k < len(outs) and hlo_matches(hlo.instrs[outs[off + k]].shape, shapes[k], dtypes[k]):
      k += 1
    return k

  runs = [matched(off) for off in range(max(len(outs) - n + 1, 1))]
  fits = [off for off, k in enumerate(runs) if k == n]
  if len(fits) == 1:
    return list(outs[fits[0]:fits[0] + n])
  if len(fits) > 1:
    raise ValueError(f"profile_from_trace: the program's outputs hold the shapes of the {n} leaves of params "
                     f"at {len(fits)} places (outputs {fits[0]}.. and {fits[1]}..): cannot tell which are the "
                     f"gradients. Trace a program that returns the gradients alone (jax.grad), as "
                     f"profile_step does.")
  # name the first leaf that differs, against the best alignment (outputs 0.. or 1.. for value_and_grad)
  best = max(runs)
  where = runs.index(best)
  got = hlo.instrs[outs[where + best]].shape if where + best < len(outs) else "nothing (too few outputs)"
  raise ValueError(
      f"profile_from_trace: the program {hlo.module!r} has {len(outs)} outputs; they do not match the {n} "
      f"floating leaves of params: leaf {paths[best]!r} ({dtypes[best]}{list(shapes[best])}) meets output "
      f"{where + best}, {got}. Pass the tree whose gradients the traced program returns (in its flatten "
      f"order), and the HLO text of that same program.")
