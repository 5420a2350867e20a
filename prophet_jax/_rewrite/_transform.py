"""Carrying a Schedule out in the user's own jitted step: `scheduled` (optax) and `hooked` (backward hooks).

- `scheduled(tx, schedule, axis_name=...)` is an optax transformation: the scheduled all-reduce of the
  gradients, then `tx`. The all-reduces run after the backward pass, where the step's `update` is.
- `hooked(loss_fn, schedule, axis_name=...)` returns `grad_fn(params, batch) -> (loss, grads)` whose
  all-reduces run *inside* the backward pass: each group of chunks is issued from the backward rule of a
  `custom_vjp` identity on its parameters, as soon as their gradients exist, and a scalar token threaded
  through the hooks keeps the issue order of the schedule in the compiled program.
- `loop_hook(tree, name=...)` is the model-side helper for scan-over-layers models: applied to a layer's
  params inside the scanned body (e.g. through `flax.linen.map_variables`), it all-reduces that layer's
  gradients inside the backward loop, one trip per layer, when the step runs under `hooked(...,
  in_loop=(...))`; elsewhere it is the identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _mesh, _reduction, _zero
from .._values._checks import check_int, check_values, match_tree
from ._accumulate import init as accum_init
from ._collectives import (_zero_of, accumulated_allreduce, axis_size, carries, carry_over,
                           check_residual_varying, is_varying, reduce_scatter_chunks, reduce_units,
                           schedule_units, scheduled_allreduce, to_varying, unit_allreduces, vma_enabled)
from ._defer import DeferState, GroupState, check_state, group_states, init as defer_init, with_groups
from .._values._errors import AlreadyReducedError, CompositionError
from .._values._schedule import Bucket, Chunk, Schedule, shard_size
from .._values._tree import dtype_name, is_float_dtype, is_reduced_leaf, path_str

__all__ = ["ScheduledState", "scheduled", "check_composition", "hooked", "loop_hook", "hook_groups", "LOOP_SCOPE"]

LOOP_SCOPE = "prophet/loop/"


# --------------------------------------------------------------------------------------------------
# scheduled: the optax wrapper


class ScheduledState(NamedTuple):
  """State of `scheduled(tx, ...)`.

  Attributes:
    inner: the wrapped transformation's state, unchanged.
    defer_state: the schedule's `DeferState` (`prophet_jax.defer_state`) when it defers (`dlcp` with
      `max_defer > 0`), else None. Its residuals are each device's own: under `shard_map`, pass the
      whole optimizer state with `prophet_jax.state_specs(opt_state, axis_name)`.
    accum: with `every_k > 1`, the gradient accumulator (`AccumState`: the micro-step count and each
      device's sums, which `state_specs` also gives `P(axis_name)`), else None.
  """

  inner: Any
  defer_state: Any = None
  accum: Any = None


# Where `scheduled` sits in the user's optax composition is visible on the Python stack while the
# composition calls it (at init, eagerly, and at trace time): optax.chain and optax.named_chain call
# their members from a loop whose locals say which members ran before; optax.MultiSteps calls it from
# its `update`. These are the code objects of those functions (shared by every instance).


@functools.lru_cache(maxsize=1)
def _optax_codes() -> dict[str, Any]:
  ident = optax.identity()
  chain = optax.chain(ident)
  named = optax.named_chain(("a", ident))
  return {"chain.init": chain.init.__code__, "chain.update": chain.update.__code__,
          "named.init": named.init.__code__, "named.update": named.update.__code__,
          "multisteps.update": optax.MultiSteps.update.__code__}


def _transform_name(fn: Any) -> str:
  """'clip_by_global_norm' for optax's `clip_by_global_norm.<locals>.update_fn`."""
  q = getattr(fn, "__qualname__", None) or type(fn).__name__
  name = q.split(".<locals>")[0] if ".<locals>" in q else q
  if name == "with_extra_args_support":  # optax.chain's wrapper of a plain GradientTransformation
    for cell in getattr(fn, "__closure__", None) or ():
      inner = getattr(cell.cell_contents, "update", None)
      if callable(inner):
        return _transform_name(inner)
  return name


def _ran_before_in_chain(max_depth: int = 40) -> list[str]:
  """Names of the transformations an enclosing optax.chain / named_chain ran before the current member.

  Walks up the Python stack from the caller (plain host Python: at init, or while jax traces the step).
  Empty when no enclosing chain is found or every enclosing chain is at its first member.
  """
  codes = _optax_codes()
  before: list[str] = []
  frame = sys._getframe(2)
  callee = None
  for _ in range(max_depth):
    if frame is None:
      break
    code = frame.f_code
    try:
      loc = frame.f_locals if any(code is c for c in codes.values()) else {}
      if code is codes["chain.update"]:
        k = len(loc.get("new_state", ()))
        before += [_transform_name(f) for f in loc.get("update_fns", ())[:k]]
      elif code is codes["chain.init"] and callee is not None:
        cur = callee.f_locals.get("fn")  # the generator expression calling each member's init
        fns = list(loc.get("init_fns", ()))
        k = next((i for i, f in enumerate(fns) if f is cur), 0)
        before += [f"the chain's member #{i}" for i in range(k)]
      elif code in (codes["named.init"], codes["named.update"]):
        k = len(loc.get("states", loc.get("new_state", ())))
        before += [name for name, _ in loc.get("transforms", ())[:k]]
    except (TypeError, AttributeError):  # an optax version whose locals differ: no diagnosis
      pass
    callee, frame = frame, frame.f_back
  return before


def _inside_multisteps(max_depth: int = 100) -> bool:
  code = _optax_codes()["multisteps.update"]
  frame = sys._getframe(2)
  for _ in range(max_depth):
    if frame is None:
      return False
    if frame.f_code is code:
      return True
    frame = frame.f_back
  return False


def _not_first_error(before: list[str], where: str) -> CompositionError:
  names = ", ".join(before)
  those = "<those transformations>" if any(b.startswith("the chain's") for b in before) else names
  return CompositionError(
      f"scheduled(...) {where} runs after {names} in an optax.chain: those transformations would act "
      f"on each device's own gradients before the all-reduce, which gives another (silently wrong) "
      f"result than applying them to the all-reduced gradients. `scheduled` must be the first "
      f"transformation: wrap the rest instead, e.g. prophet_jax.scheduled(optax.chain({those}, tx), "
      f"schedule, axis_name=...).")


def scheduled(tx: optax.GradientTransformation, schedule: Schedule, *,
              axis_name: str | tuple[str, ...], mesh: Any = None,
              every_k: int = 1) -> optax.GradientTransformationExtraArgs:
  """An optax transformation that all-reduces the gradients as `schedule` says, then applies `tx`.

  Use it in place of a `jax.lax.pmean(grads, axis_name)` followed by `tx`: inside `jax.pmap(...,
  axis_name=...)`, or inside `jax.shard_map` over a mesh axis of that name (with the params marked
  varying before `jax.grad`: `jax.lax.pcast(params, axis_name, to='varying')`, see below). It drops
  into `flax.training.train_state.TrainState.create(..., tx=scheduled(tx, schedule, axis_name='data'))`
  and `flax.nnx.Optimizer(model, scheduled(tx, ...), wrt=nnx.Param)` unchanged. The updates passed to
  `update` must be the gradient tree the schedule was planned for (rows are matched by path; a
  mismatch raises ScheduleMismatchError naming the path, shape or dtype at fault and some of the
  tree's own paths). For nnx, plan from `nnx.state(model, nnx.Param)` or from the pure arrays
  (`nnx.to_pure_dict`): a Variable's 'l1/kernel/value' and the plain 'l1/kernel' name the same leaf.

  **It must be the outermost transformation, first in any chain.** Anything before it (clipping,
  normalising, any nonlinear function of the gradients) acts on each device's own gradients, not on
  the all-reduced ones, and gives a silently different result: write `scheduled(optax.chain(
  optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), schedule, axis_name=...)`, never
  `optax.chain(optax.clip_by_global_norm(1.0), scheduled(...))`. `init` and `update` raise
  CompositionError when they find themselves after another member of an `optax.chain` or
  `optax.named_chain` (visible on the call stack); for other compositions, `check_composition(tx,
  params, axis_name=...)` tests numerically that the optimizer's result depends only on the mean
  gradient.

  Gradient accumulation: `scheduled(tx, schedule, axis_name=..., every_k=k)`. Each call adds this
  device's gradients to a per-device accumulator (`ScheduledState.accum`); every k-th call all-reduces
  the mean of the k micro-steps' gradients on the schedule and applies `tx`, the other calls return
  zero updates and leave `tx`'s state alone: the full-batch step over k micro-batches, for one
  all-reduce of the gradients per k micro-steps (the compiled program holds the chunks' all-reduces
  in the branch of one `lax.cond` taken on the k-th call). It works under `pmap`, `shard_map` (pass
  the state with `prophet_jax.state_specs`, which gives the accumulator's sums `P(axis_name)`, and
  make it inside the map, as for deferral residuals) and on the mesh (`mesh=`: `init` lays the sums
  out over the data axis). The sums are float32 for gradients narrower than 32 bits. A deferring
  schedule defers once per k micro-steps. Why not `optax.MultiSteps`: in optax 0.2.8 its `update`
  runs the inner transformation on every micro-step and keeps the result with `jnp.where`, so
  `MultiSteps(scheduled(tx), k)` all-reduces (the running mean) on every micro-step, and under
  `shard_map` its per-device accumulator cannot live in a replicated state (it raises
  CompositionError naming `every_k`); `scheduled(optax.MultiSteps(tx, k))` all-reduces every
  micro-step's gradients (correct, replicated, k times the communication).

  Deferral (a `dlcp` schedule with `max_defer > 0`): the schedule's `DeferState` lives in the state
  (`ScheduledState.defer_state`; None for a schedule that defers nothing, whose state and compiled
  step are what they were before deferral existed). Each step, up to `max_defer` of the elements (a
  group's lowest-ranked chunks by the previous step's reduced norms, the same on every device) are not
  all-reduced; each device keeps its values in its residual, which later sends of the same chunks
  carry (error feedback: nothing is lost; all at the next step with `Bucket.release` 1, damped over
  the following sends below 1, dlcp's default). Under `pmap`
  nothing changes for the user: `init` once, replicate, as any optimizer state. Under `shard_map` the
  residuals vary over the axis: pass the optimizer state with `prophet_jax.state_specs(opt_state,
  axis_name)` (`P(axis_name)` for residuals, `P()` for the rest) as in_specs and out_specs, and make
  it inside the map: `jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
  params)` with `specs = prophet_jax.state_specs(jax.eval_shape(tx.init, params), axis_name)`; a
  residual passed replicated raises ValueError naming `state_specs`.

  Under `shard_map`'s default `check_vma=True`, `jax.grad` of replicated params already sums the
  gradients over the axis; that is detected and raises AlreadyReducedError naming the fix. Under
  `pmap` it cannot be detected (nothing is marked varying there); a pmap step is per-device already.

  A sharded schedule (`dear`, ZeRO-1; docs/design.md, "Sharded schedules in the rewrite"): `update`
  reduce-scatters the gradients chunk by chunk (or takes `hooked`'s `GradShards`, whose
  reduce-scatters ran inside backward, and then needs `params`), runs `tx` on the tuple of this
  device's shards (one 1-D array per chunk, the params' shards beside them), and all-gathers the
  update, returned whole and replicated. The state is `ScheduledState(inner=ShardedState(...))`,
  `tx`'s state for this device's shards only: 1/n of the replicated one plus the padding. `init`
  runs where the axis is bound (`jax.pmap(tx.init, axis_name=...)`, inside the `shard_map` with
  `out_specs=P(axis_name)`, or anywhere with `mesh=`), and checks what `tx` may be: elementwise
  transformations run as they are, `clip_by_global_norm` gets the global norm from one extra psum,
  anything needing whole leaves or the params' tree raises ShardingError (`_zero.shard_mode`).

  On global arrays, in a plain `jax.jit` (`mesh=`): the gradients must come *unreduced* over the
  data axis, each device's partial sum (jax's `unreduced` sharding type, on a mesh with Explicit
  axes: differentiate with respect to params resharded to `P(reduced={axis_name})`, and `jax.grad`
  leaves the sum to you); `update` then reduces them on the schedule (its chunks' all-reduces, in
  order, summed: the partial sums already carry the loss's mean) and applies `tx` to the replicated
  result. Replicated gradients (the partitioner already reduced them) raise AlreadyReducedError; with
  a deferring schedule, `init` lays the deferral residuals out on the mesh (`P(axis_name)`).

  Args:
    tx: the optimizer to apply to the averaged gradients (e.g. `optax.sgd(0.1, momentum=0.9)`).
    schedule: the Schedule to carry out (from `prophet_jax.plan`).
    axis_name: the data-parallel axis name.
    mesh: reduce gradients obtained unreduced over `axis_name` on this mesh, inside a plain
      `jax.jit` on global arrays (see above); None: inside `jax.pmap` or `jax.shard_map`.
    every_k: micro-steps per all-reduce and update (gradient accumulation, see above); 1, the
      default, reduces and updates on every call.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `ScheduledState(inner=tx_state,
    defer_state=..., accum=...)` (`defer_state` None unless the schedule defers; `accum` None unless
    `every_k > 1`).

  Raises:
    TypeError: `tx`, `schedule`, `axis_name` or `every_k` is of the wrong kind (at construction).
    ValueError: `every_k` below 1, or above 1 with a sharded schedule (at construction).
    CompositionError: at `init` or `update`, `scheduled` is not first in an `optax.chain`; at trace
      time, it is inside `optax.MultiSteps` under `shard_map`.
    UnboundAxisError, ScheduleMismatchError, AlreadyReducedError: at trace time, from `update`
      (ScheduleMismatchError also for a state made by `init` of another deferring schedule).
    ValueError: at trace time, the schedule stripes over more links than the platform runs at once
      (CPU: 1), or, under shard_map, a deferral residual or an accumulator's sums passed replicated.
    ShardingError: a sharded schedule, at `init`: `tx` cannot run on shards.
    UnboundAxisError: a sharded schedule, `init` outside the mapping (without `mesh=`).

  Example:
    >>> tx = prophet_jax.scheduled(optax.sgd(0.1, momentum=0.9), schedule, axis_name="data")
    >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    >>> # inside jax.pmap(..., axis_name="data"): state = state.apply_gradients(grads=grads)
  """
  check_values("scheduled", tx=tx, schedule=schedule, axis_name=axis_name)
  every_k = check_int("scheduled", "every_k", every_k, lo=1,
                      fix="It is the number of micro-steps per all-reduce and update; 1 reduces every call.")
  if every_k > 1 and schedule.sharded:
    raise ValueError(
        f"scheduled: every_k={every_k} with a sharded schedule (policy {schedule.policy!r}: reduce-scatters "
        f"and all-gathers): its accumulation is not built for the shards. Accumulate inside instead, "
        f"scheduled(optax.MultiSteps(tx, {every_k}), schedule) (it reduce-scatters every micro-step), or plan "
        f"an all-reduce policy for every_k.")
  if mesh is not None:
    _mesh.check_mesh(mesh, axis_name, "scheduled")

  def init_fn(params):
    before = _ran_before_in_chain()
    if before:
      raise _not_first_error(before, "init")
    if schedule.sharded:  # ZeRO-1: tx's state for this device's shards only
      if mesh is not None:
        return ScheduledState(inner=_mesh.sharded_init(tx, params, schedule, mesh=mesh, axis_name=axis_name))
      return ScheduledState(inner=_zero.init(tx, params, schedule, axis_name, "scheduled"))
    defer = accum = None
    if schedule.defers:
      defer = defer_init(schedule) if mesh is None else _mesh.global_defer_state(schedule, mesh, axis_name)
    if every_k > 1:
      accum = accum_init(schedule) if mesh is None else _mesh.global_accum_state(schedule, mesh, axis_name)
    return ScheduledState(inner=tx.init(params), defer_state=defer, accum=accum)

  def inner_update(reduced, inner, params, extra_args):
    if isinstance(tx, optax.GradientTransformationExtraArgs):
      return tx.update(reduced, inner, params, **extra_args)
    return tx.update(reduced, inner, params)

  def update_fn(updates, state, params=None, **extra_args):
    before = _ran_before_in_chain()
    if before:
      raise _not_first_error(before, "update")
    if not (isinstance(state, tuple) and hasattr(state, "inner") and hasattr(state, "defer_state")):
      raise TypeError(f"scheduled(...).update(updates, state): state={state!r:.80} is not the state this "
                      f"transformation's init made (a ScheduledState(inner, defer_state)). Pass the state "
                      f"tx.init(params) returned (or the one the last update returned; TrainState and "
                      f"nnx.Optimizer keep it for you).")
    _check_masked(updates, schedule)
    if schedule.sharded:  # reduce-scatter, tx on this device's shards, all-gather the update
      if carries(state.defer_state, schedule):   # a re-plan from a deferring plan: carry its residual
        if mesh is not None:
          raise TypeError(
              "scheduled(..., mesh=...).update: the state holds the deferral state of another (deferring) "
              "plan, whose residual a sharded schedule's update on the mesh does not carry over. Keep it: "
              "g = prophet_jax.deferred_grads(opt_state, params) (its mean over the data axis), one more "
              "update with the old tx, then opt_state._replace(defer_state=None).")
        updates, _ = carry_over(updates, state.defer_state, schedule, axis_name, "scheduled")
      if mesh is not None:
        new, inner = _mesh.sharded_update(tx, updates, state.inner, params, schedule, mesh=mesh,
                                          axis_name=axis_name, extra_args=extra_args)
      else:
        new, inner = _zero.update(tx, updates, state.inner, params, schedule, axis_name, where="scheduled",
                                  extra_args=extra_args)
      return new, ScheduledState(inner=inner)
    try:
      if every_k > 1:
        if mesh is not None:
          reduced, defer, accum, emit = _mesh.accumulate_unreduced(
              updates, schedule, mesh=mesh, axis_name=axis_name, where="scheduled(mesh=...)",
              every_k=every_k, accum=state.accum, defer_state=state.defer_state)
        else:
          reduced, defer, accum, emit = accumulated_allreduce(
              updates, schedule, axis_name, every_k=every_k, accum=state.accum, mean=True,
              where="scheduled", defer_state=state.defer_state)
      elif mesh is not None:  # global gradients, unreduced over the axis: reduced on the mesh
        reduced, defer = _mesh.reduce_unreduced(updates, schedule, mesh=mesh, axis_name=axis_name,
                                                where="scheduled(mesh=...)", defer_state=state.defer_state)
      else:
        reduced, defer = scheduled_allreduce(updates, schedule, axis_name, mean=True, where="scheduled",
                                             defer_state=state.defer_state)
    except AlreadyReducedError as e:
      if mesh is not None or not _inside_multisteps():
        raise
      raise CompositionError(
          f"scheduled(...) inside optax.MultiSteps under shard_map: MultiSteps keeps an accumulator of "
          f"each device's own gradients, which varies over axis {axis_name!r} and cannot live in the "
          f"replicated optimizer state (optax's own update then fails); and MultiSteps runs the inner "
          f"transformation on every micro-step, so the all-reduces would run on every one anyway. "
          f"Accumulate in scheduled itself: prophet_jax.scheduled(tx, schedule, axis_name={axis_name!r}, "
          f"every_k=k) all-reduces once per k micro-steps (pass its state with "
          f"prophet_jax.state_specs(state, {axis_name!r})).") from e
    if every_k == 1:
      new, inner = inner_update(reduced, state.inner, params, extra_args)
      return new, ScheduledState(inner=inner, defer_state=defer)
    # the update on the k-th micro-step only, zeros (and tx's state unchanged) on the others
    apply = lambda r, i: inner_update(r, i, params, extra_args)  # noqa: E731
    shapes = jax.eval_shape(apply, reduced, state.inner)[0]
    new, inner = jax.lax.cond(
        emit, apply, lambda r, i: (jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), i),
        reduced, state.inner)
    return new, ScheduledState(inner=inner, defer_state=defer, accum=accum)

  init_fn._prophet_scheduled = True  # type: ignore[attr-defined]
  update_fn._prophet_scheduled = True  # type: ignore[attr-defined]
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_masked(updates: Any, schedule: Schedule) -> None:
  """CompositionError when `scheduled` runs inside `optax.masked` / `optax.multi_transform` and sees
  only part of the tree its schedule was planned for (the other leaves arrive as optax's MaskedNode).

  With a mask (or partition) that gives this transformation every leaf, or a schedule planned for
  exactly the leaves it sees, nothing is raised: that composition works. Otherwise the leaves masked
  away from `scheduled` would not be all-reduced by it, and the schedule's rows for them have no leaf:
  the message names them and the two compositions that work.
  """
  masked_type = getattr(optax, "MaskedNode", None)
  if masked_type is None:
    return
  with_masks, _ = jax.tree_util.tree_flatten_with_path(updates, is_leaf=lambda x: isinstance(x, masked_type))
  masked = [path_str(p) for p, x in with_masks if isinstance(x, masked_type)]
  if not masked:
    return
  present = {path_str(p) for p, x in with_masks if not isinstance(x, masked_type)}
  alias = lambda p: p[:-len("/value")] if p.endswith("/value") else p  # noqa: E731 (nnx spelling)
  present |= {alias(p) for p in present}
  missing = [r[0] for r in schedule.rows if r[0] not in present and alias(r[0]) not in present]
  if not missing:
    return   # the schedule covers exactly what this transformation sees: a partition of its own
  raise CompositionError(
      f"scheduled(...) runs inside optax.masked or optax.multi_transform, which give it only part of the "
      f"gradient tree: {len(masked)} leaves are masked away from it (e.g. {masked[:3]}), and the "
      f"schedule was planned for {len(schedule.rows)} leaves, {len(missing)} of them masked away (e.g. "
      f"{missing[:3]}); the model did not change. Either make scheduled the outermost transformation, "
      f"prophet_jax.scheduled(optax.multi_transform(...), schedule, axis_name=...) (every leaf "
      f"all-reduced, then partitioned), or plan a schedule for exactly the leaves this partition gets "
      f"(GradientProfile.from_params of that subtree) and give every other partition its own "
      f"scheduled(...) (a masked-away leaf that no scheduled(...) reduces is never all-reduced).")


