"""FLOPs and bytes of a compiled HLO module's ops, from the HLO shapes alone."""

from __future__ import annotations

import math
import re

from ._hlo import HloInstruction, HloModule, shape_bytes, shape_dims

# --------------------------------------------------------------------------------------------------
# FLOPs and bytes from the shapes

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


class OpCosts:
  """FLOPs and bytes of HLO instructions from their shapes (docs/design.md, "Reading compiled programs")."""

  def __init__(self, module: HloModule):
    self._module = module
    self._shapes: dict[str, dict[str, str]] = {}
    self._body_flops: dict[str, int] = {}

  def _shape_map(self, comp: str) -> dict[str, str]:
    if comp not in self._shapes:
      self._shapes[comp] = {i.name: i.shape for i in self._module.computations.get(comp, ())}
    return self._shapes[comp]

  def cost(self, comp: str, ins: HloInstruction) -> tuple[int, int]:
    shapes = self._shape_map(comp)
    nbytes = shape_bytes(ins.shape) + sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    return self.flops(comp, ins), nbytes

  def flops(self, comp: str, ins: HloInstruction, depth: int = 0) -> int:
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
      return sum(self._body(callee, depth + 1) for kind, callee in ins.callees
                 if kind == "calls" or (op == "call" and kind == "to_apply"))
    return 0

  def _body(self, comp: str, depth: int) -> int:
    if comp not in self._body_flops:
      self._body_flops[comp] = sum(self.flops(comp, i, depth)
                                   for i in self._module.computations.get(comp, ()))
    return self._body_flops[comp]

  def _dot(self, comp: str, ins: HloInstruction, contract: re.Match | None) -> int:
    dims = shape_dims(ins.shape)
    lhs = shape_dims(self._shape_map(comp).get(ins.operands[0], "")) if ins.operands else ()
    if not dims or not lhs or contract is None:
      return 0
    k = math.prod(lhs[0][d] for d in map(int, re.findall(r"\d+", contract.group(1))) if d < len(lhs[0]))
    return 2 * math.prod(dims[0]) * k

  def _conv(self, comp: str, ins: HloInstruction, target: str = "") -> int:
    labels = _DIM_LABELS.search(ins.text)
    if labels is None or len(ins.operands) < 2:
      return 0
    shapes = self._shape_map(comp)
    result = shape_dims(ins.shape)
    op0 = shape_dims(shapes.get(ins.operands[0], ""))
    op1 = shape_dims(shapes.get(ins.operands[1], ""))
    # (the output, the filter) of a convolution, and of the gradients of its filter and its input
    out, rhs = ((op1, result) if "backwardfilter" in target else (op0, op1) if "backwardinput" in target
                else (result, op1))
    rhs_labels = labels.group(2)
    if not out or not rhs or "o" not in rhs_labels or len(rhs[0]) != len(rhs_labels):
      return 0
    out_features = rhs[0][rhs_labels.index("o")] or 1
    return 2 * math.prod(out[0]) * math.prod(rhs[0]) // out_features
