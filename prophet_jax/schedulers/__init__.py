"""Scheduling policies: pure factories returning Scheduler callables.

Each factory takes keyword-only, validated options and returns
`scheduler(profile, network, *, cross_step) -> Schedule`. `prophet_jax.plan` accepts a policy name
(see `prophet_jax.POLICIES`) or any such callable.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._types import GradientProfile, NetworkModel, Schedule
from ._bucket import bucket
from ._mgwfbp import mgwfbp
from ._priority import priority
from ._prophet import prophet
from ._wfbp import wfbp
from ._xla import xla


@runtime_checkable
class Scheduler(Protocol):
  """A planning policy: a pure function of the profile and the network model.

  It must return a Schedule for `profile` (its rows, every element of every non-empty row in exactly
  one chunk) and record `cross_step`, the step mode it planned for.
  """

  def __call__(self, profile: GradientProfile, network: NetworkModel, *,
               cross_step: bool) -> Schedule: ...


def __getattr__(name: str) -> Any:
  if name == "auto":  # written separately; imported on first use
    from ._auto import auto

    globals()["auto"] = auto
    return auto
  raise AttributeError(f"module 'prophet_jax.schedulers' has no attribute {name!r}")


__all__ = ["Scheduler", "auto", "bucket", "mgwfbp", "priority", "prophet", "wfbp", "xla"]
