"""The public state helpers (`unshard_state`, `shard_state`, `state_specs`, `deferred_grads`) on whatever
holds the library's states: a flax `TrainState`, a dict, an optax chain's tuple, a `PipelinedState`, an
`nnx.Optimizer` or its `nnx.state` (`_nnx`). The same kind of container comes out; nothing is mutated;
an object that holds no library state is a TypeError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _convert, _defer, _nnx, _states, _zero
from ._pending import PipelinedState
from ._states import DeferState, ScheduledState, ShardedState
from jax.sharding import NamedSharding, PartitionSpec

from .._values._checks import check_bool, check_int, check_values
from .._values._errors import ShardingError
from .._values._schedule import Schedule

# --------------------------------------------------------------------------------------------------
# what a container holds


def _not_a_state(where: str, obj: Any, wanted: str) -> TypeError:
  return TypeError(
      f"{where}: no {wanted} in the given {type(obj).__name__}: it neither is nor holds one. Pass the "
      f"optimizer state "
      f"of prophet_jax.scheduled(...) (tx.init(params) or what the step returned), a PipelinedState, or a "
      f"container holding one: a flax TrainState, an nnx.Optimizer or nnx.state(optimizer), a dict, an "
      f"optax chain's tuple.")


def _map_typed(obj: Any, pred, fn) -> tuple[Any, int]:
  found = [x for x in jax.tree_util.tree_leaves(obj, is_leaf=pred) if pred(x)]
  return jax.tree_util.tree_map(lambda x: fn(x) if pred(x) else x, obj, is_leaf=pred), len(found)


# --------------------------------------------------------------------------------------------------
# the helpers


def _is_sharded(x: Any) -> bool:
  return isinstance(x, ShardedState)


def _recast(given: Any, template: Any, where: str, what: str, lead: bool = False) -> Any:
  """`given`'s leaves in `template`'s structure (an nnx.Optimizer keeps a Param-shaped state's leaves in
  OptVariables, tx.init makes Params: the same leaves); ShardingError naming both transformations'
  states when the two are not the same state (other types, leaf counts or shapes). With `lead`, the
  given leaves carry leading device axes (a global or pmap-stacked per-device state)."""
  got, want = jax.tree_util.tree_leaves(given), jax.tree_util.tree_flatten(template)
  tail = lambda a, b: np.shape(a)[np.ndim(a) - np.ndim(b):] if lead else np.shape(a)  # noqa: E731
  if (_types(given) != _types(template) or len(got) != len(want[0])
      or any(tail(a, b) != np.shape(b) for a, b in zip(got, want[0]))):
    raise ShardingError(
        f"{where}: the {what} given is {_kinds(given)}, but tx's state is {_kinds(template)}: the state "
        f"was made by another transformation than the tx given, or for other params. Pass the tx the "
        f"state was made by (the one given to scheduled) and its params.")
  return jax.tree_util.tree_unflatten(want[1], got)


def _types(tree: Any) -> list[str]:
  """The names of the NamedTuples in `tree`, in order (an optax state's shape by its types)."""
  if isinstance(tree, Mapping) and not _nnx.is_variable(tree):
    return [t for k in tree for t in _types(tree[k])]
  own = [type(tree).__name__] if isinstance(tree, tuple) and hasattr(tree, "_fields") else []
  return own + ([t for x in tree for t in _types(x)] if isinstance(tree, (tuple, list)) else [])


def _kinds(x: Any, depth: int = 0) -> str:
  """The state's structure by its types' names, no values: e.g. '(TraceState, EmptyState)'."""
  if isinstance(x, (tuple, list)) and not hasattr(x, "_fields") and depth < 2:
    return "(" + ", ".join(_kinds(y, depth + 1) for y in x) + ")"
  if isinstance(x, Mapping):
    return "{" + ", ".join(map(str, list(x)[:6])) + "}"
  return type(x).__name__


def unshard_state(state: Any, tx: Any, params: Any, schedule: Schedule) -> Any:
  """Every `ShardedState` in `state` replaced by `tx`'s whole (replicated) state for `params`, on the
  host, in the container it came in (see `prophet_jax._rewrite._convert.unshard_state` for the layout).

  Args:
    state: a ShardedState or any container holding one: `scheduled`'s state, a flax TrainState, an
      nnx.Optimizer (an nnx.State comes out, for `nnx.update` of an optimizer made with the new tx) or
      `nnx.state(optimizer)`, a dict, a PipelinedState, a chain's tuple. Not mutated.
    tx: the optimizer the state was made by (the one passed to `scheduled`).
    params: the params' tree (arrays or ShapeDtypeStructs).
    schedule: the sharded schedule the state was made for.

  Returns:
    The same kind of container with each ShardedState replaced by a tree like `tx.init(params)`. With an
    FSDP plan (its state is tx's own, placed as the params are): every array of `state` whole, on the host
    (numpy; from every process where an array spans several): what a replicated checkpoint holds.

  Raises:
    TypeError: `state` neither is nor holds a ShardedState.
    ScheduleMismatchError: a ShardedState was made for another schedule or tree.
    ShardingError: the state was made by another tx.
  """
  where = "unshard_state"
  check_values(where, schedule=schedule)
  if _places_params(schedule):
    return jax.tree_util.tree_map(_whole, _nnx.flax_nnx().state(state) if _nnx.is_optimizer(state) else state)

  def one(s: Any) -> Any:
    _recast(s.per_device, jax.eval_shape(tx.init, _zero.shard_structs(schedule, s.tag.n, s.tag.mode)), where,
            "sharded optimizer state", lead=True)
    return _convert.unshard_state(s, tx, params, schedule)

  if _nnx.is_optimizer(state):
    return _nnx.on_optimizer(state, lambda st: _typed(st, _is_sharded, one, where, "ShardedState"))
  if _nnx.is_nnx_state(state):
    def from_labels(d: Mapping) -> Any:
      s = _sharded_from_labels(d, tx, schedule, where)
      return _nnx.labelled(_nnx.to_nnx(_convert.unshard_state(s, tx, params, schedule)))
    new, count = _nnx.walk_mappings(_nnx.labelled(state), lambda d: "per_device" in d, from_labels)
    if not count:
      raise _not_a_state(where, state, "sharded optimizer state (no 'per_device' entry)")
    return _nnx.as_state(new)
  return _typed(state, _is_sharded, one, where, "ShardedState")


def _places_params(schedule: Schedule) -> bool:
  """An FSDP plan: its params are sharded, and an optimizer state is tx's own, placed as they are."""
  return any(d is not None for d in schedule.placement)


def _whole(x: Any) -> Any:
  """An array whole on the host (from every process where it spans several); anything else as it is."""
  if not isinstance(x, jax.Array):
    return x
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils   # jax.experimental loads on first use only
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _placed(state: Any, params: Any, schedule: Schedule, n: int, mesh: Any, where: str) -> Any:
  """An FSDP plan's whole state placed on `mesh` as `state_specs` says (shard_state's FSDP form)."""
  axis = schedule.fsdp.shard_axes[0]
  if not isinstance(mesh, jax.sharding.Mesh) or dict(mesh.shape).get(axis) != n:
    raise ValueError(f"{where}: an FSDP plan's state follows the params: it is placed on the mesh, not cut. Pass "
                     f"mesh= a jax.sharding.Mesh whose {axis!r} axis has n={n} devices; got mesh={mesh!r:.80}.")
  specs = state_specs(state, axis, params=params, schedule=schedule)
  state = _nnx.flax_nnx().state(state) if _nnx.is_optimizer(state) else state
  return jax.device_put(state, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                                      is_leaf=lambda s: isinstance(s, PartitionSpec)))


