"""The tree/row contract: how a parameter pytree becomes profile rows, and whether a schedule fits it.

One place for every rule that ties a pytree to the rows of a GradientProfile or a Schedule:

- `path_str`, `flatten_with_paths`: a leaf's canonical path ('params/Conv_0/kernel'), in jax's
  flatten order (rows map to leaves by path, never by position);
- `is_reduced_leaf`, `dtype_name`: which leaves are rows (floating dtypes, bfloat16 and the float8
  kinds included; integer and float0 leaves pass through unreduced), and how a dtype is named;
- `layer_of`: the layer a leaf belongs to (every path component but the last, or the first
  `layer_depth` of them);
- `forward_paths`: the order in which a loss function first reads each parameter (the rows' priority
  order);
- `match_rows` (a schedule against a profile's or a process's rows) and `match_tree` (a schedule
  against a pytree, giving the row -> leaf map): errors that name the row, path, shape or dtype that
  differs and some of the tree's own paths.

Pure where it can be: jax is imported only by `path_str`, `forward_paths` and, when jax is installed,
`flatten_with_paths` (plain dicts, lists and tuples flatten the same way without it, dict keys sorted),
so the planner reads trees on a machine without jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._errors import ScheduleMismatchError

__all__ = ["path_str", "flatten_with_paths", "dtype_name", "is_float_dtype", "is_reduced_leaf",
           "layer_of", "forward_paths", "tree_fingerprint", "RowsInfo", "rows_info", "LeafMap", "match_tree",
           "match_rows"]

Row = tuple[str, tuple[int, ...], str]   # (path, shape, dtype) of one reduced leaf

_REPLAN = "The model changed after planning; run prophet_jax.plan() again on the current params."


# --------------------------------------------------------------------------------------------------
# Paths


def path_str(keypath: Any) -> str:
  """'params/Conv_0/kernel' for a jax key path (a string passes through unchanged)."""
  if isinstance(keypath, str):
    return keypath
  import jax

  return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")


def flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """[(path, leaf)] in jax's flatten order (a pure walk of dicts, lists and tuples without jax)."""
  try:
    import jax
  except ImportError:  # the pure walk: dicts (sorted keys), lists and tuples, as jax flattens them
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
      if isinstance(node, dict):
        for k in sorted(node):
          walk(f"{prefix}/{k}" if prefix else str(k), node[k])
      elif isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
          walk(f"{prefix}/{i}" if prefix else str(i), x)
      elif node is not None:
        out.append((prefix, node))

    walk("", tree)
    return out
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in leaves]


# --------------------------------------------------------------------------------------------------
# Leaves that are rows


def dtype_name(dtype: Any) -> str:
  """The name a row records for a dtype: 'float32', 'bfloat16', 'float8_e4m3fn', ... ('void' for
  jax's float0; an extended dtype such as a typed PRNG key's, which numpy does not know, by its own
  name: 'key<fry>')."""
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


def is_float_dtype(dtype: Any) -> bool:
  """True for the dtypes the rewrite reduces: numpy's inexact kinds (float, complex) and the ml_dtypes
  floats (bfloat16, float8_*, float6_*, float4_*), exactly `jnp.issubdtype(dtype, jnp.inexact)`
  without importing jax. False for integers, bools, int4, float0 and jax's extended dtypes (typed PRNG
  keys)."""
  try:
    dt = np.dtype(dtype)
  except TypeError:  # an extended dtype (a typed PRNG key's): not a number
    return False
  if dt.kind in "fc":
    return True
  return dt.kind == "V" and (dt.name == "bfloat16" or dt.name.startswith(("float8_", "float6_",
                                                                          "float4_")))


def is_reduced_leaf(leaf: Any) -> bool:
  """True for leaves that are profile rows and get all-reduced: arrays (or ShapeDtypeStructs) of a
  floating dtype (`is_float_dtype`). Integer and float0 leaves pass through; zero-size leaves are
  rows with nbytes = 0."""
  dt = getattr(leaf, "dtype", None)
  return dt is not None and is_float_dtype(dt)


def layer_of(path: str, layer_depth: int | None = None) -> str:
  """The layer a leaf belongs to: the first `layer_depth` path components (default: all but the
  last); a one-component path is its own layer.

  `'params/Conv_0/kernel'` -> `'params/Conv_0'`. The rule of `GradientProfile.from_params`,
  `profile_step`, `prophet_jax.models.layer_of` and the bundled traces.

  Raises:
    ValueError: `path` is empty or not a string.
  """
  if not isinstance(path, str) or not path:
    raise ValueError(f"layer_of(path={path!r}): expected a non-empty key path such as "
                     f"'params/Conv_0/kernel'.")
  parts = path.split("/")
  return "/".join(parts[:layer_depth] if layer_depth else parts[:-1]) or parts[0]


