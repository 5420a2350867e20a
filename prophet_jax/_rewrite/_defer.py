"""DLCP's deferral in the step: the deferral groups' state (`DeferState`), its checks against a schedule,
the state given to a step (`given_state`: its own, or a re-plan's owed values), and the deferred
values put back at their elements. The step itself is the engine's (`_collectives.reduce_units`); a
schedule that defers nothing never calls into this module. docs/design.md, "Deferral in the rewrite"."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._states import DeferState, OwedState, StateTag
from .._values._checks import check_values, match_tree
from .._values._errors import ScheduleMismatchError
from .._values._schedule import Chunk, Schedule
from .._values._tree import IdentityMemo
from .._values._types import itemsize

# --------------------------------------------------------------------------------------------------
# the static plan of the groups


@dataclasses.dataclass(frozen=True)
class DeferGroup:
  """A deferral group as the step sees it.

  Attributes:
    bucket: the bucket's index in the schedule.
    chunks: the group's chunks, in chunk-index order.
    defer: k, the chunks deferred per step.
    size: c, elements per slot (the largest chunk).
    dtype: the group's dtype name.
    release: r, the fraction of a chunk's residual each send carries (`Bucket.release`).
  """

  bucket: int
  chunks: tuple[Chunk, ...]
  defer: int
  size: int
  dtype: str
  release: float = 1.0

  @property
  def m(self) -> int:
    return len(self.chunks)

  @property
  def rows(self) -> int:
    """Rows of the residual: k (the chunks deferred last step) when a send carries all of its
    residual, else m (every chunk may hold an unsent part)."""
    return self.defer if self.release == 1 else len(self.chunks)

  @property
  def residual_dtype(self) -> str:
    """The residual's dtype: the group's, but float32 under damped feedback for a narrower float (a
    bfloat16 residual that keeps 1 - release of itself every send would round away a part of each
    deferred value; at release 1 it holds one step's values, as the gradient does)."""
    return "float32" if self.release != 1 and itemsize(self.dtype) < 4 else self.dtype


@IdentityMemo(64)
def defer_groups(schedule: Schedule) -> tuple[DeferGroup, ...]:
  """The schedule's deferral groups (buckets with `defer > 0`), in issue order."""
  return tuple(DeferGroup(bucket=b, chunks=bucket.chunks, defer=bucket.defer, size=bucket.slot_size,
                          dtype=bucket.chunks[0].dtype, release=bucket.release)
               for b, bucket in enumerate(schedule.buckets) if bucket.defer)


# --------------------------------------------------------------------------------------------------
# the state


def defer_tag(schedule: Schedule) -> StateTag:
  """The tag of `schedule`'s DeferState: its layout (m, residual rows, c, dtype) per group (k rows, or m
  under damped feedback)."""
  return StateTag.of(schedule, tuple((g.m, g.rows, g.size, g.residual_dtype) for g in defer_groups(schedule)))


class GroupState(NamedTuple):
  """One group's slice of a DeferState (norms, deferred, index, residual)."""

  norms: jax.Array
  deferred: jax.Array
  index: jax.Array
  residual: jax.Array


def init(schedule: Schedule) -> DeferState | None:
  """The state before the first step (public as `prophet_jax.defer_state`, which says more)."""
  check_values("defer_state", schedule=schedule)
  if not schedule.defers:
    return None
  groups = defer_groups(schedule)
  return DeferState(
      norms=tuple(jnp.zeros((g.m,), jnp.float32) for g in groups),
      deferred=tuple(jnp.zeros((g.m,), jnp.bool_) for g in groups),
      index=tuple(jnp.arange(g.m - g.rows, g.m, dtype=jnp.int32) for g in groups),
      residual=tuple(jnp.zeros((1, g.rows, g.size), g.residual_dtype) for g in groups),
      tag=defer_tag(schedule))


def defer_state(schedule: Schedule) -> DeferState | None:
  """The deferral state of `schedule` before its first step (None when it defers nothing).

  Needed where the caller owns the step's state: `allreduce(..., defer_state=...)` and
  `hooked`'s `grad_fn(params, batch, defer_state)` (`scheduled` and `pipelined` keep it in their
  own states). Norms 0 and nothing deferred, so the first step defers the last k chunks of every
  group; zero residuals, so one state serves every device: under `pmap` replicate it, under
  `shard_map` make it inside the mapped function (or stack one copy per device on the residuals'
  leading axis) and pass it with `state_specs`.

  Raises:
    TypeError: `schedule` is not a Schedule.
  """
  return init(schedule)


_HOW_TO_CARRY = (
    "A residual holds gradient values that were deferred and not yet applied: dropping it loses them. "
    "Change plans outside the step with prophet_jax.convert_state(state, params, new_schedule) (the new "
    "plan's first step adds them), or take them out with prophet_jax.deferred_grads(state, params) "
    "(this device's deferred values in the parameters' shape; average them over the axis and apply them "
    "as one more update) before starting the new plan's state from its init.")


def schedule_of(state: Any) -> Schedule | None:
  """The schedule a DeferState was made for (recorded in its tag), or None when it is not recorded."""
  tag = getattr(state, "tag", None)
  return tag.schedule if isinstance(tag, StateTag) else None


def belongs(state: Any, schedule: Schedule) -> bool:
  """Whether `state` is what `schedule`'s step takes as is: its own DeferState (same key and layout),
  or None for a schedule that defers nothing. Anything else is a re-plan's state (or a mistake)."""
  if state is None:
    return not schedule.defers
  return schedule.defers and isinstance(state, DeferState) and state.tag == defer_tag(schedule)   # StateTag's ==


def check_state(state: Any, schedule: Schedule, where: str) -> None:
  """ScheduleMismatchError unless `state` is this schedule's DeferState with the right shapes.

  Plain Python at trace time: None for a schedule that defers nothing; else the tag (the schedule's
  key and the groups' layout) must match, then every leaf's per-device shape and dtype.

  Raises:
    TypeError: a state for a schedule that defers nothing, or none (or not a DeferState) for one
      that defers.
    ScheduleMismatchError: the state belongs to another schedule or tree, or has other shapes.
  """
  if not schedule.defers:
    if state is not None:
      raise TypeError(f"{where}: a deferral state was given, but the schedule ({schedule.policy}) "
                      f"defers nothing and the state does not say which schedule it came from, so its "
                      f"residual cannot be carried over. {_HOW_TO_CARRY}")
    return
  if not isinstance(state, DeferState):
    raise TypeError(f"{where}: the schedule defers ({len(defer_groups(schedule))} deferral groups, up to "
                    f"{schedule.max_deferred_fraction:.1%} of the elements per step), so it needs its "
                    f"deferral state: a DeferState (prophet_jax.defer_state(schedule) before the first "
                    f"step, then the one each step returns), got {type(state).__name__}.")
  want, tag = defer_tag(schedule), state.tag
  if not isinstance(tag, StateTag) or tag != want:
    got = repr(tag) if isinstance(tag, StateTag) else type(tag).__name__
    same_tree = isinstance(tag, StateTag) and tag.fingerprint == want.fingerprint
    why = ("planned for the same tree but with other deferral groups" if same_tree else
           "planned for another tree")
    raise ScheduleMismatchError(
        f"{where}: the deferral state belongs to another schedule ({got}, groups (m, k, c, dtype) "
        f"{getattr(tag, 'layout', '?')}) than this one ({want!r}, groups {want.layout}): it was "
        f"{why}, and it does not record that schedule, so its residual cannot be carried over. "
        f"{_HOW_TO_CARRY}")
  for g, gs in zip(defer_groups(schedule), group_states(state)):
    expect = (((g.m,), "float32"), ((g.m,), "bool"), ((g.rows,), "int32"),
              ((1, g.rows, g.size), g.residual_dtype))
    for name, x, (shape, dtype) in zip(GroupState._fields, gs, expect):
      got_shape, got_dtype = tuple(np.shape(x)), str(jnp.dtype(getattr(x, "dtype", np.float64)))
      if got_shape != shape or got_dtype != dtype:
        raise ScheduleMismatchError(
            f"{where}: the deferral state's {name} of group {g.bucket} (bucket {g.bucket}, m={g.m}, "
            f"k={g.defer}, c={g.size}) has shape {got_shape} and dtype {got_dtype}, expected {shape} "
            f"{dtype} per device. Under shard_map pass the state with prophet_jax's state_specs "
            f"(residuals P(axis), the rest P()); under pmap replicate it over the devices.")


# --------------------------------------------------------------------------------------------------
# the state given to a step: its own, or a re-plan's owed values


def owed_tag(schedule: Schedule) -> StateTag:
  """The tag of an `OwedState` owed to `schedule`'s first step."""
  return StateTag.of(schedule, ("owed", len(schedule.rows)))


def check_foreign(state: Any, schedule: Schedule, where: str) -> None:
  """ScheduleMismatchError naming `convert_state` when `state` is a DeferState or OwedState that
  records another schedule (a re-plan's state given to the new plan's step unconverted)."""
  if isinstance(state, OwedState):
    if state.tag != owed_tag(schedule):
      raise ScheduleMismatchError(
          f"{where}: the state owes deferred values to another schedule's first step ({state.tag!r}), "
          f"not this one's ({schedule.policy} plan, key {owed_tag(schedule).key}): convert the state for "
          f"this schedule with prophet_jax.convert_state(state, params, schedule).")
    return
  old = schedule_of(state) if isinstance(state, DeferState) else None
  if old is not None and not belongs(state, schedule):
    raise ScheduleMismatchError(
        f"{where}: the deferral state was made by another schedule (a {old.policy} plan, key "
        f"{state.tag.key}) than this step's ({schedule.policy} plan): a step takes only its own "
        f"schedule's state. Change plans outside the step: state = prophet_jax.convert_state(state, "
        f"params, new_schedule) (nothing deferred is lost: the first step of the new plan adds it).")


def given_state(state: Any, schedule: Schedule, flat: Sequence[Any] | None, lmap: Any, where: str
                ) -> tuple[list[Any] | None, Any]:
  """The deferral state given to a step of `schedule`, checked (another schedule's refused naming
  `convert_state`, its own checked for shapes); for convert_state's `OwedState`, (its values per leaf
  of `flat`, None for a leaf no row covers, or None without `flat`; `schedule`'s initial state): what
  the first step adds and continues from (its residuals each device's own: the step setup casts them
  varying). Else (None, the state)."""
  check_foreign(state, schedule, where)
  if isinstance(state, OwedState):
    owed = None if flat is None else _owed_leaves(state, flat, lmap, where="the first step after convert_state")
    return owed, init(schedule)
  if schedule.defers or state is not None:   # a lossless schedule's walk has no deferral stop
    check_state(state, schedule, where)
  return None, state


def _owed_leaves(state: OwedState, flat: Sequence[Any], lmap: Any, where: str) -> list[Any]:
  """An OwedState's values as leaves of `flat` (None for a leaf no row covers), each device's own."""
  owed: list[Any] = [None] * len(flat)
  for r, i in enumerate(lmap.row_leaf):
    x, shape = state.owed[r], np.shape(flat[i])
    if np.size(x) != np.size(flat[i]):
      raise ValueError(
          f"{where}: the converted state's owed values for {lmap.paths[i]!r} have shape {tuple(np.shape(x))} "
          f"here, but one device's are {(1, *shape)}: the state was passed in its global layout (each "
          f"device's values on a leading axis) without splitting it over the devices. Under shard_map pass "
          f"it with prophet_jax.first_step_specs(state, axis_name)[0] as in_specs; on the mesh, use the "
          f"step made with mesh= (convert_state(..., mesh=mesh, axis_name=...) lays it out for it).")
    owed[i] = jnp.reshape(x, shape).astype(flat[i].dtype)
  return owed


# --------------------------------------------------------------------------------------------------
# the engine's per-group view (`_collectives.reduce_units`)


def group_states(state: DeferState | None) -> tuple[GroupState, ...]:
  """The per-group states of a DeferState, in issue order (() for None)."""
  return () if state is None else tuple(GroupState(*g) for g in zip(*state[:4]))


def with_groups(state: DeferState, groups: Sequence[GroupState]) -> DeferState:
  """`state` with its groups replaced (the same tag)."""
  return DeferState(*(tuple(x) for x in zip(*groups)), tag=state.tag) if groups else state


# --------------------------------------------------------------------------------------------------
# across schedules (a re-plan) and back to the parameters' shape


@IdentityMemo(16)
def lossless(schedule: Schedule) -> Schedule:
  """`schedule` with no deferral: every chunk one all-reduce, in issue order (one tie chain)."""
  if not schedule.defers:
    return schedule
  buckets = tuple(dataclasses.replace(b, defer=0) if b.defer else b for b in schedule.buckets)
  return dataclasses.replace(schedule, buckets=buckets, links=())


def matched_leaves(tree: Any, schedule: Schedule, where: str, **match: Any) -> tuple[list, Any, Any]:
  """(`tree`'s leaves, its treedef, the schedule's rows matched to them by `match_tree`, given `match`)."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [x for _, x in leaves_with_path], treedef, match_tree(leaves_with_path, schedule, where=where, **match)


def deferred_values(tree: Any, state: Any, schedule: Schedule, where: str) -> Any:
  """`tree` (per device, like the parameters) with the deferred values `state` holds added at their
  elements: convert_state's owed values, or a DeferState's residual; `tree` for None.

  Group g's residual row j holds this device's values of chunk `index[j]` (zero-padded to the slot
  size); the chunk's slices say where they go. The indices are traced (chosen at run time), so each
  chunk's row is read from an (m, c) scatter of the residual: zero for the chunks not deferred.
  """
  if state is None:
    return tree
  flat, treedef, lmap = matched_leaves(tree, schedule, where)
  if isinstance(state, OwedState):
    owed = _owed_leaves(state, flat, lmap, where)
    return jax.tree_util.tree_unflatten(treedef, [x if o is None else x + o for x, o in zip(flat, owed)])
  row_leaf = lmap.row_leaf
  for g, gs in zip(defer_groups(schedule), group_states(state)):
    rows = jnp.zeros((g.m, g.size), gs.residual.dtype).at[gs.index].add(gs.residual[0])
    for i, chunk in enumerate(g.chunks):
      off = 0
      for r, a, b in chunk.slices:
        leaf = flat[row_leaf[r]]
        part = rows[i, off:off + b - a].astype(leaf.dtype)
        # not `.at[a:b].add(part)`: its scatter's empty index array is hoisted into the enclosing
        # shard_map/pmap as a zero-size operand, which crashes jax 0.11.2's XLA:CPU compiler
        # (docs/facts.md, "jax 0.11.2: zero-size operands of a mapped program")
        flat1 = leaf.reshape(-1)
        flat[row_leaf[r]] = jax.lax.dynamic_update_slice(flat1, flat1[a:b] + part, (a,)).reshape(leaf.shape)
        off += b - a
  return jax.tree_util.tree_unflatten(treedef, flat)


# --------------------------------------------------------------------------------------------------
# the residual out of any state


def find_states(state: Any) -> list[DeferState]:
  """Every DeferState inside `state` (a DeferState, an optax state holding ScheduledStates, a
  TrainState, a PipelinedState, a dict, ...), in flatten order."""
  return [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, DeferState))
          if isinstance(x, DeferState)]


def device_part(d: DeferState, i: int) -> DeferState:
  """Device i's DeferState, on the host, out of one laid out for several: a global state (residuals
  `(n, k, c)`, the replicated parts once) or pmap's stacked one (`(n, 1, k, c)`, the rest `(n, ...)`)."""
  def pick(xs: Any, k: int, dims: int) -> tuple[np.ndarray, ...]:   # copy k (the last `dims` axes)
    return tuple(np.asarray(x).reshape((-1,) + np.shape(x)[np.ndim(x) - dims:])[k] for x in xs)

  # pmap keeps a copy of the replicated parts per device
  j = i if np.prod(np.shape(d.norms[0])[:-1], dtype=np.int64) == np.prod(d.lead, dtype=np.int64) else 0
  return DeferState(norms=pick(d.norms, j, 1), deferred=pick(d.deferred, j, 1), index=pick(d.index, j, 1),
                    residual=tuple(r[None] for r in pick(d.residual, i, 2)), tag=d.tag)


