"""GradientProfile and its rows, `itemsize`, the JSON helpers and the one scalar rule every door applies
(`is_bool`, `is_int`, `is_number`). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ProfileError
from ._placement import (Placed, check_mesh, check_placement, leaf_placement, mesh_of, placement_fingerprint)
from ._stacks import check_stacks, in_order, unstack_rows
from ._tree import (IdentityMemo, check_layer_depth, dtype_name, flatten_with_layer_paths, is_float_dtype,
                    is_reduced_leaf, layer_of, rows_info, shardings_by_path)

PROFILE_SCHEMA = 1
PROFILE_METHODS = ("measured", "timed", "estimated")

# GradientProfile.tree_rows, memoized by the profile's identity (the one memo policy, `_tree.IdentityMemo`)
_profile_rows = IdentityMemo(64)(lambda p: rows_info(tuple((r.path, r.shape, r.dtype) for r in p.rows)).rows)

_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float0": 0}


def itemsize(dtype: str) -> int:
  """Bytes per element of a dtype name ('float32', 'bfloat16', ...), without importing jax."""
  if dtype in _ITEMSIZE:
    return _ITEMSIZE[dtype]
  try:
    return int(np.dtype(dtype).itemsize)
  except TypeError as e:
    raise ValueError(f"unknown dtype {dtype!r}; expected a numpy dtype name or 'bfloat16'") from e


# --------------------------------------------------------------------------------------------------
# The scalar rule: what every door (a value's constructor, a factory, an entry point) accepts as a
# bool, an integer or a number. Written once, here, at the bottom of the house, so that values can
# use it and the argument checks (`_checks`) are built on it.


def is_bool(x: Any) -> bool:
  """True for Python and numpy booleans."""
  return isinstance(x, (bool, np.bool_))


def is_int(x: Any) -> bool:
  """True for Python and numpy integers, never for a boolean."""
  return isinstance(x, (int, np.integer)) and not is_bool(x)


def is_number(x: Any) -> bool:
  """True for Python and numpy integers and floats (a real number), never for a boolean."""
  return isinstance(x, (int, float, np.integer, np.floating)) and not is_bool(x)


def is_finite_nonneg(x: Any) -> bool:
  """True for a finite real number >= 0 (a time, a rate, a residual)."""
  return is_number(x) and math.isfinite(x) and x >= 0


def check_items(items: tuple[Any, ...], kind: type, error: type[Exception], empty: str | None, has: str,
                fix: str) -> None:
  """Raises `error(empty)` for no items (unless `empty` is None), and `error` naming the first item that is
  not a `kind`.
  """
  if not items and empty is not None:
    raise error(empty)
  bad = next((x for x in items if not isinstance(x, kind)), None)
  if bad is not None:
    raise error(f"{has} {bad!r} of type {type(bad).__name__}; {fix}")


def nonneg_or_none(value: Any, error: Callable[[Any], Exception]) -> float | None:
  """None, or `value` as a float when it is a finite number >= 0; otherwise raises `error(value)`."""
  if value is None:
    return None
  if not is_finite_nonneg(value):
    raise error(value)
  return float(value)


def _finite_nonneg(owner: str, name: str, value: Any) -> float:
  if not is_number(value):
    raise ProfileError(f"{owner} has {name}={value!r}; {name} must be a number of seconds (finite, >= 0), "
                       f"not {type(value).__name__}.")
  value = float(value)
  if not is_finite_nonneg(value):
    raise ProfileError(f"{owner} has {name}={value!r}; {name} must be finite and >= 0.")
  return value


def _row_shape(path: str, shape: Any) -> tuple[int, ...]:
  """A row's shape: a list or tuple of integers >= 0, else a ProfileError naming the leaf."""
  if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) and not isinstance(shape, np.ndarray):
    raise ProfileError(f"leaf {path!r} has shape={shape!r}; a shape must be a list (or tuple) of integers "
                       f"such as [64, 128] ([] for a scalar).")
  dims = list(shape.tolist() if isinstance(shape, np.ndarray) else shape)
  bad = [d for d in dims if not is_int(d)]
  if bad:
    raise ProfileError(f"leaf {path!r} has shape={shape!r}; every dimension must be an integer, got "
                       f"{bad[0]!r} ({type(bad[0]).__name__}).")
  out = tuple(int(d) for d in dims)
  if any(d < 0 for d in out):
    raise ProfileError(f"leaf {path!r} has shape {out}; dimensions must be >= 0.")
  return out


