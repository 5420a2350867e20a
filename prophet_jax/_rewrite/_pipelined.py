"""The cross-step pipelined train step: this backward, its all-reduces and the next forward in one program.

Each call runs the previous forward's pending backward, the per-device scheduled update `scheduled`
builds (`_transform.per_device`: the reduction layer chosen once from the schedule), and the next
batch's forward, carrying the forward's residuals in the state: the simulator's `cross_step=True`.
docs/design.md ("The pipelined step") says why the step is cut between forward and backward, what is
carried (`residuals=`), deferral, sharded schedules, aux outputs, model state and low precision.
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

from . import _defer, _loss_reduction, _states
from ._axis import axis_size, is_varying, to_varying, vma_enabled
from ._keys import check_enforce_order, ordered_by
from ._mesh import MeshPipelined, on_mesh
from ._pending import Pending, PendingMeta, PipelinedState, Traced, check_state, meta_nbytes, round_to_dtype

from ._residuals import carried_avals, carry_plan, forward, recompute, save_matmuls, vjp_jaxpr
from ._states import ScheduledState
from ._transform import per_device
from .._values._checks import check_values, match_tree
from .._values._errors import ScheduleMismatchError
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf, path_str

_NO_STATE = object()  # `init`'s default: no model state given (None is a valid model state)


@dataclasses.dataclass(frozen=True, eq=False)
class Pipelined:
  """The pipelined train step returned by `pipelined(...)`: pure functions over a `PipelinedState`.

  Run `init` anywhere (or under the mapping), and `step` / `flush` under the user's own `jax.pmap` or
  `jax.shard_map` (inside `jax.jit`) with the axis `axis_name` bound. The fields are `pipelined`'s
  arguments.
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
    self._update("pipelined")   # the reduction layer this schedule's family asks for (an FSDP plan refused)
    if not self.enforce_order:   # the programs that reduce are traced with keys in place of the tie
      for name in ("step", "flush"):
        object.__setattr__(self, name, ordered_by(False, getattr(self, name)))

  def _update(self, where: str) -> Any:
    """The per-device scheduled update (`scheduled`'s, the reduction layer chosen once), for `where`."""
    return per_device(self.tx, self.schedule, self.axis_name, mean=_loss_reduction.is_mean(self.reduction),
                      where=where)

  # -- public -------------------------------------------------------------------------------------
  def init(self, params: Any, model_state: Any = _NO_STATE) -> PipelinedState:
    """The initial state: `params`, the update's state for them (tx's, or its ZeRO-1 shards), nothing
    pending, the model state (with `has_state=True`, and only then) and the deferral state.

    Raises:
      ScheduleMismatchError: the schedule was planned for another tree (the leaf at fault is named).
      TypeError: `model_state` given without `has_state=True`, or missing with it.
    """
    where = "pipelined.init"
    match_tree(jax.tree_util.tree_flatten_with_path(params)[0], self.schedule, where=where)
    if self.has_state and model_state is _NO_STATE:
      raise TypeError("pipelined.init: this step was made with has_state=True, so init needs the model "
                      "state the first forward reads: init(params, model_state).")
    if not self.has_state and model_state is not _NO_STATE:
      raise TypeError("pipelined.init: a model_state was given, but this step was made without "
                      "has_state=True, so loss_fn would never see it. Pass has_state=True to pipelined "
                      "and write loss_fn(params, model_state, batch) -> (loss, new_model_state).")
    st = self._update(where).init(params)
    return PipelinedState(params=params, opt_state=st.inner, pending=None,
                          model_state=None if model_state is _NO_STATE else model_state, defer=st.defer_state)

  def step(self, state: PipelinedState, batch: Any) -> tuple[PipelinedState, Any]:
    """One pipelined step: the pending backward, the scheduled update, then the forward of `batch`.

    On the first call (nothing pending) only the forward runs. Per call, the loss (and aux) returned
    for `batch` equal the plain step's on the same batch; after `flush` the parameters equal the
    plain loop's (docs/design.md, "The pipelined step").

    Args:
      state: from `init`, `step` or `flush`.
      batch: this device's batch; every call between flushes must see the same shapes.

    Returns:
      `(state, loss)`, or `(state, (loss, aux))` with `has_aux=True`.

    Raises:
      TypeError: a state that is not a PipelinedState, or a `loss_fn` output of the wrong form.
      ValueError: the batch's shapes or dtypes differ from the pending forward's (flush first).
      ScheduleMismatchError: params, the pending forward or `state.defer` of another tree or plan
        (change plans with `convert_state`).
      UnboundAxisError: `axis_name` is not bound here.
    """
    where = "pipelined.step"
    check_state(state, where)
    axis_size(self.axis_name, where)
    match_tree(jax.tree_util.tree_flatten_with_path(state.params)[0], self.schedule, where=where)
    batch_tree, batch_avals = _avals(batch, self.axis_name)
    params, opt_state, defer = state.params, state.opt_state, state.defer
    traced = None  # the backward's trace of the forward, which the next forward reuses when it can
    if state.pending is not None:
      _check_batch(state.pending.meta, batch_tree, batch_avals, self.axis_name)
      params, opt_state, defer, traced = self._backward_and_update(state, where)
    elif defer is None and self.schedule.defers:
      defer = _defer.init(self.schedule)  # nothing was deferred (a lossless step's state): start here
    else:   # convert_state's owed values ride until the next backward, which adds them
      _check_defer(defer, self.schedule, where)
    loss, model_state, aux, pending = self._forward(params, state.model_state, batch, batch_tree,
                                                    batch_avals, traced)
    new = PipelinedState(params=params, opt_state=opt_state, pending=pending, model_state=model_state,
                         defer=defer)
    return new, ((loss, aux) if self.has_aux else loss)

  def flush(self, state: PipelinedState) -> PipelinedState:
    """Runs the pending backward and the scheduled update; a no-op when none is pending.

    Call it before evaluating, checkpointing, changing the batch shape and at the end of training:
    `params(state)` is then the plain loop's. What a deferring plan deferred stays in `state.defer`
    (apply it with `deferred_grads`, or let the next step add it).

    Raises:
      TypeError: `state` is not a PipelinedState.
      ScheduleMismatchError: the pending forward or `state.defer` of another tree or plan.
      UnboundAxisError: `axis_name` is not bound here (only checked when something is pending).
    """
    where = "pipelined.flush"
    check_state(state, where)
    if state.pending is None:
      return state
    axis_size(self.axis_name, where)
    params, opt_state, defer, _ = self._backward_and_update(state, where)
    return state._replace(params=params, opt_state=opt_state, pending=None, defer=defer)

  def params(self, state: PipelinedState) -> Any:
    """The parameters after every applied update (`flush` first for the plain loop's parameters)."""
    check_state(state, "pipelined.params")
    return state.params

  def model_state(self, state: PipelinedState) -> Any:
    """The model state the last forward produced (`has_state=True`); `None` without `has_state`."""
    check_state(state, "pipelined.model_state")
    return state.model_state

  def state_specs(self, state: PipelinedState | None = None, *,
                  model_state: Any = PartitionSpec()) -> PipelinedState:
    """PartitionSpecs of the state for `jax.shard_map`'s in_specs / out_specs.

    Each device's own parts (the pending residuals, a ZeRO-1 optimizer state, deferral residuals)
    `P(axis_name)`, the rest `P()`, as `prophet_jax.state_specs` says; the model state as `model_state`
    says (`P()` when it is the same on every device, `P(axis_name)` for per-device values).

    Args:
      state: optional. Without it, a prefix spec valid for any state of this step; with it, a spec
        for every leaf. (After `convert_state`, give the first call `prophet_jax.first_step_specs`.)
      model_state: the spec (or a prefix tree of specs) of the model state.
    """
    axis = self.axis_name
    if state is None:
      sp = self._update("pipelined.state_specs").specs(axis)
      return PipelinedState(params=PartitionSpec(), opt_state=sp.inner, pending=PartitionSpec(axis),
                            model_state=model_state, defer=sp.defer_state)
    check_state(state, "pipelined.state_specs")
    ms = jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), model_state,
                                state.model_state, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return _states.state_specs(state, axis)._replace(model_state=ms)

  def deferred_grads(self, state: PipelinedState) -> Any:
    """This device's deferred gradient values as a tree like the parameters (zero elsewhere): what
    the next step would add. Average them over the axis and apply them with `tx` to end a deferring
    plan (pure and local: call it where the state's leaves are per device).

    Raises:
      TypeError: `state` is not a PipelinedState.
      ScheduleMismatchError: `state.defer` belongs to another schedule.
    """
    where = "pipelined.deferred_grads"
    check_state(state, where)
    schedule = self.schedule if state.pending is None else state.pending.meta.schedule
    _check_defer(state.defer, schedule, where)   # its own, or convert_state's owed to the next backward
    return _defer.deferred_values(jax.tree_util.tree_map(jnp.zeros_like, state.params), state.defer, schedule, where)

  def residual_bytes(self, state: PipelinedState) -> int:
    """Bytes of carried residuals per device (0 when nothing is pending)."""
    check_state(state, "pipelined.residual_bytes")
    return 0 if state.pending is None else meta_nbytes(state.pending.meta)

  # -- the pieces ---------------------------------------------------------------------------------
  def _call(self, params: Any, inputs: Any) -> tuple[Any, tuple[Any, Any]]:
    """`loss_fn` on the forward's inputs (the batch, or (model_state, batch)), as (loss, (state, aux))."""
    out = self.loss_fn(params, *inputs) if self.has_state else self.loss_fn(params, inputs)   # (model_state, batch)
    loss, state, aux = _loss_reduction.split_output(out, self.has_aux, self.has_state, "pipelined")
    return loss, (state, aux)

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
    plan = carry_plan(trace.closed, len(jax.tree_util.tree_leaves(pv)),
                      "min-cut" if self.residuals == "min-cut" else "closure", n_head=trace.n_head)
    return Traced(signature, trace, plan)

  def _forward(self, params: Any, model_state: Any, batch: Any, batch_tree: Any,
               batch_avals: tuple, traced: Traced | None = None) -> tuple[jax.Array, Any, Any, Pending]:
    pv = _varying_params(params, self.axis_name)
    state_tree, state_avals = _avals(model_state, self.axis_name)
    # traced once, run from its jaxpr: the same trace says what to carry
    inputs = self._inputs(model_state, batch)
    _, trace, plan = self._trace(pv, inputs, traced)
    n_head = trace.n_head
    with jax.named_scope("pipelined_forward"):
      loss, *outs = forward(trace.closed, plan, n_head=n_head)(*jax.tree_util.tree_leaves((pv, inputs)))
    new_state, aux = jax.tree_util.tree_unflatten(trace.aux_tree, outs[:n_head - 1])
    residuals = outs[n_head - 1:]
    _check_loss(loss)
    if self.has_state:
      _check_new_state(model_state, new_state, self.axis_name)
    meta = PendingMeta(
        schedule=self.schedule, batch_tree=batch_tree, batch=batch_avals,
        residuals=tuple((tuple(np.shape(x)), x.dtype) for x in residuals),
        carry=plan, forward_size=_jaxpr_size(trace.closed, n_head),
        loss_varying=_varying(loss, self.axis_name), loss_dtype=jnp.result_type(loss),
        state_tree=state_tree, state=state_avals, has_state=self.has_state)
    return loss, new_state, aux, Pending(tuple(x[None] for x in residuals), meta)

  def _backward_and_update(self, state: PipelinedState, where: str) -> tuple[Any, Any, Any, Traced]:
    params, opt_state, pending, defer = state.params, state.opt_state, state.pending, state.defer
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
    pv = _varying_params(params, self.axis_name)
    # the forward traced on the recorded input shapes (nothing of it runs): its vjp_jaxpr and carry plan
    traced = self._trace(pv, self._inputs(_placeholders(meta.state_tree, meta.state, self.axis_name),
                                          _placeholders(meta.batch_tree, meta.batch, self.axis_name)))
    _, trace, plan = traced
    closed = trace.closed
    res_avals = tuple((tuple(a.shape), a.dtype) for a in carried_avals(closed, plan))
    if (res_avals != meta.residuals or plan != meta.carry
        or _jaxpr_size(closed, trace.n_head) != meta.forward_size):
      same = " (the same shapes, other values of the forward)" if res_avals == meta.residuals else ""
      raise ValueError(
          f"{where}: the state carries {len(meta.residuals)} residuals {_short(meta.residuals)}, but this "
          f"pipelined step's forward on the recorded batch shapes carries {len(res_avals)} "
          f"{_short(res_avals)}{same}. The state was made by a pipelined step with another loss_fn or "
          f"residuals= option: flush it with that step first, or start from init(params).")
    if len(pending.residuals) != len(meta.residuals):
      raise ValueError(f"{where}: the state's pending node holds {len(pending.residuals)} arrays but "
                       f"records {len(meta.residuals)}; it was edited. Start from init(params).")
    _check_defer(defer, schedule, where)
    with jax.named_scope("pipelined_backward"):
      leaves = recompute(closed, plan, len(jax.tree_util.tree_leaves(pv)), n_head=trace.n_head)(
          *jax.tree_util.tree_leaves(pv), *(r[0] for r in pending.residuals))
      vjp_fn = jax.tree_util.tree_unflatten(trace.treedef, leaves)
      (grads,) = vjp_fn(_full((), 1, meta.loss_dtype, meta.loss_varying, self.axis_name))
    # the per-device scheduled update: a ZeRO-1 step's all-gathers run inside the next forward
    updates, st = self._update(where).update(grads, ScheduledState(inner=opt_state, defer_state=defer), params)
    opt_state, defer = st.inner, st.defer_state
    params = optax.apply_updates(params, updates)
    # the next forward reads these inside this program: round low-precision leaves as memory would
    return jax.tree_util.tree_map(round_to_dtype, params), opt_state, defer, traced


