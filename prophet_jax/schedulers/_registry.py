"""The policy registry: every policy's name and factory, as `plan` and the CLI see them (pure)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._auto import auto
from ._base import Scheduler
from ._bucket import bucket
from ._dear import dear
from ._dlcp import dlcp
from ._fsdp import fsdp
from ._mgwfbp import mgwfbp
from ._priority import priority
from ._prophet import prophet
from ._wfbp import wfbp
from ._xla import xla


class _Policies(Mapping[str, Callable[..., Scheduler]]):
  """Every policy name and its factory, read-only, in a fixed order."""

  def __init__(self, table: Mapping[str, Callable[..., Scheduler]]):
    self._table = dict(table)

  def __getitem__(self, name: str) -> Callable[..., Scheduler]:
    return self._table[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._table)

  def __len__(self) -> int:
    return len(self._table)

  def __repr__(self) -> str:
    return f"POLICIES({list(self._table)})"


POLICIES: Mapping[str, Callable[..., Scheduler]] = _Policies({
    "wfbp": wfbp, "bucket": bucket, "xla": xla, "mgwfbp": mgwfbp, "priority": priority,
    "prophet": prophet, "auto": auto, "dlcp": dlcp, "dear": dear, "fsdp": fsdp})


def resolve(policy: Any, options: Mapping[str, Any], cross_step: Any) -> tuple[str, Scheduler]:
  """(policy name, scheduler) from a name and its options, or from a Scheduler callable; ValueError for an
  unknown name or cross_step='auto' with another policy, TypeError for an unknown option.
  """
  if isinstance(policy, str):
    if policy not in POLICIES:
      raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)} or a Scheduler "
                       f"callable.")
    if cross_step == "auto" and policy != "auto":
      raise ValueError(f"plan(policy={policy!r}, cross_step='auto'): only the 'auto' policy chooses the "
                       f"step mode; pass cross_step=True or False, or use policy='auto'.")
    valid = [p.name for p in inspect.signature(POLICIES[policy]).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(valid))
    if unknown:
      raise TypeError(f"plan(policy={policy!r}): unknown option(s) {unknown}; {policy!r} accepts "
                      f"{list(valid) or 'no options'}.")
    return policy, POLICIES[policy](**options)
  if callable(policy):
    if options:
      raise TypeError(f"plan(): options {sorted(options)} are for named policies; configure the "
                      f"Scheduler callable itself (e.g. prophet_jax.schedulers.bucket(bucket_bytes=...)).")
    name = getattr(policy, "__name__", None) or type(policy).__name__
    try:
      sig = inspect.signature(policy)
    except (TypeError, ValueError):   # a builtin or C callable without a signature: tried as is
      return name, policy
    try:
      sig.bind(None, None, cross_step=cross_step)
    except TypeError as e:
      raise TypeError(f"plan(policy={name}): a Scheduler is called as scheduler(profile, network, *, "
                      f"cross_step=...) -> Schedule, but {name}{sig} cannot be ({e}). Define it as "
                      f"def {name}(profile, network, *, cross_step=False): ... (see "
                      f"prophet_jax.schedulers.Scheduler).") from None
    return name, policy
  raise TypeError(f"plan(policy={policy!r}): a policy is a name ({sorted(POLICIES)}) or a Scheduler "
                  f"callable.")
