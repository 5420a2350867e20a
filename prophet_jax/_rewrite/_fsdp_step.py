"""The per-device FSDP step: an FSDP plan (`Schedule.fsdp`) carried out inside the user's `shard_map`.

`fsdp_grad(loss_fn, schedule, axis_name=...)` returns `grad_fn(param_shards, batch) -> (loss, grad_shards)`.
`loss_fn(params, batch)` is the user's, written for whole parameters (linen `apply`, an nnx `merge`, plain
JAX: the step sees only its jaxpr). The step traces it once on the gathered parameters' types, cuts it
where each gather group is first read (`_fsdp_trace`), and runs the pieces itself:

- forward: gather group g's all-gather is issued when the piece of the group `prefetch` before it
  starts, its buffer tied to that piece's input activation (docs/facts.md F2); a scanned stack (a
  `lax.scan` over stacked leaves: linen `nn.scan`, `nnx.scan`, `jax.lax.scan`) gathers layer k + 1 inside
  the loop while layer k computes, the gathered layer carried, never saved;
- backward: the pieces in reverse, each saving only the residuals that depend on activations
  (`SplitVjp`): a group the plan does not keep is gathered again when the backward of the group
  `backward_prefetch` before it starts, tied to that point's cotangent; a kept group's gathered
  leaves are held from forward. Each unit is reduce-scattered once its leaves' gradients are whole, in
  the plan's chunk order, on one token chain with the replicated leaves' all-reduces (the library's
  engine, `_collectives.reduce_units`); in a scanned stack, one reduce-scatter per iteration.

docs/design.md, "FSDP in the user's step: the mechanism", says why it is built this way and what the
compiled programs show.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from . import _loss_reduction
from ._collectives import _hooked, axis_size, reduce_units, tie, to_varying, vma_enabled
from ._fsdp_trace import SplitVjp, flat_jaxpr, reads, scan_parts, sub_fn, zero_like
from .._values._schedule import Chunk, Schedule
from .._values._tree import path_str

__all__ = ["fsdp_grad", "unstack", "LAYOUTS", "AG_SCOPE", "REAG_SCOPE", "RS_SCOPE"]

LAYOUTS = ("packed", "leaf")
AG_SCOPE = "prophet/fsdp/ag"       # + gather group g: its forward all-gather
REAG_SCOPE = "prophet/fsdp/reag"   # + g: its all-gather again in backward
RS_SCOPE = "prophet/fsdp/rs"       # + chunk k: a unit's reduce-scatter
_CAST = "convert_element_type"


def unstack(tree: Any, stacked: Sequence[str], shardings: Any = None) -> Any:
  """The per-layer view of a scanned model, for its profile: an OrderedDict {path: leaf} in `tree`'s
  flatten order where each leaf under a `stacked` prefix (its leading axis the layer) becomes one leaf per
  layer at `<prefix>/<k>/<rest>` (layers in order, a stack's leaves side by side). With `shardings` (a
  tree of PartitionSpecs or NamedShardings), also their per-layer view (a stacked leaf's spec loses its
  leading entry), as a second OrderedDict: `GradientProfile.from_params(*unstack(params, ("stack",),
  specs), mesh=...)` plans the stack per layer, and `fsdp_grad` maps its rows back to slices."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  specs = [None] * len(leaves) if shardings is None else jax.tree_util.tree_structure(tree).flatten_up_to(shardings)
  out, out_specs, done = collections.OrderedDict(), collections.OrderedDict(), set()
  for (kp, leaf), spec in zip(leaves, specs):
    path = path_str(kp)
    pre = _prefix(path, stacked)
    spec = getattr(spec, "spec", spec)
    if pre is None:
      out[path], out_specs[path] = leaf, (None if spec is None else tuple(spec))
      continue
    if pre in done:
      continue
    done.add(pre)
    members = [(path_str(k), x, getattr(s, "spec", s)) for (k, x), s in zip(leaves, specs)
               if _prefix(path_str(k), stacked) == pre]
    for i in range(np.shape(leaf)[0]):
      for p, x, s in members:
        key = f"{pre}/{i}/{p[len(pre) + 1:]}"
        out[key] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[i]
        out_specs[key] = None if s is None else tuple(s)[1:]
  return out if shardings is None else (out, out_specs)


def _prefix(path: str, stacked: Sequence[str]) -> str | None:
  return next((p.rstrip("/") for p in stacked if path.startswith(p.rstrip("/") + "/")), None)


# --------------------------------------------------------------------------------------------------
# the plan, mapped to the parameters: a slot is (leaf, layer), layer None for an unstacked leaf


class Plan(NamedTuple):
  """The schedule as the step reads it."""

  slot_of: tuple[tuple[int, int | None], ...]   # per schedule row
  dim_of: dict[int, int]                        # sharded leaf -> its sharded dimension (of the leaf)
  groups: tuple[tuple[tuple[int, int | None], ...], ...]   # gather groups, forward order
  keep: tuple[bool, ...]
  units: dict[int, tuple[tuple[int, int | None], ...]]     # chunk -> the slots it reduce-scatters
  replicated: dict[int, Chunk]                  # chunk -> its all-reduce (slices of rows)
  order: tuple[int, ...]                        # chunk issue order
  prefetch: int
  backward_prefetch: int


