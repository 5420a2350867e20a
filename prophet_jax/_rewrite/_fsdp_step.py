"""The per-device FSDP step: an FSDP plan (`Schedule.fsdp`) carried out inside the user's `shard_map`.

`fsdp_grad(loss_fn, schedule, axis_name=...)` returns `grad_fn(param_shards, batch) -> (loss, grad_shards)`.
`loss_fn(params, batch)` is the user's own, on whole parameters (a linen `apply`, an nnx `merge`, plain
JAX: the step sees only its jaxpr). The step traces it on the gathered parameters' types, cuts it where
each gather group is first read (`_fsdp_trace`) and runs the pieces itself:

- forward: gather group g's all-gather is issued when the piece of the group `prefetch` before it
  starts, tied to that piece's input activation (docs/facts.md F2), and a piece waits for the gather
  issued one group before it (at depth > 1); a scanned stack is gathered layer by layer inside its loop
  (`_fsdp_scan`);
- backward: the pieces in reverse, each with only the residuals the plan allows; a group the plan does
  not keep is gathered again when the backward of the group `backward_prefetch` after it in forward
  starts, tied to that point's cotangent; each unit is reduce-scattered once its leaves' gradients are
  whole, in the plan's chunk order (a unit waits for the chunks before it), on one token chain with the
  replicated leaves' all-reduces (the library's engine, `_collectives.reduce_units`).

docs/design.md, "FSDP in the user's step: the mechanism", says why it is built this way and what the
compiled programs show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from . import _loss_reduction
from ._axis import axis_size, is_varying, to_varying, vma_enabled
from ._collectives import engine_divisor, reduce_units, tie
from ._fsdp_scan import make_scan, scan_backward, scan_forward
from ._fsdp_trace import SplitVjp, cut, flat_jaxpr, lazy, rebind_casts, reads, sub_fn
from ._fsdp_units import AG_SCOPE, LAYOUTS, REAG_SCOPE, RS_SCOPE, gather, last, read_plan, scatter, split_axes
from .._compiled._jaxcompat import check_jaxpr_api
from .._values._schedule import Chunk, Schedule
from .._values._tree import path_str

def fsdp_grad(loss_fn: Callable[..., Any], schedule: Schedule, *, axis_name: Any, reduction: str = "mean",
              gather_dtype: str | None = "auto", layout: str = "packed") -> Callable[..., Any]:
  """`grad_fn(param_shards, batch) -> (loss, grad_shards)` carrying out an FSDP plan, per device.

  Call `grad_fn` inside `jax.shard_map` over `axis_name` with the parameters placed as the plan says (a
  sharded leaf split over the axis on its planned dimension: `P("data", None)`; a scanned stack's leaves
  on that dimension + 1: `P(None, "data", None)`; the rest `P()`) and the batch split over the axis.

  Args:
    loss_fn: `loss_fn(params, batch)` on whole parameters: the loss, or a pytree whose first leaf is the
      loss (the rest is returned as computed); a mean over its examples (`reduction="sum"`: a sum).
    schedule: an FSDP plan (`plan(profile, network, "fsdp", ...)`); a scanned stack planned per layer
      (rows `<prefix>/<k>/<rest>`: `GradientProfile.from_params(..., stacked=)`), each layer one gather group and
      one unit; where it gathers a leaf in another dtype, the leaf's one reader casts it to that dtype. A plan
      of `micro_batches=k` splits each device's batch into k along its leading axis (`_accumulate`).
    axis_name: the data axis the parameters are sharded over; HSDP: every axis of the plan's mesh (a tuple),
      the parameters sharded over its shard axes, each reduced shard all-reduced over the others.
    reduction: "mean" or "sum" (`hooked`'s).
    gather_dtype: "auto": a sharded leaf whose only reader casts it to another float dtype (a bf16 model
      over f32 shards) is cast before its all-gather, which then moves the compute dtype's bytes; its
      reduce-scatter stays in the leaf's dtype. None: every leaf gathers in its own dtype.
    layout: "packed": one all-gather / reduce-scatter per group / unit on every backend; "leaf": one per
      leaf under the group's XLA combiner key (`_fsdp_units`).

  Returns:
    `grad_fn(param_shards, batch)`: this device's loss (as `loss_fn` returns it) and the gradients laid
    out as `param_shards` (the mean over the global batch for "mean").

  Example:
    >>> grad_fn = fsdp_grad(loss_fn, schedule, axis_name="data")    # doctest: +SKIP
    >>> jax.shard_map(grad_fn, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P("data"), specs))
  """
  check_jaxpr_api("fsdp_grad")
  _loss_reduction.check(reduction, "fsdp_grad")
  if layout not in LAYOUTS:
    raise ValueError(f"fsdp_grad(layout={layout!r}): expected one of {LAYOUTS}.")
  if gather_dtype not in ("auto", None):
    raise ValueError(f"fsdp_grad(gather_dtype={gather_dtype!r}): expected 'auto' or None.")

  split_axes(schedule, axis_name, "fsdp_grad")

  def grad_fn(params, batch):
    step = lambda b: _Step(loss_fn, schedule, axis_name, reduction, gather_dtype == "auto", layout, params, b)  # noqa: E731
    if schedule.fsdp.micro_batches == 1:
      return step(batch).run()
    return _accumulate(step, schedule.fsdp, batch, reduction)

  return grad_fn


def _accumulate(step: Callable[[Any], Any], f: Any, batch: Any, reduction: str) -> tuple[Any, Any]:
  """k micro-batches (each device's batch split in k along every leaf's leading axis) in one step, as the plan
  holds: each held group gathered by the first and read by all, each held unit's whole gradient summed and
  reduce-scattered once after the last (docs/fsdp.md, "Accumulation"); the mean (or sum) over all examples."""
  k = f.micro_batches
  kp, tree = jax.tree_util.tree_flatten_with_path(batch)
  for p, x in kp:
    if np.ndim(x) == 0 or np.shape(x)[0] % k:
      raise ValueError(f"fsdp_grad: the plan runs micro_batches={k}, but batch leaf {path_str(p)!r} has shape "
                       f"{np.shape(x)} on each device; its leading axis must split into {k} equal micro-batches.")
  hold = {g for g, h in enumerate(f.hold_params) if h}
  later = {f.units[u] for u, h in enumerate(f.hold_grads) if h}
  held, sums, acc, values, st = {}, {}, None, [], None
  parts = [jnp.split(x, k) for _, x in kp]
  real = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
  for m in range(k):    # each micro-batch after the last one's backward (its gradients), as the plan runs them
    after = None if st is None else last([x for x in jax.tree.leaves((st.token, acc, sums)) if real(x)])
    st = step(jax.tree_util.tree_unflatten(tree, [tie(x[m], after) for x in parts]))
    value, g = st.run(hold, held, later, after)
    mine = {i for c in later for i, _ in st.plan.units[c]}      # leaves of held units: from `scatter_later`
    g = [None if i in mine else x for i, x in enumerate(st.treedef.flatten_up_to(g))]
    held = {h: st.whole[h] for h in hold}
    sums = {c: [a + b for a, b in zip(sums[c], x)] if c in sums else x for c, x in st.later_cts.items()}
    acc = g if acc is None else [a + x if x is not None and real(x) else a for a, x in zip(acc, g)]
    values.append(value)
  once = st.treedef.flatten_up_to(st.scatter_later(sums))
  grads = st.treedef.unflatten([once[i] if x is None else x for i, x in enumerate(acc)])
  mean = (lambda x: x / k if jnp.issubdtype(x.dtype, jnp.inexact) else x) if reduction == "mean" else (lambda x: x)
  leaves = [jnp.stack(xs) for xs in zip(*[jax.tree_util.tree_leaves(v) for v in values])]
  leaves = [leaves[0].sum(0) if reduction == "sum" else leaves[0].mean(0)] + [
      x.mean(0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1] for x in leaves[1:]]
  return (jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(values[0]), leaves),
          jax.tree.map(lambda x: mean(x).astype(x.dtype), grads))


class _Step:
  """One trace of the FSDP step, made inside the shard_map (where the axis and the types are known)."""

  def __init__(self, loss_fn, schedule, axis_name, reduction, gather_cast, layout, params, batch):
    self.layout, self.reduction, self.all_axes = layout, reduction, axis_name
    self.axis, self.replicas = split_axes(schedule, axis_name, "fsdp_grad")   # the shard axes, HSDP's replica axes
    self.one_chain = schedule.fsdp.in_flight == 1     # HSDP: each replica all-reduce before the next reduce-scatter
    self.n = n = axis_size(self.axis, "fsdp_grad")
    self.total = axis_size(axis_name, "fsdp_grad")
    kp, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.flat = flat = [x for _, x in kp]
    self.plan = plan = read_plan(schedule, [path_str(p) for p, _ in kp], [np.shape(x) for x in flat], n)
    self.divisor = engine_divisor(_loss_reduction.divisor(reduction, self.total))[0]
    self.vma = vma = vma_enabled(axis_name)
    # HSDP: the gathered leaves vary over the replica axes, so that autodiff never sums them over those (F7)
    self.local = [to_varying(x, axis_name) if vma and i not in plan.dim_of else self._varying(x) for i, x in
                  enumerate(flat)]
    b_flat, b_tree = jax.tree_util.tree_flatten(batch)
    out_tree: dict = {}

    def flat_loss(*xs):
      out = loss_fn(jax.tree_util.tree_unflatten(self.treedef, list(xs[:len(flat)])),
                    jax.tree_util.tree_unflatten(b_tree, list(xs[len(flat):])))
      leaves, out_tree["tree"] = jax.tree_util.tree_flatten(out)
      return leaves

    whole = []
    for i, x in enumerate(self.local):
      a = jax.typeof(x)
      d = plan.dim_of.get(i)
      whole.append(a if d is None else a.update(shape=a.shape[:d] + (a.shape[d] * n,) + a.shape[d + 1:]))
    self.whole_shape = [a.shape for a in whole]
    jx, consts = flat_jaxpr(flat_loss, *whole, *b_flat)
    self.out_tree = out_tree["tree"]
    self.leaf_var = leaf_var = list(jx.invars[:len(flat)])
    stacked = {i for i, k in plan.slot_of if k is not None}
    self.jx, self.bound, self.cast = rebind_casts(jx, {i: leaf_var[i] for i in plan.dim_of}, gather_cast)
    jx = self.jx
    self.var_slot = {v: (i, None) for i, v in self.bound.items() if i not in stacked}
    self.leaf_index = {v: i for i, v in enumerate(leaf_var)}
    self.static = dict(zip(jx.constvars, consts))
    self.static.update({leaf_var[i]: self.local[i] for i in range(len(flat)) if i not in plan.dim_of})
    self.static.update(zip(jx.invars[len(flat):], b_flat))
    eqns = lazy(jx, set(self.bound.values()) | set(leaf_var))
    # where each leaf is first read (through parameter-only equations, which belong to their reader)
    src = {v: {i} for i, v in self.bound.items()}
    src.update({leaf_var[i]: {i} for i in range(len(flat)) if i not in plan.dim_of})
    pure, self.first, scans_at, block = set(src) | set(jx.constvars), {}, [], 0
    self.defined = {}
    for k, e in enumerate(eqns):
      self.defined.update({o: k for o in e.outvars})
      got = set().union(set(), *[src.get(v, set()) for v in reads(e)])
      if all(v in pure for v in reads(e)) and not e.effects:
        pure.update(e.outvars)
        src.update({o: got for o in e.outvars})
        continue
      at, block = block, k + 1
      if e.primitive.name == "scan" and got & stacked:
        scans_at.append(k)
      for i in got:
        self.first.setdefault(i, at)
    self.pieces = cut(jx, eqns, list(self.first.values()) + scans_at + [k + 1 for k in scans_at])
    self.starts = np.cumsum([0] + [len(p.eqns) for p in self.pieces])
    self.needs = set(self.bound.values()) | set(leaf_var)
    for e in eqns:
      if any(v in self.needs for v in reads(e)):
        self.needs.update(e.outvars)
    self.scans = {self._piece(k): make_scan(self, eqns[k], gather_cast) for k in scans_at}
    for sc in self.scans.values():
      self.cast.update(sc.cast)
    for i, dt in plan.gather_dtype.items():      # the plan's gather dtype, costed by the planner, is what runs
      got = np.dtype(self.cast.get(i, flat[i].dtype)).name
      if got != dt:
        raise ValueError(f"fsdp_grad: the plan gathers leaf {path_str(kp[i][0])!r} in {dt}, but it would gather in "
                         f"{got} (gather_dtype={'auto' if gather_cast else None!r}: a leaf is gathered in another dtype "
                         f"only when its one reader casts it to it); plan without gather_dtype for it, or cast it in "
                         f"loss_fn.")
    self.vjps = [None if s in self.scans else self._split(p) for s, p in enumerate(self.pieces)]
    # the groups outside scanned stacks: the pieces that first and last read each
    self.group_of = {sl: g for g, slots in enumerate(plan.groups) for sl in slots}
    self.first_piece, self.last_piece = {}, {}
    for g, slots in enumerate(plan.groups):
      if all(k is None for _, k in slots) and any(i in self.first for i, _ in slots):
        self.first_piece[g] = self.last_piece[g] = self._piece(min(self.first.get(i, 1 << 62) for i, _ in slots))
    for s, p in enumerate(self.pieces):
      for v in p.ins:
        if v in self.var_slot:
          g = self.group_of[self.var_slot[v]]
          self.last_piece[g] = max(self.last_piece[g], s)

  def _piece(self, k: int) -> int:
    return int(np.searchsorted(self.starts, k, side="right") - 1)

  def _split(self, p) -> SplitVjp:
    diff = [v in self.needs and jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in p.ins]
    rec = [v in self.static or v in self.var_slot for v in p.ins]
    return SplitVjp(sub_fn(p.eqns, p.ins, p.outs, self.jx), [v.aval for v in p.ins], diff, rec)

  def gather(self, g: int, scope: str, after: Any, shards: list | None = None) -> list:
    """Gather group g's whole leaves (a stacked leaf's layer: its slice), tied to `after`; `shards`: this
    device's shards when given (a loop's slice), else read from the parameters."""
    slots = self.plan.groups[g]
    if shards is None:
      shards = [self.flat[i] if k is None else self.flat[i][k] for i, k in slots]
    shards = [self._varying(x.astype(self.cast[i]) if i in self.cast else x) for (i, _), x in zip(slots, shards)]
    if getattr(self, "after", None) is not None:    # a later micro-batch's: never the same value as an earlier one's
      after = last([after, self.after])
    return gather(shards, [self.plan.dim_of[i] - (k is not None) for i, k in slots], self.axis, self.n,
                  f"{scope}{g}", self.layout, after)

  def _varying(self, x: Any) -> Any:
    """A sharded leaf's value made varying over HSDP's replica axes (under shard_map's varying checks)."""
    return to_varying(x, self.replicas) if self.vma and self.replicas and not is_varying(x, self.replicas) else x

  def value(self, v: Any, live: dict) -> Any:
    """What backward can read again of a value: a constant, a parameter, the batch, a live gathered leaf
    (None for an activation)."""
    if isinstance(v, Literal):
      return v.val
    if v in self.static:
      return self.static[v]
    if v in self.var_slot and self.group_of[self.var_slot[v]] in live:
      g = self.group_of[self.var_slot[v]]
      return live[g][self.plan.groups[g].index(self.var_slot[v])]
    return None

  def accumulate(self, vars_: list, cts: list, anchor: Any) -> Any:
    """Adds cotangents: a parameter's to its leaf's, an activation's to its own (the new anchor)."""
    for v, c in zip(vars_, cts):
      if c is None or isinstance(v, Literal):
        continue
      i = self.var_slot[v][0] if v in self.var_slot else self.leaf_index.get(v)
      if i is not None:
        self.ct_leaf[i] = c if i not in self.ct_leaf else self.ct_leaf[i] + c
      elif v not in self.static:
        self.ct[v] = c if v not in self.ct else self.ct[v] + c
        anchor = c
    return anchor

  # ---------------- forward

  def run(self, hold=(), held=None, later=(), after=None):
    """The step (forward, then `_backward`); accumulating (`_accumulate`): `hold` the groups kept to the end
    (and in `self.whole`), `held` those gathered by an earlier micro-batch, `later` the units whose whole
    gradient is left in `self.later_cts` unscattered, `after` what the first gathers wait for."""
    plan, pieces, d = self.plan, self.pieces, self.plan.prefetch
    self.hold, self.later, self.later_cts, self.after, held = set(hold), set(later), {}, after, held or {}
    self.token = (after, after) if self.replicas else after     # HSDP: the reduce-scatters' and all-reduces' chains
    if any(set(sc.groups) & self.hold or set(sc.units) & self.later for sc in self.scans.values()):
      raise ValueError("fsdp_grad: the plan holds a scanned stack's layer across micro-batches; the step "
                       "gathers and reduce-scatters a stack inside its loop each micro-batch. Plan it again.")
    needs_at: dict[int, list[int]] = {}
    for g, s in self.first_piece.items():
      needs_at.setdefault(s, []).append(g)
    for s, sc in self.scans.items():
      needs_at.setdefault(s, []).append(sc.groups[0])
    steps = sorted(needs_at)
    issue: dict[int, list[int]] = {}
    for j, s in enumerate(steps):
      issue.setdefault(steps[j - d] if j >= d else -1, []).extend(needs_at[s])
    waits = {steps[j]: needs_at[steps[j - 1 + d]] for j in range(1, len(steps) - d + 1)
             if d > 1 and steps[j] not in self.scans}
    issue = {s: [g for g in gs if g not in held] for s, gs in issue.items()}
    env, whole, kept, saved = dict(self.static), dict(held), {}, [None] * len(pieces)
    for g in issue.get(-1, ()):
      whole[g] = self.gather(g, AG_SCOPE, after)
    for s, p in enumerate(pieces):
      x = max((v for v in p.ins if v in self.defined and v in env), key=self.defined.get, default=None)
      if s in self.scans:
        def tail(anchor, s=s):
          whole.update({g: self.gather(g, AG_SCOPE, anchor) for g in issue.get(s, ())})
        self._bind(env, whole)
        outs, saved[s] = scan_forward(self, self.scans[s], [self.value(v, {}) if v not in env else env[v]
                                                            for v in p.eqns[0].invars], whole, tail)
        outs = [dict(zip(p.eqns[0].outvars, outs))[v] for v in p.outs]
      else:
        whole.update({g: self.gather(g, AG_SCOPE, None if x is None else env[x]) for g in issue.get(s, ())})
        self._bind(env, whole)
        if s in waits and x is not None:
          env[x] = tie(env[x], last([w for g in waits[s] for w in whole.get(g, ())]))
        outs, saved[s] = self.vjps[s].forward([env[v] for v in p.ins])
      env.update(zip(p.outs, outs))
      kept.update({g: w for g, w in whole.items() if plan.keep[g] or g in self.hold})
    self.whole = {g: w for g, w in whole.items() if g in self.hold}
    values = [v.val if isinstance(v, Literal) else env[v] for v in self.jx.outvars]
    grads = self._backward(saved, kept, values[0])
    return jax.tree_util.tree_unflatten(self.out_tree, values), jax.tree_util.tree_unflatten(self.treedef, grads)

  def _bind(self, env: dict, whole: dict) -> None:
    for g, w in whole.items():
      env.update({self.bound[i]: x for (i, k), x in zip(self.plan.groups[g], w) if k is None})

  # ---------------- backward

  def _backward(self, saved, kept, loss):
    plan, pieces = self.plan, self.pieces
    self.ct, self.ct_leaf, self.rep_parts, self.stack_parts = {self.jx.outvars[0]: jnp.ones_like(loss)}, {}, {}, {}
    self.pending = sorted({*plan.units, *plan.replicated})
    self.done = {sl for sl in plan.slot_of if sl[0] not in self.first}
    bneeds: dict[int, list[int]] = {}
    for g, s in self.last_piece.items():
      if not (plan.keep[g] or g in self.hold):
        bneeds.setdefault(s, []).append(g)
    for s, sc in self.scans.items():
      if not sc.runs[-1][2]:
        bneeds.setdefault(s, []).append(sc.groups[-1])
    bsteps = sorted(bneeds, reverse=True)
    regather: dict[int, list[int]] = {}
    for j, s in enumerate(bsteps):
      at = bsteps[j - plan.backward_prefetch] if j >= plan.backward_prefetch else len(pieces)
      regather.setdefault(at, []).extend(bneeds[s])
    live, anchor = dict(kept), loss
    live.update({g: self.gather(g, REAG_SCOPE, anchor) for g in regather.get(len(pieces), ())})
    for s in range(len(pieces) - 1, -1, -1):
      p = pieces[s]
      if s in self.scans:
        def tail(anchor, s=s):
          live.update({g: self.gather(g, REAG_SCOPE, anchor) for g in regather.get(s, ())})
        self._issue_ready()
        anchor = scan_backward(self, self.scans[s], saved[s], live, tail, anchor)
      else:
        live.update({g: self.gather(g, REAG_SCOPE, anchor) for g in regather.get(s, ())})
        cts = self.vjps[s].backward(saved[s], [self.value(v, live) for v in p.ins],
                                    [self.ct.pop(v, None) for v in p.outs])
        anchor = self.accumulate([v for v, d in zip(p.ins, self.vjps[s].diff) if d], cts, anchor)
      saved[s] = None
      for g in [g for g, f in self.first_piece.items() if f == s]:
        live.pop(g, None)
      self.done.update(sl for sl in plan.slot_of if self.first.get(sl[0], -1) >= self.starts[s])
      self._issue_ready()
    self.done.update(plan.slot_of)
    self._issue_ready()
    return self._assemble()

  def _issue_ready(self):
    """Issues, in the plan's chunk order, every chunk whose leaves' gradients are whole (a chunk waits for
    the ones before it): a unit's reduce-scatter, a replicated chunk's all-reduce, on one token chain."""
    plan = self.plan
    while self.pending:
      k = self.pending[0]
      slots = plan.units[k] if k in plan.units else [plan.slot_of[r] for r, _, _ in plan.replicated[k].slices]
      if not all(sl in self.done for sl in slots):
        return
      self.pending.pop(0)
      if k in self.later:
        self.later_cts[k] = [self._ct_slot(sl) for sl in slots]
        continue
      if k in plan.units:
        out, self.token = scatter([self._ct_slot(sl) for sl in slots], [plan.dim_of[i] - (j is not None)
                                  for i, j in slots], self.axis, self.n, self.divisor, f"{RS_SCOPE}{k}", self.layout,
                                  self.token, self.replicas, self.one_chain)
        self.rep_parts.update({sl: [(0, x)] for sl, x in zip(slots, out)})
        continue
      c = plan.replicated[k]
      parts = [self._ct_slot(plan.slot_of[r]).reshape(-1)[a:b] for r, a, b in c.slices]
      one = Chunk(slices=tuple((j, 0, b - a) for j, (_, a, b) in enumerate(c.slices)), dtype=c.dtype)
      prev = self.token[1] if self.replicas else self.token    # HSDP: on the replica all-reduces' chain
      red, tok, _ = reduce_units(parts, [one], tuple(range(len(parts))), self.all_axes, first_index=k,
                                 divisor=_loss_reduction.divisor(self.reduction, self.total), prev=prev)
      self.token = (self.token[0], tok) if self.replicas else tok
      for (r, a, _), x in zip(c.slices, red):
        self.rep_parts.setdefault(plan.slot_of[r], []).append((a, x))

  def scatter_later(self, sums: dict) -> list:
    """The gradients (laid out as `_assemble`'s, zeros elsewhere) of the units in `sums` (chunk -> their whole
    gradients summed over the micro-batches), each reduce-scattered once in chunk order after this step's."""
    self.rep_parts, self.stack_parts = {}, {}
    for k in sorted(sums):
      slots = self.plan.units[k]
      out, self.token = scatter(sums[k], [self.plan.dim_of[i] for i, _ in slots], self.axis, self.n, self.divisor,
                                f"{RS_SCOPE}{k}", self.layout, self.token, self.replicas, self.one_chain)
      self.rep_parts.update({sl: [(0, x)] for sl, x in zip(slots, out)})
    return jax.tree_util.tree_unflatten(self.treedef, self._assemble())

  def _ct_slot(self, slot):
    """A slot's whole gradient on this device (unreduced) in its leaf's dtype; zeros if it has none."""
    i, k = slot
    c = self.ct_leaf.get(i)
    if c is None:
      return jnp.zeros(self.whole_shape[i][k is not None:], self.flat[i].dtype)
    return (c if k is None else c[k]).astype(self.flat[i].dtype)

  def _assemble(self):
    """The gradients laid out as the parameters: each sharded leaf's shard (a stack's, layer by layer),
    each replicated leaf whole (its chunks' parts put back)."""
    grads = []
    for i, x in enumerate(self.flat):
      if i in self.stack_parts:
        grads.append(jnp.concatenate([p for _, p in sorted(self.stack_parts[i], key=lambda t: t[0])]))
        continue
      layers = sorted(k for j, k in self.plan.slot_of if j == i and k is not None)
      per = []
      for k in layers or [None]:
        got = [g.reshape(-1) for _, g in sorted(self.rep_parts.get((i, k), []), key=lambda t: t[0])]
        shape = np.shape(x)[k is not None:]
        per.append(jnp.concatenate(got).reshape(shape) if got else np.zeros(shape, x.dtype if jnp.issubdtype(
            x.dtype, jnp.inexact) else jax.dtypes.float0))
      grads.append(jnp.stack(per) if layers else per[0])
    return grads
