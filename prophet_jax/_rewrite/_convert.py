"""Between layouts, on the host: a schedule's states taken to another schedule's, or to and from the
whole optimizer state (for checkpoints, a re-plan, another device count).

- `unshard_state` / `shard_state`: a sharded schedule's ZeRO-1 optimizer state (`ShardedState`)
  gathered into `tx`'s whole state, and the whole state cut into shards for any device count.
- `convert(state, params, new_schedule, ...)`: the state layer's one conversion primitive: every
  library state in any container taken from its own schedule's layout (recorded in its `StateTag`) to
  `new_schedule`'s, nothing lost, bit for bit (see its docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from . import _defer
from ._collectives import chunk_buffer, scatter_chunks
from ._sharded import padded
from ._accumulate import accum_dtype
from ._states import AccumState, DeferState, OwedState, ScheduledState, ShardedState, StateTag, is_kind, is_state, kind_of
from ._defer import defer_tag, matched_leaves, owed_tag
from ._zero import shard_tag, check_state, shard_mode, shard_structs
from .._values._errors import ScheduleMismatchError, ShardingError
from .._values._checks import check_values, match_tree
from .._values._schedule import Schedule

def _host(x: Any) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def _groups(schedule: Schedule, n: int, mode: str, params: Any, tx: Any, where: str):
  """(per-device template of tx's shard state flattened into groups, the replicated template flattened
  into groups, lmap, flat params): a group is the tuple of shards (one per chunk, + the norm carrier)
  or the params' tree; a leaf is anything else (a step count, a scalar)."""
  flat, treedef, lmap = matched_leaves(params, schedule, where)
  shard_struct = shard_structs(schedule, n, mode)
  shapes = [tuple(np.shape(s)) for s in shard_struct]

  def is_shards(x: Any) -> bool:
    # (an optimizer's own tuple of k states, e.g. adam's (ScaleByAdamState, EmptyState) for k = 2, is
    # not a group of shards: only arrays are)
    return type(x) is tuple and len(x) == len(shapes) and all(
        hasattr(y, "shape") and tuple(y.shape) == s for y, s in zip(x, shapes))

  pshapes = [tuple(np.shape(x)) for x in flat]

  def is_params(x: Any) -> bool:
    leaves, td = jax.tree_util.tree_flatten(x)
    return td == treedef and [tuple(np.shape(y)) for y in leaves] == pshapes

  per = jax.eval_shape(tx.init, shard_struct)
  rep = jax.eval_shape(tx.init, jax.tree_util.tree_unflatten(treedef, flat))
  per_items, per_def = jax.tree_util.tree_flatten(per, is_leaf=is_shards)
  rep_items, rep_def = jax.tree_util.tree_flatten(rep, is_leaf=is_params)
  kinds = lambda items, f: [bool(f(x)) for x in items]  # noqa: E731
  if len(per_items) != len(rep_items) or kinds(per_items, is_shards) != kinds(rep_items, is_params):
    raise ShardingError(
        f"{where}: tx's state on the shards ({per_def}) does not match its state on the params' tree "
        f"({rep_def}) part for part, so the two layouts cannot be converted: tx's state holds something "
        f"other than per-parameter arrays and scalars.")
  return per_def, per_items, is_shards, rep_def, rep_items, is_params, treedef, flat, lmap