def _typed(state: Any, pred, fn, where: str, wanted: str) -> Any:
  out, count = _map_typed(_nnx.unwrap(state), pred, fn)
  if not count:
    raise _not_a_state(where, state, wanted)
  return out


def _sharded_from_labels(d: Mapping, tx: Any, schedule: Schedule, where: str) -> Any:
  """The ShardedState nnx re-labelled as {'per_device': ...}: its tag rebuilt from the schedule, the
  axis size read from the leaves' leading axis, the mode from the number of shard entries."""
  leaves = [x.get_value() if _nnx.is_variable(x) else x
            for x in jax.tree_util.tree_leaves(d["per_device"], is_leaf=_nnx.is_variable)]
  if not leaves:
    raise ShardingError(f"{where}: the sharded optimizer state holds no arrays.")
  n = int(np.shape(leaves[0])[0])
  last = None
  for mode in _zero.MODES:
    template = jax.eval_shape(tx.init, _zero.shard_structs(schedule, n, mode))
    try:
      per = _nnx.rebuild(template, d["per_device"], where)
    except ShardingError as e:
      last = e
      continue
    if len(jax.tree_util.tree_leaves(template)) == len(leaves):
      return ShardedState(per_device=per, tag=_zero.shard_tag(schedule, n, mode))
  raise last or ShardingError(f"{where}: the sharded optimizer state was made by another tx than the one "
                              f"given.")


