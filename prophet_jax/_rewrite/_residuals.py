"""What the pipelined forward carries to the next call's backward: a cut of the forward's jaxpr
("min-cut": the fewest batch-dependent bytes from which the backward recomputes the rest by cheap ops;
docs/design.md, "The rewrite's layers"). The plan is positions in `vjp_jaxpr`'s jaxpr, so the forward
and the next call's backward agree. Jaxprs are read through `jax.extend.core` (`check_jaxpr_api`)."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core

from .._compiled._jaxcompat import check_jaxpr_api

# Position of a value in a jaxpr: (-1, k) the k-th input; (i, j) output j of equation i.
Position = tuple[int, int]

# outputs `save_matmuls` keeps: products (expensive to recompute) and reductions (small, and their
# recomputation would read a whole input again); everything else is recomputed in the backward
_SAVED_PRIMITIVES = frozenset({
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
})


def save_matmuls(prim: Any, *_: Any, **__: Any) -> bool:
  """A `jax.checkpoint` policy: keep matmul, convolution and reduction outputs; recompute the rest.

  What `pipelined(..., residuals="matmuls")` uses. The recomputed operations are elementwise: XLA
  fuses them into the backward's consumers, so they cost little compute and save the bytes the
  pipelined step would otherwise write out and read back.
  """
  return prim.name in _SAVED_PRIMITIVES


# recomputed in the backward when that carries fewer bytes: elementwise and layout operations, which
# XLA fuses into their consumers
_CHEAP = frozenset({
    "abs", "add", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "div",
    "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pow", "pvary",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt", "square", "sub",
    "tanh", "xor", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
    # transcendental elementwise; jax 0.12 added `one_minus_square` (tanh's and asin's derivatives write
    # 1 - x^2 with it) and `log2`
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "cosh", "log2",
    "one_minus_square", "sinh", "tan",
})


class VjpTrace(NamedTuple):
  """A traced `jax.vjp` of the forward (`vjp_jaxpr`).

  Attributes:
    closed: the closed jaxpr. Inputs: the params' leaves, then the batch's. Outputs: the loss, the
      auxiliary output's leaves (`n_head` values in all), then the vjp closure's leaves in flatten order.
    treedef: the vjp closure's treedef.
    aux_tree: the auxiliary output's treedef (of `None` without `has_aux`).
  """

  closed: Any
  treedef: Any
  aux_tree: Any

  @property
  def n_head(self) -> int:
    """The number of leading outputs that are the forward's own (the loss and the aux leaves)."""
    return 1 + self.aux_tree.num_leaves


def vjp_jaxpr(forward_fn: Callable[[Any, Any], Any], pv: Any, batch: Any, *,
              has_aux: bool = False) -> VjpTrace:
  """`jax.vjp(forward_fn(., batch), pv, has_aux=has_aux)`, traced (nothing runs).

  With `has_aux`, `forward_fn` returns `(loss, aux)`; aux is not differentiated, and its leaves are the
  jaxpr's outputs after the loss.
  """
  check_jaxpr_api("pipelined's residual analysis")
  p_leaves, p_tree = jax.tree_util.tree_flatten(pv)
  b_leaves, b_tree = jax.tree_util.tree_flatten(batch)
  box: list[Any] = []

  def loss_and_closure(pl, bl):
    b = jax.tree_util.tree_unflatten(b_tree, bl)
    q = jax.tree_util.tree_unflatten(p_tree, pl)
    if has_aux:
      loss, vjp_fn, aux = jax.vjp(lambda r: forward_fn(r, b), q, has_aux=True)
    else:
      (loss, vjp_fn), aux = jax.vjp(lambda r: forward_fn(r, b), q), None
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
    box.append((treedef, aux_tree))
    return [loss, *aux_leaves, *leaves]

  return VjpTrace(jax.make_jaxpr(loss_and_closure)(p_leaves, b_leaves), *box[0])   # box: filled by the trace


