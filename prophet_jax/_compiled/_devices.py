"""Mesh geometry: which devices, along which axes, hold what (docs/design.md, "Reading compiled programs")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._values._checks import check_values


def data_axes(axis_name: Any) -> tuple[Any, ...]:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def mesh_axis_names(mesh: Any) -> tuple[Any, ...]:
  return tuple(mesh.axis_names)


def check_mesh(mesh: Any, axis_name: Any, where: str) -> tuple[Any, ...]:
  """The data axes, after checking that `mesh` is a Mesh (TypeError) with every one of them (ValueError)."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"{where}(mesh={mesh!r}): expected a jax.sharding.Mesh (e.g. jax.make_mesh((8,), "
                    f"({axis_name!r},))), got {type(mesh).__name__}.")
  axes = data_axes(axis_name)
  missing = [a for a in axes if a not in mesh_axis_names(mesh)]
  if missing:
    shape = dict(zip(mesh_axis_names(mesh), mesh.axis_sizes))
    raise ValueError(
        f"{where}(axis_name={axis_name!r}, mesh=...): the mesh has no axis {missing[0]!r}; its axes are "
        f"{shape}. Pass the name of the mesh axis the batch is split over (axis_name="
        f"{mesh_axis_names(mesh)[0]!r}?), or make the mesh with that name: jax.make_mesh((n,), ({missing[0]!r},)).")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{where}(axis_name={axis_name!r}): an axis is named twice.")
  return axes


def check_in_node(mesh: Any, axes: Sequence[str], where: str) -> None:
  """ValueError when the devices along `axes` of `mesh` (HSDP's shard axes) span processes or slices."""
  devices = getattr(mesh, "devices", None)
  if devices is None:       # an abstract mesh: no devices to read
    return
  names, devices = mesh_axis_names(mesh), np.asarray(devices)
  along = [names.index(a) for a in axes]
  groups = np.moveaxis(devices, along, range(devices.ndim - len(along), devices.ndim))
  for group in groups.reshape(-1, int(np.prod([devices.shape[k] for k in along], dtype=np.int64))):
    for attr in ("process_index", "slice_index"):
      got = sorted({getattr(d, attr, None) for d in group} - {None})
      if len(got) > 1:
        raise ValueError(
            f"{where}: the HSDP plan shards over {tuple(axes)}, but on the mesh {dict(zip(names, mesh.axis_sizes))} "
            f"the devices along {tuple(axes)} ({[getattr(d, 'id', d) for d in group]}) span {attr} {got}: each "
            f"shard group's gathers and reduce-scatters must stay inside one node. Order the mesh so that the "
            f"shard axes run over one process's devices (e.g. jax.make_mesh((replicas, shards), ('replica', "
            f"{axes[0]!r})) with shards <= jax.local_device_count()).")


def axis_total(mesh: Any, axes: Sequence[Any]) -> int:
  sizes = dict(zip(mesh_axis_names(mesh), mesh.axis_sizes))
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def data_devices(mesh: Any, axis_name: Any, where: str) -> int | None:
  """Devices along `axis_name` (an axis or a tuple of axes) of `mesh`; None without a mesh."""
  if mesh is None:
    return None
  if axis_name is None:
    raise ValueError(f"{where}: mesh= needs axis_name= (the data axis, or a tuple of axes) to count the "
                     f"devices the state is laid out over.")
  return axis_total(mesh, check_mesh(mesh, axis_name, where))


def _data_axis(mesh: Any, axis_name: Any, where: str) -> Any:
  if axis_name is None and len(mesh.axis_names) == 1:
    return mesh.axis_names[0]
  if axis_name is None:
    raise ValueError(f"{where}(mesh=...): the mesh has axes {tuple(mesh.axis_names)}; name the one "
                     f"the batch is split over: axis_name=...")
  return axis_name


def profiled_devices(mesh: Any, axis_name: Any, where: str) -> list[Any]:
  """This process's devices, or those of them along the training mesh's data axis."""
  if mesh is None:
    return jax.local_devices()
  axes = check_mesh(mesh, _data_axis(mesh, axis_name, where), where)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"{where}(mesh=...): profiling runs the step, so it needs a mesh of real devices "
                    f"(jax.sharding.Mesh), not {type(mesh).__name__}.")
  names = mesh_axis_names(mesh)
  along = np.asarray(mesh.devices)[tuple(slice(None) if n in axes else 0 for n in names)]
  order = [n for n in names if n in axes]
  along = np.transpose(along, [order.index(a) for a in axes]).reshape(-1)
  out = [d for d in along if d.process_index == jax.process_index()]
  if not out:
    raise ValueError(f"{where}(mesh=...): none of the mesh's devices along {axes} belongs to this "
                     f"process.")
  return out


def profiled_axis(mesh: Any, axis_name: Any, default: str, where: str) -> str:
  """The name of a per-device profile's one mesh axis: the data axis the user names, else `default`."""
  if axis_name is None:
    return str(mesh.axis_names[0]) if mesh is not None and len(mesh.axis_names) == 1 else default
  check_values(where, axis_name=axis_name)
  if isinstance(axis_name, str):
    return axis_name
  if mesh is None:
    raise ValueError(f"{where}(axis_name={axis_name!r}): without a mesh the profiled step maps the batch "
                     f"over one axis; name it (axis_name={axis_name[0]!r}), or pass the training mesh.")
  return default


def mesh_workers(mesh: Any, axis_name: Any, where: str) -> int | None:
  """The devices along the training mesh's data axis (its all-reduces' workers); None without a mesh."""
  if mesh is None:
    return None
  return axis_total(mesh, check_mesh(mesh, _data_axis(mesh, axis_name, where), where))


def host_rows(batch: Any, mesh: Any, where: str) -> Any:
  if mesh is None:
    return batch

  def host(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      raise ValueError(f"{where}(mesh=...): the batch holds a global array that spans processes; "
                       f"pass the rows this process's devices train on (host data).")
    return jax.device_get(x)

  return jax.tree_util.tree_map(host, batch)


def placed(tree: Any, spec: Any, mesh: Any, default: Callable[[], Any]) -> Any:
  """`tree` as ShapeDtypeStructs placed on `mesh` (or `default()`) with PartitionSpec(s) `spec`."""
  mesh = default() if mesh is None else mesh

  def one(s, sub):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=NamedSharding(mesh, s)), sub)

  # one spec for the whole tree is a leaf at the root: one(spec, tree)
  return jax.tree.map(one, spec, tree, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)


def spec_axes(spec: Any, where: str) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec (or a pytree of them) names, in first-use order; TypeError for a non-spec."""
  names: dict[str, None] = {}
  for s in jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, PartitionSpec)):
    if not isinstance(s, PartitionSpec):
      raise TypeError(f"{where}(spec={s!r}): expected a PartitionSpec (or a pytree of them, as shard_map's "
                      f"in_specs), got {type(s).__name__}. Write P({s!r}) with `from jax.sharding import "
                      f"PartitionSpec as P`, or P() for a replicated value.")
    for entry in s:
      names.update(dict.fromkeys(a for a in data_axes(entry) if isinstance(a, str)))
  return tuple(names)
