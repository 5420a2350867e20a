"""The tree/row contract: a leaf's path, which leaves are rows, a leaf's layer, a tree's fingerprint
(jax imported lazily; docs/design.md, "Trees and rows").
"""

from __future__ import annotations

import re

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

Row = tuple[str, tuple[int, ...], str]   # (path, shape, dtype) of one reduced leaf


# --------------------------------------------------------------------------------------------------
# Paths


def path_str(keypath: Any) -> str:
  """'params/Conv_0/kernel' for a jax key path (a string passes through unchanged)."""
  if isinstance(keypath, str):
    return keypath
  import jax  # lazy: the planner reads trees without jax

  return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")


def flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """[(path, leaf)] in jax's flatten order (a pure walk of dicts, lists and tuples without jax)."""
  try:
    import jax  # lazy: the planner reads trees without jax
  except ImportError:  # the pure walk: dicts (sorted keys), lists and tuples, as jax flattens them
    return [(path, leaf) for path, leaf, _ in _walk(tree)]
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in leaves]


def shardings_by_path(params: Any, shardings: Any) -> list[Any]:
  """The node of `shardings` at each leaf of `params`, in flatten order; ValueError when the structures
  differ.
  """
  try:
    import jax  # optional: jax's own structure check where it is installed (this module is pure)
  except ImportError:  # the pure walk, in the same order as flatten_with_paths'
    return [spec for _, _, spec in _walk(params, shardings, check=True)]
  treedef = jax.tree_util.tree_structure(params)
  try:
    return list(treedef.flatten_up_to(shardings))
  except (TypeError, ValueError) as e:
    raise ValueError(f"shardings do not match the structure of params: {e}") from None


def _walk(tree: Any, spec: Any = None, *, check: bool = False) -> list[tuple[str, Any, Any]]:
  """[(path, leaf, the node of `spec` there)] of dicts (sorted keys), lists and tuples, as jax flattens
  them; with `check`, ValueError where `spec` is not shaped like `tree`."""
  out: list[tuple[str, Any, Any]] = []

  def walk(prefix: str, node: Any, sp: Any) -> None:
    if isinstance(node, dict):
      if check and (not isinstance(sp, dict) or set(sp) != set(node)):
        raise ValueError(f"shardings do not match params at {prefix or 'the root'!r}: expected keys "
                         f"{sorted(node)}, got {sp!r}.")
      keys: Any = sorted(node)
    elif isinstance(node, (list, tuple)):
      if check and (not isinstance(sp, (list, tuple)) or len(sp) != len(node)):
        raise ValueError(f"shardings do not match params at {prefix or 'the root'!r}: expected "
                         f"{len(node)} entries, got {sp!r}.")
      keys = range(len(node))
    else:
      if node is not None:
        out.append((prefix, node, sp))
      return
    for k in keys:
      walk(f"{prefix}/{k}" if prefix else str(k), node[k], sp[k] if check else None)

  walk("", tree, spec)
  return out


# --------------------------------------------------------------------------------------------------
# Leaves that are rows


def row_slots(rows: Sequence[tuple[str, Sequence[int], str]], paths: Sequence[str], ranks: Sequence[int]
              ) -> list[tuple[int, int | None] | None]:
  """Per schedule row, the parameter leaf it plans: (leaf index, None), or (leaf index, k) for layer k
  of a scanned stack (a leaf whose leading axis is the layer, planned per layer as
  '<prefix>/<k>/<rest>'); None where no leaf matches. `ranks` are the leaves' numbers of dimensions."""
  index = {p: i for i, p in enumerate(paths)}
  index.update({p.removesuffix("/value"): i for i, p in enumerate(paths)})   # nnx Variables' arrays
  out: list[tuple[int, int | None] | None] = []
  for path, shape, _ in rows:
    slot = (index[path], None) if path in index else None
    for m in re.finditer(r"(?:^|/)(\d+)(?=/)", path) if slot is None else ():
      whole = (path[:m.start()] + path[m.end():]).strip("/")
      if whole in index and ranks[index[whole]] == len(shape) + 1:
        slot = (index[whole], int(m.group(1)))
    out.append(slot)
  return out