def carry_plan(closed: Any, n_params: int, how: str, *, n_head: int = 1) -> tuple[Position, ...]:
  """The positions of the values the forward carries, for a `vjp_jaxpr` jaxpr.

  how: "closure": the closure leaves that depend on the batch (what `jax.vjp` keeps, less the
    parameters and constants); "min-cut": the fewest bytes from which the backward recomputes every
    closure leaf by cheap operations.
  n_head: the outputs before the closure's leaves (`VjpTrace.n_head`).
  """
  jaxpr = closed.jaxpr
  on_batch = _batch_vars(jaxpr, n_params)
  needed = [v for v in jaxpr.outvars[n_head:] if _is_var(v) and v in on_batch]
  if how == "closure":
    chosen = list(dict.fromkeys(needed))
  elif how == "min-cut":
    chosen = _min_cut(jaxpr, on_batch, needed)
  else:
    raise ValueError(f"carry_plan(how={how!r}): expected 'closure' or 'min-cut'.")
  return tuple(sorted(_positions(jaxpr)[v] for v in chosen))


def carried_avals(closed: Any, plan: Sequence[Position]) -> tuple[Any, ...]:
  """The abstract values (shape, dtype) of the carried values, in plan order."""
  return tuple(_vars_at(closed.jaxpr)[p].aval for p in plan)


def forward(closed: Any, plan: Sequence[Position], *, n_head: int = 1) -> Callable[..., list[Any]]:
  """`f(*param_leaves, *batch_leaves) -> [loss, *aux, *carried]`: the forward, computing only what it
  needs."""
  jaxpr, at = closed.jaxpr, _vars_at(closed.jaxpr)
  return _subprogram(closed, list(jaxpr.invars), [*jaxpr.outvars[:n_head], *(at[p] for p in plan)])


def recompute(closed: Any, plan: Sequence[Position], n_params: int, *,
              n_head: int = 1) -> Callable[..., list[Any]]:
  """`f(*param_leaves, *carried) -> closure leaves`: the backward's inputs, from the carried values."""
  jaxpr, at = closed.jaxpr, _vars_at(closed.jaxpr)
  return _subprogram(closed, [*jaxpr.invars[:n_params], *(at[p] for p in plan)], list(jaxpr.outvars[n_head:]))


# --------------------------------------------------------------------------------------------------
# internals


def _is_var(v: Any) -> bool:
  return not isinstance(v, jex_core.Literal)


# the parameters of a `jit` equation with one entry per input / per output: pruning a call filters them
_CALL_IN_PARAMS = ("in_shardings", "in_layouts", "donated_invars")
_CALL_OUT_PARAMS = ("out_shardings", "out_layouts")
_CALL_PARAMS = frozenset({"jaxpr", "ctx_mesh", "name", "keep_unused", "inline", "compiler_options_kvs",
                          *_CALL_IN_PARAMS, *_CALL_OUT_PARAMS})


def _inner_jaxpr(eqn: Any) -> Any:
  """The body of a nested `jit` call that can be looked into and pruned, else None (an opaque equation).

  One predicate for both sides of the rule: `_live` decides liveness per output of exactly these calls,
  and `_slice` recomputes exactly these calls pruned to the outputs it needs (reading only the inputs
  those outputs depend on). Any other equation, or a call with effects or with parameters this module
  does not know how to prune, is a unit: all its outputs are live when one input is, and recomputing
  one output recomputes it whole.
  """
  if eqn.primitive.name != "jit" or eqn.effects or not set(eqn.params) <= _CALL_PARAMS:
    return None
  inner = eqn.params.get("jaxpr")
  inner = getattr(inner, "jaxpr", inner)
  if (inner is None or inner.effects or len(inner.invars) != len(eqn.invars)
      or len(inner.outvars) != len(eqn.outvars)):
    return None
  return inner


def _live(jaxpr: Any, live_in: Sequence[bool]) -> set[Any]:
  """The variables of `jaxpr` that depend on an input marked live (looking inside nested jit calls)."""
  live = {v for v, on in zip(jaxpr.invars, live_in) if on}
  for eqn in jaxpr.eqns:
    ins = [_is_var(v) and v in live for v in eqn.invars]
    if not any(ins):
      continue
    inner = _inner_jaxpr(eqn)
    if inner is None:
      live.update(eqn.outvars)
    else:
      inner_live = _live(inner, ins)
      live.update(o for o, i in zip(eqn.outvars, inner.outvars) if _is_var(i) and i in inner_live)
  return live


