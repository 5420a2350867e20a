"""What XLA does with a step's gradient all-reduces when left alone.

Pure: numpy only, never jax.
"""

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

  - `network.overlap` False (XLA on the CPU, where a collective blocks the executor): the CPU
    all-reduce combiner merges every independent all-reduce into one, with no byte limit, after the
    backward pass. Here: one bucket holding one chunk per dtype, rows in ready order.
  - `network.overlap` True (GPUs): the GPU all-reduce combiner merges all-reduces up to its threshold,
    30 MiB by default; modelled as buckets of whole leaves of at most 30 MiB in ready order.

  Returns:
    A Scheduler: `scheduler(profile, network, *, cross_step) -> Schedule`. The plan is the same for
    both step modes (`cross_step` is only recorded).

  References:
    OpenXLA, `AllReduceCombiner` / `CpuAllReduceCombiner` passes and the GPU flag
    `xla_gpu_all_reduce_combine_threshold_bytes` (openxla/xla, 2023-2025); docs/facts.md, "XLA on the CPU merges and reorders all-reduces".
  """

  def plan_groups(profile: GradientProfile, network: NetworkModel, cross_step: bool) -> Groups:
    order = profile.ready_order()
    if network.overlap:
      groups = fill_buckets(profile, order, GPU_COMBINE_THRESHOLD_BYTES)
    else:
      groups = [[s for r in order if (s := whole_slice(profile, r)) is not None]]
    return groups

  return grouped_scheduler(POLICY, {}, plan_groups)