def unshard_state(s: ShardedState, tx: Any, params: Any, schedule: Schedule) -> Any:
  """A `ShardedState` as `tx`'s whole (replicated) state for `params`, on the host: what `tx.init(params)`
  and the same updates on the whole tree would hold (per-parameter arrays put back at their slices, padding
  dropped; scalars from device 0).

  Args:
    s: the ShardedState, as the step leaves it (global `(n, ...)` or pmap's `(n, 1, ...)`).
    tx: the optimizer the state was made by.
    params: the params' tree (arrays or ShapeDtypeStructs).
    schedule: the sharded schedule the state was made for.

  Returns:
    A tree like `tx.init(params)` of numpy arrays.

  Raises:
    ScheduleMismatchError: a ShardedState of another schedule or tree.
    ShardingError: tx's state is not per-parameter arrays and scalars.
  """
  where = "unshard_state"
  n = s.tag.n
  check_state(s, schedule, n, where)
  per_def, per_items, is_shards, rep_def, rep_items, _, treedef, flat, lmap = _groups(
      schedule, n, s.tag.mode, params, tx, where)
  out = []
  for tmpl, have, like in zip(per_items, per_def.flatten_up_to(s.per_device), rep_items):
    if is_shards(tmpl):
      hosts = [_host(part) for part in have]   # global (n, s), or pmap's (n, 1, s)
      bufs = [(a[:, 0] if a.ndim == 3 and a.shape[1] == 1 else a).reshape(-1)[:c.size]
              for c, a in zip(schedule.chunks, hosts)]
      like_leaves = jax.tree_util.tree_leaves(like)
      base = [np.zeros(np.shape(x), t.dtype) for x, t in zip(flat, like_leaves)]
      leaves = scatter_chunks(base, schedule.chunks, lmap.row_leaf, bufs)
      out.append(jax.tree_util.tree_unflatten(treedef, [np.asarray(x).astype(t.dtype)
                                                        for x, t in zip(leaves, like_leaves)]))
    else:
      a = _host(have)
      out.append(a.reshape((a.shape[0], -1))[0].reshape(np.shape(tmpl)).astype(tmpl.dtype))
  return jax.tree_util.tree_unflatten(rep_def, out)


def shard_state(tx_state: Any, tx: Any, params: Any, schedule: Schedule, n: int, *,
                pmap: bool = False) -> ShardedState:
  """`tx`'s whole state for `params` cut into the ZeRO-1 shard state of `schedule` for `n` devices, on the
  host: the inverse of `unshard_state` (resume a replicated checkpoint under a sharded plan, or re-shard
  for another device count).

  Args:
    tx_state: tx's state for the whole params' tree.
    tx: the optimizer.
    params: the params' tree (arrays or ShapeDtypeStructs).
    schedule: the sharded schedule to cut for.
    n: the number of devices on the data axis.
    pmap: lay each leaf out as pmap's `(n, 1, ...)`; by default a global `(n, ...)`.

  Returns:
    A ShardedState of numpy arrays.

  Raises:
    ShardingError: tx cannot run on shards, or its state is not per-parameter arrays and scalars.
  """
  where = "shard_state"
  if not schedule.sharded:
    raise ValueError(f"{where}: schedule ({schedule.policy}) is not sharded (no gathers): its "
                     f"optimizer state is tx's whole state, nothing to cut.")
  n = int(n)
  if n < 1:
    raise ValueError(f"{where}: n={n}: the number of devices on the data axis must be >= 1.")
  mode = shard_mode(tx, params, where)
  per_def, per_items, is_shards, rep_def, _, _, treedef, _, lmap = _groups(schedule, n, mode, params, tx, where)
  have = rep_def.flatten_up_to(tx_state)
  out = []
  for tmpl, x in zip(per_items, have):
    if is_shards(tmpl):
      leaves = [_host(v) for v in treedef.flatten_up_to(x)]
      parts = [np.asarray(padded(chunk_buffer(leaves, c, lmap.row_leaf), n)).astype(t.dtype).reshape(n, -1)
               for c, t in zip(schedule.chunks, tmpl)]
      # the global norm's carrier: what init gives it (its update is dropped)
      out.append(tuple(parts) + ((np.zeros((n,), tmpl[-1].dtype),) if mode == "global-norm" else ()))
    else:
      out.append(np.broadcast_to(_host(x).astype(tmpl.dtype), (n,) + tuple(np.shape(tmpl))).copy())
  per_device = jax.tree_util.tree_unflatten(per_def, out)
  if pmap:
    per_device = jax.tree_util.tree_map(lambda a: a[:, None], per_device)
  return ShardedState(per_device=per_device, tag=shard_tag(schedule, n, mode))


# --------------------------------------------------------------------------------------------------
# the one conversion between schedules


