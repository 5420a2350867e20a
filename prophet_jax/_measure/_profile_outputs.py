"""Which outputs of a traced program are the gradient leaves: HLO shapes matched to the leaves'."""

from __future__ import annotations

from collections.abc import Sequence

from . import _step_hlo
from .._compiled._hlo import shape_dims, shape_dtypes

_HLO_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "complex64": "c64",
               "complex128": "c128"}


def _hlo_dtype(name: str) -> str:
  if name in _HLO_DTYPES:
    return _HLO_DTYPES[name]
  if name.startswith("float8_"):
    return "f8" + name[len("float8_"):]
  return name


def hlo_matches(shape_text: str, shape: tuple[int, ...], dtype: str) -> bool:
  return shape_dims(shape_text) == (tuple(shape),) and shape_dtypes(shape_text) == (_hlo_dtype(dtype),)


def gradient_outputs(hlo: _step_hlo.StepHlo, paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
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
