"""A scanned stack in the FSDP step: a `lax.scan` over stacked leaves (linen `nn.scan`, `nnx.scan` and
`jax.lax.scan` all trace to one), each layer gathered inside the loop with the next one's gather in flight.

The scan's body is one layer's function (`make_scan`: its `SplitVjp`, the gathered slices bound where the
body reads the stacked leaves, or their casts). Each run of layers the plan keeps alike is carried out
as its first layer, a loop over the middle and its last layer (peeled, so every layer's gather and
re-gather is issued exactly once and the loop body is uniform):

- forward: layer k's computation runs with layer k + 1's all-gather in flight (tied to layer k's
  input, carried, never saved); its residuals are stacked by the loop, with its gathered leaves when
  kept; the last layer issues the next run's or the next pieces' gathers;
- backward: the layers in reverse, each gathering layer k - 1 again (unless kept) tied to the incoming
  cotangent of the carry, then the layer's pullback and its unit's reduce-scatter on the token chain,
  one per iteration. The carry is saved once per layer: a residual that is the layer's carry in or out
  is read from the next layer's saved carry (`SplitVjp`'s `forward_in`/`forward_out`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from ._fsdp_trace import SplitVjp, rebind_casts, sub_fn, zero_like
from ._fsdp_units import AG_SCOPE, REAG_SCOPE, RS_SCOPE, scatter
from .._compiled._jaxcompat import scan_parts

class Scan(NamedTuple):
  """A scanned stack: one layer's function and per layer its gather group, unit and keep."""

  eqn: Any
  n_consts: int
  n_carry: int
  xs_slot: tuple          # per xs operand: ("shard", leaf) / ("rep", leaf) / ("other", None)
  cast: dict              # sharded leaf -> dtype its slice is cast to before gathering
  vjp: SplitVjp           # one layer: (body consts, consts, carry, xs) -> (carry, ys)
  body_consts: list
  groups: tuple           # per layer
  units: tuple            # per layer: its unit's chunk
  runs: tuple             # (first layer, end layer, keep): runs of equal keep


def anchor_of(values: Any) -> Any:
  """The first floating array of `values`: what a collective issued here is tied to."""
  return next((c for c in values if c is not None and jnp.issubdtype(c.dtype, jnp.inexact)), None)


