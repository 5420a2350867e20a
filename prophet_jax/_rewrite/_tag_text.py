"""What the library's state types say about themselves where jax, not the library, rejects them.

A compiled step (or a plain optax `tx`) given a state of another schedule fails inside jax before any
library code runs: jax's pytree message prints the node's type and its metadata. So the metadata of the
schedule tag (`_states.StateTag`) is a tuple whose repr says what the state is and how to convert
it, and the class of `hooked`'s gradient shards says which transformation takes them. The values and
their equality are plain tuples': treedef comparisons (jit's cache) are unchanged.
"""

from __future__ import annotations

from typing import Any

_CONVERT = ("convert it with prophet_jax.unshard_state(state, tx, params, old_schedule) and "
            "shard_state(..., new_schedule, n) (or start the new plan's state from its init)")


class StateAux(tuple):
  """StateTag's pytree metadata: (key, fingerprint, layout, schedule ref). The layout is a shard
  state's (`ShardLayout`: n, sizes, mode) or a deferral state's (one entry per group)."""

  __slots__ = ()

  def __repr__(self) -> str:
    return "<{}; {}>".format(*describe(*self[:3]))


def describe(key: str, fingerprint: str, layout: Any) -> tuple[str, str]:
  """(what a state of this tag is, what a step of another schedule does with it), for messages."""
  if hasattr(layout, "sizes"):  # a ShardLayout: an optimizer state (mode set) or gradient shards
    what = (f"the optimizer state of a sharded (dear, ZeRO-1) plan, {layout.mode}" if layout.mode else
            "the gradient shards of a sharded (dear) plan")
    return (f"{what}: schedule {key}, tree {fingerprint}, cut for {layout.n} devices into {len(layout.sizes)} "
            f"chunk shards", f"a step compiled for another schedule or device count cannot take it: {_CONVERT}")
  if tuple(layout[:1]) == ("owed",):
    return (f"deferred values owed to the first step of schedule {key} (tree {fingerprint}), made by "
            f"prophet_jax.convert_state", "that schedule's step takes them (its first call adds them to its gradients)")
  return (f"the deferral state of a deferring (dlcp) plan: schedule {key}, tree {fingerprint}, {len(layout)} "
          f"deferral groups (prophet_jax.convert_state takes it to another plan)", "a step compiled for another "
          "schedule cannot take it: apply its residual with prophet_jax.deferred_grads(state, params) and start "
          "the new plan's state from its init")


class HintedClass(type):
  """A metaclass whose class repr carries a hint (`__hint__`): jax names the class in its messages."""

  def __repr__(cls) -> str:
    hint = cls.__dict__.get("__hint__")
    return f"<class 'prophet_jax.{cls.__name__}': {hint}>" if hint else super().__repr__()