# --------------------------------------------------------------------------------------------------
# Forward order

# jaxpr params holding a sub-jaxpr whose invars and outvars map one-to-one onto the equation's
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# primitives that only re-label a value (its k-th output is its k-th input, re-typed or re-shaped):
# not a use; the use is wherever the result is read
_ALIAS_PRIMITIVES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                               "broadcast_in_dim", "transpose", "copy", "copy_p", "pvary", "pcast",
                               "optimization_barrier", "device_put"})


def forward_paths(fn: Callable[..., Any], params: Any, *args: Any) -> tuple[str, ...]:
  """Leaf paths of `params` in FORWARD order: the order in which `fn(params, *args)` first uses them.

  The order comes from the jaxpr of `fn`: the first equation that reads each parameter, descending
  into `jit` / `scan` / custom-derivative sub-jaxprs, and following values through re-labelling
  primitives (casts, reshapes, transposes, identity `custom_vjp` hooks), so a hook or a cast applied
  to every parameter up front does not count as a use. It does not come from the pytree: flax stores
  submodules in dicts whose sorted keys put `Dense_10` before `Dense_2`. A tied embedding is placed
  where the forward pass first reads it (the input lookup, so row 0). Leaves `fn` never reads come
  last, in flatten order.

  Args:
    fn: e.g. a loss function; traced abstractly (nothing runs), so `args` may be ShapeDtypeStructs.
    params: the parameter pytree (arrays or ShapeDtypeStructs).
    *args: the other arguments of `fn` (e.g. a batch).

  Returns:
    Every leaf path of `params`, each once.
  """
  import jax
  from jax.extend.core import Literal

  from ._jaxcompat import check_jaxpr_api

  check_jaxpr_api("forward_paths")
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_str(p) for p, _ in leaves_with_paths]
  leaves = [x for _, x in leaves_with_paths]

  def flat_fn(flat, *rest):
    return fn(jax.tree_util.tree_unflatten(treedef, flat), *rest)

  jaxpr = jax.make_jaxpr(flat_fn)(leaves, *args).jaxpr
  order: list[int] = []
  seen: set[int] = set()

  def walk(jx: Any, mapping: dict[int, int]) -> None:
    """mapping: id(var) -> leaf index; grows with the outputs that carry a leaf unchanged."""
    for eqn in jx.eqns:
      ins = [(k, mapping[id(v)]) for k, v in enumerate(eqn.invars)
             if not isinstance(v, Literal) and id(v) in mapping]
      if not ins:
        continue
      sub = None
      for name in _CALL_PARAMS:
        cand = eqn.params.get(name)
        cand = getattr(cand, "jaxpr", cand)  # ClosedJaxpr -> Jaxpr (jax >= 0.11: the same object)
        if (cand is not None and hasattr(cand, "eqns") and len(cand.invars) == len(eqn.invars)
            and len(cand.outvars) == len(eqn.outvars)):
          sub = cand
          break
      if sub is not None:
        inner = {id(sub.invars[k]): i for k, i in ins}
        walk(sub, inner)
        for ov, iv in zip(eqn.outvars, sub.outvars):  # passed through unchanged: alias, not a use
          if not isinstance(iv, Literal) and id(iv) in inner:
            mapping[id(ov)] = inner[id(iv)]
      elif eqn.primitive.name in _ALIAS_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
        for k, i in ins:
          mapping[id(eqn.outvars[k])] = i
      else:
        for _, i in ins:
          if i not in seen:
            seen.add(i)
            order.append(i)

  walk(jaxpr, {id(v): i for i, v in enumerate(jaxpr.invars[:len(leaves)])})
  order += [i for i in range(len(leaves)) if i not in seen]
  return tuple(paths[i] for i in order)


# --------------------------------------------------------------------------------------------------
# Does this schedule fit this tree?


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


# An identity memo (rows are frozen tuples; an entry holds its tuple, so an id is never reused while
# cached): a schedule's rows are shared by every schedule planned from one profile and by every copy
# (`dataclasses.replace`), so they are normalized and fingerprinted once per tuple, not per Schedule.
_ROWS: dict[int, tuple[Any, RowsInfo]] = {}
_MEMO_SIZE = 64


def remember(table: dict[int, tuple[Any, Any]], key: Any, value: Any, size: int = _MEMO_SIZE) -> None:
  """Stores `value` under `key`'s identity in a small first-in-first-out identity memo."""
  if len(table) >= size:
    table.pop(next(iter(table)))
  table[id(key)] = (key, value)