def dtype_name(dtype: Any) -> str:
  """The name a row records for a dtype ('float32', 'bfloat16', ...; an extended dtype by its own name)."""
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


def is_float_dtype(dtype: Any) -> bool:
  """True for the dtypes the rewrite reduces: `jnp.issubdtype(dtype, jnp.inexact)` without jax (numpy's
  float and complex kinds, bfloat16, float8/6/4_*).
  """
  if isinstance(dtype, str) and (dtype == "bfloat16" or dtype.startswith(("float8_", "float6_", "float4_"))):
    return True   # the ml_dtypes floats by name (numpy knows them only once ml_dtypes is imported)
  try:
    dt = np.dtype(dtype)
  except TypeError:  # an extended dtype (a typed PRNG key's): not a number
    return False
  return dt.kind in "fc" or dt.kind == "V" and (dt.name == "bfloat16" or dt.name.startswith(("float8_", "float6_",
                                                                                             "float4_")))


def is_reduced_leaf(leaf: Any) -> bool:
  """True for leaves that are rows: arrays (or ShapeDtypeStructs) of a floating dtype."""
  dt = getattr(leaf, "dtype", None)
  return dt is not None and is_float_dtype(dt)


def flatten_with_layer_paths(tree: Any) -> list[tuple[str, str, Any]]:
  """[(path, layer path, leaf)] in jax's flatten order; the layer path drops a flax.nnx Variable's trailing
  `value` key (`layer_path`).
  """
  try:
    import jax  # lazy: the planner reads trees without jax
  except ImportError:
    return [(p, p, leaf) for p, leaf in flatten_with_paths(tree)]
  return [(path_str(kp), layer_path(kp), leaf) for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def layer_path(keypath: Any) -> str:
  """The path a leaf's layer is read from: its key path without a flax.nnx Variable's trailing `value` key
  (a string path is taken as it is).
  """
  if isinstance(keypath, str):
    return keypath
  kp = tuple(keypath)
  return path_str(kp[:-1] if len(kp) > 1 and is_variable_value(kp[-1]) else kp)


def is_variable_value(key: Any) -> bool:
  """True for a flax.nnx Variable's array key, jax's GetAttrKey('value') (read by name)."""
  return type(key).__name__ == "GetAttrKey" and getattr(key, "name", None) == "value"


def check_layer_depth(where: str, layer_depth: Any) -> int | None:
  """`layer_depth` as None or an integer >= 1; TypeError or ValueError otherwise."""
  if layer_depth is None:
    return None
  if not isinstance(layer_depth, (int, np.integer)) or isinstance(layer_depth, (bool, np.bool_)):
    raise TypeError(f"{where}(layer_depth={layer_depth!r}): `layer_depth` must be an integer >= 1 (the "
                    f"key-path components that name a layer) or None (all but the last).")
  if layer_depth < 1:
    raise ValueError(f"{where}(layer_depth={layer_depth!r}): `layer_depth` must be >= 1 (the key-path "
                     f"components that name a layer, e.g. 2 for 'params/Dense_0'), or None for all but "
                     f"the last component.")
  return int(layer_depth)


def layer_of(path: str, layer_depth: int | None = None) -> str:
  """The layer a leaf belongs to: its first `layer_depth` path components (default: all but the last).

  >>> layer_of("params/Conv_0/kernel")
  'params/Conv_0'
  """
  if not isinstance(path, str) or not path:
    raise ValueError(f"layer_of(path={path!r}): expected a non-empty key path such as "
                     f"'params/Conv_0/kernel'.")
  layer_depth = check_layer_depth("layer_of", layer_depth)
  parts = path.split("/")
  return "/".join(parts[:layer_depth] if layer_depth else parts[:-1]) or parts[0]


# --------------------------------------------------------------------------------------------------
# Rows: their fingerprint and what the checks of a Schedule read from them


def tree_fingerprint(rows: Sequence[tuple[str, Sequence[int], str]]) -> str:
  """A short hash of (path, shape, dtype) of every row, in order (`Schedule.tree_fingerprint`)."""
  h = hashlib.sha256()
  for path, shape, dtype in rows:
    h.update(f"{path}|{','.join(str(int(d)) for d in shape)}|{dtype};".encode())
  return h.hexdigest()[:16]


class RowsInfo(NamedTuple):
  """What the checks of a Schedule need from its rows, computed once per row tuple (`rows_info`)."""

  rows: tuple[Row, ...]          # normalized: (str, tuple of int, str)
  fingerprint: str
  sizes: np.ndarray              # elements per row, int64
  dtype_code: np.ndarray         # per row, index into `dtypes`
  dtypes: dict[str, int]


class IdentityMemo:
  """The library's one memo policy: a small FIFO table of values derived from frozen values, keyed by the
  identities of those values (docs/design.md, "Trees and rows").
  """

  __slots__ = ("_table", "_size")

  def __init__(self, size: int):
    self._table: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}
    self._size = size

  def get(self, *keys: Any) -> Any:
    """The value stored for exactly these objects, or None."""
    hit = self._table.get(tuple(map(id, keys)))
    return hit[1] if hit is not None and all(a is b for a, b in zip(hit[0], keys)) else None

  def put(self, keys: tuple[Any, ...], value: Any) -> Any:
    """Stores `value` for the objects `keys` (evicting the oldest entry when full); returns it."""
    if len(self._table) >= self._size:
      self._table.pop(next(iter(self._table)))
    self._table[tuple(map(id, keys))] = (keys, value)
    return value

  def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` memoized by the identities of its positional arguments."""
    def memoized(*args: Any) -> Any:
      hit = self.get(*args)
      return hit if hit is not None else self.put(args, fn(*args))
    memoized.__doc__, memoized.__name__, memoized.__wrapped__ = fn.__doc__, fn.__name__, fn
    return memoized


# A schedule's rows are shared by every schedule planned from one profile and by every copy
# (`dataclasses.replace`), so they are normalized and fingerprinted once per tuple, not per Schedule.
_ROWS = IdentityMemo(64)


def _norm_row(k: int, row: Any) -> Row:
  """Row k as (path, shape of ints, dtype name), or a ValueError naming the row and the value."""
  try:
    p, shape, t = row
  except (TypeError, ValueError):
    raise ValueError(f"row {k} is {row!r}; a row is [path, shape, dtype].") from None
  if not isinstance(p, str) or not p:
    raise ValueError(f"row {k} has path {p!r}; a path is a non-empty string.")
  if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
    raise ValueError(f"row {k} ({p!r}) has shape {shape!r}; a shape is a list of integers.")
  dims = list(shape)
  if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 0
             for d in dims):
    raise ValueError(f"row {k} ({p!r}) has shape {shape!r}; every dimension must be an integer >= 0.")
  if not isinstance(t, str) or not is_float_dtype(t):
    raise ValueError(f"row {k} ({p!r}) has dtype {t!r}; rows are floating leaves (e.g. 'float32', "
                     f"'bfloat16').")
  return p, tuple(int(d) for d in dims), t


def rows_info(rows: Sequence[tuple[str, Sequence[int], str]]) -> RowsInfo:
  """The normalized rows, their fingerprint, sizes and dtype codes, memoized per row tuple; ValueError
  naming a malformed row.
  """
  hit = _ROWS.get(rows)
  if hit is not None:
    return hit
  norm = tuple(_norm_row(k, row) for k, row in enumerate(rows))
  dtypes = {d: i for i, d in enumerate(dict.fromkeys(t for _, _, t in norm))}
  info = RowsInfo(rows=norm, fingerprint=tree_fingerprint(norm),
                  sizes=np.fromiter((math.prod(s) for _, s, _ in norm), dtype=np.int64, count=len(norm)),
                  dtype_code=np.fromiter((dtypes[t] for _, _, t in norm), dtype=np.int64, count=len(norm)),
                  dtypes=dtypes)
  return _ROWS.put((norm,), info)
