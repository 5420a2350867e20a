"""`reduction=`: how a front-end combines the devices' gradients and losses (`hooked`, `pipelined`).

A data-parallel step over a global batch split across n devices gives each device a part. For a loss
that is a mean over its examples (`reduction="mean"`, the default), the plain step's gradient is the
mean of the devices' gradients and its loss the mean of their losses; for a loss summed over its
examples (`reduction="sum"`), both are sums. The library cannot tell the two apart from the loss's
value, so the choice is stated. It sets the divisor of every gradient collective (n or 1) and how
`mesh=` combines the per-device losses (`pmean` or `psum`).
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["REDUCTIONS", "check", "divisor", "is_mean", "combine"]

REDUCTIONS = ("mean", "sum")


def check(reduction: Any, where: str) -> str:
  """`reduction` if it is 'mean' or 'sum', else a ValueError naming it."""
  if not (isinstance(reduction, str) and reduction in REDUCTIONS):
    raise ValueError(f"{where}(reduction={reduction!r}): expected 'mean' (loss_fn averages over its "
                     f"examples, the default) or 'sum' (loss_fn sums over them).")
  return reduction


def is_mean(reduction: str) -> bool:
  return reduction == "mean"


def divisor(reduction: str, n: int) -> int:
  """The gradient collectives' divisor: n for a mean loss, 1 for a summed one."""
  return n if is_mean(reduction) else 1


def combine(x: Any, axes: Any, reduction: str) -> Any:
  """The devices' losses (or deferred values) combined as the plain step over the global batch would."""
  return jax.lax.pmean(x, axes) if is_mean(reduction) else jax.lax.psum(x, axes)
