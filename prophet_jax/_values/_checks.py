"""The argument checks of every entry point: scalar options, argument kinds, and whether a schedule fits
a tree or a profile (pure numpy; docs/design.md, "Trees and rows").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import ScheduleMismatchError
from ._network import NetworkModel
from ._schedule import Schedule
from ._tree import Row, dtype_name, is_reduced_leaf, is_variable_value, path_str, tree_fingerprint
from ._types import GradientProfile, is_bool, is_int, is_number


# --------------------------------------------------------------------------------------------------
# Scalar options


def _fix(fix: str) -> str:
  return f" {fix}" if fix else ""


def _bounds(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
  if lo is not None and hi is not None:
    return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
  if lo is not None:
    return f" {'>' if lo_open else '>='} {lo:g}"
  if hi is not None:
    return f" {'<' if hi_open else '<='} {hi:g}"
  return ""


def _inside(v: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
  return ((lo is None or (v > lo if lo_open else v >= lo))
          and (hi is None or (v < hi if hi_open else v <= hi)))


def check_bool(call: str, name: str, value: Any, *, fix: str = "") -> bool:
  """`value` as a bool; TypeError unless it is True or False (a numpy bool counts)."""
  if not is_bool(value):
    raise TypeError(f"{call}({name}={value!r}): `{name}` must be True or False.{_fix(fix)}")
  return bool(value)


def check_int(call: str, name: str, value: Any, *, lo: int | None = None, hi: int | None = None,
              none: bool = False, fix: str = "") -> int | None:
  """`value` as an int in [lo, hi] (None passes when `none`); TypeError or ValueError otherwise."""
  if value is None and none:
    return None
  what = f"`{name}` must be an integer{_bounds(lo, hi, False, False)}{' or None' if none else ''}."
  if not is_int(value):
    raise TypeError(f"{call}({name}={value!r}): {what}{_fix(fix)}")
  if not _inside(value, lo, hi, False, False):
    raise ValueError(f"{call}({name}={value!r}): {what}{_fix(fix)}")
  return int(value)


def check_number(call: str, name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False, none: bool = False,
                 fix: str = "") -> float | None:
  """`value` as a finite float in the range (None passes when `none`); TypeError or ValueError otherwise."""
  if value is None and none:
    return None
  what = (f"`{name}` must be a finite number{_bounds(lo, hi, lo_open, hi_open)}"
          f"{' or None' if none else ''}.")
  if not is_number(value):
    raise TypeError(f"{call}({name}={value!r}): {what}{_fix(fix)}")
  if not math.isfinite(value) or not _inside(value, lo, hi, lo_open, hi_open):
    raise ValueError(f"{call}({name}={value!r}): {what}{_fix(fix)}")
  return float(value)


def check_bytes(call: str, name: str, value: Any, *, allow_none: bool = True, hint: str = "") -> int | None:
  """A positive whole number of bytes (or None when allowed), as int."""
  if value is None and allow_none:
    return None
  if not is_number(value) or (not is_int(value) and not float(value).is_integer()):
    raise TypeError(f"{call}({name}={value!r}): `{name}` must be an integer number of bytes"
                    f"{' or None' if allow_none else ''}.{_fix(hint)}")
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{call}({name}={value!r}): `{name}` must be a positive number of bytes.{_fix(hint)}")
  return int(value)


def check_max_defer(where: str, max_defer: Any) -> float:
  """`max_defer` as a float in [0, 1) (a fraction of the elements); ValueError otherwise."""
  if not is_number(max_defer) or not 0 <= max_defer < 1:
    raise ValueError(f"{where}: max_defer={max_defer!r} must be a fraction of the gradient elements in "
                     f"[0, 1), e.g. 0.1 (0: lossless, every element sent every step).")
  return float(max_defer)


# --------------------------------------------------------------------------------------------------
# The kinds of the arguments

_UNSET: Any = object()

# argument -> (what it must be, how to make one)
_KINDS = {
    "schedule": ("prophet_jax.Schedule",
                 "Make one with prophet_jax.plan(profile, network, policy) or Schedule.from_json."),
    "profile": ("prophet_jax.GradientProfile",
                "Make one with prophet_jax.profile_step(...), GradientProfile.from_params(params) or "
                "GradientProfile.from_json."),
    "network": ("prophet_jax.NetworkModel",
                "Make one with prophet_jax.measure_network(...), NetworkModel.preset(name, workers=...) "
                "or NetworkModel.from_json."),
}


def check_values(where: str, *, loss_fn: Any = _UNSET, tx: Any = _UNSET, schedule: Any = _UNSET,
                 profile: Any = _UNSET, network: Any = _UNSET, cross_step: Any = _UNSET,
                 axis_name: Any = _UNSET) -> None:
  """Raises TypeError naming `where` and the argument when one of those given has the wrong kind: a
  callable `loss_fn`, an optax `tx`, a Schedule, GradientProfile, NetworkModel, a bool `cross_step`, an
  axis name (a non-empty string or tuple of them).
  """
  if loss_fn is not _UNSET and not callable(loss_fn):
    raise TypeError(f"{where}: `loss_fn` must be callable, loss_fn(params, batch) -> loss, got "
                    f"{type(loss_fn).__name__}.")
  if tx is not _UNSET and not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise TypeError(f"{where}: `tx` must be an optax.GradientTransformation (with init and update), got "
                    f"{type(tx).__name__}. Pass e.g. optax.sgd(0.1, momentum=0.9).")
  for name, value, cls in (("schedule", schedule, Schedule), ("profile", profile, GradientProfile),
                           ("network", network, NetworkModel)):
    if value is not _UNSET and not isinstance(value, cls):
      what, fix = _KINDS[name]
      raise TypeError(f"{where}: `{name}` must be a {what}, got {type(value).__name__}. {fix}")
  if cross_step is not _UNSET and not is_bool(cross_step):
    raise TypeError(f"{where}: cross_step={cross_step!r} must be True or False (the step mode); "
                    f"cross_step='auto' is a planning option of policy 'auto' only, through plan().")
  if axis_name is not _UNSET:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) and n for n in names):
      raise TypeError(f"{where}: `axis_name` must be a non-empty string (or a tuple of them) naming the "
                      f"pmap/shard_map axis, got {axis_name!r}.")


# --------------------------------------------------------------------------------------------------
# Does this schedule fit this tree (or these rows)?

_REPLAN = "The model changed after planning; run prophet_jax.plan() again on the current params."


@dataclasses.dataclass(frozen=True)
class LeafMap:
  """Where each schedule row lives in a flattened tree: every leaf's path and each row's leaf index."""

  paths: tuple[str, ...]
  row_leaf: tuple[int, ...]


def _schedule_rows(schedule: Any, where: str) -> tuple[Row, ...]:
  check_values(where, schedule=schedule)
  return schedule.rows


def _some(paths: Sequence[str], k: int = 3) -> str:
  return f"{list(paths[:k])}" + (f" and {len(paths) - k} more" if len(paths) > k else "")


def match_tree(leaves_with_path: Sequence[tuple[Any, Any]], schedule: Any, *, where: str = "allreduce",
               skip_prefixes: Sequence[str] = ()) -> LeafMap:
  """Maps schedule rows to a tree's leaves by path, checking shape and dtype.

  Args:
    leaves_with_path: `jax.tree_util.tree_flatten_with_path(tree)[0]`, or `flatten_with_paths(tree)`.
    schedule: the Schedule whose rows must be exactly the tree's floating leaves.
    where: the caller's name, for messages.
    skip_prefixes: leaf paths at or under these are reduced elsewhere (e.g. by `loop_hook`).

  Returns:
    The LeafMap.

  Raises:
    ValueError: an empty tree or an FSDP schedule; TypeError: not a Schedule.
    ScheduleMismatchError: the tree and the rows differ (docs/design.md, "Trees and rows").
  """
  rows = _schedule_rows(schedule, where)
  if getattr(schedule, "fsdp", None) is not None:   # every rewrite path maps its tree here
    raise ValueError(f"{where}: this is an FSDP schedule (policy {schedule.policy!r}: parameters sharded "
                     f"over the data axis); it is planned, simulated and bounded, but carrying it out in "
                     f"the step is not implemented yet. Plan 'dear' or 'auto' for the rewrite.")
  if not leaves_with_path:
    raise ValueError(f"{where}: the gradient tree is empty; there is nothing to reduce. Pass the "
                     f"gradients of the params the schedule was planned for.")
  paths = tuple(path_str(p) for p, _ in leaves_with_path)
  leaves = [leaf for _, leaf in leaves_with_path]
  index = {p: i for i, p in enumerate(paths)}
  # nnx spellings: a Variable's 'x/value' also answers to 'x'; a plain 'x' also answers to 'x/value'
  alias: dict[str, int] = {}
  for i, (kp, _) in enumerate(leaves_with_path):
    if not isinstance(kp, str) and kp and is_variable_value(kp[-1]):
      alias.setdefault(path_str(kp[:-1]), i)
    else:
      alias.setdefault(f"{paths[i]}/value", i)
  floats = [p for p, x in zip(paths, leaves) if is_reduced_leaf(x)] or list(paths)
  like = f"the tree has paths like {_some(floats, 4)}"
  covers = f"the schedule covers {len(rows)} leaves, like {_some([r[0] for r in rows], 4)}"
  row_leaf = []
  for path, shape, dtype in rows:
    i = index.get(path, alias.get(path))
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
  """Checks that `schedule` was planned for exactly `rows` ((path, shape, dtype), in order); `where` and
  `theirs` name the caller and the rows in messages.

  Raises:
    ScheduleMismatchError: naming the first differing row (or the counts) and both fingerprints.
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