def check_composition(tx: optax.GradientTransformation, params: Any, *, axis_name: str | tuple[str, ...],
                      num_devices: int = 4, steps: int = 4, seed: int = 0,
                      rtol: float = 1e-5) -> None:
  """Checks numerically that `tx`'s update depends only on the mean of the per-device gradients.

  That is what a data-parallel optimizer must compute, and what `scheduled(...)` outermost gives. The
  check runs one `init` and `steps` updates of `tx` under `jax.vmap(..., axis_name=axis_name)` over
  `num_devices` simulated devices (on the default device, no mesh needed), twice: with random
  per-device gradients g_i, and with g_i + d_i where the d_i sum to zero (at a small and at a large
  scale, so clipping thresholds are crossed either way). Both must give the same update on every
  device. A transformation before the all-reduce that is not linear in the gradients (clipping,
  normalising, `scale_by_adam`), or a missing all-reduce, makes the update depend on the d_i and
  fails the check. Use it in a test or once at start-up for compositions the automatic check of
  `scheduled` cannot see (a custom wrapper, `optax.multi_transform`, ...).

  Args:
    tx: the user's whole optimizer (containing `scheduled(...)` somewhere).
    params: the params (or a tree of arrays / ShapeDtypeStructs shaped like them).
    axis_name: the axis name `scheduled` was given.
    num_devices: simulated devices (>= 2).
    steps: updates to run (each compared), enough for e.g. `optax.MultiSteps` to emit one.
    seed: for the random gradients.
    rtol: allowed difference, relative to the largest update (the reduced gradients are exact, so
      a correct composition gives identical updates).

  Raises:
    CompositionError: the update depends on more than the mean gradient (names the leaf and the size
      of the difference).
    ValueError: `num_devices` < 2.
  """
  check_int("check_composition", "num_devices", num_devices, lo=2)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  shapes = [(tuple(np.shape(x)), jnp.dtype(x.dtype)) for _, x in leaves_with_path]
  paths = [path_str(p) for p, _ in leaves_with_path]
  params = jax.tree_util.tree_unflatten(treedef, [jnp.zeros(s, d) for s, d in shapes])
  rng = np.random.default_rng(seed)

  # Values on a grid that every float dtype here holds exactly (multiples of 2**-8 below 2**13 in
  # float32; small integers in 16-bit floats), so g_i + d_i and every partial sum over the devices are
  # exact: the all-reduced mean is bit-identical in all three runs, and any difference in the update
  # comes from a transformation that saw the per-device values.
  def grid(shape: tuple[int, ...], dtype: Any, spread: float) -> np.ndarray:
    if jnp.dtype(dtype).itemsize >= 4:
      return np.round(np.clip(rng.standard_normal(shape) * spread, -2 ** 12, 2 ** 12) * 256) / 256
    return np.round(np.clip(rng.standard_normal(shape) * min(spread, 4.0), -16, 16))

  inexact = [is_float_dtype(d) for _, d in shapes]
  base = [grid((num_devices, *s), d, 1.0).astype(np.float32) if f else np.zeros((num_devices, *s), d)
          for (s, d), f in zip(shapes, inexact)]
  variants = []
  for spread in (0.1, 1e3):
    v = []
    for g, (s, d), f in zip(base, shapes, inexact):
      if not f:
        v.append(g)
        continue
      e = grid(s, d, spread).astype(np.float32)
      dev = np.zeros_like(g)
      dev[0], dev[1] = e, -e  # sums to exactly zero
      v.append(g + dev)
    variants.append(v)
  def one(flat_g):
    g = jax.tree_util.tree_unflatten(treedef, [x.astype(d) if is_float_dtype(d) else x
                                               for x, (_, d) in zip(flat_g, shapes)])
    # init where the axis is bound (a sharded schedule's state is each device's shard state)
    st, outs = tx.init(params), []
    for _ in range(steps):  # several steps, so that e.g. optax.MultiSteps emits an update
      u, st = tx.update(g, st, params)
      outs += [jnp.asarray(x, jnp.float32) for x in jax.tree_util.tree_leaves(u)]
    return outs

  run = jax.jit(jax.vmap(one, axis_name=axis_name))
  ref = [np.asarray(x) for x in run(base)]
  paths = paths * steps
  scale = max((float(np.max(np.abs(x))) for x in ref if x.size), default=0.0)
  for i, x in enumerate(ref):
    spread = float(np.max(np.abs(x - x[:1]))) if x.size else 0.0
    if spread > rtol * scale:
      raise CompositionError(
          f"check_composition: the updates differ across the {num_devices} simulated devices (leaf "
          f"{paths[i] if i < len(paths) else i!r}: by {spread:.3g}, the largest update is {scale:.3g}): "
          f"no all-reduce runs before them. Wrap the optimizer: prophet_jax.scheduled(tx, schedule, "
          f"axis_name={axis_name!r}).")
  for v in variants:
    got = [np.asarray(x) for x in run(v)]
    for i, (x, y) in enumerate(zip(got, ref)):
      diff = float(np.max(np.abs(x - y))) if x.size else 0.0
      if diff > rtol * scale:
        raise CompositionError(
            f"check_composition: the update of leaf {paths[i] if i < len(paths) else i!r} changes "
            f"(by {diff:.3g}; the largest update is {scale:.3g}) when the per-device gradients change "
            f"but their mean does not: some transformation acts on each device's own gradients "
            f"before the all-reduce (clipping, normalising, ...). Make scheduled(...) the outermost "
            f"transformation: prophet_jax.scheduled(optax.chain(<the others>, tx), schedule, "
            f"axis_name={axis_name!r}).")


