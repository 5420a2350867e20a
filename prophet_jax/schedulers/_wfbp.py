"""WFBP: one all-reduce per layer, in ready order (pure numpy)."""

from __future__ import annotations

from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler
from ._common import Groups, grouped_scheduler, layer_groups, whole_slice

POLICY = "wfbp"


def wfbp() -> Scheduler:
  """Wait-free backpropagation: one all-reduce per layer, issued as soon as the layer is ready.

  Returns:
    A Scheduler; the plan is the same for both step modes.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel
    >>> p = GradientProfile.from_rows([
    ...     dict(path="a/w", layer="a", shape=(4,), dtype="float32", nbytes=16, ready_s=0.2),
    ...     dict(path="b/w", layer="b", shape=(4,), dtype="float32", nbytes=16, ready_s=0.1)],
    ...     forward_s=0.1, backward_s=0.2)
    >>> s = wfbp()(p, NetworkModel.preset("10gbe", workers=4), cross_step=False)
    >>> [c.slices for c in s.chunks]
    [((1, 0, 4),), ((0, 0, 4),)]

  References:
    H. Zhang et al., "Poseidon: An Efficient Communication Architecture for Distributed Deep Learning on
    GPU Clusters", USENIX ATC 2017.
  """

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    return [[s for r in rows if (s := whole_slice(profile, r)) is not None] for _, rows, _ in layer_groups(profile)]

  return grouped_scheduler(POLICY, {}, plan_groups)
