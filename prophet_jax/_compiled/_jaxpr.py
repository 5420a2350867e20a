"""The order in which a function first reads each parameter, read from its jaxpr.

`forward_paths` is the rows' priority order: where the loss's forward pass first uses each leaf
(descending into sub-jaxprs, not counting re-labelling primitives), which is not the pytree's order.
It reads jaxprs through `jax.extend.core` (`_jaxcompat.JAXPR_API`, checked before reading).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from ._jaxcompat import check_jaxpr_api
from .._values._tree import path_str

__all__ = ["forward_paths"]


# jaxpr params holding a sub-jaxpr whose invars and outvars map one-to-one onto the equation's
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# primitives that only re-label a value (its k-th output is its k-th input, re-typed or re-shaped):
# not a use; the use is wherever the result is read
_ALIAS_PRIMITIVES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                               "broadcast_in_dim", "transpose", "copy", "copy_p", "pvary", "pcast",
                               "optimization_barrier", "device_put"})


def forward_paths(fn: Callable[..., Any], params: Any, *args: Any,
                  axis_env: Sequence[tuple[str, int]] = ()) -> tuple[str, ...]:
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
    axis_env: (axis name, size) pairs bound while tracing (`jax.make_jaxpr`'s): the data axis a model's
      collectives name.

  Returns:
    Every leaf path of `params`, each once.
  """
  check_jaxpr_api("forward_paths")
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_str(p) for p, _ in leaves_with_paths]
  leaves = [x for _, x in leaves_with_paths]

  def flat_fn(flat, *rest):
    return fn(jax.tree_util.tree_unflatten(treedef, flat), *rest)

  jaxpr = jax.make_jaxpr(flat_fn, axis_env=list(axis_env))(leaves, *args).jaxpr
  used: dict[int, None] = {}   # the leaves used, in order of first use

  def walk(jx: Any, mapping: dict[int, int]) -> None:
    """mapping: id(var) -> leaf index; grows with the outputs that carry a leaf unchanged."""
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
        for k, i in ins:
          mapping[id(eqn.outvars[k])] = i
      else:
        for _, i in ins:
          used.setdefault(i)

  walk(jaxpr, {id(v): i for i, v in enumerate(jaxpr.invars[:len(leaves)])})
  order = list(used) + [i for i in range(len(leaves)) if i not in used]
  return tuple(paths[i] for i in order)