# --------------------------------------------------------------------------------------------------
# hooked: all-reduces inside the backward pass


def hook_groups(schedule: Schedule) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
  """Splits the issued units into hook groups: (first unit, end unit, rows), in issue order.

  The units are `_collectives.schedule_units(schedule)`: each chunk of a lossless bucket, and each
  deferral group (`Bucket.defer > 0`, whose chunks are ranked and reduced together) as one unit; for a
  lossless schedule they are its chunks. A hook fires when all of its parameters' gradients exist, so
  a unit must live in the hook of every row it touches: units sharing a row share a group, and groups
  are contiguous ranges of the issue order (so the token keeps the order of the schedule exactly).
  Typical schedules give one group per chunk (merged leaves) or one group per leaf (a leaf split into
  partitions).
  """
  groups: list[list[Any]] = []  # [start, end, set(rows)]
  for k, unit in enumerate(schedule_units(schedule)):
    rows = set(unit.rows) if isinstance(unit, Chunk) else {r for c in unit.chunks for r in c.rows}
    hit = next((j for j, g in enumerate(groups) if g[2] & rows), None)
    if hit is None:
      groups.append([k, k + 1, rows])
    else:
      merged = set(rows)
      for g in groups[hit:]:
        merged |= g[2]
      groups[hit:] = [[groups[hit][0], k + 1, merged]]
  return tuple((a, b, tuple(sorted(r))) for a, b, r in groups)


