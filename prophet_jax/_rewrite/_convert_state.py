"""`convert_state`: the one way to change plans, outside the step, on the containers users hold (the
conversion walk is `_convert.Conversion`). A re-plan's deferred values travel as an `OwedState` the new
plan's first step adds to its gradients (docs/design.md, "The rewrite's layers")."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import _mesh, _nnx
from ._convert import Conversion, steady_state
from ._states import ScheduledState, holds_state, state_specs
from .._compiled._devices import data_devices
from .._values._checks import check_values
from .._values._schedule import Schedule

def _count(value: Any, name: str, what: str, where: str) -> int | None:
  """`value` (None, or an int >= 1) as an int, else a ValueError saying what it counts."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
    raise ValueError(f"{where}: {name}={value!r}: {what}, an int >= 1.")
  return None if value is None else int(value)


def convert_state(state: Any, params: Any, new_schedule: Schedule, *, tx: Any = None, mesh: Any = None,
                  axis_name: Any = None, num_devices: int | None = None, every_k: int | None = None) -> Any:
  """Any state of the library, in the container it is held in, taken to `new_schedule`'s layout, outside
  the step: the one way to change plans; nothing is lost, bit for bit.

  A deferring plan's residual travels as an `OwedState` the new plan's first step adds to its gradients
  (under shard_map give that step `first_step_specs`); a ZeRO-1 state is gathered and cut again for
  `num_devices`; accumulation sums are kept (`every_k=` changes them); a `PipelinedState` must be flushed
  first; a plain optax state (with `tx=`) becomes the state `scheduled(tx, new_schedule)` takes. The
  layout (pmap's, global, per device) is kept; with `mesh=` the result is placed on the mesh.

  Args:
    state: the state as the step leaves it: a ScheduledState, an optax chain's tuple, a flax TrainState,
      a dict, a PipelinedState, a bare DeferState, an nnx.Optimizer (an nnx.State comes out, for
      `nnx.update`) or its opt_state.
    params: the params' tree (arrays or ShapeDtypeStructs) the schedules were planned for.
    new_schedule: the schedule to go to.
    tx: the optimizer, where a ZeRO-1 state is gathered or cut (or a plain optax state is given).
    mesh: a mesh to count the devices of (with `axis_name`) and to place the result on.
    axis_name: the data axis of `mesh`.
    num_devices: the devices on the data axis, where a whole state is cut into shards.
    every_k: the new `scheduled(..., every_k=)` where it differs: 1 drops the accumulator (it must be
      empty: convert at the k-th micro-step), k > 1 adds an empty one.

  Returns:
    The converted state, in the same kind of container.

  Raises:
    TypeError: no library state (and no `tx`), or `new_schedule` is not a Schedule.
    ValueError: a pipelined forward pending; a ZeRO-1 state without `tx`; micro-steps not yet reduced.
    ScheduleMismatchError: a state's schedule is of another tree than `params`.

  Example:
    >>> opt_state = prophet_jax.convert_state(opt_state, params, new_plan, tx=tx, mesh=mesh, axis_name="dp")
  """
  where = "convert_state"
  check_values(where, schedule=new_schedule)
  n = _count(num_devices, "num_devices", "the number of devices on the data axis", where)
  n = data_devices(mesh, axis_name, where) if n is None else n
  again = functools.partial(convert_state, params=params, new_schedule=new_schedule, tx=tx, mesh=mesh,
                            axis_name=axis_name, num_devices=num_devices, every_k=every_k)
  if _nnx.is_optimizer(state):   # an nnx.State of the optimizer comes out, for nnx.update
    return _nnx.on_optimizer(state, again, whole=True)
  if _nnx.holds_variables(state):   # an nnx.Optimizer's opt_state: its arrays in Variables
    return _nnx.to_nnx(again(_nnx.values(state)))
  if _nnx.is_nnx_state(state) and not holds_state(state):
    raise TypeError(
        f"{where}: nnx.state(optimizer) re-labels the library's states as nested dicts, so their "
        f"schedules cannot be read: pass the nnx.Optimizer itself (an nnx.State comes out: "
        f"nnx.update(optimizer, new)) or its .opt_state.")
  if state is not None and not holds_state(state):
    if tx is None:
      raise TypeError(
          f"{where}: no state of this library in the given {type(state).__name__}: pass the optimizer "
          f"state of scheduled(tx, schedule), a TrainState or dict holding it, a PipelinedState, or the "
          f"DeferState of hooked/allreduce; a plain optax state (hooked with a plain tx) converts with "
          f"tx= (to a 'dear' plan it is cut into the ZeRO-1 shards scheduled(tx, schedule) takes).")
    # a plain tx's state (the jit path's): what scheduled(tx, new_schedule) takes
    state = ScheduledState(inner=state)
  _count(every_k, "every_k", "the new transformation's every_k", where)
  out = Conversion(params, new_schedule, tx=tx, n=n, owed_in_place=True, where=where,
                   every_k=every_k, on_mesh=data_devices(mesh, axis_name, where) is not None)(state)
  return _mesh.put_on(out, mesh, lambda: state_specs(out, axis_name))


def first_step_specs(state: Any, axis_name: Any) -> tuple[Any, Any]:
  """(in_specs, out_specs) of the state for the new plan's first step under shard_map: `state_specs` of
  the converted state (with its OwedState) and of the steady state the step returns. Later steps use
  the second for both."""
  return state_specs(state, axis_name), state_specs(steady_state(state), axis_name)