class Converted(NamedTuple):
  """What `convert` returns.

  Attributes:
    state: the state in the new schedule's layout (the same containers as went in).
    owed: what the new layout cannot hold: the deferred gradient values the old schedule would have
      added to its next gradients, as a tree like the params (with the state's device axis in front
      where it had one), to be added to the new schedule's first gradients; None when nothing is owed.
  """

  state: Any
  owed: Any


def _pmap_layout(s: ShardedState) -> bool:
  """Whether a shard state's leaves are pmap's `(n, 1, ...)` (else a global `(n, ...)`): a shard is
  `(n, 1, s)` there, a scalar `(n, 1)`; a global layout with every shard of size 1 reads as global."""
  leaves = [np.shape(x) for x in jax.tree_util.tree_leaves(s.per_device)]
  return any(len(x) == 3 for x in leaves) or (
      all(x[1:] == (1,) for x in leaves) and any(z != 1 for z in s.tag.sizes))


def defer_like(new: Schedule, rep_prefix: tuple[int, ...], res_prefix: tuple[int, ...]) -> Any:
  """`new`'s initial deferral state laid out as another one was: replicated leaves with `rep_prefix`
  in front, residuals with `res_prefix` in place of their leading 1 (None when `new` defers nothing)."""
  init = _defer.init(new)
  if init is None:
    return None
  rep = lambda xs: tuple(np.broadcast_to(np.asarray(x), rep_prefix + x.shape).copy() for x in xs)  # noqa: E731
  return init._replace(norms=rep(init.norms), deferred=rep(init.deferred), index=rep(init.index),
                       residual=tuple(np.zeros(res_prefix + x.shape[1:], x.dtype) for x in init.residual))


def _owed_of(d: DeferState, old: Schedule, params: Any) -> tuple[Any, tuple[int, ...]]:
  """(each device's deferred values at their elements, stacked on a device axis; that axis' shape)."""
  devices = int(np.prod(d.lead, dtype=np.int64))
  zeros = jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x), getattr(x, "dtype", np.float32)), params)
  per = [_defer.deferred_values(zeros, _defer.device_part(d, i), old, "convert") for i in range(devices)]
  if d.lead == (1,):
    return per[0], ()
  return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *per), (devices,)