def _encode(g: GroupState) -> tuple[jax.Array, ...]:
  """A deferral group's state as floats, so it can be a custom_vjp primal input whose "cotangent" the
  backward rule sets to the new state (an int or bool input only takes a float0 cotangent). The chunk
  numbers and the mask are small integers: exact in float32."""
  return (g.norms, g.deferred.astype(jnp.float32), g.index.astype(jnp.float32), g.residual)


def _decode(x: Sequence[jax.Array]) -> GroupState:
  norms, deferred, index, residual = x
  return GroupState(norms=norms, deferred=deferred > 0.5, index=index.astype(jnp.int32), residual=residual)


def _relabel(c: Chunk, local: Mapping[int, int]) -> Chunk:
  """`c` with its rows renumbered to a hook's own leaves (`local`: schedule row -> the hook's index)."""
  return Chunk(slices=tuple((local[r], a, b) for r, a, b in c.slices), dtype=c.dtype)


def _make_hook(units: Sequence[Any], first_index: int, rows: Sequence[int], axis_name: Any,
               divisor: int, cast: Sequence[bool]) -> Callable:
  """A custom_vjp identity on (leaves of `rows`, token, deferral states) whose backward runs `units`.

  Forward: the leaves (cast to varying where `cast` says, so that under check_vma their cotangents
  stay per-device) and the token, unchanged. Backward: the units' all-reduces on the leaves'
  cotangents, the first tied to the incoming token cotangent, and a token cotangent tied to the last
  result. The deferral groups among `units` take their states (encoded by `_encode`) as primal inputs
  and return the new states as those inputs' cotangents, so `jax.grad` with respect to the states
  gives the new states.
  """
  local = {r: i for i, r in enumerate(rows)}
  local_units = tuple(_relabel(u, local) if isinstance(u, Chunk) else
                      dataclasses.replace(u, chunks=tuple(_relabel(c, local) for c in u.chunks)) for u in units)
  row_leaf = tuple(range(len(rows)))

  @jax.custom_vjp
  def hook(leaves, token, states):
    return [(to_varying(x, axis_name) if c else x) for x, c in zip(leaves, cast)], token

  def fwd(leaves, token, states):
    return hook(leaves, token, states), states

  def bwd(states, cts):
    ct_leaves, ct_token = cts
    out, last, new = reduce_units(list(ct_leaves), local_units, row_leaf, axis_name, divisor=divisor,
                                  first_index=first_index, prev=ct_token,
                                  defer=tuple(_decode(x) for x in states))
    return out, _zero_of(last, ct_token.dtype), tuple(_encode(g) for g in new)

  hook.defvjp(fwd, bwd)
  return hook


