"""ZeRO-1 under a sharded (`dear`) plan: `tx` runs on this device's flat shard of every chunk and keeps its
state for those shards only (`ShardedState`); the update is all-gathered. `shard_mode` probes once what
`tx` may be: elementwise ('elementwise'), deciding from the global norm ('global-norm': one extra psum),
or refused (needs whole leaves). docs/design.md, "Sharded schedules in the rewrite".
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from . import _probe_trials
from ._states import ShardedState, ShardLayout, StateTag, expect, is_state
from ._defer import matched_leaves
from ._axis import axis_size
from ._reduction import step_setup, with_owed
from ._collectives import scatter_chunks
from ._sharded import all_gather_chunks, local_shards, reduce_scatter_chunks, shards_square_sum
from .._values._errors import ScheduleMismatchError, ShardingError
from .._values._schedule import Schedule, shard_size
from .._values._tree import is_reduced_leaf, path_str

NORM_SCOPE = "prophet/norm"  # the one extra psum of a global-norm transformation's squares
MODES = ("elementwise", "global-norm")

# transformations that choose or shape leaves by the params' tree (by name: a numeric check on a few
# small representative leaves cannot see what depends on paths or on the leaves' real sizes)
_STRUCTURAL = {
    "masked": "a mask that picks leaves of the params' tree (optax.masked, adamw(mask=...))",
    "partition": "labels that route leaves of the params' tree (optax.multi_transform / partition)",
    "multi_transform": "labels that route leaves of the params' tree (optax.multi_transform)",
    "scale_by_factored_rms": "second moments factored over each leaf's two largest axes (Adafactor)",
}


# --------------------------------------------------------------------------------------------------
# values


def shard_tag(schedule: Schedule, n: int, mode: str) -> StateTag:
  return StateTag.of(schedule, ShardLayout(int(n), tuple(shard_size(c.size, n) for c in schedule.chunks), mode))


def shard_structs(schedule: Schedule, n: int, mode: str) -> tuple[jax.ShapeDtypeStruct, ...]:
  """What `tx` runs on for n devices: this device's shard of every chunk, and the global norm's carrier."""
  structs = tuple(jax.ShapeDtypeStruct((shard_size(c.size, n),), c.dtype) for c in schedule.chunks)
  return structs + ((jax.ShapeDtypeStruct((), jnp.float32),) if mode == "global-norm" else ())


def _init_unbound(axis_name: Any, where: str) -> str:
  piped = where.startswith("pipelined")
  init, specs = ("p.init", "p.state_specs()") if piped else ("tx.init", f"P({axis_name!r})")
  return (f"{where}: the schedule is sharded (ZeRO-1): each device keeps the optimizer state of its own "
          f"shard, whose size depends on the number of devices on axis {axis_name!r} and whose values on "
          f"the device's index, so the state is made where that axis is bound. Under pmap: state = "
          f"jax.pmap({init}, axis_name={axis_name!r})(replicated_params)"
          f"{'' if piped else ' (or TrainState.create inside the pmap)'}; under shard_map: "
          f"jax.jit(jax.shard_map({init}, mesh=mesh, in_specs=P(), out_specs={specs}))(params), and pass "
          f"it with those specs (prophet_jax.state_specs(state, {axis_name!r}) gives them per leaf); on "
          f"global arrays in a plain jax.jit: {'pipelined' if piped else 'scheduled'}(..., mesh=mesh).")


# --------------------------------------------------------------------------------------------------
# may tx run on shards?


def _names(tx: Any, limit: int = 400) -> set[str]:
  """Names of the functions reachable from tx's init and update through closures (optax builds every
  transformation as closures: 'masked', 'clip_by_global_norm', ...)."""
  seen: set[int] = set()
  names: set[str] = set()
  todo = [tx.init, tx.update]
  while todo and len(seen) < limit:
    o = todo.pop()
    if id(o) in seen:
      continue
    seen.add(id(o))
    if isinstance(o, (tuple, list)):
      todo.extend(o)
    elif isinstance(o, dict):
      todo.extend(o.values())
    elif callable(o):
      names.add((getattr(o, "__qualname__", "") or "").split(".<locals>")[0])
      todo.extend(getattr(o, "func", None) for _ in (0,) if hasattr(o, "func"))  # functools.partial
      for cell in getattr(o, "__closure__", None) or ():
        try:
          todo.append(cell.cell_contents)
        except ValueError:  # an empty cell
          pass
  return names


_PROBE_DEVICES = 3
_PROBE_STEPS = 3
_PROBE_RTOL = 1e-4
_PROBE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_MODE_MEMO: dict[tuple, tuple[Any, str]] = {}


def shard_mode(tx: Any, params: Any, where: str = "scheduled") -> str:
  """How `tx` runs on ZeRO-1 shards: 'elementwise' or 'global-norm' (see the module docstring).

  Refuses by name what picks or shapes leaves by the params' tree; then runs `tx` on representative
  leaves (one per rank of `params`' floating leaves, dimensions cut to at most 3) and on their flat
  shards over 3 simulated devices (two chunks, zero-padded), 3 steps at gradient scales 1e-6, 1 and
  1e6, and compares the updates element by element (rtol 1e-4 of the largest): one small program
  (about 0.3 s of CPU), run in a thread of its own (jax's trace state is per thread), so it may be
  called while a step is traced; memoized per (tx, representative shapes).

  Raises:
    ShardingError: `tx` needs whole leaves or the params' tree (names what differs and the fix).
  """
  # one leaf per rank of the params' floating leaves (the first leaf of that rank, each dimension cut
  # to at most 3): what a leaf's shape can change; masks and labels by path are refused by name above
  ranks: dict[int, tuple[str, tuple[int, ...]]] = {}
  for p, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    shape = tuple(min(int(d), 3) for d in np.shape(x))
    if is_reduced_leaf(x) and int(np.prod(shape, dtype=np.int64)) > 0:
      ranks.setdefault(len(shape), (path_str(p), shape))
  reps = tuple(ranks[r] for r in sorted(ranks))
  key = (id(tx.init), id(tx.update), reps)
  hit = _MODE_MEMO.get(key)
  if hit is not None and hit[0] is tx:
    return hit[1]
  found = sorted(set(_STRUCTURAL) & _names(tx))
  if found:
    raise ShardingError(
        f"{where}: the schedule is sharded (ZeRO-1), so tx runs on each device's flat shards of the "
        f"chunks, not on the params' tree, but tx uses {_STRUCTURAL[found[0]]} ({found[0]}): on flat "
        f"shards that would silently change which values it touches. Drop it (e.g. adamw without "
        f"mask=), or use an all-reduce schedule (any policy but 'dear') for this optimizer.")
  # in a thread of its own: jax's trace state is per thread, so the probe runs (one small compiled
  # program) even while the caller is tracing a step (an init inside pmap or shard_map)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    mode = pool.submit(_probe, tx, reps, where).result()
  if len(_MODE_MEMO) > 64:
    _MODE_MEMO.clear()
  _MODE_MEMO[key] = (tx, mode)
  return mode


def _probe(tx: Any, reps: tuple[tuple[str, tuple[int, ...]], ...], where: str) -> str:
  if not reps:
    return "elementwise"
  paths, shapes = zip(*reps)
  sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
  total = sum(sizes)
  cut = max(1, total // 2)                                   # two chunks of the flat vector
  chunk_sizes = [cut, total - cut] if total > 1 else [total]
  d = _PROBE_DEVICES
  shard = [shard_size(c, d) for c in chunk_sizes]
  rng = np.random.default_rng(0)
  p0 = rng.standard_normal(total).astype(np.float32)
  grads = _probe_trials.gradients(rng, _PROBE_STEPS, chunk_sizes, shard)  # (trial, step, total)
  names = _names(tx)

  def tree_of(vec):  # the representative leaves, as a tuple (one per rank)
    return tuple(x.reshape(shape) for x, shape in zip(jnp.split(vec, np.cumsum(sizes)[:-1]), shapes))

  def whole(scale, p0, grads):
    p, out = tree_of(p0), []
    st = tx.init(p)
    for t in range(_PROBE_STEPS):
      u, st = tx.update(tree_of(grads[t] * scale), st, p, **_probe_trials.extra_args(names, t))
      out.append(jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in u]))
    return jnp.stack(out)

  def split(vec):   # each chunk zero-padded, one row per device
    return [jnp.pad(x, (0, d * s - c)).reshape(d, s)
            for x, c, s in zip(jnp.split(vec, np.cumsum(chunk_sizes)[:-1]), chunk_sizes, shard)]

  def sharded(scale, carrier, p0, grads):
    p_parts = split(p0)

    def one(dev):
      p = tuple(part[dev] for part in p_parts) + ((jnp.zeros((), jnp.float32),) if carrier else ())
      st, out = tx.init(p), []
      for t in range(_PROBE_STEPS):
        g_parts = split(grads[t] * scale)
        g = tuple(part[dev] for part in g_parts)
        if carrier:
          total_sq = sum(jnp.sum(jnp.square(part)) for part in g_parts)
          local_sq = sum(jnp.sum(jnp.square(x)) for x in g)
          g = g + (jnp.sqrt(jnp.maximum(total_sq - local_sq, 0.0)),)
        u, st = tx.update(g, st, p, **_probe_trials.extra_args(names, t))
        out.append(u[:len(chunk_sizes)])
      return out

    per_dev = jax.vmap(one)(jnp.arange(d))             # per step: tuple of (d, s) parts
    return jnp.stack([jnp.concatenate([part.reshape(-1)[:c] for part, c in zip(step, chunk_sizes)])
                      for step in per_dev])

  def run(scales, p0, grads):  # the values are arguments: nothing is evaluated while tracing
    return (jax.vmap(lambda sc, g: whole(sc, p0, g))(scales, grads),
            jax.vmap(lambda sc, g: sharded(sc, False, p0, g))(scales, grads),
            jax.vmap(lambda sc, g: sharded(sc, True, p0, g))(scales, grads))

  def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, int]:
    worst = (0.0, 1.0, 0)
    for r, g in zip(ref, got):
      big = (float(np.nanmax(np.abs(r))) if np.isfinite(r).any() else 0.0) or 1.0
      if not np.array_equal(np.isfinite(g), np.isfinite(r)):
        return float("inf"), big, int(np.argmax(np.isfinite(g) != np.isfinite(r)) % total)
      diff = np.abs(g - r)
      err = float(np.nanmax(diff)) if diff.size else 0.0
      if err / big > worst[0] / worst[1]:
        worst = (err, big, int(np.nanargmax(diff)) % total)
    return worst

  try:  # one small program, compiled once: the tree, the shards, the shards with the global norm
    args = (_probe_trials.scales(), p0, grads)
    # many tiny ops: XLA's backend optimisations cost seconds here and save nothing
    out = jax.jit(run).lower(*args).compile(compiler_options=_PROBE_OPTIONS)(*args)
    ref, plain, normed = (np.asarray(x, np.float64) for x in out)
    err, big, at = compare(ref, plain)
    if err <= _PROBE_RTOL * big:
      return "elementwise"
    err2, big2, _ = compare(ref, normed)
    if err2 <= _PROBE_RTOL * big2:
      return "global-norm"
  except Exception as e:  # noqa: BLE001 (whatever tx raises on flat shards: sm3's IndexError, ...)
    raise ShardingError(
        f"{where}: the schedule is sharded (ZeRO-1), so tx ({_probe_trials.tx_names(names)}) runs on each "
        f"device's flat shards of the chunks (a tuple of 1-D arrays), not on the params' tree; tx fails "
        f"there ({type(e).__name__}: "
        f"{str(e)[:300]}). It depends on the params' tree: use an all-reduce schedule (any policy but "
        f"'dear') for this optimizer.") from e
  leaf = paths[int(np.searchsorted(np.cumsum(sizes), at, side="right"))]   # where the update differs most
  raise ShardingError(
      f"{where}: the schedule is sharded (ZeRO-1), so tx ({_probe_trials.tx_names(names)}) runs on each "
      f"device's flat shards of the chunks, but its update there differs from its update on the params' tree (on a small stand-in "
      f"for the params' leaf {leaf!r}: by {err:.3g} where the largest update is {big:.3g}; with the global norm given, "
      f"by {err2:.3g}): tx needs whole leaves (per-leaf norms such as LAMB/LARS's trust ratio or "
      f"adaptive_grad_clip, matrix-shaped updates, a leaf's shape), which flat shards are not. Only "
      f"elementwise transformations (sgd, momentum, Adam/AdamW, ...) and global-norm ones "
      f"(clip_by_global_norm) run sharded; use an all-reduce schedule (any policy but 'dear') for this "
      f"optimizer.")


# --------------------------------------------------------------------------------------------------
# init and update, per device (inside pmap / shard_map)


def init(tx: Any, params: Any, schedule: Schedule, axis_name: Any, where: str = "scheduled") -> ShardedState:
  """`tx`'s state for this device's shards of `params` (inside the mapping: the axis must be bound).

  Raises:
    UnboundAxisError: called outside pmap / shard_map (says where to make the state).
    ShardingError: `tx` cannot run on shards (`shard_mode`).
    ScheduleMismatchError: `params` is not the schedule's tree.
  """
  n = axis_size(axis_name, where, _init_unbound(axis_name, where))
  flat, _, lmap = matched_leaves(params, schedule, where)
  mode = shard_mode(tx, params, where)
  p = local_shards(flat, schedule.chunks, lmap.row_leaf, axis_name, n)
  state = tx.init(p + ((jnp.zeros((), jnp.float32),) if mode == "global-norm" else ()))
  return ShardedState(per_device=jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], state),
                      tag=shard_tag(schedule, n, mode))


def check_state(state: Any, schedule: Schedule, n: int, where: str) -> None:
  """ScheduleMismatchError unless `state` is a ShardedState of this schedule for n devices."""
  expect(state, ShardedState,
         f"{where}: the schedule is sharded (ZeRO-1), so the optimizer state is each device's shard state (a "
         f"prophet_jax.ShardedState made by this transformation's init inside the mapping), got "
         f"{type(state).__name__}. Make it with init where the axis is bound (jax.pmap(tx.init, ...) or inside "
         f"the shard_map), or, after a re-plan, convert the old state: "
         f"prophet_jax.convert_state(state, params, schedule, tx=tx, num_devices=n).")
  tag, want = state.tag, shard_tag(schedule, n, "")
  shard = isinstance(tag, StateTag) and isinstance(tag.layout, ShardLayout)
  if not shard or tag.key != want.key or tag.layout[:2] != want.layout[:2]:
    got = repr(tag) if isinstance(tag, StateTag) else type(tag).__name__
    why = (f"made for {tag.n} devices, this axis has {n}" if shard and tag.key == want.key
           else "made for another schedule or tree")
    raise ScheduleMismatchError(
        f"{where}: the sharded optimizer state ({got}) does not belong to this schedule "
        f"({want!r}): it was {why}. A shard state holds one device's part of the "
        f"chunks it was cut from: after a re-plan or for another device count, re-shard it outside the "
        f"step with prophet_jax.convert_state(state, params, schedule, tx=tx, num_devices=n).")


def check_grad_shards(g: Any, schedule: Schedule, n: int, where: str) -> None:
  """ScheduleMismatchError unless `g` is a GradShards of this schedule for n devices."""
  tag, want = g.tag, shard_tag(schedule, n, "")
  if not (isinstance(tag, StateTag) and isinstance(tag.layout, ShardLayout)) or (
      tag.key, tag.layout[:2]) != (want.key, want.layout[:2]):
    raise ScheduleMismatchError(
        f"{where}: the gradient shards ({tag!r}) were reduce-scattered for another schedule or axis "
        f"size than this one ({want!r}): use the same schedule in hooked and scheduled.")
  if len(g.shards) != len(want.sizes):
    raise ScheduleMismatchError(f"{where}: the gradient shards hold {len(g.shards)} arrays, the schedule "
                                f"has {len(want.sizes)} chunks; they were edited.")


def update(tx: Any, updates: Any, state: Any, params: Any, schedule: Schedule, axis_name: Any, *,
           where: str = "scheduled", mean: bool = True, extra_args: dict | None = None, defer_state: Any = None
           ) -> tuple[Any, ShardedState]:
  """The ZeRO-1 step: reduce-scatter (unless `updates` is already `GradShards`), `tx` on this
  device's shards, all-gather the update; returns (the whole update, replicated, in the tree's
  structure; the new ShardedState). A re-plan's owed values (`defer_state`, convert_state's
  OwedState) join the gradients before the reduce-scatters.

  Leaves the schedule does not cover (integers, float0, zero-size) get a zero update (float0 stays).
  """
  given = is_state(updates)   # hooked's GradShards, or the gradients
  if given and defer_state is not None:
    raise ValueError(
        f"{where}: the state owes a re-plan's deferred values (convert_state's OwedState) to this "
        f"schedule's first step, which needs the gradients to add them to, but was given hooked's "
        f"reduce-scattered GradShards: run that first step with plain gradients (jax.grad of the loss, "
        f"then tx.update), or apply the owed values before converting.")
  if given and params is None:
    raise TypeError(f"{where}: given the gradient shards of hooked(...) (GradShards), update needs the "
                    f"params to lay the update out in their tree: tx.update(shards, opt_state, params) "
                    f"(flax's TrainState.apply_gradients and nnx.Optimizer pass them).")
  # tx's state for this device's shards: each device's own (a state made in this same map may be
  # invariant; a transformation's lax.cond, apply_if_finite's, needs both branches' states typed alike)
  s = step_setup(params if given else updates, schedule, axis_name, where, defer_state=defer_state,
                 grads=not given, checks=not given,
                 varying=jax.tree_util.tree_map(lambda x: x[0], getattr(state, "per_device", None)))
  n, template, treedef, lmap, chunks = s.n, s.flat, s.treedef, s.lmap, schedule.chunks
  check_state(state, schedule, n, where)
  if given:
    check_grad_shards(updates, schedule, n, where)
    shards, prev = tuple(updates.shards), updates.token[0]
  else:
    shards, prev = reduce_scatter_chunks(with_owed(s), chunks, lmap.row_leaf, axis_name, n=n,
                                         divisor=n if mean else None)
  p = None
  if params is not None:
    pflat, _, plmap = matched_leaves(params, schedule, where)
    p = local_shards(pflat, chunks, plmap.row_leaf, axis_name, n)
  if state.tag.mode == "global-norm":
    local, total = shards_square_sum(shards, axis_name, NORM_SCOPE)
    shards = shards + (jnp.sqrt(jnp.maximum(total - local, 0.0)),)
    if p is not None:
      p = p + (jnp.zeros((), jnp.float32),)
  try:
    u, inner = optax.with_extra_args_support(tx).update(shards, s.varying, p, **(extra_args or {}))
  except TypeError as e:  # jax's words for a per-device state meeting tx's constants in a lax.cond
    if "manual axis types do not match" not in str(e):
      raise
    raise TypeError(
        f"{where}: under shard_map with check_vma=True, tx's state on the shards is each device's own "
        f"(varying over {axis_name!r}), and tx picks between it and constants in a lax.cond "
        f"(contrib.reduce_on_plateau does), which jax's type check refuses. Map the step with "
        f"jax.shard_map(..., check_vma=False), or use scheduled(..., mesh=mesh) in a plain jax.jit, or "
        f"pmap. (jax: {str(e).splitlines()[0]})") from e
  # the carrier's update dropped
  bufs, _ = all_gather_chunks(tuple(u)[:len(chunks)], chunks, schedule.gathers, axis_name, n=n, vma=s.vma, prev=prev)
  rows = set(lmap.row_leaf)
  base = [x if i in rows or getattr(x, "dtype", None) == jax.dtypes.float0 else jnp.zeros_like(x)
          for i, x in enumerate(template)]
  out = scatter_chunks(base, chunks, lmap.row_leaf, bufs)
  new = ShardedState(per_device=jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], inner), tag=state.tag)
  return jax.tree_util.tree_unflatten(treedef, out), new
