"""Mesh geometry: a mesh's data axes, their device count, and this process's devices along them.

The floor under both the rewrite's mesh layer (`_rewrite/_mesh.py`) and measurement (`profile_step`,
`Monitor`), which need the same geometry of a user's training mesh and nothing of the rewrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["data_axes", "check_mesh", "axis_total", "local_devices_along"]


def data_axes(axis_name: Any) -> tuple[Any, ...]:
  """The data axis as a tuple of mesh axis names ('dp' -> ('dp',))."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _names(mesh: Any) -> tuple[Any, ...]:
  return tuple(mesh.axis_names)


def check_mesh(mesh: Any, axis_name: Any, where: str) -> tuple[Any, ...]:
  """The data axes, after checking that `mesh` is a mesh that has every one of them.

  Raises:
    TypeError: `mesh` is not a `jax.sharding.Mesh` / `AbstractMesh`.
    ValueError: the mesh lacks an axis of `axis_name` (its axes are named).
  """
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"{where}(mesh={mesh!r}): expected a jax.sharding.Mesh (e.g. jax.make_mesh((8,), "
                    f"({axis_name!r},))), got {type(mesh).__name__}.")
  axes = data_axes(axis_name)
  missing = [a for a in axes if a not in _names(mesh)]
  if missing:
    shape = dict(zip(_names(mesh), mesh.axis_sizes))
    raise ValueError(
        f"{where}(axis_name={axis_name!r}, mesh=...): the mesh has no axis {missing[0]!r}; its axes are "
        f"{shape}. Pass the name of the mesh axis the batch is split over (axis_name="
        f"{_names(mesh)[0]!r}?), or make the mesh with that name: jax.make_mesh((n,), ({missing[0]!r},)).")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{where}(axis_name={axis_name!r}): an axis is named twice.")
  return axes


def axis_total(mesh: Any, axes: Sequence[Any]) -> int:
  """Devices along the data axes (the product of their sizes): the number of per-device batches."""
  sizes = dict(zip(_names(mesh), mesh.axis_sizes))
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def local_devices_along(mesh: Any, axis_name: Any, where: str) -> list[Any]:
  """This process's devices along the data axes of `mesh` (at the first index of every other axis):
  the devices a per-device profile of the mesh's step runs on."""
  axes = check_mesh(mesh, axis_name, where)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"{where}(mesh=...): profiling runs the step, so it needs a mesh of real devices "
                    f"(jax.sharding.Mesh), not {type(mesh).__name__}.")
  names = _names(mesh)
  devices = np.asarray(mesh.devices)
  index = tuple(slice(None) if n in axes else 0 for n in names)
  along = devices[index]
  order = [n for n in names if n in axes]
  along = np.transpose(along, [order.index(a) for a in axes]).reshape(-1)
  here = jax.process_index()
  out = [d for d in along if d.process_index == here]
  if not out:
    raise ValueError(f"{where}(mesh=...): none of the mesh's devices along {axes} belongs to this "
                     f"process.")
  return out
