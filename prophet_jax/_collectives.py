"""The scheduled all-reduce: the only module that calls `psum` or ties chunks together.

`allreduce(grads, schedule, axis_name)` runs inside `jax.pmap` or `jax.shard_map` (under `jit`). For each
chunk of the schedule, in issue order, it gathers the chunk's element slices into one flat buffer, runs
one `psum` under `jax.named_scope("prophet/chunk<k>")`, and scatters the result back into the leaves.

XLA on the CPU merges every independent all-reduce into one (`cpu-all-reduce-combiner`) and strips
optimization barriers before that pass runs, so neither independence nor barriers keep chunks apart in
a user's own `jax.pmap` with default flags. What survives (docs/facts.md, "Ordering that survives a
plain jax.pmap"; the tests read the compiled HLO to prove it): chunk k+1's buffer depends on chunk k's
*result* through an added zero that cannot carry a NaN or Inf. That tie is `tie`, in one place, so a
better mechanism replaces it here alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import AlreadyReducedError, UnboundAxisError
from ._schedule import Schedule
from ._tree import is_reduced_leaf, match_tree

__all__ = ["allreduce", "tie", "chunk_scope", "axis_size", "check_not_reduced", "vma_enabled",
           "is_varying", "to_varying", "reduce_chunks", "scheduled_allreduce"]

SCOPE_PREFIX = "prophet/chunk"


def chunk_scope(k: int) -> str:
  """The named scope of chunk k's collective: 'prophet/chunk<k>' (what `audit` looks for)."""
  return f"{SCOPE_PREFIX}{k}"


# --------------------------------------------------------------------------------------------------
# the tie


def _zero_of(prev: jax.Array, dtype: Any) -> jax.Array:
  """An exact scalar zero that data-depends on `prev[0]` and is 0 even when prev[0] is NaN or Inf."""
  p = prev.reshape(-1)[0]
  return jnp.where(jnp.isfinite(p), p * 0, jnp.zeros((), p.dtype)).astype(dtype)


def tie(buf: jax.Array, prev: jax.Array | None) -> jax.Array:
  """`buf` with an exact zero, computed from `prev` (the previous chunk's reduced result), added.

  The data dependency makes the compiled program run prev's all-reduce before buf's, and keeps the two
  from being combined into one by XLA's all-reduce combiner (which only merges independent ones). The
  zero is `where(isfinite(p), p * 0, 0)`, so a NaN or Inf in one chunk never leaks into the next.
  """
  if prev is None:
    return buf
  return buf.at[0].add(_zero_of(prev, buf.dtype))


# --------------------------------------------------------------------------------------------------
# axis checks


