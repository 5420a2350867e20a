"""The scheduled all-reduce: the only module that calls `psum` or ties chunks together.

`allreduce(grads, schedule, axis_name)` runs inside `jax.pmap` or `jax.shard_map` (under `jit`). For each
chunk of the schedule, in issue order, it gathers the chunk's element slices into one flat buffer, runs
one `psum` under `jax.named_scope("prophet/chunk<k>")`, and scatters the result back into the leaves.

XLA on the CPU merges every independent all-reduce into one (`cpu-all-reduce-combiner`) and strips
optimization barriers before that pass runs, so neither independence nor barriers keep chunks apart in
a user's own `jax.pmap` with default flags. What survives (docs/facts.md, "Ordering that survives a
plain jax.pmap"; the tests read the compiled HLO to prove it): chunk k+1's buffer depends on chunk k's
*result* through an added zero that cannot carry a NaN or Inf. That tie is `tie`, in one place, so a
better mechanism replaces it here alone.

The one engine (`reduce_units`) runs both kinds of unit a schedule issues: a Chunk (one all-reduce) and
a deferral group (a `Bucket` with `defer = k > 0`: m chunks of which m - k are all-reduced each step,
ranked by `rank` from the norms of their reduced values; `Bucket`'s docstring states the semantics).
Only the state of the groups (`DeferState`: init, shapes, specs, the checks that a state belongs to a
schedule) lives in `_defer`, below this module; a schedule that defers nothing never calls into it.
Tests reach the engine through one explicit seam, `engine_hooks` (never by patching a module
attribute).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._accumulate import check_state as check_accum
from .._values._checks import check_bool, match_tree
from ._defer import (DeferState, GroupState, add_residual, belongs, check_state, group_states, schedule_of,
                     with_groups)
from ._defer import init as defer_init
from ._keys import check_enforce_order, enforced, ordering, unit_scope
from .._values._errors import AlreadyReducedError, ScheduleMismatchError, UnboundAxisError
from .._values._schedule import Bucket, Schedule, shard_size
from .._values._tree import is_reduced_leaf

__all__ = ["allreduce", "tie", "reduce_tied", "chunk_scope", "axis_size", "check_not_reduced", "vma_enabled",
           "is_varying", "to_varying", "check_residual_varying", "rank", "reduce_units", "schedule_units",
           "unit_allreduces", "schedule_chains", "scheduled_allreduce", "accumulated_allreduce", "EngineHooks",
           "engine_hooks", "rs_scope", "ag_scope", "reduce_scatter_chunks", "all_gather_chunks", "scatter_chunks",
           "local_shards", "shards_square_sum", "sharded_allreduce"]

SCOPE_PREFIX = "prophet/chunk"
RS_PREFIX = "prophet/rs"   # a sharded schedule's reduce-scatter of chunk k
AG_PREFIX = "prophet/ag"   # a sharded schedule's all-gather g


def chunk_scope(k: int) -> str:
  """The named scope of chunk k's collective: 'prophet/chunk<k>' (what `audit` looks for)."""
  return f"{SCOPE_PREFIX}{k}"


# --------------------------------------------------------------------------------------------------
# the tie


def _zero_of(prev: jax.Array, dtype: Any) -> jax.Array:
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
  return buf.at[0].add(_zero_of(prev, buf.dtype))


def reduce_tied(buf: jax.Array, prev: jax.Array | None, axis_name: Any, divisor: int | None) -> jax.Array:
  """One issued all-reduce: `buf` tied to `prev` (its chain's previous result), summed over the axis
  and divided by `divisor` (in the buffer's dtype, as `pmean` does) unless None. The one place a chunk
  or a deferral slot is reduced (`reduce_units`); the caller sets its scope."""
  red = jax.lax.psum(tie(buf, prev), axis_name)
  return red if divisor is None else red / jnp.asarray(divisor, red.dtype)


# --------------------------------------------------------------------------------------------------
# axis checks


