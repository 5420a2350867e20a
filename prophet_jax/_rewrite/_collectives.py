"""The engine: the only module that issues all-reduces or ties units together.

`reduce_units` runs a plan's units in issue order (a chunk: one `psum` of its gathered slices; a
deferral group: m chunks ranked by `rank`, m - k sent); `tie` keeps them apart and ordered in the
compiled program (docs/design.md, "The rewrite's layers"); `engine_hooks` is the tests' one seam.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._defer import GroupState
from ._keys import enforced, unit_scope
from .._values._schedule import Bucket, Schedule

SCOPE_PREFIX = "prophet/chunk"
RS_PREFIX = "prophet/rs"   # a sharded schedule's reduce-scatter of chunk k
AG_PREFIX = "prophet/ag"   # a sharded schedule's all-gather g


def chunk_scope(k: int) -> str:
  """The named scope of chunk k's collective: 'prophet/chunk<k>' (what `audit` looks for)."""
  return f"{SCOPE_PREFIX}{k}"


# --------------------------------------------------------------------------------------------------
# the tie


def zero_of(prev: jax.Array, dtype: Any) -> jax.Array:
  """An exact scalar zero that data-depends on `prev[0]` and is 0 even when prev[0] is NaN or Inf."""
  p = prev.reshape(-1)[0]
  return jnp.where(jnp.isfinite(p), p * 0, jnp.zeros((), p.dtype)).astype(dtype)


def tie(buf: jax.Array, prev: jax.Array | None) -> jax.Array:
  """`buf` with an exact zero, computed from `prev` (the previous chunk's reduced result), added.

  The data dependency makes the compiled program run prev's all-reduce before buf's, and keeps the two
  from being combined into one by XLA's all-reduce combiner (which only merges independent ones). The
  zero is `where(isfinite(p), p * 0, 0)`, so a NaN or Inf in one chunk never leaks into the next.
  """
  if prev is None or not enforced():   # keyed units (`_keys`): XLA orders them, nothing ties them
    return buf
  return buf.at[0].add(zero_of(prev, buf.dtype))


def reduce_tied(buf: jax.Array, prev: jax.Array | None, axis_name: Any, divisor: int | None) -> jax.Array:
  """One issued all-reduce: `buf` tied to `prev` (its chain's previous result), summed over the axis
  and divided by `divisor` (in the buffer's dtype, as `pmean` does) unless None. The one place a chunk
  or a deferral slot is reduced (`reduce_units`); the caller sets its scope."""
  red = jax.lax.psum(tie(buf, prev), axis_name)
  return red if divisor is None else red / jnp.asarray(divisor, red.dtype)


# --------------------------------------------------------------------------------------------------
# the seam: how tests hook the engine


class EngineHooks(NamedTuple):
  """Test-only hooks of the one engine, read while a step is traced (`engine_hooks`).

  Attributes:
    divisor: maps the divisor the engine was given (the axis size for a mean; never called for a
      sum) to the one it uses: e.g. `lambda n: n - 1` (a 14% gradient-scale bug, the negative control
      of the equivalence tests) or `lambda n: n / scale` with `scale` a traced scalar (one compiled
      step runs both the library's division, scale = 1, and the bug).
    gathered: called with (k, buffer) for every all-reduce k the engine issues, with the buffer as
      gathered on this device, before the tie (a chunk's slices; a deferral slot's chosen row).
    sum_divisor: the divisor a sum (no divisor given) uses instead: e.g. `1 / scale` multiplies
      every summed chunk by a traced `scale` (the negative control of a path that sums).
  """

  divisor: Callable[[Any], Any] | None = None
  gathered: Callable[[int, jax.Array], None] | None = None
  sum_divisor: Any = None


_HOOKS: contextvars.ContextVar = contextvars.ContextVar("prophet_engine_hooks", default=None)   # EngineHooks


@contextlib.contextmanager
def engine_hooks(**hooks: Any) -> Iterator[EngineHooks]:
  """Hooks every all-reduce the engine issues while a step is traced inside this context.

  The explicit seam through which tests reach the one engine (`reduce_units`): `scheduled`,
  `allreduce`, `hooked` (its backward rules run inside the trace of `jax.grad`), `pipelined` and
  `loop_hook` all reach it. Nothing changes outside the context, and a step traced outside it
  compiles to the library's own program. `hooks`: `EngineHooks`' fields (`divisor`, `gathered`,
  `sum_divisor`), by keyword.
  """
  hooks = EngineHooks(**hooks)
  tok = _HOOKS.set(hooks)
  try:
    yield hooks
  finally:
    _HOOKS.reset(tok)