def _batch_vars(jaxpr: Any, n_params: int) -> set[Any]:
  return _live(jaxpr, [False] * n_params + [True] * (len(jaxpr.invars) - n_params))


def _positions(jaxpr: Any) -> dict[Any, Position]:
  where: dict[Any, Position] = {v: (-1, k) for k, v in enumerate(jaxpr.invars)}
  for i, eqn in enumerate(jaxpr.eqns):
    for j, v in enumerate(eqn.outvars):
      where.setdefault(v, (i, j))
  return where


def _vars_at(jaxpr: Any) -> dict[Position, Any]:
  return {p: v for v, p in _positions(jaxpr).items()}


def _nbytes(v: Any) -> int:
  return max(1, int(getattr(v.aval, "size", 1)) * v.aval.dtype.itemsize)


def _min_cut(jaxpr: Any, on_batch: set[Any], needed: list[Any]) -> list[Any]:
  """The batch values to carry: a minimum-bytes cut between what only the forward can compute and what
  the backward needs, with the latest such cut (the least recomputation) among equals."""
  # every batch value v is two nodes, v.in -> v.out with capacity bytes(v) (cutting it = carrying v)
  ordered = dict.fromkeys(v for v in [*jaxpr.invars, *(v for eqn in jaxpr.eqns for v in eqn.outvars)] if v in on_batch)
  index = {v: k for k, v in enumerate(ordered)}
  n = len(index)
  source, sink = 2 * n, 2 * n + 1
  inf = sum(_nbytes(v) for v in index) + 1
  graph = _FlowGraph(2 * n + 2)
  for v, k in index.items():
    graph.add(2 * k, 2 * k + 1, _nbytes(v))
  for v in jaxpr.invars:
    if v in index:  # the batch itself exists only in the forward
      graph.add(source, 2 * index[v], inf)
  for eqn in jaxpr.eqns:
    outs = [v for v in eqn.outvars if v in index]
    if not outs:
      continue
    if eqn.primitive.name not in _CHEAP or len(eqn.outvars) != 1:
      for v in outs:  # computed in the forward only
        graph.add(source, 2 * index[v], inf)
      continue
    for u in eqn.invars:  # recomputing v in the backward needs u there
      if _is_var(u) and u in index:
        graph.add(2 * index[u] + 1, 2 * index[outs[0]], inf)
  for v in needed:
    graph.add(2 * index[v] + 1, sink, inf)
  graph.max_flow(source, sink)
  to_sink = graph.reaching(sink)
  return [v for v, k in index.items() if 2 * k not in to_sink and 2 * k + 1 in to_sink]


class _FlowGraph:
  """A directed graph with integer capacities: Dinic's maximum flow, and the nodes that can still reach
  the sink afterwards (their complement is the source side of the latest minimum cut)."""

  def __init__(self, n: int):
    self.adj: list[list[int]] = [[] for _ in range(n)]
    self.to: list[int] = []
    self.cap: list[int] = []

  def add(self, u: int, v: int, cap: int) -> None:
    for a, b, c in ((u, v, cap), (v, u, 0)):   # the edge, then its residual twin (e ^ 1)
      self.adj[a].append(len(self.to))
      self.to.append(b)
      self.cap.append(c)

  def levels(self, start: int, backward: bool = False) -> list[int]:
    """Each node's distance from `start` along edges of residual capacity (-1: unreached); `backward`:
    its distance to `start` (edge e: v -> u out of v has the twin u -> v, of residual capacity cap[e ^ 1])."""
    level = [-1] * len(self.adj)
    level[start] = 0
    queue = collections.deque([start])
    while queue:
      u = queue.popleft()
      for e in self.adj[u]:
        if self.cap[e ^ 1 if backward else e] > 0 and level[self.to[e]] < 0:
          level[self.to[e]] = level[u] + 1
          queue.append(self.to[e])
    return level

  def max_flow(self, s: int, t: int) -> int:
    flow = 0
    while True:
      level = self.levels(s)
      if level[t] < 0:
        return flow
      it = [0] * len(self.adj)
      while pushed := self._push(s, t, level, it):
        flow += pushed

  def _push(self, s: int, t: int, level: list[int], it: list[int]) -> int:
    """One augmenting path along the level graph (iterative depth-first search)."""
    path: list[int] = []  # edge ids
    u = s
    while u != t:
      while it[u] < len(self.adj[u]):
        e = self.adj[u][it[u]]
        if self.cap[e] > 0 and level[self.to[e]] == level[u] + 1:
          break
        it[u] += 1
      else:  # dead end: retreat
        if not path:
          return 0
        level[u] = -1
        e = path.pop()
        u = self.to[e ^ 1]
        it[u] += 1
        continue
      path.append(e)
      u = self.to[e]
    pushed = min(self.cap[e] for e in path)
    for e in path:
      self.cap[e] -= pushed
      self.cap[e ^ 1] += pushed
    return pushed

  def reaching(self, t: int) -> set[int]:
    """The nodes with a path of residual capacity to `t`."""
    return {v for v, d in enumerate(self.levels(t, backward=True)) if d >= 0}