def _make_rs_hook(chunks: Sequence[Chunk], first_index: int, rows: Sequence[int], axis_name: Any, n: int,
                  divisor: int, cast: Sequence[bool], avals: Sequence[tuple[tuple[int, ...], Any]]) -> Callable:
  """A custom_vjp identity on (leaves of `rows`, token, shard slots) whose backward reduce-scatters
  `chunks` (a sharded schedule's hook: the DeAR pipeline's first half).

  Forward: the leaves (cast to varying where `cast` says) and the token, unchanged; the slots (one
  zero array of `shard_size` elements per chunk) are inputs only. Backward: the chunks'
  reduce-scatters on the leaves' cotangents, the first tied to the incoming token cotangent; the
  reduced shards are returned as the slots' cotangents (so `jax.grad` with respect to the slots gives
  them), zeros as the leaves' (nothing reads the full gradients), and a token cotangent tied to the
  last result.
  """
  local = {r: i for i, r in enumerate(rows)}
  local_chunks = tuple(_relabel(c, local) for c in chunks)
  row_leaf = tuple(range(len(rows)))

  @jax.custom_vjp
  def hook(leaves, token, slots):
    return [(to_varying(x, axis_name) if c else x) for x, c in zip(leaves, cast)], token

  def fwd(leaves, token, slots):
    return hook(leaves, token, slots), None

  def bwd(_, cts):
    ct_leaves, ct_token = cts
    shards, last = reduce_scatter_chunks(list(ct_leaves), local_chunks, row_leaf, axis_name, n=n,
                                         divisor=divisor, first_index=first_index, prev=ct_token)
    return [jnp.zeros(s, d) for s, d in avals], _zero_of(last, ct_token.dtype), tuple(shards)

  hook.defvjp(fwd, bwd)
  return hook