# --------------------------------------------------------------------------------------------------
# the all-reduce


def chunk_buffer(flat: Sequence[jax.Array], chunk: Any, row_leaf: Sequence[int]) -> jax.Array:
  """Chunk's element slices gathered, in order, into one flat buffer (its dtype, `chunk.size` long)."""
  parts = [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in chunk.slices]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def scatter_chunks(flat: Sequence[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int],
                   buffers: Sequence[jax.Array]) -> list[jax.Array]:
  """`flat` with every chunk's buffer put back at its slices (the rows the chunks cover replaced)."""
  flat = list(flat)
  pieces: dict[int, list[tuple[int, jax.Array]]] = {}
  for chunk, buf in zip(chunks, buffers):
    off = 0
    for r, a, b in chunk.slices:
      pieces.setdefault(r, []).append((a, buf[off:off + (b - a)]))
      off += b - a
  for r, segs in pieces.items():
    i = row_leaf[r]
    parts = [s for _, s in sorted(segs, key=lambda t: t[0])]
    full = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    flat[i] = full.reshape(np.shape(flat[i]))
  return flat


def schedule_units(schedule: Schedule) -> tuple[Any, ...]:
  """What the step issues, in issue order: each chunk of a lossless bucket, and each deferral group
  (`Bucket` with `defer > 0`) as one unit of `slots` all-reduces."""
  return tuple(u for b in schedule.buckets for u in ((b,) if b.defer else b.chunks))


def unit_allreduces(unit: Any) -> int:
  """All-reduces a unit issues: 1 for a chunk, `slots` for a deferral group."""
  return unit.slots if isinstance(unit, Bucket) else 1


def _platform() -> str | None:
  """The platform of the devices the mapped computation is traced for ('cpu', 'gpu', ...), from the
  abstract mesh (set under shard_map and pmap): a compile-only GPU topology counts as 'gpu' in a
  process whose default backend is the CPU. None when unknown."""
  try:
    return jax.sharding.get_abstract_mesh().abstract_device.platform
  except (AttributeError, RuntimeError, ValueError):
    return None


# collectives a device runs at once, on the platforms where that is known to be limited
_PLATFORM_LINKS = {"cpu": 1}


def schedule_chains(schedule: Schedule, where: str) -> tuple[int, ...] | None:
  """The tie chain of every issued all-reduce (`schedule.links`), or None for one chain.

  Raises:
    ValueError: the schedule stripes over more links than the platform runs at once. On the CPU a
      collective blocks the executor (docs/facts.md, "CPU collectives are synchronous"): a second chain
      there only lets XLA merge or reorder the chunks.
  """
  links = schedule.links
  if not links or max(links) == 0:
    return None
  n = max(links) + 1
  platform = _platform()
  most = _PLATFORM_LINKS.get(platform or "")
  if most is not None and n > most:
    raise ValueError(
        f"{where}: the schedule stripes its all-reduces over links={n} tie chains, more links than the "
        f"platform can run at once ({platform}: {most}; its collectives are synchronous, so a second "
        f"chain only lets XLA merge or reorder the chunks). Plan with NetworkModel(..., links={most}), "
        f"or drop the assignment: dataclasses.replace(schedule, links=()).")
  return links


def rank(norms: jax.Array, deferred: jax.Array) -> jax.Array:
  """A deferral group's chunk numbers in rank order: the chunks deferred last step first, then non-finite
  norms, then by norm descending, ties by index (a stable sort), so a chunk deferred at t is sent at
  t + 1 even when gradients blow up. Every worker ranks the same: the norms are of reduced values (the
  same bits everywhere) and the previous choice is replicated (docs/design.md, "Deferral in the rewrite",
  says what would break it: workers computing the norm differently).
  """
  score = jnp.where(deferred, jnp.inf, jnp.where(jnp.isfinite(norms), norms, jnp.finfo(jnp.float32).max))
  return jnp.argsort(-score, stable=True).astype(jnp.int32)


def engine_divisor(divisor: Any) -> tuple[Any, Any]:
  """(the divisor as the tests' seam changes it, the seam's `gathered` callback or None)."""
  hooks = _HOOKS.get()
  if hooks is None:
    return divisor, None
  if hooks.divisor is not None and divisor is not None:
    divisor = hooks.divisor(divisor)
  elif hooks.sum_divisor is not None and divisor is None:
    divisor = hooks.sum_divisor
  return divisor, hooks.gathered


