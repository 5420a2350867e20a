"""What a pipelined step carries from one call to the next: the pending forward (`Pending`: its VJP
residuals as plain arrays, and `PendingMeta`, what the next call's backward needs to rebuild its
structure) and the step's whole state (`PipelinedState`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._residuals import VjpTrace
from ._states import DeferState, declare, expect, is_state
from .._values._schedule import Schedule

# --------------------------------------------------------------------------------------------------
# state

class Traced(NamedTuple):
  """The forward traced once inside a step's program: its inputs' types, `vjp_jaxpr` and carry plan."""

  signature: tuple
  trace: VjpTrace
  plan: tuple



@dataclasses.dataclass(frozen=True, eq=True)
class PendingMeta:
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

  def __hash__(self) -> int:  # the schedule can be large: hash once (equality is the dataclass's, field by field)
    h = self.__dict__.get("_hash")
    if h is None:
      h = hash((self.schedule.tree_fingerprint, len(self.schedule.chunks), self.batch_tree, self.batch,
                self.residuals, self.carry, self.forward_size, self.loss_varying, self.loss_dtype,
                self.state_tree, self.state, self.has_state))
      object.__setattr__(self, "_hash", h)
    return h


@jax.tree_util.register_pytree_node_class
class Pending:
  """The residuals of a forward pass whose backward has not run yet.

  Attributes:
    residuals: the `jax.vjp` closure's arrays, in flatten order, each with a leading axis of size 1
      (so that under `shard_map` every residual, scalars included, has an axis to split over devices:
      `P(axis_name)`; under `pmap` the device axis comes in front of it).
    meta: static shapes, dtypes and the schedule (see `PendingMeta`); part of the pytree structure.
  """

  __slots__ = ("residuals", "meta")

  def __init__(self, residuals: tuple[Any, ...], meta: PendingMeta):
    self.residuals, self.meta = tuple(residuals), meta

  def tree_flatten(self):
    return self.residuals, self.meta

  @classmethod
  def tree_unflatten(cls, meta, residuals):
    return cls(tuple(residuals), meta)

  def __repr__(self) -> str:
    return f"Pending({len(self.residuals)} residuals, {meta_nbytes(self.meta)} bytes per device)"


@declare(per_device=("pending",), label="the pending forward's residual {}", convert="pipelined",
         container=True)
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


def meta_nbytes(meta: PendingMeta) -> int:
  """Bytes of the carried residuals (a dtype's name read as numpy's; extended dtypes as they are)."""
  return int(sum(int(np.prod(s, dtype=np.int64)) * (d if jax.dtypes.issubdtype(d, jax.dtypes.extended)
                                                    else jnp.dtype(d)).itemsize for s, d in meta.residuals))


def round_to_dtype(x: Any) -> Any:
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


def check_state(state: Any, where: str) -> None:
  """TypeError unless `state` is a PipelinedState (its pending node a Pending, its defer a state)."""
  expect(state, PipelinedState, f"{where}: expected the PipelinedState returned by init/step/flush, got "
                                f"{type(state).__name__}. Start with state = pipelined(...).init(params).")
  if state.pending is not None and not isinstance(state.pending, Pending):
    raise TypeError(f"{where}: state.pending must be None or a Pending node, got "
                    f"{type(state.pending).__name__}.")
  if state.defer is not None and not is_state(state.defer):
    raise TypeError(f"{where}: state.defer must be None or a prophet_jax.DeferState (or convert_state's "
                    f"OwedState), got {type(state.defer).__name__}. Start with state = pipelined(...).init(params).")
