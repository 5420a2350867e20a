"""How each parameter leaf lies on the mesh (sharded on one dimension, or replicated), read from
PartitionSpec-like values without jax (pure; docs/fsdp.md, "Placement as input").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import ProfileError

Mesh = tuple[tuple[str, int], ...]


def spec_of(sharding: Any) -> tuple | None:
  """The PartitionSpec-like tuple of a leaf's sharding (`.spec`, a tuple or list, None: replicated);
  anything else is returned for `leaf_placement` to refuse.
  """
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
  return tuple((str(k), int(v)) for k, v in shape.items()) if isinstance(shape, Mapping) else None


def check_mesh(where: str, mesh: Any) -> Mesh:
  """A mesh shape ((name, size) pairs) from a mapping, a jax Mesh or pairs (None: ()); ProfileError
  otherwise.
  """
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
  """(shard_dim, axes in mesh order) of one leaf, or (None, ()) when replicated; ProfileError naming the
  leaf for a bad spec, an unknown axis, two split dimensions or an uneven split.
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
      found.append((dim, tuple(a for a, _ in mesh if a in axes), n))
  if not found:
    return None, ()
  if len(found) > 1:
    raise ProfileError(f"leaf {path!r} of shape {tuple(shape)} is split on dimensions "
                       f"{[f[0] for f in found]} ({spec}); FSDP shards a leaf over the data axis on one "
                       f"dimension. Split one dimension, or leave the leaf replicated.")
  dim, axes, n = found[0]
  if shape[dim] % n:
    raise ProfileError(f"leaf {path!r} of shape {tuple(shape)} splits dimension {dim} ({shape[dim]}) over "
                       f"{axes} of size {n}, which does not divide it; pad the dimension to a multiple of "
                       f"{n} or replicate the leaf.")
  return dim, axes


def check_placement(rows: Sequence[Any], mesh: Mesh, shard_axes: tuple[str, ...]) -> None:
  """A profile's placement checked: sharded dimensions in range and divisible, `shard_axes` in the mesh;
  ProfileError naming the leaf or axis.
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
  for r in sharded:       # each ProfileRow has checked its shard_dim is a dimension of its shape
    d = r.shard_dim
    if r.shape[d] % n:
      raise ProfileError(f"leaf {r.path!r} of shape {r.shape} is sharded on dimension {d} over {n} devices "
                         f"({shard_axes}), which does not divide {r.shape[d]}.")


def shard_count(mesh: Mesh, shard_axes: Sequence[str]) -> int:
  """How many devices a sharded leaf is split over: the product of the shard axes' sizes."""
  return math.prod(dict(mesh)[a] for a in shard_axes) if shard_axes else 1


class Placed:
  """What a value placed on a mesh says of it: `shard_count` and `replica_count`."""

  __slots__ = ()

  @property
  def shard_count(self) -> int:
    """Devices a sharded leaf is split over (the product of `shard_axes`' sizes; 1 without placement)."""
    return shard_count(self.mesh, self.shard_axes)  # type: ignore[attr-defined]

  @property
  def replica_count(self) -> int:
    """Copies of each shard on the mesh (> 1 is HSDP; 1 without placement)."""
    return replica_count(self.mesh, self.shard_axes)  # type: ignore[attr-defined]


def replica_count(mesh: Mesh, shard_axes: Sequence[str]) -> int:
  """How many copies of each shard the mesh holds: the product of the other axes' sizes."""
  return math.prod(v for k, v in mesh if k not in shard_axes) if mesh else 1


def placement_fingerprint(rows_fingerprint: str, shard_dims: Sequence[int | None], mesh: Mesh,
                          shard_axes: Sequence[str]) -> str:
  """The tree fingerprint with the placement folded in; `rows_fingerprint` itself without a mesh."""
  if not mesh:
    return rows_fingerprint
  h = hashlib.sha256(rows_fingerprint.encode())
  h.update(("|".join(f"{k}={v}" for k, v in mesh) + ";" + ",".join(shard_axes) + ";").encode())
  h.update(",".join("r" if d is None else str(d) for d in shard_dims).encode())
  return h.hexdigest()[:16]
