"""The mapped axis's facts, below the engine and the step setup: its size, whether a value varies
over it (shard_map's check_vma), the cast to varying, and the varying checks every path runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._values._errors import AlreadyReducedError, UnboundAxisError
from .._values._tree import is_reduced_leaf

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


def is_varying(x: Any, axis_name: Any) -> bool:
  """True when `x`'s type says it varies over every axis of `axis_name` (jax's `vma` set, which only
  shard_map with check_vma=True fills: docs/facts.md, "The 8x gradient trap")."""
  varying = jax.typeof(x).manual_axis_type.varying
  return all(n in varying for n in (axis_name if isinstance(axis_name, tuple) else (axis_name,)))


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


def check_varying(axis_name: Any, where: str, *, grads: Sequence[tuple[str, Any]] = (),
                  params: Sequence[tuple[str, Any]] = (), per_device: Sequence[tuple[str, Any]] = ()) -> bool:
  """The varying checks every path runs, at once; returns whether values carry the axes they vary
  over here (shard_map's check_vma: under pmap, or check_vma=False, nothing can be checked).

  Args:
    axis_name: the mapped axis.
    where: the public caller, for messages.
    grads: (path, gradient): none may be already summed over the axis (`AlreadyReducedError`: under
      check_vma, jax.grad sums the gradients of replicated params).
    params: (path, parameter) of `hooked`: none may already vary over the axis (ValueError).
    per_device: (name, leaf) of a state's per-device parts: each must vary (ValueError: passed with
      `P()`, every device would start from one copy and all but one device's values be lost).
  """
  if not vma_enabled(axis_name):
    return False
  for path, g in grads:
    if is_reduced_leaf(g) and np.size(g) and not is_varying(g, axis_name):
      raise AlreadyReducedError(
          f"{where}: gradient {path!r} is already summed over axis {axis_name!r} (it does not vary over "
          f"it): under shard_map's default check_vma, jax.grad sums the gradients of replicated params. "
          f"Mark the params varying before jax.grad: params = jax.lax.pcast(params, {axis_name!r}, "
          f"to='varying'), or use prophet_jax.hooked, which does it for you (or shard_map(..., "
          f"check_vma=False)). A step that kept its own jax.lax.pmean of the gradients after switching to "
          f"prophet_jax reduces them twice: drop that pmean.")
  for path, p in params:
    if is_varying(p, axis_name):
      raise ValueError(
          f"{where}: parameter {path!r} already varies over axis {axis_name!r} (e.g. "
          f"jax.lax.pcast(params, {axis_name!r}, to='varying'), the line a scheduled(...) step needs, or "
          f"params passed with in_specs P({axis_name!r})). hooked marks the replicated params varying "
          f"itself and returns gradients averaged over the axis: pass them as they are (replicated, "
          f"in_specs P()), without the pcast.")
  for name, x in per_device:
    if not is_varying(x, axis_name):
      raise ValueError(
          f"{where}: {name} (shape {tuple(np.shape(x))} per device) is replicated over axis {axis_name!r} "
          f"(passed with PartitionSpec P()), but each device's values are its own: pass the state with "
          f"prophet_jax.state_specs(state, {axis_name!r}) as in_specs and out_specs (P({axis_name!r}) "
          f"for them, P() for the rest), and make the initial state inside the shard_map with those "
          f"out_specs.")
  return True


def bind(axis_name: Any, where: str, *, varying: Any = None, **checks: Sequence) -> tuple[int, bool, Any]:
  """The axis facts a step needs, at once: (the bound axis's size, whether values carry the axes they
  vary over here, `varying` cast to varying where they do), after the varying checks (`check_varying`'s
  `grads`, `params`, `per_device`)."""
  n = axis_size(axis_name, where)
  vma = check_varying(axis_name, where, **checks)
  if vma:
    varying = jax.tree_util.tree_map(lambda x: x if is_varying(x, axis_name) else to_varying(x, axis_name), varying)
  return n, vma, varying