def rows_info(rows: Sequence[tuple[str, Sequence[int], str]]) -> RowsInfo:
  """The normalized rows (path str, shape of ints, dtype str), their fingerprint, element counts and
  dtype codes; memoized by the identity of the normalized tuple."""
  hit = _ROWS.get(id(rows))
  if hit is not None and hit[0] is rows:
    return hit[1]
  norm = tuple((str(p), tuple(int(d) for d in s), str(t)) for p, s, t in rows)
  dtypes = {d: i for i, d in enumerate(dict.fromkeys(t for _, _, t in norm))}
  info = RowsInfo(rows=norm, fingerprint=tree_fingerprint(norm),
                  sizes=np.fromiter((math.prod(s) for _, s, _ in norm), dtype=np.int64, count=len(norm)),
                  dtype_code=np.fromiter((dtypes[t] for _, _, t in norm), dtype=np.int64, count=len(norm)),
                  dtypes=dtypes)
  remember(_ROWS, norm, info)
  return info


@dataclasses.dataclass(frozen=True)
class LeafMap:
  """Where each schedule row lives in a flattened tree.

  Attributes:
    paths: canonical path of every leaf in flatten order.
    row_leaf: for each schedule row, the index of its leaf in flatten order.
  """

  paths: tuple[str, ...]
  row_leaf: tuple[int, ...]


def _schedule_rows(schedule: Any, where: str) -> tuple[Row, ...]:
  from ._types import check_values

  check_values(where, schedule=schedule)
  return schedule.rows


def _some(paths: Sequence[str], k: int = 3) -> str:
  return f"{list(paths[:k])}" + (f" and {len(paths) - k} more" if len(paths) > k else "")


_VARIABLE_VALUE = "value"  # the attribute under which a flax.nnx Variable holds its array


def _is_variable_value_key(key: Any) -> bool:
  """True for the last key path entry of an nnx Variable's array: jax's GetAttrKey('value') (read by
  name, so this module needs no jax)."""
  return type(key).__name__ == "GetAttrKey" and getattr(key, "name", None) == _VARIABLE_VALUE