def _hooked_sharded(loss_fn: Callable[..., Any], schedule: Schedule, axis_name: Any, has_aux: bool,
                    has_state: bool, reduction: str = "mean") -> Callable[..., Any]:
  """`hooked`'s grad_fn for a sharded schedule: (value, GradShards), the reduce-scatters in backward."""
  groups = hook_groups(schedule)
  chunks = schedule.chunks

  def grad_fn(params, *args, **kwargs):
    n = axis_size(axis_name, "hooked")
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    lmap = match_tree(leaves_with_path, schedule, where="hooked")
    flat = [leaf for _, leaf in leaves_with_path]
    vma = vma_enabled(axis_name)
    varying = (lambda x: to_varying(x, axis_name)) if vma else (lambda x: x)
    hooks = []
    for a, b, rows in groups:
      cast = [vma and not is_varying(flat[lmap.row_leaf[r]], axis_name) for r in rows]
      avals = [(np.shape(flat[lmap.row_leaf[r]]), flat[lmap.row_leaf[r]].dtype) for r in rows]
      hooks.append((rows, a, b, _make_rs_hook(chunks[a:b], a, rows, axis_name, n,
                                              _reduction.divisor(reduction, n), cast, avals)))
    slots = tuple(varying(jnp.zeros((shard_size(c.size, n),), c.dtype)) for c in chunks)

    def inner(flat_params, token, slots):
      flat_params = list(flat_params)
      for rows, a, b, hook in reversed(hooks):  # backward runs them in reverse: issue order
        ids = [lmap.row_leaf[r] for r in rows]
        out, token = hook([flat_params[i] for i in ids], token, slots[a:b])
        for i, x in zip(ids, out):
          flat_params[i] = x
      return loss_fn(jax.tree_util.tree_unflatten(treedef, flat_params), *args, **kwargs)

    token = varying(jnp.zeros((), jnp.float32))
    value, (_, tok, shards) = jax.value_and_grad(inner, argnums=(0, 1, 2), has_aux=has_aux or has_state,
                                                 allow_int=True)(flat, token, slots)
    return value, _zero.GradShards(shards=tuple(shards), token=tok.reshape(1),
                                   tag=_zero._tag(schedule, n, ""))

  return grad_fn


_LOOP_AXIS: contextvars.ContextVar[Any] = contextvars.ContextVar("prophet_loop_axis", default=None)


@contextlib.contextmanager
def _loop_axis(axis_name: Any, divisor: int, vma: bool, calls: list[str]):
  tok = _LOOP_AXIS.set((axis_name, divisor, vma, calls))
  try:
    yield
  finally:
    _LOOP_AXIS.reset(tok)


def loop_hook(tree: Any, *, name: str = "layer") -> Any:
  """Model-side helper: all-reduce `tree`'s gradients inside a scanned body's backward pass.

  Apply it to one layer's params *inside* the body of `jax.lax.scan` / `flax.linen.scan` (for linen,
  wrap the scanned module: `nn.map_variables(Block, "params", trans_in_fn=lambda p: loop_hook(p),
  init=True)`). When the step runs under `hooked(..., in_loop=(path prefix of the scanned params,))`,
  the body's backward then all-reduces that layer's gradients (one all-reduce per dtype, labelled
  `prophet/loop/<name>`) on every trip of the backward loop, right after the layer's weight
  gradients exist, which a loss-level hook or `scheduled` cannot do (their all-reduces run after the
  loop ends). Outside `hooked` (init, evaluation, a plain `jax.grad`) it is the identity.

  Args:
    tree: the layer's params (one scan slice).
    name: a label for the all-reduce's named scope.

  Returns:
    `tree`, unchanged in value.
  """
  ctx = _LOOP_AXIS.get()
  if ctx is None:
    return tree
  axis_name, divisor, vma, calls = ctx
  calls.append(name)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  idx = [i for i, x in enumerate(leaves) if is_reduced_leaf(x) and np.size(x) > 0]
  if not idx:
    return tree
  sel = [leaves[i] for i in idx]
  dtypes = list(dict.fromkeys(dtype_name(x.dtype) for x in sel))
  chunks = []
  for dt in dtypes:
    chunks.append(Chunk(slices=tuple((j, 0, int(np.size(x))) for j, x in enumerate(sel)
                                     if dtype_name(x.dtype) == dt), dtype=dt))
  row_leaf = tuple(range(len(sel)))
  cast = [vma and not is_varying(x, axis_name) for x in sel]

  @jax.custom_vjp
  def hook(xs):
    return [(to_varying(x, axis_name) if c else x) for x, c in zip(xs, cast)]

  def fwd(xs):
    return hook(xs), None

  def bwd(_, cts):
    out, _, _ = reduce_units(list(cts), chunks, row_leaf, axis_name, divisor=divisor,
                             scope=f"{LOOP_SCOPE}{name}")
    return (out,)

  hook.defvjp(fwd, bwd)
  new = hook(sel)
  for i, x in zip(idx, new):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


_NO_STATE = object()


def _check_loss_output(out: Any, has_aux: bool, has_state: bool) -> Any:
  """The loss in `loss_fn`'s output, with a TypeError that names the fix when the output's form is not
  the one hooked was told (a `(loss, aux)` tuple without `has_aux=True`, a non-scalar loss)."""
  if has_aux or has_state:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      flag = "has_state" if has_state else "has_aux"
      raise TypeError(f"hooked(..., {flag}=True): loss_fn must return a pair (loss, "
                      f"{'new_model_state' if has_state else 'aux'}), got {type(out).__name__}.")
    loss = out[0]
  else:
    if isinstance(out, (tuple, list)):
      raise TypeError(f"hooked: loss_fn returned a {type(out).__name__} of {len(out)} values, not a scalar "
                      f"loss. If it returns (loss, aux), pass has_aux=True (grad_fn then returns ((loss, "
                      f"aux), grads)); if (loss, new_model_state) with a model state argument, "
                      f"has_state=True.")
    loss = out
  shape = np.shape(loss)
  if shape != () or not is_float_dtype(getattr(loss, "dtype", np.float32)):
    raise TypeError(f"hooked: the loss must be a real floating scalar to be differentiated; loss_fn "
                    f"returned {getattr(loss, 'dtype', type(loss).__name__)}{tuple(shape)}. Reduce it to a "
                    f"scalar (e.g. .mean()) and return other values as aux (has_aux=True).")
  return loss