def axis_size(axis_name: Any, where: str) -> int:
  """The size of a bound axis, or UnboundAxisError naming the fix."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise UnboundAxisError(
        f"{where}(..., axis_name={axis_name!r}) ran outside a mapped context (no axis {axis_name!r} is "
        f"bound). Call the train step inside jax.shard_map with a mesh axis named {axis_name!r}, or "
        f"inside jax.pmap(..., axis_name={axis_name!r}).") from e


def _axis_names(axis_name: Any) -> tuple[Any, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def is_varying(x: Any, axis_name: Any) -> bool:
  """True when `x`'s type says it varies over every axis of `axis_name` (jax's `vma` set, which only
  shard_map with check_vma=True fills: docs/facts.md, "The 8x gradient trap")."""
  varying = jax.typeof(x).manual_axis_type.varying
  return all(n in varying for n in _axis_names(axis_name))


def to_varying(x: Any, axis_name: Any) -> Any:
  """`x` marked varying over `axis_name` (`jax.lax.pcast(x, axis_name, to="varying")`): its gradient
  then stays per-device instead of being summed over the axis by `jax.grad`."""
  return jax.lax.pcast(x, axis_name, to="varying")


def vma_enabled(axis_name: Any) -> bool:
  """True under shard_map with check_vma=True, where values carry the axes they vary over.

  Under pmap and under shard_map(check_vma=False) nothing is marked varying, so an already-summed
  gradient cannot be told from a per-device one there.
  """
  return is_varying(jax.lax.axis_index(axis_name), axis_name)


def check_not_reduced(leaves: Sequence[tuple[str, Any]], axis_name: Any, where: str) -> None:
  """AlreadyReducedError when a floating gradient is invariant over `axis_name` under check_vma.

  Under shard_map's default check_vma, replicated params (in_specs P()) that meet per-device data get an
  implicit pvary whose transpose is a psum: jax.grad then returns gradients already summed over the axis,
  and reducing them again would make them `axis_size` times too large.
  """
  if not vma_enabled(axis_name):
    return
  for path, g in leaves:
    if not is_reduced_leaf(g) or np.size(g) == 0:
      continue
    if not is_varying(g, axis_name):
      raise AlreadyReducedError(
          f"{where}: gradient {path!r} is already summed over axis {axis_name!r} (it does not vary over "
          f"it): under shard_map's default check_vma, jax.grad sums the gradients of replicated params. "
          f"Mark the params varying before jax.grad: params = jax.lax.pcast(params, {axis_name!r}, "
          f"to='varying'), or use prophet_jax.hooked, which does it for you (or shard_map(..., "
          f"check_vma=False)).")


def check_residual_varying(state: Any, axis_name: Any, where: str) -> None:
  """ValueError when, under shard_map with check_vma, a DeferState's residual arrives replicated (`P()`).

  Each device's residual holds its own deferred values; passed with `P()`, every device starts from
  one copy and the step's new residuals (which vary over the axis) cannot leave through `P()` either:
  the deferred values of all devices but one would be lost. Only checkable where jax marks values
  varying (shard_map's default check_vma); under pmap every state is per device anyway.
  """
  for gi, r in enumerate(state.residual):
    if not is_varying(r, axis_name):
      raise ValueError(
          f"{where}: the deferral state's residual of group {gi} (shape {tuple(np.shape(r))} per "
          f"device) is replicated over axis {axis_name!r} (passed with PartitionSpec P()), but each "
          f"device's residual is its own: pass the state with prophet_jax.state_specs(state, "
          f"{axis_name!r}) as in_specs and out_specs (P({axis_name!r}) for residuals, P() for the "
          f"rest), and make the initial state inside the shard_map with those out_specs.")


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


_HOOKS: contextvars.ContextVar[EngineHooks | None] = contextvars.ContextVar("prophet_engine_hooks",
                                                                             default=None)


@contextlib.contextmanager
def engine_hooks(*, divisor: Callable[[Any], Any] | None = None,
                 gathered: Callable[[int, jax.Array], None] | None = None,
                 sum_divisor: Any = None) -> Iterator[EngineHooks]:
  """Hooks every all-reduce the engine issues while a step is traced inside this context.

  The explicit seam through which tests reach the one engine (`reduce_units`): `scheduled`,
  `allreduce`, `hooked` (its backward rules run inside the trace of `jax.grad`), `pipelined` and
  `loop_hook` all reach it. Nothing changes outside the context, and a step traced outside it
  compiles to the library's own program. See `EngineHooks` for the hooks.
  """
  hooks = EngineHooks(divisor=divisor, gathered=gathered, sum_divisor=sum_divisor)
  tok = _HOOKS.set(hooks)
  try:
    yield hooks
  finally:
    _HOOKS.reset(tok)


# --------------------------------------------------------------------------------------------------
# the all-reduce


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


def _norm(x: jax.Array) -> jax.Array:
  """The float32 L2 norm of x (what the ranking reads)."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(x * x))


def rank(norms: jax.Array, deferred: jax.Array) -> jax.Array:
  """A deferral group's chunk numbers in rank order: the chunks deferred last step first, then
  non-finite norms, then by norm descending; ties by chunk index (a stable sort).

  A non-finite norm (NaN or Inf: the chunk overflowed) ranks just below a chunk deferred the previous
  step and above every finite norm, so a chunk deferred at t is always sent at t + 1 (2k <= m): the
  staleness bound holds even when gradients blow up. (`Bucket`'s docstring says "NaN counts as +inf";
  this is that rule with the deferred chunks kept first among the infinities.)

  Why every worker defers the same chunks: the ranking reads only replicated values, the norms of
  *reduced* slots and the mask of the previous choice. An all-reduce leaves bitwise the same result on
  every participant (a ring reduce-scatter + all-gather computes each element once and copies it, and
  so do NCCL's tree, gloo and XLA's in-process CPU all-reduce); the norm is then the same compiled
  computation on the same bits, hence the same float; the argsort is stable, so ties go by index. By
  induction from the common initial state (norms 0, nothing deferred: the first step defers the last
  k chunks by index), every worker holds the same state and makes the same choice, with no extra
  communication. What would break it: workers that compute the norm differently (heterogeneous
  hardware or software: a GPU model, a CPU's vector width, a jaxlib version or XLA flags that change
  the reduction order of the sum of squares) can round one norm differently, and two nearly equal
  norms could then rank differently on two workers: silently wrong. Guarding it costs one more
  all-reduce per group, which the schedule's timing does not have, so the step does not; the tests
  gather the chosen indices from all 8 devices and from two processes. Run every worker on one
  hardware and software stack.
  """
  big = jnp.finfo(jnp.float32).max
  score = jnp.where(deferred, jnp.inf, jnp.where(jnp.isfinite(norms), norms, big))
  return jnp.argsort(-score, stable=True).astype(jnp.int32)


def _hooked(divisor: Any) -> tuple[Any, Any]:
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
  """Runs `units` in issue order on the flattened leaves `flat`: the one chunked all-reduce engine.

  A unit is a Chunk (one all-reduce: gather its slices into one buffer, `tie` it to the previous
  result of its chain, one `psum` divided by `divisor`, scatter back) or a deferral group (a Bucket
  with `defer = k > 0`, with its state from `defer`): its m chunks gathered into rows (m, c), c its
  `slot_size` (a smaller chunk zero-padded at its end), the residual (the values this worker deferred
  last step) added to the rows it came from, the chunks ranked (`rank`), and m - k slots issued, slot s
  carrying the chunk of rank s, each tied and reduced as a chunk is; a deferred chunk contributes zero
  to this step's gradient and its local values become the new residual. Under damped feedback
  (`Bucket.release` r < 1) the residual has a row per chunk: a slot carries its chunk plus r of the
  chunk's row, which keeps the rest, and a deferred chunk's row takes its values. Every chunked all-reduce of
  the library goes through here: `allreduce`, `scheduled`, `pipelined`, the hooks of `hooked` and the
  per-layer hook of `loop_hook`.

  Args:
    flat: leaves (any shape); rows index them through `row_leaf`.
    units: chunks and deferral groups to run, in issue order (`schedule_units`, or a range of it).
    row_leaf: schedule row -> index into `flat`.
    axis_name: the mapped axis.
    divisor: divide each reduced buffer by this (the axis size, for a mean, as `pmean` does), or None.
    first_index: k of the first all-reduce, for its named scope 'prophet/chunk<k>'.
    prev: the result of the all-reduce issued just before (tied to the first), or None; with several
      chains, a tuple with one entry (or None) per chain.
    scope: the named scope of every chunk instead of 'prophet/chunk<k>' (`loop_hook`'s
      'prophet/loop/<name>', which `audit` reads as a loop-body all-reduce).
    defer: the `GroupState` of each deferral group among `units`, in order.
    chains: the tie chain of every issued all-reduce of the schedule (`schedule_chains`; indexed by
      the all-reduce's k), or None for one chain.

  Returns:
    (the new leaves, the last result (a tuple per chain when `prev` is a tuple), the new GroupStates).
  """
  divisor, seen = _hooked(divisor)
  multi = isinstance(prev, tuple)
  last: dict[int, Any] = dict(enumerate(prev)) if multi else {0: prev}
  flat = list(flat)
  pieces: dict[int, list[tuple[int, jax.Array]]] = {}
  touched: list[int] = []
  new_defer: list[GroupState] = []

  def put(chunk: Any, red: jax.Array) -> None:
    off = 0
    for r, a, b in chunk.slices:
      if r not in pieces:
        pieces[r] = []
        touched.append(r)
      pieces[r].append((a, red[off:off + (b - a)]))
      off += b - a

  def gather(chunk: Any) -> list[jax.Array]:
    return [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in chunk.slices]

  def join(parts: list[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

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
      rows = jnp.stack([jnp.pad(join(gather(c)), (0, size - c.size)) for c in unit.chunks])
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
        norms.append(_norm(red))
      out = jnp.zeros_like(reds[0], shape=(m, size)).at[send].set(jnp.stack(reds))
      new_defer.append(GroupState(norms=state.norms.at[send].set(jnp.stack(norms)),
                                  deferred=jnp.zeros((m,), jnp.bool_).at[wait].set(True),
                                  index=index, residual=kept[None]))
      for i, chunk in enumerate(unit.chunks):
        put(chunk, out[i, :chunk.size])
      k += slots
      continue
    parts = gather(unit)
    with unit_scope(chunk_scope(k) if scope is None else scope):
      red = issue(k, join(parts))
    put(unit, red)
    k += 1
  for r in touched:
    i = row_leaf[r]
    segs = [s for _, s in sorted(pieces[r], key=lambda t: t[0])]
    full = segs[0] if len(segs) == 1 else jnp.concatenate(segs)
    flat[i] = full.reshape(np.shape(flat[i]))
  out_prev = tuple(last.get(j) for j in range(len(prev))) if multi else last[0]
  return flat, out_prev, tuple(new_defer)


# --------------------------------------------------------------------------------------------------
# the sharded engine: reduce-scatters and all-gathers (a sharded schedule, ZeRO-1)


def rs_scope(k: int) -> str:
  """The named scope of chunk k's reduce-scatter in a sharded schedule: 'prophet/rs<k>' (`audit`)."""
  return f"{RS_PREFIX}{k}"


def ag_scope(g: int) -> str:
  """The named scope of all-gather g (`schedule.gathers[g]`): 'prophet/ag<g>' (`audit`)."""
  return f"{AG_PREFIX}{g}"


def _chunk_buffer(flat: Sequence[jax.Array], chunk: Any, row_leaf: Sequence[int]) -> jax.Array:
  """Chunk's element slices gathered, in order, into one flat buffer (its dtype, `chunk.size` long)."""
  parts = [flat[row_leaf[r]].reshape(-1)[a:b] for r, a, b in chunk.slices]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _padded(buf: jax.Array, n: int) -> jax.Array:
  """`buf` zero-padded at its end to n x `shard_size(len, n)` elements (the reduce-scatter's buffer)."""
  extra = n * shard_size(buf.shape[0], n) - buf.shape[0]
  return buf if not extra else jnp.pad(buf, (0, extra))


def reduce_scatter_chunks(flat: Sequence[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int],
                          axis_name: Any, *, n: int, divisor: int | None, first_index: int = 0,
                          prev: jax.Array | None = None) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
  """One reduce-scatter per chunk, in issue order: the sharded half of the one engine.

  Each chunk's slices are gathered into one flat buffer, zero-padded at its end to a multiple of `n`
  (`shard_size`: padding never drops an element, and the zeros it adds reduce to zeros), `tie`d to the
  chain's previous result, reduce-scattered (`psum_scatter`, tiled: device i receives elements
  [i*s, (i+1)*s) of the sum, s = `shard_size(chunk.size, n)`) under `jax.named_scope("prophet/rs<k>")`
  and divided by `divisor` (in the buffer's dtype, as `pmean` does) unless None. The test seam
  (`engine_hooks`) sees each buffer as gathered (unpadded, before the tie) and may change the divisor,
  as it does for an all-reduce.

  Args:
    flat: leaves (any shape); rows index them through `row_leaf`.
    chunks: the chunks to reduce-scatter, in issue order.
    row_leaf: schedule row -> index into `flat`.
    axis_name: the mapped axis; `n` its size.
    divisor: the axis size for a mean, None for a sum.
    first_index: k of the first chunk (its scope 'prophet/rs<k>').
    prev: the chain's previous result (tied to the first buffer), or None.

  Returns:
    (this device's shard of every chunk, `shard_size` elements each, in chunk order; the last result).
  """
  divisor, seen = _hooked(divisor)
  shards = []
  for k, chunk in enumerate(chunks, start=first_index):
    buf = _chunk_buffer(flat, chunk, row_leaf)
    if seen is not None:
      seen(k, buf)
    with unit_scope(rs_scope(k)):
      red = jax.lax.psum_scatter(tie(_padded(buf, n), prev), axis_name, scatter_dimension=0, tiled=True)
      if divisor is not None:
        red = red / jnp.asarray(divisor, red.dtype)
    shards.append(red)
    prev = red
  return tuple(shards), prev


def all_gather_chunks(shards: Sequence[jax.Array], chunks: Sequence[Any], gathers: Sequence[Sequence[int]],
                      axis_name: Any, *, n: int, prev: jax.Array | None = None
                      ) -> tuple[list[jax.Array], jax.Array | None]:
  """One all-gather per entry of `gathers`, in order: the other half of the sharded engine.

  All-gather g concatenates this device's shards of its chunks (`shards[k]`, `shard_size` elements
  each), `tie`s the buffer to the chain's previous result and all-gathers it (tiled) under
  `jax.named_scope("prophet/ag<g>")`; each chunk's whole buffer is then read back from the result
  (device i's part holds its shard of every chunk of the gather, in order) and its padding dropped.
  Under shard_map with check_vma the result is typed invariant (the same on every device).

  Returns:
    (every chunk's whole buffer, `chunk.size` elements, in chunk order; the last result).
  """
  vma = vma_enabled(axis_name)
  out: list[Any] = [None] * len(chunks)
  for g, ks in enumerate(gathers):
    sizes = [shard_size(chunks[k].size, n) for k in ks]
    buf = shards[ks[0]] if len(ks) == 1 else jnp.concatenate([shards[k] for k in ks])
    with unit_scope(ag_scope(g)):
      full = jax.lax.all_gather(tie(buf, prev), axis_name, axis=0, tiled=True,
                                **({"to": "invarying"} if vma else {}))
    prev = full
    rows = full.reshape(n, sum(sizes))
    off = 0
    for k, s in zip(ks, sizes):
      out[k] = rows[:, off:off + s].reshape(-1)[:chunks[k].size]
      off += s
  return out, prev


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


def local_shards(flat: Sequence[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int], axis_name: Any,
                 n: int) -> tuple[jax.Array, ...]:
  """This device's shard of every chunk's (padded) flat buffer of `flat`: elements [i*s, (i+1)*s), i
  the device's index on the axis, s = `shard_size` (what its reduce-scatter leaves it). Used for the
  parameters a ZeRO-1 update reads (weight decay)."""
  i = jax.lax.axis_index(axis_name)
  out = []
  for chunk in chunks:
    s = shard_size(chunk.size, n)
    out.append(jax.lax.dynamic_slice_in_dim(_padded(_chunk_buffer(flat, chunk, row_leaf), n), i * s, s))
  return tuple(out)


def shards_square_sum(shards: Sequence[jax.Array], axis_name: Any, scope: str) -> tuple[jax.Array, jax.Array]:
  """(this device's sum of squares of `shards` in float32, the sum over the axis: one `psum` labelled
  `scope`): the global norm a ZeRO-1 update's global-norm transformation reads."""
  local = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in shards)
  with jax.named_scope(scope):
    return local, jax.lax.psum(local, axis_name)


def sharded_allreduce(flat: Sequence[jax.Array], schedule: Schedule, row_leaf: Sequence[int], axis_name: Any,
                      *, n: int, divisor: int | None) -> list[jax.Array]:
  """A sharded schedule carried out as an all-reduce: every chunk's reduce-scatter, then every
  all-gather (one tie chain), the whole buffers scattered back (replicated)."""
  chunks = schedule.chunks
  shards, last = reduce_scatter_chunks(flat, chunks, row_leaf, axis_name, n=n, divisor=divisor)
  bufs, _ = all_gather_chunks(shards, chunks, schedule.gathers, axis_name, n=n, prev=last)
  return scatter_chunks(flat, chunks, row_leaf, bufs)


def allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True,
              defer_state: Any = None, enforce_order: bool = True) -> Any:
  """All-reduces `grads` over `axis_name` chunk by chunk, in the schedule's order.

  Call it inside `jax.pmap(..., axis_name=...)` or `jax.shard_map` (under `jit`). Rows of the schedule
  are matched to leaves by their canonical path ('params/Dense_0/kernel'). For each chunk, in issue
  order: its element slices are gathered into one flat buffer, reduced by one `psum` labelled
  `jax.named_scope("prophet/chunk<k>")`, and scattered back. Each chunk's buffer is tied to the previous
  chunk's result (an exact, NaN-proof zero), so the compiled program keeps one all-reduce per chunk, in
  schedule order, even in a plain `jax.pmap` with default XLA flags on the CPU. With
  `schedule.links` (planned for `links > 1`), each link is its own tie chain, so up to that many
  all-reduces may be in flight (not on the CPU, whose collectives are synchronous: ValueError).

  A sharded schedule (`dear`, `schedule.gathers`) is carried out as reduce-scatters then all-gathers:
  each chunk's buffer (zero-padded to a multiple of the axis size) is reduce-scattered under
  `prophet/rs<k>`, in chunk order, then each gather's shards are all-gathered under `prophet/ag<g>`,
  in gather order, all in one tie chain; the result is the replicated mean, as above. (Inside a
  training step, `scheduled(tx, schedule)` updates each device's shard between the two halves
  instead: ZeRO-1.)

  A schedule with deferral groups (`dlcp` with `max_defer > 0`) needs their state: pass
  `defer_state` (from `prophet_jax.defer_state(schedule)`, then the one returned) and get
  `(reduced, new_defer_state)`; a deferred chunk's elements are zero in `reduced` and kept in the
  state's residual, to be added to the same elements at the next call (`Bucket` has the semantics).
  After a re-plan, pass the old schedule's state to the new one: its residual is added to these
  gradients (nothing deferred is lost) and the new schedule starts from its initial state (None for
  a lossless one: then `(reduced, None)` is returned).

  Integer leaves and float0 gradients pass through unreduced; zero-size leaves pass through unchanged.

  Under `shard_map` with `check_vma=True` (the default) the gradients of replicated params are already
  summed by `jax.grad`; this is detected and raises AlreadyReducedError. Under `pmap` (and
  `check_vma=False`) it cannot be detected: there, make sure the gradients are per-device.

  Args:
    grads: a pytree of per-device gradients, the tree the schedule was planned for.
    schedule: a Schedule (from `prophet_jax.plan`).
    axis_name: the data-parallel axis (a name bound by pmap or shard_map).
    mean: divide the sums by the axis size (a `pmean`); False gives the `psum`.
    defer_state: the DeferState of a schedule that defers (None otherwise).
    enforce_order: True (the default): the tie keeps one collective per unit, in schedule order
      (inside a step that `scheduled`, `hooked` or `pipelined` traces with `enforce_order=False`, their
      keys). False: each unit (a chunk, a deferral slot, a reduce-scatter, an all-gather) carries one
      XLA `combiner_key` and no tie: XLA:GPU keeps exactly the plan's units and orders them itself
      (`_keys`); XLA:CPU ignores the key and merges them (the numbers are the same).

  Returns:
    The reduced tree, same structure, shapes and dtypes; `(tree, new_defer_state)` when the schedule
    defers.

  Raises:
    UnboundAxisError: `axis_name` is not bound here.
    ScheduleMismatchError: the schedule was planned for another tree (the path, shape or dtype at fault
      is named), or `defer_state` belongs to another schedule.
    AlreadyReducedError: under shard_map with check_vma, the gradients are already summed.
    ValueError: the tree is empty; more links than the platform runs at once.
    TypeError: a deferring schedule without `defer_state`, or a `defer_state` for one that does not
      defer.

  Example:
    >>> step = jax.pmap(lambda g: prophet_jax.allreduce(g, schedule, "data"), axis_name="data")
  """
  keyed = not check_enforce_order("allreduce", enforce_order)
  # True leaves the ordering as it is: the tie, unless a front-end traces this call with keys
  with ordering(False) if keyed else contextlib.nullcontext():
    reduced, new = scheduled_allreduce(grads, schedule, axis_name, mean=mean, where="allreduce",
                                       defer_state=defer_state)
  return (reduced, new) if schedule.defers or defer_state is not None else reduced


def carries(state: Any, schedule: Schedule) -> bool:
  """Whether `state` is a DeferState of another schedule than `schedule` (a re-plan's): one whose
  residual the step carries over (`carry_over`) instead of using it as its own."""
  return isinstance(state, DeferState) and not belongs(state, schedule)


def carry_over(grads: Any, state: DeferState, schedule: Schedule, axis_name: Any, where: str
               ) -> tuple[Any, Any]:
  """A re-plan without a lost byte: (`grads` with `state`'s residual added at the elements it was
  deferred from, `schedule`'s initial deferral state or None).

  `state` was made by another schedule of the same tree (it records which, `_defer.schedule_of`): its
  residual holds this device's deferred values, which that schedule would have added to the next
  gradients; they are added to these, which `schedule` then reduces from its own initial state (the
  first step of a new plan). Under shard_map with check_vma the new residuals are marked varying,
  as every device's own.

  Raises:
    ScheduleMismatchError: the state's schedule was planned for another tree (the residual's elements
      are not these gradients'), or the state does not record its schedule; both say how to keep it.
  """
  old = schedule_of(state)
  if old is None:
    check_state(state, schedule, where)   # raises, saying how to carry a residual
  try:
    grads = add_residual(grads, old, state, where)
  except ScheduleMismatchError as e:
    raise ScheduleMismatchError(
        f"{where}: the deferral state was made by a schedule for another tree (a {old.policy} plan of "
        f"{len(old.rows)} leaves), so its residual, gradient values deferred and not yet applied, "
        f"cannot be added to these gradients ({e}). Apply it with the old model before changing it: "
        f"g = jax.lax.pmean(prophet_jax.deferred_grads(state, old_params), axis), then tx.update(g, "
        f"...), and start the new plan from its init.") from None
  new = defer_init(schedule)
  if new is not None and vma_enabled(axis_name):
    new = new._replace(residual=tuple(to_varying(r, axis_name) for r in new.residual))
  return grads, new


def scheduled_allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, mean: bool = True,
                        where: str = "allreduce", defer_state: Any = None) -> tuple[Any, Any]:
  """`allreduce` as (reduced tree, new DeferState or None), with `where` naming the public caller.

  A schedule that defers nothing, given no state, never calls into `_defer`. A DeferState of another
  schedule of the same tree (a re-plan) is carried over (`carry_over`): its residual is added to
  `grads`, and `schedule` starts from its initial state."""
  check_bool(where, "mean", mean)
  n = axis_size(axis_name, where)
  if defer_state is not None and carries(defer_state, schedule):
    grads, defer_state = carry_over(grads, defer_state, schedule, axis_name, where)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  lmap = match_tree(leaves_with_path, schedule, where=where)
  deferring = schedule.defers or defer_state is not None
  if deferring:
    check_state(defer_state, schedule, where)
  chains = schedule_chains(schedule, where)
  flat = [leaf for _, leaf in leaves_with_path]
  check_not_reduced([(lmap.paths[i], flat[i]) for i in lmap.row_leaf], axis_name, where)
  if schedule.sharded:  # reduce-scatters, then all-gathers: replicated, as an all-reduce's result
    flat = sharded_allreduce(flat, schedule, lmap.row_leaf, axis_name, n=n, divisor=n if mean else None)
    return jax.tree_util.tree_unflatten(treedef, flat), None
  if defer_state is not None and vma_enabled(axis_name):
    check_residual_varying(defer_state, axis_name, where)
  flat, _, groups = reduce_units(flat, schedule_units(schedule), lmap.row_leaf, axis_name,
                                 divisor=n if mean else None,
                                 defer=group_states(defer_state) if deferring else (),
                                 prev=None if chains is None else (None,) * (max(chains) + 1),
                                 chains=chains)
  new = with_groups(defer_state, groups) if schedule.defers else None
  return jax.tree_util.tree_unflatten(treedef, flat), new