def _row_dtype(path: str, dtype: Any) -> str:
  """A row's dtype: a floating dtype's name, else a ProfileError naming the leaf."""
  if not isinstance(dtype, str) or not dtype:
    raise ProfileError(f"leaf {path!r} has dtype={dtype!r}; a dtype is a name such as 'float32' or "
                       f"'bfloat16'.")
  if dtype not in _ITEMSIZE:
    try:
      np.dtype(dtype)
    except TypeError:
      raise ProfileError(f"leaf {path!r} has dtype={dtype!r}, which is not a dtype name; expected a "
                         f"floating one such as 'float32' or 'bfloat16'.") from None
  if not is_float_dtype(dtype):
    raise ProfileError(f"leaf {path!r} has dtype={dtype!r}; profile rows are floating gradients only "
                       f"(float32, bfloat16, float16, ...): integer, bool and float0 leaves are not "
                       f"all-reduced and have no row. Drop the row, or give its gradient's float dtype.")
  return dtype


def json_object(text_or_obj: str | Mapping[str, Any], what: str) -> dict[str, Any]:
  if isinstance(text_or_obj, Mapping):
    return dict(text_or_obj)
  try:
    obj = json.loads(text_or_obj)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what}.from_json: malformed JSON ({e.msg} at line {e.lineno} col {e.colno}).") from e
  if not isinstance(obj, dict):
    raise ValueError(f"{what}.from_json: expected a JSON object, got {type(obj).__name__}.")
  return obj


