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


def split_output(out: Any, has_aux: bool, has_state: bool, where: str) -> tuple[Any, Any, Any]:
  """(loss, new model state, aux) of `loss_fn`'s output, as `has_aux` and `has_state` say it is formed
  (`(loss, (state, aux))` with both), with a TypeError naming the fix when it is formed otherwise."""
  what = ("(loss, (new_model_state, aux))" if has_aux and has_state else "(loss, new_model_state)" if has_state
          else "(loss, aux)" if has_aux else "the scalar loss")
  if not (has_aux or has_state):
    if isinstance(out, (tuple, list)):
      raise TypeError(f"{where}: loss_fn returned a {type(out).__name__} of {len(out)} values; without "
                      f"has_aux=True it must return the scalar loss. If it returns (loss, aux), pass "
                      f"has_aux=True (has_state=True if aux is a model state the next forward reads, such as "
                      f"BatchNorm statistics, taken as loss_fn(params, model_state, batch)).")
    return out, None, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2) or (
      has_aux and has_state and not (isinstance(out[1], (tuple, list)) and len(out[1]) == 2)):
    raise TypeError(f"{where}: with has_aux={has_aux} and has_state={has_state}, loss_fn must return {what}; "
                    f"got {type(out).__name__}.")
  loss, rest = out
  return (loss, *rest) if has_aux and has_state else (loss, rest, None) if has_state else (loss, None, rest)
