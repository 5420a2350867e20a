"""The Scheduler protocol: what every policy factory returns (pure)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .._values._network import NetworkModel
from .._values._schedule import Schedule
from .._values._types import GradientProfile

Slice = tuple[int, int, int]  # (profile row, start element, stop element)


@runtime_checkable
class Scheduler(Protocol):
  """A planning policy: a pure function of the profile and the network returning a Schedule for the
  profile's rows, recording `cross_step`.
  """

  def __call__(self, profile: GradientProfile, network: NetworkModel, *,
               cross_step: bool) -> Schedule: ...
