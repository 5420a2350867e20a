"""`scheduled(tx, schedule, axis_name=...)`: a Schedule carried out in the user's own optax step.

Layers (docs/design.md, "The rewrite's layers"): the composition guard outermost, the placement layer
(`_mesh.placed`), and the per-device update (`per_device`): one state check over the reduction layer
the schedule's family asks for. `pipelined` runs the same per-device update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from . import _mesh, _zero
from ._accumulate import init as accum_init
from ._compose import check_first, check_masked, inside_multisteps
from ._defer import init as defer_init
from ._reduction import accumulated_allreduce, reduction_kind, scheduled_allreduce
from ._keys import check_enforce_order, ordered_by
from ._states import AccumState, DeferState, ScheduledState, is_state, prefix_specs
from .._values._checks import check_int, check_values
from .._values._errors import AlreadyReducedError, CompositionError, ScheduleMismatchError
from .._values._schedule import Schedule

def scheduled(tx: optax.GradientTransformation, schedule: Schedule, *,
              axis_name: str | tuple[str, ...], mesh: Any = None,
              every_k: int = 1, enforce_order: bool = True) -> optax.GradientTransformationExtraArgs:
  """An optax transformation: the gradients reduced as `schedule` says, then `tx`.

  Use it in place of a `jax.lax.pmean(grads, axis_name)` before `tx`, inside `jax.pmap` or
  `jax.shard_map` (params marked varying before `jax.grad`: `jax.lax.pcast(params, axis_name,
  to="varying")`), or with `mesh=` in a plain `jax.jit` on gradients obtained unreduced. It must be the
  outermost transformation, first in any `optax.chain` (anything before it would act on each
  device's own gradients). With `every_k=k` it accumulates k micro-steps per reduction; a deferring
  plan (`dlcp`) keeps its deferral state in the state; a sharded plan (`dear`) runs `tx` on this
  device's shards (ZeRO-1). docs/usage.md says more of each.

  Args:
    tx: the optimizer applied to the reduced gradients (e.g. `optax.sgd(0.1, momentum=0.9)`).
    schedule: the Schedule to carry out (`prophet_jax.plan`); an FSDP plan is `hooked`'s.
    axis_name: the data-parallel axis (or a tuple of axes).
    mesh: reduce gradients obtained unreduced over `axis_name` on this mesh, inside a plain `jax.jit`;
      None: inside `jax.pmap` or `jax.shard_map`.
    every_k: micro-steps per reduction and update (gradient accumulation); 1 reduces every call.
    enforce_order: True: the tie keeps one collective per unit in schedule order; False: each unit
      carries an XLA `combiner_key` instead (docs/keys.md).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `ScheduledState(inner=tx_state,
    defer_state=..., accum=...)`.

  Raises:
    TypeError, ValueError: bad arguments (at construction); an FSDP plan (naming `hooked`).
    CompositionError: not first in an `optax.chain`, or inside `optax.MultiSteps` under shard_map.
    UnboundAxisError, ScheduleMismatchError, AlreadyReducedError: at trace time, from `update`.
    ShardingError: a sharded plan's `tx` that cannot run on shards (at `init`).

  Example:
    >>> tx = prophet_jax.scheduled(optax.sgd(0.1, momentum=0.9), schedule, axis_name="data")
    >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  """
  check_values("scheduled", tx=tx, schedule=schedule, axis_name=axis_name)
  every_k = check_int("scheduled", "every_k", every_k, lo=1,
                      fix="It is the number of micro-steps per all-reduce and update; 1 reduces every call.")
  enforce_order = check_enforce_order("scheduled", enforce_order)
  make = functools.partial(per_device, tx, schedule, axis_name, every_k=every_k)
  step = _mesh.placed(make, mesh=mesh, axis_name=axis_name, where="scheduled")

  # the composition guard is the outermost layer: it reads the caller's frames (an optax.chain's)
  def init_fn(params):
    check_first("init")
    return step.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    check_first("update")
    return step.update(updates, state, params, **extra_args)

  # keys or the tie: read where the units are issued, while this update traces
  return optax.GradientTransformationExtraArgs(init_fn, ordered_by(enforce_order, update_fn))


class PerDevice(NamedTuple):
  """The per-device scheduled update (`per_device`): optax's `init` and `update`, and `specs(axis)`, the
  prefix PartitionSpecs of its `ScheduledState` (each device's own parts `P(axis)`) for shard_map."""

  init: Callable[..., Any]
  update: Callable[..., Any]
  specs: Callable[[Any], ScheduledState]


def per_device(tx: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True, every_k: int = 1,
               where: str = "scheduled") -> PerDevice:
  """The scheduled reduction of the gradients, then `tx`, per device (inside pmap / shard_map, or the
  mesh layer's map): `scheduled`'s transformation and `pipelined`'s backward-and-update.

  One layer checks the state; under it, chosen once from the schedule's family, the reduction and
  update of one kind: ZeRO-1 (`_zero_layer`) or the all-reduce (`_allreduce_layer`, with `every_k`'s
  accumulation).

  Args:
    tx: the optimizer applied to the reduced gradients.
    schedule: the schedule.
    axis_name: the mapped data axis.
    mean: reduce to the mean (False: the sum, for gradients that are each device's partial sums).
    every_k: micro-steps per reduction.
    where: the public caller, for messages.

  Returns:
    A `PerDevice`.
  """
  if every_k > 1 and getattr(schedule, "fsdp", None) is not None:
    raise ValueError(f"{where}: every_k={every_k} with an FSDP plan (policy {schedule.policy!r}): its step accumulates "
                     f"inside one step instead: plan(profile, network, 'fsdp', micro_batches={every_k}, ...) and "
                     f"grad_fn = prophet_jax.hooked(loss_fn, schedule, axis_name=..., mesh=mesh), which runs each "
                     f"batch as {every_k} micro-batches (docs/usage.md, 'FSDP in your step').")
  if reduction_kind(schedule, where) == "zero1":
    if every_k > 1:
      raise ValueError(
          f"scheduled: every_k={every_k} with a sharded schedule (policy {schedule.policy!r}: reduce-scatters "
          f"and all-gathers): its accumulation is not built for the shards. Accumulate inside instead, "
          f"scheduled(optax.MultiSteps(tx, {every_k}), schedule) (it reduce-scatters every micro-step), or plan "
          f"an all-reduce policy for every_k.")
    layer = _zero_layer(tx, schedule, axis_name, mean, where)
  else:
    layer = _allreduce_layer(tx, schedule, axis_name, every_k, mean, where)

  def update_fn(updates, state, params=None, **extra_args):
    if not (isinstance(state, tuple) and hasattr(state, "inner") and hasattr(state, "defer_state")):
      raise TypeError(f"{where}(...).update(updates, state): state={state!r:.80} is not the state this "
                      f"transformation's init made (a ScheduledState(inner, defer_state)). Pass the state "
                      f"tx.init(params) returned (or the one the last update returned; TrainState and "
                      f"nnx.Optimizer keep it for you).")
    check_masked(updates, schedule)
    return layer.update(updates, state, params, extra_args)

  return PerDevice(layer.init, update_fn, layer.specs)


# a layer is a PerDevice whose update takes (updates, state, params, extra_args), the state checked


def _zero_layer(tx, schedule, axis_name, mean, where):
  """ZeRO-1: reduce-scatter, `tx` on this device's shards (its state for them only), all-gather the
  update; a re-plan's owed values (convert_state's OwedState) added before the reduce-scatters."""

  def init_fn(params):
    return ScheduledState(inner=_zero.init(tx, params, schedule, axis_name, where))

  def update(updates, state, params, extra_args):
    if state.accum is not None:
      _whole(state, schedule, where)
    new, inner = _zero.update(tx, updates, state.inner, params, schedule, axis_name, where=where,
                              mean=mean, extra_args=extra_args, defer_state=state.defer_state)
    return new, ScheduledState(inner=inner)

  return PerDevice(init_fn, update, lambda axis: ScheduledState(inner=P(axis), defer_state=P(), accum=P()))


def _whole(state, schedule, where):
  """`state.inner`, refused when it is a ZeRO-1 shard state (this schedule keeps tx's whole state), or
  when the state holds a gradient accumulator this step (every_k=1) would ignore."""
  if state.accum is not None:
    raise ValueError(
        f"{where}(...).update: the optimizer state holds a gradient accumulator (made by a step with "
        f"every_k > 1; its micro-steps since the last all-reduce would be dropped), but this step has "
        f"every_k=1: pass the same every_k to {where}, or convert the state at the k-th micro-step: "
        f"prophet_jax.convert_state(state, params, schedule, every_k=1).")
  if is_state(state.inner):   # tx's state is not a library state: this one is ZeRO-1's shards
    raise ScheduleMismatchError(
        f"{where}(...).update: the optimizer state is the ZeRO-1 shard state of a sharded schedule "
        f"({state.inner.tag!r}), but this schedule ({schedule.policy}) all-reduces and keeps tx's whole "
        f"state: unshard it outside the step with prophet_jax.convert_state(state, params, schedule, "
        f"tx=tx).")
  return state.inner


def _allreduce_layer(tx, schedule, axis_name, every_k, mean, where):
  """The scheduled all-reduce (with the deferral state of a deferring plan), then `tx`. With `every_k` > 1,
  `every_k` micro-steps accumulated, their mean all-reduced on the schedule and `tx` applied on the k-th;
  zeros (and tx's state unchanged) on the others."""

  def init_fn(params):
    return ScheduledState(inner=tx.init(params), defer_state=defer_init(schedule) if schedule.defers else None,
                          accum=accum_init(schedule) if every_k > 1 else None)

  def update(updates, state, params, extra_args):
    apply = lambda r, i: optax.with_extra_args_support(tx).update(r, i, params, **extra_args)  # noqa: E731
    inner = _whole(state if every_k == 1 else state._replace(accum=None), schedule, where)
    if every_k == 1:
      reduced, defer = _composed(lambda: scheduled_allreduce(
          updates, schedule, axis_name, mean=mean, where=where, defer_state=state.defer_state), axis_name)
      new, inner = apply(reduced, inner)
      return new, ScheduledState(inner=inner, defer_state=defer)
    reduced, defer, accum, emit = _composed(lambda: accumulated_allreduce(
        updates, schedule, axis_name, every_k=every_k, accum=state.accum, mean=mean, where=where,
        defer_state=state.defer_state), axis_name)
    shapes = jax.eval_shape(apply, reduced, inner)[0]
    new, inner = jax.lax.cond(
        emit, apply, lambda r, i: (jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), i),
        reduced, inner)
    return new, ScheduledState(inner=inner, defer_state=defer, accum=accum)

  return PerDevice(init_fn, update, lambda axis: ScheduledState(
      inner=P(), defer_state=prefix_specs(DeferState, axis) if schedule.defers else P(),
      accum=prefix_specs(AccumState, axis) if every_k > 1 else P()))


def _composed(reduce, axis_name):
  """`reduce()`, with the error of `scheduled` inside optax.MultiSteps under shard_map said as such."""
  try:
    return reduce()
  except AlreadyReducedError as e:
    if not inside_multisteps():
      raise
    raise CompositionError(
        f"scheduled(...) inside optax.MultiSteps under shard_map: MultiSteps keeps an accumulator of "
        f"each device's own gradients, which varies over axis {axis_name!r} and cannot live in the "
        f"replicated optimizer state (optax's own update then fails); and MultiSteps runs the inner "
        f"transformation on every micro-step, so the all-reduces would run on every one anyway. "
        f"Accumulate in scheduled itself: prophet_jax.scheduled(tx, schedule, axis_name={axis_name!r}, "
        f"every_k=k) all-reduces once per k micro-steps (pass its state with "
        f"prophet_jax.state_specs(state, {axis_name!r})).") from e