def reduce_units(flat: list[jax.Array], units: Sequence[Any], row_leaf: Sequence[int], axis_name: Any, *,
                 divisor: int | None, first_index: int = 0, prev: Any = None, scope: str | None = None,
                 defer: Sequence[GroupState] = (), chains: Sequence[int] | None = None
                 ) -> tuple[list[jax.Array], Any, tuple[GroupState, ...]]:
  """Runs `units` in issue order on the flattened leaves `flat`: the one all-reduce engine.

  A unit is a Chunk (its slices gathered into one buffer, `tie`d to its chain's previous result, one
  `psum` divided by `divisor`, scattered back) or a deferral group (a Bucket with `defer = k`: its m
  chunks' rows plus each device's residual, ranked by `rank` on the previous norms, the top m - k sent
  in slots, the rest kept in the new residual; docs/design.md, "Deferral in the rewrite").

  Args:
    flat: the leaves; rows index them through `row_leaf`.
    units: chunks and deferral groups, in issue order.
    row_leaf: schedule row -> index into `flat`.
    axis_name: the mapped axis.
    divisor: the axis size for a mean, None for a sum.
    first_index: k of the first unit (its named scope).
    prev: the chain's previous result (or one per chain), tied to the first buffer.
    scope: a scope for every unit (loop_hook's) instead of each chunk's.
    defer: the deferral groups' states, in order.
    chains: the tie chain of every issued all-reduce (`schedule_chains`).

  Returns:
    (the leaves with the reduced values, the last result(s), the groups' new states).
  """
  divisor, seen = engine_divisor(divisor)
  multi = isinstance(prev, tuple)
  last: dict[int, Any] = dict(enumerate(prev)) if multi else {0: prev}
  done: list[tuple[Any, jax.Array]] = []   # (chunk, its reduced buffer), scattered back at the end
  new_defer: list[GroupState] = []

  def issue(k: int, buf: jax.Array) -> jax.Array:
    """All-reduce k: `buf` tied to its chain's last result, reduced; it becomes that result."""
    if seen is not None:
      seen(k, buf)
    j = 0 if chains is None else int(chains[k])
    red = reduce_tied(buf, last.get(j), axis_name, divisor)
    last[j] = red
    return red

  k = first_index
  for unit in units:
    if isinstance(unit, Bucket):
      state = defer[len(new_defer)]
      m, size, slots = len(unit.chunks), unit.slot_size, unit.slots
      rows = jnp.stack([jnp.pad(chunk_buffer(flat, c, row_leaf), (0, size - c.size)) for c in unit.chunks])
      order = rank(state.norms, state.deferred)
      send, wait = order[:slots], order[slots:]
      if unit.release == 1:     # all of a residual goes with the next send: k rows, at `index`
        rows = rows.at[state.index].add(state.residual[0].astype(rows.dtype))
        picks, kept, index = rows, rows[wait], wait
      else:                     # damped: a send carries `release` of its row; the rest stays (m rows)
        residual = state.residual[0]                  # float32 for a narrower float (`_defer`)
        owed = rows.astype(residual.dtype) + residual
        picks = (owed - jnp.asarray(1 - unit.release, residual.dtype) * residual).astype(rows.dtype)
        # a sent row keeps what it owed less what it sent, as sent (a bfloat16 rounding included)
        kept = (owed - picks.astype(residual.dtype)).at[wait].set(owed[wait])
        index = state.index
      reds, norms = [], []
      for s in range(slots):
        with unit_scope(chunk_scope(k + s)):
          red = issue(k + s, jax.lax.dynamic_index_in_dim(picks, send[s], axis=0, keepdims=False))
        reds.append(red)
        norms.append(jnp.sqrt(jnp.sum(jnp.square(red.astype(jnp.float32)))))   # what the ranking reads
      out = jnp.zeros_like(reds[0], shape=(m, size)).at[send].set(jnp.stack(reds))
      new_defer.append(GroupState(norms=state.norms.at[send].set(jnp.stack(norms)),
                                  deferred=jnp.zeros((m,), jnp.bool_).at[wait].set(True),
                                  index=index, residual=kept[None]))
      done += [(chunk, out[i, :chunk.size]) for i, chunk in enumerate(unit.chunks)]
      k += slots
      continue
    with unit_scope(chunk_scope(k) if scope is None else scope):
      red = issue(k, chunk_buffer(flat, unit, row_leaf))
    done.append((unit, red))
    k += 1
  flat = scatter_chunks(flat, [c for c, _ in done], row_leaf, [red for _, red in done])
  return flat, tuple(last.get(j) for j in range(len(prev))) if multi else last[0], tuple(new_defer)