def make_scan(step: Any, eqn: Any, gather_cast: bool) -> Scan:
  """The Scan of a scan equation of `step`'s jaxpr reading stacked leaves as `xs`.

  Raises:
    ValueError: a reversed scan; a layer that is not exactly one gather group and one unit of the plan.
  """
  plan = step.plan
  if eqn.params.get("reverse"):
    raise ValueError("fsdp_grad: a reversed scan over stacked parameters is not supported; scan forward.")
  nc, ncar = scan_parts(eqn)
  body = eqn.params["jaxpr"]
  bj, bconsts = getattr(body, "jaxpr", body), list(getattr(body, "consts", ()))
  leaf_of = {v: i for i, v in enumerate(step.leaf_var)}
  leaf_of.update({v: i for i, v in step.bound.items()})   # a stack cast before the scan: gathered cast
  xs_slot, shard_vars = [], {}
  for v, bv in zip(eqn.invars[nc + ncar:], bj.invars[nc + ncar:]):
    i = None if isinstance(v, Literal) else leaf_of.get(v)
    xs_slot.append(("other", None) if i is None else ("shard", i) if i in plan.dim_of else ("rep", i))
    shard_vars.update({i: bv} if i in plan.dim_of else {})
  bj, bound, cast = rebind_casts(bj, shard_vars, gather_cast)
  nb = len(bj.constvars)
  ins = list(bj.constvars) + [bound.get(i, v) if kind == "shard" else v
                              for v, (kind, i) in zip(bj.invars, [("", None)] * (nc + ncar) + xs_slot)]
  diff, rec = [False] * nb, [True] * nb
  for j, v in enumerate(eqn.invars):
    exact = jnp.issubdtype(ins[nb + j].aval.dtype, jnp.inexact)
    known = isinstance(v, Literal) or v in step.static or v in step.var_slot
    kind = xs_slot[j - nc - ncar][0] if j >= nc + ncar else None
    diff.append(exact and (nc <= j < nc + ncar or kind in ("shard", "rep") or
                           (not isinstance(v, Literal) and v in step.needs)))
    rec.append(j >= nc + ncar and kind != "other" or (known and not nc <= j < nc + ncar))
  vjp = SplitVjp(sub_fn(bj.eqns, ins, bj.outvars, bj), [v.aval for v in ins], diff, rec,
                 forward_in=[nb + nc <= j < nb + nc + ncar for j in range(len(ins))],
                 forward_out=[j < ncar for j in range(len(bj.outvars))])
  shard_leaves = [i for kind, i in xs_slot if kind == "shard"]
  groups, units = [], []
  for k in range(eqn.params["length"]):
    want = {(i, k) for i in shard_leaves}
    g = [g for g, slots in enumerate(plan.groups) if set(slots) & want]
    u = [u for u, slots in plan.units.items() if set(slots) & want]
    if len(g) != 1 or set(plan.groups[g[0]]) != want or len(u) != 1 or set(plan.units[u[0]]) != want:
      raise ValueError(f"fsdp_grad: layer {k} of a scanned stack must be exactly one gather group and one unit "
                       f"(its slices of every sharded stacked leaf), as a loop runs every layer alike; plan the "
                       f"stack per layer (GradientProfile.from_params(..., stacked=)).")
    groups.append(g[0])
    units.append(u[0])
  runs, a = [], 0
  for k in range(1, len(groups) + 1):
    if k == len(groups) or plan.keep[groups[k]] != plan.keep[groups[a]]:
      runs.append((a, k, plan.keep[groups[a]]))
      a = k
  return Scan(eqn, nc, ncar, tuple(xs_slot), cast, vjp, bconsts, tuple(groups), tuple(units), tuple(runs))


def _gather_layer(step, sc, k, scope, anchor, shards=None):
  """Layer k's gathered leaves (`shards`: a loop's slice, else read from the stack)."""
  return step.gather(sc.groups[k], scope, anchor, shards)


def _at(x, k):
  """Layer k of a stacked array, read in place (`k` traced)."""
  return jax.lax.dynamic_index_in_dim(x, k, keepdims=False)


def _args(sc, consts, carry, xs_k, w_k):
  """The layer's arguments: body consts, consts, carry, xs (a sharded slice as its gathered layer)."""
  it = iter(w_k)
  return list(sc.body_consts) + list(consts) + list(carry) + [
      next(it) if kind == "shard" else x for (kind, _), x in zip(sc.xs_slot, xs_k)]