# --------------------------------------------------------------------------------------------------
# the checks, beside their callers


def _check_defer(defer: Any, schedule: Schedule, where: str) -> None:
  """`state.defer` against the schedule it is used with: its own DeferState (or None), or convert_state's
  OwedState owed to it; the fix said for a pipelined state."""
  hint = ("A pipelined step makes its deferral state in init and threads it through step and flush; "
          "to change plans, flush with the old step and convert the state outside the step: "
          "state = prophet_jax.convert_state(state, params, new_schedule) (nothing deferred is lost).")
  try:
    _defer.given_state(defer, schedule, None, None, where)
  except (ScheduleMismatchError, TypeError) as e:
    raise type(e)(f"{e} {hint}") from None


def _varying(x: Any, axis_name: Any) -> bool:
  return vma_enabled(axis_name) and is_varying(x, axis_name)


def _varying_params(params: Any, axis_name: Any) -> Any:
  """Under shard_map with check_vma, the params marked varying before differentiating (docs/facts.md,
  "The 8x gradient trap")."""
  if not vma_enabled(axis_name):
    return params
  return jax.tree_util.tree_map(
      lambda x: x if not is_reduced_leaf(x) or is_varying(x, axis_name) else to_varying(x, axis_name), params)


def _full(shape: tuple, fill: int, dtype: Any, varying: bool, axis_name: Any) -> jax.Array:
  """A constant of a recorded type (also for extended dtypes: typed PRNG keys), varying where it was."""
  x = jax.lax.full(shape, fill, dtype)
  return to_varying(x, axis_name) if varying and vma_enabled(axis_name) else x


