"""The reduction paths' entry points, over the one engine (`_collectives`): `allreduce`, the step's
`scheduled_allreduce` and `accumulated_allreduce`, and the one step setup every path runs first
(`step_setup`: the axis size, the tree matched to the schedule, the state's schedule (a converted
state's owed values taken: `take_owed`; another schedule's state refused: `check_foreign`), the
varying checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._accumulate import check_state as check_accum
from ._axis import bind
from ._collectives import reduce_units, schedule_chains, schedule_units
from ._sharded import sharded_allreduce
from ._defer import given_state, group_states, matched_leaves, with_groups
from ._keys import check_enforce_order, ordered_by
from ._states import per_device_leaves
from .._values._checks import check_bool, check_values
from .._values._schedule import Schedule

def allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True,
              defer_state: Any = None, enforce_order: bool = True) -> Any:
  """`grads` reduced over `axis_name` as the schedule says, unit by unit, in its order.

  Inside `jax.pmap` or `jax.shard_map`: rows match leaves by path; each chunk's slices are gathered
  into one buffer, reduced by one `psum` under `jax.named_scope("prophet/chunk<k>")` and scattered
  back, tied to the previous chunk's result so the compiled program keeps one all-reduce per chunk in
  order. A sharded plan (`dear`) reduce-scatters then all-gathers; a deferring plan (`dlcp`) takes
  and returns its deferral state (a deferred chunk's elements are zero and wait in its residual).
  Integer, float0 and zero-size leaves pass through.

  Args:
    grads: the per-device gradients, the tree the schedule was planned for.
    schedule: a Schedule (an all-reduce or `dear` plan).
    axis_name: the data-parallel axis bound by pmap or shard_map.
    mean: divide the sums by the axis size (a `pmean`); False gives the `psum`.
    defer_state: the deferral state of a deferring plan (`prophet_jax.defer_state`), or what
      `convert_state` left (its owed values are added to these gradients).
    enforce_order: True: the tie; False: XLA combiner keys (docs/keys.md).

  Returns:
    The reduced tree; `(tree, new_defer_state)` when a deferral state is involved.

  Raises:
    UnboundAxisError, ScheduleMismatchError, AlreadyReducedError: the axis is not bound; another
      tree's schedule or another plan's state; gradients already summed (shard_map's check_vma).
    TypeError, ValueError: a deferral state missing or unexpected; an FSDP plan; more links than the
      platform runs at once.

  Example:
    >>> step = jax.pmap(lambda g: prophet_jax.allreduce(g, schedule, "data"), axis_name="data")
  """
  # True leaves the ordering as it is: the tie, unless a front-end traces this call with keys
  reduced, new = ordered_by(check_enforce_order("allreduce", enforce_order), scheduled_allreduce)(
      grads, schedule, axis_name, mean=mean, where="allreduce", defer_state=defer_state)
  return (reduced, new) if schedule.defers or defer_state is not None else reduced


def reduction_kind(schedule: Schedule, where: str) -> str:
  """The reduction layer a schedule's family asks for: 'allreduce' or 'zero1' (the one reader of
  `Schedule.family` on the reduction paths: `per_device` and `allreduce` choose through it).

  Raises:
    ValueError: an FSDP plan (its parameters are sharded: only `hooked` carries it out).
  """
  check_values(where, schedule=schedule)
  if schedule.family == "fsdp":
    raise ValueError(
        f"{where}: the schedule is an FSDP plan (policy {schedule.policy!r}: parameters sharded over the "
        f"data axis, gathered in forward and reduce-scattered in backward), which only hooked carries "
        f"out: grad_fn = prophet_jax.hooked(loss_fn, schedule, axis_name=..., mesh=mesh) with a plain optax "
        f"tx on the sharded params. For {where}, plan an all-reduce or 'dear' policy.")
  return schedule.family


class StepSetup(NamedTuple):
  """What every reduction path knows once its preamble ran (`step_setup`).

  Attributes:
    n: the size of the bound axis.
    flat: the tree's leaves, in flatten order.
    treedef: the tree's structure.
    lmap: the schedule's rows matched to `flat` (`match_tree`).
    defer_state: the deferral state this step continues from: the given one, or, for a converted
      state's `OwedState`, this schedule's initial one (None when it defers nothing).
    owed: for an `OwedState`, its values at their elements, one entry per leaf of `flat` (None for a
      leaf no row covers), to be added to this step's gradients; else None.
    vma: whether values carry the axes they vary over here (shard_map's check_vma).
    varying: the `varying` tree given, marked varying where values carry that.
  """

  n: int
  flat: list[Any]
  treedef: Any
  lmap: Any
  defer_state: Any
  owed: list[Any] | None
  vma: bool
  varying: Any = None


def step_setup(tree: Any, schedule: Schedule, axis_name: Any, where: str, *, defer_state: Any = None,
               grads: bool = True, checks: bool = True, skip_prefixes: Sequence[str] = (),
               per_device: Sequence[tuple[str, Any]] = (), varying: Any = None) -> StepSetup:
  """The preamble every reduction path runs, written once: the tree matched to the schedule, the state given
  to the step (`_defer.given_state`), and the axis facts with the varying checks (`_axis.bind`).

  Args:
    tree: the per-device gradients (`grads=True`: none may be already summed) or hooked's params
      (`grads=False`: none may already vary).
    schedule: the schedule the step carries out.
    axis_name: the mapped axis.
    where: the public caller, for messages.
    defer_state: the deferral state given to the step, or None.
    checks: run the varying checks on `tree` (False: a template, e.g. ZeRO-1's params for GradShards).
    skip_prefixes: paths the schedule does not cover (`hooked(in_loop=...)`).
    per_device: (name, leaf) of other per-device state parts to check (an accumulator's sums).
    varying: a tree of each device's own values to mark varying where values carry that.

  Raises:
    UnboundAxisError, ScheduleMismatchError, AlreadyReducedError, TypeError, ValueError.
  """
  flat, treedef, lmap = matched_leaves(tree, schedule, where, skip_prefixes=skip_prefixes)
  owed, start = given_state(defer_state, schedule, flat, lmap, where)
  named = [(lmap.paths[i], flat[i]) for i in lmap.row_leaf] if checks else []
  fresh = start.residual if owed is not None and start is not None else None
  n, vma, (fresh, varying) = bind(
      axis_name, where, varying=(fresh, varying), grads=named if grads else (), params=() if grads else named,
      per_device=[*(() if owed is not None else per_device_leaves(defer_state)), *per_device])
  if fresh is not None:   # the new plan's initial residuals: each device's own
    start = start._replace(residual=fresh)
  return StepSetup(n=n, flat=flat, treedef=treedef, lmap=lmap, defer_state=start, owed=owed, vma=vma,
                   varying=varying)


def scheduled_allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True,
                        where: str = "allreduce", defer_state: Any = None) -> tuple[Any, Any]:
  """`allreduce` as (reduced tree, new DeferState or None), with `where` naming the public caller.

  A schedule that defers nothing, given no state, never calls into `_defer`. An `OwedState` (what
  `convert_state` leaves after a re-plan) is added to `grads`, and `schedule` starts from its
  initial state."""
  check_bool(where, "mean", mean)
  kind = reduction_kind(schedule, where)
  s = step_setup(grads, schedule, axis_name, where, defer_state=defer_state)
  chains, divisor = schedule_chains(schedule, where), s.n if mean else None
  flat = with_owed(s)
  if kind == "zero1":  # reduce-scatters, then all-gathers: replicated, as an all-reduce's result
    flat = sharded_allreduce(flat, schedule, s.lmap.row_leaf, axis_name, n=s.n, divisor=divisor, vma=s.vma)
    return jax.tree_util.tree_unflatten(s.treedef, flat), None
  flat, _, groups = reduce_units(flat, schedule_units(schedule), s.lmap.row_leaf, axis_name, divisor=divisor,
                                 defer=() if s.defer_state is None else group_states(s.defer_state), chains=chains,
                                 prev=None if chains is None else (None,) * (max(chains) + 1))
  return jax.tree_util.tree_unflatten(s.treedef, flat), with_groups(s.defer_state, groups) if schedule.defers else None


def with_owed(s: StepSetup, times: int = 1) -> list[Any]:
  """The setup's leaves with a re-plan's owed residual added (`StepSetup.owed`), `times` times."""
  if s.owed is None:
    return s.flat
  return [x if o is None else x + (o if times == 1 else o * times) for x, o in zip(s.flat, s.owed)]


def accumulated_allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, every_k: int, accum: Any,
                          mean: bool = True, where: str = "scheduled", defer_state: Any = None
                          ) -> tuple[Any, Any, Any, jax.Array]:
  """`scheduled_allreduce` once per `every_k` calls: gradient accumulation (`scheduled(..., every_k=k)`).

  Adds this device's `grads` to `accum`'s sums (an `_accumulate.AccumState`); on the k-th call since
  the last all-reduce it reduces the mean of the k micro-steps' gradients on the schedule (every
  chunk, deferral included) and resets the sums, and on the other calls it issues nothing: the
  all-reduces sit in the true branch of one `lax.cond` on the replicated count, so the compiled
  program runs them only when that branch is taken. The reduced gradients are zero on the other calls.
  An `OwedState` (the first call after `convert_state`) joins this call's gradients `every_k` times,
  so the k-th call's mean adds it once.

  Returns:
    (the reduced tree on the k-th call, zeros otherwise; the new DeferState or None, changed on the
    k-th call only; the new AccumState; `emit`, a replicated bool: whether this call reduced).
  """
  check_bool(where, "mean", mean)
  check_accum(accum, schedule, where)
  s = step_setup(grads, schedule, axis_name, where, defer_state=defer_state, per_device=[
      (f"the gradient accumulator's sum for {path!r}", a) for (path, _, _), a in zip(schedule.rows, accum.grads)])
  treedef, lmap, defer_state = s.treedef, s.lmap, s.defer_state
  flat = with_owed(s, every_k)   # convert_state's owed values: k times into the sums, so their mean adds them once
  rows = tuple(a[0] + flat[i].astype(a.dtype) for a, i in zip(accum.grads, lmap.row_leaf))
  count = accum.count + 1
  emit = count >= every_k

  def with_rows(rows):   # the leaves, each row's leaf replaced
    by_leaf = dict(zip(lmap.row_leaf, rows))
    return jax.tree_util.tree_unflatten(treedef, [by_leaf.get(i, x) for i, x in enumerate(flat)])

  def fire(rows, defer):
    mean_rows = [(r / every_k).astype(flat[i].dtype) for i, r in zip(lmap.row_leaf, rows)]
    red, new = scheduled_allreduce(with_rows(mean_rows), schedule, axis_name, mean=mean, where=where,
                                   defer_state=defer)
    red = jax.tree_util.tree_leaves(red)
    return tuple(red[i] for i in lmap.row_leaf), new, tuple(jnp.zeros_like(r) for r in rows)

  def wait(rows, defer):
    return tuple(jnp.zeros(np.shape(flat[i]), flat[i].dtype) for i in lmap.row_leaf), defer, rows

  reduced, new_defer, rows = jax.lax.cond(emit, fire, wait, rows, defer_state)
  new_accum = type(accum)(count=jnp.where(emit, 0, count).astype(jnp.int32),
                          grads=tuple(r[None] for r in rows))
  return with_rows(reduced), new_defer, new_accum, emit
