"""The traced side of the FSDP step: the user's loss as a jaxpr, cut into pieces whose forward and backward
the step runs itself, each saving only the residuals the step allows.

`flat_jaxpr` traces `loss_fn` on the gathered parameters' types and inlines nested `jit` calls; `lazy`
moves every equation that reads only parameters and constants (a cast, a transpose of a weight) to just
before its first reader; `cut` splits the equations into `Piece`s; `rebind_casts` makes a leaf whose only
reader is a cast to another float dtype gather in that dtype. `SplitVjp` is one piece's `jax.vjp` with
its residuals split: those that depend on activations are saved by its forward, the others (whatever
depends only on gathered or replicated parameters and constants) recomputed by its backward from the
parameters it is given then (kept ones, or gathered again), so no gathered weight survives in a residual
unless the plan keeps it. docs/design.md, "FSDP in the user's step: the mechanism".

Reads jaxprs through `jax.extend.core` (`_jaxcompat.JAXPR_API`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DebugInfo, Literal, Var, jaxpr_as_fun

_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})
_INFO = DebugInfo("fsdp_grad", "a piece of loss_fn", None, None)   # the jaxprs this module cuts out
# what a backward computes again from values it holds rather than have forward save it: elementwise and
# layout primitives (XLA fuses them into their readers), never products, reductions or loops
_CHEAP = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "sqrt", "rsqrt", "integer_pow", "pow", "square", "erf", "one_minus_square",
    "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "convert_element_type",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p", "pvary", "pcast"})


def _sub(v: Any, env: dict) -> Any:
  return v if isinstance(v, Literal) else env.get(v, v)


def _inline(jaxpr: Any, consts: list[tuple[Var, Any]]) -> tuple[list, list]:
  """`jaxpr`'s equations with every nested jit call inlined (its variables renamed per call, its
  constants added to `consts`), and its outvars after the renaming."""
  env: dict = {}
  eqns: list = []
  for eqn in jaxpr.eqns:
    ins = [_sub(v, env) for v in eqn.invars]
    sub = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
    if sub is None:
      eqns.append(eqn.replace(invars=ins))
      continue
    inner = getattr(sub, "jaxpr", sub)
    fresh = {v: Var(v.aval) for v in inner.invars}    # a jitted function's jaxpr is shared by its calls
    for cv, c in zip(inner.constvars, getattr(sub, "consts", ())):
      fresh[cv] = Var(cv.aval)
      consts.append((fresh[cv], c))
    renamed = _rename(inner, fresh)
    sub_eqns, sub_outs = _inline(renamed, consts)
    for iv, x in zip(renamed.invars, ins):
      env[iv] = x
    eqns.extend(e.replace(invars=[_sub(v, env) for v in e.invars]) for e in sub_eqns)
    for ov, x in zip(eqn.outvars, sub_outs):
      env[ov] = _sub(x, env)
  return eqns, [_sub(v, env) for v in jaxpr.outvars]


def _rename(jaxpr: Any, fresh: dict) -> Any:
  """`jaxpr` with every variable it binds replaced by a fresh one (`fresh` seeds invars/constvars)."""
  env = dict(fresh)
  eqns = []
  for e in jaxpr.eqns:
    outs = [Var(v.aval) if isinstance(v, Var) and type(v) is Var else v for v in e.outvars]
    eqns.append(e.replace(invars=[_sub(v, env) for v in e.invars], outvars=outs))
    env.update({o: n for o, n in zip(e.outvars, outs)})
  return jaxpr.replace(invars=[env.get(v, v) for v in jaxpr.invars], constvars=[], eqns=eqns,
                       outvars=[_sub(v, env) for v in jaxpr.outvars], debug_info=_INFO)


def flat_jaxpr(fn: Callable[..., Any], *avals: Any) -> tuple[Any, list[Any]]:
  """(jaxpr, consts): `fn` traced on `avals` (types, or values), nested jit calls inlined, its
  constants as leading constvars."""
  closed = jax.make_jaxpr(fn)(*avals)
  jx = closed.jaxpr
  consts = list(zip(jx.constvars, closed.consts))
  eqns, outs = _inline(jx.replace(constvars=[]), consts)
  return jx.replace(constvars=[v for v, _ in consts], eqns=eqns, outvars=outs, debug_info=_INFO), [c for _, c in consts]


def reads(eqn: Any) -> list[Var]:
  """The variables an equation reads (literals left out)."""
  return [v for v in eqn.invars if not isinstance(v, Literal)]


def sub_fn(eqns: Sequence[Any], ins: Sequence[Var], outs: Sequence[Any], like: Any) -> Callable[..., list]:
  """A function evaluating `eqns` from `ins` to `outs` (a piece of the jaxpr `like`)."""
  jx = like.replace(constvars=[], invars=list(ins), outvars=list(outs), eqns=list(eqns), debug_info=_INFO)
  fn = jaxpr_as_fun(ClosedJaxpr(jx, []))
  return lambda *args: list(fn(*args))


def dce(jaxpr: Any, keep: Sequence[bool], given: Sequence[Any] = ()) -> tuple[Any, list[bool], list]:
  """`jaxpr` reduced to the outvars `keep` marks and the equations they need, the variables in `given`
  taken as inputs (their equations left out). Returns (that jaxpr, whose invars are the invars it reads
  then the given ones it reads; which invars it reads; which given ones)."""
  given = list(given)
  live = {v for v, k in zip(jaxpr.outvars, keep) if k and isinstance(v, Var)}
  eqns = []
  for e in reversed(jaxpr.eqns):
    if any(o in live and o not in given for o in e.outvars):
      eqns.append(e)
      live.update(reads(e))
  used = [v in live for v in jaxpr.invars]
  used_given = [v for v in given if v in live]
  out = jaxpr.replace(invars=[v for v, u in zip(jaxpr.invars, used) if u] + used_given, eqns=eqns[::-1],
                      outvars=[v for v, k in zip(jaxpr.outvars, keep) if k], debug_info=_INFO)
  return out, used, used_given


def depends_on(jaxpr: Any, sources: Sequence[bool]) -> list[bool]:
  """Per outvar of `jaxpr`: whether it depends on an invar that `sources` marks."""
  dep = {v for v, s in zip(jaxpr.invars, sources) if s}
  for e in jaxpr.eqns:
    if any(v in dep for v in reads(e)):
      dep.update(e.outvars)
  return [isinstance(v, Var) and v in dep for v in jaxpr.outvars]


def zero_like(aval: Any) -> Any:
  """A zero cotangent for a value of type `aval` (float0 for integers), varying as `aval` is."""
  if not jnp.issubdtype(aval.dtype, jnp.inexact):
    return np.zeros(aval.shape, jax.dtypes.float0)
  z = jnp.zeros(aval.shape, aval.dtype)
  vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None) or getattr(aval, "vma", ())
  return jax.lax.pcast(z, tuple(vma), to="varying") if vma else z


class SplitVjp:
  """The forward and backward of `fn(*args)` with its residuals split: those that depend on an argument
  `recomputable` leaves unmarked (activations) are saved by `forward`; the rest are recomputed by
  `backward` from the marked arguments alone (parameters, constants), which the caller supplies again.
  A residual that is an argument marked in `forward_in` or an output marked in `forward_out` is neither:
  the caller supplies it to `backward` (a scanned layer's carry, stored once for two layers).

  Args:
    fn: list of arrays -> list of arrays.
    avals: the arguments' types (with their varying axes).
    diff: per argument, whether to differentiate with respect to it.
    recomputable: per argument, whether backward can supply it again (a parameter, a constant).
    forward_in, forward_out: per argument / output (default none).
  """

  def __init__(self, fn: Callable[..., list], avals: Sequence[Any], diff: Sequence[bool],
               recomputable: Sequence[bool], forward_in: Sequence[bool] = (), forward_out: Sequence[bool] = ()):
    self.diff, self.recomputable = list(diff), list(recomputable)
    box: dict[str, Any] = {}

    def residuals(*args):
      def f(*d):
        it = iter(d)
        return fn(*[next(it) if k else a for a, k in zip(args, self.diff)])
      outs, pullback = jax.vjp(f, *[a for a, k in zip(args, self.diff) if k])
      leaves, box["tree"] = jax.tree_util.tree_flatten(pullback)
      return outs, leaves

    closed = jax.make_jaxpr(residuals)(*avals)
    self.jaxpr, self.consts = closed.jaxpr, closed.consts
    self.tree = box["tree"]
    self.n_out = n_out = len(jax.eval_shape(lambda *a: fn(*a), *avals))
    self.out_avals = [v.aval for v in self.jaxpr.outvars[:n_out]]
    res = self.jaxpr.outvars[n_out:]
    ins = {v: i for i, v in enumerate(self.jaxpr.invars) if i < len(forward_in) and forward_in[i]}
    outs = {v: j for j, v in enumerate(self.jaxpr.outvars[:n_out]) if j < len(forward_out) and forward_out[j]}
    self.source = [("in", ins[r]) if r in ins else ("out", outs[r]) if r in outs else None for r in res]
    # what backward can compute again: anything from the recomputable arguments alone (a weight's cast or
    # transpose), and cheap (elementwise, layout) functions of those and the forwarded values
    param = {v for v, r in zip(self.jaxpr.invars, self.recomputable) if r}
    cheap = param | set(ins) | set(outs)
    for e in self.jaxpr.eqns:
      vs = reads(e)
      if all(v in param for v in vs):
        param.update(e.outvars)
      if all(v in cheap for v in vs) and (e.primitive.name in _CHEAP or all(v in param for v in vs)):
        cheap.update(e.outvars)
    self.saved = [s is None and r not in cheap for r, s in zip(res, self.source)]   # saved in forward
    keep = [False] * n_out + [s is None and r in cheap for r, s in zip(res, self.source)]
    self.rec_jaxpr, self.rec_used, given = dce(self.jaxpr, keep, list(outs))
    self.rec_outs = [outs[v] for v in given]
    bad = [i for i, u in enumerate(self.rec_used) if u and not self.recomputable[i] and i not in ins.values()]
    if bad:
      raise AssertionError(f"prophet_jax internal error: recomputed residuals read argument {bad[0]}.")

  def forward(self, args: Sequence[Any]) -> tuple[list, list]:
    """(outputs, the saved residuals)."""
    vals = jaxpr_as_fun(ClosedJaxpr(self.jaxpr, self.consts))(*args)
    outs, res = list(vals[:self.n_out]), vals[self.n_out:]
    return outs, [r for r, s in zip(res, self.saved) if s]

  def backward(self, saved: Sequence[Any], args: Sequence[Any], cts: Sequence[Any], outs: Sequence[Any] = ()
               ) -> list:
    """Cotangents of the differentiated arguments; `args` holds the recomputable arguments and those
    marked `forward_in` (others may be None), `outs` the outputs marked `forward_out`, `cts` one
    cotangent (or None: zero) per output."""
    rec = jaxpr_as_fun(ClosedJaxpr(self.rec_jaxpr, self.consts))(
        *[a for a, u in zip(args, self.rec_used) if u], *[outs[j] for j in self.rec_outs])
    it_s, it_r = iter(saved), iter(rec)
    leaves = []
    for s, src in zip(self.saved, self.source):
      if src is not None:
        leaves.append(args[src[1]] if src[0] == "in" else outs[src[1]])
      else:
        leaves.append(next(it_s) if s else next(it_r))
    pullback = jax.tree_util.tree_unflatten(self.tree, leaves)
    cts = [(zero_like(a) if c is None else c) for c, a in zip(cts, self.out_avals)]
    return list(pullback(cts))


class Piece(NamedTuple):
  """A run of equations: the variables it reads that are defined before it, those it defines that are
  read after it (or returned)."""

  eqns: tuple
  ins: tuple
  outs: tuple


def lazy(jaxpr: Any, pure_vars: set) -> list:
  """`jaxpr`'s equations, each that reads only `pure_vars` (parameters), constants and their results moved
  to just before its first reader: a weight's cast or transpose is computed where the weight is used, so
  it does not pull the weight's gather forward."""
  pure = set(pure_vars) | set(jaxpr.constvars)
  pending: dict = {}
  out: list = []

  def emit(v):
    e = pending.pop(v, None)
    if e is not None:
      for o in e.outvars:
        pending.pop(o, None)
      for x in reads(e):
        emit(x)
      out.append(e)

  for e in jaxpr.eqns:
    if all(v in pure for v in reads(e)) and not e.effects:
      pure.update(e.outvars)
      pending.update({o: e for o in e.outvars})
      continue
    for v in reads(e):
      emit(v)
    out.append(e)
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      emit(v)
  return out


def cut(jaxpr: Any, eqns: list, cuts: Sequence[int]) -> list[Piece]:
  """`eqns` (of `jaxpr`) cut before each position in `cuts`."""
  cuts = sorted({0, len(eqns), *[c for c in cuts if 0 < c < len(eqns)]})
  defined_at = {o: k for k, e in enumerate(eqns) for o in e.outvars}
  last_read: dict = {}
  for k, e in enumerate(eqns):
    last_read.update({v: k for v in reads(e)})
  last_read.update({v: len(eqns) for v in jaxpr.outvars if not isinstance(v, Literal)})
  pieces = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    ins = dict.fromkeys(v for e in eqns[a:b] for v in reads(e) if not a <= defined_at.get(v, -1) < b)
    outs = [o for e in eqns[a:b] for o in e.outvars if last_read.get(o, -1) >= b]
    pieces.append(Piece(tuple(eqns[a:b]), tuple(ins), tuple(outs)))
  return pieces


def rebind_casts(jaxpr: Any, vars_: dict, enabled: bool) -> tuple[Any, dict, dict]:
  """Gathering in the compute dtype: each of `vars_` (key -> var) whose one reader casts it to another
  float dtype is replaced by the cast's result, the cast dropped. Returns (the jaxpr, key -> var to bind
  the gathered value to, key -> dtype to cast the shard to before gathering)."""
  readers: dict = {}
  for e in jaxpr.eqns:
    for v in reads(e):
      readers.setdefault(v, []).append(e)
  bound, cast, drop = dict(vars_), {}, set()
  for key, v in vars_.items():
    rs = readers.get(v, [])
    if (enabled and len(rs) == 1 and rs[0].primitive.name == "convert_element_type" and v not in jaxpr.outvars
        and jnp.issubdtype(rs[0].outvars[0].aval.dtype, jnp.floating)):
      bound[key], cast[key] = rs[0].outvars[0], rs[0].outvars[0].aval.dtype
      drop.add(id(rs[0]))
  return jaxpr.replace(eqns=[e for e in jaxpr.eqns if id(e) not in drop]), bound, cast