def _read_plan(schedule: Schedule, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], n: int) -> Plan:
  f = schedule.fsdp
  if f is None:
    raise ValueError(f"fsdp_grad: schedule (policy {schedule.policy!r}) is not an FSDP plan; plan it with "
                     f"plan(profile, network, 'fsdp', ...).")
  index = {p: i for i, p in enumerate(paths)}
  slots = []
  for path, shape, _ in schedule.rows:
    i = index.get(path, index.get(f"{path}/value"))
    slot = (i, None)
    if i is None:                       # a stacked leaf's layer: <prefix>/<k>/<rest>
      for m in re.finditer(r"/(\d+)/", "/" + path + "/"):
        whole = path[:max(m.start() - 1, 0)] + path[m.end() - 2:] if m.start() else path[m.end() - 1:]
        j = index.get(whole.strip("/"), index.get(whole.strip("/") + "/value"))
        if j is not None and len(shapes[j]) == len(shape) + 1:
          slot = (j, int(m.group(1)))
          break
    if slot[0] is None:
      raise ValueError(f"fsdp_grad: the plan's leaf {path!r} is not among the parameters (their paths "
                       f"look like {list(paths)[:3]}); a scanned stack's layers are planned as "
                       f"'<prefix>/<k>/<rest>' (unstack).")
    slots.append(slot)
  dim_of = {}
  for r, d in enumerate(f.shard_dims):
    if d is None:
      continue
    i, k = slots[r]
    dd = d if k is None else d + 1
    want = tuple(schedule.rows[r][1])
    got = tuple(shapes[i]) if k is None else tuple(shapes[i][1:])
    dl = dd if k is None else d
    if got[:dl] + (got[dl] * n,) + got[dl + 1:] != want:
      raise ValueError(f"fsdp_grad: parameter {paths[i]!r} has shard shape {tuple(shapes[i])}; the plan "
                       f"splits dimension {d} of {want} over {n} devices (place it as planned).")
    dim_of[i] = dd
  chunks = schedule.chunks
  units = {u: tuple(slots[r] for r, _, _ in chunks[u].slices) for u in f.units}
  groups = (tuple(tuple(slots[r] for r in g) for g in f.gathers) if f.gathers
            else tuple(units[u] for u in f.units))
  replicated = {k: c for k, c in enumerate(chunks) if k not in units}
  return Plan(tuple(slots), dim_of, groups, f.keep, units, replicated, tuple(range(len(chunks))),
              f.prefetch, f.backward_prefetch)


# --------------------------------------------------------------------------------------------------
# the collectives of one group or unit


def _key(name: str):
  from jax.experimental.xla_metadata import set_xla_metadata  # noqa: PLC0415 (loaded when a step traces)
  return set_xla_metadata(combiner_key=name)


def gather(shards: Sequence[Any], dims: Sequence[int], axis_name: Any, n: int, scope: str, layout: str,
           after: Any) -> list:
  """The whole leaves of `shards` (each split on `dims[i]`): one all-gather (`packed`) or one per leaf
  (`leaf`), its input tied to `after`, under one XLA combiner key (`scope`: XLA:GPU never joins two
  groups' gathers, and joins a group's per-leaf gathers into one)."""
  with jax.named_scope(scope), _key(scope):
    if layout == "leaf":
      return [jnp.moveaxis(jax.lax.all_gather(tie(jnp.moveaxis(s, d, 0), after), axis_name, axis=0, tiled=True), 0, d)
              for s, d in zip(shards, dims)]
    moved = [jnp.moveaxis(s, d, 0) for s, d in zip(shards, dims)]
    buf = jnp.concatenate([m.reshape(-1) for m in moved]) if len(moved) > 1 else moved[0].reshape(-1)
    full = jax.lax.all_gather(tie(buf, after), axis_name, axis=0, tiled=True).reshape(n, -1)
  out, off = [], 0
  for m, d in zip(moved, dims):
    part = full[:, off:off + m.size].reshape((n * m.shape[0],) + m.shape[1:])
    out.append(jnp.moveaxis(part, 0, d))
    off += m.size
  return out


