"""The cross-step pipelined train step: this backward, its all-reduces and the next forward in one program.

Each call runs the previous forward's pending backward, its chunked all-reduces in the schedule's
order, the update, and the next batch's forward, carrying the forward's residuals in the state: the
simulator's `cross_step=True`. docs/design.md ("The pipelined step") says why the step is cut between
forward and backward, what is carried (`residuals=`), the two compiled programs, deferral, sharded
schedules, auxiliary outputs and model state, and low-precision parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from . import _defer, _loss_reduction, _states, _zero
from .._values._checks import check_values
from ._axis import axis_size
from ._reduction import add_owed, allreduce, check_foreign
from ._defer import DeferState
from ._keys import check_enforce_order, ordered_by
from ._states import OwedState
from .._values._errors import ScheduleMismatchError
from ._mesh import placed_step
from ._pipelined_checks import PipelinedChecks, short_avals, jaxpr_size
from ._pending import Pending, PipelinedState, meta_nbytes, PendingMeta, round_to_dtype, Traced
from ._residuals import carried_avals, carry_plan, forward, recompute, save_matmuls, vjp_jaxpr
from .._values._schedule import Schedule

__all__ = ["pipelined", "Pipelined", "PipelinedState", "Pending", "save_matmuls"]

# --------------------------------------------------------------------------------------------------
# the object

_NO_STATE = object()  # `init`'s default: no model state given (None is a valid model state)


@dataclasses.dataclass(frozen=True, eq=False)
class Pipelined(PipelinedChecks):
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
    reduction: "mean" (`loss_fn` averages over its examples) or "sum" (it sums over them).
    enforce_order: False: the schedule's units carry XLA combiner keys instead of the tie (`_keys`).
  """

  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  schedule: Schedule
  axis_name: Any
  residuals: Any = "min-cut"
  has_aux: bool = False
  has_state: bool = False
  reduction: str = "mean"
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

    On the first call (nothing pending) only the forward runs. A state of another plan (its pending
    forward or its deferral state) raises ScheduleMismatchError: to change plans, flush with the old
    plan's step and convert the state outside the step (`prophet_jax.convert_state`); what the old
    plan deferred is added by the new plan's next backward (nothing is lost).

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
    elif isinstance(defer, OwedState):   # convert_state's owed values ride until the next backward,
      check_foreign(defer, self.schedule, where)   # which adds them to its gradients (`_reduce`)
    else:
      self._check_defer(defer, self.schedule, where)
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
        NamedShardings). (After `convert_state`, `state.defer` may hold an OwedState until the next
        backward: give that call `prophet_jax.first_step_specs(state, axis)`.)
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
    return PipelinedState(*full, defer=_states.state_specs(state.defer, axis))

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
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    if isinstance(state.defer, OwedState):   # convert_state's: owed to the next backward
      check_foreign(state.defer, self.schedule, where)
      return add_owed(zeros, state.defer, self.schedule, where)
    self._check_defer(state.defer, schedule, where)
    return zeros if state.defer is None else _defer.add_residual(zeros, schedule, state.defer, where)

  def residual_bytes(self, state: PipelinedState) -> int:
    """Bytes of carried residuals per device (0 when nothing is pending).

    These are what a plain step holds between its forward and its backward anyway (activations and the
    parameter copies the backward reads); the pipelined step holds them across the call boundary.
    """
    self._check_state(state, "pipelined.residual_bytes")
    return 0 if state.pending is None else meta_nbytes(state.pending.meta)

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

  def _trace(self, pv: Any, inputs: Any, reuse: Traced | None = None) -> Traced:
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
    return Traced(signature, trace, plan)

  def _forward(self, params: Any, model_state: Any, batch: Any, batch_tree: Any,
               batch_avals: tuple, traced: Traced | None = None) -> tuple[jax.Array, Any, Any, Pending]:
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
    meta = PendingMeta(
        schedule=self.schedule, batch_tree=batch_tree, batch=batch_avals,
        residuals=tuple((tuple(np.shape(x)), x.dtype) for x in residuals),
        carry=plan, forward_size=jaxpr_size(trace.closed, n_head),
        loss_varying=self._is_varying(loss), loss_dtype=jnp.result_type(loss),
        state_tree=state_tree, state=state_avals, has_state=self.has_state)
    return loss, new_state, aux, Pending(tuple(x[None] for x in residuals), meta)

  def _backward_and_update(self, params: Any, opt_state: Any, pending: Pending, defer: Any,
                           where: str) -> tuple[Any, Any, Any, Traced]:
    meta = pending.meta
    schedule = meta.schedule
    if schedule.tree_fingerprint != self.schedule.tree_fingerprint:
      raise ScheduleMismatchError(
          f"{where}: the state's pending forward ran under a schedule for another tree (fingerprint "
          f"{schedule.tree_fingerprint!r}; this pipelined step's schedule has "
          f"{self.schedule.tree_fingerprint!r}). The state was made by a pipelined step of a different "
          f"model: flush it with that step, or start from init(params) with this one.")
    if _states.schedule_key(schedule) != _states.schedule_key(self.schedule):
      raise ScheduleMismatchError(
          f"{where}: the state's pending forward ran under another plan ({schedule.policy}, key "
          f"{_states.schedule_key(schedule)}) than this step's ({self.schedule.policy}): a step takes only "
          f"its own plan's state. Flush it with the old plan's step, then change plans outside the step: "
          f"state = prophet_jax.convert_state(state, params, new_schedule, tx=tx).")
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
        or jaxpr_size(closed, trace.n_head) != meta.forward_size):
      same = " (the same shapes, other values of the forward)" if res_avals == meta.residuals else ""
      raise ValueError(
          f"{where}: the state carries {len(meta.residuals)} residuals {short_avals(meta.residuals)}, but this "
          f"pipelined step's forward on the recorded batch shapes carries {len(res_avals)} "
          f"{short_avals(res_avals)}{same}. The state was made by a pipelined step with another loss_fn or "
          f"residuals= option: flush it with that step first, or start from init(params).")
    if len(pending.residuals) != len(meta.residuals):
      raise ValueError(f"{where}: the state's pending node holds {len(pending.residuals)} arrays but "
                       f"records {len(meta.residuals)}; it was edited. Start from init(params).")
    if isinstance(defer, OwedState):   # convert_state's owed values: added by `_reduce`
      check_foreign(defer, self.schedule, where)
    else:
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
            f"with the step that made the state, then prophet_jax.convert_state(state, params, schedule, "
            f"tx=tx).")
      if isinstance(defer, OwedState):   # convert_state's owed values join these gradients
        grads, defer = add_owed(grads, defer, self.schedule, where), None
      # ZeRO-1: reduce-scatter, tx on this device's shards, all-gather the update (the next forward
      # reads each gather's params as soon as it lands: the all-gathers run inside it)
      updates, opt_state = _zero.update(self.tx, grads, opt_state, params, schedule, self.axis_name,
                                        where=where, mean=_loss_reduction.is_mean(self.reduction))
    else:
      grads, defer = self._reduce(grads, schedule, defer, where)
      updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # the next forward reads these inside this program: round low-precision leaves as memory would
    params = jax.tree_util.tree_map(round_to_dtype, params)
    return params, opt_state, defer, traced

  def _reduce(self, grads: Any, schedule: Schedule, defer: Any, where: str) -> tuple[Any, Any]:
    """The pending gradients all-reduced with `schedule` (this step's: a pending forward of another
    plan is refused before), and the deferral state the next step continues from. The groups defer as
    in any step (`allreduce(..., defer_state=)`); `convert_state`'s OwedState is added to these
    gradients there, and the schedule's deferral starts from its initial state."""
    mean = _loss_reduction.is_mean(self.reduction)
    if not schedule.defers and defer is None:   # the ordering is this step's: allreduce follows it
      return allreduce(grads, schedule, self.axis_name, mean=mean), None
    return allreduce(grads, schedule, self.axis_name, mean=mean, defer_state=defer)

  def _vjp_structure(self, pv: Any, meta: PendingMeta) -> Traced:
    """The forward traced on the recorded input shapes (nothing of it runs): its `vjp_jaxpr` and the
    carry plan."""
    batch = jax.tree_util.tree_unflatten(meta.batch_tree, [self._placeholder(a) for a in meta.batch])
    model_state = jax.tree_util.tree_unflatten(meta.state_tree, [self._placeholder(a) for a in meta.state])
    return self._trace(pv, self._inputs(model_state, batch))


def pipelined(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
              schedule: Schedule, *, axis_name: Any, residuals: Any = "min-cut", has_aux: bool = False,
              has_state: bool = False, mesh: Any = None, reduction: str = "mean",
              enforce_order: bool = True) -> Pipelined:
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
    reduction: "mean" (the default): `loss_fn` averages over its examples, the gradients are the
      devices' mean (with `mesh`, the loss too); "sum": it sums over them, and the gradients (with
      `mesh`, the loss) are the devices' sum: the plain step's over the global batch either way.
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
                   has_aux=has_aux, has_state=has_state, reduction=_loss_reduction.check(reduction, "pipelined"),
                   enforce_order=check_enforce_order("pipelined", enforce_order))
  # global arrays in a plain jax.jit: the same step mapped over the mesh
  return placed_step(step, mesh=mesh)
