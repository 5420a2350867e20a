"""Scheduling policies: pure factories returning `scheduler(profile, network, *, cross_step) ->
Schedule`, and their registry (`POLICIES`).
"""

from ._auto import auto as auto
from ._base import Scheduler as Scheduler
from ._bucket import bucket as bucket
from ._dear import dear as dear
from ._dlcp import dlcp as dlcp
from ._fsdp import fsdp as fsdp
from ._mgwfbp import mgwfbp as mgwfbp
from ._priority import priority as priority
from ._prophet import prophet as prophet
from ._registry import POLICIES as POLICIES
from ._wfbp import wfbp as wfbp
from ._xla import xla as xla

__all__ = ["POLICIES", "Scheduler", "auto", "bucket", "dear", "dlcp", "fsdp", "mgwfbp", "priority", "prophet", "wfbp", "xla"]
