"""Gradient accumulation in `scheduled(..., every_k=k)`: the accumulator a step carries (`AccumState`:
the replicated micro-step count and each device's sums, float32 for rows narrower than 32 bits) and its
check against a schedule. The step is the engine's (`_reduction.accumulated_allreduce`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ._states import AccumState, expect
from .._values._errors import ScheduleMismatchError
from .._values._schedule import Schedule
from .._values._types import itemsize

def accum_dtype(dtype: Any) -> str:
  """The dtype a row's gradients are summed in: float32 for floats narrower than 32 bits, else the row's."""
  name = str(jnp.dtype(dtype))
  return "float32" if itemsize(name) < 4 else name


def init(schedule: Schedule) -> AccumState:
  """The accumulator before the first micro-step: count 0, zero sums (one per schedule row, each with a
  leading axis of 1; under shard_map make it inside the map, or stack one per device on that axis)."""
  return AccumState(count=jnp.zeros((), jnp.int32),
                    grads=tuple(jnp.zeros((1, *shape), accum_dtype(dtype)) for _, shape, dtype in schedule.rows))


def check_state(state: Any, schedule: Schedule, where: str) -> None:
  """TypeError unless `state` is an AccumState; ScheduleMismatchError unless it has one sum per row of
  `schedule`, each `(1, *row shape)` in the accumulation dtype (per device)."""
  expect(state, AccumState, f"{where}: with every_k > 1 the optimizer state holds the gradient accumulator, "
                            f"an AccumState (made by this transformation's init), got {type(state).__name__}: a "
                            f"state made with every_k=1 converts with prophet_jax.convert_state(state, params, "
                            f"schedule, every_k=k).")
  rows = schedule.rows
  if len(state.grads) != len(rows):
    raise ScheduleMismatchError(
        f"{where}: the gradient accumulator holds {len(state.grads)} sums, but the schedule has {len(rows)} "
        f"rows: it was made by the init of another schedule's transformation. Make the state with this "
        f"transformation's init.")
  for (path, shape, dtype), g in zip(rows, state.grads):
    want = ((1, *shape), accum_dtype(dtype))
    got = (tuple(np.shape(g)), str(jnp.dtype(getattr(g, "dtype", np.float64))))
    if got != want:
      raise ScheduleMismatchError(
          f"{where}: the gradient accumulator's sum for {path!r} has shape {got[0]} and dtype {got[1]} "
          f"per device, expected {want[0]} {want[1]} (the row {path!r} of shape {tuple(shape)}, {dtype}, "
          f"on a leading axis of 1). Under shard_map pass the optimizer state with "
          f"prophet_jax.state_specs(state, axis_name) (the sums P(axis_name), the rest P()) and make it "
          f"inside the map; under pmap replicate it over the devices.")
