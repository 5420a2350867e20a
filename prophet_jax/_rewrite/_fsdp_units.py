"""An FSDP plan as the step reads it, and the collectives of one gather group or unit.

A *slot* is one planned leaf: `(leaf, None)` for a parameter leaf, `(leaf, k)` for layer k of a scanned
stack (a leaf whose leading axis is the layer), which a profile plans per layer under the path
`<prefix>/<k>/<rest>` (`GradientProfile.unstacked` makes those rows). `read_plan` maps the schedule's rows to slots.

One gather group is one all-gather and one unit one reduce-scatter (`layout="packed"`, the default):
each device's shards of the group's leaves, each moved to put its sharded dimension first, flattened and
concatenated; the gathered buffer is device-major, so each leaf is read back from n strided parts (a
copy of the group, and a transpose for a leaf split on another dimension than 0). `layout="leaf"`: one
collective per leaf under the group's combiner key, which XLA:GPU joins up to its combine threshold
(30 MiB by default) and XLA:CPU never joins (docs/design.md, "FSDP in the user's step: the mechanism",
says why packed is the default). Every collective is tied to the value it must follow (`_collectives.tie`)
and carries the group's or unit's XLA combiner key, so XLA:GPU never joins two of them. On an HSDP mesh
(`split_axes`) each reduced shard is then all-reduced over the replica axes (`AR_SCOPE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._collectives import tie
from .._values._schedule import Chunk, Schedule
from .._values._tree import row_slots

LAYOUTS = ("packed", "leaf")
AG_SCOPE = "prophet/fsdp/ag"       # + gather group g: its forward all-gather (the named scope and combiner key)
REAG_SCOPE = "prophet/fsdp/reag"   # + g: its all-gather again in backward
RS_SCOPE = "prophet/fsdp/rs"       # + chunk k: a unit's reduce-scatter
AR_SCOPE = "prophet/fsdp/ar"       # + chunk k: HSDP: the unit's reduced shard all-reduced over the replica axes
Slot = tuple[int, "int | None"]


class Plan(NamedTuple):
  """The schedule as the step reads it (`read_plan`)."""

  slot_of: tuple[Slot, ...]                 # per schedule row
  dim_of: dict[int, int]                    # sharded leaf -> its sharded dimension (of the whole leaf)
  groups: tuple[tuple[Slot, ...], ...]      # gather groups, in forward order
  keep: tuple[bool, ...]                    # per gather group
  units: dict[int, tuple[Slot, ...]]        # chunk -> the slots it reduce-scatters
  replicated: dict[int, Chunk]              # chunk -> its all-reduce (slices of rows)
  prefetch: int
  backward_prefetch: int
  gather_dtype: dict[int, str]              # sharded leaf -> the dtype the plan gathers it in, where not its own


def read_plan(schedule: Schedule, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], n: int) -> Plan:
  """The FSDP plan of `schedule` mapped to parameter leaves (`paths`, this device's `shapes`, n devices).

  Raises:
    ValueError: not an FSDP plan; a row matching no leaf (or no stacked leaf's layer); a sharded leaf not
      placed as planned.
  """
  f = schedule.fsdp
  if f is None:
    raise ValueError(f"fsdp_grad: schedule (policy {schedule.policy!r}) is not an FSDP plan; plan it with "
                     f"plan(profile, network, 'fsdp', ...).")
  slots: list[Slot] = []
  for (path, _, _), slot in zip(schedule.rows, row_slots(schedule.rows, paths, [len(s) for s in shapes])):
    if slot is None:
      raise ValueError(f"fsdp_grad: the plan's leaf {path!r} is not among the parameters (they look like "
                       f"{list(paths)[:3]}); a scanned stack's layers are planned as '<prefix>/<k>/<rest>' "
                       f"(GradientProfile.from_params(..., stacked=)).")
    slots.append(slot)
  dim_of = {}
  for r, d in enumerate(f.shard_dims):
    if d is not None:
      (i, k), want = slots[r], tuple(schedule.rows[r][1])
      local = tuple(shapes[i][k is not None:])
      if local[:d] + (local[d] * n,) + local[d + 1:] != want:
        raise ValueError(f"fsdp_grad: parameter {paths[i]!r} has shape {tuple(shapes[i])} on each device; the "
                         f"plan splits dimension {d} of {want} over {n} devices. Place it as planned.")
      dim_of[i] = d + (k is not None)
  units = {u: tuple(slots[r] for r, _, _ in schedule.chunks[u].slices) for u in f.units}
  groups = (tuple(tuple(slots[r] for r in g) for g in f.gathers) if f.gathers
            else tuple(units[u] for u in f.units))
  replicated = {k: c for k, c in enumerate(schedule.chunks) if k not in units}
  gather_dtype = {slots[r][0]: g for r, g in enumerate(f.gather_dtypes) if g is not None}
  return Plan(tuple(slots), dim_of, groups, f.keep, units, replicated, f.prefetch, f.backward_prefetch, gather_dtype)


def split_axes(schedule: Schedule, axis_name: Any, where: str) -> tuple[Any, tuple[str, ...]]:
  """(the axis or axes the plan shards over, the replica axes) of an FSDP plan run over `axis_name` (an
  axis or a tuple: every axis of the plan's mesh); ValueError naming the axes otherwise."""
  f = schedule.fsdp
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  replicas = tuple(a for a in axes if a not in f.shard_axes)   # any order; the shard axes in the plan's
  if set(axes) != {a for a, _ in f.mesh} or len(set(axes)) != len(axes) or (
      not replicas and axes != tuple(f.shard_axes)):
    replicas = [a for a, _ in f.mesh if a not in f.shard_axes]
    want = tuple(a for a, _ in f.mesh) if replicas else f.shard_axes[0] if len(f.shard_axes) == 1 else f.shard_axes
    raise ValueError(f"{where}(axis_name={axis_name!r}): the FSDP plan shards the parameters over "
                     f"{tuple(f.shard_axes)}" + (f" and replicates them over {tuple(replicas)} (HSDP)" if replicas
                                                 else "") + f" on the mesh {dict(f.mesh)}; pass axis_name={want!r}.")
  if not replicas:
    return axis_name, ()
  return (f.shard_axes[0] if len(f.shard_axes) == 1 else tuple(f.shard_axes)), replicas


def _key(name: str) -> Any:
  # jax.experimental loads when a step traces, not when prophet_jax imports
  from jax.experimental.xla_metadata import set_xla_metadata
  return set_xla_metadata(combiner_key=name)


def gather(shards: Sequence[Any], dims: Sequence[int], axis_name: Any, n: int, scope: str, layout: str,
           after: Any) -> list:
  """The whole leaves of `shards` (each split over the axis on `dims[i]`): one all-gather (`packed`) or one
  per leaf (`leaf`), tied to `after`, under `jax.named_scope(scope)` and the combiner key `scope`."""
  moved = [jnp.moveaxis(s, d, 0) for s, d in zip(shards, dims)]
  with jax.named_scope(scope), _key(scope):
    if layout == "leaf":
      out = [jax.lax.all_gather(tie(m, after), axis_name, axis=0, tiled=True) for m in moved]
    else:
      buf = jnp.concatenate([m.reshape(-1) for m in moved]) if len(moved) > 1 else moved[0].reshape(-1)
      full = jax.lax.all_gather(tie(buf, after), axis_name, axis=0, tiled=True).reshape(n, -1)
      offs = np.cumsum([0] + [m.size for m in moved])
      out = [full[:, a:b].reshape((n * m.shape[0],) + m.shape[1:]) for m, a, b in zip(moved, offs, offs[1:])]
  return [jnp.moveaxis(x, 0, d) for x, d in zip(out, dims)]


def scatter(cts: Sequence[Any], dims: Sequence[int], axis_name: Any, n: int, divisor: Any, scope: str,
            layout: str, after: Any, replicas: tuple[str, ...] = (), one_chain: bool = False) -> tuple[list, Any]:
  """This device's shard of the sum over the axis of each of `cts` (whole leaves, split on `dims`),
  divided by `divisor` (None: the sum): one reduce-scatter (`packed`) or one per leaf (`leaf`), tied to
  `after`, under `jax.named_scope(scope)` and the combiner key `scope`. With `replicas` (HSDP) the
  shards are then all-reduced over those axes under `AR_SCOPE` + k, and `after` is a pair of chains
  (the reduce-scatters', the all-reduces'); `one_chain` (a plan for one collective in flight) ties the next
  reduce-scatter to this all-reduce, as the plan runs them. Returns (the shards, the chain(s) after them)."""
  moved = [jnp.moveaxis(c, d, 0) for c, d in zip(cts, dims)]
  rs_after, ar_after = after if replicas else (after, None)

  def shards(red):
    if layout != "leaf":
      offs = np.cumsum([0] + [m.size // n for m in moved])
      red = [red[0][a:b].reshape((m.shape[0] // n,) + m.shape[1:]) for m, a, b in zip(moved, offs, offs[1:])]
    return [x if divisor is None else x / jnp.asarray(divisor, x.dtype) for x in red]

  with jax.named_scope(scope), _key(scope):
    if layout == "leaf":
      red = [jax.lax.psum_scatter(tie(m, rs_after), axis_name, scatter_dimension=0, tiled=True) for m in moved]
    else:
      buf = jnp.concatenate([m.reshape(n, -1) for m in moved], axis=1).reshape(-1)
      red = [jax.lax.psum_scatter(tie(buf, rs_after), axis_name, scatter_dimension=0, tiled=True)]
    if not replicas:
      out = [jnp.moveaxis(x, 0, d) for x, d in zip(shards(red), dims)]
      return out, last(out)
  ar_scope = AR_SCOPE + scope[len(RS_SCOPE):]
  with jax.named_scope(ar_scope), _key(ar_scope):  # the shard, not the whole gradient, crosses the replicas (F7)
    out = shards([jax.lax.psum(tie(x, ar_after), replicas) for x in red])
  out = [jnp.moveaxis(x, 0, d) for x, d in zip(out, dims)]
  return out, ((last(out) if one_chain else last(red)), last(out))


def last(xs: Sequence[Any]) -> Any:
  """One value that depends on every array of `xs` (what the next collective is tied to)."""
  xs = [x for x in xs if x is not None]
  if len(xs) <= 1:
    return xs[0] if xs else None
  return sum(x.reshape(-1)[0].astype(jnp.float32) for x in xs)