def shard_state(tx_state: Any, tx: Any, params: Any, schedule: Schedule, n: int, *, pmap: bool = False,
                mesh: Any = None) -> Any:
  """`tx`'s whole state cut into the ZeRO-1 shard state of `schedule` for `n` devices, on the host, in
  the container it came in: the inverse of `unshard_state`.

  Takes `tx.init(params)` itself (a `ShardedState` comes out), or a container holding `scheduled`'s
  state of an all-reduce plan (each `ScheduledState`'s `inner` is cut), or a `PipelinedState` of an
  all-reduce plan (its `opt_state` is cut): a flax TrainState, an nnx.Optimizer (an nnx.State comes
  out) or its nnx.state, a dict, a chain's tuple. Not mutated. See `prophet_jax._rewrite._convert.shard_state`.
  With an FSDP plan nothing is cut: the whole state (any container: a TrainState's params too) is placed
  on `mesh` as `state_specs` says (parts shaped as the params as the plan places them, the rest
  replicated), the inverse of `unshard_state`.

  Raises:
    TypeError: `n` is not an integer (a bool or 2.7 are refused), or the object holds no tx state.
    ValueError: `n` < 1, the schedule is not sharded, or a ScheduledState holds a deferral or
      accumulation state that cutting would drop; an FSDP plan without a `mesh` of n devices on its axis.
    ShardingError: tx cannot run on shards, or the state was made by another tx.
  """
  where = "shard_state"
  check_values(where, schedule=schedule)
  n = check_int(where, "n", n, lo=1, fix="It is the number of devices on the data axis.")
  check_bool(where, "pmap", pmap)
  if _places_params(schedule):
    return _placed(tx_state, params, schedule, n, mesh, where)
  template = jax.eval_shape(tx.init, params)

  def cut(whole: Any) -> Any:
    whole = _recast(whole, template, where, "optimizer state")
    return _convert.shard_state(whole, tx, params, schedule, n, pmap=pmap)

  def keeps_nothing_else(held: Any) -> None:   # a ScheduledState's fields, or nnx's entries for them
    for name in ("defer_state", "accum"):
      if name in held:
        raise ValueError(f"{where}: the optimizer state holds a {name} (its plan defers or accumulates): "
                         f"cutting it would drop those values. Apply them first (prophet_jax.deferred_grads, "
                         f"or finish the k micro-steps), then pass the state without them.")

  def scheduled_state(s: ScheduledState) -> ScheduledState:
    if _is_sharded(s.inner):
      return s
    keeps_nothing_else([f for f, v in s._asdict().items() if v is not None])
    return ScheduledState(inner=cut(s.inner))

  def pipelined_state(p: PipelinedState) -> PipelinedState:
    return p if _is_sharded(p.opt_state) else p._replace(opt_state=cut(p.opt_state))

  def typed(state: Any) -> Any:
    state = _nnx.unwrap(state)
    if not _states.holds_state(state):
      return cut(state)   # tx's state itself (the recast names both transformations' states where it is not)
    for cls, fn in ((ScheduledState, scheduled_state), (PipelinedState, pipelined_state)):
      out, count = _map_typed(state, lambda x: isinstance(x, cls), fn)   # noqa: B023 (used at once)
      if count:
        return out
    raise _not_a_state(where, state, "tx's whole optimizer state")

  if _nnx.is_optimizer(tx_state):
    return _nnx.on_optimizer(tx_state, typed)
  if _nnx.is_nnx_state(tx_state):
    def from_labels(d: Mapping) -> Any:
      if isinstance(d["inner"], Mapping) and "per_device" in d["inner"]:
        return d
      keeps_nothing_else(d)
      return {**d, "inner": _nnx.labelled(_nnx.to_nnx(cut(_nnx.rebuild(template, d["inner"], where))))}
    new, count = _nnx.walk_mappings(_nnx.labelled(tx_state), lambda d: "inner" in d, from_labels)
    if not count:
      raise _not_a_state(where, tx_state, "scheduled's optimizer state (no 'inner' entry)")
    return _nnx.as_state(new)
  return typed(tx_state)


