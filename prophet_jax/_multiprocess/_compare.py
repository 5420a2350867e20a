"""What `choose` compares: a candidate's loss and parameters against the control's (docs/choose.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._values._tree import path_str

_ABS = 1e-6   # the absolute bound of a leaf whose update is zero (relative to max(1, max|before|))


def host(x: Any) -> np.ndarray:
  """The global value of an array on the host (gathered from every process where it spans them)."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    from jax.experimental import multihost_utils  # multi-process only

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def loss_of(out: Any, is_state: bool) -> Any:
  """The loss a step returned: the array `aux` of `(state, aux, ...)`, or its `"loss"`; else None."""
  if is_state or not isinstance(out, tuple) or len(out) < 2:
    return None
  aux = out[1]
  if isinstance(aux, Mapping):
    aux = aux.get("loss")
  return aux if isinstance(aux, (jax.Array, np.ndarray, float)) and np.size(aux) > 0 else None


def params_of(state: Any) -> Any:
  """The parameters in a known container (a TrainState, a dict's "params", an nnx model), or None."""
  if isinstance(state, Mapping):
    return state.get("params")
  params = getattr(state, "params", None)   # flax TrainState (and subclasses), PipelinedState
  if params is not None:
    return params
  if type(state).__module__.startswith("flax.nnx"):
    from flax import nnx  # only for an nnx container

    model = getattr(state, "model", None) if not isinstance(state, nnx.Module) else state
    if isinstance(model, nnx.Module):
      return nnx.state(model, nnx.Param)
  return None


@dataclass(frozen=True, slots=True)
class Snapshot:
  """What one call of a step computed, on the host: its loss and its (path, array) values, or None."""

  loss: np.ndarray | None
  values: tuple[tuple[str, np.ndarray], ...] | None


def snapshot(state: Any, loss: Any, compare: Callable[[Any], Any] | None) -> Snapshot:
  """The host copy of a call's loss and of `compare(state)` (default: `params_of(state)`)."""
  tree = compare(state) if compare is not None else params_of(state)
  values = None
  if tree is not None:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    values = tuple((path_str(p), host(x)) for p, x in flat
                   if jnp.issubdtype(x.dtype if hasattr(x, "dtype") else np.result_type(x), jnp.inexact))
  return Snapshot(loss=None if loss is None else host(loss), values=values)


def _worst(got: np.ndarray, ref: np.ndarray, before: np.ndarray) -> float:
  """max|got - ref| over the tolerance of one leaf (> 1 fails)."""
  g, r, b = (np.asarray(v, np.float64) for v in (got, ref, before))
  if g.size == 0:
    return 0.0
  rel = 1e-2 if str(np.asarray(ref).dtype) in ("bfloat16", "float16") else 1e-3
  floor = _ABS * max(1.0, float(np.max(np.abs(b))))
  scale = float(np.max(np.abs(r - b)))
  allowed = rel * scale if scale > floor else floor
  err = float(np.max(np.abs(g - r)))
  return err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)


def difference(got: Snapshot, ref: Snapshot, first: Snapshot, before: Snapshot) -> tuple[float, str] | None:
  """The worst (ratio to the tolerance, where) of the loss and the values, or None; ValueError for another
  tree than the control's. `first` is the control's first call, `before` its starting values."""
  parts: list[tuple[float, str]] = []
  if got.loss is not None and ref.loss is not None and first.loss is not None:
    if got.loss.shape != ref.loss.shape:
      raise ValueError(f"it returns a loss of shape {got.loss.shape}, the control one of {ref.loss.shape}")
    parts.append((_worst(got.loss, ref.loss, first.loss), "the loss"))
  if got.values is not None and ref.values is not None and before.values is not None:
    paths, want = [p for p, _ in got.values], [p for p, _ in ref.values]
    if paths != want:
      odd = next((p for p in paths if p not in want), None) or next(p for p in want if p not in paths)
      raise ValueError(f"its parameters are another tree than the control's (leaf {odd!r} is in one only)")
    for (p, g), (_, r), (_, b) in zip(got.values, ref.values, before.values):
      if g.shape != r.shape:
        raise ValueError(f"its leaf {p!r} has shape {g.shape}, the control's {r.shape}")
      parts.append((_worst(g, r, b), f"leaf {p!r}"))
  return max(parts, key=lambda x: x[0]) if parts else None