def accumulated_allreduce(grads: Any, schedule: Schedule, axis_name: Any, *, every_k: int, accum: Any,
                          mean: bool = True, where: str = "scheduled", defer_state: Any = None
                          ) -> tuple[Any, Any, Any, jax.Array]:
  """`scheduled_allreduce` once per `every_k` calls: gradient accumulation (`scheduled(..., every_k=k)`).

  Adds this device's `grads` to `accum`'s sums (an `_accumulate.AccumState`); on the k-th call since
  the last all-reduce it reduces the mean of the k micro-steps' gradients on the schedule (every
  chunk, deferral included) and resets the sums, and on the other calls it issues nothing: the
  all-reduces sit in the true branch of one `lax.cond` on the replicated count, so the compiled
  program runs them only when that branch is taken. The reduced gradients are zero on the other calls.

  Returns:
    (the reduced tree on the k-th call, zeros otherwise; the new DeferState or None, changed on the
    k-th call only; the new AccumState; `emit`, a replicated bool: whether this call reduced).
  """
  check_bool(where, "mean", mean)
  axis_size(axis_name, where)
  check_accum(accum, schedule, where)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  lmap = match_tree(leaves_with_path, schedule, where=where)
  flat = [leaf for _, leaf in leaves_with_path]
  check_not_reduced([(lmap.paths[i], flat[i]) for i in lmap.row_leaf], axis_name, where)
  if schedule.defers:
    check_state(defer_state, schedule, where)
  if vma_enabled(axis_name):
    for (path, _, _), a in zip(schedule.rows, accum.grads):
      if not is_varying(a, axis_name):
        raise ValueError(
            f"{where}: the gradient accumulator's sum for {path!r} (shape {tuple(np.shape(a))} per device) "
            f"is replicated over axis {axis_name!r} (passed with PartitionSpec P()), but each device "
            f"sums its own gradients: pass the optimizer state with prophet_jax.state_specs(state, "
            f"{axis_name!r}) as in_specs and out_specs (P({axis_name!r}) for the sums, P() for the rest), "
            f"and make the initial state inside the shard_map with those out_specs.")
  rows = tuple(a[0] + flat[i].astype(a.dtype) for a, i in zip(accum.grads, lmap.row_leaf))
  count = accum.count + 1
  emit = count >= every_k

  def fire(rows, defer):
    mine = list(flat)
    for i, r in zip(lmap.row_leaf, rows):
      mine[i] = (r / every_k).astype(flat[i].dtype)
    red, new = scheduled_allreduce(jax.tree_util.tree_unflatten(treedef, mine), schedule, axis_name,
                                   mean=mean, where=where, defer_state=defer)
    red = jax.tree_util.tree_leaves(red)
    return tuple(red[i] for i in lmap.row_leaf), new, tuple(jnp.zeros_like(r) for r in rows)

  def wait(rows, defer):
    return tuple(jnp.zeros(np.shape(flat[i]), flat[i].dtype) for i in lmap.row_leaf), defer, rows

  reduced, new_defer, rows = jax.lax.cond(emit, fire, wait, rows, defer_state)
  out = list(flat)
  for i, r in zip(lmap.row_leaf, reduced):
    out[i] = r
  new_accum = type(accum)(count=jnp.where(emit, 0, count).astype(jnp.int32),
                          grads=tuple(r[None] for r in rows))
  return jax.tree_util.tree_unflatten(treedef, out), new_defer, new_accum, emit
