"""The order in which a function first reads each parameter, read from its jaxpr."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from ._jaxcompat import check_jaxpr_api
from .._values._tree import path_str


# jaxpr params holding a sub-jaxpr whose invars and outvars map one-to-one onto the equation's
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# primitives that only re-label a value (its k-th output is its k-th input, re-typed or re-shaped):
# not a use; the use is wherever the result is read
_ALIAS_PRIMITIVES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                               "broadcast_in_dim", "transpose", "copy", "copy_p", "pvary", "pcast",
                               "optimization_barrier", "device_put"})


def forward_paths(fn: Callable[..., Any], params: Any, *args: Any,
                  axis_env: Sequence[tuple[str, int]] = ()) -> tuple[str, ...]:
  """Every leaf path of `params`, once, in the order `fn(params, *args)` first reads them (docs/design.md).

  Args:
    fn, params, *args: e.g. a loss, its parameters and a batch; traced abstractly (ShapeDtypeStructs will do).
    axis_env: (axis name, size) pairs bound while tracing: the data axis a model's collectives name.

  Example:
    >>> forward_paths(loss_fn, params, batch)[0]      # the embedding a language model reads first
  """
  check_jaxpr_api("forward_paths")
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_str(p) for p, _ in leaves_with_paths]
  leaves = [x for _, x in leaves_with_paths]
  jaxpr = jax.make_jaxpr(lambda flat, *rest: fn(jax.tree_util.tree_unflatten(treedef, flat), *rest),
                         axis_env=list(axis_env))(leaves, *args).jaxpr
  used: dict[int, None] = {}   # the leaves used, in order of first use

  def walk(jx: Any, mapping: dict[int, int]) -> None:
    for eqn in jx.eqns:
      ins = [(k, mapping[id(v)]) for k, v in enumerate(eqn.invars)
             if not isinstance(v, Literal) and id(v) in mapping]
      if not ins:
        continue
      # ClosedJaxpr -> Jaxpr (jax >= 0.11: the same object)
      cands = (getattr(eqn.params.get(name), "jaxpr", eqn.params.get(name)) for name in _CALL_PARAMS)
      sub = next((c for c in cands if hasattr(c, "eqns") and len(c.invars) == len(eqn.invars)
                  and len(c.outvars) == len(eqn.outvars)), None)
      if sub is not None:
        inner = {id(sub.invars[k]): i for k, i in ins}
        walk(sub, inner)
        for ov, iv in zip(eqn.outvars, sub.outvars):  # passed through unchanged: alias, not a use
          if not isinstance(iv, Literal) and id(iv) in inner:
            mapping[id(ov)] = inner[id(iv)]
      elif eqn.primitive.name in _ALIAS_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
        mapping.update({id(eqn.outvars[k]): i for k, i in ins})
      else:
        used.update(dict.fromkeys(i for _, i in ins if i not in used))

  walk(jaxpr, {id(v): i for i, v in enumerate(jaxpr.invars[:len(leaves)])})
  order = list(used) + [i for i in range(len(leaves)) if i not in used]
  return tuple(paths[i] for i in order)
