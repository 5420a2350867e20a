"""Placement: how each parameter leaf lies on the mesh (sharded over the data axis on one dimension, or
replicated), read from PartitionSpec-like values without importing jax.

Pure: numpy only, never jax (jax is imported by `shardings_by_path` only when installed, to flatten a
tree of shardings up to the parameters' structure, as `_tree.flatten_with_paths` does).

The contract (DESIGN.md, 2026-11-27; docs/fsdp.md):

- A *mesh shape* is the ordered mapping axis name -> size (a jax `Mesh.shape`), recorded on a profile as
  `GradientProfile.mesh`, a tuple of (name, size) pairs.
- A leaf's spec is read by duck typing: an object with `.spec` (a NamedSharding) gives its spec, and,
  through `.mesh.shape`, the mesh shape; a tuple or list (a PartitionSpec is one, or a tuple subclass)
  is the spec itself; None is replicated. Each entry of a spec is None (that dimension whole), an axis
  name, or a tuple of axis names (the dimension split over their product).
- A leaf is *sharded* when exactly one dimension is split over one or more mesh axes whose product is
  > 1: `ProfileRow.shard_dim` is that dimension; it must divide evenly (jax's NamedSharding needs it,
  and an FSDP bucket's slices must be equal). Every sharded leaf of one profile is split over the same
  axes (`GradientProfile.shard_axes`, in mesh order); the other mesh axes replicate it (HSDP's replica
  axis). A leaf split on two dimensions is refused, naming it (the data axis shards one dimension).
- A leaf with no split dimension (or one over axes of size 1) is *replicated*: `shard_dim` None.
- The placement is part of the profile's tree fingerprint only when present (`placement_fingerprint`),
  so the fingerprint and the JSON of a profile without placement are what they were before.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import ProfileError

__all__ = ["spec_of", "mesh_of", "leaf_placement", "check_mesh", "check_placement", "placement_fingerprint",
           "shard_count", "replica_count", "Placed"]

Mesh = tuple[tuple[str, int], ...]


def spec_of(sharding: Any) -> tuple | None:
  """The PartitionSpec-like tuple of a leaf's sharding (duck-typed): `.spec` of a NamedSharding-like
  object, a tuple or list as it is, None for None (replicated). Anything else is None too only if it
  has a `.spec` attribute; otherwise a TypeError is raised by the caller (`leaf_placement`)."""
  if sharding is None:
    return None
  spec = getattr(sharding, "spec", sharding)
  if spec is None:
    return None
  if isinstance(spec, (tuple, list)):
    return tuple(spec)
  try:                               # a PartitionSpec that is not a tuple subclass iterates its entries
    return tuple(iter(spec))
  except TypeError:
    return spec                      # refused by leaf_placement, naming the leaf


def mesh_of(sharding: Any) -> Mesh | None:
  """The mesh shape of a NamedSharding-like object (`.mesh.shape`, a mapping), else None."""
  shape = getattr(getattr(sharding, "mesh", None), "shape", None)
  if isinstance(shape, Mapping):
    return tuple((str(k), int(v)) for k, v in shape.items())
  return None


def check_mesh(where: str, mesh: Any) -> Mesh:
  """A mesh shape from a mapping (axis -> size), an object with a `.shape` mapping (a jax Mesh), or a
  sequence of (name, size) pairs; every size an integer >= 1, names unique. None gives () (no mesh)."""
  shape = getattr(mesh, "shape", mesh)
  if shape is None:
    return ()
  items = list(shape.items()) if isinstance(shape, Mapping) else shape
  try:
    out = tuple((k, v) for k, v in items)
  except (TypeError, ValueError):
    raise ProfileError(f"{where}: mesh={mesh!r} is not a mesh shape; expected a mapping of axis name to "
                       f"size such as {{'data': 8}} (or a jax Mesh).") from None
  for k, v in out:
    if not isinstance(k, str) or not k:
      raise ProfileError(f"{where}: mesh axis name {k!r} must be a non-empty string.")
    if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 1:
      raise ProfileError(f"{where}: mesh axis {k!r} has size {v!r}; a size is an integer >= 1.")
  names = [k for k, _ in out]
  if len(set(names)) != len(names):
    raise ProfileError(f"{where}: mesh axis names {names} repeat; each axis is named once.")
  return tuple((k, int(v)) for k, v in out)


def leaf_placement(path: str, shape: Sequence[int], sharding: Any, mesh: Mesh
                   ) -> tuple[int | None, tuple[str, ...]]:
  """(shard_dim, axes) of one leaf: the dimension split over the data axes and those axes in mesh
  order, or (None, ()) for a replicated leaf.

  Raises:
    ProfileError: an entry that is not None, an axis name or a tuple of names; an axis not in the mesh;
      two split dimensions; a spec longer than the shape; a dimension not divisible by its axes' size.
  """
  spec = spec_of(sharding)
  if spec is None:
    return None, ()
  if not isinstance(spec, tuple):
    raise ProfileError(f"leaf {path!r} has sharding {sharding!r}; expected a PartitionSpec-like tuple "
                       f"(e.g. ('data', None)), an object with .spec (a NamedSharding) or None.")
  sizes = dict(mesh)
  if len(spec) > len(shape):
    raise ProfileError(f"leaf {path!r} of shape {tuple(shape)} has spec {spec} with {len(spec)} entries; a "
                       f"spec has at most one entry per dimension.")
  found: list[tuple[int, tuple[str, ...]]] = []
  for dim, e in enumerate(spec):
    if e is None:
      continue
    axes = (e,) if isinstance(e, str) else tuple(e) if isinstance(e, (tuple, list)) else None
    if axes is None or not all(isinstance(a, str) for a in axes):
      raise ProfileError(f"leaf {path!r} has spec entry {e!r} at dimension {dim}; an entry is None, a mesh "
                         f"axis name or a tuple of names.")
    missing = [a for a in axes if a not in sizes]
    if missing:
      raise ProfileError(f"leaf {path!r} is split over axis {missing[0]!r}, which is not in the mesh "
                         f"{dict(mesh)}; pass the mesh the arrays live on.")
    n = math.prod(sizes[a] for a in axes)
    if n > 1:
      found.append((dim, tuple(a for a, _ in mesh if a in axes)))
  if not found:
    return None, ()
  if len(found) > 1:
    raise ProfileError(f"leaf {path!r} of shape {tuple(shape)} is split on dimensions "
                       f"{[d for d, _ in found]} ({spec}); FSDP shards a leaf over the data axis on one "
                       f"dimension. Split one dimension, or leave the leaf replicated.")
  dim, axes = found[0]
  n = math.prod(sizes[a] for a in axes)
  if shape[dim] % n:
    raise ProfileError(f"leaf {path!r} of shape {tuple(shape)} splits dimension {dim} ({shape[dim]}) over "
                       f"{axes} of size {n}, which does not divide it; pad the dimension to a multiple of "
                       f"{n} or replicate the leaf.")
  return dim, axes


def check_placement(rows: Sequence[Any], mesh: Mesh, shard_axes: tuple[str, ...]) -> None:
  """A profile's placement: every sharded row's dimension in range and divisible by the shard count;
  `shard_axes` in the mesh; a sharded row only with a mesh.

  Raises:
    ProfileError: naming the leaf (or the axis) at fault.
  """
  sharded = [r for r in rows if r.shard_dim is not None]
  if not mesh:
    if sharded or shard_axes:
      raise ProfileError(f"leaf {sharded[0].path if sharded else '?'!r} is sharded (shard_dim), but the "
                         f"profile has no mesh; give mesh (axis name -> size) and shard_axes.")
    return
  sizes = dict(mesh)
  bad = [a for a in shard_axes if a not in sizes]
  if bad:
    raise ProfileError(f"the profile's shard_axes name {bad[0]!r}, which is not in its mesh {sizes}.")
  if sharded and not shard_axes:
    raise ProfileError(f"leaf {sharded[0].path!r} is sharded, but the profile has no shard_axes; name the "
                       f"mesh axes its shard_dim is split over.")
  n = shard_count(mesh, shard_axes)
  for r in sharded:
    d = r.shard_dim
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < len(r.shape):
      raise ProfileError(f"leaf {r.path!r} has shard_dim={d!r}; expected a dimension of its shape {r.shape} "
                         f"or null (replicated).")
    if r.shape[d] % n:
      raise ProfileError(f"leaf {r.path!r} of shape {r.shape} is sharded on dimension {d} over {n} devices "
                         f"({shard_axes}), which does not divide {r.shape[d]}.")


def shard_count(mesh: Mesh, shard_axes: Sequence[str]) -> int:
  """How many devices a sharded leaf is split over: the product of the shard axes' sizes."""
  sizes = dict(mesh)
  return math.prod(sizes[a] for a in shard_axes) if shard_axes else 1


