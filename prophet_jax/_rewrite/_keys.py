"""Who orders the plan's collectives: the tie (`enforce_order=True`, `_collectives.tie`) or XLA:GPU, told
the units by `combiner_key`s (`enforce_order=False`): one context variable read while a step is traced
(`ordered_by`); the engine asks `enforced()` and `unit_scope(name)` and nothing else."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._values._checks import check_bool

# a unit's combiner key is its named scope ('prophet/chunk3', 'prophet/rs3', 'prophet/ag1'): where a
# jaxlib prints frontend attributes (0.12) the key names the unit; where it does not (0.10) the audit
# matches units by size and provenance (`_compiled._keyed_audit`)

_ENFORCE: contextvars.ContextVar[bool] = contextvars.ContextVar("prophet_enforce_order", default=True)


def check_enforce_order(where: str, value: Any) -> bool:
  """`value` as a bool, or TypeError naming the front-end (a string such as 'false' is not a bool)."""
  return check_bool(where, "enforce_order", value, fix="True: the tie keeps the plan's order; False: each unit "
                    "carries an XLA combiner key and XLA orders them.")


def enforced() -> bool:
  """Whether the step being traced ties its units (True, the default) or keys them (False)."""
  return _ENFORCE.get()


def ordered_by(enforce_order: bool, fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` traced with one combiner key per unit (False); `fn` itself when `enforce_order` is True (the
  default, the tie, adds nothing to a front-end's function)."""
  if enforce_order:
    return fn

  @functools.wraps(fn)
  def keyed(*args: Any, **kwargs: Any) -> Any:
    tok = _ENFORCE.set(False)
    try:
      return fn(*args, **kwargs)
    finally:
      _ENFORCE.reset(tok)

  return keyed


@contextlib.contextmanager
def unit_scope(name: str) -> Iterator[None]:
  """The named scope of one unit (`jax.named_scope(name)`, what the audit reads where op names
  survive) and, when the order is XLA's, the unit's combiner key: the same name."""
  with jax.named_scope(name), combiner_key(None if _ENFORCE.get() else name):
    yield


def combiner_key(key: str | None) -> Any:
  """The context that gives the ops traced inside it XLA's `combiner_key` (nothing for None)."""
  if key is None:
    return contextlib.nullcontext()
  # imported here: jax.experimental modules load on first use only when a step asks for keys
  from jax.experimental.xla_metadata import set_xla_metadata
  return set_xla_metadata(combiner_key=key)
