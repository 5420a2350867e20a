"""What XLA does with a step's gradient all-reduces when left alone (pure numpy)."""

from __future__ import annotations

from .._values._network import NetworkModel
from .._values._types import GradientProfile
from ._base import Scheduler
from ._bucket import fill_buckets
from ._common import Groups, grouped_scheduler, whole_slice

POLICY = "xla"
GPU_COMBINE_THRESHOLD_BYTES = 30 * 2**20  # xla_gpu_all_reduce_combine_threshold_bytes' default


def xla() -> Scheduler:
  """XLA's own all-reduce combining, following `network.overlap`.

  One all-reduce per dtype without overlap (CPU), whole leaves up to 30 MiB with overlap (GPU)
  (docs/design.md, "The policies", "xla"). Returns a Scheduler, the same plan for both step modes.

  References:
    OpenXLA `AllReduceCombiner` / `CpuAllReduceCombiner`, `xla_gpu_all_reduce_combine_threshold_bytes`.
  """

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    order = profile.ready_order()
    if network.overlap:
      return fill_buckets(profile, order, GPU_COMBINE_THRESHOLD_BYTES)
    return [[s for r in order if (s := whole_slice(profile, r)) is not None]]

  return grouped_scheduler(POLICY, {}, plan_groups)