class Conversion:
  """One walk that takes every library state in a tree from its own schedule's layout (recorded in its
  `StateTag`) to `new`'s: each kind's declared conversion step (`_states.Kind.convert`) is a method.

  With `owed_in_place`, what the new layout cannot hold (a deferral residual) travels as an `OwedState`
  where the new step takes its deferral state (`convert_state`); else it is summed in `owed` (`convert`).
  """

  def __init__(self, params: Any, new: Schedule, *, tx: Any = None, n: int | None = None,
               owed_in_place: bool = False, where: str = "convert", every_k: int | None = None,
               on_mesh: bool = False):
    check_values(where, schedule=new)
    self.params, self.new, self.tx, self.n, self.where = params, new, tx, n, where
    self.owed_in_place, self.every_k, self.on_mesh = owed_in_place, every_k, on_mesh
    self.owed: list[tuple[Any, tuple[int, ...]]] = []

  def __call__(self, state: Any) -> Any:
    return jax.tree_util.tree_map(self.step, state, is_leaf=is_kind)

  def step(self, x: Any) -> Any:
    kind = kind_of(x)
    return getattr(self, kind.convert)(x) if kind is not None and kind.convert else x

  def _need_tx(self, what: str) -> None:
    if self.tx is None:
      raise ValueError(f"{self.where}: {what}, which needs the optimizer: pass tx= (the one given to scheduled).")

  def _old(self, tag: Any, what: str) -> Schedule:
    sched = tag.schedule if isinstance(tag, StateTag) else None
    if sched is None:
      raise ValueError(f"{self.where}: the {what} does not record the schedule it was made for (its tag was "
                       f"rebuilt without it); make the state with this library's init or step.")
    return sched

  # -- the kinds' steps ----------------------------------------------------------------------------
  def defer(self, d: DeferState) -> Any:
    """Kept for its own schedule; else the new schedule's initial state in the same layout, and the
    residual owed (at the elements it was deferred from) to the new schedule's first gradients."""
    new = self.new
    if new.defers and d.tag == defer_tag(new):
      return d
    owed, axis = _owed_of(d, self._old(d.tag, "deferral state"), self.params)
    if self.owed_in_place:
      return _owed_state(owed, d, self.params, new)
    self.owed.append((owed, axis))
    return defer_like(new, tuple(np.shape(d.norms[0])[:-1]), d.lead)

  def owed(self, o: OwedState) -> OwedState:
    if o.tag == owed_tag(self.new):
      return o
    raise ValueError(f"{self.where}: the state still owes deferred values to the first step of another plan "
                     f"({o.tag!r}): run that step once before converting again.")

  def sharded(self, s: ShardedState) -> Any:
    """Kept for its own schedule and device count; else gathered into tx's whole state and, for a
    sharded new schedule, cut again for `n` devices in the same layout."""
    new, old, count = self.new, self._old(s.tag, "ZeRO-1 optimizer state"), self.n or s.tag.n
    if new.family == "zero1" and s.tag == shard_tag(new, count, s.tag.mode):
      return s
    self._need_tx("a ZeRO-1 optimizer state is gathered")
    pmap = _pmap_layout(s)
    whole = unshard_state(s, self.tx, self.params, old)
    if new.family == "zero1":
      return shard_state(whole, self.tx, self.params, new, count, pmap=pmap)
    if pmap:   # each device's copy, as pmap keeps a replicated state
      return jax.tree_util.tree_map(lambda x: np.broadcast_to(x, (s.tag.n,) + np.shape(x)).copy(), whole)
    return whole

  def accum(self, a: AccumState) -> AccumState:
    rows = self.new.rows
    ok = len(a.grads) == len(rows) and all(
        tuple(np.shape(g))[len(np.shape(g)) - len(shape):] == tuple(shape) for (_, shape, _), g in zip(rows, a.grads))
    if not ok:
      raise ScheduleMismatchError(
          f"{self.where}: the gradient accumulator holds {len(a.grads)} sums shaped "
          f"{[tuple(np.shape(g)) for g in a.grads][:4]}, which are not the rows of the new schedule "
          f"({len(rows)} rows): it was planned for another tree.")
    return a

  def scheduled(self, x: ScheduledState) -> ScheduledState:
    """Its parts by their kinds; tx's whole state cut into shards for a ZeRO-1 schedule; an initial
    deferral state where the new schedule defers and the old did not."""
    whole = kind_of(x.inner) is None and self.new.family == "zero1"
    inner = self._whole_to_shards(x.inner) if whole else self.step(x.inner)
    fresh = x.defer_state is None and self.new.defers
    d = defer_like(self.new, (), (self.n,) if self.n else (1,)) if fresh else self.step(x.defer_state)
    return self._every_k(ScheduledState(inner=inner, defer_state=d, accum=self.step(x.accum)))

  def _every_k(self, x: ScheduledState) -> ScheduledState:
    """`x` with the accumulator the new `every_k` needs: dropped when empty (refused while micro-steps wait
    for their all-reduce), or an empty one added (laid out as the deferral state, else globally on a mesh)."""
    if self.every_k is None:
      return x
    if self.every_k == 1:
      if x.accum is not None and np.any(np.asarray(jax.device_get(x.accum.count)) != 0):
        raise ValueError(
            f"{self.where}: the gradient accumulator holds {int(np.max(np.asarray(x.accum.count)))} micro-steps "
            f"not yet all-reduced, which a plan without every_k would drop: convert at the k-th micro-step "
            f"(count 0).")
      return x._replace(accum=None)
    if x.accum is not None:
      return x
    prefix = x.defer_state.lead if x.defer_state is not None else (self.n,) if self.on_mesh and self.n else (1,)
    grads = tuple(np.zeros(prefix + tuple(shape), accum_dtype(dtype)) for _, shape, dtype in self.new.rows)
    return x._replace(accum=AccumState(count=np.zeros(prefix[:1] if len(prefix) == 2 else (), np.int32), grads=grads))

  def pipelined(self, x: Any) -> Any:
    """tx's state as `scheduled`'s is converted (a pipelined step keeps it bare) and its deferral state;
    a pending forward (half of the old plan's step) is refused."""
    if x.pending is not None:
      raise ValueError(
          f"{self.where}: the PipelinedState holds a pending forward of its plan (half of a step): flush it "
          f"with the old plan's step first (state = jax.pmap(old.flush, axis_name=...)(state), or "
          f"old.flush inside its shard_map / jit), then convert.")
    return x._replace(opt_state=self.scheduled(ScheduledState(inner=x.opt_state)).inner, defer=self.step(x.defer))

  def _whole_to_shards(self, inner: Any) -> Any:
    self._need_tx("a whole optimizer state is cut into ZeRO-1 shards")
    tmpl = jax.tree_util.tree_leaves(jax.eval_shape(self.tx.init, self.params))
    have = jax.tree_util.tree_leaves(inner)
    stacked = bool(tmpl) and len(have) == len(tmpl) and np.ndim(have[0]) == len(tmpl[0].shape) + 1
    count = self.n or (np.shape(have[0])[0] if stacked else None)
    if count is None:
      raise ValueError(f"{self.where}: cutting the whole optimizer state into ZeRO-1 shards needs the number "
                       f"of devices: pass n=.")
    if stacked:
      inner = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], inner)
    return shard_state(inner, self.tx, self.params, self.new, count, pmap=stacked)