def deferred_grads(state: Any, params: Any, *, schedule: Schedule | None = None) -> Any:
  """This device's deferred gradient values, as a tree like `params` (zero elsewhere): what the next step
  of the state's schedule would add to its gradients.

  Use it to end a deferring plan without losing anything: average it over the axis and apply it as one
  more update (inside the mapping: `g = jax.lax.pmean(prophet_jax.deferred_grads(opt_state, params),
  axis)`). Pure and local: call it where the state's residuals are per device.

  Args:
    state: any pytree holding DeferStates (a DeferState, scheduled's state, a PipelinedState, ...);
      None or a state without one gives zeros.
    params: the parameters (or anything shaped like the gradients).
    schedule: the schedule, for a state that does not record its own.

  Returns:
    A tree like `params`.

  Raises:
    ScheduleMismatchError: the state belongs to a schedule of another tree.
    ValueError: a state that records no schedule, and none given.
  """
  out = jax.tree_util.tree_map(lambda x: jnp.zeros(np.shape(x), getattr(x, "dtype", jnp.float32)), params)
  for st in find_states(state):
    sched = schedule_of(st)
    if sched is None:
      if schedule is None or not (schedule.defers and st.tag == defer_tag(schedule)):
        raise ValueError("deferred_grads: the deferral state does not record the schedule it was made "
                         "for; pass it: deferred_grads(state, params, schedule=the_old_schedule).")
      sched = schedule
    out = deferred_values(out, st, sched, "deferred_grads")
  return out