def scan_forward(step: Any, sc: Scan, ins: list, whole: dict, tail: Any) -> tuple[list, list]:
  """The stack's forward (`ins`: the scan's operands; `whole[sc.groups[0]]`: layer 0 gathered; `tail(anchor)`
  issues the gathers due when the last layer starts). Returns (the scan's outputs, per run (its parts in
  layer order, each (residuals, carry in), the carry after it))."""
  nc, ncar = sc.n_consts, sc.n_carry
  consts, carry = ins[:nc], list(ins[nc:nc + ncar])
  xs = [None if kind == "shard" else x for (kind, _), x in zip(sc.xs_slot, ins[nc + ncar:])]
  w, runs, ys_parts = whole.pop(sc.groups[0]), [], []

  def compute(w_k, carry, xs_k, keep):
    outs, res = sc.vjp.forward(_args(sc, consts, carry, xs_k, w_k))
    return outs[:ncar], outs[ncar:], res + (list(w_k) if keep else [])

  for r, (a, b, keep) in enumerate(sc.runs):
    def one(k, w_k, carry, keep=keep, b=b, r=r):
      anchor = anchor_of(carry)
      nxt = tail(anchor) if k + 1 == b and r + 1 == len(sc.runs) else _gather_layer(step, sc, k + 1, AG_SCOPE, anchor)
      new, ys, res = compute(w_k, carry, [x if x is None else x[k] for x in xs], keep)
      ys_parts.append([y[None] for y in ys])
      return new, (res, carry), nxt

    parts = []
    carry, part, w = one(a, w, carry)
    parts.append(part)
    if b - a > 2:     # the middle layers: the stacks are read in place by index (a slice would copy them)
      def body(c, _, a=a, keep=keep):
        carry, w_k, k = c
        nxt = [_at(step.flat[i], k + 1) for kind, i in sc.xs_slot if kind == "shard"]
        w_next = _gather_layer(step, sc, a + 2, AG_SCOPE, anchor_of(carry), nxt)
        new, ys, res = compute(w_k, carry, [x if x is None else _at(x, k) for x in xs], keep)
        return (new, w_next, k + 1), (ys, (res, carry))

      (carry, w, _), (ys, part) = jax.lax.scan(body, (carry, w, jnp.int32(a + 1)), None, length=b - a - 2)
      parts.append(part)
      ys_parts.append(ys)
    if b - a > 1:
      carry, part, w = one(b - 1, w, carry)
      parts.append(part)
    runs.append((parts, carry))
  ys = [jnp.concatenate([p[j] for p in ys_parts]) for j in range(len(sc.eqn.outvars) - ncar)]
  return carry + ys, runs


