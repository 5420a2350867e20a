"""The mapped axis's facts, below the engine and the step setup: its size, whether a value varies
over it (shard_map's check_vma), the cast to varying, and the varying checks every path runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._values._errors import AlreadyReducedError, UnboundAxisError
from .._values._tree import is_reduced_leaf

__all__ = ["axis_size", "axis_names", "is_varying", "to_varying", "vma_enabled", "check_not_reduced"]


def axis_size(axis_name: Any, where: str, unbound: str | None = None) -> int:
  """The size of a bound axis, or UnboundAxisError naming the fix (`unbound`: the message, if not the
  train step's)."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise UnboundAxisError(unbound or (
        f"{where}(..., axis_name={axis_name!r}) ran outside a mapped context (no axis {axis_name!r} is "
        f"bound). Call the train step inside jax.shard_map with a mesh axis named {axis_name!r}, or "
        f"inside jax.pmap(..., axis_name={axis_name!r}).")) from e


def axis_names(axis_name: Any) -> tuple[Any, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def is_varying(x: Any, axis_name: Any) -> bool:
  """True when `x`'s type says it varies over every axis of `axis_name` (jax's `vma` set, which only
  shard_map with check_vma=True fills: docs/facts.md, "The 8x gradient trap")."""
  varying = jax.typeof(x).manual_axis_type.varying
  return all(n in varying for n in axis_names(axis_name))


def to_varying(x: Any, axis_name: Any) -> Any:
  """`x` marked varying over `axis_name` (`jax.lax.pcast(x, axis_name, to="varying")`): its gradient
  then stays per-device instead of being summed over the axis by `jax.grad`."""
  return jax.lax.pcast(x, axis_name, to="varying")


def vma_enabled(axis_name: Any) -> bool:
  """True under shard_map with check_vma=True, where values carry the axes they vary over.

  Under pmap and under shard_map(check_vma=False) nothing is marked varying, so an already-summed
  gradient cannot be told from a per-device one there.
  """
  return is_varying(jax.lax.axis_index(axis_name), axis_name)


def check_not_reduced(leaves: Sequence[tuple[str, Any]], axis_name: Any, where: str) -> None:
  """AlreadyReducedError when a floating gradient is invariant over `axis_name` under check_vma.

  Under shard_map's default check_vma, replicated params (in_specs P()) that meet per-device data get an
  implicit pvary whose transpose is a psum: jax.grad then returns gradients already summed over the axis,
  and reducing them again would make them `axis_size` times too large.
  """
  if not vma_enabled(axis_name):
    return
  for path, g in leaves:
    if not is_reduced_leaf(g) or np.size(g) == 0:
      continue
    if not is_varying(g, axis_name):
      raise AlreadyReducedError(
          f"{where}: gradient {path!r} is already summed over axis {axis_name!r} (it does not vary over "
          f"it): under shard_map's default check_vma, jax.grad sums the gradients of replicated params. "
          f"Mark the params varying before jax.grad: params = jax.lax.pcast(params, {axis_name!r}, "
          f"to='varying'), or use prophet_jax.hooked, which does it for you (or shard_map(..., "
          f"check_vma=False)).")