def _placeholders(tree: Any, avals: tuple, axis_name: Any) -> Any:
  """A tree of recorded (path, shape, dtype, varying) leaves (constants; only their types matter)."""
  return jax.tree_util.tree_unflatten(tree, [_full(shape, 0, dtype, vary, axis_name)
                                             for _, shape, dtype, vary in avals])


def _avals(tree: Any, axis_name: Any) -> tuple[Any, tuple]:
  """(treedef, ((path, shape, dtype, varying), ...)) of a batch or model state."""
  avals = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      x = jnp.asarray(x)
    avals.append((path_str(path), tuple(int(d) for d in x.shape), x.dtype, _varying(x, axis_name)))
  return jax.tree_util.tree_structure(tree), tuple(avals)


def _check_batch(meta: PendingMeta, batch_tree: Any, avals: tuple, axis_name: Any) -> None:
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
                       f"{axis_name!r} now but was {'' if vary0 else 'not '}before: keep the "
                       f"same in_specs for the batch between flushes.")


def _check_new_state(old: Any, new: Any, axis_name: Any) -> None:
  """The new model state must be a drop-in for the old: same structure, shapes, dtypes, and not
  varying over the axis where the old one was not."""
  fix = ("loss_fn(params, model_state, batch) must return a new model state of the same structure, "
         "shapes and dtypes as the one it was given (flax: `variables['batch_stats']` in, "
         "`updates['batch_stats']` out).")
  (old_tree, old_avals), (new_tree, new_avals) = _avals(old, axis_name), _avals(new, axis_name)
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
          f"varying over {axis_name!r} (computed from this device's batch). Average it in "
          f"loss_fn (jax.lax.pmean(..., {axis_name!r}), as synchronized BatchNorm statistics "
          f"are), or keep it per device: pass it with a leading device axis and "
          f"state_specs(model_state=P({axis_name!r})).")


