"""The pipelined step's checks and placeholders (`Pipelined` inherits them): the state, the deferral
state, the params and the batch against what the pending forward recorded; the loss; the new model
state; the shapes of the residuals' placeholders. Written apart from the step so each reads alone."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _defer
from ._axis import is_varying, to_varying, vma_enabled
from ._defer import DeferState
from ._pending import Pending, PipelinedState, PendingMeta
from ._reduction import check_foreign
from ._states import OwedState
from .._values._checks import match_tree
from .._values._errors import ScheduleMismatchError
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf, path_str

__all__ = ["PipelinedChecks"]


class PipelinedChecks:
  """The checks `Pipelined` runs on what it is given (a mixin: it reads the step's fields)."""

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

  def _ones_ct(self, meta: PendingMeta) -> jax.Array:
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
    if state.defer is not None and not isinstance(state.defer, (DeferState, OwedState)):
      raise TypeError(f"{where}: state.defer must be None or a prophet_jax.DeferState (or convert_state's "
                      f"OwedState), got "
                      f"{type(state.defer).__name__}. Start with state = pipelined(...).init(params).")

  def _check_defer(self, defer: Any, schedule: Schedule, where: str) -> None:
    """`_defer.check_state` for `state.defer` against the schedule it is used with, the fix said for
    a pipelined state."""
    hint = ("A pipelined step makes its deferral state in init and threads it through step and flush; "
            "to change plans, flush with the old step and convert the state outside the step: "
            "state = prophet_jax.convert_state(state, params, new_schedule) (nothing deferred is lost).")
    check_foreign(defer, schedule, where)
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

  def _check_batch(self, meta: PendingMeta, batch_tree: Any, avals: tuple) -> None:
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


def jaxpr_size(closed: Any, n_head: int) -> tuple[int, int]:
  return len(closed.jaxpr.eqns), len(closed.jaxpr.outvars) - n_head


def short_avals(avals: tuple) -> str:
  text = ", ".join(f"{d}{list(s)}" for s, d in avals[:4])
  return f"[{text}{', ...' if len(avals) > 4 else ''}]"