class Placed:
  """What a value placed on a mesh (`mesh`, `shard_axes`) says of it: `shard_count` and `replica_count`
  (`GradientProfile`, `FsdpPlan`)."""

  __slots__ = ()

  @property
  def shard_count(self) -> int:
    """Devices a sharded leaf is split over (the product of `shard_axes`' sizes; 1 without placement)."""
    return shard_count(self.mesh, self.shard_axes)  # type: ignore[attr-defined]

  @property
  def replica_count(self) -> int:
    """Copies of each shard on the mesh (the product of the other axes' sizes; > 1 is HSDP; 1 without
    placement)."""
    return replica_count(self.mesh, self.shard_axes)  # type: ignore[attr-defined]


def replica_count(mesh: Mesh, shard_axes: Sequence[str]) -> int:
  """How many copies of each shard the mesh holds: the product of the other axes' sizes."""
  return math.prod(v for k, v in mesh if k not in shard_axes) if mesh else 1


def placement_fingerprint(rows_fingerprint: str, shard_dims: Sequence[int | None], mesh: Mesh,
                          shard_axes: Sequence[str]) -> str:
  """The tree fingerprint with the placement folded in; `rows_fingerprint` itself when there is none
  (no mesh), so profiles and schedules without placement keep their fingerprints."""
  if not mesh:
    return rows_fingerprint
  h = hashlib.sha256(rows_fingerprint.encode())
  h.update(("|".join(f"{k}={v}" for k, v in mesh) + ";" + ",".join(shard_axes) + ";").encode())
  h.update(",".join("r" if d is None else str(d) for d in shard_dims).encode())
  return h.hexdigest()[:16]