def match_tree(leaves_with_path: Sequence[tuple[Any, Any]], schedule: Any, *, where: str = "allreduce",
               skip_prefixes: Sequence[str] = ()) -> LeafMap:
  """Maps schedule rows to a tree's leaves BY PATH, checking shape and dtype (plain Python).

  A flax.nnx Variable is a pytree node whose array sits under the key `.value`: the same parameter is
  'l1/kernel/value' in `nnx.state(model, nnx.Param)` and 'l1/kernel' in the pure arrays that
  `nnx.Optimizer.update` (through `nnx.as_pure`) and `nnx.to_pure_dict` give. A row matches its leaf
  under either spelling, exact paths first, so a schedule planned from either form works with both
  (`nnx.Optimizer`'s init sees Variables, its update pure arrays); two rows naming one leaf are an
  error. (With string paths, a Variable's key cannot be told from a dict key 'value': there only a
  plain 'x' answers to 'x/value'.)

  Args:
    leaves_with_path: `jax.tree_util.tree_flatten_with_path(tree)[0]`, or `flatten_with_paths(tree)`
      (paths as key paths or as strings).
    schedule: the Schedule whose rows must be exactly the tree's floating leaves.
    where: the caller's name, for messages.
    skip_prefixes: leaf paths equal to, or under, one of these are not the schedule's business
      (reduced elsewhere, e.g. inside a scanned body by `loop_hook`).

  Returns:
    The LeafMap (every leaf's path in flatten order, and each row's leaf index).

  Raises:
    TypeError: `schedule` is not a Schedule.
    ValueError: the tree is empty.
    ScheduleMismatchError: a row's path is missing from the tree (naming near misses), a shape or dtype
      differs, two rows name one leaf, or the tree has a floating leaf the schedule lacks; every message
      lists some of the tree's own paths ("the tree has paths like [...]").
  """
  rows = _schedule_rows(schedule, where)
  if not leaves_with_path:
    raise ValueError(f"{where}: the gradient tree is empty; there is nothing to reduce. Pass the "
                     f"gradients of the params the schedule was planned for.")
  paths = tuple(path_str(p) for p, _ in leaves_with_path)
  leaves = [leaf for _, leaf in leaves_with_path]
  index = {p: i for i, p in enumerate(paths)}
  # nnx spellings: a Variable's 'x/value' also answers to 'x'; a plain 'x' also answers to 'x/value'
  alias: dict[str, int] = {}
  for i, (kp, _) in enumerate(leaves_with_path):
    if not isinstance(kp, str) and kp and _is_variable_value_key(kp[-1]):
      alias.setdefault(path_str(kp[:-1]), i)
    else:
      alias.setdefault(f"{paths[i]}/{_VARIABLE_VALUE}", i)
  floats = [p for p, x in zip(paths, leaves) if is_reduced_leaf(x)] or list(paths)
  like = f"the tree has paths like {_some(floats, 4)}"
  covers = f"the schedule covers {len(rows)} leaves, like {_some([r[0] for r in rows], 4)}"
  row_leaf = []
  for path, shape, dtype in rows:
    i = index.get(path)
    if i is None:
      i = alias.get(path)
    if i is None:
      near = [p for p in paths if p.split("/")[-1] == path.split("/")[-1]]
      hint = f"e.g. {_some(near)} end the same way; {like}" if near else like
      raise ScheduleMismatchError(
          f"{where}: the schedule has a row for leaf {path!r}, but the tree has no leaf at that path "
          f"({hint}); {covers}. {_REPLAN}")
    leaf = leaves[i]
    got_shape = tuple(int(d) for d in np.shape(leaf))
    if got_shape != tuple(shape):
      raise ScheduleMismatchError(
          f"{where}: leaf {paths[i]!r} has shape {got_shape}, but the schedule was planned for shape "
          f"{tuple(shape)} {dtype} ({like}). {_REPLAN}")
    got_dtype = dtype_name(getattr(leaf, "dtype", None))
    if got_dtype != dtype:
      raise ScheduleMismatchError(
          f"{where}: leaf {paths[i]!r} has dtype {got_dtype}, but the schedule was planned for dtype "
          f"{dtype} ({like}). {_REPLAN} (Plan with the gradients' dtype, e.g. bfloat16 params give "
          f"bfloat16 gradients.)")
    row_leaf.append(i)
  if len(set(row_leaf)) != len(row_leaf):
    dup = next(i for i in row_leaf if row_leaf.count(i) > 1)
    named = [rows[k][0] for k, i in enumerate(row_leaf) if i == dup]
    raise ScheduleMismatchError(
        f"{where}: schedule rows {named} all name the tree's leaf {paths[dup]!r} (an nnx Variable's "
        f"'x/value' and a plain 'x' are the same leaf); {like}. {_REPLAN}")
  rowset = set(row_leaf)
  prefixes = tuple(s.rstrip("/") + "/" for s in skip_prefixes)
  extra = [i for i, leaf in enumerate(leaves)
           if i not in rowset and is_reduced_leaf(leaf)
           and not (paths[i] in skip_prefixes or paths[i].startswith(prefixes))]
  if extra:
    i = extra[0]
    raise ScheduleMismatchError(
        f"{where}: the tree has floating leaf {paths[i]!r} (shape {tuple(np.shape(leaves[i]))}, dtype "
        f"{dtype_name(leaves[i].dtype)}) that the schedule does not cover"
        f"{f' (nor {len(extra) - 1} more)' if len(extra) > 1 else ''}; {covers}, and the tree has "
        f"{sum(map(is_reduced_leaf, leaves))} floating ones ({like}). {_REPLAN}")
  return LeafMap(paths=paths, row_leaf=tuple(row_leaf))


def match_rows(schedule: Any, rows: Sequence[Row], *, where: str, theirs: str = "the profile") -> None:
  """Checks that a schedule was planned for exactly these rows (same paths, shapes, dtypes, order).

  The rows are a GradientProfile's (`profile.tree_rows()`), or a process's. Equal tree fingerprints
  short-circuit the comparison.

  Args:
    schedule: the Schedule.
    rows: the (path, shape, dtype) rows it must have.
    where: the caller's name, for messages.
    theirs: what `rows` are, for messages ('the profile', "this process's profile").

  Raises:
    TypeError: `schedule` is not a Schedule.
    ScheduleMismatchError: naming the row count, or the first row that differs on both sides, and
      the two tree fingerprints.
  """
  mine = _schedule_rows(schedule, where)
  rows = tuple(rows)
  if mine == rows:
    return
  fps = (f"(tree fingerprints: the Schedule's {schedule.tree_fingerprint!r}, {theirs}'s "
         f"{tree_fingerprint(rows)!r})")
  fix = f"Run prophet_jax.plan() again on {theirs}."
  if len(mine) != len(rows):
    raise ScheduleMismatchError(
        f"{where}: this Schedule was planned for a tree with {len(mine)} leaves, but {theirs} has "
        f"{len(rows)} {fps}. {fix}")
  k, got, want = next((k, a, b) for k, (a, b) in enumerate(zip(mine, rows)) if a != b)
  raise ScheduleMismatchError(
      f"{where}: row {k} of the Schedule is {got[0]!r} {got[1]} {got[2]}, but {theirs}'s is "
      f"{want[0]!r} {want[1]} {want[2]} {fps}. {fix}")