def scatter(cts: Sequence[Any], dims: Sequence[int], axis_name: Any, n: int, divisor: Any, scope: str,
            layout: str, after: Any) -> list:
  """Each device's shard of the sum over the axis of `cts` (whole leaves split on `dims`), divided by
  `divisor`: one reduce-scatter (`packed`) or one per leaf (`leaf`), tied to `after`, under one combiner
  key (`scope`)."""
  with jax.named_scope(scope), _key(scope):
    if layout == "leaf":
      out = [jnp.moveaxis(jax.lax.psum_scatter(tie(jnp.moveaxis(c, d, 0), after), axis_name, scatter_dimension=0,
                                               tiled=True), 0, d) for c, d in zip(cts, dims)]
    else:
      moved = [jnp.moveaxis(c, d, 0) for c, d in zip(cts, dims)]
      buf = jnp.concatenate([m.reshape(n, -1) for m in moved], axis=1).reshape(-1)
      red = jax.lax.psum_scatter(tie(buf, after), axis_name, scatter_dimension=0, tiled=True)
      out, off = [], 0
      for m, d in zip(moved, dims):
        size = m.size // n
        out.append(jnp.moveaxis(red[off:off + size].reshape((m.shape[0] // n,) + m.shape[1:]), 0, d))
        off += size
    return [x if divisor is None else x / jnp.asarray(divisor, x.dtype) for x in out]


def _last(xs: Sequence[Any]) -> Any:
  """One value that depends on every array of `xs` (the tie's `prev` for a group of results)."""
  xs = [x for x in xs if x is not None]
  if len(xs) <= 1:
    return xs[0] if xs else None
  return sum(x.reshape(-1)[0].astype(jnp.float32) for x in xs)


# --------------------------------------------------------------------------------------------------
# the traced loss cut into pieces


class Piece(NamedTuple):
  eqns: tuple
  ins: tuple                  # vars read, defined before
  outs: tuple                 # vars defined here and read later (or returned)


def _lazy(jaxpr: Any, pure_vars: set) -> list:
  """The equations with every one that reads only parameters and constants moved to just before its
  first reader (a cast or transpose of a weight is computed where the weight is used, so it does not
  pull the weight's gather forward)."""
  pure = set(pure_vars) | set(jaxpr.constvars)
  pending: dict = {}
  out: list = []

  def emit(v):
    e = pending.pop(v, None)
    if e is None:
      return
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


def _cut(jaxpr: Any, eqns: list, cuts: Sequence[int]) -> list[Piece]:
  """`eqns` cut at the positions `cuts`."""
  cuts = sorted({0, len(eqns), *[c for c in cuts if 0 < c < len(eqns)]})
  defined_at = {o: k for k, e in enumerate(eqns) for o in e.outvars}
  last_read: dict = {}
  for k, e in enumerate(eqns):
    for v in reads(e):
      last_read[v] = k
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      last_read[v] = len(eqns)
  pieces = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    ins = list(dict.fromkeys(v for e in eqns[a:b] for v in reads(e) if not a <= defined_at.get(v, -1) < b))
    outs = [o for e in eqns[a:b] for o in e.outvars if last_read.get(o, -1) >= b]
    pieces.append(Piece(tuple(eqns[a:b]), tuple(ins), tuple(outs)))
  return pieces


def _rebind_casts(jaxpr: Any, vars_: dict, gather_dtype: Any) -> tuple[Any, dict, dict]:
  """Gathering in the compute dtype: for each key's var (`vars_`: key -> var) read only by one cast to
  another float dtype, the cast's result becomes the key's var and the cast is dropped. Returns (the
  jaxpr, key -> bound var, key -> the dtype to cast the shard to)."""
  if gather_dtype != "auto":
    return jaxpr, dict(vars_), {}
  readers: dict = {}
  for e in jaxpr.eqns:
    for v in reads(e):
      readers.setdefault(v, []).append(e)
  bound, cast, drop = dict(vars_), {}, set()
  for key, v in vars_.items():
    rs = readers.get(v, [])
    if len(rs) == 1 and rs[0].primitive.name == _CAST and v not in jaxpr.outvars and jnp.issubdtype(
        rs[0].outvars[0].aval.dtype, jnp.floating):
      bound[key], cast[key] = rs[0].outvars[0], rs[0].outvars[0].aval.dtype
      drop.add(id(rs[0]))
  return jaxpr.replace(eqns=[e for e in jaxpr.eqns if id(e) not in drop]), bound, cast


# --------------------------------------------------------------------------------------------------
# the step


def fsdp_grad(loss_fn: Callable[..., Any], schedule: Schedule, *, axis_name: Any, reduction: str = "mean",
              gather_dtype: str | None = "auto", layout: str = "packed") -> Callable[..., Any]:
  """`grad_fn(param_shards, batch) -> (loss, grad_shards)` carrying out an FSDP plan, per device.

  Call `grad_fn` inside `jax.shard_map` over `axis_name`, the parameters placed as the plan says (each
  sharded leaf split over the axis on its planned dimension: `P("data", None)`; a scanned stack's
  leaves on that dimension + 1: `P(None, "data", None)`; the rest `P()`), the batch split over the axis.

  Args:
    loss_fn: `loss_fn(params, batch)` on whole parameters: the loss, or a tuple (pytree) whose first
      leaf is the loss (the rest is returned as computed, not differentiated); a mean over its examples
      (`reduction="sum"`: a sum).
    schedule: an FSDP plan (`plan(profile, network, "fsdp", ...)`); a scanned stack planned per layer
      (its rows `<prefix>/<k>/<rest>`, `unstack`), each layer one gather group and one unit.
    axis_name: the data axis the parameters are sharded over.
    gather_dtype: "auto" (the default): a sharded leaf whose only reader casts it to another float
      dtype (a bf16 model over f32 shards) is cast before its all-gather, so it gathers in the compute
      dtype; its reduce-scatter is in the leaf's dtype. None: every leaf gathers in its own dtype.
    layout: "packed" (the default): one all-gather and one reduce-scatter per group and unit on every
      backend; "leaf": one collective per leaf under one XLA combiner key per group or unit.

  Returns:
    `grad_fn(param_shards, batch)`: this device's loss (as `loss_fn` returns it) and the gradients laid
    out as `param_shards` (the mean over the global batch for `reduction="mean"`).

  Example:
    >>> grad_fn = fsdp_grad(loss_fn, schedule, axis_name="data")       # doctest: +SKIP
    >>> step = jax.shard_map(grad_fn, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
  """
  _loss_reduction.check(reduction, "fsdp_grad")
  if layout not in LAYOUTS:
    raise ValueError(f"fsdp_grad(layout={layout!r}): expected one of {LAYOUTS}.")
  if gather_dtype not in ("auto", None):
    raise ValueError(f"fsdp_grad(gather_dtype={gather_dtype!r}): expected 'auto' or None.")

  def grad_fn(params, batch):
    return _Step(loss_fn, schedule, axis_name, reduction, gather_dtype, layout, params, batch).run()

  return grad_fn


class _Scan(NamedTuple):
  """A scanned stack: the scan equation's piece, its body as one layer's function, and per layer its
  gather group, unit and keep."""

  piece: int
  eqn: Any
  n_consts: int
  n_carry: int
  length: int
  xs_slot: tuple                 # per xs operand: ("shard", leaf) / ("rep", leaf) / ("other", None)
  cast: dict                     # shard leaf -> dtype to cast its slice to before gathering
  vjp: SplitVjp                  # one layer: (body consts, consts, carry, xs) -> (carry, ys)
  body_consts: list
  groups: tuple                  # per layer: its gather group
  units: tuple                   # per layer: its unit's chunk
  runs: tuple                    # (first layer, end layer, keep): runs of equal keep


class _Step:
  """One trace of the FSDP step (built inside the shard_map, where the axis and the types are known)."""

  def __init__(self, loss_fn, schedule, axis_name, reduction, gather_dtype, layout, params, batch):
    self.axis, self.layout, self.reduction = axis_name, layout, reduction
    self.n = n = axis_size(axis_name, "fsdp_grad")
    vma = vma_enabled(axis_name)
    kp, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.flat = flat = [x for _, x in kp]
    paths = [path_str(p) for p, _ in kp]
    self.plan = plan = _read_plan(schedule, paths, [np.shape(x) for x in flat], n)
    self.divisor = _hooked(_loss_reduction.divisor(reduction, n))[0]
    self.local = [to_varying(x, axis_name) if vma and i not in plan.dim_of else x for i, x in enumerate(flat)]
    b_flat, b_tree = jax.tree_util.tree_flatten(batch)
    out_tree: dict[str, Any] = {}

    def flat_loss(*xs):
      out = loss_fn(jax.tree_util.tree_unflatten(self.treedef, list(xs[:len(flat)])),
                    jax.tree_util.tree_unflatten(b_tree, list(xs[len(flat):])))
      leaves, out_tree["tree"] = jax.tree_util.tree_flatten(out)
      return leaves

    jx, consts = flat_jaxpr(flat_loss, *[self._whole_aval(i) for i in range(len(flat))], *b_flat)
    self.out_tree = out_tree["tree"]
    self.leaf_var = leaf_var = list(jx.invars[:len(flat)])
    stacked = {i for i, k in plan.slot_of if k is not None}
    jx, bound, self.cast = _rebind_casts(jx, {i: leaf_var[i] for i in plan.dim_of if i not in stacked}, gather_dtype)
    self.bound, self.jx = bound, jx
    self.var_slot = {v: (i, None) for i, v in bound.items()}
    self.static = dict(zip(jx.constvars, consts))
    self.static.update({leaf_var[i]: self.local[i] for i in range(len(flat)) if i not in plan.dim_of})
    self.static.update(zip(jx.invars[len(flat):], b_flat))
    eqns = _lazy(jx, set(bound.values()) | set(leaf_var))
    # cut where each group (and each leaf) is first read, through parameter-only equations; a scan over
    # stacked leaves is a piece of its own
    src = {v: {i} for i, v in bound.items()}
    src.update({leaf_var[i]: {i} for i in range(len(flat)) if i not in plan.dim_of or i in stacked})
    pure, first, scans_at, block = set(src) | set(jx.constvars), {}, [], 0
    for k, e in enumerate(eqns):
      got = set().union(set(), *[src.get(v, set()) for v in reads(e)])
      if all(v in pure for v in reads(e)) and not e.effects:
        pure.update(e.outvars)
        src.update({o: got for o in e.outvars})
        continue
      # the parameter-only equations `_lazy` put just before this one are its: a cut goes before them
      at, block = block, k + 1
      if e.primitive.name == "scan" and got & stacked:
        scans_at.append((k, k + 1))
      for i in got:
        first.setdefault(i, at)
    self.first = first
    self.pieces = pieces = _cut(jx, eqns, list(first.values()) + [c for ab in scans_at for c in ab])
    starts = np.cumsum([0] + [len(p.eqns) for p in pieces])
    self.piece_at = lambda k: int(np.searchsorted(starts, k, side="right") - 1)
    self.starts = starts
    needs = set(bound.values()) | set(leaf_var)
    for e in eqns:
      if any(v in needs for v in reads(e)):
        needs.update(e.outvars)
    self.needs = needs
    self.scans = {self.piece_at(a): self._scan(self.piece_at(a), eqns[a], gather_dtype) for a, _ in scans_at}
    self.vjps = [None if s in self.scans else self._split(p) for s, p in enumerate(pieces)]

  # ---------------- trace-time helpers

  def _whole_aval(self, i):
    a = jax.typeof(self.local[i])
    if i not in self.plan.dim_of:
      return a
    d = self.plan.dim_of[i]
    return a.update(shape=a.shape[:d] + (a.shape[d] * self.n,) + a.shape[d + 1:])

  def _split(self, p: Piece) -> SplitVjp:
    avals = [v.aval for v in p.ins]
    diff = [v in self.needs and jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in p.ins]
    rec = [v in self.static or v in self.var_slot for v in p.ins]
    return SplitVjp(sub_fn(p.eqns, p.ins, p.outs, self.jx), avals, diff, rec)

  def _scan(self, s: int, eqn: Any, gather_dtype: Any) -> _Scan:
    plan = self.plan
    if eqn.params.get("reverse"):
      raise ValueError("fsdp_grad: a reversed scan over stacked parameters is not supported; scan forward.")
    nc, ncar = scan_parts(eqn)
    length = eqn.params["length"]
    body = eqn.params["jaxpr"]
    bj = getattr(body, "jaxpr", body)
    bconsts = list(getattr(body, "consts", ()))
    top_xs = eqn.invars[nc + ncar:]
    var_leaf = {v: i for i, v in enumerate(self.leaf_var)}
    xs_slot, shard_vars = [], {}
    for v, bv in zip(top_xs, bj.invars[nc + ncar:]):
      i = var_leaf.get(v) if not isinstance(v, Literal) else None
      if i is not None and i in plan.dim_of:
        xs_slot.append(("shard", i))
        shard_vars[i] = bv
      elif i is not None:
        xs_slot.append(("rep", i))
      else:
        xs_slot.append(("other", None))
    bj, bound, cast = _rebind_casts(bj, shard_vars, gather_dtype)
    ins = list(bj.constvars) + list(bj.invars)
    for j, (kind, i) in enumerate(xs_slot):
      if kind == "shard":
        ins[len(bj.constvars) + nc + ncar + j] = bound[i]
    top = list(eqn.invars)
    avals = [v.aval for v in ins]
    diff, rec = [False] * len(bj.constvars), [True] * len(bj.constvars)
    for j, v in enumerate(top):
      float_ = jnp.issubdtype(avals[len(bj.constvars) + j].dtype, jnp.inexact)
      lit = isinstance(v, Literal)
      if j < nc:
        diff.append(float_ and not lit and v in self.needs)
        rec.append(lit or v in self.static or v in self.var_slot)
      elif j < nc + ncar:
        diff.append(float_)
        rec.append(False)
      else:
        kind = xs_slot[j - nc - ncar][0]
        diff.append(float_ and (kind != "other" or (not lit and v in self.needs)))
        rec.append(kind != "other" or lit or v in self.static)
    carry_in = [len(bj.constvars) + nc <= j < len(bj.constvars) + nc + ncar for j in range(len(ins))]
    vjp = SplitVjp(sub_fn(bj.eqns, ins, bj.outvars, bj), avals, diff, rec, forward_in=carry_in,
                   forward_out=[j < ncar for j in range(len(bj.outvars))])
    shard_leaves = sorted(i for kind, i in xs_slot if kind == "shard")
    groups, units = [], []
    for k in range(length):
      want = {(i, k) for i in shard_leaves}
      g = [g for g, slots in enumerate(plan.groups) if set(slots) & want]
      u = [u for u, slots in plan.units.items() if set(slots) & want]
      if len(g) != 1 or set(plan.groups[g[0]]) != want or len(u) != 1 or set(plan.units[u[0]]) != want:
        raise ValueError(f"fsdp_grad: layer {k} of a scanned stack must be exactly one gather group and one "
                         f"unit (its slices of every sharded stacked leaf); the plan groups it otherwise. "
                         f"Plan the stack per layer (bucket_bytes of one layer).")
      groups.append(g[0])
      units.append(u[0])
    runs, a = [], 0
    for k in range(1, length + 1):
      if k == length or plan.keep[groups[k]] != plan.keep[groups[a]]:
        runs.append((a, k, plan.keep[groups[a]]))
        a = k
    return _Scan(s, eqn, nc, ncar, length, tuple(xs_slot), cast, vjp, bconsts, tuple(groups), tuple(units),
                 tuple(runs))

  def _dims(self, slots):
    return [self.plan.dim_of[i] - (k is not None) for i, k in slots]

  def _shards(self, slots, cast):
    out = []
    for i, k in slots:
      x = self.flat[i] if k is None else self.flat[i][k]
      dt = cast.get(i)
      out.append(x if dt is None else x.astype(dt))
    return out

  def _gather(self, g, scope, after, cast=None):
    slots = self.plan.groups[g]
    return gather(self._shards(slots, self.cast if cast is None else cast), self._dims(slots), self.axis, self.n,
                  f"{scope}{g}", self.layout, after)

  # ---------------- run

  def run(self):
    plan, pieces = self.plan, self.pieces
    # the forward slots: outer groups in the order their pieces read them; a scan is one slot (its first
    # layer's group), and gathers its other layers itself
    scan_groups = {g for sc in self.scans.values() for g in sc.groups}
    first_g = {g: min(self.first.get(i, len(self.starts)) for i, _ in plan.groups[g])
               for g in range(len(plan.groups)) if g not in scan_groups}
    slots = sorted([(self.piece_at(p) if p < self.starts[-1] else len(pieces) - 1, g) for g, p in first_g.items()]
                   + [(s, sc.groups[0]) for s, sc in self.scans.items()])
    issue: dict[int, list[int]] = {}
    for j, (s, g) in enumerate(slots):
      at = slots[j - plan.prefetch][0] if j >= plan.prefetch else -1
      issue.setdefault(at, []).append(g)
    waits: dict[int, int] = {}
    for j in range(1, len(slots)):
      k = j - 1 + plan.prefetch
      if k < len(slots) and k != j and slots[j][0] not in self.scans:
        waits.setdefault(slots[j][0], slots[k][1])
    env = dict(self.static)
    whole: dict[int, list] = {}
    for g in issue.get(-1, ()):
      whole[g] = self._gather(g, AG_SCOPE, None)
    saved: list = [None] * len(pieces)
    kept: dict[int, list] = {}
    for s, p in enumerate(pieces):
      x = self._latest(p.ins, env)
      if s in self.scans:
        def tail(anchor, s=s):
          for g in issue.get(s, ()):
            whole[g] = self._gather(g, AG_SCOPE, anchor)
        ins = [v.val if isinstance(v, Literal) else env.get(v) for v in p.eqns[0].invars]
        outs, saved[s] = self._scan_forward(self.scans[s], ins, whole, tail)
        outs = dict(zip(p.eqns[0].outvars, outs))
        outs = [outs[v] for v in p.outs]
      else:
        for g in issue.get(s, ()):
          whole[g] = self._gather(g, AG_SCOPE, None if x is None else env[x])
        for g, w in whole.items():
          for (i, k), wi in zip(plan.groups[g], w):
            if k is None:
              env[self.bound[i]] = wi
        if s in waits and x is not None and waits[s] in whole:
          env[x] = tie(env[x], _last(whole[waits[s]]))
        outs, saved[s] = self.vjps[s].forward([env[v] for v in p.ins])
      env.update(zip(p.outs, outs))
      for g in [g for g in whole if plan.keep[g]]:
        kept[g] = whole[g]
    values = [v.val if isinstance(v, Literal) else env[v] for v in self.jx.outvars]
    del env, whole
    grads = self._backward(slots, saved, kept, values[0])
    return jax.tree_util.tree_unflatten(self.out_tree, values), jax.tree_util.tree_unflatten(self.treedef, grads)

  def _latest(self, ins, env):
    acts = [v for v in ins if v not in self.static and v not in self.var_slot and v in env]
    return acts[-1] if acts else None

  # ---------------- backward

  def _backward(self, slots, saved, kept, loss):
    plan, pieces = self.plan, self.pieces
    self.ct: dict = {self.jx.outvars[0]: jnp.ones_like(loss)}
    self.ct_leaf: dict = {}
    self.grads: list = [None] * len(self.flat)
    self.rep_parts: dict = {}
    self.stack_parts: dict = {}
    self.token = None
    self.pending = list(plan.order)
    self.done: set = {(i, k) for i, k in plan.slot_of if i not in self.first}
    # backward slots: outer groups in reverse; a scan is one slot (its last layer's group)
    bslots = [(s, self.scans[s].groups[-1] if s in self.scans and g == self.scans[s].groups[0] else g)
              for s, g in reversed(slots)]
    regather: dict[int, list[int]] = {}
    for j, (s, g) in enumerate(bslots):
      if not plan.keep[g]:
        at = bslots[j - plan.backward_prefetch][0] if j >= plan.backward_prefetch else len(pieces)
        regather.setdefault(at, []).append(g)
    live = dict(kept)
    anchor = loss
    for g in regather.get(len(pieces), ()):
      live[g] = self._gather(g, REAG_SCOPE, anchor)
    for s in range(len(pieces) - 1, -1, -1):
      p = pieces[s]
      if s in self.scans:
        def tail(anchor, s=s):
          for g in regather.get(s, ()):
            live[g] = self._gather(g, REAG_SCOPE, anchor)
        self._issue_ready()
        anchor = self._scan_backward(self.scans[s], saved[s], live, tail, anchor)
      else:
        for g in regather.get(s, ()):
          live[g] = self._gather(g, REAG_SCOPE, anchor)
        cts_out = [self.ct.pop(v, None) for v in p.outs]
        args = []
        for v in p.ins:
          if v in self.var_slot:
            i = self.var_slot[v][0]
            g = next(g for g in live if (i, None) in plan.groups[g])
            args.append(live[g][plan.groups[g].index((i, None))])
          else:
            args.append(self.static.get(v))
        cts_in = self.vjps[s].backward(saved[s], args, cts_out)
        anchor = self._accumulate(p.ins, self.vjps[s].diff, cts_in, anchor)
      saved[s] = None
      self.done.update((i, k) for i, k in plan.slot_of if i in self.first and self.first[i] >= self.starts[s])
      self._issue_ready()
    self.done.update(plan.slot_of)
    self._issue_ready()
    return self._assemble()

  def _accumulate(self, vars_, diff, cts, anchor):
    leaf_of_var = {v: i for i, v in enumerate(self.leaf_var)}
    it = iter(cts)
    for v, d in zip(vars_, diff):
      if not d:
        continue
      c = next(it)
      if isinstance(v, Literal):
        continue
      if v in self.var_slot or v in leaf_of_var:
        i = self.var_slot[v][0] if v in self.var_slot else leaf_of_var[v]
        self.ct_leaf[i] = c if i not in self.ct_leaf else self.ct_leaf[i] + c
      elif v not in self.static:
        self.ct[v] = c if v not in self.ct else self.ct[v] + c
        anchor = c
    return anchor

  def _issue_ready(self):
    plan = self.plan
    while self.pending:
      k = self.pending[0]
      slots = plan.units[k] if k in plan.units else tuple(plan.slot_of[r] for r, _, _ in plan.replicated[k].slices)
      if not all(sl in self.done for sl in slots):
        return
      self.pending.pop(0)
      if k in plan.units:
        cts = [self._ct_slot(sl) for sl in slots]
        out = scatter(cts, self._dims(slots), self.axis, self.n, self.divisor, f"{RS_SCOPE}{k}", self.layout,
                      self.token)
        for sl, x in zip(slots, out):
          self.rep_parts.setdefault(sl, []).append((0, x))
        self.token = _last(out)
      else:
        c = plan.replicated[k]
        parts = [self._ct_slot(plan.slot_of[r]).reshape(-1)[a:b] for r, a, b in c.slices]
        rel = Chunk(slices=tuple((j, 0, b - a) for j, (_, a, b) in enumerate(c.slices)), dtype=c.dtype)
        red, self.token, _ = reduce_units(parts, [rel], tuple(range(len(parts))), self.axis,
                                          divisor=_loss_reduction.divisor(self.reduction, self.n), first_index=k,
                                          prev=self.token)
        for (r, a, _), x in zip(c.slices, red):
          self.rep_parts.setdefault(plan.slot_of[r], []).append((a, x))

  def _ct_slot(self, slot):
    """The whole gradient of a slot (this device's, unreduced), in its leaf's dtype; zeros if none."""
    i, k = slot
    c = self.ct_leaf.get(i)
    leaf = self.flat[i]
    if c is None:
      shape = self._whole_aval(i).shape
      return jnp.zeros(shape if k is None else shape[1:], leaf.dtype)
    return (c if k is None else c[k]).astype(leaf.dtype)

  def _assemble(self):
    grads = []
    for i, x in enumerate(self.flat):
      if i in self.stack_parts:
        ps = self.stack_parts[i]
        grads.append(jnp.concatenate(ps) if len(ps) > 1 else ps[0])
        continue
      stacked = [k for j, k in self.plan.slot_of if j == i and k is not None]
      keys = [(i, k) for k in sorted(stacked)] if stacked else [(i, None)]
      parts = []
      for key in keys:
        got = sorted(self.rep_parts.get(key, []), key=lambda t: t[0])
        if not got:
          parts = None
          break
        shape = np.shape(x) if key[1] is None else np.shape(x)[1:]
        if i in self.plan.dim_of or len(got) == 1:
          parts.append(got[0][1].reshape(shape))
        else:
          parts.append(jnp.concatenate([g.reshape(-1) for _, g in got]).reshape(shape))
      if parts is None:
        grads.append(jnp.zeros_like(x))
      else:
        grads.append(parts[0] if not stacked else jnp.stack(parts))
    return grads

  # ---------------- a scanned stack

  def _gather_layer(self, sc, k, scope, anchor, shards=None):
    """Layer k's gathered leaves (its shards given, e.g. a loop's slice, or read from the stack)."""
    slots = self.plan.groups[sc.groups[k]]
    if shards is None:
      shards = [self.flat[i][k] for i, _ in slots]
    shards = [x if sc.cast.get(i) is None else x.astype(sc.cast[i]) for (i, _), x in zip(slots, shards)]
    return gather(shards, self._dims(slots), self.axis, self.n, f"{scope}{sc.groups[k]}", self.layout, anchor)

  def _layer_args(self, sc, consts, carry, xs_k, w_k):
    """The layer function's arguments: body consts, consts, carry, xs (a sharded leaf's slice replaced
    by its gathered layer)."""
    it = iter(w_k)
    xs = [next(it) if kind == "shard" else x for (kind, _), x in zip(sc.xs_slot, xs_k)]
    return list(sc.body_consts) + list(consts) + list(carry) + xs

  def _scan_forward(self, sc, top_ins, whole, tail):
    """The stack's forward, run by run of equal keep: per run its first layer, a loop over the middle
    (layer k + 1 gathered, tied to layer k's input, and carried), its last layer (issuing the next run's
    or the pieces' gather). Returns (the scan's outputs, per run: its parts in layer order, each
    (residuals, carry in), and the carry after it)."""
    nc, ncar = sc.n_consts, sc.n_carry
    consts, carry, xs = top_ins[:nc], list(top_ins[nc:nc + ncar]), list(top_ins[nc + ncar:])
    xs = [None if kind == "shard" else x for (kind, _), x in zip(sc.xs_slot, xs)]
    w = whole.pop(sc.groups[0])
    runs, ys_parts = [], []

    def compute(w_k, carry, xs_k, keep):
      outs, res = sc.vjp.forward(self._layer_args(sc, consts, carry, xs_k, w_k))
      return outs[:ncar], outs[ncar:], res + (list(w_k) if keep else [])

    for r, (a, b, keep) in enumerate(sc.runs):
      def one(k, w_k, carry, keep=keep, b=b, r=r):
        anchor = _anchor(carry)
        last = k + 1 == b and r + 1 == len(sc.runs)
        w_next = tail(anchor) if last else self._gather_layer(sc, k + 1, AG_SCOPE, anchor)
        new, ys, res = compute(w_k, carry, [x if x is None else x[k] for x in xs], keep)
        ys_parts.append([y[None] for y in ys])
        return new, (res, carry), w_next

      parts = []
      carry, part, w = one(a, w, carry)
      parts.append(part)
      if b - a > 2:
        def body(c, x, a=a, keep=keep):
          carry, w_k = c
          nxt, xs_k = x
          w_next = self._gather_layer(sc, a + 1, AG_SCOPE, _anchor(carry), nxt)
          new, ys, res = compute(w_k, carry, xs_k, keep)
          return (new, w_next), (ys, (res, carry))

        shards = [self.flat[i][a + 2:b] for kind, i in sc.xs_slot if kind == "shard"]
        loop_xs = (shards, [x if x is None else x[a + 1:b - 1] for x in xs])
        (carry, w), (ys, part) = jax.lax.scan(body, (carry, w), loop_xs)
        parts.append(part)
        ys_parts.append(ys)
      if b - a > 1:
        carry, part, w = one(b - 1, w, carry)
        parts.append(part)
      runs.append((parts, carry))
    ys = [jnp.concatenate([p[j] for p in ys_parts]) if len(ys_parts) > 1 else ys_parts[0][j]
          for j in range(len(sc.eqn.outvars) - ncar)]
    return carry + ys, runs

  def _scan_backward(self, sc, runs, live, tail, anchor):
    """The stack's backward, runs and layers in reverse: per layer, layer k - 1 gathered again (tied to
    the carry's cotangent) unless kept, the layer's pullback, its unit's reduce-scatter on the token
    chain (in a loop, one per iteration). Returns the backward's anchor after it."""
    nc, ncar = sc.n_consts, sc.n_carry
    nb = len(sc.body_consts)
    top = list(sc.eqn.invars)
    cts_top = [self.ct.pop(v, None) for v in sc.eqn.outvars]
    diff = sc.vjp.diff[nb:]
    ct_carry = [zero_like(v.aval) if c is None and d else c
                for v, c, d in zip(sc.eqn.outvars[:ncar], cts_top[:ncar], diff[nc:nc + ncar])]
    ct_ys = cts_top[ncar:]
    consts = [self._rec_value(v) for v in top[:nc]]
    xs = [None if kind == "shard" else self.local[i] if kind == "rep" else self._rec_value(v)
          for (kind, i), v in zip(sc.xs_slot, top[nc + ncar:])]
    shard_leaves = [i for kind, i in sc.xs_slot if kind == "shard"]
    ns = len(shard_leaves)
    ct_consts = [zero_like(v.aval) if d and not isinstance(v, Literal) else None
                 for v, d in zip(top[:nc], diff[:nc])]
    ct_xs_parts: list[list] = [[] for _ in sc.xs_slot]
    shard_parts: dict[int, list] = {i: [] for i in shard_leaves}
    token = self.token if self.token is not None else jnp.zeros((), jnp.float32)
    w = None if sc.runs[-1][2] else live.pop(sc.groups[-1])
    self.pending = [k for k in self.pending if k not in set(sc.units)]

    def layer_bwd(res, carry_in, carry_out, w_k, ct_carry, ct_consts, token, keep, ys_ct_k, xs_k, unit):
      if keep:
        w_k, res = res[len(res) - ns:], res[:len(res) - ns]
      args = self._layer_args(sc, consts, carry_in, xs_k, w_k)
      cts_in = iter(sc.vjp.backward(res, args, list(ct_carry) + list(ys_ct_k), carry_out))
      new_consts, new_carry, ct_w, ct_x = list(ct_consts), [None] * ncar, [], []
      for j, d in enumerate(diff):
        c = next(cts_in) if d else None
        if j < nc:
          new_consts[j] = None if c is None or ct_consts[j] is None else ct_consts[j] + c
        elif j < nc + ncar:
          new_carry[j - nc] = c
        elif sc.xs_slot[j - nc - ncar][0] == "shard":
          ct_w.append(c.astype(self.flat[sc.xs_slot[j - nc - ncar][1]].dtype))
        else:
          ct_x.append(c)
      out = scatter(ct_w, [self.plan.dim_of[i] - 1 for i in shard_leaves], self.axis, self.n, self.divisor,
                    f"{RS_SCOPE}{unit}", self.layout, token)
      return new_carry, new_consts, _last(out), out, ct_x

    def store(k0, out, ct_x, stacked):
      for i, x in zip(shard_leaves, out):
        shard_parts[i].append((k0, x if stacked else x[None]))
      it = iter(ct_x)
      for j, (kind, _) in enumerate(sc.xs_slot):
        c = None if kind == "shard" else next(it)
        if c is not None:
          ct_xs_parts[j].append((k0, c if stacked else c[None]))

    for r in range(len(sc.runs) - 1, -1, -1):
      a, b, keep = sc.runs[r]
      parts, nxt = list(runs[r][0]), runs[r][1]

      def regather(k, anchor, a=a, keep=keep, r=r):
        if k > a:
          return None if keep else self._gather_layer(sc, k - 1, REAG_SCOPE, anchor)
        if r > 0:
          return None if sc.runs[r - 1][2] else self._gather_layer(sc, a - 1, REAG_SCOPE, anchor)
        return tail(anchor)

      def one(k, part, nxt, w_k, ct_carry, ct_consts, token, keep=keep):
        res, carry_in = part
        w_next = regather(k, _anchor(ct_carry))
        ct_carry, ct_consts, token, out, ct_x = layer_bwd(
            list(res), carry_in, nxt, w_k, ct_carry, ct_consts, token, keep,
            [None if c is None else c[k] for c in ct_ys], [None if x is None else x[k] for x in xs], sc.units[k])
        store(k, out, ct_x, False)
        return ct_carry, ct_consts, token, w_next, carry_in

      if b - a > 1:
        ct_carry, ct_consts, token, w, nxt = one(b - 1, parts.pop(), nxt, w, ct_carry, ct_consts, token)
      if b - a > 2:
        def body(c, x, a=a, keep=keep):
          ct_carry, ct_consts, token, w_k, nxt = c
          (res, carry_in), ys_k, xs_k, prev = x
          w_prev = None if keep else self._gather_layer(sc, a + 1, REAG_SCOPE, _anchor(ct_carry), prev)
          ct_carry, ct_consts, token, out, ct_x = layer_bwd(list(res), carry_in, nxt, w_k, ct_carry, ct_consts,
                                                            token, keep, ys_k, xs_k, sc.units[a + 1])
          return (ct_carry, ct_consts, token, w_prev, carry_in), (out, ct_x)

        loop_xs = (parts.pop(), [None if c is None else c[a + 1:b - 1] for c in ct_ys],
                   [None if x is None else x[a + 1:b - 1] for x in xs],
                   None if keep else [self.flat[i][a:b - 2] for i in shard_leaves])
        (ct_carry, ct_consts, token, w, nxt), (out, ct_x) = jax.lax.scan(
            body, (ct_carry, ct_consts, token, w, nxt), loop_xs, reverse=True)
        store(a + 1, out, ct_x, True)
      ct_carry, ct_consts, token, w, nxt = one(a, parts.pop(), nxt, w, ct_carry, ct_consts, token)
    self.token = token
    for i, ps in shard_parts.items():
      self.stack_parts[i] = [x for _, x in sorted(ps, key=lambda t: t[0])]
    for j, ((kind, i), v) in enumerate(zip(sc.xs_slot, top[nc + ncar:])):
      ps = [x for _, x in sorted(ct_xs_parts[j], key=lambda t: t[0])]
      if kind != "shard" and ps:
        full = jnp.concatenate(ps) if len(ps) > 1 else ps[0]
        anchor = self._accumulate([self.leaf_var[i] if kind == "rep" else v], [True], [full], anchor)
    anchor = self._accumulate(top[:nc], [c is not None for c in ct_consts], [c for c in ct_consts if c is not None],
                              anchor)
    return self._accumulate(top[nc:nc + ncar], [c is not None for c in ct_carry],
                            [c for c in ct_carry if c is not None], anchor)

  def _rec_value(self, v):
    """What backward can read again of a top-level value: a constant, a parameter, the batch, a live
    gathered leaf; None for an activation."""
    if isinstance(v, Literal):
      return v.val
    return self.static.get(v)


def _anchor(values):
  return next((c for c in values if c is not None and jnp.issubdtype(c.dtype, jnp.inexact)), None)