def scan_backward(step: Any, sc: Scan, runs: list, live: dict, tail: Any, anchor: Any) -> Any:
  """The stack's backward: its cotangents taken from and given to `step`, its units reduce-scattered on
  `step`'s token chain; `live[sc.groups[-1]]`: the last layer gathered again (unless kept); `tail(anchor)`
  issues the re-gathers due when the first layer's backward starts. Returns the backward's anchor after it.
  Per-layer results (the gradient shards, the xs' cotangents) go into whole stacks in place."""
  nc, ncar, nb = sc.n_consts, sc.n_carry, len(sc.body_consts)
  top, diff = list(sc.eqn.invars), sc.vjp.diff[nb:]
  cts = [step.ct.pop(v, None) for v in sc.eqn.outvars]
  ct_carry = [zero_like(v.aval) if c is None and d else c
              for v, c, d in zip(sc.eqn.outvars, cts[:ncar], diff[nc:nc + ncar])]
  ct_ys = cts[ncar:]
  consts = [step.value(v, live) for v in top[:nc]]
  xs = [None if kind == "shard" else step.local[i] if kind == "rep" else step.value(v, live)
        for (kind, i), v in zip(sc.xs_slot, top[nc + ncar:])]
  shard_leaves = [i for kind, i in sc.xs_slot if kind == "shard"]
  ns = len(shard_leaves)
  ct_consts = [zero_like(v.aval) if d and not isinstance(v, Literal) else None for v, d in zip(top[:nc], diff[:nc])]
  acc = [zero_like(jax.typeof(step.flat[i])) if kind == "shard" else zero_like(v.aval) if d else None
         for (kind, i), v, d in zip(sc.xs_slot, top[nc + ncar:], diff[nc + ncar:])]
  zero = lambda t: jnp.zeros((), jnp.float32) if t is None else t  # noqa: E731
  token = tuple(map(zero, step.token)) if isinstance(step.token, tuple) else zero(step.token)  # HSDP: two chains
  w = None if sc.runs[-1][2] else live.pop(sc.groups[-1])
  step.pending = [k for k in step.pending if k not in set(sc.units)]

  def layer(k, res, carry_in, carry_out, w_k, ct_carry, ct_consts, acc, token, keep, unit):
    """Layer k's backward (`k` traced in a loop): new (carry cotangent, consts' cotangents, stacks, token)."""
    if keep:
      w_k, res = res[len(res) - ns:], res[:len(res) - ns]
    args = _args(sc, consts, carry_in, [None if x is None else _at(x, k) for x in xs], w_k)
    got = iter(sc.vjp.backward(res, args, list(ct_carry) + [None if c is None else _at(c, k) for c in ct_ys],
                               carry_out))
    ct_consts, new_carry, ct_xs = list(ct_consts), [None] * ncar, []
    for j, d in enumerate(diff):
      c = next(got) if d else None
      if j < nc:
        ct_consts[j] = None if c is None or ct_consts[j] is None else ct_consts[j] + c
      elif j < nc + ncar:
        new_carry[j - nc] = c
      else:
        ct_xs.append(c)
    ct_w = [c.astype(step.flat[i].dtype) for c, (kind, i) in zip(ct_xs, sc.xs_slot) if kind == "shard"]
    out, token = scatter(ct_w, [step.plan.dim_of[i] - 1 for i in shard_leaves], step.axis, step.n, step.divisor,
                         f"{RS_SCOPE}{unit}", step.layout, token, step.replicas, step.one_chain)
    it = iter(out)
    new_acc = []
    for (kind, _), c, st in zip(sc.xs_slot, ct_xs, acc):
      x = next(it) if kind == "shard" else c
      new_acc.append(st if st is None or x is None else
                     jax.lax.dynamic_update_index_in_dim(st, x.astype(st.dtype), k, 0))
    return new_carry, ct_consts, new_acc, token

  for r in range(len(sc.runs) - 1, -1, -1):
    a, b, keep = sc.runs[r]
    parts, nxt = list(runs[r][0]), runs[r][1]

    def regather(k, anchor, a=a, keep=keep, r=r):
      if k > a:
        return None if keep else _gather_layer(step, sc, k - 1, REAG_SCOPE, anchor)
      if r > 0:
        return None if sc.runs[r - 1][2] else _gather_layer(step, sc, a - 1, REAG_SCOPE, anchor)
      return tail(anchor)

    def one(k, part, nxt, w_k, ct_carry, ct_consts, acc, token, keep=keep):
      res, carry_in = part
      w_next = regather(k, anchor_of(ct_carry))
      ct_carry, ct_consts, acc, token = layer(k, list(res), carry_in, nxt, w_k, ct_carry, ct_consts, acc, token,
                                              keep, sc.units[k])
      return ct_carry, ct_consts, acc, token, w_next, carry_in

    if b - a > 1:
      ct_carry, ct_consts, acc, token, w, nxt = one(b - 1, parts.pop(), nxt, w, ct_carry, ct_consts, acc, token)
    if b - a > 2:
      def body(c, x, b=b, keep=keep):
        ct_carry, ct_consts, acc, token, w_k, nxt, k = c
        res, carry_in = x
        prev = None if keep else [_at(step.flat[i], k - 1) for i in shard_leaves]
        w_prev = None if keep else _gather_layer(step, sc, b - 3, REAG_SCOPE, anchor_of(ct_carry), prev)
        ct_carry, ct_consts, acc, token = layer(k, list(res), carry_in, nxt, w_k, ct_carry, ct_consts, acc, token,
                                                keep, sc.units[b - 2])
        return (ct_carry, ct_consts, acc, token, w_prev, carry_in, k - 1), None

      (ct_carry, ct_consts, acc, token, w, nxt, _), _ = jax.lax.scan(
          body, (ct_carry, ct_consts, acc, token, w, nxt, jnp.int32(b - 2)), parts.pop(), reverse=True)
    ct_carry, ct_consts, acc, token, w, nxt = one(a, parts.pop(), nxt, w, ct_carry, ct_consts, acc, token)
  step.token = token
  for ((kind, i), v), s in zip(zip(sc.xs_slot, top[nc + ncar:]), acc):
    if kind == "shard":
      step.stack_parts[i] = [(0, s)]
    elif s is not None:
      anchor = step.accumulate([step.leaf_var[i] if kind == "rep" else v], [s], anchor)
  anchor = step.accumulate([v for v, c in zip(top[:nc], ct_consts) if c is not None],
                           [c for c in ct_consts if c is not None], anchor)
  return step.accumulate([v for v, c in zip(top[nc:nc + ncar], ct_carry) if c is not None],
                         [c for c in ct_carry if c is not None], anchor)
