"""flax.nnx's containers, as the state helpers meet them: an `nnx.Optimizer` wraps every array of its
`opt_state` in a Variable, and `nnx.state(...)` re-labels the library's NamedTuples as nested dicts.
Nothing here imports flax: an nnx object exists only where the user imported it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

import jax

from ._states import is_state
from .._values._errors import ShardingError

def flax_nnx() -> Any:
  """flax.nnx if the user imported it (an nnx object cannot exist otherwise): no import of our own."""
  return sys.modules.get("flax.nnx")


def _is_a(cls: str, x: Any) -> bool:
  """Whether `x` is an instance of `flax.nnx.<cls>` (never, where flax.nnx is not imported)."""
  nnx = flax_nnx()
  return nnx is not None and isinstance(x, getattr(nnx, cls))


is_optimizer = functools.partial(_is_a, "Optimizer")
is_nnx_state = functools.partial(_is_a, "State")
is_variable = functools.partial(_is_a, "Variable")


def values(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable)


def unwrap(tree: Any) -> Any:
  """`tree` with the flax Variables inside the library's per-device states (nnx.Optimizer wraps every
  array in an OptArray) replaced by their values; the library's types and tags kept. A tx state's own
  Variables (Param-shaped momenta) stay: `_recast` lays them on tx's template."""
  if flax_nnx() is None:
    return tree
  return jax.tree_util.tree_map(lambda x: values(x) if is_state(x) else x, tree, is_leaf=is_state)


def label(k: Any) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def labelled(tree: Any) -> dict:
  """`tree` (with flax Variables as leaves) as the nested dicts nnx.state uses: one key per path entry."""
  out: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
    d = out
    for k in path[:-1]:
      d = d.setdefault(label(k), {})
    d[label(path[-1])] = leaf
  return out


def to_nnx(tree: Any) -> Any:
  """A typed state of arrays as nnx.Optimizer keeps it (arrays in OptArray, Variables in OptVariable)."""
  from flax.nnx.training.optimizer import to_opt_state  # only reached with flax.nnx already imported
  return to_opt_state(tree)


def rebuild(template: Any, labelled: Mapping, where: str) -> Any:
  """The typed tree `template` (arrays or ShapeDtypeStructs) with its leaves looked up by path in the
  nnx-labelled `labelled` (values unwrapped from their Variables)."""
  paths, _ = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_variable)
  treedef = jax.tree_util.tree_structure(template)   # a Variable holds one leaf: the same order
  leaves = []
  for path, _ in paths:
    d: Any = labelled
    for k in path:
      key = label(k)
      if not isinstance(d, Mapping) or key not in d:
        raise ShardingError(f"{where}: the nnx state has no entry {'/'.join(str(label(q)) for q in path)!r} "
                            f"where the optimizer's state keeps one: it was made by another transformation "
                            f"than the tx given.")
      d = d[key]
    leaves.append(d.get_value() if is_variable(d) else d)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def walk_mappings(tree: Any, pred, fn) -> tuple[Any, int]:
  """Every Mapping of the nnx-labelled `tree` for which `pred` holds replaced by `fn(it)` (not
  descending into it); returns (the new tree as plain nested dicts, how many were replaced)."""
  if isinstance(tree, Mapping):
    if pred(tree):
      return fn(tree), 1
    out, count = {}, 0
    for k, v in tree.items():
      out[k], c = walk_mappings(v, pred, fn)
      count += c
    return out, count
  return tree, 0


def as_state(d: Any) -> Any:
  return flax_nnx().State(d) if isinstance(d, Mapping) else d


def holds_variables(tree: Any) -> bool:
  """Whether `tree` holds flax Variables (an nnx.Optimizer's opt_state wraps its arrays in them)."""
  return flax_nnx() is not None and any(
      is_variable(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_variable))


def on_optimizer(opt: Any, fn, *, whole: bool = False) -> Any:
  """fn on the optimizer's typed opt_state (the Variables in the library's states unwrapped; with
  `whole`, every Variable); the result as the nnx.State of an optimizer holding it (for nnx.update)."""
  new = fn(values(opt.opt_state) if whole else unwrap(opt.opt_state))
  rest = {k: v for k, v in labelled(flax_nnx().state(opt)).items() if k != "opt_state"}
  return as_state({**rest, "opt_state": labelled(to_nnx(new))})