def json_fields(cls: type, obj: dict[str, Any], what: str, *, required: bool = False) -> dict[str, Any]:
  """`obj`, checked to hold only fields of the dataclass `cls` (and, with `required`, all)."""
  fields = dataclasses.fields(cls)
  names = {f.name for f in fields}
  unknown = sorted(set(obj) - names)
  if unknown:
    raise ValueError(f"{what}.from_json: unknown field(s) {unknown}; expected some of {sorted(names)}.")
  if required:
    missing = sorted(f.name for f in fields if f.name not in obj and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
      raise ValueError(f"{what}.from_json: missing field(s) {missing}.")
  return obj


class JsonValue:
  """What every JSON value shares: `to_json` writes `to_dict()`; `from_json` reads `_json_fields`."""

  __slots__ = ()

  def to_dict(self) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

  def to_json(self, indent: int | None = None) -> str:
    """`to_dict()` as JSON text."""
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def _json_fields(cls, text_or_obj: str | Mapping[str, Any]) -> dict[str, Any]:
    return json_fields(cls, json_object(text_or_obj, cls.__name__), cls.__name__)


# --------------------------------------------------------------------------------------------------
# GradientProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRow:
  """One reduced gradient leaf.

  Attributes:
    path: canonical key path, e.g. 'params/Conv_0/kernel' (rows map to leaves by path).
    layer: the layer it belongs to.
    shape: the leaf's shape.
    dtype: the gradient's dtype name.
    nbytes: bytes; must equal prod(shape) * itemsize(dtype).
    ready_s: when backward has produced it, seconds from the start of backward.
    fwd_s: forward time of its layer, seconds, on the layer's first row (0 on the others).
    update_s: optimizer time for this leaf, seconds (0 when unknown).
    shard_dim: the dimension sharded over the profile's `shard_axes` (FSDP), or None: replicated.
    gather_dtype: a sharded leaf's dtype when all-gathered (a bf16 model over f32 shards: 'bfloat16'), or
      None: its own; its gradient is reduce-scattered in `dtype`.
  """

  path: str
  layer: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  ready_s: float
  fwd_s: float = 0.0
  update_s: float = 0.0
  shard_dim: int | None = None
  gather_dtype: str | None = None

  def __post_init__(self):
    if not isinstance(self.path, str) or not self.path:
      raise ProfileError(f"a profile row has path={self.path!r}; paths must be non-empty strings.")
    if not isinstance(self.layer, str) or not self.layer:
      raise ProfileError(f"leaf {self.path!r} has layer={self.layer!r}; a layer is a non-empty string naming "
                         f"the layer the leaf belongs to (e.g. {layer_of(self.path)!r}; wfbp sends one "
                         f"all-reduce per layer).")
    object.__setattr__(self, "shape", _row_shape(self.path, self.shape))
    object.__setattr__(self, "dtype", _row_dtype(self.path, self.dtype))
    if not (is_int(self.nbytes) or (is_number(self.nbytes) and math.isfinite(self.nbytes)
                                    and float(self.nbytes).is_integer())):
      raise ProfileError(f"leaf {self.path!r} has nbytes={self.nbytes!r}; nbytes must be an integer number "
                         f"of bytes.")
    expected = int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)
    if int(self.nbytes) != expected:
      raise ProfileError(
          f"leaf {self.path!r} has nbytes={self.nbytes}; shape {self.shape} of {self.dtype} holds "
          f"{expected} bytes.")
    object.__setattr__(self, "nbytes", int(self.nbytes))
    for name in ("ready_s", "fwd_s", "update_s"):
      object.__setattr__(self, name, _finite_nonneg(f"leaf {self.path!r}", name, getattr(self, name)))
    d = self.shard_dim
    if d is not None and (not is_int(d) or not 0 <= d < len(self.shape)):
      raise ProfileError(f"leaf {self.path!r} has shard_dim={d!r}; expected a dimension of its shape "
                         f"{self.shape} or null (replicated).")
    if d is not None:
      object.__setattr__(self, "shard_dim", int(d))
    if self.gather_dtype is not None:
      _row_dtype(self.path, self.gather_dtype)
      if d is None:
        raise ProfileError(f"leaf {self.path!r} has gather_dtype={self.gather_dtype!r} but is replicated "
                           f"(shard_dim null); only sharded leaves are all-gathered.")

  @property
  def size(self) -> int:
    """Number of elements."""
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def gather_nbytes(self) -> int:
    """Bytes of the leaf as all-gathered (in `gather_dtype`)."""
    return self.nbytes if self.gather_dtype is None else self.size * itemsize(self.gather_dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientProfile(JsonValue, Placed):
  """Per-leaf gradient readiness of one training step, rows in priority (forward) order.

  Attributes:
    rows: one ProfileRow per reduced leaf; row 0 is the leaf the next forward needs first.
    forward_s, backward_s: the step's forward and backward times, seconds (ready_s <= backward_s).
    method: 'measured', 'timed' or 'estimated'.
    model, device, notes: free text.
    mesh: the mesh shape, (axis name, size) pairs; () when no placement is known.
    shard_axes: the mesh axes sharded rows are split over (the others replicate them: HSDP).
    stacks: the prefixes of scanned stacks planned per layer: rows `<prefix>/<k>/<rest>` of layer
      `<prefix>/<k>` (`unstacked`).
    schema: format version.
  """

  rows: tuple[ProfileRow, ...]
  forward_s: float
  backward_s: float
  method: str = "estimated"
  model: str = ""
  device: str = ""
  notes: str = ""
  mesh: tuple[tuple[str, int], ...] = ()
  shard_axes: tuple[str, ...] = ()
  stacks: tuple[str, ...] = ()
  schema: int = PROFILE_SCHEMA

  def __post_init__(self):
    if isinstance(self.rows, (str, bytes, Mapping)) or not isinstance(self.rows, Iterable):
      raise ProfileError(f"the profile has rows={self.rows!r}; rows must be a list of ProfileRows.")
    object.__setattr__(self, "rows", tuple(self.rows))
    check_items(self.rows, ProfileRow, ProfileError, "the profile is empty: it needs at least one gradient row.",
                "the profile has a row", "rows must be ProfileRows (GradientProfile.from_rows takes dicts).")
    if not isinstance(self.method, str) or self.method not in PROFILE_METHODS:
      raise ProfileError(f"profile has method={self.method!r}; expected one of {PROFILE_METHODS}.")
    for name in ("model", "device", "notes"):
      if not isinstance(getattr(self, name), str):
        raise ProfileError(f"profile has {name}={getattr(self, name)!r}; it must be a string (free text).")
    if self.schema != PROFILE_SCHEMA or not is_int(self.schema):
      raise ProfileError(f"profile has schema={self.schema!r}; this version reads {PROFILE_SCHEMA}.")
    for name in ("forward_s", "backward_s"):
      object.__setattr__(self, name, _finite_nonneg("the profile", name, getattr(self, name)))
    paths = [r.path for r in self.rows]
    if len(set(paths)) != len(paths):
      dup = next(p for p in paths if paths.count(p) > 1)
      raise ProfileError(f"leaf {dup!r} appears twice in the profile; paths must be unique.")
    tol = 1e-9 + 1e-6 * self.backward_s
    for r in self.rows:
      if r.ready_s > self.backward_s + tol:
        raise ProfileError(
            f"leaf {r.path!r} has ready_s={r.ready_s}; ready times must be <= backward_s="
            f"{self.backward_s}.")
    object.__setattr__(self, "mesh", check_mesh("the profile", self.mesh) if self.mesh else ())
    if isinstance(self.shard_axes, str) or not all(isinstance(a, str) for a in self.shard_axes):
      raise ProfileError(f"the profile has shard_axes={self.shard_axes!r}; expected a list of mesh axis "
                         f"names such as ['data'].")
    object.__setattr__(self, "shard_axes", tuple(self.shard_axes))
    check_placement(self.rows, self.mesh, self.shard_axes)
    object.__setattr__(self, "stacks", check_stacks(self.rows, self.stacks))
    fwd = sum(r.fwd_s for r in self.rows)
    if fwd > 0 and abs(fwd - self.forward_s) > 1e-9 + 1e-6 * self.forward_s:
      raise ProfileError(
          f"the rows' fwd_s sum to {fwd}, but forward_s={self.forward_s}; they must agree (or leave "
          f"every fwd_s at 0).")

  # -- derived --------------------------------------------------------------------------------------
  @property
  def total_nbytes(self) -> int:
    return sum(r.nbytes for r in self.rows)

  @property
  def update_s(self) -> float:
    return sum(r.update_s for r in self.rows)

  @property
  def sharded(self) -> bool:
    """True when some row is sharded over the data axis (`ProfileRow.shard_dim`): an FSDP profile."""
    return any(r.shard_dim is not None for r in self.rows)


  @property
  def compute_s(self) -> float:
    """forward + backward + update: the iteration time with free communication."""
    return self.forward_s + self.backward_s + self.update_s

  @property
  def layers(self) -> tuple[str, ...]:
    """Layer names in order of first appearance (priority order)."""
    return tuple(dict.fromkeys(r.layer for r in self.rows))

  def layer_fwd_s(self) -> dict[str, float]:
    """Forward time per layer; with no per-row forward times, all of forward_s on the first layer."""
    out = dict.fromkeys(self.layers, 0.0)
    for r in self.rows:
      out[r.layer] += r.fwd_s
    if self.forward_s > 0 and not any(out.values()):
      out[self.layers[0]] = self.forward_s
    return out

  def ready_order(self) -> tuple[int, ...]:
    """Row indices sorted by ready time (ties: later rows first, as backward runs back to front)."""
    return tuple(sorted(range(len(self.rows)), key=lambda i: (self.rows[i].ready_s, -i)))

  def tree_rows(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(path, shape, dtype) of every row, in order: what a Schedule for this profile records."""
    return _profile_rows(self)

  def fingerprint(self) -> str:
    """The tree fingerprint of `tree_rows()` (what `Schedule.tree_fingerprint` must equal), with the
    placement folded in when the profile has one (`_placement.placement_fingerprint`)."""
    return placement_fingerprint(rows_info(self.tree_rows()).fingerprint, [r.shard_dim for r in self.rows],
                                 self.mesh, self.shard_axes)

  def describe(self, max_rows: int = 8) -> str:
    """A short human summary: totals, how it was made, and the first rows in ready order."""
    return "\n".join([
        f"{self.model or 'profile'} on {self.device or '?'} ({self.method}): {len(self.rows)} gradients in "
        f"{len(self.layers)} layers, {self.total_nbytes / 2**20:.3f} MiB; forward {self.forward_s * 1e3:.3f} "
        f"ms, backward {self.backward_s * 1e3:.3f} ms, update {self.update_s * 1e3:.3f} ms",
        f"  {self.notes}",
        f"  ready order (first {max_rows}): " + ", ".join(
            f"{self.rows[i].path} @{self.rows[i].ready_s * 1e3:.3f}ms" for i in self.ready_order()[:max_rows])])

  def scaled(self, compute: float) -> GradientProfile:
    """This profile with every time multiplied by `compute` (> 0); ValueError otherwise."""
    if not is_number(compute) or not math.isfinite(compute) or compute <= 0:
      raise ValueError(f"GradientProfile.scaled(compute={compute!r}): `compute` must be a finite number > 0, "
                       f"the factor every time is multiplied by (e.g. 0.5 for a device twice as fast).")
    compute = float(compute)
    rows = tuple(dataclasses.replace(r, ready_s=r.ready_s * compute, fwd_s=r.fwd_s * compute,
                                     update_s=r.update_s * compute) for r in self.rows)
    return dataclasses.replace(self, rows=rows, forward_s=self.forward_s * compute,
                               backward_s=self.backward_s * compute)

  def with_placement(self, params: Any, shardings: Any, *, mesh: Any = None,
                     gather_dtype: str | None = None) -> GradientProfile:
    """This profile with the placement of `params` (as `from_params`' `shardings`, `mesh`, `gather_dtype`),
    rows matched by path, times kept; ProfileError as `from_params`, or for a row not in `params`.
    """
    flat = flatten_with_layer_paths(params)
    specs = shardings_by_path(params, shardings)
    dims, shape, axes, gathers = _placements(flat, specs, shardings, mesh, gather_dtype)
    paths = {p for p, _, _ in flat}
    missing = [r.path for r in self.rows if r.path not in paths]
    if missing:
      raise ProfileError(f"with_placement: leaf {missing[0]!r} of the profile is not in params (paths like "
                         f"{sorted(paths)[:3]}); pass the params the profile was made from.")
    rows = tuple(dataclasses.replace(r, shard_dim=dims.get(r.path), gather_dtype=gathers.get(r.path))
                 for r in self.rows)
    return dataclasses.replace(self, rows=rows, mesh=shape, shard_axes=axes)

  # -- construction ---------------------------------------------------------------------------------
  @classmethod
  def from_rows(cls, rows: Iterable[Mapping[str, Any] | ProfileRow], **kw) -> GradientProfile:
    """A profile from rows given as ProfileRows or dicts of their fields (the other fields as keywords)."""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
      raise ProfileError(f"GradientProfile.from_rows: rows must be a list of row objects (dicts of "
                         f"ProfileRow's fields), got {type(rows).__name__}.")
    out = []
    for k, r in enumerate(rows):
      if not isinstance(r, (ProfileRow, Mapping)):
        raise ProfileError(f"profile row {k} is {r!r} ({type(r).__name__}); a row is an object of "
                           f"ProfileRow's fields (path, layer, shape, dtype, nbytes, ready_s, ...).")
      out.append(r if isinstance(r, ProfileRow) else ProfileRow(**_row_kwargs(r)))
    return cls(rows=tuple(out), **kw)

  @classmethod
  def from_params(cls, params: Any, *, forward_s: float = 0.0, backward_s: float = 0.0,
                  update_s_per_byte: float = 0.0, layer_depth: int | None = None, model: str = "",
                  device: str = "", shardings: Any = None, mesh: Any = None, gather_dtype: str | None = None,
                  stacked: Sequence[str] = (), order: Sequence[str] | None = None) -> GradientProfile:
    """A profile from a parameter pytree: exact paths, shapes and sizes; times spread over layers by bytes.

    Args:
      params: a pytree of arrays (or anything with .shape and .dtype), flatten order as forward order
        unless `order` says otherwise.
      forward_s, backward_s: step times to spread, seconds.
      update_s_per_byte: optimizer seconds per gradient byte.
      layer_depth: key-path components naming a layer (>= 1; default: all but the last).
      model, device: recorded in the profile.
      shardings, mesh: the placement, PartitionSpec-like per leaf, and the mesh shape (docs/fsdp.md).
      gather_dtype: the dtype every sharded leaf is all-gathered in (a bf16 model over f32 shards:
        'bfloat16'); None: its own.
      stacked: prefixes of scanned stacks (leaves whose leading axis is the layer): planned per layer
        (`unstacked`).
      order: forward order: leaf paths or path prefixes, whose leaves come first, in this order.

    Raises:
      ValueError, TypeError: a bad time or `layer_depth`; shardings not shaped like params.
      ProfileError: no floating leaves; a placement a profile cannot hold (the leaf named).
    """
    for name, value in (("forward_s", forward_s), ("backward_s", backward_s),
                        ("update_s_per_byte", update_s_per_byte)):
      if not is_finite_nonneg(value):
        raise ValueError(f"GradientProfile.from_params({name}={value!r}): `{name}` must be a finite number "
                         f">= 0 ({'seconds per gradient byte' if name == 'update_s_per_byte' else 'seconds'}"
                         f").")
    check_layer_depth("GradientProfile.from_params", layer_depth)
    for name, value in (("model", model), ("device", device)):
      if not isinstance(value, str):
        raise TypeError(f"GradientProfile.from_params({name}={value!r}): `{name}` must be a string.")
    forward_s, backward_s, update_s_per_byte = float(forward_s), float(backward_s), float(update_s_per_byte)
    flat = flatten_with_layer_paths(params)
    specs = [None] * len(flat) if shardings is None else shardings_by_path(params, shardings)
    if order is not None:
      flat, specs = in_order(flat, specs, order)
    leaves = [(path, layer_of(layer_path, layer_depth), tuple(leaf.shape), dtype_name(leaf.dtype))
              for path, layer_path, leaf in flat if is_reduced_leaf(leaf)]
    if not leaves:
      raise ProfileError("from_params: the tree has no floating-point leaves to reduce.")
    place = _placements(flat, specs, shardings, mesh, gather_dtype)
    nbytes = [int(np.prod(s, dtype=np.int64)) * itemsize(d) for _, _, s, d in leaves]
    layer_bytes: dict[str, int] = {}
    for (_, layer, _, _), b in zip(leaves, nbytes):
      layer_bytes[layer] = layer_bytes.get(layer, 0) + b
    ready_of, fwd_of = spread_by_bytes(layer_bytes, forward_s, backward_s)
    rows, seen = [], set()
    for (path, layer, shape, dtype), b in zip(leaves, nbytes):
      fwd = fwd_of[layer] if layer not in seen else 0.0
      seen.add(layer)
      rows.append(ProfileRow(path=path, layer=layer, shape=shape, dtype=dtype, nbytes=b,
                             ready_s=ready_of[layer], fwd_s=fwd, update_s=update_s_per_byte * b,
                             shard_dim=place[0].get(path), gather_dtype=place[3].get(path)))
    fsum = sum(r.fwd_s for r in rows)
    prof = cls(rows=tuple(rows), forward_s=fsum if fsum > 0 else forward_s, backward_s=backward_s,
               method="estimated", model=model, device=device,
               notes="from_params: sizes exact; times spread over layers by bytes", mesh=place[1],
               shard_axes=place[2])
    return prof.unstacked(stacked) if stacked else prof

  def unstacked(self, stacked: Sequence[str]) -> GradientProfile:
    """This profile with each scanned stack under a `stacked` prefix planned per layer (`_stacks.unstack_rows`:
    rows `<prefix>/<k>/<rest>` of layer `<prefix>/<k>`), the prefixes added to `stacks`; ProfileError for a
    prefix naming no row, a stack's leaves of different lengths, or one split on its layer axis."""
    stacked = (stacked,) if isinstance(stacked, str) else tuple(str(x).rstrip("/") for x in stacked)
    return dataclasses.replace(self, rows=unstack_rows(self.rows, stacked),
                               stacks=self.stacks + tuple(x for x in stacked if x not in self.stacks))

  # -- JSON -----------------------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    # placement and stack keys only when present: a profile without them is written as before
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"
         and (self.mesh or f.name not in ("mesh", "shard_axes")) and (self.stacks or f.name != "stacks")}
    if self.mesh:
      d.update(mesh=dict(self.mesh), shard_axes=list(self.shard_axes))
    if self.stacks:
      d["stacks"] = list(self.stacks)
    d["rows"] = [_row_dict(r) for r in self.rows]
    return d

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> GradientProfile:
    obj = cls._json_fields(text_or_obj)
    if not isinstance(obj.get("rows"), list):
      raise ProfileError("GradientProfile.from_json: field 'rows' must be a list of row objects.")
    try:
      return cls.from_rows(obj.pop("rows"), **obj)
    except TypeError as e:
      raise ProfileError(f"GradientProfile.from_json: {e}") from e


def spread_by_bytes(layer_bytes: Mapping[str, int], forward_s: float, backward_s: float
                    ) -> tuple[dict[str, float], dict[str, float]]:
  """Per layer (given in forward order with its bytes), its ready time and its forward time when the step's
  times are spread over the layers by bytes, backward running from the last layer to the first."""
  total = max(sum(layer_bytes.values()), 1)
  ready, t = {}, 0.0
  for layer in reversed(list(layer_bytes)):
    t += backward_s * layer_bytes[layer] / total
    ready[layer] = min(t, backward_s)
  return ready, {layer: forward_s * b / total for layer, b in layer_bytes.items()}


def _row_dict(r: ProfileRow) -> dict[str, Any]:
  d = dataclasses.asdict(r) | {"shape": list(r.shape)}
  for name in ("shard_dim", "gather_dtype"):       # written only when set: older files stay as they were
    if d[name] is None:
      del d[name]
  return d


def _placements(flat: Sequence[tuple[str, str, Any]], specs: Sequence[Any], shardings: Any, mesh: Any,
                gather_dtype: str | None = None
                ) -> tuple[dict[str, int], tuple[tuple[str, int], ...], tuple[str, ...], dict[str, str]]:
  """({path: shard_dim} of the sharded leaves, mesh shape, shard axes, {path: gather dtype}) of
  `from_params`' shardings."""
  given = check_mesh("GradientProfile.from_params", mesh)  # a shape to plan for: () when none is given
  if gather_dtype is not None:
    _row_dtype("gather_dtype", gather_dtype)
  if shardings is None:
    return {}, given, (), {}
  shape = given or next((m for m in map(mesh_of, specs) if m is not None), None)
  if shape is None:
    raise ProfileError("GradientProfile.from_params(shardings=...): the mesh shape is unknown; pass "
                       "mesh={'data': 8} (axis name -> size, or the jax Mesh) with PartitionSpec-like specs.")
  dims: dict[str, int] = {}
  axes: tuple[str, ...] | None = None
  first = ""
  for (path, _, leaf), spec in zip(flat, specs):
    if not is_reduced_leaf(leaf):
      continue
    dim, ax = leaf_placement(path, tuple(leaf.shape), spec, shape)
    if dim is None:
      continue
    if axes is not None and ax != axes:
      raise ProfileError(f"leaf {path!r} is split over {ax}, but leaf {first!r} over {axes}; every sharded "
                         f"leaf of one profile is split over the same data axes.")
    axes, first = ax, first or path
    dims[path] = dim
  gathers = {p: gather_dtype for p, _, leaf in flat
             if p in dims and gather_dtype is not None and gather_dtype != dtype_name(leaf.dtype)}
  return dims, shape, axes or (), gathers


def _row_kwargs(r: Mapping[str, Any]) -> dict[str, Any]:
  unknown = sorted(set(r) - {f.name for f in dataclasses.fields(ProfileRow)})
  if unknown:
    raise ProfileError(f"profile row {r.get('path', '?')!r}: unknown field(s) {unknown}.")
  missing = sorted({"path", "layer", "shape", "dtype", "nbytes", "ready_s"} - set(r))
  if missing:
    raise ProfileError(f"profile row {r.get('path', '?')!r}: missing field(s) {missing}.")
  return dict(r)
