"""Who orders the plan's collectives: the tie (`enforce_order=True`) or XLA, told the units by keys.

Every collective the engine issues (`_collectives.reduce_units`, `reduce_scatter_chunks`,
`all_gather_chunks`) is one *unit* of the plan: a chunk's all-reduce, a deferral slot's, a sharded
chunk's reduce-scatter, a gather's all-gather. Two mechanisms keep units apart in the compiled program:

- the tie (`_collectives.tie`, the default): each unit's buffer depends on the previous unit's result
  through an exact zero, so XLA can neither combine two units nor reorder them;
- a combiner key (`enforce_order=False`): each unit's ops are traced under
  `jax.experimental.xla_metadata.set_xla_metadata(combiner_key=<the unit's scope name>)` and carry no
  tie. XLA:GPU's combiners only join collectives of one key, so every unit stays exactly one collective
  (docs/facts.md, "Buckets in XLA's own terms": six psums keyed in pairs compile to exactly three, with
  the default combine threshold and an unlimited one), and the latency hiding scheduler orders them
  itself. XLA:CPU ignores the key (its combiner merges independent all-reduces anyway): there the key
  path proves numbers only.

The choice is one context variable, read while a step is traced: the front-ends (`allreduce`,
`scheduled`, `hooked`, `pipelined`) take `enforce_order` and, given False, trace their function under
`ordering(False)` (`ordered_by`); the engine asks `enforced()` (in `tie`) and `unit_scope(name)` (where
it names a unit) and nothing else. `True` adds nothing: every traced function stays exactly as it was,
and a call made inside a keyed step (pipelined's `allreduce`) follows that step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["ordering", "ordered_by", "enforced", "unit_scope", "check_enforce_order", "KEY_PREFIX"]

# a unit's combiner key is its named scope ('prophet/chunk3', 'prophet/rs3', 'prophet/ag1'): where a
# jaxlib prints frontend attributes (0.12) the key names the unit; where it does not (0.10) the audit
# matches units by size and provenance (`_compiled._keyed_audit`)
KEY_PREFIX = "prophet/"

_ENFORCE: contextvars.ContextVar[bool] = contextvars.ContextVar("prophet_enforce_order", default=True)


def check_enforce_order(where: str, value: Any) -> bool:
  """`value` as a bool, or TypeError naming the front-end (a string such as 'false' is not a bool)."""
  if not isinstance(value, bool):
    raise TypeError(f"{where}(..., enforce_order={value!r}): expected True (the tie keeps the plan's "
                    f"order) or False (each unit carries an XLA combiner key and XLA orders them).")
  return value


def enforced() -> bool:
  """Whether the step being traced ties its units (True, the default) or keys them (False)."""
  return _ENFORCE.get()


@contextlib.contextmanager
def ordering(enforce_order: bool) -> Iterator[None]:
  """Traces the engine's units with the tie (`True`) or with one combiner key each (`False`)."""
  tok = _ENFORCE.set(bool(enforce_order))
  try:
    yield
  finally:
    _ENFORCE.reset(tok)


def ordered_by(enforce_order: bool, fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` traced under `ordering(enforce_order)`; `fn` itself when `enforce_order` is True (the default
  adds nothing to a front-end's function)."""
  if enforce_order:
    return fn

  @functools.wraps(fn)
  def keyed(*args: Any, **kwargs: Any) -> Any:
    with ordering(False):
      return fn(*args, **kwargs)

  return keyed


@contextlib.contextmanager
def unit_scope(name: str) -> Iterator[None]:
  """The named scope of one unit (`jax.named_scope(name)`, what the audit reads where op names
  survive) and, when the order is XLA's, the unit's combiner key: the same name."""
  with jax.named_scope(name):
    if _ENFORCE.get():
      yield
      return
    # imported here: jax.experimental modules load on first use only when a step asks for keys
    from jax.experimental.xla_metadata import set_xla_metadata
    with set_xla_metadata(combiner_key=name):
      yield