def state_specs(state: Any, axis_name: Any, *, params: Any = None, schedule: Schedule | None = None) -> Any:
  """PartitionSpecs of any state holding the library's per-device parts, in the container it came in (an
  nnx.Optimizer gives the specs of `nnx.state(optimizer)`): each device's parts `P(axis_name)`, the rest
  `P()`; with `params` and an FSDP `schedule`, every part shaped as the params (an optimizer's moments)
  placed as the plan places the params. Use them as shard_map's in/out specs, or as `jax.jit(tx.init,
  out_shardings=...)` (a jitted init on Auto axes otherwise puts the moments on one device).

  Example:
    >>> specs = prophet_jax.state_specs(jax.eval_shape(tx.init, params), "data", params=params, schedule=s)

  Raises:
    TypeError: `axis_name` is not a non-empty string (or tuple of them).
  """
  where = "state_specs"
  ok = (isinstance(axis_name, str) and axis_name) or (
      isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) and a for a in axis_name))
  if not ok:
    raise TypeError(f"{where}: axis_name={axis_name!r}: expected the data-parallel mesh axis's name (a "
                    f"non-empty string such as 'data', or a tuple of them), as given to scheduled(..., "
                    f"axis_name=...).")
  if (params is None) != (schedule is None):
    raise TypeError(f"{where}: params= and schedule= go together (the plan places the params); got only "
                    f"{'params' if schedule is None else 'schedule'}.")
  if _nnx.is_optimizer(state):
    state = _nnx.flax_nnx().state(state)
  like = None if params is None else (params, _states.param_specs(params, schedule, axis_name))
  return _states.state_specs(state, axis_name, like=like)


def deferred_grads(state: Any, params: Any, *, schedule: Schedule | None = None, average: bool = False) -> Any:
  """This device's deferred gradient values, as a tree like `params` (zero elsewhere); see
  `prophet_jax._rewrite._defer.deferred_grads`.

  `state` is any container of a library state (a ScheduledState, DeferState, PipelinedState, a
  TrainState, an nnx.Optimizer or its nnx.state (give `schedule=` there: nnx drops the record of
  it), a dict, a chain's tuple) or None; a library state with nothing deferred gives zeros.

  Outside a mapping, on the global state of `mesh=` (each residual `(n, k, c)`) or pmap's stacked
  states (`(n, 1, k, c)`): the per-device values stacked on a new leading axis `(n, ...)`, or with
  `average=True` their mean over the devices (what to apply with `tx`).

  Raises:
    TypeError: `state` neither is nor holds a library state.
    ValueError: a state that records no schedule (an nnx.state), and none (or another) was given.
  """
  where = "deferred_grads"
  check_bool(where, "average", average)
  if state is None:
    return _defer.deferred_grads(None, params)
  given = state
  if _nnx.is_nnx_state(state):
    state = _defer_from_labels(_nnx.labelled(state), schedule, where)
  else:
    state = _nnx.unwrap(state.opt_state if _nnx.is_optimizer(state) else state)
    if not _states.holds_state(state):
      raise _not_a_state(where, given, "library state (a ScheduledState, DeferState, PipelinedState)")
  found = _defer.find_states(state)
  n = _global_n(found)
  if n is None:
    return _defer.deferred_grads(state, params, schedule=schedule)
  per = [_defer.deferred_grads([_defer.device_part(s, i) for s in found], params, schedule=schedule)
         for i in range(n)]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per)
  return jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), stacked) if average else stacked


def _global_n(found: list) -> int | None:
  """The device count of states laid out outside a mapping (residual (n, k, c) or (n, 1, k, c)), else None."""
  shapes = {np.shape(r) for s in found for r in s.residual}
  lead = {s[0] for s in shapes}   # (none without a state: no count)
  if len(lead) == 1 and (lead != {1} or any(len(s) == 4 for s in shapes)):
    return int(lead.pop())
  return None


def _defer_from_labels(labelled: Mapping, schedule: Schedule | None, where: str) -> list:
  """The DeferStates nnx re-labelled as {'norms', 'deferred', 'index', 'residual'} dicts, rebuilt with
  the schedule's tag (nnx drops it)."""
  keys = {"norms", "deferred", "index", "residual"}
  found: list = []

  def take(d: Mapping) -> Any:
    seq = lambda m: tuple((m[k].get_value() if _nnx.is_variable(m[k]) else m[k]) for k in sorted(m))  # noqa: E731
    found.append({k: seq(d[k]) for k in keys if isinstance(d.get(k), Mapping)})
    return d

  _nnx.walk_mappings(labelled, lambda d: {"residual", "index"} <= set(d), take)
  holds = found or _nnx.walk_mappings(labelled, lambda d: "inner" in d or "per_device" in d, lambda d: d)[1]
  if not holds:
    raise _not_a_state(where, labelled, "library state")
  if not found:
    return []
  if schedule is None or not schedule.defers:
    raise ValueError(f"{where}: an nnx.state holds {len(found)} deferral state(s), but nnx drops the "
                     f"record of the schedule they were made for: pass it, deferred_grads(state, params, "
                     f"schedule=the_schedule), or pass the nnx.Optimizer itself.")
  tag = _defer.defer_tag(schedule)
  return [DeferState(norms=f.get("norms", ()), deferred=f.get("deferred", ()), index=f["index"],
                            residual=f["residual"], tag=tag) for f in found]
