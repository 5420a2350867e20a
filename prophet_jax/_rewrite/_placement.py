"""The mesh layer's placement checks: where placement is visible (a concrete `jax.Array`'s sharding,
or, in a trace, the type of a value on a mesh with Explicit axes), bad placement is refused before
anything is traced, naming the leaf, its spec and the fix (`_mesh`'s docstring says what each input
must be). Pure checks over the mesh and the arrays' types; `_mesh` decides and maps.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._compiled._devices import mesh_axis_names, axis_total
from .._values._tree import path_str

P = PartitionSpec


# --------------------------------------------------------------------------------------------------
# the mesh and its data axis


def spec_entry(axes: tuple[Any, ...]) -> Any:
  """The PartitionSpec entry splitting one array axis over `axes` ('dp', or ('a', 'b'))."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def explicit_axes(mesh: Any) -> frozenset[Any]:
  types = getattr(mesh, "axis_types", None) or ()
  return frozenset(n for n, t in zip(mesh_axis_names(mesh), types) if t == jax.sharding.AxisType.Explicit)


def check_not_mapped(axes: tuple[Any, ...], where: str) -> None:
  """ValueError when called where the data axis is already manual (inside the user's shard_map)."""
  try:
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  except (AttributeError, RuntimeError, ValueError):
    return
  inside = [a for a in axes if a in manual]
  if inside:
    raise ValueError(
        f"{where}: called inside a jax.shard_map (or pmap) over {inside[0]!r}, but it was made with "
        f"mesh=..., which maps over the mesh itself, for a plain jax.jit on global arrays. Inside your "
        f"own shard_map, make it without mesh= (it then works on this device's values).")


# --------------------------------------------------------------------------------------------------
# placement checks (where placement is visible)


def known_spec(x: Any) -> PartitionSpec | None:
  """The PartitionSpec `x` is known to have, or None where that is not visible.

  Concrete arrays: from their sharding. Traced values: from their type, which carries a spec only on
  a mesh with Explicit axes (and names only those axes). Host data (numpy): None (it is placed by
  the call).
  """
  if isinstance(x, jax.core.Tracer):
    sharding = jax.typeof(x).sharding
    return sharding.spec if explicit_axes(sharding.mesh) else None
  if isinstance(x, jax.Array):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.spec
    if sharding is not None and getattr(sharding, "is_fully_replicated", False):
      return P()
  return None


def _entry_axes(entry: Any) -> tuple[Any, ...]:
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_axes(spec: PartitionSpec) -> list[tuple[int, tuple[Any, ...]]]:
  """(array axis, mesh axes) for every array axis `spec` splits."""
  return [(i, _entry_axes(e)) for i, e in enumerate(spec) if _entry_axes(e)]


def _extras(spec: PartitionSpec) -> str:
  """' unreduced={...}' / ' reduced={...}' of a spec, or ''."""
  return "".join(f" {name}={set(s)}" for name in ("unreduced", "reduced") if (s := getattr(spec, name, None)))


def named_leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [((f"{prefix}/{path_str(p)}" if path_str(p) else prefix), x) for p, x in flat]


def check_placed(tree: Any, specs: Any, what: str, where: str, fix: str) -> None:
  """ValueError when a leaf of `tree` is known to be placed otherwise than `specs` (a PartitionSpec for
  every leaf, or a tree of them) says: split (or unreduced/reduced) where it should be replicated, or
  not split as the plan splits it."""
  want = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
  for i, (name, x) in enumerate(named_leaves(tree, what)):
    spec, expect = known_spec(x), want[i] if len(want) > 1 else want[0] if want else P()
    if spec is None:
      continue
    split, extra = spec_axes(spec), _extras(spec)
    if spec_axes(expect):
      if split != spec_axes(expect) or extra:
        raise ValueError(
            f"{where}: {what} leaf {name!r} (shape {tuple(np.shape(x))}) is placed as {spec}, but the plan "
            f"places it as {expect} (split over the data axis on that dimension). {fix}")
      continue
    if split or extra:
      dim, axes = split[0] if split else (None, ())
      how = (f"split over mesh axis {axes[0] if len(axes) == 1 else axes!r} on its axis {dim}" if split
             else f"typed{extra}")
      raise ValueError(
          f"{where}: {what} leaf {name!r} (shape {tuple(np.shape(x))}) is {how} (PartitionSpec "
          f"{spec}), but data parallelism needs every {what} leaf replicated, P(). {fix}")


def check_batch(batch: Any, mesh: Any, axes: tuple[Any, ...], where: str) -> None:
  """ValueError for a batch leaf that cannot be split over the data axes on its leading axis, or is
  known to be placed otherwise (replicated, split over another axis, or on another array axis)."""
  n, entry = axis_total(mesh, axes), spec_entry(axes)
  leaves = named_leaves(batch, "batch")
  if not leaves:
    raise ValueError(f"{where}: the batch has no array leaves; pass the global batch (leading axis: "
                     f"examples, split over {entry!r}).")
  for name, x in leaves:
    shape = tuple(np.shape(x))
    if not shape or shape[0] % n:
      raise ValueError(
          f"{where}: batch leaf {name!r} has shape {shape}; every batch leaf needs a leading (example) "
          f"axis that splits over mesh axis {entry!r} ({n} devices), e.g. ({4 * n}, ...). Values that "
          f"are the same for the whole batch (a PRNG key, a step number) belong in the model state "
          f"(has_state=True) or in loss_fn's closure.")
    spec = known_spec(x)
    if spec is None:
      if set(axes) & explicit_axes(mesh):   # jax's shard_map would refuse it, naming only in_specs
        what = "host data (numpy), not placed on the mesh" if not isinstance(x, jax.Array) else (
            "not placed on the mesh (its type names no mesh axis)")
        raise ValueError(
            f"{where}: batch leaf {name!r} (shape {shape}) is {what}, but the mesh's axis {entry!r} is "
            f"Explicit, so the batch must arrive split over it: jax.device_put(batch, NamedSharding(mesh, "
            f"P({entry!r}))) before the step (outside the jit).")
      continue
    split = spec_axes(spec)
    lead = _entry_axes(spec[0]) if len(spec) else ()
    if tuple(lead) != axes or len(split) != 1 or _extras(spec):
      now = "replicated (not split over any axis)" if not split else f"placed as {spec}"
      raise ValueError(
          f"{where}: batch leaf {name!r} (shape {shape}) is {now}, but the batch must be split over "
          f"mesh axis {entry!r} on its leading axis and nothing else: "
          f"jax.device_put(batch, NamedSharding(mesh, P({entry!r}))) before the step (or, inside a "
          f"jit on Explicit axes, jax.sharding.reshard(x, P({entry!r}))).")


def check_model_state(new: Any, axes: tuple[Any, ...], where: str) -> None:
  for name, x in named_leaves(new, "model_state"):
    if hasattr(x, "dtype") and any(a in jax.typeof(x).manual_axis_type.varying for a in axes):
      entry = spec_entry(axes)
      raise ValueError(
          f"{where}: the new model state's leaf {name!r} varies over mesh axis {entry!r} (it was "
          f"computed from each device's own batch), but on the mesh the model state is one value, "
          f"replicated, as in a plain jax.jit step. Average it over the axis in loss_fn: "
          f"jax.lax.pmean(..., {entry!r}) (flax: nn.BatchNorm(axis_name={entry!r}), which is what a "
          f"plain jax.jit step over the global batch computes).")