def _check_loss(loss: Any) -> None:
  if np.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise TypeError(f"pipelined: loss_fn(params, batch) must return a floating scalar, got shape "
                    f"{np.shape(loss)} and dtype {jnp.result_type(loss)}. Return the mean loss over "
                    f"this device's batch.")


def _jaxpr_size(closed: Any, n_head: int) -> tuple[int, int]:
  return len(closed.jaxpr.eqns), len(closed.jaxpr.outvars) - n_head


def _short(avals: tuple) -> str:
  text = ", ".join(f"{d}{list(s)}" for s, d in avals[:4])
  return f"[{text}{', ...' if len(avals) > 4 else ''}]"


def pipelined(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
              schedule: Schedule, *, axis_name: Any, residuals: Any = "min-cut", has_aux: bool = False,
              has_state: bool = False, mesh: Any = None, reduction: str = "mean",
              enforce_order: bool = True) -> Pipelined:
  """The cross-step pipelined train step for `loss_fn`, `tx` and `schedule` over `axis_name`.

  Each `step` runs the previous batch's backward with the schedule's collectives, `tx`'s update and
  this batch's forward in one program, so each layer's next forward can start as soon as its chunks
  are reduced (the simulator's `cross_step=True`). Per call the loss (and aux) equal the plain step's
  on the same batch; after `flush` the parameters equal the plain loop's (docs/design.md, "The
  pipelined step").

  Args:
    loss_fn: the mean loss over this device's batch, as `jax.value_and_grad` takes it (`(loss, aux)`
      with `has_aux`; `loss_fn(params, model_state, batch) -> (loss, new_model_state)` with
      `has_state`).
    tx: an optax GradientTransformation, applied to the reduced gradients.
    schedule: a Schedule for the params (an all-reduce or `dear` plan; `plan(..., cross_step=True)`).
    axis_name: the data-parallel axis bound by the user's `jax.pmap` or `jax.shard_map`.
    residuals: what the forward keeps for the next call's backward: "min-cut" (the fewest bytes),
      "all", "matmuls", or a `jax.checkpoint` policy.
    has_aux: `loss_fn` returns an aux output; `step` returns `(state, (loss, aux))`.
    has_state: `loss_fn` takes and returns a model state (`init(params, model_state)`).
    mesh: run `init`, `step`, `flush` on global arrays inside a plain `jax.jit` over this mesh.
    reduction: "mean" (`loss_fn` averages over its examples) or "sum".
    enforce_order: True: the tie keeps the plan's order; False: XLA combiner keys.

  Returns:
    A `Pipelined` (`init`, `step`, `flush`, `params`, `model_state`, `state_specs`, `residual_bytes`,
    `deferred_grads`).

  Raises:
    TypeError, ValueError: bad arguments; an FSDP plan (naming `hooked`).

  Example:
    >>> p = prophet_jax.pipelined(model.loss_fn, optax.adamw(1e-3), schedule, axis_name="data")
    >>> step = jax.pmap(p.step, axis_name="data")
    >>> state = jax.pmap(p.init, axis_name="data")(replicated_params)
    >>> for batch in batches:
    ...   state, loss = step(state, batch)
    >>> state = jax.pmap(p.flush, axis_name="data")(state)
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
  return on_mesh(step, mesh, MeshPipelined)