def _check_not_varying(flat: Sequence[Any], lmap: Any, axis_name: Any) -> None:
  """ValueError when, under shard_map with check_vma, a parameter already varies over the axis: the
  README's `pcast` line of `scheduled` kept in a `hooked` step. hooked marks the params varying itself
  (and returns the gradients replicated), so the cast is not needed and breaks the hooks' types."""
  for r, i in enumerate(lmap.row_leaf):
    if is_varying(flat[i], axis_name):
      raise ValueError(
          f"hooked: parameter {lmap.paths[i]!r} already varies over axis {axis_name!r} (e.g. "
          f"jax.lax.pcast(params, {axis_name!r}, to='varying'), the line a scheduled(...) step needs, or "
          f"params passed with in_specs P({axis_name!r})). hooked marks the replicated params varying "
          f"itself and returns gradients averaged over the axis: pass them as they are (replicated, "
          f"in_specs P()), without the pcast.")


def hooked(loss_fn: Callable[..., Any], schedule: Schedule, *, axis_name: str | tuple[str, ...],
           has_aux: bool = False, has_state: bool = False, in_loop: Sequence[str] = (),
           mesh: Any = None, reduction: str = "mean") -> Callable[..., Any]:
  """`grad_fn(params, batch) -> (loss, grads)` whose all-reduces run inside the backward pass.

  (With a deferring schedule: `grad_fn(params, batch, defer_state) -> (loss, grads, new_state)`.)

  The chunks of `schedule` are issued from the backward rules of `custom_vjp` identities placed on the
  parameter groups before `loss_fn` runs: each group's all-reduce can start as soon as that group's
  gradients exist, while the rest of backward still runs. A scalar token threaded through the hooks (in
  reverse issue order) ties each group's first buffer to the previous group's result, so the compiled
  program keeps one all-reduce per chunk in schedule order (XLA's CPU combiner cannot merge them).
  Chunks that share a leaf are issued from one hook (see `hook_groups`); issuing in an order other than
  readiness makes a chunk wait for the slowest one before it.

  The returned gradients are already averaged over `axis_name`: pair them with a plain `tx` (not
  `scheduled`). The loss is the per-device loss (average it yourself if you log it). Under
  `shard_map` the hooks also cast the params to varying themselves, so replicated params (`P()`) are
  fine and the gradients come back replicated (invariant); do not `pcast` them yourself.
  Integer leaves get float0 gradients (as `jax.grad(..., allow_int=True)` gives); zero-size leaves
  get their (empty) gradients unreduced.

  A sharded schedule (`dear`, ZeRO-1) makes the hooks reduce-scatter instead: `grad_fn` returns
  `(value, GradShards)`, this device's mean gradient shards (the DeAR pipeline's first half), which
  `scheduled(tx, schedule, axis_name=...)`'s `update(shards, opt_state, params)` consumes: it skips
  its own reduce-scatters, updates the shards and all-gathers the update (flax's
  `state.apply_gradients(grads=shards)` works as it is). The full gradients are never formed.

  A deferring schedule (`dlcp` with `max_defer > 0`) needs its deferral state, which the caller
  owns here: `grad_fn(params, batch, defer_state) -> (loss, grads, new_defer_state)` (the state as
  the last positional argument or `defer_state=`; `((loss, aux), grads, new_defer_state)` with
  `has_aux`), starting from `prophet_jax.defer_state(schedule)` (under `shard_map`, made inside the
  map and passed with `prophet_jax.state_specs(state, axis_name)`). Each deferral group's hook takes
  its state as a primal input and its backward rule returns the new state as that input's
  "cotangent" (chunk numbers and the mask encoded as float32, exact), so the ranking, the slots and
  the residuals are those of `scheduled` and `allreduce`, issued inside the backward pass. The
  deferred chunks' elements are zero in `grads` and wait in the new state's residual.

  On global arrays, in a plain `jax.jit` (or `nnx.jit`) step: pass `mesh=` (the mesh the arrays are
  placed on; `axis_name` its data axis). The returned `grad_fn` (a `MeshGradFn`) then takes the params
  replicated (`NamedSharding(mesh, P())`) and the global batch split over the axis (`P(axis_name)`),
  maps the per-device step above over the mesh itself (`jax.shard_map`, manual over every mesh axis:
  other axes only replicate it), and returns the loss averaged over the global batch, the gradients
  replicated for the user's own `tx`, any model state replicated and the aux stacked per device on a
  new leading axis; the compiled program's gradient all-reduces are the schedule's chunks alone (the
  partitioner's own all-reduce is gone). `loss_fn` then runs per device, on its slice of the batch, as
  under `shard_map`: it must be a mean over the examples it is given (a sum would make the gradient
  the mean of per-device sums), and anything computed across examples (BatchNorm statistics) is per
  device unless it averages over the axis itself (flax: `nn.BatchNorm(axis_name=...)`). Bad
  placement is refused with the leaf and the fix (see prophet_jax/_mesh.py); a deferring schedule's
  state starts from `grad_fn.defer_state()`.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`; with
      `has_state=True`, `loss_fn(params, model_state, batch) -> (loss, new_model_state)`, and with
      both `(loss, (new_model_state, aux))`, as `pipelined` takes it).
    schedule: the Schedule to carry out; its rows are the params' floating leaves (minus `in_loop`).
    axis_name: the data-parallel axis name.
    has_aux: `loss_fn` returns `(loss, aux)`; `grad_fn` then returns `((loss, aux), grads)`.
    has_state: `loss_fn` takes a model state after the params and returns `(loss, new_model_state)`;
      `grad_fn(params, model_state, batch)` then returns `((loss, new_model_state), grads)` (as
      `jax.value_and_grad(loss_fn, has_aux=True)` does).
    in_loop: path prefixes (e.g. 'params/blocks') of params reduced inside a scanned body by
      `loop_hook`; the schedule does not cover them.
    mesh: run on global arrays inside a plain `jax.jit` over this mesh (see above); None (the
      default): call `grad_fn` inside your own `jax.shard_map` or `jax.pmap`.
    reduction: "mean" (the default): `loss_fn` averages over its examples, the gradients are the
      devices' mean (and with `mesh`, the loss their mean); "sum": `loss_fn` sums over its examples,
      the gradients (and with `mesh`, the loss) are the devices' sum: the plain step's over the
      global batch either way.

  Returns:
    `grad_fn(params, batch)` (`grad_fn(params, batch, defer_state)` for a deferring schedule); with
    `mesh`, a `MeshGradFn` taking and returning global arrays.

  Raises:
    TypeError: bad arguments (at construction); at trace time, a deferring schedule's grad_fn called
      without its DeferState.
    ValueError: `mesh` lacks an axis of `axis_name` (at construction); with `mesh`, at call time,
      params or a model state not replicated, a batch leaf not split over the axis on its leading
      axis (or not divisible over it), a new model state that varies over the axis.
    UnboundAxisError, ScheduleMismatchError: at trace time (ScheduleMismatchError also for the
      DeferState of another schedule or tree).
    ValueError: at trace time, under shard_map, a deferral residual passed replicated.
  """
  check_values("hooked", loss_fn=loss_fn, schedule=schedule, axis_name=axis_name)
  _reduction.check(reduction, "hooked")
  for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
    if not isinstance(flag, bool):
      raise TypeError(f"hooked({name}={flag!r}): expected True or False.")
  if isinstance(in_loop, str):
    in_loop = (in_loop,)
  in_loop = tuple(in_loop)
  if schedule.sharded:
    if in_loop:
      raise ValueError(f"hooked(in_loop={in_loop!r}) with a sharded schedule ({schedule.policy}): "
                       f"loop_hook all-reduces a scanned layer's gradients inside the loop, but a "
                       f"sharded (ZeRO-1) step updates every parameter from its reduce-scatter shard, "
                       f"and the schedule does not cover those params. Plan the sharded schedule over "
                       f"every param and drop in_loop, or use an all-reduce schedule with in_loop.")
    grad_fn = _hooked_sharded(loss_fn, schedule, axis_name, has_aux, has_state, reduction)
    if mesh is not None:
      return _mesh.MeshGradFn(grad_fn, schedule, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                              has_state=has_state, reduction=reduction)
    return grad_fn
  groups = hook_groups(schedule)
  units = schedule_units(schedule)
  firsts = np.concatenate([[0], np.cumsum([unit_allreduces(u) for u in units])]).astype(int).tolist()
  # the deferral groups (their index among the schedule's groups) each hook runs
  group_index, seen = [], 0
  for a, b, _ in groups:
    n_groups = sum(isinstance(u, Bucket) for u in units[a:b])
    group_index.append(tuple(range(seen, seen + n_groups)))
    seen += n_groups

  def grad_fn(params, *args, **kwargs):
    n = axis_size(axis_name, "hooked")
    given = _NO_STATE
    if "defer_state" in kwargs:
      given = kwargs.pop("defer_state")
    elif args and (schedule.defers or isinstance(args[-1], DeferState)):
      *args, given = args
    defer_state = None if given is _NO_STATE else given
    carried = defer_state if carries(defer_state, schedule) else None
    if carried is None and schedule.defers:
      check_state(defer_state, schedule, "hooked")
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    lmap = match_tree(leaves_with_path, schedule, where="hooked", skip_prefixes=in_loop)
    for p in in_loop:
      if not any(q == p or q.startswith(p.rstrip("/") + "/") for q in lmap.paths):
        raise ValueError(f"hooked(in_loop={in_loop!r}): no leaf of the params has a path starting "
                         f"with {p!r}; the paths look like {lmap.paths[:3]}.")
    flat = [leaf for _, leaf in leaves_with_path]
    vma = vma_enabled(axis_name)
    if vma:
      _check_not_varying(flat, lmap, axis_name)
    residual = None
    if carried is not None:  # a re-plan: the old schedule's residual joins these gradients
      zeros = jax.tree_util.tree_unflatten(treedef, [jnp.zeros(np.shape(x), x.dtype) if is_reduced_leaf(x)
                                                     else x for x in flat])
      residual, defer_state = carry_over(zeros, carried, schedule, axis_name, "hooked")
      residual = jax.tree_util.tree_leaves(residual)
    if defer_state is not None and vma:
      check_residual_varying(defer_state, axis_name, "hooked")
    hooks = []
    for (a, b, rows), gi in zip(groups, group_index):
      cast = [vma and not is_varying(flat[lmap.row_leaf[r]], axis_name) for r in rows]
      hooks.append((rows, gi, _make_hook(units[a:b], firsts[a], rows, axis_name,
                                         _reduction.divisor(reduction, n), cast)))
    with_aux = has_aux or has_state

    def inner(flat_params, states):
      flat_params = list(flat_params)
      token = jnp.zeros((), jnp.float32)
      for rows, gi, hook in reversed(hooks):  # backward runs them in reverse: issue order
        ids = [lmap.row_leaf[r] for r in rows]
        out, token = hook([flat_params[i] for i in ids], token, tuple(states[g] for g in gi))
        for i, x in zip(ids, out):
          flat_params[i] = x
      out = loss_fn(jax.tree_util.tree_unflatten(treedef, flat_params), *args, **kwargs)
      loss = _check_loss_output(out, has_aux, has_state)
      if residual is None:
        return out
      # d/dp sum(r * p) = r: the carried residual joins each leaf's cotangent before its hook reduces
      # it; the value is unchanged (the term minus itself), and the user's output rides as aux
      term = sum(jnp.sum(r.astype(jnp.float32) * x.astype(jnp.float32))
                 for r, x, leaf in zip(residual, flat_params, flat) if is_reduced_leaf(leaf))
      return loss + (term - jax.lax.stop_gradient(term)).astype(loss.dtype), out

    calls: list[str] = []
    states = tuple(_encode(g) for g in group_states(defer_state)) if schedule.defers else ()
    with _loop_axis(axis_name, _reduction.divisor(reduction, n), vma, calls):
      value, (grads, new_states) = jax.value_and_grad(inner, argnums=(0, 1),
                                                      has_aux=with_aux or residual is not None,
                                                      allow_int=True)(flat, states)
    if residual is not None:
      value = value[1]   # what loss_fn returned: the carry term is not part of the value
    if in_loop and not calls:
      raise ValueError(f"hooked(in_loop={in_loop!r}): loss_fn never called prophet_jax's loop_hook, so "
                       f"those params would not be all-reduced. Apply loop_hook to the layer params "
                       f"inside the scanned body (see models/scan.py), or drop in_loop and plan a "
                       f"schedule that covers them.")
    grads = jax.tree_util.tree_unflatten(treedef, grads)
    if schedule.defers:
      return value, grads, with_groups(defer_state, [_decode(x) for x in new_states])
    if given is not _NO_STATE:   # a state was passed (a re-plan's): state in, state out
      return value, grads, None
    return value, grads

  if mesh is not None:  # global arrays in a plain jax.jit: the same grad_fn mapped over the mesh
    return _mesh.MeshGradFn(grad_fn, schedule, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                      has_state=has_state, reduction=reduction)
  return grad_fn