def _owed_state(owed: Any, d: DeferState, params: Any, schedule: Schedule) -> OwedState:
  """An owed tree (per device, or stacked on a device axis) as an OwedState laid out as `d` was: each
  row `(1, *shape)` per device, `(n, *shape)` global, `(n, 1, *shape)` under pmap."""
  lmap = match_tree(jax.tree_util.tree_flatten_with_path(params)[0], schedule, where="convert_state")
  flat = jax.tree_util.tree_leaves(owed)
  rows = tuple(np.asarray(flat[i]).reshape(d.lead + tuple(shape)).astype(dtype)
               for i, (_, shape, dtype) in zip(lmap.row_leaf, schedule.rows))
  return OwedState(owed=rows, tag=owed_tag(schedule))


def steady_state(state: Any) -> Any:
  """`state` (as `convert_state` returns it) with every `OwedState` replaced by what the new plan's first
  step returns in its place (the plan's initial DeferState in the same layout, or None): the shapes of
  the steady state, for specs or `jax.eval_shape`."""
  def one(x: Any) -> Any:
    return defer_like(x.tag.schedule, x.lead[:1] if len(x.lead) == 2 else (), x.lead) if isinstance(x, OwedState) else x

  return jax.tree_util.tree_map(one, state, is_leaf=is_state)


def convert(state: Any, params: Any, new_schedule: Schedule, *, tx: Any = None, n: int | None = None
            ) -> Converted:
  """Every library state in `state` taken to `new_schedule`'s layout, on the host, bit for bit; what the new
  layout cannot hold (a deferral residual) summed in `owed` (`convert_state` runs the same walk and puts
  it in an `OwedState` instead).

  Args:
    state: any tree holding library states, in any layout (per device, pmap's, global).
    params: the params' tree the schedules were planned for.
    new_schedule: the schedule to convert to.
    tx: the optimizer, wherever a ZeRO-1 state is gathered or cut.
    n: devices on the data axis, where a state is cut into shards.

  Returns:
    `Converted(state, owed)`.
  """
  c = Conversion(params, new_schedule, tx=tx, n=n)
  out = c(state)
  if not c.owed:
    return Converted(out, None)
  total, axis = c.owed[0]
  for tree, ax in c.owed[1:]:
    if ax != axis:
      raise ValueError(f"convert: the state holds deferral states in two layouts ({axis} and {ax} devices).")
    total = jax.tree_util.tree_map(np.add, total, tree)
  return Converted(out, total)