def axis_size(axis_name: Any, where: str) -> int:
  """The size of a bound axis, or UnboundAxisError naming the fix."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise UnboundAxisError(
        f"{where}(..., axis_name={axis_name!r}) ran outside a mapped context (no axis {axis_name!r} is "
        f"bound). Call the train step inside jax.shard_map with a mesh axis named {axis_name!r}, or "
        f"inside jax.pmap(..., axis_name={axis_name!r}).") from e


def _axis_names(axis_name: Any) -> tuple[Any, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def is_varying(x: Any, axis_name: Any) -> bool:
  """True when `x`'s type says it varies over every axis of `axis_name` (jax's `vma` set, which only
  shard_map with check_vma=True fills: docs/facts.md, "The 8x gradient trap")."""
  varying = jax.typeof(x).manual_axis_type.varying
  return all(n in varying for n in _axis_names(axis_name))


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


# --------------------------------------------------------------------------------------------------
# the all-reduce


def reduce_chunks(flat: list[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int],
                  axis_name: Any, *, divisor: int | None, first_index: int = 0,
                  prev: jax.Array | None = None,
                  scope: str | None = None) -> tuple[list[jax.Array], jax.Array | None]:
  """Runs `chunks` in order on the flattened leaves `flat`; returns the new leaves and the last result.

  Per chunk: gather its slices into one buffer, `tie` it to the previous result, one `psum` (divided
  by `divisor`), scatter back. Every chunked all-reduce of the library goes through here: `allreduce`,
  `scheduled`, `pipelined`, the hooks of `hooked` and the per-layer hook of `loop_hook`.

  Args:
    flat: leaves (any shape); rows index them through `row_leaf`.
    chunks: the schedule's chunks to run, in issue order.
    row_leaf: schedule row -> index into `flat`.
    axis_name: the mapped axis.
    divisor: divide each reduced buffer by this (the axis size, for a mean, as `pmean` does), or None.
    first_index: k of the first chunk, for its named scope 'prophet/chunk<k>'.
    prev: the result of the chunk issued just before (tied to the first chunk), or None.
    scope: the named scope of every chunk instead of 'prophet/chunk<k>' (`loop_hook`'s
      'prophet/loop/<name>', which `audit` reads as a loop-body all-reduce).
  """
  flat = list(flat)
  pieces: dict[int, list[tuple[int, jax.Array]]] = {}
  touched: list[int] = []
  for k, chunk in enumerate(chunks, start=first_index):
    parts = []
    for r, a, b in chunk.slices:
      leaf = flat[row_leaf[r]]
      parts.append(leaf.reshape(-1)[a:b])
    with jax.named_scope(chunk_scope(k) if scope is None else scope):
      buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      buf = tie(buf, prev)
      red = jax.lax.psum(buf, axis_name)
      if divisor is not None:
        red = red / jnp.asarray(divisor, red.dtype)
    prev = red
    off = 0
    for r, a, b in chunk.slices:
      if r not in pieces:
        pieces[r] = []
        touched.append(r)
      pieces[r].append((a, red[off:off + (b - a)]))
      off += b - a
  for r in touched:
    i = row_leaf[r]
    segs = [s for _, s in sorted(pieces[r], key=lambda t: t[0])]
    full = segs[0] if len(segs) == 1 else jnp.concatenate(segs)
    flat[i] = full.reshape(np.shape(flat[i]))
  return flat, prev


def allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True) -> Any:
  """All-reduces `grads` over `axis_name` chunk by chunk, in the schedule's order.

  Call it inside `jax.pmap(..., axis_name=...)` or `jax.shard_map` (under `jit`). Rows of the schedule
  are matched to leaves by their canonical path ('params/Dense_0/kernel'). For each chunk, in issue
  order: its element slices are gathered into one flat buffer, reduced by one `psum` labelled
  `jax.named_scope("prophet/chunk<k>")`, and scattered back. Each chunk's buffer is tied to the previous
  chunk's result (an exact, NaN-proof zero), so the compiled program keeps one all-reduce per chunk, in
  schedule order, even in a plain `jax.pmap` with default XLA flags on the CPU.

  Integer leaves and float0 gradients pass through unreduced; zero-size leaves pass through unchanged.

  Under `shard_map` with `check_vma=True` (the default) the gradients of replicated params are already
  summed by `jax.grad`; this is detected and raises AlreadyReducedError. Under `pmap` (and
  `check_vma=False`) it cannot be detected: there, make sure the gradients are per-device.

  Args:
    grads: a pytree of per-device gradients, the tree the schedule was planned for.
    schedule: a Schedule (from `prophet_jax.plan`).
    axis_name: the data-parallel axis (a name bound by pmap or shard_map).
    mean: divide the sums by the axis size (a `pmean`); False gives the `psum`.

  Returns:
    The reduced tree, same structure, shapes and dtypes.

  Raises:
    UnboundAxisError: `axis_name` is not bound here.
    ScheduleMismatchError: the schedule was planned for another tree (the path, shape or dtype at fault
      is named).
    AlreadyReducedError: under shard_map with check_vma, the gradients are already summed.
    ValueError: the tree is empty.

  Example:
    >>> step = jax.pmap(lambda g: prophet_jax.allreduce(g, schedule, "data"), axis_name="data")
  """
  return scheduled_allreduce(grads, schedule, axis_name, mean=mean, where="allreduce")


def scheduled_allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True,
                        where: str = "allreduce") -> Any:
  """`allreduce`, with `where` naming the public caller in error messages."""
  if not isinstance(mean, bool):
    raise TypeError(f"{where}: `mean` must be True or False, got {mean!r}.")
  n = axis_size(axis_name, where)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  lmap = match_tree(leaves_with_path, schedule, where=where)
  flat = [leaf for _, leaf in leaves_with_path]
  check_not_reduced([(lmap.paths[i], flat[i]) for i in lmap.row_leaf], axis_name, where)
  flat, _ = reduce_chunks(flat, schedule.chunks, lmap.row_leaf, axis_name,
                          divisor=n if mean else None)
  return jax.tree_util.tree_unflatten(treedef, flat)
