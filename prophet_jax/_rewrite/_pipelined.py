"""The cross-step pipelined train step: this backward, its all-reduces and the next forward in one program.

In a plain JAX loop every step is one jitted call, so step k+1 cannot start before every all-reduce of
step k has ended: the order of the all-reduces cannot help the next forward pass (docs/design.md,
"Simulator semantics", `cross_step=False`). An asynchronous collective cannot stay in flight across
two jitted calls either, so `pipelined` cuts the step elsewhere: *between forward and backward*. Each
call receives the VJP residuals of the previous call's forward pass (`jax.vjp`'s closure, carried as
plain arrays in the state), and in one program

  1. runs that pending backward pass,
  2. all-reduces the gradients chunk by chunk, in the schedule's order (`prophet_jax.allreduce`),
  3. applies the optimizer's update, and
  4. runs the forward pass of the new batch, returning its residuals and its loss.

Layer l's forward of step k+1 depends only on layer l's reduced and updated parameters, so in the
compiled program it can start as soon as l's chunks are reduced, while the chunks of later layers are
still in flight: the simulator's `cross_step=True`, where priority order (Prophet, ByteScheduler, P3)
pays. (On the CPU a collective blocks the executor, so there is no overlap there; see
bench/pipelined.py for the cost of the cut.)

After N calls and a `flush`, the parameters equal N plain steps, up to float32 reduction order.

Compiled programs. The first call (and the first after a `flush`) only runs a forward pass. Whether a
backward is pending is part of the state's *structure* (`pending` is `None` or a `Pending` node), not
a traced flag, so `jax.pmap`/`jax.jit` compile two programs: forward-only, and the full step. A single
program with a traced flag would need a `lax.cond` around the backward (its collectives inside a
conditional, where XLA cannot schedule them against the forward) and dummy residuals of the right
shapes before any batch was seen. The cost is one extra compilation of the forward-only program.

Residuals. What is carried is what a step holds between its forward and backward anyway: the values
computed from the batch that the backward reads. Values that depend on the parameters alone (a
parameter, its cast or transpose) or on nothing (a mask, an iota, a zero fill) are recomputed in the
backward from the state's parameters, which are the ones the forward read. By default
(`residuals="min-cut"`) the forward carries the fewest bytes from which the backward recomputes
everything else it reads by elementwise and layout operations, fused by XLA into their consumers (a
minimum cut of the forward's value graph, prophet_jax/_residuals.py): e.g. a tanh-GELU's input rather
than the half dozen derivative terms `jax.vjp` keeps (gpt-tiny: 3.2x fewer bytes than
`residuals="all"`, which carries what `jax.vjp` keeps). `residuals="matmuls"` or any `jax.checkpoint`
policy runs the forward under `jax.checkpoint` instead. `Pipelined.residual_bytes(state)` reports the
carried bytes per device.

The residuals' pytree structure (which holds the linearized jaxpr, compared by identity) is not
stored: each call rebuilds it from a trace of the forward (`jax.make_jaxpr`, nothing is computed) on
the shapes recorded in the state, with the carry plan, so the state is a stable pytree of arrays and
the user's `jax.pmap` traces each program once. The forward itself runs from the same trace (one trace
of `loss_fn` per program). Writing the residuals out and reading them back in the next call is the
cut's cost on the CPU (bench/pipelined.py).

Transformations that need every gradient at once (e.g. `optax.clip_by_global_norm`) stay correct: the
update then waits, through the dataflow, for the last chunk, so the next forward cannot start on the
front layers early and the overlap is lost.

Auxiliary outputs and model state. With `has_aux=True` the loss returns `(loss, aux)` and each `step`
returns the aux of the forward it ran (this batch's), as the plain loop's step does. With
`has_state=True` the loss is `loss_fn(params, model_state, batch) -> (loss, new_model_state)` (BatchNorm
statistics, a PRNG key, any pytree that is not differentiated): the model state lives in the
`PipelinedState`, each forward reads the state the previous forward produced and stores the one it
produces, so the forward of step k+1 sees step k's state, exactly as in the plain loop. The model
state is an input of the forward like the batch: the values computed from it that the backward needs
are carried with the residuals.

Deferral (DLCP). With a schedule that defers (`plan(..., "dlcp", max_defer=...)`: `Bucket.defer > 0`),
the step's all-reduce is `allreduce(grads, schedule, axis_name, defer_state=...)`: each deferral group
sends m - k of its m chunks (its slots, consecutive `prophet/chunk<k>` all-reduces in the group's place
in issue order) and keeps the other k in a per-device residual that the next step adds back
(prophet_jax/_defer.py). Its state (`prophet_jax.DeferState`) rides in `PipelinedState.defer`: made by
`init`, threaded by `step` and `flush`, its residuals per device (`state_specs` gives them
`P(axis_name)`). The step then equals the plain loop with that all-reduce in place of `pmean`. The
flushed step defers as any step: its deferred values stay in `state.defer` (`Pipelined.deferred_grads`
puts them back in the parameters' shape, to apply at the end if wanted).

Sharded schedules (`dear`, ZeRO-1). The pending gradients are reduce-scattered chunk by chunk, `tx`
updates this device's shards (its state, `PipelinedState.opt_state`, is `scheduled`'s `ShardedState`:
1/n per device, `P(axis_name)` in `state_specs`, made by `init` where the axis is bound), and the
update is all-gathered gather by gather, front layers first: the next forward reads each gather's
params in the same program, so each all-gather runs inside that forward, before the layers that read
it (where XLA places it: `audit`'s `gathers_forward_overlap`).

Batches and model states may hold typed PRNG keys (`jax.random.key`, extended dtypes): they are traced
as such; nothing converts them to numbers.

Low-precision parameters. The updated parameters are both an output of the program and the input of
the next forward inside it. XLA on the CPU computes bfloat16 arithmetic in float32 and, by default
(`xla_allow_excess_precision`), lets a consumer read the unrounded float32 value of a bfloat16 result:
the next forward would read parameters the plain loop never has (it reads them back from memory,
rounded). So the updated bfloat16 and float16 parameters are rounded explicitly, by a
`reduce_precision` on their float32 value, which XLA cannot drop (it is not a no-op on float32) and
which equals the rounding to the parameter's dtype: the step is as exact as with
`--xla_allow_excess_precision=false`. (bfloat16 parameters computing in float32, flax's promotion:
equal to the plain loop.) What cannot be matched is bfloat16 *compute* across the cut: the residuals
are written out in their dtype (rounded), while the plain step, one program, may keep some bfloat16
activations in float32 between its forward and its backward. The two then differ by bfloat16 rounding
(tests/test_pipelined.py measures it); compiled with `xla_allow_excess_precision=False` both round
every value where the program says, and they are equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from . import _defer, _zero
from .._values._checks import check_values, match_tree
from ._collectives import allreduce, axis_size, is_varying, to_varying, vma_enabled
from ._defer import DeferState
from ._keys import check_enforce_order, ordered_by
from .._values._errors import ScheduleMismatchError
from ._mesh import MeshPipelined
from ._residuals import VjpTrace, carried_avals, carry_plan, forward, recompute, vjp_jaxpr
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf, path_str

__all__ = ["pipelined", "Pipelined", "PipelinedState", "Pending", "save_matmuls"]

# outputs `save_matmuls` keeps: products (expensive to recompute) and reductions (small, and their
# recomputation would read a whole input again); everything else is recomputed in the backward
_SAVED_PRIMITIVES = frozenset({
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
})


def save_matmuls(prim: Any, *_: Any, **__: Any) -> bool:
  """A `jax.checkpoint` policy: keep matmul, convolution and reduction outputs; recompute the rest.

  What `pipelined(..., residuals="matmuls")` uses. The recomputed operations are elementwise: XLA
  fuses them into the backward's consumers, so they cost little compute and save the bytes the
  pipelined step would otherwise write out and read back.
  """
  return prim.name in _SAVED_PRIMITIVES


# --------------------------------------------------------------------------------------------------
# state

class _Traced(NamedTuple):
  """The forward traced once inside a step's program: its inputs' types, `vjp_jaxpr` and carry plan."""

  signature: tuple
  trace: VjpTrace
  plan: tuple



@dataclasses.dataclass(frozen=True, eq=True)
class _PendingMeta:
  """Static facts about a pending forward pass (pytree aux data, hashed into jit's cache key).

  Attributes:
    schedule: the schedule the pending gradients will be reduced with (the one the forward ran under).
    batch_tree: the batch's treedef.
    batch: (path, shape, dtype, varying) of every batch leaf, as the step saw it (per device); dtype is
      the dtype object (a numpy dtype, or an extended dtype such as a typed PRNG key's).
    residuals: (shape, dtype) of every carried residual, per device, in flatten order.
    carry: where the carried values are in the forward's jaxpr (`_residuals.carry_plan`); the
      backward recomputes the rest of what it reads from them and the state's parameters.
    forward_size: (equations, outputs after the loss) of that jaxpr: the backward's trace must match.
    loss_varying: whether the loss varied over the axis (shard_map with check_vma).
    loss_dtype: the loss's dtype (the cotangent's).
    state_tree: the treedef of the model state the forward read (that of `None` without `has_state`).
    state: (path, shape, dtype, varying) of every leaf of that model state.
    has_state: whether the forward ran with a model state (`pipelined(..., has_state=True)`).
  """

  schedule: Schedule
  batch_tree: Any
  batch: tuple[tuple[str, tuple[int, ...], Any, bool], ...]
  residuals: tuple[tuple[tuple[int, ...], Any], ...]
  carry: tuple[tuple[int, int], ...]
  forward_size: tuple[int, int]
  loss_varying: bool
  loss_dtype: Any = np.dtype("float32")
  state_tree: Any = None
  state: tuple[tuple[str, tuple[int, ...], Any, bool], ...] = ()
  has_state: bool = False

  def __hash__(self) -> int:  # the schedule can be large: hash once
    h = self.__dict__.get("_hash")
    if h is None:
      h = hash((self.schedule.tree_fingerprint, len(self.schedule.chunks), self.batch_tree, self.batch,
                self.residuals, self.carry, self.forward_size, self.loss_varying, self.loss_dtype,
                self.state_tree, self.state, self.has_state))
      object.__setattr__(self, "_hash", h)
    return h

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, _PendingMeta):
      return NotImplemented
    return (self.batch == other.batch and self.residuals == other.residuals
            and self.carry == other.carry and self.forward_size == other.forward_size
            and self.loss_varying == other.loss_varying and self.loss_dtype == other.loss_dtype
            and self.batch_tree == other.batch_tree and self.state_tree == other.state_tree
            and self.state == other.state and self.has_state == other.has_state
            and (self.schedule is other.schedule or self.schedule == other.schedule))


@jax.tree_util.register_pytree_node_class
class Pending:
  """The residuals of a forward pass whose backward has not run yet.

  Attributes:
    residuals: the `jax.vjp` closure's arrays, in flatten order, each with a leading axis of size 1
      (so that under `shard_map` every residual, scalars included, has an axis to split over devices:
      `P(axis_name)`; under `pmap` the device axis comes in front of it).
    meta: static shapes, dtypes and the schedule (see `_PendingMeta`); part of the pytree structure.
  """

  __slots__ = ("residuals", "meta")

  def __init__(self, residuals: tuple[Any, ...], meta: _PendingMeta):
    self.residuals = tuple(residuals)
    self.meta = meta

  def tree_flatten(self):
    return self.residuals, self.meta

  @classmethod
  def tree_unflatten(cls, meta, residuals):
    return cls(tuple(residuals), meta)

  def __repr__(self) -> str:
    return f"Pending({len(self.residuals)} residuals, {_meta_nbytes(self.meta)} bytes per device)"


class PipelinedState(NamedTuple):
  """State of the pipelined step.

  Attributes:
    params: the parameters after every *applied* update (replicated over the axis). While a backward is
      pending they lag the plain loop by one step: `flush` first to evaluate or checkpoint.
    opt_state: `tx`'s state (replicated).
    pending: `None` when nothing is pending (after `init` and `flush`), else a `Pending` holding the last
      forward's residuals (per device).
    model_state: with `has_state=True`, the model state the last forward produced (the one the plain
      loop holds after as many steps as `step` calls; `init`'s before any); `None` otherwise. Not
      touched by `flush`.
    defer: the schedule's deferral state (`prophet_jax.DeferState`: the previous step's reduced chunk
      norms and choice, replicated, and each device's residual of the chunks it deferred) when the
      schedule defers (`dlcp` with `max_defer > 0`); `None` otherwise. Threaded by `step` and `flush`.
  """

  params: Any
  opt_state: Any
  pending: Pending | None
  model_state: Any = None
  defer: DeferState | None = None


def _meta_nbytes(meta: _PendingMeta) -> int:
  return int(sum(int(np.prod(s, dtype=np.int64)) * _dtype_of(d).itemsize for s, d in meta.residuals))


def _dtype_of(dt: Any) -> Any:
  """A dtype object from a dtype or its name (numpy dtypes, bfloat16, extended dtypes as they are)."""
  return dt if jax.dtypes.issubdtype(dt, jax.dtypes.extended) else jnp.dtype(dt)


def _round_to_dtype(x: Any) -> Any:
  """`x` rounded to its own dtype in a way XLA keeps, for bfloat16 and float16 leaves; others as given.

  XLA's CPU backend computes in float32 and, with excess precision allowed (its default), may hand a
  fused consumer the float32 value of a bfloat16 result instead of the rounded one. `reduce_precision`
  on the float32 value rounds exactly as the conversion to the dtype does (round to nearest even, the
  same exponent range), and XLA cannot remove it: on float32 it is not a no-op.
  """
  dt = getattr(x, "dtype", None)
  if dt is None or dt not in (jnp.bfloat16, jnp.float16):
    return x
  info = jnp.finfo(dt)
  wide = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=int(info.nexp),
                                  mantissa_bits=int(info.nmant))
  return wide.astype(dt)


# --------------------------------------------------------------------------------------------------
# the object

_NO_STATE = object()  # `init`'s default: no model state given (None is a valid model state)


@dataclasses.dataclass(frozen=True, eq=False)
class Pipelined:
  """The pipelined train step returned by `pipelined(...)`: pure functions over a `PipelinedState`.

  Run `init` anywhere (or under the mapping), and `step` / `flush` under the user's own `jax.pmap` or
  `jax.shard_map` (inside `jax.jit`) with the axis `axis_name` bound.

  Attributes:
    loss_fn: `loss_fn(params, batch)`, or `loss_fn(params, model_state, batch)` with `has_state`; it
      returns the per-device mean loss, with the new model state and the aux as `pipelined` says.
    tx: the optimizer (any optax GradientTransformation).
    schedule: the all-reduce schedule (from `prophet_jax.plan`; any policy works).
    axis_name: the data-parallel axis.
    residuals: "min-cut" (the fewest bytes; `_residuals.carry_plan`), "all" (what `jax.vjp` keeps),
      "matmuls" (`save_matmuls`), or a `jax.checkpoint` policy.
    has_aux: `loss_fn` returns an auxiliary output beside the loss.
    has_state: `loss_fn` takes and returns a model state.
    enforce_order: False: the schedule's units carry XLA combiner keys instead of the tie (`_keys`).
  """

  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  schedule: Schedule
  axis_name: Any
  residuals: Any = "min-cut"
  has_aux: bool = False
  has_state: bool = False
  enforce_order: bool = True

  def __post_init__(self):
    # one callable for the life of this step: jax.checkpoint caches its trace of a function by identity,
    # and a bound method is a new object at every access
    object.__setattr__(self, "_loss_call", self._call)
    if not self.enforce_order:   # the programs that reduce are traced with keys in place of the tie
      for name in ("step", "flush"):
        object.__setattr__(self, name, ordered_by(False, getattr(self, name)))

  # -- public -------------------------------------------------------------------------------------
  def init(self, params: Any, model_state: Any = _NO_STATE) -> PipelinedState:
    """The initial state: `params`, `tx.init(params)`, nothing pending, the model state and, for a
    schedule that defers, its deferral state before the first step (`prophet_jax.defer_state`).

    Args:
      params: the parameters (the tree the schedule was planned for).
      model_state: with `has_state=True` (and only then), the model state the first forward reads
        (e.g. `variables["batch_stats"]`, a PRNG key).

    Raises:
      ScheduleMismatchError: the schedule was planned for another tree (the leaf at fault is named).
      TypeError: `model_state` given without `has_state=True`, or missing with it.
    """
    self._check_params(params, "pipelined.init")
    if self.has_state and model_state is _NO_STATE:
      raise TypeError("pipelined.init: this step was made with has_state=True, so init needs the model "
                      "state the first forward reads: init(params, model_state).")
    if not self.has_state and model_state is not _NO_STATE:
      raise TypeError("pipelined.init: a model_state was given, but this step was made without "
                      "has_state=True, so loss_fn would never see it. Pass has_state=True to pipelined "
                      "and write loss_fn(params, model_state, batch) -> (loss, new_model_state).")
    opt_state = (_zero.init(self.tx, params, self.schedule, self.axis_name, "pipelined.init")
                 if self.schedule.sharded else self.tx.init(params))
    return PipelinedState(params=params, opt_state=opt_state, pending=None,
                          model_state=None if model_state is _NO_STATE else model_state,
                          defer=_defer.init(self.schedule))

  def step(self, state: PipelinedState, batch: Any) -> tuple[PipelinedState, Any]:
    """One pipelined step: pending backward, scheduled all-reduce, update, then the forward of `batch`.

    On the first call (nothing pending) only the forward runs. A state whose pending forward ran under
    another schedule for the same tree (a re-plan between calls) is flushed first, with the schedule it
    was made under, inside the same program: the result stays exact. If the re-plan changes the
    deferral groups, that transition sends every chunk of the old schedule, each deferred value added
    back (nothing is lost), and the new schedule's deferral starts from its initial state.

    With a schedule that defers (`dlcp`, `max_defer > 0`), the pending gradients go through its
    deferral groups (`Bucket`): the step equals the plain loop with
    `prophet_jax.allreduce(grads, schedule, axis_name, defer_state=...)` in place of `pmean`, the
    deferral state threaded through `state.defer`.

    What equals the plain loop (`jax.value_and_grad(loss_fn, has_aux=...)`, `pmean`, `tx`, one jitted
    call per batch), call by call: the loss (and aux) returned for `batch` are the plain step's on
    the same batch, i.e. at the parameters after the previous batches' updates and, with `has_state`,
    at the model state the previous batch's forward produced; `state.model_state` after the call is
    the plain loop's after this batch. The parameters lag by one update until `flush`; after it they
    are the plain loop's. Equal means: up to float32 reduction order (docs/design.md, "Equivalence
    tolerance"); bfloat16 parameters are rounded as the plain loop rounds them.

    Args:
      state: from `init`, `step` or `flush`.
      batch: this device's batch (any pytree; typed PRNG keys allowed); every call between flushes must
        see the same shapes.

    Returns:
      `(state, loss)`, or `(state, (loss, aux))` with `has_aux=True`: the new state (holding this
      batch's residuals and, with `has_state`, the model state this forward produced), this device's
      loss on `batch` and the aux of this forward.

    Raises:
      TypeError: `state` is not a PipelinedState, or `loss_fn` returns something other than it should
        (a non-scalar loss, a tuple without `has_aux`, a model state of another structure).
      ValueError: the batch's shapes or dtypes differ from the pending forward's (flush first).
      ScheduleMismatchError: the params, or the pending forward's schedule, belong to another tree;
        `state.defer` belongs to another schedule than the one it is used with.
      UnboundAxisError: `axis_name` is not bound here.
    """
    where = "pipelined.step"
    self._check_state(state, where)
    axis_size(self.axis_name, where)
    self._check_params(state.params, where)
    batch_tree, batch_avals = self._avals(batch)
    params, opt_state, defer = state.params, state.opt_state, state.defer
    traced = None  # the backward's trace of the forward, which the next forward reuses when it can
    if state.pending is not None:
      self._check_batch(state.pending.meta, batch_tree, batch_avals)
      params, opt_state, defer, traced = self._backward_and_update(params, opt_state, state.pending, defer,
                                                                   where)
    elif defer is None and self.schedule.defers:
      defer = _defer.init(self.schedule)  # nothing was deferred (a lossless step's state): start here
    elif not (_defer.carries_over(defer, self.schedule)):
      self._check_defer(defer, self.schedule, where)
    # else: a re-plan after a flush: the state of the old schedule rides until the next backward,
    # which adds its residual to those gradients (`_reduce`)
    loss, model_state, aux, pending = self._forward(params, state.model_state, batch, batch_tree,
                                                    batch_avals, traced)
    new = PipelinedState(params=params, opt_state=opt_state, pending=pending, model_state=model_state,
                         defer=defer)
    return new, ((loss, aux) if self.has_aux else loss)

  def flush(self, state: PipelinedState) -> PipelinedState:
    """Runs the pending backward, its scheduled all-reduce and the update; a no-op when none is pending.

    Call it before evaluating, checkpointing, changing the batch shape, and at the end of training:
    afterwards `params(state)` equals the plain loop's parameters after as many steps as `step` calls
    (and `model_state(state)`, which `flush` leaves as it is, the plain loop's model state).

    With a schedule that defers, the flushed step defers as any step does (the plain loop's last step
    does too): the values it deferred are not lost, they stay in `state.defer.residual` (each
    device's own), and the next `step` adds them to the same elements. To apply them at the end of
    training, reduce and apply them as one more update: under the mapping,
    `g = jax.lax.pmean(p.deferred_grads(state), axis_name)`, then `tx.update(g, ...)` (an optimizer
    step of its own, beyond the plain loop's steps). Or simply stop: at most
    `schedule.max_deferred_fraction` of one step's gradient waits, kept in a checkpoint of the state.

    Raises:
      TypeError: `state` is not a PipelinedState.
      ScheduleMismatchError: the pending forward belongs to another tree, or `state.defer` to another
        schedule.
      UnboundAxisError: `axis_name` is not bound here (only checked when something is pending).
    """
    where = "pipelined.flush"
    self._check_state(state, where)
    if state.pending is None:
      return state
    axis_size(self.axis_name, where)
    params, opt_state, defer, _ = self._backward_and_update(state.params, state.opt_state,
                                                            state.pending, state.defer, where)
    return state._replace(params=params, opt_state=opt_state, pending=None, defer=defer)

  def params(self, state: PipelinedState) -> Any:
    """The parameters after every applied update (`flush` first for the plain loop's parameters)."""
    self._check_state(state, "pipelined.params")
    return state.params

  def model_state(self, state: PipelinedState) -> Any:
    """The model state the last forward produced (`has_state=True`), the plain loop's after as many
    steps; `None` without `has_state`."""
    self._check_state(state, "pipelined.model_state")
    return state.model_state

  def state_specs(self, state: PipelinedState | None = None, *,
                  model_state: Any = PartitionSpec()) -> PipelinedState:
    """PartitionSpecs of the state for `jax.shard_map`'s in_specs / out_specs.

    Parameters and optimizer state are replicated (`P()`; a sharded schedule's optimizer state is each
    device's shard state, `P(axis_name)`, as `prophet_jax.state_specs` says); the residuals are per device
    (`P(axis_name)`, each with a leading axis of size 1 per device); the model state is as
    `model_state` says; the deferral state as `prophet_jax.state_specs` says (its residuals
    `P(axis_name)`, its norms, mask and indices `P()`).

    Args:
      state: optional. Without it the result is a *prefix* spec (one PartitionSpec per field, and per
        field of the DeferState when the schedule defers), valid for any state of this step, pending
        or not, as shard_map accepts; with it, a spec for every leaf (e.g. for `jax.device_put` with
        NamedShardings). (A re-plan from a schedule that defers to one that does not, or back, changes
        `state.defer` between None and a DeferState: that one call takes the old step's specs in and
        the new step's out.)
      model_state: the spec (or a prefix tree of specs) of the model state: `P()` (the default) when
        it is the same on every device (e.g. BatchNorm statistics averaged over the axis in `loss_fn`,
        a PRNG key split alike everywhere), `P(axis_name)` for per-device values stacked on a leading
        axis.
    """
    axis = self.axis_name
    rep = PartitionSpec()
    defer = (DeferState(norms=rep, deferred=rep, index=rep, residual=PartitionSpec(axis), tag=rep)
             if self.schedule.defers else rep)
    opt = PartitionSpec(axis) if self.schedule.sharded else rep  # ZeRO-1: each device's shard state
    prefix = PipelinedState(params=rep, opt_state=opt, pending=PartitionSpec(axis),
                            model_state=model_state, defer=defer)
    if state is None:
      return prefix
    self._check_state(state, "pipelined.state_specs")
    def expand(spec, part):  # a spec (or a prefix tree of them) -> one spec per leaf of `part`
      return jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), spec, part,
                                    is_leaf=lambda x: isinstance(x, PartitionSpec))

    full = [expand(spec, part) for part, spec in zip(state[:-1], prefix[:-1])]
    return PipelinedState(*full, defer=_defer.state_specs(state.defer, axis))

  def deferred_grads(self, state: PipelinedState) -> Any:
    """This device's deferred gradient values as a tree like the parameters (zero elsewhere).

    The values in `state.defer.residual`, put back at their elements: what the next step would add
    to its gradients. To apply them at the end of training, average them over the axis and apply
    them as one more update (`jax.lax.pmean(p.deferred_grads(state), axis_name)`, then `tx`); their
    `psum` plus every applied gradient times the axis size is the sum of every true gradient
    (conservation). Pure and local: no collective; call it where the state's leaves are per device
    (inside the mapping, or on one device's slice). A tree of zeros when the schedule defers nothing.

    Raises:
      TypeError: `state` is not a PipelinedState.
      ScheduleMismatchError: `state.defer` belongs to another schedule.
    """
    where = "pipelined.deferred_grads"
    self._check_state(state, where)
    schedule = self.schedule if state.pending is None else state.pending.meta.schedule
    if _defer.carries_over(state.defer, schedule):
      schedule = _defer.schedule_of(state.defer)   # a re-plan's state: its own schedule's elements
    self._check_defer(state.defer, schedule, where)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    return zeros if state.defer is None else _defer.add_residual(zeros, schedule, state.defer, where)

  def residual_bytes(self, state: PipelinedState) -> int:
    """Bytes of carried residuals per device (0 when nothing is pending).

    These are what a plain step holds between its forward and its backward anyway (activations and the
    parameter copies the backward reads); the pipelined step holds them across the call boundary.
    """
    self._check_state(state, "pipelined.residual_bytes")
    return 0 if state.pending is None else _meta_nbytes(state.pending.meta)

  # -- the pieces ---------------------------------------------------------------------------------
  def _call(self, params: Any, inputs: Any) -> tuple[Any, tuple[Any, Any]]:
    """`loss_fn` on the forward's inputs (the batch, or (model_state, batch)), as (loss, (state, aux))."""
    if self.has_state:
      model_state, batch = inputs
      out = self.loss_fn(params, model_state, batch)
    else:
      out = self.loss_fn(params, inputs)
    if not (self.has_aux or self.has_state):
      if isinstance(out, (tuple, list)):
        raise TypeError(f"pipelined: loss_fn returned a {type(out).__name__} of {len(out)} values; "
                        f"without has_aux=True it must return the scalar loss. If it returns (loss, "
                        f"aux), pass has_aux=True (and has_state=True if aux is a model state the next "
                        f"forward reads, such as BatchNorm statistics).")
      return out, (None, None)
    what = ("(loss, (new_model_state, aux))" if self.has_aux and self.has_state else
            "(loss, new_model_state)" if self.has_state else "(loss, aux)")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(f"pipelined: with has_aux={self.has_aux} and has_state={self.has_state}, loss_fn "
                      f"must return {what}; got {type(out).__name__}.")
    loss, rest = out
    if self.has_aux and self.has_state:
      if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
        raise TypeError(f"pipelined: with has_aux=True and has_state=True, loss_fn must return {what}; "
                        f"its second value is a {type(rest).__name__}, not a pair.")
      return loss, tuple(rest)
    return loss, ((rest, None) if self.has_state else (None, rest))

  def _forward_fn(self, params: Any, inputs: Any) -> Any:
    """`_call`, under `jax.checkpoint` with the residual policy unless every residual is kept."""
    if self.residuals in ("all", "min-cut"):
      return self._call(params, inputs)
    policy = save_matmuls if self.residuals == "matmuls" else self.residuals
    # prevent_cse=False: the recomputation runs in the *next* call's backward, on carried residuals,
    # where nothing can be CSE'd with this forward; the guard would only add copies
    return jax.checkpoint(self._loss_call, policy=policy, prevent_cse=False)(params, inputs)

  def _inputs(self, model_state: Any, batch: Any) -> Any:
    return (model_state, batch) if self.has_state else batch

  def _trace(self, pv: Any, inputs: Any, reuse: _Traced | None = None) -> _Traced:
    """The forward's `vjp_jaxpr` on `inputs` and its carry plan (nothing runs).

    `reuse`: a trace made earlier in the same program; returned as it is when its inputs' types (tree,
    shapes, dtypes, weak types, varying axes) are these. The jaxpr depends on nothing else, so a
    pipelined step traces its forward once, not once for the pending backward and again for the next
    forward (a third of a ResNet-50 step's lowering time).
    """
    leaves, tree = jax.tree_util.tree_flatten((pv, inputs))
    signature = (tree, tuple(jax.typeof(x) for x in leaves))
    if reuse is not None and reuse.signature == signature:
      return reuse
    trace = vjp_jaxpr(self._forward_fn, pv, inputs, has_aux=True)
    plan = carry_plan(trace.closed, len(jax.tree_util.tree_leaves(pv)), self._how, n_head=trace.n_head)
    return _Traced(signature, trace, plan)

  def _forward(self, params: Any, model_state: Any, batch: Any, batch_tree: Any,
               batch_avals: tuple, traced: _Traced | None = None) -> tuple[jax.Array, Any, Any, Pending]:
    pv = self._varying_params(params)
    state_tree, state_avals = self._avals(model_state)
    # traced once, run from its jaxpr: the same trace says what to carry
    _, trace, plan = self._trace(pv, self._inputs(model_state, batch), traced)
    n_head = trace.n_head
    with jax.named_scope("pipelined_forward"):
      loss, *outs = forward(trace.closed, plan, n_head=n_head)(
          *jax.tree_util.tree_leaves(pv), *jax.tree_util.tree_leaves(self._inputs(model_state, batch)))
    new_state, aux = jax.tree_util.tree_unflatten(trace.aux_tree, outs[:n_head - 1])
    residuals = outs[n_head - 1:]
    self._check_loss(loss)
    if self.has_state:
      self._check_new_state(model_state, new_state)
    meta = _PendingMeta(
        schedule=self.schedule, batch_tree=batch_tree, batch=batch_avals,
        residuals=tuple((tuple(np.shape(x)), x.dtype) for x in residuals),
        carry=plan, forward_size=_size(trace.closed, n_head),
        loss_varying=self._is_varying(loss), loss_dtype=jnp.result_type(loss),
        state_tree=state_tree, state=state_avals, has_state=self.has_state)
    return loss, new_state, aux, Pending(tuple(x[None] for x in residuals), meta)

  def _backward_and_update(self, params: Any, opt_state: Any, pending: Pending, defer: Any,
                           where: str) -> tuple[Any, Any, Any, _Traced]:
    meta = pending.meta
    schedule = meta.schedule
    if schedule.tree_fingerprint != self.schedule.tree_fingerprint:
      raise ScheduleMismatchError(
          f"{where}: the state's pending forward ran under a schedule for another tree (fingerprint "
          f"{schedule.tree_fingerprint!r}; this pipelined step's schedule has "
          f"{self.schedule.tree_fingerprint!r}). The state was made by a pipelined step of a different "
          f"model: flush it with that step, or start from init(params) with this one.")
    if meta.has_state != self.has_state:
      raise ValueError(f"{where}: the state's pending forward ran {'with' if meta.has_state else 'without'} "
                       f"a model state, but this pipelined step has has_state={self.has_state}. Flush it "
                       f"with the step that made it, or start from init(...).")
    pv = self._varying_params(params)
    traced = self._vjp_structure(pv, meta)
    _, trace, plan = traced
    closed = trace.closed
    res_avals = tuple((tuple(a.shape), a.dtype) for a in carried_avals(closed, plan))
    if (res_avals != meta.residuals or plan != meta.carry
        or _size(closed, trace.n_head) != meta.forward_size):
      same = " (the same shapes, other values of the forward)" if res_avals == meta.residuals else ""
      raise ValueError(
          f"{where}: the state carries {len(meta.residuals)} residuals {_short(meta.residuals)}, but this "
          f"pipelined step's forward on the recorded batch shapes carries {len(res_avals)} "
          f"{_short(res_avals)}{same}. The state was made by a pipelined step with another loss_fn or "
          f"residuals= option: flush it with that step first, or start from init(params).")
    if len(pending.residuals) != len(meta.residuals):
      raise ValueError(f"{where}: the state's pending node holds {len(pending.residuals)} arrays but "
                       f"records {len(meta.residuals)}; it was edited. Start from init(params).")
    if not _defer.carries_over(defer, schedule):   # a re-plan's state is carried over by `_reduce`
      self._check_defer(defer, schedule, where)
    with jax.named_scope("pipelined_backward"):
      leaves = recompute(closed, plan, len(jax.tree_util.tree_leaves(pv)), n_head=trace.n_head)(
          *jax.tree_util.tree_leaves(pv), *(r[0] for r in pending.residuals))
      vjp_fn = jax.tree_util.tree_unflatten(trace.treedef, leaves)
      (grads,) = vjp_fn(self._ones_ct(meta))
    if schedule.sharded or self.schedule.sharded:
      if schedule.sharded != self.schedule.sharded:
        was = "a sharded" if schedule.sharded else "an all-reduce"
        now = "sharded" if self.schedule.sharded else "an all-reduce one"
        raise ValueError(
            f"{where}: the state's pending forward ran under {was} schedule ({schedule.policy}), but this "
            f"pipelined step's is {now} ({self.schedule.policy}): the "
            f"optimizer state's layout (each device's shard, or replicated) changes between them. Flush "
            f"with the step that made the state, then start this one from init(params).")
      # ZeRO-1: reduce-scatter, tx on this device's shards, all-gather the update (the next forward
      # reads each gather's params as soon as it lands: the all-gathers run inside it)
      updates, opt_state = _zero.update(self.tx, grads, opt_state, params, schedule, self.axis_name,
                                        where=where)
    else:
      grads, defer = self._reduce(grads, schedule, defer, where)
      updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # the next forward reads these inside this program: round low-precision leaves as memory would
    params = jax.tree_util.tree_map(_round_to_dtype, params)
    return params, opt_state, defer, traced

  def _reduce(self, grads: Any, schedule: Schedule, defer: Any, where: str) -> tuple[Any, Any]:
    """The pending gradients all-reduced (mean) with `schedule`, the one their forward ran under, and
    the deferral state this step's schedule continues from.

    Within one schedule (or schedules with the same deferral groups) the groups defer as in any step
    (`allreduce(..., defer_state=)`). A re-plan between calls that changes the deferral groups ends the
    old ones here: their residual is added back to its elements and every chunk of `schedule` is
    sent (its groups without deferral, one all-reduce per chunk, in issue order: the simulator's
    lossless reading of the schedule), and the new schedule's deferral starts from its initial state:
    nothing deferred is lost across a re-plan.
    """
    if _defer.same_groups(schedule, self.schedule):
      if not schedule.defers and defer is None:
        return allreduce(grads, schedule, self.axis_name, mean=True), None
      # a state of a third schedule (a re-plan after a flush) is carried over by allreduce itself
      return allreduce(grads, schedule, self.axis_name, mean=True, defer_state=defer)
    if defer is not None:
      grads = _defer.add_residual(grads, _defer.schedule_of(defer) or schedule, defer, where)
    grads = allreduce(grads, _defer.lossless(schedule), self.axis_name, mean=True)
    return grads, _defer.init(self.schedule)

  def _vjp_structure(self, pv: Any, meta: _PendingMeta) -> _Traced:
    """The forward traced on the recorded input shapes (nothing of it runs): its `vjp_jaxpr` and the
    carry plan."""
    batch = jax.tree_util.tree_unflatten(meta.batch_tree, [self._placeholder(a) for a in meta.batch])
    model_state = jax.tree_util.tree_unflatten(meta.state_tree, [self._placeholder(a) for a in meta.state])
    return self._trace(pv, self._inputs(model_state, batch))

  def _placeholder(self, aval: tuple) -> jax.Array:
    """A value of a recorded (path, shape, dtype, varying) leaf (a constant; only its type matters)."""
    _, shape, dtype, varying = aval
    x = jax.lax.full(shape, 0, dtype)  # also for extended dtypes (typed PRNG keys)
    if varying and vma_enabled(self.axis_name):
      x = to_varying(x, self.axis_name)
    return x

  @property
  def _how(self) -> str:
    return "min-cut" if self.residuals == "min-cut" else "closure"

  def _ones_ct(self, meta: _PendingMeta) -> jax.Array:
    ct = jnp.ones((), meta.loss_dtype)
    if meta.loss_varying and vma_enabled(self.axis_name):
      ct = to_varying(ct, self.axis_name)
    return ct

  def _varying_params(self, params: Any) -> Any:
    """Under shard_map with check_vma, marks the params varying before differentiating (docs/facts.md,
    "The 8x gradient trap": otherwise jax.grad returns gradients already summed over the axis)."""
    if not vma_enabled(self.axis_name):
      return params

    def cast(x):
      if not is_reduced_leaf(x) or is_varying(x, self.axis_name):
        return x
      return to_varying(x, self.axis_name)

    return jax.tree_util.tree_map(cast, params)

  # -- checks -------------------------------------------------------------------------------------
  def _is_varying(self, x: Any) -> bool:
    return vma_enabled(self.axis_name) and is_varying(x, self.axis_name)

  def _check_state(self, state: Any, where: str) -> None:
    if not isinstance(state, PipelinedState):
      raise TypeError(f"{where}: expected the PipelinedState returned by init/step/flush, got "
                      f"{type(state).__name__}. Start with state = pipelined(...).init(params).")
    if state.pending is not None and not isinstance(state.pending, Pending):
      raise TypeError(f"{where}: state.pending must be None or a Pending node, got "
                      f"{type(state.pending).__name__}.")
    if state.defer is not None and not isinstance(state.defer, DeferState):
      raise TypeError(f"{where}: state.defer must be None or a prophet_jax.DeferState, got "
                      f"{type(state.defer).__name__}. Start with state = pipelined(...).init(params).")

  def _check_defer(self, defer: Any, schedule: Schedule, where: str) -> None:
    """`_defer.check_state` for `state.defer` against the schedule it is used with, the fix said for
    a pipelined state."""
    hint = ("A pipelined step makes its deferral state in init and threads it through step and flush; "
            "a re-plan between calls carries it over while a forward is pending (the first call under "
            "the new schedule ends the old deferral groups, their residual added back). After a flush "
            "under another schedule, its residual is only meaningful for that schedule's chunks: apply "
            "it with that step (pmean of its deferred_grads(state), then tx) or drop it, then set "
            "state = state._replace(defer=prophet_jax.defer_state(schedule)).")
    try:
      _defer.check_state(defer, schedule, where)
    except ScheduleMismatchError as e:
      raise ScheduleMismatchError(f"{e} {hint}") from None
    except TypeError as e:
      raise TypeError(f"{e} {hint}") from None

  def _check_params(self, params: Any, where: str) -> None:
    match_tree(jax.tree_util.tree_flatten_with_path(params)[0], self.schedule, where=where)

  def _avals(self, tree: Any) -> tuple[Any, tuple]:
    """(treedef, ((path, shape, dtype, varying), ...)) of a batch or model state."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    avals = []
    for path, x in leaves:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
      avals.append((path_str(path), tuple(int(d) for d in x.shape), x.dtype, self._is_varying(x)))
    return jax.tree_util.tree_structure(tree), tuple(avals)

  def _check_batch(self, meta: _PendingMeta, batch_tree: Any, avals: tuple) -> None:
    fix = ("Every step between flushes must see the same batch shapes; call state = flush(state) "
           "before changing them (e.g. for a last, smaller batch).")
    if batch_tree != meta.batch_tree:
      raise ValueError(f"pipelined.step: the batch's structure {batch_tree} differs from the pending "
                       f"forward's {meta.batch_tree}. {fix}")
    for (path, shape, dtype, vary), (_, shape0, dtype0, vary0) in zip(avals, meta.batch):
      if shape != shape0 or dtype != dtype0:
        raise ValueError(f"pipelined.step: batch leaf {path!r} has shape {shape} and dtype {dtype}, but "
                         f"the pending forward ran on shape {shape0} and dtype {dtype0}. {fix}")
      if vary != vary0:
        raise ValueError(f"pipelined.step: batch leaf {path!r} is {'' if vary else 'not '}varying over "
                         f"{self.axis_name!r} now but was {'' if vary0 else 'not '}before: keep the "
                         f"same in_specs for the batch between flushes.")

  def _check_new_state(self, old: Any, new: Any) -> None:
    """The new model state must be a drop-in for the old: same structure, shapes, dtypes, and not
    varying over the axis where the old one was not."""
    fix = ("loss_fn(params, model_state, batch) must return a new model state of the same structure, "
           "shapes and dtypes as the one it was given (flax: `variables['batch_stats']` in, "
           "`updates['batch_stats']` out).")
    old_tree, old_avals = self._avals(old)
    new_tree, new_avals = self._avals(new)
    if old_tree != new_tree:
      raise TypeError(f"pipelined: the model state loss_fn returned has structure {new_tree}, but it was "
                      f"given {old_tree}. {fix}")
    for (path, shape, dtype, vary), (_, shape0, dtype0, vary0) in zip(new_avals, old_avals):
      if shape != shape0 or dtype != dtype0:
        raise TypeError(f"pipelined: model state leaf {path!r} comes back with shape {shape} and dtype "
                        f"{dtype}, but went in with shape {shape0} and dtype {dtype0}. {fix}")
      if vary and not vary0:
        raise ValueError(
            f"pipelined: model state leaf {path!r} went in the same on every device but comes back "
            f"varying over {self.axis_name!r} (computed from this device's batch). Average it in "
            f"loss_fn (jax.lax.pmean(..., {self.axis_name!r}), as synchronized BatchNorm statistics "
            f"are), or keep it per device: pass it with a leading device axis and "
            f"state_specs(model_state=P({self.axis_name!r})).")

  def _check_loss(self, loss: Any) -> None:
    if np.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise TypeError(f"pipelined: loss_fn(params, batch) must return a floating scalar, got shape "
                      f"{np.shape(loss)} and dtype {jnp.result_type(loss)}. Return the mean loss over "
                      f"this device's batch.")


def _size(closed: Any, n_head: int) -> tuple[int, int]:
  return len(closed.jaxpr.eqns), len(closed.jaxpr.outvars) - n_head


def _short(avals: tuple) -> str:
  text = ", ".join(f"{d}{list(s)}" for s, d in avals[:4])
  return f"[{text}{', ...' if len(avals) > 4 else ''}]"


def pipelined(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
              schedule: Schedule, *, axis_name: Any, residuals: Any = "min-cut", has_aux: bool = False,
              has_state: bool = False, mesh: Any = None, enforce_order: bool = True) -> Pipelined:
  """The cross-step pipelined train step for `loss_fn`, `tx` and `schedule` over `axis_name`.

  Each `step` runs the previous batch's backward with the schedule's chunked, ordered all-reduces,
  `tx`'s update and this batch's forward in one program, so each layer's next forward can start as
  soon as its chunks are reduced (docs/design.md, "Simulator semantics", `cross_step=True`).

  Equal to the plain loop: per call, the returned loss and aux are the plain step's on the same batch,
  `state.model_state` is the plain loop's after that batch, and after N steps and a `flush` the
  parameters equal N plain steps (`jax.value_and_grad(loss_fn, has_aux=...)`, `pmean`, `tx`), up to
  float32 reduction order (bfloat16 parameters rounded as the plain loop rounds them).

  Args:
    loss_fn: the mean loss over this device's batch, one of (as `jax.value_and_grad` would take it):
      `loss_fn(params, batch) -> loss`;
      with `has_aux=True`, `loss_fn(params, batch) -> (loss, aux)`;
      with `has_state=True`, `loss_fn(params, model_state, batch) -> (loss, new_model_state)`;
      with both, `loss_fn(params, model_state, batch) -> (loss, (new_model_state, aux))`.
      The batch and the model state may hold typed PRNG keys.
    tx: an optax GradientTransformation, applied to the averaged gradients. Transformations that need
      every gradient at once (`optax.clip_by_global_norm`) stay correct but remove the overlap.
    schedule: a Schedule for `params` (any policy; `plan(..., cross_step=True)` plans for this step).
      With deferral groups (`dlcp`, `max_defer > 0`) the state carries their deferral state.
    axis_name: the data-parallel axis bound by the user's `jax.pmap` or `jax.shard_map`.
    residuals: what the forward keeps for the next call's backward. "min-cut" (the default): the
      fewest bytes from which the backward recomputes the rest of what it reads by elementwise and
      layout operations (prophet_jax/_residuals.py). "all": every batch value `jax.vjp` keeps.
      "matmuls": the forward under `jax.checkpoint` keeping only matmul, convolution and reduction
      outputs (`save_matmuls`). Or any `jax.checkpoint` policy. bench/pipelined.py measures them;
      the result is the same up to float32 rounding either way.
    has_aux: `loss_fn` returns an auxiliary output (metrics, logits, ...), not differentiated;
      `step` then returns `(state, (loss, aux))`, the aux of the forward it ran.
    has_state: `loss_fn` takes the model state (BatchNorm statistics, a PRNG key: anything the
      forward reads and updates without differentiating it) and returns the new one. The state lives
      in `PipelinedState.model_state` (`init(params, model_state)`); each forward reads the state the
      previous forward produced. Under `shard_map`, name its spec in `state_specs(model_state=...)`.
    mesh: run `init`, `step` and `flush` on global arrays inside a plain `jax.jit` over this mesh
      (a `MeshPipelined`: params replicated, the batch split over `axis_name`, the loss averaged
      over the global batch, as `hooked(..., mesh=)` does); None: call them under your own
      `jax.shard_map` or `jax.pmap`.
    enforce_order: True (the default): the tie keeps one collective per unit, in schedule order.
      False: each unit carries one XLA `combiner_key` and no tie; XLA:GPU keeps exactly the plan's
      units and orders them itself (`prophet_jax.allreduce` says more).

  Returns:
    A `Pipelined` with `init(params[, model_state])`, `step(state, batch) -> (state, loss)` (or
    `(state, (loss, aux))`), `flush(state)`, `params(state)`, `model_state(state)`,
    `state_specs(state=None, *, model_state=P())`, `residual_bytes(state)` and
    `deferred_grads(state)`.

  Raises:
    TypeError: `loss_fn` is not callable, `tx` is not a GradientTransformation, `schedule` is not a
      Schedule, or `has_aux` / `has_state` is not a bool.

  Example:
    >>> p = prophet_jax.pipelined(model.loss_fn, optax.adamw(1e-3), schedule, axis_name="data")
    >>> step = jax.pmap(p.step, axis_name="data")
    >>> state = jax.pmap(p.init, axis_name="data")(replicated_params)
    >>> for batch in batches:
    ...   state, loss = step(state, batch)
    >>> state = jax.pmap(p.flush, axis_name="data")(state)

    Under `jax.shard_map` (params replicated, batch split over "data"):

    >>> specs = p.state_specs()
    >>> step = jax.jit(jax.shard_map(lambda s, b: p.step(s, b), mesh=mesh,
    ...                              in_specs=(specs, P("data")), out_specs=(specs, P())))

    (the loss varies over the axis there: return `jax.lax.pmean(loss, "data")` or `loss[None]` with
    `P("data")` from a wrapper; `step` itself adds no collective beyond the schedule's.)

    A flax model with BatchNorm (statistics averaged over the devices in the loss, so the same on
    every device):

    >>> def loss_fn(params, batch_stats, batch):
    ...   logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, batch["x"],
    ...                             train=True, mutable=["batch_stats"])
    ...   loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    ...   return loss, jax.lax.pmean(upd["batch_stats"], "data")
    >>> p = prophet_jax.pipelined(loss_fn, tx, schedule, axis_name="data", has_state=True)
    >>> state = p.init(params, variables["batch_stats"])
  """
  check_values("pipelined", loss_fn=loss_fn, tx=tx, schedule=schedule, axis_name=axis_name)
  if not (callable(residuals) or isinstance(residuals, str) and residuals in ("all", "min-cut", "matmuls")):
    raise ValueError(f"pipelined(residuals={residuals!r}): expected 'all', 'min-cut', 'matmuls' or a "
                     f"jax.checkpoint policy (a callable, e.g. "
                     f"jax.checkpoint_policies.dots_with_no_batch_dims_saveable).")
  for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
    if not isinstance(flag, bool):
      raise TypeError(f"pipelined({name}={flag!r}): expected True or False.")
  step = Pipelined(loss_fn=loss_fn, tx=tx, schedule=schedule, axis_name=axis_name, residuals=residuals,
                   has_aux=has_aux, has_state=has_state,
                   enforce_order=check_enforce_order("pipelined", enforce_order))
  # global arrays in a plain jax.jit: the same step mapped over the mesh
  return step if mesh is None else MeshPipelined(step, mesh=mesh)