def _slice(jaxpr: Any, have: set[Any], outvars: Sequence[Any]) -> tuple[list[Any], set[Any]]:
  """The equations of `jaxpr` that compute `outvars` from the values in `have`, and what they miss.

  Walks back from `outputs`: an equation is kept when one of its outputs is needed. A nested call of
  which only some outputs are needed is pruned to those outputs (`_prune_call`), so it reads only the
  inputs they depend on: the same granularity at which `_live` decides what depends on the batch.
  Returns (kept equations in program order, the needed values that neither `have` nor an equation
  gives).
  """
  need = {v for v in outvars if _is_var(v) and v not in have}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    used = [v in need for v in eqn.outvars]
    if not any(used):
      continue
    need.difference_update(eqn.outvars)
    if not all(used) and _inner_jaxpr(eqn) is not None:
      eqn = _prune_call(eqn, used)
    kept.append(eqn)
    need.update(v for v in eqn.invars if _is_var(v) and v not in have)
  return kept[::-1], need


def _prune_call(eqn: Any, used: Sequence[bool]) -> Any:
  """A nested `jit` equation computing only its `used` outputs, from only the inputs they read."""
  closed = eqn.params["jaxpr"]
  inner = closed.jaxpr
  outs = [v for v, u in zip(inner.outvars, used) if u]
  eqns, missing = _slice(inner, set(inner.invars) | set(inner.constvars), outs)
  if missing:  # every value of a jaxpr comes from its inputs, constants or equations
    raise AssertionError(f"prophet_jax internal error: a nested call ({eqn.params.get('name')!r}) "
                         f"reads {len(missing)} values it does not define; please report it.")
  reads = {v for e in eqns for v in e.invars if _is_var(v)} | {v for v in outs if _is_var(v)}
  keep = [v in reads for v in inner.invars]
  body = jex_core.ClosedJaxpr(inner.replace(invars=list(itertools.compress(inner.invars, keep)), outvars=outs,
                                            eqns=eqns), closed.consts)
  params = dict(eqn.params, jaxpr=body)
  for names, mask in ((_CALL_IN_PARAMS, keep), (_CALL_OUT_PARAMS, used)):
    params.update({name: tuple(itertools.compress(params[name], mask)) for name in names if name in params})
  return eqn.replace(invars=list(itertools.compress(eqn.invars, keep)),
                     outvars=list(itertools.compress(eqn.outvars, used)), params=params)


def _subprogram(closed: Any, invars: list[Any], outvars: list[Any]) -> Callable[..., list[Any]]:
  """A function computing `outvars` from `invars` by the equations of `closed` between them."""
  jaxpr = closed.jaxpr
  kept, need = _slice(jaxpr, set(invars) | set(jaxpr.constvars), outvars)
  if need:  # a value no kept equation makes and no input gives: a wrong plan, never a wrong number
    raise AssertionError(f"prophet_jax internal error: {len(need)} values of the pipelined forward are "
                         f"neither carried nor recomputable; please report it.")
  debug = jaxpr.debug_info._replace(arg_names=tuple(f"in{k}" for k in range(len(invars))),
                                    result_paths=tuple(f"out{k}" for k in range(len(outvars))))
  sub = jaxpr.replace(invars=invars, outvars=outvars, eqns=kept, debug_info=debug)
  return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(sub, closed.consts))
